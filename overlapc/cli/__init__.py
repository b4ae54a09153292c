"""The command line: ``overlapc dump | report | timeline | calibrate | analyze | demo``.

The room on top. ``commands`` runs each command (its docstring is the CLI's
manual), ``parser`` holds the commands' options and what counts as bad input,
``targets`` loads a TARGET under a fake process group, ``timeline`` writes the
Chrome trace of ``overlapc timeline``, ``demo`` is ``make demo``'s run. It may
import any other room; nothing in overlapc imports it.

    overlapc ...  ==  python -m overlapc.cli ...  ==  overlapc.cli.main([...])
"""
from overlapc.cli.commands import main
from overlapc.cli.parser import REPORT_SCHEMA, UsageError
from overlapc.cli.timeline import TIMELINE_SCHEMA

__all__ = ["REPORT_SCHEMA", "TIMELINE_SCHEMA", "UsageError", "main"]

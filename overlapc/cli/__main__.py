"""``python -m overlapc.cli ARGS``: the ``overlapc`` command."""
import sys

from overlapc.cli import main

sys.exit(main())

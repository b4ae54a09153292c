"""The graph passes (installed as ``overlapc.passes``; the card keeps this folder at the top level).

The ground floor: nothing here imports anything under ``overlapc`` but the passes
(``tests/test_layers.py`` checks): recognising collectives is theirs
(``collectives.py``, public as ``overlapc.collectives``), and they take their own
``ScheduleOptions`` (``options.py``; an ``OverlapConfig`` gives them through its
``scheduling()``). ``schedule`` here is the passes alone: ``chunks="auto"`` needs
the ``estimator=`` it chooses piece counts with, and no report is logged;
``overlapc.schedule`` builds the estimator from the config's profile and logs the
report."""
from overlapc.passes.options import ScheduleOptions
from overlapc.passes.pipeline import (
    ScheduleError, ScheduleResult, limit_in_flight, reorder_all_gathers, run, schedule, sink_waits, verify,
)

__all__ = ["reorder_all_gathers", "limit_in_flight", "sink_waits", "schedule", "run", "verify", "ScheduleError",
           "ScheduleResult", "ScheduleOptions"]

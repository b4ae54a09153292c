"""The graph passes (installed as ``overlapc.passes``; the card keeps this folder at the top level)."""
from overlapc.passes.pipeline import (
    ScheduleError, limit_in_flight, reorder_all_gathers, schedule, sink_waits, verify,
)

__all__ = ["reorder_all_gathers", "limit_in_flight", "sink_waits", "schedule", "verify", "ScheduleError"]

"""The graph passes (installed as ``overlapc.passes``; the card keeps this folder at the top level)."""
from overlapc.passes.limit import limit_in_flight
from overlapc.passes.pipeline import ScheduleError, schedule, verify
from overlapc.passes.reorder import reorder_all_gathers
from overlapc.passes.sink_waits import sink_waits

__all__ = ["reorder_all_gathers", "limit_in_flight", "sink_waits", "schedule", "verify", "ScheduleError"]

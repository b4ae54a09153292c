"""overlapc: schedule communication in PyTorch training graphs so it overlaps compute."""
from overlapc.collectives import Collective, collectives
from overlapc.config import OverlapConfig
from overlapc.passes.pipeline import ScheduleError, schedule, verify

__all__ = ["OverlapConfig", "Collective", "collectives", "schedule", "verify", "ScheduleError"]
__version__ = "0.1.0"

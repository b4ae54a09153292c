"""overlapc: schedule communication in PyTorch training graphs so it overlaps compute.

``overlapc.fsdp`` is imported on first use (``overlapc.fsdp.shard(model, mesh)``
works after ``import overlapc``), so a plain import stays cheap.

The package is in rooms (README "Layout"; tests/test_layers.py holds the arrows):
config, collectives, torch_compat and launch at the bottom, then ``estimate``,
``explain``, this package's ``api``, ``backend`` (the compile path), ``calibrate``
and ``cli`` on top; ``fsdp`` and ``integrations`` beside them.
"""
import importlib

from overlapc.api import schedule, verify
from overlapc.collectives import Collective, collectives
from overlapc.config import OverlapConfig
from overlapc.passes.pipeline import ScheduleError

__all__ = ["OverlapConfig", "Collective", "collectives", "schedule", "verify", "ScheduleError", "fsdp"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "fsdp":   # imports torch.distributed.tensor and the checkpoint machinery
        return importlib.import_module("overlapc.fsdp")
    raise AttributeError(f"module 'overlapc' has no attribute {name!r}")

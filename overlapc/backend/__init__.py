"""The compile path: ``torch.compile(model, backend="overlapc")`` -> AOTAutograd ->
``overlapc.schedule`` -> Inductor, keeping the schedule's order and windows.

``compiler`` is the backend itself (the ``torch_dynamo_backends`` entry point
``overlapc.backend:overlapc_backend``, the per-graph wrapper, ``capture``);
``inductor_order`` checks the order and windows in Inductor's generated code;
``rankcheck`` checks that every rank compiled the same graphs and options
(``RankMismatchError`` where one did not);
``cuda_capture`` compiles for a fake H100 without a GPU. Every torch-version
workaround is in ``overlapc.torch_compat``.

May import: ``overlapc.passes``, the core modules (``config``, ``collectives``,
``api``, ``torch_compat``), the estimator only through its interface (the
names of the ``overlapc.estimate`` package) and ``overlapc.explain.report``
(the artifacts ``dump_dir`` writes). Never calibration, sharding or the
command line.
"""
from overlapc.backend.compiler import (
    GraphRecord, SchedulePass, backward_root, capture, drop_dead_compute, overlapc_backend, run_step,
)
from overlapc.backend.rankcheck import RankMismatchError

__all__ = ["GraphRecord", "RankMismatchError", "SchedulePass", "backward_root", "capture", "drop_dead_compute",
           "overlapc_backend", "run_step"]

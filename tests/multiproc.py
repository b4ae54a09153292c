"""The tests' face of overlapc.launch, the project's rank launcher.

    results = run_ranks(fn, world_size=2, args=(...,), timeout=120.0)

calls ``fn(rank, world_size, port, *args)`` on each rank through
``overlapc.launch.run`` (which see: results by rank, a raising rank re-raised
with its traceback, a dead or hung rank named as ``RankFailure``, every rank
ended); ``fn`` joins the group itself with ``init_gloo(rank, world_size, port)``.
In every rank, as in the parent (pyproject's filterwarnings), a graph left
unscheduled fails the test.
"""
from __future__ import annotations

import os
import warnings

from overlapc.launch import init_gloo, run

__all__ = ["init_gloo", "run_ranks"]


def run_ranks(fn, world_size: int = 2, args: tuple = (), timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, port, *args)`` on ranks 0..world_size-1; return results by rank."""
    return run(_with_port, world_size, (fn, args), timeout=timeout, gloo=False)


def _with_port(rank: int, world_size: int, fn, args: tuple):
    warnings.filterwarnings("error", message="overlapc left the graph unscheduled")
    return fn(rank, world_size, int(os.environ["MASTER_PORT"]), *args)

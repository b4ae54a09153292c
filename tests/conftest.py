"""Shared fixtures: a fake process group (no network) for graph-level tests, the
rule that no test degrades a schedule unseen, and pytest-xdist's split of the suite."""
import functools
import logging
import os

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZE = 8


@pytest.fixture(scope="session")
def fake_pg():
    """Default process group of the 'fake' backend, world size 8; group name '0'."""
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def two_groups(fake_pg):
    """Two further groups over all ranks (names differ from the default group's)."""
    return dist.new_group(list(range(WORLD_SIZE))), dist.new_group(list(range(WORLD_SIZE)))


# The WARNINGs of a schedule that held only in part: collectives placed serially, the
# whole graph in its serial order, the rewrites dropped (passes/pipeline.py).
DEGRADED = ("placed serially", "runs in its serial order", "scheduled without buckets, pipelined pieces")


def degradations(records) -> list[str]:
    """The messages of ``records`` (log records) that say overlapc degraded a schedule."""
    return [r.getMessage() for r in records if r.name == "overlapc" and r.levelno >= logging.WARNING
            and any(phrase in r.getMessage() for phrase in DEGRADED)]


@pytest.fixture(autouse=True)
def no_unseen_degradation(request, caplog):
    """Fail a test in which overlapc degraded a schedule, unless it is marked
    ``degrades``: on_error="raise" does not raise there (degrading is not an error), so
    the property tests would otherwise pass on a graph that lost its overlap."""
    yield
    if request.node.get_closest_marker("degrades"):
        return
    degraded = degradations(caplog.get_records("call"))
    assert not degraded, f"overlapc degraded a schedule: {degraded[0][:2000]}"


# ---------------------------------------------------------------- pytest-xdist (make test: -n 2)

@functools.cache
def _has_module_fixture(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return 'scope="module"' in f.read()
    except OSError:
        return False


def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (``--dist load``), hand out tests one at a time, except that every
    test of a module defining a module-scoped fixture goes to one worker: those fixtures
    compile models or run gloo jobs for minutes, and each worker running the module's
    tests built its own (5 fixtures built twice: 365 s of worker time in one run).
    ``--dist loadgroup`` would do it with marks, but pytest-xdist 3.8 under pytest 9
    ignores them: a marked module's tests still went to both workers."""
    if config.getvalue("dist") != "load":   # another --dist asked for by name: xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = str(config.rootpath)

    class ModuleFixturesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _has_module_fixture(os.path.join(root, module)) else nodeid

    return ModuleFixturesOnOneWorker(config, log)

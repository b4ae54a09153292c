"""Shared fixtures: a fake process group (no network) for graph-level tests."""
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

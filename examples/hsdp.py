"""HSDP with ``overlapc.fsdp.shard``: parameters sharded over ``dp_shard`` (inside a
node), replicated over ``dp_replicate`` (across nodes), optionally x tp; and the
in-graph DDP (``dp_shard`` of size 1)::

    overlapc report examples/hsdp.py:build --world-size 8        # dp_replicate 2 x dp_shard 4
    overlapc report examples/hsdp.py:build_tp --world-size 8     # dp_replicate 2 x dp_shard 2 x tp 2
    overlapc report examples/hsdp.py:build_ddp --world-size 8    # dp_replicate 8 x dp_shard 1

The model is examples/fsdp_tp.py's transformer. In the backward graph each
gradient is reduce-scattered over dp_shard and the shard then all-reduced over
dp_replicate (a chained collective: the all-reduce's input is the
reduce-scatter's result); with dp_shard 1 there are only the all-reduces.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import overlapc.fsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_tp  # noqa: E402  (the sibling example's model)

DIMS = ("dp_replicate", "dp_shard")


def build(replicate: int = 2, tp: int = 1, dim: int = 64, heads: int = 4, hidden: int = 128, depth: int = 2,
          batch: int = 2, seq: int = 32):
    """(model sharded on a (dp_replicate, dp_shard[, tp]) mesh of the default group, (input,)).

    dp_shard = world size / (``replicate`` x ``tp``); with ``tp`` > 1 the input is
    the local sequence shard [batch, seq/tp, dim] (sequence parallel)."""
    world = dist.get_world_size()
    if world % (replicate * tp):
        raise ValueError(f"world size {world} does not divide by replicate {replicate} x tp {tp}")
    shape, names = (replicate, world // (replicate * tp)), DIMS
    if tp > 1:
        shape, names = (*shape, tp), (*names, "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = fsdp_tp.Model(dim, heads, hidden, depth)
    if tp > 1:
        model = fsdp_tp.parallelize(model, mesh["tp"])
    overlapc.fsdp.shard(model, mesh)
    return model, (torch.randn(batch, seq // tp, dim, requires_grad=True),)


def build_tp():
    """dp_replicate 2 x dp_shard (world / 4) x tp 2."""
    return build(replicate=2, tp=2)


def build_ddp():
    """dp_replicate = world size, dp_shard 1: no all-gathers, one all-reduce per gradient."""
    return build(replicate=dist.get_world_size())

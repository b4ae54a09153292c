"""An MLP whose layers keep a row shard of their weight and all-gather it on
use with torch's functional collectives directly (no DTensor, no
overlapc.fsdp): the forward graph gets one all-gather per layer, the backward
graph one reduce-scatter per layer (the all-gather's gradient)::

    overlapc report examples/allgather.py:build --world-size 4
"""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn


class GatheredLinear(nn.Module):
    """y = x @ W.T, with W's rows split evenly over the ranks."""

    def __init__(self, n_in: int, n_out: int, world_size: int):
        super().__init__()
        if n_out % world_size:
            raise ValueError(f"{n_out} output features do not split over {world_size} ranks")
        self.shard = nn.Parameter(torch.randn(n_out // world_size, n_in) * n_in ** -0.5)

    def forward(self, x):
        weight = funcol.all_gather_single_autograd(self.shard, 0, dist.group.WORLD)
        return x @ weight.t()


def build(dim: int = 128, depth: int = 4, tokens: int = 256):
    """(model for the default process group's world size, (input,))."""
    torch.manual_seed(0)
    world = dist.get_world_size()
    layers = []
    for _ in range(depth):
        layers += [GatheredLinear(dim, dim, world), nn.ReLU()]
    return nn.Sequential(*layers), (torch.randn(tokens, dim),)

"""A stack of pre-norm MLP blocks with SimpleFSDP-style sharded parameters.

Every parameter read becomes an all-gather in the forward graph and a
reduce-scatter of its gradient in the backward graph (``overlapc.fsdp``)::

    overlapc report examples/mlp.py:build --world-size 8

Capturing runs one real forward and backward on CPU, so the sizes are small.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import overlapc.fsdp


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build(dim: int = 256, hidden: int = 1024, depth: int = 4, tokens: int = 1024):
    """(model sharded over the default process group, (input,)); the input needs no grad."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = overlapc.fsdp.shard(MLP(dim, hidden, depth), mesh)
    return model, (torch.randn(tokens, dim),)

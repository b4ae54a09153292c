"""A mixture-of-experts layer with expert parallelism: one expert MLP per rank::

    overlapc report examples/moe.py:build --world-size 2

Routing is expert choice (each expert picks the same number of tokens), so the
dispatch and the combine are ``all_to_all_single`` with equal splits, taken from
``torch.distributed._functional_collectives.all_to_all_single_autograd`` so the
backward is two all-to-alls as well. The dispatched tokens feed the expert right
away and the combine reads its output right away: the pattern
``overlapc.passes.chunk`` pipelines ("all_to_all_expert").
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


class MoE(nn.Module):
    """Tokens [T, dim] -> [T, dim]. Expert e lives on rank e; each expert takes
    ``capacity`` tokens from every rank (expert choice)."""

    def __init__(self, dim: int, hidden: int, world: int, rank: int, capacity: int, group=None):
        super().__init__()
        self.world, self.capacity, self.group = world, capacity, group or dist.group.WORLD
        self.router = nn.Linear(dim, world, bias=False)
        g = torch.Generator().manual_seed(100 + rank)   # this rank's expert
        self.w_in = nn.Parameter(torch.randn(dim, hidden, generator=g) / dim ** 0.5)
        self.w_out = nn.Parameter(torch.randn(hidden, dim, generator=g) / hidden ** 0.5)

    def expert(self, x):
        return F.gelu(x @ self.w_in) @ self.w_out

    def forward(self, x):
        scores = self.router(x).softmax(dim=-1)                      # [T, E]
        weight, index = scores.topk(self.capacity, dim=0)            # [C, E]: expert choice
        index, weight = index.t().reshape(-1), weight.t().reshape(-1, 1)  # expert-major
        splits = [self.capacity] * self.world
        sent = all_to_all_single_autograd(x[index], splits, splits, self.group)
        done = all_to_all_single_autograd(self.expert(sent), splits, splits, self.group)
        return torch.zeros_like(x).index_add(0, index, done * weight) + x


class Stack(nn.Module):
    def __init__(self, dim: int, hidden: int, world: int, rank: int, capacity: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(MoE(dim, hidden, world, rank, capacity) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))

    def forward(self, x):
        for norm, layer in zip(self.norms, self.layers):
            x = layer(norm(x))
        return x


def build(dim: int = 64, hidden: int = 256, tokens: int = 64, capacity: int = 16, depth: int = 2):
    """(MoE stack over the default process group, (tokens [tokens, dim],)); one expert per rank."""
    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = Stack(dim, hidden, world, rank, capacity, depth)
    torch.manual_seed(1 + rank)
    return model, (torch.randn(tokens, dim, requires_grad=True),)

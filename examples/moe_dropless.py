"""A dropless mixture-of-experts layer (token choice, as torchtitan's MoE and
DeepSeek-style routing): one expert per rank::

    overlapc report examples/moe_dropless.py:build --world-size 2

Each token goes to its top-1 expert; nothing is dropped, so how many tokens a
rank sends to each expert depends on the data. The layer first exchanges the
token counts (an all-to-all of one int per rank), then dispatches and combines
with ``all_to_all_single`` whose split sizes are those counts
(``.tolist()``: under torch.compile they are unbacked symbolic ints, which
``build`` allows with ``torch._dynamo.config.capture_scalar_outputs``).

With ``chunks`` (``--chunks 4``, ``options={"chunks": 4}``) dispatch -> expert ->
combine pipelines in token ranges of every rank block
(``overlapc.passes.chunk.ragged``), forward and backward; the count exchange
stays whole.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd


class DroplessMoE(nn.Module):
    """Tokens [T, dim] -> [T, dim]. Expert e lives on rank e."""

    def __init__(self, dim: int, hidden: int, world: int, rank: int, group=None):
        super().__init__()
        self.world, self.group = world, group or dist.group.WORLD
        self.router = nn.Linear(dim, world, bias=False)
        g = torch.Generator().manual_seed(100 + rank)   # this rank's expert
        self.w_in = nn.Parameter(torch.randn(dim, hidden, generator=g) / dim ** 0.5)
        self.w_out = nn.Parameter(torch.randn(hidden, dim, generator=g) / hidden ** 0.5)

    def expert(self, x):
        return F.gelu(x @ self.w_in) @ self.w_out

    def forward(self, x):
        scores = self.router(x).softmax(dim=-1)                      # [T, E]
        weight, expert = scores.max(dim=-1)                          # top-1 expert per token
        order = expert.argsort(stable=True)                          # tokens grouped by expert
        counts = (expert[:, None] == torch.arange(self.world)).sum(0)    # tokens sent to each expert
        ones = [1] * self.world
        received = all_to_all_single(counts, ones, ones, self.group)     # tokens each rank sends here
        send, recv = counts.tolist(), received.tolist()
        tokens = all_to_all_single_autograd(x[order], recv, send, self.group)
        done = all_to_all_single_autograd(self.expert(tokens), send, recv, self.group)
        return torch.zeros_like(x).index_add(0, order, done * weight[order, None]) + x


class Stack(nn.Module):
    def __init__(self, dim: int, hidden: int, world: int, rank: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(DroplessMoE(dim, hidden, world, rank) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))

    def forward(self, x):
        for norm, layer in zip(self.norms, self.layers):
            x = layer(norm(x))
        return x


def build(dim: int = 64, hidden: int = 256, tokens: int = 64, depth: int = 2):
    """(dropless MoE stack over the default process group, (tokens [tokens, dim],)); one expert per rank."""
    torch._dynamo.config.capture_scalar_outputs = True   # .tolist() of the counts stays in the graph
    torch.manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = Stack(dim, hidden, world, rank, depth)
    torch.manual_seed(1 + rank)
    return model, (torch.randn(tokens, dim, requires_grad=True),)

"""A Llama decoder written and parallelized the way torchtitan does it::

    overlapc report examples/tp_llama.py:build --world-size 2 --chunks 2

Batch-first activations [batch, seq, dim], sharded along the sequence between
the parallel regions. Each block: RMSNorm (``SequenceParallel``), attention
with separate q/k/v projections (``ColwiseParallel``), rotary embeddings
applied as a complex product (``view_as_complex``), grouped-query attention
(k/v heads repeated by expand + reshape), output projection
(``RowwiseParallel(output_layouts=Shard(1))``); RMSNorm; SwiGLU feed-forward
(w1, w3 colwise, w2 rowwise). ``PrepareModuleInput`` turns the sequence shard
into a replicated input of attention and the feed-forward, as torchtitan's
plan does: DTensor all-gathers dim 1 as an all-gather on dim 0 + split + cat,
and reduce-scatters dim 1 after a split + cat.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_sp import check_split  # noqa: E402  (the sibling example's size check)


def rotary_table(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """[seq, head_dim / 2] complex rotations."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim] rotated pairwise by ``table`` [seq, head_dim / 2]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * table[None, :, None, :]).flatten(3)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.repeats = dim // heads, heads // kv_heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        b, s, kv, d = x.shape
        return x[:, :, :, None, :].expand(b, s, kv, self.repeats, d).reshape(b, s, kv * self.repeats, d)

    def forward(self, x, table):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)   # -1: this rank's heads under TP
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rotary(q, table), apply_rotary(k, table)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, table):
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, depth: int, seq: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(depth))
        self.register_buffer("table", rotary_table(dim // heads, seq), persistent=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.table)
        return x


def parallelize(model: Decoder, mesh) -> Decoder:
    """torchtitan's tensor + sequence parallel plan for each block."""
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def build(dim: int = 64, heads: int = 4, kv_heads: int = 2, hidden: int = 192, depth: int = 2, seq: int = 32,
          batch: int = 4):
    """(the decoder over the default process group, (local sequence shard [batch, seq/world, dim],))."""
    world = dist.get_world_size()
    check_split("examples/tp_llama.py", world, {"the sequence": seq, "the query heads": heads,
                                                "the key/value heads": kv_heads, "the hidden size": hidden})
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize(Decoder(dim, heads, kv_heads, hidden, depth, seq), mesh)
    torch.manual_seed(1 + dist.get_rank())
    return model, (torch.randn(batch, seq // mesh.size(), dim, requires_grad=True),)

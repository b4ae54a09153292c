"""A tiny Llama-style decoder (RMSNorm, causal attention, SwiGLU) with
SimpleFSDP-style sharded parameters (``overlapc.fsdp``)::

    overlapc report examples/llama.py:build --world-size 8

No rotary embedding: it adds no communication. Capturing runs one real
forward and backward on CPU, so the sizes are small.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import overlapc.fsdp


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, hidden) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build(vocab: int = 1024, dim: int = 256, heads: int = 4, hidden: int = 688, depth: int = 2,
          batch: int = 2, seq: int = 128):
    """(model sharded over the default process group, (token ids,))."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = overlapc.fsdp.shard(Llama(vocab, dim, heads, hidden, depth), mesh)
    return model, (torch.randint(0, vocab, (batch, seq)),)


def memory_reference():
    """The model issue 9's memory target names: dim 1024, 8 layers (SwiGLU hidden
    2816), one sequence of 256 tokens per rank::

        overlapc report examples/llama.py:memory_reference --world-size 8
    """
    return build(vocab=1024, dim=1024, heads=8, hidden=2816, depth=8, batch=1, seq=256)

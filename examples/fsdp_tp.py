"""A small transformer (pre-norm attention + MLP blocks) with tensor + sequence
parallelism on the tp dim and SimpleFSDP-style sharding (``overlapc.fsdp``) on
the dp dim of a 2-D dp x tp mesh::

    overlapc report examples/fsdp_tp.py:build --world-size 4     # dp 2 x tp 2

Activations are batch-first ``[batch, seq, dim]`` and sharded along the
sequence between the parallel regions (``SequenceParallel`` on the norms).
Each parameter read all-gathers its dp shards over the dp group only; the tp
collectives (sequence all-gather in, reduce-scatter out) stay on the tp group.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
)

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
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 128, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def parallelize(model: Model, tp_mesh) -> Model:
    """Tensor + sequence parallel: norms on sequence shards (dim 1), Colwise in, Rowwise out."""
    seq = Shard(1)
    for block in model.blocks:
        block.attention.heads //= tp_mesh.size()  # heads per rank after the colwise split
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(sequence_dim=1),
            "mlp_norm": SequenceParallel(sequence_dim=1),
            "attention.q": ColwiseParallel(input_layouts=seq),
            "attention.k": ColwiseParallel(input_layouts=seq),
            "attention.v": ColwiseParallel(input_layouts=seq),
            "attention.o": RowwiseParallel(output_layouts=seq),
            "mlp.up": ColwiseParallel(input_layouts=seq),
            "mlp.down": RowwiseParallel(output_layouts=seq),
        })
    return model


def build(tp: int = 2, dim: int = 64, heads: int = 4, hidden: int = 128, depth: int = 2,
          batch: int = 2, seq: int = 32):
    """(model on a dp x tp mesh of the default process group, (local sequence shard [batch, seq/tp, dim],)).

    dp = world size / ``tp``; the world size must divide by ``tp``.
    """
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"fsdp_tp.build: world size {world} does not divide by tp={tp}; pass --world-size {tp * 2}")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(Model(dim, heads, hidden, depth), mesh["tp"])
    overlapc.fsdp.shard(model, mesh)
    x = torch.randn(batch, seq // tp, dim, requires_grad=True)
    return model, (x,)

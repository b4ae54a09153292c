"""A small transformer block with tensor + sequence parallelism on a 1-D tp mesh::

    overlapc report examples/tp_sp.py:build --world-size 2

    overlapc report examples/tp_sp.py:build_batch_first --world-size 2

Activations are sequence-first ``[seq, batch, dim]`` (Megatron's layout;
``build``) or batch-first ``[batch, seq, dim]`` (torchtitan's and most
``parallelize_module`` code; ``build_batch_first``), sharded along the sequence
between the parallel regions (``SequenceParallel`` on the norms). Entering
attention or the MLP all-gathers the sequence
(``ColwiseParallel(input_layouts=Shard(seq_dim))``); leaving them
reduce-scatters it (``RowwiseParallel(output_layouts=Shard(seq_dim))``).
DTensor gathers the batch-first layout's dim 1 as an all-gather on dim 0
followed by split + cat (and reduce-scatters it after a split + cat). The
all-gather feeds a matmul right away and the reduce-scatter reads a matmul's
output right away: these are the patterns ``overlapc.passes.chunk`` pipelines.
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


class Attention(nn.Module):
    """Causal self-attention; one fused q/k/v projection whose output features
    are laid out head by head ([heads, 3, head_dim]), so that a column split
    gives each rank whole heads with their own q, k and v (Megatron's layout)."""

    def __init__(self, dim: int, heads: int, batch_first: bool = False):
        super().__init__()
        self.heads, self.batch_first = heads, batch_first
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        if self.batch_first:
            b, s, _ = x.shape
            qkv = self.qkv(x).view(b, s, self.heads, 3, -1)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        else:
            s, b, _ = x.shape
            qkv = self.qkv(x).view(s, b, self.heads, 3, -1)      # heads: this rank's heads under TP
            q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # [b, heads, s, head_dim]
        if self.batch_first:
            return self.o(y.transpose(1, 2).reshape(b, s, -1))
        return self.o(y.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, batch_first: bool = False):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads, batch_first)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Stack(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, depth: int, attention: bool = True,
                 batch_first: bool = False):
        super().__init__()
        self.batch_first = batch_first
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, batch_first) for _ in range(depth))
        if not attention:
            for block in self.blocks:
                block.attention = None

    def forward(self, x):
        for block in self.blocks:
            if block.attention is None:
                x = x + block.mlp(block.mlp_norm(x))
            else:
                x = block(x)
        return x


def parallelize(model: Stack, mesh) -> Stack:
    """Tensor + sequence parallel plan: norms on sequence shards, Colwise in, Rowwise out."""
    dim = 1 if model.batch_first else 0
    seq = Shard(dim)
    for block in model.blocks:
        plan = {
            "attention_norm": SequenceParallel(sequence_dim=dim),
            "mlp_norm": SequenceParallel(sequence_dim=dim),
            "mlp.up": ColwiseParallel(input_layouts=seq),
            "mlp.down": RowwiseParallel(output_layouts=seq),
        }
        if block.attention is not None:
            block.attention.heads //= mesh.size()   # heads per rank after the colwise split
            plan.update({"attention.qkv": ColwiseParallel(input_layouts=seq),
                         "attention.o": RowwiseParallel(output_layouts=seq)})
        parallelize_module(block, mesh, plan)
    return model


def check_split(example: str, world: int, split: dict[str, int]) -> None:
    """ValueError unless ``world`` tensor-parallel ranks divide every size in ``split``
    (what -> size): the message names the sizes and the world sizes that would do."""
    if not any(n % world for n in split.values()):
        return
    fits = [str(k) for k in range(2, min(split.values()) + 1) if not any(n % k for n in split.values())]
    listed = " or ".join([", ".join(fits[:-1]), fits[-1]] if len(fits) > 1 else fits)
    advice = f"run it with --world-size {listed}, or " if fits else ""
    raise ValueError(f"{example} splits {', '.join(f'{what} ({n})' for what, n in split.items())} over the {world} "
                     f"tensor-parallel ranks, so the world size must divide each: {advice}build it with other sizes")


def build(dim: int = 64, heads: int = 4, hidden: int = 256, depth: int = 2, seq: int = 64,
          batch: int = 2, attention: bool = True, batch_first: bool = False):
    """(TP+SP model over the default process group, (local sequence shard: [seq/world, batch, dim],
    or [batch, seq/world, dim] when ``batch_first``))."""
    world = dist.get_world_size()
    check_split("examples/tp_sp.py", world, {"the sequence": seq, "the hidden size": hidden}
                | ({"the attention heads": heads} if attention else {}))
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize(Stack(dim, heads, hidden, depth, attention, batch_first), mesh)
    x = torch.randn(seq // mesh.size(), batch, dim)
    if batch_first:
        x = x.transpose(0, 1).contiguous()
    return model, (x.requires_grad_(True),)


def build_batch_first(**kwargs):
    """``build`` with batch-first activations ([batch, seq/world, dim] per rank)."""
    return build(batch_first=True, **kwargs)

"""torchtitan SimpleFSDP-style sharding: every parameter is a DTensor shard that a
*parametrization* all-gathers when the module reads it.

Two ways of installing the parametrization, as real code does it:

* ``style="property"`` (torchtitan's ``simple_fsdp``): each module's class is
  replaced by a subclass whose parameter names are properties calling the
  parametrization module (``property(lambda self: replicate(self._parameters[name]))``);
* ``style="parametrize"``: ``torch.nn.utils.parametrize.register_parametrization``.

One ``ReplicateComputation`` instance is shared by every parameter (``shared=True``),
so Dynamo names it by the first module that used it: without care, every
collective would be attributed to ``blocks.0``. Forward graphs get one
all-gather per parameter, backward graphs one reduce-scatter per gradient::

    overlapc report examples/simplefsdp_tp.py:build --world-size 8
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


class ReplicateComputation(nn.Module):
    """Shard(0) DTensor parameter -> full local tensor (all-gather forward, reduce-scatter backward)."""

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        if not isinstance(shard, DTensor):
            return shard
        return shard.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.wo(torch.tanh(self.wq(x)))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.attn = Attention(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _as_properties(module: nn.Module, names: list[str], replicate: nn.Module) -> None:
    """torchtitan's way: swap the module's class for a subclass whose ``names`` are properties."""
    properties = {name: property(lambda self, pn=name: replicate(self._parameters[pn])) for name in names}
    module.__class__ = type(f"SimpleFSDP{type(module).__name__}", (type(module),), properties)


def simple_fsdp(model: nn.Module, mesh, style: str = "property", shared: bool = True) -> nn.Module:
    """Shard every parameter on dim 0 over ``mesh`` and install the all-gathering
    parametrization (one shared instance when ``shared``); in place, returns ``model``."""
    if style not in ("property", "parametrize"):
        raise ValueError(f"style must be 'property' or 'parametrize', got {style!r}")
    replicate = ReplicateComputation()
    for module in list(model.modules()):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        for name in names:
            full = module._parameters[name]
            module._parameters[name] = nn.Parameter(distribute_tensor(full.data, mesh, [Shard(0)]))
        if not names:
            continue
        own = replicate if shared else ReplicateComputation()
        if style == "property":
            _as_properties(module, names, own)
        else:
            for name in names:
                parametrize.register_parametrization(module, name, own, unsafe=True)
    return model


def build(dim: int = 64, hidden: int = 128, depth: int = 2, tokens: int = 32, style: str = "property",
          shared: bool = True):
    """(model sharded over the default process group, (input,)); the input needs no grad."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = simple_fsdp(Model(dim, hidden, depth), mesh, style=style, shared=shared)
    return model, (torch.randn(tokens, dim),)

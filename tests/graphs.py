"""Graph builders for the unit and property tests (make_fx under the fake process group)."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

F = torch.ops._c10d_functional
WORLD = 8


def ag(x, group="0"):
    return F.all_gather_into_tensor(x, WORLD, group)


def wait(x):
    return F.wait_tensor(x)


def trace(fn, *shapes, dtype=torch.float32):
    """make_fx graph of fn over random inputs of the given shapes."""
    torch.manual_seed(0)
    return make_fx(fn)(*[torch.randn(*s, dtype=dtype) for s in shapes])


def body(gm):
    """Names of the graph's nodes except placeholders and output, in order."""
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]

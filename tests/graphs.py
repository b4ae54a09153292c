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


def ancestors(node):
    """Every node ``node`` reads, directly or through others."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def body(gm):
    """Names of the graph's nodes except placeholders and output, in order."""
    return [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def random_inputs(gm, seed=0):
    """Random values for ``gm``'s placeholders from their ``meta["val"]`` (None for a
    non-tensor, such as a device mesh: unused by the local stand-ins)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor):
            out.append(None)
        elif v.dtype.is_complex:   # rotary tables
            out.append(torch.randn(v.shape, generator=g, dtype=v.dtype))
        elif v.dtype.is_floating_point:
            out.append(torch.randn(v.shape, generator=g).to(v.dtype))
        else:
            out.append(torch.randint(0, 8, v.shape, generator=g, dtype=v.dtype))
    return out


class Block(torch.nn.Module):
    """A residual norm -> up -> activation -> down block (6 parameters): the module
    unit the bucketing tests shard and bucket."""

    def __init__(self, dim, activation=torch.relu):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)
        self.activation = activation

    def forward(self, x):
        return x + self.down(self.activation(self.up(self.norm(x))))


class Encoder(torch.nn.Module):
    """A small transformer encoder layer and a linear head: the model the
    end-to-end gloo tests shard and train."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.block(x))


def plan_entry(plan, module: str):
    """The index of the entry of bucket plan ``plan`` (entries: a module path or paths) that
    names ``module`` or its longest prefix, or None: README "Buckets"' rule, written here
    apart from overlapc's own lookup."""
    entries = {path: i for i, paths in enumerate(plan) for path in ([paths] if isinstance(paths, str) else paths)}
    parts = module.split(".")
    return next((entries[p] for p in (".".join(parts[:k]) for k in range(len(parts), 0, -1)) if p in entries), None)

"""Row-wise legality: whether piece i of a node is the node applied to piece i of its inputs.

A tensor in a pipeline has a layout (dim, blocks): its pieces are cut along
``dim`` (dim 0, the rows, unless the pipeline cuts the batch of a
sequence-first tensor, its dim 1), which holds ``blocks`` equal blocks (the
ranks of a collective that moved it, or the rows of a view that merged outer
dims into it, or 1); piece i is entries ``r*n + i*n/k ... + n/k`` of every
block r (n a block). See ``overlapc.passes.chunk``'s docstring. Every check
raises ``Skip`` with the reason a note reports.

``check_rowwise`` runs the checks every op shares, then the op's rule: one
small function per op family, registered for its targets with ``@_rule``
(a new op family is a new rule); pointwise ops without a rule share one.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from overlapc.passes.collectives import barrier_reason_when_compute_moves, node_value, wait_nodes

aten = torch.ops.aten

VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
PERMUTES = {aten.permute.default, aten.transpose.int, aten.t.default}
COPIES = {aten.clone.default, aten._to_copy.default, aten.alias.default, aten._conj.default,
          aten.view_as_real.default}   # view_as_real: a trailing dim of 2 added, the rows stay
# ops that add, drop or broadcast other dims than the rows (rotary embeddings as complex
# products, grouped-query attention's repeated k/v heads and its backward)
RESHAPES = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
            aten.select.int, aten.view_as_complex.default}
MATMULS = {aten.mm.default, aten.addmm.default}
# reductions whose dims are args[1]: row-wise when dim 0 is not among them (norm statistics)
ROW_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.var_mean.correction, aten.var.correction,
                  aten.amax.default, aten.amin.default}
# ops independent along dim 0 (the batch) whose every tensor operand has it: attention
BATCHWISE = {aten.bmm.default, aten._softmax.default, aten._log_softmax.default,
             aten._softmax_backward_data.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


class Skip(Exception):
    """A pattern that does not qualify; the message is the note's reason."""


def val(node) -> torch.Tensor:
    """``node``'s (first) output tensor, with int sizes; Skip otherwise."""
    return outputs(node)[0]


def outputs(node) -> list[torch.Tensor]:
    """The tensors ``node`` returns (one, or each of a tuple such as var_mean's)."""
    value = node_value(node) if isinstance(node, fx.Node) else None
    return [_checked(node, v) for v in value] if isinstance(value, (tuple, list)) else [_checked(node, value)]


def is_multi(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node_value(node), (tuple, list))


def _checked(node, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise Skip(f"unknown shape of {getattr(node, 'name', node)}")
    if any(not isinstance(d, int) for d in value.shape):
        raise Skip(f"symbolic shape of {node.name} ({tuple(value.shape)})")
    return value


def opname(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}"
    return getattr(target, "__name__", str(target))


def group_size(start: fx.Node, op: str) -> int:
    if op == "all_to_all_single":   # split sizes are one per rank
        splits = start.args[2]
        if not isinstance(splits, (list, tuple)):
            raise Skip(f"{start.name}: input split sizes are not a list ({splits!r})")
        return len(splits)
    return int(start.args[1] if op == "all_gather_into_tensor" else start.args[2])


def one_wait(start: fx.Node) -> fx.Node:
    waits = wait_nodes(start)
    if len(waits) != 1 or waits[0].args[0] is not start:
        raise Skip(f"{start.name} has {len(waits)} waits (need exactly one, directly on the start)")
    return waits[0]


def rows(node: fx.Node, blocks: int, k: int, dim: int = 0) -> int:
    """Dim ``dim`` of ``node`` (of each of its outputs): must split into blocks * k
    equal parts, the same for all outputs."""
    found = set()
    for value in outputs(node):
        if value.dim() <= dim or value.shape[dim] % (blocks * k):
            raise Skip(f"dim {dim} of {node.name} ({tuple(value.shape)}) does not divide by "
                       f"world {blocks} x chunks {k}")
        found.add(value.shape[dim])
    if len(found) != 1:
        raise Skip(f"outputs of {node.name} differ in dim {dim} ({sorted(found)})")
    return found.pop()


def equal_splits(start: fx.Node, world: int) -> None:
    out_splits, in_splits = start.args[1], start.args[2]
    for splits in (out_splits, in_splits):
        if not isinstance(splits, (list, tuple)) or not all(isinstance(s, int) for s in splits):
            raise Skip(f"{start.name}: split sizes are not constant ints ({splits!r})")
        if len(set(splits)) != 1 or len(splits) != world:
            raise Skip(f"{start.name}: unequal split sizes {list(splits)}")
    if list(out_splits) != list(in_splits):
        raise Skip(f"{start.name}: output splits {list(out_splits)} differ from input splits")


def keeps_rows(node: fx.Node, piece_dim: int = 0) -> bool:
    """A slice along another dim than the pieces', or along theirs over all of it
    (DTensor emits ``slice(wait, 0, 0, n)`` after an all-gather): piece i in, piece i out."""
    if node.target is not aten.slice.Tensor:
        return False
    value = node_value(node.args[0])
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    if dim % value.dim() != piece_dim:
        return True
    return start in (None, 0) and step == 1 and (end is None or end >= value.shape[piece_dim])


def is_layout(node: fx.Node) -> bool:
    """A node that only moves rows around: views, slices that keep them, DTensor's
    split + getitem + cat between a dim-0 collective and another sharded dim."""
    return node.target in VIEWS or keeps_rows(node) or node.target in (
        operator.getitem, aten.split.Tensor, aten.cat.default)


def row_operand(mm: fx.Node):
    return mm.args[1] if mm.target is aten.addmm.default else mm.args[0]


def _dim(node: fx.Node, index: int, rank: int) -> int:
    """The dim argument at ``index`` (default 0), in [0, rank)."""
    value = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
    return value % rank if rank else value


def cut_dim(node: fx.Node, a: fx.Node, layout: tuple[int, int]) -> int | None:
    """The dim along which ``node``, run on a piece (its layout ``layout``), takes the
    matching piece of ``a``, an operand from outside the pipeline with the full extent
    there (a saved activation in a backward); None when it takes ``a`` whole."""
    if node.target in MATMULS:
        return None
    out, va = val(node), val(a)
    if node.target in BATCHWISE:   # every operand has the batch first (attention's log-sum-exp too)
        dim = 0
    else:
        dim = layout[0] - (out.dim() - va.dim())   # operands broadcast from the right
        if va.dim() != out.dim():
            return None
    if dim < 0 or va.dim() == 0 or va.shape[dim] != out.shape[layout[0]] or out.shape[layout[0]] <= 1:
        return None
    return dim


def _view_layout(shape, layout, out_shape, k: int) -> tuple[int, int]:
    """The layout of ``shape`` (in ``layout``) viewed as ``out_shape``. In row-major
    order the tensor is [outer][n][inner] with outer = prod(shape[:dim]) * blocks and
    pieces cutting n; the view keeps them iff some dim q of ``out_shape`` is
    [outer / prod(out_shape[:q])][m] with m * prod(out_shape[q+1:]) = n * inner."""
    dim, blocks = layout
    outer = math.prod(shape[:dim]) * blocks
    per_block = shape[dim] // blocks * math.prod(shape[dim + 1:])
    for q in range(len(out_shape)):
        before = math.prod(out_shape[:q])
        if outer % before or out_shape[q] % (outer // before):
            continue
        b = outer // before
        if out_shape[q] // b * math.prod(out_shape[q + 1:]) == per_block and out_shape[q] // b % k == 0:
            return q, b
    raise Skip(f"a view of {tuple(shape)} as {tuple(out_shape)} does not keep the pieces of dim {dim}")


_KEEPDIM_ARG = {aten.sum.dim_IntList: 2, aten.mean.dim: 2, aten.amax.default: 2, aten.amin.default: 2}


@dataclasses.dataclass(frozen=True)
class _Site:
    """What a row-wise rule reads of the node it checks: its tensor inputs (``args``),
    those already in pieces (``ins``), its output and first piece input values, the
    count of pieces, and the layouts of the nodes in pieces."""

    node: fx.Node
    layouts: dict
    k: int
    args: list
    ins: list
    out: torch.Tensor
    src: torch.Tensor

    @property
    def what(self) -> str:
        return f"{self.node.name} ({opname(self.node)})"

    @property
    def why(self) -> str:
        return f"{self.what} is not row-wise"

    def single(self, first: bool = True) -> None:
        """Skip unless the node has one tensor input (``args``) and, with ``first``,
        its first argument is in pieces."""
        if len(self.args) != 1 or (first and self.node.args[0] not in self.layouts):
            raise Skip(self.why)

    def all_in_pieces(self) -> None:
        if any(a not in self.layouts for a in self.args):
            raise Skip(f"{self.what} joins pipelined rows with others")


# target -> rule(site, p, b) -> (p, b): the layout of the node's output from that of its
# inputs in pieces (dim p, b blocks); Skip with the reason when piece i out is not the
# node of piece i in. Ops with no rule are row-wise when pointwise (``_pointwise``).
_RULES: dict = {}


def _rule(*targets):
    def register(rule):
        for target in targets:
            if target in _RULES:
                raise ValueError(f"two row-wise rules for {target}")
            _RULES[target] = rule
        return rule
    return register


def check_rowwise(node: fx.Node, layouts: dict, k: int) -> tuple[int, int]:
    """Raise Skip unless piece i of ``node`` is ``node`` of piece i of its inputs;
    ``layouts`` maps the nodes already in pieces to their layouts (dim, blocks).
    Returns ``node``'s layout (each output's, for a node with several)."""
    why = f"{node.name} ({opname(node)}) is not row-wise"
    if node.op != "call_function":
        raise Skip(why)
    if barrier_reason_when_compute_moves(node) is not None:
        raise Skip(f"barrier {node.name} ({barrier_reason_when_compute_moves(node)})")
    args = list(node._input_nodes)
    ins = [a for a in args if a in layouts]
    if not ins:
        raise Skip(why)
    if len({layouts[a] for a in ins}) != 1:
        raise Skip(f"{node.name} ({opname(node)}) mixes inputs of different rank layouts")
    site = _Site(node, layouts, k, args, ins, val(node), val(ins[0]))
    rule = _RULES.get(node.target)
    if rule is None and isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        rule = _pointwise
    if rule is None:
        raise Skip(why)
    p, b = rule(site, *layouts[ins[0]])
    rows(node, b, k, p)
    return p, b


@_rule(operator.getitem, *COPIES, aten.slice.Tensor)
def _same_rows(site: _Site, p: int, b: int) -> tuple[int, int]:
    """Copies, getitem and slices that keep the rows (``keeps_rows``)."""
    if site.node.target is aten.slice.Tensor and not keeps_rows(site.node, p):
        raise Skip(site.why)
    site.single()
    return p, b


@_rule(*VIEWS)
def _view(site: _Site, p: int, b: int) -> tuple[int, int]:
    site.single(first=False)
    return _view_layout(tuple(site.src.shape), (p, b), tuple(site.out.shape), site.k)


@_rule(*ROW_REDUCTIONS)
def _row_reduction(site: _Site, p: int, b: int) -> tuple[int, int]:
    node, rank = site.node, site.src.dim()
    dims = node.args[1] if len(node.args) > 1 else None
    if len(site.args) != 1 or not dims or any(d % rank == p for d in dims):
        raise Skip(f"{site.what} reduces over the rows")
    index = _KEEPDIM_ARG.get(node.target)
    keepdim = node.kwargs.get("keepdim", node.args[index] if index is not None and len(node.args) > index
                              else False)
    if not keepdim:
        p -= sum(1 for d in dims if d % rank < p)
    return p, b


@_rule(aten.native_layer_norm.default)
def _layer_norm(site: _Site, p: int, b: int) -> tuple[int, int]:
    """A norm left whole (no decompositions)."""
    if site.node.args[0] not in site.layouts or len(site.ins) != 1:
        raise Skip(site.why)
    if p >= site.src.dim() - len(site.node.args[1]):
        raise Skip(f"{site.what} normalises over the rows")
    return p, b


@_rule(*RESHAPES)
def _reshape(site: _Site, p: int, b: int) -> tuple[int, int]:
    site.single()
    return _reshaped_dim(site.node, site.src, site.out, p), b


@_rule(aten.stack.default)
def _stack(site: _Site, p: int, b: int) -> tuple[int, int]:
    site.all_in_pieces()
    return p + (_dim(site.node, 1, site.out.dim()) <= p), b


@_rule(*PERMUTES)
def _permute(site: _Site, p: int, b: int) -> tuple[int, int]:
    node, rank = site.node, site.out.dim()
    if node.target is aten.permute.default:
        order = [d % rank for d in node.args[1]]
    else:
        order = list(range(rank))
        i, j = (0, 1) if node.target is aten.t.default else (node.args[1] % rank, node.args[2] % rank)
        order[i], order[j] = order[j], order[i]
    return order.index(p), b


@_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def _split(site: _Site, p: int, b: int) -> tuple[int, int]:
    node, src = site.node, site.src
    parts = len(outputs(node))
    d = _dim(node, 1 if node.target is aten.unbind.int else 2, src.dim())
    site.single(first=False)
    if d == p:
        if node.target is not aten.split.Tensor or b % parts or src.shape[p] % parts:
            raise Skip(f"{site.what} splits the rows unevenly across rank blocks")
        b //= parts   # DTensor's regather: rank blocks become separate tensors
    elif node.target is aten.unbind.int and d < p:
        p -= 1
    return p, b


@_rule(aten.cat.default)
def _cat(site: _Site, p: int, b: int) -> tuple[int, int]:
    site.all_in_pieces()
    if _dim(site.node, 1, site.out.dim()) == p:
        if len({tuple(val(a).shape) for a in site.args}) != 1:
            raise Skip(f"{site.what} joins unequal parts along the rows")
        b *= len(site.args)   # separate rank blocks become one tensor (before a reduce-scatter)
    elif len({val(a).shape[p] for a in site.args}) != 1:
        raise Skip(site.why)
    return p, b


@_rule(*MATMULS)
def _matmul(site: _Site, p: int, b: int) -> tuple[int, int]:
    node = site.node
    if row_operand(node) not in site.layouts or len(site.ins) != 1 or p != 0:
        raise Skip(f"{site.what} does not read the rows as its first operand")
    if node.target is aten.addmm.default:
        bias = val(node.args[0])
        if bias.dim() == 2 and bias.shape[0] != 1:
            raise Skip(f"{node.name}: bias {node.args[0].name} has rows")
    return p, b


_SOFTMAX_DIM_ARG = {aten._softmax.default: 1, aten._log_softmax.default: 1, aten._softmax_backward_data.default: 2}


@_rule(*BATCHWISE)
def _batchwise(site: _Site, p: int, b: int) -> tuple[int, int]:
    out = site.out
    if p != 0 or any(val(a).shape[0] != out.shape[0] for a in site.ins):
        raise Skip(f"{site.what} is cut along dim {p}, not its batch")
    index = _SOFTMAX_DIM_ARG.get(site.node.target)
    if index is not None and _dim(site.node, index, out.dim()) == p:
        raise Skip(f"{site.what} normalises over the rows")
    return p, b


def _pointwise(site: _Site, p: int, b: int) -> tuple[int, int]:
    """Elementwise ops: no operand in pieces broadcast along the rows, none from
    outside with rows of another length."""
    out = site.out
    for a in site.args:
        v = val(a)
        if a in site.layouts and (v.dim() != out.dim() or v.shape[p] != out.shape[p]):
            raise Skip(f"{site.what} broadcasts {a.name} along rows")
        d = p - (out.dim() - v.dim())
        if a not in site.layouts and d >= 0 and v.shape[d] not in (1, out.shape[p]):
            raise Skip(site.why)
    return p, b


def _reshaped_dim(node: fx.Node, src: torch.Tensor, out: torch.Tensor, p: int) -> int:
    """Where the rows (dim ``p`` of ``src``) are in the output of a RESHAPES ``node``;
    Skip when it selects, squeezes or broadcasts along them."""
    target = node.target
    if target is aten.unsqueeze.default:
        return p + (_dim(node, 1, out.dim()) <= p)
    if target in (aten.squeeze.dim, aten.squeeze.dims):
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        gone = [d % src.dim() for d in dims if src.shape[d] == 1]   # squeeze leaves other dims
        return p - sum(1 for d in gone if d < p)
    if target is aten.expand.default:
        lead = out.dim() - src.dim()
        if out.shape[p + lead] != src.shape[p]:
            raise Skip(f"{node.name} ({opname(node)}) broadcasts along the rows")
        return p + lead
    if target is aten.select.int:
        d = _dim(node, 1, src.dim())
        if d == p:
            raise Skip(f"{node.name} ({opname(node)}) selects a row")
        return p - (d < p)
    if p == src.dim() - 1:   # view_as_complex folds the last dim
        raise Skip(f"{node.name} ({opname(node)}) folds the rows into complex numbers")
    return p


def check_no_feedback(region, wait, depends) -> None:
    """Skip when a region node reads a node outside the region that itself depends on
    the pipelined rows (it would need every piece before any piece could go on)."""
    inside = set(region) | {wait}
    for node in region:
        for a in node._input_nodes:
            if a not in inside and a in depends:
                raise Skip(f"intermediate has another user: {a.name} ({opname(a)}) reads the "
                           f"pipelined rows and feeds {node.name} back")

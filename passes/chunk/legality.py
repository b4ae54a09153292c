"""Row-wise legality: whether piece i of a node is the node applied to piece i of its inputs.

A tensor in a pipeline has a layout (dim, blocks): its pieces are cut along
``dim`` (dim 0, the rows, unless the pipeline cuts the batch of a
sequence-first tensor, its dim 1), which holds ``blocks`` equal blocks (the
ranks of a collective that moved it, or the rows of a view that merged outer
dims into it, or 1); piece i is entries ``r*n + i*n/k ... + n/k`` of every
block r (n a block). See ``overlapc.passes.chunk``'s docstring. Every check
raises ``Skip`` with the reason a note reports.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from overlapc.collectives import barrier_reason_when_compute_moves, node_value, wait_nodes

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


def target_is_split(node: fx.Node) -> bool:
    return node.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)


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


def check_rowwise(node: fx.Node, layouts: dict, k: int) -> tuple[int, int]:
    """Raise Skip unless piece i of ``node`` is ``node`` of piece i of its inputs;
    ``layouts`` maps the nodes already in pieces to their layouts (dim, blocks).
    Returns ``node``'s layout (each output's, for a node with several)."""
    target = node.target
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
    p, b = layouts[ins[0]]
    out = val(node)
    src = val(ins[0])
    if target is operator.getitem or target in COPIES or keeps_rows(node, p):
        if node.args[0] not in layouts or len(args) != 1:
            raise Skip(why)
    elif target in VIEWS:
        if len(args) != 1:
            raise Skip(why)
        p, b = _view_layout(tuple(src.shape), (p, b), tuple(out.shape), k)
    elif target in ROW_REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else None
        if len(args) != 1 or not dims or any(d % src.dim() == p for d in dims):
            raise Skip(f"{node.name} ({opname(node)}) reduces over the rows")
        index = _KEEPDIM_ARG.get(target)
        keepdim = node.kwargs.get("keepdim", node.args[index] if index is not None and len(node.args) > index
                                  else False)
        if not keepdim:
            p -= sum(1 for d in dims if d % src.dim() < p)
    elif target is aten.native_layer_norm.default:   # a norm left whole (no decompositions)
        if node.args[0] not in layouts or len(ins) != 1:
            raise Skip(why)
        if p >= src.dim() - len(node.args[1]):
            raise Skip(f"{node.name} ({opname(node)}) normalises over the rows")
    elif target in RESHAPES:
        if node.args[0] not in layouts or len(args) != 1:
            raise Skip(why)
        p = _reshaped_dim(node, src, out, p)
    elif target is aten.stack.default:
        if any(a not in layouts for a in args):
            raise Skip(f"{node.name} ({opname(node)}) joins pipelined rows with others")
        p += _dim(node, 1, out.dim()) <= p
    elif target in PERMUTES:
        if target is aten.permute.default:
            order = [d % out.dim() for d in node.args[1]]
        else:
            order = list(range(out.dim()))
            i, j = (0, 1) if target is aten.t.default else (node.args[1] % out.dim(), node.args[2] % out.dim())
            order[i], order[j] = order[j], order[i]
        p = order.index(p)
    elif target_is_split(node):
        parts = len(outputs(node))
        d = _dim(node, 1 if target is aten.unbind.int else 2, src.dim())
        if len(args) != 1:
            raise Skip(why)
        if d == p:
            if target is not aten.split.Tensor or b % parts or src.shape[p] % parts:
                raise Skip(f"{node.name} ({opname(node)}) splits the rows unevenly across rank blocks")
            b //= parts   # DTensor's regather: rank blocks become separate tensors
        elif target is aten.unbind.int and d < p:
            p -= 1
    elif target is aten.cat.default:
        if any(a not in layouts for a in args):
            raise Skip(f"{node.name} ({opname(node)}) joins pipelined rows with others")
        if _dim(node, 1, out.dim()) == p:
            if len({tuple(val(a).shape) for a in args}) != 1:
                raise Skip(f"{node.name} ({opname(node)}) joins unequal parts along the rows")
            b *= len(args)   # separate rank blocks become one tensor (before a reduce-scatter)
        elif len({val(a).shape[p] for a in args}) != 1:
            raise Skip(why)
    elif target in MATMULS:
        first = row_operand(node)
        if first not in layouts or len(ins) != 1 or p != 0:
            raise Skip(f"{node.name} ({opname(node)}) does not read the rows as its first operand")
        if target is aten.addmm.default:
            bias = val(node.args[0])
            if bias.dim() == 2 and bias.shape[0] != 1:
                raise Skip(f"{node.name}: bias {node.args[0].name} has rows")
    elif target in BATCHWISE:
        if p != 0 or any(val(a).shape[0] != out.shape[0] for a in ins):
            raise Skip(f"{node.name} ({opname(node)}) is cut along dim {p}, not its batch")
        if target in (aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default) \
                and _dim(node, 2 if target is aten._softmax_backward_data.default else 1, out.dim()) == p:
            raise Skip(f"{node.name} ({opname(node)}) normalises over the rows")
    elif isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        for a in args:
            v = val(a)
            if a in layouts and (v.dim() != out.dim() or v.shape[p] != out.shape[p]):
                raise Skip(f"{node.name} ({opname(node)}) broadcasts {a.name} along rows")
            d = p - (out.dim() - v.dim())
            if a not in layouts and d >= 0 and v.shape[d] not in (1, out.shape[p]):
                raise Skip(why)
    else:
        raise Skip(why)
    rows(node, b, k, p)
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

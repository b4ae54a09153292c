"""Pipelining all-to-alls whose split sizes are known only at run time (dropless MoE).

    why = count_exchange(start)       # a reason string when ``start`` exchanges split sizes
    if is_ragged(start):
        plan = plan_ragged(start, k)  # a RaggedPlan, or Skip with the reason
        names = emit_ragged(emitter, plan)

Dropless MoE (token choice, torchtitan's MoE, DeepSeek-style routing) first
exchanges token counts with an all-to-all, reads them as ints (``tolist()``:
unbacked SymInts under torch.compile, one FX node each) and then dispatches
and combines with ``all_to_all_single`` whose split sizes are those nodes. The
pattern here is the same as ``all_to_all_expert``: dispatch -> row-wise expert
compute -> combine that sends back the rows it received (the combine's input
splits are the dispatch's output splits, node for node).

Pieces are token ranges of every rank block: with a block of s rows, piece i
of k is its rows [s*i//k, s*(i+1)//k). The receiver cuts the block it gets
from rank r (q rows, the sender's s) by the same formula, so piece i of the
dispatch is ``all_to_all_single`` of piece i of every block, with sizes
``s*(i+1)//k - s*i//k`` on both sides; its result is piece i of every received
block. Row-wise compute maps it to piece i, and the combine sends piece i back
by the same rule. Every result is exact (the matmuls see fewer rows, the
arithmetic per row is the same); blocks smaller than k give empty pieces.
The sizes are SymInt arithmetic nodes (``operator.mul``, ``floordiv``, ``sub``)
on the split nodes; the cuts are ``split_with_sizes`` + ``cat`` per piece, and
values that the rest of the graph reads (activations saved for backward, the
combine's result) are reassembled by ``split_with_sizes`` of each piece and
one ``cat`` in block order. Nodes are ordered by the Emitter's waves.

Row-wise here: mm / addmm with the rows as first operand (the weight not
derived from them), pointwise ops (an operand from outside with the same rows,
such as a saved activation in a backward, is cut the same way), copies,
reductions over other dims, views that keep dim 0. Anything else is reported.

``chunks="auto"`` (``estimate_ragged``) needs shapes: it assumes balanced
routing, every split size = tokens / world, where tokens are the rows of the
dispatch input when static, else the largest upper bound the graph asserts on a
split size (a count cannot exceed the tokens: ``u0 <= 64``); without either it
reports that it cannot estimate.
"""
from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx

from overlapc.passes.collectives import (
    barrier_reason_when_compute_moves, collective_op, group_of, is_wait, node_value,
)
from overlapc.passes.chunk import legality as L
from overlapc.passes.chunk.legality import Skip
from overlapc.passes.chunk.plan import between, first_sink
from overlapc.passes.meta import set_piece_of

aten = torch.ops.aten
F = torch.ops._c10d_functional
A2A = "all_to_all_single"
# integer reads of a tensor: what makes an all-to-all's result split sizes
_TO_INT = {aten._local_scalar_dense.default, aten.item.default}
_INDEXING = {aten.select.int, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default, operator.getitem,
             *L.VIEWS, *L.COPIES}


@dataclasses.dataclass
class RaggedPlan:
    """dispatch (source) -> row-wise region -> combine (sink), split sizes symbolic."""

    group: str
    world: int
    chunks: int
    source: fx.Node
    sink: fx.Node
    region: list[fx.Node]            # graph order
    cut: list[fx.Node]               # operands from outside with the region's rows, cut per piece
    pattern: str = "all_to_all_expert"
    link = None                      # never fed by another pipeline (``plan.Plan.link``)
    stops = ""                       # reaches its sink (``plan.Plan.stops``)

    @property
    def starts(self) -> tuple[fx.Node, ...]:
        return self.source, self.sink


def _splits(start: fx.Node) -> tuple[list, list]:
    """(output split sizes, input split sizes) of an all_to_all_single start."""
    out_splits, in_splits = start.args[1], start.args[2]
    if not isinstance(out_splits, (list, tuple)) or not isinstance(in_splits, (list, tuple)):
        raise Skip(f"{start.name}: split sizes are not lists ({out_splits!r}, {in_splits!r})")
    return list(out_splits), list(in_splits)


def is_ragged(start: fx.Node) -> bool:
    """An all_to_all_single with a split size computed in the graph (a SymInt node)."""
    return collective_op(start) == A2A and any(
        isinstance(s, fx.Node) for splits in start.args[1:3] if isinstance(splits, (list, tuple)) for s in splits)


def count_exchange(start: fx.Node) -> str | None:
    """Why ``start`` is no pipeline: an all_to_all_single whose result is only read
    as ints (``tolist()``: the split sizes of later all-to-alls); None otherwise."""
    if collective_op(start) != A2A:
        return None
    seen, stack, ints = set(), list(start.users), 0
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target in _TO_INT:
            ints += 1
        elif is_wait(node) or node.target in _INDEXING:
            stack.extend(node.users)
        else:
            return None
    if not ints:
        return None
    fed = sorted({u.name for n in seen if n.target in _TO_INT for u in _sym_users(n) if is_ragged(u)})
    return (f"{start.name} exchanges split sizes (read as ints at run time"
            f"{', the splits of ' + ', '.join(fed) if fed else ''}): nothing computes on its rows")


def _sym_users(node: fx.Node):
    """Nodes that read the SymInt ``node``, through SymInt arithmetic."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user not in seen:
                seen.add(user)
                if isinstance(node_value(user), torch.SymInt):
                    stack.append(user)
                yield user


def _same(a, b) -> bool:
    """Equal sizes without a guard: equal ints, or SymInts of one expression."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return type(a) is type(b) and a == b


def _tensor(node) -> torch.Tensor | None:
    value = node_value(node) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def plan_ragged(start: fx.Node, k: int) -> RaggedPlan:
    """The dispatch -> expert -> combine pipeline that ``start`` begins, cut into
    ``k`` token ranges per rank block; Skip with the reason when it does not qualify."""
    received, _ = _splits(start)
    world, group = len(received), group_of(start)
    wait = L.one_wait(start)
    _only_sizes_read(start, wait)
    sink, depends = first_sink(wait, A2A, group)
    if sink is None or _splits(sink)[1] != received:
        found = f" ({sink.name} sends {_splits(sink)[1]})" if sink is not None else ""
        raise Skip(f"no all_to_all_single of group {group} after {start.name} sends back the rows it "
                   f"received (input splits {[getattr(s, 'name', s) for s in received]}){found}")
    sink_wait = L.one_wait(sink)
    _only_sizes_read(sink, sink_wait)
    on_path = {sink.args[0]}
    span = between(wait, sink)
    for node in reversed(span):
        if node in on_path:
            on_path.update(i for i in node._input_nodes if i in depends)
        if barrier_reason_when_compute_moves(node) is not None:
            raise Skip(f"barrier {node.name} ({L.opname(node)}: {barrier_reason_when_compute_moves(node)}) "
                       f"between {start.name} and {sink.name}")
    on_path.discard(wait)
    region = [n for n in span if n in on_path]
    inside = {wait, *region}
    if _tensor(wait) is None:
        raise Skip(f"unknown shape of {wait.name}")
    rows = _tensor(wait).shape[0]
    cut: dict[fx.Node, None] = {}
    for node in region:
        cut.update(dict.fromkeys(_check(node, inside, depends, rows)))
    if sink.args[0] not in inside:
        raise Skip(f"{sink.name} reads {sink.args[0].name}, not the dispatched rows")
    return RaggedPlan(group, world, k, start, sink, region, list(cut))


def _only_sizes_read(start: fx.Node, wait: fx.Node) -> None:
    for user in start.users:
        if user is not wait and user.target is not aten.sym_size.int:
            raise Skip(f"{start.name} is read by {user.name} ({L.opname(user)}) besides its wait")


def _check(node: fx.Node, inside: set, depends: set, rows) -> list[fx.Node]:
    """Skip unless piece i of ``node`` is ``node`` on piece i of its inputs (every
    piece cut by token ranges of dim 0, ``rows`` in all); returns the operands from
    outside with the same rows that must be cut alike."""
    why = f"{node.name} ({L.opname(node)}) is not row-wise"
    out = _tensor(node)
    if node.op != "call_function" or out is None or out.dim() == 0 or not _same(out.shape[0], rows):
        raise Skip(why)
    args = list(node._input_nodes)
    for a in args:
        if a not in inside and a in depends:
            raise Skip(f"{a.name} ({L.opname(a)}) reads the dispatched rows outside the pipeline "
                       f"and feeds {node.name}")
    ins = [a for a in args if a in inside]
    target = node.target
    cut = []
    if target in L.MATMULS:
        if L.row_operand(node) not in inside or len(ins) != 1:
            raise Skip(f"{node.name} ({L.opname(node)}) does not read the rows as its first operand")
        if target is aten.addmm.default:
            bias = _tensor(node.args[0])
            if bias is not None and bias.dim() == 2 and not _same(bias.shape[0], 1):
                raise Skip(f"{node.name}: bias {node.args[0].name} has rows")
    elif target in L.COPIES or target in L.VIEWS:
        sizes = [a for a in args if a is not node.args[0]]   # a view's symbolic sizes: replaced per piece
        if node.args[0] not in inside or (sizes and target not in L.VIEWS) or \
                any(_tensor(a) is not None for a in sizes) or any(not isinstance(d, int) for d in out.shape[1:]):
            raise Skip(why)
        if target in L.VIEWS and not _same(_tensor(node.args[0]).shape[0], rows):
            raise Skip(f"{node.name} ({L.opname(node)}) merges or splits the rows")
    elif target in L.ROW_REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else None
        if len(args) != 1 or not dims or any(d % _tensor(args[0]).dim() == 0 for d in dims):
            raise Skip(f"{node.name} ({L.opname(node)}) reduces over the rows")
    elif isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        for a in args:
            v = _tensor(a)
            if v is None:
                raise Skip(why)
            if v.dim() == out.dim() and _same(v.shape[0], rows):
                if a not in inside:
                    cut.append(a)
            elif a in inside or (v.dim() == out.dim() and not _same(v.shape[0], 1)):
                raise Skip(f"{node.name} ({L.opname(node)}) broadcasts {a.name} along the rows")
    else:
        raise Skip(why)
    return cut


class _Sizes:
    """Piece sizes as graph values: ``size(s, i)`` = s*(i+1)//k - s*i//k for a split
    size s (an int, or a SymInt node: new arithmetic nodes, made once each)."""

    def __init__(self, new, k: int):
        self.new, self.k, self.made = new, k, {}

    def bound(self, s, i: int):
        if i == 0 or i == self.k:
            return s if i else 0
        if not isinstance(s, fx.Node):
            return s * i // self.k
        key = ("bound", s, i)
        if key not in self.made:
            self.made[key] = self.new(operator.floordiv, (self.new(operator.mul, (s, i)), self.k))
        return self.made[key]

    def size(self, s, i: int):
        lo, hi = self.bound(s, i), self.bound(s, i + 1)
        if not isinstance(lo, fx.Node) and not isinstance(hi, fx.Node):
            return hi - lo
        if lo == 0:
            return hi
        key = ("size", s, i)
        if key not in self.made:
            self.made[key] = self.new(operator.sub, (hi, lo))
        return self.made[key]


def emit_ragged(emitter, plan: RaggedPlan) -> tuple[str, ...]:
    """Rewrite ``plan`` into its pieces through ``emitter`` (an ``emit.Emitter``: its
    node creation, wave keys and ``discard``); returns the new collective starts' names.
    Skip (nothing rewritten yet) when the fake values of a piece cannot be computed."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    emitter.created = []
    emitter._prefix, emitter._base = (emitter.keys[plan.sink][0], -1), 0
    try:
        starts, replaced = _build(emitter, plan)
    except GuardOnDataDependentSymNode as error:
        raise Skip(f"the pieces of {plan.source.name} need a guard on data-dependent sizes: "
                   f"{str(error).splitlines()[0]}") from None
    inside = {L.one_wait(plan.source), *plan.region}
    for old, new in replaced.items():
        old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in inside and u is not plan.sink)
    readers = {start: [n for n in start.users if n.target is aten.sym_size.int] for start in plan.starts}
    for node in [*readers[plan.sink], L.one_wait(plan.sink), plan.sink, *reversed(plan.region),
                 *readers[plan.source], L.one_wait(plan.source), plan.source]:
        if node.users:
            raise RuntimeError(f"overlapc chunk: {node.name} ({L.opname(node)}) still has users "
                               f"{[u.name for u in node.users]}")
        emitter.graph.erase_node(node)
        emitter.keys.pop(node, None)
    emitter.created = []
    emitter.changed = True
    return tuple(n.name for n in starts)


def _build(emitter, plan: RaggedPlan) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]]:
    """The pieces' nodes, in waves: (the new starts, {original node: its reassembly}
    for what the rest of the graph reads, sym_size readers of the starts included)."""
    k, world = plan.chunks, plan.world

    def new(target, args, kwargs=None, like=None, at=None, name=None):
        if at is not None:
            emitter._at = at
        return emitter._new(target, args, kwargs, like=like or plan.source, name=name)

    emitter._at = (0, 0)
    sizes = _Sizes(new, k)
    received, sent = _splits(plan.source)
    returned = _splits(plan.sink)[0]
    source_wait, sink_wait = L.one_wait(plan.source), L.one_wait(plan.sink)

    def cut(x: fx.Node, splits: list, stage: int) -> list[fx.Node]:
        """Piece i of every rank block of ``x``, for each i: one split, a cat per piece.
        The dispatch's pieces (stage 0) are all cut in wave 0, so that the scheduler
        can issue them together, as the slices of an equal-split dispatch; pieces
        the pipeline computes on are cut in their own waves."""
        emitter._at = (0, stage)
        parts = new(aten.split_with_sizes.default, (x, [sizes.size(s, i) for s in splits for i in range(k)]),
                    like=x)
        items = [new(operator.getitem, (parts, j), like=x) for j in range(world * k)]
        return [new(aten.cat.default, ([items[r * k + i] for r in range(world)],), like=x, at=(i if stage else 0, stage))
                for i in range(k)]

    def join(pieces: list[fx.Node], splits: list, like: fx.Node, stage: int) -> fx.Node:
        """Inverse of cut: each piece split into its rank blocks, all in block order."""
        emitter._at = (k - 1, stage)
        blocks = []
        for i, piece in enumerate(pieces):
            parts = new(aten.split_with_sizes.default, (piece, [sizes.size(s, i) for s in splits]), like=like)
            blocks.append([new(operator.getitem, (parts, r), like=like) for r in range(world)])
        return new(aten.cat.default, ([blocks[i][r] for r in range(world) for i in range(k)],), like=like)

    def start(original: fx.Node, x: fx.Node, i: int, out_splits: list, in_splits: list) -> fx.Node:
        node = new(original.target, (x, [sizes.size(s, i) for s in out_splits],
                                     [sizes.size(s, i) for s in in_splits], *original.args[3:]),
                   dict(original.kwargs), like=original, name=f"{original.name}_chunk{i}")
        set_piece_of(node, original.name)
        return node

    emitter._at = (0, 0)   # every dispatch piece's sizes up front, with its input
    for split in (*received, *sent):
        for i in range(k):
            sizes.size(split, i)
    inputs = cut(plan.source.args[0], sent, 0)
    cuts = {x: cut(x, received, 1) for x in plan.cut}
    sources = []
    for i in range(k):
        emitter._at = (i, 0)
        sources.append(start(plan.source, inputs[i], i, received, sent))
    envs: list[dict] = [{} for _ in range(k)]
    sinks, results = [], []
    for i, env in enumerate(envs):
        emitter._at = (i, 1)
        env[source_wait] = new(F.wait_tensor.default, (sources[i],), like=source_wait)
        env.update((x, pieces[i]) for x, pieces in cuts.items())
        for node in plan.region:
            env[node] = _copy(node, env, new)
        sinks.append(start(plan.sink, env[plan.sink.args[0]], i, returned, received))
        emitter._at = (i, 2)
        results.append(new(F.wait_tensor.default, (sinks[i],), like=sink_wait))

    inside = {source_wait, *plan.region}
    replaced = {sink_wait: join(results, returned, sink_wait, 2)}
    for node in [source_wait, *plan.region]:
        if any(u not in inside and u is not plan.sink for u in node.users) or \
                (node is source_wait and len(plan.source.users) > 1):
            replaced[node] = join([env[node] for env in envs], received, node, 1)
    for original, wait in ((plan.source, source_wait), (plan.sink, sink_wait)):
        for user in original.users:
            if user is not wait:   # sym_size of the start: of the reassembled result
                replaced[user] = new(aten.sym_size.int, (replaced[wait], *user.args[1:]), like=user)
    return sources + sinks, replaced


def _copy(node: fx.Node, env: dict, new) -> fx.Node:
    """``node`` on piece i of its inputs (``env``: piece i of the pipeline's nodes)."""
    args = fx.node.map_arg(node.args, lambda a: env.get(a, a))
    if node.target in L.VIEWS:   # dim 0: the piece's rows
        rows = new(aten.sym_size.int, (args[0], 0), like=node)
        args = (args[0], [rows, *node_value(node).shape[1:]], *args[2:])
    return new(node.target, args, fx.node.map_arg(dict(node.kwargs), lambda a: env.get(a, a)), like=node)


# -- chunks="auto" ---------------------------------------------------------------------------------

def estimate_ragged(plan: RaggedPlan, ks, estimator):
    """(best k, ((k, estimated ms), ...)) for ``plan`` with each count in ``ks`` and 1,
    by ``estimate.choose`` on a copy of the pipeline whose sizes assume balanced
    routing (module docstring); Skip when no token count is known."""
    from overlapc.passes.chunk import estimate
    from overlapc.passes.chunk.plan import Plan
    hints = _balanced_hints(plan)
    graph, env = fx.Graph(), {}

    def concrete(value):
        if isinstance(value, torch.Tensor):
            return torch.empty([_hint(d, hints) for d in value.shape], dtype=value.dtype, device="meta")
        if isinstance(value, (list, tuple)):
            return type(value)(concrete(v) for v in value)
        return _hint(value, hints) if isinstance(value, torch.SymInt) else value

    def copy(node):
        if node not in env:
            env[node] = graph.placeholder(node.name)
            env[node].meta["val"] = concrete(node_value(node))
        return env[node]

    members = [plan.source, L.one_wait(plan.source), *plan.region, plan.sink]
    for node in members:
        env[node] = graph.node_copy(node, copy)
        env[node].meta["val"] = concrete(node_value(node))
    region = [env[n] for n in plan.region]
    plans = {k: Plan(plan.pattern, plan.group, plan.world, k, env[plan.source], env[plan.source.args[0]],
                     env[plan.sink], region, [], env[plan.sink], {}) for k in ks}
    return estimate.choose(plans, estimator)


def _hint(size, hints: dict) -> int:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if not expr.free_symbols <= set(hints):
        raise Skip(f"chunks auto: no size known for {expr} (not a split size of the pipeline)")
    return int(expr.xreplace(hints))


def _balanced_hints(plan: RaggedPlan) -> dict:
    """Every symbol of the pipeline's split sizes -> tokens / world (balanced routing)."""
    symbols, shape_env = set(), None
    for start in plan.starts:
        for splits in _splits(start):
            for s in splits:
                value = node_value(s) if isinstance(s, fx.Node) else s
                if isinstance(value, torch.SymInt):
                    symbols |= value.node.expr.free_symbols
                    shape_env = value.node.shape_env
    rows = _tensor(plan.source.args[0])
    tokens = rows.shape[0] if rows is not None else None
    if not isinstance(tokens, int):
        ranges = shape_env.var_to_range if shape_env is not None else {}
        bounds = [ranges[s].upper for s in symbols if s in ranges]
        finite = [int(b) for b in bounds if isinstance(b, sympy.Integer)]
        if not finite:
            raise Skip(f"chunks auto: the token count of {plan.source.name} is unknown (no static rows, "
                       f"no upper bound on its split sizes): give chunks as an int")
        tokens = max(finite)
    per_rank = max(1, tokens // plan.world)
    return {s: sympy.Integer(per_rank) for s in sorted(symbols, key=str)}

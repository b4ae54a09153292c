"""Split collectives on the critical path into pipelined pieces.

    notes = chunk_collectives(gm, chunks)   # rewrites gm.graph in place; no recompile

Targets: a collective whose input is produced right before it and whose result
is needed right after (tensor/sequence parallel, MoE), where reordering alone
hides nothing. Each becomes ``chunks`` pieces so that piece i+1's collective
runs while piece i computes.

Row layout. All three patterns split dim 0 ("rows": tokens or sequence) and
never the dims a collective or a matmul contracts. A tensor of R rows that a
collective over W ranks moves is R = W blocks of n rows (rank-major); piece i
of it is rows ``r*n + i*n/chunks + j`` of every block r. That layout commutes
with the collectives, so every result is exact (only matmuls over fewer rows):

* all_gather(shard)[piece i] = all_gather(shard rows i*n/k ...): the shard is
  split along its own dim 0 (a cheap view) and the gathered pieces are already
  in piece layout; splitting a non-gathered dim instead would need a strided
  copy of the shard and only works for inputs with a batch dim.
* reduce_scatter(x)[rows i*n/k ...] = reduce_scatter(x[piece i]).
* all_to_all_single(x)[piece i] = all_to_all_single(x[piece i]) for equal splits.

Row-wise compute (matmul with the rows as its first operand and a weight not
derived from them, elementwise ops, reductions over other dims such as a norm's
statistics, views that keep dim 0 a multiple of W*chunks, permutes that keep
dim 0 first) maps piece i to piece i. Patterns:

* ``all_gather_matmul``: all-gather -> row-wise compute -> reduce-scatter of
  the same group (a TP+SP MLP, forward and backward) becomes one pipeline and
  its note names both starts; without a reduce-scatter reachable through
  row-wise compute, all-gather -> views -> the matmuls that read the rows.
* ``matmul_reduce_scatter``: matmul -> views -> reduce-scatter; the matmul's
  row operand is copied piece by piece.
* ``all_to_all_expert``: all_to_all_single -> row-wise expert compute ->
  all_to_all_single of the same group (MoE dispatch / combine).

Chained pipelines: when an all-gather's input is row-wise compute of an earlier
reduce-scatter pipeline's result (the residual add and norm between attention
and MLP in TP+SP), that compute runs piece by piece on the reduce-scatter's
pieces and feeds the all-gather's pieces directly (the note's ``fed_by``), so
the two pipelines become one and piece i's reduce-scatter overlaps the compute
of other pieces of the next pattern.

Values computed inside a pipeline that other nodes read (activations saved for
backward, weight gradients, graph outputs) are reassembled with one ``cat``;
operands from outside with full rows (saved activations in a backward) are
sliced piece by piece. Node order emitted: in waves; a pipeline's stages are
its source start (0), its compute and sink start (1) and its sink wait (2), a
fed pipeline's counting on from its feeder's, and wave w holds stage s of
piece w - s, stages in order. So piece i+1's start comes before piece i's
compute, and each collective is in flight over one wave of other pieces'
compute. Nodes that read a reassembled value move after it (a stable
topological order, the same on every rank); a node outside the pipelines that
it reads (a weight's transpose) moves to just before its first reader.

Left alone, with a ChunkNote saying why: a dim 0 that does not divide, unknown
or symbolic shapes, unequal all-to-all splits, a start without exactly one
wait, compute that is not row-wise, an intermediate whose other users feed the
pipeline back, a barrier between the collectives.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from overlapc.collectives import collective_op, group_of, node_value, role, wait_nodes
from overlapc.passes.structure import apply_order

__all__ = ["ChunkNote", "chunk_collectives"]

aten = torch.ops.aten
F = torch.ops._c10d_functional

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_PERMUTES = {aten.permute.default, aten.transpose.int, aten.t.default}
_COPIES = {aten.clone.default, aten._to_copy.default, aten.alias.default}
_MATMULS = {aten.mm.default, aten.addmm.default}
# reductions whose dims are args[1]: row-wise when dim 0 is not among them (norm statistics)
_ROW_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.var_mean.correction, aten.var.correction,
                   aten.amax.default, aten.amin.default}


@dataclasses.dataclass(frozen=True)
class ChunkNote:
    """What chunk_collectives did with one pattern.

    pattern: "all_gather_matmul", "matmul_reduce_scatter" or "all_to_all_expert".
    starts: names of the original collective start node(s) (a pipeline that
        ends in a reduce-scatter or combine all-to-all names both).
    group: process group name. chunks: pieces asked for.
    applied: True when the graph was rewritten; reason: why not ("" when applied).
    pieces: names of the new collective start nodes (empty when not applied).
    fed_by: the start of an earlier pipeline whose pieces feed this one, piece by
        piece, through row-wise compute (a reduce-scatter -> residual add -> norm ->
        all-gather chain); "" when the pipeline starts from a whole tensor.
    """

    pattern: str
    starts: tuple[str, ...]
    group: str
    chunks: int
    applied: bool
    reason: str = ""
    pieces: tuple[str, ...] = ()
    fed_by: str = ""


class _Skip(Exception):
    """A pattern that does not qualify; the message is the note's reason."""


def chunk_collectives(gm: fx.GraphModule, chunks: int) -> list[ChunkNote]:
    """Split qualifying all-gather/matmul, matmul/reduce-scatter and
    all-to-all/expert/all-to-all patterns of ``gm`` into ``chunks`` pipelined
    pieces, in place (``gm.graph`` only: the caller recompiles). Returns one
    note per pattern found, applied or not, and appends them to
    ``gm.meta["overlapc_chunks"]``. chunks == 1 changes nothing and returns []."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunk_collectives: chunks must be an int >= 1, got {chunks!r}")
    notes: list[ChunkNote] = []
    if chunks > 1:
        rewriter = _Rewriter(gm, chunks)
        for start in [n for n in gm.graph.nodes if collective_op(n) is not None]:
            if start in rewriter.done:
                continue
            note = rewriter.try_start(start)
            if note is not None:
                notes.append(note)
        if rewriter.changed:
            rewriter.finish()
            gm.graph.lint()
    gm.meta.setdefault("overlapc_chunks", []).extend(notes)
    return notes


# ---------------------------------------------------------------- shapes and fake values


def _val(node) -> torch.Tensor:
    """``node``'s (first) output tensor, with int sizes; _Skip otherwise."""
    return _outputs(node)[0]


def _outputs(node) -> list[torch.Tensor]:
    """The tensors ``node`` returns (one, or each of a tuple such as var_mean's)."""
    value = node_value(node) if isinstance(node, fx.Node) else None
    return [_checked(node, v) for v in value] if isinstance(value, (tuple, list)) else [_checked(node, value)]


def _is_multi(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node_value(node), (tuple, list))


def _checked(node, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _Skip(f"unknown shape of {getattr(node, 'name', node)}")
    if any(not isinstance(d, int) for d in value.shape):
        raise _Skip(f"symbolic shape of {node.name} ({tuple(value.shape)})")
    return value


def _group_size(start: fx.Node, op: str) -> int:
    if op == "all_to_all_single":   # split sizes are one per rank
        splits = start.args[2]
        if not isinstance(splits, (list, tuple)):
            raise _Skip(f"{start.name}: input split sizes are not a list ({splits!r})")
        return len(splits)
    return int(start.args[1] if op == "all_gather_into_tensor" else start.args[2])


class FakeValues:
    """``meta["val"]`` for nodes a pass creates: the op run on fake inputs, in the
    graph's own fake mode when it has one (a fresh one otherwise). Shared by the
    chunk and bucket passes."""

    def __init__(self, gm: fx.GraphModule):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode
        vals = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        try:
            self.mode = detect_fake_mode(vals)
        except Exception:  # make_fx in real mode: one fake mode per value
            self.mode = None
        self.mode = self.mode or FakeTensorMode()

    def of(self, node: fx.Node):
        from torch._subclasses.fake_tensor import FakeTensor
        val = node_value(node)
        if isinstance(val, FakeTensor) and val.fake_mode is self.mode:
            return val
        if isinstance(val, torch.Tensor):
            with self.mode:
                return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        return val

    def run(self, target, args, kwargs):
        a, k = tree_map(lambda x: self.of(x) if isinstance(x, fx.Node) else x, (args, kwargs))
        with self.mode:
            return target(*a, **k)


# ---------------------------------------------------------------- the rewriter


@dataclasses.dataclass
class _Plan:
    """One pipeline: an optional source collective, row-wise region, optional sink."""

    pattern: str
    group: str
    world: int
    source: fx.Node | None           # start whose result the region reads (all-gather / dispatch)
    source_input: fx.Node | None     # what to cut for the source (shard / dispatch input)
    sink: fx.Node | None             # start that reads the region (reduce-scatter / combine)
    region: list[fx.Node]            # row-wise nodes, graph order
    cut: list[fx.Node]               # row operands cut into pieces (matmul -> reduce-scatter)
    anchor: fx.Node                  # new nodes go just before it
    link: _Link | None = None        # an earlier pipeline's pieces feed source_input


@dataclasses.dataclass
class _Joined:
    """A reduce-scatter pipeline's result, reassembled by one cat of its pieces."""

    pieces: list[fx.Node]            # piece i: rows i*n/k ... of the shard
    prefix: tuple                    # the pipeline's key prefix: (its anchor's index, -1)
    stage: int                       # the pieces' stage (their waits')
    start: str                       # the original reduce-scatter's name


@dataclasses.dataclass
class _Link:
    """Row-wise compute (shard layout) from a _Joined cat to an all-gather's input."""

    join: fx.Node
    joined: _Joined
    bridge: list[fx.Node]            # graph order, ending at the all-gather's input


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, chunks: int):
        self.gm, self.graph, self.k = gm, gm.graph, chunks
        self.done: set[fx.Node] = set()
        self.changed = False
        self.fake = FakeValues(gm)
        self.original = list(self.graph.nodes)
        # finish() orders by key: (original index, 0, ...) for the graph's nodes; a
        # pipeline's nodes (its anchor's index, -1, wave, stage, seq), where piece i's
        # nodes of stage s (0: source start, 1: compute, 2: sink wait; a fed pipeline
        # counts on from its feeder's) run in wave i + s, so that stage s of piece i
        # overlaps stage s + 1 of piece i - 1.
        self.keys: dict[fx.Node, tuple] = {n: (i, 0, 0, 0, 0) for i, n in enumerate(self.original)}
        self.seq = itertools.count()
        self.created: list[fx.Node] = []   # nodes of the pipeline being built
        self.joins: list[tuple[fx.Node, _Joined]] = []   # in the order made
        self._prefix, self._base, self._at = (0, -1), 0, (0, 0)

    # ---- finding patterns

    def try_start(self, start: fx.Node) -> ChunkNote | None:
        op = collective_op(start)
        if op == "all_gather_into_tensor":
            pattern = "all_gather_matmul"
        elif op == "reduce_scatter_tensor":
            pattern = "matmul_reduce_scatter"
        elif op == "all_to_all_single":
            pattern = "all_to_all_expert"
        else:
            return None
        group = group_of(start)
        try:
            if pattern == "matmul_reduce_scatter":
                plan = self._plan_reduce_scatter(start, group)
            else:
                plan = self._plan_source(start, op, pattern, group)
            if plan is None:
                return None
            self._check_barriers(plan)
            self.created = []
            pieces = self._rewrite(plan)
        except _Skip as skip:
            for node in reversed(self.created):   # a half-built pipeline: nothing of it stays
                self.graph.erase_node(node)
            self.created = []
            self.done.add(start)
            return ChunkNote(pattern, (start.name,), group, self.k, False, str(skip))
        self.created = []
        starts = tuple(n.name for n in (plan.source, plan.sink) if n is not None)
        fed_by = plan.link.joined.start if plan.link is not None else ""
        return ChunkNote(plan.pattern, starts, group, self.k, True, "", pieces, fed_by)

    def _one_wait(self, start: fx.Node) -> fx.Node:
        waits = wait_nodes(start)
        if len(waits) != 1 or waits[0].args[0] is not start:
            raise _Skip(f"{start.name} has {len(waits)} waits (need exactly one, directly on the start)")
        return waits[0]

    def _rows(self, node: fx.Node, world: int) -> int:
        """Dim 0 of ``node`` (of each of its outputs): must split into world * chunks
        equal blocks, the same for all outputs."""
        rows = set()
        for value in _outputs(node):
            if value.dim() == 0 or value.shape[0] % (world * self.k):
                raise _Skip(f"dim 0 of {node.name} ({tuple(value.shape)}) does not divide by "
                            f"world {world} x chunks {self.k}")
            rows.add(value.shape[0])
        if len(rows) != 1:
            raise _Skip(f"outputs of {node.name} differ in dim 0 ({sorted(rows)})")
        return rows.pop()

    def _plan_source(self, start, op, pattern, group) -> _Plan | None:
        world = _group_size(start, op)
        wait = self._one_wait(start)
        if op == "all_to_all_single":
            self._equal_splits(start, world)
            self._rows(start.args[0], world)
        else:
            shard = _val(start.args[0])
            if shard.dim() == 0 or shard.shape[0] % self.k:
                raise _Skip(f"dim 0 of the shard {start.args[0].name} ({tuple(shard.shape)}) "
                            f"does not divide by chunks {self.k}")
        self._rows(wait, world)
        sink_op = "reduce_scatter_tensor" if op == "all_gather_into_tensor" else "all_to_all_single"
        region, sink, why = self._region_to_sink(wait, sink_op, group, world)
        if sink is None and op == "all_to_all_single":
            raise _Skip(why or f"no all_to_all_single of group {group} reads {wait.name}'s rows")
        if sink is None:
            region = self._matmul_consumers(wait, world)
        plan = _Plan(pattern, group, world, start, start.args[0], sink, region, [], sink or region[-1])
        if op == "all_gather_into_tensor":
            plan.link = self._link(start)
        return plan

    def _link(self, start: fx.Node) -> _Link | None:
        """The row-wise compute by which an earlier reduce-scatter pipeline's result
        (a _Joined cat) reaches the all-gather ``start``'s input, or None. Every node
        on the way must be row-wise on the shard's rows and no barrier may lie
        between that pipeline and ``start``."""
        shard = start.args[0]
        end = self.keys[start][0]
        for join, joined in self.joins:
            if join._erased:
                continue
            reach = {join}           # original nodes before ``start`` that depend on the join
            for node in self.original[joined.prefix[0] + 1:end]:
                if not node._erased and any(i in reach for i in node._input_nodes):
                    reach.add(node)
            if shard not in reach:
                continue
            needed = {shard}
            for node in reversed(self.original[:end]):
                if node in needed:
                    needed.update(i for i in node._input_nodes if i in reach)
            bridge = [n for n in self.original[:end] if n in needed and n is not join]
            for node in list(bridge):   # the other outputs of a var_mean on the way
                if _is_multi(node):
                    bridge += [u for u in node.users if u.target is operator.getitem and u not in needed]
            bridge.sort(key=lambda n: self.keys[n])
            try:
                inside = set(bridge) | {join}
                for node in bridge:
                    self._check_rowwise(node, inside, 1)
                    if _is_multi(node) and any(u not in inside for u in node.users):
                        raise _Skip(f"{node.name} ({_opname(node)}) has a reader outside the chain")
                self._check_no_feedback(bridge, join, reach)
                for node in self.original[joined.prefix[0] + 1:end]:
                    if role(node)[2] is not None:
                        raise _Skip(f"barrier {node.name}")
            except _Skip:
                return None
            return _Link(join, joined, bridge)
        return None

    def _equal_splits(self, start: fx.Node, world: int) -> None:
        out_splits, in_splits = start.args[1], start.args[2]
        for splits in (out_splits, in_splits):
            if not isinstance(splits, (list, tuple)) or not all(isinstance(s, int) for s in splits):
                raise _Skip(f"{start.name}: split sizes are not constant ints ({splits!r})")
            if len(set(splits)) != 1 or len(splits) != world:
                raise _Skip(f"{start.name}: unequal split sizes {list(splits)}")
        if list(out_splits) != list(in_splits):
            raise _Skip(f"{start.name}: output splits {list(out_splits)} differ from input splits")

    def _region_to_sink(self, wait, sink_op, group, world):
        """(row-wise nodes from ``wait`` to the first ``sink_op`` of ``group`` that
        reads them, the sink start, None) or ([], None, why-not)."""
        depends = {wait}
        sink = None
        for node in self._after(wait):
            if any(i in depends for i in node._input_nodes):
                depends.add(node)
                if collective_op(node) == sink_op and group_of(node) == group and node.args[0] in depends:
                    sink = node
                    break
        if sink is None:
            return [], None, None
        # nodes on a path wait -> sink input
        on_path = {sink.args[0]}
        for node in reversed(self._between(wait, sink)):
            if node in on_path:
                on_path.update(i for i in node._input_nodes if i in depends)
        on_path.discard(wait)
        region = [n for n in self._between(wait, sink) if n in on_path]
        try:
            if sink_op == "all_to_all_single":
                self._equal_splits(sink, world)
            self._one_wait(sink)
            for node in region:
                self._check_rowwise(node, set(region) | {wait}, world)
            self._check_no_feedback(region, wait, depends)
        except _Skip as skip:
            return [], None, f"compute between {wait.name} and {sink.name} is not pipelined: {skip}"
        return region, sink, None

    def _matmul_consumers(self, wait: fx.Node, world: int) -> list[fx.Node]:
        """The matmuls that read the gathered rows as their first operand (through
        views that keep the rows), with those views, in graph order."""
        views = {wait}
        matmuls: list[fx.Node] = []
        first_other = None
        for node in self._after(wait):
            if not any(i in views for i in node._input_nodes):
                continue
            try:
                if node.target in _VIEWS or self._keeps_rows(node):
                    self._check_rowwise(node, views, world)
                    views.add(node)
                    continue
                if node.target in _MATMULS:
                    self._check_rowwise(node, views, world)
                    matmuls.append(node)
                    continue
            except _Skip:
                pass
            first_other = first_other or node
        if not matmuls:
            other = f" (first consumer: {first_other.name}, {_opname(first_other)})" if first_other else ""
            raise _Skip(f"no matmul reads the rows of {wait.name}{other}")
        needed = set(matmuls)
        for node in reversed(list(self._between(wait, matmuls[-1]))):
            if node in views and any(u in needed for u in node.users):
                needed.add(node)
        return [n for n in self._between(wait, matmuls[-1]) if n in needed] + [matmuls[-1]]

    def _plan_reduce_scatter(self, start: fx.Node, group: str) -> _Plan:
        world = _group_size(start, "reduce_scatter_tensor")
        self._one_wait(start)
        chain = []
        node = start.args[0]
        while isinstance(node, fx.Node) and node.target in _VIEWS:
            chain.append(node)
            node = node.args[0]
        if not isinstance(node, fx.Node) or node.target not in _MATMULS:
            what = f"{node.name} ({_opname(node)})" if isinstance(node, fx.Node) else repr(node)
            raise _Skip(f"the reduce-scatter input is produced by {what}, not a matmul")
        mm = node
        region = [mm, *reversed(chain)]
        for n in region:
            self._rows(n, world)
        rows = self._row_operand(mm)
        self._rows(rows, world)
        inside = set(region)
        for n in region:
            for user in n.users:
                if user not in inside and user is not start and self._reaches(user, start):
                    raise _Skip(f"intermediate {n.name} has another user {user.name} ({_opname(user)}) "
                                f"that feeds {start.name}")
        return _Plan("matmul_reduce_scatter", group, world, None, None, start, region, [rows], start)

    @staticmethod
    def _keeps_rows(node: fx.Node) -> bool:
        """A slice along another dim, or along dim 0 over all of it (DTensor emits
        ``slice(wait, 0, 0, n)`` after an all-gather): piece i in, piece i out."""
        if node.target is not aten.slice.Tensor:
            return False
        value = node_value(node.args[0])
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return False
        dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
        if dim % value.dim() != 0:
            return True
        return start in (None, 0) and step == 1 and (end is None or end >= value.shape[0])

    @staticmethod
    def _row_operand(mm: fx.Node):
        return mm.args[1] if mm.target is aten.addmm.default else mm.args[0]

    def _check_rowwise(self, node: fx.Node, inside: set, world: int) -> None:
        """Raise _Skip unless piece i of ``node`` is ``node`` of piece i of its inputs."""
        target = node.target
        why = f"{node.name} ({_opname(node)}) is not row-wise"
        if node.op != "call_function":
            raise _Skip(why)
        if role(node)[2] is not None:
            raise _Skip(f"barrier {node.name} ({role(node)[2]})")
        out = _val(node)
        self._rows(node, world)
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)] + \
            [a for a in node.kwargs.values() if isinstance(a, fx.Node)]
        if target is operator.getitem:
            if node.args[0] not in inside:
                raise _Skip(why)
            return
        if target in _ROW_REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else None
            rank = _val(node.args[0]).dim()
            if node.args[0] not in inside or len(tensor_args) != 1 or not dims or \
                    any(d % rank == 0 for d in dims):
                raise _Skip(f"{node.name} ({_opname(node)}) reduces over the rows")
            return
        if target in _VIEWS or target in _COPIES or self._keeps_rows(node):
            if node.args[0] not in inside or len(tensor_args) != 1:
                raise _Skip(why)
            return
        if target in _PERMUTES:
            dims = [0, 1] if target is aten.t.default else (
                list(node.args[1:3]) if target is aten.transpose.int else list(node.args[1]))
            dims = [d % out.dim() for d in dims] if out.dim() else dims
            if target is aten.permute.default and dims[0] != 0 or \
                    target is not aten.permute.default and 0 in dims and dims[0] != dims[-1]:
                raise _Skip(f"{node.name} ({_opname(node)}) moves dim 0")
            return
        if target in _MATMULS:
            rows = self._row_operand(node)
            others = [a for a in tensor_args if a is not rows]
            if rows not in inside or any(a in inside for a in others):
                raise _Skip(f"{node.name} ({_opname(node)}) does not read the rows as its first operand")
            if target is aten.addmm.default:
                bias = _val(node.args[0])
                if bias.dim() == 2 and bias.shape[0] != 1:
                    raise _Skip(f"{node.name}: bias {node.args[0].name} has rows")
            return
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            for a in tensor_args:
                v = _val(a)
                if a in inside and (v.dim() != out.dim() or v.shape[0] != out.shape[0]):
                    raise _Skip(f"{node.name} ({_opname(node)}) broadcasts {a.name} along rows")
                if a not in inside and v.dim() == out.dim() and v.shape[0] not in (1, out.shape[0]):
                    raise _Skip(why)
            return
        raise _Skip(why)

    def _check_no_feedback(self, region, wait, depends) -> None:
        inside = set(region) | {wait}
        for node in region:
            for a in node._input_nodes:
                if a not in inside and a in depends:
                    raise _Skip(f"intermediate has another user: {a.name} ({_opname(a)}) reads the "
                                f"pipelined rows and feeds {node.name} back")

    def _check_barriers(self, plan: _Plan) -> None:
        first = plan.source or plan.region[0]
        last = plan.sink or plan.anchor
        for node in self._between(first, last):
            reason = role(node)[2]
            if reason is not None:
                raise _Skip(f"barrier {node.name} ({_opname(node)}: {reason}) between "
                            f"{first.name} and {last.name}")

    def _after(self, node: fx.Node):
        node = node.next
        while node.op != "output":
            yield node
            node = node.next

    def _between(self, first: fx.Node, last: fx.Node) -> list[fx.Node]:
        out = []
        for node in self._after(first):
            if node is last:
                break
            out.append(node)
        return out

    def _reaches(self, node: fx.Node, target: fx.Node) -> bool:
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n is target:
                return True
            if n in seen:
                continue
            seen.add(n)
            stack.extend(n.users)
        return False

    # ---- rewriting

    def _new(self, target, args, kwargs=None, like: fx.Node | None = None, name: str | None = None) -> fx.Node:
        kwargs = kwargs or {}
        node = self.graph.create_node("call_function", target, tuple(args), kwargs, name=name)
        node.meta["val"] = self.fake.run(target, args, kwargs)
        if like is not None:
            for key in ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "original_aten",
                        "seq_nr"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        piece, stage = self._at
        self.keys[node] = (*self._prefix, piece + self._base + stage, self._base + stage, next(self.seq))
        self.created.append(node)
        return node

    def _piece(self, x: fx.Node, i: int, world: int, like) -> fx.Node:
        """Piece i of ``x`` (rows: ``world`` blocks, piece i of each), contiguous."""
        v = _val(x)
        rows, rest = v.shape[0], list(v.shape[1:])
        n = rows // world
        if world == 1:
            part = self._new(aten.slice.Tensor, (x, 0, i * n // self.k, (i + 1) * n // self.k), like=like)
            if not v.is_contiguous():
                part = self._new(aten.clone.default, (part,), {"memory_format": torch.contiguous_format}, like)
            return part
        if not v.is_contiguous():
            x = self._new(aten.clone.default, (x,), {"memory_format": torch.contiguous_format}, like)
        blocks = self._new(aten.view.default, (x, [world, self.k, n // self.k, *rest]), like=like)
        part = self._new(aten.select.int, (blocks, 1, i), like=like)
        part = self._new(aten.clone.default, (part,), {"memory_format": torch.contiguous_format}, like)
        return self._new(aten.view.default, (part, [world * n // self.k, *rest]), like=like)

    def _join(self, pieces: list[fx.Node], world: int, like: fx.Node) -> fx.Node:
        """Inverse of _piece: rows of ``world`` blocks, piece i of each from pieces[i]."""
        v = _val(pieces[0])
        rest = list(v.shape[1:])
        m = v.shape[0] // world
        if world == 1:
            return self._new(aten.cat.default, (pieces, 0), like=like)
        parts = [self._new(aten.view.default, (p, [world, m, *rest]), like=like) for p in pieces]
        whole = self._new(aten.cat.default, (parts, 1), like=like)
        return self._new(aten.view.default, (whole, [world * m * self.k, *rest]), like=like)

    def _copy_piece(self, node: fx.Node, env: dict, i: int, world: int, inside: set) -> fx.Node:
        out = _val(node)
        piece_shape = [out.shape[0] // self.k, *out.shape[1:]]
        slices: dict[fx.Node, fx.Node] = {}

        def arg(a):
            if not isinstance(a, fx.Node):
                return a
            if a in inside:
                return env[a]
            va = _val(a)
            if va.dim() == out.dim() and va.dim() > 0 and va.shape[0] == out.shape[0] and out.shape[0] > 1 \
                    and node.target not in _MATMULS:
                if a not in slices:
                    slices[a] = self._piece(a, i, world, node)
                return slices[a]
            return a

        args = tree_map(arg, node.args)
        kwargs = tree_map(arg, dict(node.kwargs))
        if node.target in _VIEWS:
            args = (args[0], piece_shape, *args[2:])
        return self._new(node.target, args, kwargs, like=node)

    def _rewrite(self, plan: _Plan) -> tuple[str, ...]:
        k, world, link = self.k, plan.world, plan.link
        if link is not None:   # counts on in the feeding pipeline's waves
            self._prefix, self._base = link.joined.prefix, link.joined.stage
        else:
            self._prefix, self._base = (self.keys[plan.anchor][0], -1), 0
        inside = set(plan.region)
        source_wait = self._one_wait(plan.source) if plan.source is not None else None
        if source_wait is not None:
            inside.add(source_wait)
        envs: list[dict] = [{} for _ in range(k)]
        new_starts: list[fx.Node] = []
        source_starts: list[fx.Node] = []
        sink_starts: list[fx.Node] = []
        sink_results: list[fx.Node] = []
        sink_wait = self._one_wait(plan.sink) if plan.sink is not None else None

        bridge_envs: list[dict] = [{} for _ in range(k)]

        def start_source(i):
            self._at = (i, 0)
            src = plan.source
            op = collective_op(src)
            if link is not None:   # the feeder's piece i through the row-wise bridge
                env = bridge_envs[i]
                env[link.join] = link.joined.pieces[i]
                for node in link.bridge:
                    env[node] = self._copy_piece(node, env, i, 1, set(link.bridge) | {link.join})
                shard = env[plan.source_input]
            elif op == "all_gather_into_tensor":
                shard = self._piece(plan.source_input, i, 1, src)
            else:
                shard = self._piece(plan.source_input, i, world, src)
            args = list(src.args)
            args[0] = shard
            if op == "all_to_all_single":
                args[1:3] = [[s[0] // k] * world for s in src.args[1:3]]
            started = self._new(src.target, args, dict(src.kwargs), like=src, name=f"{src.name}_chunk{i}")
            new_starts.append(started)
            source_starts.append(started)

        def compute(i):
            self._at = (i, 1)
            env = envs[i]
            if source_wait is not None:
                env[source_wait] = self._new(F.wait_tensor.default, (source_starts[i],), like=source_wait)
            for cut in plan.cut:
                env[cut] = self._piece(cut, i, world, plan.region[0])
            for node in plan.region:
                env[node] = self._copy_piece(node, env, i, world, inside | set(plan.cut))

        def start_sink(i):
            self._at = (i, 1)
            sink = plan.sink
            args = list(sink.args)
            args[0] = envs[i][sink.args[0]]
            if collective_op(sink) == "all_to_all_single":
                args[1:3] = [[s[0] // k] * world for s in sink.args[1:3]]
            started = self._new(sink.target, args, dict(sink.kwargs), like=sink, name=f"{sink.name}_chunk{i}")
            new_starts.append(started)
            sink_starts.append(started)

        def wait_sink(i):
            self._at = (i, 2)
            sink_results.append(self._new(F.wait_tensor.default, (sink_starts[i],), like=sink_wait))

        # emission order: the pipeline
        if plan.source is not None:
            start_source(0)
        for i in range(k):
            if plan.source is not None and i + 1 < k:
                start_source(i + 1)
            compute(i)
            if plan.sink is not None:
                start_sink(i)
                if i >= 1:
                    wait_sink(i - 1)
        if plan.sink is not None:
            wait_sink(k - 1)

        # reassemble what the rest of the graph reads
        replaced: dict[fx.Node, fx.Node] = {}
        if link is not None:
            self._at = (k - 1, 0)
            bridge = set(link.bridge)
            for node in link.bridge:
                if any(u not in bridge and u is not plan.source for u in node.users):
                    replaced[node] = self._join([bridge_envs[i][node] for i in range(k)], 1, node)
        self._at = (k - 1, 1)
        for node in [source_wait, *plan.region] if source_wait is not None else plan.region:
            outside = [u for u in node.users if u not in inside and u is not plan.sink]
            if outside:
                replaced[node] = self._join([envs[i][node] for i in range(k)], world, node)
        if plan.sink is not None:
            self._at = (k - 1, 2)
            sink_world = 1 if collective_op(plan.sink) == "reduce_scatter_tensor" else world
            joined = self._join(sink_results, sink_world, plan.sink)
            if tuple(_val(joined).shape) != tuple(_val(sink_wait).shape):
                joined = self._new(aten.view.default, (joined, list(_val(sink_wait).shape)), like=sink_wait)
            elif sink_world == 1:   # a later all-gather may read these pieces through row-wise compute
                self.joins.append((joined, _Joined(sink_results, self._prefix, self._base + 2, plan.sink.name)))
            replaced[sink_wait] = joined
        keep = set(inside)   # readers that go with the originals
        if link is not None:
            keep |= {plan.source, *link.bridge}
        for old, new in replaced.items():
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in keep and u is not plan.sink)
        # erase the originals (users first)
        dead = [*plan.region, *(link.bridge if link is not None else ())]
        if plan.sink is not None:
            dead += [plan.sink, self._one_wait(plan.sink)]
        if plan.source is not None:
            dead += [plan.source, source_wait]
        for node in sorted(dead, key=lambda n: self.keys[n], reverse=True):
            if not node.users:
                self.graph.erase_node(node)
                self.keys.pop(node, None)
            else:
                raise RuntimeError(f"overlapc chunk: {node.name} ({_opname(node)}) still has users "
                                   f"{[u.name for u in node.users]}")
        if link is not None and not link.join.users:   # every reader now takes the pieces
            self.graph.erase_node(link.join)
        for node in (plan.source, plan.sink):
            if node is not None:
                self.done.add(node)
        self.changed = True
        return tuple(n.name for n in new_starts)

    def finish(self) -> None:
        """Stable topological order by key: original order, new nodes before their
        anchor in wave order, and nodes that read a reassembled value after it. A
        graph node that a pipeline reads (a weight's transpose) takes its reader's
        key when that is smaller, so that it is placed before the pipeline needs it
        rather than when the pipeline stalls on it."""
        nodes = list(self.graph.nodes)
        key = {n: self.keys.get(n, (len(nodes), 0, 0, 0, 0)) for n in nodes}
        for node in reversed(_topological(nodes, key)):
            if key[node][1] == 0:
                key[node] = min([key[node], *(key[u] for u in node.users)])
        order = _topological(nodes, key)
        outputs = [n for n in order if n.op == "output"]
        order = [n for n in order if n.op == "placeholder"] + \
            [n for n in order if n.op not in ("placeholder", "output")] + outputs
        apply_order(self.gm, order)


def _topological(nodes: list[fx.Node], key: dict) -> list[fx.Node]:
    """``nodes`` in a topological order that, among the nodes ready, takes the least key."""
    indegree = {n: len(set(n._input_nodes)) for n in nodes}
    index = {n: i for i, n in enumerate(nodes)}
    ready = [(key[n], i, n) for i, n in enumerate(nodes) if indegree[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            indegree[user] -= 1
            if indegree[user] == 0:
                heapq.heappush(ready, (key[user], index[user], user))
    if len(order) != len(nodes):
        raise RuntimeError("overlapc chunk: the rewritten graph has a cycle")
    return order


def _opname(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}"
    return getattr(target, "__name__", str(target))

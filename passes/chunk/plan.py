"""Finding patterns and chaining them: a Plan per pipeline, nothing rewritten.

    planner = Planner(gm)
    plan = planner.plan(start, k)    # a Plan, None (not a pattern start) or Skip

A Plan names the source collective (all-gather / dispatch all-to-all) whose
result the row-wise region reads, the region in graph order, the sink
collective (reduce-scatter / combine all-to-all) that reads it, the row
operands to cut (matmul -> reduce-scatter) and, for an all-gather fed by an
earlier reduce-scatter pipeline through row-wise compute, the Link to it.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from overlapc.passes.collectives import barrier_reason_when_compute_moves, collective_op, group_of
from overlapc.passes.chunk import legality as L
from overlapc.passes.chunk.legality import Skip

aten = torch.ops.aten

PATTERNS = {"all_gather_into_tensor": "all_gather_matmul", "reduce_scatter_tensor": "matmul_reduce_scatter",
            "all_to_all_single": "all_to_all_expert"}


@dataclasses.dataclass
class Joined:
    """A reduce-scatter pipeline's result, reassembled by one cat of its pieces."""

    pieces: list[fx.Node]            # piece i: rows i*n/k ... of the shard
    prefix: tuple                    # the pipeline's key prefix: (its anchor's index, -1)
    stage: int                       # the pieces' stage (their waits')
    start: str                       # the original reduce-scatter's name
    chunks: int
    dim: int                         # the pieces' dim


@dataclasses.dataclass
class Link:
    """Row-wise compute (shard layout) from a Joined cat to an all-gather's input."""

    join: fx.Node
    joined: Joined
    bridge: list[fx.Node]            # graph order, ending at the all-gather's input
    layouts: dict[fx.Node, tuple[int, int]]   # (dim, blocks) of the join and each bridge node


@dataclasses.dataclass
class Plan:
    """One pipeline: an optional source collective, row-wise region, optional sink."""

    pattern: str
    group: str
    world: int
    chunks: int
    source: fx.Node | None           # start whose result the region reads (all-gather / dispatch)
    source_input: fx.Node | None     # what to cut for the source (shard / dispatch input)
    sink: fx.Node | None             # start that reads the region (reduce-scatter / combine)
    region: list[fx.Node]            # row-wise nodes, graph order
    cut: list[fx.Node]               # row operands cut into pieces (matmul -> reduce-scatter)
    anchor: fx.Node                  # new nodes go just before it
    layouts: dict[fx.Node, tuple[int, int]]   # (dim, blocks) of the source wait, cut and region nodes
    dim: int = 0                     # the dim its collectives' pieces are cut along (not theirs: 0)
    link: Link | None = None         # an earlier pipeline's pieces feed source_input
    stops: str = ""                  # an all-gather's pipeline without its reduce-scatter: why it stops

    @property
    def starts(self) -> tuple[fx.Node, ...]:
        return tuple(n for n in (self.source, self.sink) if n is not None)


class Planner:
    """Plans over ``gm``'s original nodes; ``joins`` lists the reassembled results of
    the reduce-scatter pipelines emitted so far (the emitter appends to it)."""

    def __init__(self, gm: fx.GraphModule):
        self.original = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.original)}
        self.joins: list[tuple[fx.Node, Joined]] = []

    def plan(self, start: fx.Node, k: int) -> Plan | None:
        """The pipeline that ``start`` begins with ``k`` pieces; None when ``start``
        begins none; Skip with the reason when it does not qualify."""
        op = collective_op(start)
        pattern = PATTERNS.get(op)
        if pattern is None:
            return None
        group = group_of(start)
        if pattern == "matmul_reduce_scatter":
            plan = self._plan_reduce_scatter(start, group, k)
        else:
            plan = self._plan_source(start, op, pattern, group, k)
        self._check_barriers(plan)
        return plan

    def _plan_source(self, start, op, pattern, group, k) -> Plan:
        world = L.group_size(start, op)
        wait = L.one_wait(start)
        if op == "all_to_all_single":
            L.equal_splits(start, world)
            L.rows(start.args[0], world, k)
            region, sink, layouts, why = self._region_to_sink(wait, op, group, world, k, 0)
            if sink is None:
                raise Skip(why or f"no all_to_all_single of group {group} reads {wait.name}'s rows")
            return Plan(pattern, group, world, k, start, start.args[0], sink, region, [], sink, layouts)
        shard = L.val(start.args[0])
        # pieces of the gathered rows (dim 0), else of a sequence-first activation's batch
        # (dim 1), which flow through attention; a plan fed by an earlier pipeline first,
        # then one whose dim the next all-gather can cut too
        dims = [d for d in (0, 1) if shard.dim() > (0 if d == 0 else 2) and shard.shape[d] % k == 0]
        plans, whys = [], []
        for dim in dims:
            region, sink, layouts, why = self._region_to_sink(wait, "reduce_scatter_tensor", group, world, k, dim)
            if why:
                whys.append(f"cut along dim {dim}, {why}" if len(dims) > 1 else why)
            if sink is not None:
                plans.append(Plan(pattern, group, world, k, start, start.args[0], sink, region, [], sink, layouts,
                                  dim, self._link(start, k, dim)))
        if not plans:
            if 0 not in dims:
                raise Skip(f"dim 0 of the shard {start.args[0].name} ({tuple(shard.shape)}) "
                           f"does not divide by chunks {k}")
            L.rows(wait, world, k)
            region, layouts = self._matmul_consumers(wait, world, k)
            plans.append(Plan(pattern, group, world, k, start, start.args[0], None, region, [], region[-1], layouts,
                              0, self._link(start, k, 0), "; ".join(whys)))
        if len(plans) > 1 and all(p.link is None for p in plans):   # cut what the next gather can cut
            later = self._next_dims(plans[0].sink, group, world, k)
            plans.sort(key=lambda p: p.dim not in later)
        return min(plans, key=lambda p: p.link is None)

    def _next_dims(self, after: fx.Node, group: str, world: int, k: int) -> set[int]:
        """The dims along which the next all-gather of ``group`` after ``after`` could
        pipeline to a reduce-scatter: the dim this pipeline's pieces should take for
        the two to chain (in a backward, the MLP's then the attention's)."""
        for node in _after(after):
            if collective_op(node) == "all_gather_into_tensor" and group_of(node) == group:
                try:
                    wait = L.one_wait(node)
                except Skip:
                    return set()
                return {d for d in (0, 1)
                        if self._region_to_sink(wait, "reduce_scatter_tensor", group, world, k, d)[1] is not None}
        return set()

    def _link(self, start: fx.Node, k: int, dim: int) -> Link | None:
        """The row-wise compute by which an earlier reduce-scatter pipeline's result
        (a Joined cat) reaches the all-gather ``start``'s input, or None. Every node
        on the way must be row-wise on the shard's rows, no barrier may lie between
        that pipeline and ``start``, and both must cut the same dim into as many pieces."""
        shard = start.args[0]
        end = self.index[start]
        for join, joined in self.joins:
            if join._erased or joined.chunks != k or joined.dim != dim:
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
                if L.is_multi(node):
                    bridge += [u for u in node.users if u.target is operator.getitem and u not in needed]
            bridge.sort(key=self.index.__getitem__)
            try:
                inside = set(bridge) | {join}
                layouts = {join: (dim, 1)}
                for node in bridge:
                    layouts[node] = L.check_rowwise(node, layouts, k)
                    if L.is_multi(node) and any(u not in inside for u in node.users):
                        raise Skip(f"{node.name} ({L.opname(node)}) has a reader outside the chain")
                if layouts[shard] != (dim, 1):
                    raise Skip(f"{shard.name} is not in one block")
                L.check_no_feedback(bridge, join, reach)
                for node in self.original[joined.prefix[0] + 1:end]:
                    if barrier_reason_when_compute_moves(node) is not None:
                        raise Skip(f"barrier {node.name}")
            except Skip:
                return None
            return Link(join, joined, bridge, layouts)
        return None

    def _region_to_sink(self, wait, sink_op, group, world, k, dim):
        """(row-wise nodes from ``wait`` to the first ``sink_op`` of ``group`` that
        reads them (and the other outputs of a node with several), the sink start,
        their layouts, None) or ([], None, {}, why-not); pieces cut along ``dim`` of
        the collectives' tensors."""
        sink, depends = first_sink(wait, sink_op, group)
        if sink is None:
            return [], None, {}, None
        on_path = {sink.args[0]}   # nodes on a path wait -> sink input
        for node in reversed(between(wait, sink)):
            if node in on_path:
                on_path.update(i for i in node._input_nodes if i in depends)
                if L.is_multi(node):   # attention's log-sum-exp: computed with the output, saved
                    on_path.update(u for u in node.users if u.target is operator.getitem)
        on_path.discard(wait)
        region = [n for n in between(wait, sink) if n in on_path]
        layout = (0, world) if dim == 0 else (dim, 1)
        layouts = {wait: layout}
        try:
            if sink_op == "all_to_all_single":
                L.equal_splits(sink, world)
            L.one_wait(sink)
            L.rows(wait, layout[1], k, dim)
            for node in region:
                layouts[node] = L.check_rowwise(node, layouts, k)
            if layouts[sink.args[0]] != layout:
                raise Skip(f"{sink.args[0].name} has its pieces as {layouts[sink.args[0]]} (dim, blocks), "
                           f"{sink.name} needs {layout}")
            L.check_no_feedback(region, wait, depends)
        except Skip as skip:
            return [], None, {}, f"compute between {wait.name} and {sink.name} is not pipelined: {skip}"
        return region, sink, layouts, None

    def _matmul_consumers(self, wait: fx.Node, world: int, k: int) -> tuple[list[fx.Node], dict]:
        """The matmuls that read the gathered rows as their first operand (through
        views that keep the rows and DTensor's regather), with those views, in graph
        order; and their layouts."""
        views = {wait: (0, world)}
        matmuls: list[fx.Node] = []
        first_other = None
        for node in _after(wait):
            if not any(i in views for i in node._input_nodes):
                continue
            try:
                if L.is_layout(node):
                    views[node] = L.check_rowwise(node, views, k)
                    continue
                if node.target in L.MATMULS:
                    views[node] = L.check_rowwise(node, views, k)
                    matmuls.append(node)
                    continue
            except Skip:
                pass
            first_other = first_other or node
        if not matmuls:
            other = f" (first consumer: {first_other.name}, {L.opname(first_other)})" if first_other else ""
            raise Skip(f"no matmul reads the rows of {wait.name}{other}")
        needed = set(matmuls)
        for node in reversed(between(wait, matmuls[-1])):
            if node in views and any(u in needed for u in node.users):
                needed.add(node)
        region = [n for n in between(wait, matmuls[-1]) if n in needed] + [matmuls[-1]]
        return region, {n: views[n] for n in [wait, *region]}

    def _plan_reduce_scatter(self, start: fx.Node, group: str, k: int) -> Plan:
        """matmul -> views (and DTensor's split + cat) -> reduce-scatter."""
        world = L.group_size(start, "reduce_scatter_tensor")
        L.one_wait(start)
        tail = {}
        node = start.args[0]
        while isinstance(node, fx.Node) and L.is_layout(node):
            tail[node] = None
            inputs = list(node._input_nodes)
            if node.target is aten.cat.default:   # getitems of one split
                if len({i.args[0] for i in inputs if i.target is operator.getitem}) != 1 or \
                        any(i.target is not operator.getitem for i in inputs):
                    break
                tail.update(dict.fromkeys(inputs))
                inputs = [inputs[0].args[0]]
            if len(inputs) != 1:
                break
            node = inputs[0]
        if not isinstance(node, fx.Node) or node.target not in L.MATMULS:
            what = f"{node.name} ({L.opname(node)})" if isinstance(node, fx.Node) else repr(node)
            raise Skip(f"the reduce-scatter input is produced by {what}, not a matmul")
        mm = node
        region = [mm, *sorted(tail, key=self.index.__getitem__)]
        first = L.row_operand(mm)
        why = None
        for b in (world, 1):   # the matmul's rows: rank blocks as they are scattered, or one block
            try:
                layouts = {first: (0, b)}
                L.rows(first, b, k)
                for n in region:
                    layouts[n] = L.check_rowwise(n, layouts, k)
                if layouts[start.args[0]] == (0, world):
                    break
                why = f"{start.args[0].name} holds {layouts[start.args[0]]} (dim, rank blocks), " \
                      f"{start.name} scatters {world} along dim 0"
            except Skip as skip:
                why = str(skip)
        else:
            raise Skip(why)
        inside = set(region)
        for n in region:
            for user in n.users:
                if user not in inside and user is not start and _reaches(user, start):
                    raise Skip(f"intermediate {n.name} has another user {user.name} ({L.opname(user)}) "
                               f"that feeds {start.name}")
        return Plan("matmul_reduce_scatter", group, world, k, None, None, start, region, [first], start, layouts)

    @staticmethod
    def _check_barriers(plan: Plan) -> None:
        first = plan.source or plan.region[0]
        last = plan.sink or plan.anchor
        for node in between(first, last):
            reason = barrier_reason_when_compute_moves(node)
            if reason is not None:
                raise Skip(f"barrier {node.name} ({L.opname(node)}: {reason}) between "
                           f"{first.name} and {last.name}")


def first_sink(wait: fx.Node, op: str, group: str) -> tuple[fx.Node | None, set[fx.Node]]:
    """(the first ``op`` start of ``group`` after ``wait`` whose input depends on it, or
    None; the nodes up to it that depend on ``wait``, ``wait`` included)."""
    depends = {wait}
    for node in _after(wait):
        if any(i in depends for i in node._input_nodes):
            depends.add(node)
            if collective_op(node) == op and group_of(node) == group and node.args[0] in depends:
                return node, depends
    return None, depends


def _after(node: fx.Node):
    node = node.next
    while node.op != "output":
        yield node
        node = node.next


def between(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    out = []
    for node in _after(first):
        if node is last:
            break
        out.append(node)
    return out


def _reaches(node: fx.Node, target: fx.Node) -> bool:
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

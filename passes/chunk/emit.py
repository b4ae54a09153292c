"""Emitting a Plan's pieces and ordering the graph.

    emitter = Emitter(gm, planner)
    pieces = emitter.emit(plan)      # new start names; the originals erased
    emitter.finish()                 # one stable topological order for the graph

Each Plan is emitted by a ``_Pipeline``, a method a step (a piece's source start,
compute, sink start and wait; reassembly, rewiring, erasing the originals); the
Emitter keeps what spans pipelines: the order keys and the wave a new node is in.

Order: in waves. A pipeline's stages are its source start (0), its compute and
sink start (1) and its sink wait (2), a fed pipeline's counting on from its
feeder's; wave w holds stage s of piece w - s, stages in order. Nodes that read
a reassembled value move after it, and those the next pipeline's first start
does not need (weight gradients) after that pipeline's last pieces are computed
and issued, while they are in flight (``_defer_off_path``); a node outside the
pipelines that one reads moves to just before its first reader.
"""
from __future__ import annotations

import heapq
import itertools

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from overlapc.passes.collectives import collective_op
from overlapc.passes.chunk import legality as L
from overlapc.passes.chunk.plan import Joined, Plan, Planner
from overlapc.passes.meta import set_piece_of
from overlapc.passes.rewrite import FakeValues, new_node
from overlapc.passes.structure import apply_order

aten = torch.ops.aten
F = torch.ops._c10d_functional


class Emitter:
    def __init__(self, gm: fx.GraphModule, planner: Planner):
        self.gm, self.graph, self.planner = gm, gm.graph, planner
        self.fake = FakeValues(gm)
        # finish() orders by key: (original index, 0, ...) for the graph's nodes; a
        # pipeline's nodes (its anchor's index, -1, wave, stage, seq), where piece i's
        # nodes of stage s run in wave i + s.
        self.keys: dict[fx.Node, tuple] = {n: (i, 0, 0, 0, 0) for i, n in enumerate(planner.original)}
        self.seq = itertools.count()
        self.created: list[fx.Node] = []   # nodes of the pipeline being built
        self.changed = False
        self.k = 1
        self._prefix, self._base, self._at = (0, -1), 0, (0, 0)

    def discard(self) -> None:
        """Erase the nodes of a half-built pipeline (emit raised Skip)."""
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created = []

    def _new(self, target, args, kwargs=None, like: fx.Node | None = None, name: str | None = None) -> fx.Node:
        node = new_node(self.graph, self.fake, target, args, kwargs, like=like, name=name)
        piece, stage = self._at
        self.keys[node] = (*self._prefix, piece + self._base + stage, self._base + stage, next(self.seq))
        self.created.append(node)
        return node

    def _piece(self, x: fx.Node, i: int, layout: tuple[int, int], like) -> fx.Node:
        """Piece i of ``x`` in ``layout`` (dim, blocks): piece i of each block, contiguous."""
        dim, blocks = layout
        v = L.val(x)
        shape = list(v.shape)
        n = shape[dim] // blocks
        if blocks == 1:
            part = self._new(aten.slice.Tensor, (x, dim, i * n // self.k, (i + 1) * n // self.k), like=like)
            if not (v.is_contiguous() and all(d == 1 for d in shape[:dim])):
                part = self._new(aten.clone.default, (part,), {"memory_format": torch.contiguous_format}, like)
            return part
        if not v.is_contiguous():
            x = self._new(aten.clone.default, (x,), {"memory_format": torch.contiguous_format}, like)
        split = [*shape[:dim], blocks, self.k, n // self.k, *shape[dim + 1:]]
        part = self._new(aten.select.int, (self._new(aten.view.default, (x, split), like=like), dim + 1, i), like=like)
        part = self._new(aten.clone.default, (part,), {"memory_format": torch.contiguous_format}, like)
        return self._new(aten.view.default, (part, [*shape[:dim], blocks * n // self.k, *shape[dim + 1:]]),
                         like=like)

    def _join(self, pieces: list[fx.Node], layout: tuple[int, int], like: fx.Node) -> fx.Node:
        """Inverse of _piece: the whole tensor from its k pieces."""
        dim, blocks = layout
        shape = list(L.val(pieces[0]).shape)
        if blocks == 1:
            return self._new(aten.cat.default, (pieces, dim), like=like)
        m = shape[dim] // blocks
        parts = [self._new(aten.view.default, (p, [*shape[:dim], blocks, m, *shape[dim + 1:]]), like=like)
                 for p in pieces]
        whole = self._new(aten.cat.default, (parts, dim + 1), like=like)
        return self._new(aten.view.default, (whole, [*shape[:dim], blocks * m * self.k, *shape[dim + 1:]]),
                         like=like)

    def _copy_piece(self, node: fx.Node, env: dict, i: int, layout: tuple[int, int], inside: set) -> fx.Node:
        """``node`` on piece i of its inputs (``layout``: its own)."""
        out = L.val(node)
        slices: dict[fx.Node, fx.Node] = {}

        def arg(a):
            if not isinstance(a, fx.Node):
                return a
            if a in inside:
                return env[a]
            dim = L.cut_dim(node, a, layout)
            if dim is not None:
                if a not in slices:
                    slices[a] = self._piece(a, i, (dim, layout[1]), node)
                return slices[a]
            return a

        args = tree_map(arg, node.args)
        kwargs = tree_map(arg, dict(node.kwargs))
        dim = layout[0]
        if node.target in L.VIEWS or node.target is aten.expand.default:   # sizes: a piece's
            args = (args[0], [d // self.k if q == dim else d for q, d in enumerate(out.shape)], *args[2:])
        if node.target is aten.split.Tensor and (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % out.dim() == dim:
            args = (args[0], args[1] // self.k, *args[2:])   # a rank block's piece
        return self._new(node.target, args, kwargs, like=node)

    def emit(self, plan: Plan) -> tuple[str, ...]:
        """Rewrite ``plan`` into its pieces; returns the new collective starts' names."""
        self.created = []
        self.k = plan.chunks
        if plan.link is not None:   # counts on in the feeding pipeline's waves
            self._prefix, self._base = plan.link.joined.prefix, plan.link.joined.stage
        else:
            self._prefix, self._base = (self.keys[plan.anchor][0], -1), 0
        names = _Pipeline(self, plan).emit()
        self.created = []
        self.changed = True
        return names

    def finish(self) -> None:
        """Stable topological order by key: original order, new nodes before their
        anchor in wave order, and nodes that read a reassembled value after it (off
        the next pipeline's path: after its last fed starts, ``_defer_off_path``). A
        graph node that a pipeline reads (a weight's transpose) takes its reader's
        key when that is smaller, so that it is placed before the pipeline needs it
        rather than when the pipeline stalls on it."""
        nodes = list(self.graph.nodes)
        key = {n: self.keys.get(n, (len(nodes), 0, 0, 0, 0)) for n in nodes}
        pipeline = {n: key[n][:2] for n in nodes if key[n][1] == -1}
        for node in reversed(_topological(nodes, key)):
            if key[node][1] == 0:
                key[node] = min([key[node], *(key[u] for u in node.users)])
        _defer_off_path(nodes, key, pipeline)
        order = _topological(nodes, key)
        outputs = [n for n in order if n.op == "output"]
        order = [n for n in order if n.op == "placeholder"] + \
            [n for n in order if n.op not in ("placeholder", "output")] + outputs
        apply_order(self.gm, order)


class _Pipeline:
    """One Plan being emitted through an Emitter, a step a method: its pieces in wave
    order (``emit``: ``start_source``, ``compute``, ``start_sink``, ``wait_sink``), the
    whole values the rest of the graph reads (``reassemble``), its readers moved onto
    those (``rewire``) and the original nodes erased (``erase``)."""

    def __init__(self, emitter: Emitter, plan: Plan):
        self.emitter, self.plan, self.link = emitter, plan, plan.link
        self.k, self.world = plan.chunks, plan.world
        self.inside = set(plan.region)
        self.source_wait = L.one_wait(plan.source) if plan.source is not None else None
        if self.source_wait is not None:
            self.inside.add(self.source_wait)
        self.envs: list[dict] = [{} for _ in range(self.k)]          # piece i of each region node
        self.bridge_envs: list[dict] = [{} for _ in range(self.k)]   # piece i of each bridge node
        self.new_starts: list[fx.Node] = []
        self.source_starts: list[fx.Node] = []
        self.sink_starts: list[fx.Node] = []
        self.sink_results: list[fx.Node] = []
        self.sink_wait = L.one_wait(plan.sink) if plan.sink is not None else None

    def emit(self) -> tuple[str, ...]:
        """The pipeline: piece i+1's source start before piece i's compute, piece i's
        sink start after it and piece i-1's sink wait after that."""
        plan, k = self.plan, self.k
        if plan.source is not None:
            self.start_source(0)
        for i in range(k):
            if plan.source is not None and i + 1 < k:
                self.start_source(i + 1)
            self.compute(i)
            if plan.sink is not None:
                self.start_sink(i)
                if i >= 1:
                    self.wait_sink(i - 1)
        if plan.sink is not None:
            self.wait_sink(k - 1)
        self.rewire(self.reassemble())
        self.erase()
        return tuple(n.name for n in self.new_starts)

    def _start(self, original: fx.Node, shard: fx.Node, i: int) -> fx.Node:
        """Piece i of the collective ``original``, on ``shard``."""
        args = list(original.args)
        args[0] = shard
        if collective_op(original) == "all_to_all_single":
            args[1:3] = [[s[0] // self.k] * self.world for s in original.args[1:3]]
        started = self.emitter._new(original.target, args, dict(original.kwargs), like=original,
                                    name=f"{original.name}_chunk{i}")
        set_piece_of(started, original.name)
        self.new_starts.append(started)
        return started

    def start_source(self, i: int) -> None:
        self.emitter._at = (i, 0)
        plan, link, e = self.plan, self.link, self.emitter
        if link is not None:   # the feeder's piece i through the row-wise bridge
            env = self.bridge_envs[i]
            env[link.join] = link.joined.pieces[i]
            for node in link.bridge:
                env[node] = e._copy_piece(node, env, i, link.layouts[node], set(link.bridge) | {link.join})
            shard = env[plan.source_input]
        elif collective_op(plan.source) == "all_gather_into_tensor":
            shard = e._piece(plan.source_input, i, (plan.dim, 1), plan.source)
        else:
            shard = e._piece(plan.source_input, i, (0, self.world), plan.source)
        self.source_starts.append(self._start(plan.source, shard, i))

    def compute(self, i: int) -> None:
        self.emitter._at = (i, 1)
        plan, env, e = self.plan, self.envs[i], self.emitter
        if self.source_wait is not None:
            env[self.source_wait] = e._new(F.wait_tensor.default, (self.source_starts[i],), like=self.source_wait)
        for cut in plan.cut:
            env[cut] = e._piece(cut, i, plan.layouts[cut], plan.region[0])
        for node in plan.region:
            env[node] = e._copy_piece(node, env, i, plan.layouts[node], self.inside | set(plan.cut))

    def start_sink(self, i: int) -> None:
        self.emitter._at = (i, 1)
        self.sink_starts.append(self._start(self.plan.sink, self.envs[i][self.plan.sink.args[0]], i))

    def wait_sink(self, i: int) -> None:
        self.emitter._at = (i, 2)
        self.sink_results.append(self.emitter._new(F.wait_tensor.default, (self.sink_starts[i],),
                                                   like=self.sink_wait))

    def reassemble(self) -> dict[fx.Node, fx.Node]:
        """original -> its whole value joined from the pieces, for each one read outside
        the pipeline."""
        plan, link, k, e = self.plan, self.link, self.k, self.emitter
        replaced: dict[fx.Node, fx.Node] = {}
        if link is not None:
            e._at = (k - 1, 0)
            bridge = set(link.bridge)
            for node in link.bridge:
                if any(u not in bridge and u is not plan.source for u in node.users):
                    replaced[node] = e._join([self.bridge_envs[i][node] for i in range(k)], link.layouts[node], node)
        e._at = (k - 1, 1)
        for node in [self.source_wait, *plan.region] if self.source_wait is not None else plan.region:
            outside = [u for u in node.users if u not in self.inside and u is not plan.sink]
            if outside:
                replaced[node] = e._join([self.envs[i][node] for i in range(k)], plan.layouts[node], node)
        if plan.sink is not None:
            e._at = (k - 1, 2)
            replaced[self.sink_wait] = self._join_sink()
        return replaced

    def _join_sink(self) -> fx.Node:
        """The sink's whole result; a reduce-scatter's pieces are offered to a later
        all-gather that reads them through row-wise compute (``Planner.joins``)."""
        plan, e, sink_wait = self.plan, self.emitter, self.sink_wait
        scattered = collective_op(plan.sink) == "reduce_scatter_tensor"
        layout = (plan.dim, 1) if scattered else (0, self.world)
        joined = e._join(self.sink_results, layout, plan.sink)
        if tuple(L.val(joined).shape) != tuple(L.val(sink_wait).shape):
            joined = e._new(aten.view.default, (joined, list(L.val(sink_wait).shape)), like=sink_wait)
        elif scattered:
            e.planner.joins.append(
                (joined, Joined(self.sink_results, e._prefix, e._base + 2, plan.sink.name, self.k, plan.dim)))
        return joined

    def rewire(self, replaced: dict[fx.Node, fx.Node]) -> None:
        """Readers outside the pipeline take the reassembled values."""
        plan = self.plan
        keep = set(self.inside)   # readers that go with the originals
        if self.link is not None:
            keep |= {plan.source, *self.link.bridge}
        for old, new in replaced.items():
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in keep and u is not plan.sink)

    def erase(self) -> None:
        """Erase the originals, users first."""
        plan, link, e = self.plan, self.link, self.emitter
        dead = [*plan.region, *(link.bridge if link is not None else ())]
        if plan.sink is not None:
            dead += [plan.sink, self.sink_wait]
        if plan.source is not None:
            dead += [plan.source, self.source_wait]
        for node in sorted(dead, key=lambda n: e.keys[n], reverse=True):
            if node.users:
                raise RuntimeError(f"overlapc chunk: {node.name} ({L.opname(node)}) still has users "
                                   f"{[u.name for u in node.users]}")
            e.graph.erase_node(node)
            e.keys.pop(node, None)
        if link is not None and not link.join.users:   # every reader now takes the pieces
            e.graph.erase_node(link.join)


def _defer_off_path(nodes: list[fx.Node], key: dict, pipeline: dict) -> None:
    """Give each graph node that reads a pipeline's result (a weight gradient of a
    reassembled activation gradient) a key just after a fed start of the next
    pipeline, when that pipeline's first start does not depend on it. Fed starts are
    those the pipeline's own compute feeds (reduce-scatter or combine pieces, a fed
    pipeline's gathers; all its starts when they share one stage); the nodes are
    spread over them from the back: the last (graph order) after the last fed start,
    the one before after the fed start before, the rest after the first. The next
    pipeline's pieces are then computed and their collectives issued first, and this
    work runs while those are in flight, instead of holding the pieces back while the
    link idles. ``pipeline``: the pipelines' nodes and their key prefix (anchor index,
    -1), one per pipeline (a fed one shares its feeder's)."""
    starts: dict[tuple, list[fx.Node]] = {}
    for node, prefix in pipeline.items():
        group = starts.setdefault(prefix, [])
        if collective_op(node) is not None:
            group.append(node)
    prefixes = sorted(p for p, group in starts.items() if group)
    if len(prefixes) < 2:
        return
    for p in prefixes:
        starts[p].sort(key=key.__getitem__)
    ancestors: dict[tuple, set] = {}
    deferred: dict[tuple, list[fx.Node]] = {}   # pipeline -> nodes deferred to it, graph order
    for node in nodes:
        if node in pipeline:
            continue
        read = [pipeline[i] for i in node._input_nodes if i in pipeline]
        if not read:
            continue
        later = [p for p in prefixes if p > max(read)]
        if not later:
            continue
        q = later[0]
        if q not in ancestors:
            ancestors[q] = _ancestors(starts[q][0])
        if node in ancestors[q]:
            continue
        deferred.setdefault(q, []).append(node)
    for q, waiting in deferred.items():
        first_stage = min(key[s][3] for s in starts[q])
        fed = [s for s in starts[q] if key[s][3] > first_stage] or starts[q]
        for j, node in enumerate(reversed(waiting)):
            mark = fed[max(len(fed) - 1 - j, 0)]
            key[node] = max(key[node], (*key[mark][:-1], key[mark][-1] + 0.5))


def _ancestors(node: fx.Node) -> set:
    seen, stack = set(), [node]
    while stack:
        for i in stack.pop()._input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


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

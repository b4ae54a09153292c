"""Live bytes along an order of a graph's nodes (the memory tracker).

The model is what Inductor's generated code allocates (``tests/wrapper_replay.py``
replays that code and ``tests/test_wrapper_replay.py`` holds the two within 3%):

- A node allocates one storage when it runs, of the bytes its output's sizes and
  strides span (``meta["val"]``; a tuple or list: the sum of its tensors; symbolic
  sizes count their hint, no guard is added; unknown, data-dependent sizes 0).
- Aliases allocate nothing: views, getitem, and waits (a wait returns its
  collective's buffer, allocated at the start).
- Fused away, nothing allocated: a functional pointwise op (tagged pointwise, casts,
  ``full``, and the gathers Inductor lowers as pointwise loops: index, embedding,
  gather, index_select, constant_pad_nd) whose every reader reads from inside a fused
  loop (pointwise, reductions, scatters, cat, or a view whose readers all do) is
  computed inside its readers' kernels; its readers read what it reads instead. With
  several readers only when it reads at most 4 storages (Inductor realizes a reused
  node that reads more).
- In place, nothing allocated: a pointwise op that is not fused away writes into an
  input's storage when that input is a compute node's own buffer (not a graph input,
  an alias or a collective), read by this op alone, of the same dtype and 95-100% of
  the output's bytes (Inductor's ``buf7 = buf6; del buf6  # reuse``).
- A storage is freed after the last node that reads it or any alias of it; graph
  outputs live to the end; a collective's inputs are held until its last wait (the
  c10d work keeps them). Graph inputs are live from the top until their last use
  (the wrapper deletes them there), an input nothing reads until the end. (overlapc
  compiles with Inductor's buffer pool off, ``torch_compat.inductor_patches``: with
  it on, the wrapper keeps a dead buffer allocated until a later output of its
  dtype and bytes takes it, which this model does not count.)

Every decision above reads the graph, never the order: one ``Liveness`` serves any
order. Deterministic, O(nodes + edges). ``EditedPeak`` keeps the peak of one order
while a pass drops nodes and re-points readers (keep-or-regather's trials),
recounting only what each edit touches.
"""
from __future__ import annotations

import heapq
import math
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.fx as fx

from overlapc.passes.collectives import is_alias, node_value, role, size_hint, tensor_nbytes, wait_nodes
from overlapc.passes.structure import Structure


class Liveness:
    """What liveness needs of a graph's nodes, independent of their order; then
    ``live_bytes(order)`` / ``peak_bytes(order)`` for any topological order of them."""

    def __init__(self, nodes: list[fx.Node]):
        """``nodes``: every node of one graph, each after its inputs (graph order)."""
        self.root: dict[fx.Node, fx.Node] = {}
        self.size: dict[fx.Node, int] = {}
        self.reads: dict[fx.Node, list[fx.Node]] = {}       # node -> storages it reads
        self.held_until: dict[fx.Node, tuple] = {}          # start -> its waits
        self.unread: list[fx.Node] = []                     # inputs nothing reads: live to the end
        self.inlined: dict[fx.Node, list[fx.Node]] = {}     # fused-away node -> storages it reads
        self._fusable: dict[fx.Node, bool] = {}
        self._extents: dict[tuple, int] = {}                # (sizes, strides, dtype) -> bytes
        for node in nodes:
            self._add(node)

    def fork(self) -> Liveness:
        """A copy of these decisions that ``EditedPeak`` may edit, leaving this one as it is
        (what ``Liveness`` of the same nodes builds, without deciding every node again)."""
        twin = object.__new__(Liveness)
        twin.root, twin.size, twin.reads = dict(self.root), dict(self.size), dict(self.reads)
        twin.held_until, twin.unread, twin.inlined = dict(self.held_until), list(self.unread), dict(self.inlined)
        twin._fusable, twin._extents = dict(self._fusable), self._extents   # extents: by shape alone
        return twin

    def _add(self, node: fx.Node) -> None:
        """Decide where ``node``'s output lives (its root storage, the bytes it allocates)
        and which storages it reads, from its inputs' decisions (made before)."""
        root, inlined = self.root, self.inlined
        inputs = node._input_nodes
        read = [root[i] for i in inputs]
        if inlined and not inlined.keys().isdisjoint(read):
            read = _expand(read, inlined)
        self.reads[node] = read
        entry = _FACTS_BY_TARGET.get(id(node.target)) if node.op == "call_function" else None
        facts = entry[1] if entry is not None and entry[0] is node.target else _facts(node)
        if facts.starts:
            waits = wait_nodes(node)
            if waits:
                self.held_until[node] = waits
        if inputs and (facts.waits or facts.aliases):
            root[node] = root[next(iter(inputs))]
            return
        if facts.pointwise and node.users:
            if _fuses_away(node, self._fusable, read):
                root[node], inlined[node] = node, read
                self.size[node] = 0
                return
            reused = _reused_input(node, self.size, self._extents)
            if reused is not None:
                root[node] = reused   # Inductor writes the output into that input's buffer
                return
        root[node] = node
        if node.op == "output":
            self.size[node] = 0
            return
        self.size[node] = _nbytes(node, self._extents)
        if node.op == "placeholder" and not node.users:
            self.unread.append(node)

    def live_bytes(self, order: list[fx.Node], pos: dict[fx.Node, int] | None = None) -> list[int]:
        """Bytes live while each node of ``order`` runs (its output allocated, its
        inputs not yet freed). ``pos``: node -> position in ``order``, when the caller has it."""
        return self.along(order, pos)[0]

    def along(self, order: list[fx.Node], pos: dict[fx.Node, int] | None = None) \
            -> tuple[list[int], dict[fx.Node, int], dict[fx.Node, int]]:
        """(``live_bytes(order)``, node -> position in ``order``, ``_last_use`` of ``order``)."""
        if pos is None:
            pos = dict(zip(order, range(len(order))))
        last = self._last_use(order, pos)
        change = [0] * (len(order) + 1)
        for r, nbytes in self.size.items():
            if nbytes:
                change[pos[r]] += nbytes
                change[last[r] + 1] -= nbytes
        return list(accumulate(change[:-1])), pos, last

    def _last_use(self, order: list[fx.Node], pos: dict[fx.Node, int]) -> dict[fx.Node, int]:
        """Storage -> the position in ``order`` after which it is freed."""
        last = {root: pos[root] for root in self.size}
        reads = self.reads
        for until, node in enumerate(order):   # positions rise: the last reader writes last
            for r in reads[node]:
                last[r] = until
        for start, waits in self.held_until.items():   # a collective's inputs: until its last wait
            if start not in pos:
                continue
            until = pos[waits[0]] if len(waits) == 1 else max(pos[w] for w in waits)
            for r in reads[start]:
                if last[r] < until:
                    last[r] = until
        for r in self.unread:
            last[r] = len(order) - 1
        return last

    def live_at(self, order: list[fx.Node], index: int) -> list[tuple[fx.Node, int]]:
        """The storages live while ``order[index]`` runs, as (node that allocated
        it, bytes), largest first (ties in order)."""
        pos = {node: i for i, node in enumerate(order)}
        last = self._last_use(order, pos)
        live = [(r, n) for r, n in self.size.items() if n and pos[r] <= index <= last[r]]
        return sorted(live, key=lambda item: (-item[1], pos[item[0]]))

    def peak_bytes(self, order: list[fx.Node]) -> int:
        """Most bytes live at any point of ``order`` (0 for an empty order)."""
        return max(self.live_bytes(order), default=0)


def _expand(roots: list[fx.Node], inlined: dict[fx.Node, list[fx.Node]]) -> list[fx.Node]:
    """``roots`` with each fused-away node replaced by the storages it reads (no repeats)."""
    if inlined.keys().isdisjoint(roots):
        return roots
    out: dict[fx.Node, None] = {}
    for r in roots:
        out.update(dict.fromkeys(inlined.get(r, (r,))))
    return list(out)


# Inductor inlines a pointwise op into the kernels of its consumers when they are pointwise or
# reductions too (its lowering keeps it unrealized; the scheduler fuses the rest): no buffer.
_EXTRA_POINTWISE = {"aten._to_copy.default", "aten.full.default", "aten.scalar_tensor.default",
                    # gathers Inductor lowers as pointwise loops (indirect loads)
                    "aten.index.Tensor", "aten.embedding.default", "aten.gather.default",
                    "aten.index_select.default", "aten.constant_pad_nd.default"}
# ops that read their (non-index) inputs from inside their own loop (scatters load the
# values and the base they copy; cat writes each input into its slice of the output)
_FUSED_READERS = {"aten.index_put.default", "aten.scatter.src", "aten.scatter.value",
                  "aten.scatter_add.default", "aten.slice_scatter.default",
                  "aten.select_scatter.default", "aten.cat.default"}
_MAX_REUSE_READS = 4   # torch._inductor.config.realize_reads_threshold


class _OpFacts(NamedTuple):
    """What the memory model reads of a node's call target (the same for every node
    that calls it)."""

    aliases: bool        # ``is_alias``
    starts: bool         # starts a collective (``role``)
    waits: bool          # a wait (``role``)
    pointwise: bool      # a functional pointwise op (Inductor lowers it to a loop body it can inline)
    fused_reader: bool   # reads its inputs from inside its own loop: pointwise, a reduction, a scatter, cat


_FACTS_BY_TARGET: dict[int, tuple[object, _OpFacts]] = {}
_OTHER_FACTS = {(aliases, fused): _OpFacts(aliases, False, False, False, fused)
                for aliases in (False, True) for fused in (False, True)}


def _facts(node: fx.Node) -> _OpFacts:
    """``node``'s ``_OpFacts``; for a call_function cached per call target (the entry
    keeps the target alive: ids are not reused while it lives)."""
    if node.op != "call_function":
        return _OTHER_FACTS[is_alias(node), str(node.target) in _FUSED_READERS]
    entry = _FACTS_BY_TARGET.get(id(node.target))
    if entry is None or entry[0] is not node.target:
        entry = _FACTS_BY_TARGET[id(node.target)] = (node.target, _call_facts(node))
    return entry[1]


def _call_facts(node: fx.Node) -> _OpFacts:
    """``_OpFacts`` of a call_function node, read off its target (its tags, schema and name)."""
    target = node.target
    tags = getattr(target, "tags", ())
    name = str(target)
    mutable = getattr(getattr(target, "_schema", None), "is_mutable", True)   # in-place ops mutate self
    pointwise = not mutable and (torch.Tag.pointwise in tags or name in _EXTRA_POINTWISE)
    start, wait, _ = role(node)   # what it starts or waits depends on the target alone
    return _OpFacts(is_alias(node), start is not None, wait, pointwise,
                    pointwise or torch.Tag.reduction in tags or name in _FUSED_READERS)


def _fusable_reader(node: fx.Node, fusable: dict[fx.Node, bool]) -> bool:
    """``node`` reads its inputs from inside a fused loop: pointwise or a reduction, or an
    alias (not a wait) whose own readers all are."""
    known = fusable.get(node)
    if known is None:
        facts = _facts(node)
        if facts.fused_reader:
            known = True
        elif node.op == "call_function" and facts.aliases and not facts.waits and node.users:
            known = all(_fusable_reader(user, fusable) for user in node.users)
        else:
            known = False
        fusable[node] = known
    return known


def _fuses_away(node: fx.Node, fusable: dict[fx.Node, bool], reads: list[fx.Node]) -> bool:
    """Inductor computes ``node``, a functional pointwise op with users, inside its readers'
    kernels and never allocates it: all of its readers read from fused loops (several
    readers only when it reads few storages, as Inductor realizes a reused node that
    reads many)."""
    users = node.users
    if len(users) == 1:
        return _fusable_reader(next(iter(users)), fusable)
    if len(reads) > _MAX_REUSE_READS:
        return False
    return all(_fusable_reader(user, fusable) for user in users)


def _reused_input(node: fx.Node, size: dict[fx.Node, int], extents: dict[tuple, int]) -> fx.Node | None:
    """The input whose buffer Inductor reuses for ``node``'s output (its in-place update,
    ``buf7 = buf6; del buf6  # reuse``): ``node``, a pointwise kernel with users, is not fused
    away, the input is a buffer of its own (allocated by a compute node, not an input, an
    alias or a collective) read by ``node`` alone, of the same dtype and 95-100% of the
    bytes of ``node``'s output. None when there is none. ``extents``: ``_nbytes``' cache."""
    value = nbytes = None
    for x in node._input_nodes:
        if size.get(x, 0) <= 0 or x.op != "call_function" or len(x.users) != 1 or _facts(x).starts:
            continue
        if value is None:
            value = node_value(node)
            if not isinstance(value, torch.Tensor):
                return None
        other = node_value(x)
        if not isinstance(other, torch.Tensor) or other.dtype != value.dtype:
            continue
        nbytes = _nbytes(node, extents) if nbytes is None else nbytes
        if 0.95 * size[x] <= nbytes <= size[x]:
            return x
    return None


def _nbytes(node: fx.Node, extents: dict[tuple, int]) -> int:
    """Bytes of ``node``'s output storage: the extent its sizes and strides span (what
    ``empty_strided`` allocates; a strided input's storage holds at least that), with
    size hints for symbolic sizes (no guard), 0 for data-dependent (unbacked) sizes and
    non-tensors; a tuple or list sums its tensors. ``extents``: a cache of the bytes of
    each (sizes, strides, dtype) seen, for one graph's tensors."""
    value = node.meta.get("val")
    if value is None:
        value = node_value(node)
    if isinstance(value, torch.Tensor):
        return _cached_extent(value, extents)
    if isinstance(value, (list, tuple)):
        return sum(_cached_extent(v, extents) for v in value if isinstance(v, torch.Tensor))
    return 0


def _cached_extent(tensor: torch.Tensor, extents: dict[tuple, int]) -> int:
    """``_extent_bytes(tensor)``, looked up in ``extents`` by (sizes, strides, dtype) when
    those are plain ints (a symbolic size is not hashable: computed each time; a nested
    tensor's nested int is, but comparing two could guard)."""
    if tensor.is_nested:
        return _extent_bytes(tensor)
    try:
        key = (tensor.shape, tensor.stride(), tensor.dtype)
        found = extents.get(key)
    except (RuntimeError, NotImplementedError, TypeError):   # no strides (sparse, nested), or symbolic
        return _extent_bytes(tensor)
    if found is None:
        found = extents[key] = _extent_bytes(tensor)
    return found


def _extent_bytes(tensor: torch.Tensor) -> int:
    """``element_size`` x (1 + sum over dims of (size - 1) x stride); 0 when empty or unknown."""
    try:
        sizes = [size_hint(n) for n in tensor.shape]
        strides = [size_hint(n) for n in tensor.stride()]
    except (RuntimeError, NotImplementedError):   # no strides (sparse, nested): contiguous bytes
        return tensor_nbytes(tensor) or 0
    if None in sizes or None in strides:
        return 0
    if 0 in sizes:
        return 0
    return (1 + sum((n - 1) * abs(st) for n, st in zip(sizes, strides))) * tensor.element_size()


def _topological(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes``, checked to list every node after its inputs (ValueError otherwise)."""
    seen: set[fx.Node] = set()
    for node in nodes:
        if any(i not in seen for i in node._input_nodes):
            raise ValueError(f"{node.name} comes before its inputs: not a topological order")
        seen.add(node)
    return nodes


def peak_bytes(order: list[fx.Node]) -> int:
    """Most bytes live at any point of ``order``, a topological order of one graph
    (ValueError naming the first node placed before its inputs otherwise)."""
    return Liveness(_topological(order)).peak_bytes(order)


class EditedPeak:
    """The peak live bytes of one graph's node order (``Liveness``'s model) while the
    caller edits the graph: nodes leave the order (they stay in the graph, read by
    nothing that stays) and readers of a wait are re-pointed to another wait. Each
    ``edit`` recounts the nodes it touches and the storages they read, O((those) x
    log n), instead of the whole graph; ``undo`` takes the last edit back. The
    peak is always the one ``peak_bytes`` gives for the order without the dropped
    nodes, on the graph as edited."""

    def __init__(self, nodes: list[fx.Node], liveness: Liveness | None = None):
        """``nodes``: the graph's nodes in graph order (positions stay theirs); ``liveness``:
        ``Liveness(nodes)`` when the caller has it (forked: this one is left as it is)."""
        self.liveness = liveness.fork() if liveness is not None else Liveness(nodes)
        self.pos = {node: index for index, node in enumerate(nodes)}
        self.end = len(nodes) - 1
        self.dropped: set[fx.Node] = set()
        self.unread = set(self.liveness.unread)
        self.last = self.liveness._last_use(nodes, self.pos)
        self.readers: dict[fx.Node, dict[fx.Node, None]] = {}   # storage -> nodes that read it
        for node in nodes:
            for r in self.liveness.reads[node]:
                self.readers.setdefault(r, {})[node] = None
        self._live = _MaxAfterAdds(self.liveness.live_bytes(nodes))
        self._undo: list = []

    @property
    def peak(self) -> int:
        """Most bytes live at any point of the order as it stands (0 when empty)."""
        return self._live.peak

    def edit(self, drop: set[fx.Node], repointed: list[fx.Node]) -> int:
        """Drop the nodes ``drop`` and recount ``repointed`` (nodes the caller made read
        another wait, in place of one) and what reads them through aliases and fused-away
        ops; return the new peak. Kept until ``undo``."""
        lv = self.liveness
        saved = {}   # node -> (root, size, inlined, reads) before, None: absent
        touched: dict[fx.Node, None] = {}   # storages whose bytes or readers may have changed
        drop = drop - self.dropped

        def save(node):
            if node not in saved:
                saved[node] = (lv.root.get(node), lv.size.get(node), lv.inlined.get(node), lv.reads.get(node))
        for node in sorted(drop, key=self.pos.__getitem__):
            save(node)
            touched.update(dict.fromkeys(lv.reads[node]))
            touched[lv.root[node]] = None
        self.dropped |= drop
        heap = [(self.pos[n], n.name, n) for n in dict.fromkeys(repointed) if n not in self.dropped]
        heapq.heapify(heap)
        done: set[fx.Node] = set()
        while heap:
            node = heapq.heappop(heap)[2]
            if node in done:
                continue
            done.add(node)
            save(node)
            root, nbytes, inlined, reads = saved[node]
            lv.size.pop(node, None)
            lv.inlined.pop(node, None)
            lv._add(node)
            touched.update(dict.fromkeys(reads))
            touched.update(dict.fromkeys(lv.reads[node]))
            touched[node] = None
            if lv.root[node] is not root or lv.inlined.get(node) != inlined:
                for user in node.users:
                    if user not in self.dropped:
                        heapq.heappush(heap, (self.pos[user], user.name, user))
        self._undo.append((drop, saved, self._recount(saved, touched)))
        return self.peak

    def undo(self) -> None:
        """Take the last ``edit`` back (the caller restores the graph's edges)."""
        drop, saved, intervals = self._undo.pop()
        lv = self.liveness
        for node, (root, nbytes, inlined, reads) in saved.items():
            self._reindex(node, () if node in drop else lv.reads[node], reads)
            for table, value in ((lv.root, root), (lv.size, nbytes), (lv.inlined, inlined), (lv.reads, reads)):
                if value is None:
                    table.pop(node, None)
                else:
                    table[node] = value
        self.dropped -= drop
        for r, (before, after) in intervals.items():
            self._move(r, after, before)
            self.last[r] = before[1]

    def _recount(self, saved: dict[fx.Node, tuple], touched: dict[fx.Node, None]) -> dict:
        """Update the readers index of the nodes in ``saved`` and the live intervals of the
        storages ``touched``; return storage -> (interval before, after) for ``undo``."""
        lv = self.liveness
        for node, (root, nbytes, inlined, reads) in saved.items():
            self._reindex(node, reads, () if node in self.dropped else lv.reads[node])
        intervals = {}
        for r in sorted(touched, key=self.pos.__getitem__):
            before = (saved[r][1] if r in saved else lv.size.get(r)) or 0, self.last.get(r, self.pos[r])
            alive = r not in self.dropped and lv.size.get(r)
            after = (lv.size[r] if alive else 0), self._last_of(r)
            if before != after:
                self._move(r, before, after)
                intervals[r] = (before, after)
                self.last[r] = after[1]
        return intervals

    def _reindex(self, node: fx.Node, old_reads, new_reads) -> None:
        """``node`` reads ``new_reads`` now, not ``old_reads`` (the readers index)."""
        for r in old_reads:
            self.readers.get(r, {}).pop(node, None)
        for r in new_reads:
            self.readers.setdefault(r, {})[node] = None

    def _last_of(self, r: fx.Node) -> int:
        """The position after which storage ``r`` is freed (``Liveness._last_use``)."""
        pos, held = self.pos, self.liveness.held_until
        last = self.end if r in self.unread else pos[r]
        for node in self.readers.get(r, ()):
            waits = held.get(node)
            last = max(last, pos[node] if waits is None else max(pos[w] for w in waits))
        return last

    def _move(self, r: fx.Node, before: tuple[int, int], after: tuple[int, int]) -> None:
        """Storage ``r``'s (bytes, last position) from ``before`` to ``after``."""
        first = self.pos[r]
        if before[0]:
            self._live.add(first, before[1], -before[0])
        if after[0]:
            self._live.add(first, after[1], after[0])


class _MaxAfterAdds:
    """The largest of a list of numbers under range additions: a segment tree (each
    node the largest below it plus what was added to all of it), O(log n) an add."""

    def __init__(self, values: list[int]):
        size = 1
        while size < len(values):
            size *= 2
        self.size, self.empty = size, not values
        self.top = [0] * size + values + [-math.inf] * (size - len(values))
        self.added = [0] * size
        for p in range(size - 1, 0, -1):
            self.top[p] = max(self.top[2 * p], self.top[2 * p + 1])

    @property
    def peak(self) -> int:
        """The largest value (0 for none)."""
        return 0 if self.empty else self.top[1]

    def add(self, first: int, last: int, delta: int) -> None:
        """Add ``delta`` to positions first..last (inclusive)."""
        top, added, size = self.top, self.added, self.size
        left, right = first + size, last + size + 1
        while left < right:   # the O(log n) subtrees that cover first..last
            if left & 1:
                self._add_below(left, delta)
                left += 1
            if right & 1:
                right -= 1
                self._add_below(right, delta)
            left >>= 1
            right >>= 1
        for p in (first + size, last + size):   # their ancestors: the largest below plus what was added
            p >>= 1
            while p:
                top[p] = max(top[2 * p], top[2 * p + 1]) + added[p]
                p >>= 1

    def _add_below(self, p: int, delta: int) -> None:
        """Add ``delta`` to every position under tree node ``p``."""
        self.top[p] += delta
        if p < self.size:
            self.added[p] += delta


class Headroom:
    """How far a graph's memory stays below its peak, along its spine.

    Reference: ``serial``, a serial order of ``s`` (the pipeline passes
    ``invariants.serial_order(s, asap=True)``, built without the scheduler:
    the same spine, each all-gather issued right before its wait, every other
    collective issued when its inputs are ready and waited right after its
    start; the least memory any placement of the collectives needs). At a spine node, headroom = the reference's peak live bytes minus
    the live bytes there. A schedule whose bytes in flight (all groups) stay
    within the headroom at every spine node they span keeps the reference's
    peak: its live bytes there are the reference's plus what is in flight.
    Positions are ``s.pos``; ``least(first, last)`` is O(1) (a sparse table).

    ``segments``: the headroom at a spine node is also no more than at the
    bundle nodes (collectives' starts and waits, their input chains) the
    reference runs after it, up to the next spine node: a collective in flight
    at a spine node is in flight until the next one too, so it must fit there
    as well ("serial-peak" asks this; without it bundle nodes do not constrain).
    "serial-peak" issues by ``fits_collective``, which counts a collective's own
    buffers only where the reference does not hold them live already."""

    def __init__(self, s: Structure, serial: list[fx.Node], segments: bool = False, peak: int | None = None,
                 liveness: Liveness | None = None, along: tuple | None = None, in_place: bool = False):
        """``peak``: the bound instead of ``serial``'s own peak (the serial peak of the
        graph before a rewrite changed it: a headroom below 0 fits nothing).
        ``liveness``: ``Liveness(s.nodes)`` when the caller has it (one per graph);
        ``along``: ``liveness.along(serial)`` when the caller has it. ``in_place``:
        ``serial`` issues every collective other than an all-gather where it stands in
        ``s`` (``invariants.serial_order`` without ``asap``), so that issuing one earlier
        holds its input chain and output where the reference does not: the core issues
        it early only where that fits (``in_place`` is what it reads)."""
        self.serial, self.in_place = serial, in_place
        self.liveness = liveness or Liveness(s.nodes)   # kept: the invariant check reuses both
        self.along = along if along is not None else self.liveness.along(self.serial)   # reused by a raised bound
        live, index, last = self.along
        self.live = live   # bytes live at each node of ``serial`` (the invariant check reuses them)
        peak = max(live, default=0) if peak is None else peak
        level = [peak] * len(s.nodes)
        spine = None   # s.pos of the spine node the reference ran last
        for node, nbytes in zip(self.serial, live):
            if node not in s.bundled:
                spine = s.pos[node]
                level[spine] = peak - nbytes
            elif segments and spine is not None:
                level[spine] = min(level[spine], peak - nbytes)
        self.peak = peak
        self._least = RangeTable(level, min)
        if segments:   # what ``fits_collective`` reads: the serial order node by node
            self._index, self._last = index, last
            self._below = RangeTable([peak - nbytes for nbytes in live], min)   # per serial index
            freed = [0] * len(serial)
            for r, nbytes in self.liveness.size.items():
                freed[self._last[r]] += nbytes
            # headroom right after serial[i] ran and freed what it read last (an issue point)
            self._gap = [peak - nbytes + f for nbytes, f in zip(live, freed)]

    def least(self, first: int, last: int) -> int:
        """Smallest headroom at positions first..last (inclusive, first <= last)."""
        return self._least.query(first, last)

    def fits_collective(self, start: fx.Node, others: int, after: fx.Node, due: fx.Node) -> bool:
        """Whether the collective of ``start``, issued right after spine node ``after`` and
        waited before spine node ``due``, with ``others`` bytes of other collectives in
        flight, keeps the peak: at its issue (after ``after`` frees what it last reads) and
        at every node the reference runs between ``after`` and ``due``, ``others`` plus the
        storages it holds (its inputs until its wait, its output) that the reference does
        not keep live there (an input it has freed, an output or input chain it has not
        yet allocated) fit below the peak. Storages the reference holds live there anyway
        are counted once. Needs ``segments``."""
        first = self._index[after]   # issued in the gap after ``first``
        end = max(self._index[due], first + 1)
        size, index, last = self.liveness.size, self._index, self._last
        held = [(index[r], last[r], size[r]) for r in dict.fromkeys([*self.liveness.reads[start], start])
                if size.get(r)]
        if others + sum(n for a, z, n in held if not a <= first < z) > self._gap[first]:
            return False
        cuts = sorted({first + 1, end, *(min(max(k, first + 1), end) for a, z, _ in held for k in (a, z + 1))})
        for lo, hi in zip(cuts, cuts[1:]):   # which storages the reference holds is fixed in lo..hi-1
            extra = sum(n for a, z, n in held if not a <= lo <= z)
            if others + extra > self._below.query(lo, hi - 1):
                return False
        return True


class RangeTable:
    """``combine`` (min or max) of ``values[first..last]``: a sparse table over blocks of
    ``_BLOCK`` values, so that building it is O(n) and a query reads two table entries
    plus fewer than ``2 * _BLOCK`` values at each end. Plain lists (no torch: the backend
    runs the passes under a fake tensor mode)."""

    def __init__(self, values: list[int], combine):
        self.combine, self.values = combine, values
        blocks = [combine(values[i:i + _BLOCK]) for i in range(0, len(values), _BLOCK)]
        self.table = [blocks]
        width = 1
        while 2 * width <= len(blocks):
            below = self.table[-1]
            self.table.append(list(map(combine, below, below[width:])))
            width *= 2

    def query(self, first: int, last: int) -> int:
        """``combine`` over positions first..last (inclusive, first <= last)."""
        values, combine = self.values, self.combine
        if last - first < 2 * _BLOCK:
            return combine(values[first:last + 1])
        low, high = -(-first // _BLOCK), (last + 1) // _BLOCK - 1   # the whole blocks inside: at least one
        k = (high - low + 1).bit_length() - 1
        row = self.table[k]
        return combine(row[low], row[high - (1 << k) + 1],
                       combine(values[first:low * _BLOCK], default=row[low]),
                       combine(values[(high + 1) * _BLOCK:last + 1], default=row[low]))


_BLOCK = 16   # values per block of a RangeTable


class SpineRoom:
    """The headroom (``Headroom``) at each node of a spine, and the first spine
    index in a range where a given number of bytes fits: where a chained
    start's own buffers (its upstream results and its input chain) may appear
    without raising the peak; and the first where it does not: where an upstream
    result may not stay live in flight. ``first_fitting`` and ``first_short`` are
    O(log n) (sparse tables of maxima and minima)."""

    def __init__(self, headroom: Headroom, positions: list[int]):
        """``positions``: ``s.pos`` of each spine node, in spine order."""
        self._levels = [headroom.least(p, p) for p in positions]
        self._most = RangeTable(self._levels, max).query
        self._fewest = None   # RangeTable of minima, built on the first ``first_short``

    def first_fitting(self, first: int, last: int, nbytes: int) -> int | None:
        """Smallest spine index in first..last whose headroom is at least ``nbytes``, or None."""
        if first > last or self._most(first, last) < nbytes:
            return None
        while first < last:
            middle = (first + last) // 2
            if self._most(first, middle) >= nbytes:
                last = middle
            else:
                first = middle + 1
        return first

    def first_short(self, first: int, last: int, nbytes: int) -> int | None:
        """Smallest spine index in first..last whose headroom is below ``nbytes``, or None."""
        if nbytes <= 0 or first > last:
            return None
        if self._fewest is None:
            self._fewest = RangeTable(self._levels, min).query
        if self._fewest(first, last) >= nbytes:
            return None
        while first < last:
            middle = (first + last) // 2
            if self._fewest(first, middle) < nbytes:
                last = middle
            else:
                first = middle + 1
        return first

"""Live bytes along an order of a graph's nodes (the memory tracker).

Model: a node that is not an alias allocates its output (``meta["val"]``
sizes) when it runs; views, getitem and waits alias their input's storage (a
wait returns its collective's buffer, allocated at the start). A storage is
freed after the last node that reads it or any alias of it; graph outputs live
to the end. A collective's inputs are held until its last wait (the c10d work
keeps them). Placeholders are live from the top until their last use, the same
in every order. Symbolic sizes count their hint (no guard is
added); unknown (data-dependent) sizes count 0. Deterministic, O(nodes + edges).
"""
from __future__ import annotations

import torch.fx as fx

from overlapc.passes.collectives import is_alias, node_value, role, tensor_nbytes, wait_nodes
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
        root, size, reads = self.root, self.size, self.reads
        for node in nodes:
            start, wait, _ = role(node)
            inputs = node._input_nodes
            if inputs and (wait or _aliases(node)):
                root[node] = root[next(iter(inputs))]
            else:
                root[node] = node
                size[node] = 0 if node.op == "output" else _nbytes(node)
            reads[node] = [root[i] for i in inputs]
            if start is not None:
                waits = wait_nodes(node)
                if waits:
                    self.held_until[node] = waits

    def live_bytes(self, order: list[fx.Node]) -> list[int]:
        """Bytes live while each node of ``order`` runs (its output allocated, its
        inputs not yet freed)."""
        pos = {node: index for index, node in enumerate(order)}
        last = self._last_use(order, pos)
        change = [0] * (len(order) + 1)
        for r, nbytes in self.size.items():
            if nbytes:
                change[pos[r]] += nbytes
                change[last[r] + 1] -= nbytes
        live, running = [], 0
        for delta in change[:-1]:
            running += delta
            live.append(running)
        return live

    def _last_use(self, order: list[fx.Node], pos: dict[fx.Node, int]) -> dict[fx.Node, int]:
        """Storage -> the position in ``order`` after which it is freed."""
        last = {root: pos[root] for root in self.size}
        held_until = self.held_until
        for node in order:
            until = pos[node]
            waits = held_until.get(node)
            if waits is not None:
                until = max(pos[w] for w in waits)
            for r in self.reads[node]:
                if last[r] < until:
                    last[r] = until
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


_ALIAS_BY_TARGET: dict[int, tuple[object, bool]] = {}


def _aliases(node: fx.Node) -> bool:
    """``is_alias(node)``, cached per call target (the entry keeps the target alive)."""
    if node.op != "call_function":
        return is_alias(node)
    entry = _ALIAS_BY_TARGET.get(id(node.target))
    if entry is None or entry[0] is not node.target:
        entry = _ALIAS_BY_TARGET[id(node.target)] = (node.target, is_alias(node))
    return entry[1]


def _nbytes(node: fx.Node) -> int:
    """Bytes of ``node``'s output: size hints for symbolic sizes (no guard), 0 for
    data-dependent (unbacked) sizes and non-tensors."""
    return tensor_nbytes(node_value(node)) or 0


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
    as well ("serial-peak" asks this; without it bundle nodes do not constrain)."""

    def __init__(self, s: Structure, serial: list[fx.Node], segments: bool = False):
        self.serial = serial
        self.liveness = Liveness(s.nodes)   # kept: the invariant check reuses both
        live = self.liveness.live_bytes(self.serial)
        peak = max(live, default=0)
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

    def least(self, first: int, last: int) -> int:
        """Smallest headroom at positions first..last (inclusive, first <= last)."""
        return self._least.query(first, last)


class RangeTable:
    """``combine`` (min or max) of ``values[first..last]`` in O(1): a sparse table of
    plain lists (no torch: the backend runs the passes under a fake tensor mode)."""

    def __init__(self, values: list[int], combine):
        self.combine = combine
        self.table = [values]
        width = 1
        while 2 * width <= len(values):
            below = self.table[-1]
            self.table.append(list(map(combine, below, below[width:])))
            width *= 2

    def query(self, first: int, last: int) -> int:
        """``combine`` over positions first..last (inclusive, first <= last)."""
        k = (last - first + 1).bit_length() - 1
        row = self.table[k]
        return self.combine(row[first], row[last - (1 << k) + 1])


class SpineRoom:
    """The headroom (``Headroom``) at each node of a spine, and the first spine
    index in a range where a given number of bytes fits: where a chained
    start's own buffers (its upstream results and its input chain) may appear
    without raising the peak. ``first_fitting`` is O(log n) (a sparse table of
    maxima)."""

    def __init__(self, headroom: Headroom, positions: list[int]):
        """``positions``: ``s.pos`` of each spine node, in spine order."""
        self._most = RangeTable([headroom.least(p, p) for p in positions], max).query

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

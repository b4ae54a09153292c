"""The peak of one order of a graph's nodes while a pass edits the graph (``EditedPeak``,
keep-or-regather's per-block trials), by ``memory.Liveness``'s model, without recounting
the whole graph at each edit."""
from __future__ import annotations

import heapq
import math
from itertools import accumulate

import torch.fx as fx

from overlapc.passes.memory import Liveness
from overlapc.passes.pool import Pool, reuses


class EditedPeak:
    """The peak live bytes of one graph's node order (``Liveness``'s model) while the
    caller edits the graph: nodes leave the order (they stay in the graph, read by
    nothing that stays) and readers of a wait are re-pointed to another wait. Each
    ``edit`` recounts the nodes it touches and the storages they read, and pairs the
    pool again (``pool.reuses``, one pass over the order), moving in the tree of live
    bytes only the storages whose span changed, O(n + (those) x log n), instead of
    building the whole graph's liveness again; ``undo`` takes the last edit back. The
    peak is always the one ``peak_bytes`` gives for the order without the dropped
    nodes, on the graph as edited."""

    def __init__(self, nodes: list[fx.Node], liveness: Liveness | None = None):
        """``nodes``: the graph's nodes in graph order (positions stay theirs); ``liveness``:
        ``Liveness(nodes)`` when the caller has it (forked: this one is left as it is)."""
        lv = self.liveness = liveness.fork() if liveness is not None else Liveness(nodes)
        self.nodes = nodes
        self.pos = {node: index for index, node in enumerate(nodes)}
        self.end = len(nodes) - 1
        self.dropped: set[fx.Node] = set()
        self.unread = set(lv.unread)
        self.base = lv._last_use(nodes, self.pos)   # storage -> freed after, by its readers
        self.taken = reuses(lv.pool, nodes, self.base, lv.size)   # storage -> the allocation that takes it
        self.span = {r: (n, self.taken[r] - 1 if r in self.taken else self.base[r])   # what the tree counts
                     for r, n in lv.size.items() if n}
        self.readers: dict[fx.Node, dict[fx.Node, None]] = {}   # storage -> nodes that read it
        for node in nodes:
            for r in lv.reads[node]:
                self.readers.setdefault(r, {})[node] = None
        change = [0] * (len(nodes) + 1)   # the live bytes of these spans (``Liveness.along``'s, paired along ``nodes``)
        for r, (nbytes, last) in self.span.items():
            change[self.pos[r]] += nbytes
            change[last + 1] -= nbytes
        self._live = _MaxAfterAdds(list(accumulate(change[:-1])))
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
        saved = {}   # node -> its entries in the tables of ``_TABLES`` before, None: absent
        touched: dict[fx.Node, None] = {}   # storages whose bytes or readers may have changed
        drop = drop - self.dropped

        def save(node):
            if node not in saved:
                saved[node] = tuple(_entry(lv, name, node) for name in _TABLES)
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
            root, nbytes, inlined, reads = saved[node][:4]
            for name in _TABLES[1:3] + _TABLES[4:]:   # what ``_add`` decides afresh
                _table(lv, name).pop(node, None)
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
        drop, saved, (spans, bases, taken) = self._undo.pop()
        lv = self.liveness
        for node, entries in saved.items():
            self._reindex(node, () if node in drop else lv.reads[node], entries[3])
            for name, value in zip(_TABLES, entries):
                if value is None:
                    _table(lv, name).pop(node, None)
                else:
                    _table(lv, name)[node] = None if name == "kernels" else value
        self.dropped -= drop
        for r, before in bases.items():
            if before is None:
                self.base.pop(r, None)
            else:
                self.base[r] = before
        self.taken = taken
        for r, (before, after) in spans.items():
            self._move(r, after, before)

    def _recount(self, saved: dict[fx.Node, tuple], touched: dict[fx.Node, None]) -> tuple:
        """Update the readers index of the nodes in ``saved``, the readers' last positions of
        the storages ``touched``, the pool's pairing and the spans the tree counts; return
        (spans, bases, pairing) as they were, for ``undo``."""
        lv, dropped = self.liveness, self.dropped
        for node, entries in saved.items():
            self._reindex(node, entries[3], () if node in dropped else lv.reads[node])
        bases = {}
        for r in sorted(touched, key=self.pos.__getitem__):
            last = self._last_of(r)
            if last != self.base.get(r):
                bases[r] = self.base.get(r)
                self.base[r] = last
        before, self.taken = self.taken, reuses(self._standing(), self.nodes, self.base, lv.size)
        changed = dict(touched)
        changed.update(dict.fromkeys(r for r in before if self.taken.get(r) != before[r]))
        changed.update(dict.fromkeys(r for r in self.taken if r not in before))
        spans = {}
        for r in sorted(changed, key=self.pos.__getitem__):
            old = self.span.get(r, (0, self.pos[r]))
            nbytes = 0 if r in dropped else lv.size.get(r) or 0
            new = (nbytes, self.taken[r] - 1 if r in self.taken else self.base.get(r, self.pos[r]))
            if old != new:
                self._move(r, old, new)
                spans[r] = (old, new)
        return spans, bases, before

    def _standing(self) -> Pool:
        """The liveness's pool tables without the dropped nodes (inert where they stand)."""
        pool, dropped = self.liveness.pool, self.dropped
        if not dropped:
            return pool
        kept = Pool()
        kept.key = {n: k for n, k in pool.key.items() if n not in dropped}
        kept.takes = {n: k for n, k in pool.takes.items() if n not in dropped}
        kept.kernels = {n: None for n in pool.kernels if n not in dropped}
        kept.inputs = [n for n in pool.inputs if n not in dropped]
        return kept

    def _reindex(self, node: fx.Node, old_reads, new_reads) -> None:
        """``node`` reads ``new_reads`` now, not ``old_reads`` (the readers index)."""
        for r in old_reads or ():
            self.readers.get(r, {}).pop(node, None)
        for r in new_reads:
            self.readers.setdefault(r, {})[node] = None

    def _last_of(self, r: fx.Node) -> int:
        """The position after which storage ``r``'s readers let it go (``Liveness._last_use``)."""
        pos, held = self.pos, self.liveness.held_until
        last = self.end if r in self.unread else pos[r]
        for node in self.readers.get(r, ()):
            waits = held.get(node)
            last = max(last, pos[node] if waits is None else max(pos[w] for w in waits))
        return last

    def _move(self, r: fx.Node, before: tuple[int, int], after: tuple[int, int]) -> None:
        """Storage ``r``'s (bytes, last position) in the tree from ``before`` to ``after``."""
        first = self.pos[r]
        if before[0]:
            self._live.add(first, before[1], -before[0])
        if after[0]:
            self._live.add(first, after[1], after[0])
            self.span[r] = after
        else:
            self.span.pop(r, None)


# Liveness's tables an edit may change: its own, then its pool's
_TABLES = ("root", "size", "inlined", "reads", "key", "takes", "kernels")


def _table(liveness: Liveness, name: str) -> dict:
    """The table ``name`` of ``_TABLES`` in ``liveness``."""
    return getattr(liveness.pool, name) if name in ("key", "takes", "kernels") else getattr(liveness, name)


def _entry(liveness: Liveness, name: str, node: fx.Node):
    """``node``'s entry in the table ``name`` (for "kernels", a set as a dict: True when in
    it); None when absent."""
    table = _table(liveness, name)
    if name == "kernels":
        return True if node in table else None
    return table.get(node)


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

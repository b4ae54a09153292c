"""The peak of one order of a graph's nodes while a pass edits the graph (``EditedPeak``,
keep-or-regather's per-block trials), by ``memory.Liveness``'s model, without recounting
the whole graph at each edit."""
from __future__ import annotations

import heapq
import math

import torch.fx as fx

from overlapc.passes.memory import Liveness


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

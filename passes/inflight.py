"""Open collectives along an order, and the budget that bounds them.

One tracker for the scheduler, the invariant check and the simulator alike.
A collective is *open* from its start until its last wait. Per process group:
the number open of each kind, and the bytes they hold (``structure.held_bytes``:
an all-gather's output and input, another collective's input). The pieces of
one chunked collective (``meta["overlapc_piece_of"]``, set by the chunk pass)
count as one collective, open while any piece is: splitting a collective does
not make it more collectives in flight.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch.fx as fx

from overlapc.passes.collectives import Collective
from overlapc.passes import meta
from overlapc.passes.structure import held_bytes

if TYPE_CHECKING:
    from overlapc.passes.memory import Headroom


@dataclasses.dataclass(frozen=True)
class Budget:
    """What may be in flight per process group.

    max_count: collectives of one kind (all-gathers, reduce-scatters, ...) open
        at once (a chunked collective's pieces as one), or None.
    max_bytes: group -> held bytes open at once, or None for no limit.
    reserve: group -> bytes all-gathers issued ahead of need leave free, so the
        group's largest other collective always fits once no other one is open
        (0 when the group has no other kind).
    headroom: with the "auto" byte budget, a ``memory.Headroom`` of the graph:
        a collective may also be issued past ``max_bytes`` when everything in
        flight (all groups) fits the headroom at every spine node from here to
        its wait's target (``fits_headroom``); None: ``max_bytes`` alone.
    within_peak: the "serial-peak" byte budget: the headroom alone bounds the
        bytes in flight (``max_bytes`` holds no number): a collective goes ahead only
        where the others in flight and what it holds beyond the serial order's
        live bytes fit it (``Headroom.fits_collective``); one other than an
        all-gather that does not fit is waited right after its start, an
        all-gather that does not fit is issued right before its wait; the invariant check compares
        the peak with the serial order's peak exactly (``Headroom.peak``).
    held: start -> bytes held in flight (``held_of``): ``Structure.held_ahead`` for a
        byte budget other than "serial-peak"; None: ``Structure.held``.
    issue: "early" (a start goes as soon as its inputs are placed and the bounds let it)
        or "per-kernel" (no earlier than the hiding kernel it is to run under, one start
        per kernel: ``kernel_points``); ``ScheduleOptions.issue``.
    """

    max_count: int | None
    max_bytes: dict[str, int | None]
    reserve: dict[str, int]
    headroom: Headroom | None = None
    within_peak: bool = False
    held: Mapping[fx.Node, int] | None = None
    issue: str = "early"

    def held_of(self, s) -> Mapping[fx.Node, int]:
        """Start -> bytes its collective holds in flight as this budget counts them:
        ``held`` when set, else ``s.held`` (``s``: the graph's Structure)."""
        return s.held if self.held is None else self.held

    def fits_headroom(self, in_flight: int, first: int, last: int) -> bool:
        """Whether ``in_flight`` bytes (all groups, the new collective included) fit
        the headroom at positions first..last."""
        return self.headroom is not None and in_flight <= self.headroom.least(first, last)

    def gather_room(self, group: str) -> int | None:
        """Bytes open all-gathers of ``group`` may hold, or None for no limit."""
        limit = self.max_bytes.get(group)
        return None if limit is None else limit - self.reserve.get(group, 0)


def piece_of(c: Collective) -> str:
    """The collective ``c`` is a piece of (the chunked original's name), else its own start's name."""
    return meta.piece_of(c.start)


def auto_budget(collectives: list[Collective], held: dict[fx.Node, int]) -> dict[str, int]:
    """The "auto" byte budget per group: twice the bytes held by the group's
    largest collective, a chunked one's pieces together (so the next one can be
    in flight while the largest one is, as FSDP2's one-ahead prefetch does).
    ``held``: start -> held bytes (``Structure.held``)."""
    whole: dict[tuple[str, str], int] = {}
    for c in collectives:
        key = (c.group, piece_of(c))
        whole[key] = whole.get(key, 0) + held[c.start]
    largest: dict[str, int] = {}
    for (group, _), size in whole.items():
        largest[group] = max(largest.get(group, 0), size)
    return {group: max(1, 2 * size) for group, size in largest.items()}


class InFlight:
    """Collectives issued and not yet fully waited, per group, oldest first.

    ``held`` maps a start node to the bytes its collective holds in flight.
    Records the peak held bytes per group and over all groups, and the peak
    count per (group, kind), a chunked collective's open pieces counting once."""

    def __init__(self, held: dict[fx.Node, int]):
        self.held = held
        self.queue: dict[str, deque[Collective]] = {}
        self.closed_queued: dict[str, int] = {}   # closed collectives still in a group's queue
        self.is_open: set[fx.Node] = set()
        self.counts: dict[tuple[str, str], int] = {}
        self.pieces_open: dict[tuple[str, str], int] = {}   # (group, piece_of) -> open pieces
        self.bytes: dict[str, int] = {}
        self.total = 0
        self.peak_total = 0
        self.peak_bytes: dict[str, int] = {}
        self.peak_counts: dict[tuple[str, str], int] = {}
        self.pinned_counts: dict[tuple[str, str], int] = {}   # (group, kind) -> open pinned ones
        self.pinned_open = 0                                   # all of them
        self._whole: dict[fx.Node, tuple[str, str]] = {}   # start -> (group, piece_of): read once

    def _whole_of(self, c: Collective) -> tuple[str, str]:
        whole = self._whole.get(c.start)
        if whole is None:
            whole = self._whole[c.start] = (c.group, piece_of(c))
        return whole

    def open(self, c: Collective) -> None:
        group, start = c.group, c.start
        queue = self.queue.get(group)
        if queue is None:
            queue = self.queue[group] = deque()
        queue.append(c)
        self.is_open.add(start)
        whole = self._whole.get(start) or self._whole_of(c)
        pieces = self.pieces_open[whole] = self.pieces_open.get(whole, 0) + 1
        if pieces == 1:
            key = (group, c.kind)
            count = self.counts[key] = self.counts.get(key, 0) + 1
            if count > self.peak_counts.get(key, 0):
                self.peak_counts[key] = count
        size = self.held[start]
        group_bytes = self.bytes[group] = self.bytes.get(group, 0) + size
        self.total += size
        if self.total > self.peak_total:
            self.peak_total = self.total
        if group_bytes >= self.peak_bytes.get(group, 0):
            self.peak_bytes[group] = group_bytes

    def close(self, c: Collective) -> None:
        group, start = c.group, c.start
        self.is_open.discard(start)
        self._forget_closed(group)
        whole = self._whole.get(start) or self._whole_of(c)
        pieces = self.pieces_open[whole] = self.pieces_open[whole] - 1
        if pieces == 0:
            self.counts[(group, c.kind)] -= 1
        size = self.held[start]
        self.bytes[group] -= size
        self.total -= size

    def _forget_closed(self, group: str) -> None:
        """Drop the closed collectives from ``group``'s queue once they are half of it
        (one closed out of order stays there until then): ``open_in`` reads the queue,
        so it must not grow with everything ever issued. O(1) amortized a close."""
        queue = self.queue[group]
        closed = self.closed_queued[group] = self.closed_queued.get(group, 0) + 1
        if 2 * closed > len(queue):
            self.queue[group] = deque(x for x in queue if x.start in self.is_open)
            self.closed_queued[group] = 0

    def open_pinned(self, c: Collective) -> None:
        """``c`` stays where it stands (``Structure.pinned``) and its start ran: it counts
        against its group's and kind's ``count`` until ``close_pinned``, holds no bytes
        here (its buffers are in the serial order's live bytes already) and is never a
        collective to wait early (``oldest``, ``open_in``)."""
        key = (c.group, c.kind)
        count = self.counts[key] = self.counts.get(key, 0) + 1
        self.pinned_counts[key] = self.pinned_counts.get(key, 0) + 1
        self.pinned_open += 1
        if count > self.peak_counts.get(key, 0):
            self.peak_counts[key] = count

    def close_pinned(self, c: Collective) -> None:
        """The last wait of pinned ``c`` ran."""
        key = (c.group, c.kind)
        self.counts[key] -= 1
        self.pinned_counts[key] -= 1
        self.pinned_open -= 1

    def count(self, group: str, kind: str) -> int:
        """Open collectives of ``group`` and ``kind``, pinned ones included."""
        return self.counts.get((group, kind), 0)

    def adds_one(self, c: Collective) -> bool:
        """Whether opening ``c`` raises its (group, kind) count: no piece of its collective is open."""
        return not self.pieces_open.get(self._whole_of(c))

    def closes_one(self, c: Collective) -> bool:
        """Whether closing ``c`` lowers its (group, kind) count: it is open, the last open piece
        of its collective."""
        return c.start in self.is_open and self.pieces_open.get(self._whole_of(c)) == 1

    def nbytes(self, group: str) -> int:
        return self.bytes.get(group, 0)

    def gather_bytes(self, group: str) -> int:
        return sum(self.held[c.start] for c in self.open_in(group) if c.kind == "all_gather")

    def open_in(self, group: str) -> list[Collective]:
        """Open collectives of ``group``, oldest first."""
        if not self.any_open(group):
            return []
        return [c for c in self.queue[group] if c.start in self.is_open]

    def any_open(self, group: str) -> bool:
        """Whether a collective of ``group`` is open (closed ones at the head of its queue go)."""
        queue = self.queue.get(group)
        while queue and queue[0].start not in self.is_open:
            queue.popleft()
        return bool(queue)

    def open_besides(self, c: Collective) -> list[Collective]:
        """Open collectives of ``c``'s group that are not pieces of ``c``'s collective, oldest
        first (what the byte limit counts against ``c``: alone, it may exceed the limit)."""
        whole = piece_of(c)
        return [x for x in self.open_in(c.group) if piece_of(x) != whole]

    def oldest(self, group: str, kind: str | None = None, gathers: bool = False,
               skip: Callable[[Collective], bool] | None = None) -> Collective | None:
        """Oldest open collective of ``group``: of ``kind`` when given, else of any
        kind but all-gather (or of any kind at all when ``gathers``); none for which
        ``skip`` is true."""
        for c in self.open_in(group):
            if kind is not None and c.kind != kind or skip is not None and skip(c):
                continue
            if kind is None and not gathers and c.kind == "all_gather":
                continue
            return c
        return None


def replay(found: list[Collective], order: list[fx.Node]) -> InFlight:
    """An InFlight that has seen ``order`` (collectives ``found``, open from their
    start to their last wait); its peaks describe the whole order."""
    flight = InFlight({c.start: held_bytes(c) for c in found})
    of_start = {c.start: c for c in found if c.waits}
    of_wait = {w: c for c in found for w in c.waits}
    waits_left = {c.start: len(c.waits) for c in found}
    for node in order:
        c = of_start.get(node)
        if c is not None:
            flight.open(c)
        c = of_wait.get(node)
        if c is not None:
            waits_left[c.start] -= 1
            if waits_left[c.start] == 0:
                flight.close(c)
    return flight

"""limit_in_flight: bound the all-gathers of a process group that are issued and not waited."""
from __future__ import annotations

from collections import deque

import torch.fx as fx

from overlapc.config import OverlapConfig
from overlapc.collectives import Collective
from overlapc.passes.analysis import Analysis, apply_order
from overlapc.passes.sink_waits import sink_in_graph


class InFlight:
    """All-gathers of one group issued and not yet fully waited, oldest first."""

    def __init__(self, max_count: int | None, max_bytes: int | None):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.open: deque[Collective] = deque()
        self.nbytes = 0

    def fits(self, c: Collective) -> bool:
        if not self.open:
            return True  # one all-gather larger than the byte limit still runs, alone
        if self.max_count is not None and len(self.open) >= self.max_count:
            return False
        return self.max_bytes is None or self.nbytes + (c.nbytes or 0) <= self.max_bytes

    def add(self, c: Collective) -> None:
        self.open.append(c)
        self.nbytes += c.nbytes or 0

    def remove(self, c: Collective) -> None:
        self.open.remove(c)
        self.nbytes -= c.nbytes or 0


def limit_in_flight(gm: fx.GraphModule, max_in_flight: int | None | OverlapConfig = 2,
                    max_in_flight_bytes: int | None = None) -> fx.GraphModule:
    """Keep at most ``max_in_flight`` all-gathers of each process group (and at
    most ``max_in_flight_bytes`` of their outputs) issued and not yet waited.

    The bound is meant for sunk waits, so all-gather waits are first sunk
    (``sink_waits(gm, kinds=("all_gather",))``). Then an all-gather that would
    exceed the bound, with its input chain, is issued right after the wait that
    frees its slot; all-gathers of a group keep their issue order. Takes the two
    limits or an OverlapConfig. In place; returns ``gm`` recompiled.
    """
    if isinstance(max_in_flight, OverlapConfig):
        max_in_flight, max_in_flight_bytes = max_in_flight.max_in_flight, max_in_flight.max_in_flight_bytes
    if limit_in_graph(gm, max_in_flight, max_in_flight_bytes):
        gm.recompile()
    return gm


def limit_in_graph(gm: fx.GraphModule, max_in_flight: int | None, max_in_flight_bytes: int | None,
                   info: Analysis | None = None) -> bool:
    """limit_in_flight on ``gm.graph`` without recompiling; True if it ran.
    ``info``, when given, is the graph's Analysis and is refreshed afterwards."""
    OverlapConfig(max_in_flight=max_in_flight, max_in_flight_bytes=max_in_flight_bytes)  # validates
    if max_in_flight is None and max_in_flight_bytes is None:
        return False
    info = info or Analysis(gm)
    sink_in_graph(gm, kinds=("all_gather",), info=info)
    gathers = [c for c in info.movable if c.kind == "all_gather"]
    if not gathers:
        return True
    if max_in_flight_bytes is not None:
        unknown = [c for c in gathers if c.nbytes is None]
        if unknown:
            from overlapc.passes.pipeline import ScheduleError
            c = unknown[0]
            raise ScheduleError(
                f"max_in_flight_bytes needs output sizes, but {c.op} {c.start.name} has no shape "
                "metadata; trace with make_fx or run torch.fx.passes.shape_prop.ShapeProp first",
                node=c.start, group=c.group, position=info.pos[c.start])
    _Limit(info, gathers, max_in_flight, max_in_flight_bytes).run()
    info.refresh()
    return True


class _Limit:
    def __init__(self, info: Analysis, gathers: list[Collective], max_count, max_bytes):
        self.info = info
        self.gathers = {c.start: c for c in gathers}
        self.groups = {c.group: InFlight(max_count, max_bytes) for c in gathers}
        self.pending = {group: deque() for group in self.groups}   # group -> deferred all-gathers
        self.state: dict[fx.Node, str] = {}                        # start -> "open" | "pending"
        self.held: dict[fx.Node, list[fx.Node]] = {}               # start -> deferred members
        self.waits_left = {c.start: len(c.waits) for c in gathers}
        self.order: list[fx.Node] = []
        self.emitted: set[fx.Node] = set()

    def _emit(self, node: fx.Node) -> None:
        self.order.append(node)
        self.emitted.add(node)

    def _open(self, c: Collective) -> None:
        self.state[c.start] = "open"
        self.groups[c.group].add(c)
        for member in self.held.pop(c.start, []):
            self._emit(member)

    def _decide(self, c: Collective) -> None:
        slots = self.groups[c.group]
        if not self.pending[c.group] and slots.fits(c):
            self._open(c)
        else:
            self.state[c.start] = "pending"
            self.pending[c.group].append(c)

    def _waited(self, wait: fx.Node) -> None:
        c = self.info.coll_of_wait[wait]
        self._emit(wait)
        self.waits_left[c.start] -= 1
        if self.waits_left[c.start] == 0:
            self.groups[c.group].remove(c)
            self._release(c.group)

    def _release(self, group: str) -> None:
        slots, pending = self.groups[group], self.pending[group]
        while pending and slots.fits(pending[0]):
            self._open(pending.popleft())

    def _force_open(self, group: str, until: fx.Node | None = None) -> None:
        """Open pending all-gathers (up to ``until``) now, waiting the oldest ones early."""
        slots, pending = self.groups[group], self.pending[group]
        while pending and (until is None or self.state[until] == "pending"):
            if slots.fits(pending[0]):
                self._open(pending.popleft())
                continue
            oldest = slots.open[0]
            for wait in oldest.waits:
                if wait not in self.emitted:
                    self._waited(wait)

    def run(self) -> None:
        info = self.info
        for node in info.nodes:
            if node in self.emitted:
                continue
            start = info.start_of_member.get(node)
            if start in self.gathers:
                c = self.gathers[start]
                if start not in self.state:
                    self._decide(c)
                if self.state[start] == "pending":
                    self.held.setdefault(start, []).append(node)
                else:
                    self._emit(node)
                continue
            wait_of = info.coll_of_wait.get(node)
            if wait_of is not None and wait_of.start in self.gathers:
                if self.state.get(wait_of.start) != "open":
                    self._force_open(wait_of.group, until=wait_of.start)
                self._waited(node)
                continue
            if node in info.is_barrier or node is info.output:
                for group in self.pending:
                    self._force_open(group)
            self._emit(node)
        apply_order(info.gm, self.order)

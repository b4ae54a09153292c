"""reorder_all_gathers: issue collectives early, all-gathers in consumer order."""
from __future__ import annotations

import heapq

import torch.fx as fx

from overlapc.passes.analysis import Analysis, apply_order


def reorder_all_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every collective start, with its cheap input chain, as early as its
    inputs allow; within a process group (and barrier region) all-gathers are
    issued in the order of their first real consumer.

    Every other node keeps its relative order. A wait whose start moves past it
    follows right after its start. Nothing crosses a barrier. In place; returns
    ``gm`` linted and recompiled. A graph with no movable collective is left as is.
    """
    if reorder_in_graph(gm):
        gm.recompile()
    return gm


def reorder_in_graph(gm: fx.GraphModule, info: Analysis | None = None) -> bool:
    """reorder_all_gathers on ``gm.graph`` without recompiling; True if it ran.
    ``info``, when given, is the graph's Analysis and is refreshed afterwards."""
    info = info or Analysis(gm)
    if not info.movable:
        return False
    _Reorder(info).run()
    info.refresh()
    return True


class _Reorder:
    def __init__(self, info: Analysis):
        self.info = info
        self.order: list[fx.Node] = []
        self.emitted: set[fx.Node] = set()
        self.issued: set[fx.Node] = set()
        self.deferred: dict[fx.Node, list[fx.Node]] = {}   # start -> its waits' bundles, in order
        self.deferred_members: set[fx.Node] = set()
        self.region = 0
        self.missing: dict[fx.Node, int] = {}               # start -> external inputs not emitted
        self.blocked_on: dict[fx.Node, list[fx.Node]] = {}  # node -> starts waiting for it
        self.queue: dict[tuple[str, int], list[fx.Node]] = {}  # all-gathers in consumer order
        self.head: dict[tuple[str, int], int] = {}
        self.ready: list[tuple[int, str]] = []
        pos = info.pos
        for c in info.movable:
            inputs = info.bundle_inputs[c.start]
            self.missing[c.start] = len(inputs)
            for node in inputs:
                self.blocked_on.setdefault(node, []).append(c.start)
            if c.kind == "all_gather":
                self.queue.setdefault(self._lane(c.start), []).append(c.start)
        for lane, starts in self.queue.items():
            starts.sort(key=lambda s: (info.key[s], pos[s]))
            self.head[lane] = 0
        self.by_name = {c.start.name: c.start for c in info.movable}
        self.by_region: dict[int, list[fx.Node]] = {}
        for c in info.movable:
            self.by_region.setdefault(info.region_of(c.start), []).append(c.start)

    def _lane(self, start: fx.Node) -> tuple[str, int]:
        return self.info.coll_of_start[start].group, self.info.region_of(start)

    def _is_next(self, start: fx.Node) -> bool:
        if self.info.coll_of_start[start].kind != "all_gather":
            return True
        lane = self._lane(start)
        return self.queue[lane][self.head[lane]] is start

    def _consider(self, start: fx.Node) -> None:
        if (start not in self.issued and self.missing[start] == 0
                and self.info.region_of(start) <= self.region and self._is_next(start)):
            heapq.heappush(self.ready, (self.info.pos[start], start.name))

    def _emit(self, node: fx.Node) -> None:
        self.order.append(node)
        self.emitted.add(node)
        for start in self.blocked_on.get(node, ()):
            self.missing[start] -= 1
            self._consider(start)

    def _issue(self, start: fx.Node) -> None:
        self.issued.add(start)
        for member in self.info.start_bundle[start]:
            self._emit(member)
        if self.info.coll_of_start[start].kind == "all_gather":
            lane = self._lane(start)
            while self.head[lane] < len(self.queue[lane]) and self.queue[lane][self.head[lane]] in self.issued:
                self.head[lane] += 1
            if self.head[lane] < len(self.queue[lane]):
                self._consider(self.queue[lane][self.head[lane]])
        for bundle in self.deferred.pop(start, []):
            for member in bundle:
                self._emit(member)

    def _drain(self) -> None:
        while self.ready:
            _, name = heapq.heappop(self.ready)
            start = self.by_name[name]
            if start not in self.issued:
                self._issue(start)

    def _force(self, node: fx.Node) -> None:
        """Emit ``node`` now because something emitted next reads it."""
        info = self.info
        start = info.start_of_member.get(node)
        if start is None and node in self.deferred_members:
            start = info.coll_of_wait[info.wait_of_member[node]].start
        if start is None:
            raise AssertionError(f"overlapc internal error: {node.name} is read before it is placed")
        if start in self.issued:
            return
        if info.coll_of_start[start].kind == "all_gather":
            # Keep consumer order where the earlier all-gathers can go now.
            lane = self._lane(start)
            while self.queue[lane][self.head[lane]] is not start:
                earlier = self.queue[lane][self.head[lane]]
                if self.missing[earlier] or earlier in self.issued:
                    break
                self._issue(earlier)
        for i in info.bundle_inputs[start]:
            if i not in self.emitted:
                self._force(i)
        if start not in self.issued:
            self._issue(start)
        self._drain()

    def _flush_region(self) -> None:
        """Issue what is left of the current region before its closing barrier."""
        info = self.info
        left = [s for s in self.by_region.get(self.region, ()) if s not in self.issued]
        left.sort(key=lambda s: (info.key.get(s, (info.pos[s], 0, info.pos[s])), info.pos[s]))
        for start in left:
            self._force(start)

    def run(self) -> None:
        info = self.info
        for start in self.missing:
            self._consider(start)
        self._drain()
        for node in info.nodes:
            if node in self.emitted or node in info.start_of_member or node in self.deferred_members:
                continue
            wait = info.wait_of_member.get(node)
            if wait is not None and node is wait and info.coll_of_wait[wait].start not in self.issued:
                bundle = [m for m in info.wait_bundle[wait] if m not in self.emitted]
                self.deferred.setdefault(info.coll_of_wait[wait].start, []).append(bundle)
                self.deferred_members.update(bundle)
                continue
            for i in node._input_nodes:
                if i not in self.emitted:
                    self._force(i)
            if node in info.is_barrier:
                self._flush_region()
            self._emit(node)
            if node in info.is_barrier:
                self.region += 1
                for start in self.by_region.get(self.region, ()):
                    self._consider(start)
            self._drain()
        apply_order(info.gm, self.order)

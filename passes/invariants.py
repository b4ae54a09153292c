"""The guarantees a schedule keeps, checked on a graph as it stands.

``check(s, order, budget)`` raises ScheduleError at the first node of
``order`` (a new order of the nodes of Structure ``s``) that breaks one:

1. consumer order: within a group and region, all-gathers are issued in the
   order of their first real consumer;
2. waits: no wait after its target (first real consumer, region end, output);
   an all-gather's wait just before it (only waits, starts with their input
   chains and views of waited tensors in between);
3. in-flight bound, without exception: per group and kind at most
   ``max_count`` open (a chunked collective's pieces as one,
   ``inflight.piece_of``); per group at most ``max_bytes`` held when a
   collective is issued, unless nothing else of the group is open (one
   collective larger than the budget goes alone) or, with a headroom (the
   "auto" budget, ``Budget.headroom``), everything in flight fits the headroom
   from the issuing point to the collective's wait target. Chained collectives
   (a start that reads another collective's result) are no exception.
   Collectives that stay where they stand (``Structure.pinned``: start and
   wait on two sides of a barrier) count while open: across a spine node,
   the collectives of a group and kind open there are within ``max_count``,
   or are the pinned ones alone (``_check_pinned``);
4. memory: peak live bytes <= a reference order's peak + the most bytes held
   in flight at once. ``schedule`` compares with the order it started from
   (a graph with chained collectives with its serial order too: what
   ``verify`` compares with); ``verify`` on a graph alone with its serial
   order (``serial_order``, built here without the scheduler: the same spine
   and starts, every collective other than an all-gather waited right after
   its start, every all-gather issued right before its wait, just before its
   first reader). With ``max_in_flight_bytes="serial-peak"``
   (``Budget.within_peak``): peak live bytes <= the serial order's peak
   (``serial_order(s, asap=True)``, the budget's headroom reference), exactly,
   with no allowance for the bytes in flight.

5. compute order (``check_compute_order``, when ``order`` is a new order of
   ``s.nodes``): compute keeps its relative order, except elementwise compute
   on collectives' results alone that feeds only collective starts, which may
   move later, never before compute it followed. Judged from the nodes alone,
   not from ``Structure``'s bundles, so a bundle rule that lets more travel with
   a start is caught here.

Valid topological order (lint) and "nothing crossed a barrier" need the order
before scheduling; ``pipeline.schedule`` checks those; ``verify`` on a graph
alone has no other order to compare with, so 5 holds there trivially. Whether
a start could have been issued earlier is a quality figure for the report, not
an error.
"""
from __future__ import annotations

import dataclasses
import heapq

import torch
import torch.fx as fx

from overlapc.passes.collectives import barrier_reason_when_compute_moves, is_cheap, role
from overlapc.passes.inflight import Budget, InFlight
from overlapc.passes.meta import in_input_chain
from overlapc.passes.memory import Liveness
from overlapc.passes.structure import Structure


class ScheduleError(RuntimeError):
    """A schedule guarantee does not hold (or scheduling failed) at a named node."""

    def __init__(self, message: str, node: fx.Node | None = None, group: str | None = None,
                 position: int | None = None):
        self.node, self.group, self.position = node, group, position
        self.op = None if node is None else str(node.target)
        where = []
        if node is not None:
            where.append(f"node {node.name} (op {self.op}")
            where[-1] += f", group {group}" if group is not None else ""
            where[-1] += f", position {position})" if position is not None else ")"
        super().__init__(f"{where[0]}: {message}" if where else message)


class _Order:
    """Positions of a new order of ``s``'s nodes, with ``s``'s structure, and what
    the guarantees read off it: each wait's first consumer in this order (chained
    collectives move their consumers)."""

    def __init__(self, s: Structure, order: list[fx.Node]):
        self.s, self.nodes = s, order
        self.pos = s.pos if order is s.nodes else dict(zip(order, range(len(order))))
        pos = self.pos
        if order is s.nodes:   # the first consumers of ``s``: its targets
            self.first: dict[fx.Node, int] = {wait: pos[target] for wait, target in s.target.items()}
            return
        self.first = {}
        for wait, consumers in s.consumers.items():
            end = pos[s.nodes[s.region_end(wait)]]
            self.first[wait] = min(min([pos[u] for u in consumers]), end) if consumers else end

    def consumer_key(self, c) -> tuple[int, int]:
        """(position of the first consumer in this order, the order in which that
        consumer reads the waits it shares with others)."""
        keys = []
        for wait in c.waits:
            first = self.first[wait]
            keys.append((first, self.s._order_read(self.nodes[first]).get(wait, len(self.nodes))))
        return min(keys)

    def fail(self, node: fx.Node, message: str) -> ScheduleError:
        c = self.s.coll_of_start.get(node) or self.s.coll_of_wait.get(node)
        return ScheduleError(message, node=node, group=c.group if c else None, position=self.pos[node])


def fail(s: Structure, node: fx.Node, message: str, order: list[fx.Node] | None = None) -> ScheduleError:
    """ScheduleError at ``node`` (its group and position in ``order``, default ``s.nodes``)."""
    return _Order(s, s.nodes if order is None else order).fail(node, message)


@dataclasses.dataclass(frozen=True)
class Peaks:
    """What ``check`` measured on an order: its peak live bytes, the reference
    order's, the most bytes in flight at once (all groups) and the most
    collectives of one group and kind open at once."""

    peak_bytes: int
    reference_peak_bytes: int
    peak_in_flight_bytes: int
    peak_count: int


def check(s: Structure, order: list[fx.Node], budget: Budget,
          reference: list[fx.Node] | None = None, serial: bool = True) -> Peaks:
    """Raise ScheduleError at the first broken guarantee; return the Peaks. The
    memory guarantee compares with ``reference`` when given (``schedule`` passes
    the order before scheduling) and with the serial order (``serial_order``:
    each all-gather right before its wait, everything else waited right after
    its start) unless ``serial`` is False; ``verify`` passes ``order`` =
    ``s.nodes`` and no reference: the serial order alone."""
    if order != s.nodes:   # (Nodes compare by identity)
        check_compute_order(s.nodes, order)
    else:   # nothing moved: the positions of ``s``
        order = s.nodes
    o = _Order(s, order)
    _check_waits(o)
    _check_consumer_order(o)
    flight, peak_count = _check_bounds(o, budget)
    room = budget.headroom   # built on this structure: its liveness and serial order serve here too
    liveness = room.liveness if room is not None else Liveness(s.nodes)
    live = room.live if room is not None and order == room.serial else liveness.live_bytes(order, o.pos)
    peak = max(live, default=0)
    if budget.within_peak:
        serial_peak = room.peak if room is not None else liveness.peak_bytes(serial_order(s, asap=True))
        if peak > serial_peak:
            raise _memory_error(o, liveness, live, "serial order", serial_peak, None)
        return Peaks(peak, serial_peak, flight.peak_total, peak_count)
    references = [] if reference is None else [("order before scheduling", liveness.peak_bytes(reference))]
    if serial or reference is None:
        references.append(("serial order", liveness.peak_bytes(serial_order(s))))
    for what, bytes_ in references:
        if peak > bytes_ + flight.peak_total:
            raise _memory_error(o, liveness, live, what, bytes_, flight.peak_total)
    return Peaks(peak, references[0][1], flight.peak_total, peak_count)


def _memory_error(o: _Order, liveness: Liveness, live: list[int], what: str, reference: int,
                  in_flight: int | None) -> ScheduleError:
    """The memory guarantee broken: named at the node of ``o`` where the live bytes
    peak, with the largest buffers live there (a collective's with its kind and group).
    ``in_flight`` None: the bound is ``reference`` alone ("serial-peak")."""
    s, at = o.s, live.index(max(live))
    largest, groups = [], []
    for node, nbytes in liveness.live_at(o.nodes, at)[:4]:
        c = s.coll_of_start.get(node)
        largest.append(f"{node.name} {nbytes} B" + (f" ({c.kind} of group {c.group})" if c else ""))
        groups += [c.group] if c else []
    bound = f"the {what}'s {reference} plus the {in_flight} bytes in flight" if in_flight is not None else \
        f"the {what}'s peak {reference} (max_in_flight_bytes=\"serial-peak\")"
    return ScheduleError(f"peak live bytes {live[at]} exceed {bound}; largest live there: {', '.join(largest)}",
                         node=o.nodes[at],
                         group=groups[0] if len(set(groups)) == 1 else None, position=at)


def check_compute_order(before: list[fx.Node], after: list[fx.Node]) -> None:
    """Raise ScheduleError unless ``after``, a reordering of ``before``, keeps the
    compute-order guarantee. Nodes fall in three classes, read off each node:

    * free: collective starts and waits, cheap nodes (aliases, casts, copies)
      and nodes a rewrite marked as a start's input chain: placed by the
      other guarantees;
    * late-only: elementwise ops (``torch.Tag.pointwise``) on collectives'
      results alone (waits, through free cheap nodes, with placeholders and
      attributes) whose every use is a start or another late-only or cheap node
      that feeds only starts: each keeps at least the compute it followed
      before it;
    * compute: everything else (placeholders, barriers and the output
      included): its relative order is exactly the order in ``before``.

    The error names the node that moved, its op, and its old and new position
    next to the compute it passed."""
    kind = _OrderClasses().of_each(before)   # one lookup per node from here on
    fixed_before = [n for n in before if kind[n] == "compute"]
    fixed_after = [n for n in after if kind[n] == "compute"]
    late = [n for n in before if kind[n] == "late-only"]
    if fixed_after == fixed_before and not late:   # Nodes compare by identity: the common case, no position needed
        return
    old, new = {n: i for i, n in enumerate(before)}, {n: i for i, n in enumerate(after)}
    rank_before = {n: i for i, n in enumerate(fixed_before)}
    rank_after = {n: i for i, n in enumerate(fixed_after)}
    for k, (ahead, behind) in enumerate(zip(fixed_after, fixed_before)):
        if ahead is not behind:   # the one displaced further moved; a tie blames the one now ahead
            earlier = rank_before[ahead] - k >= rank_after[behind] - k
            moved, passed = (ahead, behind) if earlier else (behind, ahead)
            raise ScheduleError(
                f"compute moved {'before' if earlier else 'after'} {passed.name} (op {passed.target}): given "
                f"order {moved.name} at {old[moved]}, {passed.name} at {old[passed]}; new order "
                f"{moved.name} at {new[moved]}, {passed.name} at {new[passed]}", node=moved, position=new[moved])
    seen_before = _compute_counts(before, kind)
    seen_after = _compute_counts(after, kind)
    for node in late:
        if seen_after[node] < seen_before[node]:
            passed = fixed_before[seen_after[node]]
            raise ScheduleError(
                f"elementwise compute carried with a start moved before {passed.name} (op {passed.target}), "
                f"which it followed: given order {node.name} at {old[node]}, {passed.name} at {old[passed]}; "
                f"new order {node.name} at {new[node]}, {passed.name} at {new[passed]}", node=node,
                position=new[node])


def _compute_counts(order: list[fx.Node], kind: dict[fx.Node, str]) -> dict[fx.Node, int]:
    """Per node of ``order``: how many compute nodes (``kind``: each node's class) stand before it."""
    counts, seen = {}, 0
    for node in order:
        counts[node] = seen
        seen += kind[node] == "compute"
    return counts


class _OrderClasses:
    """``check_compute_order``'s class of each node ("free", "late-only",
    "compute"), memoised: a pure function of the node and its neighbours."""

    def __init__(self):
        self._class: dict[fx.Node, str] = {}
        self._feeds: dict[fx.Node, bool] = {}

    def of(self, node: fx.Node) -> str:
        if node not in self._class:
            self._class[node] = self._classify(node)
        return self._class[node]

    def of_each(self, nodes: list[fx.Node]) -> dict[fx.Node, str]:
        """Node -> class, for every node of ``nodes`` (``of`` each, without a call per node;
        nodes classified on the way, as users of others, are in it too). Where the call
        target decides the class, one lookup per node (``_target_class``)."""
        known, classify = self._class, self._classify
        for node in nodes:
            if node in known:
                continue
            fixed = _target_class(node)
            if fixed is None:
                known[node] = classify(node)
            elif fixed == "compute unless marked":
                known[node] = "free" if in_input_chain(node) else "compute"
            else:
                known[node] = fixed
        return known

    def _classify(self, node: fx.Node) -> str:
        start, wait, barrier = role(node)
        if barrier is None and (start is not None or wait or is_cheap(node) or in_input_chain(node)):
            return "free"
        if (barrier is None and node.op == "call_function"
                and torch.Tag.pointwise in getattr(node.target, "tags", ())
                and _on_results_alone(node) and self._feeds_only_starts(node)):
            return "late-only"
        return "compute"

    def _feeds_only_starts(self, node: fx.Node) -> bool:
        """``node`` has uses, and each is a collective start, a late-only node, or
        a cheap or marked node that itself feeds only starts."""
        if node not in self._feeds:
            self._feeds[node] = bool(node.users) and all(self._toward_starts(u) for u in node.users)
        return self._feeds[node]

    def _toward_starts(self, user: fx.Node) -> bool:
        start, wait, _ = role(user)
        if start is not None:
            return True
        kind = self.of(user)
        return kind == "late-only" or (kind == "free" and not wait and self._feeds_only_starts(user))


# call target -> (target, ``_target_class``): the entry keeps the target alive (ids are not reused)
_CLASS_BY_TARGET: dict[int, tuple[object, str | None]] = {}


def _target_class(node: fx.Node) -> str | None:
    """What ``_OrderClasses._classify`` answers for every call_function node of
    ``node``'s target: "free", "compute unless marked" (free when a rewrite marked the
    node as an input chain), or None where it reads the node itself (not a
    call_function, a barrier or an op writing in place or into ``out=``, an elementwise op).
    Cached per call target."""
    if node.op != "call_function":
        return None
    entry = _CLASS_BY_TARGET.get(id(node.target))
    if entry is None or entry[0] is not node.target:
        entry = _CLASS_BY_TARGET[id(node.target)] = (node.target, _uncached_target_class(node))
    return entry[1]


def _uncached_target_class(node: fx.Node) -> str | None:
    if barrier_reason_when_compute_moves(node) is not None:
        return None   # a barrier, or a write in place or into out= (a barrier or not as the node stands)
    start, wait, _ = role(node)
    if start is not None or wait or is_cheap(node):
        return "free"
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return None
    return "compute unless marked"


def _on_results_alone(node: fx.Node) -> bool:
    """Whether every input of ``node`` is a wait, a placeholder, an attribute or
    a cheap node over those, and at least one is a wait."""
    found, frontier, seen = False, list(node._input_nodes), set()
    while frontier:
        i = frontier.pop()
        if i in seen:
            continue
        seen.add(i)
        _, wait, barrier = role(i)
        if wait:
            found = True
        elif i.op not in ("placeholder", "get_attr"):
            if not is_cheap(i) or barrier is not None:
                return False
            frontier.extend(i._input_nodes)
    return found


def _compute_between(o: _Order, first: int, last: int) -> fx.Node | None:
    """First node at positions first..last-1 outside every bundle, or None."""
    for node in o.nodes[first:last]:
        if node not in o.s.bundled:
            return node
    return None


def _check_waits(o: _Order) -> None:
    """Every wait comes before its first consumer; an all-gather's first wait placed comes
    just before the first consumer of any of its waits (with several waits, as coalesced
    all-gathers and a gather Inductor reads through several waits have, the first one
    completes the collective: the others may come with it or later)."""
    s, pos = o.s, o.pos
    for c in s.movable:
        for wait in c.waits:
            first = o.first[wait]
            if pos[wait] > first:
                raise o.fail(wait, f"wait of {c.kind} {c.start.name} comes after its first consumer "
                                   f"{o.nodes[first].name} (position {first})")
        if c.kind == "all_gather":
            wait = min(c.waits, key=pos.__getitem__)
            first = min(o.first[w] for w in c.waits)
            between = _compute_between(o, pos[wait] + 1, first)
            if between is not None:
                raise o.fail(wait, f"wait of all-gather {c.start.name} is not just before its first "
                                   f"consumer {o.nodes[first].name} (position {first}): {between.name} "
                                   "stands between")


def _check_consumer_order(o: _Order) -> None:
    s = o.s
    lanes: dict[tuple[str, int], list] = {}
    for c in s.movable:
        if c.kind == "all_gather":
            lanes.setdefault((c.group, s.region_of(c.start)), []).append(c)
    for starts in lanes.values():
        starts.sort(key=lambda c: o.pos[c.start])
        keys = list(map(o.consumer_key, starts))
        for before, after, key_before, key_after in zip(starts, starts[1:], keys, keys[1:]):
            if key_before > key_after:
                raise o.fail(after.start,
                             f"all-gather issued after {before.start.name} but consumed first (at "
                             f"{o.nodes[key_after[0]].name} vs {o.nodes[key_before[0]].name}): consumer order broken")


def _check_pinned(o: _Order, node: fx.Node, flight: InFlight, limit: int) -> int:
    """At spine ``node``: count a pinned collective it starts (``Structure.pinned``: it
    stays where it stands) and let go of one it completes; then, per group and kind with
    pinned collectives open, the collectives in flight across ``node`` (moved ones and
    pinned ones) must be within ``limit``, or, where the pinned ones alone reach it, be
    those alone (a moved one goes right before its wait there, across no spine node).
    Returns the most open of one group and kind."""
    c = o.s.pinned.get(node)
    if c is not None:
        flight.open_pinned(c)
    c = o.s.pinned_last_wait.get(node)
    if c is not None:
        flight.close_pinned(c)
    most = 0
    for (group, kind), standing in flight.pinned_counts.items():
        count = flight.count(group, kind)
        most = max(most, count)
        if standing and count > max(limit, standing):
            raise o.fail(node, f"{count - standing} {kind} collectives of group {group} in flight across it beside "
                               f"{standing} that stay where they stand (start and wait on two sides of a barrier), "
                               f"limit {limit}")
    return most


def _check_bounds(o: _Order, budget: Budget) -> tuple[InFlight, int]:
    s = o.s
    flight = InFlight(budget.held_of(s))
    waits_left = {c.start: len(c.waits) for c in s.movable}
    peak_count = 0
    here = 0   # s.pos of the last spine node
    bundled, pos, start_of, wait_of = s.bundled, s.pos, s.coll_of_start.get, s.coll_of_wait.get
    bounded = any(limit is not None for limit in budget.max_bytes.values())   # else ``here`` is not read
    pinned = s.pinned if budget.max_count is not None else {}
    nodes = o.nodes if bounded or pinned else \
        filter((s.coll_of_start.keys() | s.coll_of_wait.keys()).__contains__, o.nodes)
    for node in nodes:
        spine = node not in bundled
        if pinned and (node in pinned or node in s.pinned_last_wait or spine and flight.pinned_open):
            peak_count = max(peak_count, _check_pinned(o, node, flight, budget.max_count))
        if spine:
            here = pos[node]
            continue   # neither a start nor a wait (both are bundled)
        c = start_of(node)
        if c is not None:
            flight.open(c)
            count = flight.count(c.group, c.kind) - flight.pinned_counts.get((c.group, c.kind), 0)
            peak_count = max(peak_count, flight.count(c.group, c.kind))
            if budget.max_count is not None and count > budget.max_count:
                raise o.fail(node, f"{count} {c.kind} collectives of group {c.group} in flight, "
                                   f"limit {budget.max_count}")
            limit = budget.max_bytes.get(c.group)
            if limit is not None and flight.nbytes(c.group) > limit:
                others = flight.open_besides(c)
                due = max(s.due(c), here)
                if others and not budget.fits_headroom(flight.total, here, due):
                    raise o.fail(node, f"{flight.nbytes(c.group)} bytes in flight in group {c.group}, "
                                       f"limit {limit}, with {others[0].start.name} still open"
                                       + (f", and {flight.total} bytes in flight exceed the memory headroom "
                                          f"{budget.headroom.least(here, due)}" if budget.headroom else ""))
        c = wait_of(node)
        if c is not None:
            waits_left[c.start] -= 1
            if waits_left[c.start] == 0:
                flight.close(c)
    return flight, peak_count


def serial_order(s: Structure, asap: bool = False) -> list[fx.Node]:
    """The serial order of the graph of ``s``, built here and not by the scheduler,
    so that a scheduler bug cannot loosen the check meant to catch it.

    The spine (every node outside the movable collectives' bundles) keeps its
    order, and no two collectives are in flight at once: every collective other
    than an all-gather is issued where it stands in ``s`` (later only if an
    input is placed later) and waited right after its start; an all-gather is
    issued right before its wait, just before the first node that reads it (a
    spine node, another collective's start bundle, or the barrier or output
    closing its region). ``verify``'s memory reference for a graph as it stands;
    also the pipeline's fallback for a graph whose chained collectives the core
    could not place within the guarantees: it keeps every one by construction.

    ``asap``: every collective other than an all-gather is issued as soon as its
    inputs are placed and its region is open instead. Then every order of one
    graph with the same spine (a schedule of it) has the same serial order: the
    reference of the "auto" budget's memory headroom, which ``schedule`` (on the
    graph before) and ``verify`` (on the graph after) must compute alike."""
    return _Serial(s, asap).run()


class _Serial:
    def __init__(self, s: Structure, asap: bool):
        self.s = s
        self.members = {m: c for c in s.movable for m in s.start_bundle[c.start]}
        self.members.update((m, s.coll_of_wait[w]) for w, bundle in s.wait_bundle.items() for m in bundle)
        self.order: list[fx.Node] = []
        self.placed: set[fx.Node] = set()
        self.missing = {c.start: len(s.bundle_inputs[c.start]) for c in s.movable}
        self.blocked_on: dict[fx.Node, list[fx.Node]] = {}
        for c in s.movable:
            for i in s.bundle_inputs[c.start]:
                self.blocked_on.setdefault(i, []).append(c.start)
        before = None   # each start also waits for the spine node it follows in ``s``
        for node in s.coll_of_start if asap else s.nodes:   # (asap reads no ``before``: the starts alone)
            c = s.coll_of_start.get(node)
            if c is not None and c.kind != "all_gather":
                region = s.region_of(node)   # with asap: for the barrier that opens its region
                anchor = (s.barriers[region - 1] if region else None) if asap else before
                if anchor is not None:
                    self.missing[node] += 1
                    self.blocked_on.setdefault(anchor, []).append(node)
            if node not in self.members:
                before = node
        self.due_at: dict[fx.Node, list[fx.Node]] = {}    # spine node -> waits due there
        for wait, target in s.spine_target.items():
            self.due_at.setdefault(target, []).append(wait)
        self.ready: list[tuple[int, str, fx.Node]] = []   # heap: ready starts, by position in ``s``
        for c in s.movable:
            if not self.missing[c.start]:
                self._became_ready(c.start)

    def _became_ready(self, start: fx.Node) -> None:
        if self.s.coll_of_start[start].kind != "all_gather":   # an all-gather is issued when read
            heapq.heappush(self.ready, (self.s.pos[start], start.name, start))

    def _place(self, node: fx.Node) -> None:
        self.order.append(node)
        self.placed.add(node)
        for start in self.blocked_on.get(node, ()):
            self.missing[start] -= 1
            if not self.missing[start]:
                self._became_ready(start)

    def _emit(self, start: fx.Node) -> None:
        """Issue the collective of ``start`` and wait it, after what its start bundle reads."""
        self._prepare(start)
        self._put(start)

    def _prepare(self, start: fx.Node) -> None:
        """Place what the start bundle of ``start`` reads (collectives it chains on:
        issued and waited now, so that they stand before anything placed after)."""
        bundle = self.s.start_bundle[start]
        for member in bundle:   # in the order each member reads its inputs (the consumer order's ties)
            for i in member._input_nodes:
                if i not in self.members or self.members[i].start is not start:
                    self._ensure(i)

    def _put(self, start: fx.Node) -> None:
        s = self.s
        if start in self.placed:
            return
        for member in s.start_bundle[start]:
            self._place(member)
        for wait in s.in_wait_order(s.coll_of_start[start].waits):
            for member in s.wait_bundle[wait]:
                self._place(member)

    def _ensure(self, node: fx.Node) -> None:
        if node in self.placed:
            return
        if node not in self.members:
            raise AssertionError(f"overlapc internal error: serial order reads {node.name} before it is placed")
        self._emit(self.members[node].start)

    def _due(self, node: fx.Node) -> list[fx.Node]:
        """Starts of the collectives to complete before spine node ``node``: other
        kinds first, then all-gathers in the order ``node`` reads them, then
        all-gathers due because their region ends at ``node``."""
        s = self.s
        found: dict[fx.Node, None] = {}
        for i in node._input_nodes:
            c = self.members.get(i)
            if c is not None and i not in self.placed:
                found[c.start] = None
        if node in self.due_at:
            for wait in s.in_wait_order(self.due_at[node]):
                if wait not in self.placed:
                    found[s.coll_of_wait[wait].start] = None
        if not found:   # most spine nodes
            return []
        gathers = [st for st in found if s.coll_of_start[st].kind == "all_gather"]
        return [st for st in found if s.coll_of_start[st].kind != "all_gather"] + gathers

    def _flush(self) -> None:
        """Issue and wait every ready collective other than an all-gather, in graph order."""
        while self.ready:
            start = heapq.heappop(self.ready)[2]
            if start not in self.placed:
                self._emit(start)

    def run(self) -> list[fx.Node]:
        s, members, placed, due_at = self.s, self.members, self.placed, self.due_at
        order, blocked_on = self.order, self.blocked_on
        spine = [n for n in s.nodes if n not in members]
        last = len(spine) - 1
        for index, node in enumerate(spine):
            # ``_due`` only where ``node`` reads a bundle member or has waits due (few spine nodes)
            if node in due_at or not members.keys().isdisjoint(node._input_nodes):
                due = self._due(node)
                for start in due:   # chains first: what they pull in is read before ``node``
                    self._prepare(start)
                for start in due:
                    self._put(start)
            order.append(node)   # ``_place``
            placed.add(node)
            for start in blocked_on.get(node, ()):
                self.missing[start] -= 1
                if not self.missing[start]:
                    self._became_ready(start)
            if self.ready and (node.op != "placeholder" or index == last or spine[index + 1].op != "placeholder"):
                self._flush()
        return self.order

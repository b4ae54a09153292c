"""The scheduling core: one pass that keeps the spine's order and places collectives.

``schedule_order(structure, budget)`` walks the spine (every node outside the
collectives' bundles, see ``structure.py``) in its order and places around it:

* other collectives (reduce-scatter, all-reduce, all-to-all) are issued as
  soon as their inputs are placed (against a "serial-peak" reference that keeps
  them where they stand, ``Headroom.in_place``, only where what they hold fits
  the headroom, else once the spine node they followed is placed: ``_defer``);
  when one does not fit the budget, the oldest open non-all-gather collectives
  of its group are waited first;
* all-gathers are issued in consumer order per group and region, each as
  soon as its inputs are placed and it fits the room the budget leaves to
  all-gathers (``Budget.gather_room``); one that never fits is issued right
  before its wait, after waiting what else of its group is open;
* under ``issue="per-kernel"`` a start is ready no earlier than its kernel point
  (``kernel_points``), right before that kernel, after the waits due there;
* every wait is placed just before its target (first real consumer, or the
  barrier closing its region, or the output) unless the budget waited it
  earlier; all-gathers are never waited early for room. Waits due at one
  target go as in the serial order: other kinds first (a start issued then
  pulls in its chain), then all-gathers, each kind by ``Structure.wait_key``.

Room: the count bound always; the byte budget, or, when the budget has a
headroom (``max_in_flight_bytes="auto"``), the headroom from the spine node
last placed to the collective's wait target: where the graph's memory is far
below its peak, collectives go ahead further than the byte budget alone allows.
With ``max_in_flight_bytes="serial-peak"`` (``Budget.within_peak``) the
headroom alone: a collective other than an all-gather that does not fit it is
waited right after its start (as in the serial order), an all-gather that does
not fit is issued when its result is due.

Modes: "schedule" (the above), "sink" (starts stay, waits move, no budget), "serial"
(all-gathers issued right before their wait, every other collective waited right after
its start, at the schedule's chain points; ``verify``'s memory reference is
``invariants.serial_order``, built without this core).
Deterministic: ties break on graph positions, never on hashes.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from itertools import accumulate

import torch.fx as fx

from overlapc.passes.chain_points import ChainPoints
from overlapc.passes.collectives import Collective
from overlapc.passes.inflight import Budget, InFlight, piece_of
from overlapc.passes.invariants import fail
from overlapc.passes.kernel_points import KernelPoints
from overlapc.passes.memory import Headroom
from overlapc.passes.structure import Structure

UNBOUNDED = Budget(None, {}, {})
MODES = ("schedule", "sink", "serial")
# Why a start or wait stands where it is (recorded per node; the report prints them).
REASONS = {
    "inputs ready": "issued as soon as its inputs were placed",
    "kernel point": "issued right before the kernel it runs under (issue=\"per-kernel\")",
    "count bound": "held back by max_in_flight until an earlier one was waited",
    "byte budget": "held back by the byte budget (or the memory headroom)",
    "consumer order": "held behind an all-gather of its group whose consumer comes first",
    "forced by consumer": "did not fit earlier: issued when its result was due",
    "chain point": "reads another collective's result: issued at its chain point",
    "not moved": "left where it was (sink mode)",
    "serial": "waited right after its start (serial reference)",
    "before consumer": "waited just before its first consumer",
    "before chained start": "waited just before the collective start that reads it",
    "before output": "waited before the graph output",
    "before barrier": "waited before the barrier that closes its region",
    "early for room": "waited early to make room in the in-flight budget",
    "no headroom": "waited right after its start: in flight it would raise the serial order's peak",
    "pinned ahead": "waited right after its start: one that stays where it is starts before it is due",
    "kept serial": "placed as in the serial order (any kind but all-gather: where it stood): scheduled with "
                   "overlap it broke a guarantee (a WARNING says which)",
}


def schedule_order(s: Structure, budget: Budget = UNBOUNDED, mode: str = "schedule",
                   kinds: tuple[str, ...] | None = None,
                   reasons: dict[fx.Node, str] | None = None, late_chains: bool = False,
                   chain_room: Headroom | None = None, serial: frozenset[fx.Node] = frozenset()) -> list[fx.Node]:
    """A new order of ``s.nodes``: the spine in its order, collectives placed by ``mode``
    under ``budget``. ``kinds`` limits which collectives move (default all). ``reasons``, when
    given, receives why each start and wait was placed where it is (``REASONS``).
    ``late_chains``: chain points at the latest spine node a chained start may go instead of
    halfway, which keeps the all-gathers ahead of it in its group due there too (the
    pipeline's second try). ``chain_room``: the headroom under the serial order's peak
    (``memory.Headroom``): a chain point moves from halfway to the first spine node where
    the chained start's own buffers fit it (``_plan_gates``). ``serial``: starts placed as
    the "serial" mode places them (an all-gather when its result is due, any other kind
    waited right after its start and, under ``Headroom.in_place``, issued no earlier than
    where it stands unless chained), the rest scheduled: the pipeline's local degradation."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return _Core(s, budget, mode, kinds, reasons, late_chains, chain_room, serial).run()


class _Core(ChainPoints, KernelPoints):
    def __init__(self, s: Structure, budget: Budget, mode: str, kinds: tuple[str, ...] | None,
                 reasons: dict[fx.Node, str] | None, late_chains: bool = False,
                 chain_room: Headroom | None = None, serial: frozenset[fx.Node] = frozenset()):
        self.late_chains, self.chain_room, self.serial = late_chains, chain_room, serial
        self.s, self.budget, self.mode = s, budget, mode
        self.reasons = reasons if reasons is not None else {}
        managed = [c for c in s.movable if kinds is None or c.kind in kinds]
        self.managed = {c.start: c for c in managed}
        self.move_starts = mode != "sink"
        self.moving = self._moving(managed)   # members of bundles placed by the core, not the spine
        self.spine = [n for n in s.nodes if n not in self.moving]
        self.held = budget.held_of(s)
        self.flight = InFlight(self.held)
        self.order: list[fx.Node] = []
        self.placed: set[fx.Node] = set()
        self.issued: set[fx.Node] = set()
        self.waits_left = {c.start: len(c.waits) for c in managed}
        self.region = 0
        self.dirty = True
        self.here = self.room_from = 0   # s.pos of the spine node placed last, of the last that is no wait
        self.step, self.placing = 0, None   # index in self.spine of the spine node placed next; it, while its waits go
        self.ready_step: dict[fx.Node, int] = {}
        self.held_back: dict[fx.Node, str] = {}
        self.deferred: set[fx.Node] = set()   # starts held back by the byte budget (``_defer``, ``_issue_ready``)
        self._fixed: dict[fx.Node, tuple[int, bool]] = {}   # start -> (s.due, counted whole): ``_in_headroom``
        self.trying: list[int] = []   # s.pos of the starts ``_try_issue`` is making room for
        self.ahead: dict[fx.Node, int] = {}   # open starts issued ahead of where they stood -> uncounted output bytes
        self.other_starts: dict[str, list[int]] = {}   # group -> s.pos of its other kinds' starts, rising
        for c in managed:
            if c.kind != "all_gather":
                self.other_starts.setdefault(c.group, []).append(s.pos[c.start])

        # Chains: a start bundle that reads a moving wait's bundle is *gated*: it
        # is issued at a chain point, a spine node between the earliest point its
        # upstream collectives may go and the point it must be complete, and
        # the chained waits are placed right before it (their first consumer).
        self.gate: dict[fx.Node, int] = {}                   # start -> spine index
        self.chained: set[fx.Node] = set()                   # waits placed by their gated reader
        self.readers: dict[fx.Node, list[fx.Node]] = {}      # chained wait -> the gated starts reading it
        self.gate_open: set[fx.Node] = set()                 # gated starts whose chain point has come
        if self.move_starts:
            self._plan_gates(managed)
        self._plan_kernel_points(managed)
        self._plan_targets(managed)

        self.ready: list[tuple[int, str]] = []              # other kinds, by position
        self.later: dict[int, list[fx.Node]] = {}            # region -> ready starts not yet in ready
        self.missing: dict[fx.Node, int] = {}
        self.blocked_on: dict[fx.Node, list[fx.Node]] = {}
        self.by_name: dict[str, Collective] = {}
        self.lanes: dict[tuple[str, int], list[fx.Node]] = {}  # all-gathers in consumer order
        self.head: dict[tuple[str, int], int] = {}
        self.key = dict(s.key)
        if self.move_starts:
            self._plan_readiness(managed)

    def _moving(self, managed: list[Collective]) -> set[fx.Node]:
        """Bundle members the core places (the rest is the spine): every start and
        wait bundle, except in "sink" mode starts and the waits already in place
        (no compute between them and their target)."""
        s, moving = self.s, set()
        if self.move_starts:
            for c in managed:
                moving.update(s.start_bundle[c.start])
                for wait in c.waits:
                    moving.update(s.wait_bundle[wait])
            return moving
        compute_before = list(accumulate((int(node not in s.bundled) for node in s.nodes), initial=0))
        for c in managed:
            for wait in c.waits:
                if compute_before[s.pos[s.target[wait]]] != compute_before[s.pos[wait] + 1]:
                    moving.update(s.wait_bundle[wait])
        return moving

    def _plan_targets(self, managed: list[Collective]) -> None:
        """The spine node each moving wait (not chained) is placed before, and the
        spine node each gated start is issued before, in a deterministic order."""
        s = self.s
        self.waits_at: dict[fx.Node, list[fx.Node]] = {}    # spine node -> waits placed just before it
        for c in managed:
            for wait in c.waits:
                if wait not in self.moving or wait in self.chained:
                    continue
                target = s.spine_target[wait] if self.move_starts else s.target[wait]
                self.waits_at.setdefault(target, []).append(wait)
        for waits in self.waits_at.values():   # as the serial order has them: other kinds (their chains) first
            if len(waits) > 1:
                waits.sort(key=lambda wait: (s.coll_of_wait[wait].kind == "all_gather", s.wait_key(wait)))
        self.gates_at: dict[fx.Node, list[fx.Node]] = {}
        for start, index in self.gate.items():
            self.gates_at.setdefault(self.spine[index], []).append(start)
        for starts in self.gates_at.values():
            starts.sort(key=s.pos.__getitem__)

    def _plan_readiness(self, managed: list[Collective]) -> None:
        """Readiness: a start may issue once every external input of its bundle is
        placed (and, when gated, its chain point is reached). An input that is a
        chained wait counts once that collective is issued (issuing the gated
        start places the wait first); any other wait's member counts once placed
        (at its spine target, or earlier when waited for room). All-gathers (but
        those placed serially) go in lanes (group, region) in consumer order, an
        upstream all-gather consumed at its gated reader's chain point, where the
        walk issues that reader (``_issue_ranks``)."""
        s = self.s
        for c in managed:
            self.by_name[c.start.name] = c
            inputs = [self._producer(i, c.start) for i in s.bundle_inputs[c.start]]
            if c.start in self.serial:   # placed serially: issued where it stood, as the reference has it
                inputs += self._serial_anchors(c)
            self.missing[c.start] = len(inputs) + (c.start in self.gate) + (c.start in self.kernel_gate)
            for node in inputs:
                self.blocked_on.setdefault(node, []).append(c.start)
            if c.kind == "all_gather" and c.start not in self.serial:   # placed serially: issued when due
                self.lanes.setdefault(self._lane(c), []).append(c.start)
        ranks = {point: self._issue_ranks(point) for point in self.gates_at}   # chain point -> its ranks
        for start, index in self.gate.items():
            point = self.spine[index]
            for i in s.bundle_inputs[start]:
                wait = s.wait_of_member.get(i)
                if wait in self.chained and s.coll_of_wait[wait].kind == "all_gather":
                    up = s.coll_of_wait[wait].start
                    key = (s.pos[point], ranks[point][start] - len(s.nodes), s.pos[up])
                    self.key[up] = min(self.key[up], key)
        for lane, starts in self.lanes.items():
            starts.sort(key=lambda start: (self.key[start], s.pos[start]))
            self.head[lane] = 0
        self.lane_order = sorted(self.lanes, key=lambda lane: (lane[1], lane[0]))

    def _serial_anchors(self, c: Collective) -> list[fx.Node]:
        """Spine nodes that ``c``, placed serially and not gated, follows as the serial
        reference has it: the one it followed in the graph handed in (``_place_anchor``),
        and, for a collective other than an all-gather, the spine node each all-gather whose
        result its bundle reads is due at (the reference issues that all-gather right
        before that node, and what else it makes ready after it)."""
        anchor = self._place_anchor(c)
        found = [] if anchor is None else [anchor]
        if c.kind == "all_gather" or c.start in self.gate:
            return found
        s = self.s
        for i in s.bundle_inputs[c.start]:
            wait = s.wait_of_member.get(i)
            if wait is not None and i in self.moving and wait not in self.chained \
                    and s.coll_of_wait[wait].kind == "all_gather":
                found.append(s.spine_target[wait])
        return found

    def _issue_ranks(self, node: fx.Node) -> dict[fx.Node, int]:
        """Starts the walk issues at spine ``node``, numbered in the order it issues them
        (``run``): gated starts kept serial, the collectives of the waits due there
        (``waits_at``'s order), the other gated starts; each after the gated starts it reads.
        An all-gather read at a chain point is consumed in that order: its lane follows it."""
        s, gates, ranks = self.s, self.gates_at.get(node, []), {}
        due = [s.coll_of_wait[wait].start for wait in self.waits_at.get(node, ())]
        stack = [(start, False) for start in reversed([g for g in gates if g in self.serial] + due + gates)]
        while stack:   # depth first: each start after the gated starts it reads
            start, expanded = stack.pop()
            if start not in ranks and expanded:
                ranks[start] = len(ranks)
            elif start not in ranks:
                ups = [s.coll_of_wait[s.wait_of_member[i]].start for i in reversed(s.bundle_inputs[start])
                       if s.wait_of_member.get(i) in self.chained]
                stack += [(start, True)] + [(up, False) for up in ups if up in self.gate]
        return ranks

    def _place_anchor(self, c: Collective) -> fx.Node | None:
        """Under a "serial-peak" reference that keeps collectives other than all-gathers in place
        (``Headroom.in_place``), for one: the spine node it followed in the graph handed in (None:
        none); else None. A gated ``c`` ready early (waited for room) waits for it too."""
        room = self.budget.headroom
        if not (self.budget.within_peak and room is not None and room.in_place) or c.kind == "all_gather":
            return None
        s, at = self.s, self.s.pos[c.start]
        while at > 0:
            at -= 1
            if s.nodes[at] not in self.moving:
                return s.nodes[at]
        return None

    def _defer(self, c: Collective) -> bool:
        """Hold back ready ``c`` until the spine node it followed in the graph handed in
        (``_place_anchor``), or under "serial-peak" the one whose due waits made it ready (the
        asap reference issues it after that node), when what it holds (its input chain's and its
        own output, its input until its wait) does not fit the headroom from here to its wait.
        True when held back: ready again once that node is placed, it goes as the reference has it."""
        anchor = self._place_anchor(c)
        if anchor is None and self.budget.within_peak and self.placing is not None:
            anchor = self.placing   # made ready by waits due at the spine node placed next
        if anchor is None or anchor in self.placed or self._in_headroom(c):
            return False
        self.deferred.add(c.start)
        self.missing[c.start] += 1
        self.blocked_on.setdefault(anchor, []).append(c.start)
        return True

    # -- bookkeeping -----------------------------------------------------------------
    def _producer(self, node: fx.Node, reader: fx.Node) -> fx.Node:
        """What ``reader``'s readiness waits for: for a chained wait's member read
        by its gated start, the start of the wait's collective, else ``node``."""
        wait = self.s.wait_of_member.get(node)
        if wait in self.chained and reader in self.gate:
            return self.s.coll_of_wait[wait].start
        return node

    def _release(self, region: int) -> None:   # region opened: its ready starts onto the heap
        for start in self.later.pop(region, ()):
            heapq.heappush(self.ready, (self.s.pos[start], start.name))

    def _lane(self, c: Collective) -> tuple[str, int]:   # all-gathers in consumer order per group and region
        return c.group, self.s.region_of(c.start)

    def _place(self, node: fx.Node) -> None:
        self.order.append(node)
        self.placed.add(node)
        for start in self.blocked_on.get(node, ()):
            self._became_ready(start)

    def _became_ready(self, start: fx.Node) -> None:
        self.missing[start] -= 1
        if self.missing[start]:
            return
        self.dirty = True
        self.ready_step[start] = self.step
        if self.managed[start].kind != "all_gather" and start not in self.issued:
            if self.s.region_of(start) <= self.region:
                heapq.heappush(self.ready, (self.s.pos[start], start.name))
            else:
                self.later.setdefault(self.s.region_of(start), []).append(start)

    def _issue(self, c: Collective, reason: str | None = None) -> None:
        self.issued.add(c.start)   # first: a chain point reached while its inputs are placed must not issue it again
        for node in self.s.bundle_inputs[c.start]:
            self._ensure(node)
        if reason is None:
            reason = ("kernel point" if c.start in self.kernel_gate else "inputs ready") \
                if self.ready_step.get(c.start) == self.step or c.kind != "all_gather" \
                else self.held_back.get(c.start, "consumer order")
        self.reasons[c.start] = reason
        for member in self.s.start_bundle[c.start]:
            self._place(member)
        self.flight.open(c)
        if self.budget.within_peak and not self.s.holds[c.start] and self.s.pos[c.start] > self.here:
            self.ahead[c.start] = self.budget.headroom.liveness.size.get(c.start, 0)
        if c.kind == "all_gather" and c.start not in self.serial:
            lane = self._lane(c)
            starts = self.lanes[lane]
            while self.head[lane] < len(starts) and starts[self.head[lane]] in self.issued:
                self.head[lane] += 1
        if self.mode == "serial" and c.kind != "all_gather":
            self._wait(c, "serial")
        elif c.start in self.serial and c.kind != "all_gather":
            self.reasons[c.start] = "kept serial"
            self._wait(c, "kept serial")

    def _ensure(self, node: fx.Node) -> None:
        """Place ``node`` now if it is a bundle member not yet placed (something
        placed next reads it): issue its collective, and wait it for a wait's member."""
        if node in self.placed:
            return
        start = self.s.start_of_member.get(node)
        wait = self.s.wait_of_member.get(node)
        if node not in self.moving or (start is None and wait is None):
            raise AssertionError(f"overlapc internal error: {node.name} is read before it is placed")
        c = self.managed[start] if start is not None else self.s.coll_of_wait[wait]
        if c.start not in self.issued:
            self._force_issue(c)
        if wait is not None:
            self._wait(c, "before chained start" if wait in self.chained else "before consumer")

    def _pass_gate(self, start: fx.Node) -> None:
        """The walk reached gated ``start``'s chain point: issue it if its lane lets it."""
        self._open_gate(start)
        if start not in self.issued and self._lane_ready(self.managed[start]):
            self._force_issue(self.managed[start], gathers=False, reason="chain point")

    def _open_gate(self, start: fx.Node) -> None:
        """The chain point of gated ``start`` has come (once): it may issue when its inputs are placed."""
        if start not in self.gate_open:
            self.gate_open.add(start)
            self._became_ready(start)

    def _wait_one(self, wait: fx.Node, reason: str) -> None:
        c = self.s.coll_of_wait[wait]
        self.reasons[wait] = reason
        for member in self.s.wait_bundle[wait]:
            self._place(member)
        self.waits_left[c.start] -= 1
        if self.waits_left[c.start] == 0:
            self.flight.close(c)
            self.ahead.pop(c.start, None)
            self.dirty = True
        for reader in self.readers.get(wait, ()):
            # a chained wait placed before its reader's chain point (for room): the reader's
            # chain point is now, else the waited result stays live uncounted until then; a
            # reader other than an all-gather goes at once if ready (it frees that result)
            self._open_gate(reader)
            if not self.missing[reader] and reader not in self.issued and self.managed[reader].kind != "all_gather" \
                    and not self._ready_before(reader) and not self._defer(self.managed[reader]):
                self._try_issue(self.managed[reader])

    def _wait(self, c: Collective, reason: str) -> None:
        """Place every wait of ``c`` not yet placed, in wait order."""
        for wait in self.s.in_wait_order(c.waits):
            if wait not in self.placed:
                self._wait_one(wait, reason)

    # -- the budget ----------------------------------------------------------------------
    def _count_full(self, c: Collective, ahead: bool = True) -> bool:
        """Whether issuing ``c`` now would open more than ``max_count`` collectives of its
        group and kind, not counting those its issue waits first (``_waited_first``), and
        counting the pinned ones open now or (``ahead``) starting before ``c`` is due (they
        stay where they stand: ``c`` may not be in flight across their start)."""
        limit = self.budget.max_count
        return limit is not None and self.flight.adds_one(c) and self.flight.count(c.group, c.kind) \
            + (self._pinned_ahead(c) if ahead else 0) - self._waited_first(c) >= limit

    def _pinned_ahead(self, c: Collective) -> int:
        """Pinned collectives of ``c``'s group and kind whose start lies after the spine
        node placed last and before the spine node where ``c`` is due."""
        starts = self.s.pinned_starts.get((c.group, c.kind))
        if not starts:
            return 0
        due = max(self.s.due(c), self.here)
        return max(0, bisect_left(starts, due) - bisect_right(starts, self.here))

    def _waited_first(self, c: Collective) -> int:
        """How many open collectives of ``c``'s group and kind issuing gated ``c`` closes
        first: its chained waits are placed right before it (``_ensure`` waits every wait of
        their collectives), so a count bound full of them leaves room for ``c``; held to
        it, ``c`` went later than its chain point, and with it the point where its upstream
        all-gather is consumed, past other all-gathers' consumers (consumer order broken)."""
        if c.start not in self.gate:
            return 0
        s, flight = self.s, self.flight
        ups = dict.fromkeys(s.coll_of_wait[s.wait_of_member[i]] for i in s.bundle_inputs[c.start]
                            if s.wait_of_member.get(i) in self.chained)
        return sum(1 for up in ups if up.group == c.group and up.kind == c.kind and flight.closes_one(up))

    def _bytes_over(self, c: Collective) -> bool:
        if self.budget.within_peak:
            return not self._in_headroom(c)
        limit = self.budget.max_bytes.get(c.group)
        return limit is not None and self.flight.nbytes(c.group) + self.held[c.start] > limit \
            and not self._in_headroom(c)

    def _in_headroom(self, c: Collective) -> bool:
        """Whether ``c`` issued now keeps everything in flight within the headroom until its
        wait is due; under "serial-peak", counting only what ``c`` holds beyond the serial
        order's live bytes (``Headroom.fits_collective``), unless ``c`` is part of a chain
        (gated, or its result read at a chain point: a chain's buffers outlive the
        collective's own wait), a pipelined piece (pieces read and write slices whose
        storage the count per buffer does not follow) or an all-gather with no hiding
        kernel (``Structure.kernels``) between here and its consumer (its window would be
        pointwise ops that Inductor fuses into the consumer, past the wait: gpu_check's
        window check): then all it holds is counted, as under "auto"."""
        fixed = self._fixed.get(c.start)
        if fixed is None:   # what does not change while the core runs: where it is due, how it is counted
            whole = c.start in self.gate or any(w in self.chained for w in c.waits) \
                or piece_of(c) != c.start.name
            fixed = self._fixed[c.start] = (self.s.due(c), whole)
        due = max(fixed[0], self.here)
        if self.budget.within_peak and not fixed[1] and (
                c.kind != "all_gather" or self.s.kernels.between(self.here, due)):
            nodes = self.s.nodes
            others = self.flight.total + sum(self.ahead.values())
            return self.budget.headroom.fits_collective(c.start, others, nodes[self.here], nodes[due])
        since = self.room_from
        return self.budget.fits_headroom(self.flight.total + self.held[c.start], since, max(fixed[0], since))

    def _gather_fits(self, c: Collective, past_room: bool = True) -> bool:
        """May all-gather ``c`` be issued ahead of its consumer now (waiting open
        collectives of other kinds for room if needed)? ``past_room`` False: not beyond
        its group's room for all-gathers, even where the memory headroom would hold it."""
        if self.mode == "serial" or c.start in self.serial:
            return False
        if self._count_full(c):
            self.held_back[c.start] = "count bound"
            return False
        if self.budget.within_peak:
            fits = self._in_headroom(c)
            if not fits:
                self.held_back[c.start] = "byte budget"
            return fits
        room = self.budget.gather_room(c.group)
        if room is None or self.flight.gather_bytes(c.group) + self.held[c.start] <= room \
                or past_room and not self._other_before_due(c) and self._in_headroom(c):
            return True
        self.held_back[c.start] = "byte budget"
        return False

    def _other_before_due(self, c: Collective) -> bool:
        """Whether a collective of another kind in all-gather ``c``'s group stood between
        here and ``c``'s due position in the given order: the group's room is kept for
        it (``Budget.reserve``), since ``c``, an all-gather, cannot be waited early."""
        starts = self.other_starts.get(c.group)
        return bool(starts) and bisect_left(starts, max(self.s.due(c), self.here)) > bisect_right(starts, self.here)

    def _make_room(self, c: Collective, gathers: bool, forced: bool = False) -> None:
        """Wait the oldest open collectives of ``c``'s group until ``c`` fits or
        nothing more may be waited (all-gathers only when ``gathers``; one whose
        wait would not free its bytes yet (``_not_freed``) only when ``forced``:
        ``c``'s result is due)."""
        skip = None if forced or self.budget.within_peak or not self.s.goes_ahead else self._not_freed
        while self.flight.any_open(c.group):   # none open: nothing to wait, whether ``c`` fits or not
            same = self.flight.oldest(c.group, c.kind, skip=skip) if self._count_full(c) else None
            if same is not None:   # (None also where pinned ones alone fill the count: bytes next)
                victim = same if gathers or c.kind != "all_gather" else None
            elif self._bytes_over(c):
                victim = self.flight.oldest(c.group, gathers=gathers, skip=skip)
            else:
                return
            if victim is None:
                return
            self._wait(victim, "early for room")

    def _not_freed(self, c: Collective) -> bool:
        """Whether waiting open ``c`` now would not free what its held bytes count under a
        byte budget other than "serial-peak": a start that went ahead of compute
        (``Structure.goes_ahead``) holds its output until its reader whatever its wait,
        and here is still before where the given order allocated that output."""
        ahead = self.s.goes_ahead.get(c.start)
        return ahead is not None and self.here < ahead

    # -- issuing ---------------------------------------------------------------------------
    def _issue_ready(self) -> None:
        """Issue what may go now: ready non-all-gathers, then all-gathers that fit; nothing unless a
        start became ready, a wait freed room or a region opened. Under a byte limit (not
        "serial-peak"), a non-all-gather that would take its group past it with others in flight
        (all-gathers the headroom let run past its room, never waited early) waits for their
        waits, and no further all-gather of that group goes past the room meanwhile; when its
        own wait comes first it is issued then (``_force_issue``)."""
        if not self.move_starts or not self.dirty:
            return
        self.dirty = False
        no_room = []   # over a byte limit that only open all-gathers' waits can free: tried again then
        short: set[str] = set()   # the groups of those: no all-gather goes past its room meanwhile
        while self.ready:
            entry = heapq.heappop(self.ready)
            c = self.by_name[entry[1]]
            if c.start in self.issued or self._defer(c):
                continue
            if not self._try_issue(c):
                self.deferred.add(c.start)
                short.add(c.group)
                no_room.append(entry)
        for entry in no_room:
            heapq.heappush(self.ready, entry)
        for lane in self.lane_order:
            if lane[1] != self.region:
                continue
            starts = self.lanes[lane]
            while self.head[lane] < len(starts):
                c = self.managed[starts[self.head[lane]]]
                if self.missing[c.start] or not self._gather_fits(c, past_room=c.group not in short):
                    break
                self._make_room(c, gathers=False)
                if c.start in self.issued:
                    continue
                if not self.budget.within_peak and self._bytes_over(c) and self.flight.open_besides(c):
                    self.held_back[c.start] = "byte budget"   # what is open cannot be waited yet
                    break
                self._issue(c)

    def _try_issue(self, c: Collective) -> bool:
        """Issue ready ``c`` (not an all-gather) now, after waiting open collectives of other
        kinds for room; waited right after where only pinned ones starting before it is due
        fill the count, or, under "serial-peak", where in flight it would raise the peak. False,
        issuing nothing, when open ones fill the count, or over a byte limit with others in
        flight (``_issue_ready`` tries it again when a wait frees room)."""
        self.trying.append(self.s.pos[c.start])
        self._make_room(c, gathers=False)
        self.trying.pop()
        if c.start in self.issued:   # (a wait for room reached its chain point)
            return True
        full = self._count_full(c)
        if full and self._count_full(c, ahead=False):   # open pinned ones, never waited early
            self.held_back[c.start] = "count bound"
            return False
        over = self._bytes_over(c)
        if over and not self.budget.within_peak and self.flight.open_besides(c):
            return False
        self._issue(c, self.held_back.get(c.start, "byte budget") if c.start in self.deferred else None)
        if full:   # as in the serial order, before a pinned one starts (held, its input would stay live)
            self._wait(c, "pinned ahead")
        elif over and self.budget.within_peak:   # as in the serial order: in flight, it would raise the peak
            self._wait(c, "no headroom")
        return True

    def _ready_before(self, start: fx.Node) -> bool:
        """Whether a ready non-all-gather that stood before ``start`` is still to be issued."""
        at = self.s.pos[start]
        return bool(self.ready and self.ready[0][0] < at or self.trying and min(self.trying) < at)

    def _lane_ready(self, c: Collective) -> bool:
        """Whether ``c`` can be issued now with what must go before it: its inputs placed
        and, for an all-gather, those of every all-gather ahead of it in its lane (a gated
        all-gather whose lane is not ready issues through its lane later, at the latest
        when its result is due)."""
        if c.kind != "all_gather" or c.start in self.serial:
            return True
        lane, starts = self._lane(c), self.lanes[self._lane(c)]
        for start in starts[self.head[lane]:]:
            if self.missing[start] and start not in self.issued:
                return False
            if start is c.start:
                return True
        return True

    def _force_issue(self, c: Collective, gathers: bool = True, reason: str = "forced by consumer") -> None:
        """Issue ``c`` now (all-gathers before it in its lane first): its wait is
        due, or (``gathers`` False) its chain point came; open all-gathers are
        waited for room only when ``gathers``. At a chain point an all-gather goes
        only where it fits the bounds (``_gather_fits``; never one placed serially),
        else its lane issues it later, at the latest when its result is due. An all-gather
        placed serially is in no lane: it goes when its result is due, alone."""
        if c.kind != "all_gather" or c.start in self.serial:
            if c.kind != "all_gather" or gathers:
                self._make_room(c, gathers=c.kind == "all_gather", forced=gathers)
                if c.start not in self.issued:
                    self._issue(c, reason)
            return
        lane, starts = self._lane(c), self.lanes[self._lane(c)]
        while c.start not in self.issued:
            earlier = self.managed[starts[self.head[lane]]]
            if earlier.start in self.issued:   # being issued: its start bundle reads ``c``'s result
                raise fail(self.s, c.start, f"all-gather read by {earlier.start.name}, ahead of it in its lane")
            self._make_room(earlier, gathers=gathers, forced=gathers)
            if not gathers and not self._gather_fits(earlier):
                return
            if earlier.start not in self.issued:
                self._issue(earlier, reason if earlier is c else None)

    # -- the walk ---------------------------------------------------------------------------
    def run(self) -> list[fx.Node]:
        s = self.s
        placed, waits_at, gates_at = self.placed, self.waits_at, self.gates_at
        order, blocked_on, pos, barriers = self.order, self.blocked_on, s.pos, s.is_barrier
        spine, move_starts = self.spine, self.move_starts
        last = len(spine) - 1
        for index, node in enumerate(spine):
            self.step, self.placing = index, node   # ``placing``: its due waits go first
            gates = gates_at.get(node, ())
            for start in gates:   # kept serial: issued before what is due here, as where it stood
                if start in self.serial:
                    self._pass_gate(start)
            due = waits_at.get(node, ())
            for wait in due:
                if wait in placed:
                    continue
                c = s.coll_of_wait[wait]
                if self.move_starts and c.start not in self.issued:
                    self._force_issue(c)
                if wait not in placed:
                    self._wait_one(wait, _wait_reason(node, s))
            for start in self.kernel_gates_at.get(node, ()):   # its kernel is next: it may go now
                self._became_ready(start)
            if due or node in self.kernel_gates_at:
                self._issue_ready()   # a wait freed room, or a kernel point came: what may go goes now
            for start in gates:
                self._pass_gate(start)
            for i in node._input_nodes:
                if i not in placed:
                    self._ensure(i)
            self.step, self.placing = index + 1, None   # what this node makes ready can go right after it
            order.append(node)   # ``_place``
            placed.add(node)
            for start in blocked_on.get(node, ()):
                self._became_ready(start)
            self.here = pos[node]
            self.room_from = self.here if node not in s.bundled else self.room_from
            self._pass_pinned(node)
            if not move_starts and node in self.managed:
                self.flight.open(self.managed[node])
                self.reasons[node] = "not moved"
            if node in barriers:
                self.region += 1
                self._release(self.region)
                self.dirty = True
            if node.op == "placeholder" and index < last and spine[index + 1].op == "placeholder":
                continue   # keep placeholders together at the top
            if self.dirty and move_starts:
                self._issue_ready()
        if len(self.order) != len(s.nodes):
            raise AssertionError("overlapc internal error: schedule lost nodes")
        return self.order

    def _pass_pinned(self, node: fx.Node) -> None:
        """Spine ``node`` was placed: count a pinned collective it starts, let go of one it completes."""
        c = self.s.pinned.get(node)
        if c is not None:
            self.flight.open_pinned(c)
        c = self.s.pinned_last_wait.get(node)
        if c is not None:
            self.flight.close_pinned(c)
            self.dirty = True


def _wait_reason(target: fx.Node, s: Structure) -> str:
    if target.op == "output":
        return "before output"
    return "before barrier" if target in s.is_barrier else "before consumer"

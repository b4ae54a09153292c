"""Chain points: where the scheduling core issues a start that reads another collective's wait.

A start bundle that reads a moving wait's bundle (a *chain*: HSDP's reduce-scatter then
all-reduce, an all-gather of an all-reduce's result) is *gated*: the core issues it at a
chain point, a spine node between the earliest point its upstream collectives may go and
the point it must be complete, and places the chained waits right before it.
``ChainPoints`` plans them once, before the walk (``_plan_gates``), for ``scheduler._Core``,
which it is a part of: it reads and fills the core's state (``s``, ``spine``, ``moving``,
``serial``, ``late_chains``, ``chain_room``; ``gate``, ``chained``, ``readers``).
Deterministic: positions and graph order only.
"""
from __future__ import annotations

import bisect

import torch.fx as fx

from overlapc.passes.collectives import Collective
from overlapc.passes.memory import SpineRoom


class ChainPoints:
    """The chain-point planning of ``scheduler._Core`` (a mixin: the core's state is ``self``)."""

    def _plan_gates(self, managed: list[Collective]) -> None:
        """Chain points, in spine indices. For a start B reading chained waits:
        lo = the earliest index at which B's inputs can all be there (its spine
        inputs placed, other waits at their spine targets, upstream collectives
        issued: at their own chain point, or once their inputs are there);
        hi = the latest index B may go (no later than any chained wait's spine
        target, nor than where B itself must be complete); the chain point is
        halfway, splitting the compute between the upstream collective and B
        (at hi with ``late_chains``), or, with a ``chain_room``, the first index
        from there on where B's own buffers (its upstream results and what its
        start bundle allocates, beyond the bytes in flight that count them while
        the chain passes from one collective to the next) fit the headroom, else hi,
        or sooner where the upstream results may not stay live (``_roomy_gate``).
        Serial mode uses the same chain points. A start placed serially (``serial``) is
        issued where it stood: its chain point is the spine node it stood before (lo when
        that is earlier), and it is not gated when it stood after hi (a chained wait's
        spine target: that wait is placed there, before it, as where it stood).
        When hi < lo, B is not gated: its chained waits stay at their targets. An
        all-gather placed serially is issued when its result is due: its readers' lo is
        past that spine node (as in ``invariants.serial_order``)."""
        s, spine = self.s, self.spine
        if not any(i in s.wait_of_member for c in managed for i in s.bundle_inputs[c.start]):
            return   # no start reads a wait: nothing is chained
        index = {node: i for i, node in enumerate(spine)}
        spine_pos = self._spine_pos = [s.pos[node] for node in spine]
        room = None if self.chain_room is None or self.late_chains else SpineRoom(self.chain_room, spine_pos)
        body = next((i for i, node in enumerate(spine) if node.op != "placeholder"), 0)
        region_first = [body] + [index[b] + 1 for b in s.barriers]   # placeholders stay together
        deadline: dict[fx.Node, int] = {}
        for c in reversed(managed):   # downstream first
            ends = []
            for wait in c.waits:
                ends.append(index[s.spine_target[wait]])
                for u in s.consumers[wait]:
                    down = s.start_of_member.get(u)
                    if down is not None and down in deadline and u in self.moving:
                        ends.append(deadline[down])
            deadline[c.start] = min(ends)
        earliest: dict[fx.Node, int] = {}
        for c in managed:
            lo, hi, chained = region_first[s.region_of(c.start)], deadline[c.start], []
            for i in s.bundle_inputs[c.start]:
                wait = s.wait_of_member.get(i)
                if wait is None or i not in self.moving:
                    lo = max(lo, index.get(i, -1) + 1)   # (a moving start's member: issued on demand)
                elif s.coll_of_wait[wait].start in earliest and s.region_of(wait) == s.region_of(c.start):
                    chained.append(wait)
                    lo = max(lo, earliest[s.coll_of_wait[wait].start])
                    hi = min(hi, index[s.spine_target[wait]])
                else:
                    lo = max(lo, index[s.spine_target[wait]])
            stood = bisect.bisect_left(spine_pos, s.pos[c.start])   # the spine node it stood before
            gate = self._chain_point(c.start, lo, hi, stood, chained, room) if chained and lo <= hi else None
            if gate is not None:
                self.gate[c.start] = gate
                self.chained.update(chained)
                for wait in chained:
                    self.readers.setdefault(wait, []).append(c.start)
                earliest[c.start] = gate
            else:
                for wait in chained:   # not gated: each chained wait stays at its target
                    lo = max(lo, index[s.spine_target[wait]])
                earliest[c.start] = lo
            if c.kind == "all_gather" and c.start in self.serial:   # issued when due: read after that node
                earliest[c.start] = max(earliest[c.start], 1 + min(index[s.spine_target[w]] for w in c.waits))

    def _chain_point(self, start: fx.Node, lo: int, hi: int, stood: int, chained: list[fx.Node],
                     room: SpineRoom | None) -> int | None:
        """The chain point of ``start``, reading the waits ``chained``, between spine indices
        ``lo`` and ``hi`` (``_plan_gates``), or None: not gated. ``stood``: the index of the
        spine node it stood before in the graph handed in. Placed serially: there (``lo``
        when that is earlier), not gated when that is past ``hi``. Otherwise ``hi`` with
        ``late_chains``, halfway without a ``room``, else ``_roomy_gate`` from halfway; when
        nothing up to ``hi`` fits and it stood past ``hi`` (a chained wait's spine
        consumer stood between its upstream and it), not gated: as where it stood, its
        chained wait before that consumer and it after."""
        if start in self.serial:
            return max(lo, stood) if stood <= hi else None
        if self.late_chains:
            return hi
        halfway = lo + (hi - lo) // 2
        if room is None:
            return halfway
        gate = self._roomy_gate(room, halfway, hi, start, chained, stood)
        if gate is None:
            return None if stood > hi else hi
        return gate

    def _roomy_gate(self, room: SpineRoom, first: int, hi: int, start: fx.Node, chained: list[fx.Node],
                    stood: int) -> int | None:
        """The chain point of gated ``start`` (reading the waits ``chained``; it stood before
        spine index ``stood``) from spine index ``first`` (halfway) on: the first index up to
        ``hi`` where its chain's own bytes fit the headroom (``_chain_bytes``; with a chain
        point ahead of spine nodes ``start`` followed, also all it holds in flight) and, under
        "serial-peak" for a collective other than an all-gather, its output, allocated there,
        fits it at every spine node before ``stood`` (the graph's own order allocates it only
        there, and a wait placed early for room does not free it), unless an index before
        it has less headroom than the upstream results no held bytes count
        (``_uncounted_results``): the chain point goes there, the latest that does not keep
        those upstream collectives in flight, their results live, across that node. None
        when neither comes, or when that index would allocate the output too early."""
        need = self._chain_bytes(start, chained) + (self.s.held[start] if stood > hi else 0)
        # an all-gather is never waited early: counted in flight until its reader
        kept = self.budget.within_peak and self.managed[start].kind != "all_gather"
        output = self.chain_room.liveness.size.get(start, 0) if kept else 0
        uncounted = self._uncounted_results(chained, first)
        while first <= hi:
            fits = room.first_fitting(first, hi, need)
            short = room.first_short(first, hi if fits is None else fits, uncounted)
            gate = min([index for index in (fits, short) if index is not None], default=None)
            early = None if gate is None else room.first_short(gate, stood - 1, output)
            if early is None or gate == short:
                return gate if early is None else None
            first = early + 1
        return None

    def _uncounted_results(self, chained: list[fx.Node], first: int) -> int:
        """Bytes of the results of the collectives whose waits ``chained`` are, that their
        held bytes do not count (``structure.holds_output``: an all-reduce's, an
        all-to-all's, a reduce-scatter's). Their reader, the gated start's bundle, moves
        with the chain point, so until it those results stay live with the collectives
        in flight, where issuing and waiting them back to back frees them first. Not
        counted: a result that is live at spine index ``first`` in the graph handed in
        anyway (its collective stood before that node, and a spine node reads the result
        after any chain point: its wait's spine target is a consumer, not its region's end)."""
        s, size = self.s, self.chain_room.liveness.size

        def live_anyway(wait: fx.Node) -> bool:
            c = s.coll_of_wait[wait]
            return s.spine_target[wait] in s.consumers[wait] \
                and bisect.bisect_left(self._spine_pos, s.pos[c.start]) <= first
        ups = dict.fromkeys(s.coll_of_wait[w] for w in chained if not live_anyway(w))
        return sum(size.get(c.start, 0) for c in ups if not s.holds[c.start])

    def _chain_bytes(self, start: fx.Node, chained: list[fx.Node]) -> int:
        """Bytes that gated ``start``'s chain point adds beyond what is counted in
        flight: when its chained waits are placed and its bundle runs, the upstream
        results and what the bundle allocates (its input chain, its output) are
        live at once, while the bytes in flight just before (the upstream
        collectives held) or just after (``start`` held) count only part of them."""
        s, live = self.s, self.chain_room.liveness
        ups = list(dict.fromkeys(s.coll_of_wait[w].start for w in chained))
        own = [m for m in s.start_bundle[start] if live.root[m] is m] + ups
        counted = max(sum(s.held[up] for up in ups), s.held[start])
        return max(0, sum(live.size.get(node, 0) for node in own) - counted)

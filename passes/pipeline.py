"""run = [chunk, bucket] -> core -> invariants -> commit or roll back; verify; the presets.

    result = run(gm, config, estimator=None)   # a ScheduleResult; gm rescheduled in place
    gm = schedule(gm, config)                  # the same, returning gm

The ground floor: nothing here logs a report or reads a cost model. ``config``
is what scheduling reads (``ScheduleOptions``, ``options.py``), or an
``OverlapConfig``, read through its ``scheduling()``. What the chunk pass needs to
choose piece counts (``chunks="auto"``) is handed in as ``estimator``;
``overlapc.schedule`` (``overlapc/api.py``) builds it from the config's profile,
runs this, and logs the report from the result.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import warnings

import torch.fx as fx

from overlapc.passes import invariants, meta
from overlapc.passes.collectives import Collective, role
from overlapc.passes.duplicates import merge_repeated_waits
from overlapc.passes.inflight import Budget, auto_budget
from overlapc.passes.invariants import Peaks, ScheduleError, fail
from overlapc.passes.memory import Headroom, Liveness
from overlapc.passes.options import BYTE_MODES, PEAK_MODES, ScheduleOptions, as_options, is_plan
from overlapc.passes.rewrite import hoist_attributes
from overlapc.passes.scheduler import UNBOUNDED, schedule_order
from overlapc.passes.structure import Structure, apply_order

log = logging.getLogger("overlapc")

__all__ = ["ScheduleError", "ScheduleResult", "run", "schedule", "verify", "reorder_all_gathers", "limit_in_flight",
           "sink_waits"]


def check_graph(gm) -> None:
    """TypeError unless ``gm`` is a torch.fx.GraphModule."""
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"overlapc expects a torch.fx.GraphModule, got {type(gm).__name__}; "
                        "trace the function first (make_fx or torch.fx.symbolic_trace)")


def _prepare(gm: fx.GraphModule) -> None:
    """What a graph traced without tensor metadata needs (``torch.fx.symbolic_trace``):
    its parameter reads hoisted (``rewrite.hoist_attributes``), and a WARNING when its
    collectives carry no ``meta["val"]`` (their bytes then count as 0, so byte budgets
    and memory estimates bound nothing). Graphs without collectives are left alone."""
    starts = [n for n in gm.graph.nodes if role(n)[0] is not None]
    if not starts:
        return
    hoist_attributes(gm.graph)
    blind = [n.name for n in starts if "val" not in n.meta]
    if blind:
        log.warning("overlapc: %d of %d collectives (%s) have no meta[\"val\"] (a torch.fx.symbolic_trace "
                    "graph?): their bytes count as 0, so byte budgets and memory estimates bound nothing; "
                    "trace with make_fx, or run torch.fx.passes.shape_prop.ShapeProp on example inputs first",
                    len(blind), len(starts), ", ".join(blind[:3]) + (", ..." if len(blind) > 3 else ""))


@dataclasses.dataclass(frozen=True)
class _Placed:
    """What one run of the core did: how many movable collectives it placed,
    whether it reordered the graph, what the invariant check measured on the
    result (None when nothing was movable or only waits moved), why each start
    and wait stands where it is ((node name, reason), in graph order), and the
    graph's Structure it scheduled with (of the order before)."""

    collectives: int
    modified: bool
    peaks: Peaks | None = None
    reasons: tuple[tuple[str, str], ...] = ()
    structure: Structure | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleResult:
    """What ``run`` did to ``gm``.

    collectives: movable collectives the core placed (0: nothing movable, or the
        schedule was disabled or rolled back). modified: the core changed the order.
    peaks: what the invariant check measured on the scheduled order (None when
        nothing was checked). before: node names in the order just before the core
        ran (after bucketing and chunking rewrote the graph, that graph's order).
    duplicates, buckets, chunks, regather: this run's rewrite notes (``merge_duplicates``'
        merged names, ``BucketNote``s, ``ChunkNote``s, ``RegatherChoice``s; also appended
        to ``gm.meta``, ``passes/meta.py``). narrowed: the ``narrow.NarrowResult`` of
        ``narrow_gathers`` (all-gathers that now gather float8 bytes, and those left with a reason).
    reasons: (node name, why the core placed it) per placed start and wait (also
        each node's ``meta.REASON``). error: the ScheduleError that rolled the graph back
        (on_error="fallback"), else None.
    structure: the graph's ``Structure`` the core scheduled with (built once, in the
        order before it; its bundles, consumers and regions hold for the scheduled order
        too, so the report reads it with the new positions); None when the core did not
        run (disabled, rolled back)."""

    gm: fx.GraphModule
    collectives: int = 0
    modified: bool = False
    peaks: Peaks | None = None
    before: tuple[str, ...] = ()
    duplicates: tuple[tuple[str, ...], ...] = ()
    buckets: tuple = ()
    chunks: tuple = ()
    regather: tuple = ()
    reasons: tuple[tuple[str, str], ...] = ()
    error: ScheduleError | None = None
    structure: Structure | None = None
    narrowed: object = None


def budget_for(s: Structure, config, headroom: Headroom | None = None) -> Budget:
    """The Budget ``config`` (what ``as_options`` takes) sets for the graph of ``s``
    (its movable collectives); with the "auto" byte budget, the headroom under the
    serial order's peak; with "serial-peak" or "graph-peak", that headroom alone
    (``Budget.within_peak``), under the peak of the graph before the pipeline rewrote it
    where it did, or the graph's own as handed in ("graph-peak", where higher):
    ``meta.serial_peak``. ``headroom``: ``serial_headroom(s, config)`` when the caller has it."""
    cfg = as_options(config)
    collectives, held = s.movable, s.held
    groups = sorted({c.group for c in collectives})
    within_peak = cfg.max_in_flight_bytes in PEAK_MODES
    if cfg.max_in_flight_bytes in BYTE_MODES:
        max_bytes: dict[str, int | None] = {group: None for group in groups} if within_peak \
            else dict(auto_budget(collectives, held))
        if headroom is None and collectives:
            headroom = serial_headroom(s, cfg)
    else:
        max_bytes, headroom = {group: cfg.max_in_flight_bytes for group in groups}, None
    # In flight, a start that may go ahead counts its output too under the other budgets;
    # not in the limits, which verify reads off the scheduled graph, where it stands ahead.
    in_flight = held if within_peak else s.held_ahead
    reserve: dict[str, int] = {}
    for c in collectives:
        if c.kind != "all_gather":
            reserve[c.group] = max(reserve.get(c.group, 0), in_flight[c.start])
    return Budget(cfg.max_in_flight, max_bytes, reserve, headroom, within_peak, in_flight, cfg.issue)


def serial_headroom(s: Structure, config, recorded: bool = True) -> Headroom:
    """The ``Headroom`` that the byte budget of ``config`` reads for the graph of ``s``:
    under its serial order's peak; under "serial-peak" and "graph-peak", bundle nodes bound it too, the
    order is the lower-peaked of two serial orders (``reference_order``), and the bound
    is the serial peak of the graph before the pipeline's rewrites where it recorded one
    and ``recorded`` (``meta.serial_peak``: "auto" buckets may not raise it, pipelined pieces
    may use what the unsplit collective held), else that order's."""
    if as_options(config).max_in_flight_bytes not in PEAK_MODES:
        return Headroom(s, invariants.serial_order(s, asap=True))
    liveness = Liveness(s.nodes)
    serial, along, in_place = reference_order(s, liveness)
    return Headroom(s, serial, segments=True, peak=meta.serial_peak(s.gm) if recorded else None,
                    liveness=liveness, along=along, in_place=in_place)


def reference_order(s: Structure, liveness: Liveness) -> tuple[list[fx.Node], tuple, bool]:
    """(order, ``liveness.along(order)``, whether it keeps starts in place) of the serial
    order the "serial-peak" budget keeps a graph under: the lower-peaked of the serial
    order that issues every collective other than an all-gather as soon as its inputs
    allow (``invariants.serial_order(asap=True)``; on ties) and the graph's own
    (``invariants.serial_order``: those collectives issued where they stand, as traced).
    Issued early, a reduce-scatter's input chain (a cast to the reduce dtype) and output
    are live with buffers the graph's own order frees first; under the own order the core
    issues such a collective early only where its buffers fit the headroom."""
    asap = invariants.serial_order(s, asap=True)
    early = liveness.along(asap, s.pos if asap == s.nodes else None)   # (Nodes compare by identity)
    if all(c.kind == "all_gather" or _stands_where_ready(s, c) for c in s.movable):
        return asap, early, False   # the two orders issue every collective after the same spine node
    own = invariants.serial_order(s)
    kept = liveness.along(own)
    if max(kept[0], default=0) < max(early[0], default=0):
        return own, kept, True
    return asap, early, False


def _stands_where_ready(s: Structure, c: Collective) -> bool:
    """Whether no spine node stands between the last node ``c``'s start bundle reads and
    the bundle in ``s``: issued as soon as its inputs allow, it follows the same spine
    node as where it stands. (A shortcut: where it is wrong, the early order stays the
    reference, as it was before the graph's own order was compared with it.)"""
    bundle = s.start_bundle[c.start]
    first = s.pos[bundle[0]]
    last = max((s.pos[i] for i in s.bundle_inputs[c.start]), default=-1)
    return all(n in s.bundled for n in s.nodes[last + 1:first])


def verify(gm: fx.GraphModule, config=None) -> Peaks:
    """Check the schedule guarantees on ``gm`` as it stands (``invariants.py``:
    consumer order, waits, the in-flight budget of ``config``, the memory
    guarantee); raise ScheduleError naming the first node that breaks one.
    ``config``: ScheduleOptions, an OverlapConfig or None (``as_options``).
    Returns the measured Peaks."""
    check_graph(gm)
    cfg = as_options(config)
    try:
        gm.graph.lint()
    except Exception as error:
        raise ScheduleError(f"graph is not a valid FX graph: {error}") from error
    s = Structure(gm)
    # the order as it stands: no start is ahead of where it stands (``Structure.held_ahead``
    # counts what a start could go ahead of, for scheduling)
    return invariants.check(s, s.nodes, dataclasses.replace(budget_for(s, cfg), held=None))


def _reorder(gm: fx.GraphModule, budget_of, mode: str = "schedule",
             kinds: tuple[str, ...] | None = None, s: Structure | None = None, degrade: bool = True) -> _Placed:
    """Schedule ``gm.graph`` in place with the core and check the result.
    ``budget_of(structure)`` gives the Budget; ``s``: the graph's Structure when
    the caller has it (the graph unchanged since). A graph with chained
    collectives is scheduled with its headroom under the serial order's peak
    (chain points where a chain's own buffers fit it) and checked against that
    order too. A schedule that fails the check (or the core) degrades locally
    (``_degrade``): chained graphs first try late chain points, then the collectives
    the failure names are placed serially and the rest scheduled again
    (``degrade=False``: the failure raises, for a caller with a better retry). Each
    placed start and wait gets its reason (``meta.REASON``) once the check passed."""
    s = s if s is not None else Structure(gm)
    if not s.movable:
        return _Placed(0, False, structure=s)
    budget: Budget = budget_of(s)
    shared = budget.headroom.liveness if budget.headroom is not None else None   # the same graph's
    room = Headroom(s, invariants.serial_order(s), liveness=shared) if mode != "sink" and _has_chains(s) else None
    try:
        order, reasons, peaks = _attempt(s, budget, kinds, mode=mode, chain_room=room)
    except _Failed as failed:
        if mode == "sink" or not degrade:
            raise failed.error from None
        order, reasons, peaks = _degrade(s, budget, kinds, failed, room)
    modified = order != s.nodes   # (Nodes compare by identity)
    if modified:
        apply_order(gm, order)
    for node, reason in reasons.items():
        meta.set_reason(node, reason)
    placed = tuple((n.name, reasons[n]) for n in filter(reasons.__contains__, order))
    return _Placed(len(s.movable), modified, peaks, placed, s)


class _Failed(Exception):
    """A schedule that broke a guarantee: the error, and the order when the core built one."""

    def __init__(self, error: Exception, order: list[fx.Node] | None):
        super().__init__(str(error))
        self.error, self.order = error, order


def _attempt(s: Structure, budget: Budget, kinds, mode: str = "schedule", **core) -> tuple:
    """(order, reasons, peaks) of one run of the core (``core``: ``schedule_order``'s
    keywords) that passed the checks, else raise _Failed. Starts not placed by the
    core (sink mode) are checked for compute order and regions only."""
    reasons: dict[fx.Node, str] = {}
    order = None
    try:
        order = schedule_order(s, budget, mode, kinds, reasons, **core)
        _check_kept(s, order)
        peaks = None if mode == "sink" else _check(s, order, budget)
    except (ScheduleError, AssertionError) as error:
        raise _Failed(error, order) from error
    return order, reasons, peaks


_DEGRADE_ROUNDS = 8   # rounds of placing more collectives serially before the whole graph goes serial


def _has_chains(s: Structure) -> bool:
    """Whether a movable collective's start reads another one's result (a chain)."""
    return any(i in s.wait_of_member for c in s.movable for i in s.bundle_inputs[c.start])


def _degrade(s: Structure, budget: Budget, kinds, failed: _Failed, room):
    """(order, reasons, peaks) when the schedule failed (``failed``), losing as little
    overlap as it can: for a chained graph the core again with late chain points
    (an INFO line); then rounds in which the collectives the failure names
    (``_culprits``) are placed serially and everything else scheduled again (one
    WARNING naming them); after ``_DEGRADE_ROUNDS`` rounds, or when a failure names
    nothing new, the whole graph in its serial order (``_serial_fallback``)."""
    first = failed.error
    if _has_chains(s):
        try:
            result = _attempt(s, budget, kinds, late_chains=True)
        except _Failed as again:
            log.debug("overlapc: late chain points failed too: %s", again.error)
            failed = again
        else:
            log.info("overlapc: chained collectives issued where their results are due (less overlap): the "
                     "schedule with earlier chain points broke a guarantee: %s", first)
            return result
    serial: dict[fx.Node, Collective] = {}
    for _ in range(_DEGRADE_ROUNDS):
        new = [c for c in _culprits(s, failed) if c.start not in serial]
        if not new:
            break
        serial.update((c.start, c) for c in new)
        try:
            result = _attempt(s, budget, kinds, chain_room=room, serial=frozenset(serial))
        except _Failed as again:
            failed = again
            continue
        names = ", ".join(f"{c.start.name} ({c.kind}, group {c.group})" for c in serial.values())
        log.warning("overlapc: %d of %d collectives placed serially (no overlap for them; the rest is "
                    "scheduled): %s. Scheduled with overlap they broke a guarantee: %s",
                    len(serial), len(s.movable), names, first)
        return result
    order, reasons = _serial_fallback(s, first, budget)
    _check_kept(s, order)
    # against the serial order alone (guarantee 4's reference): an all-gather issued when its
    # result is due can keep its input live longer than the order handed in does
    return order, reasons, invariants.check(s, order, budget)


def _culprits(s: Structure, failed: _Failed) -> list[Collective]:
    """The movable collectives a failure names: the one whose start, wait or input chain
    it names, those in flight at its position of the failed order (a memory or bound
    error) and those other than all-gathers issued before that position although they
    stood after its node in the graph handed in (their input chain and output allocated
    early; an all-gather only while its result is still read after that position), and
    the collectives whose results these read (a chain), in graph order; none when the
    core failed before building an order."""
    error, order = failed.error, failed.order
    node = getattr(error, "node", None)
    found = [c for c in (s.coll_of_start.get(node), s.coll_of_wait.get(node),
                         s.coll_of_start.get(s.start_of_member.get(node))) if c is not None]
    position = getattr(error, "position", None)
    if order is not None and position is not None:
        pos = {n: i for i, n in enumerate(order)}
        given = s.pos[order[position]]

        def early(c: Collective) -> bool:
            if pos[c.start] > position or s.pos[c.start] <= given:
                return False
            return c.kind != "all_gather" or any(pos[u] > position for w in c.waits for u in s.consumers[w])

        found += [c for c in s.movable if pos[c.start] <= position < max(pos[w] for w in c.waits) or early(c)]
    found += [s.coll_of_wait[s.wait_of_member[i]] for c in found for i in s.bundle_inputs[c.start]
              if i in s.wait_of_member]   # their upstream in a chain: placed serially, they follow it
    unique = {c.start: c for c in found}
    return sorted(unique.values(), key=lambda c: s.pos[c.start])


def _check(s: Structure, order: list[fx.Node], budget: Budget) -> invariants.Peaks:
    """``invariants.check`` of a scheduled ``order``: memory against the order before
    scheduling and, for a chained graph, against the serial order too, which
    ``verify`` compares with (a chain point moves a chain's own buffers, which the
    bytes in flight do not count; unchained graphs keep the serial reference, which
    the property tests check independently, without its cost)."""
    return invariants.check(s, order, budget, reference=s.nodes, serial=_has_chains(s))


def _serial_fallback(s: Structure, error: Exception, budget: Budget) -> tuple[list[fx.Node], dict[fx.Node, str]]:
    """A serial order: every guarantee holds by construction, no overlap. Under
    "serial-peak" the order the budget's bound is the peak of (``reference_order``: its
    other collectives issued where they stand or as soon as their inputs allow, whichever
    peaks lower), else ``invariants.serial_order`` (starts kept in place). For a graph whose
    schedule broke a guarantee (``error``) even with the collectives it named placed
    serially. A WARNING: the graph loses its overlap, and a user must not have to find that
    out from a profile."""
    log.warning("overlapc: collectives this schedule could not place within the bounds, even with those the "
                "failures named placed serially; the graph runs in its serial order (each collective waited "
                "right after its start, an all-gather issued right before its consumer), without overlap: %s",
                error)
    room = budget.headroom
    order = room.serial if budget.within_peak else invariants.serial_order(s)
    kept = not budget.within_peak or room.in_place
    reasons: dict[fx.Node, str] = {}
    for c in s.movable:
        gather = c.kind == "all_gather"
        reasons[c.start] = "forced by consumer" if gather else "not moved" if kept else "inputs ready"
        for wait in c.waits:
            reasons[wait] = "before consumer" if gather else "serial"
    return order, reasons


def _check_kept(s: Structure, order: list[fx.Node]) -> None:
    """Compute (the spine) kept its order, and no movable start or wait changed region."""
    if order == s.nodes:   # nothing moved (Nodes compare by identity)
        return
    members = s.start_of_member.keys() | s.wait_of_member.keys()   # (membership only)
    spine = [n for n in s.nodes if n not in members]
    placed = [n for n in order if n not in members]
    if placed != spine:
        moved = next(a for a, b in zip(placed, spine) if a is not b)
        raise fail(s, moved, "compute order changed", order)
    barriers_before, region = {}, 0
    for node in order:
        barriers_before[node] = region
        region += node in s.is_barrier
    for c in s.movable:
        for node in (c.start, *c.waits):
            if barriers_before[node] != s.region_of(node):
                raise fail(s, node, "moved across a barrier", order)


@dataclasses.dataclass(frozen=True)
class _Rewritten:
    """What ``_run_passes`` did: the core's placement, the node names just before the
    core ran when a rewrite may have changed the graph (else None), and the notes."""

    placed: _Placed
    before: tuple[str, ...] | None = None
    duplicates: tuple = ()
    buckets: tuple = ()
    chunks: tuple = ()
    regather: tuple = ()
    narrowed: object = None


def _narrow(gm: fx.GraphModule, cfg: ScheduleOptions, snapshot):
    """``narrow_gathers`` when ``cfg`` asks for it (one INFO line for what it rewrote, one per
    gather it left at full width with the reason); its NarrowResult, else None."""
    if not cfg.narrow_gathers:
        return None
    from overlapc.passes.narrow import narrow_gathers
    result = narrow_gathers(gm, before_rewrite=snapshot)
    if result.rewritten:
        before = sum(n.bytes_before for n in result.rewritten)
        after = sum(n.bytes_after for n in result.rewritten)
        dtypes = sorted({f"{n.dtype} (as {n.wire})" if n.wire != n.dtype else n.dtype for n in result.rewritten})
        log.info("overlapc: %d all-gathers gather %s after a cast on the shard: %d -> %d bytes; %d amax "
                 "all-reduce(s)", len(result.rewritten), ", ".join(dtypes), before, after, result.amax_reduces)
    for skip in result.skipped:
        log.info("overlapc: all-gather %s stays at full width: %s", skip.gather, skip.reason)
    return result


def _run_passes(gm: fx.GraphModule, cfg: ScheduleOptions, snapshot, estimator=None,
                bucketing: bool = True) -> _Rewritten:
    """Everything ``run`` does to the graph; returns what the rewrites noted and what
    ``_reorder`` measured. ``snapshot()`` runs before a rewrite first changes the graph;
    ``estimator``: what ``chunks="auto"`` estimates with; ``bucketing=False``: no buckets
    although ``cfg.bucket`` asks for them (its duplicate merging stays)."""
    duplicates, buckets, chunks, regather = [], [], [], ()
    waits_merged = bool(merge_repeated_waits(gm, before_rewrite=snapshot))   # before all: one wait per collective
    narrowed = _narrow(gm, cfg, snapshot)   # first: bucketing and the budget see the gathers as they will run
    within_peak = cfg.max_in_flight_bytes in PEAK_MODES
    s = Structure(gm) if within_peak or cfg.bucket is not None else None
    room = serial_headroom(s, cfg) if within_peak and s.movable else None   # of the graph as handed in
    if room is not None and cfg.max_in_flight_bytes == "graph-peak":
        room = _graph_peak_room(gm, s, room)
    if cfg.regather == "auto":   # first: bucketing would merge the re-gathers it may drop
        from overlapc.passes.regather import keep_or_regather
        regather = keep_or_regather(gm, before_rewrite=snapshot, recompile=False,
                                    liveness=room.liveness if room is not None else None).choices
    if cfg.bucket is not None:   # before chunking: one pipeline for one gathered activation
        from overlapc.passes.duplicates import merge_duplicates
        unchanged = s if not any(c.kept for c in regather) else None   # keep_or_regather rewrote none
        duplicates = merge_duplicates(gm, before_rewrite=snapshot, structure=unchanged)
    if cfg.chunks != 1:
        from overlapc.passes.chunk import chunk_collectives
        snapshot()
        chunks = chunk_collectives(gm, cfg.chunks, estimator)
    rewritten = any(c.kept for c in regather) or bool(duplicates) or bool(chunks)
    if rewritten and s is not None:
        s = Structure(gm)
        room = _rewritten_room(gm, s, cfg, room)
    if cfg.bucket is not None and not bucketing:
        meta.add_notes(gm, meta.BUCKETS, [])   # bucketing ran and kept none
    elif cfg.bucket is not None:
        from overlapc.passes.bucket import bucket_collectives
        held_to_peak = not _costs_what_it_holds(cfg)
        buckets = bucket_collectives(gm, bucket=cfg.bucket, before_rewrite=snapshot, structure=s,
                                     headroom=room if held_to_peak else None,
                                     coalesced=cfg.bucket_op == "coalesced")
        if buckets and held_to_peak and room is not None:
            meta.set_serial_peak(gm, room.peak)
            s = room = None   # the graph changed: the core needs a new one
        elif buckets:
            s = Structure(gm)
            room = _rewritten_room(gm, s, cfg, room)
    before = tuple(n.name for n in gm.graph.nodes) if cfg.chunks != 1 or buckets or rewritten or waits_merged \
        or narrowed is not None and narrowed.modified else None
    retry_unbucketed = bool(buckets) and within_peak and not _costs_what_it_holds(cfg)
    try:
        placed = _reorder(gm, lambda built: budget_for(built, cfg, room if built is s else None), s=s,
                          degrade=not retry_unbucketed)
    except ScheduleError as error:
        if not retry_unbucketed:
            raise
        raise _BucketsRaisePeak(len(buckets), error) from error
    if within_peak and placed.peaks is not None:   # what ``verify`` of this graph compares with
        meta.set_serial_peak(gm, placed.peaks.reference_peak_bytes)
    return _Rewritten(placed, before, tuple(duplicates), tuple(buckets), tuple(chunks), regather, narrowed)


def _graph_peak_room(gm: fx.GraphModule, s: Structure, room: Headroom) -> Headroom:
    """Under "graph-peak": ``room`` (the serial order's) with its bound raised to the peak of
    the graph of ``s`` in its own order, where that is higher (a graph handed in with
    collectives already issued early), recorded as ``meta.serial_peak`` for the rest of the
    pipeline and ``verify``; else ``room``."""
    own = room.liveness.peak_bytes(s.nodes)
    if own <= room.peak:
        return room
    meta.raise_serial_peak(gm, own)
    return Headroom(s, room.serial, segments=True, peak=own, liveness=room.liveness, along=room.along,
                    in_place=room.in_place)


def _costs_what_it_holds(cfg: ScheduleOptions) -> bool:
    """Whether ``cfg.bucket`` forms buckets that may raise the peak by what they hold (the
    options say so: "module", a plan), rather than only where the serial peak keeps."""
    return cfg.bucket == "module" or is_plan(cfg.bucket)


def _rewritten_room(gm: fx.GraphModule, s: Structure, cfg: ScheduleOptions, before: Headroom | None):
    """The headroom of the graph of ``s`` (rewritten: pipelined pieces, merged duplicates,
    kept gathers, a bucket per block or plan entry) under the larger of its own serial
    order's peak and ``before``'s (the graph's before this rewrite), which is recorded as
    ``meta.serial_peak`` (raised where an earlier rewrite recorded less): pieces may hold
    what the unsplit collective held, and the copies of pieces and of ``bucket="module"``
    or a plan are what those options cost; the schedule adds nothing above. None when
    ``before`` is (another budget) or nothing is movable."""
    if before is None or not s.movable:
        return None
    own = serial_headroom(s, cfg, recorded=False)   # its own order's: an earlier rewrite recorded the one before
    meta.raise_serial_peak(gm, max(own.peak, before.peak))
    if own.peak >= before.peak:
        return own
    # serial_headroom(s, cfg) now (a "before" exists only under "serial-peak"), its serial order and liveness shared
    return Headroom(s, own.serial, segments=True, peak=before.peak, liveness=own.liveness, in_place=own.in_place)


def _without_rewrites(cfg: ScheduleOptions) -> ScheduleOptions:
    """``cfg`` with the rewrites off (no buckets, no pieces, every re-gather kept): what
    ``run`` schedules when a rewrite failed, before it leaves the graph unscheduled."""
    return dataclasses.replace(cfg, bucket=None, chunks=1, regather="always", narrow_gathers=False)


class _BucketsRaisePeak(Exception):
    """Under the "serial-peak" budget the bucketed graph failed its check (the buckets' copies
    raised the peak above the serial peak of the graph before bucketing): ``run`` schedules
    it again without buckets."""

    def __init__(self, count: int, error: ScheduleError):
        super().__init__(f"{count} bucket(s) broke a guarantee: {error}")


class Snapshot:
    """A graph's nodes as they stood when taken, enough to rebuild them after rewrites
    erased, added or rewired nodes: per node its op, target, arguments, name, type and a
    shallow copy of its meta (what ``Graph.graph_copy`` copies). Holds the Node objects
    themselves for their arguments (FX replaces a node's args, never edits them in
    place), so taking it costs a tuple and a dict copy per node, not a copy of the graph
    (on a 27k-node graph 0.4 s, and cyclic garbage for the collector)."""

    def __init__(self, graph: fx.Graph):
        self.rows = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, dict(n.meta)) for n in graph.nodes]

    def rebuild(self, graph: fx.Graph) -> None:
        """Append a copy of every saved node to ``graph``, in the saved order, under the saved
        names where ``graph`` has them free (each copy gets its own shallow copy of the meta)."""
        copies: dict[fx.Node, fx.Node] = {}
        for node, op, target, args, kwargs, name, type_expr, node_meta in self.rows:
            copied = graph.create_node(op, target, fx.map_arg(args, copies.__getitem__),
                                       fx.map_arg(kwargs, copies.__getitem__), name, type_expr)
            copied.meta = dict(node_meta)
            copies[node] = copied


def _restore(gm: fx.GraphModule, saved: Snapshot | None, order: list[fx.Node], notes: dict) -> None:
    """Put ``gm`` back as it was: its node order, or (when a pass added or removed
    nodes) a copy of every node of ``saved`` under the same names, in the same
    Graph object (Inductor holds it); ``gm.meta`` gets back the rewrite notes
    ``notes`` held."""
    graph = gm.graph
    meta.restore_notes(gm, notes)
    if saved is None or len(graph.nodes) == len(order) and not any(n._erased for n in order):
        apply_order(gm, order)
        return
    for node in reversed(list(graph.nodes)):
        graph.erase_node(node)
    # erase_node keeps the names taken; free them so the copy keeps the original names
    graph._graph_namespace = type(graph._graph_namespace)()
    saved.rebuild(graph)


def run(gm: fx.GraphModule, config=None, *, estimator=None,
        recompile: bool = True) -> ScheduleResult:
    """Reschedule ``gm`` in place so communication overlaps compute; say what was done.

    Runs the chunk and bucket passes when ``config`` (ScheduleOptions, an
    OverlapConfig or None: ``as_options``) asks for them, then the scheduling
    core under its budget, then the invariant check. Under the "serial-peak"
    byte budget with ``bucket`` "auto" or a byte target, a scheduled peak above the unbucketed
    graph's serial peak (the buckets' copies) schedules the graph again without
    buckets (an INFO line); a rewrite that fails (bucketing, chunking, keep-or-regather)
    schedules the graph again without rewrites (a WARNING).
    Deterministic: the same graph gives the same order in every process. A
    graph without movable collectives (or ``enabled`` False) comes back
    untouched, but for its parameter reads moved up (``_prepare``). On failure the graph is restored; on_error="raise" raises
    ScheduleError, "fallback" warns (node, op, group, position) and returns
    the result with ``error`` set. ``estimator``: what ``chunks="auto"`` chooses
    piece counts with (``overlapc.costmodel``'s, handed to ``chunk_collectives``;
    ``overlapc.schedule`` builds it from the config's profile); required for
    chunks="auto". ``recompile=False`` skips regenerating ``gm.forward`` (for
    callers that read only ``gm.graph``, such as Inductor).
    """
    check_graph(gm)
    cfg = as_options(config)
    original = list(gm.graph.nodes)
    before = tuple(n.name for n in original)
    if not cfg.enabled:
        return ScheduleResult(gm, before=before)
    _prepare(gm)
    if cfg.chunks == "auto" and estimator is None:
        raise ValueError('overlapc.passes: chunks="auto" chooses piece counts with an estimator: pass '
                         "estimator= (overlapc.costmodel.resolve(profile)), or call overlapc.schedule, which "
                         "builds it from the config's profile")
    saved: list[Snapshot] = []   # what to roll back to, taken only when a rewrite changes the graph

    def snapshot() -> None:
        if not saved:
            saved.append(Snapshot(gm.graph))
    notes = meta.save_notes(gm)
    collecting = gc.isenabled()
    gc.disable()   # the pass allocates many small objects; collections would cost more than it does
    try:
        try:
            done = _run_passes(gm, cfg, snapshot, estimator)
        except _BucketsRaisePeak as raised:
            _restore(gm, saved[0] if saved else None, original, notes)
            log.info("overlapc: scheduled without buckets: %s", raised)
            done = _run_passes(gm, cfg, snapshot, estimator, bucketing=False)
        except Exception as error:
            plain = _without_rewrites(cfg)
            if plain == cfg:
                raise
            _restore(gm, saved[0] if saved else None, original, notes)
            log.warning("overlapc: scheduled without buckets, pipelined pieces, kept gathers or narrow gathers "
                        "(bucket=None, chunks=1, regather=\"always\", narrow_gathers=False): with them the pass "
                        "failed: %s: %s",
                        type(error).__name__, error)
            done = _run_passes(gm, plain, snapshot, estimator)
    except Exception as error:
        _restore(gm, saved[0] if saved else None, original, notes)
        if recompile:
            gm.recompile()
        failure = error if isinstance(error, ScheduleError) else ScheduleError(
            f"{type(error).__name__}: {error}")
        if cfg.on_error == "raise":
            raise failure from error
        warnings.warn(f"overlapc left the graph unscheduled: {failure}", stacklevel=3)
        log.warning("overlapc left the graph unscheduled: %s", failure)
        return ScheduleResult(gm, before=before, error=failure)
    else:
        placed = done.placed
        if placed.collectives and recompile:   # nothing movable: nothing changed (a rewrite leaves movable ones)
            gm.recompile()   # with the collector still off: it allocates as much as the passes
    finally:
        if collecting:
            gc.enable()
    return ScheduleResult(gm, placed.collectives, placed.modified, placed.peaks, done.before or before,
                          done.duplicates, done.buckets, done.chunks, done.regather, placed.reasons,
                          structure=placed.structure, narrowed=done.narrowed)


def schedule(gm: fx.GraphModule, config=None, *, estimator=None,
             recompile: bool = True) -> fx.GraphModule:
    """``run`` (arguments the same), returning ``gm``: the passes alone, without the
    report's log lines (``overlapc.schedule`` adds those and builds the estimator)."""
    run(gm, config, estimator=estimator, recompile=recompile)
    return gm


# -- presets of the core, one job each -----------------------------------------------------

def _preset(gm: fx.GraphModule, budget_of, **reorder) -> fx.GraphModule:
    """A preset's run: repeated waits made one (``merge_repeated_waits``), then ``_reorder``
    with ``budget_of`` and ``reorder``'s arguments; ``gm`` recompiled when either changed it."""
    merged = merge_repeated_waits(gm)
    if _reorder(gm, budget_of, **reorder).modified or merged:
        gm.recompile()
    return gm


def reorder_all_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Issue every collective as early as its inputs allow (all-gathers in consumer
    order per group and region) and wait each just before its first real consumer,
    with no in-flight bound. In place; returns ``gm`` recompiled."""
    return _preset(gm, lambda s: UNBOUNDED)


def limit_in_flight(gm: fx.GraphModule, max_in_flight=2,
                    max_in_flight_bytes: int | str | None = None) -> fx.GraphModule:
    """Schedule ``gm`` under the bound: at most ``max_in_flight`` collectives of
    one group and kind, and at most ``max_in_flight_bytes`` held bytes per group
    ("auto" derives it), in flight; takes the two limits (as ``OverlapConfig``
    accepts them) or what ``as_options`` takes. In place; returns ``gm`` recompiled."""
    limits = max_in_flight is None or isinstance(max_in_flight, int)
    cfg = ScheduleOptions(max_in_flight=max_in_flight, max_in_flight_bytes=max_in_flight_bytes) if limits \
        else as_options(max_in_flight)
    return _preset(gm, lambda s: budget_for(s, cfg))


def sink_waits(gm: fx.GraphModule, kinds=None) -> fx.GraphModule:
    """Move each wait (with the views that read only through it) to just before
    its first real consumer, never past the barrier closing its region; starts
    stay where they are. ``kinds`` restricts the pass to those collective kinds
    (e.g. ``("all_gather",)``). In place; returns ``gm`` recompiled."""
    kinds = None if kinds is None else tuple(kinds)
    return _preset(gm, lambda s: UNBOUNDED, mode="sink", kinds=kinds)

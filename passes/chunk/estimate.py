"""How long a pipeline takes with k pieces, by the estimator, and which k to take.

    ms = pipeline_ms(plan, k, prof)      # plan: a Plan of any piece count
    best, estimates = choose(plans, prof)

``prof`` is the estimator the chunk pass is handed (``overlapc.costmodel.Profile``);
this module calls only its methods and those of the link it returns, so the
passes never import the cost model: ``prof.compute_ms(node)``, ``prof.fixed_ms()``,
``prof.link_for(group)`` and that link's ``latency_ms``, ``transfer_ms``, ``issue_ms``
and ``end_ms``, the one link model ``overlapc.simulate`` uses too.

The model replays the emitted order on two streams: the compute stream runs the
region's nodes piece by piece (``compute_ms`` of each node on the full rows, its
roofline part divided by k, its fixed per-op cost paid once a piece) and issues
the collectives (``issue_ms`` of a piece's bytes: the calibrated compute time
one collective costs its caller); the link moves them in issue order, each
ending at ``link.end_ms(issue, link free, latency, transfer of bytes/k)``: on a
link whose latency overlaps earlier transfers, more pieces cost the link their
bytes only, and a piece issued before the one ahead of it ends pays the link's
met latency (``latency_after_ms``). Order, as emitted: source 0; then for each
piece i: source i+1, wait and compute i, sink i, wait for sink i-1; wait for the
last sink. A pipeline fed by an earlier one (``Plan.link``) has its first source
issued while the feeder still computes: it is on the link when the pipeline
starts, its issue paid by the feeder (the link's time is still the pipeline's: a
chain of pipelines moves every piece's bytes). With 1 piece nothing feeds it.
"""
from __future__ import annotations

from overlapc.passes.collectives import collective_op, op_kind
from overlapc.passes.chunk import legality as L
from overlapc.passes.chunk.plan import Plan

CANDIDATES = (1, 2, 4, 8)


def _comm_ms(start, k: int, link, world: int) -> tuple[float, float, float]:
    """One of ``k`` pieces of collective ``start`` on ``link`` (a ``prof.link_for`` result):
    (its latency; the link's time for its share of the full bytes; the compute stream's
    time to issue it)."""
    kind = op_kind(collective_op(start))
    full = L.val(start if kind == "all_gather" else start.args[0])
    nbytes = full.numel() * full.element_size() / k
    return link.latency_ms(kind), link.transfer_ms(kind, nbytes, world), link.issue_ms(nbytes)


def pipeline_ms(plan: Plan, k: int, prof) -> float:
    """Estimated time from the pipeline's first start to its last wait with ``k`` pieces."""
    link, fixed = prof.link_for(plan.group), prof.fixed_ms()
    nodes = [*plan.region, *(plan.link.bridge if plan.link is not None else ())]
    piece = 0.0
    for node in nodes:
        ms = prof.compute_ms(node)
        if ms > 0:
            piece += (ms - fixed) / k + fixed
    source = _comm_ms(plan.source, k, link, plan.world) if plan.source is not None else None
    sink = _comm_ms(plan.sink, k, link, plan.world) if plan.sink is not None else None
    t, busy = 0.0, None       # compute stream clock; the link is busy until ``busy`` (None: unused)
    source_done, sink_done = [], []

    def issue_on_link(comm: tuple[float, float, float]) -> float:
        nonlocal t, busy
        latency, transfer, issue = comm
        busy = link.end_ms(t, busy, latency, transfer)
        t += issue
        return busy

    if source is not None:
        fed = plan.link is not None and k == plan.link.joined.chunks
        source_done.append(issue_on_link((*source[:2], 0.0) if fed else source))
    for i in range(k):
        if source is not None and i + 1 < k:
            source_done.append(issue_on_link(source))
        t = max(t, source_done[i] if source is not None else 0.0) + piece
        if sink is not None:
            sink_done.append(issue_on_link(sink))
            if i >= 1:
                t = max(t, sink_done[i - 1])
    if sink is not None:
        t = max(t, sink_done[-1])
    return t


def fastest(estimates) -> int:
    """The count of least estimate among (k, ms) pairs; ties (within 1e-9) to the
    most pieces. A tie is a pipeline whose compute hides its communication at
    every count; the estimate starts it on an idle link, and where the pieces of
    the pipeline before are still in flight, more pieces leave less of each
    collective waiting behind them (TP+SP backward: 8 pieces measured 820 ms a
    step against 850 with 2, both estimated equal)."""
    least = min(ms for _, ms in estimates)
    return max(k for k, ms in estimates if ms <= least * (1 + 1e-9))


def choose(plans: dict[int, Plan], prof) -> tuple[int, tuple[tuple[int, float], ...]]:
    """The piece count ``fastest`` among ``plans`` (k -> the Plan for k pieces) and
    1 (the pattern left as it is, estimated on the smallest plan); and every
    candidate's estimate in ms, by k."""
    base = plans[min(plans)]
    estimates = [(1, pipeline_ms(base, 1, prof))]
    estimates += [(k, pipeline_ms(plan, k, prof)) for k, plan in sorted(plans.items())]
    return fastest(estimates), tuple(estimates)

"""Split collectives on the critical path into pipelined pieces.

    notes = chunk_collectives(gm, chunks)   # chunks: int, or "auto" (with profile=...);
                                            # rewrites gm.graph in place; no recompile

Targets: a collective whose input is produced right before it and whose result
is needed right after (tensor/sequence parallel, MoE), where reordering alone
hides nothing. Each becomes ``chunks`` pieces so that piece i+1's collective
runs while piece i computes.

Layout. Pieces are cut along one dim of the collectives' tensors, never a
dim a collective or a matmul contracts: dim 0 ("rows": tokens or sequence),
or, for a sequence-first [seq, batch, ...] activation whose rows attention
mixes, its batch (dim 1). A tensor in a pipeline has a layout (dim, blocks): a
tensor of R rows that a collective over W ranks moves is W blocks of n rows
(rank-major), and piece i is entries ``r*n + i*n/chunks + j`` of every block r
along that dim. That commutes with the collectives, so every result is exact
(only matmuls over fewer rows):

* all_gather(shard)[piece i] = all_gather(shard piece i): the shard is cut
  along its own dim 0 (a view) or its batch (a copy of 1/k of the shard), and
  the gathered pieces are already in piece layout.
* reduce_scatter(x)[piece i] = reduce_scatter(x[piece i]).
* all_to_all_single(x)[piece i] = all_to_all_single(x[piece i]) for equal splits.

Row-wise compute maps piece i to piece i and carries the layout on (legality):
a matmul with the rows as its first operand and a weight not derived from
them, elementwise ops, reductions over other dims (a norm's statistics), views
(the layout followed through row-major order: [seq, batch/k, d] viewed as
[seq*batch/k, d] is ``seq`` blocks), permutes (the dim moves), ops that add,
drop, select or broadcast another dim (unsqueeze, squeeze, expand, select,
stack, view_as_complex / view_as_real: rotary embeddings as complex products,
grouped-query attention's repeated k/v heads), attention
(SDPA forward and backward, softmax, bmm: independent per batch row when the
pieces are batch rows), and DTensor's layout changes: an all-gather on dim 0
followed by ``split`` + ``cat`` into dim k (and ``split`` + ``cat`` before a
reduce-scatter) turn W rank blocks into separate tensors and back, so a
batch-first [batch, seq, ...] activation's pieces are batch rows. Patterns:

* ``all_gather_matmul``: all-gather -> row-wise compute -> reduce-scatter of
  the same group (a TP+SP attention block or MLP, forward and backward) becomes
  one pipeline and its note names both starts; without a reduce-scatter
  reachable through row-wise compute, all-gather -> views -> the matmuls that
  read the rows. A pipeline fed by an earlier one (below) is preferred, then
  one cut along a dim the next all-gather of the group can cut too (so they
  chain), then rows before the batch of a sequence-first activation.
* ``matmul_reduce_scatter``: matmul -> views -> reduce-scatter; the matmul's
  row operand is copied piece by piece.
* ``all_to_all_expert``: all_to_all_single -> row-wise expert compute ->
  all_to_all_single of the same group (MoE dispatch / combine). With split
  sizes known only at run time (dropless MoE: a count exchange, then ``tolist()``),
  ``ragged`` cuts every rank block into token ranges instead: piece i of a block
  of s rows is its rows [s*i//k, s*(i+1)//k), the same rule on the receiving side.
  The count exchange itself is reported, not pipelined.

Chained pipelines: when an all-gather's input is row-wise compute of an earlier
reduce-scatter pipeline's result (the residual add and norm between attention
and MLP in TP+SP) cut along the same dim into as many pieces, that compute
runs piece by piece on the reduce-scatter's pieces and feeds the all-gather's
pieces directly (the note's ``fed_by``), so
the two pipelines become one and piece i's reduce-scatter overlaps the compute
of other pieces of the next pattern.

Values computed inside a pipeline that other nodes read (activations saved for
backward, weight gradients, graph outputs) are reassembled with one ``cat``;
operands from outside with full rows (saved activations in a backward) are
sliced piece by piece. Node order emitted: in waves; a pipeline's stages are
its source start (0), its compute and sink start (1) and its sink wait (2), a
fed pipeline's counting on from its feeder's, and wave w holds stage s of
piece w - s, stages in order. So piece i+1's start comes before piece i's
compute, and each collective is in flight over one wave of other pieces'
compute. Nodes that read a reassembled value move after it (a stable
topological order, the same on every rank); a node outside the pipelines that
it reads (a weight's transpose) moves to just before its first reader.

``chunks="auto"``: per pattern, the count among ``estimate.CANDIDATES`` that
the estimator puts fastest (``estimate``), 1 leaving the pattern alone.
Pipelines chain only with as many pieces each, so patterns that feed one
another at some count (a chain) take one count together: the one whose
summed estimate is least. Every count is tried on a copy of the graph first,
so each pattern is estimated as it would be emitted (fed by its feeder or
not); its estimate always includes the row-wise compute between it and its
feeder: inside the pipeline when fed, before it when not.

Code: ``legality`` (row-wise checks, layouts), ``plan`` (finding patterns and
chaining them into Plans), ``emit`` (pieces, reassembly, order), ``estimate``
(a pipeline's time for k pieces), ``ragged`` (all-to-alls with data-dependent
splits: plan, pieces through the same Emitter, estimate assuming balanced
routing); this module drives them.

Left alone, with a ChunkNote saying why: a dim that does not divide, unknown
or symbolic shapes (outside ``ragged``), unequal constant all-to-all splits, a
count exchange, a start without exactly one
wait, compute that is not row-wise, an intermediate whose other users feed the
pipeline back, a barrier between the collectives.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from overlapc.collectives import collective_op, group_of

__all__ = ["ChunkNote", "chunk_collectives"]


@dataclasses.dataclass(frozen=True)
class ChunkNote:
    """What chunk_collectives did with one pattern.

    pattern: "all_gather_matmul", "matmul_reduce_scatter" or "all_to_all_expert".
    starts: names of the original collective start node(s) (a pipeline that
        ends in a reduce-scatter or combine all-to-all names both).
    group: process group name. chunks: pieces asked for (with chunks="auto": the
        count chosen, 1 when leaving the pattern alone was estimated fastest).
    applied: True when the graph was rewritten; reason: why not, or for an applied
        all-gather pipeline that stops at its matmuls, why it does not reach the
        reduce-scatter after them ("" otherwise).
    pieces: names of the new collective start nodes (empty when not applied).
    fed_by: the start of an earlier pipeline whose pieces feed this one, piece by
        piece, through row-wise compute (a reduce-scatter -> residual add -> norm ->
        all-gather chain); "" when the pipeline starts from a whole tensor.
    estimates: with chunks="auto", ((pieces, estimated ms), ...) for every count
        that could be cut, 1 included (``chunk.estimate``): of the pattern's pipeline,
        or, for patterns that feed one another, of their chain's pipelines summed (the
        chain takes one count); () otherwise.
    """

    pattern: str
    starts: tuple[str, ...]
    group: str
    chunks: int
    applied: bool
    reason: str = ""
    pieces: tuple[str, ...] = ()
    fed_by: str = ""
    estimates: tuple[tuple[int, float], ...] = ()


def chunk_collectives(gm: fx.GraphModule, chunks: int | str, profile=None) -> list[ChunkNote]:
    """Split qualifying all-gather/matmul, matmul/reduce-scatter and
    all-to-all/expert/all-to-all patterns of ``gm`` into ``chunks`` pipelined
    pieces, in place (``gm.graph`` only: the caller recompiles). ``chunks="auto"``:
    per pattern (per chain of patterns that feed one another), the count in
    ``estimate.CANDIDATES`` that ``profile`` (anything ``overlapc.costmodel.resolve``
    takes) estimates fastest. Returns one note per pattern found, applied or not, and
    appends them to ``gm.meta["overlapc_chunks"]``. chunks == 1 changes nothing and
    returns []."""
    from overlapc.passes.chunk import ragged
    from overlapc.passes.chunk.emit import Emitter
    from overlapc.passes.chunk.legality import Skip
    from overlapc.passes.chunk.plan import PATTERNS, Planner

    auto = chunks == "auto"
    if not auto and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f'chunk_collectives: chunks must be an int >= 1 or "auto", got {chunks!r}')
    notes: list[ChunkNote] = []
    if auto or chunks > 1:
        prof = choice = None
        if auto:
            from overlapc import costmodel
            prof = costmodel.resolve(profile)
            choice = _auto_counts(gm, prof)
        planner = Planner(gm)
        emitter = Emitter(gm, planner)
        done: set[fx.Node] = set()
        for start in [n for n in gm.graph.nodes if collective_op(n) in PATTERNS]:
            if start in done:
                continue
            pattern, group = PATTERNS[collective_op(start)], group_of(start)
            k, estimates = chunks, ()
            exchange = ragged.count_exchange(start)
            if exchange is not None:
                done.add(start)
                notes.append(ChunkNote(pattern, (start.name,), group, k if not auto else 1, False, exchange))
                continue
            uneven = ragged.is_ragged(start)
            try:
                if auto:
                    if uneven:
                        k, estimates, plan = _choose_ragged(start, prof)
                        starts, skip = tuple(n.name for n in plan.starts), None
                    else:
                        k, estimates, starts, skip = choice.get(start.name, (1, (), (start.name,), None))
                    if skip is not None:
                        raise skip
                    if k == 1:
                        done.update(n for n in gm.graph.nodes if n.name in starts)
                        notes.append(ChunkNote(pattern, starts, group, 1, False,
                                               "chunks auto: one piece is estimated fastest", estimates=estimates))
                        continue
                if not (auto and uneven):
                    plan = ragged.plan_ragged(start, k) if uneven else planner.plan(start, k)
                pieces = ragged.emit_ragged(emitter, plan) if uneven else emitter.emit(plan)
            except Skip as skip:
                emitter.discard()
                done.add(start)
                notes.append(ChunkNote(pattern, (start.name,), group, k if not auto else 1, False, str(skip),
                                       estimates=estimates))
                continue
            done.update(plan.starts)
            fed_by = plan.link.joined.start if plan.link is not None else ""
            notes.append(ChunkNote(plan.pattern, tuple(n.name for n in plan.starts), group, k, True,
                                   plan.stops, pieces, fed_by, estimates))
        if emitter.changed:
            emitter.finish()
            gm.graph.lint()
    gm.meta.setdefault("overlapc_chunks", []).extend(notes)
    return notes


@dataclasses.dataclass
class _Trial:
    """One pattern emitted with k pieces on a copy of the graph."""

    ms: float                        # its pipeline's estimate with k pieces (its bridge inside when fed)
    one_ms: float                    # its estimate left alone (1 piece, nothing feeds it), no bridge
    fed_by: str                      # its feeder's start name, or ""
    bridge_ms: float                 # the compute from its feeder's result to its input
    starts: tuple[str, ...]


def _auto_counts(gm: fx.GraphModule, prof) -> dict:
    """start name -> (k, estimates, the pattern's start names, None), or (1, estimates,
    names, the Skip of a count the pattern's chain chose but it cannot take), for
    chunks="auto" and every pattern but the ragged ones and count exchanges. Each count
    in ``CANDIDATES`` is emitted for the whole graph on a copy; patterns joined by a
    feed at any count form a chain that takes the count ``estimate.fastest`` puts first
    by summed estimate, each pattern's estimate including its bridge compute (inside
    the pipeline when fed, before it when not)."""
    import copy

    from overlapc import costmodel
    from overlapc.passes.chunk import ragged
    from overlapc.passes.chunk.emit import Emitter
    from overlapc.passes.chunk.estimate import CANDIDATES, fastest, pipeline_ms
    from overlapc.passes.chunk.legality import Skip
    from overlapc.passes.chunk.plan import PATTERNS, Planner

    trials: dict[str, dict[int, _Trial]] = {}   # pattern (its first start's name) -> k -> trial
    skips: dict[str, Skip] = {}
    order: list[str] = []                       # patterns in graph order
    owner: dict[str, str] = {}                  # any start's name -> its pattern
    for k in CANDIDATES[1:]:
        trial = copy.deepcopy(gm)
        planner = Planner(trial)
        emitter = Emitter(trial, planner)
        done: set[fx.Node] = set()
        for start in [n for n in trial.graph.nodes if collective_op(n) in PATTERNS]:
            if start in done or ragged.count_exchange(start) is not None or ragged.is_ragged(start):
                continue
            if start.name not in order:
                order.append(start.name)
            try:
                plan = planner.plan(start, k)
                ms, one_ms = pipeline_ms(plan, k, prof), pipeline_ms(plan, 1, prof)
                emitter.emit(plan)
            except Skip as skip:
                emitter.discard()
                done.add(start)
                skips.setdefault(start.name, skip)
                continue
            done.update(plan.starts)
            bridge = sum(costmodel.compute_ms(n, prof.device) for n in (plan.link.bridge if plan.link else ()))
            starts = tuple(n.name for n in plan.starts)
            owner.update((name, start.name) for name in starts)
            trials.setdefault(start.name, {})[k] = _Trial(
                ms, one_ms - bridge, plan.link.joined.start if plan.link is not None else "", bridge, starts)
    head = {name: name for name in order}       # chains: union of the feeds at every count
    for name in order:
        for t in trials.get(name, {}).values():
            if t.fed_by in owner:
                a, b = sorted((_root(head, owner[t.fed_by]), _root(head, name)), key=order.index)
                head[b] = a
    chains: dict[str, list[str]] = {}
    for name in order:
        chains.setdefault(_root(head, name), []).append(name)

    def estimate(name: str, k: int) -> float:
        """The pattern's estimate with k pieces (1, or a count it cannot take: left
        alone), its bridge compute included."""
        runs = trials[name]
        bridge = max(r.bridge_ms for r in runs.values())
        if k not in runs:
            return runs[min(runs)].one_ms + bridge
        return runs[k].ms + (0.0 if runs[k].fed_by else bridge)

    choice = {}
    for members in chains.values():
        cut = [m for m in members if m in trials]
        ks = [1, *sorted({k for m in cut for k in trials[m]})]
        summed = tuple((k, sum(estimate(m, k) for m in cut)) for k in ks)
        best = fastest(summed) if cut else 1
        for m in members:
            if m not in trials:
                choice[m] = (1, (), (m,), skips[m])
                continue
            own = tuple((k, estimate(m, k)) for k in [1, *sorted(trials[m])])
            runs = trials[m]
            if best not in runs and best != 1:
                why = skips.get(m) or Skip(f"chunks auto: its chain takes {best} pieces, which do not cut it")
                choice[m] = (1, own, runs[min(runs)].starts, why)
            else:
                choice[m] = (best, summed if len(cut) > 1 else own, runs.get(best, runs[min(runs)]).starts, None)
    return choice


def _root(head: dict, name: str) -> str:
    while head[name] != name:
        name = head[name]
    return name


def _choose_ragged(start: fx.Node, prof):
    """(k, estimates, the Plan for k) for chunks="auto" on an all-to-all with
    data-dependent splits (``ragged``): every count cuts (empty pieces are allowed),
    estimated assuming balanced routing; such pipelines never chain."""
    from overlapc.passes.chunk import ragged
    from overlapc.passes.chunk.estimate import CANDIDATES
    plan = ragged.plan_ragged(start, CANDIDATES[1])
    k, estimates = ragged.estimate_ragged(plan, CANDIDATES[1:], prof)
    return k, estimates, dataclasses.replace(plan, chunks=k)

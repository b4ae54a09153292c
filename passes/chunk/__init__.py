"""Split collectives on the critical path into pipelined pieces.

    notes = chunk_collectives(gm, chunks)   # chunks: int, or "auto" (with an estimator);
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

from overlapc.passes.collectives import collective_op, group_of
from overlapc.passes import meta

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


def chunk_collectives(gm: fx.GraphModule, chunks: int | str, estimator=None) -> list[ChunkNote]:
    """Split qualifying all-gather/matmul, matmul/reduce-scatter and
    all-to-all/expert/all-to-all patterns of ``gm`` into ``chunks`` pipelined
    pieces, in place (``gm.graph`` only: the caller recompiles). ``chunks="auto"``:
    per pattern (per chain of patterns that feed one another), the count in
    ``estimate.CANDIDATES`` that ``estimator`` (what ``estimate``'s functions take: an
    ``overlapc.costmodel.Profile``, handed in by the caller) estimates
    fastest; ValueError without one. Returns one note per pattern found, applied or not, and
    appends them to ``gm.meta[meta.CHUNKS]``. chunks == 1 changes nothing and
    returns []."""
    auto = chunks == "auto"
    if not auto and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f'chunk_collectives: chunks must be an int >= 1 or "auto", got {chunks!r}')
    if auto and estimator is None:
        raise ValueError('chunk_collectives: chunks="auto" needs an estimator to choose piece counts with: '
                         "pass overlapc.costmodel.resolve(profile), or call overlapc.schedule")
    notes = _Chunker(gm, chunks, estimator).run() if auto or chunks > 1 else []
    meta.add_notes(gm, meta.CHUNKS, notes)
    return notes


@dataclasses.dataclass(frozen=True)
class _Choice:
    """The count a pattern takes: ``k`` pieces (with chunks="auto", 1 when leaving it
    alone is estimated fastest), the estimates its note reports, its start names, and
    with chunks="auto" the Skip to report when its chain chose a count it cannot take."""

    k: int
    estimates: tuple[tuple[int, float], ...]
    starts: tuple[str, ...]
    skip: Exception | None = None


class _Chunker:
    """One chunk_collectives run: each pattern's count chosen (given, auto, or auto
    for data-dependent splits), planned, and emitted through one Emitter."""

    def __init__(self, gm: fx.GraphModule, chunks: int | str, estimator):
        from overlapc.passes.chunk.emit import Emitter
        from overlapc.passes.chunk.plan import Planner

        self.gm, self.chunks, self.auto = gm, chunks, chunks == "auto"
        self.left = 1 if self.auto else chunks   # a note's count when the pattern is left alone
        self.prof, self.choices = None, {}
        if self.auto:
            self.prof = estimator
            self.choices = _auto_counts(gm, self.prof)
        self.planner = Planner(gm)
        self.emitter = Emitter(gm, self.planner)
        self.done: set[fx.Node] = set()

    def run(self) -> list[ChunkNote]:
        from overlapc.passes.chunk.plan import PATTERNS

        notes = [self._note(start) for start in [n for n in self.gm.graph.nodes if collective_op(n) in PATTERNS]
                 if start not in self.done]
        if self.emitter.changed:
            self.emitter.finish()
            self.gm.graph.lint()
        return notes

    def _note(self, start: fx.Node) -> ChunkNote:
        """Choose, plan and emit the pattern of ``start``; its note."""
        from overlapc.passes.chunk import ragged
        from overlapc.passes.chunk.legality import Skip
        from overlapc.passes.chunk.plan import PATTERNS

        pattern, group = PATTERNS[collective_op(start)], group_of(start)
        exchange = ragged.count_exchange(start)
        if exchange is not None:
            self.done.add(start)
            return ChunkNote(pattern, (start.name,), group, self.left, False, exchange)
        uneven = ragged.is_ragged(start)
        choice = _Choice(self.left, (), (start.name,))
        try:
            choice, plan = self._choose(start, uneven)
            if choice.skip is not None:
                raise choice.skip
            if choice.k == 1:   # chunks="auto" only
                self.done.update(n for n in self.gm.graph.nodes if n.name in choice.starts)
                return ChunkNote(pattern, choice.starts, group, 1, False,
                                 "chunks auto: one piece is estimated fastest", estimates=choice.estimates)
            if plan is None:
                plan = ragged.plan_ragged(start, choice.k) if uneven else self.planner.plan(start, choice.k)
            pieces = ragged.emit_ragged(self.emitter, plan) if uneven else self.emitter.emit(plan)
        except Skip as skip:
            self.emitter.discard()
            self.done.add(start)
            return ChunkNote(pattern, (start.name,), group, self.left, False, str(skip), estimates=choice.estimates)
        self.done.update(plan.starts)
        fed_by = plan.link.joined.start if plan.link is not None else ""
        return ChunkNote(plan.pattern, tuple(n.name for n in plan.starts), group, choice.k, True,
                         plan.stops, pieces, fed_by, choice.estimates)

    def _choose(self, start: fx.Node, uneven: bool) -> tuple[_Choice, object]:
        """The count for ``start``'s pattern: the one given, or chunks="auto"'s choice
        (``_auto_counts``), or for data-dependent splits its own with the plan it was
        estimated on (``_choose_ragged``); the plan is None otherwise."""
        if not self.auto:
            return _Choice(self.chunks, (), (start.name,)), None
        if uneven:
            return _choose_ragged(start, self.prof)
        return self.choices.get(start.name, _Choice(1, (), (start.name,))), None


@dataclasses.dataclass
class _Trial:
    """One pattern emitted with k pieces on a copy of the graph."""

    ms: float                        # its pipeline's estimate with k pieces (its bridge inside when fed)
    one_ms: float                    # its estimate left alone (1 piece, nothing feeds it), no bridge
    fed_by: str                      # its feeder's start name, or ""
    bridge_ms: float                 # the compute from its feeder's result to its input
    starts: tuple[str, ...]


@dataclasses.dataclass
class _Trials:
    """Every count in ``CANDIDATES`` (but 1) emitted for the whole graph on a copy."""

    runs: dict[str, dict[int, _Trial]] = dataclasses.field(default_factory=dict)   # pattern -> k -> trial
    skips: dict[str, Exception] = dataclasses.field(default_factory=dict)   # pattern -> its first Skip
    order: list[str] = dataclasses.field(default_factory=list)              # patterns in graph order
    owner: dict[str, str] = dataclasses.field(default_factory=dict)         # any start's name -> its pattern

    def add(self, gm: fx.GraphModule, k: int, prof) -> None:
        """Emit every pattern (but the ragged ones and count exchanges) with ``k`` pieces
        on a copy of ``gm``; a pattern is named by its first start's name."""
        import copy

        from overlapc.passes.chunk import ragged
        from overlapc.passes.chunk.emit import Emitter
        from overlapc.passes.chunk.estimate import pipeline_ms
        from overlapc.passes.chunk.legality import Skip
        from overlapc.passes.chunk.plan import PATTERNS, Planner

        trial = copy.deepcopy(gm)
        planner = Planner(trial)
        emitter = Emitter(trial, planner)
        done: set[fx.Node] = set()
        for start in [n for n in trial.graph.nodes if collective_op(n) in PATTERNS]:
            if start in done or ragged.count_exchange(start) is not None or ragged.is_ragged(start):
                continue
            if start.name not in self.order:
                self.order.append(start.name)
            try:
                plan = planner.plan(start, k)
                ms, one_ms = pipeline_ms(plan, k, prof), pipeline_ms(plan, 1, prof)
                emitter.emit(plan)
            except Skip as skip:
                emitter.discard()
                done.add(start)
                self.skips.setdefault(start.name, skip)
                continue
            done.update(plan.starts)
            bridge = sum(prof.compute_ms(n) for n in (plan.link.bridge if plan.link else ()))
            starts = tuple(n.name for n in plan.starts)
            self.owner.update((name, start.name) for name in starts)
            self.runs.setdefault(start.name, {})[k] = _Trial(
                ms, one_ms - bridge, plan.link.joined.start if plan.link is not None else "", bridge, starts)

    def chains(self) -> list[_Chain]:
        """Patterns joined by a feed at any count, each chain in graph order."""
        head = {name: name for name in self.order}
        for name in self.order:
            for t in self.runs.get(name, {}).values():
                if t.fed_by in self.owner:
                    a, b = sorted((_root(head, self.owner[t.fed_by]), _root(head, name)), key=self.order.index)
                    head[b] = a
        members: dict[str, list[str]] = {}
        for name in self.order:
            members.setdefault(_root(head, name), []).append(name)
        return [_Chain(names, self) for names in members.values()]


def _root(head: dict, name: str) -> str:
    while head[name] != name:
        name = head[name]
    return name


@dataclasses.dataclass
class _Chain:
    """Patterns that feed one another at some count: they take one count together, the
    one ``estimate.fastest`` puts first by summed estimate."""

    members: list[str]
    trials: _Trials

    def estimate(self, name: str, k: int) -> float:
        """The pattern's estimate with k pieces (1, or a count it cannot take: left
        alone), its bridge compute included (inside the pipeline when fed, before it
        when not)."""
        runs = self.trials.runs[name]
        bridge = max(r.bridge_ms for r in runs.values())
        if k not in runs:
            return runs[min(runs)].one_ms + bridge
        return runs[k].ms + (0.0 if runs[k].fed_by else bridge)

    def choices(self) -> dict[str, _Choice]:
        from overlapc.passes.chunk.estimate import fastest

        cut = [m for m in self.members if m in self.trials.runs]
        ks = [1, *sorted({k for m in cut for k in self.trials.runs[m]})]
        summed = tuple((k, sum(self.estimate(m, k) for m in cut)) for k in ks)
        best = fastest(summed) if cut else 1
        return {m: self._choice(m, best, summed if len(cut) > 1 else None) for m in self.members}

    def _choice(self, name: str, best: int, summed) -> _Choice:
        """``name``'s choice when its chain takes ``best`` pieces; its note reports the
        chain's ``summed`` estimates, or its own when it is alone (None)."""
        from overlapc.passes.chunk.legality import Skip

        runs, skip = self.trials.runs.get(name), self.trials.skips.get(name)
        if runs is None:
            return _Choice(1, (), (name,), skip)
        own = tuple((k, self.estimate(name, k)) for k in [1, *sorted(runs)])
        if best not in runs and best != 1:
            why = skip or Skip(f"chunks auto: its chain takes {best} pieces, which do not cut it")
            return _Choice(1, own, runs[min(runs)].starts, why)
        return _Choice(best, summed or own, runs.get(best, runs[min(runs)]).starts)


def _auto_counts(gm: fx.GraphModule, prof) -> dict[str, _Choice]:
    """start name -> its _Choice, for chunks="auto" and every pattern but the ragged
    ones and count exchanges. Each count in ``CANDIDATES`` is emitted for the whole
    graph on a copy (``_Trials``); patterns joined by a feed at any count form a chain
    (``_Chain``) that takes one count."""
    from overlapc.passes.chunk.estimate import CANDIDATES

    trials = _Trials()
    for k in CANDIDATES[1:]:
        trials.add(gm, k, prof)
    choices: dict[str, _Choice] = {}
    for chain in trials.chains():
        choices.update(chain.choices())
    return choices


def _choose_ragged(start: fx.Node, prof) -> tuple[_Choice, object]:
    """chunks="auto" on an all-to-all with data-dependent splits (``ragged``): the choice
    and the Plan for its count; every count cuts (empty pieces are allowed), estimated
    assuming balanced routing; such pipelines never chain."""
    from overlapc.passes.chunk import ragged
    from overlapc.passes.chunk.estimate import CANDIDATES
    plan = ragged.plan_ragged(start, CANDIDATES[1])
    k, estimates = ragged.estimate_ragged(plan, CANDIDATES[1:], prof)
    return _Choice(k, estimates, tuple(n.name for n in plan.starts)), dataclasses.replace(plan, chunks=k)

"""Identical collectives made one, in place (``merge_duplicates``: the step the pipeline runs
before bucketing, so that a bucket never holds the same collective twice and an activation
gathered for several modules is gathered once), and the waits of one result made one
(``merge_repeated_waits``: the first step of every schedule, so that every later step sees
one wait per collective). Rules in each function. ``overlapc.passes.bucket`` exports
``merge_duplicates``."""
from __future__ import annotations

import logging
import operator
from typing import Callable

import torch.fx as fx

from overlapc.passes import meta
from overlapc.passes.collectives import group_of, is_wait, role, wait_nodes
from overlapc.passes.structure import Structure

log = logging.getLogger("overlapc")

# (node, its waits when it starts a collective else None, is a barrier, its collective's group or None)
_Mark = tuple[fx.Node, "tuple[fx.Node, ...] | None", bool, "str | None"]


def merge_repeated_waits(gm: fx.GraphModule,
                         before_rewrite: Callable[[], None] | None = None) -> list[tuple[str, ...]]:
    """Make the waits of one tensor one, in place. AOTAutograd's CSE turns a collective
    traced twice (a parametrization that gathers its parameter at every read, as
    SimpleFSDP's does, read twice) into one start with a ``wait_tensor`` per read, and a
    pass that re-waits a result leaves a wait of a wait. Every ``wait_tensor`` of a tensor
    that an earlier ``wait_tensor`` in graph order already waits becomes that earlier one,
    and a ``wait_tensor`` of a wait's result becomes that wait: a wait returns its argument,
    and the first wait completes the collective before any later one's readers run, so
    values and memory stay. Bucketing leaves collectives with several waits alone; after
    this they can join a bucket. Deterministic (graph order). Returns (kept, erased, ...)
    wait names per kept wait that took others, in the order of their first repeat; logs one INFO line.
    ``before_rewrite``: as for ``bucket_collectives``."""
    first_wait: dict[fx.Node, fx.Node] = {}   # waited tensor -> its first wait (lookups only)
    repeats: list[tuple[fx.Node, fx.Node]] = []
    for node in gm.graph.nodes:
        if not is_wait(node) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        waited = node.args[0]
        kept = waited if is_wait(waited) else first_wait.setdefault(waited, node)
        if kept is not node:
            repeats.append((kept, node))
    if not repeats:
        return []
    if before_rewrite is not None:
        before_rewrite()
    replaced: dict[fx.Node, fx.Node] = {}   # erased repeat -> the wait that took its readers
    erased: dict[fx.Node, list[str]] = {}
    for kept, repeat in repeats:   # graph order: a kept wait that is itself a repeat is replaced already
        kept = replaced.get(kept, kept)
        replaced[repeat] = kept
        repeat.replace_all_uses_with(kept)
        gm.graph.erase_node(repeat)
        erased.setdefault(kept, []).append(repeat.name)
    gm.graph.lint()
    names = [(kept.name, *repeated) for kept, repeated in erased.items()]
    log.info("overlapc: made %d repeated waits one with the earlier wait of the same result: %s",
             len(repeats), "; ".join(f"{', '.join(rest)} -> {kept}" for kept, *rest in names))
    return names


def merge_duplicates(gm: fx.GraphModule, before_rewrite: Callable[[], None] | None = None,
                     structure: Structure | None = None) -> list[tuple[str, ...]]:
    """Make identical collectives one, in place. First, a collective nothing
    reads (every wait unused) that an identical collective later in the graph
    repeats is erased: torch 2.14's min-cut partitioner gathers each
    ``nn.MultiheadAttention`` ``in_proj_weight`` / ``in_proj_bias`` twice in
    the forward and reads only the second. Then starts of the same op with the same
    arguments (the same input nodes, group and sizes), each read by exactly one
    ``wait_tensor``, with no other collective of their group and no barrier between
    them. DTensor emits them when several modules ask for the same redistribution
    (``ColwiseParallel(input_layouts=Shard(1))`` on q, k and v each gathers the same
    activation). The same parameter gathered again later (tied weights, FSDP's
    re-gather) is not merged: other collectives of its group stand between, and
    merging would hold the gathered result all that time. The first start is kept;
    its wait moves to just before the first of the merged waits and takes their
    users; the others are erased. Every rank traces the same graph, so every rank
    merges the same collectives. Returns the merged starts' names, each group
    first-kept, in graph order (also appended to ``gm.meta["overlapc_duplicates"]``).
    ``before_rewrite``: as for ``bucket_collectives``. ``structure``: ``Structure(gm)`` of the graph
    as it stands, when the caller has it (its collectives and barriers stand for a walk of the graph)."""
    marks = _starts_and_barriers(gm, structure)
    names = _drop_unread_repeats(gm, [(node, waits) for node, waits, _, _ in marks if waits is not None],
                                 before_rewrite)
    if names:   # a write that the erased collectives read may be no barrier now
        marks = _starts_and_barriers(gm)
    names += _merge_identical_runs(gm, marks, before_rewrite)
    if names:
        gm.graph.lint()
    meta.add_notes(gm, meta.DUPLICATES, names)
    return names


def _starts_and_barriers(gm: fx.GraphModule, structure: Structure | None = None) -> list[_Mark]:
    """(node, its waits (``wait_nodes``) when it starts a collective else None, is a barrier,
    its collective's group or None) for each node of ``gm`` that starts a collective or is a
    barrier, in graph order: what both merging steps read, from one ``role`` lookup a node, or
    from ``structure`` (``Structure(gm)``: its collectives, found and paired the same way, and
    its barriers)."""
    if structure is not None:
        found = {c.start: [c.waits, False, c.group] for c in structure.all}
        for barrier in structure.barriers:
            found.setdefault(barrier, [None, False, None])[1] = True
        return sorted(((node, *mark) for node, mark in found.items()), key=lambda mark: structure.pos[mark[0]])
    marks = []
    for node in gm.graph.nodes:
        start, _, barrier = role(node)
        if start is not None or barrier is not None:
            marks.append((node, wait_nodes(node) if start is not None else None, barrier is not None,
                          group_of(node) if start is not None else None))
    return marks


def _drop_unread_repeats(gm: fx.GraphModule, starts: list[tuple[fx.Node, tuple[fx.Node, ...]]],
                         before_rewrite: Callable[[], None] | None) -> list[tuple[str, ...]]:
    """Erase every collective whose waits nobody reads when a later collective
    with the same op and arguments exists (the same result is computed again
    where it is read). ``starts``: every collective start of ``gm`` with its waits, in graph order.
    Values are unchanged, and every rank traces the same graph, so every rank
    erases the same collectives. Returns (kept, erased) name pairs in graph order."""
    unread = {start for start, waits in starts if _unread(start, waits)}   # (membership only)
    if not unread:   # the common case: no arguments hashed
        return []
    seen: dict[tuple, list[fx.Node]] = {}
    for node, _ in starts:
        seen.setdefault((node.target, _key(node.args), _key(node.kwargs)), []).append(node)
    dropped = [(later, earlier) for same in seen.values()
               for earlier, later in zip(same, same[1:]) if earlier in unread]
    if not dropped:
        return []
    if before_rewrite is not None:
        before_rewrite()
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    dropped.sort(key=lambda pair: position[pair[1]])
    for _, earlier in dropped:
        for wait in wait_nodes(earlier):
            gm.graph.erase_node(wait)
        for getitem in list(earlier.users):   # left without users by the waits' erasure
            gm.graph.erase_node(getitem)
        gm.graph.erase_node(earlier)
    names = [(later.name, earlier.name) for later, earlier in dropped]
    log.info("overlapc: erased %d collectives whose results nothing reads, each repeated later: %s",
             len(names), "; ".join(f"{erased} (again as {kept})" for kept, erased in names))
    return names


def _unread(start: fx.Node, waits: tuple[fx.Node, ...]) -> bool:
    """Whether nothing reads the result of the collective ``start`` (its waits ``waits``,
    ``wait_nodes``): it has waits, its only users are them (or getitems read only by them),
    and the waits have no users."""
    only_waits = all(u in waits or (u.target is operator.getitem and all(w in waits for w in u.users))
                     for u in start.users)
    return bool(waits) and only_waits and not any(w.users for w in waits)


def _merge_identical_runs(gm: fx.GraphModule, marks: list[_Mark],
                          before_rewrite: Callable[[], None] | None) -> list[tuple[str, ...]]:
    """Merge runs of identical, adjacent-in-their-group collectives (see
    ``merge_duplicates``); ``marks``: ``_starts_and_barriers`` of ``gm``. Returns the
    merged starts' names, first-kept."""
    runs: list[list[fx.Node]] = []
    run_of: dict[fx.Node, list[fx.Node]] = {}   # mergeable start -> its run (identical starts so far)
    last: dict[str, fx.Node] = {}                # the latest start of each group
    for node, waits, barrier, group in marks:
        if barrier:
            run_of.clear()
            last.clear()
            continue
        if len(waits) == 1 and waits[0].args[0] is node and len(node.users) == 1:
            # a run goes on only from the group's latest start (identical arguments name the
            # same group): compare with that one, the input nodes first (no arguments hashed)
            previous = last.get(group)
            run = run_of.get(previous)
            if run is not None and _identical(previous, node):
                run.append(node)
            else:
                run = [node]
                runs.append(run)
            run_of[node] = run
        last[group] = node
    merged = [run for run in runs if len(run) > 1]   # graph order of their first start
    if not merged:
        return []
    if before_rewrite is not None:
        before_rewrite()
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for kept, *others in merged:
        wait = wait_nodes(kept)[0]
        waits = [wait_nodes(other)[0] for other in others]
        first = min(waits, key=position.__getitem__)
        if position[first] < position[wait]:
            first.prepend(wait)
        for other, other_wait in zip(others, waits):
            other_wait.replace_all_uses_with(wait)
            gm.graph.erase_node(other_wait)
            gm.graph.erase_node(other)
    names = [tuple(n.name for n in run) for run in merged]
    log.info("overlapc: merged %d identical collectives into %d: %s",
             sum(len(n) - 1 for n in names), len(names), "; ".join(", ".join(n) for n in names))
    return names


def _identical(a: fx.Node, b: fx.Node) -> bool:
    """Whether starts ``a`` and ``b`` have the same op and arguments (``_key``: nodes by
    identity, lists as tuples); the input nodes are compared first, unhashed."""
    return (a.target == b.target and list(a._input_nodes) == list(b._input_nodes)
            and _key(a.args) == _key(b.args) and _key(a.kwargs) == _key(b.kwargs))


def _key(value):
    """A hashable form of a node's arguments: nodes by identity, lists as tuples."""
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in value.items())
    return (type(value).__name__, repr(value))

"""Keep or re-gather: per block, whether the backward gathers a parameter again.

In a joint forward + backward graph with FSDP's reshard-after-forward (or
graph_trainer's remat), a parameter is all-gathered twice: for the forward and
again for the backward. Keeping the forward's gathered weight alive until the
backward saves the second all-gather and costs its bytes for the time between.
FSDP2 leaves this to a manual flag (``reshard_after_forward``); here it is a
per-block decision under a memory budget: blocks are tried from the last one
forward (the last blocks' weights are needed again soonest, so keeping them
costs least), and a block's forward gathers are kept only when the graph's
peak live bytes, with every re-gather of that block dropped, stay within the
budget (default: the graph's own peak, so keeping never raises it).

Two all-gathers gather the same value when they read the same graph input
through the same chain of cheap ops (casts, views) with the same arguments, on
the same group, with no barrier between them. The block of a gather is
``overlapc.passes.bucket.block_of`` of its module path, else the gather alone.

``keep_or_regather(gm, budget)`` edits ``gm`` in place (the backward's wait
readers read the forward's wait; the re-gather and its input chain are
erased), returns what it chose and appends the choices to
``gm.meta["overlapc_regather"]``. ``overlapc.schedule`` runs it before
bucketing and scheduling with ``OverlapConfig(regather="auto")`` (the
scheduler then sees one all-gather where there were two); a graph without
re-gathers (a forward or backward graph alone) is left as it is.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch.fx as fx

from overlapc.passes.collectives import collectives, is_cheap, module_path, role
from overlapc.passes import meta
from overlapc.passes.bucket import block_of
from overlapc.passes.memory import EditedPeak, Liveness, peak_bytes

log = logging.getLogger("overlapc")


@dataclasses.dataclass(frozen=True)
class RegatherChoice:
    """One block: ``kept`` when its forward gathers stay alive for the backward and
    its re-gathers (``regathers``, start names) were erased; ``nbytes`` the gathered
    bytes concerned; ``peak`` the graph's peak with them kept (whether or not chosen)."""

    block: str
    kept: bool
    regathers: tuple[str, ...]
    nbytes: int
    peak: int


@dataclasses.dataclass(frozen=True)
class RegatherResult:
    """Every block with a re-gather, last block first; the budget and the peaks."""

    choices: tuple[RegatherChoice, ...]
    budget: int
    peak_before: int
    peak_after: int


@dataclasses.dataclass
class _Pair:
    early_wait: fx.Node
    late_start: fx.Node
    late_wait: fx.Node
    nbytes: int


def keep_or_regather(gm: fx.GraphModule, budget: int | None = None,
                     before_rewrite: Callable[[], None] | None = None, recompile: bool = True,
                     liveness: Liveness | None = None) -> RegatherResult:
    """Drop the re-gathers of every block whose forward gathers fit the memory
    budget kept alive (module docstring). ``budget``: peak live bytes allowed,
    None for the graph's own peak. ``before_rewrite``: called once before the
    graph is first changed (the pipeline's snapshot for a rollback).
    ``recompile=False``: ``gm.forward`` is not regenerated after re-gathers are
    erased (the pipeline recompiles once, at its end). Returns the choices, last
    block first (also appended to ``gm.meta["overlapc_regather"]``). Each block's
    trial recounts only what it changes (``memory.EditedPeak``), starting from
    ``liveness`` (``memory.Liveness`` of the graph as it stands, left unchanged) when
    the caller has one."""
    nodes = list(gm.graph.nodes)
    blocks = _pairs_by_block(gm, nodes)
    if not blocks:
        return RegatherResult((), budget or 0, 0, 0)
    if before_rewrite is not None:
        before_rewrite()
    tracker = EditedPeak(nodes, liveness)   # counts each block's change, not the whole graph again
    peak_before = tracker.peak
    budget = peak_before if budget is None else budget
    choices = []
    for block, pairs in blocks:
        saved = [(user, user.args, user.kwargs) for p in pairs for user in p.late_wait.users]
        for p in pairs:
            p.late_wait.replace_all_uses_with(p.early_wait)
        peak = tracker.edit(_dead_after(pairs), [user for user, _, _ in saved])
        kept = peak <= budget
        if not kept:
            tracker.undo()
            for user, args, kwargs in saved:
                user.args, user.kwargs = args, kwargs
        choices.append(RegatherChoice(block, kept, tuple(p.late_start.name for p in pairs),
                                      sum(p.nbytes for p in pairs), peak))
    dead = tracker.dropped
    for node in reversed(nodes):
        if node in dead:
            gm.graph.erase_node(node)
    if dead:
        gm.graph.lint()
        if recompile:
            gm.recompile()
    peak_after = peak_bytes(list(gm.graph.nodes)) if dead else peak_before   # nothing dropped: the graph is as it was
    result = RegatherResult(tuple(choices), budget, peak_before, peak_after)
    meta.add_notes(gm, meta.REGATHER, choices)
    log.info("overlapc: %s", summary_text(result))
    return result


def summary_text(result: RegatherResult) -> str:
    """One line: the blocks whose forward gathers were kept for the backward (with
    the bytes kept alive and re-gathers dropped), the count re-gathered, the peaks."""
    kept = [c for c in result.choices if c.kept]
    names = ", ".join(f"{c.block or '?'} ({c.nbytes} B, {len(c.regathers)} re-gathers dropped)" for c in kept)
    return (f"forward gathers kept for the backward in {len(kept)} of {len(result.choices)} blocks"
            + (f": {names}" if kept else "") + f"; peak {result.peak_before} -> {result.peak_after} bytes "
            f"(budget {result.budget})")


def _pairs_by_block(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[tuple[str, list[_Pair]]]:
    """Re-gathers paired with the first gather of the same value, grouped by the
    first gather's block; blocks ordered by their first forward gather, last first."""
    barriers_before, count = {}, 0
    for node in nodes:
        barriers_before[node] = count
        count += role(node)[2] is not None
    first: dict[tuple, object] = {}
    blocks: dict[str, list[_Pair]] = {}
    position: dict[str, int] = {}
    index = {node: i for i, node in enumerate(nodes)}
    for c in collectives(gm):
        if c.kind != "all_gather" or not c.movable or len(c.waits) != 1:
            continue
        signature = _signature(c.start)
        if signature is None:
            continue
        key = (signature, c.group)
        earlier = first.setdefault(key, c)
        if earlier is c or barriers_before[earlier.start] != barriers_before[c.start]:
            continue
        block = block_of(module_path(earlier.start)) or earlier.start.name
        blocks.setdefault(block, []).append(_Pair(earlier.waits[0], c.start, c.waits[0], c.nbytes or 0))
        position.setdefault(block, index[earlier.start])
    order = sorted(blocks, key=position.__getitem__, reverse=True)
    return [(block, blocks[block]) for block in order]


def _signature(start: fx.Node) -> tuple | None:
    """What ``start`` gathers: its op and arguments, with each node argument
    replaced by the chain of cheap ops from a graph input; None when an input
    is computed (not a graph input through cheap ops)."""
    def of(value):
        if isinstance(value, fx.Node):
            if value.op in ("placeholder", "get_attr"):
                return ("input", value.name)
            if value.op != "call_function" or not is_cheap(value) or role(value)[2] is not None:
                raise LookupError
            return (str(value.target), of(list(value.args)), of(dict(value.kwargs)))
        if isinstance(value, (list, tuple)):
            return tuple(of(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, of(v)) for k, v in sorted(value.items()))
        return (type(value).__name__, repr(value))
    try:
        return (str(start.target), of(list(start.args)), of(dict(start.kwargs)))
    except LookupError:
        return None


def _dead_after(pairs: list[_Pair]) -> set[fx.Node]:
    """The re-gathers' waits and starts and the input chains only they read."""
    dead: set[fx.Node] = set()
    frontier = []
    for p in pairs:
        dead.update((p.late_wait, p.late_start))
        frontier.extend(p.late_start._input_nodes)
    while frontier:
        node = frontier.pop()
        if node in dead or node.op in ("placeholder", "get_attr"):
            continue
        if all(u in dead for u in node.users):
            dead.add(node)
            frontier.extend(node._input_nodes)
    return dead

"""Per-collective rows and a graph summary, before and after scheduling.

The scheduler works in place, so callers record the order first::

    before = [n.name for n in gm.graph.nodes]
    overlapc.schedule(gm, cfg)
    rows = report.rows(gm, before, profile)
    print(report.format_text(rows, report.summary(gm, before, profile)))

``format_graph`` is the per-graph text of ``overlapc report`` (compact, within
``WIDTH`` columns; ``wide=True``: every column, as ``format_graph_wide`` writes
report.txt);
``write_artifacts(record, folder)`` writes the four files per graph that
``overlapc dump`` and the backend's ``dump_dir`` produce.

Both orders are simulated (``overlapc.estimate.simulate``), once per graph: ``study``
returns rows and summary together, and ``rows``/``summary`` reuse its latest
result. A *compute node* is a node
with estimated cost > 0 that is not a collective start, a wait, or a member of
their bundles (a start's cheap input chain, a wait's views; see
``passes/structure.py``). Positions are indices into the node order; a row's
positions can differ before and after without the row having moved, when other
collectives moved around it.

Moved. A collective *moved* when its start or one of its waits now stands
between other nodes of the graph than before, counting every node that is not
a collective start, a wait or a member of their bundles (placeholders, views
and free ops included, whatever their estimated cost): the number of such nodes
before it changed. The summary's ``moved`` is the number of rows with moved set.

Module. ``module`` is the user's module that reads the collective's parameter:
Dynamo's ``nn_module_stack`` (``fwd_nn_module_stack`` in backward graphs, which
AOTAutograd copies from the forward node; the nearest input with a stack when
the node has none), innermost first, skipping parametrization and wrapper
entries (``torch.nn.utils.parametrize``'s ``parametrizations.<name>``,
torchtitan SimpleFSDP's ``dict(type(m).__dict__)['<name>'].fget...`` property,
any entry that is not a plain dotted path, FSDP/checkpoint/compile wrapper
segments, and modules that are not a submodule of the entry outside them: a
shared module carries the path of its first user). When no user module is
left, the parameter's qualified name ("blocks.0.attn.wq.weight") when a
parametrization entry names it, else "".

Exposed time. The simulator's stall on each wait is shared among the
collectives its group's stream ran during the stall (a wait on a collective
queued behind another waits for both), so a row's ``exposed_ms`` is the
compute stall its own transfer caused, and the rows add up to the summary's
total. Verdicts. A collective is "hidden" when that exposed time is < 1% of its
duration or < 1 us (the simulator's rule); otherwise "exposed" with the first
reason whose rule holds, checked in this order, on the order after scheduling.
Let *consumer* be its first real consumer (the output node when nothing reads
it) and *ready* the position of the latest node its start reads (looking
through its input chain; -1 when it reads nothing):

1. "graph input/output": the consumer is the output node (the result is a
   graph output), or no compute node stands before the consumer (it feeds the
   graph's first compute, like the forward's first all-gather).
2. "data dependency": no compute node stands between ready and the consumer:
   its input is produced right before its result is needed, so no order of
   these nodes could overlap it.
3. "in-flight limit": an all-gather whose start stands right after the wait
   of another all-gather of its group (only non-compute nodes between), with
   compute between ready and that wait: the in-flight bound delayed an issue
   that its inputs allowed earlier.
4. "no compute left": otherwise. The compute between its issue and its wait
   (``compute_ms``) is shorter than the time from issue until it ends (its own
   ``comm_ms`` plus any time queued behind earlier collectives of its group).

Recorded reasons. The scheduler records why it placed each start and wait in
``node.meta[passes.meta.REASON]`` (starts: "inputs ready", "count bound", "byte
budget", "consumer order", "forced by consumer", "not moved"; waits: "before
consumer", "before output", "before barrier", "early for room"). A row's
``issue_reason`` and ``wait_reason`` (its first wait) carry them, "" for a node
without one (a graph scheduled before reasons were recorded). The table prints
them in its "placed" column ("-" when none), beside the verdict with its
inferred reason; ``Row.why`` is the recorded reasons, else the inferred one.

``to_json`` schema ("overlapc.report/1")::

    {"schema": "overlapc.report/1",
     "summary": {<the keys of summary(), below>},
     "collectives": [{<the fields of Row, below>}, ...],   # in issue order after
     "dispatch": {"device": "cuda" | "cpu", "attention": [kernel, ...], "partitioner": str,
                  "described": str}}   # only where the writer knows how the graph was captured

Row fields: name (start node), kind, group (the mesh dim name where a DeviceMesh
names the process group, ``costmodel.group_label``, else its name), nbytes (int or null), dtype (str
or null), module (qualified path or ""), issue_before, wait_before,
issue_after, wait_after (positions; a wait position is the collective's first
wait, null when it has none), moved (bool, see "Moved"), compute_nodes and
compute_ms (between issue and first wait, after), comm_ms, exposed_ms_before,
exposed_ms (after), verdict ("hidden" | "exposed"), reason (inferred, "" when
hidden), issue_reason and wait_reason (recorded, "" when none), start_ms and
end_ms (when it runs in the simulated order after, ms from the graph's start).

Summary keys: collectives, moved, hidden_before, hidden_after,
exposed_ms_before, exposed_ms_after, peak_in_flight_bytes_before,
peak_in_flight_bytes_after (bytes held by collectives in flight, all groups and
kinds together: an all-gather's output and input, another collective's input;
``passes/inflight.py``), peak_bytes_before, peak_bytes_after (peak live bytes
along the order, ``passes/memory.py``), in_flight (per kind the graph has, in
KINDS order: {kind: {"count_before", "count_after", "bytes_before",
"bytes_after"}}: the most collectives of that kind of one group issued and not
yet waited, and the most bytes they held), rewrites (``rewrites()``: one dict
per run of identical collectives merged, bucket or chunked pattern),
step_ms_before, step_ms_after, compute_ms (the compute nodes' estimated time,
the same in both orders), issue_ms_after (the compute stream's time issuing
collectives after: step = compute + issue + exposed), device, link, profile
(its name) and profile_source (where its numbers came from).
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import json
import os
import textwrap
import weakref
from typing import Callable

import torch.fx as fx

from overlapc.collectives import KINDS as COLLECTIVE_KINDS
from overlapc.collectives import Collective, alias_closure, module_path, real_consumers
from overlapc.estimate import costmodel
from overlapc.estimate.simulate import HIDDEN_FRACTION, HIDDEN_MS, Timeline, checked_order, simulate
from overlapc.passes import meta
from overlapc.passes.inflight import replay
from overlapc.passes.structure import Structure

SCHEMA = "overlapc.report/1"
KINDS = tuple(COLLECTIVE_KINDS)   # the order tables list kinds in
REASONS = ("graph input/output", "data dependency", "in-flight limit", "no compute left")
REASON_KEY = meta.REASON   # node.meta key where the scheduler records why it placed a start or wait


@dataclasses.dataclass(frozen=True)
class Row:
    """One collective before and after scheduling (see the module docstring)."""

    name: str
    kind: str
    group: str
    nbytes: int | None
    dtype: str | None
    module: str
    issue_before: int
    wait_before: int | None
    issue_after: int
    wait_after: int | None
    moved: bool
    compute_nodes: int
    compute_ms: float
    comm_ms: float
    exposed_ms_before: float
    exposed_ms: float
    verdict: str
    reason: str
    issue_reason: str
    wait_reason: str
    start_ms: float
    end_ms: float

    @property
    def why(self) -> str:
        """The scheduler's recorded reasons ("inputs ready; before consumer"), else the
        inferred reason of an exposed row, else ""."""
        recorded = "; ".join(r for r in (self.issue_reason, self.wait_reason) if r)
        return recorded or self.reason


_last: list = []   # [(key, rows, summary)] of the latest study: rows() then summary() simulate once


def study(gm_after: fx.GraphModule, before_order: list[str], profile: costmodel.Profile | str | None = None, *,
          compute_ms: Callable[[fx.Node], float] | None = None,
          comm_ms: Callable[[Collective], float] | None = None,
          structure: Structure | None = None) -> tuple[list[Row], dict]:
    """``(rows, summary)`` of one graph: each order (before, after) simulated once. The
    latest result is kept, so ``rows`` and ``summary`` called one after the other on the
    same graph, orders, profile and costs share it. Arguments as in ``rows``;
    ``structure``: ``gm_after``'s ``Structure`` when the caller has it, built on this order
    or on the order the scheduler was given (``ScheduleResult.structure``: its bundles,
    consumers and regions hold in both; positions are taken from ``gm_after``), else
    built here."""
    profile = costmodel.resolve(profile)
    key = (id(gm_after), tuple(before_order), tuple(n.name for n in gm_after.graph.nodes), profile,
           compute_ms, comm_ms)
    if _last and _last[0][0] == key and _last[0][1]() is gm_after:
        _, _, rows_, summary_ = _last[0]
    else:
        rows_, summary_ = _study(gm_after, before_order, profile, compute_ms, comm_ms, structure)
        _last[:] = [(key, weakref.ref(gm_after), rows_, summary_)]
    return list(rows_), copy.deepcopy(summary_)


def _study(gm_after: fx.GraphModule, before_order, profile: costmodel.Profile, compute_ms, comm_ms,
           structure: Structure | None = None):
    """Simulate both orders and build every row and the summary."""
    if compute_ms is None:   # estimate each node once for both orders
        memo: dict[fx.Node, float] = {}

        def compute_ms(node: fx.Node) -> float:
            if node not in memo:
                memo[node] = costmodel.compute_ms(node, profile.device)
            return memo[node]
    before = checked_order(gm_after, before_order)
    after = list(gm_after.graph.nodes)
    timeline_before = simulate(gm_after, profile, before, compute_ms=compute_ms, comm_ms=comm_ms)
    timeline_after = simulate(gm_after, profile, after, compute_ms=compute_ms, comm_ms=comm_ms)
    info = structure if structure is not None else Structure(gm_after)
    pos = {n: i for i, n in enumerate(after)}   # ``info`` may be of the order before: positions are these
    found = sorted(info.all, key=lambda c: pos[c.start])
    cost = {name: end - start for name, (start, end) in timeline_after.compute.items()}
    is_compute = [cost.get(n.name, 0.0) > 0 and n not in info.bundled for n in after]
    _, ms_after = _prefix(after, is_compute, cost)
    count_after, _ = _prefix(after, is_compute, cost)
    starts = {c.start for c in found}
    fixed = [n not in info.bundled and n not in starts for n in after]   # what moved nodes move around
    fixed_before, _ = _prefix(before, [fixed[pos[n]] for n in before], cost)
    fixed_after, _ = _prefix(after, fixed, cost)
    pos_before = {n: i for i, n in enumerate(before)}
    gather_waits: dict[str, list[int]] = {}
    for c in found:
        if c.kind == "all_gather":
            gather_waits.setdefault(c.group, []).extend(pos[w] for w in c.waits)
    for waits in gather_waits.values():
        waits.sort()

    exposed_before, exposed_after = _attributed(timeline_before), _attributed(timeline_after)
    rows = []
    for c in found:
        waits_before = sorted(pos_before[w] for w in c.waits)
        waits_after = sorted(pos[w] for w in c.waits)
        issue_b, issue_a = pos_before[c.start], pos[c.start]
        moved = fixed_before[issue_b] != fixed_after[issue_a] or any(
            fixed_before[pos_before[w]] != fixed_after[pos[w]] for w in c.waits)
        until = waits_after[0] if waits_after else len(after)
        timed_after = timeline_after.collectives[c.start.name]
        verdict, reason = "hidden", ""
        if not _hidden(exposed_after[c.start.name], timed_after.duration_ms):
            verdict, reason = "exposed", _reason(c, info, after, pos, count_after, gather_waits)
        rows.append(Row(
            name=c.start.name, kind=c.kind, group=costmodel.group_label(c.group), nbytes=c.nbytes,
            dtype=None if c.dtype is None else str(c.dtype).replace("torch.", ""),
            module=module_path(c.start),
            issue_before=issue_b, wait_before=waits_before[0] if waits_before else None,
            issue_after=issue_a, wait_after=waits_after[0] if waits_after else None,
            moved=moved,
            compute_nodes=count_after[until] - count_after[issue_a + 1],
            compute_ms=ms_after[until] - ms_after[issue_a + 1],
            comm_ms=timed_after.duration_ms,
            exposed_ms_before=exposed_before[c.start.name],
            exposed_ms=exposed_after[c.start.name],
            verdict=verdict, reason=reason,
            issue_reason=meta.reason(c.start),
            wait_reason=meta.reason(after[waits_after[0]]) if c.waits else "",
            start_ms=timed_after.start_ms, end_ms=timed_after.end_ms,
        ))
    summary = _summary(rows, timeline_before, timeline_after, profile)
    summary["peak_bytes_before"] = timeline_before.peak_bytes
    summary["peak_bytes_after"] = timeline_after.peak_bytes
    summary["rewrites"] = rewrites(gm_after)
    summary["in_flight"] = _in_flight(found, before, after)
    return rows, summary


def _in_flight(found: list[Collective], before: list[fx.Node], after: list[fx.Node]) -> dict:
    """Per kind present: the most collectives of one group issued and not waited, and the
    most bytes they held in one group (the scheduler's tracker, ``passes/inflight.py``)."""
    kinds = sorted({c.kind for c in found if c.waits}, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))
    result = {}
    for kind in kinds:
        mine = [c for c in found if c.kind == kind and c.waits]
        entry = {}
        for label, order in (("before", before), ("after", after)):
            flight = replay(mine, order)
            entry[f"count_{label}"] = max(flight.peak_counts.values(), default=0)
            entry[f"bytes_{label}"] = max(flight.peak_bytes.values(), default=0)
        result[kind] = entry
    return result


def _hidden(exposed_ms: float, duration_ms: float) -> bool:
    """The simulator's rule (``CollectiveTime.hidden``) applied to an attributed exposure."""
    return exposed_ms < HIDDEN_MS or exposed_ms < HIDDEN_FRACTION * duration_ms


def _attributed(timeline: Timeline) -> dict[str, float]:
    """Exposed ms per collective, each stall shared among the collectives its group's stream
    ran during it: a wait that stalls on a collective queued behind another also waits for
    that other one, which is then not hidden. The values sum to ``timeline.exposed_ms``."""
    times = list(timeline.collectives.values())
    result = {t.name: 0.0 for t in times}
    for stalled in times:
        if stalled.exposed_ms <= 0:
            continue
        begin, end = stalled.end_ms - stalled.exposed_ms, stalled.end_ms
        shares = {t.name: min(end, t.end_ms) - max(begin, t.start_ms) for t in times
                  if t.collective.group == stalled.collective.group}
        shares = {name: share for name, share in shares.items() if share > 0}
        total = sum(shares.values())
        if total <= 0:
            result[stalled.name] += stalled.exposed_ms
            continue
        for name, share in shares.items():   # the stream is busy all through the stall: total == exposed
            result[name] += stalled.exposed_ms * share / total
    return result


def _prefix(order: list[fx.Node], is_compute: list[bool], cost: dict[str, float]):
    """counts[i], ms[i]: compute nodes (and their ms) among order[:i]."""
    counts, ms = [0], [0.0]
    for node, flag in zip(order, is_compute):
        counts.append(counts[-1] + flag)
        ms.append(ms[-1] + (cost[node.name] if flag else 0.0))
    return counts, ms


def _reason(c: Collective, info: Structure, order: list[fx.Node], pos: dict[fx.Node, int], count: list[int],
            gather_waits: dict[str, list[int]]) -> str:
    """Why an exposed collective stays exposed: the first rule of the module docstring that holds.

    ``order``: the nodes after scheduling, ``pos`` their positions (``info`` may be the
    graph's Structure in the order before: its bundles, consumers and regions are the
    same in both); ``count[i]``: compute nodes before position i; ``gather_waits``:
    group -> sorted positions of its all-gathers' waits."""
    if c.start in info.coll_of_start:   # a wait's target: its first real consumer, else its region's end
        targets = [min([pos[u] for u in info.consumers[w]] + [pos[info.nodes[info.region_end(w)]]])
                   for w in c.waits]
    else:  # kept in place: its first real consumer, as overlapc.collectives() finds it
        targets = [pos[u] for w in c.waits for u in real_consumers(w, alias_closure(w))]
    consumer = min(targets, default=pos[info.output])
    if order[consumer] is info.output or count[consumer] == 0:
        return "graph input/output"
    bundle = info.start_bundle.get(c.start, [c.start])
    inputs = info.bundle_inputs.get(c.start, c.start.all_input_nodes)
    ready = max((pos[i] for i in inputs), default=-1)
    if count[consumer] - count[ready + 1] == 0:
        return "data dependency"
    if c.kind == "all_gather":
        first = min(pos[m] for m in bundle)
        waits = gather_waits.get(c.group, [])
        index = bisect.bisect_left(waits, first)
        gate = waits[index - 1] if index else None
        if gate is not None and count[first] - count[gate + 1] == 0 and count[gate] - count[ready + 1] > 0:
            return "in-flight limit"
    return "no compute left"


def _summary(rows: list[Row], before: Timeline, after: Timeline, profile) -> dict:
    compute = sum(end - start for start, end in after.compute.values())
    return {
        "collectives": len(rows),
        "moved": sum(1 for r in rows if r.moved),
        "hidden_before": sum(1 for r in rows if _hidden(r.exposed_ms_before, r.comm_ms)),
        "hidden_after": sum(1 for r in rows if r.verdict == "hidden"),
        "exposed_ms_before": before.exposed_ms,
        "exposed_ms_after": after.exposed_ms,
        "peak_in_flight_bytes_before": before.peak_in_flight_bytes,
        "peak_in_flight_bytes_after": after.peak_in_flight_bytes,
        "step_ms_before": before.step_ms,
        "step_ms_after": after.step_ms,
        "compute_ms": compute,
        "issue_ms_after": max(0.0, after.step_ms - compute - after.exposed_ms),
        "device": profile.device.name,
        "link": profile.link.name,
        "profile": profile.name,
        "profile_source": profile.source,
    }


def rows(gm_after: fx.GraphModule, before_order: list[str], profile: costmodel.Profile | str | None = None, *,
         compute_ms: Callable[[fx.Node], float] | None = None,
         comm_ms: Callable[[Collective], float] | None = None) -> list[Row]:
    """One Row per collective of ``gm_after`` (in its order), comparing with ``before_order``
    (node names in the order before scheduling). ``profile``: a Profile, or anything
    ``costmodel.resolve`` takes (None = h100:nvlink, a "device:link" name, a profile file).
    Cost overrides as in ``simulate``."""
    return study(gm_after, before_order, profile, compute_ms=compute_ms, comm_ms=comm_ms)[0]


def summary(gm_after: fx.GraphModule, before_order: list[str], profile: costmodel.Profile | str | None = None,
            *, compute_ms: Callable[[fx.Node], float] | None = None,
            comm_ms: Callable[[Collective], float] | None = None) -> dict:
    """Per-graph numbers before -> after (keys in the module docstring); plain JSON types.
    ``profile`` as in ``rows``."""
    return study(gm_after, before_order, profile, compute_ms=compute_ms, comm_ms=comm_ms)[1]


def summary_line(summary: dict) -> str:
    """'moved M of N collectives; hidden X -> Y of N by estimate with P (exposed A -> B ms)':
    X and A before scheduling, Y and B after, P the profile (``profile_label``)."""
    return (f"moved {summary['moved']} of {summary['collectives']} collectives; "
            f"hidden {summary['hidden_before']} -> {summary['hidden_after']} of {summary['collectives']} "
            f"by estimate with {profile_label(summary)} "
            f"(exposed {_ms(summary['exposed_ms_before'])} -> {_ms(summary['exposed_ms_after'])} ms)")


def profile_label(summary: dict) -> str:
    """The profile a summary's estimates used, short: a built-in's name ("cpu:ethernet"),
    a calibrated file's base name ("profile.json (calibrated)"), else "device/link"."""
    name = str(summary.get("profile") or "")
    if not name:
        return f"{summary.get('device', '?')}/{summary.get('link', '?')}"
    if "/" in name or os.sep in name or name.endswith(".json"):
        return f"{os.path.basename(name)} (calibrated)"
    return name


def in_flight_text(summary: dict) -> str:
    """'peak in flight per group: all_gather 1 -> 2 (4.0KiB -> 8.0KiB); ...' for the kinds
    the graph has; "" when it has none."""
    parts = [f"{kind} {v['count_before']} -> {v['count_after']} "
             f"({size_text(v['bytes_before'])} -> {size_text(v['bytes_after'])})"
             for kind, v in summary.get("in_flight", {}).items()]
    return f"peak in flight per group: {'; '.join(parts)}" if parts else ""


def rewrites(gm: fx.GraphModule) -> list[dict]:
    """What keep-or-regather, merging, bucketing and chunking did to ``gm`` (their records
    in ``gm.meta``), as plain dicts with a "rewrite" key ("regather", "identical", "bucket"
    or "chunk") first."""
    found = [{"rewrite": "regather", **dataclasses.asdict(r)} for r in meta.notes(gm, meta.REGATHER)]
    found += [{"rewrite": "identical", "members": list(names)} for names in meta.notes(gm, meta.DUPLICATES)]
    for key, label in ((meta.BUCKETS, "bucket"), (meta.CHUNKS, "chunk")):
        for record in meta.notes(gm, key):
            found.append({"rewrite": label, **dataclasses.asdict(record)})
    return found


def rewrites_text(summary: dict, compact: bool = False) -> str:
    """The collective count before -> after the rewrites, then one line per bucket or
    chunked pattern (applied or not, and why); "" when none. ``compact``: a bucket's
    members as ``grouped_modules`` instead of one module path per member."""
    records = summary.get("rewrites", ())
    if not records:
        return ""
    merged = sum(len(r["members"]) - 1 for r in records if r["rewrite"] == "bucket")
    same = sum(len(r["members"]) - 1 for r in records if r["rewrite"] == "identical")
    split = sum(len(r["pieces"]) - len(r["starts"]) for r in records if r["rewrite"] == "chunk" and r["applied"])
    buckets = sum(r["rewrite"] == "bucket" for r in records)
    dropped = sum(len(r["regathers"]) for r in records if r["rewrite"] == "regather" and r["kept"])
    lines = [f"collectives {summary['collectives'] + same + merged - split + dropped} -> {summary['collectives']}: "
             + (f"{dropped} backward re-gathers dropped, " if dropped else "")
             + (f"{same} identical merged away, " if same else "")
             + f"{merged + buckets} merged into {buckets} buckets, {split} pieces added by chunking"]
    for r in records:
        if r["rewrite"] == "regather":
            what = f"forward gathers kept for the backward ({size_text(r['nbytes'])}), " \
                   f"{len(r['regathers'])} re-gathers dropped" if r["kept"] else \
                "re-gathered (keeping its gathers would raise the peak)"
            lines.append(f"regather {r['block'] or '?'}: {what}")
        elif r["rewrite"] == "identical":
            lines.append(f"identical {' = '.join(r['members'])}: one collective, {r['members'][0]}")
        elif r["rewrite"] == "chunk":
            state = f"split into {r['chunks']}: {', '.join(r['pieces'])}" if r["applied"] \
                else f"left alone: {r['reason']}"
            if r["applied"] and r["reason"]:   # an all-gather pipeline that stops at its matmuls
                state += f"; stops at its matmuls: {r['reason']}"
            if r.get("fed_by"):
                state += f"; fed piece by piece by {r['fed_by']}'s pieces"
            if r.get("estimates"):   # chunks="auto": the choice among the counts it estimated
                chained = r.get("fed_by") or any(o.get("fed_by") in r["starts"] for o in records
                                                 if o["rewrite"] == "chunk")
                state += "; auto chose " + str(r["chunks"]) + (" for its chain" if chained else "") + " of " \
                    + ", ".join(f"{k}: {ms:.3f}ms" for k, ms in r["estimates"])
            lines.append(f"chunk {r['pattern']} ({', '.join(r['starts'])}, group {r['group']}): {state}")
        else:
            kind, group, size = r.get("kind", "?"), r.get("group", "?"), size_text(r.get("nbytes"))
            sources = r.get("sources") or ()
            named = sources if sources and all(sources) else r.get("modules")
            if compact and any(named or ()):   # the parameters moved where known, else their modules
                lines.append(f"bucket {r.get('start', '?')} ({KIND_SHORT.get(kind, kind)}, {size}, "
                             f"{len(named)} members): {grouped_modules(named)}")
                continue
            members = ", ".join(r.get("modules") or r.get("members") or ())
            lines.append(f"bucket {r.get('start', '?')} ({kind}, group {group}, {size}): {members}")
    return "\n".join(lines)


def grouped_modules(modules) -> str:
    """Module paths as a tree, each shared prefix written once and a module's count of
    members after it: ("blocks.0.norm1", "blocks.0.norm1", "blocks.0.attn.q", "blocks.0.attn.k")
    -> "blocks.0.{norm1 x2, attn.{q, k}}"; "" (unknown) reads "?". Order of first appearance.
    Parameter names group the same way: "blocks.0.norm1.{weight, bias}"."""
    tree: dict = {}
    for module in modules:
        node = tree
        for part in (module or "?").split("."):
            node = node.setdefault(part, {})
        node[""] = node.get("", 0) + 1   # "" holds the count of members at this module
    return ", ".join(_tree_text(name, node) for name, node in tree.items() if name)


def _tree_text(name: str, node: dict) -> str:
    count = node.get("", 0)
    children = [(child, sub) for child, sub in node.items() if child]
    own = f"{name} x{count}" if count > 1 else name
    if not children:
        return own
    if len(children) == 1 and not count:
        return _tree_text(f"{name}.{children[0][0]}", children[0][1])
    inner = f"{name}.{{{', '.join(_tree_text(child, sub) for child, sub in children)}}}"
    return f"{own}, {inner}" if count else inner


def memory_text(summary: dict) -> str:
    """'peak memory 327.0MiB -> 331.2MiB (1.013x); in flight 0B -> 24.0MiB'."""
    before, after = summary["peak_bytes_before"], summary["peak_bytes_after"]
    ratio = f" ({after / before:.3f}x)" if before else ""
    return (f"peak memory {size_text(before)} -> {size_text(after)}{ratio}; in flight "
            f"{size_text(summary['peak_in_flight_bytes_before'])} -> {size_text(summary['peak_in_flight_bytes_after'])}")


def _ms(value: float) -> str:
    """One decimal, or two significant digits below 0.1 ms (so 0.045 does not read 0.0)."""
    return f"{value:.1f}" if value >= 0.1 or value == 0 else f"{value:.2g}"


def size_text(nbytes: int | None) -> str:
    """``nbytes`` for people: "512B", "1.5KiB", ... up to GiB; "?" for None."""
    if nbytes is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes}{unit}" if unit == "B" else f"{nbytes:.1f}{unit}"
        nbytes /= 1024


def _pos(value: int | None) -> str:
    return "-" if value is None else str(value)


def format_text(rows: list[Row], summary: dict) -> str:
    """A fixed-width table: summary lines, then one line per collective. Deterministic."""
    s = summary
    lines = [
        summary_line(s),
        f"step {s['step_ms_before']:.3f} -> {s['step_ms_after']:.3f} ms; exposed "
        f"{s['exposed_ms_before']:.3f} -> {s['exposed_ms_after']:.3f} ms ({s['device']}, {s['link']})",
        memory_text(s),
    ]
    flight = in_flight_text(s)
    return "\n".join(lines + ([flight] if flight else [])) + "\n" + format_table(rows)


def format_table(rows: list[Row]) -> str:
    """One fixed-width line per collective under a header line. Deterministic."""
    header = ("collective", "kind", "group", "bytes", "dtype", "issue", "wait", "compute",
              "comm_ms", "exposed_ms", "verdict", "placed", "module")
    table = [header]
    for r in rows:
        table.append((
            r.name, r.kind, r.group, size_text(r.nbytes), r.dtype or "?",
            f"{r.issue_before}->{r.issue_after}", f"{_pos(r.wait_before)}->{_pos(r.wait_after)}",
            f"{r.compute_nodes}/{r.compute_ms:.3f}ms", f"{r.comm_ms:.3f}",
            f"{r.exposed_ms_before:.3f}->{r.exposed_ms:.3f}",
            r.verdict + (f" ({r.reason})" if r.reason else ""),
            "; ".join(x for x in (r.issue_reason, r.wait_reason) if x) or "-", r.module or "-",
        ))
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() + "\n"
                   for line in table)


WIDTH = 120   # columns of the compact text (``format_compact``, ``format_graph`` without ``wide``)
KIND_SHORT = {kind: described.short for kind, described in COLLECTIVE_KINDS.items()}


def format_compact(rows: list[Row], width: int = WIDTH) -> str:
    """One line per collective under a header line, at most ``width`` columns: collective,
    kind (``KIND_SHORT``: AG all-gather, RS reduce-scatter, AR all-reduce, A2A all-to-all, BC
    broadcast), group, bytes, its issue position before->after, the estimated exposed ms
    before->after, why it stands there (``compact_why``) and its module. A line that would
    be wider loses the middle of its module, then of its why. Deterministic."""
    header = ("collective", "kind", "group", "bytes", "issued at", "exposed ms", "why", "module")
    table = [header] + [(
        r.name, KIND_SHORT.get(r.kind, r.kind), r.group, size_text(r.nbytes), f"{r.issue_before}->{r.issue_after}",
        f"{_ms(r.exposed_ms_before)}->{_ms(r.exposed_ms)}", compact_why(r), r.module or "-") for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for column in (7, 6):   # module, then why: shrink until the widest line fits
        over = sum(widths) + 2 * (len(widths) - 1) - width
        if over > 0:
            widths[column] = max(len(header[column]), widths[column] - over)
    return "".join("  ".join(_cut(cell, w).ljust(w) for cell, w in zip(line, widths)).rstrip() + "\n"
                   for line in table)


def compact_why(row: Row) -> str:
    """Why a collective stands where it does, short: an exposed one's inferred reason
    ("no compute left"), a hidden one "hidden" and the scheduler's recorded reason for
    its issue ("hidden: inputs ready")."""
    if row.verdict == "exposed":
        return row.reason or "exposed"
    return f"hidden: {row.issue_reason}" if row.issue_reason else "hidden"


def _cut(text: str, width: int) -> str:
    """``text`` with its middle replaced by ".." when it is wider than ``width``."""
    if len(text) <= width:
        return text
    keep = width - 2
    return text[:keep - keep // 2] + ".." + text[len(text) - keep // 2:] if keep > 0 else text[:width]


def format_graph(name: str, rows: list[Row], summary: dict, wide: bool = False, quiet: bool = False) -> str:
    """One graph for people (``overlapc report``, the demo): by default compact, within
    ``WIDTH`` columns (a summary block, ``format_compact``'s table, the rewrites with bucket
    members grouped by module); ``quiet``: the summary block only; ``wide``:
    ``format_graph_wide`` (every column, as report.txt). Deterministic."""
    if wide:
        return format_graph_wide(name, rows, summary)
    s = summary
    lines = [f"{name}: {s['collectives']} collectives ({s['device']}, {s['link']}); moved {s['moved']}; hidden "
             f"{s['hidden_before']} -> {s['hidden_after']} by estimate with {profile_label(s)}",
             f"  estimated exposed {s['exposed_ms_before']:.3g} -> {s['exposed_ms_after']:.3g} ms; step "
             f"{s['step_ms_before']:.3g} -> {s['step_ms_after']:.3g} ms", f"  {memory_text(s)}"]
    flight = in_flight_text(s)
    lines += [f"  {flight}"] if flight else []
    text = "".join(wrap(line, "    ") for line in lines)
    if quiet:
        return text
    text += format_compact(rows)
    for line in rewrites_text(s, compact=True).splitlines():
        text += wrap(line, "    ")
    return text


def wrap(line: str, indent: str, width: int = WIDTH) -> str:
    """``line`` broken at spaces into lines of at most ``width`` columns, the later ones indented."""
    return "\n".join(textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=True,
                                    break_on_hyphens=False)) + "\n"


def format_graph_wide(name: str, rows: list[Row], summary: dict) -> str:
    """One graph with every column (report.txt, ``overlapc report --wide``): a header line,
    ``format_table``, then two summary lines (before -> after). Deterministic."""
    s = summary
    return (
        f"{name}: {s['collectives']} collectives ({s['device']}, {s['link']})\n"
        + format_table(rows)
        + f"hidden {s['hidden_after']} of {s['collectives']} collectives (before: {s['hidden_before']}); "
        f"moved {s['moved']}\n"
        f"estimated exposed {s['exposed_ms_before']:.3f} -> {s['exposed_ms_after']:.3f} ms; "
        f"step {s['step_ms_before']:.3f} -> {s['step_ms_after']:.3f} ms\n"
        + memory_text(s) + "\n"
        + (in_flight_text(s) + "\n" if s.get("in_flight") else "")
        + (rewrites_text(s) + "\n" if s.get("rewrites") else "")
    )


def write_artifacts(record, folder: str, profile: costmodel.Profile | str | None = None,
                    built: tuple[list[Row], dict] | None = None, dispatch: dict | None = None) -> None:
    """Write one scheduled graph (a ``backend.GraphRecord``) into ``folder``, creating it:
    before.txt and after.txt (its readable code before and after scheduling), report.txt
    (``format_graph_wide`` and a last line naming the profile's source) and report.json
    (``to_json``). ``profile`` as in ``rows``; ``built``: the graph's (rows, summary) with
    that profile when the caller built them (the backend, from its schedule), else built
    here. ``dispatch`` (``overlapc.backend.cuda_capture.Dispatch.as_dict()``, when the caller knows how
    the graph was captured) adds a "dispatch: ..." line to report.txt and a "dispatch" entry
    to report.json. Same record and profile -> same bytes."""
    rows_, summary_ = built if built is not None else study(record.gm, record.before_order, profile)
    os.makedirs(folder, exist_ok=True)
    files = {
        "before.txt": record.before_code,
        "after.txt": record.after_code,
        "report.txt": format_graph_wide(record.name, rows_, summary_)
        + f"estimates: {summary_['profile_source'] or summary_['profile']}\n"
        + (f"dispatch: {dispatch['described']}\n" if dispatch else ""),
        "report.json": json.dumps({**to_json(rows_, summary_), **({"dispatch": dispatch} if dispatch else {})},
                                  indent=2) + "\n",
    }
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8", newline="\n") as out:
            out.write(text if text.endswith("\n") else text + "\n")


def to_json(rows: list[Row], summary: dict) -> dict:
    """The report as plain JSON types (schema in the module docstring)."""
    return {"schema": SCHEMA, "summary": dict(summary), "collectives": [dataclasses.asdict(r) for r in rows]}

"""``overlapc timeline``: before and after of every graph as a Chrome trace (schema ``overlapc.cli.timeline/1``)."""
from __future__ import annotations

import json

TIMELINE_SCHEMA = "overlapc.cli.timeline/1"


def timeline_document(records, header: dict, profile) -> dict:
    """The "overlapc.cli.timeline/1" trace document: before and after of every record."""
    from overlapc.estimate.simulate import simulate

    events = []
    for index, record in enumerate(records):
        before = simulate(record.gm, profile, record.before_order)
        after = simulate(record.gm, profile)
        events += trace_events(record.gm, before, 2 * index + 1, f"{record.name} before")
        events += trace_events(record.gm, after, 2 * index + 2, f"{record.name} after")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schema": TIMELINE_SCHEMA, **header}}


def trace_events(gm, timeline, pid: int, label: str) -> list[dict]:
    """Chrome trace events for one simulated order of ``gm`` (an ``overlapc.estimate.simulate.Timeline``):
    process ``pid`` named ``label``, thread 0 "compute", threads 1.. "comm group <name>" (sorted
    group names), "X" events for compute ("compute"), collectives ("comm") and compute stalls on
    waits ("exposed"); ts and dur in microseconds. Deterministic."""
    nodes = {n.name: n for n in gm.graph.nodes}
    groups = sorted({t.collective.group for t in timeline.collectives.values()})
    tid = {group: index + 1 for index, group in enumerate(groups)}
    events = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}},
              {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
              {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}}]
    events += [{"ph": "M", "pid": pid, "tid": tid[g], "name": "thread_name", "args": {"name": f"comm group {g}"}}
               for g in groups]

    def complete(cat, thread, name, start_ms, dur_ms, args):
        return {"ph": "X", "cat": cat, "pid": pid, "tid": thread, "name": name,
                "ts": round(start_ms * 1e3, 3), "dur": round(max(dur_ms, 0.0) * 1e3, 3), "args": args}

    for name, (start, end) in timeline.compute.items():
        if end > start:
            events.append(complete("compute", 0, _event_name(nodes[name]), start, end - start, {"node": name}))
    for name, t in timeline.collectives.items():
        c = t.collective
        args = {"node": name, "kind": c.kind, "group": c.group, "bytes": c.nbytes,
                "issue_us": round(t.issue_ms * 1e3, 3), "exposed_us": round(t.exposed_ms * 1e3, 3)}
        events.append(complete("comm", tid[c.group], _event_name(c.start), t.start_ms, t.duration_ms, args))
        if t.exposed_ms > 0:
            events.append(complete("exposed", 0, f"wait {name}", t.end_ms - t.exposed_ms, t.exposed_ms,
                                   {"node": name}))
    return events


def _event_name(node) -> str:
    """Op name ("addmm", "all_gather_into_tensor") plus the module path where known."""
    from overlapc.explain.report import module_path

    target = node.target
    packet = getattr(target, "overloadpacket", None)
    op = packet.__name__ if packet is not None else getattr(target, "__name__", str(target))
    module = module_path(node)
    return f"{op} {module}" if module else op


def write_timeline(path: str, trace: dict) -> None:
    """The trace with one event per line (diff-friendly), keys sorted."""
    events = ",\n".join(json.dumps(e, sort_keys=True) for e in trace["traceEvents"])
    rest = json.dumps({k: v for k, v in trace.items() if k != "traceEvents"}, sort_keys=True)
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        out.write('{"traceEvents": [\n' + events + "\n],\n" + rest[1:-1] + "}\n")

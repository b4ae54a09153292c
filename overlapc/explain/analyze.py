"""``overlapc analyze TRACE``: measured communication of a torch.profiler trace, per collective.

Input: a Chrome trace written by ``torch.profiler.profile(...).export_chrome_trace``
(one rank's file). Steps are the profiler's ``ProfilerStep#N`` spans on the CPU (pass
``schedule=`` and call ``prof.step()``); a trace without them is one step
spanning the compute threads' events. Two formats:

* CPU (gloo): collectives run on gloo's worker threads (events "gloo:<op>");
  every other thread that issues collectives is a *compute thread* (the
  caller's, and autograd's device threads, which run backward on CUDA). Per
  collective: ``issue_ms`` = time its thread spent in its start op
  (``_c10d_functional::all_gather_into_tensor``, ...), ``exposed_ms`` = time
  that thread was blocked in its wait(s) (``wait_tensor``),
  ``duration_ms`` = the worker's span running it (the k-th start in time order
  runs in the first worker span that begins after it and is not yet taken).
  A step's measured exposed communication is the union of the wait spans
  in it.
* CUDA (NCCL; any trace with "kernel" events): kernels whose name starts with
  "nccl" are communication, every other kernel is compute. A kernel belongs to
  the op whose launch (a "cuda_runtime" or "cuda_driver" event with the same
  ``correlation``) it came from, and to that launch's step. Exposed = communication kernel time with no
  compute kernel running (the definition Holistic Trace Analysis uses); where
  several communication kernels run at once, the time is shared equally, so
  the collectives add up to the step's exposed time, which is the union of
  communication kernel time minus compute kernel time.

Matching to overlapc's rows (``dump=``, the backend's ``dump_dir`` or
``overlapc dump``'s folder): every ``CompiledFunction`` (forward) and
``CompiledFunctionBackward`` span is matched to a dumped graph of that
direction (one not yet matched in the step first) whose collective starts (kinds, in
``report.json`` issue order) equal the span's and which has as many waits;
the k-th start is the k-th row, the k-th wait the row whose (first) wait comes
k-th (Inductor keeps collectives and waits in order, though it may move a
wait across a start); its collectives then get graph, issue order, name,
group, bytes, module, the scheduler's reasons and the estimates. Anything else (eager collectives, a
span that matches no graph) is listed with graph "" and its op's kind; its
waits are given to its open starts oldest first. A graph is found under
``DIR/rank<R>/<graph>/report.json`` (R = the trace's rank) or
``DIR/<graph>/report.json``.

JSON schema ("overlapc.analyze/1")::

    {"schema": "overlapc.analyze/1", "trace": path, "format": "cpu" | "cuda",
     "rank": int | null, "dump": path | null,
     "steps": [{"step", "step_ms", "exposed_ms", "issue_ms", "collectives",
                "estimated_step_ms", "estimated_exposed_ms", "graphs"}, ...],
     "collectives": [{<Measured fields>}, ...]}

Estimated step/exposed of a step: the sum over its matched graphs of their
``step_ms_after`` / ``exposed_ms_after`` (null when none matched). Times in ms;
``*_at_ms`` and ``begin_ms`` from the start of the step (a step's from the
first step's). ``analysis_output`` writes an analysis out: JSON, text, and (``--timeline FILE``)
measured and estimated spans side by side as a Chrome trace.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import os
import re

from overlapc.collectives import KINDS

SCHEMA = "overlapc.analyze/1"
_STEP = re.compile(r"ProfilerStep#(\d+)$")
_REGIONS = {"CompiledFunction": "fw", "CompiledFunctionBackward": "bw"}
_KINDS = (*((spelling, kind) for kind, known in KINDS.items() for spelling in known.spellings),
          ("barrier", "barrier"))   # (lower-case part of a trace name, kind), from collectives.KINDS


@dataclasses.dataclass(frozen=True)
class Measured:
    """One collective in one step: what overlapc knows of it and what the trace measured.

    graph/order/name/group/nbytes/module/reason/estimates come from the dump
    (graph "" and estimates None when unmatched; name is then the trace op)."""

    step: int
    graph: str
    order: int | None
    name: str
    kind: str
    group: str
    nbytes: int | None
    module: str
    reason: str
    issue_ms: float
    duration_ms: float | None
    exposed_ms: float
    estimated_ms: float | None
    estimated_exposed_ms: float | None
    issued_at_ms: float | None = None    # when its start op began, from its step's start
    ran_at_ms: float | None = None       # when it began running (gloo worker span, NCCL kernel)
    waited_at_ms: float | None = None    # when its first wait began
    estimated_start_ms: float | None = None   # the dump's simulated run, from its graph's start
    estimated_end_ms: float | None = None


@dataclasses.dataclass(frozen=True)
class GraphRun:
    """One run of a dumped graph in a step: its measured span (the ``CompiledFunction`` or
    ``CompiledFunctionBackward`` event) and exposed communication (its collectives'), beside
    the dump's estimates (``step_ms_after``, ``exposed_ms_after``)."""

    graph: str
    measured_ms: float
    exposed_ms: float
    estimated_ms: float
    estimated_exposed_ms: float
    begin_ms: float = 0.0    # from its step's start
    issue_ms: float = 0.0    # its collectives' start ops
    estimated_issue_ms: float | None = None     # the dump's issue_ms_after
    estimated_compute_ms: float | None = None   # the dump's compute_ms

    @property
    def rest_ms(self) -> float:
        """Measured time neither issuing nor waiting: compute and the code around it."""
        return self.measured_ms - self.exposed_ms - self.issue_ms


@dataclasses.dataclass(frozen=True)
class Step:
    """One profiler step: its span, measured exposed communication and issue time, and the
    graphs it ran; the estimates are their sums (None when no graph matched)."""

    step: int
    step_ms: float
    exposed_ms: float
    issue_ms: float
    collectives: int
    estimated_step_ms: float | None
    estimated_exposed_ms: float | None
    graphs: list[GraphRun]
    begin_ms: float = 0.0    # from the first step's start


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What ``analyze`` found: the trace's format ("cpu" or "cuda") and rank, its steps, and
    every collective of every step in issue order."""

    trace: str
    format: str
    rank: int | None
    dump: str | None
    steps: list[Step]
    collectives: list[Measured]


@dataclasses.dataclass
class _Op:
    """A top-level communication op on a CPU thread (a start or a wait)."""

    name: str
    begin: float
    end: float
    kind: str | None          # None for a wait
    thread: tuple = ()        # (pid, tid)
    correlations: tuple = ()  # CUDA launches inside it


def kind_of(name: str) -> str | None:
    """Collective kind of a trace op or kernel name ("c10d::_allgather_base_" -> "all_gather")."""
    low = name.lower()
    for key, kind in _KINDS:
        if key in low:
            return kind
    return None


def _is_comm_op(name: str) -> bool:
    return name.startswith(("_c10d_functional::", "c10d::", "c10d_functional::"))


def _is_wait(name: str) -> bool:
    return name.endswith("wait_tensor") or name == "c10d::wait"


def load_trace(path: str) -> dict:
    """The trace document; ValueError when it is not a Chrome trace."""
    from overlapc.estimate.costmodel import read_json

    document = read_json(path, "trace")
    if isinstance(document, list):
        document = {"traceEvents": document}
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError(f"trace {path} has no traceEvents list (write it with export_chrome_trace)")
    return document


def _spans(events: list[dict]) -> list[dict]:
    """Complete ("X") events with numeric ts and dur."""
    return [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("dur"), (int, float))]


def _top_level(ops: list[_Op]) -> list[_Op]:
    """Ops not nested in an earlier op (sorted by begin)."""
    kept: list[_Op] = []
    for op in sorted(ops, key=lambda o: (o.begin, -o.end)):
        if kept and op.begin < kept[-1].end and op.end <= kept[-1].end:
            continue
        kept.append(op)
    return kept


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > begin:
            merged.append([begin, end])
    return [(b, e) for b, e in merged]


def _length(intervals) -> float:
    return sum(e - b for b, e in _union(intervals))


# -- the dump ------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Graph:
    name: str
    rows: list[dict]            # report.json rows in issue order
    summary: dict
    kinds: list[str]            # the rows' kinds (starts in issue order)
    waits: list[int]            # row index of each wait, in wait order


def load_dump(folder: str, rank: int | None) -> list[_Graph]:
    """The graphs of a dump folder (see the module docstring); ValueError when there are none."""
    base = folder
    ranked = os.path.join(folder, f"rank{rank if rank is not None else 0}")
    if os.path.isdir(ranked):
        base = ranked
    if not os.path.isdir(base):
        raise ValueError(f"no dump folder {folder}")
    graphs = []
    def order(name: str):
        prefix, _, number = name.partition("_")
        return prefix != "fw", int(number) if number.isdigit() else 0, name

    for name in sorted(os.listdir(base), key=order):
        path = os.path.join(base, name, "report.json")
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as source:
                document = json.load(source)
            rows = sorted(document.get("collectives", []), key=lambda r: r["issue_after"])
            waits = sorted((r["wait_after"], i) for i, r in enumerate(rows) if r.get("wait_after") is not None)
            graphs.append(_Graph(name, rows, document.get("summary", {}), [r["kind"] for r in rows],
                                 [i for _, i in waits]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{path} is not an overlapc report.json: {error!r}") from None
    if not graphs:
        raise ValueError(f"{folder}: no <graph>/report.json found (write it with dump_dir= or overlapc dump)")
    return graphs


def _reason(row: dict) -> str:
    recorded = "; ".join(r for r in (row.get("issue_reason", ""), row.get("wait_reason", "")) if r)
    return recorded or row.get("reason", "")


# -- the analysis --------------------------------------------------------------------------------

@dataclasses.dataclass
class _Collective:
    step: int
    start: _Op | None
    waits: list[_Op]
    row: dict | None = None
    graph: _Graph | None = None
    order: int | None = None
    run: int | None = None      # index of the graph run (matched region) it belongs to


def _match(step: int, ops: list[_Op], regions: list[tuple], graphs: list[_Graph], runs: list[tuple]
           ) -> list[_Collective]:
    """The collectives of one step's ops: matched per compiled region to a dumped graph
    (each match appended to ``runs`` as (graph, begin, end)), the rest paired start -> wait
    oldest first."""
    found: list[_Collective] = []
    taken: set[int] = set()
    used: set[str] = set()
    for begin, end, direction, thread in regions:
        inside = [i for i, op in enumerate(ops)
                  if op.thread == thread and begin <= op.begin and op.end <= end and i not in taken]
        starts = [i for i in inside if ops[i].kind is not None]
        waits = [i for i in inside if ops[i].kind is None]
        fits = [g for g in graphs if g.name.startswith(direction + "_") and len(g.waits) == len(waits)
                and g.kinds == [ops[i].kind for i in starts]]
        if not fits:
            continue
        graph = next((g for g in fits if g.name not in used), fits[0])   # identical graphs: in turn
        used.add(graph.name)
        runs.append((graph, begin, end))
        mine = [_Collective(step, ops[i], [], graph.rows[row], graph, row, len(runs) - 1)
                for row, i in enumerate(starts)]
        for row, i in zip(graph.waits, waits):
            mine[row].waits.append(ops[i])
        found += mine
        taken.update(inside)
    open_: dict[tuple, list[_Collective]] = {}
    for i, op in enumerate(ops):
        if i in taken:
            continue
        if op.kind is not None:
            open_.setdefault(op.thread, []).append(_Collective(step, op, []))
            found.append(open_[op.thread][-1])
        elif open_.get(op.thread):
            open_[op.thread].pop(0).waits.append(op)
        else:
            found.append(_Collective(step, None, [op]))
    return sorted(found, key=lambda c: (c.start or c.waits[0]).begin)


def _cpu_runs(spans: list[dict], workers: set, found: list[_Collective]) -> list[tuple | None]:
    """The gloo worker span (begin, end) of each collective: the first free one beginning
    after its start."""
    free = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                  if (e.get("pid"), e.get("tid")) in workers and str(e.get("name", "")).startswith("gloo:"))
    result: list[tuple | None] = [None] * len(found)
    for index in sorted(range(len(found)), key=lambda i: found[i].start.begin if found[i].start else 0):
        start = found[index].start
        if start is None:
            continue
        at = bisect.bisect_left(free, (start.begin, float("-inf")))
        if at < len(free):
            result[index] = free.pop(at)
    return result


def _cuda_kernels(spans: list[dict], found: list[_Collective]):
    """(communication kernels as (begin, end, collective index or None, step or None),
    compute kernel intervals)."""
    owner = {c: index for index, coll in enumerate(found) if coll.start for c in coll.start.correlations}
    comm, compute = [], []
    for e in spans:
        if e.get("cat") != "kernel":
            continue
        interval = (e["ts"], e["ts"] + e["dur"])
        if str(e["name"]).lower().startswith("nccl"):
            index = owner.get((e.get("args") or {}).get("correlation"))
            comm.append((*interval, index, found[index].step if index is not None else None))
        else:
            compute.append(interval)
    return comm, compute


def _shared_exposure(comm: list[tuple], compute: list[tuple]) -> list[float]:
    """Per communication kernel: its time with no compute kernel running, shared equally
    among the communication kernels running at that moment (us)."""
    points = sorted({p for b, e, *_ in comm for p in (b, e)} | {p for iv in _union(compute) for p in iv})
    busy = _union(compute)
    result = [0.0] * len(comm)
    order = sorted(range(len(comm)), key=lambda i: comm[i][0])
    active: list[int] = []
    cursor = 0
    for left, right in zip(points, points[1:]):
        while cursor < len(order) and comm[order[cursor]][0] <= left:
            active.append(order[cursor])
            cursor += 1
        active = [i for i in active if comm[i][1] > left]
        if not active:
            continue
        at = bisect.bisect_right(busy, (left, float("inf"))) - 1
        if at >= 0 and busy[at][0] <= left and busy[at][1] >= right:
            continue   # a compute kernel covers the whole segment
        for i in active:
            result[i] += (right - left) / len(active)
    return result


def _minus(intervals: list[tuple], cover: list[tuple]) -> float:
    """Length of the union of ``intervals`` outside the union of ``cover``."""
    total = 0.0
    cover = _union(cover)
    for begin, end in _union(intervals):
        total += end - begin
        for b, e in cover:
            total -= max(0.0, min(end, e) - max(begin, b))
    return total


def analyze(trace: "str | dict", dump: str | None = None, profile=None) -> Analysis:
    """Measure every collective of ``trace`` (a path or a loaded document) per step and join
    it to ``dump``'s rows (module docstring). ``profile`` (anything ``costmodel.resolve``
    takes) replaces each matched collective's estimated duration by one from its kind, bytes
    and group size. ValueError for a trace that is not one or has no communication ops."""
    path = trace if isinstance(trace, str) else "<trace>"
    document = load_trace(trace) if isinstance(trace, str) else trace
    info = document.get("distributedInfo") or {}
    rank = info.get("rank") if isinstance(info.get("rank"), int) else None
    spans = _spans(document["traceEvents"])
    cuda = any(e.get("cat") == "kernel" for e in spans)
    workers = {(e.get("pid"), e.get("tid")) for e in spans if str(e.get("name", "")).startswith("gloo:")}
    threads: dict = {}
    for e in spans:
        key = (e.get("pid"), e.get("tid"))
        if key not in workers and e.get("cat") != "gpu_user_annotation" and (   # a CPU span's copy on the GPU
                _is_comm_op(e["name"]) or e["name"] in _REGIONS or _STEP.match(e["name"])):
            threads.setdefault(key, []).append(e)
    if not any(_is_comm_op(e["name"]) for events in threads.values() for e in events):
        raise ValueError(f"{path}: no communication ops found (profile with ProfilerActivity.CPU)")
    ops = _comm_ops(threads, spans)
    everything = [e for events in threads.values() for e in events]
    steps = sorted((int(_STEP.match(e["name"]).group(1)), e["ts"], e["ts"] + e["dur"])
                   for e in everything if _STEP.match(e["name"]))
    if not steps:
        steps = [(0, min(e["ts"] for e in everything), max(e["ts"] + e["dur"] for e in everything))]
    regions = sorted((e["ts"], e["ts"] + e["dur"], _REGIONS[e["name"]], (e.get("pid"), e.get("tid")))
                     for e in everything if e["name"] in _REGIONS)
    graphs = load_dump(dump, rank) if dump else []

    found: list[_Collective] = []
    runs: list[tuple] = []
    for number, begin, end in steps:
        found += _match(number, [op for op in ops if begin <= op.begin < end],
                        [r for r in regions if begin <= r[0] < end], graphs, runs)
    timing = _cuda_timing(spans, found, steps) if cuda else _cpu_timing(spans, workers, found, ops, steps)
    measured = _measured(found, timing, _estimator(profile, info), steps)
    return Analysis(path, "cuda" if cuda else "cpu", rank, dump, _steps(steps, runs, found, measured, timing),
                    measured)


def _comm_ops(threads: dict, spans: list[dict]) -> list[_Op]:
    """The top-level communication ops of each compute thread, in time order, each with
    the CUDA launches (correlations) made inside it."""
    launches: dict = {}
    for e in spans:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and isinstance(e.get("args"), dict) \
                and "correlation" in e["args"]:
            launches.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["args"]["correlation"]))
    ops: list[_Op] = []
    for thread, events in threads.items():
        mine = _top_level([_Op(e["name"], e["ts"], e["ts"] + e["dur"],
                               None if _is_wait(e["name"]) else kind_of(e["name"]) or "other", thread)
                           for e in events if _is_comm_op(e["name"])])
        calls = sorted(launches.get(thread, []))
        for op in mine:
            low = bisect.bisect_left(calls, (op.begin, float("-inf")))
            op.correlations = tuple(c for _, c in calls[low:bisect.bisect_right(calls, (op.end, float("inf")))])
        ops += mine
    ops.sort(key=lambda op: op.begin)
    return ops


@dataclasses.dataclass
class _Timing:
    """Per collective (as ``found``): how long it ran, when it began running (trace us),
    its exposed time; per step number: its exposed communication (ms)."""

    durations: list
    ran: list
    exposed: list
    step_exposed: dict


def _cuda_timing(spans: list[dict], found: list[_Collective], steps: list[tuple]) -> _Timing:
    """NCCL kernels: exposed = kernel time with no compute kernel running, shared."""
    comm, compute = _cuda_kernels(spans, found)
    shares = _shared_exposure(comm, compute)
    timing = _Timing([None] * len(found), [None] * len(found), [0.0] * len(found), {})
    for (begin, end, index, _), share in zip(comm, shares):
        if index is not None:
            timing.exposed[index] += share / 1e3
            timing.durations[index] = (timing.durations[index] or 0.0) + (end - begin) / 1e3
            timing.ran[index] = begin if timing.ran[index] is None else min(timing.ran[index], begin)
    for number, *_ in steps:
        timing.step_exposed[number] = _minus([(b, e) for b, e, _, s in comm if s == number], compute) / 1e3
    return timing


def _cpu_timing(spans: list[dict], workers: set, found: list[_Collective], ops: list[_Op],
                steps: list[tuple]) -> _Timing:
    """gloo: a collective runs in its worker span; exposed = time in its waits."""
    on_workers = _cpu_runs(spans, workers, found)
    step_exposed = {number: _length([(op.begin, op.end) for op in ops
                                     if op.kind is None and begin <= op.begin < end]) / 1e3
                    for number, begin, end in steps}
    return _Timing([None if r is None else (r[1] - r[0]) / 1e3 for r in on_workers],
                   [None if r is None else r[0] for r in on_workers],
                   [sum(w.end - w.begin for w in c.waits) / 1e3 for c in found], step_exposed)


def _measured(found: list[_Collective], timing: _Timing, estimate, steps: list[tuple]) -> list[Measured]:
    """One Measured per collective: its dump row's fields (when matched) and the trace's times."""
    step_begin = {number: begin for number, begin, _ in steps}
    since = lambda t, c: None if t is None else (t - step_begin[c.step]) / 1e3  # noqa: E731
    measured = []
    for c, duration, stalled, began in zip(found, timing.durations, timing.exposed, timing.ran):
        row, head = c.row, c.start or c.waits[0]
        measured.append(Measured(
            step=c.step, graph=c.graph.name if c.graph else "", order=c.order,
            name=row["name"] if row else head.name, kind=row["kind"] if row else (head.kind or "other"),
            group=str(row["group"]) if row else "", nbytes=row.get("nbytes") if row else None,
            module=row.get("module") or "" if row else "", reason=_reason(row) if row else "",
            issue_ms=(c.start.end - c.start.begin) / 1e3 if c.start else 0.0, duration_ms=duration,
            exposed_ms=stalled, estimated_ms=estimate(row) if row else None,
            estimated_exposed_ms=row.get("exposed_ms") if row else None,
            issued_at_ms=since(c.start.begin if c.start else None, c), ran_at_ms=since(began, c),
            waited_at_ms=since(c.waits[0].begin if c.waits else None, c),
            estimated_start_ms=row.get("start_ms") if row else None,
            estimated_end_ms=row.get("end_ms") if row else None))
    return measured


def _steps(steps: list[tuple], runs: list[tuple], found: list[_Collective], measured: list[Measured],
           timing: _Timing) -> list[Step]:
    """Each step with its graph runs (matched regions) and their measured and estimated totals."""
    run_exposed, run_issue = [0.0] * len(runs), [0.0] * len(runs)
    for c, stalled in zip(found, timing.exposed):
        if c.run is not None:
            run_exposed[c.run] += stalled
            run_issue[c.run] += (c.start.end - c.start.begin) / 1e3 if c.start else 0.0
    result = []
    for number, begin, end in steps:
        ran = [GraphRun(graph.name, (stop - start) / 1e3, run_exposed[index],
                        graph.summary.get("step_ms_after", 0.0), graph.summary.get("exposed_ms_after", 0.0),
                        (start - begin) / 1e3, run_issue[index], graph.summary.get("issue_ms_after"),
                        graph.summary.get("compute_ms"))
               for index, (graph, start, stop) in enumerate(runs) if begin <= start < end]
        rows = [m for m in measured if m.step == number]
        result.append(Step(
            step=number, step_ms=(end - begin) / 1e3, exposed_ms=timing.step_exposed[number],
            issue_ms=sum(m.issue_ms for m in rows), collectives=len(rows),
            estimated_step_ms=sum(r.estimated_ms for r in ran) if ran else None,
            estimated_exposed_ms=sum(r.estimated_exposed_ms for r in ran) if ran else None,
            graphs=ran, begin_ms=(begin - steps[0][1]) / 1e3))
    return result


def _estimator(profile, info: dict):
    """row -> estimated duration (ms): the dump's comm_ms, or ``profile``'s for its kind, bytes
    and group (by name or mesh dim name; its size from the trace's process group list), as
    ``costmodel.collective_ms`` (``LinkProfile.duration_ms``)."""
    if profile is None:
        return lambda row: row.get("comm_ms")
    from overlapc.estimate import costmodel

    resolved = costmodel.resolve(profile)
    sizes = {}
    for group in info.get("pg_config") or []:
        if isinstance(group, dict):
            desc = str(group.get("pg_desc", ""))
            for key in (str(group.get("pg_name")), desc[len("mesh_"):] if desc.startswith("mesh_") else None):
                if key:
                    sizes[key] = group.get("pg_size")

    def estimate(row: dict) -> float | None:
        if row.get("nbytes") is None:
            return None
        link = resolved.link_for(str(row["group"]))
        return link.duration_ms(row["kind"], row["nbytes"], sizes.get(str(row["group"])))
    return estimate

"""An analysis (``analyze.Analysis``) written out: JSON (schema ``overlapc.analyze/1``, in
``analyze``'s docstring), text (what ``overlapc analyze`` and ``make demo`` print) and a
Chrome trace of the measured spans beside the estimated ones (``overlapc.analyze.timeline/1``)."""
from __future__ import annotations

import dataclasses
import statistics

from overlapc.explain.analyze import SCHEMA, Analysis, GraphRun, Measured, Step


def to_json(analysis: Analysis) -> dict:
    """The analysis as plain JSON types (schema in ``analyze``'s docstring)."""
    return {"schema": SCHEMA, "trace": analysis.trace, "format": analysis.format, "rank": analysis.rank,
            "dump": analysis.dump, "steps": [dataclasses.asdict(s) for s in analysis.steps],
            "collectives": [dataclasses.asdict(m) for m in analysis.collectives]}


TIMELINE_SCHEMA = "overlapc.analyze.timeline/1"


def timeline(analysis: Analysis) -> dict:
    """A Chrome trace (open in ui.perfetto.dev) with the measured spans beside the estimated ones.

    Process 1 "measured (rank R)": thread 0 "compute" holds each step, each graph run, each
    collective's start op (cat "issue") and its wait (cat "exposed", at its first wait, as
    long as the measured exposed time); thread 1 "communication" each collective as it ran
    (cat "comm"). Process 2 "estimated" holds the dump's simulation of each graph run, placed
    at the run's measured start: the run as long as its estimated step (cat "graph"), each
    collective from its simulated start to end (thread 1) and its estimated exposed time
    ending when it ends (thread 0). ts and dur in microseconds from the first step's start;
    args name the collective, graph and step. Schema "overlapc.analyze.timeline/1"."""
    rank = "?" if analysis.rank is None else analysis.rank
    events = []
    for pid, label in ((1, f"measured (rank {rank})"), (2, "estimated")):
        events += [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}},
                   {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
                   {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}},
                   {"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "communication"}}]

    def span(pid, tid, cat, name, begin_ms, dur_ms, args):
        events.append({"ph": "X", "pid": pid, "tid": tid, "cat": cat, "name": name,
                       "ts": round(begin_ms * 1e3, 3), "dur": round(max(dur_ms, 0.0) * 1e3, 3), "args": args})

    for step in analysis.steps:
        at = step.begin_ms
        span(1, 0, "step", f"step {step.step}", at, step.step_ms, {"step": step.step})
        for run in step.graphs:
            args = {"graph": run.graph, "step": step.step}
            span(1, 0, "graph", run.graph, at + run.begin_ms, run.measured_ms, args)
            span(2, 0, "graph", run.graph, at + run.begin_ms, run.estimated_ms, args)
        for m in analysis.collectives:
            if m.step != step.step:
                continue
            args = {"collective": m.name, "kind": m.kind, "graph": m.graph, "step": m.step}
            if m.issued_at_ms is not None:
                span(1, 0, "issue", f"issue {m.name}", at + m.issued_at_ms, m.issue_ms, args)
            if m.waited_at_ms is not None and m.exposed_ms > 0:
                span(1, 0, "exposed", f"wait {m.name}", at + m.waited_at_ms, m.exposed_ms, args)
            if m.ran_at_ms is not None and m.duration_ms is not None:
                span(1, 1, "comm", m.name, at + m.ran_at_ms, m.duration_ms, args)
            run = _run_of(step, m)
            if run is None or m.estimated_start_ms is None or m.estimated_end_ms is None:
                continue
            origin = at + run.begin_ms
            span(2, 1, "comm", m.name, origin + m.estimated_start_ms, m.estimated_end_ms - m.estimated_start_ms, args)
            if m.estimated_exposed_ms:
                span(2, 0, "exposed", f"wait {m.name}", origin + m.estimated_end_ms - m.estimated_exposed_ms,
                     m.estimated_exposed_ms, args)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schema": TIMELINE_SCHEMA, "trace": analysis.trace, "dump": analysis.dump,
                          "rank": analysis.rank}}


def _run_of(step: Step, m: Measured) -> GraphRun | None:
    """The run of ``m``'s graph in ``step`` during which it was issued (or first waited)."""
    when = m.issued_at_ms if m.issued_at_ms is not None else m.waited_at_ms
    for run in step.graphs:
        if run.graph == m.graph and when is not None and run.begin_ms <= when <= run.begin_ms + run.measured_ms:
            return run
    return None


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_text(analysis: Analysis) -> str:
    """Per step: a line of measured vs estimated totals, then one line per collective."""
    lines = [f"overlapc analyze {analysis.trace}: {analysis.format} trace, rank "
             f"{'?' if analysis.rank is None else analysis.rank}, {len(analysis.steps)} step(s)"
             + (f"; estimates from {analysis.dump}" if analysis.dump else "")]
    header = ("step", "graph", "#", "collective", "kind", "group", "bytes", "module", "issue_ms",
              "comm_ms", "est_ms", "exposed_ms", "est_exposed", "why")
    for step in analysis.steps:
        lines.append("")
        lines += _step_lines(step)
        table = [header]
        for m in analysis.collectives:
            if m.step != step.step:
                continue
            table.append((str(m.step), m.graph or "-", "-" if m.order is None else str(m.order), m.name, m.kind,
                          m.group or "-", "?" if m.nbytes is None else str(m.nbytes), m.module or "-",
                          _num(m.issue_ms), _num(m.duration_ms), _num(m.estimated_ms), _num(m.exposed_ms),
                          _num(m.estimated_exposed_ms), m.reason or "-"))
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    return "\n".join(lines) + "\n"


def comparison_text(analysis: Analysis, outside_ms: float | None = None) -> str:
    """Per step and per graph run, estimated vs measured time and exposed communication. A
    step's estimate is its graphs' simulated times plus ``outside_ms``, the caller's
    estimate of what runs outside them (optimizer, Python, barriers; e.g.
    ``costmodel.outside_ms``), when given."""
    lines = [line for step in analysis.steps for line in _step_lines(step, outside_ms)]
    timed = [s for s in analysis.steps if s.estimated_step_ms is not None]
    if len(timed) > 1:
        measured = statistics.median(s.step_ms for s in timed)
        estimated = statistics.median(s.estimated_step_ms + (outside_ms or 0.0) for s in timed)
        lines.append(f"median of {len(timed)} steps: measured {measured:.1f} ms, estimated {estimated:.1f} ms "
                     f"({_ratio(estimated, measured)}); exposed communication measured "
                     f"{statistics.median(s.exposed_ms for s in timed):.1f} ms, estimated "
                     f"{statistics.median(s.estimated_exposed_ms for s in timed):.1f} ms")
    return "\n".join(lines)


def _step_lines(step: Step, outside_ms: float | None = None) -> list[str]:
    inside = sum(r.measured_ms for r in step.graphs)
    graphs = step.estimated_step_ms
    estimate = None if graphs is None else graphs + (outside_ms or 0.0)
    split = "" if outside_ms is None or graphs is None else f" = graphs {graphs:.1f} + outside {outside_ms:.1f}"
    lines = [f"step {step.step}: measured {step.step_ms:.1f} ms"
             + (f" (graphs {inside:.1f} ms, outside them {step.step_ms - inside:.1f} ms)" if step.graphs else "")
             + (f", estimated {estimate:.1f} ms{split} ({_ratio(estimate, step.step_ms)} of the step, "
                f"{_ratio(graphs, inside)} of its graphs)" if estimate is not None else "")
             + f"; exposed communication measured {step.exposed_ms:.1f} ms"
             + (f", estimated {step.estimated_exposed_ms:.1f} ms" if estimate is not None else "")
             + f"; issuing {step.issue_ms:.1f} ms for {step.collectives} collectives"]
    for run in step.graphs:
        parts = [f"exposed communication measured {run.exposed_ms:.1f} ms, estimated {run.estimated_exposed_ms:.1f} ms"]
        if run.estimated_issue_ms is not None and run.estimated_compute_ms is not None:
            parts += [f"issuing {run.issue_ms:.1f} / {run.estimated_issue_ms:.1f}",
                      f"compute (the rest) {run.rest_ms:.1f} / {run.estimated_compute_ms:.1f}"]
        lines.append(f"  {run.graph}: measured {run.measured_ms:.1f} ms, estimated {run.estimated_ms:.1f} ms "
                     f"({_ratio(run.estimated_ms, run.measured_ms)}); " + "; ".join(parts))
    return lines


def _ratio(estimate: float | None, measured: float) -> str:
    return f"{estimate / measured:.2f}x" if estimate and measured else "-"

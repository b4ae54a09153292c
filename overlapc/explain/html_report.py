"""One self-contained HTML page of a schedule: timelines, memory and the collectives, before and after.

The page needs no network: its CSS is inline and its pictures are inline SVG
drawn here (no script; tooltips are SVG ``<title>`` elements). Per graph:

* **Timeline**: the simulated run (``overlapc.estimate.simulate``) of the order before
  scheduling and of overlapc's order, on one time axis: a "compute" lane (each
  node that costs time; the compute stream's stalls on waits marked as
  *exposed*, red) and one lane per process group's link (each collective from
  when it starts running to when it ends, coloured by kind).
* **Memory**: live bytes along both orders (``passes/memory.py``'s tracker),
  each node drawn at the simulated time it runs, with the order before's peak
  and the *budget*: under "serial-peak" (the default) the bound itself, the
  serial order's peak of the graph as handed in (``passes/pipeline.budget_for``'s
  headroom); else that peak plus the in-flight byte budget of the config
  (summed over groups). Under "auto" more may be in flight where it fits under
  the graph's memory peak (``passes/memory.Headroom``), so the line is the plan,
  not a hard ceiling. No budget line when the byte budget is unlimited.
* **Table**: one row per collective (``overlapc.explain.report.Row``), compact.
* With a profiler trace (what ``overlapc analyze`` reads): per graph, one run
  of it (the median of the runs the trace holds) measured beside the
  estimate: the graph's run, the issue and wait spans on the compute thread
  and each collective as it ran, above the estimated run, stalls and
  collectives (``overlapc.explain.analyze.Analysis``; estimates from the dump).

API::

    view = graph_view(name, gm, before_order, profile, config)   # one graph's numbers
    text = render_html([view, ...], title=..., notes=[...], analysis=None)
    html_for_records(records, profile=None, config=None, trace=None, dump=None, title=...)
    write_html(path, records, **same keywords)                   # the page, to a file

(``overlapc.cli.targets.html_for_target`` captures a CLI target and draws its page.)

Elements carry data attributes that say what they draw (``data-graph``,
``data-order`` "before" | "after", ``data-lane``, ``data-kind``, ``data-start-ms``,
``data-end-ms``, ``data-peak-bytes``, ...), with the simulation's numbers, so
tests and tools can read the page. Deterministic: same graphs, same bytes.
"""
from __future__ import annotations

import dataclasses
import html
import os
import statistics
import tempfile

import torch.fx as fx

from overlapc.estimate import costmodel
from overlapc.estimate.simulate import Timeline, checked_order, simulate
from overlapc.explain import report
from overlapc.explain.report import size_text, write_artifacts

KIND_COLOURS = {"all_gather": "#2f6fb3", "reduce_scatter": "#e07b1a", "all_reduce": "#7a4bb0",
                "all_to_all": "#22936a", "broadcast": "#c2457f"}
OTHER_COLOUR = "#6b6b6b"
ORDERS = (("before", "before: original order"), ("after", "after: overlapc's order"))

LEFT, PLOT, RIGHT = 150, 960, 20     # SVG margins and plot width (px)
LANE, GAP = 20, 5                    # lane height and the gap between lanes (px)
MEMORY_HEIGHT = 150


@dataclasses.dataclass(frozen=True)
class GraphView:
    """What the page draws of one graph: report rows and summary, both simulated orders,
    live bytes and simulated time per node of each order, and the memory budget (None when
    the byte budget is unlimited)."""

    name: str
    rows: list
    summary: dict
    timelines: dict[str, Timeline]           # "before" / "after"
    live_bytes: dict[str, list[int]]         # per node of that order
    at_ms: dict[str, list[float]]            # when each node of that order runs
    groups: list[str]                        # process groups, sorted
    group_labels: dict[str, str]
    op_names: dict[str, str]                 # node name -> "op module" for tooltips
    budget_bytes: int | None
    in_flight_budget: int | None


def graph_view(name: str, gm: fx.GraphModule, before_order: list[str], profile=None, config=None) -> GraphView:
    """Simulate both orders of ``gm`` (scheduled in place; ``before_order`` its node names before
    scheduling) with ``profile`` (anything ``costmodel.resolve`` takes) and gather what the page
    draws. ``config``: the OverlapConfig (or options dict) it was scheduled with, for the budget
    line (default: OverlapConfig's defaults). Call it while the graph's process groups exist, so
    groups are named by their mesh dims."""
    from overlapc.config import OverlapConfig
    from overlapc.passes.memory import Liveness

    profile = costmodel.resolve(profile)
    cfg = config if isinstance(config, OverlapConfig) else OverlapConfig.from_options(config)
    rows, summary = report.study(gm, before_order, profile)
    orders = {"before": checked_order(gm, before_order), "after": list(gm.graph.nodes)}
    memo: dict[fx.Node, float] = {}

    def compute_ms(node: fx.Node) -> float:   # one estimate per node for both orders, as report.study
        if node not in memo:
            memo[node] = costmodel.compute_ms(node, profile.device)
        return memo[node]

    timelines = {key: simulate(gm, profile, order, compute_ms=compute_ms) for key, order in orders.items()}
    liveness = Liveness(list(gm.graph.nodes))
    live = {key: liveness.live_bytes(order) for key, order in orders.items()}
    at = {key: _node_times(order, timelines[key]) for key, order in orders.items()}
    groups = sorted({t.collective.group for t in timelines["after"].collectives.values()})
    budget, in_flight = _budget(gm, cfg, timelines["before"].peak_bytes)
    return GraphView(name, rows, summary, timelines, live, at, groups,
                     {g: costmodel.group_label(g) for g in groups},
                     {n.name: _op_name(n) for n in gm.graph.nodes}, budget, in_flight)


def _budget(gm: fx.GraphModule, cfg, peak_before: int) -> tuple[int | None, int | None]:
    """(the budget line's bytes, the in-flight budget summed over groups) of the config for
    ``gm``: under "serial-peak" (the bound, None); else (``peak_before`` + the in-flight
    budget, that budget); (None, None) when nothing bounds the bytes."""
    from overlapc.passes.pipeline import budget_for
    from overlapc.passes.structure import Structure

    budget = budget_for(Structure(gm), cfg)
    if budget.within_peak:
        return (budget.headroom.peak if budget.headroom is not None else peak_before), None
    limits = budget.max_bytes
    if any(v is None for v in limits.values()):
        return None, None
    in_flight = sum(limits.values())
    return peak_before + in_flight, in_flight


def _node_times(order: list[fx.Node], timeline: Timeline) -> list[float]:
    """When each node of ``order`` runs on the compute stream: a compute node at its start, a
    collective start when it is issued, a wait when the stream passes it (after any stall)."""
    starts = {t.collective.start: t for t in timeline.collectives.values()}
    waits = {w: t for t in timeline.collectives.values() for w in t.collective.waits}
    clock, result = 0.0, []
    for node in order:
        if node in starts:
            clock = max(clock, starts[node].issue_ms)
        elif node in waits:
            clock = max(clock, waits[node].end_ms)
        elif node.name in timeline.compute:
            begin, end = timeline.compute[node.name]
            result.append(begin)
            clock = end
            continue
        result.append(clock)
    return result


def _op_name(node: fx.Node) -> str:
    from overlapc.collectives import module_path

    packet = getattr(node.target, "overloadpacket", None)
    op = packet.__name__ if packet is not None else getattr(node.target, "__name__", str(node.target))
    module = module_path(node) if node.op == "call_function" else ""
    return f"{op} {module}" if module else op


# -- drawing helpers -----------------------------------------------------------------------------

def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _ms(value: float) -> str:
    return f"{value:.3f}" if abs(value) >= 0.001 or value == 0 else f"{value:.2g}"


def _colour(kind: str) -> str:
    return KIND_COLOURS.get(kind, OTHER_COLOUR)


class _Axis:
    """Maps ms to x pixels over [0, span_ms]."""

    def __init__(self, span_ms: float):
        self.span = span_ms if span_ms > 0 else 1.0

    def x(self, ms: float) -> float:
        return LEFT + ms / self.span * PLOT

    def ticks(self, y: float, bottom: float) -> list[str]:
        """Gridlines and labels at round ms values."""
        step = _nice_step(self.span / 8)
        out, value = [], 0.0
        while value <= self.span * 1.0001:
            x = self.x(value)
            out.append(f'<line class="grid" x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{bottom}"/>'
                       f'<text class="tick" x="{x:.1f}" y="{bottom + 12}" text-anchor="middle">'
                       f'{_e(_tick(value, step))}</text>')
            value += step
        return out


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    scale = 10 ** _floor_log10(raw)
    for factor in (1, 2, 5, 10):
        if raw <= factor * scale:
            return factor * scale
    return 10 * scale


def _floor_log10(value: float) -> int:
    exponent = 0
    while value >= 10:
        value /= 10
        exponent += 1
    while value < 1:
        value *= 10
        exponent -= 1
    return exponent


def _tick(value: float, step: float) -> str:
    digits = max(0, -_floor_log10(step)) if step < 1 else 0
    return f"{value:.{digits}f} ms"


def _rect(x0: float, x1: float, y: float, height: float, cls: str, fill: str | None, title: str,
          attrs: str = "") -> str:
    width = max(x1 - x0, 0.6)
    style = f' fill="{fill}"' if fill else ""
    return (f'<rect class="{cls}" x="{x0:.2f}" y="{y:.1f}" width="{width:.2f}" height="{height}"{style}{attrs}>'
            f'<title>{_e(title)}</title></rect>')


# -- the timeline --------------------------------------------------------------------------------

def _lanes_svg(view: GraphView) -> str:
    """Both orders' lanes (compute, then one per group) on one time axis."""
    axis = _Axis(max(view.timelines["before"].step_ms, view.timelines["after"].step_ms))
    lanes_per_order = 1 + len(view.groups)
    block = 22 + lanes_per_order * (LANE + GAP)
    height = 10 + 2 * block + 24
    lanes_bottom = 10 + 2 * block
    parts = axis.ticks(10, lanes_bottom)
    y = 10
    for key, label in ORDERS:
        t = view.timelines[key]
        parts.append(f'<g class="order" data-graph="{_e(view.name)}" data-order="{key}" '
                     f'data-step-ms="{t.step_ms!r}" data-exposed-ms="{t.exposed_ms!r}">')
        parts.append(f'<text class="order-title" x="4" y="{y + 14}">{_e(label)}: step {_ms(t.step_ms)} ms, '
                     f'exposed {_ms(t.exposed_ms)} ms, {t.hidden} of {t.total} collectives hidden</text>')
        lane_y = y + 22
        parts.append(_compute_lane(view, key, axis, lane_y))
        for index, group in enumerate(view.groups):
            parts.append(_link_lane(view, key, group, axis, lane_y + (index + 1) * (LANE + GAP)))
        parts.append("</g>")
        y += block
    width = LEFT + PLOT + RIGHT
    return (f'<svg class="timeline" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" data-graph="{_e(view.name)}" data-span-ms="{axis.span!r}">'
            + "".join(parts) + "</svg>")


_DEFS = ('<svg class="defs" width="0" height="0" aria-hidden="true">'
         '<defs><pattern id="exposed-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
         'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f3b6b6"/>'
         '<line x1="0" y1="0" x2="0" y2="6" stroke="#d62728" stroke-width="3"/></pattern></defs></svg>')


def _compute_lane(view: GraphView, key: str, axis: _Axis, y: float) -> str:
    t = view.timelines[key]
    parts = [f'<g class="lane" data-lane="compute" data-order="{key}" data-graph="{_e(view.name)}">',
             f'<text class="lane-label" x="{LEFT - 8}" y="{y + 14}" text-anchor="end">compute</text>',
             f'<rect class="lane-bg" x="{LEFT}" y="{y}" width="{PLOT}" height="{LANE}"/>']
    for name, (begin, end) in t.compute.items():
        if end > begin:
            parts.append(_rect(axis.x(begin), axis.x(end), y + 3, LANE - 6, "compute", None,
                               f"{view.op_names.get(name, name)} ({name}): {_ms(begin)}-{_ms(end)} ms"))
    for name, c in t.collectives.items():
        if c.exposed_ms > 0:
            begin = c.end_ms - c.exposed_ms
            parts.append(_rect(axis.x(begin), axis.x(c.end_ms), y, LANE, "exposed", "url(#exposed-hatch)",
                               f"compute waits {_ms(c.exposed_ms)} ms on {name} ({c.collective.kind})",
                               f' data-name="{_e(name)}" data-exposed-ms="{c.exposed_ms!r}"'))
    parts.append("</g>")
    return "".join(parts)


def _link_lane(view: GraphView, key: str, group: str, axis: _Axis, y: float) -> str:
    t = view.timelines[key]
    label = view.group_labels.get(group, group)
    parts = [f'<g class="lane" data-lane="link" data-group="{_e(group)}" data-order="{key}" '
             f'data-graph="{_e(view.name)}">',
             f'<text class="lane-label" x="{LEFT - 8}" y="{y + 14}" text-anchor="end">link {_e(label)}</text>',
             f'<rect class="lane-bg" x="{LEFT}" y="{y}" width="{PLOT}" height="{LANE}"/>']
    for name, c in t.collectives.items():
        if c.collective.group != group:
            continue
        kind = c.collective.kind
        title = (f"{name} ({kind}, {size_text(c.collective.nbytes)}): issued {_ms(c.issue_ms)} ms, runs "
                 f"{_ms(c.start_ms)}-{_ms(c.end_ms)} ms, compute waits {_ms(c.exposed_ms)} ms")
        if c.start_ms > c.issue_ms:   # queued behind the group's earlier collectives
            parts.append(f'<line class="queued" x1="{axis.x(c.issue_ms):.2f}" y1="{y + LANE / 2}" '
                         f'x2="{axis.x(c.start_ms):.2f}" y2="{y + LANE / 2}"/>')
        parts.append(_rect(axis.x(c.start_ms), axis.x(c.end_ms), y + 2, LANE - 4, "coll", _colour(kind), title,
                           f' data-name="{_e(name)}" data-kind="{_e(kind)}" data-start-ms="{c.start_ms!r}" '
                           f'data-end-ms="{c.end_ms!r}" data-exposed-ms="{c.exposed_ms!r}"'))
    parts.append("</g>")
    return "".join(parts)


# -- memory --------------------------------------------------------------------------------------

def _memory_svg(view: GraphView) -> str:
    """Live bytes of both orders over simulated time, with the order before's peak and the budget."""
    axis = _Axis(max(view.timelines["before"].step_ms, view.timelines["after"].step_ms))
    peaks = {key: max(view.live_bytes[key], default=0) for key, _ in ORDERS}
    top = max([*peaks.values(), view.budget_bytes or 0, 1])
    top *= 1.08
    y0, height = 10, MEMORY_HEIGHT
    bottom = y0 + height

    def y(nbytes: float) -> float:
        return bottom - nbytes / top * height

    parts = [f'<rect class="lane-bg" x="{LEFT}" y="{y0}" width="{PLOT}" height="{height}"/>',
             *axis.ticks(y0, bottom)]
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        value = top / 1.08 * fraction
        parts.append(f'<line class="grid" x1="{LEFT}" y1="{y(value):.1f}" x2="{LEFT + PLOT}" y2="{y(value):.1f}"/>'
                     f'<text class="tick" x="{LEFT - 8}" y="{y(value) + 4:.1f}" text-anchor="end">'
                     f'{_e(size_text(int(value)))}</text>')
    for key, label in ORDERS:
        points, times, live = [], view.at_ms[key], view.live_bytes[key]
        end = view.timelines[key].step_ms
        for index, nbytes in enumerate(live):
            x0 = axis.x(times[index])
            x1 = axis.x(times[index + 1] if index + 1 < len(times) else end)
            points.append(f"{x0:.2f},{y(nbytes):.2f} {x1:.2f},{y(nbytes):.2f}")
        parts.append(f'<polyline class="mem mem-{key}" data-graph="{_e(view.name)}" data-order="{key}" '
                     f'data-peak-bytes="{peaks[key]}" points="{" ".join(points)}">'
                     f'<title>{_e(label)}: peak {_e(size_text(peaks[key]))}</title></polyline>')
    reference = peaks["before"]
    parts.append(_hline(y(reference), "peak-line", f"peak before {size_text(reference)}", reference))
    if view.budget_bytes is not None:
        said = f"budget {size_text(view.budget_bytes)} = " + (
            "the serial order's peak (serial-peak)" if view.in_flight_budget is None
            else f"peak before + in-flight budget {size_text(view.in_flight_budget)}")
        parts.append(_hline(y(view.budget_bytes), "budget-line", said, view.budget_bytes))
    width, total = LEFT + PLOT + RIGHT, bottom + 24
    return (f'<svg class="memory" width="{width}" height="{total}" '
            f'viewBox="0 0 {width} {total}" data-graph="{_e(view.name)}">' + "".join(parts) + "</svg>")


def _hline(y: float, cls: str, label: str, nbytes: int) -> str:
    return (f'<g class="{cls}" data-bytes="{nbytes}"><line x1="{LEFT}" y1="{y:.2f}" x2="{LEFT + PLOT}" '
            f'y2="{y:.2f}"/><text x="{LEFT + PLOT - 4}" y="{y - 4:.2f}" text-anchor="end">{_e(label)}</text></g>')


# -- the table and the page ----------------------------------------------------------------------

def _table(view: GraphView) -> str:
    head = ("collective", "kind", "group", "bytes", "issue", "wait", "comm ms", "exposed ms", "verdict", "why",
            "module")
    lines = ["<table class=\"rows\" data-graph=\"" + _e(view.name) + "\"><thead><tr>"
             + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for r in view.rows:
        wait = "-" if r.wait_after is None else f"{r.wait_before}&rarr;{r.wait_after}"
        cells = (f'<td><span class="swatch" style="background:{_colour(r.kind)}"></span>{_e(r.name)}</td>',
                 f"<td>{_e(r.kind)}</td>", f"<td>{_e(r.group)}</td>", f'<td class="num">{_e(size_text(r.nbytes))}</td>',
                 f'<td class="num">{r.issue_before}&rarr;{r.issue_after}</td>', f'<td class="num">{wait}</td>',
                 f'<td class="num">{_ms(r.comm_ms)}</td>',
                 f'<td class="num">{_ms(r.exposed_ms_before)}&rarr;{_ms(r.exposed_ms)}</td>',
                 f'<td class="{r.verdict}">{_e(r.verdict)}</td>', f"<td>{_e(r.why or '-')}</td>",
                 f"<td>{_e(r.module or '-')}</td>")
        lines.append(f'<tr data-name="{_e(r.name)}">' + "".join(cells) + "</tr>")
    return "".join(lines) + "</tbody></table>"


def _summary_html(view: GraphView) -> str:
    s = view.summary
    ratio = f" ({s['peak_bytes_after'] / s['peak_bytes_before']:.3f}x)" if s["peak_bytes_before"] else ""
    items = [
        ("step", f"{_ms(s['step_ms_before'])} &rarr; {_ms(s['step_ms_after'])} ms", "step"),
        ("exposed communication", f"{_ms(s['exposed_ms_before'])} &rarr; {_ms(s['exposed_ms_after'])} ms", "exposed"),
        ("hidden", f"{s['hidden_before']} &rarr; {s['hidden_after']} of {s['collectives']}", "hidden"),
        ("moved", f"{s['moved']} of {s['collectives']}", "moved"),
        ("peak memory", f"{_e(size_text(s['peak_bytes_before']))} &rarr; {_e(size_text(s['peak_bytes_after']))}{ratio}",
         "peak"),
        ("in flight", f"{_e(size_text(s['peak_in_flight_bytes_before']))} &rarr; "
         f"{_e(size_text(s['peak_in_flight_bytes_after']))}", "in-flight"),
    ]
    return '<dl class="summary">' + "".join(f'<div data-key="{k}"><dt>{name}</dt><dd>{value}</dd></div>'
                                            for name, value, k in items) + "</dl>"


def _legend(kinds: list[str]) -> str:
    entries = [f'<span><i class="swatch" style="background:{_colour(k)}"></i>{_e(k)}</span>' for k in kinds]
    entries += ['<span><i class="swatch" style="background:#9aa6b2"></i>compute</span>',
                '<span><i class="swatch hatch"></i>exposed (compute waits)</span>',
                '<span><i class="bar queued"></i>queued behind the link</span>',
                '<span><i class="bar mem-before"></i>live bytes before</span>',
                '<span><i class="bar mem-after"></i>live bytes after</span>',
                '<span><i class="bar budget"></i>budget</span>']
    return '<div class="legend">' + "".join(entries) + "</div>"


def _graph_section(view: GraphView, analysis) -> str:
    kinds = sorted({r.kind for r in view.rows})
    parts = [f'<section class="graph" id="graph-{_e(view.name)}" data-graph="{_e(view.name)}">',
             f"<h2>{_e(view.name)}{_direction(view.name)}: {view.summary['collectives']} collectives</h2>",
             _summary_html(view), _legend(kinds),
             "<h3>Simulated timeline</h3>", _lanes_svg(view),
             "<h3>Live bytes</h3>", _memory_svg(view),
             "<h3>Collectives</h3>", _table(view)]
    if analysis is not None:
        parts.append(_measured_section(view.name, analysis))
    parts.append("</section>")
    return "".join(parts)


def _direction(name: str) -> str:
    return {"fw": " (forward)", "bw": " (backward)"}.get(name.partition("_")[0], "")


def render_html(views: list[GraphView], *, title: str = "overlapc schedule", notes: list[str] = (),
                analysis=None) -> str:
    """The page for ``views`` (``graph_view`` results), with ``notes`` (lines of text under the
    title: target, profile, options) and, when given, an ``overlapc.explain.analyze.Analysis`` whose
    measured runs are drawn beside each graph's estimate. Self-contained; deterministic."""
    toc = " ".join(f'<a href="#graph-{_e(v.name)}">{_e(v.name)}</a>' for v in views)
    body = "".join(_graph_section(v, analysis) for v in views)
    notes_html = "".join(f"<p class=\"note\">{_e(n)}</p>" for n in notes)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>{_DEFS}"
            f"<h1>{_e(title)}</h1>{notes_html}<nav>graphs: {toc}</nav>{body}</body></html>\n")


# -- measured beside estimated -------------------------------------------------------------------

def _measured_section(graph: str, analysis) -> str:
    """One run of ``graph`` in the trace (the median-length one): measured spans above estimated."""
    runs = [(step, run) for step in analysis.steps for run in step.graphs if run.graph == graph]
    if not runs:
        return (f'<h3>Measured</h3><p class="note" data-measured="none">the trace has no run of {_e(graph)} '
                "that matched its collectives</p>")
    runs.sort(key=lambda pair: (pair[1].measured_ms, pair[0].step))
    step, run = runs[(len(runs) - 1) // 2]
    mine = [m for m in analysis.collectives if m.step == step.step and m.graph == graph
            and _in_run(m, run)]
    axis = _Axis(max(run.measured_ms, run.estimated_ms))
    lanes = [("measured", "compute"), ("measured", "link"), ("estimated", "compute"), ("estimated", "link")]
    height = 10 + len(lanes) * (LANE + GAP) + 24
    parts = axis.ticks(10, 10 + len(lanes) * (LANE + GAP))
    for index, (source, lane) in enumerate(lanes):
        y = 10 + index * (LANE + GAP)
        parts.append(f'<g class="lane" data-lane="{source} {lane}" data-graph="{_e(graph)}">'
                     f'<text class="lane-label" x="{LEFT - 8}" y="{y + 14}" text-anchor="end">{source}: {lane}</text>'
                     f'<rect class="lane-bg" x="{LEFT}" y="{y}" width="{PLOT}" height="{LANE}"/>')
        if lane == "compute":   # the graph's run, measured or estimated
            length = run.measured_ms if source == "measured" else run.estimated_ms
            parts.append(_rect(axis.x(0.0), axis.x(length), y + 3, LANE - 6, "run", None,
                               f"{graph} {source}: {length:.3f} ms", f' data-ms="{length!r}"'))
        parts += _measured_spans(mine, run, source, lane, axis, y)
        parts.append("</g>")
    width = LEFT + PLOT + RIGHT
    svg = (f'<svg class="measured" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" data-graph="{_e(graph)}">' + "".join(parts) + "</svg>")
    others = [r.measured_ms for _, r in runs]
    return (f'<h3>Measured (step {step.step}) beside estimated</h3>'
            f'<p class="note" data-measured-ms="{run.measured_ms!r}" data-estimated-ms="{run.estimated_ms!r}">'
            f"{_e(analysis.format)} trace {_e(os.path.basename(analysis.trace))}: this run took "
            f"{run.measured_ms:.3f} ms measured, {run.estimated_ms:.3f} ms estimated; exposed communication "
            f"{run.exposed_ms:.3f} ms measured, {run.estimated_exposed_ms:.3f} ms estimated "
            f"(the median of {len(runs)} run{'s' if len(runs) != 1 else ''} of {_e(graph)} in the trace: "
            f"{statistics.median(others):.3f} ms)</p>" + _MEASURED_LEGEND + svg)


_MEASURED_LEGEND = ('<div class="legend"><span><i class="swatch" style="background:#dfe4ea"></i>the graph\'s run'
                    '</span><span><i class="swatch issue"></i>issuing (the start op)</span>'
                    '<span><i class="swatch hatch"></i>waiting (exposed)</span>'
                    '<span><i class="swatch" style="background:#2f6fb3"></i>running on the link</span></div>')


def _in_run(m, run) -> bool:
    when = m.issued_at_ms if m.issued_at_ms is not None else m.waited_at_ms
    return when is not None and run.begin_ms <= when <= run.begin_ms + run.measured_ms


def _measured_spans(mine, run, source: str, lane: str, axis: _Axis, y: float) -> list[str]:
    """The spans of one lane of the measured section, in ms from the run's start."""
    out, at = [], run.begin_ms
    for m in mine:
        colour = _colour(m.kind)
        attrs = f' data-name="{_e(m.name)}" data-kind="{_e(m.kind)}"'
        if source == "measured" and lane == "compute":
            if m.issued_at_ms is not None:
                out.append(_rect(axis.x(m.issued_at_ms - at), axis.x(m.issued_at_ms - at + m.issue_ms), y + 4,
                                 LANE - 8, "issue", colour, f"issue {m.name}: {m.issue_ms:.3f} ms",
                                 attrs + f' stroke="{colour}"'))
            if m.waited_at_ms is not None and m.exposed_ms > 0:
                out.append(_rect(axis.x(m.waited_at_ms - at), axis.x(m.waited_at_ms - at + m.exposed_ms), y, LANE,
                                 "exposed", "url(#exposed-hatch)", f"wait {m.name}: {m.exposed_ms:.3f} ms",
                                 attrs + f' data-exposed-ms="{m.exposed_ms!r}"'))
        elif source == "measured" and m.ran_at_ms is not None and m.duration_ms is not None:
            out.append(_rect(axis.x(m.ran_at_ms - at), axis.x(m.ran_at_ms - at + m.duration_ms), y + 2, LANE - 4,
                             "coll", colour, f"{m.name} ran {m.duration_ms:.3f} ms", attrs))
        elif source == "estimated" and m.estimated_start_ms is not None and m.estimated_end_ms is not None:
            if lane == "link":
                out.append(_rect(axis.x(m.estimated_start_ms), axis.x(m.estimated_end_ms), y + 2, LANE - 4, "coll",
                                 colour, f"{m.name} estimated {m.estimated_end_ms - m.estimated_start_ms:.3f} ms",
                                 attrs))
            elif m.estimated_exposed_ms:
                out.append(_rect(axis.x(m.estimated_end_ms - m.estimated_exposed_ms), axis.x(m.estimated_end_ms), y,
                                 LANE, "exposed", "url(#exposed-hatch)",
                                 f"estimated wait {m.name}: {m.estimated_exposed_ms:.3f} ms", attrs))
    return out


# -- entry points --------------------------------------------------------------------------------

def html_for_records(records, profile=None, config=None, *, trace: str | None = None, dump: str | None = None,
                     title: str = "overlapc schedule", notes: list[str] = ()) -> str:
    """The page for ``backend.GraphRecord``s (``backend.capture``'s result, or the CLI's records).

    ``profile``: anything ``costmodel.resolve`` takes; ``config``: the OverlapConfig or options
    the graphs were scheduled with (for the budget line). ``trace``: a torch.profiler Chrome
    trace of a run of these graphs (``overlapc analyze``'s input); its collectives are matched
    to ``dump`` (a ``dump_dir`` / ``overlapc dump`` folder) when given, else to the records'
    own reports (written to a temporary folder). ValueError for a trace ``analyze`` rejects."""
    profile = costmodel.resolve(profile)
    views = [graph_view(r.name, r.gm, r.before_order, profile, config) for r in records]
    analysis = None
    if trace is not None:
        from overlapc.explain import analyze

        if dump is not None:
            analysis = analyze.analyze(trace, dump)
        else:
            with tempfile.TemporaryDirectory(prefix="overlapc-html-") as folder:
                for record in records:
                    write_artifacts(record, os.path.join(folder, record.name), profile)
                analysis = analyze.analyze(trace, folder)
    notes = list(notes) + [f"estimates: {profile.source or profile.name}"]
    return render_html(views, title=title, notes=notes, analysis=analysis)


def write_html(path: str, records, profile=None, config=None, **keywords) -> None:
    """Write ``html_for_records(records, profile, config, **keywords)`` to ``path`` (UTF-8)."""
    text = html_for_records(records, profile, config, **keywords)
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        out.write(text)


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:24px;color:#1d232a;
background:#fff}
h1{font-size:22px;margin:0 0 6px}h2{font-size:18px;margin:28px 0 6px;border-top:1px solid #d5dbe1;padding-top:14px}
h3{font-size:14px;margin:16px 0 4px;color:#44505c}
.note{margin:2px 0;color:#44505c}nav{margin:8px 0}nav a{margin-right:10px}
dl.summary{display:flex;flex-wrap:wrap;gap:8px 22px;margin:6px 0}dl.summary div{display:flex;gap:6px}
dt{color:#5b6773}dd{margin:0;font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;margin:6px 0;font-size:12px;color:#44505c}
.legend span{display:inline-flex;align-items:center;gap:5px}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:middle;margin-right:4px}
.swatch.hatch{background:repeating-linear-gradient(45deg,#d62728 0 3px,#f3b6b6 3px 6px)}
.bar{display:inline-block;width:18px;height:0;border-top:3px solid}
.bar.queued{border-top:2px dotted #6b6b6b}.bar.mem-before{border-color:#8a94a0}.bar.mem-after{border-color:#e07b1a}
.bar.budget{border-top:2px dashed #d62728}
svg.defs{position:absolute}svg{display:block;max-width:100%;height:auto;font:11px system-ui,"DejaVu Sans",sans-serif}
.lane-bg{fill:#f4f6f8;fill-opacity:.7}.run{fill:#dfe4ea}.issue{fill-opacity:.35;stroke-width:1}
.swatch.issue{background:#2f6fb355;border:1px solid #2f6fb3;box-sizing:border-box}
.compute{fill:#9aa6b2;shape-rendering:crispEdges}.coll{stroke:#fff;stroke-width:.5}
.grid{stroke:#e1e5ea;stroke-width:1}.tick{fill:#5b6773;font-size:10px}
.lane-label{fill:#2c3640;font-size:11px}
.order-title{fill:#1d232a;font-weight:600;font-size:12px;paint-order:stroke;stroke:#fff;stroke-width:4px}
.queued{stroke:#6b6b6b;stroke-width:1.5;stroke-dasharray:2 2}
.mem{fill:none;stroke-width:2}.mem-before{stroke:#8a94a0}.mem-after{stroke:#e07b1a}
.peak-line line{stroke:#5b6773;stroke-dasharray:4 3}.peak-line text{fill:#5b6773;font-size:10px}
.budget-line line{stroke:#d62728;stroke-dasharray:6 3;stroke-width:1.5}.budget-line text{fill:#d62728;font-size:10px}
table.rows{border-collapse:collapse;font-size:12px;margin:4px 0 10px}
table.rows th,table.rows td{padding:3px 6px;border-bottom:1px solid #e6e9ed;text-align:left;white-space:nowrap}
table.rows th{background:#f4f6f8}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.hidden{color:#22936a}td.exposed{color:#d62728}
"""

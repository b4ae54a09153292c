"""overlapc.explain.html_report: the schedule page of the Llama example (examples/llama.py).

Without a browser: the page is self-contained, holds both orders of every graph,
and the numbers it draws are the simulation's (``overlapc.estimate.simulate`` run here,
and pixel positions recomputed from them). With a real headless Chromium
(Debian's ``chromium`` package; .ci/run installs it): the page is loaded with
a measuring script appended, which reports the rendered boxes of the lanes and
curves, and a screenshot's pixels are checked for the kinds' colours, the
exposed marks and both memory curves. That test skips, saying why, only when no
browser is installed.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import zlib

import pytest

from overlapc import backend
from overlapc.cli import UsageError
from overlapc.cli.targets import fake_process_group, html_for_target, load_target
from overlapc.estimate import costmodel
from overlapc.explain import html_report
from overlapc.passes.memory import peak_bytes
from overlapc.explain.report import write_artifacts
from overlapc.estimate.simulate import checked_order, simulate

TARGET = os.path.join(os.path.dirname(__file__), "..", "examples", "llama.py") + ":build"
PROFILE = "cpu:ethernet"   # compute and communication of comparable size: both lanes have something to show


@pytest.fixture(scope="module")
def llama():
    """The Llama example's records (forward and backward, world size 8) and their page."""
    build = load_target(TARGET)
    with fake_process_group(8, 0):
        model, inputs = build()
        records = backend.capture(model, inputs)
        page = html_report.html_for_records(records, PROFILE, title="llama")
    assert [r.name for r in records] == ["fw_0", "bw_0"]
    return records, page


def _attrs(tag: str) -> dict:
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


def _tags(page: str, element: str, cls: str) -> list[dict]:
    """Attributes of every ``<element class="cls" ...>`` in ``page``."""
    return [_attrs(m) for m in re.findall(rf'<{element} class="{cls}"[^>]*>', page)]


def test_page_is_self_contained(llama):
    _, page = llama
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:)?//', page, re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//|@import|<link\b|<script\b|<iframe\b|<img\b", page, re.I)
    assert "http://" not in page and "https://" not in page


def test_page_holds_both_orders_with_the_simulations_numbers(llama):
    records, page = llama
    profile = costmodel.resolve(PROFILE)
    lanes = _tags(page, "g", "lane")
    for record in records:
        span = 0.0
        for key, order in (("before", record.before_order), ("after", None)):
            timeline = simulate(record.gm, profile, order)
            span = max(span, timeline.step_ms)
            orders = [a for a in _tags(page, "g", "order") if a["data-graph"] == record.name and a["data-order"] == key]
            assert len(orders) == 1
            assert float(orders[0]["data-step-ms"]) == pytest.approx(timeline.step_ms, rel=1e-12)
            assert float(orders[0]["data-exposed-ms"]) == pytest.approx(timeline.exposed_ms, rel=1e-12, abs=1e-15)
            mine = [a for a in lanes if a["data-graph"] == record.name and a["data-order"] == key]
            groups = sorted({t.collective.group for t in timeline.collectives.values()})
            assert [a["data-lane"] for a in mine] == ["compute"] + ["link"] * len(groups)
            assert [a["data-group"] for a in mine[1:]] == groups
            # every collective once, at the simulated times
            drawn = _drawn(page, record.name, key)
            assert sorted(drawn) == sorted(timeline.collectives)
            for name, t in timeline.collectives.items():
                a = drawn[name]
                assert (a["data-kind"], float(a["data-start-ms"]), float(a["data-end-ms"])) == \
                    (t.collective.kind, pytest.approx(t.start_ms, abs=1e-12), pytest.approx(t.end_ms, abs=1e-12))
            # the memory curve's peak is the liveness peak of that order
            nodes = checked_order(record.gm, order)
            curve = [a for a in _tags(page, "polyline", f"mem mem-{key}") if a["data-graph"] == record.name]
            assert len(curve) == 1 and int(curve[0]["data-peak-bytes"]) == peak_bytes(nodes) == timeline.peak_bytes
            highest = min(float(p.split(",")[1]) for p in curve[0]["points"].split())
            assert highest == pytest.approx(_memory_y(page, record.name, timeline.peak_bytes), abs=0.02)
        # pixel positions: x = left + ms / span * width, on the axis shared by both orders
        svg = [a for a in _tags(page, "svg", "timeline") if a["data-graph"] == record.name][0]
        assert float(svg["data-span-ms"]) == pytest.approx(span, rel=1e-12)
        for a in _coll_rects(page, record.name, "after"):
            x = html_report.LEFT + float(a["data-start-ms"]) / span * html_report.PLOT
            assert float(a["x"]) == pytest.approx(x, abs=0.006)
        assert f'data-graph="{record.name}"' in page and f"<h2>{record.name} (" in page
    # the table: one row per collective of each graph
    for record in records:
        table = page.split(f'<table class="rows" data-graph="{record.name}">')[1].split("</table>")[0]
        assert table.count("<tr data-name=") == len(simulate(record.gm, profile).collectives)


def _coll_rects(page: str, graph: str, order: str) -> list[dict]:
    block = page.split(f'<g class="order" data-graph="{graph}" data-order="{order}"')[1].split("</svg>")[0]
    if order == "before":
        block = block.split('<g class="order"')[0]
    return _tags(block, "rect", "coll")


def _drawn(page: str, graph: str, order: str) -> dict:
    return {a["data-name"]: a for a in _coll_rects(page, graph, order)}


def _memory_y(page: str, graph: str, nbytes: int) -> float:
    """The y pixel of ``nbytes`` in ``graph``'s memory chart, from its top value (recomputed)."""
    svg = [part for part in page.split('<svg class="memory"')[1:] if f'data-graph="{graph}"' in part[:200]][0]
    peaks = [int(v) for v in re.findall(r'data-peak-bytes="(\d+)"', svg.split("</svg>")[0])]
    budget = re.search(r'<g class="budget-line" data-bytes="(\d+)"', svg)
    top = max(peaks + [int(budget.group(1)) if budget else 0, 1]) * 1.08
    return 10 + html_report.MEMORY_HEIGHT - nbytes / top * html_report.MEMORY_HEIGHT


def test_budget_line_is_the_peak_before_plus_the_in_flight_budget(llama):
    records, page = llama
    from overlapc.config import OverlapConfig
    from overlapc.passes.pipeline import budget_for
    from overlapc.passes.structure import Structure

    for record in records:   # the defaults: "serial-peak", whose line is the bound itself
        bound = budget_for(Structure(record.gm), OverlapConfig()).headroom.peak
        before = peak_bytes(checked_order(record.gm, record.before_order))
        svg = [p for p in page.split('<svg class="memory"')[1:] if f'data-graph="{record.name}"' in p[:200]][0]
        assert f'<g class="budget-line" data-bytes="{bound}"' in svg and "(serial-peak)" in svg
        assert f'<g class="peak-line" data-bytes="{before}"' in svg
    with fake_process_group(8, 0):
        auto = html_report.graph_view("fw_0", records[0].gm, records[0].before_order, PROFILE,
                                      {"max_in_flight_bytes": "auto"})
        limits = budget_for(Structure(records[0].gm), OverlapConfig(max_in_flight_bytes="auto")).max_bytes
        before = peak_bytes(checked_order(records[0].gm, records[0].before_order))
    assert (auto.budget_bytes, auto.in_flight_budget) == (before + sum(limits.values()), sum(limits.values()))
    with fake_process_group(8, 0):
        unlimited = html_report.graph_view("fw_0", records[0].gm, records[0].before_order, PROFILE,
                                           {"max_in_flight_bytes": None})
    assert unlimited.budget_bytes is None
    assert 'class="budget-line"' not in html_report.render_html([unlimited])


def _cpu_trace(records, folder: str) -> str:
    """A synthetic CPU (gloo) profiler trace of one step running fw_0 then bw_0: each
    collective's start op, its gloo worker run 40 us later, and its wait; written to ``folder``."""
    events, clock = [], 100.0
    thread, worker = {"pid": 1, "tid": 1}, {"pid": 1, "tid": 2}
    for record in records:
        with open(os.path.join(folder, record.name, "report.json")) as source:
            rows = sorted(json.load(source)["collectives"], key=lambda r: r["issue_after"])
        begin = clock
        for row in rows:
            op = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}[row["kind"]]
            events.append({"ph": "X", "name": f"_c10d_functional::{op}", "ts": clock, "dur": 5.0, **thread})
            events.append({"ph": "X", "name": f"gloo:{row['kind']}", "ts": clock + 6, "dur": 40.0, **worker})
            events.append({"ph": "X", "name": "_c10d_functional::wait_tensor", "ts": clock + 20, "dur": 26.0,
                           **thread})
            clock += 60.0
        region = "CompiledFunction" if record.name.startswith("fw") else "CompiledFunctionBackward"
        events.append({"ph": "X", "name": region, "ts": begin - 10, "dur": clock - begin + 20, **thread})
        clock += 50.0
    events.append({"ph": "X", "name": "ProfilerStep#1", "ts": 0.0, "dur": clock + 100, **thread})
    path = os.path.join(folder, "trace.json")
    with open(path, "w") as out:
        json.dump({"traceEvents": events}, out)
    return path


def test_measured_spans_beside_the_estimated(llama, tmp_path):
    records, _ = llama
    with fake_process_group(8, 0):
        for record in records:
            write_artifacts(record, str(tmp_path / record.name), PROFILE)
        trace = _cpu_trace(records, str(tmp_path))
        page = html_report.html_for_records(records, PROFILE, trace=trace, dump=str(tmp_path))
        own = html_report.html_for_records(records, PROFILE, trace=trace)   # matched to the records' own reports
    profile = costmodel.resolve(PROFILE)
    for text in (page, own):
        sections = {re.search(r'data-graph="(\w+)"', part).group(1): part.split("</svg>")[0]
                    for part in text.split("<h3>Measured")[1:]}
        assert sorted(sections) == sorted(r.name for r in records)
        for record in records:
            section, count = sections[record.name], len(simulate(record.gm, profile).collectives)
            # the run: its CompiledFunction span (60 us per collective + 20 us) beside its estimate
            run = _attrs(re.search(r'<p class="note" data-measured-ms[^>]*>', section).group(0))
            assert float(run["data-measured-ms"]) == pytest.approx((60 * count + 20) / 1e3)
            assert float(run["data-estimated-ms"]) == pytest.approx(simulate(record.gm, profile).step_ms)
            lanes = section.split('<g class="lane"')[1:]
            assert [re.search(r'data-lane="([^"]+)"', lane).group(1) for lane in lanes] == [
                "measured compute", "measured link", "estimated compute", "estimated link"]
            assert lanes[0].count('class="issue"') == count
            assert re.findall(r'data-exposed-ms="([\d.e-]+)"', lanes[0]) == ["0.026"] * count   # 26 us waits
            assert lanes[1].count('class="coll"') == count     # measured runs
            assert lanes[3].count('class="coll"') == count     # estimated runs


def test_write_html_is_deterministic(llama, tmp_path):
    records, page = llama
    path = tmp_path / "page.html"
    with fake_process_group(8, 0):
        html_report.write_html(str(path), records, PROFILE, title="llama")
    assert path.read_text(encoding="utf-8") == page


def test_html_for_target(tmp_path):
    page = html_for_target(TARGET, 8, options={"bucket": None}, profile="h100:ib")
    assert "max_in_flight_bytes=serial-peak, bucket=None" in page and "built-in h100:ib" in page
    assert page.count('<section class="graph"') == 2
    with pytest.raises(UsageError, match="no such file"):
        html_for_target("examples/nothing.py:build", 8)


# -- in a real browser ---------------------------------------------------------------------------

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def _chromium(browser: str, *args: str) -> str:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", "--disable-dev-shm-usage", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


MEASURE = """<script>
addEventListener("load", () => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
  const out = {lanes: [], curves: [], rects: [], texts: []};
  for (const g of document.querySelectorAll("g.lane")) {
    out.lanes.push({graph: g.dataset.graph, order: g.dataset.order || "", lane: g.dataset.lane,
                    bg: box(g.querySelector("rect.lane-bg")), label: g.querySelector("text").textContent});
  }
  for (const p of document.querySelectorAll("polyline.mem")) {
    out.curves.push({graph: p.dataset.graph, order: p.dataset.order, box: box(p),
                     points: p.points.numberOfItems});
  }
  for (const r of document.querySelectorAll("rect.coll")) {
    const lane = r.closest("g.lane").querySelector("rect.lane-bg");
    out.rects.push({box: box(r), lane: box(lane), fill: getComputedStyle(r).fill});
  }
  for (const t of document.querySelectorAll("dl.summary dd")) out.texts.push(t.textContent);
  const pre = document.createElement("pre");
  pre.id = "measured-layout";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _png_pixels(path: str) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    with open(path, "rb") as source:
        data = source.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, {}
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        chunks.setdefault(kind, []).append(data[at + 8:at + 8 + length])
        at += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    step = 3 if colour == 2 else 4
    raw, rows, previous = zlib.decompress(b"".join(chunks[b"IDAT"])), [], bytearray(width * step)
    stride = width * step + 1
    for y in range(height):
        kind, line = raw[y * stride], bytearray(raw[y * stride + 1:(y + 1) * stride])
        for i in range(len(line)):
            left = line[i - step] if i >= step else 0
            up, corner = previous[i], previous[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        previous = line
    return width, height, [bytes(b for i, b in enumerate(row) if i % step < 3) for row in rows]


def _colours(rows: list[bytes]) -> set[tuple]:
    return {row[i:i + 3] for row in rows for i in range(0, len(row), 3)}


def test_page_in_headless_chromium(llama, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium found (tried " + ", ".join(BROWSERS) + "); .ci/run installs Debian's "
                    "`chromium` package, or `apt-get install -y chromium`")
    records, page = llama
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = _chromium(browser, "--dump-dom", measured.as_uri())
    layout = json.loads(__import__("html").unescape(dom.split('<pre id="measured-layout">')[1].split("</pre>")[0]))

    # the lanes: compute and one link per group, before and after, for both graphs, laid out with size
    for record in records:
        for order in ("before", "after"):
            mine = [lane for lane in layout["lanes"] if lane["graph"] == record.name and lane["order"] == order]
            assert [lane["lane"] for lane in mine] == ["compute", "link"]
            assert [lane["label"] for lane in mine] == ["compute", "link 0"]
            for lane in mine:
                assert lane["bg"][2] > 500 and lane["bg"][3] > 10, lane
        tops = [lane["bg"][1] for lane in layout["lanes"] if lane["graph"] == record.name]
        assert tops == sorted(tops) and len(set(tops)) == len(tops)   # stacked, not overlapping
        curves = [c for c in layout["curves"] if c["graph"] == record.name]
        assert [c["order"] for c in curves] == ["before", "after"]
        for c in curves:
            assert c["box"][2] > 400 and c["box"][3] > 50 and c["points"] == 2 * len(record.gm.graph.nodes)
    # every collective drawn inside its lane, in its kind's colour
    assert len(layout["rects"]) == 2 * sum(len(simulate(r.gm, costmodel.resolve(PROFILE)).collectives)
                                           for r in records)
    for rect in layout["rects"]:
        (x, y, w, h), (lx, ly, lw, lh) = rect["box"], rect["lane"]
        assert lx - 0.5 <= x and x + w <= lx + lw + 1 and ly <= y and y + h <= ly + lh and w > 0, rect
    fills = {rect["fill"] for rect in layout["rects"]}
    assert fills == {"rgb(47, 111, 179)", "rgb(224, 123, 26)"}    # all-gathers and reduce-scatters
    # the numbers
    assert any("→" in text and "ms" in text for text in layout["texts"])
    assert any("MiB" in text for text in layout["texts"])

    # the picture: the kinds' colours, the exposed marks and both curves are on screen
    shot, plain = tmp_path / "page.png", tmp_path / "page.html"
    plain.write_text(page, encoding="utf-8")
    _chromium(browser, "--window-size=1200,1400", f"--screenshot={shot}", plain.as_uri())
    width, height, rows = _png_pixels(str(shot))
    assert (width, height) == (1200, 1400)
    seen = _colours(rows)
    for colour in ("2f6fb3", "d62728", "8a94a0", "e07b1a", "9aa6b2"):   # all-gather, exposed, curves, compute
        assert bytes.fromhex(colour) in seen, colour

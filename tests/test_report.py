"""Report rows, verdicts (one graph per reason) and the summary, with exact costs set per node."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import overlapc
from overlapc.estimate import costmodel
from overlapc.explain import report

F = torch.ops._c10d_functional


def costs(compute=None, comm=None):
    """compute_ms / comm_ms callables from {node name: ms} and {start name: ms}; others cost 0."""
    compute, comm = compute or {}, comm or {}
    return {"compute_ms": lambda n: compute.get(n.name, 0.0),
            "comm_ms": lambda c: comm.get(c.start.name, 0.0)}


def scheduled(fn, *shapes, max_in_flight=2):
    """Trace ``fn``, record the order, schedule under a count limit only; return (gm after, names before)."""
    gm = make_fx(fn)(*(torch.randn(s) for s in shapes))
    before = [n.name for n in gm.graph.nodes]
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=max_in_flight, max_in_flight_bytes=None,
                                                 on_error="raise"))
    return gm, before


def only_row(gm, before, compute, comm):
    (row,) = report.rows(gm, before, **costs(compute, comm))
    return row


def gather_after_compute(a, w):
    x = torch.mm(a, a)
    return torch.mm(x, F.wait_tensor(F.all_gather_into_tensor(w, 8, "0")))


def test_hidden_when_compute_covers_it(fake_pg):
    gm, before = scheduled(gather_after_compute, (8, 8), (1, 8))
    row = only_row(gm, before, {"mm": 10, "mm_1": 1}, {"all_gather_into_tensor": 4})
    assert (row.verdict, row.reason, row.exposed_ms, row.exposed_ms_before) == ("hidden", "", 0, 4)
    assert (row.compute_nodes, row.compute_ms, row.comm_ms) == (1, 10, 4)
    assert row.moved and row.issue_after < row.issue_before


def test_no_compute_left(fake_pg):
    gm, before = scheduled(gather_after_compute, (8, 8), (1, 8))
    row = only_row(gm, before, {"mm": 1, "mm_1": 1}, {"all_gather_into_tensor": 4})
    assert (row.verdict, row.reason, row.exposed_ms) == ("exposed", "no compute left", 3)


def test_graph_input_feeds_first_compute(fake_pg):
    def first_layer(a, w):
        y = torch.mm(a, F.wait_tensor(F.all_gather_into_tensor(w, 8, "0")))
        return torch.mm(y, y)

    gm, before = scheduled(first_layer, (8, 8), (1, 8))
    row = only_row(gm, before, {"mm": 1, "mm_1": 1}, {"all_gather_into_tensor": 4})
    assert (row.verdict, row.reason, row.exposed_ms) == ("exposed", "graph input/output", 4)


def test_graph_output(fake_pg):
    def reduced_output(a):
        return F.wait_tensor(F.all_reduce(torch.mm(a, a), "sum", "0"))

    gm, before = scheduled(reduced_output, (8, 8))
    row = only_row(gm, before, {"mm": 1}, {"all_reduce": 4})
    assert (row.verdict, row.reason) == ("exposed", "graph input/output")


def test_data_dependency(fake_pg):
    def reduced_then_used(a):
        r = F.wait_tensor(F.all_reduce(torch.mm(a, a), "sum", "0"))
        return torch.relu(r)

    gm, before = scheduled(reduced_then_used, (8, 8))
    row = only_row(gm, before, {"mm": 1, "relu": 1}, {"all_reduce": 4})
    assert (row.verdict, row.reason, row.exposed_ms) == ("exposed", "data dependency", 4)
    assert not row.moved


def three_layers(a, w1, w2, w3):
    y = torch.mm(a, a)
    y = torch.mm(y, F.wait_tensor(F.all_gather_into_tensor(w1, 8, "0")))
    y = torch.mm(y, F.wait_tensor(F.all_gather_into_tensor(w2, 8, "0")))
    return torch.mm(y, F.wait_tensor(F.all_gather_into_tensor(w3, 8, "0")))


LAYER_COSTS = costs({"mm": 10, "mm_1": 1, "mm_2": 1, "mm_3": 1},
                    {"all_gather_into_tensor": 4, "all_gather_into_tensor_1": 4, "all_gather_into_tensor_2": 4})


def test_in_flight_limit(fake_pg):
    # max_in_flight=1: the second and third all-gathers wait for the previous one's
    # wait, although their parameters were ready before the 10 ms mm.
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=1)
    rows = report.rows(gm, before, **LAYER_COSTS)
    assert [(r.verdict, r.reason) for r in rows] == [
        ("hidden", ""), ("exposed", "in-flight limit"), ("exposed", "in-flight limit")]
    big_mm = [n.name for n in gm.graph.nodes].index("mm")
    assert rows[0].issue_before == 5 and rows[0].issue_after < big_mm   # issued before the 10 ms mm
    assert [(r.issue_before, r.issue_after, r.wait_before, r.wait_after) for r in rows[1:]] == [
        (8, 7, 9, 9), (11, 10, 12, 12)]
    assert [r.exposed_ms for r in rows] == [0, 3, 3]
    unlimited, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=None)
    assert [r.verdict for r in report.rows(unlimited, before, **LAYER_COSTS)] == ["hidden"] * 3


def test_summary_before_and_after(fake_pg):
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=1)
    s = report.summary(gm, before, **LAYER_COSTS)
    assert {k: s[k] for k in ("collectives", "moved", "hidden_before", "hidden_after")} == {
        "collectives": 3, "moved": 3, "hidden_before": 0, "hidden_after": 1}
    # before: each all-gather right before its wait (4 ms exposed each), 13 ms of compute
    assert (s["exposed_ms_before"], s["step_ms_before"]) == (12, 25)
    assert (s["exposed_ms_after"], s["step_ms_after"]) == (6, 19)
    held = 8 * 8 * 4 + 1 * 8 * 4      # a gathered weight and its shard
    assert s["in_flight"] == {"all_gather": {"count_before": 1, "count_after": 1,
                                             "bytes_before": held, "bytes_after": held}}
    assert (s["peak_in_flight_bytes_before"], s["peak_in_flight_bytes_after"]) == (held, held)
    # one more 8x8 weight is live at a time after scheduling (gathered during the 10 ms mm)
    assert s["peak_bytes_after"] - s["peak_bytes_before"] == 8 * 8 * 4
    assert report.memory_text(s).startswith(
        f"peak memory {report.size_text(s['peak_bytes_before'])} -> {report.size_text(s['peak_bytes_after'])} (")
    assert sum(r.exposed_ms for r in report.rows(gm, before, **LAYER_COSTS)) == s["exposed_ms_after"]
    assert report.summary_line(s) == \
        "moved 3 of 3 collectives; hidden 0 -> 1 of 3 by estimate with h100:nvlink (exposed 12.0 -> 6.0 ms)"


def test_unbounded_in_flight_peaks_count_every_open_gather(fake_pg):
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=None)
    s = report.summary(gm, before, **LAYER_COSTS)
    # all three issued before the first wait: 3 open, each holding its 8 x 8 output and 1 x 8 shard
    held = 8 * 8 * 4 + 8 * 4
    assert s["in_flight"]["all_gather"] == {"count_before": 1, "count_after": 3,
                                            "bytes_before": held, "bytes_after": 3 * held}


def test_no_in_flight_line_for_kinds_the_graph_lacks(fake_pg):
    def reduced(a):
        return torch.relu(F.wait_tensor(F.all_reduce(torch.mm(a, a), "sum", "0")))

    gm, before = scheduled(reduced, (8, 8))
    rows, s = report.rows(gm, before, **costs({"mm": 1})), report.summary(gm, before, **costs({"mm": 1}))
    assert list(s["in_flight"]) == ["all_reduce"]
    text = report.format_text(rows, s) + report.format_graph("g", rows, s)
    assert "all_gather" not in text and text.count("peak in flight per group: all_reduce 1 -> 1") == 2


def test_moved_counts_a_start_crossing_only_free_nodes(fake_pg):
    # the start moves above a transpose (a view: cost 0), nothing else: it moved all the same
    def gather_after_view(a, w):
        x = a.t()
        return torch.mm(x, F.wait_tensor(F.all_gather_into_tensor(w, 8, "0")))

    gm, before = scheduled(gather_after_view, (8, 8), (1, 8))
    after = [n.name for n in gm.graph.nodes]
    assert before.index("all_gather_into_tensor") > before.index("t")
    assert after.index("all_gather_into_tensor") < after.index("t")
    (row,) = report.rows(gm, before, **costs({"mm": 1}))
    s = report.summary(gm, before, **costs({"mm": 1}))
    assert row.moved and s["moved"] == 1


def test_queued_stall_is_shared_with_the_collective_ahead(fake_pg):
    # two all-reduces on one stream: the second's wait also waits for the first, so the
    # first is not hidden although its own wait found it done
    def two_reduces(a, b):
        x = F.all_reduce(torch.mm(a, a), "sum", "0")
        y = F.all_reduce(torch.mm(b, b), "sum", "0")
        z = torch.relu(b)
        return F.wait_tensor(x) + 1, torch.mm(F.wait_tensor(y), z)

    gm = make_fx(two_reduces)(torch.randn(8, 8), torch.randn(8, 8))
    names = [n.name for n in gm.graph.nodes]
    c = costs({"mm": 1, "mm_1": 1, "relu": 1, "add": 1, "mm_2": 1}, {"all_reduce": 4, "all_reduce_1": 4})
    rows, s = report.rows(gm, names, **c), report.summary(gm, names, **c)
    assert sum(r.exposed_ms for r in rows) == pytest.approx(s["exposed_ms_after"])
    assert s["hidden_after"] == sum(r.verdict == "hidden" for r in rows)


def test_unscheduled_graph_has_nothing_moved(fake_pg):
    gm = make_fx(three_layers)(torch.randn(8, 8), *(torch.randn(1, 8) for _ in range(3)))
    names = [n.name for n in gm.graph.nodes]
    s = report.summary(gm, names, **LAYER_COSTS)
    assert s["moved"] == 0 and s["exposed_ms_before"] == s["exposed_ms_after"] == 12


def test_text_and_json(fake_pg):
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=1)
    start = next(n for n in gm.graph.nodes if n.name == "all_gather_into_tensor_1")
    start.meta["nn_module_stack"] = {"L__self__": ("", torch.nn.Module),
                                     "L__self___layers_1": ("layers.1", torch.nn.Linear)}
    rows, s = report.rows(gm, before, **LAYER_COSTS), report.summary(gm, before, **LAYER_COSTS)
    assert [r.module for r in rows] == ["", "layers.1", ""]
    text = report.format_text(rows, s)
    assert text == report.format_text(report.rows(gm, before, **LAYER_COSTS), s)
    lines = text.splitlines()
    assert lines[0] == report.summary_line(s)
    assert lines[2] == report.memory_text(s)
    assert lines[3] == "peak in flight per group: all_gather 1 -> 1 (288B -> 288B)"
    assert lines[4].split()[:3] == ["collective", "kind", "group"]
    assert "exposed (in-flight limit)" in lines[6] and "layers.1" in lines[6]
    doc = report.to_json(rows, s)
    assert json.loads(json.dumps(doc)) == doc
    assert doc["schema"] == report.SCHEMA and doc["summary"] == s
    assert set(doc["collectives"][0]) == {f.name for f in dataclasses.fields(report.Row)}
    assert doc["collectives"][1]["reason"] == "in-flight limit"


def test_default_profile_estimates(fake_pg):
    gm, before = scheduled(three_layers, (256, 256), (32, 256), (32, 256), (32, 256))
    rows = report.rows(gm, before, costmodel.profile("cpu", "ethernet"))
    assert len(rows) == 3 and all(r.comm_ms > 0.05 for r in rows)
    assert all(r.verdict in ("hidden", "exposed") for r in rows)
    assert all(r.reason in ("",) + report.REASONS for r in rows)


class _Replicate(torch.nn.Module):
    """Stands for a SimpleFSDP parametrization module in a recorded stack."""


def _stack_node(*entries, key="nn_module_stack"):
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta[key] = {f"k{i}": entry for i, entry in enumerate(entries)}
    return node


def test_module_path_skips_parametrizations_and_wrappers():
    L = "L['self']."
    # torchtitan's property parametrization, named after block 0 although block 1 reads it (shared)
    shared = _stack_node((L + "blocks.1", torch.nn.Module), (L + "blocks.1.attn.wq", torch.nn.Linear),
                         ("dict(type(L['self'].blocks.0.attn.wq).__dict__)['weight'].fget.__closure__[0]"
                          ".cell_contents", _Replicate))
    assert report.module_path(shared) == "blocks.1.attn.wq"
    plain_shared = _stack_node((L + "blocks.1.up", torch.nn.Linear),
                               (L + "blocks.0.up.parametrizations.weight.0", _Replicate))
    assert report.module_path(plain_shared) == "blocks.1.up"
    wrapped = _stack_node((L + "_orig_mod.layers.0._fsdp_wrapped_module", torch.nn.Module),
                          (L + "_orig_mod.layers.0._fsdp_wrapped_module.mlp", torch.nn.Module))
    assert report.module_path(wrapped) == "layers.0.mlp"
    # a root parameter: no user module below the root, so the parameter's name
    root = _stack_node(("dict(type(L['self']).__dict__)['scale'].fget.__closure__[0].cell_contents", _Replicate))
    assert report.module_path(root) == "scale"
    backward = _stack_node((L + "head", torch.nn.Linear), key="fwd_nn_module_stack")
    assert report.module_path(backward) == "head"


def test_module_paths_on_a_simplefsdp_capture(fake_pg):
    """Forward all-gathers and backward reduce-scatters name the module that owns the parameter."""
    import importlib.util
    import os
    from overlapc import backend

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "simplefsdp_tp.py")
    spec = importlib.util.spec_from_file_location("example_simplefsdp_tp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, inputs = example.build(dim=16, hidden=32, depth=2, tokens=8)
    owners = [f"blocks.{b}.{m}" for b in range(2) for m in ("attn.wq", "attn.wo", "up", "up", "down", "down")]
    forward, backward = backend.capture(model, inputs, {"max_in_flight": 2, "bucket": None})
    for record, kind, expected in ((forward, "all_gather", owners), (backward, "reduce_scatter", owners[::-1])):
        rows = report.rows(record.gm, record.before_order)
        assert {r.kind for r in rows} == {kind}
        by_issue = sorted(rows, key=lambda r: r.issue_before)
        assert [r.module for r in by_issue] == expected, record.name


def test_recorded_reasons_replace_the_inferred_ones(fake_pg):
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=1)
    for node in gm.graph.nodes:   # what the scheduler records (passes/scheduler.py)
        node.meta.pop(report.REASON_KEY, None)
    start = next(n for n in gm.graph.nodes if n.name == "all_gather_into_tensor_1")
    start.meta[report.REASON_KEY] = "count bound"
    next(iter(start.users)).meta[report.REASON_KEY] = "before consumer"
    rows = report.rows(gm, before, **LAYER_COSTS)
    assert [(r.issue_reason, r.wait_reason, r.why) for r in rows] == [
        ("", "", ""), ("count bound", "before consumer", "count bound; before consumer"),
        ("", "", "in-flight limit")]   # no record: the inferred reason of an exposed row
    table = report.format_table(rows).splitlines()
    assert table[0].split()[10:12] == ["verdict", "placed"]
    assert "exposed (in-flight limit)  count bound; before consumer" in table[2]
    assert "exposed (in-flight limit)  -" in table[3]


def test_rows_and_summary_simulate_each_order_once(fake_pg, monkeypatch):
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=1)
    calls = []
    real = report.simulate
    monkeypatch.setattr(report, "simulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = report.rows(gm, before, **LAYER_COSTS)
    s = report.summary(gm, before, **LAYER_COSTS)
    assert len(calls) == 2 and (rows, s) == report.study(gm, before, **LAYER_COSTS) and len(calls) == 2
    s["collectives"] = -1   # callers get their own copy
    assert report.summary(gm, before, **LAYER_COSTS)["collectives"] == 3
    report.rows(gm, before, **costs({"mm": 1}))
    assert len(calls) == 4   # other costs: simulated again


def test_rewrites_text_prints_the_auto_chunk_choice_and_its_neighbours():
    record = {"rewrite": "chunk", "pattern": "all_gather_matmul", "starts": ["ag"], "group": "0", "chunks": 4,
              "applied": True, "reason": "", "pieces": ["p0", "p1", "p2", "p3"], "fed_by": "",
              "estimates": [[1, 2.0], [2, 1.5], [4, 1.25], [8, 1.375]]}
    text = report.rewrites_text({"rewrites": [record], "collectives": 4})
    assert "split into 4: p0, p1, p2, p3; auto chose 4 of 1: 2.000ms, 2: 1.500ms, 4: 1.250ms, 8: 1.375ms" in text
    # a pipeline fed by another: the estimates are their chain's, and the line says so
    fed = {**record, "starts": ["ag_1", "rs_1"], "pieces": ["q0", "q1", "q2", "q3"], "fed_by": "rs"}
    feeder = {**record, "starts": ["ag", "rs"]}
    lines = report.rewrites_text({"rewrites": [feeder, fed], "collectives": 8}).splitlines()
    assert sum("; auto chose 4 for its chain of 1: 2.000ms" in line for line in lines) == 2, lines


def test_rewrites_text_names_identical_merges_and_where_a_pipeline_stops():
    records = [{"rewrite": "identical", "members": ["ag", "ag_1", "ag_2"]},
               {"rewrite": "chunk", "pattern": "all_gather_matmul", "starts": ["ag"], "group": "0", "chunks": 2,
                "applied": True, "reason": "compute between wait and rs is not pipelined: sum reduces over the rows",
                "pieces": ["p0", "p1"], "fed_by": "", "estimates": []}]
    text = report.rewrites_text({"rewrites": records, "collectives": 2})
    lines = text.splitlines()
    assert lines[0] == "collectives 3 -> 2: 2 identical merged away, 0 merged into 0 buckets, 1 pieces added by chunking"
    assert lines[1] == "identical ag = ag_1 = ag_2: one collective, ag"
    assert lines[2].endswith("split into 2: p0, p1; stops at its matmuls: compute between wait and rs is not "
                             "pipelined: sum reduces over the rows")


def consumer_order(a, w2):
    y = torch.mm(a, a)
    g1 = F.wait_tensor(F.all_gather_into_tensor(y[:1], 8, "0"))   # its input comes late, its consumer first
    z = torch.mm(y, g1)
    return torch.mm(z, F.wait_tensor(F.all_gather_into_tensor(w2, 8, "0")))   # ready at the top


def two_reduces_out(a, b):
    r1 = F.reduce_scatter_tensor(torch.mm(a, a), "sum", 8, "0")
    r2 = F.reduce_scatter_tensor(torch.mm(b, b), "sum", 8, "0")
    return F.wait_tensor(r1), F.wait_tensor(r2)


def reduce_into_barrier(a, x):
    r = F.reduce_scatter_tensor(torch.mm(a, a), "sum", 8, "0")
    y = torch.mm(a, a.t())
    x = torch.ops.aten.add_(x, F.wait_tensor(r))   # mutates an input: a barrier, nothing moves across it
    return torch.mm(x, y)


def chained(group):
    def fn(a):
        r = F.wait_tensor(F.reduce_scatter_tensor(torch.mm(a, a), "sum", 8, "0"))
        y = torch.mm(a, a.t())
        s = F.wait_tensor(F.all_reduce(r, "sum", group))   # reads the reduce-scatter's result
        return torch.mm(s, y)
    return fn


def reduce_under_a_peak(x, w):
    """A reduce-scatter whose input, held in flight, would raise the peak the temporary sets."""
    shard = F.reduce_scatter_tensor(torch.tanh(x @ w), "sum", 8, "0")
    return x + x.repeat(64, 1).sum(0), F.wait_tensor(shard)


def pinned_ahead(x, w, scratch):
    """A reduce-scatter ready at the top and due after another one starts that stays where it
    is (its start and wait on two sides of an in-place write)."""
    early = F.reduce_scatter_tensor(x @ w, "sum", 8, "0")
    pinned = F.reduce_scatter_tensor(torch.tanh(x @ w), "sum", 8, "0")
    due = F.wait_tensor(early) + 1
    scratch.add_(1)
    return due, F.wait_tensor(pinned)


def test_each_recorded_reason_arises_and_the_rows_show_it(fake_pg, two_groups):
    from overlapc.passes import sink_waits
    from overlapc.passes.scheduler import REASONS

    gather_bytes = 8 * 8 * 4 + 8 * 4   # an all-gather holds its output and its input
    cases = [  # (graph, shapes, how it is scheduled, reasons its rows must show)
        (three_layers, [(8, 8), (1, 8), (1, 8), (1, 8)], {"max_in_flight": 1},
         {"count bound", "before consumer"}),
        (three_layers, [(8, 8), (1, 8), (1, 8), (1, 8)], {"max_in_flight": None, "max_in_flight_bytes": gather_bytes},
         {"byte budget"}),
        (three_layers, [(8, 8), (1, 8), (1, 8), (1, 8)], {"max_in_flight": None, "max_in_flight_bytes": 1},
         {"forced by consumer"}),
        (consumer_order, [(8, 8), (1, 8)], {"max_in_flight": None}, {"consumer order"}),
        (two_reduces_out, [(8, 8), (8, 8)], {"max_in_flight": 1},
         {"inputs ready", "early for room", "before output"}),
        (reduce_into_barrier, [(8, 8), (1, 8)], {}, {"before barrier"}),
        (chained(two_groups[0].group_name), [(8, 8)], {}, {"chain point", "before chained start"}),
        (three_layers, [(8, 8), (1, 8), (1, 8), (1, 8)], "sink", {"not moved"}),
        (reduce_under_a_peak, [(16, 16), (16, 16)], {"max_in_flight_bytes": "serial-peak"}, {"no headroom"}),
        (pinned_ahead, [(8, 8), (8, 8), (1, 8)], {"max_in_flight": 1}, {"pinned ahead"}),
        (three_layers, [(8, 8), (1, 8), (1, 8), (1, 8)], {"max_in_flight": None, "issue": "per-kernel"},
         {"kernel point"}),
    ]
    seen = set()
    for fn, shapes, how, expected in cases:
        gm = make_fx(fn)(*(torch.randn(s) for s in shapes))
        before = [n.name for n in gm.graph.nodes]
        if how == "sink":
            sink_waits(gm)
        else:
            overlapc.schedule(gm, overlapc.OverlapConfig(**{"max_in_flight_bytes": None, "bucket": None, **how},
                                                         on_error="raise"))
        rows = report.rows(gm, before)
        shown = {r.issue_reason for r in rows} | {r.wait_reason for r in rows}
        assert expected <= shown, (fn.__name__, how, shown)
        table = report.format_table(rows)
        assert all(f"{r.issue_reason}; {r.wait_reason}" in table for r in rows if r.issue_reason and r.wait_reason)
        seen |= shown
    # every reason the scheduler records, but "serial" (the serial reference order the
    # memory headroom is measured on; never the order a graph is given) and "kept serial"
    # (a schedule that degraded: tests/test_degrade.py injects the failure and reads it)
    assert seen - {""} == set(REASONS) - {"serial", "kept serial"}


def test_compact_table_fits_its_width_and_keeps_every_row(fake_pg):
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=1)
    long = "blocks.0.a_rather_long_module_name.with_a_deep_path.that_no_terminal_wants_in_full"
    start = next(n for n in gm.graph.nodes if n.name == "all_gather_into_tensor_1")
    start.meta["nn_module_stack"] = {"L__self__": ("", torch.nn.Module), "L__self___x": (long, torch.nn.Linear)}
    rows, s = report.rows(gm, before, **LAYER_COSTS), report.summary(gm, before, **LAYER_COSTS)
    for width in (120, 100):
        table = report.format_compact(rows, width).splitlines()
        assert max(len(line) for line in table) <= width, table
        assert table[0].split() == ["collective", "kind", "group", "bytes", "issued", "at", "exposed", "ms",
                                    "why", "module"]
        assert [line.split()[0] for line in table[1:]] == [r.name for r in rows]   # names are never cut
        assert ".." in table[2] and table[2].rstrip().endswith(long[-2:])   # the module lost its middle
        assert width == 100 or table[2].rstrip().endswith(long[-10:])
    wide = report.format_table(rows)
    assert long in wide and max(len(line) for line in wide.splitlines()) > 120   # --wide: today's table, whole
    row = rows[1]
    assert f"{row.issue_before}->{row.issue_after}" in table[2] and "AG" in table[2].split()
    assert report.compact_why(row) == "in-flight limit" and "in-flight limit" in table[2]
    hidden = next(r for r in rows if r.verdict == "hidden")
    assert report.compact_why(hidden).startswith("hidden")


def test_graph_text_compact_quiet_and_wide(fake_pg):
    gm, before = scheduled(three_layers, (8, 8), (1, 8), (1, 8), (1, 8), max_in_flight=1)
    rows, s = report.rows(gm, before, **LAYER_COSTS), report.summary(gm, before, **LAYER_COSTS)
    compact = report.format_graph("fw_0", rows, s)
    quiet = report.format_graph("fw_0", rows, s, quiet=True)
    wide = report.format_graph("fw_0", rows, s, wide=True)
    assert wide == report.format_graph_wide("fw_0", rows, s) and "verdict" in wide and "placed" in wide
    assert compact.startswith(quiet) and "issued at" not in quiet and all(r.name not in quiet for r in rows)
    assert all(r.name in compact for r in rows)
    assert quiet.splitlines()[0] == "fw_0: 3 collectives (h100, nvlink); moved 3; hidden 0 -> 1 by estimate " \
        "with h100:nvlink"
    assert max(len(line) for line in compact.splitlines()) <= report.WIDTH


def test_summary_names_its_profile():
    base = {"moved": 1, "collectives": 2, "hidden_before": 0, "hidden_after": 1, "exposed_ms_before": 2.0,
            "exposed_ms_after": 1.0, "device": "cpu", "link": "ethernet"}
    assert "by estimate with cpu:ethernet (" in report.summary_line({**base, "profile": "cpu:ethernet"})
    assert "by estimate with profile.json (calibrated) (" in report.summary_line(
        {**base, "profile": "/tmp/run/profile.json"})
    assert "by estimate with cpu/ethernet (" in report.summary_line({**base, "profile": ""})


def test_bucket_lines_group_members_by_module():
    assert report.grouped_modules(["blocks.0.norm1", "blocks.0.norm1", "blocks.0.self_attn",
                                   "blocks.0.self_attn", "blocks.0.linear1"]) == \
        "blocks.0.{norm1 x2, self_attn x2, linear1}"
    assert report.grouped_modules(["layers.1.attention.v", "layers.1.attention.k", "layers.1.attention_norm"]) \
        == "layers.1.{attention.{v, k}, attention_norm}"
    assert report.grouped_modules(["embed", "", "norm"]) == "embed, ?, norm"
    bucket = {"rewrite": "bucket", "start": "all_gather_bucket", "kind": "all_gather", "group": "0", "nbytes": 2048,
              "members": ["ag", "ag_1", "ag_2"], "modules": ["blocks.0.norm", "blocks.0.norm", "blocks.0.up"]}
    summary = {"rewrites": [bucket], "collectives": 1}
    assert report.rewrites_text(summary, compact=True).splitlines()[1] == \
        "bucket all_gather_bucket (AG, 2.0KiB, 3 members): blocks.0.{norm x2, up}"
    assert report.rewrites_text(summary).splitlines()[1] == \
        "bucket all_gather_bucket (all_gather, group 0, 2.0KiB): blocks.0.norm, blocks.0.norm, blocks.0.up"


GLOO_RUN = """
import logging, os, sys, tempfile
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as F

dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"), rank=0,
                        world_size=1)
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")

def step(x, w1, w2):
    a = torch.mm(x, F.all_gather_tensor(w1, 0, dist.group.WORLD))
    return torch.mm(a.relu(), F.all_gather_tensor(w2, 0, dist.group.WORLD)).sum()

weights = [torch.randn(16, 16, requires_grad=True) for _ in range(2)]
torch.compile(step, backend="overlapc", options={"inner": "aot_eager"})(torch.randn(16, 16), *weights).backward()
dist.destroy_process_group()
"""


def test_a_cpu_gloo_run_estimates_with_the_cpu_profile_and_says_so():
    """No profile given, CPU tensors over gloo: the INFO lines use (and name) the CPU
    profile, not the H100 one (which would call every collective exposed there)."""
    done = subprocess.run([sys.executable, "-c", GLOO_RUN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("overlapc: ")]
    assert any("compiling graph" in line and "profile='cpu:ethernet'" in line for line in lines), lines
    summaries = [line for line in lines if " by estimate " in line]
    assert len(summaries) == 2 and all("by estimate with cpu:ethernet (" in line for line in summaries), lines
    assert costmodel.default_for("cpu", "gloo") == costmodel.CPU_DEFAULT == "cpu:ethernet"
    assert costmodel.default_for("cuda", "nccl") == costmodel.default_for("cuda", "gloo") == costmodel.DEFAULT


def gathered_in_reverse(x, w0, w1, w2):
    """Every all-gather issued up front, the last layer's first (lightning-thunder #277)."""
    started = [F.all_gather_into_tensor(w, 8, "0") for w in (w2, w1, w0)][::-1]
    for full in [F.wait_tensor(s) for s in started]:
        x = torch.relu(torch.mm(x, full.t()))
    return x


def test_the_report_from_the_schedules_structure_equals_one_built_on_the_scheduled_graph(fake_pg, two_groups,
                                                                                            monkeypatch, caplog):
    """overlapc.schedule builds one Structure per graph (the one the core schedules with,
    in the order before) and the report reads it with the scheduled positions: the same
    rows and summary as a report that builds its own Structure on the scheduled graph."""
    import logging

    from overlapc import api
    from overlapc.passes import structure
    built = []
    real_init = structure.Structure.__init__

    def counting(self, gm):
        built.append(gm)
        real_init(self, gm)
    monkeypatch.setattr(structure.Structure, "__init__", counting)
    layers = [(8, 8), (1, 8), (1, 8), (1, 8)]
    cases = [(three_layers, layers, {"max_in_flight": 1}), (three_layers, layers, {"max_in_flight": None}),
             (three_layers, layers, {"max_in_flight_bytes": 8 * 8 * 4 + 8 * 4}),
             (three_layers, layers, {"bucket": "auto", "max_in_flight_bytes": "auto"}),
             (consumer_order, [(8, 8), (1, 8)], {}), (two_reduces_out, [(8, 8), (8, 8)], {"max_in_flight": 1}),
             (reduce_into_barrier, [(8, 8), (1, 8)], {}), (chained(two_groups[0].group_name), [(8, 8)], {}),
             (gathered_in_reverse, [(4, 16), (2, 16), (2, 16), (2, 16)], {"max_in_flight": 1})]
    for fn, shapes, options in cases:
        gm = make_fx(fn)(*(torch.randn(s) for s in shapes))
        cfg = overlapc.OverlapConfig(**{"max_in_flight_bytes": None, "bucket": None, **options}, on_error="raise",
                                     profile="cpu:ethernet")   # slow enough that rows are exposed
        built.clear()
        with caplog.at_level(logging.INFO, logger="overlapc"):
            done = api.schedule_graph(gm, cfg, report=True)
        assert done.result.collectives and len(built) == 1 + bool(done.result.buckets), (fn.__name__, options)
        assert done.result.structure is not None and done.result.structure.gm is gm
        assert any("moved" in r.getMessage() for r in caplog.records)   # the INFO line, from the same report
        caplog.clear()
        fresh = report._study(gm, list(done.result.before), costmodel.resolve(cfg.profile), None, None)
        assert built[-1] is gm and (done.rows, done.summary) == fresh, (fn.__name__, options)

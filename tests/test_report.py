"""Report rows, verdicts (one graph per reason) and the summary, with exact costs set per node."""
import dataclasses
import json

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import overlapc
from overlapc import costmodel, report

F = torch.ops._c10d_functional


def costs(compute=None, comm=None):
    """compute_ms / comm_ms callables from {node name: ms} and {start name: ms}; others cost 0."""
    compute, comm = compute or {}, comm or {}
    return {"compute_ms": lambda n: compute.get(n.name, 0.0),
            "comm_ms": lambda c: comm.get(c.start.name, 0.0)}


def scheduled(fn, *shapes, max_in_flight=2):
    """Trace ``fn``, record the order, schedule; return (gm after, names before)."""
    gm = make_fx(fn)(*(torch.randn(s) for s in shapes))
    before = [n.name for n in gm.graph.nodes]
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=max_in_flight, on_error="raise"))
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
    assert [(r.issue_before, r.issue_after, r.wait_before, r.wait_after) for r in rows] == [
        (5, 2, 6, 6), (8, 7, 9, 9), (11, 10, 12, 12)]
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
    assert s["peak_in_flight_bytes_before"] == s["peak_in_flight_bytes_after"] == 8 * 8 * 4
    assert report.summary_line(s) == "moved 3 of 3 collectives; hidden 1 of 3 by estimate (exposed 12.0 -> 6.0 ms)"


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
    assert lines[2].split()[:3] == ["collective", "kind", "group"]
    assert "exposed (in-flight limit)" in lines[4] and "layers.1" in lines[4]
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

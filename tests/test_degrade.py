"""Local degradation: a collective whose overlapped placement breaks a guarantee is placed
serially, alone, while the rest of the graph keeps its schedule; the WARNING names it.

The failure is injected (``pipeline._check`` wrapped to reject any order in which the
victim's window holds compute) so that the test controls which collective fails; the
windows are read off the order here, independently of the scheduler's reasons."""
import logging

import pytest
import torch

import overlapc
from overlapc.passes import invariants, pipeline
from overlapc.passes.invariants import ScheduleError
from overlapc.passes.memory import Liveness
from overlapc.passes.structure import Structure
from graphs import F, trace

AUTO = overlapc.OverlapConfig(max_in_flight_bytes="auto", on_error="raise")
pytestmark = pytest.mark.degrades


def three_reductions(x, w):
    """Three all-reduces, each followed by independent compute it can hide behind."""
    outs = []
    for _ in range(3):
        x = torch.relu(x @ w)
        outs.append(F.all_reduce(x, "sum", "0"))
    y = x
    for _ in range(3):
        y = torch.tanh(y @ w)
    return y + sum(F.wait_tensor(o) for o in outs)


def windows(gm) -> dict[str, int]:
    """Compute nodes (not collectives, waits, placeholders, output) between each
    all-reduce and its wait, by all-reduce name."""
    nodes = list(gm.graph.nodes)
    result = {}
    for index, node in enumerate(nodes):
        if node.target is not F.all_reduce.default:
            continue
        wait = next(iter(node.users))
        between = nodes[index + 1:nodes.index(wait)]
        result[node.name] = sum(1 for n in between if n.op == "call_function"
                                and n.target not in (F.all_reduce.default, F.wait_tensor.default))
    return result


@pytest.fixture
def reject(monkeypatch):
    """Make the check reject orders in which collective ``name`` overlaps compute,
    as a memory error would: at a node inside its window, at that position."""
    def install(name):
        check = pipeline._check

        def rejecting(s, order, budget):
            start = next(n for n in order if n.name == name)
            wait = next(iter(start.users))
            first, last = order.index(start), order.index(wait)
            inside = [i for i in range(first + 1, last) if order[i] in s.nodes and order[i].op == "call_function"
                      and order[i].target not in (F.all_reduce.default, F.wait_tensor.default)]
            if inside:
                raise ScheduleError("injected: window holds compute", node=order[inside[0]], position=inside[0])
            return check(s, order, budget)
        monkeypatch.setattr(pipeline, "_check", rejecting)
    return install


def test_a_failing_collective_is_placed_serially_and_the_rest_keeps_its_overlap(fake_pg, reject, caplog):
    gm = trace(three_reductions, (8, 8), (8, 8))
    free = windows(overlapc.schedule(trace(three_reductions, (8, 8), (8, 8)), AUTO))
    victim = "all_reduce_1"
    assert free[victim] > 0 and sum(free.values()) > free[victim]   # the graph overlaps without the failure
    reject(victim)
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        result = overlapc.passes.pipeline.run(gm, AUTO)
    assert result.error is None
    got = windows(gm)
    assert got[victim] == 0
    assert any(got[name] > 0 for name in got if name != victim), got
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and victim in warnings[0] and "placed serially" in warnings[0]
    assert "injected" in warnings[0]
    assert dict(result.reasons)[victim] == "kept serial"


def test_a_failure_that_names_no_collective_sends_the_graph_serial_with_a_warning(fake_pg, monkeypatch, caplog):
    gm = trace(three_reductions, (8, 8), (8, 8))
    check = pipeline._check

    def broken(s, order, budget):
        if order != pipeline.invariants.serial_order(s):
            raise ScheduleError("injected: names no node")
        return check(s, order, budget)
    monkeypatch.setattr(pipeline, "_check", broken)
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        overlapc.passes.pipeline.run(gm, AUTO)
    assert all(count == 0 for count in windows(gm).values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "serial order" in warnings[0] and "injected" in warnings[0]


def test_a_failing_rewrite_is_dropped_and_the_graph_still_scheduled(fake_pg, monkeypatch, caplog):
    from overlapc.passes import bucket

    def broken(*args, **kwargs):
        raise RuntimeError("injected: bucketing broke")
    monkeypatch.setattr(bucket, "bucket_collectives", broken)
    gm = trace(three_reductions, (8, 8), (8, 8))
    config = overlapc.OverlapConfig(max_in_flight_bytes="auto", bucket="auto", on_error="raise")
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        result = overlapc.passes.pipeline.run(gm, config)
    assert result.error is None and result.buckets == ()
    assert sum(windows(gm).values()) > 0   # scheduled, with overlap
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "injected: bucketing broke" in warnings[0] and "bucket=None" in warnings[0]


def test_a_failure_names_an_all_gather_issued_early_whose_result_is_still_live(fake_pg, two_groups):
    """A memory failure at a node where an all-gather, moved ahead of that node and already
    waited, still holds its result for a later reader: the collectives the degrade step
    places serially include that all-gather (naming only those in flight there found
    nothing new, and the whole graph went serial), and the all-gather upstream of the
    reduce-scatter (a chain). The order is the one the core built for this graph before its
    chain points were issued on an early wait (test_serial_peak)."""
    import test_chain_properties as chain_props
    from test_serial_peak import KNOWN_WHOLE_GRAPH_FALLBACK as p
    from overlapc.passes.structure import Structure

    groups = (fake_pg.group_name, two_groups[0].group_name, two_groups[1].group_name)
    gm = trace(chain_props.build(p, groups), *chain_props.shapes_for(p))
    s = Structure(gm)
    by_name = {n.name: n for n in s.nodes}
    early = ["all_gather_into_tensor", "wait_tensor", "all_gather_into_tensor_1", "wait_tensor_1",
             "all_gather_into_tensor_2", "wait_tensor_3", "slice_1", "reduce_scatter_tensor", "wait_tensor_2"]
    head = [n for n in s.nodes if n.op == "placeholder"]
    order = head + [by_name[name] for name in early] + [n for n in s.nodes if n not in head and n.name not in early]
    position = order.index(by_name["reduce_scatter_tensor"])
    error = ScheduleError("injected: peak exceeded", node=by_name["reduce_scatter_tensor"], position=position)
    named = [c.start.name for c in pipeline._culprits(s, pipeline._Failed(error, order))]
    assert named == ["all_gather_into_tensor_1", "reduce_scatter_tensor", "all_gather_into_tensor_2"]


def test_a_failing_chain_names_its_upstream_and_degrades_locally(fake_pg, caplog):
    """An all-gather whose result two chained all-reduces carry on, and an add reads last,
    under max_in_flight=1 and "serial-peak" (found by random DAGs): the failures name the
    all-reduces, and placed serially they still went before the add while the all-gather was
    due there. Now a failure names a chain's upstream too, the all-gather placed serially
    lets its readers go after the node it is due at (as the serial order has them), and the
    rest stays scheduled: one WARNING of collectives placed serially, not the whole graph."""
    def fn(x, y):
        gathered = F.wait_tensor(F.all_gather_into_tensor(x[:4], 8, "0"))
        reduced = F.wait_tensor(F.all_reduce(y, "sum", "0"))
        twice = F.wait_tensor(F.all_reduce(F.wait_tensor(F.all_reduce(gathered, "sum", "0")), "sum", "0"))
        return reduced, twice, x + gathered
    gm = trace(fn, (32, 32), (32, 32))
    config = overlapc.OverlapConfig(max_in_flight=1, on_error="raise")
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        overlapc.schedule(gm, config)
    overlapc.verify(gm, config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "placed serially" in warnings[0], warnings
    assert "runs in its serial order" not in warnings[0], warnings


def test_the_whole_graph_fallback_keeps_the_serial_peak_its_budget_is_bound_by(fake_pg, monkeypatch, caplog):
    """Under "serial-peak" the bound is the lower-peaked of two serial orders (other
    collectives issued where they stand, or as soon as their inputs allow). In this graph
    (a random DAG of benchmarks/random_dags.py) the second peaks lower (16,896 B against
    20,480), so the whole-graph fallback must run that one: with the first it broke the bound
    it falls back to, and schedule raised a ScheduleError instead of degrading."""
    from test_inductor_windows import graph_of
    steps = [["all_gather", 1, 0], ["all_reduce", 0, 2], ["all_reduce", 3, 2], ["all_reduce", 2, 3], ["add", 0, 2],
             ["mm", 2, 5], ["relu", 5, 7], ["reduce_scatter", 0, 6], ["all_gather", 5, 8]]
    gm = graph_of(steps)
    config = overlapc.OverlapConfig(max_in_flight=2, on_error="raise")
    s = Structure(gm)
    own, asap = invariants.serial_order(s), invariants.serial_order(s, asap=True)
    liveness = Liveness(s.nodes)
    assert liveness.peak_bytes(asap) < liveness.peak_bytes(own)   # what the test is about

    def failing(s, budget, kinds, mode="schedule", **core):
        raise pipeline._Failed(ScheduleError("injected: every schedule fails"), None)
    monkeypatch.setattr(pipeline, "_attempt", failing)
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        overlapc.schedule(gm, config)
    overlapc.verify(gm, config)
    assert liveness.peak_bytes(list(gm.graph.nodes)) == liveness.peak_bytes(asap)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "runs in its serial order" in warnings[0] and "injected" in warnings[0]


def test_the_whole_graph_fallback_under_no_byte_limit_is_checked_against_the_serial_order(fake_pg, caplog):
    """A random DAG (2026-11-30) whose all-gather sends a slice of a matmul's result: held in
    flight it counts the slice's bytes, not the result's (README, known issues), so every
    overlapped schedule broke the bound against the order handed in, and so did the serial
    fallback, which issues that all-gather when its result is due and keeps the result live
    until then: schedule raised under on_error="raise". The fallback is held to its own
    reference, the serial order (guarantee 4): the graph degrades, with a WARNING."""
    from test_inductor_windows import graph_of
    steps = [["all_gather", 0, 0], ["mm", 0, 0], ["all_gather", 1, 2], ["mm", 0, 0], ["mm", 0, 0], ["relu", 0, 4]]
    gm = graph_of(steps)
    config = overlapc.OverlapConfig(max_in_flight=1, max_in_flight_bytes=None, on_error="raise")
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        overlapc.schedule(gm, config)
    overlapc.verify(gm, config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "runs in its serial order" in warnings[0], warnings

"""Concrete schedules on small graphs: each test states the exact order expected."""
import logging
import re
import os
import subprocess
import sys

import pytest
import torch

import overlapc
from overlapc.passes import limit_in_flight, reorder_all_gathers, sink_waits
from graphs import F, ag, body, trace, wait

# The exact orders below are the core's under the "auto" byte budget (twice the largest
# collective, more under the headroom); these graphs' serial peaks leave the default,
# "serial-peak", little room to overlap. tests/test_memory.py and test_serial_peak.py
# check the default.
STRICT = overlapc.OverlapConfig(max_in_flight_bytes="auto", on_error="raise")


def thunder(x, w0, w1, w2, w3):
    """lightning-thunder #277: every all-gather issued up front, in reverse order."""
    ws = (w0, w1, w2, w3)
    started = [ag(w) for w in reversed(ws)][::-1]
    gathered = [wait(s) for s in reversed(started)][::-1]
    for full in gathered:
        x = torch.relu(x @ full.t())
    return x


def test_thunder_shape_is_issued_in_consumer_order_two_in_flight(fake_pg):
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    assert body(gm)[:4] == ["all_gather_into_tensor", "all_gather_into_tensor_1",
                            "all_gather_into_tensor_2", "all_gather_into_tensor_3"]
    overlapc.schedule(gm, STRICT)
    # all_gather_into_tensor_3 gathers w0 (the first layer's weight).
    assert body(gm) == [
        "all_gather_into_tensor_3", "all_gather_into_tensor_2", "wait_tensor_3", "t",
        "all_gather_into_tensor_1", "mm", "relu",
        "wait_tensor_2", "t_1", "all_gather_into_tensor", "mm_1", "relu_1",
        "wait_tensor_1", "t_2", "mm_2", "relu_2",
        "wait_tensor", "t_3", "mm_3", "relu_3"]
    overlapc.verify(gm, STRICT)


def test_thunder_shape_unlimited_issues_everything_first_in_order(fake_pg):
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=None, max_in_flight_bytes=None,
                                                 on_error="raise"))
    assert body(gm)[:5] == ["all_gather_into_tensor_3", "all_gather_into_tensor_2",
                            "all_gather_into_tensor_1", "all_gather_into_tensor", "wait_tensor_3"]


def mixed_precision(x, w0, w1, w2):
    for w in (w0, w1, w2):
        full = wait(ag(w.to(torch.bfloat16)))
        x = torch.relu(x @ full.float().t())
    return x


def test_mixed_precision_casts_travel_with_their_all_gathers(fake_pg):
    gm = trace(mixed_precision, (4, 16), *[(2, 16)] * 3)
    overlapc.schedule(gm, STRICT)
    assert body(gm) == [
        "_to_copy", "all_gather_into_tensor", "_to_copy_2", "all_gather_into_tensor_1",
        "wait_tensor", "_to_copy_4", "all_gather_into_tensor_2",
        "_to_copy_1", "t", "mm", "relu",
        "wait_tensor_1", "_to_copy_3", "t_1", "mm_1", "relu_1",
        "wait_tensor_2", "_to_copy_5", "t_2", "mm_2", "relu_2"]


def gathered_output(x, w0, w1):
    a = wait(ag(w0))
    b = wait(ag(w1))
    return x @ a.t(), b


def test_all_gather_returned_as_output_is_waited_just_before_output(fake_pg):
    gm = trace(gathered_output, (4, 16), (2, 16), (2, 16))
    overlapc.schedule(gm, STRICT)
    assert body(gm) == ["all_gather_into_tensor", "all_gather_into_tensor_1",
                        "wait_tensor", "t", "mm", "wait_tensor_1"]
    assert list(gm.graph.nodes)[-2].name == "wait_tensor_1"


def two_groups_fn(other_group):
    def fn(x, w0, w1, v0, v1):
        for w, v in ((w0, v0), (w1, v1)):
            x = torch.relu(x @ wait(ag(w, "0")).t())
            x = torch.relu(x @ wait(ag(v, other_group)).t())
        return x
    return fn


def test_two_process_groups_are_bounded_separately(fake_pg, two_groups):
    other = two_groups[0].group_name
    assert other != "0"
    gm = trace(two_groups_fn(other), (4, 16), *[(2, 16)] * 4)
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=1, max_in_flight_bytes="auto", on_error="raise"))
    assert body(gm) == [
        "all_gather_into_tensor", "all_gather_into_tensor_1", "wait_tensor", "t",
        "all_gather_into_tensor_2", "mm", "relu",
        "wait_tensor_1", "t_1", "all_gather_into_tensor_3", "mm_1", "relu_1",
        "wait_tensor_2", "t_2", "mm_2", "relu_2",
        "wait_tensor_3", "t_3", "mm_3", "relu_3"]
    assert [c.group for c in overlapc.collectives(gm)] == ["0", other, "0", other]


def all_kinds(x, w0):
    full = wait(ag(w0))
    y = x @ full.t()
    r = F.reduce_scatter_tensor(y, "sum", 8, "0")
    a = F.all_reduce(y, "sum", "0")
    z = torch.relu(y)
    t = F.all_to_all_single(z, [2] * 8, [2] * 8, "0")
    return wait(r), wait(a) + 1, wait(t) * 2


def test_reduce_scatter_all_reduce_all_to_all_issue_early_and_wait_late(fake_pg):
    gm = trace(all_kinds, (16, 16), (2, 16))
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight_bytes=None, on_error="raise"))
    assert body(gm) == [
        "all_gather_into_tensor", "wait_tensor", "t", "mm",
        "reduce_scatter_tensor", "all_reduce", "relu", "all_to_all_single",
        "wait_tensor_2", "add", "wait_tensor_3", "mul", "wait_tensor_1"]
    kinds = [c.kind for c in overlapc.collectives(gm)]
    assert kinds == ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


def test_a_collective_over_the_byte_budget_waits_the_oldest_open_one_first(fake_pg):
    # The auto budget is twice the largest held bytes: the all-gather's 1 KiB output
    # plus its 128 B input, 2304 bytes. The reduce-scatter and all-reduce hold their
    # 1 KiB inputs; the all-to-all's 1 KiB would exceed it, so the reduce-scatter,
    # oldest, is waited before the all-to-all is issued.
    gm = trace(all_kinds, (16, 16), (2, 16))
    overlapc.schedule(gm, STRICT)
    assert body(gm) == [
        "all_gather_into_tensor", "wait_tensor", "t", "mm",
        "reduce_scatter_tensor", "all_reduce", "relu", "wait_tensor_1", "all_to_all_single",
        "wait_tensor_2", "add", "wait_tensor_3", "mul"]
    assert overlapc.verify(gm, STRICT).peak_in_flight_bytes == 2048


def through_views(x, w0, w1):
    for w in (w0, w1):
        full = wait(ag(w)).view(16, 16).t()
        x = torch.tanh(x)
        x = x @ full
    return x


def test_wait_consumed_through_views_moves_with_its_views(fake_pg):
    gm = trace(through_views, (4, 16), (2, 16), (2, 16))
    overlapc.schedule(gm, STRICT)
    assert body(gm) == [
        "all_gather_into_tensor", "all_gather_into_tensor_1", "tanh",
        "wait_tensor", "view", "t", "mm", "tanh_1",
        "wait_tensor_1", "view_1", "t_1", "mm_1"]
    rows = overlapc.collectives(gm)
    assert [r.first_consumer for r in rows] == [body(gm).index("mm") + 3, body(gm).index("mm_1") + 3]


def with_barrier(x, w0, w1, w2):
    a = ag(w0)
    y = torch.relu(x) @ wait(a).t()
    torch.ops.aten.add_(x, 1)            # writes into a graph input: a barrier
    x = torch.tanh(y)
    b = ag(w1)                            # may not rise above the barrier
    x = x @ wait(b).t()
    return x @ wait(ag(w2)).t()


def test_nothing_moves_across_a_barrier(fake_pg):
    gm = trace(with_barrier, (4, 16), (2, 16), (2, 16), (2, 16))
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=None, max_in_flight_bytes="auto", on_error="raise"))
    assert body(gm) == [
        "all_gather_into_tensor", "relu", "wait_tensor", "t", "mm", "add_",
        "all_gather_into_tensor_1", "all_gather_into_tensor_2", "tanh",
        "wait_tensor_1", "t_1", "mm_1", "wait_tensor_2", "t_2", "mm_2"]


def coalesced(x, w0, w1, w2):
    outs = F.all_gather_into_tensor_coalesced([w0, w1], 8, "0")
    a, b = wait(outs[0]), wait(outs[1])
    x = torch.relu(x)
    x = x @ a.t() + b.sum()
    return x @ wait(ag(w2)).t()


def test_coalesced_all_gather_holds_its_slot_until_its_last_wait(fake_pg):
    gm = trace(coalesced, (4, 16), (2, 16), (2, 16), (2, 16))
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=1, max_in_flight_bytes="auto", on_error="raise"))
    assert body(gm) == [
        "all_gather_into_tensor_coalesced", "getitem", "getitem_1", "relu",
        "wait_tensor", "t", "mm", "wait_tensor_1", "all_gather_into_tensor",
        "sum_1", "add", "wait_tensor_2", "t_1", "mm_1"]
    (first, second) = overlapc.collectives(gm)
    assert first.op == "all_gather_into_tensor_coalesced" and len(first.waits) == 2
    assert first.nbytes == 2 * 16 * 16 * 4


def test_an_all_gather_read_through_two_waits_is_scheduled(fake_pg, caplog):
    """One all-gather waited twice, its start also a graph output: what Inductor makes of
    two gathers of one weight that a block applied twice reads (its CSE merges them), in
    the partitioned forward. The first wait completes it, so the second may come with it
    or later. Before, every wait had to stand just before its own first consumer; the
    serial fallback, which places a collective's waits together, broke that too, and the
    graph was left unscheduled."""
    def fn(shard, shard2, x):
        gathered = F.all_gather_into_tensor(shard, 8, "0")
        y = torch.relu(x * F.wait_tensor(gathered))
        y = y @ wait(ag(shard2)).view(16, 16)
        return torch.relu(y * F.wait_tensor(F.all_gather_into_tensor(shard, 8, "0"))), gathered
    gm = trace(fn, (2,), (32,), (4, 16))
    starts = [n for n in gm.graph.nodes if n.target == F.all_gather_into_tensor.default]
    starts[2].replace_all_uses_with(starts[0])   # the third gather is the first one again, waited a second time
    gm.graph.erase_node(starts[2])
    gm.graph.lint()
    gm.recompile()
    config = overlapc.OverlapConfig(on_error="raise")
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        overlapc.schedule(gm, config)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    overlapc.verify(gm, config)


def chained_waits(bias, weight, x):
    """A wait of a wait (a pass that re-waits a result) and a second wait of one gather
    (AOTAutograd's CSE of a parameter gathered at each of two reads), around a matmul."""
    gathered = ag(bias)
    b = wait(gathered)
    y = x @ x
    again = wait(gathered).view(4, 4)
    return y + wait(b).view(4, 4) + again + wait(ag(weight)).view(4, 4), b.sum()


@pytest.mark.parametrize("run", ["schedule", "no buckets", "no limits", "one in flight",
                                 "reorder_all_gathers", "limit_in_flight", "sink_waits"])
def test_waits_of_waits_and_repeated_waits_are_made_one_and_schedule_without_degrading(fake_pg, caplog, run):
    """Before, a wait of a wait counted as the gather's first consumer in the check but not in
    the core, and both gathers were placed serially ("consumer order broken")."""
    gm = trace(chained_waits, (2,), (2,), (4, 4))
    assert sum(n.target == F.wait_tensor.default for n in gm.graph.nodes) == 4
    options = {"schedule": {}, "no buckets": {"bucket": None},
               "no limits": {"bucket": None, "max_in_flight": None, "max_in_flight_bytes": None},
               "one in flight": {"bucket": None, "max_in_flight": 1}}
    with caplog.at_level(logging.INFO, logger="overlapc"):
        if run in options:
            config = overlapc.OverlapConfig(**options[run], on_error="raise")
            overlapc.schedule(gm, config)
            overlapc.verify(gm, config)
        else:
            {"reorder_all_gathers": reorder_all_gathers, "limit_in_flight": limit_in_flight,
             "sink_waits": sink_waits}[run](gm)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "made 2 repeated waits one" in caplog.text
    waits = [n for n in gm.graph.nodes if n.target == F.wait_tensor.default]
    assert len(waits) == 2 and all(w.args[0].target == F.all_gather_into_tensor.default for w in waits)
    assert run == "sink_waits" or any(n.target == torch.ops.aten.mm.default
                                      for n in gm.graph.nodes if waits[0].args[0] < n < waits[0])


@pytest.mark.parametrize("level", [logging.WARNING, logging.INFO])
def test_a_profile_that_does_not_resolve_fails_before_the_graph_changes(fake_pg, caplog, level):
    """At any log level (before, only the INFO line's report read the profile: it raised
    after the graph was reordered, and at WARNING the profile was never checked)."""
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    before = body(gm)
    with caplog.at_level(level, logger="overlapc"), pytest.raises(ValueError, match="unknown profile 'tpu:nvlink'"):
        overlapc.schedule(gm, overlapc.OverlapConfig(profile="tpu:nvlink"))
    assert body(gm) == before


def test_byte_limit_bounds_gathered_bytes(fake_pg):
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    one = 16 * 16 * 4 + 2 * 16 * 4     # held while in flight: gathered output and input shard
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=None, max_in_flight_bytes=3 * one,
                                                 on_error="raise"))
    assert body(gm)[:4] == ["all_gather_into_tensor_3", "all_gather_into_tensor_2",
                            "all_gather_into_tensor_1", "wait_tensor_3"]


def no_collectives(x, w):
    return torch.relu(x @ w.t())


def test_graph_without_collectives_comes_back_unchanged(fake_pg):
    gm = trace(no_collectives, (4, 16), (16, 16))
    code = gm.code
    assert overlapc.schedule(gm) is gm
    assert gm.code == code and overlapc.collectives(gm) == []


def test_passes_one_by_one_compose_to_the_same_schedule(fake_pg):
    gm = trace(mixed_precision, (4, 16), *[(2, 16)] * 3)
    reference = trace(mixed_precision, (4, 16), *[(2, 16)] * 3)
    overlapc.schedule(reference, STRICT)
    reorder_all_gathers(gm)
    limit_in_flight(gm, STRICT)
    sink_waits(gm)
    assert body(gm) == body(reference)
    overlapc.verify(gm, STRICT)


def test_sink_waits_alone_keeps_issue_order(fake_pg):
    gm = trace(through_views, (4, 16), (2, 16), (2, 16))
    sink_waits(gm)
    assert body(gm) == [
        "all_gather_into_tensor", "tanh", "wait_tensor", "view", "t", "mm",
        "all_gather_into_tensor_1", "tanh_1", "wait_tensor_1", "view_1", "t_1", "mm_1"]


def test_verify_names_the_wait_that_sits_too_early(fake_pg):
    gm = trace(through_views, (4, 16), (2, 16), (2, 16))
    with pytest.raises(overlapc.ScheduleError) as error:
        overlapc.verify(gm, STRICT)
    message = str(error.value)
    assert "wait_tensor" in message and "wait_tensor.default" in message and "group 0" in message
    assert "position 4" in message and "tanh" in message


@pytest.mark.degrades   # the failure it injects degrades the schedule before anything else
def test_failure_falls_back_with_a_warning_and_restores_the_order(fake_pg, monkeypatch):
    import overlapc.passes.pipeline as pipeline
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    original = body(gm)

    def broken(gm, *args, **kwargs):
        raise overlapc.ScheduleError("injected", node=next(iter(gm.graph.nodes)), group="0", position=0)

    monkeypatch.setattr(pipeline, "_run_passes", broken)
    with pytest.warns(UserWarning, match="unscheduled.*injected"):
        overlapc.schedule(gm)
    assert body(gm) == original
    with pytest.raises(overlapc.ScheduleError, match="injected"):
        overlapc.schedule(gm, STRICT)
    assert body(gm) == original


def test_bad_input_is_rejected_clearly(fake_pg):
    with pytest.raises(TypeError, match="GraphModule"):
        overlapc.schedule(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1"):
        overlapc.OverlapConfig(max_in_flight=0)
    with pytest.raises(ValueError, match="did you mean 'max_in_flight'"):
        overlapc.OverlapConfig.from_options({"max_inflight": 2})
    with pytest.raises(ValueError, match="on_error"):
        overlapc.OverlapConfig(on_error="ignore")
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    original = body(gm)
    with pytest.raises(ValueError):
        overlapc.schedule(gm, {"max_in_flight": 0})
    with pytest.raises(ValueError, match="did you mean"):
        overlapc.schedule(gm, {"max_in_fligth": 1})
    assert body(gm) == original


def test_options_beat_environment_beat_defaults():
    assert overlapc.OverlapConfig.from_options({}, env={"OVERLAPC_DISABLE": "1"}).enabled is False
    assert overlapc.OverlapConfig.from_options({"enabled": True}, env={"OVERLAPC_DISABLE": "1"}).enabled
    assert overlapc.OverlapConfig.from_options({}, env={}).max_in_flight == 3   # chosen by step_time


_SCHEDULE_IN_A_FRESH_PROCESS = """
import sys; sys.path.insert(0, {tests!r})
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
import overlapc, test_passes
from graphs import trace, body
other = dist.new_group(list(range(8))).group_name
gm = trace(test_passes.two_groups_fn(other), (4, 16), *[(2, 16)] * 4)
overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=1, on_error="raise"))
print(",".join(body(gm)))
"""


def test_same_order_whatever_the_hash_seed():
    script = _SCHEDULE_IN_A_FRESH_PROCESS.format(tests=os.path.dirname(__file__))
    orders = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        orders.add(done.stdout.strip())
    assert len(orders) == 1 and "all_gather_into_tensor" in orders.pop()


def test_debug_logs_one_line_per_collective(fake_pg, caplog):
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    with caplog.at_level(logging.DEBUG, logger="overlapc"):
        overlapc.schedule(gm)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    names = [c.start.name for c in overlapc.collectives(gm)]
    assert len(names) == 4 and len(lines) == 1 + len(names)      # a header, then one per collective
    assert "verdict" in lines[0]
    # "overlapc: <collective> ..." ("[rank R] <collective> ..." once the backend's log filter is in), in issue order
    assert [re.sub(r"^(overlapc: )?(\[rank \d+\] )?", "", line).split()[0] for line in lines[1:]] == names


def test_the_passes_return_one_result_and_log_no_report(fake_pg, caplog):
    """overlapc.passes.run: what was placed, the order before, the reasons recorded on
    the nodes, the Structure it scheduled with; no report line (the product logs it)."""
    from overlapc.passes import ScheduleResult, run
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    names = [n.name for n in gm.graph.nodes]
    with caplog.at_level(logging.DEBUG, logger="overlapc"):
        result = run(gm, STRICT)
    assert isinstance(result, ScheduleResult) and result.gm is gm and result.error is None
    assert (result.collectives, result.modified, result.before) == (4, True, tuple(names))
    assert result.peaks is not None and result.structure is not None and result.structure.nodes != list(gm.graph.nodes)
    assert dict(result.reasons) == {n.name: n.meta["overlapc_reason"] for n in gm.graph.nodes
                                    if "overlapc_reason" in n.meta} and len(result.reasons) == 8
    assert not [r for r in caplog.records if "moved" in r.getMessage()]
    again = trace(thunder, (4, 16), *[(2, 16)] * 4)
    assert overlapc.passes.schedule(again, STRICT) is again and body(again) == body(gm)


def test_chunks_auto_needs_an_estimator_below_overlapc_schedule(fake_pg):
    from overlapc.estimate import costmodel
    gm = trace(thunder, (4, 16), *[(2, 16)] * 4)
    original = body(gm)
    auto = overlapc.OverlapConfig(chunks="auto", on_error="raise")
    with pytest.raises(ValueError, match=r'chunks="auto".*estimator=.*overlapc\.schedule'):
        overlapc.passes.schedule(gm, auto)
    assert body(gm) == original
    overlapc.passes.schedule(gm, auto, estimator=costmodel.resolve(None))
    again = trace(thunder, (4, 16), *[(2, 16)] * 4)
    assert body(overlapc.schedule(again, auto)) == body(gm) != original


def _alias_uncached(node) -> bool:
    """is_alias as written before its per-target cache (the reference)."""
    import operator
    from overlapc.passes import collectives as c
    if node.op == "call_function":
        if node.target is operator.getitem:
            return True
        parts = c._target_parts(node.target)
        if parts is not None:
            return parts[0] == "aten" and parts[1] in c._ALIAS_PACKETS
        return getattr(node.target, "__name__", None) in c._ALIAS_METHODS and \
            getattr(node.target, "__module__", "") in ("torch", "torch.functional")
    return node.op == "call_method" and node.target in c._ALIAS_METHODS


def _cheap_uncached(node) -> bool:
    from overlapc.passes import collectives as c
    if _alias_uncached(node):
        return True
    if node.op == "call_function":
        parts = c._target_parts(node.target)
        return parts is not None and parts[0] in ("aten", "prims") and parts[1] in c._CAST_PACKETS
    return node.op == "call_method" and node.target in c._CAST_METHODS


def test_alias_and_cheap_cached_per_target_answer_as_the_rules(fake_pg):
    """is_alias / is_cheap cache what a call target decides; on aten graphs (make_fx) and
    on torch-function and method graphs (symbolic_trace), asked twice, every node gets the
    answer of the uncached rules."""
    from overlapc.passes.collectives import is_alias, is_cheap

    def f(x, w):
        parts = torch.split(x.t().contiguous(), 2)
        y = torch.flatten(parts[0]).view(2, -1).to(torch.bfloat16).float().clone()
        return torch.relu(y.sum() + w.reshape(-1)[0]), torch.transpose(x, 0, 1).expand(4, 4)
    graphs = [trace(thunder, (4, 16), *[(2, 16)] * 4), trace(mixed_precision, (4, 16), *[(2, 16)] * 3),
              torch.fx.symbolic_trace(f), trace(f, (4, 4), (2, 2))]
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    kinds = {(n.op, str(n.target)) for n in nodes}
    assert len(kinds) > 25 and any(_alias_uncached(n) for n in nodes) and any(
        _cheap_uncached(n) and not _alias_uncached(n) for n in nodes)
    for _ in range(2):
        assert [(is_alias(n), is_cheap(n)) for n in nodes] == [(_alias_uncached(n), _cheap_uncached(n))
                                                               for n in nodes]


class _SymbolicallyTraced(torch.nn.Module):
    """Two parameters gathered where they are used and a reduction at the end, as
    ``torch.fx.symbolic_trace`` writes them: each parameter a ``get_attr`` just before its
    all-gather, and no ``meta["val"]`` on any node."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.w1 = torch.nn.Parameter(torch.randn(2, 16))
        self.w2 = torch.nn.Parameter(torch.randn(2, 16))

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        a = F.all_gather_into_tensor(self.w1, 8, "0")
        h = torch.matmul(h, F.wait_tensor(a).t())
        h = torch.relu(self.lin(h))
        b = F.all_gather_into_tensor(self.w2, 8, "0")
        return torch.matmul(h, F.wait_tensor(b).t())


def test_symbolically_traced_parameters_are_prefetched_and_missing_sizes_said(fake_pg, caplog):
    """A symbolic_trace graph: its parameter reads (get_attr) move up, so both all-gathers
    are issued before the first linear; a WARNING says its byte counts are 0."""
    gm = torch.fx.symbolic_trace(_SymbolicallyTraced())
    x = torch.randn(4, 16)
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        overlapc.schedule(gm, overlapc.OverlapConfig(on_error="raise"))
    names = [n.name for n in gm.graph.nodes]
    first_linear = names.index("lin")
    assert names.index("all_gather_into_tensor") < first_linear
    assert names.index("all_gather_into_tensor_1") < first_linear
    said = [r.getMessage() for r in caplog.records if 'no meta["val"]' in r.getMessage()]
    assert len(said) == 1 and "2 of 2 collectives" in said[0] and "ShapeProp" in said[0], said
    gm.graph.lint()
    assert sorted(names) == sorted(n.name for n in torch.fx.symbolic_trace(_SymbolicallyTraced()).graph.nodes)
    assert gm(x).shape == (4, 16)   # it still runs (the fake group moves no data)

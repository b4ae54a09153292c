"""issue="per-kernel": each start held back to the hiding kernel it runs under, one per kernel.

Checked here from the scheduled graphs alone (positions counted against the compute
around them), against the same graph scheduled with issue="early": every guarantee
(``test_properties.independent_checks``), the same values, no start earlier than under
"early", and each start held back sits right before a kernel no other held-back start sits
before (but all-gathers queued behind one of their group, in consumer order)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import overlapc
from graphs import F, ag, trace, wait
from overlapc.passes.collectives import role
from overlapc.passes.meta import REASON
from test_properties import LocalCollectives, build, independent_checks, inputs_for, programs

KERNELS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
EXAMPLES = int(os.environ.get("OVERLAPC_EXAMPLES", "120"))


def _is_compute(node) -> bool:
    """A node of the spine: a call that is no collective, wait, view or cast."""
    if node.op != "call_function":
        return False
    start, is_wait, _ = role(node)
    return start is None and not is_wait and node.target not in (
        torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._to_copy.default,
        torch.ops.aten.transpose.int, torch.ops.aten.reshape.default)


def _starts(gm) -> dict[str, tuple[int, int | None, str]]:
    """Start name -> (compute nodes before it, position among the compute of the next kernel
    after it or None, its op and group) in ``gm``'s order."""
    found, compute, pending = {}, 0, []
    for node in gm.graph.nodes:
        op = role(node)[0]
        if op is not None:
            pending.append(node.name)
            found[node.name] = (compute, None, f"{op} {node.args[-1]}")
        elif _is_compute(node):
            if node.target in KERNELS:
                for name in pending:
                    found[name] = (found[name][0], compute, found[name][2])
                pending = []
            compute += 1
    return found


def _scheduled(p, groups, issue):
    cfg = overlapc.OverlapConfig(max_in_flight=None, max_in_flight_bytes=None, bucket=None, issue=issue,
                                 on_error="raise")
    gm = trace(build(p, groups), (16, 16), *[(2, 16)] * p["n"])
    before = list(gm.graph.nodes)
    overlapc.schedule(gm, cfg)
    return gm, cfg, before


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=programs())
def test_starts_held_back_to_their_kernel_one_per_kernel(fake_pg, two_groups, p):
    groups = (fake_pg.group_name, two_groups[0].group_name)
    early, _, _ = _scheduled(p, groups, "early")
    late, cfg, before = _scheduled(p, groups, "per-kernel")
    expected = LocalCollectives(early).run(*inputs_for(p))
    for a, b in zip(expected, LocalCollectives(late).run(*inputs_for(p))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    overlapc.verify(late, cfg)
    independent_checks(late, cfg, before)
    was, now = _starts(early), _starts(late)
    assert was.keys() == now.keys()
    held_before: dict[int, list[str]] = {}   # kernel -> what was held back to it, in order
    for name, (compute, kernel, what) in now.items():
        assert compute >= was[name][0], (name, "issued earlier than under issue='early'", compute, was[name])
        if compute > was[name][0]:   # held back: right before a kernel, no compute between
            assert kernel == compute, (name, "held back, but not to the kernel right after it", compute, kernel)
            held_before.setdefault(kernel, []).append(what)
    for kernel, held in held_before.items():   # one each, but all-gathers queued behind one of their group
        assert all(what.startswith("all_gather") and what in held[:i] for i, what in enumerate(held) if i), \
            (kernel, held)


def _gathers_and_matmuls(a, b, c, d, x):
    """Four all-gathers of graph inputs, each read by one matmul of a chain with a tanh
    between; and a reduce-scatter of the first matmul's output."""
    ga, gb, gc, gd = ag(a), ag(b), ag(c), ag(d)
    y = torch.tanh(x @ wait(ga).t())
    rs = F.reduce_scatter_tensor(y, "sum", 8, "0")
    y = torch.tanh(y @ wait(gb).t())
    y = torch.tanh(y @ wait(gc).t())
    y = torch.tanh(y @ wait(gd).t())
    return y, wait(rs)


def test_each_start_goes_right_before_the_first_kernel_no_other_start_took(fake_pg):
    gm = trace(_gathers_and_matmuls, *[(2, 16)] * 4, (16, 16))
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=None, max_in_flight_bytes=None, bucket=None,
                                                 issue="per-kernel", on_error="raise"))
    order = [n for n in gm.graph.nodes if role(n)[0] is not None or n.target in KERNELS]
    names = [n.target.__name__.split(".")[0] for n in order]
    # in the order of their first consumers: the first gather has no kernel before its
    # consumer (it goes as under "early"); the second takes the first mm, the third the second,
    # the fourth the third; the reduce-scatter (due at the output, its input live until its
    # wait there in the traced graph) takes the kernel left after its input, the fourth mm.
    assert names == ["all_gather_into_tensor", "all_gather_into_tensor", "mm", "all_gather_into_tensor", "mm",
                     "all_gather_into_tensor", "mm", "reduce_scatter_tensor", "mm"], names
    reasons = [n.meta[REASON] for n in order if role(n)[0] is not None]
    assert reasons[0] != "kernel point" and reasons[1:] == ["kernel point"] * 4, reasons


def test_early_is_the_default_and_a_misspelt_issue_says_what_it_takes():
    assert overlapc.OverlapConfig().issue == "early"
    with pytest.raises(ValueError, match="issue must be .*did you mean 'per-kernel'"):
        overlapc.OverlapConfig(issue="per_kernel")
    assert overlapc.OverlapConfig.from_options({"issue": "per-kernel"}).scheduling().issue == "per-kernel"


def test_a_start_is_not_held_past_where_the_traced_graph_frees_its_input(fake_pg, caplog):
    """Found by benchmarks/random_dags.py's draws (2026-11-30): the all-gather of ``mm`` stood
    just before the next spine node, but the traced graph waits it at once and frees ``mm``
    there; held back to that node's kernel, ``mm`` stayed live across other collectives'
    buffers and the schedule broke the memory bound (a local degradation). Held back no
    further than the traced graph keeps its input live, it schedules as a whole."""
    from conftest import degradations
    from test_inductor_windows import graph_of
    steps = [["reduce_scatter", 1, 1], ["reduce_scatter", 0, 1], ["mm", 0, 1], ["add", 4, 4], ["all_gather", 4, 3],
             ["all_gather", 2, 4], ["all_gather", 3, 4], ["reduce_scatter", 2, 7], ["relu", 8, 4]]
    gm = graph_of(steps)
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=2, max_in_flight_bytes=None, issue="per-kernel",
                                                 on_error="raise"))
    assert not degradations(caplog.records)
    gathered_mm = next(n for n in gm.graph.nodes if str(role(n)[0]).startswith("all_gather")
                       and n.args[0].args[0].name == "mm")   # all_gather(slice(mm))
    assert gathered_mm.meta[REASON] != "kernel point"

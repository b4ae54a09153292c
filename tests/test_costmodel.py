"""The issue cost's two parts: the start call (on the compute stream at the issue) and the
backend's CPU work while the collective runs (charged only where compute does not wait)."""
import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from overlapc.estimate import costmodel
from overlapc.estimate.simulate import simulate

F = torch.ops._c10d_functional


def gather_between_compute(a, w):
    x = torch.mm(a, a)
    g = F.all_gather_into_tensor(w, 8, "0")
    y = torch.mm(x, a)
    return y.sum() + F.wait_tensor(g).sum()


def test_start_ms_is_the_issue_cost_unless_split():
    link = costmodel.LinkProfile("l", gbps=1.0, latency_us=0.0, issue_us=500.0, issue_gbps=0.001)
    assert link.start_ms(1000) == link.issue_ms(1000) == pytest.approx(1.5)   # no split: all at issue
    split = costmodel.LinkProfile("l", gbps=1.0, latency_us=0.0, issue_us=500.0, start_us=100.0,
                                  start_gbps=0.01)
    assert split.start_ms(1000) == pytest.approx(0.1 + 0.1)
    assert split.start_ms(10 ** 6) == pytest.approx(split.issue_ms(10 ** 6))   # never more than the whole


def test_profile_file_carries_the_split(tmp_path):
    doc = {"schema": costmodel.PROFILE_SCHEMA, "device": {"name": "cpu", "tflops": 0.1, "mem_gbps": 10.0},
           "link": {"name": "gloo", "gbps": 1.0, "latency_us": 100.0, "issue_us": 400.0}, "collectives": {}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    assert costmodel.load_profile(path).link.start_us is None   # older files: all of it at the issue
    doc["link"].update(start_us=150.0, start_gbps=2.0)
    path.write_text(json.dumps(doc))
    link = costmodel.load_profile(path).link
    assert (link.start_us, link.start_gbps) == (150.0, 2.0)
    doc["link"]["start_us"] = -1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="link.start_us"):
        costmodel.load_profile(path)


@pytest.mark.parametrize("comm, step", [
    (3.0, 4.0 + 0.4 * 1.0 / 2.9),   # runs 1.1..4.0 after its start call, compute 1.0 ms of it: that share of 0.4
    (0.5, 2.5),                     # hidden: all 0.4 ms of background work charged at the wait
    (1.3, 2.3 + 0.4 * 1.0 / 1.2),   # runs 1.1..2.3, stalls the last 0.2 ms: 1.0 / 1.2 of it charged
])
def test_background_issue_cost_is_charged_where_compute_runs(fake_pg, comm, step):
    gm = make_fx(gather_between_compute)(torch.randn(8, 8), torch.randn(1, 8))
    compute = {"mm": 1.0, "mm_1": 1.0}
    device = costmodel.DeviceProfile("d", tflops=1.0, mem_gbps=1.0)
    link = costmodel.LinkProfile("l", gbps=1.0, latency_us=0.0, issue_us=500.0, start_us=100.0)
    timeline = simulate(gm, costmodel.Profile(device, link), compute_ms=lambda n: compute.get(n.name, 0.0),
                        comm_ms=lambda c: comm)
    gather = timeline.collectives["all_gather_into_tensor"]
    assert (gather.issue_ms, gather.start_ms) == (1.0, 1.0)         # runs from its issue
    assert timeline.compute["mm_1"] == pytest.approx((1.1, 2.1))   # after the 0.1 ms start call
    assert timeline.step_ms == pytest.approx(step)
    # without the split the whole 0.5 ms holds the compute stream at the issue
    whole = costmodel.LinkProfile("l", gbps=1.0, latency_us=0.0, issue_us=500.0)
    unsplit = simulate(gm, costmodel.Profile(device, whole), compute_ms=lambda n: compute.get(n.name, 0.0),
                       comm_ms=lambda c: comm)
    assert unsplit.step_ms == pytest.approx(max(2.5, 1.0 + comm))


@pytest.mark.parametrize("overlap", [1.0, 0.5, 0.0])
def test_the_link_model_lets_latency_run_beside_earlier_transfers(overlap):
    """end = max(issue + latency, free + (1 - overlap) x latency) + transfer, by hand."""
    link = costmodel.LinkProfile("l", gbps=1.0, latency_us=2000.0, overlap=overlap)
    # the link is free: latency then transfer, whatever the overlap
    assert link.end_ms(1.0, 0.0, 2.0, 3.0) == pytest.approx(6.0)
    # issued at 0 while earlier collectives hold the link until 4 ms
    expected = max(0.0 + 2.0, 4.0 + (1 - overlap) * 2.0) + 3.0
    assert link.end_ms(0.0, 4.0, 2.0, 3.0) == pytest.approx(expected)


def two_gathers(a, w, v):
    g = F.all_gather_into_tensor(w, 8, "0")
    h = F.all_gather_into_tensor(v, 8, "0")
    return torch.mm(a, a).sum() + F.wait_tensor(g).sum() + F.wait_tensor(h).sum()


@pytest.mark.parametrize("overlap", [1.0, 0.0])
def test_simulate_runs_a_groups_collectives_by_the_link_model(fake_pg, overlap):
    """Two all-gathers issued together, latency 2 ms, 1 ms of bytes each: the second's
    latency runs beside the first when the link overlaps them (ends at 2 + 1 + 1), after it
    when it does not (3 + 2 + 1)."""
    gm = make_fx(two_gathers)(torch.randn(8, 8), torch.randn(1, 8), torch.randn(1, 8))
    device = costmodel.DeviceProfile("d", tflops=1.0, mem_gbps=1.0)
    full = 8 * 8 * 4   # each gather's full bytes
    gbps = full * 7 / 8 / 1e9 * 1e3   # 1 ms of transfer each over 8 ranks
    link = costmodel.LinkProfile("l", gbps=gbps, latency_us=2000.0, overlap=overlap)
    timeline = simulate(gm, costmodel.Profile(device, link), compute_ms=lambda n: 0.0)
    first, second = (timeline.collectives[name] for name in ("all_gather_into_tensor", "all_gather_into_tensor_1"))
    assert first.end_ms == pytest.approx(3.0)
    assert second.end_ms == pytest.approx(4.0 if overlap == 1.0 else 6.0)
    assert timeline.step_ms == pytest.approx(second.end_ms)


def test_chunk_estimate_and_simulate_are_one_model(fake_pg):
    """The chunk pass's estimate of a pattern left whole (1 piece) is the simulated time of
    that graph: the same link model, the same compute and issue costs."""
    import dataclasses

    from overlapc.passes.chunk.estimate import pipeline_ms
    from overlapc.passes.chunk.plan import Planner

    def fn(x, w):
        g = F.wait_tensor(F.all_gather_into_tensor(x, 8, "0"))
        return F.wait_tensor(F.reduce_scatter_tensor(torch.mm(g, w), "sum", 8, "0"))
    gm = make_fx(fn)(torch.randn(64, 256), torch.randn(256, 256))
    prof = costmodel.profile("cpu", "ethernet", latency_us=300.0, link_gbps=0.5)
    prof = dataclasses.replace(prof, link=dataclasses.replace(prof.link, issue_us=50.0, overlap=0.5))
    plan = Planner(gm).plan(next(n for n in gm.graph.nodes if n.target == F.all_gather_into_tensor.default), 2)
    assert pipeline_ms(plan, 1, prof) == pytest.approx(simulate(gm, prof).step_ms)

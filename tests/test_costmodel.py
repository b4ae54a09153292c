"""The issue cost's two parts: the start call (on the compute stream at the issue) and the
backend's CPU work while the collective runs (charged only where compute does not wait)."""
import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from overlapc import costmodel
from overlapc.simulate import simulate

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
    (3.0, 4.0),    # stalls 1.9 ms >= the 0.4 ms of background work: none charged
    (0.5, 2.5),    # hidden: all 0.4 ms charged at the wait
    (1.3, 2.5),    # stalls 0.2 ms during its run: the other 0.2 ms charged
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


@pytest.mark.parametrize("latency_us, step", [
    (2000.0, 3.5),   # first pass: runs 1-3 ms, compute stalls 2-3: half its run -> + 0.5 ms
    (500.0, 2.5),    # hidden in the first pass: all of busy_us -> runs 1-2.5 ms
])
def test_busy_us_in_proportion_to_the_compute_it_runs_beside(fake_pg, latency_us, step):
    gm = make_fx(gather_between_compute)(torch.randn(8, 8), torch.randn(1, 8))
    compute = {"mm": 1.0, "mm_1": 1.0}
    device = costmodel.DeviceProfile("d", tflops=1.0, mem_gbps=1.0)
    link = costmodel.LinkProfile("l", gbps=1e9, latency_us=latency_us, busy_us=1000.0)
    timeline = simulate(gm, costmodel.Profile(device, link), compute_ms=lambda n: compute.get(n.name, 0.0))
    assert timeline.step_ms == pytest.approx(step)
    gather = timeline.collectives["all_gather_into_tensor"]
    assert gather.end_ms == pytest.approx(step)
    # exact costs given: busy_us is theirs to include
    given = simulate(gm, costmodel.Profile(device, link), compute_ms=lambda n: compute.get(n.name, 0.0),
                     comm_ms=lambda c: costmodel.collective_ms(c, link))
    assert given.collectives["all_gather_into_tensor"].duration_ms == pytest.approx(latency_us * 1e-3 + 1.0)

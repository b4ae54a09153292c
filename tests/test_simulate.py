"""Cost model and simulator, against timelines worked out by hand."""
import dataclasses
import json
import operator

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import overlapc
from overlapc.estimate import costmodel
from overlapc.estimate.simulate import simulate

F = torch.ops._c10d_functional


def costs(compute=None, comm=None):
    """compute_ms / comm_ms callables from {node name: ms} and {start name: ms}; others cost 0."""
    compute, comm = compute or {}, comm or {}
    return {"compute_ms": lambda n: compute.get(n.name, 0.0),
            "comm_ms": lambda c: comm.get(c.start.name, 0.0)}


def gather_before_compute(a, w):
    g = F.all_gather_into_tensor(w, 8, "0")
    x = torch.mm(a, a)
    y = torch.mm(x, a)
    return y.sum() + F.wait_tensor(g).sum()


def gather_between_compute(a, w):
    x = torch.mm(a, a)
    g = F.all_gather_into_tensor(w, 8, "0")
    y = torch.mm(x, a)
    return y.sum() + F.wait_tensor(g).sum()


def trace(fn, *shapes):
    return make_fx(fn)(*(torch.randn(s) for s in shapes))


def test_gather_issued_before_both_computes_is_hidden(fake_pg):
    gm = trace(gather_before_compute, (4, 4), (2, 4))
    t = simulate(gm, **costs({"mm": 3, "mm_1": 3}, {"all_gather_into_tensor": 4}))
    timed = t.collectives["all_gather_into_tensor"]
    assert (timed.issue_ms, timed.start_ms, timed.end_ms, timed.exposed_ms) == (0, 0, 4, 0)
    assert t.compute["mm"] == (0, 3) and t.compute["mm_1"] == (3, 6)
    assert t.exposed_ms == 0 and t.step_ms == 6
    assert (t.hidden, t.total) == (1, 1)


def test_gather_issued_between_computes_exposes_one_ms(fake_pg):
    gm = trace(gather_between_compute, (4, 4), (2, 4))
    t = simulate(gm, **costs({"mm": 3, "mm_1": 3}, {"all_gather_into_tensor": 4}))
    timed = t.collectives["all_gather_into_tensor"]
    assert (timed.issue_ms, timed.end_ms, timed.exposed_ms) == (3, 7, 1)
    assert t.exposed_ms == 1 and t.step_ms == 7
    assert (t.hidden, t.total) == (0, 1)


def test_order_argument_simulates_another_order(fake_pg):
    gm = trace(gather_between_compute, (4, 4), (2, 4))
    names = [n.name for n in gm.graph.nodes]
    rest = [n for n in names if n != "all_gather_into_tensor"]
    hoisted = rest[:2] + ["all_gather_into_tensor"] + rest[2:]   # right after the placeholders
    t = simulate(gm, order=hoisted, **costs({"mm": 3, "mm_1": 3}, {"all_gather_into_tensor": 4}))
    assert t.exposed_ms == 0 and t.step_ms == 6
    with pytest.raises(ValueError, match="before its input"):
        simulate(gm, order=list(reversed(names)), **costs())
    with pytest.raises(ValueError, match="every node"):
        simulate(gm, order=names[:-1], **costs())


def test_two_groups_run_concurrently_one_group_serializes(fake_pg, two_groups):
    g1, g2 = (g.group_name for g in two_groups)

    def two(a, w, v, group_a, group_b):
        ga = F.all_gather_into_tensor(w, 8, group_a)
        gb = F.all_gather_into_tensor(v, 8, group_b)
        x = torch.mm(a, a)
        return x.sum() + F.wait_tensor(ga).sum() + F.wait_tensor(gb).sum()

    comm = {"all_gather_into_tensor": 4, "all_gather_into_tensor_1": 4}
    args = (torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4))
    concurrent = make_fx(lambda a, w, v: two(a, w, v, g1, g2))(*args)
    t = simulate(concurrent, **costs({"mm": 1}, comm))
    assert [c.end_ms for c in t.collectives.values()] == [4, 4]
    assert t.exposed_ms == 3 and t.step_ms == 4
    serial = make_fx(lambda a, w, v: two(a, w, v, g1, g1))(*args)
    t = simulate(serial, **costs({"mm": 1}, comm))
    assert [(c.start_ms, c.end_ms) for c in t.collectives.values()] == [(0, 4), (4, 8)]
    assert [c.exposed_ms for c in t.collectives.values()] == [3, 4]
    assert t.exposed_ms == 7 and t.step_ms == 8


def test_peak_in_flight_bytes(fake_pg):
    def f(a, w, v):
        ga = F.all_gather_into_tensor(w, 8, "0")
        gb = F.all_gather_into_tensor(v, 8, "0")
        x = F.wait_tensor(ga).sum()
        r = F.wait_tensor(F.all_reduce(a, "sum", "0"))
        return x + F.wait_tensor(gb).sum() + r.sum()

    gm = make_fx(f)(torch.randn(32, 4), torch.randn(2, 4), torch.randn(3, 4))
    t = simulate(gm, **costs())
    # held in flight: an all-gather its output and input, the all-reduce its input
    ga, gb, ar = (16 + 2) * 4 * 4, (24 + 3) * 4 * 4, 32 * 4 * 4
    assert ga + gb < gb + ar
    assert t.peak_in_flight_bytes == gb + ar                    # after ga's wait
    # live at the all-reduce: a (held to its wait), v (held by gb), gb's output, the
    # scalar sum of ga (ga's output is freed after it) and the all-reduce's output
    assert t.peak_bytes == 32 * 4 * 4 + 3 * 4 * 4 + 24 * 4 * 4 + 4 + 32 * 4 * 4


def test_hidden_threshold(fake_pg):
    gm = trace(gather_between_compute, (4, 4), (2, 4))
    barely = simulate(gm, **costs({"mm": 3, "mm_1": 3}, {"all_gather_into_tensor": 3.0005}))
    assert barely.exposed_ms == pytest.approx(0.0005) and barely.hidden == 1
    over = simulate(gm, **costs({"mm": 3, "mm_1": 3}, {"all_gather_into_tensor": 3.2}))
    assert over.hidden == 0


def test_default_costs_come_from_the_profile(fake_pg):
    gm = trace(gather_between_compute, (64, 64), (8, 64))
    slow = simulate(gm, costmodel.profile("cpu", "ethernet"))
    fast = simulate(gm, costmodel.profile("h100", "nvlink"))
    assert slow.step_ms > fast.step_ms > 0
    again = simulate(gm, costmodel.profile("cpu", "ethernet"))   # deterministic
    assert again.compute == slow.compute and again.step_ms == slow.step_ms
    assert [(t.issue_ms, t.end_ms, t.exposed_ms) for t in again.collectives.values()] == \
        [(t.issue_ms, t.end_ms, t.exposed_ms) for t in slow.collectives.values()]


# -- cost model ---------------------------------------------------------------------------------

def _mm_node():
    gm = make_fx(torch.mm)(torch.randn(64, 128), torch.randn(128, 256))
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)


@pytest.mark.parametrize("tflops,mem_gbps", [(1.0, 1000.0), (1000.0, 1.0)])
def test_compute_ms_of_mm_is_the_roofline(tflops, mem_gbps):
    device = costmodel.profile("h100", tflops=tflops, mem_gbps=mem_gbps).device
    flops_ms = 2 * 64 * 128 * 256 / (tflops * 1e12) * 1e3
    bytes_ms = (64 * 128 + 128 * 256 + 64 * 256) * 4 / (mem_gbps * 1e9) * 1e3
    assert costmodel.compute_ms(_mm_node(), device) == pytest.approx(max(flops_ms, bytes_ms))


def test_free_nodes_cost_nothing(fake_pg):
    gm = trace(gather_between_compute, (4, 4), (2, 4))
    device = costmodel.DEVICES["cpu"]
    free = [n for n in gm.graph.nodes if n.op in ("placeholder", "output")
            or n.target in (F.all_gather_into_tensor.default, F.wait_tensor.default, torch.ops.aten.t.default)]
    assert len(free) >= 5 and all(costmodel.compute_ms(n, device) == 0 for n in free)


def test_odd_nodes_never_raise():
    device = costmodel.DEVICES["h100"]
    graph = fx.Graph()
    x = graph.placeholder("x")
    odd = [graph.call_function(lambda v: v, (x,)), graph.call_function(operator.add, (x, 1)),
           graph.call_method("relu", (x,)), graph.call_function(torch.ops.aten.mm.default, (x, x))]
    graph.output(odd[-1])
    for node in odd:
        assert costmodel.compute_ms(node, device) == 0.0
    sym = make_fx(lambda a, b: torch.mm(a, b).relu(), tracing_mode="symbolic")(torch.randn(8, 16),
                                                                               torch.randn(16, 4))
    mm = next(n for n in sym.graph.nodes if n.target == torch.ops.aten.mm.default)
    flops, moved = 2 * 8 * 16 * 4, (8 * 16 + 16 * 4 + 8 * 4) * 4     # sizes from the symbols' hints
    expected = max(flops / (device.tflops * 1e12), moved / (device.mem_gbps * 1e9)) * 1e3
    assert costmodel.compute_ms(mm, device) == pytest.approx(expected)


def test_collective_ms_ring_factors(fake_pg):
    def f(w, g, y):
        a = F.wait_tensor(F.all_gather_into_tensor(w, 8, "0"))
        b = F.wait_tensor(F.reduce_scatter_tensor(g, "sum", 8, "0"))
        c = F.wait_tensor(F.all_reduce(y, "sum", "0"))
        return a, b, c

    gm = make_fx(f)(torch.randn(128, 256), torch.randn(1024, 256), torch.randn(1024, 256))
    gather, scatter, reduce = overlapc.collectives(gm)
    link = costmodel.profile(link_gbps=1.0, latency_us=10.0).link
    full = 1024 * 256 * 4
    assert costmodel.collective_ms(gather, link) == pytest.approx(0.01 + full * 7 / 8 / 1e9 * 1e3)
    assert costmodel.collective_ms(scatter, link) == pytest.approx(0.01 + full * 7 / 8 / 1e9 * 1e3)
    assert reduce.group_size is None   # all_reduce names no size: taken from the process group
    assert costmodel.collective_ms(reduce, link) == pytest.approx(0.01 + full * 2 * 7 / 8 / 1e9 * 1e3)
    assert costmodel.collective_ms(reduce, link, world_size=2) == pytest.approx(0.01 + full / 1e9 * 1e3)
    assert costmodel.collective_ms(gather, link, world_size=2) == pytest.approx(
        0.01 + full * 7 / 8 / 1e9 * 1e3)   # a named group size wins over world_size
    # the ring formula is written once: LinkProfile.duration_ms, from its kind, bytes and n
    assert costmodel.collective_ms(reduce, link, world_size=2) == pytest.approx(
        link.duration_ms("all_reduce", full, 2))


def test_profile_names_and_overrides():
    p = costmodel.profile("a100", "ib", latency_us=0.0)
    assert p.device == costmodel.DEVICES["a100"] and p.link.gbps == costmodel.LINKS["ib"].gbps
    assert p.link.latency_us == 0.0
    with pytest.raises(ValueError, match="h100, a100, cpu"):
        costmodel.profile("tpu")
    with pytest.raises(ValueError, match="nvlink, ib, ethernet"):
        costmodel.profile(link="pcie")
    with pytest.raises(ValueError):
        costmodel.profile(tflops=0)


def test_link_per_mesh_dim_and_group_labels(fake_pg):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    shard, replicate = mesh.get_group("shard").group_name, mesh.get_group("replicate").group_name
    assert (costmodel.group_label(shard), costmodel.group_label(replicate)) == ("shard", "replicate")
    assert costmodel.group_label(dist.group.WORLD.group_name) == dist.group.WORLD.group_name   # no mesh name
    assert costmodel.group_label("no such group") == "no such group"
    p = costmodel.profile("h100", "shard=nvlink,replicate=ib")
    assert (p.link_for(shard), p.link_for(replicate), p.link_for("0")) == (
        costmodel.LINKS["nvlink"], costmodel.LINKS["ib"], costmodel.LINKS["nvlink"])
    assert costmodel.resolve("h100:ethernet,replicate=ib").link_for(shard) == costmodel.LINKS["ethernet"]
    assert costmodel.profile("h100", "replicate=ib", link_gbps=5).link_for(replicate).gbps == 5

    def two_dims(a, w):
        g = F.all_gather_into_tensor(w, 4, shard)
        r = F.all_reduce(torch.mm(a, a), "sum", replicate)
        return torch.mm(F.wait_tensor(r), F.wait_tensor(g))

    gm = trace(two_dims, (8, 8), (2, 8))
    times = simulate(gm, p).collectives
    found = {t.collective.kind: t.collective for t in times.values()}
    assert times["all_gather_into_tensor"].duration_ms == pytest.approx(
        costmodel.collective_ms(found["all_gather"], costmodel.LINKS["nvlink"]))
    assert times["all_reduce"].duration_ms == pytest.approx(
        costmodel.collective_ms(found["all_reduce"], costmodel.LINKS["ib"]))
    from overlapc.explain import report
    names = [n.name for n in gm.graph.nodes]
    assert sorted(r.group for r in report.rows(gm, names, p)) == ["replicate", "shard"]
    with pytest.raises(ValueError, match="per mesh dim"):
        costmodel.profile("h100", "shard=pcie")


def test_fixed_costs_per_op_and_per_issue(fake_pg):
    gm = trace(gather_between_compute, (8, 8), (1, 8))
    device = costmodel.DeviceProfile("d", tflops=1.0, mem_gbps=1.0, kernel_us=50.0)
    link = costmodel.LinkProfile("l", gbps=1.0, latency_us=0.0, issue_us=300.0, issue_gbps=0.001)
    mm = next(n for n in gm.graph.nodes if n.name == "mm")
    view = next(n for n in gm.graph.nodes if n.op == "placeholder")
    flops, moved = costmodel.node_cost(mm)
    assert costmodel.compute_ms(mm, device) == pytest.approx(max(flops / 1e12, moved / 1e9) * 1e3 + 0.05)
    assert costmodel.compute_ms(view, device) == 0.0   # no work, no fixed cost
    base = simulate(gm, costmodel.Profile(device, dataclasses.replace(link, issue_us=0.0, issue_gbps=0.0)))
    issued = simulate(gm, costmodel.Profile(device, link))
    t = issued.collectives["all_gather_into_tensor"]
    nbytes = costmodel.collective_bytes(t.collective)
    cost = 0.3 + nbytes / 1e6 * 1e3    # issue_us + full bytes / issue_gbps, in ms
    assert link.issue_ms(nbytes) == pytest.approx(cost) and nbytes > 0
    # the issue holds the compute stream; the collective runs from the moment it is issued
    assert t.start_ms == t.issue_ms == base.collectives["all_gather_into_tensor"].issue_ms
    assert issued.step_ms == pytest.approx(base.step_ms + cost - (base.collectives["all_gather_into_tensor"].exposed_ms
                                                                  - t.exposed_ms))


def test_old_profile_files_load_without_fixed_costs(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": costmodel.PROFILE_SCHEMA,
                                "device": {"name": "cpu", "tflops": 0.1, "mem_gbps": 10.0},
                                "link": {"name": "gloo", "gbps": 1.0, "latency_us": 100.0}, "collectives": {}}))
    p = costmodel.load_profile(path)
    assert (p.device.kernel_us, p.link.issue_us, p.link.issue_gbps, p.link.overlap) == (0.0, 0.0, 0.0, 1.0)
    assert (p.device.step_us, p.device.param_us, costmodel.outside_ms(100, p.device)) == (0.0, 0.0, 0.0)
    doc = json.loads(path.read_text())
    doc["device"]["kernel_us"] = -1
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="device.kernel_us"):
        costmodel.load_profile(path)
    doc["device"]["kernel_us"], doc["link"]["busy_us"] = 0.0, 250.0   # before issue 30: read, ignored
    path.write_text(json.dumps(doc))
    assert costmodel.load_profile(path).link == p.link
    doc["link"]["overlap"] = 1.5
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="link.overlap"):
        costmodel.load_profile(path)
    doc["link"]["overlap"], doc["link"]["met_fraction"] = 1.0, 1.5
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="link.met_fraction"):
        costmodel.load_profile(path)
    doc["link"]["met_fraction"], doc["link"]["gap_us"] = 0.5, -1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="link.gap_us"):
        costmodel.load_profile(path)
    doc["link"]["gap_us"] = 700.0
    path.write_text(json.dumps(doc))
    loaded = costmodel.load_profile(path).link
    assert (loaded.met_fraction, loaded.gap_us) == (0.5, 700.0)


def _program(serial: bool, gathers: int, matmuls: int):
    """A chain of ``matmuls`` matmuls and ``gathers`` all-gathers: serial, each gather waited right
    after it starts, between the matmuls; else all issued first and waited after the last matmul."""
    def program(a, w):
        x, total = a, 0
        if serial:
            for i in range(max(gathers, matmuls)):
                if i < matmuls:
                    x = torch.mm(x, a)
                if i < gathers:
                    total = total + F.wait_tensor(F.all_gather_into_tensor(w, 8, "0")).sum()
            return x.sum() + total
        started = [F.all_gather_into_tensor(w, 8, "0") for _ in range(gathers)]
        for _ in range(matmuls):
            x = torch.mm(x, a)
        return x.sum() + sum(F.wait_tensor(g).sum() for g in started)
    return program


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gathers=st.integers(1, 5), matmuls=st.integers(1, 5), latency_us=st.floats(200.0, 2000.0),
       issue_us=st.floats(0.0, 3000.0), start_share=st.floats(0.0, 1.0), rows=st.integers(1, 64))
def test_background_issue_cost_follows_the_compute_beside_the_run(fake_pg, gathers, matmuls, latency_us,
                                                                  issue_us, start_share, rows):
    """Random chains, timelines added up here: waited at once, a collective costs its latency and
    transfer and none of its background issuing cost (no compute runs beside it); hidden behind
    compute, its whole issuing cost."""
    start_us = min(start_share * issue_us, 0.9 * latency_us)   # the start call returns before the run ends
    link = costmodel.LinkProfile("l", gbps=0.5, latency_us=latency_us, issue_us=issue_us, start_us=start_us)
    profile = costmodel.Profile(costmodel.DeviceProfile("d", tflops=1.0, mem_gbps=1.0), link)
    for serial, mm_ms in ((True, 1.0), (False, 1000.0)):
        gm = make_fx(_program(serial, gathers, matmuls))(torch.randn(4, 4), torch.randn(rows, 4))
        compute = lambda n, mm_ms=mm_ms: mm_ms if n.target == torch.ops.aten.mm.default else 0.0  # noqa: E731
        timeline = simulate(gm, profile, compute_ms=compute)
        found = overlapc.collectives(gm)
        assert len(found) == gathers
        compute_total = matmuls * mm_ms
        if serial:
            expected = compute_total + sum(sum(costmodel.link_ms(c, link)) for c in found)
        else:
            expected = compute_total + sum(link.issue_ms(costmodel.collective_bytes(c)) for c in found)
            assert timeline.exposed_ms == 0
        assert timeline.step_ms == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_latency_after_the_last_collective_grows_with_the_gap():
    link = costmodel.LinkProfile("l", gbps=1.0, latency_us=1000.0, met_fraction=0.4, gap_us=500.0)
    assert link.latency_after_ms(3.0, None, 1.0) == 1.0              # nothing before it
    assert link.latency_after_ms(3.0, 3.5, 1.0) == pytest.approx(0.4)    # issued while the last one runs
    assert link.latency_after_ms(3.0, 3.0, 1.0) == pytest.approx(0.4)    # as it ends
    assert link.latency_after_ms(3.25, 3.0, 1.0) == pytest.approx(0.7)   # half the gap: half the way
    assert link.latency_after_ms(9.0, 3.0, 1.0) == pytest.approx(1.0)    # past the gap: all of it
    assert costmodel.LinkProfile("l", 1.0, 1000.0, met_fraction=0.4).latency_after_ms(3.0, 3.0, 1.0) == 1.0
    # end_ms: the latency it gives, after the link is free
    assert link.end_ms(3.25, 3.0, 1.0, 0.5) == pytest.approx(3.25 + 0.7 + 0.5)
    assert link.end_ms(0.0, None, 1.0, 0.5) == pytest.approx(1.5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gathers=st.integers(1, 5), mm_ms=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=5),
       met=st.floats(0.0, 1.0), gap_us=st.floats(0.0, 2000.0), rows=st.integers(1, 64))
def test_serial_collectives_pay_the_latency_their_gap_gives(fake_pg, gathers, mm_ms, met, gap_us, rows):
    """Random serial chains (matmuls of random times between all-gathers waited at once), the
    timeline added up here: the first all-gather pays its whole latency; each later one the met
    fraction of it, growing linearly to all of it over ``gap_us`` of compute since the last one
    ended."""
    link = costmodel.LinkProfile("l", gbps=0.5, latency_us=800.0, met_fraction=met, gap_us=gap_us)
    profile = costmodel.Profile(costmodel.DeviceProfile("d", tflops=1.0, mem_gbps=1.0), link)
    gm = make_fx(_program(True, gathers, len(mm_ms)))(torch.randn(4, 4), torch.randn(rows, 4))
    mms = iter(mm_ms)
    costs_by_node = {n: next(mms) for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default}
    timeline = simulate(gm, profile, compute_ms=lambda n: costs_by_node.get(n, 0.0))
    found = overlapc.collectives(gm)
    t, last_end = 0.0, None
    for i in range(max(gathers, len(mm_ms))):
        if i < len(mm_ms):
            t += mm_ms[i]
        if i < gathers:
            latency, transfer = costmodel.link_ms(found[i], link)
            if last_end is not None and gap_us * 1e-3 > 0:   # a gap under a float's reach: none
                latency *= met + (1 - met) * min(1.0, (t - last_end) / (gap_us * 1e-3))
            t = last_end = t + latency + transfer
    assert timeline.step_ms == pytest.approx(t, rel=1e-9, abs=1e-9)

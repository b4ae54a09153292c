"""overlapc calibrate: the fit, the profile file, and its use by the report and the demo (2 real gloo
ranks)."""
import contextlib
import io
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import overlapc.cli as cli
from torch.fx.experimental.proxy_tensor import make_fx

from overlapc import calibrate
from overlapc.estimate import costmodel
from overlapc.collectives import collectives
from overlapc.estimate.simulate import simulate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLGATHER = os.path.join(REPO, "examples", "allgather.py") + ":build"


def stand_in(kind, nbytes, world):
    """A Collective as far as costmodel.collective_ms reads one."""
    return types.SimpleNamespace(kind=kind, group_size=world, nbytes=nbytes, start=types.SimpleNamespace(args=()))


@pytest.mark.parametrize("kind", calibrate.KINDS)
def test_fit_recovers_the_numbers_collective_ms_used(kind):
    link = costmodel.LinkProfile("x", gbps=3.5, latency_us=120.0)
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    samples = [(b, costmodel.collective_ms(stand_in(kind, b, 4), link)) for b in sizes]
    gbps, latency_us = calibrate.fit(samples, kind, 4)
    assert gbps == pytest.approx(3.5, rel=1e-9) and latency_us == pytest.approx(120.0, rel=1e-9)


def test_fit_keeps_latency_non_negative_and_bandwidth_positive():
    # times that fall with size (noise): the fastest sample is the latency, the bandwidth huge
    gbps, latency_us = calibrate.fit([(1 << 10, 5.0), (1 << 20, 4.0)], "all_gather", 2)
    assert latency_us == pytest.approx(4000.0) and gbps == pytest.approx(1e-6 / (1e-9 / (1 << 19)))
    # one slow small sample (a noisy 4 KiB reduce-scatter) must not zero the latency: it is
    # capped at the larger one's time, then the line fits
    noisy = calibrate.fit([(4096, 3.93), (262144, 1.16), (1 << 20, 2.03)], "reduce_scatter", 2)
    assert noisy == pytest.approx(calibrate.fit([(4096, 1.16), (262144, 1.16), (1 << 20, 2.03)],
                                                "reduce_scatter", 2))
    assert 900.0 < noisy[1] < 1160.0
    # a line that would cross zero above 0 bytes: through the origin
    gbps, latency_us = calibrate.fit([(1 << 20, 1.0), (2 << 20, 3.0)], "broadcast", 2)
    assert latency_us == 0.0 and gbps == pytest.approx(
        1e-6 * ((1 << 20) ** 2 + (2 << 20) ** 2) / ((1 << 20) * 1.0 + (2 << 20) * 3.0))


def test_fit_issue_recovers_a_line_and_never_goes_negative():
    link = costmodel.LinkProfile("x", gbps=1.0, latency_us=0.0, issue_us=300.0, issue_gbps=0.5)
    samples = [(b, link.issue_ms(b) * 1e3) for b in (4096, 1 << 20)]
    assert calibrate.fit_issue(samples) == pytest.approx((300.0, 0.5))
    # a cost that falls with size (noise): no per-byte part, the mean as the fixed part
    assert calibrate.fit_issue([(4096, 900.0), (1 << 20, 500.0)]) == (700.0, 0.0)
    # a line that would cross zero above 0 bytes: through the origin instead
    us, gbps = calibrate.fit_issue([(1 << 20, 100.0), (2 << 20, 400.0)])
    assert us == 0.0 and gbps == pytest.approx(1e-3 / ((1 << 20) * 100.0 + (2 << 20) * 400.0)
                                               * ((1 << 20) ** 2 + (2 << 20) ** 2))
    assert calibrate.fit_issue([]) == (0.0, 0.0)


def test_fit_compute_solves_factor_and_fixed_cost():
    small = {"graphs_ms": 1.5 * 2.0 + 80 * 0.03, "roofline_ms": 2.0, "work_nodes": 80}
    large = {"graphs_ms": 1.5 * 50.0 + 80 * 0.03, "roofline_ms": 50.0, "work_nodes": 80}
    factor, kernel_us = calibrate.fit_compute([small, large])
    assert factor == pytest.approx(1.5) and kernel_us == pytest.approx(30.0)
    # a fixed cost that would be negative (noise): none, the factor through the origin
    factor, kernel_us = calibrate.fit_compute([{**small, "graphs_ms": 1.0}, large])
    assert kernel_us == 0.0 and factor == pytest.approx((1.0 * 2.0 + large["graphs_ms"] * 50.0) / (4.0 + 2500.0))
    # the larger block ran faster than the smaller one: the rates as measured
    factor, kernel_us = calibrate.fit_compute([{**small, "graphs_ms": 0.0}, {**large, "graphs_ms": 0.0}])
    assert (factor, kernel_us) == (1.0, 0.0)


@pytest.mark.parametrize("profiled", [False, True])
def test_reference_blocks_give_the_rates_and_fixed_cost_of_compiled_code(profiled):
    compute = calibrate.measure_compute(torch.device("cpu"), quick=True)
    step = {"step_us": 300.0, "param_us": 10.0}
    result = calibrate.measure_reference(torch.device("cpu"), compute, step, quick=True, profiled=profiled)
    blocks = result["reference"]["blocks"]
    assert [{k: b[k] for k in calibrate.REFERENCES["cpu"][0]} for b in blocks] == list(calibrate.REFERENCES["cpu"])
    assert all(b["work_nodes"] > 20 and b["parameters"] == 12 for b in blocks)
    assert [b["steps"] for b in blocks] == [27, 15]
    # the roofline weighs more: 2x the width, same sequence (2.2-3.4x with the rates measured under load)
    assert blocks[1]["roofline_ms"] > 1.5 * blocks[0]["roofline_ms"] > 0
    assert (result["factor"], result["kernel_us"]) == pytest.approx(calibrate.fit_compute(blocks))
    assert result["factor"] > 0 and result["kernel_us"] >= 0
    if profiled:   # graph runs from the profiler's spans; the rest of the step outside them
        assert all(0 < b["graphs_ms"] < b["step_ms"] for b in blocks)
        first = blocks[0]
        assert result["step_us"] == pytest.approx(max(0.0, (first["step_ms"] - first["graphs_ms"]) * 1e3 - 12 * 10.0))
        assert result["step_us"] > 0   # Dynamo, the runtime wrappers, autograd and SGD take time
    else:          # each step less the step outside the graphs
        assert all(b["graphs_ms"] == pytest.approx(b["step_ms"] - (300.0 + 12 * 10.0) * 1e-3) for b in blocks)
        assert result["step_us"] == 300.0


def test_document_takes_latency_from_serial_costs_and_overlap_from_pairs():
    """Per kind the latency is the serial in-step cost at the smallest size less that size's
    transfer at the sweep's bandwidth; the link's overlap the median over kinds of
    2 - pair / serial, kept in [0, 1]."""
    compute = {"tflops": 0.1, "mem_gbps": 10.0}
    collectives = {"all_gather": [(4096, 0.5), (1 << 20, 2.0)], "all_reduce": [(4096, 0.6), (1 << 20, 3.0)],
                   "all_to_all": [(4096, 0.4), (1 << 20, 1.0)]}
    # (bytes, overlapped us, start us, serial us, pair us)
    issue = {"all_gather": [(4096, 500.0, 150.0, 1200.0, 1800.0), (1 << 20, 1500.0, 400.0, 3000.0, 5000.0)],
             "all_reduce": [(4096, 700.0, 250.0, 1000.0, 2500.0), (1 << 20, 1700.0, 500.0, 4000.0, 7000.0)],
             "all_to_all": [(4096, 600.0, 200.0, 800.0, 700.0), (1 << 20, 1600.0, 450.0, 2000.0, 3000.0)]}
    doc = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"), issue=issue)
    met = []
    for kind, samples in collectives.items():
        gbps, sweep_latency = calibrate.fit(samples, kind, 2)
        transfer_us = 4096 * costmodel.ring_factor(kind, 2) / (gbps * 1e9) * 1e6
        assert doc["collectives"][kind]["gbps"] == pytest.approx(gbps)
        assert doc["collectives"][kind]["latency_us"] == pytest.approx(issue[kind][0][3] - transfer_us)
        assert doc["measured"]["sweep_latency_us"][kind] == pytest.approx(sweep_latency)
        met.append(min(1.0, sweep_latency / (issue[kind][0][3] - transfer_us)))
    # right after another collective: the sweep's latency over the in-step one, the kinds' mean;
    # the whole latency after the blocks' compute between two collectives: 1.5x the sweep's
    # 4 KiB times (0.5, 0.6, 0.4 ms; above SLOT_MS), their mean
    assert doc["link"]["met_fraction"] == pytest.approx(sum(met) / 3) and 0 < doc["link"]["met_fraction"] < 1
    assert doc["link"]["gap_us"] == pytest.approx(1.5 * (0.5 + 0.6 + 0.4) / 3 * 1e3)
    # 2 - 1800/1200 = 0.5, 2 - 2500/1000 -> 0, 2 - 700/800 -> 1: the median
    assert doc["link"]["overlap"] == pytest.approx(0.5)
    assert doc["link"]["latency_us"] == pytest.approx(
        sum(doc["collectives"][k]["latency_us"] for k in collectives) / 3)
    # without the in-step samples: the sweep's latencies, no overlap measured (1)
    plain = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"))
    assert plain["collectives"]["all_gather"]["latency_us"] == pytest.approx(
        calibrate.fit(collectives["all_gather"], "all_gather", 2)[1])
    plain_link = costmodel.profile_from_json(plain).link
    assert plain_link.overlap == 1.0
    assert (plain_link.met_fraction, plain_link.gap_us) == (1.0, 0.0)


def calibrate_issue(recorded: dict) -> dict:
    """A profile's ``measured.issue`` back as ``IssueSampler.result()``'s tuples."""
    return {kind: [(s["bytes"], s["us"], s["start_us"], s["serial_us"], s["pair_us"]) for s in samples]
            for kind, samples in recorded.items()}


F = torch.ops._c10d_functional


def waited_at_once(a, w):
    x = torch.mm(a, a)
    g = F.wait_tensor(F.all_gather_into_tensor(w, 8, "0"))
    return torch.mm(x, a).sum() + g.sum()


def issued_before_compute(a, w):
    g = F.all_gather_into_tensor(w, 8, "0")
    x = torch.mm(torch.mm(a, a), a)
    return x.sum() + F.wait_tensor(g).sum()


def reference_graphs():
    """``_in_step_graphs``' shape: a serial order (the gather waited right after it starts) and
    a scheduled one (the gather issued before 5 ms nodes of compute), over the fake group of 8."""
    def traced(fn):
        return [(make_fx(fn)(torch.randn(4, 4), torch.randn(2, 4)), None)]
    return {"serial": traced(waited_at_once), "scheduled": traced(issued_before_compute)}


SLOW_NODES = costmodel.DeviceProfile("d", tflops=1e3, mem_gbps=1e3, kernel_us=5000.0)   # ~5 ms a node


def link_at(scales):
    return costmodel.LinkProfile("l", gbps=0.001, latency_us=1000.0 * scales["serial_scale"],
                                 issue_us=500.0 * scales["issue_scale"], start_us=100.0 * scales["issue_scale"])


def test_in_step_scales_are_where_the_simulated_reference_spends_what_the_measured_one_did(fake_pg):
    """Worked by hand. Serial: the gather waited at once costs its latency and transfer, nothing of its
    issue beyond the start call (no compute runs beside it): (serial step - plain - parameters x param_us
    - transfer) / latency. Scheduled: the gather runs beside 5 ms nodes, so it costs its whole issue:
    (scheduled step - plain - parameters x param_us) / issue."""
    graphs = reference_graphs()
    gather = collectives(graphs["serial"][0][0])[0]
    latency, transfer = costmodel.link_ms(gather, link_at({"serial_scale": 1.0, "issue_scale": 1.0}))
    assert (latency, transfer) == pytest.approx((1.0, costmodel.collective_bytes(gather) * 7 / 8 / 1e6 * 1e3))
    reference = {"plain_ms": 10.0, "serial_ms": 13.1, "scheduled_ms": 11.4, "parameters": 10}
    profile_at = lambda scales: costmodel.Profile(SLOW_NODES, link_at(scales))  # noqa: E731
    scales = calibrate.in_step_scales(reference, graphs, profile_at, param_us=60.0)
    # extra: serial 13.1 - 10 - 10 x 0.06 = 2.5 ms; scheduled 11.4 - 10 - 0.6 = 0.8 ms; issue 0.5 ms
    assert scales == pytest.approx({"serial_scale": (2.5 - transfer) / 1.0, "issue_scale": 0.8 / 0.5}, rel=1e-5)
    # a step no slower than plain: the floor; nothing to scale: 1
    assert calibrate.in_step_scales({**reference, "serial_ms": 9.0, "scheduled_ms": 9.0}, graphs, profile_at,
                                    60.0) == pytest.approx({"serial_scale": 0.1, "issue_scale": 0.1}, rel=1e-5)
    empty = make_fx(lambda a: torch.mm(a, a))(torch.randn(4, 4))
    assert calibrate.in_step_scales(reference, {"serial": [(empty, None)], "scheduled": [(empty, None)]},
                                    profile_at, 60.0) == {"serial_scale": 1.0, "issue_scale": 1.0}


def collective_ms(graphs: dict, order: str, profile: costmodel.Profile) -> float:
    """The simulated step less its compute, over an order's graphs."""
    total = 0.0
    for gm, nodes in graphs[order]:
        t = simulate(gm, profile, nodes)
        total += t.step_ms - sum(end - begin for begin, end in t.compute.values())
    return total


def test_document_scales_latency_and_issue_costs_by_the_in_step_reference(fake_pg):
    """With an in-step reference the profile's latencies are the serial scale times the unscaled
    ones, its issue and start fits those of the samples times the issue scale, and the written
    profile, simulating the reference's graphs, spends on their collectives what the measured
    steps did."""
    compute = {"tflops": 1e3, "mem_gbps": 1e3, "kernel_us": 5000.0, "param_us": 0.0}
    collectives_swept = {"all_gather": [(4096, 0.5), (1 << 20, 2.0)], "reduce_scatter": [(4096, 0.6), (1 << 20, 3.0)]}
    issue = {"all_gather": [(4096, 900.0, 150.0, 1500.0, 2500.0), (1 << 20, 1900.0, 400.0, 3000.0, 5000.0)],
             "reduce_scatter": [(4096, 1200.0, 250.0, 1600.0, 2900.0), (1 << 20, 2400.0, 500.0, 4000.0, 7000.0)]}
    reference = {"plain_ms": 5.0, "serial_ms": 9.0, "scheduled_ms": 6.0, "parameters": 0}
    graphs = reference_graphs()
    plain = calibrate.document(compute, collectives_swept, 2, "gloo", torch.device("cpu"), issue=issue)
    doc = calibrate.document(compute, collectives_swept, 2, "gloo", torch.device("cpu"), issue=issue,
                             in_step=reference, in_step_graphs=graphs)
    serial, overlapped = doc["measured"]["in_step"]["serial_scale"], doc["measured"]["in_step"]["issue_scale"]
    written = costmodel.profile_from_json(doc)
    assert collective_ms(graphs, "serial", written) == pytest.approx(9.0 - 5.0, rel=1e-4)
    assert collective_ms(graphs, "scheduled", written) == pytest.approx(6.0 - 5.0, rel=1e-4)
    for kind in collectives_swept:
        assert doc["collectives"][kind]["latency_us"] == pytest.approx(
            serial * plain["collectives"][kind]["latency_us"])
    assert (doc["link"]["issue_us"], doc["link"]["start_us"]) == pytest.approx(
        (calibrate.fit_issue([(s[0], s[1] * overlapped) for k in sorted(issue) for s in issue[k]])[0],
         calibrate.fit_issue([(s[0], s[2] * overlapped) for k in sorted(issue) for s in issue[k]])[0]))
    assert doc["link"]["overlap"] == plain["link"]["overlap"]   # a ratio of serial costs: unscaled
    with pytest.raises(ValueError, match="in_step_graphs"):
        calibrate.document(compute, collectives_swept, 2, "gloo", torch.device("cpu"), issue=issue, in_step=reference)


def test_compute_only_profile_records_the_builtin_link(tmp_path):
    # one process: compute only, even where a default process group exists (the fake one here)
    doc = calibrate.run_local(1, str(tmp_path / "p.json"), quick=True, fallback_link="ib")
    loaded = costmodel.load_profile(tmp_path / "p.json")
    assert doc["collectives"] == {} and loaded.link == costmodel.LINKS["ib"]
    assert loaded.device.tflops == pytest.approx(doc["device"]["tflops"]) and loaded.device.tflops > 0
    assert loaded.source.startswith(f"file {tmp_path / 'p.json'} (calibrated: none")


@pytest.fixture(scope="module")
def two_rank_profile(tmp_path_factory):
    """(exit code, stdout, stderr, path) of `overlapc calibrate --world-size 2 --quick --quiet`:
    2 gloo ranks on this machine, once for this module (the demo test below reuses the profile)."""
    path = tmp_path_factory.mktemp("calibrated") / "profile.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["calibrate", "--world-size", "2", "-o", str(path), "--quick", "--quiet", "--timeout", "400"])
    return code, out.getvalue(), err.getvalue(), path


def test_calibrate_on_two_gloo_ranks_and_report_uses_it(two_rank_profile, capsys):
    code, out, err, path = two_rank_profile
    assert code == 0 and out == "" and err == "", err
    doc = json.loads(path.read_text())
    assert doc["schema"] == costmodel.PROFILE_SCHEMA
    assert doc["measured"]["world_size"] == 2 and doc["measured"]["backend"] == "gloo"
    assert sorted(doc["collectives"]) == sorted(calibrate.KINDS)
    # fixed costs: one node of compiled code, and a collective issued during compute (fitted over kinds and sizes)
    assert 0 <= doc["device"]["kernel_us"] < 1000
    issue = doc["measured"]["issue"]
    assert sorted(issue) == sorted(calibrate.KINDS)
    assert all([s["bytes"] for s in issue[k]] == list(calibrate.ISSUE_SIZES) for k in issue)
    assert all(s["us"] >= 0 for k in issue for s in issue[k])
    # the in-step reference: the small block sharded, in its traced order and in overlapc's
    in_step = doc["measured"]["in_step"]
    serial, scheduled = in_step["collectives"]["serial"], in_step["collectives"]["scheduled"]
    assert {k for k, _ in serial} == {k for k, _ in scheduled} == {"all_gather", "reduce_scatter"}
    assert len(scheduled) < len(serial) and all(b > 0 for _, b in serial + scheduled)   # buckets
    assert in_step["serial_ms"] > in_step["plain_ms"] > 0 and in_step["scheduled_ms"] > 0
    swept = {kind: [(s["bytes"], s["ms"]) for s in numbers["samples"]] for kind, numbers in doc["collectives"].items()}
    _, unscaled, _ = calibrate.link_document(swept, calibrate_issue(issue), 2, "gloo")
    assert all(0.1 <= in_step[k] <= 10.0 for k in ("serial_scale", "issue_scale"))
    for kind in calibrate.KINDS:
        assert doc["collectives"][kind]["latency_us"] == pytest.approx(
            in_step["serial_scale"] * unscaled[kind]["latency_us"])
    scale = in_step["issue_scale"]
    assert (doc["link"]["issue_us"], doc["link"]["issue_gbps"]) == pytest.approx(
        calibrate.fit_issue([(s["bytes"], s["us"] * scale) for k in sorted(issue) for s in issue[k]]))
    assert doc["link"]["issue_us"] > 0    # issuing and running a collective costs its caller time
    assert all(s["start_us"] > 0 for k in issue for s in issue[k])   # the start call's part of it
    assert (doc["link"]["start_us"], doc["link"]["start_gbps"]) == pytest.approx(
        calibrate.fit_issue([(s["bytes"], s["start_us"] * scale) for k in sorted(issue) for s in issue[k]]))
    # a training step outside its graphs: fixed and per (DTensor) parameter
    assert doc["device"]["step_us"] > 0 and doc["device"]["param_us"] > 0
    assert doc["measured"]["compute"]["step"]["dtensor"] is True
    reference = doc["measured"]["compute"]["reference"]
    assert doc["measured"]["profiled"] is False and reference["profiled"] is False
    # the device's rates: the matmul's and the copy's over the reference blocks' roofline factor
    assert doc["device"]["tflops"] == pytest.approx(2 * 512 ** 3 / doc["measured"]["compute"]["matmul"]["ms"]
                                                    / 1e9 / reference["roofline_factor"])
    # in the middle of compute: each kind's latency is its serial cost less its transfer, and
    # the link's overlap a fraction (tests below check the arithmetic)
    assert 0.0 <= doc["link"]["overlap"] <= 1.0 and "busy_us" not in doc["link"]
    assert 0.0 <= doc["link"]["met_fraction"] <= 1.0 and doc["link"]["gap_us"] >= calibrate.SLOT_MS * 1e3
    assert all(s["serial_us"] > 0 and s["pair_us"] > 0 for k in issue for s in issue[k])
    assert sorted(doc["measured"]["sweep_latency_us"]) == sorted(calibrate.KINDS)
    for kind, entry in doc["collectives"].items():
        assert [s["bytes"] for s in entry["samples"]] == list(calibrate.QUICK_SWEEP)
        assert all(s["ms"] > 0 for s in entry["samples"])
        link = costmodel.LinkProfile("fit", entry["gbps"], entry["latency_us"])
        for s in entry["samples"]:   # collective_ms with the fitted numbers gives the fitted times
            assert costmodel.collective_ms(stand_in(kind, s["bytes"], 2), link) == pytest.approx(s["fit_ms"])
    profile = costmodel.load_profile(path)
    assert (profile.device.kernel_us, profile.link.issue_us, profile.link.issue_gbps) == (
        doc["device"]["kernel_us"], doc["link"]["issue_us"], doc["link"]["issue_gbps"])
    assert costmodel.outside_ms(10, profile.device) == pytest.approx(
        (doc["device"]["step_us"] + 10 * doc["device"]["param_us"]) * 1e-3)
    assert dict((k, (g, l)) for k, g, l in profile.link.per_kind) == {
        k: (e["gbps"], e["latency_us"]) for k, e in doc["collectives"].items()}

    code, out, err = cli.main(["report", ALLGATHER, "--world-size", "8", "--format", "json", "--quiet",
                               "--profile", str(path), "--device", "h100"]), *capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["profile"]["name"] == str(path) and report["profile"]["source"].startswith(f"file {path}")
    gather, met = doc["collectives"]["all_gather"], doc["link"]["met_fraction"]
    rows = sorted(report["graphs"][0]["rows"], key=lambda row: row["start_ms"])
    for at, row in enumerate(rows):   # world size 8: ring factor 7/8 on the gathered bytes
        latency, transfer = gather["latency_us"] * 1e-3, row["nbytes"] * 7 / 8 / (gather["gbps"] * 1e9) * 1e3
        assert row["kind"] == "all_gather"
        if at == 0:   # nothing before it on the link: its whole latency
            assert row["comm_ms"] == pytest.approx(latency + transfer)
        else:         # after another: between the met fraction of its latency and all of it
            assert met * latency + transfer - 1e-9 <= row["comm_ms"] <= latency + transfer + 1e-9
    code, default, _ = cli.main(["report", ALLGATHER, "--world-size", "8", "--format", "json", "--quiet"]), \
        *capsys.readouterr()
    assert json.loads(default)["graphs"][0]["rows"][0]["comm_ms"] != pytest.approx(
        report["graphs"][0]["rows"][0]["comm_ms"])


def test_demo_prints_its_header_first_without_profiler_noise_within_120_columns(two_rank_profile, tmp_path):
    """`make demo`'s terminal (a smaller model, the profile calibrated above): the header block
    within the first 15 lines, no torch profiler line (the ranks' stderr goes to their logs), no
    line over 120 columns."""
    code, _, err, profile = two_rank_profile
    assert code == 0, err
    kept = tmp_path / "kept"
    done = subprocess.run([sys.executable, "-m", "overlapc.cli", "demo", "--layers", "1", "--width", "32",
                           "--heads", "2", "--batch", "2", "--seq", "8", "--steps", "3", "--keep", str(kept),
                           "--profile", str(profile)],
                          capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    terminal = done.stdout + done.stderr
    assert "USDT" not in terminal and "SyncActivityProfilerHandler" not in terminal
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    first = next(i for i, line in enumerate(lines) if line.startswith("== overlapc demo:"))
    assert first < 15, lines[:first + 1]
    block = [line.split()[0] for line in lines[first + 2:first + 7]]
    assert block == ["losses", "step", "estimated", "peak", "exposed"], lines[first:first + 8]
    assert "equal in all 3 steps" in lines[first + 2] and "Inductor" in lines[first + 3]
    assert "estimates above and below: profile.json (given: --profile profile.json)" in done.stdout
    assert sum(line.startswith(("fw_", "bw_")) and "by estimate with profile.json (calibrated)" in line
               for line in lines) == 2
    assert "== details ==" not in done.stdout and os.path.isfile(kept / "rank0.log")
    assert os.path.isfile(kept / "rank1.log") and os.path.isfile(kept / "trace_rank0.json")
    assert json.loads((kept / "profile.json").read_text()) == json.loads(profile.read_text())
    page = (kept / "schedule.html").read_text()   # the kept folder's schedule page, with the profiled run
    assert "fw_0" in page and "bw_0" in page and "measured" in page and "https://" not in page


def test_interleaved_takes_samples_round_robin():
    calls = []
    runs = [lambda i=i: calls.append(i) or float(10 * i + len(calls)) for i in range(3)]
    samples = calibrate.interleaved(runs, 2)
    assert calls == [0, 1, 2, 0, 1, 2]
    assert samples == [[1.0, 4.0], [12.0, 15.0], [23.0, 26.0]]


def test_document_fits_the_start_call_part_of_the_issue_cost():
    compute = {"tflops": 0.1, "mem_gbps": 10.0}
    collectives = {"all_gather": [(4096, 0.5), (1 << 20, 2.0)]}
    issue = {"all_gather": [(4096, 500.0, 150.0, 900.0, 1200.0), (1 << 20, 1500.0, 400.0, 2000.0, 3000.0)],
             "all_reduce": [(4096, 700.0, 250.0, 900.0, 1200.0), (1 << 20, 1700.0, 500.0, 2000.0, 3000.0)]}
    doc = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"), issue=issue)
    pairs = lambda part: [(s[0], s[part]) for k in sorted(issue) for s in issue[k]]  # noqa: E731
    assert (doc["link"]["issue_us"], doc["link"]["issue_gbps"]) == pytest.approx(calibrate.fit_issue(pairs(1)))
    assert (doc["link"]["start_us"], doc["link"]["start_gbps"]) == pytest.approx(calibrate.fit_issue(pairs(2)))
    assert doc["measured"]["issue"]["all_reduce"][0] == {"bytes": 4096, "us": 700.0, "start_us": 250.0,
                                                         "serial_us": 900.0, "pair_us": 1200.0}
    assert "start_us" not in calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"))["link"]


def test_ranks_that_outlive_the_timeout_are_named_and_ended(tmp_path):
    with pytest.raises(RuntimeError, match=r"calibration rank\(s\) \[0, 1\] hung.*raise --timeout"):
        calibrate.run_local(2, str(tmp_path / "p.json"), quick=True, timeout=1.0)
    assert not (tmp_path / "p.json").exists()

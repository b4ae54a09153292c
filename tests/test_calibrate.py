"""overlapc calibrate: the fit, the profile file, and its use by the report (2 real gloo ranks)."""
import json
import os
import types

import pytest
import torch

import overlapc.cli as cli
from overlapc import calibrate, costmodel

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
    for kind, samples in collectives.items():
        gbps, sweep_latency = calibrate.fit(samples, kind, 2)
        transfer_us = 4096 * costmodel.ring_factor(kind, 2) / (gbps * 1e9) * 1e6
        assert doc["collectives"][kind]["gbps"] == pytest.approx(gbps)
        assert doc["collectives"][kind]["latency_us"] == pytest.approx(issue[kind][0][3] - transfer_us)
        assert doc["measured"]["sweep_latency_us"][kind] == pytest.approx(sweep_latency)
    # 2 - 1800/1200 = 0.5, 2 - 2500/1000 -> 0, 2 - 700/800 -> 1: the median
    assert doc["link"]["overlap"] == pytest.approx(0.5)
    assert doc["link"]["latency_us"] == pytest.approx(
        sum(doc["collectives"][k]["latency_us"] for k in collectives) / 3)
    # without the in-step samples: the sweep's latencies, no overlap measured (1)
    plain = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"))
    assert plain["collectives"]["all_gather"]["latency_us"] == pytest.approx(
        calibrate.fit(collectives["all_gather"], "all_gather", 2)[1])
    assert costmodel.profile_from_json(plain).link.overlap == 1.0


def test_with_issue_derives_the_link_anew_from_the_sweep_and_new_in_step_samples():
    """The demo re-measures the in-step costs between its timed steps: the profile document
    gets the link (latency, issue cost, overlap) of the new samples, the device and the
    sweep's bandwidth unchanged, as if ``document`` had been given them."""
    compute = {"tflops": 0.1, "mem_gbps": 10.0}
    collectives = {"all_gather": [(4096, 0.5), (1 << 20, 2.0)], "reduce_scatter": [(4096, 0.6), (1 << 20, 3.0)]}
    first = {"all_gather": [(4096, 900.0, 150.0, 1500.0, 2500.0), (1 << 20, 1900.0, 400.0, 3000.0, 5000.0)],
             "reduce_scatter": [(4096, 1200.0, 250.0, 1600.0, 2900.0), (1 << 20, 2400.0, 500.0, 4000.0, 7000.0)]}
    later = {"all_gather": [(4096, 500.0, 120.0, 600.0, 900.0), (1 << 20, 1400.0, 300.0, 2000.0, 3100.0)],
             "reduce_scatter": [(4096, 550.0, 130.0, 700.0, 1000.0), (1 << 20, 1500.0, 350.0, 2100.0, 3500.0)]}
    doc = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"), issue=first)
    again = calibrate.with_issue(doc, later)
    expected = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"), issue=later)
    assert calibrate.sweep_samples(doc) == collectives
    assert again["link"] == pytest.approx(expected["link"]) and again["link"] != doc["link"]
    for kind in collectives:
        assert again["collectives"][kind]["latency_us"] == pytest.approx(expected["collectives"][kind]["latency_us"])
        assert again["collectives"][kind]["gbps"] == pytest.approx(doc["collectives"][kind]["gbps"])
    assert again["device"] == doc["device"] and again["measured"]["issue"] == expected["measured"]["issue"]
    assert costmodel.profile_from_json(again).link.latency_ms("all_gather") < \
        costmodel.profile_from_json(doc).link.latency_ms("all_gather")


def calibrate_issue(recorded: dict) -> dict:
    """A profile's ``measured.issue`` back as ``IssueSampler.result()``'s tuples."""
    return {kind: [(s["bytes"], s["us"], s["start_us"], s["serial_us"], s["pair_us"]) for s in samples]
            for kind, samples in recorded.items()}


def test_in_step_scales_price_the_reference_steps_collectives_as_they_ran():
    """Serial: (serial step - plain step - parameters x param_us - transfers) / latencies, the
    latencies and transfers those of the serial order's collectives by kind; issue: (scheduled
    step - plain - parameters x param_us) / the scheduled collectives' issue costs. Worked by hand."""
    kinds = {"all_gather": {"latency_us": 1000.0, "gbps": 1.0}, "reduce_scatter": {"latency_us": 2000.0, "gbps": 0.5}}
    link = {"issue_us": 500.0, "issue_gbps": 2.0}
    reference = {"plain_ms": 10.0, "serial_ms": 16.6, "scheduled_ms": 13.0, "parameters": 10,
                 "collectives": {"serial": [["all_gather", 1_000_000], ["all_gather", 0], ["reduce_scatter", 0]],
                                 "scheduled": [["all_gather", 1_000_000], ["reduce_scatter", 0]]}}
    # serial: extra 16.6 - 10 - 10 x 0.06 = 6.0 ms; transfer 1e6 x 1/2 / 1e9 s = 0.5 ms; latencies 1 + 1 + 2 = 4 ms
    # issue: extra 13 - 10 - 0.6 = 2.4 ms; priced 0.5 + 1e6 / 2e9 s (0.5 ms) + 0.5 = 1.5 ms
    scales = calibrate.in_step_scales(reference, link, kinds, 2, param_us=60.0)
    assert scales == pytest.approx({"serial_scale": (6.0 - 0.5) / 4.0, "issue_scale": 2.4 / 1.5})
    # nothing priced: 1; a step no slower than plain: the floor, 0.1
    assert calibrate.in_step_scales({**reference, "collectives": {"serial": [], "scheduled": []}}, {}, kinds, 2,
                                    60.0) == {"serial_scale": 1.0, "issue_scale": 1.0}
    assert calibrate.in_step_scales({**reference, "serial_ms": 9.0, "scheduled_ms": 9.0}, link, kinds, 2,
                                    60.0) == {"serial_scale": 0.1, "issue_scale": 0.1}


def test_document_scales_latency_and_issue_costs_by_the_in_step_reference():
    """With an in-step reference the profile's latencies are the serial scale times the unscaled
    ones, its issue and start fits those of the samples times the issue scale; ``with_issue``
    applies the scales the document recorded to new samples."""
    compute = {"tflops": 0.1, "mem_gbps": 10.0, "param_us": 0.0}
    collectives = {"all_gather": [(4096, 0.5), (1 << 20, 2.0)], "reduce_scatter": [(4096, 0.6), (1 << 20, 3.0)]}
    issue = {"all_gather": [(4096, 900.0, 150.0, 1500.0, 2500.0), (1 << 20, 1900.0, 400.0, 3000.0, 5000.0)],
             "reduce_scatter": [(4096, 1200.0, 250.0, 1600.0, 2900.0), (1 << 20, 2400.0, 500.0, 4000.0, 7000.0)]}
    reference = {"plain_ms": 5.0, "serial_ms": 9.0, "scheduled_ms": 7.0, "parameters": 0,
                 "collectives": {"serial": [["all_gather", 0], ["reduce_scatter", 0]],
                                 "scheduled": [["all_gather", 0]]}}
    plain = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"), issue=issue)
    doc = calibrate.document(compute, collectives, 2, "gloo", torch.device("cpu"), issue=issue, in_step=reference)
    latencies = sum(plain["collectives"][k]["latency_us"] for k in collectives) * 1e-3
    serial, overlapped = 4.0 / latencies, 2.0 / (plain["link"]["issue_us"] * 1e-3)
    assert doc["measured"]["in_step"]["serial_scale"] == pytest.approx(serial)
    assert doc["measured"]["in_step"]["issue_scale"] == pytest.approx(overlapped)
    for kind in collectives:
        assert doc["collectives"][kind]["latency_us"] == pytest.approx(serial * plain["collectives"][kind]["latency_us"])
    assert (doc["link"]["issue_us"], doc["link"]["start_us"]) == pytest.approx(
        (calibrate.fit_issue([(s[0], s[1] * overlapped) for k in sorted(issue) for s in issue[k]])[0],
         calibrate.fit_issue([(s[0], s[2] * overlapped) for k in sorted(issue) for s in issue[k]])[0]))
    assert doc["link"]["overlap"] == plain["link"]["overlap"]   # a ratio of serial costs: unscaled
    later = {kind: [(b, us / 2, start / 2, serial_us / 2, pair / 2) for b, us, start, serial_us, pair in samples]
             for kind, samples in issue.items()}
    again = calibrate.with_issue(doc, later)
    unscaled_later = calibrate.with_issue(plain, later)
    for kind in collectives:
        assert again["collectives"][kind]["latency_us"] == pytest.approx(
            serial * unscaled_later["collectives"][kind]["latency_us"])
    assert again["measured"]["in_step"] == doc["measured"]["in_step"]


def test_compute_only_profile_records_the_builtin_link(tmp_path):
    # one process: compute only, even where a default process group exists (the fake one here)
    doc = calibrate.run_local(1, str(tmp_path / "p.json"), quick=True, fallback_link="ib")
    loaded = costmodel.load_profile(tmp_path / "p.json")
    assert doc["collectives"] == {} and loaded.link == costmodel.LINKS["ib"]
    assert loaded.device.tflops == pytest.approx(doc["device"]["tflops"]) and loaded.device.tflops > 0
    assert loaded.source.startswith(f"file {tmp_path / 'p.json'} (calibrated: none")


def test_calibrate_on_two_gloo_ranks_and_report_uses_it(tmp_path, capsys):
    path = tmp_path / "profile.json"
    code = cli.main(["calibrate", "--world-size", "2", "-o", str(path), "--quick", "--quiet", "--timeout", "400"])
    out, err = capsys.readouterr()
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
    unscaled_link, unscaled, _ = calibrate.link_document(calibrate.sweep_samples(doc), calibrate_issue(issue), 2, "gloo")
    scales = calibrate.in_step_scales(in_step, unscaled_link, unscaled, 2, doc["device"]["param_us"])
    assert scales == pytest.approx({k: in_step[k] for k in ("serial_scale", "issue_scale")})
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
    gather = doc["collectives"]["all_gather"]
    for row in report["graphs"][0]["rows"]:   # world size 8: ring factor 7/8 on the gathered bytes
        expected = gather["latency_us"] * 1e-3 + row["nbytes"] * 7 / 8 / (gather["gbps"] * 1e9) * 1e3
        assert row["kind"] == "all_gather" and row["comm_ms"] == pytest.approx(expected)
    code, default, _ = cli.main(["report", ALLGATHER, "--world-size", "8", "--format", "json", "--quiet"]), \
        *capsys.readouterr()
    assert json.loads(default)["graphs"][0]["rows"][0]["comm_ms"] != pytest.approx(
        report["graphs"][0]["rows"][0]["comm_ms"])


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

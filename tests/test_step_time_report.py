"""benchmarks/step_time.py's bookkeeping on made-up per-rank results (nothing is timed)."""
import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def step_time():
    path = os.path.join(HERE, os.pardir, "benchmarks", "step_time.py")
    spec = importlib.util.spec_from_file_location("step_time_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_identical_overlapc_configs_are_measured_once(step_time):
    # overlapc_k3 spells out the default max_in_flight: the same config, measured once
    names = ["overlapc", "overlapc_bucket_module", "overlapc_nobucket", "overlapc_k3", "overlapc_k2", "inductor"]
    assert step_time._same_config(names) == {"overlapc_k3": "overlapc"}
    assert step_time._same_config(["overlapc_k3", "overlapc"]) == {"overlapc": "overlapc_k3"}
    assert step_time._same_config(["overlapc_count_only", "overlapc_unlimited", "overlapc_nobucket"]) == {}


def _rank(times, rank, aliases, peaks, estimates):
    return {"times": times, "losses": {n: [1.0 + rank, 0.9 + rank] for n in times},
            "errors": {"inductor_overlap_scheduler": "build: no triton"} if rank == 0 else
                      {"inductor_overlap_scheduler": "failed on another rank"},
            "compile_s": {n: 1.0 for n in times}, "n_params": 10, "aliases": aliases,
            "peak_bytes": peaks, "estimates": estimates}


def met_of(result, goal):
    return result["ratios"]["met"][goal]


def test_report_uses_the_slower_rank_copies_aliases_and_judges_the_goals(step_time, tmp_path, capsys):
    variants = ["fsdp2_eager", "inductor", "inductor_overlap_scheduler", "overlapc", "overlapc_k3",
                "overlapc_unlimited"]
    rank0 = {"fsdp2_eager": [3.0, 3.0, 3.0], "inductor": [2.6, 2.6, 2.6], "overlapc": [1.9, 2.0, 2.1],
             "overlapc_unlimited": [1.8, 1.8, 1.8], "compute_only": [0.9, 0.9, 0.9],
             "comm_only": [1.8, 1.8, 1.8], "edge_comm": [0.2, 0.2, 0.2], "concurrent": [2.0, 2.0, 2.0],
             "inductor_overlap_scheduler": []}                 # as rank_main: failed, never timed
    rank1 = {n: list(t) for n, t in rank0.items()}
    rank1["overlapc"] = [2.0, 2.2, 2.0]                        # slower than rank 0 at steps 0 and 1
    out = tmp_path / "st.json"
    args = step_time.parse_args(["--variants", *variants, "--steps", "3", "--json", str(out)])
    args.link = "test"
    aliases = {"overlapc_k3": "overlapc"}   # made up: k3 reported as overlapc's numbers
    mib = 2 ** 20
    peaks0 = {"fsdp2_eager": 100 * mib, "inductor": 80 * mib, "overlapc": 90 * mib, "overlapc_unlimited": 150 * mib}
    peaks1 = dict(peaks0, overlapc=86 * mib, inductor=85 * mib)  # the larger rank counts: 90 vs 85
    estimates = {"overlapc": {"ms": 1900.0, "graphs": 2, "exposed_ms": 120.0, "measured_exposed_ms": 150.0},
                 "overlapc_unlimited": {"ms": 1600.0, "graphs": 2}}
    assert step_time.report(args, [_rank(rank0, 0, aliases, peaks0, estimates),
                                   _rank(rank1, 1, aliases, peaks1, {})]) == 0

    result = json.loads(out.read_text())
    overlapc = result["variants"]["overlapc"]
    assert overlapc["median_s"] == pytest.approx(2.1)          # median of per-step max 2.0, 2.2, 2.1
    assert result["variants"]["overlapc_k3"] == dict(overlapc, same_as="overlapc")
    assert overlapc["peak_bytes"] == 90 * mib and result["variants"]["inductor"]["peak_bytes"] == 85 * mib
    assert overlapc["estimate_s"] == pytest.approx(1.9) and "estimate_s" not in result["variants"]["inductor"]
    assert result["variants"]["inductor_overlap_scheduler"] == {"error": "build: no triton"}
    assert result["bounds"]["bound_s"] == pytest.approx(1.8)   # max(0.9 + 0.2, 1.8)
    assert result["bounds"]["concurrent_s"] == pytest.approx(2.0)
    assert met_of(result, "overlapc within 1.05x of concurrent (the bound as this machine runs it)")  # 2.1 / 2.0
    met = result["ratios"]["met"]
    assert met["overlapc >= 1.3x faster than inductor"] is False      # 2.6 / 2.1 = 1.24
    assert met["overlapc faster than fsdp2_eager"] is True
    assert met["overlapc defaults within 2% of the fastest overlapc option set"] is False  # unlimited 1.8
    assert met["overlapc within 2% of the fastest variant (Inductor's overlap scheduler included)"] is False
    assert met["overlapc peak memory <= 1.10x inductor's"] is True     # 90 / 85 = 1.06
    assert met["overlapc peak memory <= fsdp2_eager's"] is True        # 90 <= 100
    assert met["estimates within 20% of measured"] is True             # 1.9 / 2.1 and 1.6 / 1.8: -10%, -11%
    assert met["estimates rank the variants as measured"] is True      # unlimited < overlapc both ways
    assert (overlapc["measured_exposed_ms"], overlapc["estimate_exposed_ms"]) == (150.0, 120.0)
    printed = capsys.readouterr().out
    assert "same config as overlapc" in printed
    assert next(line for line in printed.splitlines() if line.startswith("overlapc ")).split()[8:10] == [
        "150.0", "120.0"]   # measured and estimated exposed communication, beside the estimate


def test_estimates_carry_the_measured_exposed_communication(step_time, tmp_path):
    # a variant's dump (two graphs) and the trace of its profiled step, as rank_main leaves them
    from test_analyze import _cuda_dump, _cuda_trace

    _cuda_dump(tmp_path / "overlapc" / "rank0")
    (tmp_path / "overlapc" / "trace_rank0.json").write_text(json.dumps(_cuda_trace()))
    _cuda_dump(tmp_path / "overlapc_k2" / "rank0")   # no trace: no measurement
    got = step_time._estimates(str(tmp_path), 0, ["overlapc", "overlapc_k2"], parameters=10)
    assert got["overlapc"] == {"ms": 0.5, "graphs": 2, "outside_ms": 0.0, "exposed_ms": 0.2,
                               "measured_exposed_ms": pytest.approx(0.22)}
    assert got["overlapc_k2"] == {"ms": 0.5, "graphs": 2, "outside_ms": 0.0, "exposed_ms": 0.2}
    # with the run's calibrated profile: the time outside the graphs, for 10 parameter tensors
    (tmp_path / "profile.json").write_text(json.dumps({
        "schema": "overlapc.profile/1", "device": {"name": "cpu", "tflops": 0.1, "mem_gbps": 10.0,
                                                   "step_us": 500.0, "param_us": 20.0},
        "link": {"name": "gloo", "gbps": 1.0, "latency_us": 100.0}, "collectives": {}}))
    got = step_time._estimates(str(tmp_path), 0, ["overlapc"], parameters=10)["overlapc"]
    assert (got["outside_ms"], got["ms"]) == (pytest.approx(0.7), pytest.approx(1.2))


def test_ddp_case_judges_overlapc_ddp_against_both_ddp_variants(step_time, tmp_path):
    rank0 = {"ddp_eager": [2.5, 2.5, 2.5], "ddp_inductor": [2.0, 2.0, 2.0], "overlapc_ddp": [2.05, 2.1, 2.1],
             "compute_only": [1.9, 1.9, 1.9], "comm_only": [0.5, 0.5, 0.5], "edge_comm": [0.1, 0.1, 0.1],
             "concurrent": [2.05, 2.05, 2.05], "forward_only": [0.7, 0.7, 0.7]}
    out = tmp_path / "ddp.json"
    args = step_time.parse_args(["--ddp", "--steps", "3", "--json", str(out)])
    args.link = "test"
    mib = 2 ** 20
    peaks = {"ddp_eager": 100 * mib, "ddp_inductor": 90 * mib, "overlapc_ddp": 95 * mib}
    per_rank = [{"times": rank0, "losses": {n: [1.0, 0.9] for n in rank0}, "errors": {},
                 "compile_s": {n: 1.0 for n in rank0}, "n_params": 10, "aliases": {}, "peak_bytes": peaks,
                 "estimates": {}}]
    assert step_time.report(args, per_rank) == 0
    result = json.loads(out.read_text())
    assert result["config"]["case"] == "ddp" and sorted(result["variants"]) == ["ddp_eager", "ddp_inductor", "overlapc_ddp"]
    met = result["ratios"]["met"]
    assert result["bounds"]["bound_s"] == pytest.approx(2.0)   # max(compute 1.9 + edge 0.1, forward 0.7 + comm 0.5)
    assert met["overlapc_ddp within 1.05x of bound"] is True                      # 2.1 / 2.0
    assert "forward_only" not in result["variants"] and "forward_only" in result["bound_variants"]
    assert met["overlapc_ddp at least as fast as ddp_eager"] is True
    assert met["overlapc_ddp at least as fast as ddp_inductor"] is False         # 2.0 vs 2.1
    assert met["overlapc_ddp peak memory <= ddp_eager's"] is True                # 95 <= 100
    rank0["forward_only"] = [1.8, 1.8, 1.8]   # a slow forward: the all-reduces after it set the bound
    assert step_time.report(args, per_rank) == 0
    result = json.loads(out.read_text())
    assert result["bounds"]["bound_s"] == pytest.approx(2.3)
    assert result["ratios"]["overlapc_ddp/bound"] == pytest.approx(2.1 / 2.3)
    with pytest.raises(SystemExit):
        step_time.parse_args(["--ddp", "--variants", "overlapc"])               # an FSDP variant in the DDP case

"""overlapc analyze: a profiled compiled step on 2 real gloo ranks, and a synthetic CUDA-format trace.

The CUDA trace is built here from the Chrome trace format torch.profiler (Kineto)
writes: CPU ops ("cpu_op"), their cudaLaunchKernel calls ("cuda_runtime", with
args.correlation) and the kernels those launch ("kernel", same correlation, a
stream each). There is no GPU on these machines: it is synthetic, with timings
chosen so the exposed time is known.
"""
import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from graphs import Encoder
from multiproc import init_gloo, run_ranks
import overlapc.cli as cli
from overlapc.explain import analysis_output, analyze
from overlapc.estimate import costmodel


def _profiled_rank(rank, world_size, port, folder):
    """Train a sharded model under backend="overlapc" (dump_dir set); profile steps 2 and 3."""
    from torch.profiler import ProfilerActivity, profile, schedule

    import overlapc.fsdp

    init_gloo(rank, world_size, port)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = overlapc.fsdp.shard(Encoder(), mesh)
    compiled = torch.compile(model, backend="overlapc",
                             options={"inner": "aot_eager", "dump_dir": os.path.join(folder, "dump")})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 6, 32), torch.randn(4, 6, 8)
    path = os.path.join(folder, f"trace{rank}.json")
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(path)) as prof:
        for _ in range(3):
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    return path


def test_gloo_trace_of_a_compiled_step(tmp_path, capsys):
    paths = run_ranks(_profiled_rank, 2, args=(str(tmp_path),), timeout=240)
    dump = str(tmp_path / "dump")
    sequences = []
    for rank, path in enumerate(paths):
        result = analyze.analyze(path, dump)
        assert (result.format, result.rank, [s.step for s in result.steps]) == ("cpu", rank, [1, 2])
        expected = {}
        for graph in ("fw_0", "bw_0"):
            with open(os.path.join(dump, f"rank{rank}", graph, "report.json")) as source:
                expected[graph] = json.load(source)["collectives"]
        for step in result.steps:
            rows = [m for m in result.collectives if m.step == step.step]
            # every dumped collective measured once per step, in issue order, with module and reason
            assert [(m.graph, m.name, m.kind) for m in rows] == [
                (g, r["name"], r["kind"]) for g in ("fw_0", "bw_0") for r in expected[g]]
            assert [r.graph for r in step.graphs] == ["fw_0", "bw_0"] and step.estimated_step_ms > 0
            assert all(0 < r.exposed_ms < r.measured_ms < step.step_ms for r in step.graphs)
            assert sum(r.exposed_ms for r in step.graphs) == pytest.approx(sum(m.exposed_ms for m in rows))
            for run in step.graphs:   # where the time went, measured and estimated
                assert run.issue_ms == pytest.approx(sum(m.issue_ms for m in rows if m.graph == run.graph))
                assert run.rest_ms == pytest.approx(run.measured_ms - run.exposed_ms - run.issue_ms)
                assert run.estimated_ms == pytest.approx(
                    run.estimated_compute_ms + run.estimated_issue_ms + run.estimated_exposed_ms)
            assert all(m.module and m.reason and m.duration_ms > 0 and m.issue_ms > 0 for m in rows)
            assert 0 < step.exposed_ms < step.step_ms
            assert sum(m.exposed_ms for m in rows) == pytest.approx(step.exposed_ms, rel=0.10)
        sequences.append([(m.name, m.kind) for m in result.collectives])
    assert sequences[0] == sequences[1]

    assert _analyze(paths[0], dump, "json") == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == analyze.SCHEMA and len(document["steps"]) == 2
    assert _analyze(paths[0], dump, "text") == 0
    text = capsys.readouterr().out
    assert "step 1:" in text and "exposed communication" in text and "fw_0" in text

    events = analysis_output.timeline(analyze.analyze(paths[0], dump))["traceEvents"]
    for pid in (1, 2):   # every matched collective measured and estimated, once per step
        assert sum(1 for e in events if e["ph"] == "X" and e["pid"] == pid and e["cat"] == "comm"
                   and e["args"]["graph"]) == 2 * sum(len(expected[g]) for g in expected)

    lines = analysis_output.comparison_text(analyze.analyze(paths[0], dump)).splitlines()   # what `make demo` prints
    assert lines[0].startswith("step 1: measured ") and "estimated" in lines[0]
    assert lines[1].startswith("  fw_0: measured ") and lines[2].startswith("  bw_0: measured ")
    assert "issuing " in lines[1] and "compute (the rest) " in lines[1]
    assert lines[-1].startswith("median of 2 steps: measured ")
    analysis = analyze.analyze(paths[0], dump)
    with_outside = analysis_output.comparison_text(analysis, outside_ms=1.5).splitlines()
    graphs = analysis.steps[0].estimated_step_ms
    assert f"estimated {graphs + 1.5:.1f} ms = graphs {graphs:.1f} + outside 1.5 " in with_outside[0]


def _analyze(trace, dump=None, fmt="text", profile=None, timeline=None) -> int:
    """``overlapc analyze`` with these flags, in-process; its exit code."""
    return cli.main(["analyze", trace, *(["--dump", dump] if dump else []), "--format", fmt,
                     *(["--profile", profile] if profile else []), *(["--timeline", timeline] if timeline else [])])


# -- a synthetic CUDA-format trace -----------------------------------------------------------------

def _cuda_trace() -> dict:
    """One step: a forward with an all-gather overlapping one matmul partly, then a backward
    on autograd's device thread (tid 2, as CUDA runs it) with a reduce-scatter and an
    all-reduce (another group) running at once, the all-reduce's tail under a matmul.
    Exposed (us): all-gather 100; reduce-scatter 40 + 60/2 = 70; all-reduce 60/2 + 20 = 50."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}}]
    cpu, correlation = [], [0]

    def op(name, ts, dur, kernel=None, tid=1, cat="cpu_op"):
        cpu.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur})
        if kernel is not None:
            correlation[0] += 1
            kname, begin, length, stream = kernel
            runtime = ("cuda_driver", "cuLaunchKernelEx") if kname.startswith("nccl") else \
                ("cuda_runtime", "cudaLaunchKernel")   # NCCL launches through the driver API
            cpu.append({"ph": "X", "cat": runtime[0], "name": runtime[1], "pid": 1, "tid": tid,
                        "ts": ts + 1, "dur": dur - 2, "args": {"correlation": correlation[0]}})
            events.append({"ph": "X", "cat": "kernel", "name": kname, "pid": 0, "tid": stream, "ts": begin,
                           "dur": length, "args": {"correlation": correlation[0], "stream": stream, "device": 0}})

    op("ProfilerStep#0", 0, 1000, cat="user_annotation")
    # CUDA traces repeat the step's annotation on the device's timeline (seen on an H200, torch 2.11)
    events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#0", "pid": 0, "tid": 7,
                   "ts": 40, "dur": 580})
    op("CompiledFunction", 10, 45)
    op("_c10d_functional::all_gather_into_tensor", 20, 10, ("ncclDevKernel_AllGather_RING_LL", 40, 200, 20))
    op("aten::mm", 30, 5, ("sm90_xmma_gemm_f32f32", 50, 100, 7))
    op("_c10d_functional::wait_tensor", 45, 2)
    op("aten::mm", 50, 5, ("sm90_xmma_gemm_f32f32", 250, 100, 7))
    op("CompiledFunctionBackward", 58, 42, tid=2)
    op("_c10d_functional::reduce_scatter_tensor", 60, 10, ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
                                                            360, 100, 20), tid=2)
    op("_c10d_functional::all_reduce", 70, 10, ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 400, 100, 24), tid=2)
    op("aten::mm", 80, 5, ("sm90_xmma_gemm_f32f32", 480, 120, 7), tid=2)
    op("_c10d_functional::wait_tensor", 90, 2, tid=2)
    op("_c10d_functional::wait_tensor", 95, 2, tid=2)
    return {"traceEvents": events + cpu, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 8}}


def _cuda_dump(folder):
    graphs = {"fw_0": [("all_gather_into_tensor", "all_gather", 1, 3)],
              "bw_0": [("reduce_scatter_tensor", "reduce_scatter", 1, 5), ("all_reduce", "all_reduce", 2, 4)]}
    for name, rows in graphs.items():
        graph = folder / name
        graph.mkdir(parents=True)
        (graph / "report.json").write_text(json.dumps({
            "schema": "overlapc.report/1", "summary": {"step_ms_after": 0.25, "exposed_ms_after": 0.1},
            "collectives": [{"name": n, "kind": k, "group": "0" if k != "all_reduce" else "1", "nbytes": 1 << 20,
                             "module": "layers.0", "issue_after": i, "wait_after": w, "comm_ms": 0.1,
                             "exposed_ms": 0.05, "reason": "", "issue_reason": "inputs ready",
                             "wait_reason": "before consumer", "start_ms": 0.01 * i, "end_ms": 0.01 * i + 0.1}
                            for n, k, i, w in rows]}))


def test_cuda_format_trace(tmp_path):
    _cuda_dump(tmp_path / "dump")
    result = analyze.analyze(_cuda_trace(), str(tmp_path / "dump"))
    (step,) = result.steps
    assert result.format == "cuda"
    assert [(r.graph, r.measured_ms, r.exposed_ms) for r in step.graphs] == [
        ("fw_0", 0.045, pytest.approx(0.1)), ("bw_0", 0.042, pytest.approx(0.12))]
    got = {m.kind: (m.graph, m.order, m.duration_ms, m.exposed_ms, m.reason) for m in result.collectives}
    assert got == {"all_gather": ("fw_0", 0, pytest.approx(0.2), pytest.approx(0.1),
                                  "inputs ready; before consumer"),
                   "reduce_scatter": ("bw_0", 0, pytest.approx(0.1), pytest.approx(0.07),
                                      "inputs ready; before consumer"),
                   "all_reduce": ("bw_0", 1, pytest.approx(0.1), pytest.approx(0.05),
                                  "inputs ready; before consumer")}
    assert step.exposed_ms == pytest.approx(0.22)
    assert sum(m.exposed_ms for m in result.collectives) == pytest.approx(step.exposed_ms, rel=0.10)
    assert (step.estimated_step_ms, step.estimated_exposed_ms) == (0.5, 0.2)


def test_timeline_puts_measured_spans_beside_the_estimated_ones(tmp_path):
    _cuda_dump(tmp_path / "dump")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_cuda_trace()))
    out = tmp_path / "timeline.json"
    assert _analyze(str(path), str(tmp_path / "dump"), timeline=str(out)) == 0
    document = json.loads(out.read_text())
    assert document["otherData"]["schema"] == analysis_output.TIMELINE_SCHEMA
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(1, 0): "compute", (1, 1): "communication", (2, 0): "compute", (2, 1): "communication"}
    spans = {(e["pid"], e["cat"], e["name"]): (e["ts"], e["dur"]) for e in document["traceEvents"] if e["ph"] == "X"}
    # measured: the graph run, the start op, the wait, the NCCL kernel (us from the step's start)
    assert spans[1, "graph", "fw_0"] == (10, 45) and spans[1, "graph", "bw_0"] == (58, 42)
    assert spans[1, "issue", "issue all_gather_into_tensor"] == (20, 10)
    assert spans[1, "comm", "all_gather_into_tensor"] == (40, 200)
    assert spans[1, "exposed", "wait all_gather_into_tensor"] == (45, pytest.approx(100))
    assert spans[1, "comm", "all_reduce"] == (400, 100)
    # estimated: each run as long as its estimate, placed at the measured run's start; the
    # collectives where the dump's simulation runs them (start_ms, end_ms), exposure at their end
    assert spans[2, "graph", "fw_0"] == (10, 250) and spans[2, "graph", "bw_0"] == (58, 250)
    assert spans[2, "comm", "all_gather_into_tensor"] == (20, 100)         # 10 + 0.01 ms, 0.1 ms long
    assert spans[2, "comm", "all_reduce"] == (pytest.approx(78), pytest.approx(100))   # 58 + 0.02 ms
    assert spans[2, "exposed", "wait all_gather_into_tensor"] == (pytest.approx(70), 50)   # ends at 120 us
    assert _analyze(str(path), str(tmp_path / "dump"), timeline=str(tmp_path / "no" / "t.json")) == 2


def test_cuda_trace_without_dump_lists_ops_by_kind():
    result = analyze.analyze(_cuda_trace())
    assert [(m.graph, m.name, m.kind) for m in result.collectives] == [
        ("", "_c10d_functional::all_gather_into_tensor", "all_gather"),
        ("", "_c10d_functional::reduce_scatter_tensor", "reduce_scatter"),
        ("", "_c10d_functional::all_reduce", "all_reduce")]
    assert result.steps[0].estimated_step_ms is None


def test_bad_input(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{")
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    for name, message in (("x.json", "is not JSON"), ("empty.json", "no communication ops"),
                          ("missing.json", "cannot read trace")):
        assert _analyze(str(tmp_path / name)) == 2
        assert message in capsys.readouterr().err
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_cuda_trace()))
    assert _analyze(str(path), str(tmp_path / "nodump")) == 2
    assert "no dump folder" in capsys.readouterr().err
    (tmp_path / "bad" / "fw_0").mkdir(parents=True)
    (tmp_path / "bad" / "fw_0" / "report.json").write_text('{"collectives": [{"kind": "all_gather"}]}')
    assert _analyze(str(path), str(tmp_path / "bad")) == 2
    assert "is not an overlapc report.json" in capsys.readouterr().err


def test_profile_reestimates_matched_collectives(tmp_path):
    _cuda_dump(tmp_path / "dump")
    trace = _cuda_trace()
    trace["distributedInfo"]["pg_config"] = [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 8},
                                             {"pg_name": "1", "pg_desc": "mesh_replicate", "pg_size": 2}]
    result = analyze.analyze(trace, str(tmp_path / "dump"), "h100:ib,1=nvlink")
    got = {m.kind: m.estimated_ms for m in result.collectives}
    ib, nvlink = costmodel.LINKS["ib"], costmodel.LINKS["nvlink"]
    assert got["all_gather"] == pytest.approx(ib.latency_us * 1e-3 + (1 << 20) * 7 / 8 / (ib.gbps * 1e9) * 1e3)
    assert got["all_reduce"] == pytest.approx(nvlink.latency_us * 1e-3 + (1 << 20) * 2 * 1 / 2
                                              / (nvlink.gbps * 1e9) * 1e3)
    # a link's per-kind latency is part of every collective's time, as in costmodel.collective_ms
    slow = costmodel.Profile(costmodel.DEVICES["cpu"], dataclasses.replace(ib, per_kind=(
        ("all_gather", ib.gbps, ib.latency_us + 300.0),)))
    slower = {m.kind: m.estimated_ms for m in analyze.analyze(trace, str(tmp_path / "dump"), slow).collectives}
    assert slower["all_gather"] == pytest.approx(got["all_gather"] + 0.3)

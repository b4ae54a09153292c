"""Compute overlapc places between a collective's start and its wait stays there in the
code Inductor generates (``overlapc.backend.inductor_order.window_breaks``), for CPU (C++ kernels)
and CUDA (a fake H100, in a process of its own: ``python tests/test_inductor_windows.py
SPECS.json OUT.json``).

Graphs: PyTorch's "reorder compute for overlap" graph (test_compute_comm_reordering.py:
all_reduce(a); a @ a; relu; ...; all_reduce(f); ...), two pipelined reduce-scatter pieces
whose norms Inductor would fuse across a wait, and random DAGs of mm / add / relu
with all-gathers, all-reduces and reduce-scatters on the fake process group. Each is
scheduled by overlapc as Inductor's post-grad pass under overlapc's Inductor patches; the
windows Inductor lowered must be the ones overlapc scheduled, and none may break. A control
shows the check catching Inductor's peak-memory reordering (which overlapc turns off)
moving a window's kernels out; small hand-written wrappers pin down each of the check's
rules.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:        # run as a script for the CUDA case
    sys.path.insert(0, str(HERE.parent))

from overlapc.backend import inductor_order  # noqa: E402

F = torch.ops._c10d_functional
WORLD = 8
N = 32                                       # every value is N x N
KINDS = ("mm", "add", "relu", "all_gather", "all_reduce", "reduce_scatter")


# ---------------------------------------------------------------- graphs

def upstream(a):
    """test_compute_comm_reordering.py's graph, with functional collectives on group "0"."""
    ar = F.wait_tensor(F.all_reduce(a, "sum", "0"))
    g = torch.matmul(a, a)
    c = torch.relu(a)
    d = torch.matmul(c, c)
    f = d * c * ar
    fr = F.wait_tensor(F.all_reduce(f, "sum", "0"))
    return (torch.matmul(d + ar + fr, g),)


def hoisted_gather(x, w1, w2):
    """Two layers whose weights are all-gathered: overlapc issues the second gather before
    the first layer's compute, so that compute is the gather's window."""
    h = torch.relu(x @ F.wait_tensor(F.all_gather_into_tensor(w1[: N // WORLD], WORLD, "0")))
    h = torch.relu(h @ h + h)
    return (h @ F.wait_tensor(F.all_gather_into_tensor(w2[: N // WORLD], WORLD, "0")),)


def pipelined_norms(x, w, v, b):
    """Two reduce-scatters of matmul outputs (a pipelined block's pieces); each piece's
    wait feeds a pointwise add of the same row of ``b`` (a norm), and the first norm feeds
    a matmul, which overlapc puts in the second reduce-scatter's window. The two adds share
    an input and depend on neither other: Inductor fuses such kernels (horizontally)."""
    r1 = F.reduce_scatter_tensor(x @ w, "sum", WORLD, "0")
    r2 = F.reduce_scatter_tensor(v @ w, "sum", WORLD, "0")
    n1 = F.wait_tensor(r1) + b[0]
    m = n1 @ v
    return m, F.wait_tensor(r2) + b[0]


@st.composite
def dags(draw):
    """A random DAG over two N x N inputs: per step an op and the earlier values it reads."""
    steps = []
    for index in range(draw(st.integers(3, 9))):
        kind = draw(st.sampled_from(KINDS))
        steps.append([kind, draw(st.integers(0, index + 1)), draw(st.integers(0, index + 1))])
    return steps


def dag(steps):
    """The function ``steps`` describe; it returns every value nothing else reads."""
    def fn(x, y):
        values = [x, y]
        for kind, i, j in steps:
            a, b = values[i], values[j]
            if kind == "mm":
                out = a @ b
            elif kind == "add":
                out = a + b
            elif kind == "relu":
                out = torch.relu(a)
            elif kind == "all_gather":
                out = F.wait_tensor(F.all_gather_into_tensor(a[: N // WORLD], WORLD, "0"))
            elif kind == "all_reduce":
                out = F.wait_tensor(F.all_reduce(a, "sum", "0"))
            else:
                out = F.wait_tensor(F.reduce_scatter_tensor(a, "sum", WORLD, "0")).repeat(WORLD, 1)
            values.append(out)
        read = {k for _, i, j in steps for k in (i, j)}
        return tuple(v for k, v in enumerate(values) if k >= 2 and k not in read)
    return fn


def traced(fn, inputs: int):
    from torch.fx.experimental.proxy_tensor import make_fx
    torch.manual_seed(0)
    return make_fx(fn)(*[torch.randn(N, N) for _ in range(inputs)])


CASES = {"upstream": (upstream, 1), "hoisted_gather": (hoisted_gather, 3),    # function, inputs
         "pipelined_norms": (pipelined_norms, 4)}


def conformance_graph(name: str):
    """The conformance case ``name`` (tests/conformance_cases.py) traced with Inductor's
    decompositions (as AOTAutograd hands graphs to Inductor), its outputs a tuple."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    import conformance_cases as cc
    case = next(c for c in cc.CASES if c.name == name)

    def fn(*args):
        out = case.fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return make_fx(fn, tracing_mode="fake", decomposition_table=select_decomp_table())(*case.inputs())


def graph_of(spec):
    """A spec ("upstream", "hoisted_gather", "pipelined_norms", a DAG's steps, or
    {"conformance": case name, "options": ...}) as a make_fx graph."""
    if isinstance(spec, dict):
        return conformance_graph(spec["conformance"])
    if isinstance(spec, str):
        return traced(*CASES[spec])
    return traced(dag(spec), 2)


def options_of(spec) -> dict:
    """The overlapc options a spec is compiled with: a conformance spec's own, else ``OPTIONS``."""
    return {**spec["options"], "on_error": "raise"} if isinstance(spec, dict) else OPTIONS


# ---------------------------------------------------------------- compiling and reading

def compile_and_read(gm, options: dict, extra_patches: dict | None = None, fake=None, inference: bool = False) -> dict:
    """Compile ``gm`` with Inductor (overlapc's schedule as its post-grad pass, under
    overlapc's Inductor patches and ``extra_patches``) and return the wrapper code, the
    windows overlapc scheduled and what ``inductor_order.capture`` recorded, as JSON-able
    lists. ``fake``: the ``fake_h100()`` this runs inside (own process only): compiled for
    CUDA, its wrapper read from ``fake.codes``. ``inference``: compiled as an inference
    graph (Inductor's post-grad passes differ)."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code

    import overlapc
    from overlapc.backend import SchedulePass
    from overlapc.torch_compat import inductor_patches

    scheduled = []
    schedule = SchedulePass(overlapc.OverlapConfig.from_options(options),
                            lambda record: scheduled.append(inductor_order.fx_windows(record.gm)))
    patches = {**inductor_patches(), "post_grad_custom_post_pass": schedule, "fx_graph_cache": False,
               **(extra_patches or {})}
    if fake is not None:
        from overlapc.backend.cuda_capture import on_cuda
        gm, inputs = on_cuda(gm)
    else:
        inputs = [torch.randn(n.meta["val"].shape).to(n.meta["val"].dtype)
                  for n in gm.graph.find_nodes(op="placeholder")]
    with inductor_order.capture() as lowered, torch._inductor.config.patch(patches):
        if fake is None:
            _, codes = run_and_get_code(lambda: compile_fx_inner(gm, inputs, is_inference=inference))
        else:
            compile_fx_inner(gm, inputs, is_inference=inference)
            codes = fake.codes
    (scheduled,), (lowered,) = scheduled, lowered
    return {"code": codes[-1], "scheduled": [dataclasses.asdict(w) for w in scheduled],
            "lowered": [dataclasses.asdict(w) for w in lowered.windows], "buffers": dict(lowered.buffers)}


def windows(result: dict) -> list[inductor_order.Window]:
    """The windows Inductor lowered, from ``compile_and_read``'s result (JSON or not)."""
    return [inductor_order.Window(**{key: tuple(v) if isinstance(v, list) else v for key, v in fields.items()})
            for fields in result["lowered"]]


def breaks(result: dict) -> list[str]:
    return inductor_order.window_breaks(inductor_order.events(result["code"]), windows(result), result["buffers"])


def assert_windows_hold(result: dict) -> None:
    """The windows Inductor lowered are the ones overlapc scheduled, and none breaks."""
    assert result["lowered"] == result["scheduled"], "a post-grad pass after overlapc's moved compute"
    found = breaks(result)
    assert found == [], "\n".join([*found, result["code"][result["code"].find("def call"):]])


# ---------------------------------------------------------------- the check on code written by hand

WRAPPER = """
def call(args):
    x, w = args
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(w, 8, '0')
    buf1 = empty_strided_cpu((32, 32), (32, 1), torch.float32)
    extern_kernels.mm(x, x, out=buf1)
    buf2 = empty_strided_cpu((32, 32), (32, 1), torch.float32)
    cpp_fused_relu_0(x, buf2)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    buf3 = empty_strided_cpu((32, 32), (32, 1), torch.float32)
    extern_kernels.mm(buf2, buf0, out=buf3)
    buf4 = buf0; del buf0  # reuse
    cpp_fused_relu_0(buf3, buf4)
    return (buf4, buf1)
"""
HAND_WINDOWS = [inductor_order.Window("all_gather_into_tensor", "all_gather", ("mm", "relu"), ("mm",), ("relu",))]
HAND_BUFFERS = {"buf0": "all_gather_into_tensor", "buf1": "mm", "buf2": "relu", "buf3": "mm_1", "buf4": "relu_1"}


def _move(code: str, line: str, after: str) -> str:
    """``code`` with the line holding ``line`` moved to just after the line holding ``after``."""
    lines = code.splitlines()
    moved = lines.pop(next(i for i, text in enumerate(lines) if line in text))
    at = next(i for i, text in enumerate(lines) if after in text)
    return "\n".join([*lines[:at + 1], moved, *lines[at + 1:]])


def _hand_breaks(code: str, buffers=HAND_BUFFERS) -> list[str]:
    return inductor_order.window_breaks(inductor_order.events(code), HAND_WINDOWS, buffers)


def test_buffer_writes_are_the_first_uses_and_reuses():
    events = inductor_order.events(WRAPPER)
    assert [(e.op, e.writes) for e in events if e.kind == "compute"] == [
        ("extern_kernels.mm", ("buf1",)), ("cpp_fused_relu_0", ("buf2",)), ("extern_kernels.mm", ("buf3",)),
        ("cpp_fused_relu_0", ("buf4",))]          # buf4 = buf0  # reuse: a new buffer


def test_a_window_kept_moved_or_lost_is_told_apart():
    assert _hand_breaks(WRAPPER) == []
    mm_after = _move(WRAPPER, "out=buf1", "wait_tensor")
    (moved,) = _hand_breaks(mm_after)
    assert moved.startswith("all_gather all_gather_into_tensor (line 4): moved: extern_kernels.mm") \
        and moved.endswith("computing ['mm']) runs after its wait")
    relu_first = _move(WRAPPER, "cpp_fused_relu_0", "x, w = args")
    assert [b.split(": ")[1] for b in _hand_breaks(relu_first)] == ["moved"]      # deferrable only after the wait
    both_after = _move(mm_after, "cpp_fused_relu_0", "out=buf1")
    assert [b.split(": ")[1] for b in _hand_breaks(both_after)] == ["lost", "moved"]
    said = inductor_order.fused_out(inductor_order.events(both_after), HAND_WINDOWS, HAND_BUFFERS)
    assert len(said) == 2 and "['relu'] computed by cpp_fused_relu_0" in said[1]


def test_without_buffers_only_a_matmul_window_left_empty_is_lost():
    events = inductor_order.events(_move(_move(WRAPPER, "out=buf1", "wait_tensor"), "cpp_fused_relu_0", "out=buf1"))
    (lost,) = inductor_order.window_breaks(events, HAND_WINDOWS)
    assert ": lost: " in lost and "['mm']" in lost
    assert inductor_order.window_breaks(inductor_order.events(WRAPPER), HAND_WINDOWS) == []
    assert inductor_order.window_breaks(events, HAND_WINDOWS * 2) == [
        "1 collective starts in the code, 2 in the FX graph"]


def test_window_summary_counts_kept_windows_for_gpu_check():
    lowered = inductor_order.Lowered(tuple(HAND_WINDOWS), HAND_BUFFERS)
    kept = inductor_order.window_summary(inductor_order.events(WRAPPER), lowered)
    assert kept == {"with_compute": 1, "kept": 1, "breaks": [], "fused_out": []}
    emptied = _move(_move(WRAPPER, "out=buf1", "wait_tensor"), "cpp_fused_relu_0", "out=buf1")
    lost = inductor_order.window_summary(inductor_order.events(emptied), lowered)
    assert (lost["with_compute"], lost["kept"], len(lost["breaks"]), len(lost["fused_out"])) == (1, 0, 2, 2)


# ---------------------------------------------------------------- CPU

OPTIONS = {"max_in_flight": 2, "max_in_flight_bytes": None, "on_error": "raise"}


def test_upstream_graph_keeps_its_matmul_window_on_cpu(fake_pg):
    """The first all-reduce's window (both matmuls) holds; the second's only compute is an
    add that Inductor computes in its reader after the wait: fused_out names it, and it is
    not a break (no Inductor switch keeps it; overlapc's schedule would have to)."""
    result = compile_and_read(graph_of("upstream"), OPTIONS)
    assert_windows_hold(result)
    first, second = windows(result)
    assert first.matmuls and not second.matmuls
    events = inductor_order.events(result["code"])
    assert inductor_order.compute_between(events)[inductor_order.starts(events)[0].index] >= 2
    said = inductor_order.fused_out(events, windows(result), result["buffers"])
    assert [s for s in said if s.startswith(f"all_reduce {second.start}:")] == [
        f"all_reduce {second.start}: {list(second.nodes)} inlined into kernels outside; none in the window"]


def test_reorder_for_locality_runs_before_overlapcs_pass(fake_pg):
    """Inductor's reorder_for_locality (on by default, for inference graphs; on 2.14 for
    training graphs too with reorder_for_locality_in_training) reorders the post-grad graph
    before the custom post-grad pass that schedules: it changes the order overlapc starts
    from, never the windows overlapc placed, so overlapc leaves it as it is."""
    from torch._inductor import config
    training = "reorder_for_locality_in_training" in config.get_config_copy()     # new in 2.14
    for on in (True, False):
        patches = {"reorder_for_locality": on, **({"reorder_for_locality_in_training": on} if training else {})}
        for inference in (True, False):
            result = compile_and_read(graph_of("upstream"), OPTIONS, patches, inference=inference)
            assert_windows_hold(result)
            assert any(w.matmuls for w in windows(result))


def test_peak_memory_reorder_control_moves_a_window_and_is_caught(fake_pg):
    """With reorder_for_peak_memory left on (overlapc turns it off), the hoisted gather is
    issued after its window's kernels: the check names them as moved."""
    kept = compile_and_read(graph_of("hoisted_gather"), OPTIONS)
    assert_windows_hold(kept)
    assert any(w.matmuls for w in windows(kept))
    moved = compile_and_read(graph_of("hoisted_gather"), OPTIONS, {"reorder_for_peak_memory": True})
    found = breaks(moved)
    assert found and all(": moved: " in b or ": lost: " in b for b in found), found


def test_fx_bucketing_after_overlapcs_pass_is_pinned_off_and_would_be_caught(fake_pg):
    """Inductor's FX all-gather bucketing runs after the custom post-grad pass: left on, it
    merges the two gathers overlapc placed, and the windows lowered differ from those
    scheduled. overlapc's patches pin it (and its reduce-scatter and all-reduce kin) off."""
    from overlapc.torch_compat import inductor_patches
    assert {inductor_patches()[f"bucket_{kind}_fx"] for kind in ("all_gathers", "reduce_scatters", "all_reduces")} \
        == {"none"}
    bucketed = compile_and_read(graph_of("hoisted_gather"), OPTIONS, {"bucket_all_gathers_fx": "all"})
    assert len(bucketed["scheduled"]) == 2 and len(bucketed["lowered"]) == 1


def test_no_fused_kernel_spans_a_wait_and_the_control_loses_the_window(fake_pg):
    """Inductor fuses the two norms of ``pipelined_norms`` into one kernel placed where the
    first stood, pulling the second piece's wait ahead of the matmul overlapc put in its
    window. overlapc's patches refuse fusions across a collective's start or wait
    (``torch_compat._FusionGuard``): the window holds. Without
    the guard (the control), the window is lost and the check names it."""
    kept = compile_and_read(graph_of("pipelined_norms"), OPTIONS)
    assert_windows_hold(kept)
    assert [len(w.matmuls) for w in windows(kept)] == [1, 1]
    unguarded = compile_and_read(graph_of("pipelined_norms"), OPTIONS,
                                 {"_pre_fusion_custom_pass": None, "_post_fusion_custom_pass": None})
    assert unguarded["lowered"] == unguarded["scheduled"]
    (lost, *_) = breaks(unguarded)
    assert f"reduce_scatter {windows(unguarded)[1].start} " in lost and ": lost: " in lost, lost


def test_the_fusion_guard_keeps_a_callers_scheduler_passes_and_ends_with_the_compile(fake_pg):
    """A pre- and post-fusion pass the caller configured still run (after the guard's), and
    once the compile is done Inductor's fusion choices are its own again."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomSchedulerPass
    from torch._inductor.virtualized import V

    from overlapc.torch_compat import inductor_patches

    class Count(CustomSchedulerPass):
        def __init__(self):
            self.calls = 0

        def __call__(self, nodes):
            self.calls += 1
            return nodes

        def uuid(self):
            return "count"

    before, after = Count(), Count()
    with config.patch(_pre_fusion_custom_pass=before, _post_fusion_custom_pass=after):
        patches = inductor_patches()
    assert patches["_pre_fusion_custom_pass"].then is before and patches["_post_fusion_custom_pass"].then is after
    choices = V.choices
    assert_windows_hold(compile_and_read(graph_of("pipelined_norms"), OPTIONS, {
        key: patches[key] for key in ("_pre_fusion_custom_pass", "_post_fusion_custom_pass")}))
    assert (before.calls, after.calls) == (1, 1)
    assert V.choices is choices


# derandomized: the same examples every run. Before the fusion guard, random search
# (2026-11-30, 250 graphs) found 3 whose window Inductor's CPU code lost to a fusion across
# a wait or a start (README, known issues, until then); two of them are pinned here.
# ``degrades``: one draw degrades locally (two collectives placed serially, under "early" as
# under "per-kernel"), an open bug pinned as a strict xfail in tests/test_chains.py
# (test_..._at_the_windows_size_still_degrades); its windows are checked like every other draw's.
@pytest.mark.degrades
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=dags(), max_in_flight=st.sampled_from([1, 2, 3]), budget=st.sampled_from([None, "serial-peak"]),
       issue=st.sampled_from(["early", "per-kernel"]))
@example(steps=[["all_gather", 0, 1], ["relu", 1, 1], ["add", 0, 3], ["reduce_scatter", 0, 4], ["mm", 4, 5],
                ["all_reduce", 6, 2], ["all_gather", 1, 4], ["add", 2, 3]], max_in_flight=2, budget=None,
         issue="early")
@example(steps=[["relu", 1, 1], ["mm", 1, 1], ["all_gather", 0, 0], ["relu", 3, 4], ["reduce_scatter", 2, 0],
                ["add", 1, 5], ["all_gather", 6, 0], ["all_reduce", 1, 1], ["all_gather", 0, 2]],
         max_in_flight=3, budget="serial-peak", issue="early")
def test_random_graphs_keep_their_windows_on_cpu(fake_pg, steps, max_in_flight, budget, issue):
    """on_error="raise": every random graph schedules (a graph that once did not is
    tests/test_chains.py's gated all-gather case)."""
    result = compile_and_read(graph_of(steps), {"max_in_flight": max_in_flight, "max_in_flight_bytes": budget,
                                                "issue": issue, "on_error": "raise"})
    assert_windows_hold(result)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=dags(), budget=st.sampled_from(["graph-peak", None]), bucket=st.sampled_from(["module", 1 << 20]))
def test_random_graphs_with_coalesced_buckets_keep_their_windows_on_cpu(fake_pg, steps, budget, bucket):
    """bucket_op="coalesced" (reduce-scatter and all-reduce buckets as *_coalesced ops, chain
    levels merged) under "graph-peak" or no byte limit: Inductor keeps every window."""
    result = compile_and_read(graph_of(steps), {"bucket": bucket, "bucket_op": "coalesced",
                                                "max_in_flight_bytes": budget, "on_error": "raise"})
    assert_windows_hold(result)


# ---------------------------------------------------------------- CUDA (fake H100, own process)

CUDA_VARIANTS = {"plain": {}, "partitions": {"graph_partition": True, "triton.cudagraphs": True}}


def _run_cuda(specs: list, tmp_path: Path) -> list[dict]:
    pytest.importorskip("triton", reason="Inductor's CUDA code generation needs the triton package")
    specs_file, out = tmp_path / "specs.json", tmp_path / "out.json"
    specs_file.write_text(json.dumps(specs))
    done = subprocess.run([sys.executable, str(Path(__file__)), str(specs_file), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text())


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(random_specs=st.lists(dags(), min_size=4, max_size=4))
def test_windows_hold_in_cuda_code(tmp_path, random_specs):
    """The upstream graph, the hoisted gather and random DAGs (drawn here, compiled in one
    process for a fake H100: Triton kernels and cuBLAS matmuls), each also with cudagraph
    partitions (Inductor's triton.reorder_for_reducing_graph_partitions on, as by default)."""
    specs = ["upstream", "hoisted_gather", "pipelined_norms", *random_specs]
    results = _run_cuda(specs, tmp_path)
    assert len(results) == 2 * len(specs)
    for (spec, variant), result in zip([(s, v) for s in specs for v in CUDA_VARIANTS], results):
        assert result["lowered"] == result["scheduled"], (spec, variant)
        assert breaks(result) == [], (spec, variant, result["code"])
    assert any(w.matmuls for result in results for w in windows(result))
    assert all("def partition_0(" in r["code"] for r in results[1::2])


def _conformance_specs(configs) -> list[dict]:
    """Every case under each of ``configs``: the suite's configurations, and "upstream", each
    case under its upstream setup (issue="per-kernel" for PyTorch's overlap scheduler)."""
    import conformance_cases as cc
    return [{"conformance": case.name, "options": cc.UPSTREAM_SETUPS[case.setup] if config == "upstream"
             else cc.CONFIGS[config]} for case in cc.CASES for config in configs
            if config != "upstream" or case.setup is not None]


@pytest.mark.parametrize("config", ["defaults", "no-buckets", "module", "upstream"])
def test_conformance_graphs_keep_their_windows_on_cpu(fake_pg, config):
    """Every conformance case (tests/conformance_cases.py: PyTorch's own reordering tests,
    re-created) under each of the conformance suite's configurations: Inductor's C++ code
    keeps every window overlapc scheduled."""
    specs = _conformance_specs([config])
    with_compute = 0
    for spec in specs:
        result = compile_and_read(graph_of(spec), options_of(spec))
        assert result["lowered"] == result["scheduled"], spec
        assert breaks(result) == [], (spec, breaks(result))
        with_compute += any(w.nodes for w in windows(result))
    assert len(specs) >= 58 and with_compute >= 20, (len(specs), with_compute)


def test_conformance_graphs_keep_their_windows_in_cuda_code(tmp_path):
    """The same, compiled for a fake H100 (with and without cudagraph partitions) in one process."""
    specs = _conformance_specs(["defaults", "no-buckets", "module", "upstream"])
    results = _run_cuda(specs, tmp_path)
    assert len(results) == 2 * len(specs)
    for (spec, variant), result in zip([(s, v) for s in specs for v in CUDA_VARIANTS], results):
        assert result["lowered"] == result["scheduled"], (spec, variant)
        assert breaks(result) == [], (spec, variant, breaks(result))
    assert sum(any(w.matmuls for w in windows(r)) for r in results) >= 20


def main(argv: list[str]) -> int:
    """``python tests/test_inductor_windows.py SPECS.json OUT.json``: compile each spec for
    a fake H100 under the fake process group, once per ``CUDA_VARIANTS``, and write
    ``compile_and_read``'s results in that order."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from overlapc.backend.cuda_capture import fake_h100

    specs_file, out = argv
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        with fake_h100() as fake:
            results = [compile_and_read(graph_of(spec), options_of(spec), patches, fake=fake)
                       for spec in json.loads(Path(specs_file).read_text()) for patches in CUDA_VARIANTS.values()]
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

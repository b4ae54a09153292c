"""overlapc's memory model agrees with what Inductor's generated code allocates.

For each case (tests/wrapper_replay.py ``CASES``: examples/llama.py's forward and
backward, a make_fx joint forward + backward graph of a SimpleFSDP-sharded MLP,
examples/tp_sp.py's and examples/moe.py's forward and backward), overlapc
schedules each graph with its defaults as Inductor's post-grad pass; Inductor
generates its wrapper for CPU (C++ kernels) and for a fake H100 (Triton); the
wrapper is replayed on meta tensors (``wrapper_replay.replay``) and its
allocation peak compared with ``passes/memory.py``'s ``Liveness`` peak on the
graph the pass returned: within 3%, reached at a node of the kernel (fused
group) that allocated the replay's peak. Each case runs in a process of its own
(the fake H100's patches are process-wide), two side by side.

The replay itself is checked on wrappers whose peak is worked out by hand: one
written here (allocations, ``del``, in-place reuse, views, an extern ``out=``
call, a collective and its wait, stubbed kernels), and one Inductor generates
for a three-op graph.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import wrapper_replay

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.03


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """{(case, graph, device): row of ``wrapper_replay.compile_and_replay``}, every case
    compiled in a process of its own, two at a time."""
    pytest.importorskip("triton", reason="Inductor's CUDA code generation needs the triton package")
    folder = tmp_path_factory.mktemp("wrapper_replay")
    found, pending, running = {}, list(wrapper_replay.CASES), {}
    while pending or running:
        while pending and len(running) < 2:
            case = pending.pop(0)
            out = folder / f"{case}.json"
            running[case] = (out, subprocess.Popen([sys.executable, str(HERE / "wrapper_replay.py"), case, str(out)],
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        case = next(iter(running))
        out, process = running.pop(case)
        log, _ = process.communicate(timeout=900)
        assert process.returncode == 0, f"wrapper_replay.py {case} failed:\n{log[-6000:]}"
        for row in json.loads(out.read_text())["rows"]:
            found[case, row["graph"], row["device"]] = row
    return found


GRAPHS = [(case, graph, device) for case, graphs in
          {"llama": ("fw", "bw"), "joint": ("joint",), "tp_sp": ("fw", "bw"), "moe": ("fw", "bw")}.items()
          for graph in graphs for device in wrapper_replay.DEVICES]


@pytest.mark.parametrize("device", wrapper_replay.DEVICES)
def test_defaults_peak_at_or_under_plain_inductor(rows, device):
    """Issue 39's bar, replayed: over the training step (the larger of the forward's and
    the backward's peaks, each counting its inputs), the code Inductor generates for
    overlapc's default schedule allocates no more than plain Inductor's (its own order,
    peak-memory reordering on), for the CPU and the fake H100."""
    step = {case: max(rows[case, graph, device]["replay"]["peak_bytes"] for graph in ("fw", "bw"))
            for case in ("llama", "llama_plain")}
    assert step["llama"] <= step["llama_plain"], step


@pytest.mark.parametrize("key", GRAPHS, ids=["-".join(k) for k in GRAPHS])
def test_model_peak_is_the_generated_codes_peak(rows, key):
    row = rows[key]
    model, replayed = row["model"], row["replay"]
    assert replayed["peak_bytes"] > 0 and model["peak"] > 0
    ratio = model["peak"] / replayed["peak_bytes"]
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{key}: model {model['peak']} B at {model['node']}, replay {replayed['peak_bytes']} B at "
        f"{replayed['peak_buffer']} {replayed['peak_nodes']}; live in the replay: {replayed['peak_live'][:12]}")
    # the replay's peak buffer belongs to a kernel fused from nodes at one of which the model peaks
    at_peak = [n for n in replayed["peak_nodes"] if model["live"].get(n) == model["peak"]]
    assert at_peak, (f"{key}: the replay peaks at {replayed['peak_buffer']} from {replayed['peak_nodes']} "
                     f"(model there: {[model['live'].get(n) for n in replayed['peak_nodes']]}), "
                     f"the model at {model['node']} ({model['peak']} B)")


# ---------------------------------------------------------------- the replay on wrappers worked out by hand

HAND_WRITTEN = '''
import torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
from torch._C import _cuda_getCurrentRawStream as get_raw_stream
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
async_compile = AsyncCompile()
cpp_fused_0 = async_compile.cpp_pybinding(['float*', 'float*'], """never compiled""")
async_compile.wait(globals())
del async_compile

def call(args):
    arg0_1, arg1_1, arg2_1 = args
    args.clear()
    buf0 = empty_strided_cpu((32, 32), (32, 1), torch.float32)
    extern_kernels.mm(arg0_1, arg1_1, out=buf0)
    del arg1_1
    buf1 = reinterpret_tensor(buf0, (1024, ), (1, ), 0); del buf0  # reuse
    buf2 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf1, 8, '0')
    cpp_fused_0(buf1, buf2)
    torch.ops._c10d_functional.wait_tensor.default(buf2)
    buf3 = empty_strided_cpu((64, 64), (64, 1), torch.float32)
    cpp_fused_0(buf2, buf3)
    del buf2
    del buf1
    buf4 = empty_strided_cpu((16, ), (1, ), torch.float32)
    return (buf3, buf4, )
'''


def test_replay_counts_a_hand_written_wrapper(fake_pg):
    # inputs: 2 x 4 KiB + an unread 64 B; then buf0 4 KiB (buf1 is buf0); buf2 8 x 4 KiB;
    # buf3 16 KiB while buf2, buf1 and arg0_1 (never deleted) are live; buf4 after buf1, buf2 go
    kib = 1024
    inputs = [torch.empty(32, 32), torch.empty(32, 32), torch.empty(16)]
    found = wrapper_replay.replay(HAND_WRITTEN, inputs, {"buf3": ["mm_9", "relu_3"]})
    peak = 4 * kib + 64 + 4 * kib + 32 * kib + 16 * kib
    assert found.peak_bytes == peak
    assert (found.peak_buffer, found.peak_nodes) == ("buf3", ["mm_9", "relu_3"])
    assert sorted(found.peak_live) == sorted([("arg0_1", 4 * kib), ("arg2_1", 64), ("buf0", 4 * kib),
                                              ("buf2", 32 * kib), ("buf3", 16 * kib)])
    # the end: the outputs (the inputs it never deleted went with call's frame)
    assert found.end_bytes == 16 * kib + 64
    lines = HAND_WRITTEN.splitlines()
    assert lines[found.peak_line - 1].strip().startswith("buf3 = empty_strided_cpu")


def test_replay_counts_a_small_inductor_graph():
    # mm -> relu + 1 (Inductor writes it into the mm's buffer, its only reader) -> mm:
    # the input x (16 KiB), the first mm's buffer and the second's: 48 KiB at the second mm
    def f(x):
        return (x @ x).relu().add(1) @ x

    from torch._inductor.compile_fx import compile_fx
    x = torch.randn(64, 64)
    groups = wrapper_replay.BufferGroups()
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(x)
    with wrapper_replay.keep_cpu_wrappers() as codes, groups.recording(), \
            torch._inductor.config.patch(fx_graph_cache=False):
        compile_fx(gm, [x])
    assert len(codes) == 1
    found = wrapper_replay.replay(codes[0], [x], groups.graphs[0])
    assert found.peak_bytes == 3 * 64 * 64 * 4
    assert "# reuse" in codes[0]
    mm_nodes = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert found.peak_nodes and set(found.peak_nodes) & {mm_nodes[-1]}
    assert found.end_bytes == 64 * 64 * 4   # the result


def _held_buffer_graph():
    """A graph where Inductor's buffer pool, left on, holds a dead buffer over a collective:
    y is read first (Inductor's own estimate then has room for a hold), a's buffer dies
    at its sum, the all-gather allocates its own output, and b (the bytes of a, after
    the wait) may take a's buffer (``buf4 = buf1; del buf1  # reuse``)."""
    from graphs import F

    def f(x, w, y):
        t = y.sum()
        a = x @ w
        s = a.sum()
        g = F.wait_tensor(F.all_gather_into_tensor(w, 8, "0"))
        b = x @ (w + g[:8])
        return (b.sum() + s + t,)
    inputs = [torch.randn(16, 8), torch.randn(8, 16), torch.randn(32, 16)]
    return torch.fx.experimental.proxy_tensor.make_fx(f)(*inputs), inputs

@pytest.mark.parametrize("patched", [True, False])
def test_overlapc_compiles_free_each_buffer_where_the_model_does(fake_pg, monkeypatch, patched):
    """Compiled as overlapc compiles (its schedule as the post-grad pass, its Inductor
    patches: ``allow_buffer_reuse`` off), the wrapper frees a's buffer after its last
    reader, as ``passes/memory.py`` counts it: the replayed peak is the model's. With
    the buffer pool left on, the wrapper holds it over the all-gather for b, and the
    replay peaks above the model by a's bytes (what the patch is for). Compiled as
    traced (not re-traced: Inductor's estimate frees inputs named as y is, not arg*)."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    from overlapc import torch_compat
    from overlapc.backend import SchedulePass
    from overlapc.config import OverlapConfig
    if not patched:
        monkeypatch.setattr(torch_compat, "_MEMORY_MODEL_PATCHES", {})
    gm, inputs = _held_buffer_graph()
    models, groups = [], wrapper_replay.BufferGroups()
    patches = {**torch_compat.inductor_patches(), "fx_graph_cache": False, "post_grad_custom_post_pass":
               SchedulePass(OverlapConfig.from_options({}), lambda r: models.append(wrapper_replay.model_peak(r.gm)))}
    with wrapper_replay.keep_cpu_wrappers() as codes, groups.recording(), torch._inductor.config.patch(patches):
        compile_fx_inner(gm, inputs, cudagraphs=BoxedBool(False))
    found = wrapper_replay.replay(codes[0], inputs, groups.graphs[0])
    a_bytes = 16 * 16 * 4
    assert found.peak_bytes == models[0]["peak"] + (0 if patched else a_bytes), (found, models[0]["peak"])

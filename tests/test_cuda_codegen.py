"""Inductor's CUDA code keeps overlapc's order: checked without a GPU, for a fake H100.

Each case (tests/fake_cuda.py: the Llama example sharded over a fake group of 8,
and a TP+SP block with its collectives chunked in 4) traces one training step
on CPU, re-traces forward and backward on fake CUDA tensors and compiles them
with Inductor's CUDA backend, overlapc's schedule running as Inductor's
post-grad pass under overlapc's Inductor patches, in a process of its own (the
fakes are process-wide). The wrapper code that comes back (Python launching
Triton kernels, cuBLAS matmuls and the collectives) is read with
``overlapc.backend.inductor_order`` and checked against the schedule overlapc placed:

- every collective started in the same order and kinds as scheduled, and waited;
- all-gathers started in the order of their first use (consumer order);
- never more than ``max_in_flight`` collectives of one kind and group in flight;
- every start overlapc placed before a matmul that precedes its wait still has
  compute between it and its wait in the code (a start put back next to its wait,
  as Inductor's own reorderings do, fails this): ``inductor_order.window_breaks``
  from the code alone; tests/test_inductor_windows.py checks whole windows, node by
  node, on small graphs;

with and without cudagraph partitions. Controls show the checks can fail: on
torch >= 2.14, Inductor's simple_overlap pass (which overlapc turns off) breaks
the in-flight bound; a wait moved up to its start loses the overlap.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from overlapc.backend import inductor_order

HERE = Path(__file__).resolve().parent
MAX_IN_FLIGHT = 2

@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Both cases, each in its own process, run side by side: {case: result JSON}."""
    pytest.importorskip("triton", reason="Inductor's CUDA code generation needs the triton package")
    folder = tmp_path_factory.mktemp("fake_cuda")
    running = {}
    for case in ("llama", "tp_sp"):
        out = folder / f"{case}.json"
        running[case] = (out, subprocess.Popen([sys.executable, str(HERE / "fake_cuda.py"), case, str(out)],
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = {}
    for case, (out, process) in running.items():
        log, _ = process.communicate(timeout=900)
        assert process.returncode == 0, f"fake_cuda.py {case} failed:\n{log[-6000:]}"
        results[case] = json.loads(out.read_text())
    return results


def _graphs(cases, case, variant):
    return [(g["graph"], g, inductor_order.events(g["code"])) for g in cases[case]["variants"][variant]]


def lost_overlap(graph: dict, events: list) -> list[str]:
    """Starts overlapc placed before a matmul ahead of their wait that have no compute
    between start and wait in the code: ``inductor_order.window_breaks`` on the code alone,
    with each scheduled window's matmuls (tests/test_inductor_windows.py checks every
    node of the windows, through the buffers Inductor materialises)."""
    windows = [inductor_order.Window(row["start"], row["kind"], tuple(row["over_matmuls"]),
                                     tuple(row["over_matmuls"])) for row in graph["scheduled"]]
    return inductor_order.window_breaks(events, windows)


def check_order_and_bound(name: str, graph: dict, events: list) -> None:
    starts = inductor_order.starts(events)
    assert [e.collective for e in starts] == [row["kind"] for row in graph["scheduled"]], \
        f"{name}: Inductor's starts differ from overlapc's schedule"
    assert inductor_order.never_waited(events) == [], name
    assert inductor_order.consumer_order_breaks(events) == [], name
    whole = {start.index: row["whole"] for row, start in zip(graph["scheduled"], starts)}
    for kind, group in sorted({(e.collective, e.group) for e in starts}):
        count = inductor_order.max_in_flight(events, kind, group, whole)
        assert count <= MAX_IN_FLIGHT, f"{name}: {count} {kind} in flight in group {group}"


VARIANTS = [pytest.param(case, variant, id=f"{case}-{variant}")
            for case in ("llama", "tp_sp") for variant in ("kept", "partitions")]


@pytest.mark.parametrize("case, variant", VARIANTS)
def test_cuda_wrapper_keeps_start_order_consumer_order_and_bound(cases, case, variant):
    graphs = _graphs(cases, case, variant)
    assert [name for name, _, _ in graphs] == ["fw", "bw"]
    for name, graph, events in graphs:
        check_order_and_bound(f"{case} {variant} {name}", graph, events)
    forward, backward = graphs[0][2], graphs[1][2]
    assert inductor_order.starts(backward, "reduce_scatter")
    if case == "llama":                                         # the bound is reached, not just kept
        assert inductor_order.max_in_flight(forward, "all_gather") == MAX_IN_FLIGHT
    if variant == "partitions":
        assert all("def partition_0(" in graph["code"] for _, graph, _ in graphs)
        assert any(e.where.startswith("partition_") for _, _, events in graphs for e in events)


@pytest.mark.parametrize("case, variant", VARIANTS)
def test_cuda_wrapper_keeps_compute_between_each_hoisted_start_and_its_wait(cases, case, variant):
    """Both cases. In the chunked TP+SP block Inductor fused the norms of two pipelined
    reduce-scatter pieces across the second piece's wait, and 5 of 30 windows per graph lost
    their matmuls, until overlapc's patches refused fusions across a collective's start or
    wait (``torch_compat._FusionGuard``)."""
    graphs = _graphs(cases, case, variant)
    hoisted = sum(bool(row["over_matmuls"]) for _, graph, _ in graphs for row in graph["scheduled"])
    assert hoisted >= 4                                         # the schedule overlaps something to keep
    lost = {name: lost_overlap(graph, events) for name, graph, events in graphs}
    assert lost == {"fw": [], "bw": []}


@pytest.mark.parametrize("variant", ["kept", "partitions"])
def test_every_window_of_the_llama_keeps_its_compute(cases, variant):
    """Node by node (``inductor_order.window_summary``: the FX nodes between each start
    and its wait against the kernels that materialise them in the code), every window
    of the Llama's forward and backward that holds compute keeps it in the CUDA code,
    and no kernel of a window runs outside it."""
    for graph in cases["llama"]["variants"][variant]:
        windows = graph["windows"]
        assert windows["breaks"] == [], (graph["graph"], windows["breaks"])
        assert windows["kept"] == windows["with_compute"] >= 4, (graph["graph"], windows)


@pytest.mark.parametrize("variant", ["kept", "partitions"])
def test_every_window_of_the_chunked_forward_keeps_its_compute(cases, variant):
    """The TP+SP block's forward, node by node, as for the Llama. (Its backward keeps every
    matmul window, above; there a cat of chunked pieces, a copy, is computed by Inductor in
    its reader, after later waits: ``window_summary`` names it.)"""
    forward = cases["tp_sp"]["variants"][variant][0]
    assert forward["graph"] == "fw"
    windows = forward["windows"]
    assert windows["breaks"] == [], windows["breaks"]
    assert windows["kept"] == windows["with_compute"] >= 20, windows


def test_the_tp_sp_case_is_chunked(cases):
    """chunks=4 splits each of the block's all-gathers and reduce-scatters into 4 pieces,
    which the in-flight check counts as one collective."""
    assert cases["tp_sp"]["options"]["chunks"] == 4
    for name, graph, events in _graphs(cases, "tp_sp", "kept"):
        pieces: dict[str, int] = {}
        for row in graph["scheduled"]:
            pieces[row["whole"]] = pieces.get(row["whole"], 0) + 1
        assert len(pieces) >= 4 and set(pieces.values()) == {4}, (name, pieces)
        assert inductor_order.max_in_flight(events, "all_gather") > MAX_IN_FLIGHT   # pieces, not wholes


def test_simple_overlap_control_breaks_the_bound(cases):
    """torch >= 2.14: with Inductor's enable_simple_overlap left on, the in-flight check fails."""
    variants = cases["llama"]["variants"]
    if "simple_overlap" not in variants:
        pytest.skip(f"torch {cases['llama']['torch']} has no enable_simple_overlap")
    counts = [inductor_order.max_in_flight(events, kind, group)
              for _, _, events in _graphs(cases, "llama", "simple_overlap")
              for kind, group in {(e.collective, e.group) for e in inductor_order.starts(events)}]
    assert max(counts) > MAX_IN_FLIGHT


def test_a_wait_moved_to_its_start_is_caught(cases):
    """The overlap check fails when each hoisted start's wait is moved up to right after it."""
    name, graph, events = _graphs(cases, "llama", "kept")[0]
    lines = graph["code"].splitlines()
    moved = lines[:]
    for start in inductor_order.starts(events):
        wait = next(e for e in events if e.kind == "wait" and e.start == start.index)
        text = lines[wait.line - 1]
        moved[wait.line - 1] = ""
        indent = len(lines[start.line - 1]) - len(lines[start.line - 1].lstrip())
        moved[start.line - 1] = lines[start.line - 1] + "\n" + " " * indent + text.strip()
    broken = inductor_order.events("\n".join(moved))
    assert len(lost_overlap(graph, broken)) == sum(bool(row["over_matmuls"]) for row in graph["scheduled"])
    assert inductor_order.max_in_flight(broken) == 1


def test_peak_memory_reorder_control_loses_the_overlap(cases):
    """With Inductor's reorder_for_peak_memory left on (overlapc turns it off), starts go
    back next to their waits: the overlap check fails."""
    lost = [lost_overlap(graph, events) for _, graph, events in _graphs(cases, "llama", "peak_memory_reorder")]
    assert any(lost)


def test_peak_memory_reorder_turned_on_inside_inductor_keeps_order_keeps_the_order(cases):
    """torchtitan graph_trainer's full Inductor pass turns reorder_for_peak_memory back on
    inside overlapc's adapter (torch_compat.inductor_keeps_order): the order, the bound and
    the overlap still hold in the backward, where the control above loses the overlap."""
    for name, graph, events in _graphs(cases, "llama", "peak_memory_reorder_inside_keeps_order"):
        check_order_and_bound(name, graph, events)
        assert lost_overlap(graph, events) == [], name


WRAPPER = """
async_compile = AsyncCompile()
triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', '''
def triton_poi_fused_0(in_ptr0):
    buf9 = torch.ops._c10d_functional.wait_tensor.default(buf0)
''')
def partition_0(args):
    buf3, = args
    args.clear()
    with torch.cuda._DeviceGuard(0):
        triton_poi_fused_0.run(buf3, 16, stream=raw_stream0)
        buf4 = torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default([buf3, buf3], 8, '1')
        buf5 = buf4[0]
        buf6 = buf4[1]
    return (buf5, buf6)
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        buf0 = empty_strided_cuda((64, 8), (8, 1), torch.float32)
        torch.ops._c10d_functional.all_gather_into_tensor_out.default(primals_1, 8, '0', out=buf0)
        buf1 = torch.ops._c10d_functional.reduce_scatter_tensor.default(primals_2, 'sum', 8, '0')
        buf2 = buf0; del buf0  # reuse
        torch.ops._c10d_functional.wait_tensor.default(buf2)
        extern_kernels.mm(reinterpret_tensor(buf2, (8, 64), (1, 8), 0), primals_2, out=buf7)
        (buf5, buf6) = self.partitions[0]([buf7])
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        torch.ops._c10d_functional.all_reduce_.default(buf7, 'sum', '0')
        torch.ops._c10d_functional.wait_tensor.default(buf6)
        buf8 = torch.ops.aten._scaled_dot_product_flash_attention.default(buf5, buf6, buf7)
        torch.ops._c10d_functional.wait_tensor.default(buf1)
        torch.ops._c10d_functional.wait_tensor.default(buf7)
        return (buf8, buf1)
"""


def test_events_follow_aliases_partitions_and_op_variants():
    events = inductor_order.events(WRAPPER)
    brief = [(e.kind, e.op, e.buffer, e.start, e.where) for e in events]
    assert brief == [
        ("start", "all_gather_into_tensor_out", "buf0", 0, "call"),
        ("start", "reduce_scatter_tensor", "buf1", 1, "call"),
        ("wait", "wait_tensor", "buf2", 0, "call"),                 # buf2 = buf0: the out= gather's
        ("compute", "extern_kernels.mm", None, None, "call"),
        ("compute", "triton_poi_fused_0", None, None, "partition_0"),   # the kernel source is not read
        ("start", "all_gather_into_tensor_coalesced", "buf4", 5, "partition_0"),
        ("wait", "wait_tensor", "buf5", 5, "call"),
        ("start", "all_reduce_", "buf7", 7, "call"),                # in place: the input is the output
        ("wait", "wait_tensor", "buf6", 5, "call"),
        ("compute", "aten._scaled_dot_product_flash_attention", None, None, "call"),
        ("wait", "wait_tensor", "buf1", 1, "call"),
        ("wait", "wait_tensor", "buf7", 7, "call"),
        ("output", "return", None, None, "call")]
    assert [e.group for e in inductor_order.starts(events)] == ["0", "0", "1", "0"]
    assert events[3].reads == (0,) and events[9].reads == (5, 7) and events[12].reads == (1,)
    # the coalesced gather stays open until its second output is waited
    assert inductor_order.open_after(events) == [1, 2, 1, 1, 1, 2, 2, 3, 2, 2, 1, 0, 0]
    assert inductor_order.max_in_flight(events) == 3 and inductor_order.max_in_flight(events, "all_gather") == 1
    assert inductor_order.max_in_flight(events, group="0", whole={0: "x", 1: "x", 7: "x"}) == 1
    assert inductor_order.compute_between(events) == {0: 0, 1: 3, 5: 0, 7: 1}
    assert inductor_order.never_waited(events) == []
    assert inductor_order.consumer_order_breaks(events) == []


def test_consumer_order_break_is_named():
    code = """
def call(args):
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(a, 8, '0')
    buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(b, 8, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    extern_kernels.mm(x, buf1, out=buf2)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    extern_kernels.mm(buf2, buf0, out=buf3)
    buf4 = torch.ops._c10d_functional.all_gather_into_tensor.default(c, 8, '0')
    return (buf3,)
"""
    events = inductor_order.events(code)
    (message,) = inductor_order.consumer_order_breaks(events)
    assert message.startswith("all_gather_into_tensor of buf1 (line 4, group 0) is first used at line 6")
    assert "before buf0" in message
    assert [e.buffer for e in inductor_order.never_waited(events)] == ["buf4"]
    assert inductor_order.compute_between(events)[6] == 0 and inductor_order.first_use(events, 6) is None


def test_a_buckets_copy_out_is_not_its_first_use():
    """The copy-out (overlapc.unpack_columns) reads the gathered bucket right after its wait;
    the bucket's first use is the first read of the copy. Here that read (the fused kernel
    at line 9) also reads buf0, so neither gather is used before the other; a read of buf0
    alone after the copy is a break only when the copy's reader comes first."""
    code = """
def call(args):
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(a, 8, '0')
    buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(b, 8, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    buf2 = torch.ops.overlapc.unpack_columns.default(reinterpret_tensor(buf1, (8, 4), (4, 1), 0), [0], [4])
    buf3 = buf2
    triton_per_fused_0.run(buf0, reinterpret_tensor(buf3, (32,), (1,), 0), stream=raw_stream0)
    extern_kernels.mm(buf3, buf0, out=buf4)
    return (buf4,)
"""
    events = inductor_order.events(code)
    assert [(e.kind, e.op, e.reads) for e in events[4:6]] == [
        ("compute", "overlapc.unpack_columns", ()), ("compute", "triton_per_fused_0", (0, 1))]
    assert inductor_order.first_use(events, 1).index == 5
    assert inductor_order.consumer_order_breaks(events) == []
    broken = code.replace("triton_per_fused_0.run(buf0, ", "triton_per_fused_0.run(")
    (message,) = inductor_order.consumer_order_breaks(inductor_order.events(broken))
    assert message.startswith("all_gather_into_tensor of buf1 (line 4, group 0) is first used at line 9")


def test_code_that_is_not_a_python_wrapper_is_refused():
    with pytest.raises(ValueError, match="not Python wrapper code"):
        inductor_order.events('extern "C" void kernel(float* in_ptr0) {}')
    with pytest.raises(ValueError, match="no `call` function"):
        inductor_order.events("def forward(x):\n    return x\n")


def test_fake_h100_restores_everything_it_patched():
    """Inside, torch and Triton see an H100; after, what they saw before (own process)."""
    pytest.importorskip("triton", reason="the fake H100 stubs Triton's driver")
    probe = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import torch._dynamo.device_interface as di
import triton.runtime.driver
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._triton import has_triton
from fake_cuda import fake_h100
driver = sys.modules["triton.runtime.driver"].driver
def seen():
    return (torch.cuda.is_available(), torch.cuda.device_count(), di.get_interface_for_device("cuda").__name__,
            type(driver._active).__name__, FakeTensorMode.avoid_device_init.fget is not None and
            FakeTensorMode().avoid_device_init, has_triton())
before = seen()
with fake_h100():
    inside = seen()
    capability = torch.cuda.get_device_capability()
print(before == seen(), inside, capability, before)
"""
    done = subprocess.run([sys.executable, "-c", probe, str(HERE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    restored, rest = done.stdout.split(" ", 1)
    assert restored == "True", done.stdout
    assert rest.startswith("(True, 1, 'FakeCudaInterface', '_TritonDriverStub', True, True) (9, 0)"), done.stdout

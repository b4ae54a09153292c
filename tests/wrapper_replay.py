"""Replay Inductor's generated wrapper code on meta tensors: what it allocates, without a device.

Contract of ``replay(code, inputs)``:

- ``code`` is the Python wrapper module Inductor generated for one graph (CPU: C++
  kernels launched from Python; CUDA: Triton kernels, as ``tests/fake_cuda.py`` keeps
  it for a fake H100). It is executed as a module with every kernel stubbed: whatever
  ``async_compile`` would build (``triton``, ``cpp_pybinding``, ...) becomes a kernel
  whose call and ``.run`` do nothing. Its ``empty_strided_*`` allocators make meta
  tensors; everything else it calls (``extern_kernels``, fallback aten ops,
  ``torch.ops._c10d_functional.*``, ``overlapc::*``) runs on meta tensors as written.
- ``inputs``: the graph's inputs (tensors of any device: each is replaced by a meta
  tensor of its size, stride and dtype). They count as allocated before ``call``
  starts; the replay holds no reference to them, so they are freed where the wrapper
  drops its last one (a ``del``, or the end of ``call``).
- Counting: a ``TorchDispatchMode`` sees every op the wrapper runs; each storage
  first seen in an op's output counts its ``nbytes`` once (views, ``reinterpret_tensor``
  and ops writing ``out=`` into a known buffer add nothing), and a storage counts
  until Python frees it (``del buf``; ``buf3 = buf1; del buf1  # reuse`` keeps it;
  checked through weak references before every op). Live bytes are read after each
  op's outputs exist and before anything is freed: the peak is the largest live
  total at any op, and the wrapper line running then.
- ``Replay.peak_buffer``: the name the wrapper line running at the peak assigns (the
  buffer allocated there); ``Replay.peak_nodes``: the FX nodes (of the graph Inductor
  lowered) of the scheduler node, fused or not, that writes that buffer, as
  ``BufferGroups`` recorded them while Inductor generated the code. (Inductor's
  ``# Topologically Sorted Source Nodes`` comments name the pre-AOT graph's nodes,
  and none for re-traced graphs, so they are not used.)
- Graph outputs are what ``call`` returns: they stay live to its end.

Nothing here needs a GPU; the fake-CUDA compile (``tests/fake_cuda.py``) does, of
process-wide patches, so ``main`` runs one case per process: ``python
tests/wrapper_replay.py CASE OUT.json`` compiles a model for CPU and for the fake
H100 with overlapc's schedule as Inductor's post-grad pass, evaluates overlapc's
memory model (``passes/memory.py`` ``Liveness``) on the graph the pass returned,
replays both wrappers and writes the numbers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import types
from unittest import mock

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_WRAPPER_FILE = "<inductor wrapper replay>"


@dataclasses.dataclass
class Replay:
    """What one replayed wrapper allocated."""

    peak_bytes: int
    peak_line: int                  # 1-based line of the wrapper running at the peak
    peak_buffer: str                # the buffer allocated at the peak ("" when none is named)
    peak_nodes: list[str]           # FX nodes of the kernel / op group that buffer belongs to
    peak_op: str                    # the op that ran there
    steps: list[tuple[int, str, int]]  # (line, op, live bytes) per op, in run order
    end_bytes: int                  # live when ``call`` returned (its outputs)
    peak_live: list[tuple[str, int]]   # (buffer or input name, bytes) live at the peak, largest first


class _NoKernel:
    """A compiled kernel that does nothing when called or ``.run``."""

    def __call__(self, *args, **kwargs):
        return None

    def run(self, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return _NoKernel()


class _NoCompile:
    """``AsyncCompile`` whose every kernel is ``_NoKernel`` and whose ``wait`` does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait(self, scope):
        return None

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoKernel()


def _meta_empty(size, stride, dtype=None, *args, **kwargs):
    return torch.empty_strided(size, stride, dtype=dtype, device="meta")


def _load(code: str) -> types.ModuleType:
    """The wrapper module, executed with kernels stubbed and meta allocators."""
    import torch._inductor.async_compile as async_compile

    module = types.ModuleType("inductor_wrapper_replay")
    module.__file__ = _WRAPPER_FILE
    # a CUDA wrapper imports the stream getter from torch._C, which a CPU-only build lacks
    # (torch 2.13's CPU wheel): stub it for the import, as get_raw_stream is below
    with mock.patch.object(async_compile, "AsyncCompile", _NoCompile), \
            mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda *args: 0, create=True):
        exec(compile(code, _WRAPPER_FILE, "exec"), module.__dict__)
    for name in [n for n in vars(module) if n.startswith("empty_strided")]:
        setattr(module, name, _meta_empty)
    module.get_raw_stream = lambda *args: 0
    return module


def _wrapper_line() -> int:
    """The line of the wrapper being run (0 outside it)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _WRAPPER_FILE:
            return frame.f_lineno
        frame = frame.f_back
    return 0


class _Counter(TorchDispatchMode):
    """Counts each new storage an op returns until it is freed; keeps the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.born: dict[StorageWeakRef, int] = {}     # storage -> wrapper line that allocated it
        self.bytes = 0
        self.steps: list[tuple[int, str, int]] = []
        self.peak = -1
        self.peak_live: list[tuple[int, int]] = []

    def add(self, tensor: torch.Tensor, line: int) -> None:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in self.live:
            nbytes = tensor.untyped_storage().nbytes()
            self.live[ref] = nbytes
            self.born[ref] = line
            self.bytes += nbytes

    def add_inputs(self, args: list) -> None:
        """Count the graph inputs (their line: -1 - position)."""
        for index, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                self.add(value, -1 - index)
        self.step(0, "inputs")

    def sweep(self) -> None:
        for ref in [r for r in self.live if r.expired()]:
            self.bytes -= self.live.pop(ref)
            del self.born[ref]

    def step(self, line: int, op: str) -> None:
        self.steps.append((line, op, self.bytes))
        if self.bytes > self.peak:
            self.peak = self.bytes
            self.peak_live = sorted(((self.born[r], n) for r, n in self.live.items()), key=lambda x: -x[1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sweep()
        if func in _RETURNS_INPUT:   # the device kernel returns its input; the meta one a new tensor
            out = args[0]
        else:
            out = func(*args, **(kwargs or {}))
        line = _wrapper_line()
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.add(value, line)
        self.step(line, str(func))
        return out


_RETURNS_INPUT = (torch.ops._c10d_functional.wait_tensor.default,)


def meta_like(value):
    """A meta tensor with ``value``'s size, stride and dtype (non-tensors as they are)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def replay(code: str, inputs: list, groups: dict[str, list[str]] | None = None) -> Replay:
    """Run ``code``'s ``call`` on meta copies of ``inputs``; see the module docstring.
    ``groups``: buffer name -> FX node names of the kernel that writes it (``BufferGroups``)."""
    module = _load(code)
    args = [meta_like(v) for v in inputs]
    counter = _Counter()
    counter.add_inputs(args)   # (a loop variable here would keep the last input alive)
    guard = contextlib.nullcontext() if not hasattr(torch.cuda, "_DeviceGuard") else \
        mock.patch.object(torch.cuda, "_DeviceGuard", lambda *a: contextlib.nullcontext())
    with guard, mock.patch.object(torch.cuda, "set_device", lambda *a: None), counter:
        outputs = module.call(args)
        del args
        counter.sweep()
        end = counter.bytes
    del outputs
    peak_index = max(range(len(counter.steps)), key=lambda i: (counter.steps[i][2], -i))
    line, op, peak = counter.steps[peak_index]
    buffer = assigned(code, line)
    names = input_names(code)
    live = [(names[-1 - born] if born < 0 else assigned(code, born), nbytes) for born, nbytes in counter.peak_live]
    return Replay(peak, line, buffer, (groups or {}).get(buffer, []), op, counter.steps, end, live)


_ASSIGNED = re.compile(r"^\s*(\w+) = ")


def assigned(code: str, line: int) -> str:
    """The name line ``line`` (1-based) of ``code`` assigns, "" when it assigns none."""
    lines = code.splitlines()
    found = _ASSIGNED.match(lines[line - 1]) if 0 < line <= len(lines) else None
    return found.group(1) if found else ""


def input_names(code: str) -> list[str]:
    """The names ``call`` unpacks its ``args`` into, in order."""
    found = re.search(r"^\s*([\w, ]+?),? = args\s*$", code, re.MULTILINE)
    return [name.strip() for name in found.group(1).split(",")] if found else []


class BufferGroups:
    """While active, records for each graph Inductor generates code for: buffer name ->
    the FX node names (of the graph Inductor lowered) that the scheduler node writing
    that buffer came from (a fused kernel: every buffer it writes gets the whole group).
    ``graphs``: one such dict per graph, in code-generation order."""

    def __init__(self):
        self.graphs: list[dict[str, list[str]]] = []

    @contextlib.contextmanager
    def recording(self):
        from torch._inductor.graph import GraphLowering
        codegen = GraphLowering.codegen
        groups = self

        def codegen_and_record(lowering, *args, **kwargs):
            result = codegen(lowering, *args, **kwargs)
            groups.graphs.append(scheduler_groups(lowering.scheduler))
            return result

        with mock.patch.object(GraphLowering, "codegen", codegen_and_record):
            yield self


def scheduler_groups(scheduler) -> dict[str, list[str]]:
    """Buffer name -> FX node names of the scheduler node (fused or not) that writes it."""
    groups: dict[str, list[str]] = {}
    for snode in scheduler.nodes:
        names = sorted({origin.name for part in snode.get_nodes() if part.node is not None
                        for origin in part.node.get_origins()})
        for buffer in snode.get_buffer_names():
            groups[buffer] = names
    return groups


# ---------------------------------------------------------------- compile, model and replay one case

def model_peak(gm: torch.fx.GraphModule) -> dict:
    """overlapc's memory model on ``gm`` in its node order: {"peak": bytes, "node": the first
    node where it is reached, "live": {node name: live bytes}}."""
    from overlapc.passes.memory import Liveness
    nodes = list(gm.graph.nodes)
    live = Liveness(nodes).live_bytes(nodes)
    first = max(range(len(live)), key=lambda i: (live[i], -i))
    return {"peak": live[first], "node": nodes[first].name, "live": {n.name: b for n, b in zip(nodes, live)}}


@contextlib.contextmanager
def keep_cpu_wrappers():
    """Yield a list that collects the wrapper source of each graph Inductor lowers for CPU;
    ``GraphLowering.compile_to_module`` keeps the code and builds nothing (as
    ``torch._inductor.utils.get_code`` does: no C++ compiler runs)."""
    from torch._inductor.graph import GraphLowering
    codes: list[str] = []

    def keep_code(lowering):
        wrapper, _kernels = lowering.codegen()
        codes.append(wrapper.value)
        return types.SimpleNamespace(call=lambda *args, **kwargs: None, __file__="<kept>")

    with mock.patch.object(GraphLowering, "compile_to_module", keep_code):
        yield codes


def retrace(gm: torch.fx.GraphModule):
    """(graph, fake inputs): ``gm`` re-traced by make_fx on fake tensors shaped as its
    placeholders (what ``compile_fx_inner`` expects)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    values = [node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder")]
    with FakeTensorMode():
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                  if isinstance(v, torch.Tensor) else v for v in values]
        return make_fx(gm)(*inputs), inputs


def compile_and_replay(graphs: list[tuple[str, torch.fx.GraphModule]], device: str, options: dict,
                       plain: bool = False) -> list[dict]:
    """Per graph ("fw" / "bw" / "joint", gm before Inductor's post-grad passes): compile it
    for ``device`` ("cpu", or "cuda": the fake H100, in a process of its own) with
    overlapc's schedule as Inductor's post-grad pass, evaluate the model on the graph
    the pass returns and replay the wrapper. ``plain``: Inductor alone, as it compiles
    without overlapc (its own settings, peak-memory reordering on; the model is read on
    the graph unscheduled). Returns per graph {"graph", "device", "model": ``model_peak``,
    "replay": ``Replay`` fields as a dict}."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    import fake_cuda
    from overlapc.backend import SchedulePass
    from overlapc.config import OverlapConfig

    cfg = OverlapConfig.from_options({**options, "enabled": False} if plain else options)
    groups = BufferGroups()
    rows = []
    with (fake_cuda.fake_h100() if device == "cuda" else keep_cpu_wrappers()) as kept:
        codes = kept.codes if device == "cuda" else kept
        for number, (kind, gm) in enumerate(graphs):
            models: list[dict] = []
            graph, inputs = fake_cuda.on_cuda(gm) if device == "cuda" else retrace(gm)
            patches = {**({} if plain else fake_cuda._inductor_patches()),
                       "post_grad_custom_post_pass": SchedulePass(cfg, lambda record: models.append(model_peak(record.gm)))}
            with torch._inductor.config.patch(patches), groups.recording():
                compile_fx_inner(graph, inputs, is_backward=kind == "bw", graph_id=number, cudagraphs=BoxedBool(False))
            if len(models) != 1 or len(groups.graphs) != number + 1:
                raise RuntimeError(f"wrapper_replay: graph {kind} gave {len(models)} schedules, expected one")
            rows.append({"graph": kind, "device": device, "model": models[0], "code": codes[-1], "inputs": inputs,
                         "groups": groups.graphs[-1]})
    for row in rows:   # after the fakes are gone: the replay needs none of them
        found = replay(row.pop("code"), row.pop("inputs"), row.pop("groups"))
        row["replay"] = {k: v for k, v in dataclasses.asdict(found).items() if k != "steps"}
    return rows


def joint_graph(dim: int = 64, depth: int = 3, batch: int = 32) -> torch.fx.GraphModule:
    """One train step of a small MLP sharded SimpleFSDP-style (each weight all-gathered
    from its dim-0 shard with the autograd-aware functional collective; its gradient
    reduce-scattered), traced by make_fx into one forward + backward graph with
    Inductor's decompositions: (x, shard_0, ...) -> (loss, grad_0, ...). Needs the
    default process group."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    world = dist.get_world_size()

    def step(x, *shards):
        h = x
        for shard in shards:
            weight = wait_tensor(all_gather_tensor_autograd(shard, 0, dist.group.WORLD))
            h = torch.nn.functional.gelu(h @ weight.t())
        loss = h.square().mean()
        return (loss, *torch.autograd.grad(loss, shards))

    with FakeTensorMode():
        x = torch.randn(batch, dim)
        shards = [torch.randn(dim // world, dim, requires_grad=True) for _ in range(depth)]
        return make_fx(step, decomposition_table=select_decomp_table())(x, *shards)


def case_graphs(case: str) -> list[tuple[str, torch.fx.GraphModule]]:
    """The graphs of one case: "llama" (examples/llama.py), "tp_sp" (examples/tp_sp.py),
    "moe" (examples/moe.py), each one training step's forward and backward as AOTAutograd
    hands them to Inductor; "joint" (``joint_graph``); "gpu_llama": examples/llama.py at
    benchmarks/gpu_check.py's sizes. A case ending in "_plain" has its base case's graphs,
    compiled by Inductor alone (``main``)."""
    import fake_cuda
    case = case.removesuffix("_plain")
    if case == "joint":
        return [("joint", joint_graph())]
    kwargs = {"tp_sp": {"dim": 64, "heads": 8, "hidden": 256, "depth": 2, "seq": 64, "batch": 2},
              "gpu_llama": GPU_LLAMA}.get(case, {})
    model, inputs = fake_cuda._example("llama" if case == "gpu_llama" else case).build(**kwargs)
    return fake_cuda.capture_training_graphs(model, inputs)


CASES = ("llama", "joint", "tp_sp", "moe", "llama_plain")
GPU_LLAMA = {"vocab": 1024, "dim": 1024, "heads": 8, "hidden": 2816, "depth": 4, "batch": 1, "seq": 512}
DEVICES = ("cpu", "cuda")
OPTIONS = {"on_error": "raise"}   # overlapc's defaults otherwise


def main(argv: list[str]) -> int:
    """``python tests/wrapper_replay.py CASE OUT.json``: under the fake process group of
    world size 8, compile CASE's graphs (``case_graphs``: ``CASES``, "gpu_llama",
    "gpu_llama_plain") for CPU and for the fake H100 and write the rows of
    ``compile_and_replay`` as JSON."""
    import json

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    case, out = argv
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            graphs = case_graphs(case)
            rows = [row for device in DEVICES
                    for row in compile_and_replay(graphs, device, OPTIONS, plain=case.endswith("_plain"))]
    finally:
        dist.destroy_process_group()
    with open(out, "w", encoding="utf-8") as sink:
        json.dump({"torch": torch.__version__, "case": case, "rows": rows}, sink)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    sys.exit(main(sys.argv[1:]))

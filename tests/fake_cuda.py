"""A fake H100 for Inductor's CUDA code generation on a machine without a GPU.

``fake_h100()`` is one context manager: inside it, Inductor lowers graphs whose
tensors are (fake) ``cuda`` tensors and generates its CUDA wrapper code (the
Python that launches Triton kernels and calls the collectives), which is kept
instead of being compiled or loaded: ``FakeH100.codes`` holds each graph's
wrapper source in compile order. On exit every patch is undone and every cache
that saw the fake device is cleared.

The patches are process-wide (torch.cuda, Triton's active driver, Dynamo's
device registry), so use this in a process of its own: ``python
tests/fake_cuda.py CASE OUT.json`` compiles one of ``CASES`` there and writes
its wrapper codes; ``tests/test_cuda_codegen.py`` runs that in a subprocess.

Private internals this leans on (names as of torch 2.13 / 2.14.1, triton 3.8 / 3.9):
- ``torch._dynamo.device_interface``: ``device_interfaces`` (the registry
  ``register_interface_for_device`` writes), ``CudaInterface``, and
  ``caching_worker_device_properties``;
- ``torch._C._cuda_cudaCachingAllocator_is_enabled`` and
  ``torch._inductor.output_code.cudagraph_partition_post_compile`` (cudagraph
  partitions check the allocator and wrap each partition in a cudagraph tree);
- ``FakeTensorMode.avoid_device_init`` (a property that asks torch.cuda);
- ``torch.Tensor.__invert__``: its C binding takes a device guard, which a CPU-only
  build has none of for CUDA (replaced by ``torch.bitwise_not``);
- ``functools`` caches in ``torch.utils._triton`` (``has_triton``) and
  ``torch._inductor.utils`` (device properties, GPU type);
- ``triton.runtime.driver.driver._active`` (the stub replaces the CUDA driver,
  whose constructor loads libcuda) and ``triton.backends.compiler.GPUTarget``;
- ``GraphLowering.compile_to_module`` (replaced, as ``torch._inductor.utils.get_code``
  does, by one that keeps the wrapper code and returns a module that does nothing);
- for training graphs (autograd on fake CUDA tensors needs a device): Dynamo with
  ``aot_autograd`` (Inductor's decompositions, its min-cut partitioner) captures forward
  and backward on CPU; ``make_fx`` re-traces each on fake CUDA tensors, and
  ``compile_fx_inner(..., is_backward=...)`` compiles it as ``compile_fx`` would.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import types
from unittest import mock

import torch

H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
    total_memory=80 * 2**30, warp_size=32, max_threads_per_multi_processor=2048,
    max_threads_per_block=1024, regs_per_multiprocessor=65536, shared_memory_per_block=49152,
    shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
    L2_cache_size=50 * 2**20, is_integrated=False, is_multi_gpu_board=False, uuid="fake-h100",
    gcnArchName="NVIDIA H100", clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=5120,
    pci_bus_id=0, pci_device_id=0, pci_domain_id=0)


def _clear_device_caches() -> None:
    """Clear every functools cache that may hold an answer about devices or Triton
    (``has_triton``, device properties, GPU type, ...), and Dynamo's cached properties."""
    import torch._dynamo.device_interface as device_interface
    import torch._inductor.utils as inductor_utils
    import torch.utils._triton as triton_utils

    for module in (triton_utils, inductor_utils):
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    device_interface.caching_worker_device_properties.pop("cuda", None)
    device_interface.caching_worker_current_devices.pop("cuda", None)


class _TritonDriverStub:
    """Triton's active driver, answering what code generation asks (target, device, capability)."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)
        self.utils = types.SimpleNamespace(get_device_properties=lambda device: {
            "max_shared_mem": H100.shared_memory_per_block_optin, "multiprocessor_count": 132,
            "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": H100.clock_rate,
            "mem_clock_rate": H100.memory_clock_rate, "mem_bus_width": H100.memory_bus_width})

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_device_capability(self, device: int = 0):
        return (9, 0)

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True

    def get_active_torch_device(self):
        return torch.device("cuda", 0)


def _fake_interface():
    """A Dynamo device interface for "cuda" that reports the fake H100."""
    from torch._dynamo.device_interface import CudaInterface

    class FakeCudaInterface(CudaInterface):
        class Worker:
            @staticmethod
            def set_device(device: int) -> None:
                pass

            @staticmethod
            def current_device() -> int:
                return 0

            @staticmethod
            def get_device_properties(device=None):
                return H100

        current_device = staticmethod(lambda: 0)
        set_device = staticmethod(lambda device: None)
        device_count = staticmethod(lambda: 1)
        synchronize = staticmethod(lambda device=None: None)
        get_device_properties = staticmethod(lambda device=None: H100)
        exchange_device = staticmethod(lambda device: 0)
        maybe_exchange_device = staticmethod(lambda device: 0)
        memory_allocated = staticmethod(lambda device=None: 0)
        is_bf16_supported = staticmethod(lambda including_emulation=False: True)
        get_raw_stream = staticmethod(lambda device_idx: 0)
        is_available = staticmethod(lambda: True)
        get_compute_capability = staticmethod(lambda device=None: 90)
        is_triton_capable = staticmethod(lambda device=None: True)

    return FakeCudaInterface


class FakeH100:
    """What ``fake_h100()`` yields: ``codes``, the wrapper source of each graph lowered inside."""

    def __init__(self):
        self.codes: list[str] = []


@contextlib.contextmanager
def fake_h100():
    """Fake one H100 (sm_90, 132 SMs) for Inductor's CUDA code generation; restore everything on exit.

    Inside: ``torch.cuda`` reports one available device; Dynamo's "cuda" device interface
    and Triton's active driver are stubs answering device and capability queries; fake
    tensors never initialise a device; ``GraphLowering.compile_to_module`` keeps the
    wrapper code in the yielded ``FakeH100.codes`` and returns a module whose ``call``
    does nothing. Nothing can run on the device: only code generation works (no
    max-autotune, no cudagraph recording)."""
    import torch._dynamo.device_interface as device_interface
    import torch._inductor.output_code as output_code
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode

    triton_driver = importlib.import_module("triton.runtime.driver").driver   # the DriverConfig
    fake = FakeH100()

    def keep_code(self):
        wrapper, _kernels = self.codegen_with_cpp_wrapper() if self.cpp_wrapper else self.codegen()
        fake.codes.append(wrapper.value)
        return types.SimpleNamespace(call=lambda *args, **kwargs: None, __file__="<fake_h100>")

    cuda = torch.cuda
    patches = [
        (cuda, "is_available", lambda: True), (cuda, "device_count", lambda: 1),
        (cuda, "current_device", lambda: 0), (cuda, "set_device", lambda device: None),
        (cuda, "get_device_properties", lambda device=None: H100),
        (cuda, "get_device_capability", lambda device=None: (9, 0)),
        (cuda, "get_device_name", lambda device=None: H100.name),
        (cuda, "is_bf16_supported", lambda including_emulation=True: True),
        (cuda, "_exchange_device", lambda device: 0), (cuda, "_maybe_exchange_device", lambda device: 0),
        (cuda, "synchronize", lambda device=None: None),
        (cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8)),
        (cuda, "set_rng_state", lambda state, device="cuda": None),
        (torch._C, "_cuda_cudaCachingAllocator_is_enabled", lambda: True),
        (output_code, "cudagraph_partition_post_compile", lambda *args, **kwargs: None),
        (FakeTensorMode, "avoid_device_init", property(lambda self: True)),
        (GraphLowering, "compile_to_module", keep_code),
        # a CPU-only build has no CUDA device guard, and the C binding of `~tensor` takes one
        # (torch 2.13's embedding-backward decomposition inverts a mask): go through the op
        (torch.Tensor, "__invert__", lambda self: torch.bitwise_not(self)),
    ]
    device_interface.get_registered_device_interfaces()   # the lazy registration runs now, not inside
    registry = device_interface.device_interfaces
    old_interfaces = {key: registry.get(key) for key in ("cuda", "cuda:0")}
    old_driver = triton_driver._active
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value, create=owner is torch._C))
        stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        try:
            registry.update(dict.fromkeys(old_interfaces, _fake_interface()))
            triton_driver._active = _TritonDriverStub()
            _clear_device_caches()
            yield fake
        finally:
            triton_driver._active = old_driver
            for key, old in old_interfaces.items():
                if old is None:
                    registry.pop(key, None)
                else:
                    registry[key] = old
            _clear_device_caches()


# ---------------------------------------------------------------- training graphs through the fake H100

def capture_training_graphs(model: torch.nn.Module, inputs: tuple) -> list[tuple[str, torch.fx.GraphModule]]:
    """[("fw", gm), ("bw", gm)]: the forward and backward graphs AOTAutograd hands Inductor
    for one training step of ``model`` on CPU (Inductor's decompositions and min-cut
    partitioner), before Inductor's post-grad passes. Attention is traced with the math
    SDPA backend, so the graphs hold no CPU-only attention kernel."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from overlapc.backend import backward_root

    graphs: list[tuple[str, torch.fx.GraphModule]] = []

    def keep(kind: str):
        def compiler(gm, example_inputs):
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), decompositions=select_decomp_table(),
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    torch._dynamo.reset()
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.compile(model, backend=backend, dynamic=False)(*inputs)
        root, said = backward_root(out)
        if root is None:
            raise RuntimeError(f"fake_cuda: {said}")
        root.backward()
    torch._dynamo.reset()
    if [kind for kind, _ in graphs] != ["fw", "bw"]:
        raise RuntimeError(f"fake_cuda: expected one forward and one backward graph, got {[k for k, _ in graphs]}")
    return graphs


def on_cuda(gm: torch.fx.GraphModule):
    """(graph, inputs): ``gm`` re-traced on fake CUDA tensors (every cpu device in its
    arguments rewritten to cuda), with those inputs. Call inside ``fake_h100()``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._pytree import tree_map

    cuda = torch.device("cuda", 0)
    to_cuda = lambda value: cuda if isinstance(value, torch.device) and value.type == "cpu" else value  # noqa: E731
    gm = torch.fx.GraphModule(gm, _copy_graph(gm.graph))   # the captured graph stays as it was
    for node in gm.graph.nodes:
        node.args, node.kwargs = tree_map(to_cuda, node.args), tree_map(to_cuda, node.kwargs)
    gm.recompile()
    mode = FakeTensorMode()
    values = [node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder")]
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=cuda,
                                      requires_grad=False) if isinstance(v, torch.Tensor) else v for v in values]
    with mode:   # factory ops (empty, full, arange on cuda) make fake tensors too
        return make_fx(gm)(*inputs), inputs


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    copied = torch.fx.Graph()
    output = copied.graph_copy(graph, {})
    copied.output(output)
    return copied


_MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution.")


def scheduled_starts(gm: torch.fx.GraphModule) -> list[dict]:
    """Per collective of a scheduled graph, in start order: its kind, the collective it is a
    piece of when chunked (else itself), and the matmuls (never fused away by Inductor) that
    overlapc placed between its start and its first wait."""
    import overlapc

    nodes = list(gm.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    rows = []
    for found in sorted(overlapc.collectives(gm), key=lambda c: position[c.start]):
        end = min((position[w] for w in found.waits), default=len(nodes))
        over = [n.name for n in nodes[position[found.start] + 1:end]
                if n.op == "call_function" and str(n.target).startswith(_MATMULS)]
        rows.append({"kind": found.kind, "start": found.start.name, "over_matmuls": over,
                     "whole": found.start.meta.get("overlapc_piece_of", found.start.name)})
    return rows


def compile_on_fake_h100(graphs: list[tuple[str, torch.fx.GraphModule]], options: dict,
                         config_patches: dict, cudagraph_partitions: bool = False,
                         around=contextlib.nullcontext) -> list[dict]:
    """Compile each captured graph for the fake H100 with overlapc's schedule as Inductor's
    post-grad pass (as the backend runs it) under ``config_patches``, applied inside
    ``around()`` (a caller's context, as graph_trainer's pass runs inside overlapc's
    adapter). Returns per graph {"graph": "fw" | "bw", "code": wrapper source,
    "scheduled": ``scheduled_starts``}."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    from overlapc.backend import SchedulePass
    from overlapc.config import OverlapConfig

    cfg = OverlapConfig.from_options(options)
    results = []
    with fake_h100() as fake:
        for number, (kind, gm) in enumerate(graphs):
            records: list = []
            cuda_gm, inputs = on_cuda(gm)
            patches = {**config_patches, "post_grad_custom_post_pass": SchedulePass(cfg, records.append)}
            if cudagraph_partitions:
                patches.update({"graph_partition": True, "triton.cudagraphs": True})
            before = len(fake.codes)
            with around(), torch._inductor.config.patch(patches):
                compile_fx_inner(cuda_gm, inputs, is_backward=kind == "bw", graph_id=number,
                                 cudagraphs=BoxedBool(cudagraph_partitions))
            if len(fake.codes) != before + 1 or len(records) != 1:
                raise RuntimeError(f"fake_cuda: graph {kind} gave {len(fake.codes) - before} wrappers and "
                                   f"{len(records)} schedules, expected one each")
            results.append({"graph": kind, "code": fake.codes[-1], "scheduled": scheduled_starts(records[0].gm)})
    return results


def _example(name: str):
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"fake_cuda_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inductor_patches() -> dict:
    """overlapc's Inductor patches for the installed torch."""
    import overlapc.backend as backend
    return backend.inductor_patches() if hasattr(backend, "inductor_patches") else dict(backend.INDUCTOR_PATCHES)


MAX_IN_FLIGHT = 2
SIMPLE_OVERLAP = "aten_distributed_optimizations.enable_simple_overlap"   # torch >= 2.14


def case_llama() -> dict:
    """examples/llama.py sharded over the fake group of 8: overlapc's order as Inductor is
    patched to keep it, with cudagraph partitions, and controls the checks must catch:
    Inductor's peak-memory reordering left on, and on torch >= 2.14 its simple_overlap."""
    from overlapc.torch_compat import inductor_keeps_order

    model, inputs = _example("llama").build()
    graphs = capture_training_graphs(model, inputs)
    options = {"max_in_flight": MAX_IN_FLIGHT, "on_error": "raise"}
    patches = _inductor_patches()
    return {"options": options, "variants": {
        "kept": compile_on_fake_h100(graphs, options, patches),
        "partitions": compile_on_fake_h100(graphs, options, patches, cudagraph_partitions=True),
        # controls: the backward is where peak-memory reordering undoes the overlap, the forward
        # where simple_overlap exceeds the bound; each is compiled only there
        "peak_memory_reorder": compile_on_fake_h100(graphs[1:], options, {**patches, "reorder_for_peak_memory": True}),
        # ... turned back on inside torch_compat.inductor_keeps_order (graph_trainer's full
        # Inductor pass under overlapc's adapter): the order must hold
        "peak_memory_reorder_inside_keeps_order": compile_on_fake_h100(
            graphs[1:], options, {**patches, "reorder_for_peak_memory": True}, around=inductor_keeps_order),
        **({"simple_overlap": compile_on_fake_h100(graphs[:1], options, {**patches, SIMPLE_OVERLAP: True})}
           if SIMPLE_OVERLAP in patches else {}),
    }}


def case_tp_sp() -> dict:
    """examples/tp_sp.py (tensor + sequence parallel over the fake group of 8) with
    every pipelinable collective chunked in 4."""
    model, inputs = _example("tp_sp").build(dim=64, heads=8, hidden=256, depth=2, seq=64, batch=2)
    graphs = capture_training_graphs(model, inputs)
    options = {"max_in_flight": MAX_IN_FLIGHT, "chunks": 4, "on_error": "raise"}
    patches = _inductor_patches()
    return {"options": options, "variants": {
        "kept": compile_on_fake_h100(graphs, options, patches),
        "partitions": compile_on_fake_h100(graphs, options, patches, cudagraph_partitions=True),
    }}


CASES = {"llama": case_llama, "tp_sp": case_tp_sp}


def main(argv: list[str]) -> int:
    """``python tests/fake_cuda.py CASE OUT.json``: run one of ``CASES`` under the fake
    process group of world size 8 and write its result as JSON."""
    import json

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    case, out = argv
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            result = {"torch": torch.__version__, **CASES[case]()}
    finally:
        dist.destroy_process_group()
    with open(out, "w", encoding="utf-8") as sink:
        json.dump(result, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The graphs a CUDA compile makes, captured on a machine without a GPU.

Three things, each for the estimates of a GPU profile (``overlapc report``,
``timeline``, ``dump``, ``--html``) and for tests that read Inductor's CUDA code:

- ``capture(model, example_inputs, options, note)``: one training step of
  ``model`` compiled as the backend compiles it for CUDA (Dynamo, AOTAutograd
  with Inductor's decompositions and Inductor's min-cut partitioner), with the
  H100's attention dispatch (``device_dispatch``), each forward and
  backward re-traced on fake CUDA tensors (``on_cuda``) and scheduled by
  overlapc; returns the records and the ``Dispatch`` it used. Nothing is
  computed: the compiled step returns zeros shaped like its outputs.
- ``fake_h100()``: a context in which Inductor lowers fake CUDA tensors and
  generates its CUDA wrapper code (kept in ``FakeH100.codes``, never loaded).
- ``on_cuda(gm)``: ``gm`` re-traced on fake CUDA tensors, node meta
  (``nn_module_stack``, stack traces, input sources) kept.

Why the dispatch is modelled, not asked: autograd on fake CUDA tensors needs a
device (the autograd engine asks the CUDA runtime for the device's primary
context), so the training step is traced on the model's own (CPU or meta)
tensors. The composite ops whose decomposition branches on the device are
replaced, for the capture only, by what they do on an H100 (``device_dispatch``):
``scaled_dot_product_attention`` calls the kernel ``sdpa_backend`` picks (flash,
efficient or math, as torch's sm90 checks and enabled backends allow; cuDNN
attention, which torch >= 2.13 with cuDNN >= 9.15.1 prefers for fp16/bf16 on sm90,
is not modelled: those calls are captured as flash). Not modelled either:
``rms_norm`` (one ``_fused_rms_norm`` and ``_fused_rms_norm_backward`` on CUDA; on
CPU tensors ``_fused_rms_norm`` is itself a composite, so the capture keeps CPU's
pow/mean/rsqrt pieces and their autograd) and other device branches inside
composite ops (dropout's fused kernel, for one).

Everything here patches process-wide (the dispatcher, torch.cuda, Triton's
active driver, Dynamo's device registry) and restores all of it on exit; do not
run other torch work in other threads meanwhile.

Private internals this leans on (names as of torch 2.13 / 2.14.1, triton 3.8 / 3.9):
- ``torch.library.Library("aten", "IMPL")``: a kernel for the CompositeImplicitAutograd
  key of ``aten::scaled_dot_product_attention`` (overriding torch's own;
  ``Library._destroy`` puts it back);
- ``torch._dynamo.device_interface``: ``device_interfaces`` (the registry
  ``register_interface_for_device`` writes), ``CudaInterface``, and
  ``caching_worker_device_properties``;
- ``torch._C._cuda_cudaCachingAllocator_is_enabled`` and
  ``torch._inductor.output_code.cudagraph_partition_post_compile`` (cudagraph
  partitions check the allocator and wrap each partition in a cudagraph tree);
- ``FakeTensorMode.avoid_device_init`` (a property that asks torch.cuda);
- ``overlapc.torch_compat.fake_cuda_patches`` (what the installed build needs besides);
- ``functools`` caches in ``torch.utils._triton`` (``has_triton``) and
  ``torch._inductor.utils`` (device properties, GPU type);
- ``triton.runtime.driver.driver._active`` (the stub replaces the CUDA driver,
  whose constructor loads libcuda) and ``triton.backends.compiler.GPUTarget``;
- ``GraphLowering.compile_to_module`` (replaced, as ``torch._inductor.utils.get_code``
  does, by one that keeps the wrapper code and returns a module that does nothing);
- AOTAutograd's ``aot_autograd``, ``make_boxed_func``,
  ``min_cut_rematerialization_partition(compiler="inductor")`` and placeholder
  ``meta["desc"]`` (copied across the re-trace); ``torch.fx.Node._rename``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import types
import warnings
from typing import Any, Callable
from unittest import mock

import torch

from overlapc.torch_compat import fake_cuda_patches


class CaptureUnavailable(RuntimeError):
    """The CUDA-shaped capture cannot run here; the message says what to install or pass."""


def require_triton() -> None:
    """CaptureUnavailable unless the triton package imports (the fake H100 stands in Triton's
    CUDA driver, and Inductor's CUDA lowering asks Triton for the target)."""
    if importlib.util.find_spec("triton") is None:
        raise CaptureUnavailable("graphs as the CUDA compile makes them need the triton package for the fake "
                                 "H100 (pip install triton); or capture CPU-shaped graphs with --dispatch cpu")


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
    require_triton()
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
        *fake_cuda_patches(),
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



# ---------------------------------------------------------------- dispatch as on an H100

@dataclasses.dataclass(frozen=True)
class Dispatch:
    """How a capture dispatched: ``device`` "cuda" (the fake H100) or "cpu", the attention
    kernels SDPA calls went to (first use first), and AOTAutograd's partitioner."""

    device: str
    attention: tuple[str, ...] = ()
    partitioner: str = "default"

    def describe(self) -> str:
        """One line for reports: "cuda (fake H100, efficient attention, min-cut partitioner)" or "cpu"."""
        if self.device == "cpu":
            return "cpu"
        kernels = [f"{' and '.join(self.attention)} attention"] if self.attention else []
        return f"{self.device} ({', '.join(['fake H100', *kernels, self.partitioner + ' partitioner'])})"

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "attention": list(self.attention), "partitioner": self.partitioner,
                "described": self.describe()}


CPU = Dispatch("cpu")
_HALF = (torch.float16, torch.bfloat16)
_BACKENDS = {1: "flash", 2: "efficient", 0: "math"}   # torch.nn.attention.SDPBackend values


def sdpa_backend(query, key, value, attn_mask=None, dropout_p: float = 0.0, enable_gqa: bool = False) -> str:
    """The kernel ("flash", "efficient" or "math") torch's SDPA picks on an H100 (sm90) for
    dense inputs: the first of torch's priority order (``torch._C._get_sdp_priority_order``)
    that is enabled (``torch.backends.cuda.*_sdp_enabled``, what ``sdpa_kernel`` sets) and
    whose checks pass. flash: fp16/bf16, no mask, 4-D, equal head dims <= 256 and a multiple
    of 8, as many key/value heads as query heads; efficient: fp16/bf16/fp32, 4-D, head dims
    aligned to 8 (half) or 4 (fp32), equal head counts; math: anything. RuntimeError when no
    enabled kernel fits (torch's "No available kernel")."""
    heads_match = not enable_gqa or query.size(-3) == key.size(-3)
    dense = all(t.dim() == 4 for t in (query, key, value)) and heads_match
    dims = {query.size(-1), key.size(-1), value.size(-1)}
    flash = (dense and query.dtype in _HALF and attn_mask is None and len(dims) == 1
             and max(dims) <= 256 and max(dims) % 8 == 0)
    align = 8 if query.dtype in _HALF else 4
    efficient = (dense and query.dtype in (*_HALF, torch.float32) and query.size(-1) == key.size(-1)
                 and all(d % align == 0 for d in dims))
    fits = {"flash": flash and torch.backends.cuda.flash_sdp_enabled(),
            "efficient": efficient and torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled()}
    for number in torch._C._get_sdp_priority_order():
        if fits.get(_BACKENDS.get(number, ""), False):
            return _BACKENDS[number]
    raise RuntimeError(f"no enabled attention kernel of the fake H100 fits these inputs ({query.dtype}, "
                       f"head dims {sorted(dims)}, mask {attn_mask is not None}); enabled: "
                       f"{[name for name, ok in fits.items() if ok] or 'none'}")


def _efficient_mask(mask, query, key):
    """``mask`` as the efficient kernel takes it: additive (a bool mask becomes 0 / -inf),
    broadcast to (batch, heads, L, S), its last dim stored padded to a multiple of 16."""
    if mask.dtype == torch.bool:
        mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill(~mask, float("-inf"))
    shape = (query.size(0), query.size(1), query.size(2), key.size(2))
    pad = -key.size(2) % 16
    if pad:
        mask = torch.nn.functional.pad(mask.expand(shape), (0, pad))[..., :key.size(2)]
    return mask.expand(shape)


def _sdpa_on_h100(chosen: list[str]) -> Callable:
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
             enable_gqa=False):
        backend = sdpa_backend(query, key, value, attn_mask, dropout_p, enable_gqa)
        chosen.append(backend)
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                            scale=scale)[0]
        if backend == "efficient":
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            mask = None if attn_mask is None else _efficient_mask(attn_mask, query, key)
            return aten._scaled_dot_product_efficient_attention(query, key, value, mask, grad, dropout_p,
                                                                is_causal, scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                       scale=scale, enable_gqa=enable_gqa)[0]
    return sdpa


@contextlib.contextmanager
def device_dispatch(chosen: list[str]):
    """For the duration, ``scaled_dot_product_attention`` dispatches on any device as it
    does on an H100 (``sdpa_backend``; module docstring), each call's kernel appended to
    ``chosen``; torch's own kernel is back on exit."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            library.impl("scaled_dot_product_attention", _sdpa_on_h100(chosen), "CompositeImplicitAutograd")
        yield
    finally:
        library._destroy()


# ---------------------------------------------------------------- re-trace on fake CUDA tensors

def on_cuda(gm: torch.fx.GraphModule):
    """(graph, inputs): ``gm`` re-traced on fake CUDA tensors (every cpu device in its
    arguments rewritten to cuda), with those inputs. Each node keeps the meta it was traced
    from (``nn_module_stack``, ``stack_trace``, ...; placeholders keep their names and meta
    but "val"). ``gm`` is left as it was. Call inside ``fake_h100()``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta
    from torch.utils._pytree import tree_map

    cuda = torch.device("cuda", 0)
    to_cuda = lambda value: cuda if isinstance(value, torch.device) and value.type == "cpu" else value  # noqa: E731
    copied = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
    for node in copied.graph.nodes:
        node.args, node.kwargs = tree_map(to_cuda, node.args), tree_map(to_cuda, node.kwargs)
    copied.recompile()
    mode = FakeTensorMode()
    values = [node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder")]
    with mode:
        inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=cuda,
                                      requires_grad=False) if isinstance(v, torch.Tensor) else v for v in values]
    with mode, preserve_node_meta():   # factory ops (empty, full, arange on cuda) make fake tensors too
        traced = make_fx(torch.fx.Interpreter(copied).run)(*inputs)
    _keep_placeholders(gm, traced)
    return traced, inputs


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    copied = torch.fx.Graph()
    output = copied.graph_copy(graph, {})
    copied.output(output)
    return copied


def _keep_placeholders(source: torch.fx.GraphModule, traced: torch.fx.GraphModule) -> None:
    """The placeholders of ``traced`` take the names and meta (but "val") of ``source``'s."""
    old = list(source.graph.find_nodes(op="placeholder"))
    new = list(traced.graph.find_nodes(op="placeholder"))
    for before, after in zip(old, new):
        after._rename(before.name)
        after.meta.update({k: v for k, v in before.meta.items() if k not in ("val", "tensor_meta")})
    traced.recompile()


# ---------------------------------------------------------------- the capture

def capture(model: torch.nn.Module, example_inputs, options: dict[str, Any] | None = None,
            note: Callable[[str], None] | None = None) -> tuple[list, Dispatch]:
    """(records, dispatch): ``overlapc.compiler.capture``'s records of one training step, as
    the CUDA compile makes the graphs: Dynamo and AOTAutograd with Inductor's decompositions
    and min-cut partitioner under ``device_dispatch``, each forward and backward re-traced
    on fake CUDA tensors (``on_cuda``) and scheduled there. The step computes nothing: its
    outputs and gradients are zeros (the model's buffers that the step mutates are
    overwritten with zeros too). ``note`` is told where the backward started, as
    ``compiler.capture`` says it. CaptureUnavailable without triton."""
    from overlapc.backend import compiler
    from overlapc.config import OverlapConfig

    require_triton()
    cfg = dataclasses.replace(OverlapConfig.from_options(options), dump_dir=None, check_ranks=False)
    records: list = []
    chosen: list[str] = []
    graphs = itertools.count()

    def dynamo_backend(gm, inputs):
        return _aot_on_h100(cfg, next(graphs), records.append, compiler.input_names_of(gm))(gm, inputs)

    with device_dispatch(chosen):
        compiler.run_step(model, example_inputs, dynamo_backend, note)
    return records, Dispatch("cuda", tuple(dict.fromkeys(chosen)), "min-cut")


def _aot_on_h100(cfg, index: int, sink, input_names: list[str]) -> Callable:
    """AOTAutograd as Inductor sets it up for CUDA, whose forward and backward compilers
    re-trace the graph on the fake H100, schedule it there and return ``_zeros_like_outputs``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from overlapc.backend import compiler
    from overlapc.torch_compat import save_seeded_ops_in_checkpoints

    def compile_graph(gm, example_inputs, *args, **kwargs):
        if compiler.drop_dead_compute(gm):
            gm.recompile()
        outputs = _zeros_like_outputs(gm)
        with fake_h100():
            cuda_gm, _ = on_cuda(gm)
        compiler.schedule_and_record(cuda_gm, cfg, sink)
        return make_boxed_func(outputs)

    def partition(joint, *args, **kwargs):
        save_seeded_ops_in_checkpoints(joint.graph)
        return min_cut_rematerialization_partition(joint, *args, compiler="inductor", **kwargs)

    return aot_autograd(fw_compiler=compiler.per_graph("fw", compile_graph, index, cfg, input_names),
                        bw_compiler=compiler.per_graph("bw", compile_graph, index, cfg, input_names),
                        partition_fn=partition, decompositions=select_decomp_table())


def _zeros_like_outputs(gm: torch.fx.GraphModule) -> Callable:
    """A function of any arguments returning what ``gm`` returns, as zeros: each output's
    shape, strides, dtype and device from its traced value; ints and None as traced."""
    (returned,) = gm.graph.find_nodes(op="output")[0].args
    values = [node.meta.get("val") if isinstance(node, torch.fx.Node) else node for node in returned]

    def hint(size):
        return size if isinstance(size, int) else size.node.hint

    def zeros(*args):
        return [torch.empty_strided(tuple(map(hint, v.shape)), tuple(map(hint, v.stride())), dtype=v.dtype,
                                    device=v.device).zero_() if isinstance(v, torch.Tensor) else
                (hint(v) if isinstance(v, torch.SymInt) else v) for v in values]
    return zeros


# ---------------------------------------------------------------- which capture a profile gets

DISPATCHES = ("auto", "cuda", "cpu")


def dispatch_for(profile, choice: str = "auto") -> str:
    """"cuda" or "cpu": ``choice`` when it names one, else (``"auto"``) the profile's device:
    cpu for a CPU profile (built-in "cpu", or a file calibrated on CPU, whose device is
    named "cpu"), cuda for any GPU (built-in h100/a100, a file calibrated on a GPU)."""
    if choice not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "cpu" if profile.device.name == "cpu" else "cuda"


def capture_as(device: str, model: torch.nn.Module, example_inputs, options: dict[str, Any] | None = None,
               note: Callable[[str], None] | None = None) -> tuple[list, Dispatch]:
    """(records, dispatch) of one training step captured as ``device`` ("cuda": ``capture``;
    "cpu": ``overlapc.compiler.capture``, CPU dispatch and AOTAutograd's default partitioner)."""
    if device == "cuda":
        return capture(model, example_inputs, options, note)
    from overlapc.backend import compiler
    return compiler.capture(model, example_inputs, options, note=note), CPU

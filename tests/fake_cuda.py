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

The fake device (``fake_h100``, ``FakeH100``, ``H100``) and the re-trace onto it
(``on_cuda``) are the product's (``overlapc.backend.cuda_capture``, whose docstring lists
the private torch internals they lean on), imported here under the same names.
For training graphs (autograd on fake CUDA tensors needs a device): Dynamo with
``aot_autograd`` (Inductor's decompositions, its min-cut partitioner) captures
forward and backward on CPU with the math SDPA backend; ``on_cuda`` re-traces each
on fake CUDA tensors, and ``compile_fx_inner(..., is_backward=...)`` compiles it
as ``compile_fx`` would.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys

import torch

from overlapc.backend.cuda_capture import H100, FakeH100, fake_h100, on_cuda  # noqa: F401  (this module's names)


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
    "scheduled": ``scheduled_starts``, "windows": ``inductor_order.window_summary`` of
    the code against the graph Inductor lowered}."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    from overlapc.backend import SchedulePass, inductor_order
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
            with around(), torch._inductor.config.patch(patches), inductor_order.capture() as lowered:
                compile_fx_inner(cuda_gm, inputs, is_backward=kind == "bw", graph_id=number,
                                 cudagraphs=BoxedBool(cudagraph_partitions))
            if len(fake.codes) != before + 1 or len(records) != 1 or len(lowered) != 1:
                raise RuntimeError(f"fake_cuda: graph {kind} gave {len(fake.codes) - before} wrappers, "
                                   f"{len(records)} schedules and {len(lowered)} lowerings, expected one each")
            code = fake.codes[-1]
            results.append({"graph": kind, "code": code, "scheduled": scheduled_starts(records[0].gm),
                            "windows": inductor_order.window_summary(inductor_order.events(code), lowered[0])})
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
    from overlapc.torch_compat import inductor_patches
    return inductor_patches()


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

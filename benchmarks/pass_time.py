"""Time overlapc.schedule on synthetic graphs of 1k, 10k and 100k nodes, two families.

"synthetic" (SimpleFSDP-shaped), each layer: cast of a weight shard -> all-gather ->
wait (right after, as DTensor emits it) -> view -> mm -> relu, plus every other
layer a reduce-scatter of its output waited right away; scheduled with the
defaults.

"mixed" (mixed-precision blocks, issue 40), each block: 4 times (bf16 cast of a
weight shard -> all-gather -> wait -> fp32 cast -> t -> mm -> relu), then a
reduce-scatter of the block's output, waited right away, summed into the next
block's input; scheduled with bucketing and the byte budget on (the defaults,
bucket="auto", max_in_flight_bytes="serial-peak") and max_in_flight=2.

Graphs are built with torch.fx directly (make_fx on 100k nodes takes minutes)
with meta tensors as node values.

``--dynamo-70b`` (opt-in: the capture takes 2-3 minutes and about 2 GiB) adds the
forward and backward graphs of a 70B-shaped Llama (``llama.LlamaConfig.llama3_70b``,
80 layers, seq 8192, batch 1) captured by Dynamo + AOTAutograd the way the backend
does (``overlapc.backend.capture`` on meta tensors, ``overlapc.fsdp.shard`` over a
fake process group of world 64, bf16 parameters, fp32 reductions). Each graph is
scheduled on a copy by overlapc (``schedule`` with the defaults, CPU seconds as for
the synthetic rows) and by Inductor's own FX overlap scheduler
(``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` with
collective bucketing, as ``aten_distributed_optimizations.enable_overlap_scheduling``
runs it; on a CPU-only machine its GPU bandwidth / FLOP/s queries answered with the
profile's numbers, compute estimated analytically, collectives by overlapc's cost
model, as ``step_time.py`` does), and each result, and the graph as captured, is
estimated by ``overlapc.estimate.simulate`` at ``--profile`` (default h100:nvlink): exposed
communication, step and peak live bytes. Inductor's scheduler runs here on the
graph AOTAutograd hands to Inductor, before Inductor's own post-grad rewrites
(which run before it in a real compile). A scheduler that raises gets its error in
the row.

    python benchmarks/pass_time.py [--sizes 1000 10000 100000] [--families synthetic mixed]
                                   [--repeat 3] [--json out.json]
                                   [--dynamo-70b [--layers 80] [--profile h100:nvlink]]

The JSON holds ``provenance`` (benchmarks/provenance.py: commit, torch, machine,
date, command, plus the load average at the start and end: wall-clock timings
are on a possibly shared machine) and ``results``, one row per family and size.

Targets: issue 2, 100k nodes in under 2 s, 4x the nodes costs well under 6x the
time; issue 40, the 100k-node mixed graph in under 2 s of CPU
(``time.process_time``), 25k -> 100k nodes at most ~4.5x the time.
"pass s" / "cpu s" are the wall-clock / CPU time of overlapc.schedule(gm, cfg,
recompile=False), what the torch.compile backend runs (Inductor reads the graph,
not gm.forward). "recompile s" is torch.fx regenerating gm.forward afterwards,
which overlapc.schedule(gm, cfg) adds by default for standalone use; it is
torch.fx's cost, shown separately.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.fx as fx

import overlapc
from provenance import provenance

F = torch.ops._c10d_functional
aten = torch.ops.aten


def meta(*shape, dtype=torch.float32) -> torch.Tensor:
    """A meta tensor: the value of a node (nothing is allocated)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _adder(graph: fx.Graph):
    """``node(target, args, val, kwargs=None)``: a call_function node of ``graph`` with ``val`` as its value."""
    def node(target, args, val, kwargs=None):
        n = graph.call_function(target, args, kwargs or {})
        n.meta["val"] = val
        return n
    return node


def synthetic(n_nodes: int, world: int = 8) -> fx.GraphModule:
    graph = fx.Graph()
    node = _adder(graph)

    x = graph.placeholder("x")
    x.meta["val"] = meta(16, 64)
    layers = max(1, n_nodes // 9)
    for i in range(layers):
        shard = graph.placeholder(f"w{i}")
        shard.meta["val"] = meta(64 // world, 64)
        cast = node(aten._to_copy.default, (shard,), meta(64 // world, 64, dtype=torch.bfloat16),
                    {"dtype": torch.bfloat16})
        start = node(F.all_gather_into_tensor.default, (cast, world, "0"), meta(64, 64, dtype=torch.bfloat16))
        done = node(F.wait_tensor.default, (start,), meta(64, 64, dtype=torch.bfloat16))
        up = node(aten._to_copy.default, (done,), meta(64, 64), {"dtype": torch.float32})
        tr = node(aten.t.default, (up,), meta(64, 64))
        mm = node(aten.mm.default, (x, tr), meta(16, 64))
        x = node(aten.relu.default, (mm,), meta(16, 64))
        if i % 2:
            rs = node(F.reduce_scatter_tensor.default, (x, "sum", world, "0"), meta(16 // world, 64))
            x = node(aten.add.Tensor, (x, node(aten.sum.default, (node(F.wait_tensor.default, (rs,),
                                                                         meta(16 // world, 64)),), meta())),
                     meta(16, 64))
    graph.output((x,))
    return fx.GraphModule(torch.nn.Module(), graph)


def mixed(n_nodes: int, world: int = 8, dim: int = 64) -> fx.GraphModule:
    """Mixed-precision blocks: 4 bf16-cast all-gathers and a reduce-scatter per block,
    36 nodes a block, ``n_nodes // 30`` blocks as issue 40's reproducer counted them
    (100000 gives its 119,990-node graph)."""
    graph = fx.Graph()
    node = _adder(graph)

    x = graph.placeholder("x")
    x.meta["val"] = meta(16, dim)
    for i in range(max(1, n_nodes // 30)):
        h = x
        for j in range(4):
            shard = graph.placeholder(f"w{i}_{j}")
            shard.meta["val"] = meta(dim // world, dim)
            cast = node(aten._to_copy.default, (shard,), meta(dim // world, dim, dtype=torch.bfloat16),
                        {"dtype": torch.bfloat16})
            start = node(F.all_gather_into_tensor.default, (cast, world, "0"),
                         meta(dim, dim, dtype=torch.bfloat16))
            done = node(F.wait_tensor.default, (start,), meta(dim, dim, dtype=torch.bfloat16))
            up = node(aten._to_copy.default, (done,), meta(dim, dim), {"dtype": torch.float32})
            mm = node(aten.mm.default, (h, node(aten.t.default, (up,), meta(dim, dim))), meta(16, dim))
            h = node(aten.relu.default, (mm,), meta(16, dim))
        rs = node(F.reduce_scatter_tensor.default, (h, "sum", world, "0"), meta(16 // world, dim))
        done = node(F.wait_tensor.default, (rs,), meta(16 // world, dim))
        x = node(aten.add.Tensor, (h, node(aten.sum.default, (done,), meta())), meta(16, dim))
    graph.output((x,))
    return fx.GraphModule(torch.nn.Module(), graph)


FAMILIES = {"synthetic": (synthetic, {}), "mixed": (mixed, {"max_in_flight": 2})}


def time_family(family: str, sizes: list[int], repeat: int) -> list[dict]:
    """Rows of wall-clock and CPU times of ``overlapc.schedule`` on ``family``'s graphs."""
    build, options = FAMILIES[family]
    cfg = overlapc.OverlapConfig(on_error="raise", **options)
    results = []
    for size in sizes:
        times, cpu, recompiles = [], [], []
        for _ in range(repeat):
            gm = build(size)
            gc.collect()  # start each run without the previous graphs' garbage
            begin, begin_cpu = time.perf_counter(), time.process_time()
            overlapc.schedule(gm, cfg, recompile=False)
            middle, middle_cpu = time.perf_counter(), time.process_time()
            gm.recompile()
            times.append(middle - begin)
            cpu.append(middle_cpu - begin_cpu)
            recompiles.append(time.perf_counter() - middle)
        nodes = len(gm.graph.nodes)
        row = {"family": family, "options": options, "nodes": nodes, "collectives": len(overlapc.collectives(gm)),
               "median_s": statistics.median(times), "min_s": min(times), "runs": times,
               "cpu_median_s": statistics.median(cpu), "cpu_min_s": min(cpu), "cpu_runs": cpu,
               "recompile_median_s": statistics.median(recompiles)}
        results.append(row)
        print(f"{family:>10} {nodes:>8} {row['collectives']:>12} {row['median_s']:>8.3f} {row['min_s']:>8.3f} "
              f"{row['cpu_median_s']:>8.3f} {row['recompile_median_s']:>12.3f}  "
              + " ".join(f"{t:.3f}" for t in times), flush=True)
    for small, big in zip(results, results[1:]):
        print(f"{family}: {big['nodes'] / small['nodes']:.1f}x nodes -> {big['median_s'] / small['median_s']:.1f}x "
              f"time, {big['cpu_median_s'] / small['cpu_median_s']:.1f}x CPU time")
    return results


def capture_llama(layers: int = 80, world: int = 64, seq: int = 8192) -> list:
    """The forward and backward graphs (``backend.GraphRecord``) of a 70B-shaped Llama
    with ``layers`` blocks, captured on meta tensors under a fake process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import overlapc.fsdp
    from llama import Llama, LlamaConfig
    from overlapc.backend import capture

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = Llama(LlamaConfig.llama3_70b(layers))
    overlapc.fsdp.shard(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return capture(model, (tokens, tokens), {"enabled": False})


def _inductor_overlap(gm: fx.GraphModule, profile) -> fx.GraphModule:
    """Inductor's FX overlap scheduler with collective bucketing on ``gm``, with the
    CPU-only stand-ins of ``step_time._overlap_scheduler_options`` (undone after)."""
    import functools

    import torch._inductor.scheduler
    import torch._inductor.utils
    import torch.utils._runtime_estimation
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    from step_time import _collective_ms

    rates = (torch._inductor.utils, torch._inductor.scheduler, torch.utils._runtime_estimation)
    saved = [(m, name, getattr(m, name)) for m in rates for name in ("get_gpu_dram_gbps", "get_device_tflops")]
    for module in rates:
        module.get_gpu_dram_gbps = lambda: profile.device.mem_gbps
        module.get_device_tflops = lambda dtype: profile.device.tflops
    try:
        return schedule_overlap_bucketing(
            gm, collective_bucketing=True, compute_estimator="analytical", enable_fusion_regions=False,
            insert_overlap_deps=False, custom_runtime_estimation=functools.partial(_collective_ms, profile.link))
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def time_dynamo_70b(layers: int, profile_name: str) -> list[dict]:
    """Rows for the captured 70B-shaped forward and backward: as captured, overlapc,
    Inductor's overlap scheduler (module docstring)."""
    import copy
    import traceback

    from overlapc.estimate import costmodel
    from overlapc.estimate.simulate import simulate

    profile = costmodel.resolve(profile_name)
    begin = time.perf_counter()
    records = capture_llama(layers)
    capture_s = time.perf_counter() - begin
    print(f"captured {len(records)} graphs in {capture_s:.0f} s: "
          + ", ".join(f"{r.name} {len(r.gm.graph.nodes)} nodes" for r in records), flush=True)
    cfg = overlapc.OverlapConfig(on_error="raise")
    schedulers = {
        "overlapc": lambda gm: overlapc.schedule(gm, cfg, recompile=False),
        "inductor": lambda gm: _inductor_overlap(gm, profile),
    }
    rows = []
    for record in records:
        base = {"graph": record.name, "nodes_in": len(record.gm.graph.nodes), "layers": layers,
                "capture_s": round(capture_s, 1), "profile": profile_name}
        for name in ("as captured", *schedulers):
            row = {**base, "scheduler": name}
            gm = copy.deepcopy(record.gm)
            if name in schedulers:
                gc.collect()
                start_cpu = time.process_time()
                try:
                    gm = schedulers[name](gm)
                except Exception as error:   # noqa: BLE001 - the table says why, measured
                    row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
                    row["error_trace"] = traceback.format_exc(limit=-4)
                row["pass_cpu_s"] = round(time.process_time() - start_cpu, 3)
            if "error" not in row:
                timeline = simulate(gm, profile)
                row.update(nodes=len(gm.graph.nodes), collectives=timeline.total,
                           exposed_ms=round(timeline.exposed_ms, 3), step_ms=round(timeline.step_ms, 3),
                           peak_gib=round(timeline.peak_bytes / 2**30, 3), peak_bytes=timeline.peak_bytes)
            rows.append(row)
            print(f"{record.name:>6} {name:>12} " + (f"pass {row['pass_cpu_s']:7.3f} s CPU  " if name in schedulers
                                                     else " " * 22)
                  + (f"ERROR {row['error']}" if "error" in row else
                     f"exposed {row['exposed_ms']:10.3f} ms  step {row['step_ms']:10.3f} ms  "
                     f"peak {row['peak_gib']:8.3f} GiB  {row['collectives']} collectives"), flush=True)
            del gm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--families", nargs="*", choices=sorted(FAMILIES), default=["synthetic", "mixed"],
                        help="synthetic families to time (none: only --dynamo-70b)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dynamo-70b", action="store_true",
                        help="also the Dynamo-captured forward/backward of a 70B-shaped Llama, overlapc beside "
                             "Inductor's overlap scheduler (about 3 minutes to capture)")
    parser.add_argument("--layers", type=int, default=80, help="blocks of the --dynamo-70b model")
    parser.add_argument("--profile", default="h100:nvlink", help="cost profile of the --dynamo-70b estimates")
    args = parser.parse_args()
    load_before = os.getloadavg()
    if args.families:
        print(f"{'family':>10} {'nodes':>8} {'collectives':>12} {'pass s':>8} {'min s':>8} {'cpu s':>8} "
              f"{'recompile s':>12}  pass runs")
    results = [row for family in args.families for row in time_family(family, args.sizes, args.repeat)]
    dynamo = time_dynamo_70b(args.layers, args.profile) if args.dynamo_70b else None
    if args.json:
        record = provenance({"sizes": args.sizes, "families": args.families, "repeat": args.repeat,
                             "dynamo_70b": args.dynamo_70b, "layers": args.layers, "profile": args.profile,
                             "loadavg_before": load_before, "loadavg_after": os.getloadavg()})
        payload = {"provenance": record, "results": results}
        if dynamo is not None:
            payload["dynamo_70b"] = dynamo
        with open(args.json, "w") as out:
            json.dump(payload, out, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

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

    python benchmarks/pass_time.py [--sizes 1000 10000 100000] [--families synthetic mixed]
                                   [--repeat 3] [--json out.json]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=["synthetic", "mixed"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    print(f"{'family':>10} {'nodes':>8} {'collectives':>12} {'pass s':>8} {'min s':>8} {'cpu s':>8} "
          f"{'recompile s':>12}  pass runs")
    results = [row for family in args.families for row in time_family(family, args.sizes, args.repeat)]
    if args.json:
        record = provenance({"sizes": args.sizes, "families": args.families, "repeat": args.repeat,
                             "loadavg_before": load_before, "loadavg_after": os.getloadavg()})
        with open(args.json, "w") as out:
            json.dump({"provenance": record, "results": results}, out, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""Simulated training step of a Llama-2-7B-shaped model at scale (nothing runs on a GPU).

    python benchmarks/projection.py [--layers 32] [--world-sizes 8 64] [--seq 4096]
                                    [--json benchmarks/results/projection.json]

The model (benchmarks/llama.py): 32 layers, dim 4096, 32 heads, ffn 11008,
vocab 32000, built on the meta device (nothing materialised), sharded with
``overlapc.fsdp.shard(model, mesh, param_dtype=bfloat16, reduce_dtype=float32)``
under the fake process group at each world size (each world size in its own
subprocess, so each has a fresh fake PG). Inputs: batch 1 x seq 4096 tokens per
GPU, on meta.

World size 8 is one node (H100 + NVLink: ``costmodel.profile("h100", "nvlink")``),
64 is 8 nodes (H100 + 400 Gb/s InfiniBand per GPU: ``profile("h100", "ib")``).
``--hsdp K`` adds, for each world size above 8, HSDP over K nodes: a
("dp_replicate", "dp_shard") mesh of K x world/K, parameters sharded inside a
node and replicated across nodes (gather and reduce-scatter over NVLink, the
gradient all-reduce over InfiniBand: ``profile("h100",
"dp_shard=nvlink,dp_replicate=ib")``).

For each world size the forward and backward graphs are captured the way the
backend builds them (``overlapc.backend.capture``: Dynamo, AOTAutograd with
Inductor's decompositions, overlapc.schedule) and simulated with
``overlapc.estimate.simulate.simulate``; a step is forward + backward (their simulated
times summed). Rows: the original order (``order=before_order``, what the
graphs look like before overlapc) and overlapc with max_in_flight 1/2/3/None.

By default capture runs once per world size and each option set's schedule is
applied to a copy of the captured graphs with ``overlapc.schedule`` (the same
call capture makes; one capture of 32 layers on meta takes minutes on 2
cores). ``--recapture`` calls ``capture`` once per option set instead, and
``--check-capture`` verifies on the first world size that both ways give the
same node order.

``--float8``: every linear but the output head converted by torchao's
``convert_to_float8_training`` (dynamic per-tensor scaling; issue 42), and
the rows are the original order, overlapc with ``narrow_gathers=False``
(weights gathered in bf16, then cast) and overlapc's defaults (float8
gathers); every row adds its all-gather bytes per step.

The JSON holds ``provenance`` (benchmarks/provenance.py: commit, torch,
machine, date, command), the model and, per world size, the rows below. The
numbers are simulated, so a loaded machine changes only the wall times.

Caveat printed with the tables: the cost model charges every FX node its own
roofline time, unfused, and the captured attention is the decomposed (math)
SDPA, so elementwise and softmax nodes over (heads x seq x seq) dominate the
estimated compute (in the forward, GEMMs are ~15% of it). That inflates
compute and flatters overlap. A second table ("GEMMs only": every non-GEMM
node free) gives the pessimistic side.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from provenance import provenance  # noqa: E402

LINK_OF = {8: "nvlink"}  # larger world sizes: several nodes, InfiniBand
OPTION_SETS = {
    "overlapc (default)": {},
    "overlapc_k1": {"max_in_flight": 1},
    "overlapc_k2": {"max_in_flight": 2},
    "overlapc_count_unlimited": {"max_in_flight": None},
    "overlapc_unlimited": {"max_in_flight": None, "max_in_flight_bytes": None},
    "overlapc_nobucket": {"bucket": None},
    "overlapc_bucket_module": {"bucket": "module"},
}
FLOAT8_OPTION_SETS = {
    "overlapc, narrow off": {"narrow_gathers": False},
    "overlapc (default)": {},
}
DEFAULT_ROW = "overlapc (default)"


def log(msg: str) -> None:
    print(f"[projection {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-2-7B: 32)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64])
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--recapture", action="store_true", help="call capture() once per option set")
    p.add_argument("--check-capture", action="store_true",
                   help="check that schedule() on the captured graphs equals capture() with the options")
    p.add_argument("--hsdp", type=int, default=None, metavar="K",
                   help="also simulate HSDP over K nodes (K x world/K) for each world size above 8")
    p.add_argument("--float8", action="store_true", help="torchao float8 linears (all but the output head)")
    p.add_argument("--json", default=None)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: one world size
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--replicate", type=int, default=None, help=argparse.SUPPRESS)  # child: HSDP nodes
    return p.parse_args(argv)


# ------------------------------------------------------------------ one world size (child process)


def _build(args, mesh):
    import torch

    import overlapc.fsdp
    from llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig.llama2_7b(args.layers))
    if args.float8:
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "output")
    overlapc.fsdp.shard(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    return model, (tokens, tokens)


def one_world_size(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import overlapc
    from overlapc.estimate import costmodel
    from overlapc.backend import capture
    from overlapc.estimate.simulate import simulate

    n = args.one
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    if args.replicate:
        mesh = init_device_mesh("cpu", (args.replicate, n // args.replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
        link = "dp_shard=nvlink,dp_replicate=ib"
    else:
        mesh = init_device_mesh("cpu", (n,))
        link = LINK_OF.get(n, "ib")
    profile = costmodel.profile("h100", link)
    model, inputs = _build(args, mesh)

    def timed_capture(options):
        t0 = time.perf_counter()
        recs = capture(model, inputs, options)
        log(f"  world {n}: capture {options} -> {[r.name for r in recs]} in {time.perf_counter() - t0:.1f} s")
        return recs

    rows: dict[str, dict] = {}
    gemm_rows: dict[str, dict] = {}  # sensitivity: only GEMMs cost compute time
    t0 = time.perf_counter()
    base = timed_capture({"enabled": False})
    capture_s = time.perf_counter() - t0
    n_nodes = {r.name: len(r.gm.graph.nodes) for r in base}

    gemms = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.baddbmm.default}

    def gemm_only_ms(node):
        return costmodel.compute_ms(node, profile.device) if node.target in gemms else 0.0

    def add_row(name, graphs, orders=None, gemm_only=False):
        step = exposed = bound = 0.0
        peak = peak_mem = gathered = 0
        parts = {}
        for i, gm in enumerate(graphs):
            compute_ms = gemm_only_ms if gemm_only else None
            tl = simulate(gm, profile, order=None if orders is None else orders[i], compute_ms=compute_ms)
            step += tl.step_ms
            exposed += tl.exposed_ms
            bound += simulated_bound(gm, tl)
            peak = max(peak, tl.peak_in_flight_bytes)
            peak_mem = max(peak_mem, tl.peak_bytes)
            gathered += sum(c.nbytes or 0 for c in overlapc.collectives(gm) if c.kind == "all_gather")
            parts[base[i].name] = {"step_ms": tl.step_ms, "exposed_ms": tl.exposed_ms,
                                   "peak_in_flight_bytes": tl.peak_in_flight_bytes,
                                   "peak_bytes": tl.peak_bytes, "collectives": tl.total, "hidden": tl.hidden}
        (gemm_rows if gemm_only else rows)[name] = {
            "step_ms": step, "exposed_ms": exposed, "exposed_pct": 100 * exposed / step,
            "bound_ms": bound, "peak_in_flight_bytes": peak, "peak_bytes": peak_mem, "graphs": parts,
            "all_gather_bytes": gathered}

    add_row("original order", [r.gm for r in base], [r.before_order for r in base])
    add_row("original order", [r.gm for r in base], [r.before_order for r in base], gemm_only=True)
    checked = None
    for name, options in (FLOAT8_OPTION_SETS if args.float8 else OPTION_SETS).items():
        if args.recapture:
            recs = timed_capture(options)
            assert [r.name for r in recs] == [r.name for r in base]
            graphs = [r.gm for r in recs]
        else:
            graphs = []
            for r in base:
                gm = copy.deepcopy(r.gm)
                overlapc.schedule(gm, overlapc.OverlapConfig.from_options(dict(options, on_error="raise"),
                                                                          env={}))
                graphs.append(gm)
            if args.check_capture and checked is None:
                recs = timed_capture(options)
                checked = all([n.name for n in a.graph.nodes] == [n.name for n in b.gm.graph.nodes]
                              for a, b in zip(graphs, recs))
                log(f"  world {n}: schedule() on the captured graphs == capture({options}): {checked}")
                if not checked:
                    raise SystemExit("schedule() on a copy differs from capture() with the options")
        add_row(name, graphs)
        add_row(name, graphs, gemm_only=True)
    return {"world_size": n, "replicate": args.replicate, "link": link, "profile": repr(profile), "rows": rows, "rows_gemm_only": gemm_rows,
            "capture_s": capture_s, "graph_nodes": n_nodes,
            "check_capture": checked}


def simulated_bound(gm, timeline) -> float:
    """max(compute + edge, communication) of one graph, from a simulated timeline:
    compute is every compute node's time, communication the busiest group's total
    collective time, and edge the collectives no order can hide: those with no
    compute between the point their inputs are ready and their first consumer
    (in graph order: e.g. the forward's first all-gather, the last reduce-scatter)."""
    from overlapc.passes.structure import Structure
    s = Structure(gm)
    compute_before = [0.0]
    for node in s.nodes:
        span = timeline.compute.get(node.name)
        free = node in s.bundled or span is None
        compute_before.append(compute_before[-1] + (0.0 if free else span[1] - span[0]))
    comm: dict[str, float] = {}
    edge = 0.0
    for c in s.movable:
        duration = timeline.collectives[c.start.name].duration_ms
        comm[c.group] = comm.get(c.group, 0.0) + duration
        ready = max((s.pos[i] for i in s.bundle_inputs[c.start]), default=-1)
        target = min(s.pos[s.target[w]] for w in c.waits)
        if compute_before[target] - compute_before[ready + 1] <= 0:
            edge += duration
    return max(compute_before[-1] + edge, max(comm.values(), default=0.0))


# ------------------------------------------------------------------ driver


def _gb(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.one is not None:
        import warnings
        warnings.filterwarnings("ignore")
        result = one_world_size(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0

    t_start = time.perf_counter()
    log(f"Llama-2-7B shape{', float8 linears (torchao)' if args.float8 else ''}, "
        f"{args.layers} layers{'' if args.layers == 32 else ' (NOT the full 32)'}, "
        f"bf16 params (param_dtype), fp32 reduce-scatter, batch {args.batch} x seq {args.seq} per GPU, "
        f"reshard_after_forward=True, meta device + fake process group")
    results = []
    import tempfile
    runs = [(n, None) for n in args.world_sizes]
    if args.hsdp:
        runs += [(n, args.hsdp) for n in args.world_sizes if n > 8]
    for n, replicate in runs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        child_argv = [a for a in argv if a not in ("--json",)]
        if args.json:  # drop --json PATH
            i = argv.index("--json")
            child_argv = argv[:i] + argv[i + 2:]
        log(f"world size {n}: capturing in a subprocess ...")
        t0 = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), *child_argv, "--one", str(n), "--out", out]
        if replicate:
            cmd += ["--replicate", str(replicate)]
        if args.check_capture and n != args.world_sizes[0]:
            cmd.remove("--check-capture")
        proc = subprocess.run(cmd, timeout=3600)
        if proc.returncode != 0:
            log(f"ERROR: world size {n} failed (exit {proc.returncode})")
            return 1
        with open(out) as f:
            res = json.load(f)
        os.unlink(out)
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        log(f"world size {n}: done in {res['wall_s']:.0f} s")

    print()
    for res in results:
        where = "1 node, NVLink" if res["link"] == "nvlink" else "InfiniBand 400 Gb/s per GPU"
        if res.get("replicate"):
            where = (f"HSDP {res['replicate']} nodes x {res['world_size'] // res['replicate']}: shard over NVLink, "
                     "replicate over InfiniBand")
        print(f"world size {res['world_size']} ({where}): {res['profile']}")
        print(f"  graphs: {res['graph_nodes']} nodes; capture {res['capture_s']:.0f} s")
        for key, title in (("rows", "compute = costmodel roofline of every node (default)"),
                           ("rows_gemm_only", "sensitivity: compute = GEMMs only (mm/bmm/addmm), "
                                              "elementwise/softmax free, as if perfectly fused")):
            print(f"  {title}")
            print(f"  {'order':26s} {'step ms':>9s} {'bound ms':>9s} {'/ bound':>8s} {'exposed ms':>11s} "
                  f"{'exposed %':>10s} {'peak in-flight':>15s} {'peak memory':>12s} {'gathered':>10s}")
            for name, row in res[key].items():
                if "error" in row:
                    print(f"  {name:26s} error: {row['error']}")
                    continue
                print(f"  {name:26s} {row['step_ms']:9.2f} {row['bound_ms']:9.2f} "
                      f"{row['step_ms'] / row['bound_ms']:7.3f}x {row['exposed_ms']:11.2f} "
                      f"{row['exposed_pct']:9.2f}% {_gb(row['peak_in_flight_bytes']):>15s} "
                      f"{_gb(row['peak_bytes']):>12s} {_gb(row.get('all_gather_bytes', 0)):>10s}")
            print()
    first = next((r for r in results if r["world_size"] == 8), None)
    if first is not None:
        pct = first["rows"][DEFAULT_ROW]["exposed_pct"]
        print(f"goal: world size 8, defaults, exposed communication < 5% of the step: "
              f"{pct:.2f}% -> {'MET' if pct < 5 else 'NOT MET'}")
        pct_g = first["rows_gemm_only"][DEFAULT_ROW]["exposed_pct"]
        print(f"      (GEMM-only compute sensitivity: {pct_g:.2f}% -> {'MET' if pct_g < 5 else 'NOT MET'})")
    far = next((r for r in results if r["world_size"] == 64 and not r.get("replicate")), None)
    if far is not None:
        row = far["rows"][DEFAULT_ROW]
        ratio = row["step_ms"] / row["bound_ms"]
        print(f"goal: world size 64, defaults, step within 1.15x of the simulated bound: "
              f"{ratio:.3f}x -> {'MET' if ratio <= 1.15 else 'NOT MET'}")
    hsdp = next((r for r in results if r.get("replicate")), None)
    if hsdp is not None:
        row = hsdp["rows"][DEFAULT_ROW]
        ratio = row["step_ms"] / row["bound_ms"]
        print(f"goal: HSDP {hsdp['replicate']} x {hsdp['world_size'] // hsdp['replicate']}, defaults, step within "
              f"1.05x of the simulated bound: {ratio:.3f}x -> {'MET' if ratio <= 1.05 else 'NOT MET'}")
        if far is not None:
            print(f"      HSDP step {row['step_ms']:.1f} ms vs FSDP over {far['world_size']} "
                  f"{far['rows'][DEFAULT_ROW]['step_ms']:.1f} ms (defaults)")
    for res in results:
        original = res["rows"]["original order"]["peak_bytes"]
        default = res["rows"][DEFAULT_ROW]["peak_bytes"]
        print(f"memory, world size {res['world_size']}{' HSDP' if res.get('replicate') else ''}: defaults peak {_gb(default)} vs original order "
              f"{_gb(original)} ({default / original:.3f}x)")
    total = time.perf_counter() - t_start
    print(f"total time {total:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        document = {"provenance": provenance({"loadavg_at_write": os.getloadavg()}),   # before the file is
                    "model": {"name": "Llama-2-7B shape", "layers": args.layers, "dim": 4096, "heads": 32,   # emptied
                              "ffn": 11008, "vocab": 32000, "param_dtype": "bfloat16", "float8": args.float8,
                              "reduce_dtype": "float32", "reshard_after_forward": True},
                    "batch_per_gpu": args.batch, "seq": args.seq, "device": "h100",
                    "results": results, "total_s": total}
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measured train step on 2 real gloo ranks: graph_trainer's passes vs overlapc in their place.

The measured companion of ``benchmarks/joint_graph.py`` (which only estimates,
on a graph traced under a fake process group of 8). Here each of 2 ranks
(``overlapc.launch``: gloo on 127.0.0.1) traces torchtitan 0.3.0
graph_trainer's llama3 debug model with ``joint_graph.trace`` under the real
default group (world 2: SimpleFSDP ``fully_shard`` over 2, bf16 parameters,
fp32 reduction), gives the traced module real parameters (graph_trainer's own
``init_states`` after ``torch.manual_seed(seed)``, the same seed on both
ranks), and builds compiled step functions from that one traced graph:

* "graph_trainer": its ``compile_time_passes`` with its Inductor compilation
  (``--inductor``: "regional", graph_trainer's default, or "full");
* "overlapc": the same list through ``overlapc.integrations.torchtitan.
  replace_bucketing`` (overlapc defaults in place of its bucketing pass; the
  Inductor pass run under ``inductor_patches``);
* "as traced" (``--reference``): the traced graph with no pass, for scale.

Both ranks use the same batch (``joint_graph.trace``'s tokens and labels,
seed 0). The variants run interleaved (one step of each per round, the order
rotated every round, a barrier before each step) after warm-up rounds; the
table gives each variant's median step, the ratio to graph_trainer's, and
whether loss and gradients (the rank's local fp32 gradient shards, first
step) agree with graph_trainer's within ``--rtol`` / ``--atol``. Peak memory
is overlapc's simulator estimate on each variant's graph just before its
Inductor pass (an estimate, not a measurement).

CPU stand-ins are ``joint_graph.cpu_stand_ins`` (graph_trainer's bucketing
pass is handed the ``--profile`` device's DRAM bandwidth and FLOP/s, H100 by
default), plus, as graph_trainer's ``apply_compile`` does,
``reorder_for_peak_memory=False`` globally; Inductor compiles with one
thread. ``overlapc.torch_compat.route_gloo_all_gathers`` is installed in every rank
(gloo's coalesced all-gather corrupts the heap with many in flight), for all
variants alike.

    python benchmarks/joint_graph_step.py [--batch 8] [--seq 256] [--steps 10] [--warmup 2]
        [--inductor regional full] [--keep-order] [--reference] [--json out.json]

On plain loopback the step is CPU-bound and the collectives' order hardly
shows. To make the link the bottleneck, run it in a network namespace whose
loopback is shaped (root; DESIGN.md's recipe):

    ip netns add jgs_step; ip -n jgs_step link set lo up
    ip netns exec jgs_step tc qdisc add dev lo root tbf rate 200mbit burst 256kb limit 64mb
    ip netns exec jgs_step python benchmarks/joint_graph_step.py ...

With SDPA attention graph_trainer's "regional" Inductor compiles nothing (it
tags only FlexAttention regions), so that pair runs as FX graphs; "full"
compiles the whole step (minutes per variant on 2 loaded cores; Inductor's
FX graph cache hits on a rerun).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import joint_graph  # noqa: E402 - benchmarks/ is this script's directory
from provenance import provenance  # noqa: E402

GRAPH_TRAINER, OVERLAPC, AS_TRACED = "graph_trainer", "overlapc", "as traced"


def traced_with_state(batch: int, seq: int):
    """``joint_graph.trace`` under the current default group, and also the module
    and the (args, kwargs) it traced (recorded from graph_trainer's tracer)."""
    import torchtitan.experiments.graph_trainer.make_fx_tracer as tracer_module

    seen: dict = {}
    original = tracer_module.minimal_fx_tracer

    def recording(fn, module=None, **options):
        trace_call = original(fn, module=module, **options)

        def call(*args, **kwargs):
            seen.update(module=module, args=args, kwargs=kwargs)
            return trace_call(*args, **kwargs)
        return call

    tracer_module.minimal_fx_tracer = recording
    try:
        traced, config, dims = joint_graph.trace(batch, seq)
    finally:
        tracer_module.minimal_fx_tracer = original
    return traced, config, dims, seen


def split_at_inductor(passes):
    """(passes before the first Inductor pass, the Inductor passes and after)."""
    from overlapc.integrations.torchtitan import KEEP_ORDER, pass_name
    names = [pass_name(p) for p in passes]
    at = next((i for i, n in enumerate(names) if n in KEEP_ORDER or n.startswith("annotate_")), len(passes))
    return list(passes[:at]), list(passes[at:])


def build(name: str, passes, traced, profile, say):
    """The compiled step of one variant: (runner, estimate dict, compile seconds)."""
    before, inductor = split_at_inductor(passes)
    start = time.perf_counter()
    gm = joint_graph.run_passes(before, traced)
    estimate = joint_graph.row(name, gm, profile)
    say(f"{name}: graph passes done ({time.perf_counter() - start:.1f} s), Inductor next")
    for pass_fn in inductor:
        gm = pass_fn(gm, traced.example_inputs)
    seconds = time.perf_counter() - start
    say(f"{name}: compiled in {seconds:.1f} s")
    return dataclasses.replace(traced, gm=gm), estimate, seconds


def outputs_agree(ref, got, rtol: float, atol: float) -> dict:
    """Largest differences of loss and gradients (local shards) between two step outputs."""
    ref_flat, got_flat = [_local(t) for t in ref], [_local(t) for t in got]
    loss = (got_flat[0] - ref_flat[0]).abs().max().item()
    grads = [(g - r).abs().max().item() for r, g in zip(ref_flat[1:], got_flat[1:])]
    close = all(torch.allclose(g, r, rtol=rtol, atol=atol) for r, g in zip(ref_flat, got_flat))
    exact = all(torch.equal(g, r) for r, g in zip(ref_flat, got_flat))
    return {"loss_abs_diff": loss, "grad_max_abs_diff": max(grads), "allclose": close, "bitwise": exact,
            "loss": got_flat[0].item()}


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().float()


def variant_passes(traced, config, dims, options) -> dict:
    """Pass list of every variant, by name ("graph_trainer/regional", "overlapc/full", ...)."""
    from overlapc.integrations import torchtitan as overlapc_torchtitan
    from torchtitan.experiments.graph_trainer.passes import compile_time_passes
    lists = {}
    for mode in options["inductor"]:
        config.compile.inductor_compilation = mode
        theirs = compile_time_passes(traced, config, include_inductor=True, parallel_dims=dims)
        ours = overlapc_torchtitan.replace_bucketing(theirs)
        lists[f"{GRAPH_TRAINER}/{mode}"] = theirs
        lists[f"{OVERLAPC}/{mode}"] = ours
        if mode == "full" and options["keep_order"]:
            lists[f"{OVERLAPC}/full, order kept"] = ours
    if options["reference"]:
        lists[AS_TRACED] = []
    return lists


def order_kept(name: str):
    """The context a variant compiles in: for "... order kept", Inductor keeping the
    order it is given (``overlapc.torch_compat.inductor_keeps_order``, which the
    adapter already applies around graph_trainer's Inductor passes: the variant
    repeats "overlapc/full" with the patch applied twice, a check that the
    adapter's own patch is in effect); else nothing."""
    from overlapc.torch_compat import inductor_keeps_order
    return inductor_keeps_order() if name.endswith("order kept") else contextlib.nullcontext()


def rank_job(rank: int, world_size: int, options: dict) -> dict:
    """One rank: trace, init, compile the variants, check values, time them interleaved."""
    from overlapc.estimate import costmodel
    from overlapc.torch_compat import route_gloo_all_gathers
    from overlapc.launch import progress
    from torchtitan.experiments.graph_trainer.make_fx_tracer import run_traced

    def say(message):
        progress(f"{time.strftime('%H:%M:%S')} {message}")

    route_gloo_all_gathers()
    profile = costmodel.resolve(options["profile"])
    patches = {"compile_threads": 1, "reorder_for_peak_memory": False}
    with torch._inductor.config.patch(patches), joint_graph.cpu_stand_ins(profile):
        traced, config, dims, seen = traced_with_state(options["batch"], options["seq"])
        model = seen["module"]
        torch.manual_seed(options["seed"])
        model.init_states(buffer_device=torch.device("cpu"))
        say(f"traced {len(traced.gm.graph.nodes)} nodes")
        built = {}
        for name, passes in variant_passes(traced, config, dims, options).items():
            with order_kept(name):
                built[name] = build(name, passes, traced, profile, say)
    runners = {name: run_traced(b[0], module=model) for name, b in built.items()}
    return _measure(runners, seen["args"], seen["kwargs"], built, options, say)


def reference_of(name: str, modes: list[str]) -> str:
    """The variant ``name`` is compared with: graph_trainer's passes with the same
    Inductor mode (the first mode for "as traced")."""
    mode = name.split("/", 1)[1].split(",")[0] if "/" in name else modes[0]
    return f"{GRAPH_TRAINER}/{mode}"


def _measure(runners, args, kwargs, built, options, say) -> dict:
    names = list(runners)
    first = {name: runners[name](*args, **kwargs) for name in names}
    tolerance = options["rtol"], options["atol"]
    agree = {name: outputs_agree(first[reference_of(name, options["inductor"])], first[name], *tolerance)
             for name in names}
    agree_traced = {name: outputs_agree(first[AS_TRACED], first[name], *tolerance)
                    for name in names} if AS_TRACED in first else {}
    say("values: " + ", ".join(f"{n} loss {a['loss']:.6f} bitwise {a['bitwise']}" for n, a in agree.items()))
    times: dict = {name: [] for name in names}
    rounds = options["warmup"] + options["steps"]
    for round_ in range(rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            runners[name](*args, **kwargs)
            elapsed = (time.perf_counter() - start) * 1e3
            if round_ >= options["warmup"]:
                times[name].append(elapsed)
        if round_ >= options["warmup"]:
            say(f"round {round_ + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.0f} ms" for n in names))
        else:
            say(f"warm-up round {round_ + 1} done")
    return {"times_ms": times, "agree": agree, "agree_as_traced": agree_traced,
            "estimate": {name: b[1] for name, b in built.items()},
            "compile_s": {name: round(b[2], 1) for name, b in built.items()},
            "loadavg": os.getloadavg()}


def summarise(results: list[dict], options: dict) -> list[dict]:
    """One row per variant: per step the slower rank's time, then the median over steps;
    the ratio is to graph_trainer's passes with the same Inductor mode, as a ratio of
    medians and as the median of per-round ratios (the two steps of one round ran
    seconds apart, under about the same load)."""
    rows = []
    for name in results[0]["times_ms"]:
        per_step = [max(r["times_ms"][name][i] for r in results) for i in range(options["steps"])]
        estimate = results[0]["estimate"][name]
        rows.append({"variant": name, "median_step_ms": round(statistics.median(per_step), 1),
                     "steps_ms": [round(t, 1) for t in per_step],
                     "rank_medians_ms": [round(statistics.median(r["times_ms"][name]), 1) for r in results],
                     "values_vs": reference_of(name, options["inductor"]),
                     "values_by_rank": [r["agree"][name] for r in results],
                     "values_vs_as_traced_by_rank": [r["agree_as_traced"].get(name) for r in results],
                     "estimate_before_inductor": {k: estimate[k] for k in
                                                  ("peak_mib", "step_ms", "exposed_ms", "collectives", "nodes")},
                     "compile_s_by_rank": [r["compile_s"][name] for r in results]})
    by_name = {row["variant"]: row for row in rows}
    for row in rows:
        reference = by_name[row["values_vs"]]
        row["ratio_to_graph_trainer"] = round(row["median_step_ms"] / reference["median_step_ms"], 3)
        paired = [mine / theirs for mine, theirs in zip(row["steps_ms"], reference["steps_ms"])]
        row["paired_ratio_median"] = round(statistics.median(paired), 3)   # same round: same load
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inductor", nargs="+", choices=("regional", "full"), default=["regional", "full"],
                        help="graph_trainer's --compile.inductor_compilation value(s) to build each pair with")
    parser.add_argument("--keep-order", action="store_true",
                        help="also overlapc/full with Inductor's peak-memory reordering kept to the given order")
    parser.add_argument("--reference", action="store_true", help="also time the graph as traced")
    parser.add_argument("--profile", default="h100:nvlink")
    parser.add_argument("--rtol", type=float, default=1e-2)
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped")
    parser.add_argument("--json", help="write rows and provenance here")
    args = parser.parse_args()
    options = {k: v for k, v in vars(args).items() if k not in ("json", "timeout")}
    from overlapc import launch
    loads = [os.getloadavg()]
    results = launch.run(rank_job, 2, (options,), timeout=args.timeout,
                         on_message=lambda rank, message: print(f"[rank {rank}] {message}", flush=True))
    loads.append(os.getloadavg())
    rows = summarise(results, options)
    _print(rows)
    if args.json:
        extra = {**options, "world": 2, "loadavg_before_after": loads,
                 "rank_loadavg_end": [r["loadavg"] for r in results]}
        document = {"provenance": provenance(extra), "rows": rows}   # before the file is emptied ("dirty")
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)


def _print(rows):
    print(f"{'variant':26s} {'median ms':>10} {'ratio':>6} {'paired':>6}  {'values (both ranks)':34s} "
          f"{'est. peak MiB':>13}")
    for r in rows:
        values = r["values_by_rank"]
        said = ("bitwise" if all(v["bitwise"] for v in values) else
                "allclose" if all(v["allclose"] for v in values) else "DIFFER")
        print(f"{r['variant']:26s} {r['median_step_ms']:10.1f} {r['ratio_to_graph_trainer']:6.3f} "
              f"{r['paired_ratio_median']:6.3f}  {said + ' vs ' + r['values_vs']:34s} "
              f"{r['estimate_before_inductor']['peak_mib']:13.1f}")


if __name__ == "__main__":
    main()

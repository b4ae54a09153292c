"""What overlapc adds to a compile: cold and warm first steps against plain Inductor.

2 local gloo ranks (overlapc.launch, the project's rank launcher) train
examples/llama.py's sharded model (``overlapc.fsdp.shard``); the first step
(forward + backward) includes every compile. Per round, model and variant:

* cold: a fresh process pair on a fresh, empty Inductor cache directory
  (FX graph cache and AOTAutograd cache both live there);
* warm: a second fresh process pair on the same directory (a restart after
  preemption or a checkpoint resume).

Variants: ``inductor`` (backend="inductor"), ``overlapc`` (defaults: the rank
check on, which turns AOTAutograd's cache off for the compile) and
``overlapc_nocheck`` (check_ranks=False: AOTAutograd's cache on, so the gap
between the two is what bypassing that cache costs); each also as
``<name>+sac_hash``, with overlapc.fsdp's selective-checkpoint context given the
``cache_hash`` AOTAutograd needs to cache its graphs at all. Variants are interleaved
within each round, rotated between rounds; medians over rounds, and ratios
against Inductor's median from the same run, and the median over rounds of
each round's ratio (which cancels the load's drift between rounds). A first
step is measured as wall time (the slower rank) and as CPU seconds (user +
system of the busier rank and of the C++ compiler processes Inductor ran for
it): on a shared, loaded machine the wall time mostly measures the load, the
CPU seconds much less so.

Time split (rank 0, seconds), from torch._dynamo.utils.compile_times() and
overlapc's own functions timed in the ranks:
  dynamo    = _compile.compile_inner - OutputGraph.call_user_compiler
  aot       = call_user_compiler - the forward's compile_fx_inner - the forward's
              rank check (AOTAutograd's trace, the partitioner, cache lookups)
  passes    = overlapc's schedule pass (bucket, chunk, schedule, verify), all graphs
  check     = overlapc's rank check, all graphs (it waits for the slower rank's
              compile: mostly waiting, not work)
  inductor  = compile_fx_inner (forward and backward) - the schedule pass
(forward: read when the forward returns; the backward is compiled at the first
backward call.) Why AOTAutograd's cache was bypassed, the FX graph /
AOTAutograd cache counters and the number of kernels Inductor generated are
recorded per run.

    python benchmarks/compile_cost.py [--rounds 2] [--models small,big]
        [--variants inductor,overlapc,overlapc_nocheck] [--json out.json]

Prints a table and writes JSON with provenance (benchmarks/provenance.py: commit,
torch, machine, date, command; plus the load average when written). The machine
may be shared: the load average is recorded with each run; say so when quoting
the numbers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if os.path.join(REPO, "examples") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "examples"))

from overlapc import launch  # noqa: E402
from provenance import provenance  # noqa: E402

# examples/llama.py build() arguments; "small" is issue 28's 8-layer Llama ("tiny": a smoke test)
MODELS = {
    "tiny": dict(vocab=128, dim=64, heads=4, hidden=128, depth=1, batch=2, seq=16),
    "small": dict(vocab=1024, dim=256, heads=4, hidden=688, depth=8, batch=2, seq=128),
    "big": dict(vocab=2048, dim=512, heads=8, hidden=1376, depth=16, batch=2, seq=128),
}
VARIANTS = {
    "inductor": ("inductor", None),
    "overlapc": ("overlapc", {}),
    "overlapc_nocheck": ("overlapc", {"check_ranks": False}),
    "overlapc_nobucket": ("overlapc", {"bucket": None}),   # bucketing's copy kernels cost compile time
}
# The same with overlapc.fsdp's selective-checkpoint context given a ``cache_hash``
# (set here, for the run only): without one, AOTAutograd's cache bypasses every
# graph of a model sharded by overlapc.fsdp ("SAC context_fn does not have a
# cache_hash attribute"), whatever the backend and the rank check do.
VARIANTS.update({f"{name}+sac_hash": value for name, value in VARIANTS.items()})
PHASES = ("dynamo", "aot", "passes", "check", "inductor")


def _timed(module, name: str, into: dict, key: str) -> None:
    """Replace ``module.name`` with a wrapper adding its wall time to ``into[key]``."""
    original = getattr(module, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - start

    setattr(module, name, timed)


def _compile_seconds() -> dict:
    """Total seconds per dynamo_timed function of this process (torch's own counters)."""
    import torch
    rows = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    names, values = rows
    return {n: float(v) for n, v in zip(names, values)}


def _job(rank, world_size, model_name, variant, cache_dir):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir   # before torch reads it: the group is joined below
    import torch
    import torch.distributed as dist
    from torch._inductor import config as inductor_config

    import llama
    launch.init_gloo(rank, world_size, int(os.environ["MASTER_PORT"]))
    inductor_config.compile_threads = 1   # 2 shared cores: no worker pool, for both backends
    ours = {}
    backend, options = VARIANTS[variant]
    if variant.endswith("+sac_hash"):
        import overlapc.fsdp
        overlapc.fsdp._recompute_contexts.cache_hash = "overlapc.fsdp._recompute_contexts"
    if backend == "overlapc":
        import overlapc.backend
        from overlapc.backend import rankcheck
        # the function the backend calls for the pass (renamed schedule -> schedule_graph)
        _timed(overlapc.backend, "schedule_graph" if hasattr(overlapc.backend, "schedule_graph") else "schedule",
               ours, "pass")
        _timed(rankcheck, "check", ours, "rankcheck")
    bypass = _Reasons()
    logging.getLogger("torch._functorch._aot_autograd.autograd_cache").addHandler(bypass)
    logging.getLogger("torch._functorch._aot_autograd.autograd_cache").setLevel(logging.INFO)
    model, (tokens,) = llama.build(**MODELS[model_name])
    compiled = torch.compile(model, backend=backend, options=options)
    dist.barrier()
    times, snapshots, cpu = [], [], []
    for _ in range(2):
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        loss = compiled(tokens).float().pow(2).mean()
        snapshots.append((_compile_seconds(), dict(ours)))   # the forward's compile ends here
        loss.backward()
        times.append(time.perf_counter() - start)
        cpu.append(_cpu_seconds() - cpu_start)
    dist.barrier()
    counters = {group: dict(torch._dynamo.utils.counters[group]) for group in ("inductor", "aot_autograd")}
    from torch._inductor import metrics
    return dict(first_s=times[0], second_s=times[1], first_cpu_s=cpu[0], forward=snapshots[0], kernels=metrics.generated_kernel_count,
                total=(_compile_seconds(), dict(ours)), aot_bypass=sorted(set(bypass.reasons)),
                cache={k: v for group in counters.values() for k, v in group.items() if "cache" in k})


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the C++
    compiler Inductor runs): what a compile costs, less dependent on the machine's load
    than wall time."""
    import resource
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _Reasons(logging.Handler):
    """Why AOTAutograd's cache was bypassed ("Bypassing autograd cache due to: ...")."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "Bypassing autograd cache" in message:
            self.reasons.append(message.split("due to: ", 1)[-1][:200])


def _split(r: dict) -> dict:
    """Seconds per phase (module docstring) from one rank's result: the forward's
    compile (Dynamo, AOTAutograd, compile_fx_inner of the forward) until its
    output, then the backward's compile_fx_inner at the first backward call."""
    (fw_t, fw_ours), (all_t, all_ours) = r["forward"], r["total"]
    dynamo = fw_t.get("_compile.compile_inner", 0.0) - fw_t.get("OutputGraph.call_user_compiler", 0.0)
    fw_inner = fw_t.get("compile_fx_inner", 0.0)
    aot = fw_t.get("OutputGraph.call_user_compiler", 0.0) - fw_inner - fw_ours.get("rankcheck", 0.0)
    passes, check = all_ours.get("pass", 0.0), all_ours.get("rankcheck", 0.0)
    return dict(dynamo=dynamo, aot=max(0.0, aot), passes=passes, check=check,
                inductor=max(0.0, all_t.get("compile_fx_inner", 0.0) - passes))


def _run(model_name: str, variant: str, cache_dir: str, timeout: float) -> dict:
    load = os.getloadavg()[0]
    ranks = launch.run(_job, world_size=2, args=(model_name, variant, cache_dir), timeout=timeout, gloo=False)
    slowest = max(ranks, key=lambda r: r["first_s"])
    return dict(first_s=slowest["first_s"], second_s=max(r["second_s"] for r in ranks),
                first_cpu_s=max(r["first_cpu_s"] for r in ranks),
                split=_split(ranks[0]), cache=ranks[0]["cache"], aot_bypass=ranks[0]["aot_bypass"], load1=load,
                kernels=ranks[0].get("kernels"))


def _ratios(runs: list[dict], base: list[dict], key: str) -> float:
    """Median over rounds of run / Inductor's run of the same round (cancels the load's drift
    between rounds better than a ratio of medians)."""
    return statistics.median(r[key] / b[key] for r, b in zip(runs, base))


def _rows(results: dict, variants: list[str]):
    """(model, phase, variant, runs, stats) for every cell; stats: wall and CPU medians, their
    ratios to Inductor's medians, the median of per-round wall and CPU ratios, split medians."""
    for model_name, per_variant in results.items():
        for phase in ("cold", "warm"):
            base = per_variant["inductor"][phase]
            for variant in variants:
                runs = per_variant[variant][phase]
                wall, cpu = (statistics.median(r[k] for r in runs) for k in ("first_s", "first_cpu_s"))
                stats = dict(median_s=round(wall, 2), ratio_to_inductor=round(wall / _median(base, "first_s"), 3),
                             round_ratio=round(_ratios(runs, base, "first_s"), 3), cpu_s=round(cpu, 2),
                             cpu_ratio=round(cpu / _median(base, "first_cpu_s"), 3),
                             cpu_round_ratio=round(_ratios(runs, base, "first_cpu_s"), 3),
                             split={p: round(statistics.median(r["split"][p] for r in runs), 2) for p in PHASES})
                yield model_name, phase, variant, runs, stats


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _table(results: dict, variants: list[str]) -> str:
    lines = [f"{'model':6} {'variant':26} {'phase':5} {'wall s':>7} {'x ind':>6} {'rnd x':>6} {'cpu s':>7} "
             f"{'x ind':>6} {'rnd x':>6}  {'dynamo':>6} {'aot':>6} {'passes':>6} {'check':>6} {'inductor':>8}  "
             f"runs wall (s)"]
    for model_name, phase, variant, runs, st in _rows(results, variants):
        split, each = st["split"], ", ".join(f"{r['first_s']:.0f}" for r in runs)
        lines.append(f"{model_name:6} {variant:26} {phase:5} {st['median_s']:7.1f} {st['ratio_to_inductor']:6.2f} "
                     f"{st['round_ratio']:6.2f} {st['cpu_s']:7.1f} {st['cpu_ratio']:6.2f} {st['cpu_round_ratio']:6.2f}  "
                     f"{split['dynamo']:6.1f} {split['aot']:6.1f} {split['passes']:6.2f} {split['check']:6.2f} "
                     f"{split['inductor']:8.1f}  {each}")
    return "\n".join(lines)


def _summary(results: dict, variants: list[str]) -> dict:
    return {f"{model_name}/{variant}/{phase}": stats for model_name, phase, variant, _, stats in _rows(results, variants)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="small,big")
    parser.add_argument("--variants", default="inductor,overlapc,overlapc_nocheck")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per process pair")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    models, variants = args.models.split(","), args.variants.split(",")
    if "inductor" not in variants:
        parser.error("the variants must include inductor: ratios are against it")
    results = {m: {v: {"cold": [], "warm": []} for v in variants} for m in models}
    root = tempfile.mkdtemp(prefix="overlapc-compile-cost-")
    try:
        for round_index in range(args.rounds):
            shift = round_index % len(variants)
            order = variants[shift:] + variants[:shift]
            for model_name in models:
                for variant in order:
                    cache = os.path.join(root, f"r{round_index}-{model_name}-{variant}")
                    os.makedirs(cache)
                    for phase in ("cold", "warm"):
                        run = _run(model_name, variant, cache, args.timeout)
                        results[model_name][variant][phase].append(run)
                        _write(args.json, results, variants, args.rounds, partial=True)
                        print(f"round {round_index} {model_name} {variant} {phase}: first step "
                              f"{run['first_s']:.1f} s (steady {run['second_s']:.2f} s, load {run['load1']:.1f}) "
                              f"cache {run['cache']}", flush=True)
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(_table(results, variants))
    _write(args.json, results, variants, args.rounds, partial=False)
    return 0


def _write(path: str | None, results: dict, variants: list[str], rounds: int,
           partial: bool) -> None:
    """The JSON document (rewritten after every run, so a cut-off run keeps what it measured)."""
    if not path:
        return
    complete = {m: per for m, per in results.items()
                if all(per[v][phase] for v in variants for phase in ("cold", "warm"))}
    document = dict(provenance=provenance({"loadavg_at_write": os.getloadavg()}), partial=partial,
                    models=MODELS, variants={k: VARIANTS[k] for k in variants}, rounds=rounds,
                    summary=_summary(complete, variants), runs=results)
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
    if not partial:
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

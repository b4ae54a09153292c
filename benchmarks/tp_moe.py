"""Pipelined collectives (overlapc.passes.chunk) on 2 gloo ranks over a shaped link.

    python benchmarks/tp_moe.py [--rate 500mbit] [--no-shape] [--steps 5]
                                [--json benchmarks/results/tp_moe.json]

The link is the one benchmarks/step_time.py uses: as root with ip and tc, the
ranks run in a fresh network namespace whose loopback is shaped with a token
bucket (tbf rate RATE burst 256kb limit 64mb); otherwise (or --no-shape) plain
loopback, and the output says so. One torch thread per rank.

Models (examples/tp_sp.py, moe.py, moe_dropless.py; fp32, forward + backward):
  tp_sp        transformer blocks with tensor + sequence parallelism, sequence-first
               [seq, batch, dim]: all-gather of the sequence -> q/k/v and MLP-up
               matmuls, o and MLP-down matmuls -> reduce-scatter (pieces are
               sequence rows: attention stops them, the MLP is one pipeline)
  tp_sp_batch  the same blocks batch-first [batch, seq, dim] (torchtitan's layout;
               DTensor's split + cat around the dim-0 collectives): pieces are batch
               rows, each block (attention; MLP) is one pipeline
  moe          expert-parallel MoE layers: all_to_all_single dispatch -> expert MLP ->
               all_to_all_single combine (equal splits, one expert per rank)
  moe_dropless token-choice MoE: a count exchange, then all_to_all_single with split
               sizes known only at run time, chunked by token ranges of every rank
               block (passes/chunk/ragged.py); no compute_only / comm_only /
               concurrent (their local stand-ins need static sizes), so no ceiling

Variants, timed interleaved (A B C ... A B C ...), medians over rounds of the
slowest rank's step:
  eager        the model as written (DTensor / functional collectives, no compile)
  chunks1/2/4/8 --path overlapc (default): torch.compile(backend="overlapc",
               options={"chunks": k, "inner": "aot_eager"}): chunk_collectives, then
               the scheduler, graphs executed eagerly (no Inductor: its compile of
               these DTensor graphs costs ~45 s per variant). --path pass: an
               AOTAutograd backend that runs chunk_collectives(gm, k) alone.
               chunks1 = the same compile without chunking.
  chunks1_auto_bytes, chunks8_auto_bytes  the same with max_in_flight_bytes="auto" (the
               default until 2026-11-28; the default "serial-peak" never raises the peak)
  chunks_auto  options={"chunks": "auto", "profile": <file>} through the same
               backend (--path pass: the pass alone), the profile calibrated at the
               start of the run (overlapc calibrate's quick sweep on this link, rank
               0's numbers on every rank): per pattern, the count the estimator puts
               fastest.
  compute_only the chunks1 graphs (the same AOTAutograd graphs, no decompositions)
               with every collective replaced by a local op of the same shape (no
               communication)
  comm_only    the chunks1 graphs' collectives alone, same sizes, issued and
               waited one after the other
  concurrent   compute_only on the main thread while a second thread runs comm_only:
               compute and communication with nothing tying them together, which
               no schedule of the real graph beats. Where it is slower than
               max(compute, comm), the two slow each other down on this machine
               (2 ranks, each with a compute thread and a gloo thread, on the
               host's cores); ceiling = chunks1 / concurrent is the most any
               chunk count can gain here.
Bounds: no schedule beats floor = max(compute, comm). A pipeline of k pieces
leaves at most one piece's worth of the smaller side exposed at its edges (the
first piece's incoming collective or the last piece's compute), so
  est_k = max(compute, comm) + min(compute, comm) / k   (k = 1: compute + comm)
is what k pieces should reach; a step below it means the edges overlapped too.
Peak memory: one extra (untimed) step per variant under torch.profiler with
profile_memory: every allocation and free of the rank's process during the step,
in time order, summed; the peak of that sum = bytes allocated on top of what
lived before the step (activations, collective buffers, gradients; parameters
excluded). The same profile counts the functional collectives started ("colls").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

from harness import concurrent_step, profile_step, run_worker_on_shaped_link, write_json  # noqa: E402

VARIANTS = ["eager", "chunks1", "chunks1_auto_bytes", "chunks2", "chunks4", "chunks8", "chunks8_auto_bytes", "chunks_auto",
            "compute_only", "comm_only", "concurrent"]
FIXED = ["chunks2", "chunks4", "chunks8"]
MODELS = ["tp_sp", "tp_sp_batch", "moe", "moe_dropless"]
# data-dependent split sizes: no local stand-in of the same shapes, nothing chunked
VARIANTS_OF = {"moe_dropless": ["eager", "chunks1", "chunks1_auto_bytes", "chunks2", "chunks4", "chunks8",
                                 "chunks8_auto_bytes", "chunks_auto"]}
ALWAYS = ("eager", "chunks1")   # the losses' and the speed-ups' references


def variants_of(name: str, chosen: list[str] | None = None) -> list[str]:
    """The variants model ``name`` runs: all of its own, or those of ``chosen`` (--variants)
    plus eager and chunks1, in the usual order."""
    own = VARIANTS_OF.get(name, VARIANTS)
    return own if chosen is None else [v for v in own if v in chosen or v in ALWAYS]


def chunk_options(variant: str) -> dict:
    """overlapc's options of a chunksK variant: {"chunks": K or "auto"}, and the "auto"
    byte budget for a ..._auto_bytes one (the default budget is "serial-peak")."""
    spec = variant[len("chunks"):]
    auto_bytes = spec.endswith("_auto_bytes")
    spec = spec.removesuffix("_auto_bytes").lstrip("_")
    options = {"chunks": spec if spec == "auto" else int(spec)}
    if auto_bytes:
        options["max_in_flight_bytes"] = "auto"
    return options


def log(msg: str) -> None:
    print(f"[tp_moe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="500mbit", help="tbf rate of the shaped loopback (tc syntax)")
    p.add_argument("--no-shape", action="store_true", help="plain loopback, no namespace")
    p.add_argument("--steps", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds after the compiling one")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--tp-hidden", type=int, default=4096)
    p.add_argument("--tp-heads", type=int, default=8)
    p.add_argument("--tp-depth", type=int, default=1)
    p.add_argument("--seq", type=int, default=256, help="TP+SP sequence (all ranks)")
    p.add_argument("--batch", type=int, default=8, help="TP+SP batch")
    p.add_argument("--moe-hidden", type=int, default=2048,
                   help="expert MLP width (4x dim, the usual FFN ratio: the experts' compute is then "
                        "of the order of the all-to-alls on the shaped link)")
    p.add_argument("--moe-depth", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="MoE tokens per rank")
    p.add_argument("--models", nargs="*", default=MODELS, choices=MODELS)
    p.add_argument("--variants", nargs="*", default=None, choices=VARIANTS,
                   help="run only these variants (eager and chunks1 always run: the references)")
    p.add_argument("--path", choices=("overlapc", "pass"), default="overlapc",
                   help="chunksK through backend='overlapc' (chunk + schedule, inner aot_eager), "
                        "or through a backend that runs chunk_collectives alone")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline for the whole run (s)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--link", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------ worker: ranks


def worker(args) -> int:
    """Launch the 2 ranks (overlapc.launch) and report; a dead, hung or raising rank is said."""
    from overlapc import launch

    try:
        per_rank = launch.run(rank_main, 2, (vars(args),), timeout=args.timeout, gloo_timeout=300.0)
    except Exception as error:  # noqa: BLE001 - reported, and written to the JSON
        failure = launch.failure_text(error)
        log(f"ERROR: {failure}")
        if args.json:
            write_json(args.json, {"link": args.link, "config": config_of(args), "error": failure})
        return 1
    return report(args, per_rank)


# ------------------------------------------------------------------ in each rank


def chunk_backend(chunks, notes: list, specs: list | None = None, local: bool = False, profile=None):
    """AOTAutograd backend (no decompositions, as backend="overlapc" with
    inner="aot_eager" compiles): drop_dead_compute and chunk_collectives(gm, chunks,
    profile) on forward and backward, then eager execution, unscheduled. ``specs``
    collects each collective (op, input shape, dtype, other args) in graph order;
    ``local`` replaces collectives by local ops."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from overlapc.backend import drop_dead_compute
    from overlapc.collectives import collective_op, is_wait, node_value
    from overlapc.passes.chunk import chunk_collectives

    def compile_graph(gm, example_inputs):
        drop_dead_compute(gm)
        notes.extend(chunk_collectives(gm, chunks, profile))
        for node in gm.graph.nodes:
            op = collective_op(node)
            if op is not None and specs is not None:
                value = node_value(node.args[0])
                specs.append((node.target, tuple(value.shape), value.dtype, tuple(node.args[1:])))
            if local and op is not None:
                node.target = _LOCAL[op]
            elif local and is_wait(node):
                node.target = _identity
        gm.recompile()
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph)


def _identity(x):
    return x


def _local_all_gather(x, world, group):
    return x.repeat(world, *([1] * (x.dim() - 1)))


def _local_reduce_scatter(x, op, world, group):
    return x.narrow(0, 0, x.shape[0] // world).clone()


def _local_all_to_all(x, out_splits, in_splits, group):
    return x.clone()


_LOCAL = {"all_gather_into_tensor": _local_all_gather, "reduce_scatter_tensor": _local_reduce_scatter,
          "all_to_all_single": _local_all_to_all}


def rank_main(rank: int, world: int, argd: dict) -> dict:
    """One rank (launched in the gloo group): build, compile and time every model's variants."""
    import torch
    import torch._dynamo
    import torch.distributed as dist

    args = argparse.Namespace(**argd)
    from overlapc.torch_compat import route_gloo_all_gathers
    route_gloo_all_gathers()   # several all-gathers in flight (README, Known issues)
    import warnings
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64
    say = log if rank == 0 else (lambda msg: None)
    import moe
    import moe_dropless
    import tp_sp
    from overlapc import calibrate
    from overlapc.estimate import costmodel

    builders = {
        "tp_sp": lambda: tp_sp.build(dim=args.dim, heads=args.tp_heads, hidden=args.tp_hidden,
                                     depth=args.tp_depth, seq=args.seq, batch=args.batch),
        "tp_sp_batch": lambda: tp_sp.build(dim=args.dim, heads=args.tp_heads, hidden=args.tp_hidden,
                                           depth=args.tp_depth, seq=args.seq, batch=args.batch, batch_first=True),
        "moe": lambda: moe.build(dim=args.dim, hidden=args.moe_hidden, tokens=args.tokens,
                                 capacity=args.tokens // world, depth=args.moe_depth),
        "moe_dropless": lambda: moe_dropless.build(dim=args.dim, hidden=args.moe_hidden, tokens=args.tokens,
                                                   depth=args.moe_depth),
    }
    _record_chunk_notes()
    say("calibrating this link and the compute (overlapc calibrate, quick sweep) ...")
    # One profile: every rank must choose the same counts.
    shared = calibrate.broadcast_object(calibrate.run_in_group(None, quick=True), torch.device("cpu"))
    profile_path = os.path.join(tempfile.mkdtemp(prefix="tp_moe_profile_"), "profile.json")
    calibrate.write(shared, profile_path)
    profile = costmodel.load_profile(profile_path)
    out = {"times": {}, "losses": {}, "peak_bytes": {}, "notes": {}, "profile": repr(profile)}
    for name in args.models:
        steps, notes = {}, {}
        specs: list = []
        variants = variants_of(name, args.variants)
        on_error = "raise"
        for variant in variants:
            if variant == "comm_only":
                steps[variant] = _comm_step(specs)
                continue
            if variant == "concurrent":
                steps[variant] = concurrent_step(steps["compute_only"], steps["comm_only"])
                continue
            torch._dynamo.reset()
            model, inputs = builders[name]()
            x0 = inputs[0].detach()
            if variant == "eager":
                fn = model
            elif variant == "compute_only":
                fn = torch.compile(model, backend=chunk_backend(1, [], specs, local=True))
            elif args.path == "overlapc":
                options = {**chunk_options(variant), "inner": "aot_eager", "on_error": on_error}
                if options["chunks"] == "auto":
                    options["profile"] = profile_path
                    notes[variant] = []
                fn = torch.compile(model, backend="overlapc", options=options)
            else:
                notes[variant] = []
                fn = torch.compile(model, backend=chunk_backend(chunk_options(variant)["chunks"],
                                                                notes[variant], profile=profile))
            steps[variant] = _train_step(model, fn, x0)
        for variant in variants:          # compiles, then warm-up
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if args.path == "overlapc" and variant == "chunks_auto":
                    _NOTES_INTO.append(notes[variant])
                out["losses"][f"{name}/{variant}"] = steps[variant]()
                _NOTES_INTO.clear()
            out.setdefault("fallbacks", {})[f"{name}/{variant}"] = [
                str(w.message)[:300] for w in caught if "overlapc left the graph unscheduled" in str(w.message)]
            say(f"{name}/{variant}: first step {time.perf_counter() - t0:.1f} s")
        times = {v: [] for v in variants}
        for r in range(args.warmup + args.steps):
            for variant in variants:
                dist.barrier()
                t0 = time.perf_counter()
                steps[variant]()
                if r >= args.warmup:
                    times[variant].append(time.perf_counter() - t0)
            say(f"{name}: round {r + 1}/{args.warmup + args.steps} " +
                " ".join(f"{v}={times[v][-1] * 1e3:.0f}ms" for v in variants if times[v] and r >= args.warmup))
        for variant in variants:
            dist.barrier()
            peak, collectives = profile_step(steps[variant])
            out["peak_bytes"][f"{name}/{variant}"] = peak
            out.setdefault("collectives_run", {})[f"{name}/{variant}"] = collectives
        for variant in variants:
            out["times"][f"{name}/{variant}"] = times[variant]
        out["notes"][name] = {v: [(n.pattern, n.applied, n.reason, n.chunks, n.estimates) for n in ns]
                              for v, ns in notes.items()}
        out["collectives_per_step"] = out.get("collectives_per_step", {})
        out["collectives_per_step"][name] = len(specs)
    return out


_NOTES_INTO: list = []   # the note list of the backend="overlapc" compile in progress


def _record_chunk_notes() -> None:
    """Have the chunk pass, as backend="overlapc" calls it, also hand its notes to
    ``_NOTES_INTO`` (the report prints chunks="auto"'s choices and estimates)."""
    import overlapc.passes.chunk as chunk
    original = chunk.chunk_collectives

    def recording(gm, chunks, profile=None):
        notes = original(gm, chunks, profile)
        for sink in _NOTES_INTO:
            sink.extend(notes)
        return notes
    chunk.chunk_collectives = recording


def _train_step(model, fn, x0):
    def step():
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y = fn(x)
        loss = (y * y).mean()
        loss.backward()
        return float(loss)
    return step


def _comm_step(specs):
    import torch
    F = torch.ops._c10d_functional
    buffers: list = []

    def step():   # specs fill while chunks1 compiles: buffers are made on the first call
        if not buffers:
            buffers.extend(torch.zeros(shape, dtype=dtype) for _, shape, dtype, _ in specs)
        for (target, _, _, rest), buf in zip(specs, buffers):
            F.wait_tensor(target(buf, *rest))
        return 0.0
    return step


# ------------------------------------------------------------------ report


def config_of(args) -> dict:
    return {"world_size": 2, "rate": None if args.no_shape else args.rate, "dim": args.dim,
            "tp": {"hidden": args.tp_hidden, "heads": args.tp_heads, "depth": args.tp_depth,
                   "seq": args.seq, "batch": args.batch},
            "moe": {"hidden": args.moe_hidden, "depth": args.moe_depth, "tokens_per_rank": args.tokens,
                    "experts": 2, "capacity": args.tokens // 2, "dropless": "top-1 token choice"},
            "steps": args.steps, "warmup": args.warmup, "dtype": "float32", "torch_threads_per_rank": 1,
            "chunking": _path_text(args),
            "cpus": os.cpu_count(), "loadavg_at_report": list(os.getloadavg())}


def _path_text(args) -> str:
    if args.path == "overlapc":
        return ('backend="overlapc", options chunks=k or "auto" (with the calibrated profile), inner="aot_eager" '
                "(chunk_collectives, then the scheduler with default options); graphs run eagerly, no Inductor")
    return ("AOTAutograd backend calling chunk_collectives alone (no scheduler); graphs run eagerly, "
            "in the order the pass emits")


def report(args, per_rank: list[dict]) -> int:
    """Tables and goals; returns 1 when a loss differs from eager (fp32, rtol 1e-5)."""
    rows, ok = {}, True
    print()
    print(f"link: {args.link}")
    print(f"load average (1/5/15 min) at report: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cpus")
    print(f"chunking: {_path_text(args)}")
    print(f"profile for chunks_auto: {per_rank[0]['profile']}")
    for name in args.models:
        variants = variants_of(name, args.variants)
        med = {}
        for v in variants:
            key = f"{name}/{v}"
            slowest = [max(r["times"][key][i] for r in per_rank) for i in range(len(per_rank[0]["times"][key]))]
            med[v] = statistics.median(slowest)
        compute, comm = med.get("compute_only"), med.get("comm_only")
        unchunked = per_rank[0]["collectives_per_step"][name] or per_rank[0]["collectives_run"][f"{name}/chunks1"]
        print(f"\n{name}: {unchunked} collectives per step (unchunked)"
              + ("" if compute is None else f"; compute {compute * 1e3:.0f} ms, comm {comm * 1e3:.0f} ms")
              + f" (medians of {args.steps} rounds, slowest rank)")
        if compute is not None:
            print(f"floor max(compute, comm) = {max(compute, comm) * 1e3:.0f} ms; est_ms = floor + min(compute, comm) / k")
        print(f"{'variant':<14}{'step_ms':>9}{'vs_chunks1':>12}{'est_ms':>10}{'peak_MiB':>10}{'colls':>7}  loss_ok")
        rows[name] = {}
        for v in variants:
            k = int(v[len("chunks"):]) if v in ("chunks1", *FIXED) else None
            bound = None if k is None or compute is None else max(compute, comm) + min(compute, comm) / k
            peak = max(r["peak_bytes"][f"{name}/{v}"] for r in per_rank)
            loss_ok = None
            if v.startswith("chunks") or v == "eager":
                loss_ok = all(abs(r["losses"][f"{name}/{v}"] - r["losses"][f"{name}/eager"]) <=
                              1e-5 * abs(r["losses"][f"{name}/eager"]) + 1e-7 for r in per_rank)
                ok &= loss_ok
            speed = med["chunks1"] / med[v]
            fallbacks = per_rank[0].get("fallbacks", {}).get(f"{name}/{v}", [])
            rows[name][v] = {"step_ms": med[v] * 1e3, "speedup_vs_chunks1": speed,
                             "collectives_run_per_step": per_rank[0]["collectives_run"][f"{name}/{v}"],
                             "est_ms": None if bound is None else bound * 1e3,
                             "peak_bytes": peak, "loss_matches_eager": loss_ok, "fallbacks": fallbacks,
                             "times_ms_slowest_rank": [round(max(r["times"][f"{name}/{v}"][i] for r in per_rank) * 1e3, 2)
                                                       for i in range(args.steps)]}
            print(f"{v:<14}{med[v] * 1e3:>9.0f}{speed:>11.2f}x{'' if bound is None else f'{bound * 1e3:>10.0f}':>10}"
                  f"{peak / 2**20:>10.1f}{per_rank[0]['collectives_run'][f'{name}/{v}']:>7}  "
                  f"{'' if loss_ok is None else loss_ok}{'  FELL BACK: ' + fallbacks[0] if fallbacks else ''}")
        notes = per_rank[0]["notes"][name]
        rows[name]["notes"] = notes
        for pattern, applied, reason, k, estimates in notes.get("chunks_auto", []):
            est = ", ".join(f"{n}: {ms:.2f}" for n, ms in estimates)
            print(f"  chunks_auto {pattern}: {k if applied else 1} piece(s){'' if applied else ' (' + reason + ')'}"
                  f"{'; estimates ms ' + est if est else ''}")
        fixed = [v for v in FIXED if v in med]
        if not fixed:
            continue
        best = min(fixed, key=lambda v: med[v])
        speed = med["chunks1"] / med[best]
        tp = name.startswith("tp_sp")
        goal = 1.3 if tp else 1.5
        of_concurrent = med[best] / med["concurrent"] if "concurrent" in med else None
        auto_gap = med["chunks_auto"] / med[best] - 1 if "chunks_auto" in med else None   # --variants
        rows[name]["floor_ms"] = max(compute, comm) * 1e3 if compute is not None else None
        rows[name]["best"] = {"variant": best, "speedup_vs_chunks1": speed, "goal_speedup": goal,
                              "goal_speedup_met": speed >= goal,
                              "best_over_concurrent": of_concurrent,
                              "goal_within_10pct_of_concurrent_met":
                                  of_concurrent <= 1.10 if tp and of_concurrent is not None else None,
                              "auto_over_best": None if auto_gap is None else 1 + auto_gap,
                              "goal_auto_within_3pct_met": None if auto_gap is None else auto_gap <= 0.03,
                              "ideal_speedup": (compute + comm) / max(compute, comm) if compute else None,
                              "ceiling_speedup": med["chunks1"] / med["concurrent"] if of_concurrent else None}
        print(f"best fixed: {best} {speed:.2f}x vs chunks1 (goal >= {goal}x: {'met' if speed >= goal else 'NOT met'})"
              + (f"; {of_concurrent:.2f}x concurrent (goal <= 1.10x: {'met' if of_concurrent <= 1.10 else 'NOT met'})"
                 if tp and of_concurrent is not None else "")
              + ("" if auto_gap is None else
                 f"; chunks_auto {1 + auto_gap:.3f}x best (goal <= 1.03x: {'met' if auto_gap <= 0.03 else 'NOT met'})"))
        if of_concurrent is not None:
            print(f"concurrent (compute || comm, untied) {med['concurrent'] * 1e3:.0f} ms = "
                  f"{med['concurrent'] / max(compute, comm):.2f}x the floor; chunks1 / concurrent = "
                  f"{med['chunks1'] / med['concurrent']:.2f}x is the most any chunk count gains here")
    if args.json:
        write_json(args.json, {"link": args.link, "config": config_of(args), "results": rows,
                                "losses_per_rank": [r["losses"] for r in per_rank]})
        log(f"wrote {args.json}")
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    return run_worker_on_shaped_link(args, [a for a in argv if a != "--worker"], script=__file__, label="tpmoe",
                                     say=log)


if __name__ == "__main__":
    sys.exit(main())

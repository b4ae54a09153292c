"""`make demo` / `overlapc demo`: 2 local gloo ranks train a small sharded transformer.

First the ranks calibrate a profile of this machine and link (``overlapc
calibrate``'s quick sweep, not under the profiler: the timed steps the header
compares with are not profiled either), so the estimates are this machine's;
overlapc compiles with it (``profile.json``), and every estimate the demo prints
uses it. ``--profile FILE`` uses a profile calibrated before instead (``overlapc
calibrate --world-size 2`` on this machine; copied to ``profile.json``), and the
demo starts training at once.
Each rank builds the same model, shards it with overlapc.fsdp, and compiles it
twice from the same initial weights: under backend="overlapc" (default options
unless flags say otherwise) and under plain Inductor. After one compiling step
each, the two models train in alternating steps (the first of each pair
alternates too), so a burst of load on a shared machine hits both alike; the
step times are the medians over the pairs. Then ``PROFILED`` more overlapc
steps run under torch.profiler (``overlapc.explain.analyze`` reads the trace).

Rank 0 prints, in three parts: a header block (model and mesh, whether the
losses are equal, the measured step of overlapc vs Inductor and their ratio;
the estimate of each step and of the same ratio, the Inductor one from the
traced graphs in their own order, unbucketed, as plain Inductor runs them,
overlapc's from its scheduled graphs; peak memory of both orders, exposed
communication in both), one compact
table per graph (``report.format_graph``; its "before" is the order the
scheduler was handed, after bucketing), and only with ``--verbose`` the
details: losses and times per step, the wide tables, and per profiled step
the estimated vs the measured time (``overlapc.explain.analyze``; profiled steps carry
the profiler's cost, which the calibration leaves out). A step's estimate is
its graphs' simulated times plus what runs outside them:
``costmodel.outside_ms`` (the calibrated per-step and per-parameter costs) and
the step's barrier (the calibrated all-reduce latency).

The ranks' stderr (file descriptor 2: Python warnings and logs, and torch's
native lines such as the profiler's) goes to ``rank<R>.log`` in the demo's
folder, never to the terminal. The ranks run under ``overlapc.launch``: a rank that
raises has its traceback printed, one that dies or hangs ends the demo with its
name and the end of its log (where a hung rank's stacks go).
``--keep DIR`` keeps the folder: logs, profile, schedule dumps, traces, and
``schedule.html`` (``overlapc.explain.html_report``: the timelines before and after, live
bytes and the profiled run beside the estimate).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist


class TinyTransformer(torch.nn.Module):
    def __init__(self, layers: int, width: int, heads: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0,
                                             batch_first=True) for _ in range(layers))
        self.head = torch.nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _step(model, optimizer, x, y) -> tuple[float, float]:
    """One training step and its barrier: (loss, seconds)."""
    begin = time.perf_counter()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return loss.item(), time.perf_counter() - begin


def _train_alternating(models: dict, data, steps: int, say) -> dict:
    """Step 0 of each model (its compile), one after the other; then steps 1.. in
    alternating pairs, the model going first alternating too. name -> (losses, seconds)."""
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.05) for name, model in models.items()}
    results = {name: ([], []) for name in models}
    names = list(models)
    for name in names:
        say(f"compiling under {_LABEL[name]} (its first step) ...")
        begin = time.perf_counter()
        loss, seconds = _step(models[name], optimizers[name], *data[0])
        results[name][0].append(loss)
        results[name][1].append(seconds)
        say(f"  {_LABEL[name]}: first step incl. compile {time.perf_counter() - begin:.0f} s")
    say(f"timing {steps - 1} alternating pairs of steps ...")
    for step in range(1, steps):
        for name in (names if step % 2 else names[::-1]):
            loss, seconds = _step(models[name], optimizers[name], *data[step % len(data)])
            results[name][0].append(loss)
            results[name][1].append(seconds)
    return results


_LABEL = {"overlapc": "overlapc", "inductor": "Inductor"}


def _log_stderr(path: str) -> None:
    """Send this process's file descriptor 2 (Python's stderr and every native library's)
    to ``path`` from now on."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


@contextlib.contextmanager
def _stderr_to(path: str):
    """File descriptor 2 goes to ``path`` for the duration (processes started meanwhile keep it:
    what the ranks write before ``_rank_main`` runs, such as import-time warnings)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        _log_stderr(path)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _schedule_options(args: argparse.Namespace) -> dict:
    """The overlapc options the flags ask for (checked in ``main`` before any rank starts)."""
    options = {}
    if args.max_in_flight is not None:
        options["max_in_flight"] = None if args.max_in_flight == 0 else args.max_in_flight
    if args.bucket is not None:
        options["bucket"] = {"none": None}.get(args.bucket, int(args.bucket) if args.bucket.isdigit()
                                               else args.bucket)
    return options


def _rank_main(rank: int, world_size: int, args: argparse.Namespace, dump_dir: str) -> None:
    """One rank (``overlapc.launch`` has joined the gloo group): calibrate, train both, profile, report."""
    _log_stderr(os.path.join(dump_dir, f"rank{rank}.log"))
    import overlapc.fsdp
    logging.basicConfig(level=logging.WARNING)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    generator = torch.Generator().manual_seed(1234 + rank)
    data = [(torch.randn(args.batch, args.seq, args.width, generator=generator),
             torch.randn(args.batch, args.seq, args.width, generator=generator)) for _ in range(4)]

    profile = os.path.join(dump_dir, "profile.json")
    if args.profile:
        if rank == 0:
            shutil.copyfile(args.profile, profile)
    else:
        from overlapc import calibrate
        say("calibrating this machine and link (quick sweep) ...")
        calibrate.run_in_group(profile, quick=True)
    dist.barrier()
    options = {"dump_dir": dump_dir, "profile": profile, **_schedule_options(args)}
    models = {}
    for name, backend, opts in (("overlapc", "overlapc", options), ("inductor", "inductor", None)):
        torch.manual_seed(0)
        model = overlapc.fsdp.shard(TinyTransformer(args.layers, args.width, args.heads), mesh)
        models[name] = torch.compile(model, backend=backend, options=opts)
    results = _train_alternating(models, data, args.steps, say)
    dist.barrier()

    trace = os.path.join(dump_dir, f"trace_rank{rank}.json")
    say(f"profiling {PROFILED} overlapc steps (torch.profiler) ...")
    _profile(models["overlapc"], data, trace)
    dist.barrier()
    estimates = _estimates(mesh, args, data, options, profile)
    if rank == 0:
        parameters = sum(1 for _ in models["overlapc"].parameters())
        print(_results_text(args, world_size, dump_dir, profile, trace, results, parameters, estimates), end="",
              flush=True)
    if args.keep:
        _write_page(rank, mesh, args, data, options, profile, trace, dump_dir)


def _estimates(mesh, args, data, options: dict, profile: str) -> dict:
    """{"inductor": {graph: Timeline}, "overlapc": {graph: Timeline}}: the graphs as plain Inductor
    runs them (the traced graphs, unbucketed, in their own order: every wait right after its
    collective) and as overlapc scheduled them (``options``, the compiled model's), each simulated
    with ``profile``. Every rank captures the model twice more (``backend.capture``: the
    collectives run on gloo, so all take part)."""
    import overlapc.fsdp
    from overlapc import backend as overlapc_backend
    from overlapc.estimate import costmodel
    from overlapc.estimate.simulate import simulate

    calibrated = costmodel.load_profile(profile)
    timelines = {}
    for name, how in (("inductor", {"bucket": None, "chunks": 1}),
                      ("overlapc", {k: v for k, v in options.items() if k != "dump_dir"})):
        torch.manual_seed(0)
        model = overlapc.fsdp.shard(TinyTransformer(args.layers, args.width, args.heads), mesh)
        records = overlapc_backend.capture(model, (data[0][0],), how)
        timelines[name] = {record.name: simulate(record.gm, calibrated, record.before_order if name == "inductor"
                                                 else None) for record in records}
    return timelines


def _write_page(rank: int, mesh, args, data, options: dict, profile: str, trace: str, dump_dir: str) -> None:
    """``DIR/schedule.html`` (``overlapc.explain.html_report``) of rank 0's graphs with its profiled run.
    Every rank captures the model once more (aot_eager: the collectives run on gloo, so all take part)."""
    import overlapc.fsdp
    from overlapc import backend as overlapc_backend
    from overlapc.explain import html_report

    torch.manual_seed(0)
    model = overlapc.fsdp.shard(TinyTransformer(args.layers, args.width, args.heads), mesh)
    records = overlapc_backend.capture(model, (data[0][0],), {k: v for k, v in options.items() if k != "dump_dir"})
    if rank == 0:
        html_report.write_html(os.path.join(dump_dir, "schedule.html"), records, profile, options, trace=trace,
                               dump=dump_dir, title="overlapc demo: the schedule of rank 0")


def _results_text(args, world_size: int, dump_dir: str, profile: str, trace: str, results: dict,
                  parameters: int, estimates: dict) -> str:
    """Rank 0's three parts: the header block (estimates with ``profile``: ``_estimates``), a compact
    table per graph (the dumps': the same profile), details (--verbose)."""
    from overlapc.estimate import costmodel
    from overlapc.explain import report
    from overlapc.explain.analysis_output import comparison_text
    from overlapc.explain.analyze import analyze

    graphs = _graphs(os.path.join(dump_dir, "rank0"))
    calibrated = costmodel.load_profile(profile)
    framework = costmodel.outside_ms(parameters, calibrated.device)
    barrier = calibrated.link.for_kind("all_reduce")[1] * 1e-3   # the step's dist.barrier(): latency
    measured = analyze(trace, dump_dir)
    lines = _header(args, world_size, results, graphs, framework + barrier, measured, estimates)
    when = f"given: --profile {os.path.basename(args.profile)}" if args.profile else "calibrated before compiling"
    lines += [f"estimates above and below: {os.path.basename(profile)} ({when})",
              "", "schedule per graph"]
    text = "\n".join(report.wrap(line, "    ").rstrip("\n") for line in lines) + "\n"
    for name, rows, summary in graphs:
        text += "\n" + report.format_graph(name, rows, summary)
    if not args.verbose:
        return text + "\n(`overlapc demo --verbose` adds per-step losses and times, the wide tables and " \
            "estimated vs measured\n profiled steps)\n"
    details = ["", "== details =="]
    for name, (losses, times) in results.items():
        details.append(f"[{name}] losses: " + " ".join(f"{loss:.5f}" for loss in losses))
        details.append(f"[{name}] step ms: " + " ".join(f"{t * 1e3:.1f}" for t in times)
                       + "   (the first includes compilation)")
    for name, rows, summary in graphs:
        details += ["", report.format_graph(name, rows, summary, wide=True).rstrip("\n")]
    details += ["", "== estimated vs measured (rank 0, profiled steps; `overlapc analyze`) ==",
                f"outside the graphs, estimated {framework + barrier:.1f} ms: framework and SGD {framework:.1f} ms "
                f"(calibrated {calibrated.device.step_us:.0f} us + {parameters} parameters x "
                f"{calibrated.device.param_us:.1f} us), the barrier {barrier:.1f} ms (all-reduce latency)",
                comparison_text(measured, framework + barrier)]
    return text + "\n".join(details) + "\n"


def _graphs(folder: str) -> list:
    """(name, rows, summary) of each graph the backend dumped into ``folder``, forward first."""
    from overlapc.explain import report

    graphs = []
    for graph in sorted(os.listdir(folder), key=lambda g: (g[:2] != "fw", g)):
        with open(os.path.join(folder, graph, "report.json"), encoding="utf-8") as source:
            document = json.load(source)
        graphs.append((graph, [report.Row(**row) for row in document["collectives"]], document["summary"]))
    return graphs


def _header(args, world_size: int, results: dict, graphs: list, outside_ms: float, measured,
            estimates: dict) -> list[str]:
    """The header block: what ran, losses, measured and estimated step, memory, exposed communication.
    The estimated gain is the original order's estimate (``estimates["inductor"]``: the traced graphs
    as plain Inductor runs them, ``_estimates``) over overlapc's (``estimates["overlapc"]``), each
    the graphs' simulated steps plus what runs outside them (``outside_ms``), beside the measured
    Inductor / overlapc ratio (of the medians); each estimate is also checked against its measured
    step."""
    from overlapc.explain.report import size_text

    (o_losses, o_times), (i_losses, i_times) = results["overlapc"], results["inductor"]
    pairs = list(zip(o_times[1:], i_times[1:]))
    overlapc_ms = statistics.median(o for o, _ in pairs) * 1e3
    inductor_ms = statistics.median(i for _, i in pairs) * 1e3
    pair_ratio = statistics.median(i / o for o, i in pairs)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(o_losses, i_losses))
    losses = (f"equal in all {len(o_losses)} steps" if worst == 0 else
              f"agree to {worst:.1e} relative (largest difference over {len(o_losses)} steps)")
    before = sum(t.step_ms for t in estimates["inductor"].values()) + outside_ms
    after = sum(t.step_ms for t in estimates["overlapc"].values()) + outside_ms
    ratio = inductor_ms / overlapc_ms
    original = estimates["inductor"]
    exposed = [(name, original[name].exposed_ms if name in original else float("nan"), t.exposed_ms)
               for name, t in estimates["overlapc"].items()]
    per_graph = ", ".join(f"{name} {b:.1f} -> {a:.1f}" for name, b, a in exposed)
    peak = [max(s[f"peak_bytes_{order}"] for _, _, s in graphs) for order in ("before", "after")]
    timed = [s for s in measured.steps if s.estimated_step_ms is not None] or measured.steps
    measured_exposed = statistics.median(s.exposed_ms for s in timed) if timed else float("nan")
    return [
        f"== overlapc demo: {args.layers} x TransformerEncoderLayer (width {args.width}, {args.heads} heads) "
        f"+ Linear, batch {args.batch} x seq {args.seq}",
        f"   sharded by overlapc.fsdp over a 1-D mesh of {world_size} gloo ranks on this CPU; "
        f"torch {torch.__version__}",
        f"losses       {losses} (overlapc vs Inductor, same weights and data)",
        f"step time    overlapc {overlapc_ms:.1f} ms, Inductor {inductor_ms:.1f} ms: overlapc "
        f"{ratio:.2f}x {'faster' if ratio >= 1 else 'slower'} (medians of {len(pairs)} pairs; "
        f"per pair {pair_ratio:.2f}x)",
        f"estimated    Inductor's order {before:.1f} ms ({before / inductor_ms:.2f}x measured), overlapc's "
        f"{after:.1f} ms ({after / overlapc_ms:.2f}x): gain {before / after:.2f}x, measured {ratio:.2f}x",
        f"peak memory  original order {size_text(peak[0])}, overlapc's order {size_text(peak[1])} "
        f"({peak[1] / peak[0]:.3f}x; estimated live bytes of the largest graph)",
        f"exposed comm estimated {sum(t.exposed_ms for t in original.values()):.1f} (Inductor's order) "
        f"-> {sum(a for _, _, a in exposed):.1f} ms per step ({per_graph})",
        f"             measured under overlapc {measured_exposed:.1f} ms per step (median of {len(timed)} profiled "
        f"steps)",
    ]


STEPS = 201    # per model, the first compiling: on 2 shared cores the Inductor / overlapc ratio of 30
#               consecutive pairs moved 1.19-1.55x within one run (load comes in spells of seconds), so
#               31 pairs (2-4 s) measured 1.18-1.49x over 8 runs; 120-240 pairs (10-20 s) 1.30-1.42x
PROFILED = 9   # steps under torch.profiler, after one warm-up step: on 2 shared cores a step takes
#               28-80 ms (a ~4 ms stall hits some collectives and not others), and the median of 5
#               moved by a third between runs of the same program


def _profile(model, data, path: str) -> None:
    """``PROFILED`` training steps under torch.profiler (after one warm-up step), written to ``path``."""
    from torch.profiler import ProfilerActivity, profile, schedule

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=PROFILED, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(path)) as prof:
        for step in range(PROFILED + 1):
            x, y = data[step % len(data)]
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            prof.step()


_EXAMPLES = """examples:
  overlapc demo
  overlapc demo --keep demo-out --verbose
  overlapc demo --layers 4 --width 128 --max-in-flight 2 --bucket none"""


def _arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overlapc demo", description=textwrap.fill(
            "Train a small sharded transformer on 2 local gloo ranks under overlapc and under Inductor; print "
            "whether the losses agree, both step times and overlapc's schedule.", 100),
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per model, the first compiling "
                        f"(default {STEPS}: {STEPS - 1} timed pairs)")
    parser.add_argument("--layers", type=int, default=2, help="TransformerEncoderLayer blocks (default 2)")
    parser.add_argument("--width", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step and rank (default 8)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="collectives of a group and kind in flight (0 = no limit; default: overlapc's, 3)")
    parser.add_argument("--bucket", default=None,
                        help='"auto", "module", a byte count, or "none" (default: overlapc\'s, auto)')
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds before the ranks are stopped (default 900)")
    parser.add_argument("--keep", metavar="DIR", help="write the rank logs, profile, schedule dumps, "
                        "profiler traces and the schedule page schedule.html here and keep them (default: a temporary folder); then try "
                        "`overlapc analyze DIR/trace_rank0.json --dump DIR`")
    parser.add_argument("--profile", metavar="FILE", help="a profile from `overlapc calibrate --world-size 2` "
                        "on this machine, used instead of calibrating first (default: calibrate, about a minute)")
    parser.add_argument("--verbose", action="store_true", help="also print losses and times per step, the "
                        "wide tables and the estimated vs measured profiled steps (default: off)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _arguments()
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step includes compilation)")
    from overlapc.config import OverlapConfig
    try:
        OverlapConfig.from_options(_schedule_options(args), env={})
    except ValueError as error:
        parser.error(str(error))
    if args.profile:
        from overlapc.estimate import costmodel
        try:
            costmodel.load_profile(args.profile)
        except ValueError as error:
            parser.error(f"--profile: {error}")
    world_size = 2
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    print(f"overlapc demo: {world_size} gloo ranks on this machine; their stderr goes to rank<R>.log in "
          f"{'the folder --keep names' if args.keep else 'a temporary folder (--keep keeps it)'}", flush=True)
    with (contextlib.nullcontext(os.path.abspath(args.keep)) if args.keep
          else tempfile.TemporaryDirectory(prefix="overlapc-demo-")) as dump_dir:
        code = _run_ranks(world_size, args, dump_dir)
    if args.keep:
        print(f"\nkept (logs, profile, dumps, traces, schedule.html; try `overlapc analyze DIR/trace_rank0.json --dump DIR`):\n"
              f"  {os.path.abspath(args.keep)}")
    return code


def _run_ranks(world_size: int, args: argparse.Namespace, dump_dir: str) -> int:
    """Run the ranks through ``overlapc.launch`` (their stderr, from interpreter start, in
    ``dump_dir``); 1 with the failing rank's error when one raises, dies or outlives
    ``args.timeout`` (then with the end of the logs, where a hung rank's stacks go)."""
    from overlapc import launch

    try:
        with _stderr_to(os.path.join(dump_dir, "launch.log")):
            launch.run(_rank_main, world_size, args=(args, dump_dir), timeout=args.timeout)
    except launch.RankFailure as error:
        print(f"overlapc demo: {error}" + _log_tails(dump_dir, error.ranks), file=sys.stderr)
        return 1
    except Exception as error:   # noqa: BLE001 - a rank's exception, re-raised by the launcher
        print(f"overlapc demo: {launch.failure_text(error)}", file=sys.stderr)
        return 1
    return 0


def _log_tails(dump_dir: str, ranks, lines: int = 20) -> str:
    """The last ``lines`` lines of each rank's log, for a rank that died or hung."""
    text = ""
    for rank in ranks:
        path = os.path.join(dump_dir, f"rank{rank}.log")
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as log:
                tail = log.read().splitlines()[-lines:]
            text += f"\n--- end of {path} ---\n" + "\n".join(tail)
    return text


if __name__ == "__main__":
    sys.exit(main())

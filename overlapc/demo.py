"""`make demo` / `overlapc demo`: 2 local gloo ranks train a small sharded transformer.

First the ranks calibrate a profile of this machine and link (``overlapc
calibrate``'s quick sweep, ``profiled``: under torch.profiler, as the steps
whose measurements the estimates are compared with), so the reports'
estimates are this machine's. Each
rank builds the same model, shards it with overlapc.fsdp, and trains it twice
from the same initial weights: under backend="overlapc" (default options unless
flags say otherwise) and under plain Inductor. Rank 0 prints the loss per step,
the schedule overlapc chose for the forward and backward graphs (from the
backend's own artifacts: collectives per graph before -> after bucketing,
estimates, peak memory), and the median step time of both. Then ``PROFILED``
more overlapc steps run under torch.profiler, and rank 0 prints, per graph and
per step, the estimated and the measured time and exposed communication
(``overlapc.analyze`` on its trace). A step's estimate is its graphs' simulated
times plus what runs outside them: ``costmodel.outside_ms`` (the calibrated
per-step and per-parameter costs) and the step's barrier (the calibrated
all-reduce latency). ``--keep DIR`` keeps the profile, dumps
and traces. A rank that dies or hangs ends the demo with a message instead of
a hang.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(model, data, steps: int) -> tuple[list[float], list[float]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, times = [], []
    for step in range(steps):
        x, y = data[step % len(data)]
        begin = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - begin)
        losses.append(loss.item())
    return losses, times


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, dump_dir: str) -> None:
    import overlapc.fsdp
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    logging.basicConfig(level=logging.WARNING)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    say = print if rank == 0 else (lambda *a, **k: None)
    generator = torch.Generator().manual_seed(1234 + rank)
    data = [(torch.randn(args.batch, args.seq, args.width, generator=generator),
             torch.randn(args.batch, args.seq, args.width, generator=generator)) for _ in range(4)]

    from overlapc.calibrate import run_in_group
    profile = os.path.join(dump_dir, "profile.json")
    say("calibrating this machine and link (quick sweep, under torch.profiler as the measured steps) ...",
        flush=True)
    run_in_group(profile, quick=True, profiled=True)
    dist.barrier()
    options = {"dump_dir": dump_dir, "profile": profile}
    if args.max_in_flight is not None:
        options["max_in_flight"] = None if args.max_in_flight == 0 else args.max_in_flight
    if args.bucket is not None:
        options["bucket"] = {"none": None}.get(args.bucket, int(args.bucket) if args.bucket.isdigit()
                                               else args.bucket)
    results, models = {}, {}
    for name, backend, options in (("overlapc", "overlapc", options), ("inductor", "inductor", None)):
        torch.manual_seed(0)
        model = overlapc.fsdp.shard(TinyTransformer(args.layers, args.width, args.heads), mesh)
        compiled = torch.compile(model, backend=backend, options=options)
        say(f"[{name}] compiling and training {args.steps} steps ...", flush=True)
        begin = time.perf_counter()
        losses, times = _train(compiled, data, args.steps)
        results[name], models[name] = (losses, times), compiled
        say(f"[{name}] losses: " + " ".join(f"{loss:.5f}" for loss in losses)
            + f"   (first step incl. compile {times[0]:.1f} s, total {time.perf_counter() - begin:.1f} s)",
            flush=True)

    trace = os.path.join(dump_dir, f"trace_rank{rank}.json")
    say(f"[overlapc] profiling {PROFILED} steps (torch.profiler) ...", flush=True)
    _profile(models["overlapc"], data, trace)
    dist.barrier()
    if rank == 0:
        for graph in sorted(os.listdir(os.path.join(dump_dir, "rank0")), key=lambda g: (g[:2] != "fw", g)):
            folder = os.path.join(dump_dir, "rank0", graph)
            with open(os.path.join(folder, "report.txt")) as report:
                text = report.read().rstrip()
            before, after = (_count_collectives(os.path.join(folder, f)) for f in ("before.txt", "after.txt"))
            print(f"\n== schedule of {graph} (rank 0): {before} collectives before -> {after} after ==\n{text}")
        timed = {name: statistics.median(times[1:]) for name, (_, times) in results.items()}
        same = max(abs(a - b) / max(abs(b), 1e-12)
                   for a, b in zip(results["overlapc"][0], results["inductor"][0]))
        print(f"\nmedian step time (steps 2..{args.steps}): overlapc {timed['overlapc'] * 1e3:.1f} ms, "
              f"inductor {timed['inductor'] * 1e3:.1f} ms "
              f"(ratio {timed['inductor'] / timed['overlapc']:.2f}x); "
              f"losses agree to {same:.1e} relative")
        from overlapc import costmodel
        from overlapc.analyze import analyze, comparison_text
        calibrated = costmodel.load_profile(profile)
        params = sum(1 for _ in models["overlapc"].parameters())
        framework = costmodel.outside_ms(params, calibrated.device)
        barrier = calibrated.link.for_kind("all_reduce")[1] * 1e-3   # the step's dist.barrier(): latency
        print("\n== estimated vs measured (rank 0, profiled steps; `overlapc analyze`) ==")
        print(f"outside the graphs, estimated {framework + barrier:.1f} ms: framework and SGD "
              f"{framework:.1f} ms (calibrated {calibrated.device.step_us:.0f} us + {params} parameters x "
              f"{calibrated.device.param_us:.1f} us), the barrier {barrier:.1f} ms (all-reduce latency)")
        measured = analyze(trace, dump_dir)
        print(comparison_text(measured, framework + barrier))
        estimate = statistics.median(s.estimated_step_ms for s in measured.steps) + framework + barrier
        profiled = statistics.median(s.step_ms for s in measured.steps)
        print(f"estimated step {estimate:.1f} ms: {estimate / profiled:.2f}x the profiled median "
              f"({profiled:.1f} ms), {estimate / (timed['overlapc'] * 1e3):.2f}x the timed median above "
              f"({timed['overlapc'] * 1e3:.1f} ms, not profiled)")
        print("Estimates use the profile calibrated above (quick sweep, noisy on shared cores); "
              "benchmarks/step_time.py shapes the link to show the overlap at realistic ratios.")
    dist.destroy_process_group()


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


def _count_collectives(path: str) -> int:
    """Collective starts in a dumped graph's code (every functional op but wait_tensor)."""
    with open(path) as code:
        return sum(1 for line in code if "torch.ops._c10d_functional." in line and "wait_tensor" not in line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overlapc demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="collectives of a group and kind in flight (0 = no limit; default: overlapc's)")
    parser.add_argument("--bucket", default=None, help='"auto", "module", a byte count, or "none" (default: overlapc\'s)')
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are stopped")
    parser.add_argument("--keep", metavar="DIR", help="write the profile, schedule dumps and profiler traces "
                        "here and keep them (default: a temporary folder); then try "
                        "`overlapc analyze DIR/trace_rank0.json --dump DIR`")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step includes compilation)")
    world_size = 2
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with (contextlib.nullcontext(os.path.abspath(args.keep)) if args.keep
          else tempfile.TemporaryDirectory(prefix="overlapc-demo-")) as dump_dir:
        context = mp.start_processes(_rank_main, args=(world_size, _free_port(), args, dump_dir),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    print(f"overlapc demo: ranks still running after {args.timeout:.0f} s; stopping them",
                          file=sys.stderr)
                    return 1
        except mp.ProcessExitedException as error:
            print(f"overlapc demo: rank {error.error_index} died ({error}); stopping", file=sys.stderr)
            return 1
        except mp.ProcessRaisedException as error:
            print(f"overlapc demo: a rank failed:\n{error}", file=sys.stderr)
            return 1
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

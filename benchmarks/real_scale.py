"""overlapc's graph_trainer pass against graph_trainer's own at real scale: llama3 8B / 70B train steps.

torchtitan 0.3.0's graph_trainer traces one train step (forward + loss +
backward, batch 1, seq 8192 by default) of its llama3 flavours with its own
tracer on the fake process group (``joint_graph.trace``: parameters never
written, so a 70B model at world 64 traces in about 1 GiB), on FSDP over the
whole world or HSDP (replicas x shards). Its passes before bucketing run once
(``compile_time_passes`` less the last, Inductor left out); then, each on a
copy of that graph and timed in CPU seconds (``time.process_time``):

* "graph_trainer": its ``joint_transformer_block_bucketing_reordering_pass``;
* "overlapc": ``overlapc.integrations.torchtitan.overlapc_pass`` with the
  adapter's defaults (``DEFAULTS``), or ``--options``.

Each result is estimated by ``overlapc.estimate.simulate`` at ``--profile`` (default
h100:nvlink): exposed communication, step, peak live bytes. The overlapc row
also counts the WARNING lines overlapc logged (a serial fallback, a collective
left in place) and the serial order's peak of the graph handed in.

    python benchmarks/real_scale.py [--cases 8B:fsdp 8B:hsdp 70B:fsdp 70B:hsdp]
        [--world 64] [--replicate 8] [--seq 8192] [--options '{...}'] [--json out.json]

Each case runs in a process of its own. About 1-3 minutes per 8B case and 4-8
per 70B case on 2 cores; 405B traces too (``405B:fsdp``, about 5 minutes).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch.distributed as dist

import joint_graph
from overlapc.estimate import costmodel
from overlapc.integrations import torchtitan as overlapc_torchtitan


class _Warnings(logging.Handler):
    """Collects the WARNING (and worse) lines of the ``overlapc`` logger."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _timed(pass_fn, gm, example_inputs):
    begin = time.process_time()
    out = pass_fn(gm, example_inputs)
    return out, time.process_time() - begin


def run_case(flavor: str, mesh: str, args, profile) -> list[dict]:
    """Rows (graph_trainer, overlapc) for one flavour and mesh."""
    begin = time.perf_counter()
    traced, config, dims = joint_graph.trace(args.batch, args.seq, mesh, flavor, args.replicate)
    passes = joint_graph.graph_trainer_passes(traced, config, dims)
    if overlapc_torchtitan.pass_name(passes[-1]) != overlapc_torchtitan.REPLACED:
        raise SystemExit(f"graph_trainer's pass list does not end in {overlapc_torchtitan.REPLACED}: {passes}")
    handed_in = joint_graph.run_passes(passes[:-1], traced)
    print(f"{flavor} {mesh}: traced and prepared in {time.perf_counter() - begin:.0f} s, "
          f"{len(handed_in.graph.nodes)} nodes", flush=True)
    case = {"flavor": flavor, "mesh": mesh, "nodes_in": len(handed_in.graph.nodes)}
    theirs, their_s = _timed(passes[-1], copy.deepcopy(handed_in), traced.example_inputs)
    rows = [{**case, **joint_graph.row("graph_trainer", theirs, profile), "pass_cpu_s": round(their_s, 2)}]
    del theirs
    caught = _Warnings()
    logger = logging.getLogger("overlapc")
    logger.addHandler(caught)
    try:
        ours_pass = overlapc_torchtitan.replace_bucketing([passes[-1]], args.options)[0]
        ours, our_s = _timed(ours_pass, copy.deepcopy(handed_in), traced.example_inputs)
    finally:
        logger.removeHandler(caught)
    rows.append({**case, **joint_graph.row("overlapc", ours, profile), "pass_cpu_s": round(our_s, 2),
                 "warnings": caught.lines, "serial_peak_bytes": joint_graph.serial_peak(handed_in),
                 "options": {**overlapc_torchtitan.DEFAULTS, **args.options}})
    for r in rows:
        print(f"  {r['graph']:14s} pass {r['pass_cpu_s']:7.2f} s  exposed {r['exposed_ms']:10.3f} ms  "
              f"step {r['step_ms']:10.3f} ms  peak {r['peak_bytes'] / 2**30:8.3f} GiB  "
              f"warnings {len(r.get('warnings', ()))}", flush=True)
    for line in caught.lines:
        print(f"    WARNING {line[:400]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["8B:fsdp", "8B:hsdp", "70B:fsdp", "70B:hsdp"],
                        help="flavour:mesh, mesh fsdp or hsdp")
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--replicate", type=int, default=8, help="HSDP's replica count")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--profile", default="h100:nvlink")
    parser.add_argument("--options", type=json.loads, default={}, help="OverlapConfig options over the adapter's")
    parser.add_argument("--json", help="write rows and provenance here")
    args = parser.parse_args()
    rows = _each_in_own_process(args) if len(args.cases) > 1 else _run(args)
    if args.json:
        import importlib.metadata

        from provenance import provenance
        record = provenance({"torchtitan": importlib.metadata.version("torchtitan"), "profile": args.profile,
                             "world": args.world, "replicate": args.replicate, "batch": args.batch,
                             "seq": args.seq, "cases": args.cases, "options": args.options})
        with open(args.json, "w") as f:
            json.dump({"provenance": record, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


def _each_in_own_process(args) -> list[dict]:
    """Rows of every case, each traced in a process of its own (a second trace in one
    process inherits the first model's sharding state and fails)."""
    rows = []
    for spec in args.cases:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--cases", spec, "--world", str(args.world),
                            "--replicate", str(args.replicate), "--batch", str(args.batch), "--seq", str(args.seq),
                            "--profile", args.profile, "--options", json.dumps(args.options), "--json", out],
                           check=True)
            with open(out) as f:
                rows += json.load(f)["rows"]
    return rows


def _run(args) -> list[dict]:
    """Rows of ``args.cases`` in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    profile = costmodel.resolve(args.profile)
    rows = []
    try:
        with joint_graph.cpu_stand_ins(profile):
            for spec in args.cases:
                flavor, mesh = spec.split(":")
                rows += run_case(flavor, mesh, args, profile)
    finally:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()

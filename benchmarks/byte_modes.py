"""Scheduling variants side by side: estimated exposed communication and peak.

By default max_in_flight_bytes="auto" against "serial-peak"; ``--variants`` picks others
from ``VARIANTS`` (``issue="per-kernel"`` under each byte mode, and under no limit;
``"graph-peak"``; ``bucket="module"`` packed or coalesced).

Graphs: pass_time.py's synthetic SimpleFSDP-shaped graphs (1k and 10k nodes)
and the forward and backward graphs the CLI's examples capture at world 8
under the fake process group (``overlapc.backend.capture`` with overlapc off,
so each graph is scheduled here from the order AOTAutograd left). Each graph
is scheduled once per variant (everything else at overlapc's defaults) and
estimated by ``overlapc.estimate.simulate`` with one profile (default h100:nvlink).
Nothing runs on a device; the numbers are estimates, not timings.

    python benchmarks/byte_modes.py [--examples examples/llama.py:build ...] [--variants auto serial-peak ...]
                                    [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json

import torch.distributed as dist

import overlapc
from overlapc import backend
from overlapc.estimate import costmodel
from overlapc.estimate.simulate import simulate

import pass_time  # noqa: E402 - benchmarks/ is this script's directory

VARIANTS = {   # name -> OverlapConfig fields
    "auto": {"max_in_flight_bytes": "auto"},
    "serial-peak": {"max_in_flight_bytes": "serial-peak"},
    "per-kernel": {"issue": "per-kernel"},   # under the default "serial-peak"
    "auto per-kernel": {"max_in_flight_bytes": "auto", "issue": "per-kernel"},
    "no-limit": {"max_in_flight": None, "max_in_flight_bytes": None},
    "no-limit per-kernel": {"max_in_flight": None, "max_in_flight_bytes": None, "issue": "per-kernel"},
    "graph-peak": {"max_in_flight_bytes": "graph-peak"},
    "module": {"bucket": "module"},
    "module coalesced": {"bucket": "module", "bucket_op": "coalesced"},
}
EXAMPLES = ["examples/llama.py:build", "examples/mlp.py:build", "examples/hsdp.py:build"]


def measure(name: str, gm, profile, variants=("auto", "serial-peak")) -> dict:
    """One row: per variant, estimated exposed ms and peak bytes of ``gm`` scheduled that way."""
    out = {"graph": name}
    for variant in variants:
        scheduled = copy.deepcopy(gm)
        overlapc.schedule(scheduled, overlapc.OverlapConfig(**VARIANTS[variant], on_error="raise"))
        timeline = simulate(scheduled, profile)
        out[variant] = {"exposed_ms": round(timeline.exposed_ms, 4), "peak_bytes": timeline.peak_bytes}
    return out


def example_graphs(target: str):
    """(name, unscheduled graph) of each graph ``target`` (path:function) captures at world 8."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    path, function = target.split(":")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        spec = importlib.util.spec_from_file_location("example", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model, inputs = getattr(module, function)()
        return [(f"{path.rsplit('/', 1)[-1]} {r.name}", r.gm) for r in backend.capture(model, inputs, {"enabled": False})]
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="*", default=EXAMPLES)
    parser.add_argument("--profile", default="h100:nvlink")
    parser.add_argument("--variants", nargs="+", default=["auto", "serial-peak"], choices=sorted(VARIANTS))
    parser.add_argument("--json", help="write rows and provenance here")
    args = parser.parse_args()
    profile = costmodel.resolve(args.profile)
    graphs = [(f"pass_time synthetic {n}", pass_time.synthetic(n)) for n in (1000, 10000)]
    for target in args.examples:
        graphs += example_graphs(target)
    rows = []
    print(f"{'graph':26s}" + "".join(f" {v + ' exposed ms':>26} {v + ' peak B':>22}" for v in args.variants))
    for name, gm in graphs:
        r = measure(name, gm, profile, args.variants)
        rows.append(r)
        print(f"{name:26s}" + "".join(f" {r[v]['exposed_ms']:26.4f} {r[v]['peak_bytes']:22d}" for v in args.variants),
              flush=True)
    if args.json:
        from provenance import provenance
        document = {"provenance": provenance({"profile": args.profile, "world": 8, "variants": args.variants}),
                    "rows": rows}   # before the
        with open(args.json, "w") as f:   # file is emptied: provenance's "dirty" reads the checkout
            json.dump(document, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

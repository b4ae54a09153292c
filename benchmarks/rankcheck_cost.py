"""What the cross-rank check (``check_ranks``) costs per graph on a matching run.

N local gloo ranks (overlapc.launch, the project's rank launcher) train
examples/llama.py's sharded model under backend="overlapc" (inner="aot_eager"),
with the check on; the DEBUG line of each check gives its time in the compile
(which includes waiting for the slowest rank's compile). Then, ranks aligned by
a barrier, ``rankcheck.check`` runs ``--repeat`` times on each captured graph:
the skeleton (local) and the Store exchange, what the check adds when ranks
arrive together. Goal (issue 19): under 50 ms per graph.

    python benchmarks/rankcheck_cost.py [--world-size 2] [--depth 4] [--repeat 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
for path in (HERE, EXAMPLES):
    if path not in sys.path:
        sys.path.insert(0, path)

from harness import write_json  # noqa: E402

from overlapc import launch  # noqa: E402


class _Times(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.ms = []

    def emit(self, record):
        message = record.getMessage()
        if "checked in" in message:
            self.ms.append(float(message.split("checked in ")[1].split(" ms")[0]))


def _job(rank, world_size, depth, repeat):
    import torch
    import torch.distributed as dist

    import llama
    from overlapc.backend import rankcheck
    from overlapc.backend import capture
    from overlapc.config import OverlapConfig

    times = _Times()
    logger = logging.getLogger("overlapc")
    logger.addHandler(times)
    logger.setLevel(logging.DEBUG)
    model, (tokens,) = llama.build(depth=depth)
    compiled = torch.compile(model, backend="overlapc", options={"inner": "aot_eager"})
    for _ in range(2):
        compiled(tokens).float().pow(2).mean().backward()
    in_compile = list(times.ms)
    logger.setLevel(logging.WARNING)
    records = capture(*llama.build(depth=depth), {"inner": "aot_eager"})
    cfg = OverlapConfig(check_ranks=True)
    aligned, local = {}, {}
    for record in records:
        nodes = len(record.gm.graph.nodes)
        started = time.perf_counter()
        steps, _ = rankcheck.skeleton(record.gm, [])
        local[record.name] = ((time.perf_counter() - started) * 1e3, nodes, len(steps))
        runs = []
        for _ in range(repeat):
            dist.barrier()
            runs.append(rankcheck.check(record.gm, record.name, cfg, []) * 1e3)
        aligned[record.name] = statistics.median(runs)
    return {"in_compile_ms": in_compile, "aligned_median_ms": aligned, "skeleton_ms_nodes_collectives": local}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started = time.time()
    results = launch.run(_job, args.world_size, (args.depth, args.repeat), timeout=900)
    for rank, result in enumerate(results):
        print(f"rank {rank}: check in the compile (ms, per graph): "
              f"{', '.join(f'{ms:.1f}' for ms in result['in_compile_ms'])}")
        for name, ms in result["aligned_median_ms"].items():
            skeleton_ms, nodes, count = result["skeleton_ms_nodes_collectives"][name]
            print(f"rank {rank}: {name} ({nodes} nodes, {count} collectives): aligned check median {ms:.2f} ms "
                  f"(skeleton {skeleton_ms:.2f} ms)")
    print(f"wall {time.time() - started:.0f} s")
    if args.json:
        write_json(args.json, {"world_size": args.world_size, "depth": args.depth, "repeat": args.repeat,
                               "ranks": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

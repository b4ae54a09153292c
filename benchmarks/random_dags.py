"""How often overlapc degrades on random DAGs, and (``--inductor``) how often Inductor's CPU code loses a window.

The graphs are ``tests/test_inductor_windows.py``'s random DAGs (3-9 steps of mm, add,
relu, all-gather, all-reduce, reduce-scatter over two 32 x 32 inputs, on a fake process
group of world 8), drawn by hypothesis with ``derandomize=True``: the same draws in every
run, so two commits compare on the same graphs. Each is scheduled with ``on_error="raise"``
under ``max_in_flight`` 1, 2 or 3 and ``max_in_flight_bytes`` None or "serial-peak" (drawn
with the graph). Counted per draw:

* degraded: overlapc logged a WARNING that it placed collectives serially ("local"), or
  ran the whole graph in its serial order ("whole");
* failed: ``overlapc.schedule`` raised;
* with ``--inductor``: compiled by Inductor for the CPU with overlapc as its post-grad pass
  (``test_inductor_windows.compile_and_read``, about 10 s a graph), a window whose compute
  Inductor's generated code runs elsewhere (``inductor_order.window_breaks``).

    python benchmarks/random_dags.py [--examples 1000] [--inductor] [--json out.json]

Prints a line per degraded, failed or broken draw (its steps and options, to rerun), then
the counts; the JSON holds ``provenance`` and the same.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from provenance import provenance

TESTS = Path(__file__).resolve().parent.parent / "tests"


class _Warnings(logging.Handler):
    """The overlapc WARNING messages of the current draw."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def search(examples: int, inductor: bool) -> dict:
    """Schedule ``examples`` derandomized draws; the counts and the draws that went wrong."""
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import overlapc
    sys.path.insert(0, str(TESTS))
    import test_inductor_windows as windows

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=windows.WORLD)
    said = _Warnings()
    logging.getLogger("overlapc").addHandler(said)
    counts = {"draws": 0, "degraded_local": 0, "degraded_whole": 0, "failed": 0, "windows_broken": 0}
    cases: list[dict] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(steps=windows.dags(), max_in_flight=st.sampled_from([1, 2, 3]),
           budget=st.sampled_from([None, "serial-peak"]))
    def draw(steps, max_in_flight, budget):
        options = {"max_in_flight": max_in_flight, "max_in_flight_bytes": budget, "on_error": "raise"}
        case = {"steps": steps, "options": options}
        counts["draws"] += 1
        said.messages.clear()
        try:
            if inductor:
                result = windows.compile_and_read(windows.graph_of(steps), options)
                broken = windows.breaks(result) + ([] if result["lowered"] == result["scheduled"] else ["lowered"])
            else:
                overlapc.schedule(windows.graph_of(steps), overlapc.OverlapConfig.from_options(options))
                broken = []
        except Exception as error:   # a refusal is a finding, not the end of the search
            counts["failed"] += 1
            cases.append({**case, "failed": f"{type(error).__name__}: {error}"[:300]})
            return
        degraded = [m for m in said.messages if "placed serially" in m or "runs in its serial order" in m]
        if degraded:
            counts["degraded_whole" if "runs in its serial order" in degraded[0] else "degraded_local"] += 1
            cases.append({**case, "degraded": degraded[0][:300]})
        if broken:
            counts["windows_broken"] += 1
            cases.append({**case, "windows": broken})
    try:
        draw()
    finally:
        dist.destroy_process_group()
    return {"counts": counts, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000, help="draws (default 1000)")
    parser.add_argument("--inductor", action="store_true", help="also compile each with Inductor and check windows")
    parser.add_argument("--json", help="write the counts and cases here")
    args = parser.parse_args()
    found = search(args.examples, args.inductor)
    for case in found["cases"]:
        print(json.dumps(case), flush=True)
    print(" ".join(f"{key} {value}" for key, value in found["counts"].items()))
    if args.json:
        record = {"provenance": provenance({"examples": args.examples, "inductor": args.inductor}), **found}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

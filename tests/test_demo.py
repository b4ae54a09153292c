"""The demo's header: measured step times are medians over alternating pairs, the measured ratio
is the ratio of those medians, and each estimate is set beside its own measurement."""
import argparse
import types

from overlapc.cli import demo


def _header(overlapc_ms, inductor_ms, original_ms=60.0, after_ms=30.0, outside_ms=2.0):
    """``demo._header`` of one graph, fw_0, estimated ``original_ms`` in Inductor's order and
    ``after_ms`` in overlapc's (without ``outside_ms``), its steps measured as given (ms)."""
    args = argparse.Namespace(layers=2, width=64, heads=4, batch=8, seq=32)
    results = {"overlapc": ([1.0] * (len(overlapc_ms) + 1), [9.0] + [ms / 1e3 for ms in overlapc_ms]),
               "inductor": ([1.0] * (len(inductor_ms) + 1), [9.0] + [ms / 1e3 for ms in inductor_ms])}
    summary = {"peak_bytes_before": 1000, "peak_bytes_after": 1100}
    measured = types.SimpleNamespace(steps=[types.SimpleNamespace(estimated_step_ms=1.0, exposed_ms=4.0)])
    estimates = {"inductor": {"fw_0": types.SimpleNamespace(step_ms=original_ms, exposed_ms=5.0)},
                 "overlapc": {"fw_0": types.SimpleNamespace(step_ms=after_ms, exposed_ms=1.0)}}
    return demo._header(args, 2, results, [("fw_0", [], summary)], outside_ms, measured, estimates)


def test_step_times_are_medians_of_pairs_and_the_ratio_theirs():
    # the first step of each (compile) is left out; medians 30 and 60 ms, though the
    # per-pair ratios' median is 1.5 (a slow spell hit one model in most pairs)
    lines = _header([30.0, 20.0, 40.0, 30.0, 100.0], [45.0, 60.0, 60.0, 45.0, 150.0])
    step = next(line for line in lines if line.startswith("step time"))
    assert "overlapc 30.0 ms, Inductor 60.0 ms: overlapc 2.00x faster" in step
    assert "medians of 5 pairs; per pair 1.50x" in step


def test_each_estimate_is_beside_its_measurement_and_the_gain_beside_the_ratio():
    lines = _header([30.0] * 3, [60.0] * 3, original_ms=78.0, after_ms=38.0, outside_ms=2.0)
    estimated = next(line for line in lines if line.startswith("estimated"))
    assert "Inductor's order 80.0 ms (1.33x measured), overlapc's 40.0 ms (1.33x)" in estimated
    assert "gain 2.00x, measured 2.00x" in estimated
    exposed = next(line for line in lines if line.startswith("exposed comm"))
    assert "estimated 5.0 (Inductor's order) -> 1.0 ms per step (fw_0 5.0 -> 1.0)" in exposed


def test_the_default_times_enough_pairs():
    # 7 pairs left the measured ratio moving 1.14-2.63x between identical runs
    assert demo._arguments().parse_args([]).steps - 1 >= 25

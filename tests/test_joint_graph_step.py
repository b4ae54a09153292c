"""benchmarks/joint_graph_step.py's bookkeeping: which variant is compared with
which, the slower rank per step, the medians and ratios, and the value check.

The measured run itself needs torchtitan and several minutes of compilation
per variant (benchmarks/results/joint_graph_step.json holds one); these tests
need neither and check the parts that turn step times and outputs into the
table.
"""
from __future__ import annotations

import importlib.util
import pathlib
import statistics

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "joint_graph_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("joint_graph_step", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODES = ["regional", "full"]


def test_reference_is_graph_trainer_with_the_same_inductor_mode(bench):
    assert bench.reference_of("overlapc/full", MODES) == "graph_trainer/full"
    assert bench.reference_of("overlapc/full, order kept", MODES) == "graph_trainer/full"
    assert bench.reference_of("overlapc/regional", MODES) == "graph_trainer/regional"
    assert bench.reference_of("graph_trainer/full", MODES) == "graph_trainer/full"
    assert bench.reference_of("as traced", ["full"]) == "graph_trainer/full"


def _rank(times: dict, seed: int) -> dict:
    agree = {"loss_abs_diff": 0.0, "grad_max_abs_diff": 0.0, "allclose": True, "bitwise": True, "loss": 1.0}
    estimate = {"peak_mib": 10.0 + seed, "step_ms": 1.0, "exposed_ms": 0.1, "collectives": 4, "nodes": 9}
    return {"times_ms": times, "agree": {n: agree for n in times}, "agree_as_traced": {},
            "estimate": {n: estimate for n in times}, "compile_s": {n: 1.0 for n in times}}


def test_summary_takes_the_slower_rank_per_step_and_ratios_within_a_mode(bench):
    rank0 = {"graph_trainer/regional": [10.0, 30.0, 20.0], "overlapc/regional": [5.0, 9.0, 7.0],
             "graph_trainer/full": [100.0, 100.0, 100.0], "overlapc/full": [50.0, 70.0, 60.0]}
    rank1 = {"graph_trainer/regional": [12.0, 10.0, 25.0], "overlapc/regional": [8.0, 6.0, 6.0],
             "graph_trainer/full": [90.0, 110.0, 95.0], "overlapc/full": [40.0, 40.0, 90.0]}
    rows = {r["variant"]: r for r in bench.summarise([_rank(rank0, 0), _rank(rank1, 1)],
                                                     {"steps": 3, "inductor": MODES})}
    slower = {name: [max(a, b) for a, b in zip(rank0[name], rank1[name])] for name in rank0}
    for name, row in rows.items():
        assert row["steps_ms"] == slower[name]
        assert row["median_step_ms"] == statistics.median(slower[name])
        assert row["rank_medians_ms"] == [statistics.median(rank0[name]), statistics.median(rank1[name])]
    assert rows["overlapc/regional"]["ratio_to_graph_trainer"] == round(8.0 / 25.0, 3)
    assert rows["overlapc/full"]["ratio_to_graph_trainer"] == round(70.0 / 100.0, 3)
    assert rows["graph_trainer/full"]["ratio_to_graph_trainer"] == 1.0
    # per round: overlapc/regional 8/12, 9/30, 7/25 -> median 9/30
    assert rows["overlapc/regional"]["paired_ratio_median"] == round(9.0 / 30.0, 3)
    assert rows["overlapc/full"]["paired_ratio_median"] == round(70.0 / 110.0, 3)
    assert rows["overlapc/full"]["estimate_before_inductor"]["peak_mib"] == 10.0   # rank 0's estimate


def test_value_check_tells_bitwise_close_and_different_apart(bench):
    loss, grad = torch.tensor(2.5), torch.linspace(-1, 1, 64).to(torch.bfloat16)
    same = bench.outputs_agree([loss, grad], [loss.clone(), grad.clone()], 1e-2, 1e-3)
    assert same["bitwise"] and same["allclose"] and same["grad_max_abs_diff"] == 0.0
    nudged = grad.clone()
    nudged[3] = (grad[3].float() * (1 + 2**-7)).to(torch.bfloat16)   # ~2 bf16 ulps, 0.8% relative
    close = bench.outputs_agree([loss, grad], [loss, nudged], 1e-2, 1e-3)
    assert not close["bitwise"] and close["allclose"] and close["grad_max_abs_diff"] > 0.0
    far = bench.outputs_agree([loss, grad], [loss + 1.0, grad], 1e-2, 1e-3)
    assert not far["allclose"] and far["loss_abs_diff"] == pytest.approx(1.0)


def test_order_kept_variant_uses_torch_compats_patch_and_undoes_it(bench):
    import torch._inductor.memory as memory
    original = memory.reorder_for_peak_memory
    with bench.order_kept("overlapc/full, order kept"):
        assert memory.reorder_for_peak_memory is not original   # torch_compat.inductor_keeps_order's
    assert memory.reorder_for_peak_memory is original
    with bench.order_kept("overlapc/full"):
        assert memory.reorder_for_peak_memory is original

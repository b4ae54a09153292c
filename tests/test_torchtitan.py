"""overlapc in torchtitan graph_trainer's pass list, on a graph its tracer made.

graph_trainer's llama3 debug model (SimpleFSDP, bf16 parameters, world 8 on
the fake process group) is traced by graph_trainer's own tracer
(benchmarks/joint_graph.py's ``trace``); its ``compile_time_passes`` run with
``overlapc.integrations.torchtitan.replace_bucketing`` in place of its
bucketing pass. Needs torchtitan 0.3.0 and what its modules import (see
pyproject's dev extras); skipped, with that reason, where it is not installed.
"""
import importlib.util
import os

import pytest
import torch

import overlapc
from overlapc.estimate import costmodel
from overlapc.collectives import collectives, module_path, role
from overlapc.integrations import torchtitan as overlapc_torchtitan
from graphs import plan_entry, random_inputs
from test_properties import LocalCollectives

pytest.importorskip("torchtitan.experiments.graph_trainer.passes",
                    reason="torchtitan 0.3.0 (with torchdata, tensorboard, datasets, spmd_types) is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "joint_graph", os.path.join(HERE, os.pardir, "benchmarks", "joint_graph.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def traced(fake_pg):
    """(bench module, TracedResult, graph_trainer's pass list, profile) of a small batch."""
    bench = _benchmark()
    profile = costmodel.resolve(None)
    with bench.cpu_stand_ins(profile):
        result, config, dims = bench.trace(batch=2, seq=64)
        passes = bench.graph_trainer_passes(result, config, dims)
    return bench, result, passes, profile, config, dims


def test_replace_bucketing_swaps_only_the_bucketing_pass(traced):
    passes = traced[2]
    names = [overlapc_torchtitan.pass_name(p) for p in passes]
    replaced = [overlapc_torchtitan.pass_name(p) for p in overlapc_torchtitan.replace_bucketing(passes)]
    assert overlapc_torchtitan.REPLACED in names
    assert replaced == ["overlapc_pass" if n == overlapc_torchtitan.REPLACED else n for n in names]
    with pytest.raises(ValueError, match=overlapc_torchtitan.REPLACED):
        overlapc_torchtitan.replace_bucketing([p for p in passes
                                               if overlapc_torchtitan.pass_name(p) != overlapc_torchtitan.REPLACED])


def test_graph_trainer_graph_scheduled_by_overlapc_keeps_values(traced):
    bench, result, passes, profile = traced[:4]
    before_overlapc = [p for p in overlapc_torchtitan.replace_bucketing(passes)
                       if overlapc_torchtitan.pass_name(p) != "overlapc_pass"]
    with bench.cpu_stand_ins(profile):
        gm = bench.run_passes(before_overlapc, result)   # the graph graph_trainer would bucket
    # graph_trainer's conventions: in-place RMSNorm adds on temporaries, modules in meta["custom"]
    writes = [n for n in gm.graph.nodes
              if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
    assert writes and all(role(n)[2] is None for n in writes)
    assert all(n.meta.get("nn_module_stack") is None for n in gm.graph.nodes)
    paths = {module_path(c.start) for c in collectives(gm)}
    assert {f"layers.{i}.feed_forward.w1" for i in range(6)} <= paths, sorted(paths)

    inputs = random_inputs(gm)
    expected = LocalCollectives(gm).run(*inputs)
    before = bench.row("before", gm, profile)
    gathers_before = sum(c.kind == "all_gather" for c in collectives(gm))
    gm = overlapc_torchtitan.overlapc_pass(gm, result.example_inputs)
    # the adapter's defaults: the peak within the serial order's (verify checks it exactly
    # against the bound the schedule recorded: the lower of that order's peak and the graph's
    # own serial order's), keep-or-regather decided per block and noted
    assert overlapc_torchtitan.DEFAULTS["max_in_flight_bytes"] == "serial-peak"
    peaks = overlapc.verify(gm, overlapc.OverlapConfig(**overlapc_torchtitan.DEFAULTS))
    assert peaks.peak_bytes <= peaks.reference_peak_bytes <= bench.serial_peak(gm)
    assert {c.block for c in gm.meta["overlapc_regather"]} >= {f"layers.{i}" for i in range(6)}
    got = LocalCollectives(gm).run(*inputs)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    after = bench.row("after", gm, profile)
    assert after["exposed_ms"] < before["exposed_ms"] / 2, (before, after)
    # bucketed by block (the modules read from meta["custom"]): far fewer all-gathers
    gathers = sum(c.kind == "all_gather" for c in collectives(gm))
    assert gathers <= gathers_before / 3, (gathers_before, gathers)


def test_registered_pipeline_is_graph_trainers_default_with_overlapc(traced):
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes
    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY
    _, result, _, _, config, dims = traced
    overlapc_torchtitan.register("overlapc_test", options={"max_in_flight": 2})
    try:
        pipeline = PASS_PIPELINE_REGISTRY["overlapc_test"]
        names = [overlapc_torchtitan.pass_name(p) for p in pipeline(result, config, parallel_dims=dims)]
    finally:
        del PASS_PIPELINE_REGISTRY["overlapc_test"]
    default = [overlapc_torchtitan.pass_name(p)
               for p in construct_default_graph_passes(result, config, parallel_dims=dims)]
    assert names == ["overlapc_pass" if n == overlapc_torchtitan.REPLACED else n for n in default
                     if n not in overlapc_torchtitan.REMOVED]
    assert "regional_inductor_pass" in names   # kept, under overlapc's Inductor patches


def test_graph_trainers_own_bucket_plan_buckets_its_joint_graph_by_entry(traced):
    """``options={"bucket": plan}`` with the plan graph_trainer builds for its own bucketing
    pass (``get_default_transformer_block_buckets``): one bucket of each kind per entry (a
    block; norm with lm_head), modules read from ``meta["custom"]``, values bit for bit."""
    from torchtitan.experiments.graph_trainer.common_utils import get_default_transformer_block_buckets
    bench, result, passes, profile = traced[:4]
    before_overlapc = [p for p in overlapc_torchtitan.replace_bucketing(passes)
                       if overlapc_torchtitan.pass_name(p) != "overlapc_pass"]
    with bench.cpu_stand_ins(profile):
        gm = bench.run_passes(before_overlapc, result)
    inputs = random_inputs(gm)
    expected = LocalCollectives(gm).run(*inputs)
    plan = get_default_transformer_block_buckets(6)
    options = {"bucket": plan}
    gm = overlapc_torchtitan.overlapc_pass(gm, result.example_inputs, options=options)

    overlapc.verify(gm, overlapc.OverlapConfig(**{**overlapc_torchtitan.DEFAULTS, **options}))
    got = LocalCollectives(gm).run(*inputs)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(expected, got))
    notes = gm.meta["overlapc_buckets"]
    for note in notes:   # each bucket within one entry, by the longest prefix of its members' modules
        found = {plan_entry(plan, m) for m in note.modules}
        assert len(found) == 1 and None not in found, note
    blocks = {f"layers.{i}" for i in range(6)}   # a bucket per block: its forward gathers, backward re-gathers, grads
    for kind, per_block in (("all_gather", 2), ("reduce_scatter", 1)):
        found = [".".join(n.modules[0].split(".")[:2]) for n in notes if n.kind == kind]
        assert all(found.count(b) == per_block for b in blocks), (kind, found)

"""graph_trainer's passes vs overlapc in their place, on one traced joint train-step graph.

torchtitan 0.3.0's graph_trainer traces its llama3 debug model (6 layers, dim
256; SimpleFSDP ``data_parallel`` fully_shard, bf16 parameters, fp32
reduction) with its own tracer (``minimal_fx_tracer``: forward + loss +
backward in one graph) under the fake process group, then:

* "as traced": the graph as the tracer left it;
* "graph_trainer": its ``compile_time_passes`` (Inductor left out), ending in
  ``joint_transformer_block_bucketing_reordering_pass``;
* "overlapc": the same list with that pass replaced by ``overlapc_pass``
  (``overlapc.integrations.torchtitan.replace_bucketing``), overlapc defaults;
* any ``--options`` given, each as one more overlapc row;
* "keep_or_regather, then overlapc": ``overlapc.passes.regather`` (keep a
  block's forward gathers for its backward where the graph's own peak allows)
  before overlapc's defaults; the row lists what it chose per block.

Every graph is estimated by one simulator (``overlapc.simulate``) with one
profile (``--profile``, default h100:nvlink): step, exposed communication,
peak live bytes. Nothing runs on a device.

CPU-only stand-ins, all process-wide, all said here: ParallelDims builds its
mesh on "cpu" (torchtitan picks "cuda" when it finds no accelerator);
graph_trainer's bucketing pass asks Triton for the GPU's DRAM bandwidth and
FLOP/s (``torch._inductor.utils.get_gpu_dram_gbps`` / ``get_device_tflops``,
also bound by name in ``torch.utils._runtime_estimation`` and
``torch._inductor.scheduler``): they return the profile's device figures (H100
by default); and its selective remat refuses "RNG ops" in recompute regions,
which on CPU includes the fused attention op ``_scaled_dot_product_flash_
attention_for_cpu`` (tagged seeded for its dropout): with dropout 0 it draws
nothing, so such nodes are not counted. Attention is SDPA (FlexAttention has
no CPU backward).

    python benchmarks/joint_graph.py [--batch 8] [--seq 256] [--mesh fsdp|hsdp] [--json out.json]
        [--options '{"bucket": "module"}' ...]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json

import torch
import torch.distributed as dist

import overlapc
from overlapc import costmodel
from overlapc.integrations import torchtitan as overlapc_torchtitan
from overlapc.passes.regather import keep_or_regather
from overlapc.simulate import simulate

WORLD = 8


@contextlib.contextmanager
def cpu_stand_ins(profile: costmodel.Profile):
    """The module doc's CPU-only stand-ins, undone on exit."""
    import torch._inductor.scheduler
    import torch._inductor.utils
    import torch.utils._runtime_estimation
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.experiments.graph_trainer.selective_activation_remat as remat

    saved = [(parallel_dims, "device_type"), (remat, "has_recomputable_rng_ops")]
    rates = (torch._inductor.utils, torch._inductor.scheduler, torch.utils._runtime_estimation)
    saved += [(m, name) for m in rates for name in ("get_gpu_dram_gbps", "get_device_tflops")]
    old = [(m, name, getattr(m, name)) for m, name in saved]
    parallel_dims.device_type = "cpu"
    remat.has_recomputable_rng_ops = lambda gm: any(_draws_random(n) and remat.must_recompute(n)
                                                    for n in gm.graph.nodes)
    for module in rates:
        module.get_gpu_dram_gbps = lambda: profile.device.mem_gbps
        module.get_device_tflops = lambda dtype: profile.device.tflops
    try:
        yield
    finally:
        for module, name, value in old:
            setattr(module, name, value)


def _draws_random(node) -> bool:
    """A seeded op, other than CPU's fused attention run without dropout."""
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    if node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        dropout = node.kwargs.get("dropout_p", node.args[3] if len(node.args) > 3 else 0.0)
        return dropout != 0.0
    return True


MESHES = {"fsdp": (1, "fully_shard", ["fsdp"]), "hsdp": (2, "hybrid_shard", ["dp_replicate", "fsdp"])}


def trace(batch: int, seq: int, mesh: str = "fsdp"):
    """(graph_trainer's TracedResult, its Config, ParallelDims) of one train step of
    the llama3 debug model, traced by graph_trainer's tracer. Needs the fake
    default process group (world 8) and ``cpu_stand_ins``."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.experiments.graph_trainer.llama3 import model_registry
    from torchtitan.experiments.graph_trainer.llama3.parallelize import annotate_llama
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer
    from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel
    from torchtitan.experiments.graph_trainer.trainer import GraphTrainer, make_fwd_bwd_step

    replicate, mode, dim_names = MESHES[mesh]
    dims = ParallelDims(dp_shard=-1, dp_replicate=replicate, cp=1, tp=1, pp=1, ep=1,
                        world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
    spec = model_registry("debugmodel", attn_backend="sdpa")
    with torch.device("meta"):
        model = spec.model.build()
    annotate_llama(model)
    model = data_parallel(model, device_mesh=dims.get_mesh(dim_names), mode=mode,
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model.to_empty(device="cpu")   # values are not read: the tracer works on fake copies
    model.train()

    def loss_fn(pred, labels, global_valid_tokens=None):
        flat = pred.flatten(0, 1).float()
        return torch.nn.functional.cross_entropy(flat, labels.flatten(0, 1), reduction="sum") / global_valid_tokens

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.model.vocab_size, (batch, seq), generator=generator)
    labels = torch.randint(0, spec.model.vocab_size, (batch, seq), generator=generator)
    step = make_fwd_bwd_step(model, loss_fn)
    traced = minimal_fx_tracer(step, module=model)(tokens, labels, torch.tensor(float(batch * seq)), {})
    return traced, GraphTrainer.Config(model_spec=spec), dims


def graph_trainer_passes(traced, config, dims):
    """graph_trainer's compile_time_passes without Inductor (what it hands Inductor)."""
    from torchtitan.experiments.graph_trainer.passes import compile_time_passes
    return compile_time_passes(traced, config, include_inductor=False, parallel_dims=dims)


def run_passes(passes, traced):
    gm = copy.deepcopy(traced.gm)
    for pass_fn in passes:
        gm = pass_fn(gm, traced.example_inputs)
    return gm


def row(name: str, gm, profile) -> dict:
    timeline = simulate(gm, profile)
    return {"graph": name, "step_ms": round(timeline.step_ms, 4), "exposed_ms": round(timeline.exposed_ms, 4),
            "peak_mib": round(timeline.peak_bytes / 2**20, 2), "collectives": timeline.total,
            "nodes": len(gm.graph.nodes)}


def compare(batch: int, seq: int, profile_name: str, extra_options: list[dict], mesh: str = "fsdp") -> list[dict]:
    profile = costmodel.resolve(profile_name)
    with cpu_stand_ins(profile):
        traced, config, dims = trace(batch, seq, mesh)
        theirs = graph_trainer_passes(traced, config, dims)
        rows = [row("as traced", copy.deepcopy(traced.gm), profile),
                row("graph_trainer passes", run_passes(theirs, traced), profile)]
        for options in [{}, *extra_options]:
            gm = run_passes(overlapc_torchtitan.replace_bucketing(theirs, options), traced)
            overlapc.verify(gm, overlapc.OverlapConfig(**options))
            rows.append(row(f"overlapc {json.dumps(options) if options else 'defaults'}", gm, profile))
        ours = overlapc_torchtitan.replace_bucketing(theirs)
        at = [overlapc_torchtitan.pass_name(p) for p in ours].index("overlapc_pass")
        gm = run_passes([*ours[:at], _keep_or_regather, *ours[at:]], traced)
        overlapc.verify(gm, overlapc.OverlapConfig())
        rows.append(row("keep_or_regather, then overlapc defaults", gm, profile))
        rows[-1]["regather"] = gm.meta["regather"]
    return rows


def _keep_or_regather(gm, example_inputs):
    """overlapc.passes.regather at the graph's own peak, as a graph_trainer pass."""
    result = keep_or_regather(gm)
    gm.meta["regather"] = [{"block": c.block, "kept": c.kept, "regathers": len(c.regathers)}
                           for c in result.choices]
    return gm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--profile", default=costmodel.DEFAULT)
    parser.add_argument("--mesh", choices=sorted(MESHES), default="fsdp",
                        help="fsdp: fully_shard over 8; hsdp: replicate 2 x shard 4 (hybrid_shard)")
    parser.add_argument("--options", type=json.loads, action="append", default=[],
                        help="OverlapConfig options (JSON) for one more overlapc row")
    parser.add_argument("--json", help="write rows and provenance here")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        rows = compare(args.batch, args.seq, args.profile, args.options, args.mesh)
    finally:
        dist.destroy_process_group()
    print(f"{'graph':44s} {'step ms':>8} {'exposed ms':>10} {'peak MiB':>9} {'colls':>6}")
    for r in rows:
        print(f"{r['graph']:44s} {r['step_ms']:8.3f} {r['exposed_ms']:10.3f} {r['peak_mib']:9.1f} {r['collectives']:6d}")
    if args.json:
        import importlib.metadata

        from provenance import provenance   # benchmarks/, the script's own directory, is on sys.path
        record = provenance({"torchtitan": importlib.metadata.version("torchtitan"), "profile": args.profile,
                             "mesh": args.mesh, "batch": args.batch, "seq": args.seq, "world": WORLD})
        with open(args.json, "w") as f:
            json.dump({"provenance": record, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

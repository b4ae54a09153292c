"""graph_trainer's passes vs overlapc in their place, on one traced joint train-step graph.

torchtitan 0.3.0's graph_trainer traces its llama3 debug model (6 layers, dim
256; SimpleFSDP ``data_parallel`` fully_shard, bf16 parameters, fp32
reduction) with its own tracer (``minimal_fx_tracer``: forward + loss +
backward in one graph) under the fake process group, then:

* "as traced": the graph as the tracer left it;
* "graph_trainer": its ``compile_time_passes`` (Inductor left out), ending in
  ``joint_transformer_block_bucketing_reordering_pass``;
* "overlapc adapter defaults": the same list with that pass replaced by
  ``overlapc_pass`` (``overlapc.integrations.torchtitan.replace_bucketing``)
  with the adapter's defaults (``DEFAULTS``: ``max_in_flight_bytes=
  "serial-peak"``, ``regather="auto"``); the row lists what keep-or-regather
  chose per block;
* "overlapc library defaults": the same with ``OverlapConfig``'s own defaults
  (``max_in_flight_bytes="serial-peak"``, ``regather="always"``);
* "overlapc auto bytes": the library's defaults until 2026-11-28
  (``max_in_flight_bytes="auto"``, ``regather="always"``), which may spend memory;
* any ``--options`` given, each as one more overlapc row (over the adapter's
  defaults).

Every graph is estimated by one simulator (``overlapc.estimate.simulate``) with one
profile (``--profile``, default h100:nvlink): step, exposed communication,
peak live bytes (also exact, ``peak_bytes``); overlapc rows also give the peak
of the graph's serial order (``serial_peak_bytes``: each collective waited
right after its start, the reference of "serial-peak"). Nothing runs on a
device.

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
from overlapc.estimate import costmodel
from overlapc.integrations import torchtitan as overlapc_torchtitan
from overlapc.passes import invariants
from overlapc.passes.memory import Liveness
from overlapc.passes.structure import Structure
from overlapc.estimate.simulate import simulate

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


def trace(batch: int, seq: int, mesh: str = "fsdp", flavor: str = "debugmodel", replicate: int | None = None):
    """(graph_trainer's TracedResult, its Config, ParallelDims) of one train step of
    graph_trainer's llama3 ``flavor`` ("debugmodel", "8B", "70B", "405B"), traced by
    its tracer. Needs the fake default process group (any world size) and
    ``cpu_stand_ins``. ``replicate``: the replica groups of "hsdp" (default
    ``MESHES``'); the rest of the world shards. Parameters are allocated with
    ``to_empty`` and never written, so their pages stay unbacked: a 70B model at
    world 64 traces in about 1 GiB."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.experiments.graph_trainer.llama3 import model_registry
    from torchtitan.experiments.graph_trainer.llama3.parallelize import annotate_llama
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer
    from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel
    from torchtitan.experiments.graph_trainer.trainer import GraphTrainer, make_fwd_bwd_step

    default_replicate, mode, dim_names = MESHES[mesh]
    replicate = replicate or default_replicate
    dims = ParallelDims(dp_shard=-1, dp_replicate=replicate, cp=1, tp=1, pp=1, ep=1,
                        world_size=dist.get_world_size(), spmd_backend="partial_dtensor")
    spec = model_registry(flavor, attn_backend="sdpa")
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
            "peak_mib": round(timeline.peak_bytes / 2**20, 2), "peak_bytes": timeline.peak_bytes,
            "collectives": timeline.total,
            "nodes": len(gm.graph.nodes)}


def compare(batch: int, seq: int, profile_name: str, extra_options: list[dict], mesh: str = "fsdp") -> list[dict]:
    profile = costmodel.resolve(profile_name)
    with cpu_stand_ins(profile):
        traced, config, dims = trace(batch, seq, mesh)
        theirs = graph_trainer_passes(traced, config, dims)
        rows = [row("as traced", copy.deepcopy(traced.gm), profile),
                row("graph_trainer passes", run_passes(theirs, traced), profile)]
        variants = [("overlapc adapter defaults", {}),
                    ("overlapc library defaults", {"max_in_flight_bytes": "serial-peak", "regather": "always"}),
                    ("overlapc auto bytes", {"max_in_flight_bytes": "auto", "regather": "always"})]
        variants += [(f"overlapc {json.dumps(options)}", options) for options in extra_options]
        for name, options in variants:
            gm = run_passes(overlapc_torchtitan.replace_bucketing(theirs, options), traced)
            overlapc.verify(gm, overlapc.OverlapConfig(**{**overlapc_torchtitan.DEFAULTS, **options}))
            rows.append({**row(name, gm, profile), "serial_peak_bytes": serial_peak(gm)})
            rows[-1]["regather"] = [{"block": c.block, "kept": c.kept, "regathers": len(c.regathers),
                                     "bytes": c.nbytes} for c in gm.meta.get("overlapc_regather", ())]
    return rows


def serial_peak(gm) -> int:
    """Peak live bytes of ``gm``'s serial order (``invariants.serial_order(asap=True)``:
    the same compute order, each collective waited right after its start)."""
    s = Structure(gm)
    return Liveness(s.nodes).peak_bytes(invariants.serial_order(s, asap=True))


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
    print(f"{'graph':44s} {'step ms':>8} {'exposed ms':>10} {'peak bytes':>11} {'serial peak':>11} {'colls':>6}")
    for r in rows:
        serial = r.get("serial_peak_bytes", "")
        print(f"{r['graph']:44s} {r['step_ms']:8.3f} {r['exposed_ms']:10.4f} {r['peak_bytes']:11d} {serial:>11} "
              f"{r['collectives']:6d}")
        kept = [f"{c['block']} ({c['bytes']} B)" for c in r.get("regather", ()) if c["kept"]]
        if r.get("regather"):
            print(f"    regather: kept {len(kept)} of {len(r['regather'])} blocks{': ' + ', '.join(kept) if kept else ''}")
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

"""HSDP (replicate x shard) and in-graph DDP (shard size 1) with overlapc.fsdp.shard.

Real values: 4 gloo ranks as dp_replicate 2 x dp_shard 2 against FSDP2's HSDP
eager (``fully_shard`` on the same 2-D mesh) and overlapc's 1-D FSDP over all
4 ranks; 2 gloo ranks as dp_replicate 2 x dp_shard 1 against torch DDP eager.
Graphs: the session's fake process group (world 8), replicate x shard x tp
and replicate x shard 1, scheduled with on_error="raise" (no fallback).
"""
import collections
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from graphs import ancestors
from multiproc import init_gloo, run_ranks

STEPS = 3
TIMEOUT = 420.0  # 4 ranks compiling on 2 shared cores; the point is never to hang
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
HSDP_DIMS = ("dp_replicate", "dp_shard")
# bucket="module" on HSDP: packed, the reduce-scatter -> replica all-reduce chains stay apart;
# coalesced, they bucket level by level (Inductor lowers the coalesced ops)
CHAINED_BUCKETS = {"hsdp_module": {"bucket": "module", "inner": "aot_eager"},
                   "hsdp_coalesced": {"bucket": "module", "bucket_op": "coalesced"}}


def _model(seed=0):
    """Two blocks (FSDP2 wraps each) and a head; dim 0 of 6 is uneven over 4 ranks."""
    torch.manual_seed(seed)
    block = lambda i, o: nn.Sequential(nn.Linear(i, o), nn.LayerNorm(o), nn.ReLU())  # noqa: E731
    return nn.Sequential(block(8, 16), block(16, 6), nn.Linear(6, 4))


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(STEPS)]


def _train(model, data, backend=None, options=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(model, backend=backend, options=options) if backend else model
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(step(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _setup(rank, world_size, port):
    init_gloo(rank, world_size, port)
    warnings.filterwarnings("ignore", category=UserWarning)
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = 1  # no compile worker pool on 2 shared cores


def _job_hsdp(rank, world_size, port, checkpoint_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import overlapc.fsdp

    _setup(rank, world_size, port)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=HSDP_DIMS)
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    data = _data(rank)

    fsdp2 = _model()
    for block in fsdp2[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp2, mesh=mesh)  # a 2-D mesh: FSDP2's HSDP (dim 0 replicate, dim 1 shard)
    out = {"fsdp2_hsdp": _train(fsdp2, data), "fsdp_1d": _train(overlapc.fsdp.shard(_model(), flat), data),
           "hsdp_eager": _train(overlapc.fsdp.shard(_model(), mesh), data)}
    for name, options in CHAINED_BUCKETS.items():   # both chain levels bucketed, packed or coalesced
        out[name] = _train(overlapc.fsdp.shard(_model(), mesh), data, backend="overlapc",
                           options={"on_error": "raise", **options})
    model = overlapc.fsdp.shard(_model(), mesh)
    out["hsdp_overlapc"] = _train(model, data, backend="overlapc", options={"on_error": "raise"})

    state = model.state_dict()
    out["keys"] = sorted(state) == sorted(_model().state_dict())
    out["placed"] = all(isinstance(v, DTensor) and v.device_mesh == mesh and v.placements == (Replicate(), Shard(0))
                        for v in state.values())
    out["shards"] = {k: v.to_local().tolist() for k, v in state.items()}  # replicas must agree
    dcp.save(state, checkpoint_id=checkpoint_dir)
    resumed = overlapc.fsdp.shard(_model(seed=1), mesh)
    loaded = resumed.state_dict()
    dcp.load(loaded, checkpoint_id=checkpoint_dir)
    resumed.load_state_dict(loaded)
    out["dcp_round_trip"] = all(torch.equal(v.full_tensor(), state[k].full_tensor())
                                for k, v in resumed.state_dict().items())
    return out


def _job_ddp(rank, world_size, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import overlapc.fsdp

    _setup(rank, world_size, port)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=HSDP_DIMS)
    data = _data(rank)
    out = {"ddp": _train(DDP(_model(), bucket_cap_mb=25), data),
           "eager": _train(overlapc.fsdp.shard(_model(), mesh), data)}
    model = overlapc.fsdp.shard(_model(), mesh)
    out["overlapc"] = _train(model, data, backend="overlapc", options={"on_error": "raise"})
    out["coalesced"] = _train(overlapc.fsdp.shard(_model(), mesh), data, backend="overlapc",
                              options={"on_error": "raise", **CHAINED_BUCKETS["hsdp_coalesced"]})
    out["full_locals"] = all(p.to_local().shape == p.shape for p in model.parameters())
    return out


def _close(a, b):
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def test_hsdp_2x2_trains_like_fsdp2_hsdp_and_1d_fsdp(tmp_path):
    results = run_ranks(_job_hsdp, world_size=4, args=(str(tmp_path / "dcp"),), timeout=TIMEOUT)
    for rank, out in enumerate(results):
        reference = out["fsdp2_hsdp"]
        assert len(set(reference)) == STEPS, f"rank {rank}: the loss should move: {reference}"
        for name in ("fsdp_1d", "hsdp_eager", "hsdp_overlapc", *CHAINED_BUCKETS):
            assert _close(out[name], reference), f"rank {rank}: {name} {out[name]} vs FSDP2 HSDP {reference}"
        assert out["keys"] and out["placed"], f"rank {rank}: state_dict keys / placements"
        assert out["dcp_round_trip"], f"rank {rank}: DCP save + load into a fresh model changed values"
    # mesh (2, 2): rank = 2 * replicate index + shard index; replicas of a shard hold the same values
    for a, b in ((0, 2), (1, 3)):
        assert results[a]["shards"] == results[b]["shards"], f"ranks {a} and {b} (replicas) diverged"
    assert results[0]["shards"] != results[1]["shards"]


def test_replicate_2_shard_1_trains_like_ddp():
    for rank, out in enumerate(run_ranks(_job_ddp, world_size=2, timeout=TIMEOUT)):
        assert len(set(out["ddp"])) == STEPS
        assert out["full_locals"], f"rank {rank}: shard size 1 should keep every parameter whole"
        for name in ("eager", "overlapc", "coalesced"):
            assert _close(out[name], out["ddp"]), f"rank {rank}: {name} {out[name]} vs DDP {out['ddp']}"


# ---------------------------------------------------------------- graphs (session fake group, world 8)


def _counts(records):
    import overlapc

    return {r.name: collections.Counter(f"{c.kind}@{c.group}" for c in overlapc.collectives(r.gm)) for r in records}


def _fsdp_tp():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import fsdp_tp

    return fsdp_tp


def _upstream_kind(node):
    """Kind of the collective whose wait feeds ``node``'s first input through casts and views, or None."""
    c10d = torch.ops._c10d_functional
    arg = node.args[0]
    while arg.target is not c10d.wait_tensor.default:
        if not arg.args or not isinstance(arg.args[0], torch.fx.Node):
            return None
        arg = arg.args[0]
    return arg.args[0].target.__name__.split(".")[0]


def test_replicate_x_shard_x_tp_graphs_schedule_without_fallback(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.backend import capture

    fsdp_tp = _fsdp_tp()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=(*HSDP_DIMS, "tp"))
    groups = {dim: mesh[dim].get_group().group_name for dim in mesh.mesh_dim_names}
    torch.manual_seed(0)
    model = overlapc.fsdp.shard(fsdp_tp.parallelize(fsdp_tp.Model(dim=32, heads=4, hidden=64, depth=1), mesh["tp"]),
                                mesh)
    n = len(list(model.parameters()))
    x = torch.randn(2, 8 // 2, 32, requires_grad=True)
    for options in ({"on_error": "raise"}, {"on_error": "raise", "bucket": None}):
        records = capture(model, (x,), options)
        assert sorted(r.name for r in records) == ["bw_0", "fw_0"]
        for r in records:
            overlapc.verify(r.gm)
    fw, bw = (_counts(records)[name] for name in ("fw_0", "bw_0"))  # bucket=None: one per parameter
    shard, replicate = groups["dp_shard"], groups["dp_replicate"]
    assert fw[f"all_gather@{shard}"] == n and not any(k.endswith(f"@{replicate}") for k in fw), fw
    assert bw[f"reduce_scatter@{shard}"] == n and bw[f"all_reduce@{replicate}"] == n, bw
    assert not any(k.startswith(("all_gather", "reduce_scatter")) and k.endswith(f"@{replicate}") for k in bw), bw
    bw_gm = next(r.gm for r in records if r.name == "bw_0")
    ups = [_upstream_kind(c.start) for c in overlapc.collectives(bw_gm) if c.kind == "all_reduce"
           and c.group == replicate]
    assert ups == ["reduce_scatter_tensor"] * n, f"each replicate all-reduce reads a reduce-scatter's result: {ups}"


@pytest.mark.parametrize("bucket", ["module", 1 << 30])
def test_hsdp_chain_levels_bucket_in_coalesced_buckets_only(fake_pg, bucket):
    """replicate 2 x shard 4: with coalesced buckets the backward's reduce-scatters merge, and
    so do the replica all-reduces that read them (a level each: the all-reduce buckets read the
    reduce-scatter buckets' results); packed, neither level is bucketed. The schedules verify
    (the values: the gloo runs above)."""
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.backend import capture

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=HSDP_DIMS)
    model = overlapc.fsdp.shard(_model(), mesh)
    n = len(list(model.parameters()))
    for bucket_op in ("pack", "coalesced"):
        records = capture(model, (torch.randn(5, 8),), {"on_error": "raise", "bucket": bucket, "bucket_op": bucket_op})
        bw = next(r.gm for r in records if r.name == "bw_0")
        overlapc.verify(bw)
        notes = bw.meta.get("overlapc_buckets", [])
        kinds = collections.Counter(note.kind for note in notes)
        found = [c for c in overlapc.collectives(bw) if c.kind != "all_gather"]   # (the backward's re-gathers)
        if bucket_op == "pack":
            assert not [note for note in notes if note.kind != "all_gather"], notes
            assert collections.Counter(c.kind for c in found) == {"reduce_scatter": n, "all_reduce": n}
            continue
        assert kinds["reduce_scatter"] >= 1 and kinds["all_reduce"] >= 1, notes
        assert len(found) < 2 * n, [c.start.name for c in found]
        scattered = {w for c in found if c.kind == "reduce_scatter" for w in c.waits}
        for c in found:   # every all-reduce reads reduce-scatter results (through views, slices, getitems)
            if c.kind == "all_reduce":
                assert not scattered.isdisjoint(ancestors(c.start)), c.start.name
        assert all(c.op.endswith("_coalesced") for c in found if "_bucket" in c.start.name), found


def test_shard_size_1_is_ddp_in_the_graph(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.backend import capture

    mesh = init_device_mesh("cpu", (8, 1), mesh_dim_names=HSDP_DIMS)
    model = overlapc.fsdp.shard(_model(), mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    records = capture(model, (torch.randn(5, 8),), {"on_error": "raise", "bucket": None})
    counts = _counts(records)
    replicate = mesh["dp_replicate"].get_group().group_name
    assert counts["fw_0"] == {}, f"no all-gathers: {counts['fw_0']}"
    assert counts["bw_0"] == {f"all_reduce@{replicate}": len(list(model.parameters()))}, counts["bw_0"]
    bw = next(r.gm for r in records if r.name == "bw_0")
    dtypes = {c.dtype for c in overlapc.collectives(bw)}
    assert dtypes == {torch.float32}, f"all-reduce in reduce_dtype: {dtypes}"


def test_in_graph_ddp_gets_no_nothing_to_schedule_warning(fake_pg, caplog):
    """Its forward has no collective by design (every parameter whole on every rank) and its
    backward all-reduces: the "nothing to schedule" WARNING, said at the first graph without
    collectives, is not said at that forward (it was, before the backward was scheduled)."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    import overlapc

    mesh = init_device_mesh("cpu", (8, 1), mesh_dim_names=HSDP_DIMS)
    model = overlapc.fsdp.shard(_model(), mesh)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="overlapc"):
        torch.compile(model, backend="overlapc", options={"inner": "aot_eager"})(torch.randn(5, 8)).sum().backward()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "nothing to schedule in" in m], messages
    assert any("bw_" in m and "moved" in m for m in messages), messages


def test_mesh_dims_by_name(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import overlapc.fsdp as fsdp

    named = init_device_mesh("cpu", (2, 4), mesh_dim_names=("fsdp", "dp_replicate"))
    model = fsdp.shard(nn.Linear(8, 8), named)  # the dim that is not dp_replicate shards
    assert model._parameters["weight"].placements == (Shard(0), Replicate())
    assert model._parameters["weight"].to_local().shape == (4, 8)
    with pytest.raises(ValueError, match="dp_shard of size 1"):
        fsdp.shard(nn.Linear(8, 8), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_replicate",)))
    with pytest.raises(ValueError, match="at most one tp dim"):
        fsdp.shard(nn.Linear(8, 8), init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "cp")))
    with pytest.raises(ValueError, match="named dims"):
        fsdp.shard(nn.Linear(8, 8), init_device_mesh("cpu", (2, 4)))

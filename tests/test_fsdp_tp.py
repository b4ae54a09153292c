"""overlapc.fsdp.shard composed with tensor (+ sequence) parallel on a 2-D dp x tp mesh.

The model is examples/fsdp_tp.py's (RMSNorm/LayerNorm with SequenceParallel,
Colwise/Rowwise attention and MLP). Real values: 2 gloo ranks as dp 1 x tp 2
and dp 2 x tp 1, compiled with backend="overlapc", against the unsharded TP
model (gradients averaged over dp by hand). Graphs: a fake process group of
world size 4 (dp 2 x tp 2) in a fresh process.
"""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from multiproc import init_gloo, run_ranks

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
STEPS = 3
DIM, HEADS, HIDDEN, SEQ, BATCH = 32, 4, 64, 8, 2


def _example():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import fsdp_tp

    return fsdp_tp


# ---------------------------------------------------------------- real values (2 gloo ranks)


def _batches(mesh):
    """Same full batch on the tp ranks of a dp group (TP needs it), different per dp rank; each
    rank keeps its sequence shard (SequenceParallel)."""
    dp_rank, tp_rank, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(), mesh["tp"].size()
    g = torch.Generator().manual_seed(100 + dp_rank)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)
        part = slice(tp_rank * SEQ // tp, (tp_rank + 1) * SEQ // tp)
        out.append((x[:, part], y[:, part]))
    return out


def _train(model, batches, dp_group=None, backend=None, options=None):
    """AdamW steps; ``dp_group``: average gradients over it by hand (the unsharded reference)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(model, backend=backend, options=options) if backend else model
    losses = []
    for x, y in batches:
        loss = nn.functional.mse_loss(step(x), y)
        loss.backward()
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            for p in model.parameters():
                local = p.grad.to_local()
                dist.all_reduce(local, group=dp_group)
                local.div_(dist.get_world_size(dp_group))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _job_fsdp_tp(rank, world_size, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import overlapc.fsdp

    init_gloo(rank, world_size, port)
    warnings.filterwarnings("ignore", category=UserWarning)
    fsdp_tp = _example()
    out = {}
    for dp, tp in ((1, 2), (2, 1)):
        torch._dynamo.reset()  # a fresh compile per layout (a recompile would turn shapes dynamic)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        batches = _batches(mesh)

        def model():
            torch.manual_seed(0)
            return fsdp_tp.parallelize(fsdp_tp.Model(DIM, HEADS, HIDDEN, depth=1), mesh["tp"])

        reference_model = model()
        full = {k: v.full_tensor().clone() for k, v in reference_model.state_dict().items()}
        reference = _train(reference_model, batches, dp_group=mesh["dp"].get_group())
        sharded = overlapc.fsdp.shard(model(), mesh)
        state = sharded.state_dict()
        placed = all(isinstance(v, DTensor) and v.device_mesh == mesh for v in state.values())
        values_kept = all(torch.equal(state[k].full_tensor(), full[k]) for k in full)
        eager = _train(sharded, batches)
        compiled = _train(overlapc.fsdp.shard(model(), mesh), batches,
                          backend="overlapc", options={"inner": "aot_eager", "on_error": "raise"})
        out[dp, tp] = reference, eager, compiled, placed, values_kept
    return out


def _close(a, b):
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def test_fsdp_tp_trains_like_the_unsharded_tp_model():
    for rank, out in enumerate(run_ranks(_job_fsdp_tp, timeout=300.0)):
        for (dp, tp), (reference, eager, compiled, placed, values_kept) in out.items():
            where = f"rank {rank}, dp {dp} x tp {tp}"
            assert placed, f"{where}: every parameter should be a DTensor on the 2-D mesh"
            assert values_kept, f"{where}: full_tensor() of a shard should be the unsharded value"
            assert _close(eager, reference), f"{where}: eager {eager} vs unsharded TP {reference}"
            assert _close(compiled, reference), f"{where}: overlapc {compiled} vs unsharded TP {reference}"
            assert len(set(reference)) == STEPS, f"{where}: the loss should move: {reference}"


# ---------------------------------------------------------------- graphs (fake group, world 4, fresh process)

_GRAPHS_IN_A_FRESH_PROCESS = """
import collections, json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
sys.path.insert(0, {examples!r})
import fsdp_tp, overlapc
from overlapc.backend import capture

model, inputs = fsdp_tp.build(tp=2, depth=1)
mesh = next(model.parameters()).device_mesh
out = torch.compile(model, backend="overlapc", options={{"inner": "aot_eager", "on_error": "raise"}})(*inputs)
out.sum().backward()

def counts(m, x):
    return {{r.name: collections.Counter(f"{{c.kind}}@{{c.group}}" for c in overlapc.collectives(r.gm))
            for r in capture(m, x, {{"bucket": None}})}}

torch.manual_seed(0)
tp_only = fsdp_tp.parallelize(fsdp_tp.Model(depth=1), mesh["tp"])
print(json.dumps({{
    "dp": mesh["dp"].get_group().group_name, "tp": mesh["tp"].get_group().group_name,
    "mesh": list(mesh.mesh_dim_names), "params": len(list(model.parameters())),
    "grads": all(p.grad is not None for p in model.parameters()),
    "sharded": counts(model, inputs), "tp_only": counts(tp_only, inputs),
}}))
"""


def test_dp_x_tp_graphs_gather_parameters_over_dp_only():
    script = _GRAPHS_IN_A_FRESH_PROCESS.format(examples=EXAMPLES)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    dp, tp, n = got["dp"], got["tp"], got["params"]
    assert dp != tp and got["mesh"] == ["dp", "tp"] and got["grads"]
    sharded, tp_only = got["sharded"], got["tp_only"]
    assert sorted(sharded) == sorted(tp_only) == ["bw_0", "fw_0"]
    fw, bw = sharded["fw_0"], sharded["bw_0"]
    assert fw.get(f"all_gather@{dp}") == n, f"one dp all-gather per parameter read: {fw}"
    assert bw.get(f"reduce_scatter@{dp}") == n, f"one dp reduce-scatter per parameter: {bw}"
    assert 0 < bw.get(f"all_gather@{dp}", 0) <= n, f"reshard: backward gathers again: {bw}"
    for name, graph in tp_only.items():  # the tp all-gathers and reduce-scatters are exactly the TP model's
        ours = {k: v for k, v in sharded[name].items() if k.endswith(f"@{tp}") and not k.startswith("all_reduce")}
        assert ours == graph, f"{name}: {sharded[name]} vs TP alone {graph}"
    # New on tp: only backward all-reduces, for the gradients of parameters replicated over tp that
    # come out Partial (the SequenceParallel norms); TP alone leaves them Partial for DTensor to
    # reduce later, we reduce them before the dp reduce-scatter. No all-gather of a parameter uses tp.
    assert set(fw) <= {f"all_gather@{dp}"} | set(tp_only["fw_0"]), fw
    assert set(bw) <= {f"all_gather@{dp}", f"reduce_scatter@{dp}", f"all_reduce@{tp}"} | set(tp_only["bw_0"]), bw
    assert bw.get(f"all_reduce@{tp}", 0) <= n


# ---------------------------------------------------------------- errors and meshes (session fake group, world 8)


def _tp_model(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 16), nn.LayerNorm(16))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def test_dp_submesh_or_2d_mesh_give_the_same_placements(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import overlapc.fsdp as fsdp

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    by_2d = fsdp.shard(_tp_model(mesh["tp"]), mesh)
    by_dp = fsdp.shard(_tp_model(mesh["tp"]), mesh["dp"])
    expected = {
        "0.weight": (_StridedShard(0, split_factor=2), Shard(0)), "0.bias": (_StridedShard(0, split_factor=2), Shard(0)),
        "2.weight": (Shard(0), Shard(1)), "2.bias": (Shard(0), Replicate()),
        "3.weight": (Shard(0), Replicate()), "3.bias": (Shard(0), Replicate()),  # plain: replicated over tp
    }
    for model in (by_2d, by_dp):
        got = {name: tuple(p.placements) for name, p in model.named_parameters()}
        assert got == expected
        assert all(p.device_mesh == mesh for p in model.parameters())
    from torch.distributed.tensor import DTensor

    assert isinstance(by_2d[0].weight, DTensor) and by_2d[0].weight.device_mesh == mesh["tp"]
    assert not isinstance(by_2d[3].weight, DTensor)


def test_dp_dim_names_the_data_parallel_dim(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc.fsdp as fsdp

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("tp", "fsdp"))
    with pytest.raises(ValueError, match="dp_dim"):
        fsdp.shard(nn.Linear(8, 8), mesh)
    model = fsdp.shard(_tp_model(mesh["tp"]), mesh, dp_dim="fsdp")
    p = model[2]._parameters["weight"]
    assert p.to_local().shape == (16 // 4, 8 // 2)  # dim 0 over fsdp (4), dim 1 over tp (2)


def test_dtensor_on_another_mesh_is_refused_by_name(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc.fsdp as fsdp

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match=r"'0\.weight'.*mesh\['tp'\]"):
        fsdp.shard(_tp_model(other), mesh)

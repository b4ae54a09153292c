"""overlapc.fsdp.shard end to end: 2 real gloo ranks on 127.0.0.1 (see multiproc.py).

Each test body below named ``_job_*`` runs in both ranks; the test asserts on
what they return. Ranks get different data, so gradients really are reduced.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from multiproc import init_gloo, run_ranks

STEPS = 3
TIMEOUT = 300.0  # generous: 2 shared cores; the point is never to hang
C10D = torch.ops._c10d_functional


# ---------------------------------------------------------------- helpers (run in the ranks)


def _setup(rank, world_size, port):
    init_gloo(rank, world_size, port)
    # MHA's fast-path checks read in_proj_weight/bias (two more gathers per call) in eager.
    torch.backends.mha.set_fastpath_enabled(False)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    from torch._inductor import config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    inductor_config.compile_threads = 1  # no compile worker pool on 2 cores

    return init_device_mesh("cpu", (world_size,))


def _transformer(seed=0):
    torch.manual_seed(seed)
    layers = [
        nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        for _ in range(2)
    ]
    return nn.Sequential(*layers, nn.Linear(32, 8))


def _mlp(seed=0):
    """Dim 0 of 5 and 1: uneven over 2 ranks, and smaller than the world size."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 5), nn.LayerNorm(5), nn.ReLU(), nn.Linear(5, 1))


def _data(rank, in_features=32, out_features=8):
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(4, 6, in_features, generator=g), torch.randn(4, 6, out_features, generator=g))
        for _ in range(STEPS)
    ]


def _train(model, data, optim="adamw", backend=None):
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-2)
        if optim == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    step = torch.compile(model, backend=backend) if backend else model
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(step(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fsdp2(model, mesh, reshard_after_forward):
    from torch.distributed.fsdp import fully_shard

    for layer in model[:-1]:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _recording_backend(graphs):
    """aot_eager that keeps each forward/backward graph in ``graphs`` as (kind, GraphModule)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))


def _count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def _saves_gathered(fw_gm):
    """True if a forward output (saved for backward) is an all-gathered tensor or a view of one."""
    out = next(n for n in fw_gm.graph.nodes if n.op == "output")
    for node in out.all_input_nodes:
        while node.op == "call_function" and getattr(node.target, "is_view", False):
            node = node.args[0]
        if node.op == "call_function" and node.target is C10D.wait_tensor.default:
            if node.args[0].target is C10D.all_gather_into_tensor.default:
                return True
    return False


# ---------------------------------------------------------------- jobs (module level: picklable)


def _job_matches_fsdp2(rank, world_size, port):
    from torch.distributed.tensor import DTensor, Shard

    import overlapc.fsdp as fsdp

    mesh = _setup(rank, world_size, port)
    data = _data(rank)
    out = {}
    for reshard in (True, False):
        reference = _train(_fsdp2(_transformer(), mesh, reshard), data)
        model = fsdp.shard(_transformer(), mesh, reshard_after_forward=reshard)
        shard0 = all(isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for p in model.parameters())
        before = [p.full_tensor() for p in model.parameters()]
        losses = _train(model, data)
        all_moved = all(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
        out[reshard] = reference, losses, shard0, all_moved
    return out


def _job_bf16(rank, world_size, port):
    import overlapc.fsdp as fsdp

    mesh = _setup(rank, world_size, port)
    data = _data(rank)
    fp32 = _train(fsdp.shard(_transformer(), mesh), data)
    model = fsdp.shard(_transformer(), mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = _train(model, data)
    out_dtype = model(data[0][0]).dtype
    model(data[0][0]).float().sum().backward()
    param_dtypes = {p.dtype for p in model.parameters()}
    grad_dtypes = {p.grad.dtype for p in model.parameters()}
    # Compiled: what dtype do the collectives move?
    graphs = []
    small = fsdp.shard(_mlp(), mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _train(small, _data(rank, 8, 1)[:1], backend=_recording_backend(graphs))
    gather_dtypes = {n.meta["val"].dtype for kind, gm in graphs if kind == "fw" for n in gm.graph.nodes
                     if n.target is C10D.all_gather_into_tensor.default}
    reduce_dtypes = {n.meta["val"].dtype for kind, gm in graphs if kind == "bw" for n in gm.graph.nodes
                     if n.target is C10D.reduce_scatter_tensor.default}
    return fp32, bf16, out_dtype, param_dtypes, grad_dtypes, gather_dtypes, reduce_dtypes


def _job_state_dict(rank, world_size, port):
    from torch.distributed.tensor import DTensor, Shard

    import overlapc.fsdp as fsdp

    mesh = _setup(rank, world_size, port)
    data = _data(rank)
    full = _transformer().state_dict()
    model = fsdp.shard(_transformer(), mesh)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    same_keys = list(saved) == list(full)
    sharded = all(isinstance(v, DTensor) and tuple(v.placements) == (Shard(0),) for v in saved.values())
    values_kept = all(torch.equal(saved[k].full_tensor(), full[k]) for k in full)

    first = _train(model, data, optim="sgd")  # moves the parameters
    moved = not torch.equal(model.state_dict()["2.weight"].full_tensor(), full["2.weight"])
    model.load_state_dict(saved)  # DTensor values
    restored = all(torch.equal(v.full_tensor(), full[k]) for k, v in model.state_dict().items())
    again = _train(model, data, optim="sgd")

    fresh = fsdp.shard(_transformer(seed=1), mesh)
    fresh.load_state_dict(full)  # full plain tensors
    from_full = _train(fresh, data, optim="sgd")
    return same_keys, sharded, values_kept, moved, restored, first, again, from_full


def _job_graphs(rank, world_size, port):
    import overlapc.fsdp as fsdp

    mesh = _setup(rank, world_size, port)
    data = _data(rank)
    out = {}
    for reshard in (True, False):
        eager = _train(fsdp.shard(_transformer(), mesh, reshard_after_forward=reshard), data)
        graphs = []
        model = fsdp.shard(_transformer(), mesh, reshard_after_forward=reshard)
        compiled = _train(model, data, backend=_recording_backend(graphs))
        kinds = [kind for kind, _ in graphs]
        fw = next(gm for kind, gm in graphs if kind == "fw")
        bw = next(gm for kind, gm in graphs if kind == "bw")
        counts = {
            "params": len(list(model.parameters())),
            "fw_all_gather": _count(fw, C10D.all_gather_into_tensor.default),
            "fw_wait": _count(fw, C10D.wait_tensor.default),
            "bw_all_gather": _count(bw, C10D.all_gather_into_tensor.default),
            "bw_reduce_scatter": _count(bw, C10D.reduce_scatter_tensor.default),
            "bw_wait": _count(bw, C10D.wait_tensor.default),
            "fw_saves_gathered": _saves_gathered(fw),
        }
        other = {
            str(n.target)
            for _, gm in graphs
            for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) not in ("aten", "_c10d_functional")
        }
        out[reshard] = eager, compiled, kinds, counts, other
    return out


def _job_uneven(rank, world_size, port):
    import overlapc.fsdp as fsdp

    mesh = _setup(rank, world_size, port)
    data = _data(rank, 8, 1)
    reference = _train(_fsdp2(_mlp(), mesh, True), data)
    eager = _train(fsdp.shard(_mlp(), mesh), data)
    inductor = _train(fsdp.shard(_mlp(), mesh), data, backend="inductor")
    shapes = [tuple(p.to_local().shape) for p in fsdp.shard(_mlp(), mesh).parameters()]
    return reference, eager, inductor, shapes


def _job_gathered_freed(rank, world_size, port):
    """How many gathered parameters are still alive after forward (i.e. saved for backward)?"""
    import gc
    import weakref

    import overlapc.fsdp as fsdp

    mesh = _setup(rank, world_size, port)
    gathered = []
    gather_call = fsdp._Gather.__call__

    def recording_call(self, shard, *args):
        full = gather_call(self, shard, *args)
        gathered.append(weakref.ref(full))
        return full

    fsdp._Gather.__call__ = recording_call
    x, y = _data(rank)[0]
    alive = {}
    for reshard in (True, False):
        model = fsdp.shard(_transformer(), mesh, reshard_after_forward=reshard)
        gathered.clear()
        loss = nn.functional.mse_loss(model(x), y)
        gc.collect()
        alive[reshard] = (sum(ref() is not None for ref in gathered), len(gathered))
        loss.backward()
        del loss
        gc.collect()
        alive[reshard, "after backward"] = sum(ref() is not None for ref in gathered)
        grads = all(p.grad is not None for p in model.parameters())
    return alive, grads


# ---------------------------------------------------------------- tests


def _close(a, b, rtol=1e-5, atol=1e-6):
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=rtol, atol=atol)


def test_eager_losses_match_fsdp2():
    for rank, out in enumerate(run_ranks(_job_matches_fsdp2, timeout=TIMEOUT)):
        for reshard, (reference, ours, shard0, all_moved) in out.items():
            assert shard0, "every parameter should be a Shard(0) DTensor"
            assert all_moved, "the optimizer should update every parameter"
            assert _close(ours, reference), f"rank {rank}, reshard={reshard}: {ours} vs FSDP2 {reference}"


def test_bf16_param_dtype_close_to_fp32():
    for fp32, bf16, out_dtype, param_dtypes, grad_dtypes, gather_dtypes, reduce_dtypes in run_ranks(
        _job_bf16, timeout=TIMEOUT
    ):
        assert _close(bf16, fp32, rtol=2e-2, atol=1e-2), f"bf16 {bf16} vs fp32 {fp32}"
        assert bf16 != fp32  # the cast really happened
        assert out_dtype == torch.bfloat16
        assert param_dtypes == {torch.float32} and grad_dtypes == {torch.float32}
        assert gather_dtypes == {torch.bfloat16}, "the shard is cast before the all-gather"
        assert reduce_dtypes == {torch.float32}, "gradients are reduce-scattered in reduce_dtype"


def test_state_dict_round_trip():
    for same_keys, sharded, values_kept, moved, restored, first, again, from_full in run_ranks(
        _job_state_dict, timeout=TIMEOUT
    ):
        assert same_keys, "state_dict keys must be the unsharded model's keys"
        assert sharded and values_kept
        assert moved and restored
        assert _close(again, first) and _close(from_full, first)


def test_compiled_graphs_hold_collectives():
    for out in run_ranks(_job_graphs, timeout=TIMEOUT):
        for reshard, (eager, compiled, kinds, counts, other) in out.items():
            where = f"reshard={reshard}: {counts}"
            assert _close(compiled, eager), f"{where}: compiled {compiled} vs eager {eager}"
            assert kinds == ["fw", "bw"], f"{where}: expected one graph pair (no graph breaks), got {kinds}"
            n = counts["params"]
            assert counts["fw_all_gather"] == counts["fw_wait"] == n, where
            assert counts["bw_reduce_scatter"] == n, where
            if reshard:
                assert 0 < counts["bw_all_gather"] <= n, where
                assert not counts["fw_saves_gathered"], f"{where}: a gathered parameter is saved for backward"
            else:
                assert counts["bw_all_gather"] == 0, where
                assert counts["fw_saves_gathered"], where
            assert counts["bw_wait"] == counts["bw_reduce_scatter"] + counts["bw_all_gather"], where
            assert other <= {"<built-in function getitem>"}, f"{where}: unexpected non-aten ops {other}"


def test_uneven_dim0_eager_and_inductor_match_fsdp2():
    for rank, (reference, eager, inductor, shapes) in enumerate(run_ranks(_job_uneven, timeout=TIMEOUT)):
        assert _close(eager, reference), f"eager {eager} vs FSDP2 {reference}"
        assert _close(inductor, reference, rtol=1e-4), f"inductor {inductor} vs FSDP2 {reference}"
        expected = [(3, 8), (3,), (3,), (3,), (1, 5), (1,)] if rank == 0 else [(2, 8), (2,), (2,), (2,), (0, 5), (0,)]
        assert shapes == expected


def test_eager_reshard_frees_gathered_parameters():
    for alive, grads in run_ranks(_job_gathered_freed, timeout=TIMEOUT):
        live, total = alive[True]
        assert total == 26 and live == 0, f"reshard: {live} of {total} gathered parameters kept"
        live, total = alive[False]
        assert total == 26 and live > 0, "without reshard, backward keeps the gathered weights"
        assert alive[True, "after backward"] == 0 and alive[False, "after backward"] == 0
        assert grads


# ---------------------------------------------------------------- in-process checks (fake process group)


def test_rejects_0dim_parameter_by_name(fake_pg):
    import overlapc.fsdp as fsdp

    model = nn.Module()
    model.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="'scale'"):
        fsdp.shard(model, fake_pg)


def test_accepts_process_group(fake_pg):
    from torch.distributed.tensor import DTensor, Shard

    import overlapc.fsdp as fsdp

    model = fsdp.shard(nn.Linear(16, 16), fake_pg)
    assert isinstance(model.weight, torch.Tensor) and not isinstance(model.weight, DTensor)
    p = model._parameters["weight"]
    assert isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)
    assert p.device_mesh.size() == dist.get_world_size(fake_pg)
    with pytest.raises(ValueError, match="already sharded"):
        fsdp.shard(model, fake_pg)


def test_tied_parameters_stay_tied(fake_pg):
    import overlapc.fsdp as fsdp

    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
    model[1].weight = model[0].weight
    fsdp.shard(model, fake_pg)
    assert model[0]._parameters["weight"] is model[1]._parameters["weight"]
    assert len(list(model.parameters())) == 1


def test_meta_parameters_shard_without_data(fake_pg):
    """Projections and captures build models on the meta device: shapes only."""
    from torch.distributed.tensor import DTensor, Shard

    import overlapc.fsdp as fsdp

    with torch.device("meta"):
        model = nn.Linear(16, 24)
    fsdp.shard(model, fake_pg)
    p = model._parameters["weight"]
    assert isinstance(p, DTensor) and p.is_meta and tuple(p.placements) == (Shard(0),)
    assert tuple(p.shape) == (24, 16) and tuple(p.to_local().shape) == (3, 16)


def test_compile_is_quiet_about_overlapcs_own_checkpoint(fake_pg):
    """torch warns "context_fn is passed to torch.utils.checkpoint ... in-place ops" once per process;
    overlapc's recompute regions are functionalized (safe), so that warning is dropped for them only."""
    import logging

    from torch._logging._internal import warning_once

    import overlapc.fsdp as fsdp

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("torch._higher_order_ops.wrap")
    handler = Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        warning_once.cache_clear()  # the warning is once per process: re-arm it
        torch._dynamo.reset()
        model = fsdp.shard(nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True)), fake_pg)
        torch.compile(model, backend="aot_eager")(torch.randn(4, 16)).sum().backward()
        ours = list(records)

        warning_once.cache_clear()
        torch._dynamo.reset()
        torch.compile(_user_region, backend="aot_eager")(torch.randn(4, requires_grad=True)).sum().backward()
        theirs = records[len(ours):]
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
    assert not [m for m in ours if "context_fn" in m], ours
    assert any("context_fn is passed to torch.utils.checkpoint" in m for m in theirs), (
        "the filter must keep the warning for other checkpoints"
    )


def _user_policy(ctx, op, *args, **kwargs):
    return False  # recompute everything


def _user_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_user_policy)


def _user_region(x):
    """A selective checkpoint that is not overlapc's (the quiet test's control)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(torch.sin, x, use_reentrant=False, context_fn=_user_contexts)


def test_eager_regather_does_not_depend_on_what_is_still_alive():
    """Whether unpacking a saved gathered parameter re-gathers (a collective) must be
    the same on every rank: decided by counting the saved tensors, never by whether
    an earlier re-gathered copy has been garbage-collected yet."""
    import gc

    from overlapc.fsdp import _Regather, _Source

    calls = []

    class Gather:   # stands in for the all-gather of the parameter's shards
        def local(self, param):
            calls.append(param)
            return torch.arange(6.0).reshape(2, 3)

    full = torch.arange(6.0).reshape(2, 3)
    source = _Source(Gather(), "weight", full)
    saved = [_Regather(source, full, None), _Regather(source, full.t(), None)]
    first = saved[0].unpack()
    del first
    gc.collect()          # the first copy is gone: a liveness test would gather again
    second = saved[1].unpack()
    assert len(calls) == 1 and torch.equal(second, full.t())
    assert source.copy is None   # all saved tensors unpacked: the copy is freed
    saved[0].unpack()            # a second backward (retain_graph) gathers again, on every rank
    assert len(calls) == 2

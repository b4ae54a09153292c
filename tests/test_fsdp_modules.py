"""overlapc.fsdp.shard on a battery of common modules: 2 real gloo ranks, one run.

Every module is sharded with reshard_after_forward True and False and run
eager and compiled (aot_eager; one inductor case): the output, the input's
gradient, the buffers (BatchNorm's running stats) and the parameters'
gradients must equal the unsharded module's (its gradients averaged over the
ranks by hand; each rank feeds different data). In-place ops after saved
outputs (ReLU(inplace), RMSNorm's decomposition, BatchNorm, GRU) once crashed
the eager reshard path; a compiled backward once died of gloo's coalesced
all-gather (SIGSEGV) before shard() routed it (overlapc.torch_compat).
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from multiproc import init_gloo, run_ranks


class _SelfAttention(nn.Module):
    """MultiheadAttention on one input (its forward takes query, key, value)."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x)[0]


class _First(nn.Module):
    """The output of a module that returns (output, state)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)[0]


def _battery():
    """name -> (module factory, input factory)."""
    seq = lambda g: torch.randn(2, 5, 8, generator=g)  # noqa: E731
    rows = lambda g: torch.randn(4, 8, generator=g)  # noqa: E731
    return {
        "linear": (lambda: nn.Linear(8, 8), rows),
        "rmsnorm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8)), rows),
        "layernorm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), rows),
        "batchnorm1d": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), rows),
        "embedding": (lambda: nn.Embedding(10, 8), lambda g: torch.randint(0, 10, (4, 3), generator=g)),
        "conv1d": (lambda: nn.Conv1d(4, 6, 3), lambda g: torch.randn(2, 4, 10, generator=g)),
        "gru": (lambda: _First(nn.GRU(8, 8, batch_first=True)), seq),
        "multiheadattention": (_SelfAttention, seq),
        "relu_inplace": (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)), rows),
        "transformer_layer": (
            lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
            seq,
        ),
    }


def _step(model, x, backend, seed):
    """One forward and backward of sum(out * w), w random from ``seed``; returns (out, input grad)."""
    x = x.clone().requires_grad_(x.is_floating_point())
    out = (torch.compile(model, backend=backend) if backend else model)(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * weight).sum().backward()
    return out.detach(), (x.grad if x.is_floating_point() else None)


def _mismatches(name, reference, sharded, ref_out, out, ref_dx, dx):
    """What differs between the unsharded module (grads already averaged) and the sharded one."""
    close = dict(rtol=1e-5, atol=1e-5)
    bad = []
    if not torch.allclose(out, ref_out, **close):
        bad.append(f"{name}: output differs by {(out - ref_out).abs().max():.3g}")
    if ref_dx is not None and not torch.allclose(dx, ref_dx, **close):
        bad.append(f"{name}: input gradient differs by {(dx - ref_dx).abs().max():.3g}")
    params = dict(sharded.named_parameters())
    for pname, p in reference.named_parameters():
        grad = params[pname].grad
        if grad is None:
            bad.append(f"{name}: {pname} got no gradient")
        elif not torch.allclose(grad.full_tensor(), p.grad, **close):
            bad.append(f"{name}: {pname}.grad differs by {(grad.full_tensor() - p.grad).abs().max():.3g}")
    buffers = dict(sharded.named_buffers())
    for bname, b in reference.named_buffers():
        if not torch.equal(buffers[bname], b) and not torch.allclose(buffers[bname].float(), b.float(), **close):
            bad.append(f"{name}: buffer {bname} differs")
    return bad


def _job_battery(rank, world_size, port):
    from torch._dynamo.backends.debugging import aot_eager
    from torch._inductor import config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc.fsdp as fsdp

    init_gloo(rank, world_size, port)
    torch.backends.mha.set_fastpath_enabled(False)  # its checks read in_proj_weight eagerly
    inductor_config.compile_threads = 1
    mesh = init_device_mesh("cpu", (world_size,))
    compiled_graphs = []

    def counting_aot_eager(gm, example_inputs):
        compiled_graphs.append(gm)
        return aot_eager(gm, example_inputs)

    cases = [(name, reshard, mode) for name in _battery() for reshard in (True, False)
             for mode in ("eager", "aot_eager")] + [("rmsnorm", True, "inductor")]
    bad, compiled = [], {}
    for name, reshard, mode in cases:
        make_model, make_input = _battery()[name]
        label = f"{name} reshard={reshard} {mode}"
        g = torch.Generator().manual_seed(100 + rank)
        x = make_input(g)
        torch.manual_seed(0)
        reference = make_model()
        torch.manual_seed(0)
        sharded = fsdp.shard(make_model(), mesh, reshard_after_forward=reshard)
        ref_out, ref_dx = _step(reference, x, None, seed=7 + rank)
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        torch._dynamo.reset()  # a fresh compile per case (else Dynamo's recompile limit falls back to eager)
        before = len(compiled_graphs)
        backend = {"eager": None, "aot_eager": counting_aot_eager, "inductor": "inductor"}[mode]
        try:
            out, dx = _step(sharded, x, backend, seed=7 + rank)
        except RuntimeError as error:   # a gloo timeout says nothing of the case
            raise RuntimeError(f"rank {rank}, {label}: {error}") from error
        compiled[label] = len(compiled_graphs) - before
        bad += [f"{label}: {m}" for m in _mismatches(name, reference, sharded, ref_out, out, ref_dx, dx)]
    from overlapc.torch_compat import route_gloo_all_gathers
    routed = not route_gloo_all_gathers()   # False: shard() installed it (a gloo mesh)
    return bad, compiled, routed


def test_common_modules_match_unsharded_eager_and_compiled():
    for rank, (bad, compiled, routed) in enumerate(run_ranks(_job_battery, timeout=400.0)):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)
        assert routed, f"rank {rank}: shard() on a gloo mesh left gloo's coalesced all-gather in place"
        for label, graphs in compiled.items():
            if label.endswith("aot_eager") and not label.startswith("gru"):  # Dynamo runs RNNs eagerly
                assert graphs >= 1, f"rank {rank}: {label} was not compiled"

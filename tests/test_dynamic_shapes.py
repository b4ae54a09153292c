"""overlapc adds no guard to a graph with symbolic sizes (DESIGN.md semantics 10).

A guard on a symbolic size pins it: Dynamo then compiles a new graph for every
new size (one per sequence length) until its recompile limit. Two checks, both
independent of overlapc's own code:

* graph level: ``overlapc.schedule`` on a make_fx graph traced with symbolic
  shapes leaves the ShapeEnv's guards and replacements as they were, and still
  reorders;
* end to end: 2 gloo ranks train a small Llama sharded with overlapc.fsdp over
  steps of sequence lengths 32, 48, 64, 80, 64, 32: backend="overlapc" captures
  no more Dynamo graphs than plain Inductor, its losses equal eager's, and no
  guard or replacement is created while overlapc's code is the innermost
  overlapc frame on the stack (a spy on torch's ShapeGuard / _set_replacement).
"""
import os
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import overlapc
from multiproc import init_gloo, run_ranks

F = torch.ops._c10d_functional
WORLD = 8
LENGTHS = (32, 48, 64, 80, 64, 32)
TIMEOUT = 900.0   # three backends compile in each rank on 2 shared cores


def _symbolic_step(x, w1, w2, w3):
    """Three sharded weights gathered, activations of a symbolic length gathered
    (sequence-parallel style) and a symbolic reduce-scatter at the end."""
    h = x
    for w in (w1, w2, w3):
        full = F.wait_tensor(F.all_gather_into_tensor(w, WORLD, "0"))
        h = torch.relu(h @ full.t())
        gathered = F.wait_tensor(F.all_gather_into_tensor(h, WORLD, "0"))
        h = h + gathered[: h.shape[0]]
    return h, F.wait_tensor(F.reduce_scatter_tensor(h, "sum", WORLD, "0"))


def _shape_env(gm):
    for node in gm.graph.find_nodes(op="placeholder"):
        for size in node.meta["val"].shape:
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    raise AssertionError("the traced graph has no symbolic size")


@pytest.mark.parametrize("options", [
    dict(max_in_flight=2, max_in_flight_bytes="auto", bucket=None),
    dict(max_in_flight=1, max_in_flight_bytes=4096, bucket="auto"),
    dict(max_in_flight=2, bucket="auto", chunks="auto"),
    dict(max_in_flight=None, max_in_flight_bytes=None, bucket=None, chunks=4),
])
def test_schedule_adds_no_guard_on_symbolic_sizes(fake_pg, options):
    torch.manual_seed(0)
    gm = make_fx(_symbolic_step, tracing_mode="symbolic")(torch.randn(16, 64),
                                                         *[torch.randn(8, 64) for _ in range(3)])
    env = _shape_env(gm)
    guards, replacements = list(env.guards), dict(env.replacements)
    before = [n.name for n in gm.graph.nodes]
    overlapc.schedule(gm, overlapc.OverlapConfig(on_error="raise", **options))
    overlapc.verify(gm, overlapc.OverlapConfig(on_error="raise", **options))
    assert env.guards == guards, [str(g.expr) for g in env.guards[len(guards):]]
    assert dict(env.replacements) == replacements
    assert [n.name for n in gm.graph.nodes] != before   # it still reorders


def test_sizes_are_hints_not_guards(fake_pg):
    """Sizes overlapc reports for a symbolic graph are the traced sizes (hints)."""
    gm = make_fx(_symbolic_step, tracing_mode="symbolic")(torch.randn(16, 64),
                                                         *[torch.randn(8, 64) for _ in range(3)])
    env = _shape_env(gm)
    guards = list(env.guards)
    rows = overlapc.collectives(gm)
    gathered_activations = [r.nbytes for r in rows if r.kind == "all_gather"][1::2]
    assert gathered_activations == [WORLD * 16 * 64 * 4] * 3   # h: [s0, 64] fp32 traced at s0 = 16
    assert env.guards == guards


# ---------------------------------------------------------------- end to end (2 gloo ranks)


class _GuardSpy:
    """Records, for every ShapeGuard and replacement torch creates, the innermost
    frame of overlapc's code on the stack unless that frame only hands the graph
    to torch (the backend entry, its per-graph compiler wrapper, and the wrapper
    that logs when the pass did not run)."""

    HAND_OFF = ("overlapc_backend", "compile_named", "_compile_and_say")

    def __init__(self):
        import overlapc.passes
        self.roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (overlapc, overlapc.passes))
        self.found: list[str] = []

    def _look(self):
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.roots):
                if frame.f_code.co_name not in self.HAND_OFF:
                    self.found.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
                return
            frame = frame.f_back

    def install(self):
        from torch.fx.experimental import symbolic_shapes as ss
        original_guard, original_replace = ss.ShapeGuard, ss.ShapeEnv._set_replacement

        def guard(*args, **kwargs):
            self._look()
            return original_guard(*args, **kwargs)

        def replace(env, *args, **kwargs):
            self._look()
            return original_replace(env, *args, **kwargs)

        ss.ShapeGuard, ss.ShapeEnv._set_replacement = guard, replace


def _train(rank, backend, options=None):
    import torch.distributed as dist
    import torch.nn.functional as nnf
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from llama import Llama

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = overlapc.fsdp.shard(Llama(vocab=128, dim=64, heads=4, hidden=128, depth=1), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = model if backend is None else torch.compile(model, backend=backend, options=options)
    g = torch.Generator().manual_seed(100 + rank)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses = []
    for length in LENGTHS:
        tokens = torch.randint(0, 128, (2, length + 1), generator=g)
        logits = step(tokens[:, :-1])
        loss = nnf.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return losses, graphs


def _job_lengths(rank, world_size, port):
    init_gloo(rank, world_size, port)
    from torch._inductor import config as inductor_config
    inductor_config.compile_threads = 1
    spy = _GuardSpy()
    spy.install()
    eager, _ = _train(rank, None)
    inductor, inductor_graphs = _train(rank, "inductor")
    before = len(spy.found)
    ours, our_graphs = _train(rank, "overlapc", {"on_error": "raise"})
    return dict(eager=eager, inductor=inductor, inductor_graphs=inductor_graphs, ours=ours,
                our_graphs=our_graphs, guards=spy.found[before:])


def test_variable_lengths_compile_no_more_graphs_than_inductor(monkeypatch):
    # no FX graph or AOTAutograd cache hit (the pass must run); compiled kernels are shared
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    for r in run_ranks(_job_lengths, world_size=2, timeout=TIMEOUT):
        assert r["guards"] == [], f"overlapc added guards: {r['guards'][:5]}"
        assert r["our_graphs"] <= r["inductor_graphs"], r
        assert r["inductor_graphs"] < len(set(LENGTHS)), r   # the lengths did go dynamic
        torch.testing.assert_close(r["ours"], r["eager"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r["inductor"], r["eager"], rtol=1e-4, atol=1e-5)

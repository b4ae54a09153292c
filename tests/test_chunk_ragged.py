"""Dropless MoE (all-to-alls whose split sizes come from a count exchange at run
time): the dispatch -> expert -> combine pipeline is cut into token ranges of
every rank block (overlapc.passes.chunk.ragged) and gives exactly the unchunked
values; the count exchange and what does not qualify are reported with why.

Graph tests: make_fx graphs under the fake process group (world 8), run by
simulated ranks (one thread per rank, the all-to-alls exchanged between them)
with routings that leave blocks empty and smaller than the piece count. Training:
examples/moe_dropless.py on 2 gloo ranks, chunks 2, 4, "auto" against chunks 1
and eager."""
import copy
import dataclasses
import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.fx.experimental.proxy_tensor import make_fx

import overlapc
from multiproc import init_gloo, run_ranks
from overlapc.passes.chunk import chunk_collectives

F = torch.ops._c10d_functional
WORLD = 8          # tests/conftest.py's fake group
TOKENS, DIM, HIDDEN = 12, 8, 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _moe(x, expert, w1, w2):
    return _layer(x, expert, w1, w2, all_to_all_single)


def _layer(x, expert, w1, w2, a2a):
    """Top-1 dropless MoE over the default group: tokens of each rank to expert
    ``expert[t]`` (one per rank), a GELU MLP there, back, summed into place."""
    group = dist.group.WORLD
    order = expert.argsort(stable=True)
    counts = (expert[:, None] == torch.arange(WORLD)).sum(0)
    received = all_to_all_single(counts, [1] * WORLD, [1] * WORLD, group)
    send, recv = counts.tolist(), received.tolist()
    tokens = a2a(x[order], recv, send, group)
    done = a2a(torch.nn.functional.gelu(tokens @ w1) @ w2 * 2.0, send, recv, group)
    return torch.zeros_like(x).index_add(0, order, done)


def _train(x, expert, w1, w2):
    """The layer's output and the gradients of a weighted sum of it (forward + backward)."""
    out = _layer(x, expert, w1, w2, all_to_all_single_autograd)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum()
    return (out, *torch.autograd.grad(loss, [x, w1, w2]))


def _trace(fn, grad: bool = False) -> fx.GraphModule:
    args = _rank_args(0, "random")
    if grad:
        args = [a.requires_grad_() if a.is_floating_point() else a for a in args]
    return make_fx(fn, tracing_mode="fake")(*args)


def _rank_args(rank: int, routing: str):
    """One rank's inputs: its tokens, their experts, and the (shared) weights."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64)
    if routing == "random":
        expert = torch.randint(0, WORLD, (TOKENS,), generator=g)
    elif routing == "skewed":   # most ranks send everything to two experts: empty blocks and big ones
        expert = torch.full((TOKENS,), rank % 2) if rank else torch.arange(TOKENS) % WORLD
    else:
        raise ValueError(routing)
    w = torch.Generator().manual_seed(100)
    return [x, expert, torch.randn(DIM, HIDDEN, generator=w, dtype=torch.float64),
            torch.randn(HIDDEN, DIM, generator=w, dtype=torch.float64)]


class _SimulatedRank(fx.Interpreter):
    """Runs a graph as rank ``rank`` of WORLD threads: all_to_all_single sends its
    input blocks to the other threads and returns what they sent here."""

    def __init__(self, gm, rank, boxes, barrier):
        super().__init__(gm)
        self.rank, self.boxes, self.barrier, self.calls = rank, boxes, barrier, 0

    def call_function(self, target, args, kwargs):
        if target is F.all_to_all_single.default:
            x, out_splits, in_splits = args[0], list(args[1]), list(args[2])
            box = self.boxes.setdefault(self.calls, {})
            self.calls += 1
            box[self.rank] = x.split(in_splits)
            self.barrier.wait()
            got = torch.cat([box[r][self.rank] for r in range(WORLD)])
            assert got.shape[0] == sum(out_splits), (got.shape, out_splits)
            return got
        if target is F.wait_tensor.default:
            return args[0]
        return super().call_function(target, args, kwargs)


def _run(gm, routing: str) -> list:
    """Every rank's outputs of ``gm`` (simulated ranks)."""
    boxes, barrier = {}, threading.Barrier(WORLD, timeout=60)
    results, errors = [None] * WORLD, []

    def rank_main(rank):
        try:
            results[rank] = _SimulatedRank(gm, rank, boxes, barrier).run(*_rank_args(rank, routing))
        except BaseException as error:  # noqa: BLE001 - reported below; the others must not wait
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    if errors:
        raise errors[0]
    return results


def _assert_equal(before, after, routing):
    """Every rank's outputs equal (fp64: a matmul over fewer rows may round differently)."""
    for rank, (a, b) in enumerate(zip(_run(before, routing), _run(after, routing))):
        a = a if isinstance(a, (list, tuple)) else [a]
        b = b if isinstance(b, (list, tuple)) else [b]
        assert len(a) == len(b)
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {rank} ({routing}): {m}")


def _starts(gm):
    return [n for n in gm.graph.nodes if n.target is F.all_to_all_single.default]


@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_dispatch_expert_combine_is_cut_into_token_ranges_with_the_same_values(fake_pg, chunks, routing):
    gm = _trace(_moe)
    before = copy.deepcopy(gm)
    notes = chunk_collectives(gm, chunks)
    gm.graph.lint()
    gm.recompile()
    applied = [n for n in notes if n.applied]
    assert len(applied) == 1, notes
    note = applied[0]
    assert note.pattern == "all_to_all_expert" and len(note.starts) == 2 and len(note.pieces) == 2 * chunks
    assert len(_starts(gm)) == 1 + 2 * chunks   # the count exchange stays whole
    _assert_equal(before, gm, routing)


@pytest.mark.parametrize("chunks", [2, 4])
def test_forward_and_backward_pipelines_train_the_same(fake_pg, chunks):
    gm = _trace(_train, grad=True)
    before = copy.deepcopy(gm)
    notes = chunk_collectives(gm, chunks)
    gm.graph.lint()
    gm.recompile()
    assert sum(n.applied for n in notes) == 2, notes   # dispatch/combine and their gradients
    _assert_equal(before, gm, "skewed")
    _assert_equal(before, gm, "random")


def test_count_exchange_is_reported_as_such(fake_pg):
    gm = _trace(_moe)
    exchange = _starts(gm)[0]
    notes = chunk_collectives(gm, 2)
    note = next(n for n in notes if n.starts == (exchange.name,))
    assert not note.applied
    assert "exchanges split sizes" in note.reason and "does not divide" not in note.reason, note.reason
    assert "all_to_all_single_1" in note.reason   # names the all-to-alls it sizes


def test_pieces_issue_before_the_previous_piece_computes(fake_pg):
    gm = _trace(_moe)
    chunk_collectives(gm, 2)
    order = [n.name for n in gm.graph.nodes]
    first_mm = min(i for i, n in enumerate(gm.graph.nodes) if n.target is torch.ops.aten.mm.default)
    assert order.index("all_to_all_single_1_chunk1") < first_mm
    assert order.index("all_to_all_single_2_chunk0") < order.index("all_to_all_single_2_chunk1")


def test_scheduled_dispatch_pieces_all_go_out_before_the_first_is_waited(fake_pg):
    """As with equal splits: every dispatch piece is cut up front and issued
    before the expert computes on piece 0 (the count bound counts them as one)."""
    gm = _trace(_moe)
    overlapc.schedule(gm, overlapc.OverlapConfig(chunks=4, bucket=None, on_error="raise"))
    order = list(gm.graph.nodes)
    dispatch = [i for i, n in enumerate(order) if n.name.startswith("all_to_all_single_1_chunk")]
    first_wait = min(i for i, n in enumerate(order) if n.target is F.wait_tensor.default
                     and n.args[0].name.startswith("all_to_all_single_1_chunk"))
    assert len(dispatch) == 4 and max(dispatch) < first_wait, (dispatch, first_wait)


def test_chunking_is_deterministic(fake_pg):
    codes = set()
    for _ in range(2):
        gm = _trace(_train, grad=True)
        chunk_collectives(gm, 3)
        gm.recompile()
        codes.add(gm.code)
    assert len(codes) == 1


def _moe_views(x, expert, w1, w2):
    """An expert that views its rows as [tokens, 4, 4] (a per-row norm) and back."""
    group = dist.group.WORLD
    order = expert.argsort(stable=True)
    counts = (expert[:, None] == torch.arange(WORLD)).sum(0)
    received = all_to_all_single(counts, [1] * WORLD, [1] * WORLD, group)
    send, recv = counts.tolist(), received.tolist()
    tokens = all_to_all_single(x[order], recv, send, group)
    h = (tokens @ w1).view(tokens.shape[0], 4, HIDDEN // 4)
    h = (h - h.mean(-1, keepdim=True)).reshape(tokens.shape[0], HIDDEN)
    done = all_to_all_single(h @ w2, send, recv, group)
    return torch.zeros_like(x).index_add(0, order, done)


def test_views_and_row_reductions_in_the_expert_are_pipelined(fake_pg):
    gm = _trace(_moe_views)
    before = copy.deepcopy(gm)
    notes = chunk_collectives(gm, 3)
    gm.graph.lint()
    gm.recompile()
    assert sum(n.applied for n in notes) == 1, notes
    assert any(n.target is torch.ops.aten.view.default for n in gm.graph.nodes)
    _assert_equal(before, gm, "skewed")


def _moe_rowmix(x, expert, w1, w2):
    """An expert that mixes rows (a softmax over the tokens): no pipeline."""
    group = dist.group.WORLD
    counts = (expert[:, None] == torch.arange(WORLD)).sum(0)
    received = all_to_all_single(counts, [1] * WORLD, [1] * WORLD, group)
    send, recv = counts.tolist(), received.tolist()
    tokens = all_to_all_single(x[expert.argsort()], recv, send, group)
    return all_to_all_single((tokens @ w1).softmax(0) @ w2, send, recv, group)


def _moe_no_return(x, expert, w1, w2):
    """Rows dispatched and never sent back (the next all-to-all has other splits)."""
    group = dist.group.WORLD
    counts = (expert[:, None] == torch.arange(WORLD)).sum(0)
    received = all_to_all_single(counts, [1] * WORLD, [1] * WORLD, group)
    send, recv = counts.tolist(), received.tolist()
    tokens = all_to_all_single(x[expert.argsort()], recv, send, group)
    return all_to_all_single(tokens @ w1 @ w2, recv, send, group)


def test_expert_that_mixes_rows_is_left_alone_with_why(fake_pg):
    gm = _trace(_moe_rowmix)
    code = gm.code
    notes = chunk_collectives(gm, 2)
    assert not any(n.applied for n in notes) and gm.code == code
    assert any("_softmax" in n.reason and "not row-wise" in n.reason for n in notes), notes


def test_rows_not_sent_back_are_left_alone_with_why(fake_pg):
    gm = _trace(_moe_no_return)
    notes = chunk_collectives(gm, 2)
    assert not any(n.applied for n in notes)
    assert any("sends back the rows it received" in n.reason for n in notes), notes


def test_auto_estimates_assuming_balanced_routing(fake_pg):
    from overlapc.estimate import costmodel
    gm = _trace(_moe)
    before = copy.deepcopy(gm)
    slow_link = costmodel.profile(device="cpu", link="ethernet", tflops=1e-5, link_gbps=0.002, latency_us=1.0)
    notes = chunk_collectives(gm, "auto", slow_link)
    gm.recompile()
    note = next(n for n in notes if len(n.starts) == 2)
    counts = [k for k, _ in note.estimates]
    assert counts == [1, 2, 4, 8]
    assert note.applied and note.chunks == min(note.estimates, key=lambda e: (e[1], -e[0]))[0] > 1
    _assert_equal(before, gm, "random")
    # a fast link and slow issue: one piece is estimated fastest, and nothing changes
    gm = _trace(_moe)
    code = gm.code
    fast_link = costmodel.profile(device="cpu", link="ethernet", tflops=1e3, link_gbps=1e4, latency_us=1e4)
    fast_link = dataclasses.replace(fast_link, link=dataclasses.replace(fast_link.link, issue_us=1e4))
    notes = chunk_collectives(gm, "auto", fast_link)
    note = next(n for n in notes if len(n.starts) == 2)
    assert not note.applied and note.chunks == 1 and "one piece" in note.reason and gm.code == code


# -- 2 gloo ranks: examples/moe_dropless.py trains the same chunked ---------------------------------

CHUNKS = (1, 2, 4, "auto")
RTOL = ATOL = 1e-5


def _ranks(rank, world_size, port):
    import torch._dynamo
    init_gloo(rank, world_size, port)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import moe_dropless
    from test_chunk_training import _step, chunking_backend, count_collectives

    def build():
        return moe_dropless.build(dim=32, hidden=64, tokens=32, depth=2)

    model, inputs = build()
    out = {"eager": _step(model, inputs)}
    for chunks in CHUNKS:
        torch._dynamo.reset()
        notes = []
        model, inputs = build()
        got = _step(model, inputs, torch.compile(model, backend=chunking_backend(chunks, notes)))
        out[chunks] = (got, [(n.pattern, n.applied, n.chunks, n.reason) for n in notes])
    for chunks in (1, 2):   # the backend's chunks option reaches the dropless layers
        torch._dynamo.reset()
        model, inputs = build()
        compiled = torch.compile(model, backend="overlapc",
                                 options={"chunks": chunks, "inner": "aot_eager", "on_error": "raise"})
        _step(model, inputs, compiled)
        model.zero_grad(set_to_none=True)
        out[("overlapc", chunks)] = count_collectives(lambda: _step(model, inputs, compiled))
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_ranks, world_size=2, timeout=480.0)


def _close(a, b, what):
    torch.testing.assert_close(b[0], a[0], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} loss: {m}")
    assert len(a[1]) == len(b[1])
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        torch.testing.assert_close(y, x, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} grad {i}: {m}")


@pytest.mark.parametrize("chunks", CHUNKS[1:])
def test_dropless_moe_trains_the_same_chunked(trained, chunks):
    for rank, out in enumerate(trained):
        got, notes = out[chunks]
        what = f"rank {rank} chunks {chunks}"
        _close(out["eager"], got, what + " vs eager")
        _close(out[1][0], got, what + " vs chunks 1")
        pipelines = [n for n in notes if n[0] == "all_to_all_expert" and "exchanges split sizes" not in n[3]]
        # two layers, each a forward and a backward pipeline
        assert len(pipelines) == 4 and all(applied for _, applied, _, _ in pipelines), (what, notes)
        assert all(k > 1 for _, _, k, _ in pipelines), (what, notes)


def test_overlapc_backend_chunks_dropless_moe(trained):
    for rank, out in enumerate(trained):
        (one, one_step), (two, two_step) = out[("overlapc", 1)], out[("overlapc", 2)]
        _close(out["eager"], two_step, f"rank {rank} overlapc chunks 2")
        _close(out["eager"], one_step, f"rank {rank} overlapc chunks 1")
        # per layer and direction, 2 pipelined all-to-alls become 4
        assert two == one + 2 * 4, (one, two)

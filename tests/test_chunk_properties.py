"""Random TP/SP pipelines for overlapc.passes.chunk (hypothesis): a gathered
activation in one of the layouts users write (plain rows, sequence-first
[seq, batch, dim], batch-first [batch, seq, dim] through DTensor's split + cat),
a random chain of ops (matmuls, pointwise, norms, softmax, attention, rotary as
complex products, unsqueeze/expand/select/stack, permutes, ops that mix rows),
intermediates read outside the pipeline, barriers, then a reduce-scatter (or
none). Checked on every example, independently of the pass's own notes:
the graph lints, values equal the unchunked graph's with rank-sensitive
stand-ins, a pipeline applied has k pieces per collective, the same input gives
the same graph (determinism), and the scheduler takes the chunked graph
(overlapc.schedule with on_error="raise", then overlapc.verify).

OVERLAPC_EXAMPLES sets the number of examples (default 60)."""
import copy
import os

import torch
import torch.nn.functional as TF
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import overlapc
from graphs import F, WORLD, random_inputs
from overlapc.passes.chunk import chunk_collectives
from test_chunk import RankCollectives

EXAMPLES = int(os.environ.get("OVERLAPC_EXAMPLES", "60"))
B, S, D, H = 4, 16, 8, 2     # batch, sequence (all ranks), features, heads
aten = torch.ops.aten


def _attention(x, layout):
    """Causal self-attention over the sequence of a 3-D activation, heads from the features."""
    if layout == "batch_first":
        b, s, d = x.shape
        q = x.view(b, s, H, d // H).transpose(1, 2)
        return TF.scaled_dot_product_attention(q, q * 0.5, q, is_causal=True).transpose(1, 2).reshape(b, s, d)
    s, b, d = x.shape
    q = x.view(s, b, H, d // H).permute(1, 2, 0, 3)
    return TF.scaled_dot_product_attention(q, q, q * 2, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, d)


def _rotary(x, table):
    pairs = torch.view_as_complex(x.contiguous().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * table).flatten(-2)


# op name -> (fn(x, weights, layout), needs a 3-D activation); every op keeps x's shape
OPS = {
    "matmul": (lambda x, w, layout: x @ w["w"], False),
    "gelu": (lambda x, w, layout: TF.gelu(x), False),
    "scale_shift": (lambda x, w, layout: x * 0.5 + w["bias"], False),
    "norm": (lambda x, w, layout: (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5),
             False),
    "softmax": (lambda x, w, layout: x.softmax(-1), False),
    "rotary": (lambda x, w, layout: _rotary(x, w["table"]), False),
    "repeat_sum": (lambda x, w, layout: x.unsqueeze(-2).expand(*x.shape[:-1], 2, x.shape[-1]).sum(-2), False),
    "stack_select": (lambda x, w, layout: torch.stack([x, x * 2], -1).select(-1, 1), False),
    "squeeze": (lambda x, w, layout: torch.sigmoid(x.unsqueeze(-1)).squeeze(-1), False),
    "transpose_back": (lambda x, w, layout: (x.transpose(-1, -2) * 3).transpose(-1, -2), True),
    "attention": (lambda x, w, layout: _attention(x, layout), True),
    # mix dim 0: a pipeline may go through only when it cuts the batch (sequence-first)
    "row_sum": (lambda x, w, layout: x + x.sum(0, keepdim=True), False),
    "row_flip": (lambda x, w, layout: x.flip(0), False),
    # mix every dim, so every cut: the pass must not pipeline through them
    "global_mean": (lambda x, w, layout: x - x.mean(), False),
    "flip_all": (lambda x, w, layout: x.flatten().flip(0).view(x.shape), False),
}
MIXING = {"global_mean", "flip_all"}


def _gather(shard, layout):
    g = F.wait_tensor(F.all_gather_into_tensor(shard, WORLD, "0"))
    if layout == "batch_first":   # DTensor's Shard(1) -> Replicate: all-gather dim 0, split, cat dim 1
        return torch.cat(torch.split(g, shard.shape[0]), 1)
    return g


def _scatter(y, layout):
    if layout == "batch_first":   # Replicate -> Shard(1): split dim 1, cat dim 0, reduce-scatter
        y = torch.cat(torch.split(y, y.shape[1] // WORLD, 1), 0)
    return F.wait_tensor(F.reduce_scatter_tensor(y, "sum", WORLD, "0"))


def program(layout, ops, sink, output_at, barrier_at):
    """fn(shard, w, bias, table, z): gather -> ops -> [reduce-scatter]; with the
    activation after op ``output_at`` also returned, and an in-place op on ``z`` (a
    barrier) after op ``barrier_at`` (None: neither)."""
    def fn(shard, w, bias, table, z):
        weights = {"w": w, "bias": bias, "table": table}
        x = _gather(shard, layout)
        extra = []
        for i, name in enumerate(ops):
            x = OPS[name][0](x, weights, layout)
            if i == output_at:
                extra.append(x)
            if i == barrier_at:
                aten.add_(z, 1)
        if sink:
            x = _scatter(x @ w, layout)
        return (x, *extra)
    return fn


def shard_shape(layout):
    return {"rows": (S // WORLD * 2, D), "seq_first": (S // WORLD, B, D),
            "batch_first": (B, S // WORLD, D)}[layout]


@st.composite
def pipelines(draw):
    layout = draw(st.sampled_from(["rows", "seq_first", "batch_first"]))
    names = [n for n, (_, three_d) in sorted(OPS.items()) if layout != "rows" or not three_d]
    ops = ["matmul"] + draw(st.lists(st.sampled_from(names), max_size=5))
    sink = draw(st.booleans())
    output_at = draw(st.none() | st.integers(0, len(ops) - 1))
    barrier_at = draw(st.none() | st.integers(0, len(ops) - 1))
    chunks = draw(st.sampled_from([2, 4]))
    return layout, ops, sink, output_at, barrier_at, chunks


def trace_pipeline(layout, ops, sink, output_at, barrier_at):
    torch.manual_seed(0)
    args = (torch.randn(shard_shape(layout)), torch.randn(D, D), torch.randn(D),
            torch.polar(torch.ones(D // 2), torch.arange(D // 2.0)), torch.zeros(2))
    return make_fx(program(layout, ops, sink, output_at, barrier_at))(*args)


def scale(x):
    """Tolerance unit of an fp32 result: a matmul over fewer rows may block its sums
    differently, so an element's rounding follows the tensor's magnitude, not its own."""
    return max(1.0, x.abs().max().item())


def collective_count(gm):
    return sum(1 for n in gm.graph.nodes
               if n.target in (F.all_gather_into_tensor.default, F.reduce_scatter_tensor.default))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines(), st.sampled_from([1, 2, 3, None]))
def test_random_pipelines_keep_values_order_and_schedule(fake_pg, case, limit):
    layout, ops, sink, output_at, barrier_at, chunks = case
    original = trace_pipeline(layout, ops, sink, output_at, barrier_at)
    gm = copy.deepcopy(original)
    notes = chunk_collectives(gm, chunks)
    gm.graph.lint()
    gm.recompile()
    inputs = random_inputs(original)
    expected = RankCollectives(original).run(*inputs)
    got = RankCollectives(gm).run(*inputs)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * scale(a))

    applied = [n for n in notes if n.applied]
    # independently of the notes: every collective of an applied pattern became k pieces
    pieces = sum(len(n.pieces) for n in applied)
    assert pieces == chunks * sum(len(n.starts) for n in applied), notes
    assert collective_count(gm) == collective_count(original) - sum(len(n.starts) for n in applied) + pieces
    for note in notes:
        assert note.applied or note.reason, note   # left alone always says why
    # a pipeline from the gather to the reduce-scatter never crosses an op that mixes rows
    # or a barrier (the one between the two collectives)
    whole = [n for n in applied if len(n.starts) == 2]
    if whole:
        assert not MIXING & set(ops), (ops, notes)
        assert barrier_at is None, (barrier_at, notes)

    again = copy.deepcopy(original)
    chunk_collectives(again, chunks)
    assert [(n.name, str(n.target), repr(n.args)) for n in again.graph.nodes] == \
        [(n.name, str(n.target), repr(n.args)) for n in gm.graph.nodes]

    scheduled = copy.deepcopy(original)
    cfg = overlapc.OverlapConfig(chunks=chunks, max_in_flight=limit, on_error="raise")
    overlapc.schedule(scheduled, cfg)
    overlapc.verify(scheduled, cfg)
    if limit is not None:   # the bound, a chunked collective's pieces counted as one (by their names)
        whole = {f"{start}_chunk{i}": start for n in applied for start in n.starts for i in range(chunks)}
        open_now, kind_of = {}, {}
        for node in scheduled.graph.nodes:
            if node.target in (F.all_gather_into_tensor.default, F.reduce_scatter_tensor.default):
                open_now[node] = whole.get(node.name, node.name)
                kind_of[open_now[node]] = node.target
                for kind in set(kind_of.values()):
                    assert len({w for w in open_now.values() if kind_of[w] is kind}) <= limit, node.name
            elif node.target is F.wait_tensor.default:
                open_now.pop(node.args[0], None)
    for a, b in zip(expected, RankCollectives(scheduled).run(*inputs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * scale(a))


def test_generator_reaches_whole_pipelines(fake_pg):
    """The generator is not vacuous: a plain chain pipelines from gather to scatter in every layout."""
    for layout in ("rows", "seq_first", "batch_first"):
        gm = trace_pipeline(layout, ["matmul", "gelu", "norm", "rotary"], True, None, None)
        notes = chunk_collectives(gm, 2)
        assert [(len(n.starts), n.applied) for n in notes] == [(2, True)], (layout, notes)

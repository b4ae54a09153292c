"""Chunking through the shape ops of models as torchtitan writes them: rotary
embeddings as complex products (view_as_complex / view_as_real), grouped-query
attention (unsqueeze + expand + reshape, and squeeze + sum in the backward),
select. Each op keeps piece i to piece i along another dim than the rows, or is
left alone with a reason when it touches them. Values are checked with the
rank-sensitive stand-ins of test_chunk; training on 2 gloo ranks equals eager."""
import copy
import os
import sys

import pytest
import torch

from graphs import F, WORLD, random_inputs, trace
from multiproc import init_gloo, run_ranks
from overlapc.passes.chunk import chunk_collectives
from test_chunk import RankCollectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
aten = torch.ops.aten


def same_values(before, after):
    inputs = random_inputs(before)
    for a, b in zip(RankCollectives(before).run(*inputs), RankCollectives(after).run(*inputs)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def chunked(gm, chunks=2):
    out = copy.deepcopy(gm)
    notes = chunk_collectives(out, chunks)
    out.graph.lint()
    return out, notes


def _block(op):
    """all-gather rows -> mm -> ``op`` -> mm -> reduce-scatter: ``op`` sits inside a pipeline."""
    def fn(shard, w1, w2):
        x = F.wait_tensor(F.all_gather_into_tensor(shard, WORLD, "0"))   # [64, 8]
        h = op(x @ w1)                                                     # [64, 16] -> [64, 16]
        return F.wait_tensor(F.reduce_scatter_tensor(h @ w2, "sum", WORLD, "0"))
    return trace(fn, (8, 8), (8, 16), (16, 8))


ROWWISE_OPS = {
    "unsqueeze_expand_reshape": lambda h: h.unsqueeze(1).expand(64, 2, 16).reshape(64, 32)[:, ::2] * 2,
    "unsqueeze_squeeze": lambda h: torch.sigmoid(h.unsqueeze(-1)).squeeze(-1),
    "view_as_complex_real": lambda h: torch.view_as_real(
        torch.view_as_complex(h.reshape(64, 8, 2)) * torch.polar(torch.ones(8), torch.arange(8.0))).flatten(1),
    "select_stack": lambda h: torch.stack([h.view(64, 2, 8).select(1, 0), h.view(64, 2, 8).select(1, 1)], 1).flatten(1),
}


@pytest.mark.parametrize("name", sorted(ROWWISE_OPS))
def test_shape_op_inside_a_pipeline_keeps_the_pieces(fake_pg, name):
    gm = _block(ROWWISE_OPS[name])
    out, notes = chunked(gm)
    assert [(n.pattern, len(n.starts), n.applied) for n in notes] == [("all_gather_matmul", 2, True)], notes
    assert sum(1 for n in out.graph.nodes if n.target == F.all_gather_into_tensor.default) == 2
    same_values(gm, out)


ROW_MIXING_OPS = {
    "select of a row": (lambda h: h.unsqueeze(0).expand(2, 64, 16).select(1, 3).sum(0).expand(64, 16),
                        "row"),
    "slice stepping over the rows": (lambda h: h.unsqueeze(1).expand(64, 2, 16).reshape(128, 16)[::2],
                                     "slice"),
}


@pytest.mark.parametrize("name", sorted(ROW_MIXING_OPS))
def test_shape_op_that_mixes_rows_is_left_alone_with_a_reason(fake_pg, name):
    op, word = ROW_MIXING_OPS[name]
    gm = _block(op)
    out, notes = chunked(gm)
    # no pipeline from the all-gather through to the reduce-scatter; each side alone at most,
    # and the all-gather's note says where and why its pipeline stops
    assert notes and all(len(n.starts) == 1 for n in notes), notes
    gather = next(n for n in notes if n.pattern == "all_gather_matmul")
    assert gather.applied and "not pipelined" in gather.reason and word in gather.reason, gather
    same_values(gm, out)


def _llama(**kwargs):
    from overlapc.backend import capture
    if os.path.join(ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    import tp_llama
    model, inputs = tp_llama.build(**kwargs)
    return {r.name: r.gm for r in capture(model, inputs, {"enabled": False})}


@pytest.fixture(scope="module")
def llama_graphs(fake_pg):
    return _llama(dim=128, heads=16, kv_heads=8, hidden=128, depth=2, seq=16, batch=4)


@pytest.mark.parametrize("chunks", [2, 4])
def test_torchtitan_llama_is_one_pipeline_per_block_forward_and_backward(llama_graphs, chunks):
    """Rotary (complex), GQA and SwiGLU between the all-gather and the reduce-scatter:
    attention and the feed-forward each are one pipeline along the batch, chained
    through the residual add and the norm, in the forward and the backward."""
    for name in ("fw_0", "bw_0"):
        gm, notes = chunked(llama_graphs[name], chunks)
        assert [(n.pattern, len(n.starts), n.applied) for n in notes] == [("all_gather_matmul", 2, True)] * 4, notes
        assert [n.fed_by for n in notes[1:]] == [n.starts[1] for n in notes[:-1]], notes
        attention = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
        assert len(attention) == 2 * chunks
        same_values(llama_graphs[name], gm)


# ------------------------------------------------------------------ 2 gloo ranks


def _train(rank, world_size, port):
    import torch._dynamo
    init_gloo(rank, world_size, port)
    from overlapc.torch_compat import route_gloo_all_gathers
    import json
    import tempfile
    from overlapc.estimate import costmodel
    from test_chunk_training import _step, count_collectives
    route_gloo_all_gathers()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import tp_llama

    def build():
        return tp_llama.build(dim=32, heads=4, kv_heads=2, hidden=64, depth=1, seq=16, batch=4)
    # compute and link of the same order for this model, so that "auto" pipelines
    profile = os.path.join(tempfile.mkdtemp(), "profile.json")
    with open(profile, "w") as f:
        json.dump({"schema": costmodel.PROFILE_SCHEMA, "device": {"name": "cpu", "tflops": 1e-5, "mem_gbps": 20.0},
                   "link": {"name": "ethernet", "gbps": 0.002, "latency_us": 1.0}}, f)
    model, inputs = build()
    out = {"eager": _step(model, inputs)}
    for chunks in (1, 2, 4, "auto"):
        torch._dynamo.reset()
        model, inputs = build()
        compiled = torch.compile(model, backend="overlapc", options={
            "chunks": chunks, "inner": "aot_eager", "on_error": "raise",
            "profile": profile})
        out[chunks] = _step(model, inputs, compiled)
        model.zero_grad(set_to_none=True)
        out[chunks, "collectives"] = count_collectives(lambda: _step(model, inputs, compiled))[0]
    torch._dynamo.reset()
    return out


def test_torchtitan_llama_trains_equal_to_eager_with_chunks():
    from test_chunk_training import _close
    for rank, out in enumerate(run_ranks(_train, world_size=2, timeout=300.0)):
        for chunks in (1, 2, 4, "auto"):
            _close(out["eager"], out[chunks], f"tp_llama rank {rank} chunks {chunks} vs eager")
            _close(out[1], out[chunks], f"tp_llama rank {rank} chunks {chunks} vs chunks 1")
        # 2 all-gathers and 2 reduce-scatters per block and pass, each cut into pieces
        assert out[1, "collectives"] == 8, out
        assert out[2, "collectives"] == 16 and out[4, "collectives"] == 32, out
        assert out["auto", "collectives"] > 8, out


def test_per_projection_gathers_merge_and_attention_is_one_pipeline(fake_pg):
    """ColwiseParallel(input_layouts=Shard(1)) on q, k and v each (examples/fsdp_tp.py)
    gathers the same activation three times: overlapc.schedule merges them first, so
    that attention is one pipeline from the gather to the reduce-scatter."""
    import overlapc
    from overlapc.backend import capture
    if os.path.join(ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    import fsdp_tp
    model, inputs = fsdp_tp.build(tp=2, depth=2)
    fw = {r.name: r.gm for r in capture(model, inputs, {"enabled": False})}["fw_0"]
    gm = copy.deepcopy(fw)
    overlapc.schedule(gm, overlapc.OverlapConfig(chunks=2, on_error="raise"))
    overlapc.verify(gm)
    assert [len(run) for run in gm.meta["overlapc_duplicates"]] == [3, 3]   # q, k, v per block
    tp = [n for n in gm.meta["overlapc_chunks"] if n.applied and len(n.starts) == 2]
    assert len(tp) == 4, gm.meta["overlapc_chunks"]   # attention and MLP of both blocks, whole
    same_values(fw, gm)

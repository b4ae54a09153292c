"""overlapc.passes.chunk: which patterns are pipelined, which are left alone and
why, same values (rank-layout sensitive stand-ins for the collectives), lint,
pipeline order, determinism. Fake process group, world 8, group "0"."""
import copy
import os
import sys

import pytest
import torch
import torch.fx as fx

from overlapc.passes.chunk import ChunkNote, chunk_collectives
from graphs import F, WORLD, trace, random_inputs

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
EQUAL = [8] * WORLD   # all-to-all split sizes of the 64-row test tensors
RANK = 3   # the rank the stand-ins pretend to be (not 0: a wrong block order shows)


class RankCollectives(fx.Interpreter):
    """Runs a graph with collectives replaced by local stand-ins that depend on
    which rank's block lands where: rank r's all-gather input is x*(r+1)+r; a
    reduce-scatter sums block r times (r+1) over r (rank RANK's blocks rotated in);
    an all-to-all's output block r is input block (r+RANK)%W times (r+1) plus r.
    Each commutes with the row layout chunk.py uses, so chunked == unchunked."""

    def call_function(self, target, args, kwargs):
        if target == F.all_gather_into_tensor.default:
            x, world = args[0], args[1]
            return torch.cat([x * (r + 1) + r for r in range(world)])
        if target == F.reduce_scatter_tensor.default:
            x, world = args[0], args[2]
            blocks = x.reshape(world, x.shape[0] // world, *x.shape[1:])
            return sum(blocks[(r + RANK) % world] * (r + 1) for r in range(world))
        if target == F.all_to_all_single.default:
            x = args[0]
            world = len(args[2])
            blocks = x.reshape(world, x.shape[0] // world, *x.shape[1:])
            return torch.cat([blocks[(r + RANK) % world] * (r + 1) + r for r in range(world)])
        if target == F.wait_tensor.default:
            return args[0].clone()
        return super().call_function(target, args, kwargs)


def assert_same_values(before, after, seed=0):
    inputs = random_inputs(before, seed)
    expected = RankCollectives(before).run(*inputs)
    got = RankCollectives(after).run(*inputs)
    for a, b in zip(expected, got):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def names(gm):
    return [n.name for n in gm.graph.nodes]


def count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.target == op)


# ------------------------------------------------------------------ captured models


def _capture(module, **kwargs):
    from overlapc.backend import capture
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    build = __import__(module).build
    model, inputs = build(**kwargs)
    return {r.name: r.gm for r in capture(model, inputs, {"enabled": False})}


@pytest.fixture(scope="module")
def tp_graphs(fake_pg):
    return _capture("tp_sp", heads=8, depth=1, batch=4)


@pytest.fixture(scope="module")
def tp_batch_graphs(fake_pg):
    return _capture("tp_sp", heads=8, depth=1, batch=4, batch_first=True)


@pytest.fixture(scope="module")
def moe_graphs(fake_pg):
    return _capture("moe", depth=1)


@pytest.mark.parametrize("chunks", [2, 4])
def test_tp_sp_every_pattern_is_pipelined_with_the_same_values(tp_graphs, chunks):
    fw, bw = copy.deepcopy(tp_graphs["fw_0"]), copy.deepcopy(tp_graphs["bw_0"])
    for original, gm in ((tp_graphs["fw_0"], fw), (tp_graphs["bw_0"], bw)):
        notes = chunk_collectives(gm, chunks)
        gm.graph.lint()
        assert notes and all(n.applied and n.reason == "" and n.chunks == chunks and n.group == "0"
                             for n in notes), notes
        assert gm.meta["overlapc_chunks"] == notes
        assert_same_values(original, gm)
    fw_notes, bw_notes = fw.meta["overlapc_chunks"], bw.meta["overlapc_chunks"]
    # sequence-first: attention mixes the sequence, so its pipeline cuts the batch (dim 1):
    # all-gather -> q/k/v -> attention -> o -> reduce-scatter is one pipeline, as is the MLP
    assert [(n.pattern, len(n.starts)) for n in fw_notes] == [("all_gather_matmul", 2)] * 2, fw_notes
    assert [(n.pattern, len(n.starts)) for n in bw_notes] == [("all_gather_matmul", 2)] * 2, bw_notes
    assert count(fw, F.all_gather_into_tensor.default) == count(fw, F.reduce_scatter_tensor.default) == 2 * chunks
    assert sum(1 for n in fw.graph.nodes if "scaled_dot_product" in str(n.target)) == chunks
    # the attention's reduce-scatter feeds the MLP's all-gather piece by piece through the
    # residual add and the norm (both cut along the batch); in the backward the MLP's
    # feeds the attention's (the MLP cuts the batch too, as the next gather needs)
    assert [n.fed_by for n in fw_notes] == ["", fw_notes[0].starts[1]]
    assert [n.fed_by for n in bw_notes] == ["", bw_notes[0].starts[1]]
    for gm, feeder, fed in ((fw, fw_notes[0], fw_notes[1]), (bw, bw_notes[0], bw_notes[1])):
        pos = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        nodes = {n.name: n for n in gm.graph.nodes}
        gathers = [nodes[p] for p in fed.pieces if "all_gather" in p]
        assert all(g.args[0].target is not torch.ops.aten.slice.Tensor for g in gathers)
        last_feeder_wait = max(pos[w.name] for p in feeder.pieces if "reduce_scatter" in p
                               for w in nodes[p].users)
        # waves: with more than 2 pieces, the fed pipeline's first piece computes
        # before the feeder's last piece arrives
        first_compute = min(pos[u.name] for u in next(iter(gathers[0].users)).users)
        assert pos[gathers[0].name] < first_compute
        assert chunks == 2 or first_compute < last_feeder_wait


@pytest.mark.parametrize("chunks", [2, 4])
def test_batch_first_sp_pipelines_the_whole_block_along_the_batch(tp_batch_graphs, chunks):
    """DTensor gathers dim 1 as all-gather(dim 0) + split + cat(dim 1), and scatters it
    after split(dim 1) + cat(dim 0): read through, the pieces are batch rows and flow
    through attention, so each block (attention; MLP) is one pipeline, chained."""
    for name in ("fw_0", "bw_0"):
        gm = copy.deepcopy(tp_batch_graphs[name])
        notes = chunk_collectives(gm, chunks)
        gm.graph.lint()
        assert [(n.pattern, len(n.starts), n.applied) for n in notes] == [("all_gather_matmul", 2, True)] * 2, notes
        assert notes[1].fed_by == notes[0].starts[1]
        assert count(gm, F.all_gather_into_tensor.default) == count(gm, F.reduce_scatter_tensor.default) == 2 * chunks
        attention = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
        assert len(attention) == chunks   # one per batch piece
        # every piece's all-gather input is a contiguous batch slice, no copy
        for n in gm.graph.nodes:
            if n.target == F.all_gather_into_tensor.default and n.args[0].target is torch.ops.aten.slice.Tensor:
                assert n.args[0].args[1] == 0
        assert_same_values(tp_batch_graphs[name], gm)


def test_split_of_the_rows_across_rank_blocks_is_left_alone(fake_pg):
    def fn(x, w):
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        return torch.mm(torch.ops.aten.split.Tensor(g, 5)[0], w)   # 5 of 32 rows: not whole rank blocks
    note, = _not_applied(trace(fn, (4, 16), (16, 4)))
    assert "no matmul reads" in note.reason and "split" in note.reason


@pytest.mark.parametrize("chunks", [2, 4])
def test_moe_dispatch_expert_combine_is_pipelined_with_the_same_values(moe_graphs, chunks):
    for name in ("fw_0", "bw_0"):
        gm = copy.deepcopy(moe_graphs[name])
        notes = chunk_collectives(gm, chunks)
        gm.graph.lint()
        assert [n.pattern for n in notes] == ["all_to_all_expert"], notes
        assert notes[0].applied and len(notes[0].starts) == 2 and len(notes[0].pieces) == 2 * chunks
        assert count(gm, F.all_to_all_single.default) == 2 * chunks
        assert_same_values(moe_graphs[name], gm)


def test_pipeline_order_issues_the_next_piece_before_this_piece_computes(moe_graphs):
    gm = copy.deepcopy(moe_graphs["fw_0"])
    note, = chunk_collectives(gm, 4)
    pos = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    nodes = {n.name: n for n in gm.graph.nodes}
    dispatch = [f"{note.starts[0]}_chunk{i}" for i in range(4)]
    combine = [f"{note.starts[1]}_chunk{i}" for i in range(4)]
    assert sorted(note.pieces) == sorted(dispatch + combine)
    for i in range(4):
        wait = next(iter(nodes[dispatch[i]].users))
        first_compute = min(pos[u.name] for u in wait.users)
        if i + 1 < 4:
            assert pos[dispatch[i + 1]] < first_compute, (dispatch[i + 1], wait.name)
        assert first_compute < pos[combine[i]]          # piece i's compute, then its combine
        if i + 1 < 4:                                    # combine i is in flight while piece i+1 computes
            nxt = next(iter(nodes[dispatch[i + 1]].users))
            combine_wait = next(iter(nodes[combine[i]].users))
            assert pos[combine[i]] < min(pos[u.name] for u in nxt.users) < pos[combine_wait.name]


def test_chunking_is_deterministic(fake_pg):
    def fn(x, w1, w2):
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        y = torch.mm(torch.nn.functional.gelu(torch.mm(g, w1)), w2)
        return F.wait_tensor(F.reduce_scatter_tensor(y, "sum", WORLD, "0")), g

    codes = []
    for _ in range(2):
        gm = trace(fn, (8, 16), (16, 32), (32, 16))
        chunk_collectives(gm, 4)
        gm.recompile()
        codes.append(gm.code)
    assert codes[0] == codes[1]


def test_chunks_one_changes_nothing(fake_pg):
    gm = trace(lambda x, w: torch.mm(F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0")), w), (8, 16), (16, 4))
    before = names(gm)
    assert chunk_collectives(gm, 1) == []
    assert names(gm) == before and gm.meta["overlapc_chunks"] == []
    with pytest.raises(ValueError, match="chunks"):
        chunk_collectives(gm, 0)


# ------------------------------------------------------------------ left alone, and why


def _ag_mm(x, w):
    return torch.mm(F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0")), w)


def _not_applied(gm, chunks=2):
    before = names(gm)
    notes = chunk_collectives(gm, chunks)
    assert names(gm) == before, "a pattern that does not qualify must leave the graph alone"
    assert notes and not any(n.applied for n in notes)
    assert all(isinstance(n, ChunkNote) and n.reason and n.pieces == () for n in notes)
    return notes


def test_all_gather_matmul_values_and_shard_split(fake_pg):
    gm = trace(_ag_mm, (8, 16), (16, 4))
    original = copy.deepcopy(gm)
    note, = chunk_collectives(gm, 4)
    assert note == ChunkNote("all_gather_matmul", ("all_gather_into_tensor",), "0", 4, True, "",
                             tuple(f"all_gather_into_tensor_chunk{i}" for i in range(4)))
    assert_same_values(original, gm)


def test_full_slice_after_the_gather_keeps_the_rows(fake_pg):
    """DTensor slices the gathered rows to their full length (uneven-shard unpadding)."""
    def fn(x, w):
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        return torch.mm(torch.ops.aten.slice.Tensor(g, 0, 0, 64)[:, 2:], w)
    gm = trace(fn, (8, 16), (14, 4))
    original = copy.deepcopy(gm)
    note, = chunk_collectives(gm, 2)
    assert note.applied, note
    assert_same_values(original, gm)

    def partial(x, w):   # a slice that drops rows is not row-wise
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        return torch.mm(torch.ops.aten.slice.Tensor(g, 0, 0, 60), w)
    note, = _not_applied(trace(partial, (8, 16), (16, 4)))
    assert "no matmul reads" in note.reason and "slice" in note.reason


def test_matmul_reduce_scatter_values(fake_pg):
    def fn(a, w):
        return F.wait_tensor(F.reduce_scatter_tensor(torch.mm(a, w), "sum", WORLD, "0"))
    gm = trace(fn, (64, 16), (16, 4))
    original = copy.deepcopy(gm)
    note, = chunk_collectives(gm, 2)
    assert note.pattern == "matmul_reduce_scatter" and note.applied
    assert_same_values(original, gm)


def test_dim_that_does_not_divide_is_left_alone(fake_pg):
    note, = _not_applied(trace(_ag_mm, (3, 16), (16, 4)))
    assert "does not divide" in note.reason and "chunks 2" in note.reason


def test_unknown_shapes_are_left_alone(fake_pg):
    gm = trace(_ag_mm, (8, 16), (16, 4))
    meta = next(iter(gm.graph.find_nodes(op="placeholder"))).meta
    meta.pop("val"), meta.pop("tensor_meta", None)
    note, = _not_applied(gm)
    assert "unknown shape" in note.reason and "x_1" in note.reason


def test_barrier_between_is_left_alone(fake_pg):
    def fn(x, w, z):
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        torch.ops.aten.add_(z, 1)
        return torch.mm(g, w)
    note, = _not_applied(trace(fn, (8, 16), (16, 4), (2,)))
    assert "barrier" in note.reason and "add_" in note.reason


def test_intermediate_feeding_back_is_left_alone(fake_pg):
    def fn(x, w1, w2):
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        h = torch.mm(g, w1)
        h = h + h.sum(0)                      # a reduction over the rows feeds the pipeline back
        return F.wait_tensor(F.reduce_scatter_tensor(torch.mm(h, w2), "sum", WORLD, "0"))
    gm = trace(fn, (8, 16), (16, 8), (8, 16))
    notes = chunk_collectives(gm, 2)
    # no pipeline through the reduction: the all-gather -> matmul part alone, and the
    # matmul -> reduce-scatter part alone, are still chunked
    assert [(n.pattern, n.applied) for n in notes] == [("all_gather_matmul", True), ("matmul_reduce_scatter", True)]
    # the all-gather's note says why its pipeline stops before the reduce-scatter
    assert "reduce_scatter_tensor" in notes[0].reason and "sum" in notes[0].reason, notes[0]
    assert notes[1].reason == ""


def test_reduce_scatter_of_non_matmul_and_gather_without_matmul(fake_pg):
    def fn(x):
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        return F.wait_tensor(F.reduce_scatter_tensor(torch.relu(x.repeat(8, 1)), "sum", WORLD, "0")), torch.relu(g)
    ag, rs = _not_applied(trace(fn, (8, 16)))
    assert ag.pattern == "all_gather_matmul" and "no matmul reads" in ag.reason and "relu" in ag.reason
    assert rs.pattern == "matmul_reduce_scatter" and "not a matmul" in rs.reason and "relu" in rs.reason


def test_all_to_all_unequal_splits_and_non_rowwise_expert(fake_pg):
    def unequal(x, w):
        splits = [4] * 7 + [36]
        y = F.wait_tensor(F.all_to_all_single(x, splits, splits, "0"))
        return F.wait_tensor(F.all_to_all_single(torch.mm(y, w), splits, splits, "0"))
    note = _not_applied(trace(unequal, (64, 16), (16, 16)))[0]   # each all-to-all gets a note
    assert note.pattern == "all_to_all_expert" and "unequal split sizes" in note.reason

    def mixing(x, w):
        y = F.wait_tensor(F.all_to_all_single(x, EQUAL, EQUAL, "0"))
        y = torch.mm(w, y)                    # mixes tokens: not row-wise
        return F.wait_tensor(F.all_to_all_single(y, EQUAL, EQUAL, "0"))
    notes = _not_applied(trace(mixing, (64, 16), (64, 64)))
    assert "not pipelined" in notes[0].reason and "mm" in notes[0].reason


def test_all_to_all_expert_with_saved_full_row_operand(fake_pg):
    """Operands from outside the pipeline with full rows are cut piece by piece."""
    def fn(x, w, gate):
        y = F.wait_tensor(F.all_to_all_single(x, EQUAL, EQUAL, "0"))
        h = torch.mm(y, w) * torch.sigmoid(gate)
        return F.wait_tensor(F.all_to_all_single(h, EQUAL, EQUAL, "0")), h
    gm = trace(fn, (64, 16), (16, 16), (64, 16))
    original = copy.deepcopy(gm)
    note, = chunk_collectives(gm, 4)
    assert note.applied, note
    gm.graph.lint()
    assert_same_values(original, gm)



@pytest.mark.parametrize("chunks", [2, 4])
def test_work_off_the_next_pipelines_path_runs_while_its_last_pieces_are_in_flight(fake_pg, chunks):
    """Weight gradients of a pipeline's reassembled result run after the next
    pipeline's fed starts (its combine pieces), spread from the back: the last after
    the last combine, the one before after the combine before, any more after the
    first; the next pipeline's pieces are computed and issued first (the link would
    idle behind them otherwise). Compute on the way to the next pipeline keeps its
    place."""
    def fn(x, w1, w2):
        c = F.wait_tensor(F.all_to_all_single(
            torch.mm(F.wait_tensor(F.all_to_all_single(x, EQUAL, EQUAL, "0")), w1), EQUAL, EQUAL, "0"))
        grad_u = torch.mm(c.t(), x * 3)        # read the whole result, feed nothing later
        grad_w = torch.mm(c.t(), x)
        grad_v = torch.mm(c.t(), x + 1)
        z = F.wait_tensor(F.all_to_all_single(c * 2, EQUAL, EQUAL, "0"))
        return F.wait_tensor(F.all_to_all_single(torch.mm(z, w2), EQUAL, EQUAL, "0")), grad_u, grad_w, grad_v
    gm = trace(fn, (64, 16), (16, 8), (8, 16))
    original = copy.deepcopy(gm)
    first, second = chunk_collectives(gm, chunks)
    assert first.applied and second.applied and second.fed_by == ""
    gm.graph.lint()
    assert_same_values(original, gm)
    order = [n.name for n in gm.graph.nodes]
    grads = [order.index(n.name) for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default
             and tuple(n.meta["val"].shape) == (8, 16)]
    doubled = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor
                   and n.args[1] == 2)
    dispatch, combine = ([order.index(f"{start}_chunk{i}") for i in range(chunks)] for start in second.starts)
    assert order.index(doubled.name) < dispatch[0]
    assert len(grads) == 3
    marks = [combine[max(chunks - 3 + j, 0)] for j in range(3)]   # the combine each one follows
    for grad, mark in zip(grads, marks):
        assert mark < grad and all(grad < c for c in combine if c > mark), (chunks, grads, combine)


@pytest.mark.parametrize("name", ["fw_0", "bw_0"])
def test_a_chunked_collectives_pieces_count_once_against_max_in_flight(moe_graphs, name):
    """Under max_in_flight=2 the dispatch's 4 pieces and the combine's 4 are two
    collectives in flight, not eight: every dispatch piece goes out before the
    first is waited, no piece is waited early for room, and at no point are
    pieces of more than 2 chunked collectives open (counted here from the
    pieces' names and waits). The "auto" byte budget: the count is what is checked
    (under "serial-peak" memory may wait a piece early)."""
    import overlapc
    gm = copy.deepcopy(moe_graphs[name])
    overlapc.schedule(gm, overlapc.OverlapConfig(chunks=4, max_in_flight=2, bucket=None, max_in_flight_bytes="auto",
                                                 on_error="raise"))
    note, = gm.meta["overlapc_chunks"]
    assert note.applied, note
    family = {f"{start}_chunk{i}": start for start in note.starts for i in range(4)}
    order = list(gm.graph.nodes)
    waits = [n for n in order if n.target is F.wait_tensor.default and n.args[0].name in family]
    assert len(waits) == 8 and not [w.name for w in waits if w.meta["overlapc_reason"] == "early for room"]
    pos = {n: i for i, n in enumerate(order)}
    dispatch = [n for n in order if family.get(n.name) == note.starts[0]]
    first_wait = min(pos[w] for w in waits if w.args[0] in dispatch)
    assert all(pos[d] < first_wait for d in dispatch), [(d.name, pos[d], first_wait) for d in dispatch]
    open_pieces, most = {}, 0
    for node in order:
        if node.name in family:
            open_pieces[node] = family[node.name]
        elif node in waits:
            del open_pieces[node.args[0]]
        most = max(most, len(set(open_pieces.values())))
    assert most == 2


def _rs_norm_ag(x, w1, w2, residual):
    """matmul -> reduce-scatter -> residual add and a norm -> all-gather -> matmul."""
    y = F.wait_tensor(F.reduce_scatter_tensor(torch.mm(x, w1), "sum", WORLD, "0"))
    h = residual + y
    h = (h - h.mean(1, keepdim=True)) * torch.rsqrt(h.var(1, keepdim=True) + 1e-5)
    g = F.wait_tensor(F.all_gather_into_tensor(h, WORLD, "0"))
    return torch.mm(g, w2), h


def test_reduce_scatter_feeds_the_next_gather_piece_by_piece(fake_pg):
    gm = trace(_rs_norm_ag, (64, 16), (16, 8), (8, 4), (8, 8))
    original = copy.deepcopy(gm)
    rs, ag = chunk_collectives(gm, 4)
    gm.graph.lint()
    assert rs.applied and ag.applied and ag.fed_by == rs.starts[0], (rs, ag)
    assert_same_values(original, gm)   # h (a graph output) is reassembled from its pieces
    assert not any(n.target is torch.ops.aten.slice.Tensor for n in gm.graph.nodes
                   if any(u.name in ag.pieces for u in n.users))


def test_a_whole_layer_norm_chains_and_its_statistics_are_reassembled(fake_pg):
    """native_layer_norm as AOTAutograd leaves it without Inductor's decompositions
    (backend="overlapc" with inner="aot_eager"): row-wise over dims it does not
    normalise; its mean and rstd (saved for backward) come back whole."""
    def fn(x, w1, w2, residual, weight, bias):
        y = F.wait_tensor(F.reduce_scatter_tensor(torch.mm(x, w1), "sum", WORLD, "0"))
        h, mean, rstd = torch.ops.aten.native_layer_norm(residual + y, [8], weight, bias, 1e-5)
        g = F.wait_tensor(F.all_gather_into_tensor(h, WORLD, "0"))
        return torch.mm(g, w2), mean, rstd
    gm = trace(fn, (64, 16), (16, 8), (8, 4), (8, 8), (8,), (8,))
    original = copy.deepcopy(gm)
    rs, ag = chunk_collectives(gm, 4)
    gm.graph.lint()
    assert rs.applied and ag.applied and ag.fed_by == rs.starts[0], (rs, ag)
    assert sum(n.target is torch.ops.aten.native_layer_norm.default for n in gm.graph.nodes) == 4
    assert_same_values(original, gm)

    def over_rows(x, w1, w2, weight, bias):   # normalising over every dim mixes the rows
        y = F.wait_tensor(F.reduce_scatter_tensor(torch.mm(x, w1), "sum", WORLD, "0"))
        h = torch.ops.aten.native_layer_norm(y, [8, 8], weight, bias, 1e-5)[0]
        return torch.mm(F.wait_tensor(F.all_gather_into_tensor(h, WORLD, "0")), w2)
    gm = trace(over_rows, (64, 16), (16, 8), (8, 4), (8, 8), (8, 8))
    rs, ag = chunk_collectives(gm, 4)
    assert ag.fed_by == "", (rs, ag)


def test_compute_that_mixes_rows_between_is_not_chained(fake_pg):
    def fn(x, w1, w2):
        y = F.wait_tensor(F.reduce_scatter_tensor(torch.mm(x, w1), "sum", WORLD, "0"))
        g = F.wait_tensor(F.all_gather_into_tensor(y.cumsum(0), WORLD, "0"))
        return torch.mm(g, w2)
    gm = trace(fn, (64, 16), (16, 8), (8, 4))
    original = copy.deepcopy(gm)
    rs, ag = chunk_collectives(gm, 2)
    assert rs.applied and ag.applied and ag.fed_by == ""   # both pipelined, each on its own
    assert_same_values(original, gm)


# ------------------------------------------------------------------ chunks="auto"


def test_auto_picks_the_count_the_estimator_puts_fastest(tp_batch_graphs):
    """Pieces pay a latency, an issue cost and a fixed cost per op each: a slow link
    with compute of the same order pipelines, a fast link whose collectives cost 5 ms
    of latency and 5 ms to issue does not. Attention and MLP feed one another (a
    chain): they take one count, the least summed estimate."""
    import dataclasses

    from overlapc.estimate import costmodel
    from overlapc.passes.chunk.estimate import CANDIDATES
    balanced = costmodel.profile("cpu", "ethernet", tflops=1e-5, link_gbps=0.002, latency_us=1.0)
    latency_bound = costmodel.profile("cpu", "ethernet", link_gbps=1000.0, latency_us=5000.0)
    latency_bound = dataclasses.replace(latency_bound, link=dataclasses.replace(latency_bound.link, issue_us=5000.0))
    for prof, pipelined in ((balanced, True), (latency_bound, False)):
        gm = copy.deepcopy(tp_batch_graphs["fw_0"])
        notes = chunk_collectives(gm, "auto", prof)
        gm.graph.lint()
        assert [n.pattern for n in notes] == ["all_gather_matmul"] * 2, notes
        attention, mlp = notes
        # one chain: the same summed estimates on both notes, one count; attention cuts
        # batch 4 (at most 4 pieces), the MLP also the sequence rows (8)
        assert attention.estimates == mlp.estimates, notes
        ks = [k for k, _ in attention.estimates]
        assert ks == [1, 2, 4, 8] and set(ks) <= set(CANDIDATES), attention
        best = min(attention.estimates, key=lambda e: (e[1], -e[0]))   # ties: the most pieces
        assert attention.chunks == mlp.chunks == best[0] and best[0] != 8, notes
        assert attention.applied == mlp.applied == (best[0] > 1) == pipelined, notes
        if pipelined:
            assert mlp.fed_by == attention.starts[1], notes
            assert_same_values(tp_batch_graphs["fw_0"], gm)
        else:
            assert all("estimated fastest" in n.reason for n in notes)
            assert count(gm, F.all_gather_into_tensor.default) == 2


def test_auto_chain_estimate_counts_every_piece_of_the_fed_pipeline(tp_batch_graphs):
    """A fed pipeline's first gather is still on the link (only its issue is the
    feeder's), and left alone nothing feeds it: the chain's estimate with k pieces is at
    least the link time of every collective's bytes, and with 1 piece the collectives
    and the compute in series."""
    from overlapc.estimate import costmodel
    from overlapc.passes.chunk.estimate import _comm_ms
    prof = costmodel.profile("cpu", "ethernet", tflops=1e-4, link_gbps=0.002, latency_us=0.0)   # link-bound
    gm = copy.deepcopy(tp_batch_graphs["fw_0"])
    matmuls = sum(costmodel.compute_ms(n, prof.device) for n in gm.graph.nodes
                  if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default))
    starts = [n for n in gm.graph.nodes if n.target in (F.all_gather_into_tensor.default,
                                                        F.reduce_scatter_tensor.default)]
    link = sum(_comm_ms(s, 1, prof.link, WORLD)[0] for s in starts)
    notes = chunk_collectives(gm, "auto", prof)
    estimates = dict(notes[0].estimates)
    assert all(ms >= link * (1 - 1e-9) for ms in estimates.values()), (estimates, link)
    assert estimates[1] >= (link + matmuls) * (1 - 1e-9), (estimates, link, matmuls)
    assert notes[0].chunks > 1 and notes[1].fed_by, notes


def test_pipeline_estimate_overlaps_pieces(fake_pg):
    """One piece: all-gather, then the matmul, then the reduce-scatter, serially.
    Four pieces, compute-bound, no latency: only the first gather piece and the last
    scatter piece are exposed."""
    from overlapc.estimate import costmodel
    from overlapc.passes.chunk.plan import Planner
    from overlapc.passes.chunk.estimate import pipeline_ms

    def fn(x, w):
        g = F.wait_tensor(F.all_gather_into_tensor(x, WORLD, "0"))
        return F.wait_tensor(F.reduce_scatter_tensor(torch.mm(g, w), "sum", WORLD, "0"))
    gm = trace(fn, (64, 256), (256, 256))
    prof = costmodel.profile("cpu", "ethernet", latency_us=0.0)
    plan = Planner(gm).plan(next(n for n in gm.graph.nodes if n.target == F.all_gather_into_tensor.default), 4)
    mm = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    link = 64 * WORLD * 256 * 4 * (WORLD - 1) / WORLD / (prof.link.gbps * 1e9) * 1e3   # each collective, ms
    compute = costmodel.compute_ms(mm, prof.device)
    assert compute > 8 * link
    assert pipeline_ms(plan, 1, prof) == pytest.approx(2 * link + compute)
    assert pipeline_ms(plan, 4, prof) == pytest.approx(compute + 2 * link / 4)
    # issuing a piece costs the compute stream issue_us + its bytes / issue_gbps (the
    # calibrated cost of a collective beside compute): the pieces issued after compute
    # starts (2 gathers, 3 scatters; the others wait on the link anyway) add it
    import dataclasses
    issuing = dataclasses.replace(prof, link=dataclasses.replace(prof.link, issue_us=0.5, issue_gbps=400.0))
    issue = issuing.link.issue_ms(64 * WORLD * 256 * 4 / 4)
    assert 0 < 2 * issue < link / 4
    assert pipeline_ms(plan, 4, issuing) == pytest.approx(compute + 2 * link / 4 + 5 * issue)
    # latency delays a piece but does not hold the link: link-bound (compute ~0, every
    # piece issued at once), the pieces' latencies run while earlier pieces move, and
    # the pipeline pays one latency before the first gather piece and one between the
    # gathers and the first scatter piece, however many pieces
    fast = dataclasses.replace(prof, device=dataclasses.replace(prof.device, tflops=1e9, mem_gbps=1e9,
                                                                kernel_us=0.0))
    latency_ms = link / 16
    slow = costmodel.profile(fast, latency_us=latency_ms * 1e3)
    slow = dataclasses.replace(slow, device=fast.device)
    for k in (2, 4):
        plan_k = Planner(gm).plan(next(n for n in gm.graph.nodes if n.target == F.all_gather_into_tensor.default), k)
        assert pipeline_ms(plan_k, k, slow) - pipeline_ms(plan_k, k, fast) == pytest.approx(latency_ms, rel=1e-3), k
    with pytest.raises(ValueError, match="auto"):
        chunk_collectives(gm, "best")

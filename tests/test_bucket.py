"""overlapc.passes.bucket: which collectives merge, where buckets close, same values
(stand-ins that give every rank distinct data, so a wrong layout shows), the
scheduler and verify on bucketed graphs, determinism. Fake process group, world 8."""
import copy
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings, strategies as st

import overlapc
from overlapc.passes.bucket import DEFAULT_BUCKET_BYTES, BucketNote, block_of, bucket_collectives
from overlapc.passes.structure import Structure
from graphs import F, WORLD, Block, ag, ancestors, plan_entry, trace, wait, random_inputs
from test_properties import live_peak, serial_peak

RANK = 3   # the rank the stand-ins pretend to be (not 0: a wrong block order shows)
AG = F.all_gather_into_tensor.default
RS = F.reduce_scatter_tensor.default
AR = F.all_reduce.default
aten = torch.ops.aten


class RankCollectives(fx.Interpreter):
    """Runs a graph with collectives replaced by local stand-ins for rank RANK.

    Rank r's all-gather shard is x with every byte XORed with r % 8 (``xor_bytes``; gathered
    rank-major): the same whether a bucket gathers it typed or as bytes; its all-reduce
    input x*(r+1); rank r's
    reduce-scatter input is y with its blocks rotated by r, times r+1, so the
    reduced block RANK is sum over r of (r+1) * block (RANK+r) % W of y. Both act
    elementwise on each rank's block, which is what bucketing must preserve."""

    def call_function(self, target, args, kwargs):
        if target == AG:
            x, world = args[0], args[1]
            return torch.cat([xor_bytes(x, r) for r in range(world)])
        if target == RS:
            y, op, world = args[0], args[1], args[2]
            blocks = y.reshape(world, y.shape[0] // world, *y.shape[1:])
            reduced = sum(blocks[(RANK + r) % world] * (r + 1) for r in range(world))
            return reduced / world if op == "avg" else reduced
        if target == AR:
            x, op = args[0], args[1]
            world = 8
            reduced = sum(x * (r + 1) for r in range(world))
            return reduced / world if op == "avg" else reduced
        if target == F.reduce_scatter_tensor_coalesced.default:   # each member as its own reduce-scatter
            return [self.call_function(RS, (y, *args[1:]), {}) for y in args[0]]
        if target == F.all_reduce_coalesced.default:
            return [self.call_function(AR, (x, *args[1:]), {}) for x in args[0]]
        if target == F.wait_tensor.default:
            return args[0].clone()
        return super().call_function(target, args, kwargs)


def xor_bytes(x: torch.Tensor, r: int) -> torch.Tensor:
    """``x`` with every byte XORed with r % 8: a stand-in for rank r's data that commutes with
    viewing the bytes as another dtype (a byte bucket's gather), and flips only low bits of
    each byte, so a float's exponent moves by a few steps and stays finite."""
    flat = x.reshape(-1).contiguous().view(torch.uint8) ^ (r % 8)
    return flat.view(x.dtype).reshape(x.shape)


def assert_same_values(before, after, exact=True, seed=0):
    inputs = random_inputs(before, seed)
    expected = RankCollectives(before).run(*inputs)
    got = RankCollectives(after).run(*inputs)
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        if not isinstance(a, torch.Tensor):
            assert a == b
        elif exact:
            assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()
        else:
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.target == op)


def bucketed(fn, *shapes, bucket="module", coalesced=False):
    """(original, bucketed copy, notes) of make_fx(fn) over inputs of ``shapes``."""
    gm = trace(fn, *shapes)
    original = copy.deepcopy(gm)
    notes = bucket_collectives(gm, bucket, coalesced=coalesced)
    gm.recompile()
    return original, gm, notes


# ------------------------------------------------------------------ all-gathers


def lead(x, kernels=4):
    """``2 * kernels`` matmuls on ``x`` (n, 16) before anything reads a gathered result, summed
    into one scalar: the window of every gather that follows holds them, so a bucket of
    those gathers keeps its members' hiding intervals (``bucket._keeps_hiding``)."""
    h = x
    for _ in range(kernels):
        h = h @ x.t() @ x   # (4, 16) -> (4, 4) -> (4, 16): two kernels
    return h.sum()


def uneven_gathers(x, w1, b1, w3, w4):
    h = lead(x)
    g1 = wait(ag(w1))                       # (16, 16)
    y = x @ g1 + h
    y = y + wait(ag(b1))                    # (16,)
    y = y @ wait(ag(w3)).reshape(16, 16)    # (8, 16, 2): 3-D, other dim 0
    g4 = wait(ag(w4))                       # (24, 16): used twice, and a graph output
    y = y @ g4[:16].t() + g4[16:].sum(0)
    y = y * wait(ag(w1)).sum()              # the same parameter gathered a second time
    return y, g4


def test_all_gathers_of_uneven_shapes_become_one_with_identical_values(fake_pg):
    original, gm, notes = bucketed(uneven_gathers, (4, 16), (2, 16), (2,), (1, 16, 2), (3, 16))
    assert (count(original, AG), count(gm, AG)) == (5, 1)
    assert count(gm, F.wait_tensor.default) == 1
    note, = notes
    assert note == BucketNote(
        start="all_gather_bucket", kind="all_gather", group="0", nbytes=4 * (256 + 16 + 256 + 384 + 256),
        members=("all_gather_into_tensor", "all_gather_into_tensor_1", "all_gather_into_tensor_2",
                 "all_gather_into_tensor_3", "all_gather_into_tensor_4"),
        modules=("",) * 5, sources=("",) * 5)   # a make_fx graph: no Dynamo sources to name them by
    assert gm.meta["overlapc_buckets"] == notes
    assert_same_values(original, gm)
    start = next(n for n in gm.graph.nodes if n.name == note.start)
    assert tuple(start.meta["val"].shape) == (WORLD * (32 + 2 + 32 + 48 + 32),)
    # the copy-in (one pack) travels with the start: the scheduler sees it as its input chain
    bundle = Structure(gm).start_bundle[start]
    assert [n.target for n in bundle[-2:]] == [torch.ops.overlapc.pack.default, AG]
    assert all(n.meta.get("overlapc_input_chain") for n in bundle[:-1])


VIEWS = (torch.ops.aten.view.default, torch.ops.aten.t.default, torch.ops.aten.slice.Tensor)


def _first_real_reader(nodes, produced):
    """The first node after ``produced`` that is not a view and reads it (through views)."""
    views = {produced}
    for node in nodes[nodes.index(produced) + 1:]:
        if node.target not in VIEWS:
            return node if views & set(node.all_input_nodes) else None
        views.update([node] if node.all_input_nodes[0] in views else [])
    return None


def test_members_are_copied_out_together_before_the_first_consumer(fake_pg):
    """One unpack_columns copies every member that is not a graph output out of the
    gathered rows, member-major, just before the bucket's first consumer (Inductor calls
    it, no generated kernel); each such member's result is a view of it. g4, a graph
    output, gets a copy of its own just before its own first consumer, so no other
    member's bytes live on with it."""
    _, gm, _ = bucketed(uneven_gathers, (4, 16), (2, 16), (2,), (1, 16, 2), (3, 16))
    nodes = list(gm.graph.nodes)
    wait_node = next(n for n in nodes if n.target == F.wait_tensor.default)
    own, = [n for n in nodes if n.target == torch.ops.aten.clone.default]
    together = [n for n in nodes if n.target == torch.ops.overlapc.unpack_columns.default]
    assert len(together) == 1
    joined = together[0]
    assert nodes.index(joined) > nodes.index(wait_node)
    assert len(joined.args[2]) == 4   # the four members that are no graph output
    assert _first_real_reader(nodes, joined) is not None   # nothing but views between it and its first reader
    assert _first_real_reader(nodes, own) is not None
    out = next(n for n in nodes if n.op == "output")
    assert any(own in v.all_input_nodes for v in out.args[0])   # g4 = view(own copy)
    assert joined.meta["val"].numel() == WORLD * (32 + 2 + 32 + 32)


def casts_and_transposes(x, a, b, c, d):
    h = lead(x)
    y = x @ wait(ag(a)).t() + h                                # fp32
    y = y @ wait(ag(b.to(torch.bfloat16))).float()             # bf16 (mixed precision cast)
    y = y @ wait(ag(c.t())).t()                                # fp32, non-contiguous shard
    y = y @ wait(ag(d.to(torch.bfloat16))).float().t()         # bf16
    return y


def test_dtypes_share_a_byte_bucket_and_casts_and_transposes_are_copied_in(fake_pg):
    original, gm, notes = bucketed(casts_and_transposes, (4, 16), (2, 16), (2, 16), (16, 2), (2, 16))
    assert (count(original, AG), count(gm, AG)) == (4, 1)
    # laid out widest element first (fp32 a, c, then bf16 b, d), so every member's bytes are aligned
    assert [n.members for n in notes] == [("all_gather_into_tensor", "all_gather_into_tensor_2",
                                           "all_gather_into_tensor_1", "all_gather_into_tensor_3")]
    assert [n.nbytes for n in notes] == [2 * 256 * 4 + 2 * 256 * 2]
    assert_same_values(original, gm)
    start = next(n for n in gm.graph.nodes if n.name == notes[0].start)
    assert start.meta["val"].dtype == torch.uint8 and start.meta["val"].numel() == WORLD * 2 * (2 * 16 * 6)
    s = Structure(gm)
    chain = [n.target for n in s.start_bundle[start]]
    assert chain.count(torch.ops.aten._to_copy.default) == 2      # both casts travel with the bucket
    views = [n for n in gm.graph.nodes if n.target == torch.ops.aten.view.dtype]
    assert sorted(str(n.args[1]) for n in views) == ["torch.bfloat16"] * 2 + ["torch.float32"] * 2


def mixed_gathers(a, b, c, d):
    """Four dtypes, odd element counts: two results are graph outputs (a copy each), two are
    read by a clone (copied out together)."""
    return wait(ag(a)), wait(ag(b)), wait(ag(c)).clone(), wait(ag(d)).clone()


@pytest.mark.parametrize("bucket", ["module", 1 << 20])
def test_byte_buckets_are_bit_exact_for_every_dtype(fake_pg, bucket):
    """fp32 (15 elements), bf16 (7), fp16 (3) and fp64 (6): one uint8 all-gather; each
    member's gathered block viewed back as its dtype holds the same bits as its own gather."""
    shapes, dtypes = ((3, 5), (1, 7), (3,), (2, 3)), (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    gm = trace(lambda a, b, c, d: mixed_gathers(a.to(dtypes[0]), b.to(dtypes[1]), c.to(dtypes[2]), d.to(dtypes[3])),
               *shapes)
    original = copy.deepcopy(gm)
    notes = bucket_collectives(gm, bucket)
    gm.recompile()
    assert len(notes) == 1 and count(gm, AG) == 1
    # fp64, fp32, then the 2-byte ones in consumer order (the fp16 one is read first, by its clone)
    assert notes[0].members == ("all_gather_into_tensor_3", "all_gather_into_tensor", "all_gather_into_tensor_2",
                                "all_gather_into_tensor_1")
    inputs = random_inputs(original, seed=5)
    expected, got = RankCollectives(original).run(*inputs), RankCollectives(gm).run(*inputs)
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype and e.shape == g.shape
        assert torch.equal(e.reshape(-1).view(torch.uint8), g.reshape(-1).view(torch.uint8))


def test_byte_target_closes_a_bucket_before_it_would_overflow(fake_pg):
    def six(x, *ws):
        for w in ws:
            x = x + wait(ag(w)).sum(0)
        return x
    shapes = [(4,), (1, 4), (1, 4), (16, 4), (1, 4), (1, 4), (1, 4)]    # outputs 128, 128, 2048, 128 x 3 bytes
    names = ["all_gather_into_tensor"] + [f"all_gather_into_tensor_{i}" for i in range(1, 6)]
    original, gm, notes = bucketed(six, *shapes, bucket=300)
    # [128, 128] | [2048] alone (over the target) | [128, 128] | [128]
    assert [n.members for n in notes] == [tuple(names[:2]), tuple(names[3:5])]
    assert count(gm, AG) == 4
    assert_same_values(original, gm)
    _, gm, notes = bucketed(six, *shapes, bucket=2304)       # exactly full, then the next bucket
    assert [n.members for n in notes] == [tuple(names[:3]), tuple(names[3:])]
    assert [n.nbytes for n in notes] == [2304, 384]


def test_barrier_splits_buckets(fake_pg):
    def around_barrier(x, z, a, b, c, d):
        h = lead(x)
        x = x @ wait(ag(a)).t() @ wait(ag(b)).t() + h
        torch.ops.aten.add_(z, 1)
        return x @ wait(ag(c)).t() @ wait(ag(d)).t(), z
    original, gm, notes = bucketed(around_barrier, (4, 16), (2,), *[(2, 16)] * 4)
    assert [n.members for n in notes] == [("all_gather_into_tensor", "all_gather_into_tensor_1"),
                                          ("all_gather_into_tensor_2", "all_gather_into_tensor_3")]
    names = [n.name for n in gm.graph.nodes]
    barrier = next(n.name for n in gm.graph.nodes if n.target == torch.ops.aten.add_.Tensor)
    assert names.index(notes[0].start) < names.index(barrier) < names.index(notes[1].start)
    assert_same_values(original, gm)


def test_a_result_that_feeds_another_collective_stays_out(fake_pg):
    def tied(x, a, b, c):
        h = lead(x)
        y = x @ wait(ag(a)).t() + h
        scattered = wait(F.reduce_scatter_tensor(wait(ag(b)), "sum", WORLD, "0"))   # b's result is an input
        return y @ wait(ag(c)).t(), scattered
    original, gm, notes = bucketed(tied, (4, 16), (2, 16), (2, 16), (2, 16))
    assert [n.members for n in notes] == [("all_gather_into_tensor", "all_gather_into_tensor_2")]
    assert count(gm, AG) == 2
    assert_same_values(original, gm)


def test_pieces_of_a_chunked_collective_stay_apart(fake_pg):
    def rows_and_weights(x, w, a, b):
        h = lead(w)
        y = torch.mm(wait(ag(x)), w)               # gathered rows -> matmul: chunked into pieces
        return y @ wait(ag(a)).t() @ wait(ag(b)).t() + h
    gm = trace(rows_and_weights, (8, 16), (16, 16), (2, 16), (2, 16))
    original = copy.deepcopy(gm)
    # "auto" bytes: under "serial-peak" this tiny graph has no room for the bucket's copies
    overlapc.schedule(gm, overlapc.OverlapConfig(chunks=2, bucket=1 << 20, max_in_flight_bytes="auto",
                                                 on_error="raise"))
    chunked = [n for n in gm.meta["overlapc_chunks"] if n.applied]
    assert [len(n.pieces) for n in chunked] == [2]
    assert [n.members for n in gm.meta["overlapc_buckets"]] == [
        ("all_gather_into_tensor_1", "all_gather_into_tensor_2")]
    assert count(gm, AG) == 3
    assert_same_values(original, gm, exact=False)


# ------------------------------------------------------------------ reduce-scatters


def scatters(y1, y2, y3, y4, y5, y6):
    out = [wait(F.reduce_scatter_tensor(y1 * 2, "sum", WORLD, "0")),          # (16, 16) -> (2, 16)
           wait(F.reduce_scatter_tensor(y2 + 1, "sum", WORLD, "0")),          # (24, 5)  -> (3, 5)
           wait(F.reduce_scatter_tensor(y3 * 3, "sum", WORLD, "0")),          # (8,)     -> (1,)
           wait(F.reduce_scatter_tensor((y4 - 1).t(), "sum", WORLD, "0")),    # non-contiguous (8, 16)
           wait(F.reduce_scatter_tensor(y5 * 2, "avg", WORLD, "0")),          # another reduce op
           wait(F.reduce_scatter_tensor(y6 * 2, "avg", WORLD, "0"))]
    return [o * 1 for o in out]


def test_reduce_scatters_merge_with_each_rank_getting_its_own_blocks(fake_pg):
    original, gm, notes = bucketed(scatters, (16, 16), (24, 5), (8,), (16, 8), (8, 4), (16, 2))
    assert (count(original, RS), count(gm, RS)) == (6, 2)
    assert [(n.kind, n.members) for n in notes] == [
        ("reduce_scatter", ("reduce_scatter_tensor", "reduce_scatter_tensor_1", "reduce_scatter_tensor_2",
                            "reduce_scatter_tensor_3")),
        ("reduce_scatter", ("reduce_scatter_tensor_4", "reduce_scatter_tensor_5"))]
    assert [n.nbytes for n in notes] == [4 * (256 + 120 + 8 + 128), 4 * (32 + 32)]
    assert_same_values(original, gm, exact=False)
    start = next(n for n in gm.graph.nodes if n.name == notes[0].start)
    assert tuple(start.args[0].meta["val"].shape) == (WORLD * (32 + 15 + 1 + 16),)


def test_reduce_scatter_bucket_waits_for_its_last_input_and_not_longer(fake_pg):
    def late_input(a, b):
        first = wait(F.reduce_scatter_tensor(a * 2, "sum", WORLD, "0"))
        h = torch.tanh(b @ b)
        second = wait(F.reduce_scatter_tensor(h, "sum", WORLD, "0"))
        return first, second, torch.relu(h) @ b @ b   # kernels after the last input: the bucket keeps hiding
    original, gm, notes = bucketed(late_input, (16, 4), (16, 16))
    names = [n.name for n in gm.graph.nodes]
    assert len(notes) == 1
    assert names.index("tanh") < names.index(notes[0].start) < names.index("relu")
    assert_same_values(original, gm, exact=False)

    def needed_early(a, b):
        first = wait(F.reduce_scatter_tensor(a * 2, "sum", WORLD, "0"))
        h = torch.tanh(b @ b + first.sum())          # the first result is needed before h is ready
        return first, wait(F.reduce_scatter_tensor(h, "sum", WORLD, "0"))
    _, gm, notes = bucketed(needed_early, (16, 4), (16, 16))
    assert notes == [] and count(gm, RS) == 2


def replicated_gradients(g1, g2, g3, g4, g5):
    """In-graph DDP: each gradient all-reduced (averaged), one of them in a chain."""
    out = [wait(F.all_reduce(g1 * 2, "avg", "0")),                  # (16, 16)
           wait(F.all_reduce(g2 + 1, "avg", "0")),                  # (24, 5)
           wait(F.all_reduce((g3 - 1).t(), "avg", "0")),            # non-contiguous (16, 8)
           wait(F.all_reduce(g4 * 3, "sum", "0"))]                  # another reduce op: its own bucket
    shard = wait(F.reduce_scatter_tensor(g5, "sum", WORLD, "0"))
    out.append(wait(F.all_reduce(shard / 2, "avg", "0")))           # HSDP-style chain
    return [o * 1 for o in out]


@pytest.mark.parametrize("bucket, coalesced, members, count_after", [
    (10 ** 6, False, ("all_reduce", "all_reduce_1", "all_reduce_2"), 3),   # packed: the chain stays out
    (10 ** 6, True, ("all_reduce", "all_reduce_1", "all_reduce_2", "all_reduce_4"), 2),   # coalesced: it joins
    ("auto", False, ("all_reduce_1", "all_reduce_2"), 4),   # the defaults (g1 is the cap alone)
])
def test_all_reduces_merge_with_the_same_values_and_chains_only_in_coalesced_buckets(fake_pg, bucket, coalesced,
                                                                                    members, count_after):
    original, gm, notes = bucketed(replicated_gradients, (16, 16), (24, 5), (8, 16), (4, 4), (16, 4),
                                   bucket=bucket, coalesced=coalesced)
    assert (count(original, AR), count(gm, AR) + count(gm, F.all_reduce_coalesced.default)) == (5, count_after)
    sizes = {"all_reduce": 256, "all_reduce_1": 120, "all_reduce_2": 128, "all_reduce_4": 8}
    assert [(n.kind, n.members, n.nbytes) for n in notes] == [
        ("all_reduce", members, 4 * sum(sizes[m] for m in members))]
    assert_same_values(original, gm)
    overlapc.schedule(gm, overlapc.OverlapConfig(on_error="raise", bucket=None))
    overlapc.verify(gm)


def test_coalesced_buckets_are_one_coalesced_op_over_the_members_own_tensors(fake_pg):
    """bucket_op="coalesced": each reduce-scatter and all-reduce bucket is one *_coalesced op
    over the members' inputs as they are (no pack copy, no slices), each result its own wait;
    the values are bit-identical (each member is reduced alone, as before) and the schedule
    verifies. The chained all-reduce joins its level's bucket, reading the reduce-scatter
    bucket's result."""
    def gradients(g1, g2, g3, g4, g5):
        out = [wait(F.all_reduce(g1 * 2, "avg", "0")), wait(F.all_reduce(g2 + 1, "avg", "0"))]
        shards = [wait(F.reduce_scatter_tensor(g, "sum", WORLD, "0")) for g in (g3, g4)]
        out += [wait(F.all_reduce(s / 2, "avg", "0")) for s in shards]
        return [o * 1 for o in out] + [g5 * 1]
    original, gm, notes = bucketed(gradients, (16, 16), (24, 5), (16, 4), (8, 4), (2, 2), bucket=10 ** 6,
                                   coalesced=True)
    assert [(n.kind, n.members) for n in notes] == [
        ("reduce_scatter", ("reduce_scatter_tensor", "reduce_scatter_tensor_1")),
        ("all_reduce", ("all_reduce", "all_reduce_1", "all_reduce_2", "all_reduce_3"))]
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(F.reduce_scatter_tensor_coalesced.default) == ops.count(F.all_reduce_coalesced.default) == 1
    assert RS not in ops and AR not in ops and torch.ops.overlapc.pack.default not in ops
    assert aten.slice.Tensor not in ops
    assert_same_values(original, gm)
    overlapc.schedule(gm, overlapc.OverlapConfig(on_error="raise", bucket=None))
    overlapc.verify(gm)


def test_bucket_op_is_checked_and_reaches_the_bucket_pass(fake_pg):
    with pytest.raises(ValueError, match=r"OverlapConfig.bucket_op must be .*did you mean 'coalesced'"):
        overlapc.OverlapConfig(bucket_op="coalesce")
    def two(a, b):
        return wait(F.reduce_scatter_tensor(a, "sum", WORLD, "0")) + wait(F.reduce_scatter_tensor(b, "sum", WORLD, "0"))
    gm = trace(two, (16, 4), (16, 4))
    overlapc.schedule(gm, overlapc.OverlapConfig(on_error="raise", bucket=10 ** 6, bucket_op="coalesced",
                                                max_in_flight_bytes=None))
    assert [n.target for n in gm.graph.nodes].count(F.reduce_scatter_tensor_coalesced.default) == 1


# ------------------------------------------------------------------ modules, on a captured model


class Tiny(torch.nn.Module):
    def __init__(self, vocab=32, dim=16, depth=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


@pytest.fixture(scope="module")
def tiny_graphs(fake_pg):
    import overlapc.fsdp
    from overlapc.backend import capture
    torch.manual_seed(0)
    model = overlapc.fsdp.shard(Tiny(), fake_pg)
    records = capture(model, (torch.randint(0, 32, (2, 8)),), {"enabled": False})
    return {r.name: r.gm for r in records}


def test_module_buckets_hold_one_block_each(tiny_graphs):
    forward, backward = copy.deepcopy(tiny_graphs["fw_0"]), copy.deepcopy(tiny_graphs["bw_0"])
    fw_notes, bw_notes = bucket_collectives(forward, "module"), bucket_collectives(backward, "module")
    # forward: embed | layers.0 (6 parameters) | layers.1 (6) | norm (2) | output. layers.0's
    # gathers come first in the graph, with no kernel before its norm: the down projection's
    # bias, read last, would lose the kernels it can hide under (the norm and two matmuls)
    # to a bucket of its two projections' bytes, so it stays out (bucket._keeps_hiding)
    assert (count(tiny_graphs["fw_0"], AG), count(forward, AG)) == (16, 6)
    assert [(block_of(n.modules[0]), len(n.members)) for n in fw_notes] == [
        ("layers.0", 5), ("layers.1", 6), ("norm", 2)]
    assert fw_notes[0].modules == ("layers.0.norm", "layers.0.norm", "layers.0.up", "layers.0.up",
                                   "layers.0.down")
    # backward: gradients reduce-scattered per block, last block first
    assert (count(tiny_graphs["bw_0"], RS), count(backward, RS)) == (16, 5)
    scattered = [n for n in bw_notes if n.kind == "reduce_scatter"]
    assert [(block_of(n.modules[0]), len(n.members)) for n in scattered] == [
        ("norm", 2), ("layers.1", 6), ("layers.0", 6)]
    assert count(backward, AG) < count(tiny_graphs["bw_0"], AG)     # the backward's re-gathers too
    for note in fw_notes + bw_notes:
        assert len({block_of(m) for m in note.modules}) == 1 and all(note.modules), note
    for original, gm in ((tiny_graphs["fw_0"], forward), (tiny_graphs["bw_0"], backward)):
        gm.recompile()
        assert_same_values(original, gm, exact=False)
    # the bucket keeps a member's module stack, so the report names a module for it
    from overlapc.collectives import module_path
    start = next(n for n in forward.graph.nodes if n.name == fw_notes[0].start)
    assert block_of(module_path(start)) == "layers.0"


def test_byte_target_on_the_captured_model_ignores_modules(tiny_graphs):
    forward = copy.deepcopy(tiny_graphs["fw_0"])
    notes = bucket_collectives(forward, 1 << 30)
    # by size only, across blocks; where a bucket would lose a member's hiding kernels it
    # closes (bucket._keeps_hiding): the embedding's gather alone, then three buckets
    assert count(forward, AG) == 4 and [len(n.members) for n in notes] == [5, 6, 4]
    assert [sorted({block_of(m) for m in n.modules}) for n in notes] == [
        ["layers.0"], ["layers.0", "layers.1"], ["layers.1", "norm", "output"]]


def test_without_module_information_module_mode_uses_the_default_target(fake_pg):
    def big(x, a, b, c):   # half the default target gathered each: two fit, the third starts anew
        return x + wait(ag(a)).sum() + wait(ag(b)).sum() + wait(ag(c)).sum()
    rows = DEFAULT_BUCKET_BYTES // (2 * WORLD * 4 * 1024)
    gm = trace(big, (1,), *[(rows, 1024)] * 3)
    notes = bucket_collectives(gm, "module")
    assert [n.members for n in notes] == [("all_gather_into_tensor", "all_gather_into_tensor_1")]


def test_schedule_and_verify_on_bucketed_captured_graphs(tiny_graphs, caplog):
    from overlapc.explain import report
    for name in ("fw_0", "bw_0"):
        for cfg in (overlapc.OverlapConfig(bucket="module", on_error="raise"),
                    overlapc.OverlapConfig(bucket=1024, max_in_flight=1, max_in_flight_bytes=None,
                                           on_error="raise")):
            gm = copy.deepcopy(tiny_graphs[name])
            before = len(overlapc.collectives(gm))
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="overlapc"):   # the summary reads the buckets too
                overlapc.schedule(gm, cfg)
            notes = gm.meta["overlapc_buckets"]
            after = before - sum(len(n.members) - 1 for n in notes)
            assert notes and len(overlapc.collectives(gm)) == after
            assert f"collectives {before} -> {after} (buckets/chunks)" in caplog.text
            overlapc.verify(gm, cfg)
            assert_same_values(tiny_graphs[name], gm, exact=False)
            assert [r["start"] for r in report.rewrites(gm)] == [n.start for n in notes]


# ------------------------------------------------------------------ contract


def test_nothing_to_merge_changes_nothing(fake_pg):
    def one(x, a, b):
        return x @ wait(ag(a)).t() @ wait(ag(b.to(torch.bfloat16))).float().t()
    gm = trace(one, (4, 16), (2, 16), (2, 16))
    code = gm.code
    assert bucket_collectives(gm, "module") == [] and gm.meta["overlapc_buckets"] == []
    gm.recompile()
    assert gm.code == code


@pytest.mark.parametrize("bucket", [0, -5, True, "modules", 1.5, None])
def test_bad_bucket_argument(fake_pg, bucket):
    gm = trace(lambda x, a: x @ wait(ag(a)).t(), (4, 16), (2, 16))
    with pytest.raises(ValueError, match="bucket must be"):
        bucket_collectives(gm, bucket)


# ------------------------------------------------------------------ bucket plans


def in_modules(gm, paths):
    """Tag the graph's all-gather starts, in graph order, with ``paths`` (``nn_module_stack``, as
    make_fx of a module records it)."""
    starts = [n for n in gm.graph.nodes if n.target == AG]
    for start, path in zip(starts, paths, strict=True):
        start.meta["nn_module_stack"] = {"m": (path, "torch.nn.Module")}


def eight_projections(x, *weights):
    for w in weights:
        x = x @ wait(ag(w)).t()
    return x


PLANNED = ["tok_embeddings", "layers.0.attention.wq", "layers.0.attention.wk", "layers.0.moe.router",
           "layers.0.moe.experts.w1", "layers.0.moe.experts.w2", "norm", "output"]


def test_a_bucket_plan_buckets_each_entry_by_the_longest_prefix_and_leaves_the_rest(fake_pg):
    """graph_trainer's plans name blocks, lists of them, and for MoE a block's experts apart
    from the rest of it: a collective goes to the entry naming the longest prefix of its
    module, and one that no entry names stays alone."""
    gm = trace(eight_projections, (4, 16), *[(2, 16)] * 8)
    in_modules(gm, PLANNED)
    original = copy.deepcopy(gm)
    plan = overlapc.OverlapConfig(bucket=["layers.0", "layers.0.moe.experts", ["norm", "output"]]).bucket
    assert plan == (("layers.0",), ("layers.0.moe.experts",), ("norm", "output"))

    notes = bucket_collectives(gm, ["layers.0", "layers.0.moe.experts", ["norm", "output"]])

    names = [n.name for n in original.graph.nodes if n.target == AG]
    assert [list(note.members) for note in notes] == [names[1:4], names[4:6], names[6:8]]
    gm.recompile()
    assert_same_values(original, gm)


def test_a_plan_bucket_forms_where_the_hiding_rule_would_split_it(fake_pg):
    """The plan is the user's: one entry over two gathers whose merge loses the second one's
    hiding matmul is one bucket (``"module"``, by the hiding rule, keeps them apart)."""
    def blocking(x, a, b):
        h = x @ wait(ag(a)).t()            # the second gather hides under this matmul alone
        return h @ wait(ag(b)).t()
    gm = trace(blocking, (4, 16), (2, 16), (2, 16))
    in_modules(gm, ["block.q", "block.k"])
    by_module = bucket_collectives(copy.deepcopy(gm), "module")
    assert by_module == []
    scheduled = copy.deepcopy(gm)
    cfg = overlapc.OverlapConfig(bucket=["block"], on_error="raise")
    overlapc.schedule(scheduled, cfg)
    assert [len(note.members) for note in scheduled.meta["overlapc_buckets"]] == [2]
    overlapc.verify(scheduled, cfg)
    assert_same_values(gm, scheduled)


def test_module_buckets_after_another_rewrite_are_bounded_by_their_own_serial_peak(fake_pg, caplog):
    """A rewrite before bucketing (here an unread gather erased, as torch 2.14's partitioner
    leaves MHA's in_proj gathers) recorded the graph's serial peak; "module" buckets, which
    cost what they hold, were then bounded by that stale peak: the check failed, the serial
    fallback too, and the graph was scheduled without buckets, with a WARNING (the demo
    transformer's forward under bucket="module")."""
    def block(x, w0, w1, w2, w3):
        wait(ag(w0))                               # unread, repeated below: erased
        for w in (w0, w1, w2, w3):
            x = torch.relu(x @ wait(ag(w)).t())
        return x
    gm = trace(block, (4, 16), *[(2, 16)] * 4)
    in_modules(gm, ["layers.0.attn.wq", "layers.0.attn.wq", "layers.0.attn.wk", "layers.0.mlp.w1", "layers.0.mlp.w2"])
    original = copy.deepcopy(gm)
    for bucket, sizes in (("module", [2]), (["layers.0"], [4])):   # "module" keeps the hiding rule
        scheduled = copy.deepcopy(original)
        cfg = overlapc.OverlapConfig(bucket=bucket, on_error="raise")
        with caplog.at_level(logging.WARNING, logger="overlapc"):
            overlapc.schedule(scheduled, cfg)
        assert not caplog.records, caplog.text
        assert [len(note.members) for note in scheduled.meta["overlapc_buckets"]] == sizes, bucket
        overlapc.verify(scheduled, cfg)
        assert_same_values(original, scheduled)


def test_plan_entries_no_collective_belongs_to_are_named(fake_pg, caplog):
    gm = trace(eight_projections, (4, 16), *[(2, 16)] * 8)
    in_modules(gm, PLANNED)
    with caplog.at_level(logging.INFO, logger="overlapc"):
        bucket_collectives(gm, ["layers.0", ["lm_head", "norm"], "layers.7"])
    assert "bucket plan entries no collective of this graph belongs to: layers.7" in caplog.text
    assert "lm_head" not in caplog.text   # its entry holds norm's


def test_an_empty_plan_buckets_nothing(fake_pg):
    gm = trace(eight_projections, (4, 16), *[(2, 16)] * 8)
    in_modules(gm, PLANNED)
    overlapc.schedule(gm, overlapc.OverlapConfig(bucket=[], on_error="raise"))
    assert gm.meta["overlapc_buckets"] == [] and count(gm, AG) == 8


@pytest.mark.parametrize("plan, message", [
    (["layers.0", ["layers.0"]], "module 'layers.0' is in plan entries 0 and 1"),
    (["layers.0", []], "plan entry 1 is \\[\\]"),
    ([3], "plan entry 0 is 3"),
    ([".layers"], "plan entry 0 is '.layers'"),
])
def test_a_bad_plan_names_its_entry(plan, message):
    with pytest.raises(ValueError, match=f"OverlapConfig.bucket: {message}"):
        overlapc.OverlapConfig(bucket=plan)


def test_shapes_that_contradict_the_group_size_name_the_node(fake_pg):
    gm = trace(lambda x, a, b: x @ wait(ag(a)).t() @ wait(ag(b)).t(), (4, 16), (2, 16), (2, 16))
    start = next(n for n in gm.graph.nodes if n.name == "all_gather_into_tensor_1")
    start.meta["val"] = torch.empty(8, 16, device="meta")
    with pytest.raises(ValueError, match="all_gather_into_tensor_1 .op all_gather_into_tensor, group 0"):
        bucket_collectives(gm, "module")


_BUCKET_IN_A_FRESH_PROCESS = """
import sys; sys.path.insert(0, {tests!r})
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
import test_bucket
print(test_bucket.bucketed_code(dist.new_group(list(range(8))).group_name))
"""


def two_group_program(other):
    def fn(x, *ws):
        outs = []
        for i, w in enumerate(ws):
            w = w.to(torch.bfloat16) if i % 3 == 0 else w
            x = x @ wait(ag(w, "0" if i % 2 else other)).float().t()
            outs.append(wait(F.reduce_scatter_tensor(x.repeat(2, 1), "sum", WORLD, other if i % 2 else "0")))
        return x, *outs
    return fn


def bucketed_code(other):
    """The code and notes of a graph with lanes of two groups, two dtypes and both kinds."""
    gm = trace(two_group_program(other), (16, 16), *[(2, 16)] * 8)
    notes = bucket_collectives(gm, 4096)
    gm.recompile()
    return gm.code + "\n" + repr(notes)


def test_same_buckets_whatever_the_hash_seed(fake_pg, two_groups):
    script = _BUCKET_IN_A_FRESH_PROCESS.format(tests=os.path.dirname(os.path.abspath(__file__)))
    outputs = set()
    for seed in ("0", "4242"):
        done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONHASHSEED=seed),
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.add(done.stdout)
    assert len(outputs) == 1
    output = outputs.pop()
    # all-gathers in two lanes (by group: bf16 and fp32 share byte buckets), three buckets where
    # a bucket would lose hiding matmuls; reduce-scatters in three buckets likewise
    assert output.count("kind='all_gather'") == 3 and output.count("kind='reduce_scatter'") == 3, output


# ------------------------------------------------------------------ property test


@st.composite
def programs(draw):
    n = draw(st.integers(2, 6))
    each = lambda strategy: draw(st.lists(strategy, min_size=n, max_size=n))  # noqa: E731
    return dict(
        n=n,
        rows=each(st.integers(1, 3)),
        rest=each(st.sampled_from([(), (4,), (2, 3)])),
        bf16=each(st.booleans()),
        transposed=each(st.booleans()),
        group=each(st.integers(0, 1)),
        scatter=each(st.booleans()),
        out=each(st.booleans()),
        rewait=each(st.sampled_from([None, "again", "chained"])),
        upfront=draw(st.booleans()),
        use=draw(st.permutations(list(range(n)))),
        barrier=draw(st.one_of(st.none(), st.integers(0, n - 1))),
        bucket=draw(st.sampled_from(["auto", "module", 1, 100, 400, 1 << 20, "plan"])),
        plan=draw(st.sampled_from([["blocks.0", "blocks.1"], [["blocks.0", "blocks.2"]], ["blocks"],
                                   ["blocks.1", "blocks.1.inner"], []])),
        modules=draw(st.lists(st.sampled_from(["blocks.0", "blocks.1", "blocks.1.inner", "blocks.2", "head"]),
                              min_size=2 * n, max_size=2 * n)),
        max_in_flight=draw(st.sampled_from([1, 2, None])),
    )


def shard_shape(p, i):
    """Shard i: (rows, *rest), stored transposed (and gathered through a non-contiguous .t()) when asked."""
    shape = (p["rows"][i], *p["rest"][i])
    return shape[::-1] if p["transposed"][i] and len(shape) == 2 else shape


def build(p, groups):
    """Gather n shards (casts, transposes, two groups) and read every element of each at
    its own place; reduce-scatter some products; a barrier after one use when asked. A
    shard's later readers may wait it again (as AOTAutograd's CSE leaves a collective traced
    twice) or wait its wait."""
    def fn(x, scratch, *tensors):
        shards, weights = tensors[:p["n"]], tensors[p["n"]:]
        started, outs = {}, []

        def start(i):
            w = shards[i].t() if p["transposed"][i] and shards[i].dim() == 2 else shards[i]
            started[i] = ag(w.to(torch.bfloat16) if p["bf16"][i] else w, groups[p["group"][i]])

        if p["upfront"]:
            for i in range(p["n"]):
                start(i)
        for step, i in enumerate(p["use"]):
            if i not in started:
                start(i)
            full = wait(started[i])
            x = x * 0.5 + (full.float().reshape(-1) * weights[i]).sum()
            if p["rewait"][i] is not None:
                full = wait(started[i] if p["rewait"][i] == "again" else full)
            if p["scatter"][i]:
                outs.append(wait(F.reduce_scatter_tensor(full.float() * x, "sum", WORLD, groups[p["group"][i]])))
            if p["out"][i]:
                outs.append(full)
            if p["barrier"] == step:
                torch.ops.aten.add_(scratch, 1)
        return (x, *outs)
    return fn


@settings(max_examples=int(os.environ.get("OVERLAPC_EXAMPLES", "50")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=programs(), issue=st.sampled_from(["early", "per-kernel"]), bucket_op=st.sampled_from(["pack", "coalesced"]))
def test_random_graphs_bucket_with_the_same_values_and_verify(fake_pg, two_groups, p, issue, bucket_op):
    groups = (fake_pg.group_name, two_groups[0].group_name)
    weights = [(WORLD * p["rows"][i] * math.prod(p["rest"][i]),) for i in range(p["n"])]
    gm = trace(build(p, groups), (1,), (1,), *[shard_shape(p, i) for i in range(p["n"])], *weights)
    starts = [n for n in gm.graph.nodes if n.target in (AG, RS)]
    for start, path in zip(starts, p["modules"]):   # modules for the plans
        start.meta["nn_module_stack"] = {"m": (path, "torch.nn.Module")}
    original = copy.deepcopy(gm)
    collectives = len(overlapc.collectives(gm))
    largest = {}   # (group, kind) -> bytes of the largest all-gather output / reduce-scatter input
    for c in overlapc.collectives(gm):
        size = c.nbytes * (c.group_size if c.kind == "reduce_scatter" else 1)
        largest[(c.group, c.kind)] = max(largest.get((c.group, c.kind), 0), size)
    bucket = p["plan"] if p["bucket"] == "plan" else p["bucket"]
    cfg = overlapc.OverlapConfig(bucket=bucket, max_in_flight=p["max_in_flight"], issue=issue, bucket_op=bucket_op,
                                 on_error="raise")

    overlapc.schedule(gm, cfg)

    notes = gm.meta["overlapc_buckets"]
    assert len(overlapc.collectives(gm)) == collectives - sum(len(n.members) - 1 for n in notes)
    waits = [n for n in gm.graph.nodes if n.target == F.wait_tensor.default]
    assert len(waits) == sum(len(c.waits) for c in overlapc.collectives(gm)), "a repeated wait was left"
    assert all(len(n.members) > 1 for n in notes)
    if isinstance(p["bucket"], int):
        assert all(n.nbytes <= p["bucket"] for n in notes)
    if p["bucket"] == "auto":   # no bucket outgrows the largest collective it could have been
        assert all(n.nbytes <= largest[(n.group, n.kind)] for n in notes), (notes, largest)
    overlapc.verify(gm, cfg)
    assert_same_values(original, gm, exact=False)
    if p["bucket"] == "plan":   # a bucket holds collectives of one plan entry (its longest prefix) only
        module = {n.name: n.meta["nn_module_stack"]["m"][0] for n in starts}
        for note in notes:
            found = {plan_entry(cfg.bucket, module[m]) for m in note.members}
            assert len(found) == 1 and None not in found, (note, cfg.bucket)
    # the default budget ("serial-peak"): the schedule's peak, counted independently, at most
    # the unbucketed graph's serial order's ("module" and plan buckets cost what they hold)
    if p["bucket"] not in ("module", "plan"):
        assert live_peak(list(gm.graph.nodes), overlapc.collectives(gm)) <= serial_peak(original), notes
    inputs = random_inputs(original)
    expected, got = RankCollectives(original).run(*inputs), RankCollectives(gm).run(*inputs)
    kinds = [kind for i in p["use"] for kind in ("scatter", "out") if p[kind][i]]
    for index, (kind, a, b) in enumerate(zip(kinds, expected[1:], got[1:])):
        if kind == "out":                       # gathered tensors: bit for bit
            assert torch.equal(a, b), f"gathered output {index}"


@pytest.mark.degrades
def test_a_failure_after_bucketing_restores_names_notes_and_order(fake_pg, monkeypatch):
    import overlapc.passes.pipeline as pipeline
    gm = trace(uneven_gathers, (4, 16), (2, 16), (2,), (1, 16, 2), (3, 16))
    names = [n.name for n in gm.graph.nodes]
    code = gm.code

    def broken_core(*args, **kwargs):   # fails after bucket_collectives rewrote the graph, past degrading
        raise overlapc.ScheduleError("injected after bucketing")

    monkeypatch.setattr(pipeline, "_reorder", broken_core)
    with pytest.warns(UserWarning, match="injected after bucketing"):
        overlapc.schedule(gm, overlapc.OverlapConfig(bucket="module"))
    assert [n.name for n in gm.graph.nodes] == names and gm.code == code
    assert "overlapc_buckets" not in gm.meta and "overlapc_unscheduled_order" not in gm.meta
    gm.graph.lint()


def _graph_rows(graph: fx.Graph) -> list:
    """Each node's op, target, name, type, argument names and meta: what a rebuild must reproduce."""
    return [(n.op, n.target, n.name, n.type, str(fx.map_arg((n.args, n.kwargs), lambda a: a.name)), dict(n.meta))
            for n in graph.nodes]


def test_snapshot_rebuilds_what_a_copy_of_the_graph_rebuilds(fake_pg):
    """The rollback's Snapshot against the straightforward way (a deep copy of the graph,
    copied back with graph_copy): after bucketing erased, added and rewired nodes and set
    meta, both rebuild the same nodes, names, arguments and meta, and the code they had."""
    from overlapc.passes.pipeline import Snapshot
    gm = trace(uneven_gathers, (4, 16), (2, 16), (2,), (1, 16, 2), (3, 16))
    code, rows = gm.code, _graph_rows(gm.graph)
    snapshot, copied = Snapshot(gm.graph), copy.deepcopy(gm.graph)
    assert bucket_collectives(gm, bucket="module")
    next(iter(gm.graph.nodes)).meta["overlapc_reason"] = "changed after the snapshot"

    def rebuilt(fill) -> fx.Graph:
        graph = fx.Graph()
        fill(graph)
        return graph

    by_snapshot = rebuilt(snapshot.rebuild)
    by_copy = rebuilt(lambda graph: graph.output(*graph.graph_copy(copied, {}, return_output_node=True)[:1]))
    assert _graph_rows(by_snapshot) == _graph_rows(by_copy) == rows
    assert fx.GraphModule(gm, by_snapshot).code == code


def test_new_copy_nodes_get_the_value_the_dispatcher_gives(fake_pg):
    """FakeValues calls pack's and unpack_columns' fake implementations directly; the
    values equal what running the operators in the fake mode gives (shape, stride, dtype,
    device, a FakeTensor of the graph's mode)."""
    from overlapc.passes.rewrite import FakeValues
    gm = trace(uneven_gathers, (4, 16), (2, 16), (2,), (1, 16, 2), (3, 16))
    fake = FakeValues(gm)
    x, w1, b1 = [n for n in gm.graph.nodes if n.op == "placeholder"][:3]
    calls = [(torch.ops.overlapc.pack.default, ([x, w1, b1], 1)),
             (torch.ops.overlapc.pack.default, ([x, w1], 2)),
             (torch.ops.overlapc.unpack_columns.default, (x, [0, 4], [4, 12]))]   # x: (4, 16), 4 rows
    for target, args in calls:
        got = fake.run(target, args, {})
        values = torch.utils._pytree.tree_map(lambda a: fake.of(a) if isinstance(a, fx.Node) else a, args)
        with fake.mode:
            expected = target(*values)
        assert got.fake_mode is expected.fake_mode is fake.mode
        assert (got.shape, got.stride(), got.dtype, got.device) == (expected.shape, expected.stride(),
                                                                     expected.dtype, expected.device)


# ------------------------------------------------------------------ identical collectives


def test_identical_gathers_of_one_activation_become_one(fake_pg):
    """DTensor gathers the same activation once per ColwiseParallel(input_layouts=Shard)
    projection: the three all-gathers become one, its wait before the first consumer."""
    from overlapc.passes.bucket import merge_duplicates

    def qkv(x, wq, wk, wv):
        return [wait(ag(x)) @ w for w in (wq, wk, wv)]
    gm = trace(qkv, (4, 16), (16, 8), (16, 8), (16, 8))
    original = copy.deepcopy(gm)
    merged = merge_duplicates(gm)
    assert merged == [("all_gather_into_tensor", "all_gather_into_tensor_1", "all_gather_into_tensor_2")]
    assert gm.meta["overlapc_duplicates"] == merged
    assert count(gm, AG) == 1 and count(gm, F.wait_tensor.default) == 1
    gm.recompile()
    assert_same_values(original, gm)
    names = [n.name for n in gm.graph.nodes]
    first_mm = next(n.name for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    assert names.index("wait_tensor") < names.index(first_mm)
    scheduled = copy.deepcopy(original)
    overlapc.schedule(scheduled, overlapc.OverlapConfig(on_error="raise"))
    assert count(scheduled, AG) == 1
    overlapc.verify(scheduled)
    assert_same_values(original, scheduled)


def test_waits_that_cse_repeats_become_one_and_the_gather_joins_a_bucket(fake_pg, caplog):
    """A parametrization that gathers its parameter at every read (SimpleFSDP's), read
    twice: AOTAutograd's CSE (torch 2.14's ``fx_graph_cse``; 2.13's merges the waits too)
    leaves one all-gather with a wait per read; a pass waits one of them again. Built here
    as CSE leaves it. The waits become the first one, values stay, and the gather buckets
    with the other parameter's."""
    from overlapc.passes.duplicates import merge_repeated_waits

    def parametrized(bias, weight, x):
        gathered = ag(bias)
        wait(gathered)                          # the `self.bias is not None` read
        b = wait(wait(gathered))                # the add's read, waited again
        return x @ x + b.reshape(4, 4) + wait(ag(weight)).reshape(4, 4)
    gm = trace(parametrized, (2,), (2,), (4, 4))
    assert count(gm, AG) == 2 and count(gm, F.wait_tensor.default) == 4
    again = [n for n in gm.graph.nodes if n.target == F.wait_tensor.default][2]
    original = copy.deepcopy(gm)

    with caplog.at_level(logging.INFO, logger="overlapc"):
        merged = merge_repeated_waits(gm)
    assert merged == [("wait_tensor", "wait_tensor_1", again.name)], merged
    assert "made 2 repeated waits one" in caplog.text
    assert count(gm, F.wait_tensor.default) == 2
    gm.recompile()
    assert_same_values(original, gm)

    scheduled = copy.deepcopy(original)
    # no byte budget: under "serial-peak" this tiny graph's peak has no room for a bucket
    cfg = overlapc.OverlapConfig(bucket=DEFAULT_BUCKET_BYTES, max_in_flight=None, max_in_flight_bytes=None,
                                 on_error="raise")
    overlapc.schedule(scheduled, cfg)
    assert [len(note.members) for note in scheduled.meta["overlapc_buckets"]] == [2]
    assert count(scheduled, F.wait_tensor.default) == 1
    overlapc.verify(scheduled, cfg)
    assert_same_values(original, scheduled)


def test_regathers_across_other_collectives_barriers_or_groups_stay(fake_pg, two_groups):
    """The same shard gathered again after other collectives of its group (FSDP's
    re-gather, tied weights) or a barrier, or gathered in another group, is not merged:
    merging would hold the gathered result from the first use to the last."""
    from overlapc.passes.bucket import merge_duplicates
    other = two_groups[0].group_name

    def regather(x, w, z, y):
        a = x @ wait(ag(w)).t()
        b = a @ wait(ag(y)).t()                     # another collective of the group
        c = b @ wait(ag(w)).t()
        torch.ops.aten.add_(z, 1)                   # a barrier
        d = c @ wait(ag(w)).t()
        e = wait(F.all_gather_into_tensor(w, WORLD, other)).sum()   # another group
        return d + e + wait(ag(w)).sum(), z
    gm = trace(regather, (4, 16), (2, 16), (2,), (2, 16))
    # only the last two gathers of w in group "0" stand together (the other group's is
    # not of that group): they merge, the others stay
    merged = merge_duplicates(gm)
    assert merged == [("all_gather_into_tensor_3", "all_gather_into_tensor_5")], merged
    assert count(gm, AG) == 5


def test_a_gather_nothing_reads_is_erased_when_repeated_later(fake_pg, caplog):
    """torch 2.14's min-cut partitioner gathers MHA's in_proj weight and bias twice
    in the forward and reads only the second gather: the unread one goes, values
    stay; an unread gather that nothing repeats, and a read one, stay."""
    from overlapc.passes.bucket import merge_duplicates

    def twice(x, w, v):
        wait(ag(w))                     # unread, repeated below
        wait(ag(v))                     # unread, never repeated
        y = torch.relu(x)
        return y @ wait(ag(w)).t()
    gm = trace(twice, (4, 16), (2, 16), (2, 16))
    original = copy.deepcopy(gm)
    with caplog.at_level(logging.INFO, logger="overlapc"):
        merged = merge_duplicates(gm)
    assert merged == [("all_gather_into_tensor_2", "all_gather_into_tensor")], merged
    assert count(gm, AG) == 2 and count(gm, F.wait_tensor.default) == 2
    gathered = [n.args[0].name for n in gm.graph.nodes if n.target == AG]
    assert gathered == ["v_1", "w_1"], gathered
    assert "all_gather_into_tensor (again as all_gather_into_tensor_2)" in caplog.text
    gm.recompile()
    assert_same_values(original, gm)
    scheduled = copy.deepcopy(original)
    overlapc.schedule(scheduled, overlapc.OverlapConfig(on_error="raise"))
    assert count(scheduled, AG) == 2
    overlapc.verify(scheduled)


def test_the_transformer_forward_compiled_by_inductor_gathers_each_parameter_once(fake_pg):
    """The demo's model (nn.TransformerEncoderLayer blocks), sharded and compiled
    through Inductor: the scheduled forward gathers every parameter shard once
    (torch 2.14's partitioner emits two gathers of each MHA in_proj parameter) and
    no graph falls back to the unscheduled order."""
    import overlapc.backend as backend
    import overlapc.fsdp
    from overlapc.cli.demo import TinyTransformer
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = overlapc.fsdp.shard(TinyTransformer(2, 32, 4), mesh)
    graphs = []
    records = lambda record: graphs.append(record.gm)   # noqa: E731
    real = backend.SchedulePass.__init__

    def with_sink(self, cfg, sink=None):
        real(self, cfg, records)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):   # on_error="raise": no fallback
        backend.SchedulePass.__init__ = with_sink
        try:
            compiled = torch.compile(model, backend="overlapc", options={"check_ranks": False, "on_error": "raise"})
            compiled(torch.randn(2, 8, 32)).sum().backward()
        finally:
            backend.SchedulePass.__init__ = real
            torch._dynamo.reset()
    shards = [p.name for n in graphs[0].graph.nodes if n.target == AG for p in _placeholders_behind(n.args[0])]
    assert len(shards) == 26 and len(set(shards)) == len(shards), shards   # 13 per block, each once


def _placeholders_behind(node):
    """The graph inputs a node is computed from (a bucket's cat reads several shards)."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if current.op == "placeholder":
            found.append(current)
        stack.extend(current.all_input_nodes)
    return found


def four_projections(x, a, b, c, d):
    for _ in range(4):   # kernels (extern matmuls) before the first gathered weight is read: see lead
        x = x @ x.permute(1, 0) @ x
    y = x @ wait(ag(a)).permute(1, 0)
    y = y @ wait(ag(b)).permute(1, 0)
    y = y @ wait(ag(c)).permute(1, 0)
    return (y @ wait(ag(d)).permute(1, 0),)   # Inductor compiles graphs that return a tuple


def test_inductor_generates_no_kernel_for_a_buckets_copies(fake_pg):
    """Inductor's code for a bucket of four all-gathers read by matmuls (extern calls, no
    kernel of their own): the copy-in and the copy-out are calls of overlapc's two ops, in
    that order around the collective, and no kernel is generated for them (a ``cat`` made a
    kernel per member; each kernel is compiled code, so they cost compile time)."""
    import re
    import types
    from unittest import mock

    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering

    _, gm, notes = bucketed(four_projections, (4, 16), (2, 16), (2, 16), (2, 16), (2, 16), bucket=1 << 20)
    assert len(notes) == 1 and len(notes[0].members) == 4
    codes = []

    def keep_code(self):   # code generation only: no C++ compile, nothing runs
        codes.append(self.codegen()[0].value)
        return types.SimpleNamespace(call=lambda *args, **kwargs: None, __file__="<kept>")
    torch.manual_seed(0)
    inputs = [torch.randn(4, 16)] + [torch.randn(2, 16) for _ in range(4)]
    with mock.patch.object(GraphLowering, "compile_to_module", keep_code), \
            torch._inductor.config.patch(fx_graph_cache=False):
        compile_fx_inner(gm, inputs)
    code, = codes
    assert re.findall(r"^\s+(cpp_fused\w*)\(", code, re.M) == []
    calls = re.findall(r"torch\.ops\.(overlapc\.\w+|_c10d_functional\.\w+)\.default\(", code)
    assert calls == ["overlapc.pack", "_c10d_functional.all_gather_into_tensor", "_c10d_functional.wait_tensor",
                     "overlapc.unpack_columns"], calls


# ------------------------------------------------------------------ buckets under the serial peak


def _gathers_at_the_peak(x, a, b):
    """The gathered weights' consumers run while a large result lives (a graph output):
    they are the graph's peak, where a bucket's copies (twice the bucket) have no room."""
    big = x.repeat(64, 1)
    h = lead(x)
    return (x + h) @ wait(ag(a)).t() @ wait(ag(b)).t(), big


def _gathers_after_the_peak(x, a, b):
    """The same gathers after the large result has died: room for the bucket's copies."""
    s = x.repeat(64, 1).sum() + lead(x)
    return (x + s) @ wait(ag(a)).t() @ wait(ag(b)).t()


@pytest.mark.parametrize("fn, forms", [(_gathers_at_the_peak, False), (_gathers_after_the_peak, True)])
def test_serial_peak_buckets_only_where_their_copies_fit(fake_pg, fn, forms):
    """Under the default "serial-peak" budget a bucket (here of any size: ``bucket=1 MiB``)
    forms only where its copies keep the unbucketed graph's serial peak; the "auto" budget
    buckets both graphs. Either way the
    scheduled peak (counted independently) stays within the unbucketed serial order's."""
    shapes = (4, 16), (2, 16), (2, 16)
    reference = serial_peak(trace(fn, *shapes))
    gm = trace(fn, *shapes)
    result = overlapc.passes.pipeline.run(gm, overlapc.OverlapConfig(bucket=1 << 20, on_error="raise"))
    assert bool(result.buckets) is forms
    assert live_peak(list(gm.graph.nodes), overlapc.collectives(gm)) <= reference
    overlapc.verify(gm)
    spent = trace(fn, *shapes)
    assert overlapc.passes.pipeline.run(spent, overlapc.OverlapConfig(bucket=1 << 20, max_in_flight_bytes="auto",
                                                                      on_error="raise")).buckets


# ------------------------------------------------------------------ buckets keep hiding intervals


def _hiding_kernel_reads_a_member(a, b, w):
    """b's gather can hide under the matmul that reads a's result: one bucket would be waited
    before it (upstream's test_no_bucketing_with_dependent_hiding_nodes)."""
    g1 = wait(ag(a))
    mm2 = g1[:2] @ w
    g2 = wait(ag(b))
    return mm2.sum() + g2.sum()


def _input_from_a_hiding_kernel(a, w):
    """The second gather's input is the matmul that can hide the first: one bucket would be
    issued after it (upstream's test_no_bucketing_when_collective_depends_on_hiding_node)."""
    g1 = wait(ag(a))
    mm1 = a @ w
    g2 = wait(ag(mm1 * 2))
    return g1.sum() * g2.sum()


def _nested_interval(a, b, w):
    """The first gather's result is needed by the matmul that can hide the second
    (upstream's test_cant_bucket_nested_hiding_intervals)."""
    h1, h2 = ag(a), ag(b)
    g2 = wait(h2)
    mm1 = (w + g2[:2, :2]) @ w
    return wait(h1).sum() + mm1.sum()


def _shared_window(a, b, w):
    """Both gathers are waited after both matmuls: a bucket loses nothing
    (upstream's test_can_bucket_independent_collectives)."""
    h1, h2 = ag(a), ag(b)
    mm1, mm2 = w @ w, (w + 1) @ w
    return wait(h1).sum() + wait(h2).sum() + mm1.sum() + mm2.sum()


def _exposed_with_hidden(a, b, c, w):
    """One matmul, three gathers read after it: it hides one of them, alone or bucketed
    (upstream's test_bucket_exposed_with_hidden_single_overlap)."""
    mm = w @ w
    return wait(ag(a)).sum() + wait(ag(b)).sum() + wait(ag(c)).sum() + mm.sum()


@pytest.mark.parametrize("bucket", ["module", 1 << 20])
@pytest.mark.parametrize("fn, shapes, merged", [
    (_hiding_kernel_reads_a_member, ((2, 2), (2, 2), (2, 2)), False),
    (_input_from_a_hiding_kernel, ((2, 2), (2, 2)), False),
    (_nested_interval, ((2, 2), (2, 2), (2, 2)), False),
    (_shared_window, ((2, 2), (2, 2), (2, 2)), True),
    (_exposed_with_hidden, ((2, 2), (2, 2), (2, 2), (2, 2)), True),
])
def test_a_bucket_never_loses_a_members_hiding_kernel(fake_pg, bucket, fn, shapes, merged):
    """In every bucket mode, members whose bucket would lose a kernel one of them could hide
    under stay apart; members whose common window keeps what they had merge."""
    original, gm, notes = bucketed(lambda *xs: (fn(*xs),), *shapes, bucket=bucket)
    assert bool(notes) is merged, [n.members for n in notes]
    assert_same_values(original, gm)


def test_auto_buckets_keep_hiding_kernels_too(fake_pg):
    """``bucket="auto"`` (small members under the group's largest): the same rule."""
    def small_and_large(a, b, big, w):
        g1 = wait(ag(a))
        mm2 = g1[:2] @ w                 # can hide b's gather, but reads a's
        return mm2.sum() + wait(ag(b)).sum() + wait(ag(big)).sum()
    _, _, notes = bucketed(small_and_large, (2, 2), (2, 2), (16, 16), (2, 2), bucket="auto")
    assert notes == []
    _, _, notes = bucketed(_shared_window, (2, 2), (2, 2), (2, 2), bucket="auto")
    assert notes == []   # two equal members: "auto" caps a bucket at the largest, as before
    _, _, notes = bucketed(lambda a, b, big, w: _shared_window(a, b, w) + wait(ag(big)).sum(),
                           (2, 2), (2, 2), (16, 16), (2, 2), bucket="auto")
    assert [n.members for n in notes] == [("all_gather_into_tensor", "all_gather_into_tensor_1")]


@st.composite
def kernel_programs(draw):
    """A chain of matmuls and pointwise ops on ``w``, with gathers read between them; a
    gather's input is a graph input or an earlier matmul's result."""
    steps = draw(st.lists(st.sampled_from(["mm", "add", "gather", "use"]), min_size=3, max_size=14))
    return dict(steps=steps, from_mm=draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps))),
                bucket=draw(st.sampled_from(["module", 1 << 20, 200])))


def kernel_program(p):
    def fn(w, *shards):
        pending, out, mm = [], w.sum() * 0, None
        for i, step in enumerate(p["steps"]):
            if step == "mm":
                w = mm = torch.tanh(w @ w.t())   # a kernel, and a pointwise op that keeps values finite
            elif step == "add":
                w = w + 1
            elif step == "gather":
                source = mm if p["from_mm"][i] and mm is not None else shards[i]
                pending.append(ag(source))
            elif pending:
                out = out + wait(pending.pop(0)).sum() * w[0, 0]
        for h in pending:
            out = out + wait(h).sum()
        return (out + w.sum(),)
    return fn


def _window(gm, start_name):
    """(position of the last node the gather's input is, position of its wait's first
    reader that is no view), read off ``gm`` as it stands."""
    nodes = list(gm.graph.nodes)
    start = next(n for n in nodes if n.name == start_name)
    wait_node = next(iter(start.users))
    readers = [u for u in wait_node.users]
    while any(u.target in VIEWS for u in readers):
        readers = [v for u in readers for v in (u.users if u.target in VIEWS else [u])]
    return nodes.index(start.args[0]), min(nodes.index(u) for u in readers)


@settings(max_examples=int(os.environ.get("OVERLAPC_EXAMPLES", "50")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=kernel_programs())
def test_random_buckets_keep_a_matmul_for_each_member_that_had_one(fake_pg, p):
    """Counted on the graph before bucketing, independently of the pass: every bucket's
    common window (last input ready, first result needed) holds at least as many matmuls
    as the bucket's bytes in units of the largest gather, or as many as its members'
    windows together hold, whichever is fewer; the values stay the same."""
    gm = trace(kernel_program(p), (2, 2), *[(2, 2)] * len(p["steps"]))
    original = copy.deepcopy(gm)
    largest = max((n.meta["val"].numel() * 4 for n in gm.graph.nodes if n.target == AG), default=0)
    notes = bucket_collectives(gm, p["bucket"])
    gm.recompile()
    mms = [i for i, n in enumerate(original.graph.nodes) if n.target == torch.ops.aten.mm.default]
    for note in notes:
        windows = [_window(original, name) for name in note.members]
        low, high = max(r for r, _ in windows), min(t for _, t in windows)
        first, last = min(r for r, _ in windows), max(t for _, t in windows)
        kept = sum(low < i < high for i in mms)
        assert kept >= min(-(-note.nbytes // largest), sum(first < i < last for i in mms)), (note, windows)
    assert_same_values(original, gm)


# ------------------------------------------------------------------ chained collectives


def test_chained_all_reduces_bucket_by_level(fake_pg):
    """Two independent chains of two all-reduces (loss-parallel cross-entropy: a sum of
    exponentials, then the result that reads it), in coalesced buckets: the first level
    merges, the second merges, never a level with the one that reads it (upstream's
    test_manual_bucket_splits_dependent_all_reduce); packed, no chain is a member."""
    def two_chains(a, b, c, d):
        s0, s1 = wait(F.all_reduce(a, "sum", "0")), wait(F.all_reduce(b, "sum", "0"))
        r0, r1 = wait(F.all_reduce(s0 + c, "sum", "0")), wait(F.all_reduce(s1 + d, "sum", "0"))
        return (r0.sum() + r1.sum(),)
    for bucket in ("module", 1 << 20):
        assert bucketed(two_chains, *[(4, 4)] * 4, bucket=bucket)[2] == []
        original, gm, notes = bucketed(two_chains, *[(4, 4)] * 4, bucket=bucket, coalesced=True)
        assert [n.members for n in notes] == [("all_reduce", "all_reduce_1"), ("all_reduce_2", "all_reduce_3")]
        assert_same_values(original, gm, exact=False)
        overlapc.schedule(gm, overlapc.OverlapConfig(bucket=None, on_error="raise"))
        overlapc.verify(gm)


def test_both_levels_of_hsdp_chains_bucket(fake_pg):
    """HSDP's reduce-scatter -> all-reduce, twice, in coalesced buckets: the reduce-scatters
    merge, and the all-reduces, whose inputs are the reduce-scatters' waits themselves, merge
    reading the first bucket's results."""
    def hsdp(a, b):
        s0 = wait(F.reduce_scatter_tensor(a, "sum", WORLD, "0"))
        s1 = wait(F.reduce_scatter_tensor(b, "sum", WORLD, "0"))
        return wait(F.all_reduce(s0, "avg", "0")), wait(F.all_reduce(s1, "avg", "0"))
    original, gm, notes = bucketed(hsdp, (16, 4), (8, 4), bucket=1 << 20, coalesced=True)
    assert [(n.kind, n.members) for n in notes] == [
        ("reduce_scatter", ("reduce_scatter_tensor", "reduce_scatter_tensor_1")),
        ("all_reduce", ("all_reduce", "all_reduce_1"))]
    assert_same_values(original, gm, exact=False)
    overlapc.schedule(gm, overlapc.OverlapConfig(bucket=None, on_error="raise"))
    overlapc.verify(gm)


@st.composite
def chain_forests(draw):
    """Chains of all-reduces, or a reduce-scatter then all-reduces (each level reads the
    previous level's result, directly or plus an input)."""
    return dict(depths=draw(st.lists(st.integers(1, 3), min_size=1, max_size=4)),
                direct=draw(st.booleans()),   # a level reads the previous wait itself, or through compute
                head=draw(st.sampled_from(["all_reduce", "reduce_scatter"])),   # HSDP: reduce-scatter first
                bucket=draw(st.sampled_from(["module", 1 << 20, 64, "auto"])),
                coalesced=draw(st.booleans()))


def chain_forest(p):
    """The chains level by level (every chain's first collective, then every second one:
    HSDP's order), each chain ending with an input added."""
    def fn(*xs):
        it = iter(xs)
        values = [next(it) for _ in p["depths"]]
        for level in range(max(p["depths"])):
            for i, depth in enumerate(p["depths"]):
                if level >= depth:
                    continue
                x = values[i] if p["direct"] or level == 0 else values[i] * 0.5
                if level == 0 and p["head"] == "reduce_scatter":
                    values[i] = wait(F.reduce_scatter_tensor(x, "sum", WORLD, "0"))   # (8, 4) -> (1, 4)
                else:
                    values[i] = wait(F.all_reduce(x, "sum", "0"))
        return tuple(v + next(it) for v in values)
    return fn


@settings(max_examples=int(os.environ.get("OVERLAPC_EXAMPLES", "50")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=chain_forests())
def test_random_chains_bucket_only_independent_collectives(fake_pg, p):
    """On the graph before bucketing, no bucket holds a collective and one that reads its
    result (through any path), and packed, no collective of a chain; the values stay the same
    and the schedule verifies."""
    gm = trace(chain_forest(p), *[(8, 4)] * (2 * len(p["depths"])))
    original = copy.deepcopy(gm)
    notes = bucket_collectives(gm, p["bucket"], coalesced=p["coalesced"])
    gm.recompile()
    starts = {n.name: n for n in original.graph.nodes}
    for note in notes:
        members = [starts[name] for name in note.members]
        for m in members:
            assert not any(other in ancestors(m) for other in members if other is not m), note
        if not p["coalesced"]:   # no member reads, or is read by, another collective
            collectives = [n for n in original.graph.nodes if n.target in (F.all_reduce.default,
                                                                            F.reduce_scatter_tensor.default)]
            for m in members:
                assert not any(c in ancestors(m) or m in ancestors(c) for c in collectives if c is not m), note
    assert_same_values(original, gm, exact=False)
    overlapc.schedule(gm, overlapc.OverlapConfig(bucket=None, on_error="raise"))
    overlapc.verify(gm)

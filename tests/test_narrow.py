"""passes/narrow.py: narrowing casts moved before their all-gathers (issue 42).

Values are checked on simulated ranks: ``run_ranks_locally`` runs a graph for
every rank in lockstep with each rank's own shard, all-gathers concatenating
and all-reduces combining the ranks' values, so an amax that only one rank's
shard holds must reach every rank (the fake process group returns a rank's own
values and cannot show that). Graphs are traced with make_fx under the fake
process group (``conftest.fake_pg``, world size 8).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

import overlapc
from overlapc.passes.narrow import narrow_gathers

F = torch.ops._c10d_functional
WORLD = 8
E4M3 = torch.float8_e4m3fn
_REDUCE = {"max": lambda t: t.amax(0), "sum": lambda t: t.sum(0), "min": lambda t: t.amin(0)}


def run_ranks_locally(gm, per_rank):
    """``gm``'s outputs on every rank (a list by rank), ``per_rank[r]`` rank r's inputs."""
    envs = [{} for _ in per_rank]
    inputs = [iter(args) for args in per_rank]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            for env, args in zip(envs, inputs):
                env[node] = next(args)
        elif node.op == "get_attr":
            for env in envs:
                env[node] = getattr(gm, node.target)
        elif node.op == "output":
            return [tree_map(lambda n: env[n] if isinstance(n, torch.fx.Node) else n, node.args[0]) for env in envs]
        elif node.target is F.all_gather_into_tensor.default:
            whole = torch.cat([env[node.args[0]] for env in envs])
            for env in envs:
                env[node] = whole.clone()
        elif node.target is F.all_reduce.default:
            whole = _REDUCE[node.args[1]](torch.stack([env[node.args[0]] for env in envs]))
            for env in envs:
                env[node] = whole.clone()
        elif node.target is F.wait_tensor.default:
            for env in envs:
                env[node] = env[node.args[0]]
        else:
            for env in envs:
                args, kwargs = tree_map(lambda n: env[n] if isinstance(n, torch.fx.Node) else n,
                                        (node.args, node.kwargs))
                env[node] = node.target(*args, **kwargs)
    raise AssertionError("graph without output")


def _bits(value):
    """Bit patterns of a tensor (float8 included), for exact comparison with NaNs."""
    if not isinstance(value, torch.Tensor):
        return value
    wide = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()]
    return value.contiguous().view(wide)


def _same(a, b) -> bool:
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in zip(flat_a, flat_b))


def _gathered(shard, dtype=torch.bfloat16, group="0"):
    return F.wait_tensor(F.all_gather_into_tensor(shard.to(dtype), WORLD, group))


def _float8_weight(shard, x):
    """torchao's dynamic per-tensor scaling of a gathered weight, and a use of it."""
    w = _gathered(shard).t()
    amax = w.abs().max().to(torch.float64).clamp(min=1e-12)
    scale = (448.0 / amax).to(torch.float32)
    w8 = (w.to(torch.float32) * scale).clamp(-448, 448).to(E4M3)
    return w8, scale.reciprocal(), x * 2


def _shards(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).mul(1 + 3 * r).to(dtype) for r in range(WORLD)]


def _check_equal(fn, shard_shape, extra_shapes=(), seed=0):
    """Trace ``fn``, rewrite a copy, compare every rank's outputs; the rewrite's result."""
    shards = _shards(shard_shape, seed)
    extras = [torch.randn(s) for s in extra_shapes]
    gm = make_fx(fn)(shards[0], *extras)
    expected = run_ranks_locally(gm, [(s, *extras) for s in shards])
    result = narrow_gathers(gm)
    gm.recompile()
    got = run_ranks_locally(gm, [(s, *extras) for s in shards])
    assert all(_same(a, b) for a, b in zip(got, expected)), "rewritten values differ"
    return gm, result


def _count(gm, target, dtype=None):
    return sum(n.target is target and (dtype is None or n.meta["val"].dtype == dtype) for n in gm.graph.nodes)


def test_float8_weight_gathers_uint8_bits_after_a_max_all_reduce(fake_pg):
    gm, result = _check_equal(_float8_weight, (4, 16), [(2, 3)])
    assert [(n.dtype, n.wire, n.bytes_before, n.bytes_after, n.amaxes) for n in result.rewritten] == \
        [("float8_e4m3fn", "uint8", 32 * 16 * 2, 32 * 16, 1)]
    assert _count(gm, F.all_gather_into_tensor.default) == _count(gm, F.all_gather_into_tensor.default,
                                                                  torch.uint8) == 1
    assert _count(gm, F.all_reduce.default) == result.amax_reduces == 1
    reduce = next(n for n in gm.graph.nodes if n.target is F.all_reduce.default)
    assert reduce.args[1:] == ("max", "0") and reduce.meta["val"].dtype == torch.int32


def test_the_amax_one_rank_holds_reaches_every_rank(fake_pg):
    shards = _shards((4, 16), 1)
    shards[5][2, 3] = -1e4   # the weight's amax lives on rank 5 only
    gm = make_fx(_float8_weight)(shards[0], torch.randn(2, 3))
    x = torch.randn(2, 3)
    expected = run_ranks_locally(gm, [(s, x) for s in shards])
    narrow_gathers(gm)
    got = run_ranks_locally(gm, [(s, x) for s in shards])
    assert all(_same(a, b) for a, b in zip(got, expected))
    assert all(_same(got[0], g) for g in got), "every rank computes the same float8 weight"


def test_a_nan_on_one_rank_makes_every_rank_nan_as_before(fake_pg):
    shards = _shards((4, 16), 2)
    shards[3][0, 0] = float("nan")
    gm = make_fx(_float8_weight)(shards[0], torch.randn(2, 3))
    x = torch.randn(2, 3)
    expected = run_ranks_locally(gm, [(s, x) for s in shards])
    narrow_gathers(gm)
    got = run_ranks_locally(gm, [(s, x) for s in shards])
    assert all(torch.isnan(g[1]).item() and torch.isnan(e[1]).item() for g, e in zip(got, expected))
    assert all(_same(g[0], e[0]) for g, e in zip(got, expected))


def test_a_plain_narrowing_cast_gathers_the_narrow_dtype_without_all_reduce(fake_pg):
    def fn(shard, x):
        return x.to(torch.bfloat16) @ _gathered(shard, torch.float32).t().to(torch.bfloat16)
    gm, result = _check_equal(fn, (2, 8), [(3, 8)])
    assert [(n.dtype, n.wire, n.amaxes) for n in result.rewritten] == [("bfloat16", "bfloat16", 0)]
    assert _count(gm, F.all_gather_into_tensor.default, torch.bfloat16) == 1
    assert _count(gm, F.all_reduce.default) == 0


def test_amaxes_of_one_group_share_one_all_reduce_and_groups_get_their_own(fake_pg, two_groups):
    other = two_groups[0].group_name

    def fn(a, b, c):
        out = []
        for shard, group in ((a, "0"), (b, "0"), (c, other)):
            w = _gathered(shard, group=group)
            scale = (448.0 / w.abs().max().to(torch.float64).clamp(min=1e-12)).to(torch.float32)
            out.append((w.to(torch.float32) * scale).clamp(-448, 448).to(E4M3))
        return out
    gm = make_fx(fn)(torch.randn(2, 8), torch.randn(4, 8), torch.randn(2, 4))
    result = narrow_gathers(gm)
    reduces = [n for n in gm.graph.nodes if n.target is F.all_reduce.default]
    assert len(result.rewritten) == 3 and result.amax_reduces == 2
    assert sorted((n.args[2], n.meta["val"].shape[0]) for n in reduces) == sorted([("0", 2), (other, 1)])


@pytest.mark.parametrize("case, reason", [
    ("full_width", "reads the gathered value at full width"),
    ("scaled_amax", "of a scaled value"),
    ("activation_scale", "a scale reads"),
    ("sin_amax", "not of the value's abs"),
    ("uneven", "reads the gathered value at full width"),
])
def test_what_it_cannot_prove_stays_with_a_reason(fake_pg, case, reason):
    def full_width(shard, x):
        w = _gathered(shard, torch.float32)
        return w.to(torch.bfloat16), w.sum()

    def scaled_amax(shard, x):
        w = _gathered(shard) * x.sum()
        scale = (448.0 / w.abs().max().to(torch.float32))
        return (w.to(torch.float32) * scale).to(E4M3)

    def activation_scale(shard, x):
        w = _gathered(shard)
        return (w.to(torch.float32) * x.abs().max()).to(E4M3)

    def sin_amax(shard, x):   # rounding does not commute with sin: a fused bf16 cast could change the max
        w = _gathered(shard)
        scale = 448.0 / w.sin().abs().max().to(torch.float32)
        return (w.to(torch.float32) * scale).to(E4M3)

    def uneven(shard, x):   # DTensor's padded gather: a slice drops the other ranks' padding
        return _gathered(shard, torch.float32)[:13].to(torch.bfloat16)
    fn = locals()[case]
    gm = make_fx(fn)(torch.randn(2, 8), torch.randn(3))
    before = [n.name for n in gm.graph.nodes]
    result = narrow_gathers(gm)
    assert not result.rewritten and [n.name for n in gm.graph.nodes] == before
    assert len(result.skipped) == 1 and reason in result.skipped[0].reason, result.skipped


def test_gathers_without_a_narrowing_cast_are_not_candidates(fake_pg):
    def fn(shard, x):
        return x @ _gathered(shard, torch.bfloat16).t(), _gathered(shard, torch.float32).to(torch.float64)
    gm = make_fx(fn)(torch.randn(2, 8), torch.randn(3, 8).to(torch.bfloat16))
    result = narrow_gathers(gm)
    assert result == type(result)()   # nothing rewritten, nothing worth a reason


def test_the_pipeline_schedules_the_rewritten_graph_and_reports_it(fake_pg):
    def fn(a, b, x):
        for shard in (a, b):
            w8, inv, _ = _float8_weight(shard, x)
            x = torch._scaled_mm(x.to(E4M3), w8, torch.tensor(1.0), inv, out_dtype=torch.bfloat16).float()
        return x
    gm = make_fx(fn)(torch.randn(4, 32), torch.randn(4, 32), torch.randn(16, 32))
    reference = make_fx(fn)(torch.randn(4, 32), torch.randn(4, 32), torch.randn(16, 32))
    result = overlapc.passes.pipeline.run(gm, overlapc.OverlapConfig(on_error="raise"))
    assert len(result.narrowed.rewritten) == 2 and result.error is None
    overlapc.verify(gm)
    shards = [(a, b, torch.randn(16, 32)) for a, b in zip(_shards((4, 32), 3), _shards((4, 32), 4))]
    shards = [(a, b, shards[0][2]) for a, b, _ in shards]
    assert all(_same(g, e) for g, e in zip(run_ranks_locally(gm, shards), run_ranks_locally(reference, shards)))
    off = make_fx(fn)(torch.randn(4, 32), torch.randn(4, 32), torch.randn(16, 32))
    assert overlapc.passes.pipeline.run(off, overlapc.OverlapConfig(narrow_gathers=False)).narrowed is None
    assert _count(off, F.all_gather_into_tensor.default, torch.bfloat16) == 2


def test_the_option_is_validated():
    with pytest.raises(ValueError, match="narrow_gathers must be True"):
        overlapc.OverlapConfig(narrow_gathers="yes")
    with pytest.raises(ValueError, match="narrow_gathers"):
        overlapc.OverlapConfig.from_options({"narrow_gather": True})


_UNARY = {
    "neg": lambda v, s: -v,
    "abs": lambda v, s: v.abs(),
    "scale": lambda v, s: v * s,
    "clamp": lambda v, s: v.clamp(-3.0, 3.0),
    "add": lambda v, s: v + 0.25,
}
_VIEWS = {
    "t": lambda v: v.t() if v.dim() == 2 else v,
    "flat": lambda v: v.reshape(-1),
    "same": lambda v: v,
}


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), cols=st.sampled_from([1, 3, 8]), view=st.sampled_from(sorted(_VIEWS)),
       ops=st.lists(st.sampled_from(sorted(_UNARY)), max_size=3), wide=st.sampled_from([torch.float32, torch.bfloat16]),
       narrow=st.sampled_from([torch.bfloat16, torch.float16, E4M3, torch.float8_e5m2]),
       amax=st.booleans(), seed=st.integers(0, 2**16))
def test_random_chains_keep_every_rank_s_values(fake_pg, rows, cols, view, ops, wide, narrow, amax, seed):
    if narrow.itemsize >= wide.itemsize:
        narrow = E4M3

    def fn(shard, s):
        v = _VIEWS[view](_gathered(shard, wide)).to(torch.float32)
        scale = (448.0 / v.abs().max().to(torch.float64).clamp(min=1e-12)).to(torch.float32) if amax else s
        for op in ops:
            v = _UNARY[op](v, scale)
        return v.to(narrow), scale
    shards = _shards((rows, cols), seed)
    s = torch.tensor(0.5)
    gm = make_fx(fn)(shards[0], s)
    expected = run_ranks_locally(gm, [(x, s) for x in shards])
    result = narrow_gathers(gm)
    gm.recompile()
    assert len(result.rewritten) == 1 and result.rewritten[0].amaxes == int(amax), result
    got = run_ranks_locally(gm, [(x, s) for x in shards])
    assert all(_same(g, e) for g, e in zip(got, expected))
    gm.graph.lint()

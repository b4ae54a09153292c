"""In-place and out= writes: barriers only where what they write can be seen.

make_fx leaves decomposed ops in place (RMSNorm's ``add_(mean, eps)``). Such a
write into a temporary that nothing else aliases is compute: it keeps its place
in the compute order and collectives move across it. A write into a graph
input, a view of one, a graph output, or a tensor a collective reads or writes
(or a view of those) is a barrier. The property test runs random graphs full
of such writes with local stand-ins for the collectives: the scheduled graph's
values must be bit-exact, and which writes are barriers is decided here from
how each graph was built, not from overlapc's code.
"""
import itertools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import overlapc
from overlapc.collectives import role
from graphs import F, ag, body, trace, wait
from test_properties import LocalCollectives, check_count_with_pinned

aten = torch.ops.aten


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def _barrier(gm, name):
    return role(_node(gm, name))[2]


def rms_layers(x, w0, w1, w2):
    """Three layers of matmul -> RMSNorm written as make_fx leaves it (add_ in place)."""
    for w in (w0, w1, w2):
        x = x @ wait(ag(w)).t()
        mean = (x * x).mean(-1, keepdim=True)
        mean.add_(1e-6)
        x = x * torch.rsqrt(mean)
    return x


def test_in_place_on_a_temporary_is_compute_and_collectives_cross_it(fake_pg):
    gm = trace(rms_layers, (4, 16), (2, 16), (2, 16), (2, 16))
    writes = [n.name for n in gm.graph.nodes if n.target == aten.add_.Tensor]
    assert len(writes) == 3 and all(_barrier(gm, name) is None for name in writes)
    expected = LocalCollectives(gm).run(*_inputs(gm))
    before = [n for n in body(gm) if "all_gather" not in n and "wait" not in n]

    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=None, bucket=None, max_in_flight_bytes="auto",
                                                 on_error="raise"))

    order = body(gm)
    # every all-gather is issued before the first in-place write: none was held behind one
    assert max(order.index(n) for n in order if n.startswith("all_gather")) < order.index(writes[0]), order
    assert [n for n in order if "all_gather" not in n and "wait" not in n] == before   # compute order kept
    for a, b in zip(expected, LocalCollectives(gm).run(*_inputs(gm))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_out_variant_into_a_temporary_is_compute(fake_pg):
    def fn(x, w):
        buf = torch.empty(4, 16)
        torch.mul(x, 2, out=buf)
        return buf @ wait(ag(w))
    gm = trace(fn, (4, 16), (2, 16))
    out = next(n for n in gm.graph.nodes if n.target == aten.mul.out)
    assert role(out)[2] is None


def _writes(fn, *shapes):
    gm = trace(fn, *shapes)
    return {n.name: role(n)[2] for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable}


def test_in_place_on_a_graph_input_or_a_view_of_one_is_a_barrier(fake_pg):
    def fn(x, w):
        x.add_(1)
        w.view(-1).mul_(2)
        torch.mul(w, 3, out=w)
        return x @ wait(ag(w)).t()
    writes = _writes(fn, (4, 16), (2, 16))
    assert len(writes) == 3 and all(writes.values()), writes
    assert all("graph input" in why for why in writes.values()), writes


def test_in_place_on_an_output_or_a_view_of_one_is_a_barrier(fake_pg):
    def fn(x, w):
        y = x @ wait(ag(w)).t()
        z = y + 1
        z.mul_(2)
        v = y * 3
        v.t().add_(1)
        return z, v
    writes = _writes(fn, (4, 16), (2, 16))
    assert len(writes) == 2 and all("graph output" in why for why in writes.values()), writes


def test_in_place_on_what_a_collective_reads_or_writes_is_a_barrier(fake_pg):
    def fn(x, w):
        y = x * 2
        y.add_(1)                                  # then reduce-scattered
        rs = wait(F.reduce_scatter_tensor(y, "sum", 8, "0"))
        full = wait(ag(w))
        full.mul_(2)                               # an all-gather's result
        full.t().add_(1)                           # a view of it
        part = x * 3
        part.view(-1).add_(1)                      # a view of an all-reduce's input
        ar = wait(F.all_reduce(part, "sum", "0"))
        return (x @ full.t()).sum() + rs.sum() + ar.sum()
    writes = _writes(fn, (16, 16), (2, 16))
    assert len(writes) == 4 and all(writes.values()), writes


def test_a_temporary_a_moving_cast_reads_is_a_barrier(fake_pg):
    """A cast may travel with a collective start as its input chain: a write into
    what it reads would then change what is sent."""
    def fn(x):
        y = x * 2
        low = y.to(torch.bfloat16)
        y.add_(1)
        out = wait(F.all_reduce(low, "sum", "0"))
        return y, out
    writes = _writes(fn, (4, 16))
    assert len(writes) == 1 and all(writes.values()), writes


# -- random graphs full of in-place writes ------------------------------------------
@st.composite
def programs(draw):
    n = draw(st.integers(1, 5))
    flags = lambda: draw(st.lists(st.booleans(), min_size=n, max_size=n))  # noqa: E731
    return dict(n=n, group=draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),
                norm=flags(), view_write=flags(), out_write=flags(), rs=flags(), ar=flags(),
                input_write=flags(), output_write=flags(), span=flags())


def build(p, groups):
    """Layers of all-gather -> matmul -> in-place writes into temporaries (an RMSNorm's
    add_, a mul_ through a view, an out= op), some reduce-scatters and all-reduces, and
    writes into a graph input (``scratch``) or an output: the only barriers. ``span``: an
    all-gather started at the top of the layer and waited at its end, across the layer's
    compute and its write into ``scratch`` when there is one (then it stays where it
    stands, and counts against ``max_in_flight`` while open)."""
    def fn(x, scratch, *ws):
        outs = []
        for i in range(p["n"]):
            group = groups[p["group"][i]]
            spanning = ag(ws[i] * 1.5, group) if p["span"][i] else None
            x = torch.tanh(x @ wait(ag(ws[i], group)).t())
            if p["norm"][i]:
                mean = (x * x).mean(-1, keepdim=True)
                mean.add_(1e-6)
                x = x * torch.rsqrt(mean)
            if p["view_write"][i]:
                x = x + 1
                x.view(-1).mul_(0.5)
            if p["out_write"][i]:
                buf = torch.empty_like(x)
                torch.sub(x, 0.25, out=buf)
                x = buf
            if p["rs"][i]:
                outs.append(wait(F.reduce_scatter_tensor(x * 1, "sum", 8, group)))
            if p["ar"][i]:
                x = x + wait(F.all_reduce(x * 1, "sum", group))
            if p["input_write"][i]:
                scratch.add_(x.sum())
            if p["output_write"][i]:
                y = x * 2
                y.add_(1)
                outs.append(y)
            if spanning is not None:
                outs.append(wait(spanning))
        return (x, scratch.clone(), *outs)
    return fn


def _inputs(gm):
    torch.manual_seed(3)
    return [torch.randn(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]


def _expected_barriers(gm):
    """In-place / out= writes into ``scratch`` (the graph input) or into a tensor
    returned as an output, directly or through views and earlier in-place results:
    recognised from the graph, as ``build`` makes them."""
    mutating = lambda n: isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable  # noqa: E731

    def root(n):
        while isinstance(n, torch.fx.Node) and (mutating(n) or n.target in (aten.view.default, aten.t.default)):
            n = n.args[0] if not mutating(n) or "out" not in n.kwargs else n.kwargs["out"]
        return n
    scratch = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    seen = {scratch} | {root(n) for n in output.all_input_nodes}
    found = set()
    for n in gm.graph.nodes:
        if mutating(n) and root(n.kwargs.get("out", n.args[0])) in seen:
            found.add(n.name)
    return found


@settings(max_examples=int(os.environ.get("OVERLAPC_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=programs(), limit=st.sampled_from([1, 2, None]), byte_limit=st.sampled_from([None, 2048, "auto"]))
def test_random_graphs_full_of_in_place_writes_keep_their_values(fake_pg, two_groups, p, limit, byte_limit):
    groups = (fake_pg.group_name, two_groups[0].group_name)
    gm = trace(build(p, groups), (16, 16), (1,), *[(2, 16)] * p["n"])
    mutating = [n for n in gm.graph.nodes
                if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
    barriers = {n.name for n in mutating if role(n)[2] is not None}
    assert barriers == _expected_barriers(gm), [(n.name, role(n)[2]) for n in mutating]
    expected = LocalCollectives(gm).run(*_inputs(gm))
    compute = _compute_order(gm)

    cfg = overlapc.OverlapConfig(max_in_flight=limit, max_in_flight_bytes=byte_limit, bucket=None,
                                 on_error="raise")
    overlapc.schedule(gm, cfg)

    gm.graph.lint()
    got = LocalCollectives(gm).run(*_inputs(gm))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    overlapc.verify(gm, cfg)
    # compute (in-place writes included) keeps its order
    assert _compute_order(gm) == compute
    _check_count_across_barriers(gm, limit)


def _check_count_across_barriers(gm, limit):
    """Guarantee 2 with pinned collectives (``check_count_with_pinned``), the regions cut
    by the writes ``_expected_barriers`` finds from how ``build`` made the graph."""
    nodes = list(gm.graph.nodes)
    barriers = _expected_barriers(gm)
    region = list(itertools.accumulate((n.name in barriers for n in nodes), initial=0))[:-1]
    check_count_with_pinned(nodes, region, [c for c in overlapc.collectives(gm) if c.waits], limit)


def test_a_collective_pinned_across_a_barrier_counts_against_max_in_flight(fake_pg):
    """An all-gather started before a write into a graph input and waited after it stays
    where it stands; under ``max_in_flight=1`` another all-gather of its group goes only
    after its wait, and ``verify`` rejects the order handed in, which had both in flight."""
    def fn(x, w, scratch):
        a = ag(w)
        h = torch.tanh(x @ x)
        scratch.add_(1)                       # a barrier: ``a`` stays where it stands
        b = ag(w * 2)
        h = h @ x                             # as handed in, ``a`` and ``b`` are in flight across it
        return h @ wait(a).t(), scratch.clone(), wait(b)
    gm = trace(fn, (16, 16), (2, 16), (4,))
    cfg = overlapc.OverlapConfig(max_in_flight=1, bucket=None, on_error="raise")
    with pytest.raises(overlapc.ScheduleError, match="in flight across it beside 1 that stay where they stand"):
        overlapc.verify(gm, cfg)
    overlapc.schedule(gm, cfg)
    names = [n.name for n in gm.graph.nodes]
    assert names.index("all_gather_into_tensor_1") > names.index("wait_tensor")
    overlapc.verify(gm, cfg)


_MOVABLE = {F.all_gather_into_tensor.default, F.reduce_scatter_tensor.default, F.all_reduce.default,
            F.wait_tensor.default, aten.t.default, aten.view.default}   # collectives, waits, their views


def _compute_order(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target not in _MOVABLE]

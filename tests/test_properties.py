"""Property tests: random layered graphs with random collectives, random limits.

After scheduling: the graph lints, every node keeps its inputs, the scheduled
graph computes the same values as the original (collectives replaced by local
stand-ins with the same shapes), consumer order and the in-flight bound hold
(checked here independently of overlapc.verify), waits stand just before their
first real consumer, and scheduling is deterministic.
"""
import operator

import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings, strategies as st

import overlapc
from overlapc.collectives import is_cheap
from graphs import F, ag, trace, wait

N_MAX = 6


@st.composite
def programs(draw):
    n = draw(st.integers(1, N_MAX))
    flags = lambda p=0.5: draw(st.lists(st.booleans(), min_size=n, max_size=n))  # noqa: E731
    return dict(
        n=n,
        group=draw(st.lists(st.sampled_from(["0", "1"]), min_size=n, max_size=n)),
        cast=flags(), view=flags(), rs=flags(), ar=flags(), out=flags(),
        barrier=draw(st.lists(st.booleans().filter(lambda b: True), min_size=n, max_size=n)),
        upfront=draw(st.booleans()),
        wait_early=draw(st.booleans()),
        perm=draw(st.permutations(list(range(n)))),
        use_barriers=draw(st.integers(0, 3)) == 0,
    )


def build(p):
    def fn(x, *ws):
        started, waited, outs = {}, {}, []

        def start(i):
            w = ws[i].to(torch.bfloat16) if p["cast"][i] else ws[i]
            started[i] = ag(w, p["group"][i])

        if p["upfront"]:
            for i in p["perm"]:
                start(i)
            if p["wait_early"]:
                for i in p["perm"]:
                    waited[i] = wait(started[i])
        for i in range(p["n"]):
            if i not in started:
                start(i)
            if i not in waited:
                waited[i] = wait(started[i])
            full = waited[i].float() if p["cast"][i] else waited[i]
            full = full.view(16, 16).t() if p["view"][i] else full.t()
            x = torch.tanh(x @ full)
            if p["rs"][i]:
                outs.append(wait(F.reduce_scatter_tensor(x, "sum", 8, p["group"][i])))
            if p["ar"][i]:
                x = x + wait(F.all_reduce(x, "sum", p["group"][i]))
            if p["use_barriers"] and p["barrier"][i]:
                x = torch.ops.aten.add_(x, 1)
            if p["out"][i]:
                outs.append(waited[i])
        return (x, *outs)
    return fn


class LocalCollectives(fx.Interpreter):
    """Runs a graph with collectives replaced by local ops of the same shapes."""

    def call_function(self, target, args, kwargs):
        if target == F.all_gather_into_tensor.default:
            return torch.cat([args[0] * (r + 1) for r in range(args[1])])
        if target == F.reduce_scatter_tensor.default:
            return args[0].chunk(args[2])[0] * 3
        if target == F.all_reduce.default:
            return args[0] * 0.5
        if target == F.wait_tensor.default:
            return args[0].clone()
        return super().call_function(target, args, kwargs)


def inputs_for(p):
    torch.manual_seed(1)
    return [torch.randn(16, 16)] + [torch.randn(2, 16) for _ in range(p["n"])]


def order(gm):
    return [n.name for n in gm.graph.nodes]


def independent_checks(gm, cfg):
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    is_barrier = [n.target == torch.ops.aten.add_.Tensor for n in nodes]
    has_barrier = any(is_barrier)
    region = [sum(is_barrier[:i]) for i in range(len(nodes))]
    # Collectives whose start and wait lie on two sides of a barrier stay where they are.
    rows = [c for c in overlapc.collectives(gm)
            if c.movable and all(region[pos[w]] == region[pos[c.start]] for w in c.waits)]
    # consumer order per group
    if not has_barrier:
        for group in ("0", "1"):
            firsts = [c.first_consumer for c in rows if c.kind == "all_gather" and c.group == group]
            assert firsts == sorted(firsts), (group, firsts)
    # in-flight bound per group
    live = {}
    for node in nodes:
        for c in rows:
            if c.kind == "all_gather" and node is c.start:
                live.setdefault(c.group, set()).add(c.start)
                if cfg.max_in_flight is not None:
                    assert len(live[c.group]) <= cfg.max_in_flight, node.name
            if c.kind == "all_gather" and node in c.waits:
                live[c.group].discard(c.start)
    # only waits, starts and cheap nodes between a wait and its first real consumer
    if not has_barrier:
        for c in rows:
            for w in c.waits:
                between = nodes[pos[w] + 1:c.first_consumer]
                assert all((
                    n.target in (F.wait_tensor.default, operator.getitem) or is_cheap(n)
                    or any(n is r.start for r in rows)) for n in between), (w.name, [n.name for n in between])


@settings(max_examples=int(__import__("os").environ.get("OVERLAPC_EXAMPLES", "120")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=programs(), limit=st.sampled_from([1, 2, 3, None]), byte_limit=st.sampled_from([None, 2048, 4096]))
def test_random_graphs_keep_every_guarantee(fake_pg, two_groups, p, limit, byte_limit):
    cfg = overlapc.OverlapConfig(max_in_flight=limit, max_in_flight_bytes=byte_limit, on_error="raise")
    shapes = [(16, 16)] + [(2, 16)] * p["n"]
    gm = trace(build(p), *shapes)
    expected = LocalCollectives(gm).run(*inputs_for(p))
    args_before = {n.name: (repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes}

    overlapc.schedule(gm, cfg)

    gm.graph.lint()
    assert {n.name: (repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes} == args_before
    got = LocalCollectives(gm).run(*inputs_for(p))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    overlapc.verify(gm, cfg)
    independent_checks(gm, cfg)

    again = trace(build(p), *shapes)
    overlapc.schedule(again, cfg)
    assert order(again) == order(gm)

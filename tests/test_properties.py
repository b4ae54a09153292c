"""Property tests: random layered graphs with random collectives, random limits.

After scheduling: the graph lints, every node keeps its inputs, the scheduled
graph computes the same values as the original (collectives replaced by local
stand-ins with the same shapes), and, checked here independently of
overlapc.verify, barriers included: consumer order, waits before their first
real consumer (an all-gather's just before it), the count and byte budget, and
peak live bytes <= the original order's peak + the bytes in flight; scheduling
is deterministic.
"""
import operator

import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings, strategies as st

import overlapc
from overlapc.collectives import is_cheap
from overlapc.passes.memory import peak_bytes
from graphs import F, ag, trace, wait

N_MAX = 6


@st.composite
def programs(draw):
    n = draw(st.integers(1, N_MAX))
    flags = lambda p=0.5: draw(st.lists(st.booleans(), min_size=n, max_size=n))  # noqa: E731
    return dict(
        n=n,
        group=draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),   # index into the groups
        cast=flags(), view=flags(), rs=flags(), ar=flags(), out=flags(),
        barrier=flags(),
        upfront=draw(st.booleans()),
        wait_early=draw(st.booleans()),
        perm=draw(st.permutations(list(range(n)))),
        use_barriers=draw(st.integers(0, 3)) == 0,
    )


def build(p, groups):
    """The program ``p`` as a function; ``groups``: the two process group names."""
    group = [groups[i] for i in p["group"]]

    def fn(x, *ws):
        started, waited, outs = {}, {}, []

        def start(i):
            w = ws[i].to(torch.bfloat16) if p["cast"][i] else ws[i]
            started[i] = ag(w, group[i])

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
                outs.append(wait(F.reduce_scatter_tensor(x, "sum", 8, group[i])))
            if p["ar"][i]:
                x = x + wait(F.all_reduce(x, "sum", group[i]))
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


_CHEAP = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._to_copy.default,
          torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default,
          torch.ops.prims.convert_element_type.default}


def _over_waits(node):
    """(reaches a wait, only through cheap nodes and placeholders)"""
    if node.target == F.wait_tensor.default:
        return True, True
    if node.op == "placeholder":
        return False, True
    if node.target not in _CHEAP:
        return False, False
    found = [_over_waits(i) for i in node.all_input_nodes]
    return any(f for f, _ in found), all(ok for _, ok in found)


def _chained(start):
    """Whether a start reads another collective's result through cheap nodes, or
    through one node computing on such results and placeholders alone."""
    for i in start.all_input_nodes:
        found, ok = _over_waits(i)
        if found and ok:
            return True
        if i.op == "call_function":
            inner = [_over_waits(j) for j in i.all_input_nodes]
            if any(f for f, _ in inner) and all(ok for _, ok in inner):
                return True
    return False


def held(c):
    """Bytes a collective holds in flight: an all-gather's output and input; any
    other's input, and its output too when it is chained (reads another
    collective's result), since its start may go ahead of where it stood."""
    inputs = sum(i.meta["val"].numel() * i.meta["val"].element_size() for i in c.start.all_input_nodes)
    return (c.nbytes if c.kind == "all_gather" or _chained(c.start) else 0) + inputs


def piece(c):
    """The collective ``c`` is a piece of (``mark_pieces``), else its own start's name."""
    return c.start.meta.get("overlapc_piece_of", c.start.name)


def mark_pieces(gm):
    """Mark the movable collectives of each group and kind, two by two in graph
    order, as the pieces of one chunked collective (as the chunk pass marks its
    pieces), so the count bound sees them as one."""
    seen = {}
    for c in overlapc.collectives(gm):
        if c.movable:
            i = seen[(c.group, c.kind)] = seen.get((c.group, c.kind), -1) + 1
            c.start.meta["overlapc_piece_of"] = f"whole_{c.group}_{c.kind}_{i // 2}"


def independent_checks(gm, cfg, before_peak):
    """The guarantees, recomputed here from the graph without overlapc.verify."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    is_barrier = [n.target == torch.ops.aten.add_.Tensor for n in nodes]
    region = [sum(is_barrier[:i]) for i in range(len(nodes))]
    region_end = {}
    for i in reversed(range(len(nodes))):
        region_end[region[i]] = i if is_barrier[i] or nodes[i].op == "output" else region_end.get(region[i], i)
    # Collectives whose start and wait lie on two sides of a barrier stay where they are.
    rows = [c for c in overlapc.collectives(gm)
            if c.movable and all(region[pos[w]] == region[pos[c.start]] for w in c.waits)]
    first = {c.start: min(c.first_consumer if c.first_consumer is not None else len(nodes),
                          region_end[region[pos[c.start]]]) for c in rows}
    # consumer order per group and region
    for group in sorted({c.group for c in rows}):
        for r in sorted(set(region)):
            gathers = sorted((c for c in rows if c.kind == "all_gather" and c.group == group
                              and region[pos[c.start]] == r), key=lambda c: pos[c.start])
            firsts = [first[c.start] for c in gathers]
            assert firsts == sorted(firsts), (group, firsts)
    # waits: before the first consumer; an all-gather's only waits, starts and cheap nodes away
    starts = {c.start for c in rows}
    for c in rows:
        for w in c.waits:
            assert pos[w] < first[c.start], (w.name, first[c.start])
            if c.kind == "all_gather":
                between = nodes[pos[w] + 1:first[c.start]]
                assert all(n.target in (F.wait_tensor.default, operator.getitem) or is_cheap(n)
                           or n in starts for n in between), (w.name, [n.name for n in between])
    # the bound: count per group and kind, held bytes per group ("auto" may go past
    # twice the largest where memory is below its peak: checked on the outcome below)
    budget = cfg.max_in_flight_bytes
    if budget == "auto":   # a chunked collective's pieces together
        whole = {}
        for c in rows:
            whole[(c.group, piece(c))] = whole.get((c.group, piece(c)), 0) + held(c)
        twice_largest = {g: 2 * max(b for (h, _), b in whole.items() if h == g) for g in {c.group for c in rows}}
        budget = None
    elif budget is not None:
        budget = {g: budget for g in {c.group for c in rows}}
    live, peak_total = {}, 0
    for node in nodes:
        for c in rows:
            if node is c.start:
                live.setdefault(c.group, []).append(c)
                same_kind = {piece(o) for o in live[c.group] if o.kind == c.kind}   # pieces count once
                if cfg.max_in_flight is not None:
                    assert len(same_kind) <= cfg.max_in_flight, node.name
                total = sum(held(o) for o in live[c.group])
                if budget is not None and total > budget[c.group]:
                    others = [o for o in live[c.group] if o is not c and (c.kind == "all_gather"
                                                                          or o.kind != "all_gather")]
                    assert not others, (node.name, total, budget[c.group], [o.start.name for o in others])
                peak_total = max(peak_total, sum(held(o) for g in live for o in live[g]))
            if node is c.waits[-1]:
                live[c.group].remove(c)
    # memory: no more than the original order's peak plus what was in flight
    assert peak_bytes(nodes) <= before_peak + peak_total, (peak_bytes(nodes), before_peak, peak_total)
    if cfg.max_in_flight_bytes == "auto":   # and no more than the auto budgets allow above it
        assert peak_bytes(nodes) <= before_peak + sum(twice_largest.values()), (peak_bytes(nodes), before_peak)


@settings(max_examples=int(__import__("os").environ.get("OVERLAPC_EXAMPLES", "120")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=programs(), limit=st.sampled_from([1, 2, 3, None]), byte_limit=st.sampled_from([None, 2048, 4096, "auto"]),
       pieces=st.booleans())
def test_random_graphs_keep_every_guarantee(fake_pg, two_groups, p, limit, byte_limit, pieces):
    # the core alone (bucketing rewrites nodes; tests/test_bucket.py checks it)
    cfg = overlapc.OverlapConfig(max_in_flight=limit, max_in_flight_bytes=byte_limit, bucket=None, on_error="raise")
    shapes = [(16, 16)] + [(2, 16)] * p["n"]
    groups = (fake_pg.group_name, two_groups[0].group_name)
    gm = trace(build(p, groups), *shapes)
    if pieces:
        mark_pieces(gm)
    expected = LocalCollectives(gm).run(*inputs_for(p))
    args_before = {n.name: (repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes}
    before_peak = peak_bytes(list(gm.graph.nodes))

    overlapc.schedule(gm, cfg)

    gm.graph.lint()
    assert {n.name: (repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes} == args_before
    got = LocalCollectives(gm).run(*inputs_for(p))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    overlapc.verify(gm, cfg)
    independent_checks(gm, cfg, before_peak)

    again = trace(build(p, groups), *shapes)
    if pieces:
        mark_pieces(again)
    overlapc.schedule(again, cfg)
    assert order(again) == order(gm)

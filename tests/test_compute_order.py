"""The compute-order guarantee: compute keeps its relative order; only a start's
cheap input chain (aliases, casts, copies, a rewrite's marked copy-in) moves with
it, and elementwise compute on collectives' results alone that feeds only starts
may move later, never before compute it followed (README, "Guarantees").

The upstream cases re-create graphs from PyTorch's
test/distributed/test_overlap_bucketing_unit.py in which a matmul or an add used
to travel with a collective's start past other compute. ``compute_order_kept``
judges an order from the nodes alone, without overlapc's passes.
"""
import operator

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import overlapc
from graphs import F, WORLD, trace, wait
from overlapc.passes import invariants
from overlapc.passes.inflight import Budget
from overlapc.passes.structure import Structure
from test_properties import LocalCollectives

aten = torch.ops.aten
STARTS = {F.all_gather_into_tensor.default, F.reduce_scatter_tensor.default, F.all_reduce.default,
          F.all_to_all_single.default}
FREE = {F.wait_tensor.default, operator.getitem, aten.view.default, aten.t.default, aten.slice.Tensor,
        aten._to_copy.default, aten.clone.default, aten._unsafe_view.default, aten.permute.default,
        aten.expand.default, torch.ops.prims.convert_element_type.default}
ELEMENTWISE = {aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.sub.Tensor, aten.neg.default,
               aten.mul.Scalar, aten.add.Scalar, aten.div.Scalar}


def _reach(node):
    """(whether ``node``'s inputs reach a wait, whether only through waits,
    placeholders and free aliases/casts)."""
    found, ok = False, True
    for i in node.all_input_nodes:
        if i.target == F.wait_tensor.default:
            found = True
        elif i.target in FREE:
            inner_found, inner_ok = _reach(i)
            found, ok = found or inner_found, ok and inner_ok
        elif i.op != "placeholder":
            ok = False
    return found, ok


def _on_results_alone(node):
    return _reach(node) == (True, True)


def _feeds_only_starts(node):
    """Whether every use is a start, a "late" node, or a free node feeding only starts."""
    return bool(node.users) and all(
        u.target in STARTS or classify(u) == "late" or (u.target in FREE and _feeds_only_starts(u))
        for u in node.users)


def classify(node):
    """"free" (collective starts and waits, aliases, casts), "late" (elementwise on
    collectives' results alone feeding only starts) or "compute" (the rest)."""
    if node.target in STARTS or node.target in FREE:
        return "free"
    if node.target in ELEMENTWISE and _on_results_alone(node) and _feeds_only_starts(node):
        return "late"
    return "compute"


def compute_order_kept(before, after):
    """None when ``after`` keeps the rule relative to ``before`` (lists of node
    names of the same graph), else a description of the first break."""
    kinds = {name: kind for name, kind in before}
    old = [name for name, _ in before]
    fixed_old = [n for n in old if kinds[n] == "compute"]
    fixed_new = [n for n in after if kinds[n] == "compute"]
    if fixed_old != fixed_new:
        return f"compute order changed: {fixed_old} -> {fixed_new}"
    for name in old:
        if kinds[name] == "late":
            was = sum(kinds[n] == "compute" for n in old[:old.index(name)])
            now = sum(kinds[n] == "compute" for n in after[:after.index(name)])
            if now < was:
                return f"{name} moved ahead of compute it followed ({was} -> {now})"
    return None


def snapshot(gm):
    return [(n.name, classify(n)) for n in gm.graph.nodes]


def names(gm):
    return [n.name for n in gm.graph.nodes]


def schedule(gm, **options):
    """Schedule ``gm`` (no buckets; by default no byte budget, so only the order
    rules limit overlap) and check the rule here."""
    options.setdefault("max_in_flight_bytes", None)
    cfg = overlapc.OverlapConfig(bucket=None, on_error="raise", **options)
    before = snapshot(gm)
    overlapc.schedule(gm, cfg)
    overlapc.verify(gm, cfg)
    broken = compute_order_kept(before, names(gm))
    assert broken is None, broken
    return gm


def between(gm, first, last):
    """Compute nodes (by ``classify`` on the scheduled graph) strictly between two named nodes."""
    order = names(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    return [n for n in order[order.index(first) + 1:order.index(last)] if classify(nodes[n]) == "compute"]


def waited_by(gm, start):
    return next(u.name for u in {n.name: n for n in gm.graph.nodes}[start].users
                if u.target == F.wait_tensor.default)


# upstream: test_overlap_bucketing_unit.py, TestCrossPGOverlap.test_two_queue_scheduling_off_path_nodes
def two_queue_off_path(a, b):
    gathered = wait(F.all_gather_into_tensor(b, WORLD, "0"))
    on_path = torch.mm(a, gathered[:8, :8])
    rs1 = F.reduce_scatter_tensor(on_path, "sum", WORLD, "0")
    off_path = torch.mm(a, a)
    rs2 = F.reduce_scatter_tensor(off_path, "sum", WORLD, "0")
    last = torch.mm(a, a)
    return last.sum() + wait(rs1).sum() + wait(rs2).sum()


def test_two_queue_off_path_matmul_stays_behind_compute(fake_pg):
    gm = schedule(trace(two_queue_off_path, (8, 8), (8, 8)))
    order = names(gm)
    assert order.index("mm") < order.index("mm_1") < order.index("mm_2")
    # both reduce-scatters still overlap the matmuls after them
    assert between(gm, "reduce_scatter_tensor", waited_by(gm, "reduce_scatter_tensor"))[:2] == ["mm_1", "mm_2"]
    assert "mm_2" in between(gm, "reduce_scatter_tensor_1", waited_by(gm, "reduce_scatter_tensor_1"))


# upstream: test_overlap_bucketing_unit.py,
# TestManualOverlapSchedulingUnit.test_wait_user_repair_runs_once_after_all_bucket_groups
def wait_user_repair(a, b, c, d):
    first0 = wait(F.all_reduce(a, "sum", "0"))
    early_user = -first0
    first1 = wait(F.all_reduce(b + 1, "sum", "0"))
    second0 = wait(F.all_reduce(first0 + c, "sum", "0"))
    second1 = wait(F.all_reduce(first1 + d, "sum", "0"))
    return early_user.sum() + second0.sum() + second1.sum()


def test_wait_user_repair_adds_do_not_pass_compute(fake_pg):
    gm = trace(wait_user_repair, (4, 4), (4, 4), (4, 4), (4, 4))
    s = Structure(gm)
    carried = {m.name for bundle in s.start_bundle.values() for m in bundle if m.target == aten.add.Tensor}
    assert carried == {"add_1", "add_2"}   # first0 + c and first1 + d: elementwise on results alone
    gm = schedule(gm)
    order = names(gm)
    # the carried adds stay behind the compute they followed (neg, b + 1)
    assert order.index("neg") < order.index("add") < order.index("add_1") < order.index("add_2")
    # the all-reduce of b + 1 still overlaps the add its chained neighbour carries
    assert between(gm, "all_reduce_1", waited_by(gm, "all_reduce_1"))


# upstream: test_overlap_bucketing_unit.py, TestOverlapPreservingBucketing.test_cant_bucket_nested_hiding_intervals,
# at world size 8, with the add of a gathered slice also gathered (it used to move before the matmul)
def nested_intervals(a, b):
    ag1 = F.all_gather_into_tensor(a, WORLD, "0")
    ag2 = F.all_gather_into_tensor(b, WORLD, "0")
    inner = torch.mm(b[:2, :2], b[:2, :2])
    ag2_out = wait(ag2)
    outer = torch.mm(a + ag2_out[:4, :4], a)
    regathered = F.all_gather_into_tensor(a * ag2_out[:4, :4], WORLD, "0")
    ag1_out = wait(ag1)
    return ag1_out.sum() + ag2_out.sum() + outer.sum() + inner.sum() + wait(regathered).sum()


def test_nested_intervals_gather_add_stays_behind_matmul(fake_pg):
    gm = trace(nested_intervals, (4, 4), (4, 4))
    assert classify({n.name: n for n in gm.graph.nodes}["mul"]) == "late"
    gm = schedule(gm)
    order = names(gm)
    assert order.index("mm") < order.index("add") < order.index("mm_1") < order.index("mul")
    # ag1 overlaps both matmuls; the regather issues after the matmul it followed
    assert between(gm, "all_gather_into_tensor", waited_by(gm, "all_gather_into_tensor")) == \
        ["mm", "add", "mm_1"]


def test_hsdp_div_still_chains_between_collectives(fake_pg):
    """reduce-scatter -> div -> all-reduce: the div is carried (later only) and
    both collectives still overlap the compute after them."""
    def hsdp(x, w):
        grad = x @ w
        shard = wait(F.reduce_scatter_tensor(grad, "sum", WORLD, "0"))
        reduced = wait(F.all_reduce(shard / WORLD, "sum", "0"))
        y = x @ x
        z = y @ x
        return z, reduced
    gm = schedule(trace(hsdp, (16, 16), (16, 16)))
    order = names(gm)
    assert order.index("mm") < order.index("div")
    assert between(gm, "reduce_scatter_tensor", waited_by(gm, "reduce_scatter_tensor"))
    assert between(gm, "all_reduce", waited_by(gm, "all_reduce"))


# -- the control: the invariant check rejects a matmul moved with a start ---------

def test_check_rejects_a_matmul_moved_with_a_start(fake_pg):
    gm = trace(two_queue_off_path, (8, 8), (8, 8))
    s = Structure(gm)
    assert "mm" not in {m.name for bundle in s.start_bundle.values() for m in bundle}
    nodes = {n.name: n for n in s.nodes}
    # the old bundle rule's order: a @ gathered and its reduce-scatter's start
    # carried to a chain point past both a @ a
    moved = [n for n in s.nodes if n.name not in ("mm", "reduce_scatter_tensor")]
    at = moved.index(nodes["mm_2"]) + 1
    moved[at:at] = [nodes["mm"], nodes["reduce_scatter_tensor"]]
    assert compute_order_kept(snapshot(gm), [n.name for n in moved]) is not None
    with pytest.raises(invariants.ScheduleError, match=r"compute moved after mm_1 \(op aten.mm.default\)") as error:
        invariants.check(s, moved, Budget(None, {}, {}))
    assert error.value.node is nodes["mm"] and error.value.op == "aten.mm.default"
    assert f"given order mm at {s.pos[nodes['mm']]}" in str(error.value)


@pytest.mark.degrades   # the failure it injects degrades the schedule before anything else
def test_schedule_rejects_the_old_bundle_rule(fake_pg, monkeypatch):
    """With the bundle rule loosened back to any compute on collectives' results
    (the matmul a @ gathered joins its reduce-scatter's start), the check, which
    does not read the bundles, refuses every order the pipeline tries (chain
    points halfway, late, serial): the schedule raises, naming the matmul."""
    from overlapc.passes import structure
    monkeypatch.setattr(structure, "carries_compute", lambda node, is_wait: node.op == "call_function"
                        and structure.barrier_reason(node) is None and structure.computes_on_waits(node, is_wait))
    gm = trace(two_queue_off_path, (8, 8), (8, 8))
    assert "mm" in {m.name for bundle in Structure(gm).start_bundle.values() for m in bundle}
    with pytest.raises(invariants.ScheduleError, match=r"compute moved after mm_1") as error:
        overlapc.schedule(gm, overlapc.OverlapConfig(bucket=None, on_error="raise", max_in_flight_bytes=None))
    assert error.value.node.name == "mm" and error.value.op == "aten.mm.default"


def test_check_rejects_carried_compute_moved_earlier(fake_pg):
    gm = trace(nested_intervals, (4, 4), (4, 4))
    s = Structure(gm)
    nodes = {n.name: n for n in s.nodes}
    moved = [n for n in s.nodes if n.name != "mul"]
    moved.insert(moved.index(nodes["mm"]), nodes["mul"])   # before a matmul it followed
    assert compute_order_kept(snapshot(gm), [n.name for n in moved]) is not None
    with pytest.raises(invariants.ScheduleError, match=r"moved before mm") as error:
        invariants.check(s, moved, Budget(None, {}, {}))
    assert error.value.node is nodes["mul"]


# -- random graphs: chains, functional broadcasts as barriers, mixed compute -------

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
LINKS = ("none", "mul", "add", "div", "mm", "sum")
COMPUTE = ("mm", "add", "mul", "sum")


@st.composite
def programs(draw):
    steps = draw(st.lists(st.one_of(
        st.tuples(st.just("start"), st.sampled_from(KINDS)),
        st.tuples(st.just("wait"), st.integers(0, 3)),
        st.tuples(st.just("chain"), st.sampled_from(KINDS), st.sampled_from(LINKS)),
        st.tuples(st.just("compute"), st.sampled_from(COMPUTE)),
        st.tuples(st.just("compute"), st.sampled_from(COMPUTE)),
        st.tuples(st.just("broadcast"))), min_size=2, max_size=14))
    return steps


def _start(kind, x):
    if kind == "all_gather":
        return F.all_gather_into_tensor(x[:2], WORLD, "0")
    if kind == "reduce_scatter":
        return F.reduce_scatter_tensor(x, "sum", WORLD, "0")
    return F.all_reduce(x, "sum", "0")


def _fit(y):
    """``y`` as 16 x 16 (every kind's input shape here)."""
    return (y.sum() + torch.zeros(16, 16)) if y.numel() != 256 else y.reshape(16, 16)


def _link(how, y, w):
    y = _fit(y)
    if how == "mul":
        return y * 2
    if how == "add":
        return y + w
    if how == "div":
        return y / WORLD
    if how == "mm":
        return y @ w
    if how == "sum":
        return y.sum(0, keepdim=True).expand(16, 16)
    return y


def build(steps):
    def fn(x, w, scratch):
        open_, done, outs = [], [], []
        for step in steps:
            if step[0] == "start":
                open_.append(_start(step[1], x))
            elif step[0] == "wait" and open_:
                done.append(wait(open_.pop(min(step[1], len(open_) - 1))))
            elif step[0] == "chain" and (done or open_):   # on the oldest result, waited here if none is
                y = done.pop(0) if done else wait(open_.pop(0))
                open_.append(_start(step[1], _link(step[2], y, w)))
            elif step[0] == "compute":
                how = step[1]
                x = x @ w if how == "mm" else x + w if how == "add" else x * 0.5 if how == "mul" \
                    else x + x.sum(0, keepdim=True)
            elif step[0] == "broadcast":
                outs.append(wait(F.broadcast(scratch + 0, 0, "0")))
        for handle in open_:
            done.append(wait(handle))
        return (x, *outs, *[_fit(v) for v in done])
    return fn


class WithBroadcast(LocalCollectives):
    def call_function(self, target, args, kwargs):
        if target == F.broadcast.default:
            return args[0].clone()
        return super().call_function(target, args, kwargs)


# Found by random search (2026-11-30, 3 of 6000 graphs under "auto"): a reduce-scatter issued
# right after a pinned collective's wait (across a barrier); the core counted its headroom from
# that wait, the check from the compute before it, which had none: placed serially (a WARNING).
CHAINS_BETWEEN_BROADCASTS = [
    ("start", "all_reduce"), ("compute", "add"), ("compute", "add"), ("chain", "all_reduce", "none"),
    ("broadcast",), ("broadcast",), ("compute", "mul"), ("compute", "mul"), ("chain", "reduce_scatter", "div"),
    ("start", "all_reduce"), ("broadcast",), ("compute", "mul"), ("chain", "reduce_scatter", "div"),
    ("start", "reduce_scatter")]


@settings(max_examples=int(__import__("os").environ.get("OVERLAPC_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=programs(), limit=st.sampled_from([1, 2, None]), byte_limit=st.sampled_from([None, 4096, "auto"]))
@example(steps=CHAINS_BETWEEN_BROADCASTS, limit=2, byte_limit="auto")
def test_random_graphs_keep_compute_order(fake_pg, steps, limit, byte_limit):
    gm = trace(build(steps), (16, 16), (16, 16), (16, 16))
    torch.manual_seed(2)
    inputs = [torch.randn(16, 16) for _ in range(3)]
    expected = WithBroadcast(gm).run(*inputs)
    schedule(gm, max_in_flight=limit, max_in_flight_bytes=byte_limit)
    for a, b in zip(expected, WithBroadcast(gm).run(*inputs)):
        torch.testing.assert_close(a, b)


@settings(max_examples=int(__import__("os").environ.get("OVERLAPC_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=programs(), marked=st.integers(0, 60))
def test_classes_read_off_the_call_target_agree_with_each_nodes_own(fake_pg, steps, marked):
    """The check's shortcut (one lookup per call target where the target decides the class)
    classes every node as classifying the node itself does: with in-place writes into a graph
    input (a barrier) and into a temporary (compute), and a node a rewrite marked as an input
    chain."""
    from overlapc.passes import meta

    program = build(steps)

    def fn(x, w, scratch):
        out = program(x, w, scratch)
        temporary = x * 3
        temporary.add_(1)    # into a temporary: compute
        scratch.mul_(2)      # into a graph input: a barrier
        return (*out, temporary)

    gm = trace(fn, (16, 16), (16, 16), (16, 16))
    nodes = list(gm.graph.nodes)
    meta.mark_input_chain(nodes[marked % len(nodes)])
    shortcut = invariants._OrderClasses().of_each(nodes)
    one_by_one = {node: invariants._OrderClasses()._classify(node) for node in nodes}
    assert shortcut == one_by_one

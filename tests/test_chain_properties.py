"""Property tests where chained collectives fail: up-front issue, barriers inside chains.

Random make_fx programs of 1-5 stages. Each stage is a chain of 1-5
collectives of any kind (all-gather, reduce-scatter, all-reduce, all-to-all)
over three groups, each link reading the previous one's result through
nothing, a view, a cast, a reshape or a matmul, with barriers (an in-place
add into a graph input, or a copy of the chain's result into one) between
links; the chain's result feeds the stage's compute. Stages whose first
collective reads a weight may be issued up front, as thunder and hand-written
code emit them: every such start at the top of the graph in stage order, in
a random order or reversed, their waits at the top (the rest of the chain too,
optionally), at a random earlier stage, or at their use.

Every program is scheduled under max_in_flight 1..3 or none, byte budgets from
smaller than one collective to none and "auto", with and without buckets,
with on_error="raise" (no refusal is acceptable), and then checked:
values and determinism; ``overlapc.verify``; and the guarantees recomputed
here without overlapc's scheduling code (``independent_checks``): consumer
order, waits, the count and byte bounds without exception, and peak live
bytes (counted here, ``live_peak``) within the original order's peak and
within the serial order's peak (built here, ``serial_order``) plus the bytes
in flight.
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import overlapc
from graphs import WORLD, F, trace, wait
from test_chains import check_schedule, feasible, link, start

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
DRAWN = KINDS + ("all_gather", "all_gather")   # all-gathers twice as often: lanes are where chains collide
LINKS = ("none", "view", "cast", "reshape", "matmul")
BARRIERS = (None, None, None, "add_", "copy_")


@st.composite
def programs(draw):
    stages = []
    for _ in range(draw(st.integers(1, 5))):
        stages.append(dict(
            head=draw(st.sampled_from(DRAWN)),
            from_weight=draw(st.booleans()),
            links=[dict(kind=draw(st.sampled_from(DRAWN)), group=draw(st.integers(0, 2)),
                        how=draw(st.sampled_from(LINKS)), barrier=draw(st.sampled_from(BARRIERS)))
                   for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3, 4])))],
            group=draw(st.integers(0, 2)),
            bf16=draw(st.booleans()),
            out=draw(st.booleans()),
            barrier_after=draw(st.integers(0, 4)) == 0,
        ))
    n = len(stages)
    return dict(
        stages=stages,
        issue=draw(st.sampled_from(["inline", "stage", "random", "reversed"])),
        perm=draw(st.permutations(range(n))),
        waits=draw(st.sampled_from(["top", "use", "random"])),
        wait_stage=[draw(st.integers(0, i)) for i in range(n)],
        chain_at_top=draw(st.booleans()),
    )


def fit(kind, rows):
    if feasible(kind, rows):
        return kind
    return "all_reduce" if rows % WORLD else "reduce_scatter"


def barrier(how, scratch, y):
    if how == "add_":
        torch.ops.aten.add_(scratch, 1)
    elif how == "copy_":
        torch.ops.aten.copy_(scratch, y[:1])


def build(p, groups):
    stages = p["stages"]
    upfront = [] if p["issue"] == "inline" else [i for i in (
        range(len(stages)) if p["issue"] == "stage" else p["perm"] if p["issue"] == "random"
        else reversed(range(len(stages)))) if stages[i]["from_weight"]]

    def fn(x, eye, scratch, *ws):
        handle, value, done = {}, {}, set()

        def head(i, x):
            s = stages[i]
            src = ws[i] if s["from_weight"] else x
            src = src.to(torch.bfloat16) if s["bf16"] else src
            if not feasible(s["head"], src.shape[0]):
                src = torch.cat([src] * WORLD) if s["head"] != "all_gather" else src[:1]
            handle[i] = start(s["head"], src, groups[s["group"]])

        def take(i):
            value[i] = wait(handle.pop(i))

        def chain(i):
            y = value[i]
            for k in stages[i]["links"]:
                y = link(k["how"], y, eye)
                barrier(k["barrier"], scratch, y)
                y = wait(start(fit(k["kind"], y.shape[0]), y, groups[k["group"]]))
            value[i] = y
            done.add(i)

        for i in upfront:
            head(i, x)
        if p["waits"] == "top":
            for i in upfront:
                take(i)
                if p["chain_at_top"]:
                    chain(i)
        outs = []
        for i, s in enumerate(stages):
            if p["waits"] == "random":   # waits of later up-front stages due here
                for j in upfront:
                    if j in handle and p["wait_stage"][j] == i:
                        take(j)
            if i not in handle and i not in value:
                head(i, x)
            if i in handle:
                take(i)
            if i not in done:
                chain(i)
            y = value[i]
            if s["out"]:
                outs.append(y)
            x = torch.tanh(x @ eye + y.float().sum(0, keepdim=True))
            if s["barrier_after"]:
                torch.ops.aten.add_(scratch, 1)
        return (x, *outs)
    return fn


def inputs_for(p):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(16, 16, generator=g), torch.eye(16) * 0.5, torch.zeros(1, 16)] + \
        [torch.randn(2, 16, generator=g) for _ in p["stages"]]


def shapes_for(p):
    return [(16, 16), (16, 16), (1, 16)] + [(2, 16)] * len(p["stages"])


def run_example(groups, p, limit, byte_limit, bucket):
    """Schedule program ``p`` and check everything (raises on the first failure)."""
    cfg = overlapc.OverlapConfig(max_in_flight=limit, max_in_flight_bytes=byte_limit, bucket=bucket,
                                 on_error="raise")
    check_schedule(lambda: trace(build(p, groups), *shapes_for(p)), inputs_for(p), cfg)


BUDGETS = [None, 64, 512, 4096, 16384, "auto"]   # 64 and 512 B: smaller than one collective


# Derandomized: CI draws the same examples every run (a found counterexample is
# kept below as its own test, not redrawn by chance). OVERLAPC_SEARCH=1 searches anew.
@settings(max_examples=int(os.environ.get("OVERLAPC_EXAMPLES", "200")), deadline=None,
          derandomize=os.environ.get("OVERLAPC_SEARCH") != "1", database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(p=programs(), limit=st.sampled_from([1, 2, 3, None]), byte_limit=st.sampled_from(BUDGETS),
       bucket=st.sampled_from([None, "auto"]))
def test_chains_schedule_within_every_bound(fake_pg, two_groups, p, limit, byte_limit, bucket):
    groups = (fake_pg.group_name, two_groups[0].group_name, two_groups[1].group_name)
    run_example(groups, p, limit, byte_limit, bucket)


# Found by the search after the landing of the chain work (stop 33): an all-reduce,
# then an all-gather -> reduce-scatter -> all-gather chain at max_in_flight=1. With
# its chain point halfway, the waited all-gather's result and the cast feeding the
# reduce-scatter were live at a high point of the compute (5184 B, above the serial
# order's 3840 plus 1088 in flight), which the bytes in flight do not count; the
# pipeline compared only with the order before scheduling (4160), so verify refused
# what schedule produced. A regression test now.
KNOWN_MEMORY_BREAK = {
    "stages": [
        {"head": "all_reduce", "from_weight": True, "links": [], "group": 0, "bf16": True, "out": True,
         "barrier_after": False},
        {"head": "all_gather", "from_weight": True, "group": 0, "bf16": True, "out": False, "barrier_after": True,
         "links": [{"kind": "reduce_scatter", "group": 0, "how": "cast", "barrier": None},
                   {"kind": "all_gather", "group": 0, "how": "none", "barrier": None}]},
    ],
    "issue": "inline", "perm": [0, 1], "waits": "top", "wait_stage": [0, 0], "chain_at_top": False,
}


def test_known_memory_break_of_a_chain_at_one_in_flight(fake_pg, two_groups):
    groups = (fake_pg.group_name, two_groups[0].group_name, two_groups[1].group_name)
    run_example(groups, KNOWN_MEMORY_BREAK, 1, None, None)


# Found by a longer search (OVERLAPC_EXAMPLES=1500, OVERLAPC_SEARCH=1): bucket="auto" joins a
# fp32 and a bf16 all-gather into one byte bucket (uint8). The schedule was right; the test's
# stand-in gather multiplied the uint8 buffer by 2**r, which turned it into fp32 and broke the
# unpack (test_properties.LocalCollectives now scales the packed parts instead).
_AG = {"kind": "all_gather", "group": 0, "how": "none", "barrier": None}
KNOWN_BYTE_BUCKET = {
    "stages": [
        {"head": "all_gather", "from_weight": False, "links": [_AG, _AG], "group": 0, "bf16": False, "out": False,
         "barrier_after": True},
        {"head": "all_gather", "from_weight": True, "links": [dict(_AG, how="matmul"), _AG], "group": 0, "bf16": True,
         "out": False, "barrier_after": True},
        {"head": "all_gather", "from_weight": False, "links": [_AG], "group": 0, "bf16": False, "out": False,
         "barrier_after": True},
        {"head": "all_gather", "from_weight": True, "links": [], "group": 0, "bf16": False, "out": False,
         "barrier_after": True},
        {"head": "all_gather", "from_weight": False, "links": [], "group": 0, "bf16": False, "out": False,
         "barrier_after": True},
    ],
    "issue": "stage", "perm": [0, 1, 2, 3, 4], "waits": "top", "wait_stage": [0, 0, 0, 0, 0], "chain_at_top": False,
}


def test_a_byte_bucket_of_two_dtypes_in_a_chained_graph(fake_pg, two_groups):
    groups = (fake_pg.group_name, two_groups[0].group_name, two_groups[1].group_name)
    gm = trace(build(KNOWN_BYTE_BUCKET, groups), *shapes_for(KNOWN_BYTE_BUCKET))
    overlapc.schedule(gm, overlapc.OverlapConfig(max_in_flight=1, max_in_flight_bytes=None, bucket="auto"))
    assert any(n.meta.get("val") is not None and n.meta["val"].dtype == torch.uint8
               for n in gm.graph.nodes if n.target == F.all_gather_into_tensor.default), "no byte bucket formed"
    run_example(groups, KNOWN_BYTE_BUCKET, 1, None, "auto")


# Found by a 2,500-example search of this property (2026-11-29): two chains in one all-gather
# lane whose readers are due at one in-place op (add_): the core issued the lane's all-gathers
# in the order of their readers' positions, but at that node it issues a reader of another
# kind (here the reduce-scatter the second stage's chain became) before an all-gather reader,
# so the second all-gather was consumed first. Placed serially, the two all-gathers were still
# issued in lane order: the whole graph ran in its serial order. A lane now follows the order
# in which the walk issues the readers at their chain point (``_Core._issue_ranks``), and an
# all-gather placed serially is in no lane (issued when its result is due).
def _stage(head, group, links, from_weight=True, bf16=False, out=False):
    return {"head": head, "from_weight": from_weight, "group": group, "bf16": bf16, "out": out,
            "barrier_after": False,
            "links": [{"kind": kind, "group": g, "how": how, "barrier": barrier} for kind, g, how, barrier in links]}


KNOWN_READERS_AT_ONE_BARRIER = {
    "stages": [_stage("all_gather", 0, [("all_gather", 0, "none", None), ("all_to_all", 0, "none", "add_")],
                      from_weight=False),
               _stage("all_gather", 0, [("all_gather", 0, "none", None)])],
    "issue": "reversed", "perm": [0, 1], "waits": "top", "wait_stage": [0, 1], "chain_at_top": True,
}
# The same family with five chains over three groups (the search's original): a reader whose
# upstream all-gather is itself gated at the same chain point is issued after it.
KNOWN_READERS_AT_ONE_BARRIER_FIVE_CHAINS = {
    "stages": [
        _stage("reduce_scatter", 0, [("reduce_scatter", 1, "matmul", "copy_"), ("all_gather", 0, "view", None)]),
        _stage("all_gather", 1, [("all_gather", 1, "view", "copy_"), ("all_reduce", 2, "reshape", None),
                                 ("all_gather", 1, "view", "copy_"), ("reduce_scatter", 2, "reshape", None)],
               bf16=True, out=True),
        _stage("all_gather", 1, [("all_gather", 2, "cast", None), ("all_gather", 1, "reshape", None),
                                 ("all_to_all", 2, "none", "add_"), ("all_reduce", 1, "cast", "copy_")]),
        _stage("all_reduce", 2, [("all_gather", 2, "view", None), ("all_gather", 1, "view", None),
                                 ("all_to_all", 0, "matmul", None)], bf16=True),
        _stage("all_gather", 1, [("all_gather", 2, "view", None)]),
    ],
    "issue": "reversed", "perm": [2, 4, 0, 3, 1], "waits": "top", "wait_stage": [0, 1, 0, 0, 2], "chain_at_top": True,
}


@pytest.mark.parametrize("p", [KNOWN_READERS_AT_ONE_BARRIER, KNOWN_READERS_AT_ONE_BARRIER_FIVE_CHAINS],
                         ids=["two-chains", "five-chains"])
def test_chained_readers_due_at_one_node_keep_consumer_order(fake_pg, two_groups, p):
    groups = (fake_pg.group_name, two_groups[0].group_name, two_groups[1].group_name)
    run_example(groups, p, 2, 16384, None)

"""The shortcuts the pass takes for speed agree with the straightforward computation."""
from __future__ import annotations

import random

import torch
import torch.fx as fx

F = torch.ops._c10d_functional
aten = torch.ops.aten


def _meta(*shape):
    return torch.empty(shape, device="meta")


def _random_gathers(rng: random.Random) -> fx.GraphModule:
    """All-gathers of a few inputs over two groups (same or different sizes), some read by
    two waits or by more than their wait, with in-place writes into graph inputs (barriers)
    between them: runs of identical collectives, broken by groups and barriers."""
    graph = fx.Graph()
    inputs = []
    for i in range(3):
        inputs.append(graph.placeholder(f"x{i}"))
        inputs[-1].meta["val"] = _meta(4, 8)
    outputs = []
    for _ in range(rng.randint(1, 30)):
        choice = rng.random()
        if choice < 0.1:
            write = graph.call_function(aten.add_.Tensor, (rng.choice(inputs), 1.0))
            write.meta["val"] = _meta(4, 8)
            continue
        x, group = rng.choice(inputs), rng.choice(["0", "1"])
        size = 2 if rng.random() < 0.8 else 4
        start = graph.call_function(F.all_gather_into_tensor.default, (x, size, group))
        start.meta["val"] = _meta(4 * size, 8)
        for _ in range(2 if rng.random() < 0.1 else 1):
            wait = graph.call_function(F.wait_tensor.default, (start,))
            wait.meta["val"] = _meta(4 * size, 8)
            outputs.append(wait)
        if rng.random() < 0.1:
            outputs.append(start)
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _runs_by_key(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """The runs ``duplicates._merge_identical_runs`` merges, found as it did before it compared
    each start with its group's previous one only: every mergeable start's arguments
    hashed (``_key``), a run going on while the group's latest start ends it."""
    from overlapc.passes.duplicates import _key, _starts_and_barriers
    from overlapc.passes.collectives import group_of, wait_nodes
    runs, open_run, last = [], {}, {}
    for node, _, barrier, _ in _starts_and_barriers(gm):
        if barrier:
            open_run.clear()
            last.clear()
            continue
        group = group_of(node)
        waits = wait_nodes(node)
        if len(waits) == 1 and waits[0].args[0] is node and len(node.users) == 1:
            key = (node.target, _key(node.args), _key(node.kwargs))
            run = open_run.get(key)
            if run is not None and run[-1] is last.get(group):
                run.append(node)
            else:
                open_run[key] = run = [node]
                runs.append(run)
        last[group] = node
    return [tuple(n.name for n in run) for run in runs if len(run) > 1]


def test_identical_runs_match_the_keyed_search():
    from overlapc.passes.duplicates import _merge_identical_runs, _starts_and_barriers
    rng = random.Random(40)
    merged_some = 0
    for _ in range(200):
        gm = _random_gathers(rng)
        expected = _runs_by_key(gm)
        assert _merge_identical_runs(gm, _starts_and_barriers(gm), None) == expected
        merged_some += bool(expected)
    assert merged_some > 20   # the graphs do exercise merging


def _random_casts(rng: random.Random) -> fx.GraphModule:
    """All-gathers of fp32 or bf16 shards, each read by a random chain of casts (to fp32,
    bf16, float8), abs, max and relu: some graphs hold nothing narrower than a gather."""
    graph = fx.Graph()
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float8_e4m3fn] if rng.random() < 0.5 else [])
    outputs = []
    for i in range(rng.randint(1, 6)):
        dtype = rng.choice(dtypes[:2])
        shard = graph.placeholder(f"w{i}")
        shard.meta["val"] = torch.empty(2, 8, dtype=dtype, device="meta")
        start = graph.call_function(F.all_gather_into_tensor.default, (shard, 2, "0"))
        start.meta["val"] = torch.empty(4, 8, dtype=dtype, device="meta")
        x = graph.call_function(F.wait_tensor.default, (start,))
        x.meta["val"] = start.meta["val"]
        for _ in range(rng.randint(0, 4)):
            op = rng.choice(["cast", "relu", "abs", "max"] if rng.random() < 0.2 else ["cast", "relu"])
            if op == "cast":
                cast = rng.choice(dtypes)
                x = graph.call_function(aten._to_copy.default, (x,), {"dtype": cast})
                x.meta["val"] = torch.empty(4, 8, dtype=cast, device="meta")
            elif op == "max":
                x = graph.call_function(aten.max.default, (x,))
                x.meta["val"] = torch.empty((), dtype=x.args[0].meta["val"].dtype, device="meta")
            else:
                x = graph.call_function(getattr(aten, op).default, (x,))
                x.meta["val"] = x.args[0].meta["val"]
        outputs.append(x)
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_narrowest_value_only_skips_walks_that_find_nothing():
    from overlapc.passes.narrow import _narrowest, _reaches_narrowing
    rng = random.Random(42)
    skipped = found = 0
    for _ in range(300):
        gm = _random_casts(rng)
        narrowest = _narrowest(gm.graph)
        for start in gm.graph.find_nodes(op="call_function", target=F.all_gather_into_tensor.default):
            walked = _reaches_narrowing(start, 0)
            assert _reaches_narrowing(start, narrowest) == walked
            skipped += start.meta["val"].dtype.itemsize <= narrowest
            found += walked
    assert skipped > 50 and found > 50   # both the shortcut and the walk are exercised


def test_narrow_gathers_decide_as_without_the_narrowest_value(monkeypatch):
    """``narrow_gathers`` with its shortcut (gathers no wider than the graph's narrowest value
    are no candidates) and without it (``_narrowest`` 0: every gather matched and walked)
    rewrite the same gathers and give the same reasons."""
    from overlapc.passes import narrow
    outcomes = set()
    for seed in range(150):
        results = []
        for plain in (False, True):
            gm = _random_casts(random.Random(seed))
            with monkeypatch.context() as patch:
                if plain:
                    patch.setattr(narrow, "_narrowest", lambda graph: 0)
                result = narrow.narrow_gathers(gm)
            results.append((result, [(n.name, str(n.target)) for n in gm.graph.nodes]))
        assert results[0] == results[1]
        outcomes.add((bool(results[0][0].rewritten), bool(results[0][0].skipped)))
    assert len(outcomes) >= 3, outcomes   # rewrites, reasons and neither all occur


def _random_sized_gathers(rng: random.Random) -> fx.GraphModule:
    """All-gathers of shards of three sizes over two groups, their results the outputs: lanes in
    which some neighbours fit a byte target together and some do not."""
    graph = fx.Graph()
    outputs = []
    for i in range(rng.randint(1, 12)):
        rows = rng.choice([1, 2, 4])
        shard = graph.placeholder(f"w{i}")
        shard.meta["val"] = _meta(rows, 8)
        start = graph.call_function(F.all_gather_into_tensor.default, (shard, 2, rng.choice(["0", "0", "1"])))
        start.meta["val"] = _meta(2 * rows, 8)
        outputs.append(graph.call_function(F.wait_tensor.default, (start,)))
        outputs[-1].meta["val"] = start.meta["val"]
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_lanes_without_two_neighbours_that_fit_are_not_planned(monkeypatch):
    """``bucket_collectives`` skipping lanes ``_may_merge`` rules out gives the buckets and graph
    it gives planning every lane."""
    from overlapc.passes import bucket
    merged = skipped = 0
    for seed in range(200):
        mode = random.Random(seed).choice(["auto", "module", 64, 128, 200])
        results = []
        for plain in (False, True):
            gm = _random_sized_gathers(random.Random(seed))
            with monkeypatch.context() as patch:
                if plain:
                    patch.setattr(bucket, "_may_merge", lambda lane, mode, largest: True)
                notes = bucket.bucket_collectives(gm, mode)
            results.append((repr(notes), [(n.name, str(n.target), str(n.args)) for n in gm.graph.nodes]))
        assert results[0] == results[1]
        merged += bool(notes)
        s = bucket.Structure(_random_sized_gathers(random.Random(seed)))
        lanes = bucket._lanes(s, "all_gather", False)
        largest = bucket._largest(lanes)
        skipped += any(not bucket._may_merge(lane, mode, largest[lane[0].c.group]) and len(lane) > 1
                       for lane in lanes.values())
    assert merged > 30 and skipped > 30   # both the shortcut and the planning are exercised


def test_duplicates_read_off_the_structure_as_off_the_graph():
    """``merge_duplicates`` with the graph's ``Structure`` finds the starts, waits and barriers
    its own walk finds, and merges the same collectives."""
    from overlapc.passes.duplicates import _starts_and_barriers, merge_duplicates
    from overlapc.passes.structure import Structure
    rng = random.Random(41)
    merged_some = 0
    for _ in range(150):
        seed = rng.random()
        gm = _random_gathers(random.Random(seed))
        assert _starts_and_barriers(gm, Structure(gm)) == _starts_and_barriers(gm)
        merged = merge_duplicates(gm, structure=Structure(gm))
        plain = _random_gathers(random.Random(seed))
        assert merged == merge_duplicates(plain)
        assert [(n.name, str(n.target), str(n.args)) for n in gm.graph.nodes] == \
            [(n.name, str(n.target), str(n.args)) for n in plain.graph.nodes]
        merged_some += bool(merged)
    assert merged_some > 20


def test_kinds_without_two_collectives_that_fit_are_not_planned(monkeypatch):
    """``bucket_collectives`` skipping the kinds ``_two_may_fit`` rules out gives the buckets and
    graph it gives planning every lane, and raises the same error for contradicting shapes."""
    from overlapc.passes import bucket
    skipped = merged = 0
    for seed in range(200):
        rng = random.Random(seed)
        mode, broken = rng.choice(["auto", "module", 32, 64, 128, 200]), rng.random() < 0.1
        results = []
        for plain in (False, True):
            gm = _random_sized_gathers(random.Random(seed))
            if broken:   # a gathered value that contradicts its group size
                start = next(n for n in gm.graph.nodes if n.target is F.all_gather_into_tensor.default)
                start.meta["val"] = _meta(3, 8)
            with monkeypatch.context() as patch:
                if plain:
                    patch.setattr(bucket, "_two_may_fit", lambda s, kind, mode: True)
                try:
                    outcome = repr(bucket.bucket_collectives(gm, mode))
                except ValueError as error:
                    outcome = str(error)
            results.append((outcome, [(n.name, str(n.target), str(n.args)) for n in gm.graph.nodes]))
        assert results[0] == results[1]
        s = bucket.Structure(_random_sized_gathers(random.Random(seed)))
        skipped += not broken and not bucket._two_may_fit(s, "all_gather", mode)
        merged += results[0][0].startswith("[BucketNote")
    assert skipped > 20 and merged > 20   # both the shortcut and the planning are exercised

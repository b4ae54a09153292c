"""The cross-rank schedule check (overlapc.backend.rankcheck).

Unit tests: the skeleton the backend computes per graph (fake process group),
and the Store protocol with ranks as threads on one HashStore. End to end:
2 gloo ranks with a rank-dependent model (one block more; the same blocks in
another order) fail with overlapc's error on both ranks, and an Inductor FX
graph cache hit on one rank only neither skips the check nor trips it.
"""
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

import overlapc
from multiproc import init_gloo, run_ranks
from overlapc.backend import rankcheck


class Gathered(torch.nn.Module):
    """Layers that all-gather their weight shard; ``order`` picks which run, in which order."""

    def __init__(self, world, layers=3, width=16, order=None):
        super().__init__()
        torch.manual_seed(0)
        self.shards = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(width // world, width) * 0.3) for _ in range(layers)])
        self.order = list(range(layers)) if order is None else order

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(x @ fc.all_gather_single_autograd(self.shards[i], 0, dist.group.WORLD).t())
        return x


def _recorded(monkeypatch, options):
    """The arguments of every rankcheck.agree call while compiling Gathered under ``options``."""
    calls = []
    monkeypatch.setattr(rankcheck, "enabled", lambda cfg: cfg.check_ranks is not False)
    monkeypatch.setattr(rankcheck, "agree", lambda *args: calls.append(args))
    torch._dynamo.reset()
    compiled = torch.compile(Gathered(8), backend="overlapc", options=options)
    compiled(torch.randn(4, 16)).sum().backward()
    torch._dynamo.reset()
    return calls


def test_skeleton_names_kind_group_bytes_and_the_parameter_moved(fake_pg, monkeypatch):
    calls = _recorded(monkeypatch, {"inner": "aot_eager"})
    (_, rank, world, n0, forward, steps, events, cfg), backward = calls
    assert (rank, world, cfg.inner) == (0, 8, "aot_eager") and forward.startswith("fw_")
    assert [s.source for s in steps] == [f"shards.{i}" for i in range(3)]
    assert {(s.kind, s.group, s.nbytes, s.dtype) for s in steps} == {("all_gather", "8 ranks, stride 1", 1024,
                                                                      "float32")}
    assert events == ["s0", "w0", "s1", "w1", "s2", "w2"]
    assert backward[3] == n0 + 1 and backward[4].startswith("bw_")
    assert [(s.kind, s.nbytes) for s in backward[5]] == [("reduce_scatter", 128)] * 3
    assert _recorded(monkeypatch, {"inner": "aot_eager", "check_ranks": False}) == []


@torch._inductor.config.patch(fx_graph_cache=False)
def test_the_check_runs_in_the_inductor_path_and_is_off_on_the_fake_backend(fake_pg, monkeypatch):
    calls = _recorded(monkeypatch, {"max_in_flight": 2})
    assert [c[4][:3] for c in calls] == ["fw_", "bw_"]
    monkeypatch.undo()
    assert not rankcheck.enabled(overlapc.OverlapConfig())            # fake backend: planning, one process
    with pytest.raises(ValueError, match="check_ranks must be True, False or None"):
        overlapc.OverlapConfig(check_ranks="yes")


def _step(kind="all_gather", source="L['self'].w0", nbytes=1024, module="blocks.0"):
    return rankcheck.Step(kind, "2 ranks, stride 1", nbytes, "float32", source, module)


def _run_threads(skeletons, timeout=5.0, absent=()):
    """Run agree() for every rank in threads on one store; each rank's error text or None."""
    store, world = dist.HashStore(), len(skeletons)
    cfg = overlapc.OverlapConfig(check_ranks=True, check_ranks_timeout=timeout)
    results = {}

    def rank_main(rank):
        steps = skeletons[rank]
        events = [e for i in range(len(steps)) for e in (f"s{i}", f"w{i}")]
        try:
            rankcheck.agree(store, rank, world, 0, f"fw_{rank + 3}", steps, events, cfg)
            results[rank] = None
        except rankcheck.RankMismatchError as error:
            results[rank] = str(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world) if r not in absent]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return results


def test_matching_ranks_pass():
    same = [_step(source=f"w{i}") for i in range(4)]
    assert _run_threads([same, list(same), list(same)]) == {0: None, 1: None, 2: None}


def test_same_sizes_other_parameters_fail_on_every_rank():
    one = [_step(source="L['self'].blocks[0].w", module="blocks.0"), _step(source="L['self'].blocks[1].w",
                                                                         module="blocks.1")]
    results = _run_threads([one, one, one[::-1]])
    assert set(results) == {0, 1, 2}
    for rank, text in results.items():
        assert text.startswith(f"overlapc (rank {rank}): rank 2 differs from rank 0 in graph fw_")
        assert "collective #0 of 2 on rank 0 is all_gather over 2 ranks, stride 1, 1024 B float32 of " \
               "L['self'].blocks[0].w (module blocks.0); on rank 2 (2 collectives) it is all_gather" in text
        assert "(module blocks.1)" in text and "check_ranks" in text


def test_one_collective_more_fails_naming_the_extra_one():
    base = [_step(source="a"), _step(source="b")]
    results = _run_threads([base, base + [_step(source="c", module="blocks.2")]])
    assert all("rank 0 has 2 collectives, rank 1 has 3; the first extra one (#2, on rank 1) is all_gather"
               in text and "(module blocks.2)" in text for text in results.values()), results


def test_a_rank_that_does_not_arrive_is_named_after_the_timeout():
    began = time.monotonic()
    results = _run_threads([[_step()]] * 3, timeout=0.5, absent=(2,))
    assert time.monotonic() - began < 5
    for rank in (0, 1):
        assert "waited 0.5 s for every rank at the check of graph fw_" in results[rank]
        assert "rank(s) 2 did not arrive. Expected of them: graph" in results[rank]
        assert "with 1 collectives (1 all_gather)" in results[rank]
    results = _run_threads([[_step()]] * 2, timeout=0.5, absent=(0,))
    assert "waited 0.5 s for rank 0's skeleton of graph fw_4" in results[1] and "rank(s) 0 did not arrive" \
        in results[1]


# -- end to end: 2 gloo ranks ------------------------------------------------------------------

def _train_steps(model, steps=2, options=None):
    compiled = torch.compile(model, backend="overlapc", options=options or {"inner": "aot_eager"})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = compiled(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return losses


def _job_rank_dependent(rank, world_size, port, case):
    import overlapc.fsdp
    init_gloo(rank, world_size, port)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
    order = [0, 1] if rank == 0 else {"one_more": [0, 1, 2], "reordered": [1, 0]}[case]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            for i in order:
                x = torch.tanh(self.blocks[i](x))
            return x

    model = overlapc.fsdp.shard(Model(), mesh)
    began = time.monotonic()
    try:
        _train_steps(model, options={"inner": "aot_eager", "check_ranks_timeout": 60})
        outcome = "trained"
    except Exception as error:  # noqa: BLE001 - Dynamo wraps the backend's error
        outcome = str(error)
    return outcome, time.monotonic() - began


@pytest.mark.parametrize("case", ["one_more", "reordered"])
def test_rank_dependent_blocks_fail_on_both_ranks_with_overlapc_error(case):
    results = run_ranks(_job_rank_dependent, world_size=2, args=(case,), timeout=240)
    for rank, (outcome, seconds) in enumerate(results):
        assert f"RankMismatchError: overlapc (rank {rank}): rank 1 differs from rank 0 in graph fw_0" in outcome, \
            outcome
        assert seconds < 60
        if case == "one_more":
            assert "rank 0 has 4 collectives, rank 1 has 6; the first extra one (#4, on rank 1) is all_gather " \
                "over 2 ranks, stride 1, 1024 B float32 of blocks.2.weight (module blocks.2)" in outcome
        else:
            assert "collective #0 of 4 on rank 0 is all_gather over 2 ranks, stride 1, 1024 B float32 of " \
                "blocks.0.weight (module blocks.0); on rank 1 (4 collectives) it is all_gather over 2 ranks, " \
                "stride 1, 1024 B float32 of blocks.1.weight (module blocks.1)" in outcome


def _job_cache_hit_on_rank_0(rank, world_size, port, cache_dir):
    import os
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    from torch._dynamo.utils import counters
    init_gloo(rank, world_size, port)
    torch._inductor.config.fx_graph_cache = rank == 0     # rank 1 compiles every time
    options = {"on_error": "raise"}
    first = _train_steps(Gathered(world_size), options=options)          # rank 0 fills its cache
    torch._dynamo.reset()
    counters.clear()
    second = _train_steps(Gathered(world_size), options=options)         # rank 0: cache hits
    hits = counters["inductor"]["fxgraph_cache_hit"]
    torch._dynamo.reset()
    try:   # rank 1 runs the layers in another order; rank 0 hits its cache (the pass does not run there)
        _train_steps(Gathered(world_size, order=[0, 1, 2] if rank == 0 else [1, 0, 2]), options=options)
        third = "trained"
    except Exception as error:  # noqa: BLE001
        third = str(error)
    return first, second, hits, third


def test_a_cache_hit_on_one_rank_neither_skips_nor_trips_the_check(tmp_path):
    results = run_ranks(_job_cache_hit_on_rank_0, world_size=2, args=(str(tmp_path),), timeout=500)
    (first0, second0, hits0, third0), (first1, second1, hits1, third1) = results
    assert hits0 == 2 and hits1 == 0                              # forward and backward came from the cache
    assert second0 == first0 and second1 == first1
    for rank, third in enumerate((third0, third1)):
        assert f"overlapc (rank {rank}): rank 1 differs from rank 0 in graph fw_2" in third, third
        assert "1024 B float32 of shards.0 " in third and "1024 B float32 of shards.1 " in third


_STEPS = st.lists(st.builds(_step, kind=st.sampled_from(["all_gather", "reduce_scatter"]),
                            source=st.sampled_from(["a", "b", "c"]), nbytes=st.sampled_from([512, 1024])),
                  min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(reference=_STEPS, other=_STEPS)
def test_any_difference_fails_every_rank_at_the_first_differing_collective(reference, other):
    results = _run_threads([reference, other])
    if reference == other:
        assert results == {0: None, 1: None}
        return
    first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    for rank in (0, 1):
        text = results[rank]
        assert text.startswith(f"overlapc (rank {rank}): rank 1 differs from rank 0 in graph fw_"), text
        assert f"collective #{first} of {len(reference)} on rank 0" in text or f"(#{first}, on rank" in text, text


# -- every schedule input: the options from OverlapConfig's fields, the profile's content ------------

def _profile_file(path, link_gbps, latency_us, issue_us=0.0):
    """A profile file (``overlapc.estimate.costmodel.PROFILE_SCHEMA``) at ``path`` with these link numbers."""
    import json
    from overlapc.estimate import costmodel
    with open(path, "w") as out:
        json.dump({"schema": costmodel.PROFILE_SCHEMA,
                   "device": {"name": "cpu", "tflops": 1e-5, "mem_gbps": 20.0},
                   "link": {"name": "ethernet", "gbps": link_gbps, "latency_us": latency_us,
                            "issue_us": issue_us}}, out)
    return str(path)


def _pipelines(path):    # the chunk pass pipelines on this profile (slow link, slow compute)
    return _profile_file(path, 0.002, 1.0)


def _one_piece(path):    # and not on this one (latency and issue cost 5 ms per piece)
    return _profile_file(path, 1000.0, 5000.0, issue_us=5000.0)


def test_every_config_field_but_the_named_ones_is_a_schedule_input():
    import dataclasses
    cfg = overlapc.OverlapConfig()
    fields = {f.name for f in dataclasses.fields(cfg)}
    assert set(rankcheck.schedule_options(cfg)) == fields - set(rankcheck.NOT_SCHEDULE_INPUTS)
    assert set(rankcheck.NOT_SCHEDULE_INPUTS) <= fields
    other = {"max_in_flight": 1, "max_in_flight_bytes": 4096, "bucket": None, "chunks": 2,
             "inductor_mode": "default", "on_error": "raise", "enabled": False, "inner": "aot_eager",
             "regather": "auto", "narrow_gathers": False, "issue": "per-kernel", "bucket_op": "coalesced"}
    assert set(other) == set(rankcheck.schedule_options(cfg))   # a new field needs a value here
    for name, value in other.items():
        changed = dataclasses.replace(cfg, **{name: value})
        assert rankcheck._schedule_inputs(changed) != rankcheck._schedule_inputs(cfg), name


def test_the_profiles_content_is_a_schedule_input_where_it_chooses_piece_counts(tmp_path):
    a, b = _pipelines(tmp_path / "a.json"), _one_piece(tmp_path / "b.json")
    same_as_a = _pipelines(tmp_path / "copy_of_a.json")
    inputs = {name: rankcheck._schedule_inputs(overlapc.OverlapConfig(chunks="auto", profile=path))
              for name, path in (("a", a), ("b", b), ("copy", same_as_a))}
    assert "profile content" in inputs["a"] and inputs["a"] != inputs["b"]
    assert inputs["a"].split("profile content")[1] == inputs["copy"].split("profile content")[1]
    fixed = [rankcheck._schedule_inputs(overlapc.OverlapConfig(chunks=2, profile=p)) for p in (a, b)]
    assert fixed[0] == fixed[1] and "profile" not in fixed[0].split("options")[0]


def test_a_recalibrated_profile_changes_the_inductor_cache_key(tmp_path):
    from overlapc.backend import SchedulePass
    path = _pipelines(tmp_path / "profile.json")
    cfg = overlapc.OverlapConfig(chunks="auto", profile=path)
    before = SchedulePass(cfg).uuid()
    assert SchedulePass(cfg).uuid() == before
    _one_piece(path)   # recalibrated in place: same path, other numbers
    assert SchedulePass(cfg).uuid() != before


def test_every_rank_schedules_with_rank_0s_profile_through_the_store(tmp_path):
    from overlapc import api
    store = dist.HashStore()
    paths = [_pipelines(tmp_path / "rank0.json"), _one_piece(tmp_path / "rank1.json")]
    cfgs = [overlapc.OverlapConfig(chunks="auto", profile=p, check_ranks_timeout=5) for p in paths]
    assert rankcheck.profile_digest(cfgs[0]) != rankcheck.profile_digest(cfgs[1])
    errors = {}

    def rank_main(rank):
        try:
            rankcheck.share_profile(store, rank, 2, 0, "fw_0", cfgs[rank])
        except Exception as error:  # noqa: BLE001 - reported below
            errors[rank] = error
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    try:
        assert errors == {}
        assert rankcheck.profile_digest(cfgs[1]) == rankcheck.profile_digest(cfgs[0])
        assert "rank 0's profile" in api.schedule_profile(paths[1]).source
    finally:
        api._agreed_profiles.clear()


def _sp_block(x, w1, w2):
    """Sequence parallel: all-gather the rows, an MLP, reduce-scatter (the chunk pass's pattern)."""
    full = fc.all_gather_tensor(x, 0, dist.group.WORLD)
    return fc.reduce_scatter_tensor(torch.relu(full @ w1) @ w2, "sum", 0, dist.group.WORLD)


def _job_different_profiles(rank, world_size, port, folder):
    import os
    from torch.fx.experimental.proxy_tensor import make_fx

    import overlapc.backend.compiler
    from overlapc.estimate import costmodel
    from overlapc.passes.chunk import chunk_collectives
    init_gloo(rank, world_size, port)
    path = (_pipelines if rank == 0 else _one_piece)(os.path.join(folder, f"rank{rank}.json"))
    args = [torch.randn(32, 64), torch.randn(64, 128), torch.randn(128, 64)]
    # what this rank's own profile would choose, without the check
    alone = [n.chunks for n in chunk_collectives(make_fx(_sp_block)(*args), "auto", costmodel.resolve(path))]
    scheduled, schedule_graph = [], overlapc.backend.compiler.schedule_graph

    def recording(gm, cfg, **kwargs):
        out = schedule_graph(gm, cfg, **kwargs)
        scheduled.append([(n.name, str(n.target)) for n in gm.graph.nodes])
        return out
    overlapc.backend.compiler.schedule_graph = recording
    options = {"chunks": "auto", "profile": path, "inner": "aot_eager", "on_error": "raise",
               "check_ranks_timeout": 120}
    out = torch.compile(_sp_block, backend="overlapc", options=options)(*args)
    return alone, scheduled, out.shape


def test_ranks_with_different_profile_files_schedule_alike_under_chunks_auto(tmp_path):
    (alone0, graphs0, shape0), (alone1, graphs1, shape1) = run_ranks(
        _job_different_profiles, world_size=2, args=(str(tmp_path),), timeout=300)
    assert alone0 != alone1 and alone0[0] > 1 == alone1[0]   # on its own, each rank would choose otherwise
    assert len(graphs0) == 1 and graphs0 == graphs1             # with the check: rank 0's profile everywhere
    pieces = sum("all_gather_into_tensor" in target for _, target in graphs0[0])
    assert pieces == alone0[0] and shape0 == shape1

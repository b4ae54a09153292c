"""Check, before a compiled graph runs, that every rank compiled the same collectives.

Reordering collectives is safe only when every rank issues the same ones in
the same order. ``check(gm, ...)`` runs in the backend's per-graph compile
wrapper, on the graph AOTAutograd hands over (before Inductor's post-grad
passes, the schedule and Inductor's FX graph cache, so a cache hit on some
ranks and a miss on others checks the same thing). Each graph's *skeleton*
is its collectives in graph order with their waits (kind, group as a
rank-independent pattern, bytes, dtype, the parameter or input each one
moves, its module) plus what decides the schedule (overlapc's options, every
OverlapConfig field but those in ``NOT_SCHEDULE_INPUTS``; the cost profile's
content where it chooses piece counts, ``chunks="auto"``; overlapc's source
and torch's version); the schedule is a deterministic function of these and
the graph. With ``chunks="auto"`` every rank first takes rank 0's profile
through the Store (``share_profile``), so the ranks agree by construction.

Protocol, through the default process group's c10d Store, never a collective
(so the check cannot hang on the mismatch it looks for), for the n-th graph
with collectives that this process compiles: rank 0 publishes its skeleton's
digest; every other rank compares its own with it (and on a difference reads
rank 0's skeleton once to name the first differing collective); every rank
marks its arrival and waits, under ``check_ranks_timeout``, until all have
arrived, then every rank raises the same ``RankMismatchError`` if any rank
differed. A constant number of store operations per rank and graph (about 7)
on a match; a rank that does not arrive in time is named with what was
expected of it. Graphs without collectives are not counted.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import time
from datetime import timedelta

import torch
import torch.fx as fx

from overlapc.collectives import input_descriptor, input_source, is_wait, module_path, moved_input, scan
from overlapc.config import OverlapConfig

_PREFIX = "overlapc/rankcheck"
_sequence = itertools.count()   # the n-th graph with collectives compiled in this process


class RankMismatchError(RuntimeError):
    """Ranks compiled different collectives for one graph, or one did not arrive in time."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One collective as ranks compare it."""

    kind: str
    group: str      # rank-independent: "<size> ranks, stride <s>" (or the ranks' offsets)
    nbytes: int | None
    dtype: str
    source: str     # the graph input it moves ("layers.0.w", "L['x']"), or "" when computed
    module: str

    def describe(self) -> str:
        size = "?" if self.nbytes is None else f"{self.nbytes} B"
        moves = f" of {self.source}" if self.source else ""
        return f"{self.kind} over {self.group}, {size} {self.dtype}{moves} (module {self.module or '?'})"


def enabled(cfg: OverlapConfig) -> bool:
    """Whether ``cfg`` asks for the check here: a real (not "fake") default group
    of more than one rank, and check_ranks True or None."""
    dist = torch.distributed
    if cfg.check_ranks is False or not cfg.enabled or not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size() > 1 and dist.get_backend() != "fake"


def skeleton(gm: fx.GraphModule, input_names: list[str]) -> tuple[list[Step], list[str]]:
    """The collectives of ``gm`` in graph order and the order of their starts and
    waits ("s3", "w3"). ``input_names[i]`` names the i-th input of the Dynamo graph
    (AOTAutograd's placeholders point at them through ``meta["desc"]``)."""
    nodes = list(gm.graph.nodes)
    found = scan(nodes, {}, first_consumers=False)
    index = {c.start: i for i, c in enumerate(found)}
    waits = {w: index[c.start] for c in found for w in c.waits}
    groups = {name: _group(name) for name in sorted({c.group for c in found})}
    steps = [Step(c.kind, groups[c.group], c.nbytes, str(c.dtype).removeprefix("torch."),
                  _source(c.start, input_names), module_path(c.start)) for c in found]
    events = []
    for node in nodes:
        if node in index:
            events.append(f"s{index[node]}")
        elif is_wait(node) and node in waits:
            events.append(f"w{waits[node]}")
    return steps, events


def check(gm: fx.GraphModule, graph: str, cfg: OverlapConfig, input_names: list[str]) -> float | None:
    """Compare ``gm``'s skeleton with rank 0's through the default group's Store
    (``agree``), after taking rank 0's profile when it decides the schedule
    (``share_profile``). Returns the seconds it took, None when the graph has
    no collectives (nothing is exchanged and the graph is not counted)."""
    began = time.perf_counter()
    steps, events = skeleton(gm, input_names)
    if not steps:
        return None
    dist = torch.distributed
    store, rank, world, n = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), \
        next(_sequence)
    share_profile(store, rank, world, n, graph, cfg)
    agree(store, rank, world, n, graph, steps, events, cfg)
    return time.perf_counter() - began


def share_profile(store, rank: int, world: int, n: int, graph: str, cfg: OverlapConfig) -> None:
    """With ``chunks="auto"`` (the cost profile chooses piece counts), make every
    rank schedule the ``n``-th checked graph with rank 0's profile: rank 0
    publishes its resolved profile through the Store, every other rank reads
    it and schedules with it wherever its config names its own
    (``api.use_profile``), so a profile calibrated on one node only, or
    files that differ, cannot give ranks different schedules. Nothing is
    exchanged otherwise. RankMismatchError when rank 0 does not publish within
    ``cfg.check_ranks_timeout``."""
    if not profile_decides(cfg):
        return
    from overlapc import api, estimate
    key = f"{_PREFIX}/{n}/profile"
    if rank == 0:   # read afresh: a recalibrated file counts from the next graph on
        profile = estimate.resolve(cfg.profile)
        store.set(key, estimate.profile_to_text(profile))
    else:
        store.set(f"{_PREFIX}/{n}/rank{rank}", "")   # arrived (agree sets it too)
        where = f"graph {graph} (the {_ordinal(n + 1)} graph with collectives compiled on each rank)"
        timeout = timedelta(seconds=cfg.check_ranks_timeout)
        _wait(store, [key], timeout, rank, world, f"{_PREFIX}/{n}/", where, f"rank 0's profile for {where}", [])
        profile = estimate.profile_from_text(store.get(key).decode(), "rank 0's profile")
    api.use_profile(cfg.profile, profile)


def profile_decides(cfg: OverlapConfig) -> bool:
    """Whether the cost profile can change the schedule (it chooses piece counts)."""
    return cfg.chunks == "auto"


def profile_digest(cfg: OverlapConfig) -> str:
    """sha256 of the content of the profile the schedule of ``cfg`` reads (rank 0's
    when ranks shared it, else ``cfg.profile`` resolved): its device and link
    numbers, not its name or path, so a recalibrated file changes it."""
    from overlapc import api, estimate
    profile = estimate.resolve(api.schedule_profile(cfg.profile))
    content = dataclasses.asdict(profile)
    content.pop("name")
    content.pop("source")
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def agree(store, rank: int, world: int, n: int, graph: str, steps: list[Step], events: list[str],
          cfg: OverlapConfig) -> None:
    """The protocol for the ``n``-th checked graph (module docstring); raises
    RankMismatchError on every rank when any rank differs or one does not arrive
    within ``cfg.check_ranks_timeout``."""
    key = f"{_PREFIX}/{n}/"
    timeout = timedelta(seconds=cfg.check_ranks_timeout)
    mine = {"steps": [dataclasses.astuple(s) for s in steps], "events": events, "schedule": _schedule_inputs(cfg)}
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    where = f"graph {graph} (the {_ordinal(n + 1)} graph with collectives compiled on each rank)"
    store.set(key + f"rank{rank}", "")
    if rank == 0:
        store.set(key + "ref", digest)
        store.set(key + "ref_detail", json.dumps(mine))
    else:
        _wait(store, [key + "ref"], timeout, rank, world, key, where, f"rank 0's skeleton of {where}", steps)
        if store.get(key + "ref").decode() != digest:
            reference = json.loads(store.get(key + "ref_detail"))
            store.compare_set(key + "bad", "", f"rank {rank} differs from rank 0 in {where}: "
                              f"{_difference(reference, mine, rank)}")
    if store.add(key + "arrived", 1) == world:
        store.set(key + "done", "")
    _wait(store, [key + "done"], timeout, rank, world, key, where, f"every rank at the check of {where}", steps)
    if store.check([key + "bad"]):
        raise RankMismatchError(f"overlapc (rank {rank}): {store.get(key + 'bad').decode()}. {_ADVICE}")


_ADVICE = ("Every rank must compile the same collectives in the same order, or the job hangs or trains on "
           "mixed-up data: remove rank-dependent branches around sharded modules, make graph breaks the same "
           "on every rank (torch._dynamo.explain), and run the same torch, overlapc and options everywhere. "
           "Nothing of this graph ran; options={'check_ranks': False} turns the check off")


def _wait(store, keys, timeout, rank, world, key, where, what, steps) -> None:
    """store.wait with a RankMismatchError naming the ranks that have not arrived."""
    try:
        store.wait(keys, timeout)
    except torch.distributed.DistStoreError:   # the timeout; a lost store (DistNetworkError) propagates
        missing = _missing(store, key, world)
        kinds = ", ".join(f"{sum(s.kind == k for s in steps)} {k}" for k in sorted({s.kind for s in steps}))
        bad = store.get(key + "bad").decode() + "; also: " if store.check([key + "bad"]) else ""
        raise RankMismatchError(
            f"overlapc (rank {rank}): {bad}waited {timeout.total_seconds():g} s for {what}; "
            f"rank(s) {_ranks(missing)} did not arrive. Expected of them: {where} with {len(steps)} collectives "
            f"({kinds}). A rank that compiled fewer graphs with collectives (a graph break or a recompile on "
            f"that rank only, rank-dependent code) never arrives; a slow compile needs a larger "
            f"check_ranks_timeout (now {timeout.total_seconds():g} s). {_ADVICE}") from None


def _missing(store, key: str, world: int) -> list[int]:
    """Ranks whose arrival mark is absent (one store check per 256 ranks, more where some are missing)."""
    missing = []
    for first in range(0, world, 256):
        ranks = range(first, min(first + 256, world))
        if not store.check([key + f"rank{r}" for r in ranks]):
            missing += [r for r in ranks if not store.check([key + f"rank{r}"])]
    return missing


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "") if ranks else "(none: too slow)"


def _difference(reference: dict, mine: dict, rank: int) -> str:
    """The first difference between rank 0's skeleton and this rank's, in words."""
    theirs, ours = [Step(*s) for s in reference["steps"]], [Step(*s) for s in mine["steps"]]
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            return (f"collective #{i} of {len(theirs)} on rank 0 is {a.describe()}; "
                    f"on rank {rank} ({len(ours)} collectives) it is {b.describe()}")
    if len(theirs) != len(ours):
        longer, extra = (0, theirs[len(ours)]) if len(theirs) > len(ours) else (rank, ours[len(theirs)])
        return (f"rank 0 has {len(theirs)} collectives, rank {rank} has {len(ours)}; the first extra one "
                f"(#{min(len(theirs), len(ours))}, on rank {longer}) is {extra.describe()}")
    if reference["events"] != mine["events"]:
        at = next(i for i, (a, b) in enumerate(zip(reference["events"], mine["events"])) if a != b)
        return (f"the same collectives, waited in another order: from event #{at}, rank 0 "
                f"{' '.join(reference['events'][at:at + 6])} vs rank {rank} {' '.join(mine['events'][at:at + 6])}"
                f" (s = start, w = wait of collective #)")
    return (f"the same collectives, scheduled with other inputs: rank 0 {reference['schedule']} vs "
            f"rank {rank} {mine['schedule']}")


def _source(start: fx.Node, input_names: list[str]) -> str:
    """The graph input a collective moves (through casts and views), named by Dynamo's source."""
    node = moved_input(start)
    if node is None or node.op != "placeholder":
        return ""
    name = input_source(node, input_names)
    if name:
        return name
    target = getattr(input_descriptor(node), "target", None)
    return str(target) if target is not None else node.name


def _group(name: str) -> str:
    """A process group as every member describes it: size and rank pattern, not its local name."""
    dist = torch.distributed
    try:
        ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))
    except Exception:  # noqa: BLE001 - not resolvable here: its name is what we have
        return f"group {name}"
    strides = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(strides) <= 1:
        return f"{len(ranks)} ranks, stride {strides.pop() if strides else 0}"
    return f"{len(ranks)} ranks at offsets {[r - ranks[0] for r in ranks]}"


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 of overlapc's own source (overlapc/ and its passes, sub-folders included); once per process."""
    import overlapc
    import overlapc.passes
    digest = hashlib.sha256()
    for folder in (os.path.dirname(overlapc.__file__), os.path.dirname(overlapc.passes.__file__)):
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(root, name), "rb") as source:
                        digest.update(source.read())
    return digest.hexdigest()[:16]


# OverlapConfig fields that cannot change the collectives' order, and why; every other
# field (one added later too) is a schedule input.
NOT_SCHEDULE_INPUTS = {
    "check_ranks": "turns this check on or off",
    "check_ranks_timeout": "how long this check waits",
    "dump_dir": "where artifacts are written",
    "profile": "its content counts instead (profile_digest), where it decides the schedule",
}


def schedule_options(cfg: OverlapConfig) -> dict:
    """Every OverlapConfig field that may change the schedule (all but ``NOT_SCHEDULE_INPUTS``)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in NOT_SCHEDULE_INPUTS}


def _schedule_inputs(cfg: OverlapConfig) -> str:
    """What decides the schedule besides the graph: the options, the profile's content
    when it decides (chunks="auto"), overlapc's source, torch's version."""
    profile = f", profile content {profile_digest(cfg)}" if profile_decides(cfg) else ""
    return f"options {schedule_options(cfg)}{profile}, overlapc source {source_hash()}, torch {torch.__version__}"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 < 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"

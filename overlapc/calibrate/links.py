"""Measuring collectives: the back-to-back sweep and collectives in the middle of compute."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from overlapc.calibrate.fitting import slot_length_ms
from overlapc.calibrate.measure import REFERENCES, median_ms, sync_for, warm_train_step
from overlapc.collectives import KINDS as COLLECTIVE_KINDS
from overlapc.collectives import collectives as find_collectives
from overlapc.estimate import costmodel

KINDS = tuple(kind for kind, known in COLLECTIVE_KINDS.items() if known.ring_phases)   # what is measured
SWEEP = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)   # full buffer bytes
QUICK_SWEEP = (4 << 10, 256 << 10, 1 << 20)
REPEATS, QUICK_REPEATS = 10, 25   # samples per (kind, size), interleaved


def _start(kind: str, nbytes: int, world_size: int, group_name: str, device: torch.device):
    """A callable issuing one ``kind`` collective whose full buffer is ``nbytes``; it returns
    the result to wait on."""
    ops = torch.ops._c10d_functional
    numel = max(world_size, nbytes // 4 // world_size * world_size)
    if kind == "all_gather":
        shard = torch.ones(numel // world_size, device=device)
        return lambda: ops.all_gather_into_tensor(shard, world_size, group_name)
    full = torch.ones(numel, device=device)
    if kind == "reduce_scatter":
        return lambda: ops.reduce_scatter_tensor(full, "sum", world_size, group_name)
    if kind == "all_reduce":
        return lambda: ops.all_reduce(full, "sum", group_name)
    if kind == "all_to_all":
        splits = [numel // world_size] * world_size
        return lambda: ops.all_to_all_single(full, splits, splits, group_name)
    raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")


def _collective(kind: str, nbytes: int, world_size: int, group_name: str, device: torch.device):
    """A callable running one ``kind`` collective whose full buffer is ``nbytes``, waited."""
    start = _start(kind, nbytes, world_size, group_name, device)
    return lambda: torch.ops._c10d_functional.wait_tensor(start())


ISSUE_SIZES = (4 << 10, 1 << 20)   # full buffer bytes


ISSUE_MATMUL = 64                    # a slot's compute: n^2 fp32 matmuls, tens of us each, like a step's kernels


BLOCK_MS = 16.0                      # a timed block's compute at least: slots of SLOT_MS, at least ISSUE_SLOTS


ISSUE_SLOTS = 8                      # slots of matmuls per timed block at least, a collective (or two) at each


ISSUE_REPEATS = 11                   # rounds of IssueSampler in measure_in_step (quick)




BLOCKS = ("compute", "overlapped", "serial", "pair")


def _slot_block(start, per_slot: int, slots: int, a, b, sync, calls: list[float]):
    """A callable timing one block of ``slots`` slots of ``per_slot`` matmuls in one of
    ``BLOCKS``' ways: compute alone; "overlapped": a collective started before each slot and
    waited after it; "serial": started and waited at once before each slot; "pair": two started
    and both waited before each slot. It returns (the block's ms, the ms spent inside the
    collectives' start and wait calls), per slot. Mean start call times (us) of overlapped
    blocks go to ``calls``."""
    import torch.distributed as dist
    wait = torch.ops._c10d_functional.wait_tensor

    def block(how: str) -> tuple[float, float]:
        in_start = in_calls = 0.0
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(slots):
            work = None
            called = time.perf_counter()
            if how == "overlapped":
                work = start()
                in_start += time.perf_counter() - called
            elif how == "serial":
                wait(start())
            elif how == "pair":
                first, second = start(), start()
                wait(first)
                wait(second)
            in_calls += time.perf_counter() - called
            for _ in range(per_slot):
                torch.mm(a, b)
            if work is not None:
                sync()
                called = time.perf_counter()
                wait(work)
                in_calls += time.perf_counter() - called
        sync()
        if how == "overlapped":
            calls.append(in_start / slots * 1e6)
        return (time.perf_counter() - begin) * 1e3 / slots, in_calls * 1e3 / slots
    return block


IN_STEP_ORDERS = ("plain", "serial", "scheduled")


def _timed_round(steps, sync) -> list[float]:
    """Each of ``steps`` once, in order, every rank starting it together; ms each, the closing
    barrier included (as ``overlapc demo`` times its steps)."""
    import torch.distributed as dist

    times = []
    for step in steps:
        dist.barrier()
        begin = time.perf_counter()
        step()
        sync()
        dist.barrier()
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def _in_step_layer(device: torch.device, sizes: dict) -> torch.nn.Module:
    """The small reference block of ``sizes`` (a ``TransformerEncoderLayer``) on ``device``."""
    return torch.nn.TransformerEncoderLayer(sizes["width"], sizes["heads"], dim_feedforward=sizes["ffn"],
                                            dropout=0.0, batch_first=True).to(device)


IN_STEP_CAPTURES = (("serial", {"bucket": None, "chunks": 1}), ("scheduled", {}))   # as Inductor runs it; overlapc


def _in_step_graphs(device: torch.device, sizes: dict, mesh) -> dict:
    """{"serial": [(graph, order)], "scheduled": [...]}: the sharded reference block's forward
    and backward graphs as ``overlapc.backend.capture`` gives them, unbucketed in their traced
    order (``before_order``: as plain Inductor runs them) and as overlapc schedules them (order
    None: the graph's own); what ``in_step_scales`` simulates. Every rank calls this before
    compiling anything it keeps (capture resets Dynamo)."""
    import overlapc.fsdp
    from overlapc import backend

    graphs = {}
    for order, options in IN_STEP_CAPTURES:
        torch.manual_seed(0)
        model = overlapc.fsdp.shard(_in_step_layer(device, sizes), mesh)
        x = torch.randn(sizes["batch"], sizes["seq"], sizes["width"], device=device)
        graphs[order] = [(r.gm, r.before_order if order == "serial" else None)
                         for r in backend.capture(model, (x,), options)]
    return graphs


def _in_step_model(device: torch.device, sizes: dict, order: str, mesh) -> tuple[Callable[[], None], int]:
    """(a warm training step (``warm_train_step``) of the small reference block in ``order``,
    its parameter count): "plain" as it is, compiled by Inductor; "serial" sharded by
    ``overlapc.fsdp`` over ``mesh`` and compiled by plain Inductor (each collective waited right
    after it starts); "scheduled" sharded and compiled by overlapc (default options)."""
    import overlapc.fsdp

    torch.manual_seed(0)
    model = _in_step_layer(device, sizes)
    parameters = sum(1 for _ in model.parameters())
    if order != "plain":
        model = overlapc.fsdp.shard(model, mesh)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["width"], device=device)
    y = torch.randn(sizes["batch"], sizes["seq"], sizes["width"], device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="overlapc" if order == "scheduled" else "inductor", dynamic=False)
    return warm_train_step(compiled, optimizer, x, y), parameters


def measure_in_step(device: torch.device, collectives: dict, quick: bool = False) -> tuple[dict, dict, dict]:
    """(``IssueSampler.result()``, the in-step reference, its graphs (``_in_step_graphs``)): what
    collectives cost compiled training steps, against what ``IssueSampler``'s blocks price them
    at, at the same time.

    The small block of ``REFERENCES`` is built three times from one seed (``_in_step_model``):
    plain, sharded in its traced order ("serial") and sharded as overlapc schedules it
    ("scheduled"). During each round of the blocks (``ISSUE_REPEATS`` rounds, quick), the three
    are timed in turn after every point of the round (``IssueSampler.round``'s ``between``: its
    kinds x sizes), so their samples spread over the whole measurement as a step's slow spells
    do (over 10 consecutive rounds the scheduled step's median moved 17-33 ms). The reference:
    {"collectives": {"serial": [[kind, full bytes], ...], "scheduled": [...]} of its graphs,
    "parameters", "<order>_ms" per order (the slowest rank's median), "rounds", and the
    block's sizes};
    ``in_step_scales`` turns it into the factors the blocks' costs are scaled by. Every rank
    of the default group calls this."""
    import torch.distributed as dist

    sampler = IssueSampler(device, collectives)   # first: it routes gloo's all-gathers
    sizes = REFERENCES.get(device.type, REFERENCES["cpu"])[0]
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    graphs = _in_step_graphs(device, sizes, mesh)
    steps = []
    for order in IN_STEP_ORDERS:
        step, parameters = _in_step_model(device, sizes, order, mesh)
        steps.append(step)
    sync = sync_for(device)
    taken: list[list[float]] = [[] for _ in steps]

    def reference_round() -> None:
        for times, ms in zip(taken, _timed_round(steps, sync)):
            times.append(ms)

    for _ in range(ISSUE_REPEATS if quick else REPEATS):
        sampler.round(between=reference_round)
    medians = _slowest_median(taken)
    reference = {**sizes, "model": "TransformerEncoderLayer", "parameters": parameters, "rounds": len(taken[0]),
                 "collectives": {order: [[c.kind, costmodel.collective_bytes(c) or 0] for gm, _ in graphs[order]
                                         for c in find_collectives(gm)] for order in IN_STEP_ORDERS[1:]},
                 **{f"{order}_ms": ms for order, ms in zip(IN_STEP_ORDERS, medians)}}
    return sampler.result(), reference, graphs


class IssueSampler:
    """What collectives cost a thread that computes, at each of ``ISSUE_SIZES``, one round of
    samples at a time. Per kind and size, blocks of slots of ``ISSUE_MATMUL``^2 matmuls (each
    slot at least ``SLOT_MS`` and 1.5x the collective's sweep time; a block at least
    ``BLOCK_MS`` and ``ISSUE_SLOTS`` slots) are timed in the four ways of ``BLOCKS``:
    ``round()`` times every (kind, size) point's ways once, back to back, point after point;
    ``result()`` gives the costs from the rounds taken so far. Every rank of the default group
    makes the same calls (the blocks and the result meet the other ranks). Rounds may be
    spread over other work, so the costs are those of the machine while that work runs
    (``measure_in_step`` takes them between reference steps, ``overlapc demo`` between its
    timed steps).

    The blocks price collectives on a host where compute keeps every core busy: on 2 gloo
    ranks of a 2-core host they priced a collective waited at once at 0.9-1.5 ms and an
    overlapped one at 0.9-1.4 ms, while compiled training steps spent 0.7-1.0 ms per
    collective waited at once and 0.7-0.9 ms overlapped; ``measure_in_step`` measures the ratio."""

    def __init__(self, device: torch.device, collectives: dict):
        import torch.distributed as dist

        self.world_size = dist.get_world_size()
        group_name = dist.group.WORLD.group_name
        if dist.get_backend() == "gloo":   # functional all-gathers in flight (README, Known issues)
            from overlapc.torch_compat import route_gloo_all_gathers
            route_gloo_all_gathers()
        sync = sync_for(device)
        a = torch.randn(ISSUE_MATMUL, ISSUE_MATMUL, device=device)
        b = torch.randn(ISSUE_MATMUL, ISSUE_MATMUL, device=device)
        torch.mm(a, b)

        def matmuls() -> None:
            for _ in range(50):
                torch.mm(a, b)
        mm_ms = torch.tensor([median_ms(matmuls, 5, sync) / 50], dtype=torch.float64)
        dist.all_reduce(mm_ms, op=dist.ReduceOp.MAX)
        self.points = [(kind, nbytes) for kind in KINDS for nbytes in ISSUE_SIZES]
        self.blocks, self.starts = [], []
        for kind, nbytes in self.points:
            start = _start(kind, nbytes, self.world_size, group_name, device)
            torch.ops._c10d_functional.wait_tensor(start())
            slot_ms = slot_length_ms(collectives[kind], nbytes)
            calls: list[float] = []   # this point's start calls, us per call, per overlapped block
            slots = max(ISSUE_SLOTS, round(BLOCK_MS / slot_ms))
            block = _slot_block(start, max(1, int(slot_ms / float(mm_ms.item())) + 1), slots, a, b, sync, calls)
            block("overlapped")
            calls.clear()
            self.blocks.append(block)
            self.starts.append(calls)
        self.taken: list[list[list[float]]] = [[] for _ in self.points]

    def round(self, between: Callable[[], None] | None = None) -> None:
        """One sample of every point: its ways timed back to back, so drifts in the machine's
        load hit all alike; ``between`` (if given) called after each point."""
        for block, taken in zip(self.blocks, self.taken):
            taken.append([block(how) for how in BLOCKS])
            if between is not None:
                between()

    def result(self) -> dict:
        """{kind: [(full bytes, us, start us, serial us, pair us), ...]}, medians over the rounds,
        each the slowest rank's: us, the issuing thread's whole cost of a collective that
        compute covers (its wait included); start us, the start calls' mean time in the
        overlapped blocks; serial us, one waited at once; pair us, two started together and
        waited at once. Per slot, serial and pair the time inside their start and wait calls,
        overlapped that plus what the block took beyond its calls and the compute-only block
        (gloo's threads slowing compute). Not block less compute-only block: on a loaded
        machine a thread that waits often is scheduled ahead of one that computes throughout,
        so the compute-only block slowed more than the others' compute and the difference
        priced collectives low."""
        def costs(sample) -> list[float]:
            (compute, _), (overlapped, calls), (_, serial), (_, pair) = sample
            return [(calls + max(0.0, overlapped - calls - compute)) * 1e3, serial * 1e3, pair * 1e3]
        per_sample = [[costs(sample) for sample in point] for point in self.taken]
        extra = [_slowest_median([[cost[i] for cost in point] for point in per_sample]) for i in range(3)]
        start_us = _slowest_median(self.starts)
        result: dict[str, list[tuple[int, float, float, float, float]]] = {}
        for at, ((kind, nbytes), called) in enumerate(zip(self.points, start_us)):
            numel = max(self.world_size, nbytes // 4 // self.world_size * self.world_size)
            us, serial, pair = (max(0.0, ways[at]) for ways in extra)
            result.setdefault(kind, []).append((numel * 4, us, called, serial, pair))
        return result


def interleaved(runs: list[Callable[[], float]], rounds: int) -> list[list[float]]:
    """``rounds`` samples of each of ``runs`` (callables returning one measured number), taken
    round-robin: run 0, 1, ..., n-1, then again, so a slow spell of the machine (a ~4 ms stall
    on 2 shared cores hits several consecutive samples) spreads over every run instead of
    filling one run's samples. Returns the samples per run, in order."""
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, taken in zip(runs, samples):
            taken.append(run())
    return samples


def _slowest_median(samples: list[list[float]]) -> list[float]:
    """Per run, the median of this rank's samples, then the largest over the default group's
    ranks (every rank calls this with as many runs)."""
    import torch.distributed as dist

    medians = torch.tensor([statistics.median(taken) for taken in samples], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return [float(v) for v in medians]


def measure_collectives(device: torch.device, quick: bool = False, say=lambda message: None) -> dict:
    """{kind: [(full bytes, ms), ...]} on the default process group (every rank calls this).
    Every (kind, size) is timed ``repeats`` times, interleaved (``interleaved``), each timed
    call right after an untimed one of the same kind and size (on a shaped link a 4 KiB
    collective right after a 1 MiB one queued behind its bytes: 2.7-8.5 ms); each time is the
    slowest rank's median."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    sync = sync_for(device)
    sizes, repeats = (QUICK_SWEEP, QUICK_REPEATS) if quick else (SWEEP, REPEATS)
    for kind in KINDS:   # warm-up: connection set-up and first-use costs
        for _ in range(2):
            _collective(kind, sizes[0], world_size, group_name, device)()
    points = [(kind, nbytes) for kind in KINDS for nbytes in sizes]
    runs = []
    for kind, nbytes in points:
        run = _collective(kind, nbytes, world_size, group_name, device)
        run()

        def timed(run=run) -> float:
            run()   # settles: every rank is done with the point before, whose bytes have left the link
            sync()
            begin = time.perf_counter()
            run()
            sync()
            return (time.perf_counter() - begin) * 1e3
        runs.append(timed)
    dist.barrier()
    results: dict[str, list[tuple[int, float]]] = {}
    for (kind, nbytes), ms in zip(points, _slowest_median(interleaved(runs, repeats))):
        numel = max(world_size, nbytes // 4 // world_size * world_size)
        results.setdefault(kind, []).append((numel * 4, ms))
    for kind in KINDS:
        say(f"{kind}: " + ", ".join(f"{b >> 10} KiB {ms:.3f} ms" for b, ms in results[kind]))
    return results

"""``overlapc calibrate``: measure this machine and write a profile file.

What is measured, on the process group it runs in (every rank takes part;
rank 0 writes the file):

* collectives: all_gather, reduce_scatter, all_reduce and all_to_all (the
  functional ops overlapc schedules, each waited at once) over a sweep of
  sizes; per size the median of ``repeats`` timed runs after a warm-up (the
  first collective on a new gloo pair costs ~1.5 s), the slowest rank's median
  counting. The runs of every kind and size are interleaved (round-robin), so
  a slow spell of a shared machine spreads over all of them, each timed run
  right after an untimed one of the same kind and size. Per kind a
  least-squares fit ``ms = latency + bytes x ring / bandwidth``
  in ``costmodel.collective_ms``'s convention (bytes = the full, gathered or
  unscattered, buffer; ring = ``costmodel.ring_factor``), so ``collective_ms``
  with the fitted numbers gives back the fitted times. The profile's default
  link (for other kinds) is one fit over every kind's samples.
* compute: the median time of a square fp32 matmul (FLOP/s) and of a large copy
  (bytes read + written per second), in the costmodel's roofline convention
  (rank 0), then what compiled training steps reach of those rates
  (``measure_reference``, every rank at once as in training, the slowest rank's
  numbers): two ``torch.nn.TransformerEncoderLayer`` blocks compiled with
  Inductor, one small (fixed costs dominate) and one of training sizes (the
  roofline dominates), fit ``graphs = factor x roofline + nodes x kernel_us``;
  the profile's ``device.tflops`` and ``mem_gbps`` are the matmul's and copy's
  rates divided by ``factor`` (1.2-1.9 over 24 calibrations on this 2-core
  host: the roofline at the square matmul's rate priced a step at ~0.6x),
  ``kernel_us`` the fixed cost per node of compiled code.
* a training step outside its compiled graphs (``measure_step``, every rank):
  ``device.step_us`` per step and ``device.param_us`` per parameter (the
  optimizer), which ``costmodel.outside_ms`` adds to the graphs' estimates.
* ``profiled`` (``run_in_group``; for steps that run under torch.profiler,
  as ``overlapc analyze`` measures them): the above under the profiler, the
  reference blocks' graph runs read from the profiler's spans (else: their
  steps less the step outside the graphs), ``step_us`` from the small block's
  step outside its graphs.
* collectives in the middle of compute (``measure_in_step``), the numbers the
  simulation and ``chunks="auto"`` use (``costmodel.LinkProfile``): every rank
  runs blocks of short slots of small matmuls (a step's compute between
  collectives), with no collective, with one started before
  each slot and waited after it (overlapped), with one started and waited at
  once before each slot (serial), and with two started and waited at once
  (pair), per kind at two sizes, the samples of every kind and size
  interleaved. Overlapped (its start and wait calls plus how much its
  compute slowed against compute-only), per collective, is fitted as
  ``link.issue_us`` + full bytes / ``link.issue_gbps`` (the issuing thread's
  whole cost, its wait included; the start calls inside, fitted as
  ``link.start_us`` + full bytes / ``link.start_gbps``); serial (the time in
  its calls) at the small size, less its transfer, is each kind's latency
  (on 2 gloo ranks 1.2-1.7x the back-to-back sweep's: the ranks meet at every
  collective after computing apart, and the threads wake); 2 - pair / serial
  is ``link.overlap``, how much of a collective's latency runs beside the
  collective before it. The sweep's latency over the serial one is
  ``link.met_fraction``, a collective's latency right after its group's last
  one ended, growing to all of it over ``link.gap_us``, the blocks' compute
  between two collectives. The simulator charges the start call at the issue and
  the rest of the issuing cost for the share of the collective's run that
  compute ran beside it. On a GPU the issuing cost is the launch alone.
  Between those blocks' rounds, compiled training steps of a small
  ``TransformerEncoderLayer`` are timed three ways: plain, sharded by
  ``overlapc.fsdp`` in its traced order (each collective waited at once) and
  sharded as overlapc schedules it. The latencies (serial) and the issue and
  start costs (scheduled) are scaled until the simulator, run over those
  steps' own graphs (``in_step_scales``), spends on their collectives what the
  measured steps did: ``measured.in_step``. On a 2-core host the blocks'
  compute keeps both cores busy and gloo's threads wait for one, which a
  training step's compute, in short kernels between waits, does not.

With one process (``world_size == 1``) only compute is measured; the link is
the built-in one named by ``link``, recorded as such.

Launch: ``run_local(world_size, ...)`` spawns local ranks on 127.0.0.1 (gloo);
``run_in_group()`` measures in an existing default process group (e.g. set up
from torchrun's environment by the CLI). The file follows
``overlapc.costmodel.PROFILE_SCHEMA`` and loads with ``costmodel.load_profile``.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import statistics
import time
from typing import Callable

import torch
import torch._inductor.custom_graph_pass

from overlapc import costmodel
from overlapc.collectives import KINDS as COLLECTIVE_KINDS
from overlapc.collectives import collectives as find_collectives

KINDS = tuple(kind for kind, known in COLLECTIVE_KINDS.items() if known.ring_phases)   # what is measured
SWEEP = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)   # full buffer bytes
QUICK_SWEEP = (4 << 10, 256 << 10, 1 << 20)
REPEATS, QUICK_REPEATS = 10, 25   # samples per (kind, size), interleaved


def fit(samples: list[tuple[int, float]], kind: str, world_size: int) -> tuple[float, float]:
    """(gbps, latency_us) such that ``latency + bytes x ring / gbps`` fits ``samples``
    ((full bytes, ms), ...) by least squares, each sample first capped at the time of every
    larger one (a smaller buffer is never slower; where it was, noise hit that sample). The
    intercept is kept >= 0 (a fit through
    the origin when the free fit's is negative). When the times do not grow with size (noise
    above the bandwidth term), the latency is the fastest sample and the slope joins it to the
    largest sample (a tiny positive slope when that is not slower). Needs at least one sample
    with bytes > 0."""
    ring = costmodel.ring_factor(kind, world_size)
    points, floor = [], float("inf")
    for b, ms in sorted(samples, reverse=True):   # a smaller buffer is never slower: noise
        floor = min(floor, ms)
        points.append((b * ring, floor))
    if not points or max(x for x, _ in points) <= 0:
        raise ValueError(f"fit of {kind} needs a sample with bytes > 0, got {samples!r}")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx > 0 else 0.0
    intercept = mean_y - slope * mean_x
    if slope <= 0:
        intercept = min(y for _, y in points)
        x, y = max(points)
        slope = max(y - intercept, 1e-9) / x
    elif intercept < 0:
        intercept = 0.0
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    # ms = intercept + x * slope, and collective_ms = latency_us * 1e-3 + x / (gbps * 1e9) * 1e3
    return 1e-6 / slope, intercept * 1e3


def _warm_train_step(compiled, optimizer, x, y) -> Callable[[], None]:
    """A training step of ``compiled`` (MSE loss against ``y``, backward, ``optimizer``
    step), run three times first (the first compiles)."""
    def train_step():
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        train_step()
    return train_step


def _sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work: ``torch.cuda.synchronize`` on CUDA, nothing on CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _timed_ms(run: Callable[[], None], repeats: int, sync: Callable[[], None], pause: bool) -> list[float]:
    """``repeats`` timed runs of ``run`` (ms), the device synced around each; with
    ``pause``, each followed by a sleep as long as it took."""
    times = []
    for _ in range(repeats):
        sync()
        begin = time.perf_counter()
        run()
        sync()
        elapsed = time.perf_counter() - begin
        times.append(elapsed * 1e3)
        if pause:
            time.sleep(elapsed)
    return times


def _median_ms(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    return statistics.median(_timed_ms(run, repeats, sync, pause=False))


def _paced_ms(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """The fastest of ``repeats`` timed runs, each followed by a pause as long as it took. A
    training step computes in bursts between waits, and a thread that slept runs ahead of busy
    ones on a shared machine: under a load of 12 on this 2-core host, 128^2 matmuls took 4-6x
    longer per op run back to back (125-235 us) than in bursts with 0.5 ms pauses (35-50 us), and
    the demo's compute between waits ran as fast as on an idle machine. Preemption only adds
    time, so the fastest run is the compute's cost."""
    return min(_timed_ms(run, repeats, sync, pause=True))


def measure_compute(device: torch.device, quick: bool = False) -> dict:
    """{"tflops", "mem_gbps", "matmul": {...}, "copy": {...}}: achieved rates of one square fp32
    matmul (2 n^3 FLOPs) and of copying a large buffer (2 x its bytes), each the fastest of paced
    runs (``_paced_ms``)."""
    sync = _sync(device)
    n = 512 if quick else (1024 if device.type == "cpu" else 8192)
    repeats = 15 if quick else 25   # cheap; the copy rate moved 11-23 GB/s over runs with 3
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    torch.mm(a, b)
    mm_ms = _paced_ms(lambda: torch.mm(a, b), repeats, sync)
    numel = (8 << 20 if quick else 32 << 20) // 4 * (1 if device.type == "cpu" else 16)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = _paced_ms(lambda: dst.copy_(src), repeats, sync)
    moved = 2 * src.numel() * src.element_size()
    return {"tflops": 2 * n ** 3 / (mm_ms * 1e-3) / 1e12, "mem_gbps": moved / (copy_ms * 1e-3) / 1e9,
            "matmul": {"n": n, "dtype": "float32", "ms": mm_ms}, "copy": {"bytes": moved, "ms": copy_ms}}


def measure_step(device: torch.device, quick: bool = False, grouped: bool = False) -> dict:
    """{"step_us", "param_us", "step": {...}}: what a training step costs outside its
    compiled graphs. ``param_us``: an SGD step (torch.optim.SGD's default implementation)
    per parameter, timed on 32 one-element-per-rank parameters, DTensors sharded over the
    default group when ``grouped`` (overlapc.fsdp's parameters are). ``step_us``: one step of
    a compiled 8x8 linear layer (backend "aot_eager": Dynamo's guards, AOTAutograd's runtime,
    the autograd engine, an MSE loss, SGD, zero_grad), less its 2 parameters' ``param_us``:
    the fixed part. Medians; with ``grouped`` every rank calls this and the slowest rank's
    numbers count."""
    import torch.distributed as dist

    sync = _sync(device)
    repeats = 10 if quick else 30
    count = 32
    if grouped:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        params = [torch.nn.Parameter(distribute_tensor(torch.zeros(dist.get_world_size(), device=device), mesh,
                                                       [Shard(0)])) for _ in range(count)]
    else:
        params = [torch.nn.Parameter(torch.zeros(1, device=device)) for _ in range(count)]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer = torch.optim.SGD(params, lr=1e-3)
    optimizer.step()
    param_us = _median_ms(optimizer.step, repeats, sync) * 1e3 / count

    model = torch.nn.Linear(8, 8).to(device)
    compiled = torch.compile(model, backend="aot_eager")
    tiny = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    step_ms = _median_ms(_warm_train_step(compiled, tiny, x, y), repeats, sync)
    numbers = torch.tensor([param_us, step_ms], dtype=torch.float64)
    if grouped:
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    param_us, step_ms = (float(v) for v in numbers)
    return {"step_us": max(0.0, step_ms * 1e3 - 2 * param_us), "param_us": param_us,
            "step": {"tiny_step_ms": step_ms, "optimizer_params": count,
                     "dtensor": grouped, "backend": "aot_eager"}}


class _GraphCost(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Inductor post-grad pass that records, per graph compiled, its work nodes (the nodes
    ``costmodel.compute_ms`` charges the fixed cost to) and their roofline time on ``device``."""

    def __init__(self, device: costmodel.DeviceProfile):
        self.device = device
        self.graphs: list[tuple[int, float]] = []   # (work nodes, roofline ms) per graph
        self.key = f"overlapc.calibrate {time.time_ns()} {os.getpid()}"   # never a cache hit

    def __call__(self, graph) -> None:
        costs = [costmodel.compute_ms(node, self.device) for node in graph.nodes]
        self.graphs.append((sum(1 for ms in costs if ms > 0), sum(costs)))

    def uuid(self) -> str:
        return self.key


REFERENCES = {   # measure_reference's blocks per device type: fixed costs dominate the first, the roofline the second
    "cpu": ({"width": 128, "heads": 4, "ffn": 512, "batch": 4, "seq": 32},
            {"width": 256, "heads": 4, "ffn": 1024, "batch": 4, "seq": 32}),   # ~10 ms a step: one burst
    "cuda": ({"width": 128, "heads": 4, "ffn": 512, "batch": 4, "seq": 32},
             {"width": 1024, "heads": 16, "ffn": 4096, "batch": 8, "seq": 1024}),
}


def _reference_block(device: torch.device, compute: dict, step: dict, sizes: dict, steps: int,
                     profiled: bool, grouped: bool = False) -> dict:
    """One ``torch.nn.TransformerEncoderLayer`` of ``sizes`` compiled with Inductor, trained with SGD
    on an MSE loss: {"step_ms", "graphs_ms", "roofline_ms", "work_nodes", "parameters"}, medians
    over ``steps`` steps. ``graphs_ms``: its graph runs, when ``profiled`` (the steps run under
    torch.profiler) the ``CompiledFunction`` and ``CompiledFunctionBackward`` spans, as
    ``overlapc analyze`` counts them, else the step less ``step``'s ``step_us`` + its parameters
    x ``param_us``; ``roofline_ms``: ``costmodel.compute_ms`` of
    the post-grad graphs' nodes at ``compute``'s rates without a fixed cost; ``work_nodes``: those
    nodes that do work. ``grouped``: every rank of the default group runs it, and they start
    timing together."""
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(sizes["width"], sizes["heads"], dim_feedforward=sizes["ffn"],
                                             dropout=0.0, batch_first=True).to(device)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["width"], device=device)
    y = torch.randn(sizes["batch"], sizes["seq"], sizes["width"], device=device)
    recorder = _GraphCost(costmodel.DeviceProfile("reference", compute["tflops"], compute["mem_gbps"]))
    # a recorder of its own makes each call's options differ, so Dynamo compiles anew (no cache hit)
    compiled = torch.compile(model, dynamic=False,
                             options={"post_grad_custom_post_pass": recorder, "fx_graph_cache": False})
    train_step = _warm_train_step(compiled, torch.optim.SGD(model.parameters(), lr=1e-3), x, y)
    if grouped:
        torch.distributed.barrier()   # no rank times its steps while another still compiles
    if len(recorder.graphs) != 2:
        raise RuntimeError(f"the reference block compiled {len(recorder.graphs)} graphs, expected 2 "
                           f"(forward, backward)")
    block = {**sizes, "work_nodes": sum(n for n, _ in recorder.graphs),
             "roofline_ms": sum(ms for _, ms in recorder.graphs),
             "parameters": sum(1 for _ in model.parameters()), "steps": steps}
    sync = _sync(device)
    if not profiled:
        step_ms = _paced_ms(train_step, steps, sync)
        outside_ms = (step["step_us"] + block["parameters"] * step["param_us"]) * 1e-3
        return {**block, "step_ms": step_ms, "graphs_ms": max(0.0, step_ms - outside_ms)}
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) \
            as prof:
        for _ in range(steps + 1):
            train_step()
            prof.step()
    events = list(prof.events())
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep")]
    runs = [(e.time_range.start, e.time_range.end) for e in events
            if e.name in ("CompiledFunction", "CompiledFunctionBackward")]
    per_step = [((end - begin) / 1e3, sum(b - a for a, b in runs if begin <= a and b <= end) / 1e3)
                for begin, end in spans]
    if not per_step or not any(g for _, g in per_step):
        raise RuntimeError("the profiler recorded no graph runs of the reference block")
    return {**block, "step_ms": statistics.median(s for s, _ in per_step),
            "graphs_ms": statistics.median(g for _, g in per_step)}


def fit_compute(blocks: list[dict]) -> tuple[float, float]:
    """(factor, kernel_us) such that ``graphs_ms = factor x roofline_ms + work_nodes x
    kernel_us`` fits the reference blocks (exact for two): how much slower than the matmul's and
    the copy's rates compiled code runs, and its fixed cost per node. A negative fixed cost
    (noise) becomes 0 with the factor fitted through the origin; a factor <= 0 becomes 1."""
    (g1, r1, n1), (g2, r2, n2) = [(b["graphs_ms"], b["roofline_ms"], b["work_nodes"]) for b in blocks[:2]]
    det = r1 * n2 - r2 * n1
    if det:
        factor = (g1 * n2 - g2 * n1) / det
        kernel_ms = (g1 - factor * r1) / n1
    if not det or kernel_ms < 0:
        factor, kernel_ms = sum(b["graphs_ms"] * b["roofline_ms"] for b in blocks) / sum(
            b["roofline_ms"] ** 2 for b in blocks), 0.0
    if factor <= 0:
        factor, kernel_ms = 1.0, max(0.0, (g1 - r1) / n1)
    return factor, kernel_ms * 1e3


def measure_reference(device: torch.device, compute: dict, step: dict, quick: bool = False,
                      profiled: bool = False, grouped: bool = False) -> dict:
    """{"factor", "kernel_us", "step_us", "reference": {...}}: what compiled training steps like
    real ones cost, from ``REFERENCES``' blocks for ``device`` (``_reference_block``). Their graph runs
    (profiled: the profiler's spans; else each step less ``step``'s ``step_us`` + its parameters
    x ``param_us``) fit ``fit_compute``: ``factor`` (``compute``'s matmul and copy rates divided
    by it are the rates compiled code reaches) and ``kernel_us``, the fixed cost per node.
    ``step_us``: profiled, the first block's step outside its graphs less its parameters x
    ``param_us``; else ``step``'s. ``grouped``: every rank of the default group calls this."""
    steps = (27, 15) if quick else (45, 25)   # the small block is cheap: more steps, a steadier fixed cost
    blocks = [_reference_block(device, compute, step, sizes, count, profiled, grouped)
              for sizes, count in zip(REFERENCES.get(device.type, REFERENCES["cpu"]), steps)]
    factor, kernel_us = fit_compute(blocks)
    first = blocks[0]
    step_us = max(0.0, (first["step_ms"] - first["graphs_ms"]) * 1e3 - first["parameters"] * step["param_us"]) \
        if profiled else step["step_us"]
    return {"factor": factor, "kernel_us": kernel_us, "step_us": step_us,
            "reference": {"model": "TransformerEncoderLayer", "backend": "inductor", "profiled": profiled,
                          "blocks": blocks}}


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
SLOT_MS = 0.5                        # a slot's compute at least (and 1.5x the collective's sweep time)
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
    """(a warm training step (``_warm_train_step``) of the small reference block in ``order``,
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
    return _warm_train_step(compiled, optimizer, x, y), parameters


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
    sync = _sync(device)
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


def in_step_scales(reference: dict, graphs: dict, profile_at: Callable[[dict], "costmodel.Profile"],
                   param_us: float) -> dict:
    """{"serial_scale", "issue_scale"}: the factors on the profile's latencies and on its issue
    and start costs (``profile_at(scales)``: the profile they give) at which the reference's
    ``graphs`` (``_in_step_graphs``), simulated (``overlapc.simulate``, the model every estimate
    uses) in the serial order and in overlapc's, spend as long on their collectives as the
    measured steps did: each order's step less the plain block's and its parameters x
    ``param_us``, against the simulated steps less their compute. Each simulated time grows with
    its scale: bisection over [0.1, 10] (a measured time outside it gives the end), the serial
    scale first, then the issue scale, twice over. 1 for an order without collectives."""
    from overlapc.simulate import simulate

    costs: dict = {}

    def simulated_ms(order: str, scales: dict) -> float:
        profile, total = profile_at(scales), 0.0
        for gm, nodes in graphs[order]:
            if gm not in costs:
                costs[gm] = {n: costmodel.compute_ms(n, profile.device) for n in gm.graph.nodes}
            timeline = simulate(gm, profile, nodes, compute_ms=costs[gm].__getitem__)
            total += timeline.step_ms - sum(end - begin for begin, end in timeline.compute.values())
        return total

    def solve(order: str, key: str, scales: dict) -> float:
        if not any(find_collectives(gm) for gm, _ in graphs[order]):
            return 1.0
        measured = reference[f"{order}_ms"] - reference["plain_ms"] - reference["parameters"] * param_us * 1e-3
        low, high = math.log(IN_STEP_SCALE_RANGE[0]), math.log(IN_STEP_SCALE_RANGE[1])
        for _ in range(IN_STEP_BISECTIONS):
            middle = (low + high) / 2
            if simulated_ms(order, {**scales, key: math.exp(middle)}) < measured:
                low = middle
            else:
                high = middle
        return math.exp((low + high) / 2)

    scales = {"serial_scale": 1.0, "issue_scale": 1.0}
    for _ in range(2):
        scales["serial_scale"] = solve("serial", "serial_scale", scales)
        scales["issue_scale"] = solve("scheduled", "issue_scale", scales)
    return scales


IN_STEP_SCALE_RANGE = (0.1, 10.0)
IN_STEP_BISECTIONS = 24   # over ln 100: the scale to 3e-7 of itself


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
        sync = _sync(device)
        a = torch.randn(ISSUE_MATMUL, ISSUE_MATMUL, device=device)
        b = torch.randn(ISSUE_MATMUL, ISSUE_MATMUL, device=device)
        torch.mm(a, b)

        def matmuls() -> None:
            for _ in range(50):
                torch.mm(a, b)
        mm_ms = torch.tensor([_median_ms(matmuls, 5, sync) / 50], dtype=torch.float64)
        dist.all_reduce(mm_ms, op=dist.ReduceOp.MAX)
        self.points = [(kind, nbytes) for kind in KINDS for nbytes in ISSUE_SIZES]
        self.blocks, self.starts = [], []
        for kind, nbytes in self.points:
            start = _start(kind, nbytes, self.world_size, group_name, device)
            torch.ops._c10d_functional.wait_tensor(start())
            slot_ms = _slot_ms(collectives[kind], nbytes)
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


def _slot_ms(sweep: list[tuple[int, float]], nbytes: int) -> float:
    """The compute between two collectives of ``nbytes`` in ``IssueSampler``'s blocks (at
    least): ``SLOT_MS``, or 1.5x the collective's time in the sweep (``sweep``: [(full bytes,
    ms), ...] of its kind) if longer."""
    return max(SLOT_MS, 1.5 * _interpolate(sweep, nbytes))


def _interpolate(samples: list[tuple[int, float]], nbytes: int) -> float:
    """ms at ``nbytes`` on the line through the two samples around it (the nearest two at the ends)."""
    samples = sorted(samples)
    if len(samples) == 1:
        return samples[0][1]
    at = min(max(1, next((i for i, (b, _) in enumerate(samples) if b >= nbytes), len(samples) - 1)),
             len(samples) - 1)
    (b0, m0), (b1, m1) = samples[at - 1], samples[at]
    return max(m0 + (m1 - m0) * (nbytes - b0) / (b1 - b0), 0.0) if b1 != b0 else m1


def fit_issue(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(issue_us, issue_gbps) with ``issue_us + bytes / issue_gbps`` fitting ``samples`` ((full
    bytes, us), ...) by least squares, both >= 0: issue_gbps 0 (no per-byte part, issue_us
    their mean) when the fitted slope is not positive, a line through the origin when the
    intercept would be negative."""
    if not samples:
        return 0.0, 0.0
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in samples)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return max(mean_y, 0.0), 0.0
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        intercept, slope = 0.0, sum(x * y for x, y in samples) / sum(x * x for x, _ in samples)
    # us = intercept + bytes * slope;  issue_ms = issue_us * 1e-3 + bytes / (gbps * 1e9) * 1e3
    return intercept, 1e-3 / slope


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
    sync = _sync(device)
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


def document(compute: dict, collectives: dict | None, world_size: int, backend: str,
             device: torch.device, fallback_link: str = "ethernet", quick: bool = False,
             issue: dict | None = None, in_step: dict | None = None, in_step_graphs: dict | None = None) -> dict:
    """The profile file's JSON (``costmodel.PROFILE_SCHEMA``) from the measurements: the
    device from ``compute``, the link from ``collectives`` (the sweep) and ``issue``
    (``IssueSampler``; ``link_document``), scaled by ``in_step_scales`` of ``in_step`` and
    ``in_step_graphs`` (``measure_in_step``'s reference and its graphs; the reference is recorded
    with its scales as ``measured.in_step``)."""
    if in_step is not None and in_step_graphs is None:
        raise ValueError("calibrate.document: an in-step reference needs its graphs (in_step_graphs, "
                         "measure_in_step's third result) to scale the profile by")
    measured = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "host": socket.gethostname(), "backend": backend, "world_size": world_size,
                "device_type": device.type, "torch": torch.__version__, "platform": platform.platform(),
                "quick": quick,
                "profiled": compute.get("reference", {}).get("profiled", False),
                "compute": {k: compute[k] for k in ("matmul", "copy", "step", "reference")
                            if k in compute}}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    doc = {"schema": costmodel.PROFILE_SCHEMA,
           "device": {"name": device_name, "tflops": compute["tflops"], "mem_gbps": compute["mem_gbps"],
                      "kernel_us": compute.get("kernel_us", 0.0), "step_us": compute.get("step_us", 0.0),
                      "param_us": compute.get("param_us", 0.0)}}
    if not collectives:
        link = costmodel.LINKS[fallback_link]
        doc["link"] = {"name": link.name, "gbps": link.gbps, "latency_us": link.latency_us}
        doc["collectives"] = {}
        measured["link"] = f"not measured (one process): built-in {fallback_link}"
    else:
        if issue and in_step:
            def profile_at(scales: dict) -> costmodel.Profile:
                link, kinds, _ = link_document(collectives, issue, world_size, backend, scales)
                return costmodel.profile_from_json({**doc, "link": link, "collectives": kinds})
            in_step = {**in_step, **in_step_scales(in_step, in_step_graphs, profile_at, compute.get("param_us", 0.0))}
            measured["in_step"] = in_step
        doc["link"], doc["collectives"], link_measured = link_document(collectives, issue, world_size, backend,
                                                                       in_step)
        measured.update(link_measured)
    doc["measured"] = measured
    return doc


def link_document(collectives: dict, issue: dict | None, world_size: int, name: str,
                  scales: dict | None = None) -> tuple[dict, dict, dict]:
    """(profile "link", profile "collectives", what was measured) from the sweep
    ({kind: [(full bytes, ms), ...]}) and ``IssueSampler``'s samples ({kind: [(bytes, us,
    start us, serial us, pair us), ...]}; None: the sweep alone), the samples' serial latencies
    times ``scales["serial_scale"]`` and their overlapped and start costs times
    ``scales["issue_scale"]`` (``in_step_scales``: what compiled steps' collectives cost against
    what the blocks price them at; None: 1).

    Per kind the bandwidth is the sweep's fit (``fit``), the latency the serial in-step cost
    of ``IssueSampler``'s smallest size less its transfer at that bandwidth (what a collective
    waited at once costs in the middle of compute: on 2 gloo ranks 1.2-1.7x the back-to-back sweep's
    fitted latency, which ``measured`` keeps); without ``issue`` the sweep's fit. The default
    link: one fit over every kind's sweep samples, its latency the kinds' mean. ``issue_us`` /
    ``issue_gbps`` fit (``fit_issue``) the overlapped costs, ``start_us`` / ``start_gbps`` the start
    calls; ``overlap``: per kind at the smallest size ``2 - pair / serial`` in [0, 1] (the second
    of two collectives issued together costs nothing more where its latency runs beside the
    first's, a whole serial collective where it waits for it), their median; 1 without ``issue``.
    ``met_fraction`` / ``gap_us`` (``LinkProfile.latency_after_ms``): per kind, the sweep's
    latency (collectives back to back) over the in-step one, and the blocks' compute between
    two collectives (``_slot_ms`` at the smallest size), their means; absent without ``issue``."""
    kinds, pooled, sweep_latency, met, gaps = {}, [], {}, [], []
    serial_scale, issue_scale = (scales["serial_scale"], scales["issue_scale"]) if scales else (1.0, 1.0)
    for kind, samples in sorted(collectives.items()):
        gbps, latency_us = fit(samples, kind, world_size)
        sweep_latency[kind] = latency_us
        ring = costmodel.ring_factor(kind, world_size)
        if issue and kind in issue:
            small, _, _, serial_us, _ = min(issue[kind])
            in_step_us = max(0.0, serial_us - small * ring / (gbps * 1e9) * 1e6)
            met.append(min(1.0, sweep_latency[kind] / in_step_us) if in_step_us > 0 else 1.0)
            gaps.append(_slot_ms(samples, small) * 1e3)
            latency_us = serial_scale * in_step_us
        kinds[kind] = {"gbps": gbps, "latency_us": latency_us,
                       "samples": [{"bytes": b, "ms": ms, "fit_ms": latency_us * 1e-3 + b * ring / (gbps * 1e9) * 1e3}
                                   for b, ms in samples]}
        pooled += [(b * ring, ms) for b, ms in samples]   # already in ring units: fit with ring 1
    gbps, latency_us = fit(pooled, "broadcast", world_size)
    link = {"name": name, "gbps": gbps, "latency_us": latency_us}
    measured = {"sweep_latency_us": sweep_latency}
    if issue:
        link["latency_us"] = statistics.mean(k["latency_us"] for k in kinds.values())
        link["issue_us"], link["issue_gbps"] = fit_issue([(s[0], s[1] * issue_scale) for kind in sorted(issue)
                                                          for s in issue[kind]])
        link["start_us"], link["start_gbps"] = fit_issue([(s[0], s[2] * issue_scale) for kind in sorted(issue)
                                                          for s in issue[kind]])
        link["met_fraction"], link["gap_us"] = statistics.mean(met), statistics.mean(gaps)
        link["overlap"] = statistics.median(
            min(1.0, max(0.0, 2.0 - pair / serial)) if serial > 0 else 1.0
            for _, _, _, serial, pair in (min(samples) for _, samples in sorted(issue.items())))
        measured["issue"] = {kind: [dict(zip(("bytes", "us", "start_us", "serial_us", "pair_us"), s)) for s in samples]
                             for kind, samples in sorted(issue.items())}
    return link, kinds, measured


def _profiler(profiled: bool):
    """torch.profiler over the CPU activity (the settings ``overlapc demo`` profiles its steps
    with) when ``profiled``, else nothing."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext()


def broadcast_object(value, device: torch.device):
    """Rank 0's ``value`` (a JSON-able object) on every rank of the default
    group, sent as bytes in a tensor: ``dist.broadcast_object_list`` would need
    numpy, which neither torch nor overlapc depends on."""
    dist = torch.distributed
    payload = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=0)
    return json.loads(bytes(data.cpu().tolist()).decode())


def run_in_group(out: str | None, quick: bool = False, fallback_link: str = "ethernet",
                 say=lambda message: None, alone: bool = False, profiled: bool = False) -> dict:
    """Measure in the current default process group (compute only when there is
    none, or when ``alone``: the caller's group is then left untouched); rank 0
    writes ``out`` (when given). Returns the document on every rank.

    ``profiled``: for estimating steps that run under torch.profiler (what ``overlapc
    analyze`` measures): the collectives, the issue cost and the SGD step are measured under
    the profiler, ``measure_reference`` reads its blocks' graph runs from the profiler and
    gives ``step_us``."""
    import torch.distributed as dist

    grouped = not alone and dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if grouped else 1
    rank = dist.get_rank() if grouped else 0
    backend = str(dist.get_backend()) if grouped else "none"
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    with _profiler(profiled):
        collectives = measure_collectives(device, quick, say if rank == 0 else (lambda m: None)) \
            if world_size > 1 else None
    with _profiler(profiled):
        issue, in_step, in_step_graphs = measure_in_step(device, collectives, quick) if world_size > 1 \
            else (None, None, None)
    compute = measure_compute(device, quick) if rank == 0 else None
    with _profiler(profiled):
        step = measure_step(device, quick, grouped and world_size > 1)
    if grouped and world_size > 1:
        compute = broadcast_object(compute, device)
    compute = {**compute, **step}
    if grouped and world_size > 1:
        dist.barrier()   # every rank computes at once, as in a training step
    reference = measure_reference(device, compute, step, quick, profiled, grouped and world_size > 1)
    numbers = torch.tensor([reference["factor"], reference["kernel_us"], reference["step_us"]], dtype=torch.float64)
    if grouped and world_size > 1:
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX)   # the slowest rank's
    factor, compute["kernel_us"], compute["step_us"] = (float(v) for v in numbers)
    compute["tflops"], compute["mem_gbps"] = compute["tflops"] / factor, compute["mem_gbps"] / factor
    compute["reference"] = {**reference["reference"], "roofline_factor": factor}
    if rank == 0:
        say(f"compute: {compute['tflops']:.3g} TFLOP/s, {compute['mem_gbps']:.3g} GB/s (matmul "
            f"{compute['matmul']['n']}^2 and copy rates / {factor:.3g}, the reference blocks' roofline factor), "
            f"{compute['kernel_us']:.3g} us per node of compiled code; a training step outside its graphs "
            f"{compute['step_us']:.3g} us + {compute['param_us']:.3g} us per parameter")
    doc = document(compute, collectives, world_size, backend, device, fallback_link, quick, issue, in_step,
                   in_step_graphs)
    if rank == 0 and issue:
        link = doc["link"]
        say(f"issuing a collective during compute costs it {link['issue_us']:.3g} us"
            + (f" + bytes / {link['issue_gbps']:.3g} GB/s" if link["issue_gbps"] else "")
            + " (" + ", ".join(f"{kind} {b >> 10} KiB {us:.0f} us" for kind in sorted(issue)
                               for b, us, *_ in issue[kind]) + ")"
            + f"; waited at once {link['latency_us']:.3g} us latency (mean), overlap {link['overlap']:.2g}"
            + (f"; scaled by {doc['measured']['in_step']['serial_scale']:.2f} (waited at once) and "
               f"{doc['measured']['in_step']['issue_scale']:.2f} (overlapped), what compiled steps' "
               f"collectives cost against these blocks" if "in_step" in doc["measured"] else ""))
    if rank == 0 and out:
        write(doc, out)
    return doc


def write(doc: dict, out: str) -> None:
    """The document as indented JSON; written to a temporary name first, then renamed."""
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{out}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8", newline="\n") as sink:
        sink.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, out)


def _rank_main(rank: int, world_size: int, out: str, quick: bool, fallback_link: str, verbose: bool):
    """One rank of ``run_local`` (launched in the gloo group): measure; rank 0 returns the document."""
    say = (lambda message: print(f"overlapc calibrate: {message}", flush=True)) if verbose else (lambda m: None)
    doc = run_in_group(out, quick, fallback_link, say)
    return doc if rank == 0 else None


def run_local(world_size: int, out: str, quick: bool = False, timeout: float = 600.0,
              fallback_link: str = "ethernet", verbose: bool = False) -> dict:
    """Launch ``world_size`` gloo ranks on 127.0.0.1 (``overlapc.launch``), measure, write ``out``;
    return the document. RuntimeError naming the rank when one raises, dies or is still running
    at ``timeout`` (every rank is then ended)."""
    from overlapc import launch

    if world_size < 2:
        return run_in_group(out, quick, fallback_link,
                            (lambda m: print(f"overlapc calibrate: {m}", flush=True)) if verbose else (lambda m: None),
                            alone=True)
    try:
        return launch.run(_rank_main, world_size, (out, quick, fallback_link, verbose), timeout=timeout,
                          gloo_timeout=120.0)[0]
    except launch.RankFailure as failure:
        hint = " (raise --timeout, or check the network)" if failure.how == "hung" else ""
        raise RuntimeError(f"calibration {failure}{hint}") from failure
    except Exception as error:  # noqa: BLE001 - a rank's own exception: said with its rank and traceback
        raise RuntimeError(f"calibration failed: {launch.failure_text(error)}") from error

"""Measuring compute: a matmul and a copy (the roofline), compiled reference blocks, and a
training step outside its compiled graphs (what ``overlapc.calibrate`` fits ``device.*`` with)."""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch._inductor.custom_graph_pass

from overlapc.calibrate.fitting import fit_compute
from overlapc.estimate import costmodel


def warm_train_step(compiled, optimizer, x, y) -> Callable[[], None]:
    """A training step of ``compiled`` (MSE loss against ``y``, backward, ``optimizer``
    step), run three times first (the first compiles)."""
    def train_step():
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        train_step()
    return train_step


def sync_for(device: torch.device) -> Callable[[], None]:
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


def median_ms(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
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
    sync = sync_for(device)
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

    sync = sync_for(device)
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
    param_us = median_ms(optimizer.step, repeats, sync) * 1e3 / count

    model = torch.nn.Linear(8, 8).to(device)
    compiled = torch.compile(model, backend="aot_eager")
    tiny = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    step_ms = median_ms(warm_train_step(compiled, tiny, x, y), repeats, sync)
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
    train_step = warm_train_step(compiled, torch.optim.SGD(model.parameters(), lr=1e-3), x, y)
    if grouped:
        torch.distributed.barrier()   # no rank times its steps while another still compiles
    if len(recorder.graphs) != 2:
        raise RuntimeError(f"the reference block compiled {len(recorder.graphs)} graphs, expected 2 "
                           f"(forward, backward)")
    block = {**sizes, "work_nodes": sum(n for n, _ in recorder.graphs),
             "roofline_ms": sum(ms for _, ms in recorder.graphs),
             "parameters": sum(1 for _ in model.parameters()), "steps": steps}
    sync = sync_for(device)
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


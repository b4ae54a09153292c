"""Running a calibration: in an existing process group or on local gloo ranks."""
from __future__ import annotations

import json

import torch

from overlapc.calibrate.fitting import document, write
from overlapc.calibrate.links import measure_collectives, measure_in_step
from overlapc.calibrate.measure import measure_compute, measure_reference, measure_step


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

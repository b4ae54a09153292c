"""Fitting: from measured samples to a profile document (costmodel.PROFILE_SCHEMA)."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import statistics
from typing import Callable

import torch

from overlapc.collectives import collectives as find_collectives
from overlapc.estimate import costmodel

SLOT_MS = 0.5                        # a slot's compute at least (and 1.5x the collective's sweep time)


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


def in_step_scales(reference: dict, graphs: dict, profile_at: Callable[[dict], "costmodel.Profile"],
                   param_us: float) -> dict:
    """{"serial_scale", "issue_scale"}: the factors on the profile's latencies and on its issue
    and start costs (``profile_at(scales)``: the profile they give) at which the reference's
    ``graphs`` (``_in_step_graphs``), simulated (``overlapc.estimate.simulate``, the model every estimate
    uses) in the serial order and in overlapc's, spend as long on their collectives as the
    measured steps did: each order's step less the plain block's and its parameters x
    ``param_us``, against the simulated steps less their compute. Each simulated time grows with
    its scale: bisection over [0.1, 10] (a measured time outside it gives the end), the serial
    scale first, then the issue scale, twice over. 1 for an order without collectives."""
    from overlapc.estimate.simulate import simulate

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


def slot_length_ms(sweep: list[tuple[int, float]], nbytes: int) -> float:
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
    two collectives (``slot_length_ms`` at the smallest size), their means; absent without ``issue``."""
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
            gaps.append(slot_length_ms(samples, small) * 1e3)
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


def write(doc: dict, out: str) -> None:
    """The document as indented JSON; written to a temporary name first, then renamed."""
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{out}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8", newline="\n") as sink:
        sink.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, out)

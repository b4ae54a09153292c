"""sink_waits: every wait just before its first real consumer."""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx

from overlapc.passes.analysis import Analysis, apply_order


def sink_waits(gm: fx.GraphModule, kinds: Iterable[str] | None = None) -> fx.GraphModule:
    """Move each wait, with the views that read only through it, to just before
    its target: its first real consumer (views and getitem skipped), else the
    output node, and never past the barrier that closes its region.

    A wait already in place (only waits, collective starts with their input
    chains, and views of waited tensors stand between it and its target) is
    left alone, so the pass is idempotent and keeps the slots that
    ``limit_in_flight`` arranged. Waits sharing a target keep the order in which
    the target reads them. ``kinds`` restricts the pass to those collective
    kinds (e.g. ``("all_gather",)``). In place; returns ``gm`` recompiled.
    """
    if sink_in_graph(gm, kinds):
        gm.recompile()
    return gm


def sink_in_graph(gm: fx.GraphModule, kinds: Iterable[str] | None = None,
                  info: Analysis | None = None) -> bool:
    """sink_waits on ``gm.graph`` without recompiling; True if a wait moved.
    ``info``, when given, is the graph's Analysis and is refreshed afterwards."""
    info = info or Analysis(gm)
    wanted = None if kinds is None else tuple(kinds)
    moving: dict[fx.Node, list[fx.Node]] = {}   # target -> waits to place before it
    moved: set[fx.Node] = set()
    for c in info.movable:
        if wanted is not None and c.kind not in wanted:
            continue
        for wait in c.waits:
            target = info.target[wait]
            if info.compute_between(info.pos[wait] + 1, info.pos[target]) == 0:
                continue
            moving.setdefault(target, []).append(wait)
            moved.update(info.wait_bundle[wait])
    if not moving:
        return False

    order: list[fx.Node] = []
    for node in info.nodes:
        if node in moved:
            continue
        for wait in sorted(moving.get(node, ()), key=info.wait_key):
            order.extend(info.wait_bundle[wait])
        order.append(node)
    apply_order(gm, order)
    info.refresh()
    return True

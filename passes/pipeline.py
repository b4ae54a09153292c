"""schedule = reorder -> limit -> sink -> verify, and the checks behind verify."""
from __future__ import annotations

import logging
import warnings

import torch.fx as fx

from overlapc.config import OverlapConfig
from overlapc.passes.analysis import Analysis, apply_order
from overlapc.passes.limit import limit_in_graph
from overlapc.passes.reorder import reorder_in_graph
from overlapc.passes.sink_waits import sink_in_graph

log = logging.getLogger("overlapc")


class ScheduleError(RuntimeError):
    """A schedule guarantee does not hold (or scheduling failed) at a named node."""

    def __init__(self, message: str, node: fx.Node | None = None, group: str | None = None,
                 position: int | None = None):
        self.node, self.group, self.position = node, group, position
        self.op = None if node is None else str(node.target)
        where = []
        if node is not None:
            where.append(f"node {node.name} (op {self.op}")
            where[-1] += f", group {group}" if group is not None else ""
            where[-1] += f", position {position})" if position is not None else ")"
        super().__init__(f"{where[0]}: {message}" if where else message)


def _config(config) -> OverlapConfig:
    if config is None:
        return OverlapConfig()
    if isinstance(config, OverlapConfig):
        return config
    if isinstance(config, dict):
        return OverlapConfig.from_options(config, env={})
    raise TypeError(f"expected an OverlapConfig or an options dict, got {type(config).__name__}")


def _check_graph(gm) -> None:
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"overlapc expects a torch.fx.GraphModule, got {type(gm).__name__}; "
                        "trace the function first (make_fx or torch.fx.symbolic_trace)")


def verify(gm: fx.GraphModule, config: OverlapConfig | None = None) -> None:
    """Check the schedule guarantees on ``gm`` as it stands; raise ScheduleError
    naming the first node that breaks one.

    Checked: the graph lints (valid topological order); all-gathers of a group
    and region are issued in first-consumer order; the in-flight bounds of
    ``config`` hold; every wait has only waits, collective starts (with their
    input chains) and views of waited tensors between it and its target; every
    start stands right after the latest of its inputs, its region's barrier,
    the previous all-gather of its group and (when bounded) the last wait of
    its group. Collectives overlapc keeps in place are not checked.
    """
    _check_graph(gm)
    cfg = _config(config)
    try:
        gm.graph.lint()
    except Exception as error:
        raise ScheduleError(f"graph is not a valid FX graph: {error}") from error
    _verify(Analysis(gm), cfg)


def _fail(info: Analysis, node: fx.Node, message: str) -> ScheduleError:
    c = info.coll_of_start.get(node) or info.coll_of_wait.get(node)
    return ScheduleError(message, node=node, group=c.group if c else None, position=info.pos[node])


def _verify(info: Analysis, cfg: OverlapConfig) -> int:
    """Raise ScheduleError at the first broken guarantee; return the peak number
    of all-gathers of one group in flight."""
    pos, nodes = info.pos, info.nodes

    for c in info.movable:
        for wait in c.waits:
            target = info.target[wait]
            if info.compute_between(pos[wait] + 1, pos[target]):
                between = next(n for n in nodes[pos[wait] + 1:pos[target]] if n not in info.bundled)
                raise _fail(info, wait, f"wait of {c.kind} {c.start.name} is not just before its first "
                                        f"consumer {target.name} (position {pos[target]}): {between.name} "
                                        "stands between")

    lanes: dict[tuple[str, int], list] = {}
    for c in info.movable:
        if c.kind == "all_gather":
            lanes.setdefault((c.group, info.region_of(c.start)), []).append(c)
    for starts in lanes.values():
        starts.sort(key=lambda c: pos[c.start])
        for before, after in zip(starts, starts[1:]):
            if info.key[before.start][0] > info.key[after.start][0]:
                raise _fail(info, after.start,
                            f"all-gather issued after {before.start.name} but consumed first "
                            f"(at {nodes[info.key[after.start][0]].name} vs "
                            f"{nodes[info.key[before.start][0]].name}): consumer order broken")

    bounded = cfg.max_in_flight is not None or cfg.max_in_flight_bytes is not None
    peak = 0
    count: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    waits_left = {c.start: len(c.waits) for c in info.movable}
    for node in nodes:
        c = info.coll_of_start.get(node)
        if c is not None and c.kind == "all_gather" and c.waits:
            count[c.group] = count.get(c.group, 0) + 1
            nbytes[c.group] = nbytes.get(c.group, 0) + (c.nbytes or 0)
            peak = max(peak, count[c.group])
            if cfg.max_in_flight is not None and count[c.group] > cfg.max_in_flight:
                raise _fail(info, node, f"{count[c.group]} all-gathers in flight, limit {cfg.max_in_flight}")
            if (cfg.max_in_flight_bytes is not None and count[c.group] > 1
                    and nbytes[c.group] > cfg.max_in_flight_bytes):
                raise _fail(info, node, f"{nbytes[c.group]} bytes of all-gathers in flight, "
                                        f"limit {cfg.max_in_flight_bytes}")
        c = info.coll_of_wait.get(node)
        if c is not None and c.kind == "all_gather":
            waits_left[c.start] -= 1
            if waits_left[c.start] == 0:
                count[c.group] -= 1
                nbytes[c.group] -= c.nbytes or 0

    last_gather: dict[tuple[str, int], int] = {}
    last_gather_wait: dict[str, int] = {}
    for node in nodes:
        c = info.coll_of_start.get(node)
        if c is not None:
            earliest = max([info.region_start(node)] + [pos[i] for i in info.bundle_inputs[node]])
            if c.kind == "all_gather":
                lane = (c.group, info.region_of(node))
                earliest = max(earliest, last_gather.get(lane, -1))
                if bounded:
                    earliest = max(earliest, last_gather_wait.get(c.group, -1))
                last_gather[lane] = pos[node]
            if info.compute_between(earliest + 1, pos[node]):
                late = next(n for n in nodes[earliest + 1:pos[node]] if n not in info.bundled)
                raise _fail(info, node, f"{c.kind} could be issued before {late.name}: its inputs are "
                                        f"ready at position {earliest}")
        c = info.coll_of_wait.get(node)
        if c is not None and c.kind == "all_gather":
            last_gather_wait[c.group] = pos[node]
    return peak


def _regions(info: Analysis) -> dict[fx.Node, int]:
    """For each movable collective start and wait: the number of barriers before it."""
    return {node: info.region_of(node) for c in info.movable for node in (c.start, *c.waits)}


def schedule(gm: fx.GraphModule, config: OverlapConfig | dict | None = None, *,
             recompile: bool = True) -> fx.GraphModule:
    """Reschedule ``gm`` in place so communication overlaps compute; return it.

    Runs reorder_all_gathers -> limit_in_flight -> sink_waits, then verify.
    Deterministic: the same graph gives the same order in every process. A
    graph without movable collectives (or config.enabled False) comes back
    untouched. On failure the original order is restored; on_error="raise"
    raises ScheduleError, "fallback" warns (node, op, group, position) and
    returns the unscheduled graph. ``recompile=False`` skips regenerating
    ``gm.forward`` (for callers that read only ``gm.graph``, such as Inductor).
    """
    _check_graph(gm)
    cfg = _config(config)
    if not cfg.enabled:
        return gm
    info = Analysis(gm)
    if not info.movable:
        return gm
    original = list(info.nodes)
    regions_before = _regions(info)
    try:
        reorder_in_graph(gm, info)
        limit_in_graph(gm, cfg.max_in_flight, cfg.max_in_flight_bytes, info)
        sink_in_graph(gm, info=info)
        peak = _verify(info, cfg)
        regions_after = _regions(info)
        for node, region in regions_before.items():
            if regions_after[node] != region:
                raise _fail(info, node, "moved across a barrier")
    except Exception as error:
        apply_order(gm, original)
        if recompile:
            gm.recompile()
        failure = error if isinstance(error, ScheduleError) else ScheduleError(
            f"{type(error).__name__}: {error}")
        if cfg.on_error == "raise":
            raise failure from error
        warnings.warn(f"overlapc left the graph unscheduled: {failure}", stacklevel=2)
        log.warning("overlapc left the graph unscheduled: %s", failure)
        return gm
    if recompile:
        gm.recompile()
    if log.isEnabledFor(logging.INFO):
        from overlapc import report
        before = [n.name for n in original]
        line = report.summary_line(report.summary(gm, before))
        log.info("overlapc: %s; peak %d all-gathers in flight (limit %s)", line, peak, cfg.max_in_flight)
        if log.isEnabledFor(logging.DEBUG):
            for row in report.rows(gm, before):
                log.debug("overlapc: %s %s group %s, %s bytes: issue %s -> %s, wait %s -> %s, %s%s",
                          row.kind, row.name, row.group, row.nbytes, row.issue_before, row.issue_after,
                          row.wait_before, row.wait_after, row.verdict,
                          f" ({row.reason})" if row.reason else "")
    return gm

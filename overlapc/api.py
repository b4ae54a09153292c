"""``overlapc.schedule``: the passes with what the product adds around them.

    gm = overlapc.schedule(gm, cfg)            # in place; returns gm, recompiled
    done = schedule_graph(gm, cfg, report=True)   # the same; the result and its report

The passes (``overlapc.passes.pipeline.run``) are the ground floor: they read no
cost model and log no report. This layer builds what they are handed (the
estimator ``chunks="auto"`` chooses piece counts with, from the config's
profile, or the profile every rank agreed on: ``use_profile``), runs them, and
logs one INFO line per graph (DEBUG: one line per collective) from the result,
with the report (``overlapc.explain.report``) built once per graph from the result's
``Structure``; the backend dumps that same report.
"""
from __future__ import annotations

import dataclasses
import logging

import torch.fx as fx

from overlapc.config import OverlapConfig, as_config
from overlapc.passes import pipeline
from overlapc.passes.pipeline import ScheduleResult

log = logging.getLogger("overlapc")

__all__ = ["Scheduled", "schedule", "schedule_graph", "verify", "estimator_for", "use_profile", "schedule_profile"]


@dataclasses.dataclass(frozen=True, eq=False)
class Scheduled:
    """One scheduled graph: what the passes did, and its report (``report.study``'s
    rows and summary) when one was built (asked for, or for the INFO line)."""

    result: ScheduleResult
    rows: list | None = None
    summary: dict | None = None


# profile spec -> the Profile to schedule with instead (the cross-rank check installs rank 0's)
_agreed_profiles: dict = {}


def use_profile(spec: str | None, profile) -> None:
    """Schedule with ``profile`` (an ``estimate.Profile``) wherever a config names
    ``spec``: ``rankcheck.share_profile`` installs rank 0's profile here, so that
    every rank's chunk pass chooses its piece counts from the same numbers."""
    _agreed_profiles[spec] = profile


def schedule_profile(spec: str | None):
    """What the chunk pass estimates with for a config's ``profile``: the profile
    installed by ``use_profile`` for it, else the spec itself."""
    return _agreed_profiles.get(spec, spec)


def estimator_for(cfg: OverlapConfig):
    """The estimator the chunk pass is handed for ``cfg``: with ``chunks="auto"`` the
    resolved profile it names (or the agreed one, ``schedule_profile``), else None
    (nothing to estimate: a profile file is not read)."""
    if cfg.chunks != "auto":
        return None
    from overlapc import estimate
    return estimate.resolve(schedule_profile(cfg.profile))


def schedule_graph(gm: fx.GraphModule, config: OverlapConfig | dict | None = None, *,
                   recompile: bool = True, report: bool = False) -> Scheduled:
    """Schedule ``gm`` in place (``pipeline.run`` with ``estimator_for(config)``), log
    its INFO line, and return the result with its report: built when ``report`` is
    True, or for the INFO line when the "overlapc" logger is enabled for INFO and a
    collective was placed; once, from the result's Structure. ValueError (the graph
    untouched) when ``config.profile`` names no built-in profile and no readable file."""
    pipeline.check_graph(gm)
    cfg = as_config(config)
    if cfg.enabled:   # a profile that does not resolve fails here, before the graph changes, at any log level
        from overlapc import estimate
        estimate.resolve(schedule_profile(cfg.profile))
    rewrites = cfg.enabled and (cfg.chunks != 1 or cfg.bucket is not None)
    counted = None
    if rewrites and log.isEnabledFor(logging.INFO):
        from overlapc.collectives import collectives
        counted = len(collectives(gm))
    result = pipeline.run(gm, cfg, estimator=estimator_for(cfg) if cfg.enabled else None, recompile=recompile)
    informed = bool(result.collectives) and log.isEnabledFor(logging.INFO)
    if not (report or informed):
        return Scheduled(result)
    from overlapc.explain import report as reports
    rows, summary = reports.study(gm, list(result.before), cfg.profile, structure=result.structure)
    if informed:
        _log(rows, summary, counted)
    return Scheduled(result, rows, summary)


def _log(rows: list, summary: dict, counted: int | None) -> None:
    """The INFO line of a scheduled graph (with the collective count before rewrites,
    ``counted``, when bucketing or chunking ran), at DEBUG one line per collective."""
    from overlapc.explain import report
    rewritten = f"collectives {counted} -> {summary['collectives']} (buckets/chunks); " \
        if counted is not None else ""
    log.info("overlapc: %s%s; %s", rewritten, report.summary_line(summary), report.memory_text(summary))
    if log.isEnabledFor(logging.DEBUG):   # one line per collective, under a header
        for line in report.format_table(rows).splitlines():
            log.debug("overlapc: %s", line)


def schedule(gm: fx.GraphModule, config: OverlapConfig | dict | None = None, *,
             recompile: bool = True) -> fx.GraphModule:
    """Reschedule ``gm`` in place so communication overlaps compute; return it.

    Runs the chunk and bucket passes when ``config`` asks for them, then the
    scheduling core under the config's budget, then the invariant check
    (``overlapc.passes.pipeline.run``), and logs one INFO line per graph.
    Deterministic: the same graph gives the same order in every process. A
    graph without movable collectives (or config.enabled False) comes back
    untouched. On failure the graph is restored; on_error="raise" raises
    ScheduleError, "fallback" warns (node, op, group, position) and returns
    the unscheduled graph. ``recompile=False`` skips regenerating
    ``gm.forward`` (for callers that read only ``gm.graph``, such as Inductor).
    """
    schedule_graph(gm, config, recompile=recompile)
    return gm


def verify(gm: fx.GraphModule, config: OverlapConfig | dict | None = None):
    """``overlapc.verify``: the passes' ``verify`` with ``config`` read as ``schedule``
    reads it (an options dict validated as an OverlapConfig); returns the Peaks."""
    return pipeline.verify(gm, as_config(config))

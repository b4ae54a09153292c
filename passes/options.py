"""ScheduleOptions: what the passes read of a configuration, and nothing else.

The passes take their own small options, as XLA's scheduler takes its own
config: the product's ``OverlapConfig`` (``overlapc/config.py``) holds these and
the rest (profile, Inductor mode, dumps, rank checks), validates every field,
and hands the passes ``OverlapConfig.scheduling()``. Nothing here validates:
build options through ``OverlapConfig`` (or take the defaults) and the values
are the ones it accepts. What ``chunks="auto"`` estimates with is no option: it
is handed to ``pipeline.run`` as ``estimator``.
"""
from __future__ import annotations

import dataclasses

__all__ = ["ScheduleOptions", "as_options"]


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """The scheduling fields of ``OverlapConfig``, with its defaults; each field means
    what the same field of ``OverlapConfig`` does (its docstring says how)."""

    max_in_flight: int | None = 3
    max_in_flight_bytes: int | str | None = "auto"
    bucket: str | int | None = "auto"
    regather: str = "always"
    chunks: int | str = 1
    on_error: str = "fallback"
    enabled: bool = True


def as_options(config) -> ScheduleOptions:
    """``config`` as ScheduleOptions: None gives the defaults, ScheduleOptions stay as
    they are, and a configuration with a ``scheduling()`` method (``OverlapConfig``)
    gives what that returns. TypeError for anything else (an options dict: validate
    it with ``overlapc.OverlapConfig.from_options`` first)."""
    if config is None:
        return ScheduleOptions()
    if isinstance(config, ScheduleOptions):
        return config
    scheduling = getattr(config, "scheduling", None)
    if callable(scheduling):
        options = scheduling()
        if isinstance(options, ScheduleOptions):
            return options
    raise TypeError(f"overlapc.passes take ScheduleOptions or an OverlapConfig (None: the defaults), got "
                    f"{type(config).__name__}; for an options dict pass overlapc.OverlapConfig.from_options(options), "
                    "or call overlapc.schedule, which takes the dict")

"""ScheduleOptions: what the passes read of a configuration, and nothing else.

The passes take their own small options, as XLA's scheduler takes its own
config: the product's ``OverlapConfig`` (``overlapc/config.py``) holds these and
the rest (profile, Inductor mode, dumps, rank checks) and hands the passes
``OverlapConfig.scheduling()``. The scheduling fields are checked here, once
(``check_scheduling``), for both. What ``chunks="auto"`` estimates with is no
option: it is handed to ``pipeline.run`` as ``estimator``.
"""
from __future__ import annotations

import dataclasses
import difflib

__all__ = ["ScheduleOptions", "as_options", "check_scheduling", "bucket_plan", "is_plan"]

PEAK_MODES = ("serial-peak", "graph-peak")   # byte budgets bounded by a peak, not a number
BYTE_MODES = ("auto", *PEAK_MODES)   # the named values of max_in_flight_bytes
REGATHER = ("always", "auto")
ISSUE = ("early", "per-kernel")
BUCKET_OPS = ("pack", "coalesced")
ON_ERROR = ("fallback", "raise")


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """The scheduling fields of ``OverlapConfig``; their defaults here are its defaults too.
    Each field means what the same field of ``OverlapConfig`` does (its docstring says how)."""

    max_in_flight: int | None = 3
    max_in_flight_bytes: int | str | None = "serial-peak"
    bucket: str | int | tuple[tuple[str, ...], ...] | None = "auto"
    bucket_op: str = "pack"
    regather: str = "always"
    issue: str = "early"
    chunks: int | str = 1
    narrow_gathers: bool = True
    on_error: str = "fallback"
    enabled: bool = True

    def __post_init__(self) -> None:
        check_scheduling(self, "ScheduleOptions")
        object.__setattr__(self, "bucket", bucket_plan(self.bucket, "ScheduleOptions"))


def is_plan(bucket) -> bool:
    """Whether ``bucket`` is a bucket plan (a list or tuple of module paths or lists of them)."""
    return isinstance(bucket, (list, tuple))


def bucket_plan(bucket, owner: str):
    """``bucket`` with a plan made a tuple of tuples of module paths (one tuple an entry, one
    bucket per entry); any other value as it is. ValueError naming ``owner.bucket``, the entry
    and what a plan holds for an entry that is not a non-empty path or list of them, and for a
    path in two entries."""
    if not is_plan(bucket):
        return bucket
    entries, seen = [], {}
    for index, entry in enumerate(bucket):
        paths = (entry,) if isinstance(entry, str) else tuple(entry) if isinstance(entry, (list, tuple)) else None
        if not paths or not all(isinstance(p, str) and p and p == p.strip(".") for p in paths):
            raise ValueError(f"{owner}.bucket: plan entry {index} is {entry!r}; an entry is a module path "
                             '("layers.0") or a non-empty list of them, one bucket per entry')
        for path in paths:
            if path in seen:
                raise ValueError(f"{owner}.bucket: module {path!r} is in plan entries {seen[path]} and {index}; "
                                 "a module's collectives go to one bucket: name it once")
            seen[path] = index
        entries.append(paths)
    return tuple(entries)


def _positive_or_none(owner: str, name: str, value, extra: str = "") -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}.{name} must be an int >= 1{extra} or None, got {value!r}")


def _one_of(owner: str, name: str, value, allowed, what: str, cutoff: float) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value).lower(), allowed, n=1, cutoff=cutoff)
        raise ValueError(f"{owner}.{name} must be {what}, got {value!r}"
                         + (f"; did you mean {close[0]!r}?" if close else ""))


def check_scheduling(config, owner: str) -> None:
    """ValueError naming ``owner``'s field (``owner.field``), the values it takes and the
    closest one, for the first scheduling field of ``config`` (``ScheduleOptions`` or
    ``OverlapConfig``: the same names) that is out of range."""
    _positive_or_none(owner, "max_in_flight", config.max_in_flight)
    if isinstance(config.max_in_flight_bytes, str):
        _one_of(owner, "max_in_flight_bytes", config.max_in_flight_bytes, BYTE_MODES,
                'an int >= 1 (bytes), "auto", "serial-peak", "graph-peak" or None', 0.4)
    else:
        _positive_or_none(owner, "max_in_flight_bytes", config.max_in_flight_bytes,
                          ' (bytes), "auto", "serial-peak", "graph-peak"')
    if isinstance(config.bucket, str):
        _one_of(owner, "bucket", config.bucket, ("auto", "module"),
                '"auto", "module", an int >= 1 (bytes), a plan (a list of module paths) or None', 0.5)
    elif is_plan(config.bucket):
        bucket_plan(config.bucket, owner)
    else:
        _positive_or_none(owner, "bucket", config.bucket, ' (bytes), "auto", "module", a plan (a list of module paths)')
    _one_of(owner, "bucket_op", config.bucket_op, BUCKET_OPS,
            '"pack" (one collective of a packed copy) or "coalesced" (reduce-scatter and all-reduce buckets as '
            'one *_coalesced op over the members\' own tensors)', 0.4)
    if config.regather not in REGATHER:
        raise ValueError(f"{owner}.regather must be one of {REGATHER} (\"always\": every backward re-gather "
                         f"stays; \"auto\": keep a block's forward gathers where the peak allows), "
                         f"got {config.regather!r}")
    _one_of(owner, "issue", config.issue, ISSUE,
            '"early" (as soon as its inputs are placed) or "per-kernel" (right before the kernel it runs under)', 0.4)
    if config.chunks != "auto" and (isinstance(config.chunks, bool) or not isinstance(config.chunks, int)
                                    or config.chunks < 1):
        raise ValueError(f'{owner}.chunks must be an int >= 1 (1 = off) or "auto", got {config.chunks!r}')
    if not isinstance(config.narrow_gathers, bool):
        raise ValueError(f"{owner}.narrow_gathers must be True (gather the narrow bytes a cast after the "
                         f"all-gather uses: float8 weights) or False, got {config.narrow_gathers!r}")
    if config.on_error not in ON_ERROR:
        raise ValueError(f"{owner}.on_error must be one of {ON_ERROR}, got {config.on_error!r}")
    if not isinstance(config.enabled, bool):
        raise ValueError(f"{owner}.enabled must be a bool, got {config.enabled!r}")


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

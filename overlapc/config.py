"""OverlapConfig: the one validated, frozen set of knobs for every entry point."""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Mapping

_ON_ERROR = ("fallback", "raise")
_INNER = ("inductor", "aot_eager")


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """How overlapc schedules a graph.

    max_in_flight: all-gathers of one process group issued and not yet waited,
        at most (int >= 1), or None for no limit.
    max_in_flight_bytes: bytes of those all-gathers' outputs in flight, at most
        (int >= 1), or None for no limit. An all-gather larger than this on its
        own is issued only when nothing else of its group is in flight.
    on_error: "fallback" warns and leaves the graph unscheduled; "raise" raises.
    enabled: False leaves every graph as it is (env OVERLAPC_DISABLE=1).
    inner: compiler the backend hands scheduled graphs to.
    dump_dir: where the backend writes per-rank, per-graph artifacts
        (env OVERLAPC_DUMP_DIR), or None.
    """

    max_in_flight: int | None = 2
    max_in_flight_bytes: int | None = None
    on_error: str = "fallback"
    enabled: bool = True
    inner: str = "inductor"
    dump_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_in_flight_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"OverlapConfig.{name} must be an int >= 1 or None (no limit), got {value!r}")
        if self.on_error not in _ON_ERROR:
            raise ValueError(f"OverlapConfig.on_error must be one of {_ON_ERROR}, got {self.on_error!r}")
        if self.inner not in _INNER:
            raise ValueError(f"OverlapConfig.inner must be one of {_INNER}, got {self.inner!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"OverlapConfig.enabled must be a bool, got {self.enabled!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ValueError(f"OverlapConfig.dump_dir must be a path or None, got {self.dump_dir!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None) -> "OverlapConfig":
        """Options beat environment beat defaults.

        Unknown option keys raise ValueError naming the closest valid key.
        Environment: OVERLAPC_DISABLE=1 sets enabled=False, OVERLAPC_DUMP_DIR
        sets dump_dir. Pass env={} to ignore the process environment.
        """
        env = os.environ if env is None else env
        options = dict(options or {})
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.0)
                raise ValueError(f"unknown overlapc option {key!r}; did you mean {close[0]!r}? "
                                 f"valid options: {', '.join(names)}")
        values: dict[str, Any] = {}
        if env.get("OVERLAPC_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
            values["enabled"] = False
        if env.get("OVERLAPC_DUMP_DIR"):
            values["dump_dir"] = env["OVERLAPC_DUMP_DIR"]
        values.update(options)
        return cls(**values)

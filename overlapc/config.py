"""OverlapConfig: the one validated, frozen set of knobs for every entry point.

The passes read only its scheduling fields, as ``ScheduleOptions``
(``overlapc.passes.options``; ``OverlapConfig.scheduling``). Those fields are
checked by ``overlapc.passes.options.check_scheduling`` for both classes, the
rest here."""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Mapping

from overlapc.passes.options import ScheduleOptions, bucket_plan, check_scheduling

_INNER = ("inductor", "aot_eager")
_SCHEDULING = ScheduleOptions()   # the defaults of the fields the passes read


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
    """How overlapc schedules a graph.

    max_in_flight: collectives of one process group and kind issued and not
        yet waited, at most (int >= 1), or None for no count limit. A bucket
        counts as one, and so do the pieces of one chunked collective.
    max_in_flight_bytes: the in-flight budget of one process group: bytes of
        all-gather outputs plus bytes of reduce-scatter / all-reduce /
        all-to-all inputs, issued and not yet waited (int >= 1),
        "serial-peak" (the default; no fixed number: a collective goes ahead
        only where everything in flight, all groups, fits under the peak of
        the graph's serial order, so the scheduled graph's peak never exceeds
        that order's, which ``verify`` checks; a reduce-scatter or all-reduce
        that does not fit is waited right after its start, as in the serial
        order), "graph-peak" (as "serial-peak", under the higher of that peak
        and the graph's own as handed in: a graph that already issues
        collectives early keeps its peak, as PyTorch's simple_overlap and
        reorder_communication_preserving_peak_memory keep a graph's; a graph
        traced serially schedules as under "serial-peak"), "auto" (faster where the peak is the bound, and may raise the
        peak: twice the group's largest collective, see
        ``overlapc.passes.inflight.auto_budget``, and more wherever everything
        in flight fits under the graph's memory peak, see
        ``overlapc.passes.memory.Headroom``), or None for no limit.
    bucket: merge small collectives before scheduling: "auto" (within a block
        of the model, up to the size of the group's largest collective, so the
        byte budget and memory stay as without buckets), "module" (one bucket
        per block where the graph records modules, 64 MiB otherwise), an int
        byte target, a plan (a list whose entries are module paths or lists of
        them, one bucket per entry: ``["tok_embeddings", "layers.0", ...,
        ["norm", "output"]]``, as graph_trainer's ``module_bucket_plans``; kept
        as a tuple of tuples), or None (off). See ``overlapc.passes.bucket``.
    bucket_op: how a bucket is issued: "pack" (the default: the members packed into one
        buffer, one collective, results read back out of it) or "coalesced" (a reduce-scatter
        or all-reduce bucket is one ``reduce_scatter_tensor_coalesced`` /
        ``all_reduce_coalesced`` over the members' own tensors: no pack copy, each result a
        tensor of its own; all-gather buckets stay packed, as PyTorch's coalesced bucket mode
        keeps them). See ``overlapc.passes.bucket``.
    regather: where a joint forward + backward graph gathers a parameter in the
        forward and again in the backward (FSDP's reshard-after-forward):
        "always" keeps every re-gather as traced; "auto" decides per block
        (last block first) to keep the forward's gathered weights alive for the
        backward and drop the re-gather wherever the graph's peak live bytes do
        not rise (``overlapc.passes.regather``; the choice is logged at INFO and
        noted in ``gm.meta["overlapc_regather"]``). Graphs without re-gathers
        are unaffected.
    issue: where a start goes: "early" (the default: as soon as its inputs are placed
        and the in-flight bounds let it) or "per-kernel" (right before the hiding kernel,
        a matmul, convolution or attention, it is to run under, one start per kernel, in
        consumer order, as PyTorch's overlap scheduler prefetches; one with no kernel left
        before its first consumer goes as under "early"). "per-kernel" allocates later
        (without a byte limit, a lower peak) and is slower by estimate where a kernel could
        hide more than one collective (docs/performance.md). See
        ``overlapc.passes.kernel_points``.
    chunks: split collectives on the critical path into this many pipelined
        pieces (int >= 1; 1 = off), or "auto": per pattern, the count that the
        estimator (``profile``) puts fastest. See ``overlapc.passes.chunk``.
    narrow_gathers: where an all-gather's result is used only through a cast to a
        narrower dtype (a float8 linear's weight: scaled by its amax, clamped, cast),
        cast the shard first and gather the narrow bytes, float8 as uint8 bits,
        the amaxes combined by one max all-reduce per graph and group; values
        bit-identical (``overlapc.passes.narrow`` lists the patterns). True (default)
        or False.
    profile: estimates for reports and logs: a built-in "device:link" name
        (e.g. "h100:nvlink", "cpu:ethernet") or the path of a profile file
        written by ``overlapc calibrate``; None = the run's default
        (``overlapc.estimate.costmodel.default_for``): "cpu:ethernet" when the backend
        compiles for CPU tensors over gloo, else "h100:nvlink".
    inductor_mode: an Inductor mode ("default", "reduce-overhead",
        "max-autotune", ...) to combine with overlapc options, or None.
    on_error: "fallback" warns and leaves the graph unscheduled; "raise" raises.
    enabled: False leaves every graph as it is (env OVERLAPC_DISABLE=1).
    inner: compiler the backend hands scheduled graphs to.
    dump_dir: where the backend writes per-rank, per-graph artifacts
        (env OVERLAPC_DUMP_DIR), or None.
    check_ranks: before a compiled graph runs, check through the c10d Store
        that every rank compiled the same collectives (``overlapc.backend.rankcheck``):
        True, False, or None = on when the default process group has more
        than one rank.
    check_ranks_timeout: seconds a rank waits there for the others (> 0).
    """

    max_in_flight: int | None = _SCHEDULING.max_in_flight   # the scheduling fields' defaults are the passes'
    max_in_flight_bytes: int | str | None = _SCHEDULING.max_in_flight_bytes
    bucket: str | int | tuple[tuple[str, ...], ...] | None = _SCHEDULING.bucket
    bucket_op: str = _SCHEDULING.bucket_op
    regather: str = _SCHEDULING.regather
    issue: str = _SCHEDULING.issue
    chunks: int | str = _SCHEDULING.chunks
    narrow_gathers: bool = _SCHEDULING.narrow_gathers
    profile: str | None = None
    inductor_mode: str | None = None
    on_error: str = _SCHEDULING.on_error
    enabled: bool = _SCHEDULING.enabled
    inner: str = "inductor"
    dump_dir: str | None = None
    check_ranks: bool | None = None
    check_ranks_timeout: float = 300.0

    def __post_init__(self) -> None:
        check_scheduling(self, "OverlapConfig")
        object.__setattr__(self, "bucket", bucket_plan(self.bucket, "OverlapConfig"))
        for name in ("profile", "inductor_mode"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"OverlapConfig.{name} must be a string or None, got {value!r}")
        if self.inner not in _INNER:
            raise ValueError(f"OverlapConfig.inner must be one of {_INNER}, got {self.inner!r}")
        if self.check_ranks is not None and not isinstance(self.check_ranks, bool):
            raise ValueError(f"OverlapConfig.check_ranks must be True, False or None (on when the world "
                             f"size is > 1), got {self.check_ranks!r}")
        if isinstance(self.check_ranks_timeout, bool) or not isinstance(self.check_ranks_timeout, (int, float)) \
                or not self.check_ranks_timeout > 0:
            raise ValueError(f"OverlapConfig.check_ranks_timeout must be a number of seconds > 0, "
                             f"got {self.check_ranks_timeout!r}")
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
        _check_names(options)
        values: dict[str, Any] = {}
        if env.get("OVERLAPC_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
            values["enabled"] = False
        if env.get("OVERLAPC_DUMP_DIR"):
            values["dump_dir"] = env["OVERLAPC_DUMP_DIR"]
        values.update(options)
        return cls(**values)

    def scheduling(self) -> ScheduleOptions:
        """What the passes read of this config (its fields of the same names)."""
        return ScheduleOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ScheduleOptions)})


def as_config(config: "OverlapConfig | Mapping[str, Any] | None") -> OverlapConfig:
    """``config`` as an OverlapConfig (None: the defaults; an options dict: validated,
    without the environment)."""
    if config is None:
        return OverlapConfig()
    if isinstance(config, OverlapConfig):
        return config
    if isinstance(config, dict):
        return OverlapConfig.from_options(config, env={})
    raise TypeError(f"expected an OverlapConfig or an options dict, got {type(config).__name__}")


def _check_names(values: Mapping[str, Any]) -> None:
    """ValueError naming the closest field for the first unknown key."""
    names = [f.name for f in dataclasses.fields(OverlapConfig)]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.0)
            raise ValueError(f"unknown overlapc option {key!r}; did you mean {close[0]!r}? "
                             f"valid options: {', '.join(names)}")


_dataclass_init = OverlapConfig.__init__


def _init_with_suggestions(self, *args, **kwargs) -> None:
    _check_names(kwargs)
    _dataclass_init(self, *args, **kwargs)


_init_with_suggestions.__doc__ = _dataclass_init.__doc__
OverlapConfig.__init__ = _init_with_suggestions

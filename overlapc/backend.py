"""The torch.compile backend: AOTAutograd -> overlapc.schedule -> Inductor.

``torch.compile(model, backend="overlapc", options={...})`` finds this module
through the ``torch_dynamo_backends`` entry point, so no import of overlapc is
needed (and importing it registers nothing twice). torch.compile rejects
``mode=`` together with ``options=``; name the Inductor mode among the options
instead, and its Inductor settings are applied with overlapc's own::

    torch.compile(model, backend="overlapc",
                  options={"max_in_flight": 2, "inductor_mode": "max-autotune"})

``options={"profile": "cpu:ethernet" | "path/to/profile.json"}`` sets the
estimates of the per-graph INFO line and of the ``dump_dir`` reports (a
built-in "device:link" or a file written by ``overlapc calibrate``; default
cpu:ethernet for CPU tensors over gloo, else h100:nvlink: ``costmodel.default_for``).

With ``inner="inductor"`` (default) the schedule runs as Inductor's
``post_grad_custom_post_pass`` on the forward and backward graphs, after
Inductor's own FX rewrites, and the compile is patched, for this compile only,
to turn off every Inductor pass that would move collectives, waits or the
compute between them (``overlapc.torch_compat.inductor_patches()``: ``reorder_for_peak_memory``,
which moves each all-gather back next to its wait, 2.14's
``enable_simple_overlap``, ...). Everything else in Inductor is unchanged. The pass's ``uuid()`` carries the config, so
Inductor's FX graph cache keys on it.

Per graph, before it is compiled: the cross-rank check (``overlapc.rankcheck``,
option ``check_ranks``), and one WARNING per compiled model whose graphs hold
no collectives although its parameters are distributed (FSDP2, DDP, DTensor);
a graph break in a DTensor-sharded model gets a WARNING too, and so does a
sharded model compiled in pieces (``warn_if_cut``: per-block compiles, a
forward Dynamo skipped). Every fw/bw graph gets an INFO line, cache hits included. Once the
backend (or ``capture``) has compiled in a process, log records of the "overlapc" logger read
"[rank R] fw_0: ..."; INFO on rank 0 only unless the logger is at DEBUG. Torch-version
workarounds (``overlapc.torch_compat``) are installed by the compile, never at import.
"""
from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import itertools
import logging
import os
import sys
import weakref
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from overlapc import rankcheck
from overlapc.collectives import name_inputs
from overlapc.config import OverlapConfig
from overlapc.api import schedule_graph
from overlapc.passes import pipeline
from overlapc.torch_compat import (
    SaveSeededOps, inductor_patches, route_gloo_all_gathers, save_seeded_ops_in_checkpoints, warn_if_untested,
    with_joint_pre_pass,
)

log = logging.getLogger("overlapc")


_graph_name: contextvars.ContextVar[str] = contextvars.ContextVar("overlapc_graph", default="")
_counter = {"graphs": 0}


def _next_index() -> int:
    """Number of the Dynamo graph being compiled in this process (0, 1, ...)."""
    _counter["graphs"] += 1
    return _counter["graphs"] - 1


@dataclasses.dataclass
class GraphRecord:
    """One scheduled graph: its name ("fw_0", "bw_0", ...), the scheduled
    GraphModule, and the node order and readable code from before scheduling."""

    name: str
    gm: fx.GraphModule
    before_order: list[str]
    before_code: str
    after_code: str


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _RankAndGraph(logging.Filter):
    """On the "overlapc" logger, in a process group: a record reads "[rank R]
    fw_0: ..." while the backend compiles graph fw_0, else "[rank R] ..." (its
    leading "overlapc: " dropped: the logger's name says it); records at INFO and
    below pass on rank 0 only unless the logger is enabled for DEBUG, so
    per-graph summaries print once per job by default and on every rank at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or getattr(record, "overlapc_tagged", False):
            return True
        rank = dist.get_rank()
        if rank != 0 and record.levelno <= logging.INFO and not log.isEnabledFor(logging.DEBUG):
            return False
        graph = _graph_name.get()
        record.msg = f"[rank {rank}] {graph + ': ' if graph else ''}{str(record.msg).removeprefix('overlapc: ')}"
        record.overlapc_tagged = True
        return True


def _tag_log_records() -> None:
    """Install ``_RankAndGraph`` on the "overlapc" logger, once; the backend does when it
    compiles (importing overlapc changes no logger)."""
    if not any(isinstance(f, _RankAndGraph) for f in log.filters):
        log.addFilter(_RankAndGraph())


def _schedule_and_record(gm: fx.GraphModule, cfg: OverlapConfig,
                         sink: Callable[[GraphRecord], None] | None, recompile: bool = True) -> None:
    """Schedule ``gm`` in place; hand the before/after record to ``sink`` and dump_dir."""
    want_record = sink is not None or cfg.dump_dir
    before_code = gm.print_readable(print_output=False) if want_record else ""
    done = schedule_graph(gm, cfg, recompile=recompile, report=bool(cfg.dump_dir))
    _pass_runs["n"] += 1
    if not want_record:
        return
    # After bucketing/chunking, "before" is the rewritten graph's order before scheduling.
    record = GraphRecord(_graph_name.get() or "graph", gm, list(done.result.before), before_code,
                         gm.print_readable(print_output=False))
    if sink is not None:
        sink(record)
    if cfg.dump_dir:
        from overlapc.report import write_artifacts
        folder = os.path.join(cfg.dump_dir, f"rank{_rank()}", record.name)
        write_artifacts(record, folder, cfg.profile, built=(done.rows, done.summary))
        log.info("overlapc: wrote %s", folder)


class SchedulePass(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Inductor post-grad pass running overlapc.schedule with one config."""

    def __init__(self, cfg: OverlapConfig, sink: Callable[[GraphRecord], None] | None = None):
        self.cfg = cfg
        self.sink = sink

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            raise RuntimeError("overlapc: post-grad graph has no owning GraphModule")
        _schedule_and_record(gm, self.cfg, self.sink, recompile=False)  # Inductor reads the graph

    def uuid(self) -> str:
        """Changes with the config, the content of the profile the schedule reads (a
        recalibrated file at the same path too) and overlapc's own source."""
        return hashlib.sha256(f"{dataclasses.astuple(self.cfg)!r} {rankcheck.profile_digest(self.cfg)} "
                              f"{rankcheck.source_hash()}".encode()).hexdigest()


def _uses_gloo() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend())


def _named(kind: str, compile_fn: Callable, index: int, cfg: OverlapConfig | None = None,
           input_names: list[str] | None = None, model: "_Model | None" = None) -> Callable:
    """Wrap an AOT/Inductor compiler so the schedule pass knows which graph it
    sees; with ``cfg`` asking for it, check the ranks first (``overlapc.rankcheck``).
    The check sits here, not in the post-grad pass, so an Inductor FX graph cache
    hit (which skips the pass) cannot skip it. ``model``: say once when the
    compiled model's graphs hold no collectives although its parameters are distributed."""
    def compile_named(gm, example_inputs, *args, **kwargs):
        is_backward = kwargs.get("is_backward", kind == "bw")
        name = f"{'bw' if is_backward else 'fw'}_{index}"
        token = _graph_name.set(name)
        try:
            if model is not None:
                model.saw(gm, name)
            if input_names:
                name_inputs(gm, input_names)   # reports name what a collective moves by its parameter
            if cfg is not None and rankcheck.enabled(cfg):
                seconds = rankcheck.check(gm, name, cfg, input_names or [])
                if seconds is not None:
                    log.debug("overlapc: every rank compiled the same collectives (checked in %.1f ms)",
                              seconds * 1e3)
            _graphs_seen["n"] += 1
            if cfg is None or not cfg.enabled:
                return compile_fn(gm, example_inputs, *args, **kwargs)
            return _compile_and_say(compile_fn, gm, example_inputs, *args, **kwargs)
        finally:
            _graph_name.reset(token)
    return compile_named


@dataclasses.dataclass
class _Model:
    """A model compiled with backend="overlapc" and what overlapc has said about it."""

    name: str
    found: str              # what makes its parameters distributed, in words ("" when nothing does)
    advice: str
    collectives: bool = False
    warned: bool = False
    breaks: set = dataclasses.field(default_factory=set)

    def saw(self, gm: fx.GraphModule, graph: str) -> None:
        """One WARNING (rank 0) at the first graph without collectives, unless an earlier graph had some."""
        from overlapc.collectives import collective_op
        if any(collective_op(n) for n in gm.graph.nodes):
            self.collectives = True
        elif self.found and not self.collectives and not self.warned:
            self.warned = True
            if _rank() == 0:
                log.warning("overlapc: nothing to schedule in %s: graph %s has no collective, while the model's "
                            "parameters are distributed (%s). %s", self.name, graph, self.found, self.advice)

    def graph_break(self, gm: fx.GraphModule, index: int) -> None:
        """A WARNING (rank 0) per graph break that splits a model with in-graph collectives."""
        reason = getattr(gm, "compile_subgraph_reason", None)
        if not self.found.endswith("DTensor parameters") or reason is None or not reason.graph_break:
            return
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else "an unknown line"
        if where in self.breaks or _rank() != 0:
            return
        self.breaks.add(where)
        log.warning("overlapc: graph break in %s after graph %d at %s (%s): overlap cannot cross it; the "
                    "collectives after the break start only when the graph before it has finished, and those "
                    "before it are waited at its end. Remove the break (torch._dynamo.explain(model)(*inputs) "
                    "lists them) to let overlapc schedule across it", self.name, index, where,
                    str(reason.reason).splitlines()[0][:200])


_models: "weakref.WeakKeyDictionary[torch.nn.Module, _Model]" = weakref.WeakKeyDictionary()
_MODULE_CALLS = ("__call__", "_call_impl", "_wrapped_call_impl")


def _compiled_model() -> _Model | None:
    """The module torch.compile wrapped (found on the Python stack, as an
    OptimizedModule's ``self``) and what makes its parameters distributed; None
    for a compiled function. Inspected once per model."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name in _MODULE_CALLS and isinstance(
            frame.f_locals.get("self"), torch._dynamo.eval_frame.OptimizedModule)):
        frame = frame.f_back   # only module-call frames have their locals read
    if frame is None:
        return None
    module = frame.f_locals["self"]._orig_mod
    if module not in _models:
        inner = getattr(module, "module", None) if isinstance(module, torch.nn.parallel.DistributedDataParallel) \
            else None
        name = type(module).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
        _models[module] = _Model(name, *_distributed(module))
    return _models[module]


def _distributed(module: torch.nn.Module) -> tuple[str, str]:
    """(what makes ``module``'s parameters distributed, what to do about it); ("", "") when nothing does."""
    dist = torch.distributed
    if not dist.is_available():
        return "", ""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(module, DistributedDataParallel):
        return ("DDP replicas", "DDP all-reduces gradients in its autograd hooks, outside the compiled "
                "graphs, so nothing overlaps by overlapc; to have the graphs reduce gradients, replicate in the "
                "graph: overlapc.fsdp.shard(model, mesh) on a mesh with dims (\"dp_replicate\", \"dp_shard\") "
                "and dp_shard of size 1 (HSDP with shard size 1), instead of DDP")
    fsdp = [name or "(root)" for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if fsdp:
        return (f"{len(fsdp)} FSDP2 fully_shard module(s) ({', '.join(fsdp[:3])}{', ...' if len(fsdp) > 3 else ''})",
                "In torch 2.13 FSDP2's all-gathers and reduce-scatters run in hooks that torch.compile does not "
                "trace, outside the compiled graphs (overlap is FSDP2's own prefetching); shard with "
                "overlapc.fsdp.shard(model, mesh) instead of fully_shard to have overlapc schedule them")
    dtensors = sum(isinstance(p, DTensor) for p in module.parameters())
    if dtensors:
        return (f"{dtensors} DTensor parameters", "The graphs read the parameters without communicating "
                "(already replicated or local); nothing to overlap")
    return "", ""


def _reads_parameters(example_inputs) -> bool:
    """Whether a Dynamo graph reads a parameter or a DTensor (its inputs hold one): a graph
    that reads neither, such as the cast of the inputs that ``fsdp.shard``'s ``param_dtype``
    compiles on its own, has nothing to gather, so its lack of collectives says nothing."""
    from torch.distributed.tensor import DTensor
    return any(isinstance(x, (torch.nn.Parameter, DTensor)) for x in example_inputs)


def _input_names(gm: fx.GraphModule) -> list[str]:
    """Each Dynamo graph input as its source names it ("L['self'].layers[0].w"), else the placeholder's name."""
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        names.append(source.name if source is not None else node.name)
    return names


def drop_dead_compute(gm: fx.GraphModule) -> int:
    """Erase nodes of ``gm.graph`` whose results nothing reads, as Inductor's
    post-grad DCE does before overlapc's pass runs there; collectives, waits and
    ops with side effects stay. Returns how many were erased; no recompile.

    Why: AOTAutograd's partitioner (torch 2.13) keeps dead non-collective nodes,
    so a backward recomputes, for nothing, the matmul that fed a saved
    collective (a TP row-parallel output); with inner="aot_eager" they would run.
    """
    from overlapc.collectives import role

    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: n.is_impure() or role(n)[0] is not None or role(n)[1])
    return before - len(gm.graph.nodes)


def _aot_eager(cfg: OverlapConfig, index: int, sink=None, decompositions=None,
               input_names: list[str] | None = None, model: _Model | None = None) -> Callable:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import default_partition

    def compile_graph(gm, example_inputs, *args, **kwargs):
        if drop_dead_compute(gm):
            gm.recompile()
        _schedule_and_record(gm, cfg, sink)
        return make_boxed_func(gm.forward)

    def partition(joint, *args, **kwargs):
        save_seeded_ops_in_checkpoints(joint.graph)
        return default_partition(joint, *args, **kwargs)

    return aot_autograd(fw_compiler=_named("fw", compile_graph, index, cfg, input_names, model),
                        bw_compiler=_named("bw", compile_graph, index, cfg, input_names, model),
                        partition_fn=partition, decompositions=decompositions)


def overlapc_backend(gm: fx.GraphModule, example_inputs, *, options: dict[str, Any] | None = None,
                     mode: str | None = None):
    """torch.compile backend. ``options`` keys are OverlapConfig fields (unknown
    key -> ValueError naming the closest). The Inductor mode is
    ``options["inductor_mode"]`` (or ``mode``, for direct callers): its
    ``torch._inductor.list_mode_options`` settings are patched in with
    overlapc's own (``inductor_patches()`` win where both set a key). ValueError
    for an unknown mode, a mode with ``inner="aot_eager"``, both ``mode`` and
    ``inductor_mode``, or a profile that does not resolve."""
    _tag_log_records()
    cfg = _profile_for_run(OverlapConfig.from_options(options), example_inputs)
    mode = _inductor_mode(cfg, mode)
    if cfg.profile is not None:
        from overlapc import costmodel
        costmodel.resolve(cfg.profile)   # a bad path fails now, not in the first dump
    warn_if_untested()
    index = _next_index()
    log.info("overlapc: compiling graph %d (fw_%d, bw_%d) with %s", index, index, index, cfg)
    if cfg.enabled and _uses_gloo():
        route_gloo_all_gathers()
    names = _input_names(gm)
    model = _compiled_model() if cfg.enabled else None
    if model is not None:
        model.graph_break(gm, index)
        if not _reads_parameters(example_inputs):
            model = None   # a prologue (fsdp.shard's cast of the inputs): no sign of missing collectives
    if cfg.enabled:
        warn_if_cut(gm)
    if cfg.inner == "aot_eager":
        if not cfg.enabled:
            from torch._dynamo.backends.debugging import aot_eager
            return aot_eager(gm, example_inputs)
        return _aot_eager(cfg, index, input_names=names, model=model)(gm, example_inputs)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    patches = dict(list_mode_options(mode)) if mode else {}
    if cfg.enabled:
        patches.update(inductor_patches(), post_grad_custom_post_pass=SchedulePass(cfg), joint_custom_pre_pass=
                       with_joint_pre_pass(torch._inductor.config.joint_custom_pre_pass, SaveSeededOps()))
        if cfg.dump_dir:
            patches["fx_graph_cache"] = False  # a cache hit would skip the pass and its dump
    inner = _named("fw", compile_fx_inner, index, cfg, names, model)
    if not rankcheck.enabled(cfg):
        seen = _graphs_seen["n"]
        compiled = compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
        if cfg.enabled:
            _say_aot_cache_hit(index, seen)
        return compiled
    # An AOTAutograd cache hit would skip the per-graph wrapper and with it the check.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)


def _profile_for_run(cfg: OverlapConfig, example_inputs) -> OverlapConfig:
    """``cfg`` with the profile that fits this run when its options name none
    (``costmodel.default_for``: CPU numbers for CPU tensors over gloo), so the INFO lines
    and dumps estimate this run; the config INFO line and every summary name it."""
    if cfg.profile is not None or not _uses_gloo():
        return cfg
    from overlapc import costmodel
    devices = sorted({t.device.type for t in example_inputs if isinstance(t, torch.Tensor)} - {"cpu"})
    chosen = costmodel.default_for(devices[0] if devices else "cpu", str(torch.distributed.get_backend()))
    return cfg if chosen == costmodel.DEFAULT else dataclasses.replace(cfg, profile=chosen)


def _inductor_mode(cfg: OverlapConfig, mode: str | None) -> str | None:
    """The one Inductor mode asked for (options' inductor_mode or the mode argument), checked."""
    if mode is not None and cfg.inductor_mode is not None and mode != cfg.inductor_mode:
        raise ValueError(f"overlapc: mode={mode!r} and options['inductor_mode']={cfg.inductor_mode!r} "
                         f"disagree; give the mode once, as options['inductor_mode']")
    mode = mode if mode is not None else cfg.inductor_mode
    if mode is None:
        return None
    if cfg.inner != "inductor":
        raise ValueError(f"overlapc: inductor_mode={mode!r} needs inner='inductor', got inner={cfg.inner!r}")
    from torch._inductor import list_mode_options
    try:
        list_mode_options(mode)
    except RuntimeError as error:
        raise ValueError(f"overlapc: unknown inductor_mode {mode!r}: {error}") from None
    return mode


def capture(model: torch.nn.Module, example_inputs, options: dict[str, Any] | None = None,
            note: Callable[[str], None] | None = None) -> list[GraphRecord]:
    """Compile ``model`` the way the backend does (Dynamo, AOTAutograd with
    Inductor's decompositions, overlapc.schedule), run one forward and backward
    on ``example_inputs`` (meta or fake-process-group tensors work), and return
    the scheduled graphs. Inductor's own post-grad rewrites and code generation
    are skipped, so nothing is compiled to machine code.

    The backward starts from ``backward_root(output)``; ``note`` (if given) is
    told where it started ("backward from output['loss']") or why there is
    none ("no backward: ..."): a backward that fails is said, not raised."""
    from torch._inductor.decomposition import select_decomp_table
    _tag_log_records()
    cfg = dataclasses.replace(OverlapConfig.from_options(options), dump_dir=None, check_ranks=False)
    records: list[GraphRecord] = []
    graphs = itertools.count()

    def backend(gm, example_inputs):
        return _aot_eager(cfg, next(graphs), sink=records.append, decompositions=select_decomp_table(),
                          input_names=_input_names(gm))(gm, example_inputs)

    run_step(model, example_inputs, backend, note)
    return records


def run_step(model: torch.nn.Module, example_inputs, dynamo_backend: Callable,
             note: Callable[[str], None] | None = None) -> None:
    """One forward of ``model`` compiled with ``dynamo_backend`` (Dynamo reset before and
    after) and the backward from ``backward_root`` of its output; ``note`` (if given) is
    told where the backward started or why there is none (a backward that raises is said)."""
    torch._dynamo.reset()
    inputs = example_inputs if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    out = torch.compile(model, backend=dynamo_backend)(*inputs)
    root, said = backward_root(out)
    if root is not None:
        try:
            root.backward()
        except Exception as error:   # noqa: BLE001 - reported to the caller with its reason
            said = f"no backward: {said} raised {type(error).__name__}: {' '.join(str(error).split())[:300]}"
    if note is not None:
        note(said)
    torch._dynamo.reset()


def backward_root(out) -> tuple[torch.Tensor | None, str]:
    """The scalar a captured backward starts from, and where it came from: a
    ``loss`` entry or attribute (dict, dataclass, HF ``ModelOutput``) that
    requires grad, else the sum of every floating tensor in ``out`` (tensors,
    lists, tuples, dicts, dataclasses, nested) that requires grad; None and
    the reason when there is none."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value, path: str) -> None:
        if isinstance(value, torch.Tensor):
            found.append((path, value))
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name), f"{path}.{field.name}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")

    walk(out, "output")
    usable = [(p, t) for p, t in found if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    loss = [(p, t) for p, t in usable if p.endswith(("['loss']", ".loss"))]
    if loss:
        path, tensor = loss[0]
        return (tensor if tensor.numel() == 1 else tensor.float().sum()), f"backward from {path}"
    if usable:
        return (sum(t.float().sum() for _, t in usable),
                f"backward from the sum of {', '.join(p for p, _ in usable)}")
    if not found:
        return None, f"no backward: the output ({type(out).__name__}) holds no tensor"
    return None, (f"no backward: no floating tensor of the output requires grad "
                  f"({', '.join(f'{p}: {t.dtype}' for p, t in found[:4])}{', ...' if len(found) > 4 else ''})")


# -- per-graph INFO when the pass did not run (cache hits, graphs without collectives) ------------

_pass_runs = {"n": 0}   # how many times the schedule pass has run in this process


def _compile_and_say(compile_fn: Callable, gm: fx.GraphModule, example_inputs, *args, **kwargs):
    """``compile_fn(gm, example_inputs, ...)``; when the schedule pass did not run on
    ``gm`` (an Inductor FX graph cache hit skips post-grad passes, and a graph with
    no collective has no summary), one INFO line says so, so every compiled graph has one."""
    runs = _pass_runs["n"]
    compiled = compile_fn(gm, example_inputs, *args, **kwargs)
    if _pass_runs["n"] == runs or not _has_collective(gm):
        log.info("overlapc: %s", _unscheduled_note(gm))
    return compiled


def _has_collective(gm: fx.GraphModule) -> bool:
    from overlapc.collectives import collective_op
    return any(collective_op(n) for n in gm.graph.nodes)


def _unscheduled_note(gm: fx.GraphModule) -> str:
    """The INFO text of a graph without collectives, or one the pass did not see (a cache hit)."""
    from overlapc.collectives import collective_op
    count = sum(1 for n in gm.graph.nodes if collective_op(n))
    if not count:
        return "no collective in this graph: nothing to schedule"
    return (f"from the FX graph cache: schedule as compiled before ({count} collectives; the cache key "
            f"holds overlapc's options and source, so the order is the one scheduled then)")


def _say_aot_cache_hit(index: int, seen_before: int) -> None:
    """INFO when AOTAutograd's cache served Dynamo graph ``index`` (no fw/bw graph reached overlapc)."""
    if _graphs_seen["n"] == seen_before:
        log.info("overlapc: graph %d from the AOTAutograd cache: schedule as compiled before", index)


_graphs_seen = {"n": 0}   # fw/bw graphs handed to overlapc's per-graph wrapper in this process


# -- where overlap is cut: a sharded model compiled in pieces -----------------------------------

_cut_warned: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OVERLAPC_DIRS = tuple(os.path.dirname(p) + os.sep for p in (__file__, pipeline.__file__))
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def warn_if_cut(gm: fx.GraphModule) -> bool:
    """One WARNING (rank 0) per model when Dynamo graph ``gm`` holds only part of a
    sharded model: a module compiled on its own (``model.layers[i] =
    torch.compile(block)``), a module Dynamo compiled alone because it skipped
    the model's forward (a graph break inside a loop over blocks), or a compiled
    function that reads only some of the model's parameters. Overlap stops at
    every graph's edge, so it names where the cut is (file:line), what was
    compiled, and which parameters' all-gathers can no longer be prefetched.
    Returns True when ``gm`` is such a piece. A graph of the whole model (or of
    its forward's pieces around a graph break: ``_Model.graph_break`` says those)
    is not."""
    try:
        params = _graph_parameters(gm)
        if not params:
            return False
        stack_modules = _stack_modules()
        frame_locals, code, reachable = _compiled_frame()
        root = _root_module(params, stack_modules, reachable)
        compiled = _unwrap(frame_locals.get("self"))
        if root is None or compiled is root:
            return False
        ids = {id(p) for p in params}
        sharded = [(n.replace("._orig_mod", ""), id(p)) for n, p in root.named_parameters() if _is_dtensor(p)]
        mine = [n for n, i in sharded if i in ids]
        if len(mine) == len(sharded):
            return False
        sharded = [n for n, _ in sharded]
    except Exception as error:   # noqa: BLE001 - a diagnosis must never break a compile
        log.debug("overlapc: could not tell whether the graph holds the whole model: %s", error)
        return False
    if root not in _cut_warned:
        _cut_warned.add(root)
        if _rank() == 0:
            log.warning("overlapc: %s", _cut_message(root, mine, sharded, compiled, code, stack_modules))
    return True


def _cut_message(root, mine: list[str], sharded: list[str], compiled, code, stack_modules) -> str:
    part = ", ".join(_cover(mine, sharded)[:6])
    others = _cover([n for n in sharded if n not in set(mine)], sharded)
    model = type(root).__name__
    wrapped = [m for m, optimized in stack_modules if optimized]
    if compiled is not None and wrapped and wrapped[0] is compiled:
        how = f"{part} is compiled on its own (torch.compile on the module, not on {model})"
    elif root in wrapped:
        how = (f"Dynamo runs {model}.forward uncompiled and compiles each module it calls on its own"
               f"{_dynamo_skip_reason()}")
    else:
        how = f"the compiled {'module' if compiled is not None else 'function'} " \
              f"{getattr(code, 'co_name', '?')} reads only {part}'s parameters"
    return (f"graphs of {model} are cut at {_user_line()}: {how}. This graph holds {len(mine)} of the model's "
            f"{len(sharded)} sharded parameters ({part}); overlap stops at its edges: the all-gathers of "
            f"{', '.join(others[:6])}{', ...' if len(others) > 6 else ''} cannot be issued during its compute "
            f"(they start when their own graph, or the eager code around it, starts), and what runs "
            f"uncompiled gathers without prefetch. Compile the whole model (torch.compile(model), no graph "
            f"break inside the loop over blocks: torch._dynamo.explain(model)(*inputs) lists them) to let "
            f"overlapc schedule across blocks")


def _graph_parameters(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The DTensor parameters Dynamo graph ``gm`` takes as inputs (real objects, by identity)."""
    found = []
    for node in gm.graph.find_nodes(op="placeholder"):
        example = getattr(node.meta.get("grapharg"), "example", None)
        if isinstance(example, torch.nn.Parameter) and _is_dtensor(example):
            found.append(example)
    return found


def _is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)


def _unwrap(module):
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return module._orig_mod
    return module if isinstance(module, torch.nn.Module) else None


def _stack_modules() -> list[tuple[torch.nn.Module, bool]]:
    """(module, called through an OptimizedModule) of every module call on the Python
    stack, innermost first (only module-call frames have their locals read)."""
    found: list[tuple[torch.nn.Module, bool]] = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _MODULE_CALLS:
            module = frame.f_locals.get("self")
            optimized = isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            module = _unwrap(module)
            if module is not None:
                if found and found[-1][0] is module:
                    found[-1] = (module, found[-1][1] or optimized)
                else:
                    found.append((module, optimized))
        frame = frame.f_back
    return found


def _compiled_frame() -> tuple[dict, object, list]:
    """(locals, code, the modules it can reach by name: locals, closure cells, globals)
    of the frame Dynamo is compiling, from its ``_compile`` call on the stack (torch
    2.13 and 2.14 name it and its arguments so); ({}, None, []) when not found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_compile" and frame.f_code.co_filename.endswith(
                os.path.join("_dynamo", "convert_frame.py")):
            values = frame.f_locals
            frame_locals = dict(values.get("locals") or {})
            cells = [getattr(c, "cell_contents", None) for c in values.get("closure") or ()]
            reachable = [*frame_locals.values(), *cells, *(values.get("globals") or {}).values()]
            modules = [m for m in map(_unwrap, reachable) if m is not None]
            return frame_locals, values.get("code"), modules
        frame = frame.f_back
    return {}, None, []


def _root_module(params: list[torch.Tensor], stack_modules, reachable: list):
    """The outermost module (calling the compiled code, or reachable from the compiled
    frame) whose parameters include all of ``params``; None when there is none."""
    wanted = {id(p) for p in params}
    candidates = [m for m, _ in reversed(stack_modules)] + reachable
    for module in candidates:
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    return None


def _cover(chosen: list[str], everything: list[str], prefix: tuple = ()) -> list[str]:
    """The fewest module paths (or parameter names) whose parameters, among
    ``everything``, are exactly ``chosen``: ["embed", "layers.0"]. In ``everything``'s order."""
    chosen_set = set(chosen)
    groups: dict[str, list[str]] = {}
    for name in everything:
        parts = name.split(".")
        if tuple(parts[:len(prefix)]) == prefix and len(parts) > len(prefix):
            groups.setdefault(parts[len(prefix)], []).append(name)
    paths = []
    for key, names in groups.items():
        mine = [n for n in names if n in chosen_set]
        if len(mine) == len(names):
            paths.append(".".join((*prefix, key)))
        elif mine:
            paths += _cover(mine, names, (*prefix, key))
    return paths


def _user_line() -> str:
    """file:line of the innermost frame on the stack outside torch, overlapc and the
    standard library: the user code that called the compiled piece."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _STDLIB_DIR, *_OVERLAPC_DIRS)) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "an unknown line"


def _dynamo_skip_reason() -> str:
    """Dynamo's latest reason for skipping a frame (its graph-break counters), as
    "; Dynamo: frame skipped: forward (file line N) after: <first reason>", or ""."""
    import re
    reasons = list(torch._dynamo.utils.counters.get("unimplemented", {}))
    for text in reversed(reasons):
        skipped = re.search(r"frame skipped: (\S+) \((.+) line (\d+)\)", text)
        if skipped:
            first = text.strip().splitlines()[0][:160]
            return f" (Dynamo skipped {skipped.group(1)} at {skipped.group(2)}:{skipped.group(3)} after: {first})"
    return ""

"""The torch.compile backend: AOTAutograd -> overlapc.schedule -> Inductor.

``torch.compile(model, backend="overlapc", options={...})`` finds
``overlapc_backend`` through the ``torch_dynamo_backends`` entry point
(``overlapc.backend:overlapc_backend``, the package's name for it), so no import of overlapc is
needed (and importing it registers nothing twice). torch.compile rejects
``mode=`` together with ``options=``; name the Inductor mode among the options
instead, and its Inductor settings are applied with overlapc's own::

    torch.compile(model, backend="overlapc",
                  options={"max_in_flight": 2, "inductor_mode": "max-autotune"})

``options={"profile": "cpu:ethernet" | "path/to/profile.json"}`` sets the
estimates of the per-graph INFO line and of the ``dump_dir`` reports (a
built-in "device:link" or a file written by ``overlapc calibrate``; default
cpu:ethernet for CPU tensors over gloo, else h100:nvlink: ``estimate.default_for``).

With ``inner="inductor"`` (default) the schedule runs as Inductor's
``post_grad_custom_post_pass`` on the forward and backward graphs, after
Inductor's own FX rewrites, and the compile is patched, for this compile only,
to turn off every Inductor pass that would move collectives, waits or the
compute between them (``overlapc.torch_compat.inductor_patches()``: ``reorder_for_peak_memory``,
which moves each all-gather back next to its wait, 2.14's
``enable_simple_overlap``, ...). Everything else in Inductor is unchanged. The pass's ``uuid()`` carries the config, so
Inductor's FX graph cache keys on it.

Per graph, before it is compiled: the cross-rank check (``overlapc.backend.rankcheck``,
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

from overlapc.api import schedule_graph
from overlapc.backend import rankcheck
from overlapc.backend.cuts import MODULE_CALLS, warn_if_cut
from overlapc.collectives import name_inputs
from overlapc.config import OverlapConfig
from overlapc.torch_compat import (
    inductor_patches, route_gloo_all_gathers, save_seeded_ops_in_checkpoints, warn_if_untested, with_joint_pre_pass,
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


def schedule_and_record(gm: fx.GraphModule, cfg: OverlapConfig,
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
        from overlapc.explain.report import write_artifacts
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
        schedule_and_record(gm, self.cfg, self.sink, recompile=False)  # Inductor reads the graph

    def uuid(self) -> str:
        """Changes with the config, the content of the profile the schedule reads (a
        recalibrated file at the same path too) and overlapc's own source."""
        return hashlib.sha256(f"{dataclasses.astuple(self.cfg)!r} {rankcheck.profile_digest(self.cfg)} "
                              f"{rankcheck.source_hash()}".encode()).hexdigest()


class SaveSeededOps(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Inductor joint-graph pass running ``save_seeded_ops_in_checkpoints``."""

    def __call__(self, graph: fx.Graph) -> None:
        save_seeded_ops_in_checkpoints(graph)

    def uuid(self) -> str:
        return f"overlapc.SaveSeededOps {rankcheck.source_hash()}"


def _uses_gloo() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend())


def per_graph(kind: str, compile_fn: Callable, index: int, cfg: OverlapConfig | None = None,
           input_names: list[str] | None = None, model: "_Model | None" = None) -> Callable:
    """Wrap an AOT/Inductor compiler so the schedule pass knows which graph it
    sees; with ``cfg`` asking for it, check the ranks first (``overlapc.backend.rankcheck``).
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
    replicated: bool = False   # every DTensor parameter whole on every rank: its forward needs no collective
    collectives: bool = False
    warned: bool = False
    breaks: set = dataclasses.field(default_factory=set)

    def saw(self, gm: fx.GraphModule, graph: str) -> None:
        """One WARNING (rank 0) at the first graph without collectives, unless an earlier graph had
        some; not at the forward of a model whose parameters are all replicated (in-graph DDP:
        its backward all-reduces the gradients)."""
        from overlapc.collectives import collective_op
        if any(collective_op(n) for n in gm.graph.nodes):
            self.collectives = True
        elif self.replicated and graph.startswith("fw_"):
            return
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


def _compiled_model() -> _Model | None:
    """The module torch.compile wrapped (found on the Python stack, as an
    OptimizedModule's ``self``, or a module that ``nn.Module.compile()`` compiled in
    place) and what makes its parameters distributed; None for a compiled function.
    Inspected once per model."""
    frame, module = sys._getframe(1), None
    while frame is not None and module is None:
        if frame.f_code.co_name in MODULE_CALLS:   # only module-call frames have their locals read
            module = _compiled_module(frame.f_locals.get("self"))
        frame = frame.f_back
    if module is None:
        return None
    if module not in _models:
        inner = getattr(module, "module", None) if isinstance(module, torch.nn.parallel.DistributedDataParallel) \
            else None
        name = type(module).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
        _models[module] = _Model(name, *_distributed(module), replicated=_all_replicated(module))
    return _models[module]


def _compiled_module(candidate) -> torch.nn.Module | None:
    """The module ``candidate`` compiles: an OptimizedModule's original module, or
    ``candidate`` itself when ``nn.Module.compile()`` compiled it in place; else None."""
    if isinstance(candidate, torch._dynamo.eval_frame.OptimizedModule):
        return candidate._orig_mod
    if isinstance(candidate, torch.nn.Module) and getattr(candidate, "_compiled_call_impl", None) is not None:
        return candidate
    return None


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


def _all_replicated(module: torch.nn.Module) -> bool:
    """Whether ``module`` has DTensor parameters and every one is whole on every rank: each
    placement replicated, or sharded over a mesh dim of size 1 (in-graph DDP's dp_shard)."""
    from torch.distributed.tensor import DTensor
    params = [p for p in module.parameters() if isinstance(p, DTensor)]
    return bool(params) and all(pl.is_replicate() or p.device_mesh.size(dim) == 1
                                for p in params for dim, pl in enumerate(p.placements))


def _reads_parameters(example_inputs) -> bool:
    """Whether a Dynamo graph reads a parameter or a DTensor (its inputs hold one): a graph
    that reads neither, such as the cast of the inputs that ``fsdp.shard``'s ``param_dtype``
    compiles on its own, has nothing to gather, so its lack of collectives says nothing."""
    from torch.distributed.tensor import DTensor
    return any(isinstance(x, (torch.nn.Parameter, DTensor)) for x in example_inputs)


def input_names_of(gm: fx.GraphModule) -> list[str]:
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
        schedule_and_record(gm, cfg, sink)
        return make_boxed_func(gm.forward)

    def partition(joint, *args, **kwargs):
        save_seeded_ops_in_checkpoints(joint.graph)
        return default_partition(joint, *args, **kwargs)

    return aot_autograd(fw_compiler=per_graph("fw", compile_graph, index, cfg, input_names, model),
                        bw_compiler=per_graph("bw", compile_graph, index, cfg, input_names, model),
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
        from overlapc import estimate
        estimate.resolve(cfg.profile)   # a bad path fails now, not in the first dump
    warn_if_untested()
    index = _next_index()
    log.info("overlapc: compiling graph %d (fw_%d, bw_%d) with %s", index, index, index, cfg)
    if not cfg.enabled:   # never silent when overlap is off: a stale environment variable turns it off too
        why = "enabled=False" if (options or {}).get("enabled") is False else "OVERLAPC_DISABLE is set"
        log.warning("overlapc: off (%s): graph %d is compiled by %s without scheduling its collectives",
                    why, index, cfg.inner)
    if cfg.enabled and _uses_gloo():
        route_gloo_all_gathers()
    names = input_names_of(gm)
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
    inner = per_graph("fw", compile_fx_inner, index, cfg, names, model)
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
    (``estimate.default_for``: CPU numbers for CPU tensors over gloo), so the INFO lines
    and dumps estimate this run; the config INFO line and every summary name it."""
    if cfg.profile is not None or not _uses_gloo():
        return cfg
    from overlapc import estimate
    devices = sorted({t.device.type for t in example_inputs if isinstance(t, torch.Tensor)} - {"cpu"})
    chosen = estimate.default_for(devices[0] if devices else "cpu", str(torch.distributed.get_backend()))
    return cfg if chosen == estimate.DEFAULT else dataclasses.replace(cfg, profile=chosen)


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
                          input_names=input_names_of(gm))(gm, example_inputs)

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

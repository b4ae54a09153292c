"""What differs between the torch versions overlapc runs on, in one place.

overlapc is tested on the torch releases in ``TESTED_TORCH``; on any other it
still runs and says once (WARNING on the "overlapc" logger) which releases are
tested. Settings that depend on the version are keyed on what the installed
torch actually has (a config key, an attribute, an opaque graph input),
never on version strings.

Every workaround of a torch behaviour lives here, each with the check that
decides whether the installed torch needs it and the behaviour it works around:

- ``inductor_patches``: Inductor passes that move collectives, waits or the
  compute between them, off, its wrapper's buffer reuse, which holds dead
  buffers that overlapc's memory model frees, and its scheduler's fusions
  across a collective's start or wait (keyed on the config keys the installed
  Inductor has; per compile, through ``config_patches``, never process-wide).
- ``inductor_keeps_order``: the same, for a caller that turns Inductor's
  peak-memory reordering back on inside (torchtitan graph_trainer's full
  Inductor pass; for the duration of a with block).
- ``save_seeded_ops_in_checkpoints``: the DeviceMesh saved
  as a tensor when a checkpointed seeded op is recomputed (torch >= 2.13,
  which passes the mesh into graphs as an opaque input; per compile: the
  backend's joint-graph pass ``overlapc.backend.compiler.SaveSeededOps``).
- ``route_gloo_all_gathers``: gloo's coalesced all-gather corrupting the heap
  with many in flight (seen on 2.13 and 2.14.1; process-wide, installed by the
  backend when it compiles for a gloo group and by ``overlapc.fsdp.shard`` on a
  gloo mesh, never at import).
- ``fake_cuda_patches``: what a fake CUDA device (``overlapc.backend.cuda_capture.fake_h100``)
  needs besides on the installed build (``~tensor``'s C binding takes a CUDA device
  guard; for the duration of the fake device only).
- ``quiet_checkpoint_context_warning``: torch's warning on every
  ``context_fn`` checkpoint under torch.compile, dropped for overlapc.fsdp's
  own regions (installed on torch's logger by ``overlapc.fsdp.shard``, never
  at import).
- ``output_aware_checkpoint_contexts``: a selective-checkpoint policy that
  needs each op's result (torch 2.11-2.12 call the policy before the op runs;
  keyed on ``SelectiveCheckpointContext``'s ``op_output``; per region).

Importing overlapc installs nothing process-wide (tests/test_torch_compat.py).
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import operator
import sys
import warnings

import torch
import torch._inductor.custom_graph_pass as custom_graph_pass
import torch.fx as fx

log = logging.getLogger("overlapc")

# Releases the suite runs on (CI: one clean virtual environment each).
TESTED_TORCH = ("2.13.0", "2.14.1")

# Inductor passes that move collective starts or waits, or the compute between
# them, and the value that turns each off. Inductor must keep the order overlapc
# placed (tests/test_inductor_windows.py reads the compute windows in its code):
# - reorder_for_peak_memory puts each hoisted all-gather back next to its wait;
# - reorder_for_compute_comm_overlap runs Inductor's own comm reordering;
# - aten_distributed_optimizations.enable_simple_overlap (new in 2.14, on by
#   default, CPU and CUDA) swaps starts earlier and waits later, which raised
#   overlapc's 2 all-gathers in flight to 4;
# - aten_distributed_optimizations.enable_overlap_scheduling (off by default)
#   is Inductor's whole overlap scheduler;
# - bucket_{all_gathers,reduce_scatters,all_reduces}_fx (off by default) run
#   after the custom post-grad pass and merge overlapc's placed collectives into
#   buckets placed by their own rule.
# Left as they are, checked not to move a window (2.13.0, 2.14.1):
# reorder_for_locality (and reorder_for_locality_in_training) reorders the
# post-grad graph before the custom post-grad pass that schedules it;
# triton.reorder_for_reducing_graph_partitions (cudagraph partitions only)
# moved no window in that test's CUDA graphs.
_ORDER_MOVING_PASSES = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
    "aten_distributed_optimizations.enable_simple_overlap": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
}

# Inductor's wrapper keeps a buffer whose last reader ran allocated until a later
# kernel output of the same device, dtype and bytes takes it (``bufY = bufX; del
# bufX  # reuse``; ``allow_buffer_reuse``). overlapc's memory model
# (``overlapc.passes.memory``) frees a buffer after its last reader, which is what
# the wrapper does with reuse off; with it on, the held buffers raised the
# device peak of the Llama in benchmarks/gpu_check.py to 1.18-1.20x plain
# Inductor's (H200, torch 2.11, 2026-11-29: 26 MiB held at an 8 MiB bucket's
# unpack). Off, every buffer is freed where the model frees it, so no buffer is
# live longer than under plain Inductor (reuse only delays frees); the caching
# allocator hands a freed block to the next allocation of its size anyway.
_MEMORY_MODEL_PATCHES = {
    "allow_buffer_reuse": False,
}

_warned = {"version": False}


def inductor_patches() -> dict[str, object]:
    """Inductor config patches (``torch._inductor.config.patch`` keys, dotted
    for nested sections) that turn off every pass of the installed Inductor
    that would move collectives, waits or the compute between them, the
    wrapper's buffer reuse (``_MEMORY_MODEL_PATCHES``), and fusions across a
    collective's start or wait (``_fusion_guard_patches``). Keys the installed
    torch does not have are left out, so the dict is valid for ``config.patch`` as it is."""
    from torch._inductor import config
    known = config.get_config_copy()
    wanted = {**_ORDER_MOVING_PASSES, **_MEMORY_MODEL_PATCHES}
    return {**{key: value for key, value in wanted.items() if key in known}, **_fusion_guard_patches(known)}


# Inductor's scheduler fuses kernels that share inputs (horizontal) or feed one another
# (vertical) wherever no dependency forbids it, then places each fused kernel at its
# first member's position, pulling the later member's inputs ahead of it. Two
# independent kernels on either side of a wait (the norms of two pipelined
# reduce-scatter pieces, reading the same weights) become one kernel placed where the
# first stood, so the later piece's wait moves up to it, ahead of the matmuls overlapc
# put between them: the window is lost (tests/test_cuda_codegen.py's chunked TP+SP block,
# 5 of 30 windows per graph on 2.13 and 2.14.1). The guard refuses any fusion whose
# kernels stand on two sides of a collective's start or wait in the order Inductor
# received; every other fusion is decided as Inductor decides it.
def _fusion_guard_patches(known: dict) -> dict[str, object]:
    """The config patches that install ``_FusionGuard`` for one compile: the pre-fusion
    pass turns it on, the post-fusion pass off (each chained to a pass the caller set).
    Empty where the installed Inductor lacks the scheduler-pass keys."""
    from torch._inductor import config
    keys = ("_pre_fusion_custom_pass", "_post_fusion_custom_pass")
    if not all(key in known for key in keys) or _SCHEDULER_PASS is object:
        return {}
    callers = [getattr(config, key) for key in keys]   # (``known`` holds copies)
    if isinstance(callers[0], _GuardFusions):   # patches taken inside patches: the same guard
        return dict(zip(keys, callers))
    return {keys[0]: _GuardFusions(True, callers[0]), keys[1]: _GuardFusions(False, callers[1])}


class _FusionGuard:
    """Inductor's fusion choices (``V.choices``) for one graph, less every fusion that
    would span a collective's start or wait: ``events`` are those nodes' positions in
    the scheduler's order before fusion (a node's ``min_order`` .. ``max_order``).
    Other graphs' scheduling, and every other question, go to ``choices``."""

    def __init__(self, choices, events: list[int], graph):
        self.choices, self.events, self.graph = choices, events, graph

    def __getattr__(self, name):
        return getattr(self.choices, name)

    def can_fuse(self, scheduler, node1, node2, shared_data_score) -> bool:
        from torch._inductor.virtualized import V
        if V.graph is self.graph:
            low = min(node1.min_order, node2.min_order)
            high = max(node1.max_order, node2.max_order)
            if bisect.bisect_left(self.events, high) > bisect.bisect_right(self.events, low):
                return False
        return self.choices.can_fuse(scheduler, node1, node2, shared_data_score)


# Inductor's base class of scheduler passes (one the FX graph cache can key on); object
# where the installed Inductor has none, and then no guard is installed.
_SCHEDULER_PASS = getattr(custom_graph_pass, "CustomSchedulerPass", object)


class _GuardFusions(_SCHEDULER_PASS):
    """Inductor's pre-fusion (``on``) or post-fusion scheduler pass: turns the
    ``_FusionGuard`` of the graph being scheduled on or off, then runs ``then``, the
    pass the caller had configured (None: none)."""

    def __init__(self, on: bool, then=None):
        self.on, self.then = on, then

    def __call__(self, nodes: list) -> list:
        from torch._inductor import ir
        from torch._inductor.virtualized import V
        current = V.choices
        if isinstance(current, _FusionGuard):   # the last compile's, if its fusion raised
            V.set_choices_handler(current.choices)
        if self.on:
            events = [n.min_order for n in nodes if isinstance(getattr(n, "node", None), ir._CollectiveKernel)]
            if events:
                V.set_choices_handler(_FusionGuard(V.choices, sorted(events), V.graph))
        return nodes if self.then is None else self.then(nodes)

    def uuid(self):
        then = None if self.then is None else (self.then.uuid() if hasattr(self.then, "uuid") else repr(self.then))
        return f"overlapc.GuardFusions {self.on} {then}"


@contextlib.contextmanager
def inductor_keeps_order():
    """While active, Inductor keeps the order of collectives and waits in the graphs it
    compiles, even where a caller turns ``reorder_for_peak_memory`` back on inside:
    ``inductor_patches()`` are applied, and Inductor's peak-memory reordering, if it
    runs, tries no order but the one it is given (``methods=[]``: its baseline).

    Works around: torchtitan graph_trainer's ``full_inductor_compilation_pass``
    (0.3.0) patches ``reorder_for_peak_memory=True`` inside itself, over any patch
    around it, to undo the order AOTAutograd's re-trace leaves; that reordering puts
    hoisted all-gathers back next to their waits. The FX graph cache key reads
    config values, not this replaced function, so the key gets a tag
    (``torch.compiler.config.cache_key_tag``) and a graph compiled without it is not
    loaded for one compiled with it, or the other way round."""
    from torch._inductor import config, memory

    reorder = memory.reorder_for_peak_memory

    def given_order_only(*args, **kwargs):
        return reorder(*args, **{**kwargs, "methods": []})

    tag = f"{torch.compiler.config.cache_key_tag}|overlapc.keep_order"
    memory.reorder_for_peak_memory = given_order_only
    try:
        with config.patch(inductor_patches()), torch.compiler.config.patch(cache_key_tag=tag):
            yield
    finally:
        memory.reorder_for_peak_memory = reorder


def with_joint_pre_pass(existing, added):
    """Inductor's ``joint_custom_pre_pass`` value that runs the user's
    ``existing`` pass(es), then ``added``. torch >= 2.13 takes a list
    (``get_custom_graph_passes``); older Inductor takes one pass, so two are
    chained in one ``CustomGraphPass``."""
    if hasattr(custom_graph_pass, "get_custom_graph_passes"):
        return [*custom_graph_pass.get_custom_graph_passes(existing), added]
    return added if existing is None else _Chained(existing, added)


class _Chained(custom_graph_pass.CustomGraphPass):
    """Two joint-graph passes run in order, for an Inductor that takes only one."""

    def __init__(self, first, second):
        self.passes = (first, second)

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self):
        ids = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if None in ids else f"overlapc.Chained {ids}"


def is_opaque_input(placeholder) -> bool:
    """Whether a joint graph's placeholder is an opaque object (a DTensor's
    DeviceMesh). torch < 2.13 passes no opaque objects into graphs: False."""
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:
        return False
    return is_opaque_node(placeholder)


def release() -> str:
    """The installed torch's release, without a local build tag ("2.14.1")."""
    return torch.__version__.split("+")[0]



def fake_cuda_patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, value) patches a fake CUDA device needs on the installed torch,
    for ``overlapc.backend.cuda_capture.fake_h100`` to apply and undo: the C binding of
    ``~tensor`` takes a CUDA device guard, which a build without a usable CUDA runtime
    cannot give (torch 2.13's embedding-backward decomposition inverts a mask on fake
    CUDA tensors), so it goes through ``torch.bitwise_not``, the same op without the guard."""
    return [(torch.Tensor, "__invert__", lambda self: torch.bitwise_not(self))]


def warn_if_untested() -> None:
    """Say once per process when the installed torch is not one overlapc is tested on."""
    if _warned["version"] or release() in TESTED_TORCH:
        return
    _warned["version"] = True
    log.warning("overlapc: torch %s is not among the tested releases (%s); scheduling runs as usual, "
                "but Inductor passes new in this release may move collectives: report what you see",
                torch.__version__, ", ".join(TESTED_TORCH))


# ---------------------------------------------------------------- seeded ops in checkpoints (per compile)


def save_seeded_ops_in_checkpoints(graph: fx.Graph) -> int:
    """In a joint forward+backward graph that takes an opaque input (a DTensor's
    DeviceMesh), mark the random-seeded ops (SDPA, dropout, ...) that activation
    checkpointing would recompute as saved instead, with their getitems. Returns
    how many ops it marked. Same values (the backward reads what the forward
    computed); costs the memory of their outputs.

    Works around: torch 2.13's partitioners replay the RNG of a recomputed
    seeded op by adding its RNG state to the forward's saved outputs after the
    saved opaque objects, so AOTAutograd's runtime takes the DeviceMesh for a
    saved tensor ("expected all tensors_saved_with_vc_check to be Tensors, got
    ... DeviceMesh"). HF gradient checkpointing with SDPA on a sharded model
    hits it. The check: the graph has an opaque input (only torch >= 2.13
    passes any; ``is_opaque_input``). 2.14.1 no longer saves a dropout-0 SDPA
    as a seeded op, but still fails with dropout (tests/test_training.py says
    when torch fixes it)."""
    from torch._functorch.partitioners import must_recompute
    from torch.utils.checkpoint import CheckpointPolicy

    if not any(is_opaque_input(n) for n in graph.find_nodes(op="placeholder")):
        return 0
    marked = 0
    for node in graph.nodes:
        if must_recompute(node) and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            for saved in (node, *(u for u in node.users if u.target is operator.getitem)):
                saved.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


# ---------------------------------------------------------------- gloo all-gathers (process-wide, on compile)

_gloo_route: list = []  # the torch.library.Library holding the kernel, once installed


def route_gloo_all_gathers() -> bool:
    """Route CPU ``_c10d_functional.all_gather_into_tensor`` through
    ``all_gather_into_tensor_out`` (the process group's ``_allgather_base``)
    instead of ``allgather_into_tensor_coalesced``. Same values, same wait
    registry; process-wide and idempotent. Returns True if this call installed it.

    Works around: gloo's coalesced all-gather (seen on torch 2.13) corrupts the
    heap when several are in flight: 2 ranks keeping 24 in flight die with
    "malloc(): unaligned tcache chunk detected" within 300 rounds, while the out=
    path ran 75 in flight for 300 rounds clean. overlapc keeps several in flight
    by design, so the backend installs this when it compiles for a gloo group,
    and ``overlapc.fsdp.shard`` when its mesh is on gloo (its gathers keep a
    module's parameters in flight together under any backend, eager included).
    On 2.14.1, 2 ranks keeping 24 in flight died with SIGSEGV within 300 rounds
    (and a rank of tests/test_fsdp_modules.py once, in a compiled backward).
    The check: every supported release (2.11 up) routes the functional op
    through the coalesced path and no release is known to fix it, so it is
    installed on all of them.
    """
    if _gloo_route:
        return False
    ops = torch.ops._c10d_functional

    def all_gather_into_tensor(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        inp = inp.contiguous()
        out = inp.new_empty((inp.shape[0] * group_size, *inp.shape[1:]))
        return ops.all_gather_into_tensor_out(inp, group_size, group_name, out=out)

    lib = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl("all_gather_into_tensor", all_gather_into_tensor, "CPU")
    _gloo_route.append(lib)
    return True


# ---------------------------------------------------------------- torch's checkpoint warning (on fsdp.shard)

_CHECKPOINT_WARNING = "Detected that context_fn is passed to torch.utils.checkpoint"
_CHECKPOINT_LOGGER = "torch._higher_order_ops.wrap"


class _QuietOwnRegions(logging.Filter):
    """Drop torch's "context_fn is passed to torch.utils.checkpoint under torch.compile"
    warning when the region's context_fn is ``context_fn``; the same warning for any
    other checkpoint passes."""

    def __init__(self, context_fn):
        super().__init__()
        self.context_fn = context_fn

    def filter(self, record: logging.LogRecord) -> bool:
        if _CHECKPOINT_WARNING not in str(record.msg):
            return True
        frame = sys._getframe(1)
        while frame is not None:  # the warning's caller: tag_activation_checkpoint_impl
            if frame.f_code.co_name == "tag_activation_checkpoint_impl":
                meta = getattr(frame.f_locals.get("gmod"), "meta", {})
                return meta.get("_checkpoint_context_fn") is not self.context_fn
            frame = frame.f_back
        return True


def quiet_checkpoint_context_warning(context_fn) -> bool:
    """Install, once per ``context_fn``, a filter on torch's
    ``torch._higher_order_ops.wrap`` logger that drops its warning for
    checkpoint regions whose ``context_fn`` is ``context_fn`` (overlapc.fsdp's
    regions: their forward is functionalized, so the in-place ops the warning
    is about are safe). Returns True if this call installed it.

    Works around: torch 2.11-2.14's ``tag_activation_checkpoint_impl`` warns
    on every selective-checkpoint region under torch.compile, one line per
    compiled region. The check: the installed torch has that function (a
    torch without it emits no such warning; nothing is installed)."""
    from torch._higher_order_ops import wrap
    if not hasattr(wrap, "tag_activation_checkpoint_impl"):
        return False
    logger = logging.getLogger(_CHECKPOINT_LOGGER)
    if any(isinstance(f, _QuietOwnRegions) and f.context_fn is context_fn for f in logger.filters):
        return False
    logger.addFilter(_QuietOwnRegions(context_fn))
    return True


# ---------------------------------------------------------------- selective checkpoint policies that see results


def _policies_see_outputs() -> bool:
    import inspect
    from torch.utils.checkpoint import SelectiveCheckpointContext
    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def output_aware_checkpoint_contexts(policy):
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)`` for a
    policy that also learns each op's result: after ``policy(ctx, op, *args, **kwargs)``
    decides an op of the region's forward, ``policy.record_outputs(out)`` is called
    with that op's result, before the next op's decision.

    Works around: torch 2.11-2.12 call the policy before the op runs, and their
    ``SelectiveCheckpointContext`` has no ``op_output`` (2.13 added it). The check:
    the context's constructor takes ``op_output``. Without it, a subclass of
    torch's caching mode (the one that calls the policy in the forward) hands the
    result over once the op has run; ops torch's mode lets through without asking
    the policy are not recorded."""
    from torch.utils import checkpoint as ckpt
    if _policies_see_outputs():
        def policy_fn(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            policy.record_outputs(ctx.op_output)
            return decision
        return ckpt.create_selective_checkpoint_contexts(policy_fn)
    caching, cached = ckpt.create_selective_checkpoint_contexts(policy)

    class _RecordingCachingMode(type(caching)):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func not in ckpt.SAC_IGNORED_OPS:
                policy.record_outputs(out)
            return out

    return _RecordingCachingMode(caching.policy_fn, caching.storage), cached

"""overlapc as the scheduling pass of torchtitan's graph_trainer (tested: torchtitan 0.3.0).

graph_trainer (``torchtitan/experiments/graph_trainer``) traces the whole train
step (forward, loss and backward) into one FX graph with ``make_fx`` and runs a
list of passes over it, each ``pass_fn(gm, example_inputs) -> gm``
(``passes.compile_time_passes``). Its
``joint_transformer_block_bucketing_reordering_pass`` buckets the FSDP
all-gathers and reduce-scatters per transformer block and reorders them: the
job overlapc does. ``replace_bucketing`` puts ``overlapc_pass`` in its place;
``register`` adds graph_trainer's default pipeline with that change under the
name "overlapc"::

    from overlapc.integrations import torchtitan as overlapc_torchtitan
    overlapc_torchtitan.register()          # before the trainer is built
    # then run graph_trainer with --compile.pass_pipeline overlapc

    # or, on a pass list built by hand:
    passes = overlapc_torchtitan.replace_bucketing(
        compile_time_passes(traced, config), options={"max_in_flight": 2})

What changes in graph_trainer's list, and what to leave off:

* ``joint_transformer_block_bucketing_reordering_pass``: replaced by
  ``overlapc_pass`` (overlapc buckets with ``bucket="auto"`` by default; the
  module of each node comes from ``meta["custom"]["module_fqn"]``, which
  graph_trainer records; ``options={"bucket": plan}`` buckets by graph_trainer's
  own ``module_bucket_plans``, e.g. ``common_utils.get_default_transformer_block_buckets``'s). Its defaults differ from overlapc's in two options
  (``DEFAULTS``): ``max_in_flight_bytes="serial-peak"`` (the step's peak
  memory stays within its serial order's) and ``regather="auto"`` (the
  backward re-gather of a block whose gathered weights fit under the peak
  until its backward is dropped); ``options`` override them.
  Run overlapc instead of that pass, not after it: it emits its buckets as
  ``all_gather_into_tensor_out`` / ``reduce_scatter_tensor_out`` into
  preallocated buffers, which overlapc reports but keeps in place (they write
  a buffer other nodes may read: barriers).
* ``schedule_fsdp_comms_to_dense_regions_pass``
  (``--compile.enable_fsdp_dense_region_overlap``): removed; it would move
  overlapc's starts again. Leave the flag off.
* ``async_tensor_parallel_pass`` (``--compile.enable_async_tensor_parallel``):
  leave off; its fused all-gather-matmul ops are custom ops, which overlapc
  keeps in place as barriers.
* Inductor (``full_inductor_compilation_pass``, ``regional_inductor_pass``):
  kept, run under ``overlapc.torch_compat.inductor_keeps_order()`` so Inductor
  keeps the order of collectives and waits it is handed (its peak-memory
  reordering would otherwise put each all-gather back next to its wait; the
  full-graph pass turns that reordering back on inside itself, and it then
  keeps the given order).
* Everything before the bucketing pass (dead-code removal, canonicalisation,
  the dedup of unshard chains, the memory policy, selective remat, CPU
  offload, the EP passes) stays: overlapc schedules the graph they leave.

The graph_trainer names used here are looked up by name in the pass list, so
this module imports nothing from torchtitan until ``register`` is called.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch.fx as fx

import overlapc
from overlapc.torch_compat import inductor_keeps_order

__all__ = ["overlapc_pass", "pass_name", "replace_bucketing", "register", "REPLACED", "REMOVED", "KEEP_ORDER",
           "DEFAULTS"]

REPLACED = "joint_transformer_block_bucketing_reordering_pass"
REMOVED = ("schedule_fsdp_comms_to_dense_regions_pass",)
KEEP_ORDER = ("full_inductor_compilation_pass", "regional_inductor_pass")
# overlapc's options in graph_trainer's pass list, unless given: a joint train-step
# graph holds the whole step's memory, so the bytes in flight stay under the serial
# order's peak (graph_trainer's own bucketing does not raise it either), and each
# block's backward re-gather goes where keeping the forward's weights fits that peak.
DEFAULTS = {"on_error": "raise", "max_in_flight_bytes": "serial-peak", "regather": "auto"}


def overlapc_pass(gm: fx.GraphModule, example_inputs=None, *,
                  options: Mapping[str, object] | None = None) -> fx.GraphModule:
    """A graph_trainer pass: ``overlapc.schedule`` on the joint graph with
    ``OverlapConfig(**{**DEFAULTS, **options})`` (``DEFAULTS``: errors raise, as a
    pass list has no fallback compile; the peak stays within the serial order's;
    a block's forward gathers are kept for its backward where the peak allows).
    ``example_inputs`` is accepted for graph_trainer's signature and not read.
    Returns ``gm``, scheduled in place."""
    config = overlapc.OverlapConfig(**{**DEFAULTS, **dict(options or {})})
    return overlapc.schedule(gm, config)


def _keeping_order(pass_fn: Callable) -> Callable:
    """``pass_fn`` run with Inductor keeping the order it is given (same name):
    ``torch_compat.inductor_keeps_order``, which holds even though
    ``full_inductor_compilation_pass`` turns peak-memory reordering back on inside."""
    def run(gm, example_inputs, *args, **kwargs):
        with inductor_keeps_order():
            return pass_fn(gm, example_inputs, *args, **kwargs)
    run.__name__ = run.__qualname__ = pass_name(pass_fn)
    return run


def pass_name(pass_fn: Callable) -> str:
    """The name graph_trainer gives a pass (``--compile.disable_passes`` matches it)."""
    while isinstance(pass_fn, functools.partial):
        pass_fn = pass_fn.func
    return getattr(pass_fn, "__name__", type(pass_fn).__name__)


def replace_bucketing(passes: Sequence[Callable], options: Mapping[str, object] | None = None) -> list[Callable]:
    """graph_trainer's pass list with its bucketing / reordering pass replaced by
    ``overlapc_pass`` (named "overlapc_pass"), the passes in ``REMOVED`` left out
    and the Inductor passes in ``KEEP_ORDER`` run under overlapc's Inductor
    patches. Raises ValueError when the list holds no ``REPLACED`` pass (nothing
    would schedule the collectives there)."""
    names = [pass_name(p) for p in passes]
    if REPLACED not in names:
        raise ValueError(f"overlapc: no {REPLACED} in graph_trainer's pass list {names}; build the list "
                         "with passes.compile_time_passes (or insert overlapc_pass yourself)")
    out: list[Callable] = []
    for pass_fn, name in zip(passes, names):
        if name == REPLACED:
            out.append(functools.partial(overlapc_pass, options=dict(options or {})))
        elif name in KEEP_ORDER:
            out.append(_keeping_order(pass_fn))
        elif name not in REMOVED:
            out.append(pass_fn)
    return out


def register(name: str = "overlapc", options: Mapping[str, object] | None = None) -> None:
    """Register graph_trainer's default pass pipeline with overlapc in place of its
    bucketing pass as pass pipeline ``name`` (``--compile.pass_pipeline name``)."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes
    from torchtitan.experiments.graph_trainer.registry import register_pass_pipeline

    def pipeline(traced_result, config, *, parallel_dims=None):
        return replace_bucketing(construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims),
                                 options)
    register_pass_pipeline(name)(pipeline)

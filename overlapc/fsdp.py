"""In-graph parameter sharding on DTensor (SimpleFSDP-style).

``shard(model, mesh)`` stores every parameter as a ``Shard(0)`` DTensor and
turns each read of ``module.<param>`` into an all-gather
(``redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial("avg")])``).
Traced, that is ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``
in the forward graph and ``reduce_scatter_tensor`` + ``wait_tensor`` in the
backward graph, one per parameter read: exactly what the overlapc passes
schedule. All communication is DTensor's own.

Design after SimpleFSDP (Zhang et al., arXiv:2411.00284).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["shard"]


def shard(
    model: nn.Module,
    mesh: DeviceMesh | ProcessGroup,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters over ``mesh`` in place and return ``model``.

    Contract:
    - ``mesh``: a 1-D DeviceMesh, or a ProcessGroup (wrapped in a 1-D mesh).
      Every rank calls ``shard`` on the same model; parameter values are taken
      from rank 0 (``distribute_tensor``'s default).
    - Each parameter becomes an ``nn.Parameter`` holding a ``Shard(0)``
      DTensor (dim 0 need not divide by the world size: DTensor pads the
      gather). ``model.parameters()``, a plain torch optimizer on them, and
      ``state_dict()`` (DTensor values, same keys as before) all see the
      shards. ``load_state_dict()`` takes DTensor values, or full plain
      tensors that every rank passes alike (each rank keeps its own chunk, no
      communication). 0-dim parameters raise ValueError; tied parameters
      stay tied.
    - Reading ``module.<param>`` returns the full (all-gathered) plain
      tensor; its gradient is reduce-scattered and averaged over the ranks
      (as FSDP2 does) and lands on the shard in the parameter's dtype.
    - ``param_dtype``: the shard is cast before the all-gather, so the gather
      moves and returns ``param_dtype``; floating-point tensor inputs of
      ``model`` are cast to it too (as FSDP2 does). ``reduce_dtype`` (default:
      the gathered dtype) is the reduce-scatter's dtype; the result is cast
      back to the parameter's dtype.
    - ``reshard_after_forward=True``: the forward of every module that owns
      parameters (and has no such ancestor) runs in a selective activation
      checkpoint whose policy recomputes all-gathers, waits, casts and views
      and saves everything else. No gathered parameter is kept for backward:
      the backward re-gathers what it needs, per module in eager (the region's
      Python re-runs; the outputs of all its other ops are cached from the
      forward until then) and as all-gathers in the backward graph under
      ``torch.compile`` (where only what the backward uses is saved). Such a forward must not
      mutate saved tensors in place (a selective-checkpoint rule). A parameter
      read outside its owner's forward (a parent reading ``child.weight``) is
      gathered there without a region, so it is kept.
      ``False``: no checkpoint; gathered parameters that backward needs are
      saved, as with FSDP2's ``reshard_after_forward=False``.
    - Works in eager and under ``torch.compile`` (aot_eager, inductor).
    """
    mesh = _as_mesh(mesh)
    gather = _Gather(mesh, param_dtype, reduce_dtype)
    sharded: dict[int, nn.Parameter] = {}  # id(original) -> sharded: keeps ties
    in_region: set[str] = set()  # modules whose forward runs in a recompute region
    for module_name, module in list(model.named_modules()):
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        if hasattr(module, "_overlapc_gather"):
            raise ValueError(f"module {module_name or type(module).__name__!r} is already sharded")
        for name in names:
            param = module._parameters[name]
            if id(param) not in sharded:
                sharded[id(param)] = _shard_param(param, mesh, f"{module_name}.{name}".lstrip("."))
            module._parameters[name] = sharded[id(param)]
        covered = any(module_name.startswith(f"{outer}.") or outer == "" for outer in in_region)
        recompute = reshard_after_forward and not covered
        if recompute:
            in_region.add(module_name)
        _gather_on_read(module, names, gather, recompute)
        module.register_load_state_dict_pre_hook(functools.partial(_shard_loaded, names=names, mesh=mesh))
    if param_dtype is not None:
        model.register_forward_pre_hook(functools.partial(_cast_inputs, dtype=param_dtype), with_kwargs=True)
    return model


def _cast_inputs(module, args, kwargs, dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tree_map(cast, args), tree_map(cast, kwargs)


def _shard_loaded(module, state_dict, prefix, *args, names, mesh):
    """load_state_dict pre-hook: a full plain tensor becomes this rank's Shard(0) chunk."""
    for name in names:
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            state_dict[prefix + name] = distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None)


def _as_mesh(mesh: DeviceMesh | ProcessGroup) -> DeviceMesh:
    if isinstance(mesh, ProcessGroup):
        device_type = "cuda" if "nccl" in str(dist.get_backend(mesh)) else "cpu"
        mesh = DeviceMesh.from_group(mesh, device_type)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"shard() needs a 1-D DeviceMesh or a ProcessGroup, got {mesh!r}")
    return mesh


def _shard_param(param: nn.Parameter, mesh: DeviceMesh, qualname: str) -> nn.Parameter:
    if isinstance(param, DTensor):
        raise ValueError(f"parameter {qualname!r} is already a DTensor")
    if param.dim() == 0:
        raise ValueError(f"parameter {qualname!r} is 0-dim; Shard(0) needs at least one dimension")
    if param.is_meta:  # shapes only (projections, captures): nothing to copy or send
        sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
    else:
        sharded = distribute_tensor(param.detach().to(mesh.device_type), mesh, [Shard(0)])
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def _gather_on_read(module: nn.Module, names: list[str], gather: "_Gather", recompute: bool) -> None:
    """Swap ``module``'s class for a subclass whose properties gather ``names`` on read.

    State dicts, ``named_parameters`` and optimizers read ``module._parameters``
    directly, so they keep seeing the shards under the original names. With
    ``recompute`` the subclass's ``forward`` runs the original one in a
    selective activation checkpoint (see ``_recompute_policy``).
    """
    cls = type(module)
    members = {name: _gathered_property(name) for name in names}
    members["_overlapc_gather"] = gather
    if recompute:
        members["forward"] = _forward_in_region(cls.forward)
    module.__class__ = type(f"Sharded{cls.__name__}", (cls,), members)


def _gathered_property(name: str) -> property:
    def read(module: nn.Module) -> torch.Tensor:
        return module._overlapc_gather(module._parameters[name])

    return property(read)


def _forward_in_region(forward):
    def forward_in_region(module: nn.Module, *args, **kwargs):
        return checkpoint(
            forward,
            module,
            *args,
            use_reentrant=False,
            context_fn=_recompute_contexts,
            preserve_rng_state=False,  # random ops are saved, never recomputed
            early_stop=False,  # an early stop could leave an all-gather un-waited
            **kwargs,
        )

    return forward_in_region


# The gather: collective, eager autograd wrapper (cached, it would pin the old
# result and leave the re-issued gather un-waited), wait.
_GATHER_OPS = {
    getattr(torch.ops._c10d_functional, name).default
    for name in ("all_gather_into_tensor", "_wrap_tensor_autograd", "wait_tensor")
    if hasattr(torch.ops._c10d_functional, name)
}


def _recompute_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Recompute gathers, dtype casts (param_dtype) and views; save everything else.

    Views and casts are recomputed so that no view or copy of a gathered
    parameter is saved instead of it. MUST_SAVE (not PREFER_SAVE) for the rest
    keeps every recompute chain rooted in saved values or region inputs, which
    the default (aot_eager) partitioner needs; compiled, it still saves only
    what the backward uses. (A wait of some other collective inside a region
    is recomputed too: a second wait on a finished result, harmless.)
    """
    if op in _GATHER_OPS or op is torch.ops.aten._to_copy.default or getattr(op, "is_view", False):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _recompute_contexts():
    return create_selective_checkpoint_contexts(_recompute_policy)


class _Gather:
    """Shard(0) DTensor -> full local tensor; differentiable, gradient reduce-scattered (avg)."""

    def __init__(self, mesh: DeviceMesh, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        self.mesh = mesh
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype

    def __call__(self, shard: DTensor) -> torch.Tensor:
        full = shard.redistribute(
            self.mesh,
            [Replicate()],
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype or self.param_dtype or shard.dtype,
        )
        return full.to_local(grad_placements=[Partial("avg")])

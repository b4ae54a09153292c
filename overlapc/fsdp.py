"""In-graph parameter sharding on DTensor (SimpleFSDP-style), composable with tensor parallel.

``shard(model, mesh)`` stores every parameter as a DTensor sharded on dim 0
over the data-parallel (dp) ranks and turns each read of ``module.<param>``
into an all-gather over dp
(``redistribute(dp_mesh, [Replicate()]).to_local(grad_placements=[Partial("avg")])``).
Traced, that is ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``
in the forward graph and ``reduce_scatter_tensor`` + ``wait_tensor`` in the
backward graph, one per parameter read: exactly what the overlapc passes
schedule. All communication is DTensor's own.

With tensor parallel (parameters already DTensors on the tp sub-mesh of a
2-D dp x tp mesh, e.g. after ``parallelize_module``), a parameter becomes a
DTensor on the 2-D mesh, sharded on dim 0 over dp and placed as before over
tp; a read gathers over dp only and returns the tp DTensor the parallelized
module code expects.

HSDP: on a mesh with a ``dp_replicate`` dim and a shard dim (``dp_shard``),
as FSDP2 and torchtitan name them, parameters are sharded over the shard dim
and replicated over the replicate dim; a read gathers over the shard dim, and
the gradient is reduce-scattered over the shard dim, then all-reduced over
the replicate dim. Shard size 1 is plain replication (DDP in the graph).

Resharding after forward (``reshard_after_forward=True``): in eager, the
forward of each outermost module that owns parameters runs under saved-tensor
hooks that keep only the recipe (shard, view geometry) of a gathered
parameter that autograd saves, and gather it again when backward unpacks it;
nothing else changes (in-place ops, buffer updates such as BatchNorm's running
stats, and random ops run once, as without sharding). Any saved-tensor hooks
already active (an outer activation checkpoint) still see every other saved
tensor. Under ``torch.compile`` that forward runs in a selective activation
checkpoint whose policy recomputes all-gathers, waits, views, casts (but a
float8 cast of an activation), and the elementwise ops computed from gathered
parameters alone (a float8 weight's scale, clamp and cast), and saves everything
else, a full max of a gathered parameter (a float8 weight's amax, 0-d) included:
the backward graph holds the all-gathers again, reads the forward's amaxes
instead of reducing the weights again, and only what the backward uses is saved. A parameter read outside its owner's
forward is gathered there without these hooks, so it is kept.

Design after SimpleFSDP (Zhang et al., arXiv:2411.00284).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from overlapc.torch_compat import (output_aware_checkpoint_contexts, quiet_checkpoint_context_warning,
                                   route_gloo_all_gathers)

__all__ = ["shard"]


def shard(
    model: nn.Module,
    mesh: DeviceMesh | ProcessGroup,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    *,
    dp_dim: str | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters over the data-parallel ranks in place and return ``model``.

    Contract:
    - ``mesh``: the data-parallel (dp) ranks: a 1-D DeviceMesh, a
      ProcessGroup (wrapped in a 1-D mesh), or a DeviceMesh with named dims
      whose roles the names give: ``"dp_replicate"`` (optional) is the
      replicate dim (HSDP); the shard dim is the one named ``dp_dim`` (default
      ``"dp_shard"``, else ``"dp"``, else the only dim left); one more dim is
      tp. So ``("dp", "tp")`` is FSDP x TP, ``("dp_replicate", "dp_shard")``
      HSDP, ``("dp_replicate", "dp_shard", "tp")`` HSDP x TP, and
      ``("dp_replicate", "dp_shard")`` with dp_shard of size 1 is DDP. Every
      rank calls ``shard`` on the same model; plain parameter values are
      taken from the first rank of each dp group (``distribute_tensor``'s
      default).
    - HSDP: each parameter is sharded over the shard dim and replicated over
      the replicate dim (placements ``Replicate()`` there). Reading it
      all-gathers over the shard dim only; its gradient is reduce-scattered
      over the shard dim, then the shard is all-reduced over the replicate
      dim in ``reduce_dtype``, both averaged: the mean over all dp ranks, as
      FSDP2's HSDP. With shard size 1 nothing is gathered and each gradient
      is all-reduced (averaged) over the replicate dim.
    - Tensor parallel: parameters that are already DTensors must live on the
      tp dim of that mesh (a 1-D tp sub-mesh, e.g. after
      ``parallelize_module(model, mesh["tp"], plan)``), with placement
      ``Shard(d)`` or ``Replicate()``. Passing the dp sub-mesh
      (``mesh["dp"]``, ``mesh["dp_replicate", "dp_shard"]``) works too: it
      is widened to the dims of the root mesh it and tp span. Such a
      parameter becomes a DTensor on that mesh with
      placements (dim 0 sharded over dp, its tp placement over tp); where tp
      shards dim 0 too, dp splits each tp shard (``_StridedShard``, as FSDP2
      does), so ``full_tensor()`` is the unsharded value. Reading it
      all-gathers over dp only and returns a DTensor on the tp mesh with the
      tp placement, so the parallelized module code runs unchanged; the
      gradient is reduce-scattered (averaged) over dp only. Plain parameters
      of such a model are replicated over tp (placements ``Shard(0)`` on dp,
      ``Replicate()`` on tp) and read as plain tensors.
    - Without tensor parallel each parameter becomes an ``nn.Parameter``
      holding a ``Shard(0)`` DTensor on the dp mesh (dim 0 need not divide by
      the dp size: DTensor pads the gather).
    - ``model.parameters()``, a plain torch optimizer on them, and
      ``state_dict()`` (DTensor values, same keys as before) all see the
      shards. ``load_state_dict()`` takes DTensor values, or full plain
      tensors that every rank passes alike (each rank keeps its own chunk, no
      communication). 0-dim parameters raise ValueError; tied parameters
      stay tied.
    - Reading ``module.<param>`` returns the gathered value: a plain tensor
      (a tp DTensor under tensor parallel); its gradient is reduce-scattered
      and averaged over dp (as FSDP2 does) and lands on the shard in the
      parameter's dtype.
    - ``param_dtype``: the shard is cast before the all-gather, so the gather
      moves and returns ``param_dtype``; floating-point tensor inputs of
      ``model`` are cast to it too (as FSDP2 does). ``reduce_dtype`` (default:
      the gathered dtype) is the reduce-scatter's dtype; the result is cast
      back to the parameter's dtype.
    - ``reshard_after_forward=True``: no gathered parameter is kept for
      backward by the forward of a module that owns parameters (and has no
      such ancestor); the backward gathers again what it needs (with a shard
      dim of size 1 nothing is gathered, so nothing is resharded). A
      parameter read outside its owner's forward (a parent reading
      ``child.weight``) is kept (how: the module docstring). ``False``:
      gathered parameters that backward needs are saved, as FSDP2's.
    - Works in eager and under ``torch.compile`` (aot_eager, inductor, overlapc).
      On a gloo mesh it installs ``overlapc.torch_compat.route_gloo_all_gathers``
      (process-wide: gloo's coalesced all-gather crashes with several in flight).
    """
    _refuse_sharded(model)
    layout = _layout(model, _as_mesh(mesh), dp_dim)
    if any("gloo" in str(dist.get_backend(layout.dp.get_group(d))) for d in range(layout.dp.ndim)):
        route_gloo_all_gathers()   # a module's gathers in flight together crash gloo (torch_compat)
    _shard_modules(model, layout, _Gather(layout, param_dtype, reduce_dtype), reshard_after_forward)
    quiet_checkpoint_context_warning(_recompute_contexts)
    if param_dtype is not None:
        model.register_forward_pre_hook(functools.partial(_cast_inputs, dtype=param_dtype), with_kwargs=True)
    return model


def _refuse_sharded(model: nn.Module) -> None:
    for module_name, module in model.named_modules():
        if hasattr(module, "_overlapc_gather"):
            raise ValueError(f"module {module_name or type(module).__name__!r} is already sharded")


def _shard_modules(model: nn.Module, layout: "_Layout", gather: "_Gather", reshard_after_forward: bool) -> None:
    """Replace every module's parameters by their shards (a parameter shared by
    several modules, once: ties stay tied) and make each read gather; the
    outermost module that owns parameters runs its forward resharded when
    ``reshard_after_forward`` (its descendants are covered by it)."""
    sharded: dict[int, tuple[nn.Parameter, bool]] = {}  # id(original) -> (sharded, read as tp DTensor): keeps ties
    in_region: set[str] = set()  # modules whose forward runs resharded (hooks / recompute region)
    for module_name, module in list(model.named_modules()):
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        as_dtensor = {}
        for name in names:
            param = module._parameters[name]
            if id(param) not in sharded:
                qualname = f"{module_name}.{name}".lstrip(".")
                sharded[id(param)] = (_shard_param(param, layout, qualname), isinstance(param, DTensor))
            module._parameters[name], as_dtensor[name] = sharded[id(param)]
        covered = any(module_name.startswith(f"{outer}.") or outer == "" for outer in in_region)
        resharded = reshard_after_forward and not covered and layout.shard.size() > 1  # size 1: nothing gathered
        if resharded:
            in_region.add(module_name)
        _gather_on_read(module, as_dtensor, gather, resharded)
        module.register_load_state_dict_pre_hook(functools.partial(_shard_loaded, names=names, layout=layout))


# ---------------------------------------------------------------- meshes and placements


REPLICATE_DIM = "dp_replicate"  # the replicate dim of an HSDP mesh, named as FSDP2's tests and torchtitan do
SHARD_DIMS = ("dp_shard", "dp")  # the shard dim when dp_dim is not given, first found


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where parameters live.

    ``dp``: the data-parallel mesh, 1-D (shard) or 2-D (replicate and shard, in
    the mesh's order); ``shard`` and ``replicate``: its dims as 1-D meshes
    (``replicate`` None without HSDP). ``full`` (``dp``'s dims and tp) and ``tp``
    only when sharding composes with tensor parallel; ``tp_index``: tp's position
    in ``full``.
    """

    dp: DeviceMesh
    shard: DeviceMesh
    replicate: DeviceMesh | None = None
    full: DeviceMesh | None = None
    tp: DeviceMesh | None = None
    tp_index: int = 0

    def dp_placements(self, shard_placement=Shard(0)) -> tuple:
        """Placements on ``dp``: ``shard_placement`` on the shard dim, ``Replicate()`` on the replicate dim."""
        if self.replicate is None:
            return (shard_placement,)
        names = self.dp.mesh_dim_names
        return tuple(shard_placement if n == self.shard.mesh_dim_names[0] else Replicate() for n in names)

    def placements(self, tp_placement) -> tuple:
        """Placements on ``full``: dim 0 over the shard dim (after tp's own dim-0 split, if any),
        replicated over the replicate dim, ``tp_placement`` over tp."""
        if isinstance(tp_placement, Shard) and tp_placement.dim == 0:
            shard_placement = _StridedShard(0, split_factor=self.tp.size())
        else:
            shard_placement = Shard(0)
        placements = list(self.dp_placements(shard_placement))
        placements.insert(self.tp_index, tp_placement)
        return tuple(placements)


def _as_mesh(mesh: DeviceMesh | ProcessGroup) -> DeviceMesh:
    if isinstance(mesh, ProcessGroup):
        device_type = "cuda" if "nccl" in str(dist.get_backend(mesh)) else "cpu"
        mesh = DeviceMesh.from_group(mesh, device_type)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2, 3):
        raise ValueError(
            f"shard() needs a 1-D DeviceMesh (dp), a ProcessGroup, or a named 2-D / 3-D DeviceMesh "
            f"(dp x tp, dp_replicate x dp_shard, dp_replicate x dp_shard x tp), got {mesh!r}"
        )
    return mesh


def _layout(model: nn.Module, mesh: DeviceMesh, dp_dim: str | None) -> _Layout:
    """Name the roles of ``mesh``'s dims (replicate, shard, tp); with tensor-parallel
    parameters on a sibling tp sub-mesh, widen ``mesh`` to the root's dims it and tp span."""
    tp_params = {name: p for name, p in model.named_parameters() if isinstance(p, DTensor)}
    names = mesh.mesh_dim_names
    if mesh.ndim == 1 and not tp_params and (names is None or names[0] != REPLICATE_DIM):
        if dp_dim is not None and names is not None and dp_dim != names[0]:
            raise ValueError(f"shard(): dp_dim={dp_dim!r} but the 1-D mesh's dim is named {names[0]!r}")
        return _Layout(dp=mesh, shard=mesh)
    if tp_params and (names is None or not set(_tp_names(tp_params)) <= set(names)):
        qualname, param = next(iter(tp_params.items()))
        root = _root_mesh(mesh)
        tp_names = param.device_mesh.mesh_dim_names
        if names is None or tp_names is None or root is not _root_mesh(param.device_mesh):
            raise ValueError(
                f"parameter {qualname!r} is a DTensor on {param.device_mesh!r}, which is not the tp sub-mesh "
                f"of the same named mesh as the dp mesh {mesh!r}; build both with "
                f"init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and pass mesh['dp'] or the 2-D mesh"
            )
        wanted = set(names) | set(tp_names)
        ordered = tuple(n for n in root.mesh_dim_names if n in wanted)
        mesh = root if ordered == root.mesh_dim_names else root[ordered]
        names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "shard(): a mesh with more than one dim needs named dims, e.g. init_device_mesh(..., "
            "mesh_dim_names=('dp', 'tp')), or ('dp_replicate', 'dp_shard') for HSDP"
        )
    if names == (REPLICATE_DIM,):
        raise ValueError(
            f"shard(): the mesh has only the replicate dim {REPLICATE_DIM!r}; for replication without "
            f"sharding (DDP) pass a 2-D mesh ({REPLICATE_DIM!r}, 'dp_shard') with dp_shard of size 1"
        )
    replicate = REPLICATE_DIM if REPLICATE_DIM in names else None
    rest = [n for n in names if n != replicate]
    if dp_dim is None:
        dp_dim = next((n for n in SHARD_DIMS if n in rest), rest[0] if len(rest) == 1 else None)
    if dp_dim not in rest:
        raise ValueError(
            f"shard(): the mesh has dims {names}; pass dp_dim= the name of the dim to shard over "
            f"(default {' or '.join(map(repr, SHARD_DIMS))}; {REPLICATE_DIM!r} is the replicate dim of HSDP)"
        )
    tp_names = [n for n in rest if n != dp_dim]
    if len(tp_names) > 1:
        raise ValueError(
            f"shard(): the mesh has dims {names}; it understands {REPLICATE_DIM!r}, the shard dim "
            f"(dp_dim={dp_dim!r}) and at most one tp dim: flatten or slice the others away"
        )
    dp_names = tuple(n for n in names if n in (replicate, dp_dim))
    dp = mesh if len(dp_names) == len(names) else mesh[dp_names]
    layout = _Layout(dp=dp, shard=mesh[dp_dim], replicate=mesh[replicate] if replicate else None)
    if not tp_names:
        return layout
    layout = dataclasses.replace(layout, full=mesh, tp=mesh[tp_names[0]], tp_index=names.index(tp_names[0]))
    for qualname, param in tp_params.items():
        _check_tp_param(param, layout, qualname)
    return layout


def _tp_names(tp_params: dict[str, DTensor]) -> tuple[str, ...]:
    """The dim names of the first tensor-parallel parameter's mesh (empty when unnamed)."""
    return next(iter(tp_params.values())).device_mesh.mesh_dim_names or ()


def _root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it was not)."""
    root = mesh._get_root_mesh()  # private in torch 2.11-2.13: keep every use here
    return mesh if root is None else root


def _check_tp_param(param: DTensor, layout: _Layout, qualname: str) -> None:
    if param.device_mesh != layout.tp:
        raise ValueError(
            f"parameter {qualname!r} is a DTensor on {param.device_mesh!r}; shard() composes with tensor "
            f"parallel only on the tp dim of its mesh ({layout.tp!r}): parallelize with mesh['tp'] of the same mesh"
        )
    placement = param.placements[0]
    if not (isinstance(placement, Replicate) or type(placement) is Shard):
        raise ValueError(
            f"parameter {qualname!r} has tp placement {placement}; shard() supports Shard(d) and Replicate() "
            f"parameters (redistribute it to one of those first)"
        )


def _cast_inputs(module, args, kwargs, dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tree_map(cast, args), tree_map(cast, kwargs)


def _shard_param(param: nn.Parameter, layout: _Layout, qualname: str) -> nn.Parameter:
    if param.dim() == 0:
        raise ValueError(f"parameter {qualname!r} is 0-dim; Shard(0) needs at least one dimension")
    if isinstance(param, DTensor) and layout.full is None:  # cannot happen: _layout saw every DTensor
        raise ValueError(f"parameter {qualname!r} is a DTensor but shard() found no tp mesh for it")
    return nn.Parameter(_distribute(param.detach(), layout, src_data_rank=0), requires_grad=param.requires_grad)


def _distribute(value: torch.Tensor, layout: _Layout, src_data_rank: int | None) -> DTensor:
    """``value`` (a full plain tensor, or a tp DTensor) as this rank's shard; ``src_data_rank=None``: no communication."""
    if value.is_meta:  # shapes only (projections, captures): nothing to copy or send
        src_data_rank = None
    if layout.full is None:
        return distribute_tensor(_on_device(value, layout.dp), layout.dp, layout.dp_placements(),
                                 src_data_rank=src_data_rank)
    if not isinstance(value, DTensor):  # plain: replicated over tp, sharded over dp
        value = distribute_tensor(_on_device(value, layout.tp), layout.tp, [Replicate()], src_data_rank=None)
    tp_local = value.to_local()
    chunk = distribute_tensor(_on_device(tp_local, layout.dp), layout.dp, layout.dp_placements(),
                              src_data_rank=src_data_rank)
    return DTensor.from_local(
        chunk.to_local(), layout.full, layout.placements(value.placements[0]),
        run_check=False, shape=value.shape, stride=value.stride(),
    )


def _on_device(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return value if value.is_meta else value.to(mesh.device_type)


def _shard_loaded(module, state_dict, prefix, *args, names, layout):
    """load_state_dict pre-hook: a full plain tensor becomes this rank's shard (no communication)."""
    for name in names:
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if layout.full is not None and isinstance(module._parameters[name], DTensor):
                tp_placement = module._parameters[name].placements[layout.tp_index]
                value = distribute_tensor(value, layout.tp, [tp_placement], src_data_rank=None)
            state_dict[prefix + name] = _distribute(value, layout, src_data_rank=None)


# ---------------------------------------------------------------- reads


def _gather_on_read(module: nn.Module, as_dtensor: dict[str, bool], gather: "_Gather", resharded: bool) -> None:
    """Swap ``module``'s class for a subclass whose properties gather its parameters on read.

    ``as_dtensor[name]``: the read returns a tp DTensor (the parameter was
    one) instead of a plain tensor. State dicts, ``named_parameters`` and
    optimizers read ``module._parameters`` directly, so they keep seeing the
    shards under the original names. With ``resharded`` the subclass's
    ``forward`` drops gathered parameters after the forward (see ``shard``).
    """
    cls = type(module)
    members = {name: _gathered_property(name, tp) for name, tp in as_dtensor.items()}
    members["_overlapc_gather"] = gather
    if resharded:
        members["forward"] = _forward_resharded(cls.forward)
    module.__class__ = type(f"Sharded{cls.__name__}", (cls,), members)


def _gathered_property(name: str, as_dtensor: bool) -> property:
    def read(module: nn.Module) -> torch.Tensor:
        return module._overlapc_gather(module._parameters[name], as_dtensor)

    return property(read)


class _Gather:
    """A parameter's shard -> its gathered value; differentiable: the gradient is reduce-scattered
    (avg) over the shard dim, then (HSDP) all-reduced (avg) over the replicate dim."""

    def __init__(self, layout: _Layout, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        self.layout = layout
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype

    def __call__(self, param: DTensor, as_dtensor: bool = False) -> torch.Tensor:
        full = self.local(param)
        if not torch.compiler.is_compiling():
            _mark_gathered(full, self, param)
        if not as_dtensor:
            return full
        tp_placement = param.placements[self.layout.tp_index]
        return DTensor.from_local(full, self.layout.tp, [tp_placement], run_check=False,
                                  shape=param.shape, stride=param.stride())

    def local(self, param: DTensor) -> torch.Tensor:
        """The all-gather over the shard dim: this rank's full tp-local tensor (the full tensor without tp).

        Backward: the gradient is reduce-scattered over the shard dim, then (HSDP)
        all-reduced over the replicate dim in ``reduce_dtype``, each averaged, so the
        shard's gradient is the mean over all data-parallel ranks, as FSDP2's HSDP.
        A dim of size 1 moves nothing (shard size 1: no all-gather, the in-graph DDP).
        """
        dtypes = dict(forward_dtype=self.param_dtype,
                      backward_dtype=self.reduce_dtype or self.param_dtype or param.dtype)
        layout = self.layout
        local = param.to_local()
        if layout.replicate is not None and layout.replicate.size() > 1:
            local = _AllReduceGrad.apply(local, layout.replicate.get_group().group_name, dtypes["backward_dtype"])
        # Gather the shard dim's chunks of this rank's tp-local tensor on the shard mesh alone, so
        # that nothing moves over tp or replicate (the gradient comes back through to_local with
        # the parameter's placements).
        shape = param.shape if layout.tp is None else _tp_local_shape(param.shape, param.placements[layout.tp_index], layout.tp)
        chunks = DTensor.from_local(local, layout.shard, [Shard(0)], run_check=False,
                                    shape=shape, stride=_contiguous_stride(shape))
        return chunks.redistribute(layout.shard, [Replicate()], **dtypes).to_local(grad_placements=[Partial("avg")])


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces (average) the gradient over ``group`` in ``dtype``
    and casts it back: the replicate dim of HSDP, after the shard dim's reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str, dtype: torch.dtype) -> torch.Tensor:
        ctx.group, ctx.dtype = group, dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        c10d = torch.ops._c10d_functional
        reduced = c10d.wait_tensor(c10d.all_reduce(grad.to(ctx.dtype), "avg", ctx.group))
        return reduced.to(grad.dtype), None, None


def _tp_local_shape(shape: torch.Size, placement, tp_mesh: DeviceMesh) -> torch.Size:
    """This rank's local shape of a ``shape`` tensor placed as ``placement`` on the 1-D ``tp_mesh``."""
    if not isinstance(placement, Shard):
        return torch.Size(shape)
    size, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    full = shape[placement.dim]
    step = -(-full // size)  # torch.chunk's sizes: ceil, the last ones shorter or empty
    local = max(0, min(step, full - step * rank))
    return torch.Size((*shape[: placement.dim], local, *shape[placement.dim + 1:]))


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


# ---------------------------------------------------------------- reshard after forward: eager


def _forward_resharded(forward):
    def forward_resharded(module: nn.Module, *args, **kwargs):
        if torch.compiler.is_compiling():
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
        with _ReshardHooks():
            return forward(module, *args, **kwargs)

    return forward_resharded


# Storage of a gathered tensor (eager) -> how to gather it again. Keyed by storage, not tensor:
# a view that DTensor takes below autograd (weight.t() in a tp linear) has no ``_base``, but it
# shares the storage; an entry lives exactly as long as something still uses that storage.
_GATHERED: "weakref.WeakKeyDictionary[torch.UntypedStorage, _Source]" = weakref.WeakKeyDictionary()


def _mark_gathered(full: torch.Tensor, gather: _Gather, param: DTensor) -> None:
    """Remember how to gather ``full``'s storage again (eager only)."""
    _GATHERED[full.untyped_storage()] = _Source(gather, param, full)


class _Source:
    """How to re-gather one gathered tensor for the tensors autograd saved from it.

    The re-gathered copy is kept from the first unpack to the last of those saved
    tensors, by count. Never by whether something still holds the copy: when it
    dies depends on garbage collection, which differs between ranks, and a
    re-gather is a collective that every rank must issue alike (a weak reference
    here once let one rank re-gather while its peer went on to a reduce-scatter).
    """

    def __init__(self, gather: _Gather, param: DTensor, full: torch.Tensor):
        self.gather = gather
        self.param = param
        self.layout = (full.shape, full.stride(), full.storage_offset(), full.dtype, full.untyped_storage().nbytes())
        self.saved = 0        # saved tensors not unpacked yet
        self.copy: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        """The re-gathered tensor, for one unpack; gathers when no copy is kept."""
        full = self.copy
        if full is None:
            with torch.no_grad():
                full = self.gather.local(self.param)
            layout = (full.shape, full.stride(), full.storage_offset(), full.dtype, full.untyped_storage().nbytes())
            if layout != self.layout:
                raise RuntimeError(
                    f"overlapc.fsdp: re-gathering a parameter for backward gave layout {layout}, the forward "
                    f"had {self.layout}; shard with reshard_after_forward=False to keep gathered parameters"
                )
        self.saved -= 1
        self.copy = full if self.saved > 0 else None   # a second backward (retain_graph) gathers again
        return full


class _Regather:
    """What autograd keeps instead of a gathered parameter (or a view of one, plain or a DTensor's local)."""

    def __init__(self, source: _Source, local: torch.Tensor, spec):
        self.source = source
        source.saved += 1
        self.view = (local.shape, local.stride(), local.storage_offset())
        self.spec = spec  # (mesh, placements, shape, stride) of a DTensor, else None

    def unpack(self) -> torch.Tensor:
        size, stride, offset = self.view
        local = self.source.full().as_strided(size, stride, offset)  # same storage layout as the forward's
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _ReshardHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks: a gathered parameter is saved as a ``_Regather``; other tensors go to the
    hooks that were active before (or are saved as they are)."""

    def __init__(self):
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # private: chains an outer checkpoint
        outer_pack, outer_unpack = outer if outer else (None, None)

        def pack(tensor):
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            plain = type(local) in (torch.Tensor, nn.Parameter) and local.layout is torch.strided
            source = _GATHERED.get(local.untyped_storage()) if plain and _GATHERED else None
            if source is not None:
                spec = None
                if isinstance(tensor, DTensor):
                    spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
                return _Regather(source, local, spec)
            return tensor if outer_pack is None else (outer_pack(tensor),)

        def unpack(packed):
            if isinstance(packed, _Regather):
                return packed.unpack()
            return packed if outer_unpack is None else outer_unpack(packed[0])

        super().__init__(pack, unpack)


# ---------------------------------------------------------------- reshard after forward: compiled


# The gather: collective, eager autograd wrapper (cached, it would pin the old
# result and leave the re-issued gather un-waited), wait.
_GATHER_OPS = {
    getattr(torch.ops._c10d_functional, name).default
    for name in ("all_gather_into_tensor", "_wrap_tensor_autograd", "wait_tensor")
    if hasattr(torch.ops._c10d_functional, name)
}


def _recompute_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Recompute gathers, dtype casts (param_dtype) and views; save everything else (compiled only).

    Views and casts are recomputed so that no view or copy of a gathered
    parameter is saved instead of it. MUST_SAVE (not PREFER_SAVE) for the rest
    keeps every recompute chain rooted in saved values or region inputs, which
    the default (aot_eager) partitioner needs; the partitioner still saves only
    what the backward uses. (A wait of some other collective inside a region
    is recomputed too: a second wait on a finished result, harmless.)
    """
    if op in _GATHER_OPS or op is torch.ops.aten._to_copy.default or getattr(op, "is_view", False):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


# Full reductions of a gathered parameter to a scalar (a float8 weight's amax for torchao's dynamic
# per-tensor scaling): saved (0-d), and what is computed from them counts as derived from weights.
_WEIGHT_REDUCTIONS = {torch.ops.aten.max.default, torch.ops.aten.amax.default}


class _WeightPolicy:
    """``_recompute_policy``, refined for what derives from gathered parameters:

    - an op whose tensor inputs all derive from gathered parameters alone (through the ops
      recomputed here and the full maxes) and that is elementwise (not random) is recomputed,
      so that the backward gathers the parameter again and recomputes what it needs (a float8
      weight: its scale, clamp and cast) instead of the forward saving a full-size value
      derived from it;
    - a full max of such inputs (a float8 weight's amax) is saved: 0-d, the same value the
      backward would compute again, and the backward then neither reduces the weight again
      nor (under ``narrow_gathers``) combines the shards' amaxes in an all-reduce;
    - a cast to float8 of other compute (a float8 linear's cast of its input activation) is
      saved, so the backward keeps its 1-byte result and not the fp32 value before it; every
      other cast is recomputed as before.

    One per checkpoint region: it remembers (by identity, weakly) the tensors the region
    produced and those that derive from gathered parameters."""

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary
        self.derived = WeakIdKeyDictionary()
        self.produced = WeakIdKeyDictionary()
        self._derives = False   # whether the op just decided derives from gathered parameters alone

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        policy = _recompute_policy(ctx, op, *args, **kwargs)
        inputs = _flat_tensors(args, kwargs)
        from_weights = bool(inputs) and all(a in self.derived for a in inputs)
        if op is torch.ops.aten._to_copy.default and _to_float8(kwargs) and not all(
                a in self.derived or a not in self.produced for a in inputs):
            policy = CheckpointPolicy.MUST_SAVE   # a float8 cast of other compute: keep the 1-byte value
        elif policy is CheckpointPolicy.MUST_SAVE and from_weights and self._elementwise(op):
            policy = CheckpointPolicy.MUST_RECOMPUTE
        self._derives = op in _GATHER_OPS or from_weights and (policy is CheckpointPolicy.MUST_RECOMPUTE
                                                               or op in _WEIGHT_REDUCTIONS)
        return policy

    def record_outputs(self, out) -> None:
        """Remember the result of the op just decided (``torch_compat.output_aware_checkpoint_contexts``
        calls this after each decision)."""
        for tensor in _flat_tensors(out, {}):
            self.produced[tensor] = True
            if self._derives:
                self.derived[tensor] = True

    @staticmethod
    def _elementwise(op) -> bool:
        tags = getattr(op, "tags", ())
        return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _to_float8(kwargs) -> bool:
    dtype = kwargs.get("dtype")
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize == 1


def _flat_tensors(args, kwargs) -> list:
    from torch.utils._pytree import tree_leaves
    return [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]


def _recompute_contexts():
    return output_aware_checkpoint_contexts(_WeightPolicy())

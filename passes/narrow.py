"""Gather what the consumer uses: a narrowing cast (float8 weights) moved before its all-gather.

    result = narrow_gathers(gm)   # in place (the caller recompiles); a NarrowResult: notes and skips

Why. With in-graph (SimpleFSDP-style) sharding a float8 linear's weight is
gathered in bf16 and only then scaled and cast to float8: the all-gather moves
twice the bytes the matmul reads. Elementwise ops commute with the all-gather's
concatenation, and the amax that dynamic per-tensor scaling needs is the max
of the shards' amaxes, so the cast can run on the shard and the all-gather can
move the float8 bytes, with values equal bit for bit.

What is rewritten, and nothing else. An ``all_gather_into_tensor`` with one
wait and static shapes whose gathered value W is read only through

* *views* that keep every element and compute nothing (view, reshape,
  permute, t, transpose, identity slices, squeeze/unsqueeze, alias, detach,
  clone),
* *elementwise* ops (``torch.Tag.pointwise``, not random, not in place) with
  one operand from W, the others 0-d tensors or numbers, and dtype casts,

that end in

* *narrowing casts*: casts to a dtype of fewer bytes per element than W's (the
  narrowest on each path, the last of equals); what reads their results is not
  looked at, and
* *amaxes*: ``max`` (or ``amax`` over every dim) of ``abs`` of such a value,
  reached from W through views, casts and ``neg`` alone,

where every 0-d operand is computed, through 0-d ops alone, from graph inputs,
constants and those amaxes (torchao's dynamic per-tensor scale:
``amax -> float64 -> clamp_min -> reciprocal -> mul -> float32``).

The rewrite. At the top of the graph, per process group: each amax on its
rank's shard (the shard's cast from the graph input copied there), as float32
bits viewed as int32 (non-negative floats order as their bits, NaN above
infinity, so an integer max is exact and propagates NaN on every rank), stacked
into one vector and combined by one ``all_reduce(max)``; each amax's users read
its entry back (int32 -> float32 -> its dtype: exact), and the 0-d ops computing
the scales move up behind it. At each narrowing cast: the elementwise ops from
W to it run on the shard (marked as the new all-gather's input chain, so they
move with its start; a shard cast narrower than its graph input is first
stored by ``overlapc::exact_copy``, since Inductor's fused CPU code skips the
rounding of a cast to bfloat16 that a later op widens again), float8 values are viewed as uint8 (gloo refuses float8
all-gathers; the bits are the same on every backend), the narrow shard is
gathered, viewed back and the views from W to the cast applied again. The old
all-gather and what only it fed are erased.

Left alone (each with the reason in ``NarrowResult.skipped`` when the gathered
value reaches a narrowing cast or an amax at all, else silently): a gathered
value read at full width by anything else, uneven shards (the gathered value is
sliced: the padding of other ranks is not in this graph), an amax of a scaled
value, a scale that reads other compute, a shard not cast from a graph input by
cheap ops, an empty shard, symbolic shapes, casts that move as many bytes.

Deterministic: matches are taken in graph order, nodes are named from graph order.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx

from overlapc.passes.collectives import is_cheap, node_value, wait_nodes
from overlapc.passes.meta import NARROW, add_notes, mark_input_chain
from overlapc.passes.rewrite import FakeValues, new_node

__all__ = ["NarrowNote", "NarrowResult", "NarrowSkip", "exact_copy", "narrow_gathers"]


@torch.library.custom_op("overlapc::exact_copy", mutates_args=())
def exact_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that Inductor calls as it is (a fallback kernel): the shard's narrow
    cast is stored, so the ops after it read the rounded values. Fused, Inductor's CPU code
    keeps a float32 value cast to bfloat16 and back in float32 (the rounding is skipped, as
    without ``emulate_precision_casts``), where the unrewritten graph's all-gather stored it."""
    return x.clone()


@exact_copy.register_fake
def _exact_copy_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)

aten, prims = torch.ops.aten, torch.ops.prims
C10D = torch.ops._c10d_functional

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.permute.default,
          aten.transpose.int, aten.slice.Tensor, aten.alias.default, aten.detach.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.clone.default}
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}
_MAXES = {aten.max.default, aten.amax.default}
_MAX_IDS = frozenset(map(id, _MAXES))   # (hashing an OpOverload runs Python code; ids of these live ops are theirs)
# ops an amax may read the value through: with abs they commute with rounding (Inductor's fused
# code may skip a bfloat16 rounding before them: the max of the rounded values is the rounded max)
_MONOTONE = {aten.abs.default, aten.neg.default}
_SCALED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # amax dtypes whose float32 value is exact


@dataclasses.dataclass(frozen=True)
class NarrowNote:
    """One all-gather rewritten: its start's name, the dtype it now gathers (``wire``:
    the dtype on the link, uint8 for float8), its bytes before and after (all the
    gathers that replace it), and how many amaxes the max all-reduce now combines for it."""

    gather: str
    dtype: str
    wire: str
    bytes_before: int
    bytes_after: int
    amaxes: int


@dataclasses.dataclass(frozen=True)
class NarrowSkip:
    """An all-gather whose value reaches a narrowing cast or an amax, left as it was: why."""

    gather: str
    reason: str


@dataclasses.dataclass(frozen=True)
class NarrowResult:
    """What ``narrow_gathers`` did: the gathers rewritten, those left alone (with a reason),
    and the max all-reduces it added (one per process group with amaxes)."""

    rewritten: tuple[NarrowNote, ...] = ()
    skipped: tuple[NarrowSkip, ...] = ()
    amax_reduces: int = 0

    @property
    def modified(self) -> bool:
        return bool(self.rewritten)


class _Refused(Exception):
    """A gather this pass cannot prove safe to rewrite; the message says why."""


@dataclasses.dataclass
class _Match:
    """A gather and what the rewrite needs of it. ``parent``: region node -> its operand from
    the gathered value; ``casts``: the narrowing casts the new gathers replace; ``amaxes``: the
    max nodes that become shard amaxes; ``scale_nodes``: the 0-d nodes computing the casts'
    scalar operands (moved up behind the all-reduce); ``source``: the cheap chain from a graph
    input to the shard (first the input)."""

    start: fx.Node
    wait: fx.Node
    group: str
    world: int
    parent: dict
    casts: list
    amaxes: list
    scale_nodes: list
    source: list
    bytes_before: int
    bytes_after: int


def narrow_gathers(gm: fx.GraphModule, before_rewrite=None) -> NarrowResult:
    """Rewrite every all-gather of ``gm`` that matches the module docstring's pattern to
    gather the narrow bytes its consumers use (values bit-identical); leave the rest.

    ``before_rewrite()`` runs once before the graph first changes (the pipeline's
    snapshot). Returns the notes (also appended to ``gm.meta``, ``meta.NARROW``)."""
    nodes = list(gm.graph.nodes)
    position = functools.cache(lambda: dict(zip(nodes, range(len(nodes)))))   # node -> index, built on a first match
    narrowest = _narrowest(gm.graph)
    matches, skipped = [], []
    for start in nodes:
        if start.op != "call_function" or start.target is not C10D.all_gather_into_tensor.default:
            continue
        try:
            found = _match(start, position, narrowest)
        except _Refused as refused:
            if _reaches_narrowing(start, narrowest):
                skipped.append(NarrowSkip(start.name, str(refused)))
            continue
        if found is not None:
            matches.append(found)
    if not matches:
        return NarrowResult(skipped=tuple(skipped))
    if before_rewrite is not None:
        before_rewrite()
    reduces = _rewrite(gm, matches)
    notes = tuple(NarrowNote(m.start.name, str(node_value(m.casts[0]).dtype).replace("torch.", ""),
                             str(_wire(node_value(m.casts[0]).dtype)).replace("torch.", ""),
                             m.bytes_before, m.bytes_after, len(m.amaxes)) for m in matches)
    add_notes(gm, NARROW, notes)
    return NarrowResult(notes, tuple(skipped), reduces)


# ---------------------------------------------------------------- matching


def _val(node) -> torch.Tensor | None:
    value = node_value(node) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _static_numel(value: torch.Tensor) -> int:
    if any(type(s) is not int for s in value.shape):
        raise _Refused("symbolic shape")
    return value.numel()


def _is_cast(node: fx.Node) -> bool:
    if node.target is prims.convert_element_type.default:
        return True
    if node.target is aten._to_copy.default:
        source = _val(node.args[0])
        extra = {k: v for k, v in node.kwargs.items() if k != "dtype"}
        same_place = source is not None and extra.get("device", source.device) == source.device \
            and extra.get("layout", torch.strided) == torch.strided and not extra.get("pin_memory", False) \
            and extra.get("memory_format") in (None, torch.preserve_format)
        return same_place and len(node.args) == 1
    return False


def _is_elementwise(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags \
        and torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def _tensor_operands(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if _val(a) is not None]


def _classify(user: fx.Node, operand: fx.Node, numel: int) -> str | None:
    """How a reader of region node ``operand`` continues the region: "view", "cast",
    "elementwise", "amax" (a max of an abs), or None (it reads the value otherwise)."""
    out, data = _val(user), _val(operand)
    if user.op != "call_function" or out is None or data is None or operand in user.kwargs.values():
        return None
    others = [a for a in _tensor_operands(user) if a is not operand]
    first = bool(user.args) and user.args[0] is operand and operand not in user.args[1:]
    if user.target in _VIEWS:
        same = first and not others and _static_numel(out) == numel and out.dtype == data.dtype
        return "view" if same else None
    if user.target in _MAXES:
        dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", ())
        keepdim = user.args[2] if len(user.args) > 2 else user.kwargs.get("keepdim", False)
        every = user.target is aten.max.default or not dims or sorted(d % data.dim() for d in dims) == \
            list(range(data.dim()))
        is_abs = operand.op == "call_function" and operand.target is aten.abs.default
        return "amax" if first and every and not keepdim and is_abs and not others and out.dim() == 0 else None
    if _is_cast(user):
        return "cast" if first and not others else None
    once = sum(a is operand for a in user.args) == 1
    if _is_elementwise(user) and once and list(out.shape) == list(data.shape) \
            and all(_val(a).dim() == 0 for a in others):
        return "elementwise"
    return None


def _narrowest(graph: fx.Graph) -> int:
    """The smallest element size among the values of ``graph``'s nodes, 0 when a node is a
    max (``_MAXES``): no gather of a value at most that wide reaches a narrowing node."""
    narrowest = None
    for node in graph.nodes:
        if id(node.target) in _MAX_IDS:
            return 0
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            value = _val(node)   # no "val": what node_value reads instead
            if value is None:
                continue
        if narrowest is None or value.dtype.itemsize < narrowest:
            narrowest = value.dtype.itemsize
    return narrowest or 0


def _reaches_narrowing(start: fx.Node, narrowest: int) -> bool:
    """Whether the gathered value reaches (through a few ops) a narrowing cast or a max:
    a gather worth a skip reason. ``narrowest``: ``_narrowest`` of the graph (the walk
    cannot find one in a graph with nothing narrower than the gathered value)."""
    waits = wait_nodes(start)
    value = _val(start)
    if len(waits) != 1 or value is None or value.dtype.itemsize <= narrowest:
        return False
    frontier, seen = [waits[0]], 0
    while frontier and seen < 64:
        node = frontier.pop()
        seen += 1
        for user in node.users:
            out = _val(user)
            if user.target in _MAXES or out is not None and out.dtype.itemsize < value.dtype.itemsize:
                return True
            frontier.append(user)
    return False


def _match(start: fx.Node, position, narrowest: int) -> _Match | None:
    """The rewrite of ``start``'s gather, None when it has no narrowing cast at all;
    raise _Refused (with the reason) where the pattern does not hold. ``narrowest``:
    ``_narrowest`` of the graph (a gather no wider has nothing to rewrite or to explain);
    ``position()``: node -> index in the graph."""
    waits = wait_nodes(start)
    gathered = _val(start)
    if len(waits) != 1 or gathered is None or not gathered.dtype.is_floating_point \
            or gathered.dtype.itemsize <= narrowest:   # then no cast narrows it and no max reads it
        return None
    wait = waits[0]
    numel = _static_numel(gathered)
    parent, kinds, boundary, amaxes = _region(wait, numel)
    narrowing = [n for n, kind in kinds.items() if kind == "cast" and _val(n).dtype.itemsize < gathered.dtype.itemsize]
    if not narrowing:
        if amaxes:
            raise _Refused("an amax of the gathered value, but no narrowing cast")
        if boundary and _reaches_narrowing(start, narrowest):
            raise _Refused(_full_width(*boundary[0]))
        return None
    casts = _cut(wait, parent, kinds, boundary, gathered.dtype)
    below = _below(casts, parent)
    amaxes = [m for m in amaxes if m.args[0] not in below]
    _check_closed(wait, parent, below, set(casts), set(amaxes))
    for amax in amaxes:
        if node_value(amax).dtype not in _SCALED_DTYPES:
            raise _Refused(f"amax {amax.name} is {node_value(amax).dtype}")
        for node in _path(amax.args[0], wait, parent):
            if kinds.get(node) == "elementwise" and len(_tensor_operands(node)) > 1:
                raise _Refused(f"amax {amax.name} of a scaled value ({node.name})")
            if kinds.get(node) == "elementwise" and node.target not in _MONOTONE:
                raise _Refused(f"amax {amax.name} of {node.name} ({_op_name(node)}), not of the value's abs")
    scale_nodes = _scale_nodes(casts, wait, parent, kinds, set(amaxes), set(parent))
    shard = start.args[0]
    shard_value = _val(shard)
    if shard_value is None or _static_numel(shard_value) == 0:
        raise _Refused("empty shard")
    source = _source_chain(shard)
    world = start.args[1]
    before = numel * gathered.dtype.itemsize
    after = sum(numel * _val(c).dtype.itemsize for c in casts)
    if after >= before:
        raise _Refused(f"the narrow gathers would move {after} bytes, not fewer than {before}")
    return _Match(start, wait, str(start.args[2]), int(world), parent, casts, sorted(amaxes, key=position().get),
                  sorted(scale_nodes, key=position().get), source, before, after)


def _region(wait: fx.Node, numel: int):
    """The nodes that read the gathered value through views, casts and elementwise ops:
    (parent of each, its kind, the (node, reader) pairs that leave the region, the amax nodes)."""
    parent: dict[fx.Node, fx.Node] = {wait: None}
    kinds: dict[fx.Node, str] = {wait: "wait"}
    boundary, amaxes, frontier = [], [], [wait]
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if user in parent:
                raise _Refused(f"{user.name} reads the gathered value twice")
            kind = _classify(user, node, numel)
            if kind == "amax":
                amaxes.append(user)
            elif kind is None:
                boundary.append((node, user))
            else:
                parent[user], kinds[user] = node, kind
                frontier.append(user)
    return parent, kinds, boundary, amaxes


def _path(node: fx.Node, wait: fx.Node, parent: dict) -> list[fx.Node]:
    """The region nodes from just after ``wait`` down to ``node``, in data order."""
    path = []
    while node is not wait:
        path.append(node)
        node = parent[node]
    return path[::-1]


def _cut(wait: fx.Node, parent: dict, kinds: dict, boundary: list, dtype: torch.dtype) -> list[fx.Node]:
    """The narrowing casts the new gathers replace: per value leaving the region, the narrowest
    cast on its path (the last of equals). Raise _Refused for a value read at full width."""
    casts = []
    for node, user in boundary:
        best = None
        for step in _path(node, wait, parent):
            size = _val(step).dtype.itemsize
            if kinds[step] == "cast" and size < dtype.itemsize and (best is None or size <= _val(best).dtype.itemsize):
                best = step
        if best is None:
            raise _Refused(_full_width(node, user))
        if best not in casts:
            casts.append(best)
    return casts


def _full_width(node: fx.Node, user: fx.Node) -> str:
    """Why ``user`` reading region node ``node`` stops the rewrite, in words."""
    if user.target is aten.slice.Tensor:
        return (f"{user.name} (slice) reads the gathered value at full width and keeps part of it (uneven "
                f"shards: the padding of other ranks is not in this graph)")
    if user.op == "output":
        return f"the graph output reads {node.name} (the gathered value at full width; saved for the backward?)"
    return f"{user.name} ({_op_name(user)}) reads the gathered value at full width"


def _below(casts: list, parent: dict) -> set:
    """Region nodes at or after one of ``casts`` (they stay as they are)."""
    below = set()
    for node in parent:
        walk = node
        while walk is not None:
            if walk in casts:
                below.add(node)
                break
            walk = parent[walk]
    return below


def _check_closed(wait: fx.Node, parent: dict, below: set, casts: set, amaxes: set) -> None:
    """Every region node above the cut feeds only the region above it, the casts and the
    amaxes: after the rewrite nothing reads the wide gathered value."""
    for node in parent:
        if node in below:
            continue
        for user in node.users:
            if user not in parent and user not in amaxes:
                raise _Refused(f"{user.name} ({_op_name(user)}) reads {node.name} at full width")
            if user in below and user not in casts:
                raise _Refused(f"{user.name} reads {node.name} beside the narrowing cast")


def _scale_nodes(casts: list, wait: fx.Node, parent: dict, kinds: dict, amaxes: set, region: set) -> set:
    """The 0-d nodes that compute the elementwise ops' scalar operands on the way to the casts.
    Raise _Refused when such an operand reads anything but graph inputs, constants, 0-d ops and
    this gather's amaxes."""
    found: set[fx.Node] = set()
    for cast in casts:
        for node in _path(cast, wait, parent):
            for operand in _tensor_operands(node):
                if operand is not parent[node]:
                    _scalar_ancestry(operand, amaxes, region, found)
    return found


def _scalar_ancestry(node: fx.Node, amaxes: set, region: set, found: set) -> None:
    frontier = [node]
    while frontier:
        node = frontier.pop()
        if node in found or node in amaxes or node.op == "placeholder":
            continue
        value = _val(node)
        if node in region or node.op != "call_function" and node.op != "get_attr" or value is None \
                or value.dim() != 0 or node.op == "call_function" and (
                    not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable
                    or node.target.namespace not in ("aten", "prims")):
            raise _Refused(f"a scale reads {node.name} ({_op_name(node)})")
        found.add(node)
        frontier.extend(node.all_input_nodes)


def _source_chain(shard: fx.Node) -> list[fx.Node]:
    """[graph input, cheap ops ...] that compute the shard; _Refused if it is other compute."""
    chain = [shard]
    node = shard
    while node.op == "call_function":
        inputs = _tensor_operands(node)
        if not is_cheap(node) or node.target in (aten.slice.Tensor,) or len(inputs) != 1 \
                or any(isinstance(a, fx.Node) and a not in inputs for a in node.args[1:]):
            raise _Refused(f"the shard is computed by {node.name} ({_op_name(node)}), not cast from a graph input")
        node = inputs[0]
        chain.append(node)
    if node.op not in ("placeholder", "get_attr"):
        raise _Refused(f"the shard comes from {node.name}")
    return chain[::-1]


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)) if node.op == "call_function" else node.op


def _swap(node: fx.Node, old: fx.Node, new: fx.Node) -> tuple:
    """``node``'s args with ``old`` replaced by ``new``."""
    return tuple(new if a is old else a for a in node.args)


def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype a narrow value travels as: float8 as its uint8 bits."""
    return torch.uint8 if dtype.is_floating_point and dtype.itemsize == 1 else dtype


# ---------------------------------------------------------------- rewriting


def _rewrite(gm: fx.GraphModule, matches: list[_Match]) -> int:
    """Apply ``matches``: the amax all-reduces at the top, one narrow gather per cast; returns
    the all-reduces added."""
    graph = gm.graph
    fake = FakeValues(gm)
    top = next(n for n in graph.nodes if n.op != "placeholder")
    groups: dict[str, list[_Match]] = {}
    for m in matches:
        if m.amaxes:
            groups.setdefault(m.group, []).append(m)
    for group, members in groups.items():
        _reduce_amaxes(graph, fake, top, group, members)
    dead = []
    for m in matches:
        for cast in m.casts:
            _gather_narrow(graph, fake, m, cast)
        dead += [m.start, m.wait, *m.parent, *m.amaxes]
    _erase_dead(graph, dead)
    graph.lint()
    return len(groups)


def _reduce_amaxes(graph: fx.Graph, fake: FakeValues, top: fx.Node, group: str, members: list[_Match]) -> None:
    """Before ``top``: every member's shard amaxes, one int32 max all-reduce over ``group``,
    each amax's users switched to its entry; then the members' scale nodes, moved up."""
    bits, amaxes = [], []
    with graph.inserting_before(top):
        for m in members:
            for amax in m.amaxes:
                value = _copy_chain(graph, fake, m.source, like=m.start)
                for node in _path(amax.args[0], m.wait, m.parent):
                    if node.target not in _VIEWS:
                        value = new_node(graph, fake, node.target, _swap(node, m.parent[node], value), node.kwargs,
                                         like=node)
                local = new_node(graph, fake, aten.max.default, (value,), like=amax)
                wide = new_node(graph, fake, prims.convert_element_type.default, (local, torch.float32), like=amax)
                bit = new_node(graph, fake, aten.view.dtype, (wide, torch.int32), like=amax)
                bits.append(new_node(graph, fake, aten.view.default, (bit, [1]), like=amax))
                amaxes.append(amax)
        like = members[0].start
        packed = new_node(graph, fake, aten.cat.default, (bits,), like=like)
        reduced = new_node(graph, fake, C10D.all_reduce.default, (packed, "max", group), like=like)
        done = new_node(graph, fake, C10D.wait_tensor.default, (reduced,), like=like)
        for index, amax in enumerate(amaxes):
            entry = new_node(graph, fake, aten.select.int, (done, 0, index), like=amax)
            wide = new_node(graph, fake, aten.view.dtype, (entry, torch.float32), like=amax)
            value = new_node(graph, fake, prims.convert_element_type.default, (wide, node_value(amax).dtype),
                             like=amax)
            amax.replace_all_uses_with(value)
    order = {node: i for i, node in enumerate(graph.nodes)}
    moved = sorted({n for m in members for n in m.scale_nodes}, key=order.get)
    for node in moved:
        if order[node] > order[top]:
            top.prepend(node)


def _copy_chain(graph: fx.Graph, fake: FakeValues, source: list, like: fx.Node) -> fx.Node:
    """A copy of the cheap ops ``source[1:]`` applied to ``source[0]`` (at the insert point)."""
    value = source[0]
    for node in source[1:]:
        value = new_node(graph, fake, node.target, (value, *node.args[1:]), node.kwargs, like=node)
    return value


def _gather_narrow(graph: fx.Graph, fake: FakeValues, m: _Match, cast: fx.Node) -> None:
    """Before ``cast``: the elementwise ops from the gathered value to it on the shard (the new
    start's input chain), the narrow all-gather (float8 as uint8), the views again; ``cast``'s
    users read that."""
    path = _path(cast, m.wait, m.parent)
    with graph.inserting_before(cast):
        value = m.start.args[0]
        if _val(value).dtype.itemsize < _val(m.source[0]).dtype.itemsize:   # rounded by a cast: keep it so
            value = new_node(graph, fake, exact_copy._opoverload, (value,), like=m.start)
            mark_input_chain(value)
        for node in path:
            if node.target in _VIEWS:
                continue
            value = new_node(graph, fake, node.target, _swap(node, m.parent[node], value), node.kwargs, like=node)
            mark_input_chain(value)
        narrow = node_value(cast).dtype
        if _wire(narrow) is not narrow:
            value = new_node(graph, fake, aten.view.dtype, (value, _wire(narrow)), like=cast)
            mark_input_chain(value)
        gathered = new_node(graph, fake, C10D.all_gather_into_tensor.default, (value, m.world, m.group),
                            like=m.start)
        value = new_node(graph, fake, C10D.wait_tensor.default, (gathered,), like=m.wait)
        if _wire(narrow) is not narrow:
            value = new_node(graph, fake, aten.view.dtype, (value, narrow), like=cast)
        for node in path:
            if node.target in _VIEWS:
                value = new_node(graph, fake, node.target, (value, *node.args[1:]), node.kwargs, like=node)
    cast.replace_all_uses_with(value)


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` that nothing reads once their readers among them are gone
    (one sweep, last node first)."""
    pending = set(nodes)
    for node in [n for n in reversed(graph.nodes) if n in pending]:
        if not node.users:
            graph.erase_node(node)

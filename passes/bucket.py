"""Merge small all-gathers (reduce-scatters, all-reduces) into one collective per bucket.

    notes = bucket_collectives(gm, bucket="auto" | "module" | byte_target)   # in place; the caller recompiles

Who merges. Movable ``all_gather_into_tensor`` (``reduce_scatter_tensor``,
``all_reduce``) starts with exactly one ``wait_tensor`` and static shapes, in *lanes* of the
same barrier region, group and group size, and for reduce-scatters and all-reduces
the same dtype and reduce op: nothing merges across a barrier, a group, a reduce
op, or a dtype where values are reduced. All-gathers of several dtypes (an fp32
norm weight and bf16 projections) share a bucket as bytes (``_as_bytes``). Within a
lane, members are taken in order (all-gathers in consumer order,
``Structure.consumer_key``; reduce-scatters and all-reduces in the order their
starts stand, which is the order their inputs become ready) and a bucket holds
consecutive members. A bucket closes before a member when

* ``bucket="module"``: the member belongs to another block. Its block is the
  module path (``collectives.module_path`` of the start, else of its
  first real consumer) up to and including the first numeric segment
  ("layers.3" for "layers.3.attention.wq"), else the top-level module
  ("output", "norm"). Members without module information bucket by
  ``DEFAULT_BUCKET_BYTES``;
* ``bucket=<int>``: adding it would take the bucket past that many bytes (a
  member larger than the target is a bucket alone);
* ``bucket="auto"`` (the default): both of the above, with the byte target the
  largest member of the same group and kind in the graph. A bucket then holds
  no more than the largest single collective, so the "auto" in-flight byte
  budget (twice the largest) and the memory it allows stay as without buckets;
  what merges is the small collectives (norms, biases, the smaller projections)
  that would each take a slot of the count bound and pay a latency;
* ``bucket="auto"`` or a byte target under the "serial-peak" byte budget (the
  defaults; not ``"module"``, whose buckets cost what they hold): the pipeline
  hands in the graph's headroom under its serial order's peak, and the member
  would take the bucket's copies (at the copy-out twice the bucket, then the copy until the
  last member's consumer; for a reduce-scatter the inputs and the packed copy)
  past that headroom (``_fits_headroom``), so that buckets never raise the
  peak the unbucketed graph would have;
* either way: the bucket could not be issued before its first result is
  needed (a member's input is ready only after another member's first real
  consumer), or the member's result or input is tied to another collective;
* in every mode: the bucket would lose a member's hiding interval
  (``_keeps_hiding``): a bucket is issued when its last input is ready and waited
  before its first result is needed, so the kernels a member could hide under
  outside that common window (one that reads another member's result, one that
  produces another member's input, a nested interval) are lost to it. Without an
  estimate a kernel (``Kernels``: not pointwise, not a reduction, not a view or
  cast) is taken to hide one collective the size of the group's largest; the
  bucket keeps its members' hiding intervals when its common window holds as
  many kernels as its bytes make such collectives (rounded to the nearest, at
  least one), or all the kernels the members' windows offer.
  A transformer block gathered first in a graph (nothing before it to hide it)
  is split where the whole block would lose its later projections' kernels.

A bucket of one member stays as it was. Bytes: the all-gather's output, the
reduce-scatter's and all-reduce's input.

Rewrite. The copies are two operators of ``passes/bucket_ops.py``, which Inductor
calls as they are instead of generating a kernel per member (a ``cat`` of n
inputs was n loop nests: the compile time of Llama 8 layers' 490 kernels
against plain Inductor's 210). All-gather: the members' inputs (with the cheap
input chain the scheduler would move with it, casts included) are packed end
to end into one flat shard (``overlapc.pack``, marked
``meta["overlapc_input_chain"]`` so the scheduler moves it with the start); one
all-gather and one wait; the result viewed as (world, total). Member i's
gathered value is its columns [off, off+n) of every row, rank-major as before,
so values are bit-identical. They are copied out together by one
``overlapc.unpack_columns`` into a member-major buffer, each member's result a
view of its block in the gathered shape (world*s0, *rest). A member whose
result is a graph output gets a copy of its own instead, so that the other
members' bytes do not live on with it. The bucket and its copy-out stand just
before the first real consumer of any member's result (its views follow it);
an own copy just before its member's first real consumer. Memory: the flat
result and the copy are both live during the copy (twice the bucket, a bucket
is at most the largest collective under "auto"); the flat result dies right
after, the copy lives until the last member's consumer, as the flat result did
when each member was copied at its consumer.

Reduce-scatter: each member's input y_i (world*m_i, *rest) is read as
(world, m_i*prod(rest)) and ``overlapc.pack`` joins them along dim 1, so that
rank r's block of the flat buffer is the concatenation of every member's block
r; one reduce-scatter of it and one wait; member i's result is the slice [off,
off+m_i*prod(rest)) viewed as (m_i, *rest) (a view, no copy). The bucket
stands right after the last input it reads is ready.

All-reduce (the gradients of a replicated model: in-graph DDP): the members'
inputs packed end to end, one all-reduce and one wait, member i's result the
slice [off, off+n_i) viewed in its shape (a view). An element's reduction is
the same sum over the same ranks, so values agree within the rounding of the
backend's reduction order. Standing like a reduce-scatter bucket.

New nodes carry ``meta["val"]`` (fake tensors computed by the ops themselves)
and the module stack of a member, so the memory tracker, the cost model and the
report read them like any other node. The graph is rewritten in place
(``gm.graph``; no recompile), linted when it changed, and deterministic: the
same graph gives the same buckets and node order whatever PYTHONHASHSEED.
Returns one BucketNote per bucket, also appended to
``gm.meta["overlapc_buckets"]``. ValueError names the node, op and group when a
collective's shapes contradict its group size.

Left alone: coalesced and ``_out`` collectives, all-to-all,
collectives with several waits or symbolic/unknown shapes, the pieces of a
chunked collective (``passes/chunk/``'s notes name them), and collectives
whose result feeds another collective's input chain directly.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
from typing import Callable

import torch
import torch.fx as fx

from overlapc.passes.collectives import Collective, is_cheap, module_path, node_value, role, source_of
from overlapc.passes import bucket_ops, meta  # noqa: F401 (bucket_ops registers torch.ops.overlapc)
from overlapc.passes.memory import Headroom
from overlapc.passes.rewrite import FakeValues, new_node
from overlapc.passes.structure import Structure, apply_order

__all__ = ["BUCKET_MODES", "BucketNote", "DEFAULT_BUCKET_BYTES", "block_of", "bucket_collectives", "merge_duplicates"]

log = logging.getLogger("overlapc")
aten = torch.ops.aten
F = torch.ops._c10d_functional
OPS = torch.ops.overlapc   # bucket_ops' copy-in and copy-out

# Byte target where the graph records no module: large enough that per-collective
# latency stops mattering (on gloo one 10 MiB all-gather took a third of the time
# of the same bytes in 60 pieces), small enough that one bucket is a small share
# of a model's gathered parameters (a Llama-8B block is ~400 MiB in bf16).
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

BUCKET_MODES = ("auto", "module")
_OPS = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor", "all_reduce": "all_reduce"}


@dataclasses.dataclass(frozen=True)
class BucketNote:
    """One bucket: ``start`` is the new collective's node, ``nbytes`` its output
    (all-gather) or input (reduce-scatter) bytes; ``members`` the original start
    nodes merged, in layout order, ``modules`` their module paths ("" unknown) and
    ``sources`` the graph inputs they move ("blocks.0.norm1.weight", ``collectives.source_of``;
    "" where unknown: not an input, or a graph the backend did not name)."""

    start: str
    kind: str
    group: str
    nbytes: int
    members: tuple[str, ...]
    modules: tuple[str, ...]
    sources: tuple[str, ...] = ()


def merge_duplicates(gm: fx.GraphModule, before_rewrite: Callable[[], None] | None = None) -> list[tuple[str, ...]]:
    """Make identical collectives one, in place. First, a collective nothing
    reads (every wait unused) that an identical collective later in the graph
    repeats is erased: torch 2.14's min-cut partitioner gathers each
    ``nn.MultiheadAttention`` ``in_proj_weight`` / ``in_proj_bias`` twice in
    the forward and reads only the second. Then starts of the same op with the same
    arguments (the same input nodes, group and sizes), each read by exactly one
    ``wait_tensor``, with no other collective of their group and no barrier between
    them. DTensor emits them when several modules ask for the same redistribution
    (``ColwiseParallel(input_layouts=Shard(1))`` on q, k and v each gathers the same
    activation). The same parameter gathered again later (tied weights, FSDP's
    re-gather) is not merged: other collectives of its group stand between, and
    merging would hold the gathered result all that time. The first start is kept;
    its wait moves to just before the first of the merged waits and takes their
    users; the others are erased. Every rank traces the same graph, so every rank
    merges the same collectives. Returns the merged starts' names, each group
    first-kept, in graph order (also appended to ``gm.meta["overlapc_duplicates"]``).
    ``before_rewrite``: as for ``bucket_collectives``."""
    marks = _starts_and_barriers(gm)
    names = _drop_unread_repeats(gm, [node for node, start, _ in marks if start], before_rewrite)
    if names:   # a write that the erased collectives read may be no barrier now
        marks = _starts_and_barriers(gm)
    names += _merge_identical_runs(gm, marks, before_rewrite)
    if names:
        gm.graph.lint()
    meta.add_notes(gm, meta.DUPLICATES, names)
    return names


def _starts_and_barriers(gm: fx.GraphModule) -> list[tuple[fx.Node, bool, bool]]:
    """(node, starts a collective, is a barrier) for each node of ``gm`` that does either,
    in graph order: what both merging steps read, from one ``role`` lookup a node."""
    from overlapc.passes.collectives import role
    marks = []
    for node in gm.graph.nodes:
        start, _, barrier = role(node)
        if start is not None or barrier is not None:
            marks.append((node, start is not None, barrier is not None))
    return marks


def _drop_unread_repeats(gm: fx.GraphModule, starts: list[fx.Node],
                         before_rewrite: Callable[[], None] | None) -> list[tuple[str, ...]]:
    """Erase every collective whose waits nobody reads when a later collective
    with the same op and arguments exists (the same result is computed again
    where it is read). ``starts``: every collective start of ``gm``, in graph order.
    Values are unchanged, and every rank traces the same graph, so every rank
    erases the same collectives. Returns (kept, erased) name pairs in graph order."""
    from overlapc.passes.collectives import wait_nodes
    if not any(_unread(start) for start in starts):   # the common case: no arguments hashed
        return []
    seen: dict[tuple, list[fx.Node]] = {}
    for node in starts:
        seen.setdefault((node.target, _key(node.args), _key(node.kwargs)), []).append(node)
    dropped = [(later, earlier) for same in seen.values()
               for earlier, later in zip(same, same[1:]) if _unread(earlier)]
    if not dropped:
        return []
    if before_rewrite is not None:
        before_rewrite()
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    dropped.sort(key=lambda pair: position[pair[1]])
    for _, earlier in dropped:
        for wait in wait_nodes(earlier):
            gm.graph.erase_node(wait)
        for getitem in list(earlier.users):   # left without users by the waits' erasure
            gm.graph.erase_node(getitem)
        gm.graph.erase_node(earlier)
    names = [(later.name, earlier.name) for later, earlier in dropped]
    log.info("overlapc: erased %d collectives whose results nothing reads, each repeated later: %s",
             len(names), "; ".join(f"{erased} (again as {kept})" for kept, erased in names))
    return names


def _unread(start: fx.Node) -> bool:
    """Whether nothing reads the result of the collective ``start``: it has waits, its
    only users are them (or getitems read only by them), and the waits have no users."""
    from overlapc.passes.collectives import wait_nodes
    waits = wait_nodes(start)
    only_waits = all(u in waits or (u.target is operator.getitem and all(w in waits for w in u.users))
                     for u in start.users)
    return bool(waits) and only_waits and not any(w.users for w in waits)


def _merge_identical_runs(gm: fx.GraphModule, marks: list[tuple[fx.Node, bool, bool]],
                          before_rewrite: Callable[[], None] | None) -> list[tuple[str, ...]]:
    """Merge runs of identical, adjacent-in-their-group collectives (see
    ``merge_duplicates``); ``marks``: ``_starts_and_barriers`` of ``gm``. Returns the
    merged starts' names, first-kept."""
    from overlapc.passes.collectives import group_of, wait_nodes
    runs: list[list[fx.Node]] = []
    run_of: dict[fx.Node, list[fx.Node]] = {}   # mergeable start -> its run (identical starts so far)
    last: dict[str, fx.Node] = {}                # the latest start of each group
    for node, _, barrier in marks:
        if barrier:
            run_of.clear()
            last.clear()
            continue
        group = group_of(node)
        waits = wait_nodes(node)
        if len(waits) == 1 and waits[0].args[0] is node and len(node.users) == 1:
            # a run goes on only from the group's latest start (identical arguments name the
            # same group): compare with that one, the input nodes first (no arguments hashed)
            previous = last.get(group)
            run = run_of.get(previous)
            if run is not None and _identical(previous, node):
                run.append(node)
            else:
                run = [node]
                runs.append(run)
            run_of[node] = run
        last[group] = node
    merged = [run for run in runs if len(run) > 1]   # graph order of their first start
    if not merged:
        return []
    if before_rewrite is not None:
        before_rewrite()
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for kept, *others in merged:
        wait = wait_nodes(kept)[0]
        waits = [wait_nodes(other)[0] for other in others]
        first = min(waits, key=position.__getitem__)
        if position[first] < position[wait]:
            first.prepend(wait)
        for other, other_wait in zip(others, waits):
            other_wait.replace_all_uses_with(wait)
            gm.graph.erase_node(other_wait)
            gm.graph.erase_node(other)
    names = [tuple(n.name for n in run) for run in merged]
    log.info("overlapc: merged %d identical collectives into %d: %s",
             sum(len(n) - 1 for n in names), len(names), "; ".join(", ".join(n) for n in names))
    return names


def _identical(a: fx.Node, b: fx.Node) -> bool:
    """Whether starts ``a`` and ``b`` have the same op and arguments (``_key``: nodes by
    identity, lists as tuples); the input nodes are compared first, unhashed."""
    return (a.target == b.target and list(a._input_nodes) == list(b._input_nodes)
            and _key(a.args) == _key(b.args) and _key(a.kwargs) == _key(b.kwargs))


def _key(value):
    """A hashable form of a node's arguments: nodes by identity, lists as tuples."""
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in value.items())
    return (type(value).__name__, repr(value))


def bucket_collectives(gm: fx.GraphModule, bucket: str | int = "auto",
                       before_rewrite: Callable[[], None] | None = None,
                       structure: Structure | None = None, headroom: Headroom | None = None) -> list[BucketNote]:
    """Merge ``gm``'s all-gathers and reduce-scatters into buckets (rules in the
    module docstring), in place. ``bucket``: "auto", "module" or an int byte target >= 1.
    ``before_rewrite`` is called once just before the graph is first changed (not when
    nothing merges): the pipeline saves a copy there to roll back to. ``structure``:
    ``Structure(gm)`` when the caller has built it (the pipeline reuses it when
    nothing merged). ``headroom``: the ``memory.Headroom`` of ``gm`` as it stands (its
    serial order), when a bucket must not raise that order's peak (the "serial-peak"
    budget): a bucket then forms only where its copies fit it (``_fits_headroom``)."""
    if bucket not in BUCKET_MODES and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise ValueError(f'bucket_collectives: bucket must be "auto", "module" or an int byte target >= 1, '
                         f"got {bucket!r}")
    s = structure if structure is not None else Structure(gm)
    plans = []
    kernels: Kernels | None = None
    for kind in _OPS:
        lanes = _lanes(s, kind)
        largest = _largest(lanes)
        if kernels is None and any(len(lane) > 1 for lane in lanes.values()):
            kernels = Kernels(s)
        plans += [(kind, members) for lane in lanes.values()
                  for members in _split(lane, bucket, largest[lane[0].c.group], kernels, headroom)]
    notes: list[BucketNote] = []
    if plans:
        if before_rewrite is not None:
            before_rewrite()
        rewrite = _Rewrite(gm, s)
        with rewrite.fake.mode:   # entered once for every new node's fake value
            for kind, members in plans:
                note = getattr(rewrite, kind)(members)
                log.debug("overlapc: bucket %s (%s, group %s, %d bytes): %s", note.start, kind, note.group,
                          note.nbytes, ", ".join(note.members))
                notes.append(note)
        rewrite.finish()
        gm.graph.lint()
    meta.add_notes(gm, meta.BUCKETS, notes)
    return notes


# ---------------------------------------------------------------- who may merge


@dataclasses.dataclass
class _Member:
    """A collective that may join a bucket, with what the plan needs of it."""

    c: Collective
    wait: fx.Node
    input: fx.Node
    value: torch.Tensor        # the input's (fake) value
    out_shape: tuple[int, ...]
    nbytes: int                # all-gather output / reduce-scatter input
    ready: int                 # position of the last node its start bundle reads (-1: none)
    target: int                # position of its wait's first real consumer (or region end)
    target_node: fx.Node

    @functools.cached_property
    def source(self) -> str:
        """The graph input it moves, "" unknown (``collectives.source_of``); looked up for the
        bucket notes only (the original start stays until the rewrite finishes)."""
        return source_of(self.c.start)

    @functools.cached_property
    def module(self) -> str:
        """Module path of the start, else of its first real consumer ("" unknown); looked
        up only when a rule needs it (a lookup walks the node's module stack)."""
        found = module_path(self.c.start)
        return found or (module_path(self.target_node) if self.target_node.op == "call_function" else "")


def _lanes(s: Structure, kind: str) -> dict[tuple, list[_Member]]:
    """Members of ``kind`` by lane (region, group, group size, dtype, reduce op), each in merge order.
    Pieces of a chunked collective (``gm.meta["overlapc_chunks"]``) are no members: one
    bucket would undo their pipeline."""
    pieces = {name for note in meta.notes(s.gm, meta.CHUNKS) for name in note.pieces}
    members = [m for c in s.movable if c.op == _OPS[kind] and c.start.name not in pieces
               for m in [_member(s, c)] if m is not None]
    if kind == "all_gather":
        members.sort(key=lambda m: s.key[m.c.start])
    else:
        members.sort(key=lambda m: s.pos[m.c.start])
    lanes: dict[tuple, list[_Member]] = {}
    for m in members:   # all-gathers of several dtypes merge as bytes (_as_bytes); reductions need one dtype
        reduce_op = _argument(m.c.start, 1, "reduce_op") if kind != "all_gather" else ""
        dtype = str(m.value.dtype) if kind != "all_gather" else ""
        key = (s.region_of(m.c.start), m.c.group, m.c.group_size, dtype, str(reduce_op))
        lanes.setdefault(key, []).append(m)
    return lanes


def _member(s: Structure, c: Collective) -> _Member | None:
    """``c`` as a bucket member, or None when it must stay as it is."""
    start = c.start
    if len(c.waits) != 1 or len(start.users) != 1 or c.waits[0].args[0] is not start:
        return None
    wait = c.waits[0]
    x = start.args[0] if start.args else start.kwargs.get("input")
    value, out = node_value(x) if isinstance(x, fx.Node) else None, node_value(start)
    if not (isinstance(c.group_size, int) or c.kind == "all_reduce") or not _static(value) or not _static(out):
        return None
    _check_shapes(c, value, out)
    target = s.target[wait]
    inputs = s.bundle_inputs[start]
    if target in s.start_of_member or any(i in s.wait_of_member for i in inputs) or any(
            u in s.start_of_member for u in s.consumers[wait]):
        return None   # tied to another collective's bundle: moving one would move the other
    gathered = c.kind == "all_gather"
    return _Member(
        c=c, wait=wait, input=x, value=value, out_shape=tuple(out.shape),
        nbytes=(out if gathered else value).numel() * value.element_size(),
        ready=max((s.pos[i] for i in inputs), default=-1), target=s.pos[target], target_node=target,
    )


def _static(value) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape)


def _check_shapes(c: Collective, value: torch.Tensor, out: torch.Tensor) -> None:
    world = c.group_size
    if c.kind == "all_gather":
        fits = out.numel() == world * value.numel() and out.dtype == value.dtype
    elif c.kind == "all_reduce":
        fits = out.shape == value.shape and out.dtype == value.dtype
    else:
        fits = value.dim() > 0 and value.shape[0] % world == 0 and out.numel() * world == value.numel()
    if not fits:
        raise ValueError(f"bucket_collectives: node {c.start.name} (op {c.op}, group {c.group}): "
                         f"input {tuple(value.shape)} {value.dtype} and output {tuple(out.shape)} "
                         f"{out.dtype} do not fit group size {world}")


def _argument(node: fx.Node, index: int, name: str):
    return node.args[index] if index < len(node.args) else node.kwargs[name]


def _largest(lanes: dict[tuple, list[_Member]]) -> dict[str, int]:
    """Group -> bytes of its largest member in any of ``lanes`` (one kind's)."""
    largest: dict[str, int] = {}
    for members in lanes.values():
        for m in members:
            largest[m.c.group] = max(largest.get(m.c.group, 0), m.nbytes)
    return largest


def _split(lane: list[_Member], bucket: str | int, largest: int, kernels: Kernels,
           headroom: Headroom | None = None) -> list[list[_Member]]:
    """Consecutive members of ``lane`` cut into buckets; buckets of one dropped.
    ``largest``: the byte target of ``bucket="auto"``; ``kernels``: ``Kernels`` of the graph;
    ``headroom``: see ``bucket_collectives``. O(1) a member (``_Bucket`` keeps what the rules read)."""
    buckets: list[_Bucket] = []
    for m in lane:
        if buckets and _joins(buckets[-1], m, bucket, largest) and _keeps_hiding(buckets[-1], m, kernels, largest) and (
                headroom is None or _fits_headroom(buckets[-1], m, headroom)):
            buckets[-1].add(m)
        else:
            buckets.append(_Bucket([m], m.ready, m.target, m.nbytes, m, m.target, m.ready))
    return [b.members for b in buckets if len(b.members) > 1]


@dataclasses.dataclass
class _Bucket:
    """A bucket ``_split`` is filling: its members and what ``_joins`` and
    ``_fits_headroom`` read of them, updated as each member joins."""

    members: list[_Member]
    ready: int          # the latest member's ready position
    target: int         # the earliest member's target position
    nbytes: int         # the members' bytes
    soonest: _Member    # the (first) member with the earliest target
    last_target: int    # the latest target
    first_ready: int    # the earliest ready position

    def add(self, m: _Member) -> None:
        self.members.append(m)
        self.ready, self.target = max(self.ready, m.ready), min(self.target, m.target)
        self.nbytes += m.nbytes
        self.soonest = m if m.target < self.soonest.target else self.soonest
        self.last_target, self.first_ready = max(self.last_target, m.target), min(self.first_ready, m.ready)


def _joins(open_bucket: _Bucket, m: _Member, bucket: str | int, largest: int) -> bool:
    """Whether ``m`` may join ``open_bucket``."""
    if max(m.ready, open_bucket.ready) >= min(m.target, open_bucket.target):
        return False   # one member's input is ready only after another's result is needed
    limit = {"auto": largest, "module": DEFAULT_BUCKET_BYTES}.get(bucket, bucket)
    fits = open_bucket.nbytes + m.nbytes <= limit
    if bucket != "module" and not fits:
        return False   # (before the module lookup: bytes are cheap to compare)
    if bucket in BUCKET_MODES:
        block = block_of(m.module)
        if block != block_of(open_bucket.members[0].module):
            return False
        if block and bucket == "module":
            return True
    return fits


def _keeps_hiding(open_bucket: _Bucket, m: _Member, kernels: Kernels, largest: int) -> bool:
    """Whether merging ``m`` into ``open_bucket`` keeps the members' hiding intervals.

    A member alone can be hidden by the kernels of its window, between its inputs' ready
    point and its first real consumer. A bucket is one collective: issued once every
    member's input is ready and waited before any member's result is needed, so only the
    kernels of the members' common window can hide it. The kernels outside that window
    are lost to the members whose windows held them (a hiding kernel that reads another
    member's result, one that produces another member's input, an interval nested in
    another's). Without an estimate, one kernel is taken to hide one collective the size
    of the group's largest (``largest``; upstream's tests take a matmul to hide one
    collective), a bucket counting as its bytes in such units, rounded to the nearest and
    at least one (its latency is paid once, so a small member's bytes ride along with a
    large one's). The merge keeps the hiding intervals when the common window still holds
    that many kernels, or every kernel the members' windows offer, whichever is fewer.
    Every member's window contains the common one, so the windows together span
    (earliest ready, latest target)."""
    ready, target = max(open_bucket.ready, m.ready), min(open_bucket.target, m.target)
    offered = kernels.between(min(open_bucket.first_ready, m.ready), max(open_bucket.last_target, m.target))
    unit = max(largest, 1)
    needed = max(1, (2 * (open_bucket.nbytes + m.nbytes) + unit) // (2 * unit))
    return kernels.between(ready, target) >= min(needed, offered)


class Kernels:
    """Counts of the graph's hiding kernels by position: compute that is a kernel of its own.

    Not counted: what moves with collectives (start and wait bundles, waits), other
    collectives and barriers, aliases and casts (``collectives.is_cheap``), and pointwise
    ops and reductions: Inductor fuses those into the loops of their neighbours (and may
    move them across a wait), so a window of them alone hides nothing. Counted: matmuls,
    convolutions, attention, anything else that runs as a kernel of its own."""

    def __init__(self, s: Structure):
        self._before = [0]   # _before[i]: kernels among s.nodes[:i]
        fused_by_target: dict[int, bool] = {}   # call targets live as long as the graph's nodes
        for node in s.nodes:
            self._before.append(self._before[-1] + _is_kernel(node, s, fused_by_target))

    def between(self, low: int, high: int) -> int:
        """Kernels at positions strictly between ``low`` and ``high``."""
        low, high = max(low + 1, 0), min(high, len(self._before) - 1)
        return self._before[high] - self._before[low] if high > low else 0


def _is_kernel(node: fx.Node, s: Structure, fused_by_target: dict[int, bool]) -> bool:
    """Whether ``node`` is a hiding kernel (``Kernels``); ``fused_by_target`` caches what its
    call target decides."""
    if node.op != "call_function" or node in s.bundled or is_cheap(node):
        return False
    fused = fused_by_target.get(id(node.target))
    if fused is None:
        start, wait, barrier = role(node)
        tags = getattr(node.target, "tags", ())
        fused = fused_by_target[id(node.target)] = (
            start is not None or wait or barrier is not None
            or torch.Tag.pointwise in tags or torch.Tag.reduction in tags)
    return not fused


def _fits_headroom(open_bucket: _Bucket, m: _Member, headroom: Headroom) -> bool:
    """Whether a bucket of ``open_bucket``'s members and ``m`` keeps the peak of the serial
    order that ``headroom`` measured, counting what the bucket holds beyond its members
    gathered one at a time (conservatively: none of the members' own bytes taken off). An
    all-gather bucket of B bytes: at its copy-out the flat result and the copy (2B, less the
    first member's own result, which the serial order holds there), then the copy until the
    last member's consumer (B). A reduce-scatter or all-reduce bucket: from its first
    member's input to its last, the inputs held for the pack and the packed copy (2B)."""
    total = open_bucket.nbytes + m.nbytes
    if m.c.kind == "all_gather":
        first = open_bucket.soonest if open_bucket.soonest.target <= m.target else m
        last_target = max(open_bucket.last_target, m.target)
        return (headroom.least(first.target, first.target) >= 2 * total - first.nbytes
                and headroom.least(first.target, last_target) >= total)
    first_ready = max(0, min(open_bucket.first_ready, m.ready))
    return headroom.least(first_ready, max(first_ready, open_bucket.ready, m.ready)) >= 2 * total


def _as_bytes(members: list[_Member]) -> bool:
    """Whether an all-gather bucket of ``members`` moves bytes: they have several dtypes.
    Each member's shard is packed as its bytes (``overlapc.pack`` with ``as_bytes``), one
    all-gather of uint8 moves them all, and each gathered block is viewed back as its dtype:
    the same bytes in the same places, so the values are bit-identical."""
    return len({str(m.value.dtype) for m in members}) > 1


def _flat_size(m: _Member, as_bytes: bool) -> int:
    """``m``'s shard in units of its bucket's flat buffer: elements, or bytes."""
    return m.value.numel() * (m.value.element_size() if as_bytes else 1)


def block_of(path: str) -> str:
    """The block a module path belongs to: up to its first numeric segment
    ("layers.3.attention.wq" -> "layers.3"), else its top-level module ("" for "")."""
    parts = path.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index + 1])
    return parts[0]


# ---------------------------------------------------------------- the rewrite


class _Rewrite:
    """New nodes and moved nodes of every bucket, placed by sort key and applied at once.

    Original node at position p: key (p, 0, 0). A node placed "before position a":
    (a, -1, n) with n counting placements, so placements keep the order they were made in."""

    def __init__(self, gm: fx.GraphModule, s: Structure):
        self.gm, self.s, self.graph = gm, s, gm.graph
        self.key: dict[fx.Node, tuple[int, int, int]] = {n: (i, 0, 0) for i, n in enumerate(s.nodes)}
        self.count = itertools.count()
        self.fake = FakeValues(gm)
        self.replaced: list[fx.Node] = []   # original waits and starts, erased at the end

    def all_gather(self, members: list[_Member]) -> BucketNote:
        """One all-gather for ``members``; of several dtypes, it moves their bytes
        (``_as_bytes``), laid out widest element first so that every member's bytes
        start at a multiple of its element size."""
        as_bytes = _as_bytes(members)
        if as_bytes:
            members = sorted(members, key=lambda m: -m.value.element_size())   # stable
        first, world = members[0], members[0].c.group_size
        anchor = min(m.target for m in members)
        self._move_input_chains(members, anchor)
        shard = self._new(anchor, OPS.pack.default, ([m.input for m in members], 1, *([True] if as_bytes else [])),
                          like=first.c.start, input_chain=True)
        start = self._new(anchor, F.all_gather_into_tensor.default,
                          (shard, world, _argument(first.c.start, 2, "group_name")),
                          like=first.c.start, name="all_gather_bucket")
        wait = self._new(anchor, F.wait_tensor.default, (start,), like=first.wait)
        sizes = [_flat_size(m, as_bytes) for m in members]
        rows = self._new(anchor, aten.view.default, (wait, [world, sum(sizes)]), like=first.wait)
        offsets = dict(zip((m.c.start for m in members), itertools.accumulate([0, *sizes])))
        shared = [m for m in members if not self._reaches_output(m)]
        if len(shared) > 1:
            self._copy_out_together(shared, rows, offsets, anchor, as_bytes)
        together = {m.c.start for m in shared} if len(shared) > 1 else set()
        for m in members:
            if m.c.start in together:
                continue
            offset = offsets[m.c.start]
            columns = self._new(m.target, aten.slice.Tensor, (rows, 1, offset, offset + _flat_size(m, as_bytes)),
                                like=m.wait)
            copy = self._new(m.target, aten.clone.default, (columns,),
                             {"memory_format": torch.contiguous_format}, like=m.wait)
            self._replace(m, self._typed(m, copy, m.target, as_bytes), m.target)
        return self._note("all_gather", start, members)

    def _typed(self, m: _Member, flat: fx.Node, anchor: int, as_bytes: bool) -> fx.Node:
        """``m``'s gathered value from ``flat``, its contiguous block of the gathered buffer
        (bytes when ``as_bytes``: viewed back as its dtype first, no copy)."""
        if as_bytes:
            flat = self._new(anchor, aten.view.dtype, (flat, m.value.dtype), like=m.wait)
        return self._new(anchor, aten.view.default, (flat, list(m.out_shape)), like=m.wait)

    def reduce_scatter(self, members: list[_Member]) -> BucketNote:
        first, world = members[0], members[0].c.group_size
        anchor = self._issue_point(members)
        self._move_input_chains(members, anchor)
        flat = self._new(anchor, OPS.pack.default, ([m.input for m in members], world), like=first.c.start,
                         input_chain=True)
        sizes = [m.value.numel() // world for m in members]
        start = self._new(anchor, F.reduce_scatter_tensor.default,
                          (flat, _argument(first.c.start, 1, "reduce_op"), world,
                           _argument(first.c.start, 3, "group_name")),
                          like=first.c.start, name="reduce_scatter_bucket")
        wait = self._new(anchor, F.wait_tensor.default, (start,), like=first.wait)
        for m, offset, size in zip(members, itertools.accumulate([0, *sizes]), sizes):
            piece = self._new(anchor, aten.slice.Tensor, (wait, 0, offset, offset + size), like=m.wait)
            result = self._new(anchor, aten.view.default, (piece, list(m.out_shape)), like=m.wait)
            self._replace(m, result, anchor)
        return self._note("reduce_scatter", start, members)

    def all_reduce(self, members: list[_Member]) -> BucketNote:
        first = members[0]
        anchor = self._issue_point(members)
        self._move_input_chains(members, anchor)
        flat = self._new(anchor, OPS.pack.default, ([m.input for m in members], 1), like=first.c.start,
                         input_chain=True)
        start = self._new(anchor, F.all_reduce.default,
                          (flat, _argument(first.c.start, 1, "reduce_op"), _argument(first.c.start, 2, "group_name")),
                          like=first.c.start, name="all_reduce_bucket")
        wait = self._new(anchor, F.wait_tensor.default, (start,), like=first.wait)
        sizes = [m.value.numel() for m in members]
        for m, offset, size in zip(members, itertools.accumulate([0, *sizes]), sizes):
            piece = self._new(anchor, aten.slice.Tensor, (wait, 0, offset, offset + size), like=m.wait)
            result = self._new(anchor, aten.view.default, (piece, list(m.out_shape)), like=m.wait)
            self._replace(m, result, anchor)
        return self._note("all_reduce", start, members)

    def _copy_out_together(self, members: list[_Member], rows: fx.Node, offsets: dict, anchor: int,
                           as_bytes: bool) -> None:
        """One copy of ``members``' columns of ``rows`` (world, total) into a member-major
        buffer (member i's (world, n_i) block contiguous), placed before ``anchor``: one
        ``overlapc.unpack_columns`` call, no generated kernel; each member's result is a view of it."""
        world = members[0].c.group_size
        sizes = [_flat_size(m, as_bytes) for m in members]
        joined = self._new(anchor, OPS.unpack_columns.default,
                           (rows, [offsets[m.c.start] for m in members], sizes), like=members[0].wait)
        for m, at, size in zip(members, itertools.accumulate([0, *sizes]), sizes):
            piece = self._new(anchor, aten.slice.Tensor, (joined, 0, world * at, world * (at + size)), like=m.wait)
            self._replace(m, self._typed(m, piece, anchor, as_bytes), anchor)

    def _reaches_output(self, m: _Member) -> bool:
        """Whether ``m``'s gathered result (or a view of it) is a graph output: it gets a copy of
        its own, so that no other member's bytes stay alive with it."""
        return any(user.op == "output" for node in self.s.wait_bundle[m.wait] for user in node.users)

    def finish(self) -> None:
        """Erase the replaced collectives and put every node at its key."""
        for node in self.replaced:
            self.graph.erase_node(node)
            del self.key[node]
        apply_order(self.gm, sorted(self.graph.nodes, key=self.key.__getitem__))

    # ---- pieces

    def _issue_point(self, members: list[_Member]) -> int:
        """Position of the first node after every input of ``members`` is ready, in
        their region, and not a placeholder: a reduce-scatter bucket stands before it."""
        region = self.s.region_of(members[0].c.start)
        position = max(max(m.ready for m in members) + 1,
                       self.s.barrier_pos[region - 1] + 1 if region else 0)
        while self.s.nodes[position].op == "placeholder":
            position += 1
        return position

    def _move_input_chains(self, members: list[_Member], anchor: int) -> None:
        for m in members:
            for node in self.s.start_bundle[m.c.start]:
                if node is not m.c.start:
                    self._place(node, anchor)

    def _replace(self, m: _Member, result: fx.Node, anchor: int) -> None:
        """``result`` (placed before position ``anchor``) stands for ``m``'s wait from now
        on; the views of the wait that stood before ``anchor`` move after ``result``."""
        m.wait.replace_all_uses_with(result)
        for view in self.s.wait_bundle[m.wait][1:]:
            if self.s.pos[view] < anchor:
                self._place(view, anchor)
        self.replaced += [m.wait, m.c.start]

    def _new(self, anchor: int, target, args, kwargs=None, *, like: fx.Node, name: str | None = None,
             input_chain: bool = False) -> fx.Node:
        node = new_node(self.graph, self.fake, target, args, kwargs, like=like,
                        name=name or target.overloadpacket.__name__)
        if input_chain:
            meta.mark_input_chain(node)
        self._place(node, anchor)
        return node

    def _place(self, node: fx.Node, anchor: int) -> None:
        self.key[node] = (anchor, -1, next(self.count))

    @staticmethod
    def _note(kind: str, start: fx.Node, members: list[_Member]) -> BucketNote:
        return BucketNote(start=start.name, kind=kind, group=members[0].c.group,
                          nbytes=sum(m.nbytes for m in members),
                          members=tuple(m.c.start.name for m in members),
                          modules=tuple(m.module for m in members),
                          sources=tuple(m.source for m in members))

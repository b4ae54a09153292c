"""Merge small all-gathers (reduce-scatters, all-reduces) into one collective per bucket.

    notes = bucket_collectives(gm, bucket="auto" | "module" | byte_target | plan)   # in place; the caller recompiles

This module plans which collectives merge; ``bucket_rewrite.py`` rewrites the graph
(``BucketNote``, the copies); ``duplicates.py`` holds ``merge_duplicates``, which the
pipeline runs first (both names are exported here).

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
* ``bucket=<plan>`` (a tuple of entries, each a tuple of module paths, as
  ``options.bucket_plan`` makes it): the member belongs to another entry. A
  member's entry is the one naming its module path or the longest prefix of it
  ("layers.3" holds "layers.3.attention.wq"); a member of no entry stays alone.
  No byte limit, and none of the rules below but the first: the plan is the
  user's, so a bucket forms even where it loses a member's hiding interval, and
  costs what it holds (as under "module");
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
  consumer), or the member's result or input is tied to another collective
  (a level of a chain) and the bucket is packed, or its start bundle reads a
  member's result (the next level): in coalesced buckets (``coalesced``,
  below) reduce-scatters and all-reduces of one chain level merge (HSDP's, the
  two levels of loss-parallel's all-reduces), never two levels; packed, chains
  stay apart: the pack copies of HSDP's merged levels raised graph_trainer's
  70B HSDP estimated step 6,730 -> 6,850 ms under "module" (6,736 -> 6,856
  under "auto"), coalesced 6,731 (docs/performance.md);
* in every mode but a plan: the bucket would lose a member's hiding interval
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

With ``coalesced`` (``bucket_op="coalesced"``) a reduce-scatter or all-reduce bucket is
instead one ``reduce_scatter_tensor_coalesced`` / ``all_reduce_coalesced`` over the members'
inputs as they are: no pack copy and no slices, member i's result is output i's own wait,
each member reduced as alone (values bit-identical); chain levels may merge (above). All-gather
buckets stay packed.

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
chunked collective (``passes/chunk/``'s notes name them), and all-gathers in a
chain (their result feeds, or their input comes from, another collective's
bundle: the copy-out would stand inside it); in packed buckets, any collective
in a chain.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
from typing import Callable

import torch
import torch.fx as fx

from overlapc.passes import meta
from overlapc.passes.bucket_rewrite import BucketNote, Member, Rewrite, call_argument
from overlapc.passes.collectives import Collective, node_value
from overlapc.passes.duplicates import merge_duplicates
from overlapc.passes.memory import Headroom
from overlapc.passes.options import bucket_plan, is_plan
from overlapc.passes.structure import Kernels, Structure

__all__ = ["BUCKET_MODES", "BucketNote", "DEFAULT_BUCKET_BYTES", "block_of", "bucket_collectives", "merge_duplicates"]

log = logging.getLogger("overlapc")

# Byte target where the graph records no module: large enough that per-collective
# latency stops mattering (on gloo one 10 MiB all-gather took a third of the time
# of the same bytes in 60 pieces), small enough that one bucket is a small share
# of a model's gathered parameters (a Llama-8B block is ~400 MiB in bf16).
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

BUCKET_MODES = ("auto", "module")
_OPS = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor", "all_reduce": "all_reduce"}


def bucket_collectives(gm: fx.GraphModule, bucket: str | int | tuple = "auto",
                       before_rewrite: Callable[[], None] | None = None,
                       structure: Structure | None = None, headroom: Headroom | None = None,
                       coalesced: bool = False) -> list[BucketNote]:
    """Merge ``gm``'s all-gathers and reduce-scatters into buckets (rules in the
    module docstring), in place. ``bucket``: "auto", "module", an int byte target >= 1 or a
    plan (``options.bucket_plan``'s tuple of tuples of module paths).
    ``before_rewrite`` is called once just before the graph is first changed (not when
    nothing merges): the pipeline saves a copy there to roll back to. ``structure``:
    ``Structure(gm)`` when the caller has built it (the pipeline reuses it when
    nothing merged). ``headroom``: the ``memory.Headroom`` of ``gm`` as it stands (its
    serial order), when a bucket must not raise that order's peak (the "serial-peak"
    budget): a bucket then forms only where its copies fit it (``_fits_headroom``)."""
    if not is_plan(bucket) and bucket not in BUCKET_MODES and (
            isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise ValueError(f'bucket_collectives: bucket must be "auto", "module", an int byte target >= 1 or a '
                         f"plan, got {bucket!r}")
    if is_plan(bucket):
        bucket = _Plan(bucket_plan(bucket, "bucket_collectives"))
    s = structure if structure is not None else Structure(gm)
    plans = []
    for kind in _OPS:
        lanes = _lanes(s, kind, coalesced) if _two_may_fit(s, kind, bucket) else {}
        largest = _largest(lanes)
        mergeable = [lane for lane in lanes.values() if _may_merge(lane, bucket, largest[lane[0].c.group])]
        plans += [(kind, members) for lane in mergeable
                  for members in _split(lane, bucket, largest[lane[0].c.group], s.kernels, headroom, coalesced)]
        if isinstance(bucket, _Plan):
            bucket.matched.update(bucket.entry_of(m.module) for lane in lanes.values() for m in lane)
    if isinstance(bucket, _Plan):
        bucket.log_unmatched()
    notes: list[BucketNote] = []
    if plans:
        if before_rewrite is not None:
            before_rewrite()
        rewrite = Rewrite(gm, s, coalesced)
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


def _lanes(s: Structure, kind: str, chains: bool) -> dict[tuple, list[Member]]:
    """Members of ``kind`` by lane (region, group, group size, dtype, reduce op), each in merge order.
    Pieces of a chunked collective (``gm.meta["overlapc_chunks"]``) are no members: one
    bucket would undo their pipeline. ``chains``: see ``_member``."""
    members = [m for c in _candidates(s, kind) for m in [_member(s, c, chains)] if m is not None]
    if kind == "all_gather":
        members.sort(key=lambda m: s.key[m.c.start])
    else:
        members.sort(key=lambda m: s.pos[m.c.start])
    lanes: dict[tuple, list[Member]] = {}
    for m in members:   # all-gathers of several dtypes merge as bytes (_as_bytes); reductions need one dtype
        reduce_op = call_argument(m.c.start, 1, "reduce_op") if kind != "all_gather" else ""
        dtype = str(m.value.dtype) if kind != "all_gather" else ""
        key = (s.region_of(m.c.start), m.c.group, m.c.group_size, dtype, str(reduce_op))
        lanes.setdefault(key, []).append(m)
    return lanes


def _candidates(s: Structure, kind: str) -> list[Collective]:
    """The movable collectives of ``kind`` that may be members, in graph order. Pieces of a
    chunked collective (``gm.meta["overlapc_chunks"]``) are none: one bucket would undo
    their pipeline."""
    pieces = {name for note in meta.notes(s.gm, meta.CHUNKS) for name in note.pieces}
    return [c for c in s.movable if c.op == _OPS[kind] and c.start.name not in pieces]


def _two_may_fit(s: Structure, kind: str, bucket: "str | int | _Plan") -> bool:
    """Whether two members of ``kind`` may share a bucket by their bytes (False: no lane of
    ``_lanes`` holds two neighbours that fit, nothing needs planning). Under "module" or a
    plan they may; under "auto" or a byte target, when in some group the two smallest collectives
    that pass ``_own_shapes`` fit the target together (under "auto", the group's largest of
    them): members are some of those, of the same bytes, so their two smallest are no
    smaller and their largest no larger. Raises ``_member``'s ValueError, in ``_lanes``' order."""
    if _by_modules(bucket):
        return True
    sizes: dict[str, list[int]] = {}
    for c in _candidates(s, kind):
        shapes = _own_shapes(c)
        if shapes is not None:
            sizes.setdefault(c.group, []).append(_member_bytes(c, *shapes))
    for found in sizes.values():
        if len(found) > 1 and sum(heapq.nsmallest(2, found)) <= (max(found) if bucket == "auto" else bucket):
            return True
    return False


def _by_modules(bucket: "str | int | _Plan") -> bool:
    """Whether ``bucket`` cuts by modules with no byte target ("module", a plan)."""
    return bucket == "module" or isinstance(bucket, _Plan)


def _own_shapes(c: Collective) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input value, output value) of ``c`` when its own nodes let it be a member (one wait,
    its only user; static shapes; a group size), else None. ValueError when its shapes
    contradict its group size (``_check_shapes``)."""
    start = c.start
    if len(c.waits) != 1 or len(start.users) != 1 or c.waits[0].args[0] is not start:
        return None
    x = _input_of(start)
    value, out = node_value(x) if isinstance(x, fx.Node) else None, node_value(start)
    if not (isinstance(c.group_size, int) or c.kind == "all_reduce") or not _static(value) or not _static(out):
        return None
    _check_shapes(c, value, out)
    return value, out


def _input_of(start: fx.Node):
    """The tensor argument a collective ``start`` sends."""
    return start.args[0] if start.args else start.kwargs.get("input")


def _member_bytes(c: Collective, value: torch.Tensor, out: torch.Tensor) -> int:
    """A member's bytes: the all-gather's output, the reduce-scatter's or all-reduce's input."""
    return (out if c.kind == "all_gather" else value).numel() * value.element_size()


def _member(s: Structure, c: Collective, chains: bool) -> Member | None:
    """``c`` as a bucket member, or None when it must stay as it is. ``chains`` (coalesced
    buckets): a reduce-scatter or all-reduce tied to another collective (a level of a chain)
    may be one."""
    shapes = _own_shapes(c)
    if shapes is None:
        return None
    value, out = shapes
    start, wait, x = c.start, c.waits[0], _input_of(c.start)
    target = s.target[wait]
    inputs = s.bundle_inputs[start]
    chained = target in s.start_of_member or any(i in s.wait_of_member for i in inputs) or any(
        u in s.start_of_member for u in s.consumers[wait])
    if chained and (not chains or c.kind == "all_gather"):
        return None   # tied to another collective's bundle: moving one would move the other
    return Member(
        c=c, wait=wait, input=x, value=value, out_shape=tuple(out.shape), nbytes=_member_bytes(c, value, out),
        ready=max((s.pos[i] for i in inputs), default=-1), target=s.pos[target], target_node=target,
        after=tuple(s.coll_of_wait[s.wait_of_member[i]].start for i in inputs if i in s.wait_of_member),
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


def _largest(lanes: dict[tuple, list[Member]]) -> dict[str, int]:
    """Group -> bytes of its largest member in any of ``lanes`` (one kind's)."""
    largest: dict[str, int] = {}
    for members in lanes.values():
        for m in members:
            largest[m.c.group] = max(largest.get(m.c.group, 0), m.nbytes)
    return largest


def _may_merge(lane: list[Member], bucket: "str | int | _Plan", largest: int) -> bool:
    """Whether ``_split`` may merge any two members of ``lane`` (False: it keeps none, and
    nothing of the lane needs planning). Under "module" or a plan any two may; under "auto" (byte
    target ``largest``) or a byte target, two neighbours within the target: a bucket grows by
    the next member in lane order, and a bucket holds at least the member before it."""
    if _by_modules(bucket):
        return len(lane) > 1
    limit = largest if bucket == "auto" else bucket
    return any(a.nbytes + b.nbytes <= limit for a, b in zip(lane, lane[1:]))


def _split(lane: list[Member], bucket: "str | int | _Plan", largest: int, kernels: Kernels,
           headroom: Headroom | None = None, coalesced: bool = False) -> list[list[Member]]:
    """Consecutive members of ``lane`` cut into buckets; buckets of one dropped.
    ``largest``: the byte target of ``bucket="auto"``; ``kernels``: ``Kernels`` of the graph;
    ``headroom``, ``coalesced``: see ``bucket_collectives``. O(1) a member (``_Bucket`` keeps
    what the rules read)."""
    buckets: list[_Bucket] = []
    planned = isinstance(bucket, _Plan)
    for m in lane:
        if buckets and _joins(buckets[-1], m, bucket, largest) and (
                planned or _keeps_hiding(buckets[-1], m, kernels, largest)) and (
                headroom is None or _fits_headroom(buckets[-1], m, headroom, coalesced)):
            buckets[-1].add(m)
        else:
            buckets.append(_Bucket([m], m.ready, m.target, m.nbytes, m, m.target, m.ready, {m.c.start}))
    return [b.members for b in buckets if len(b.members) > 1]


@dataclasses.dataclass
class _Bucket:
    """A bucket ``_split`` is filling: its members and what ``_joins`` and
    ``_fits_headroom`` read of them, updated as each member joins."""

    members: list[Member]
    ready: int          # the latest member's ready position
    target: int         # the earliest member's target position
    nbytes: int         # the members' bytes
    soonest: Member    # the (first) member with the earliest target
    last_target: int    # the latest target
    first_ready: int    # the earliest ready position
    starts: set[fx.Node]   # the members' starts (membership only)

    def add(self, m: Member) -> None:
        self.members.append(m)
        self.starts.add(m.c.start)
        self.ready, self.target = max(self.ready, m.ready), min(self.target, m.target)
        self.nbytes += m.nbytes
        self.soonest = m if m.target < self.soonest.target else self.soonest
        self.last_target, self.first_ready = max(self.last_target, m.target), min(self.first_ready, m.ready)


def _joins(open_bucket: _Bucket, m: Member, bucket: "str | int | _Plan", largest: int) -> bool:
    """Whether ``m`` may join ``open_bucket``."""
    if max(m.ready, open_bucket.ready) >= min(m.target, open_bucket.target):
        return False   # one member's input is ready only after another's result is needed
    if any(start in open_bucket.starts for start in m.after):
        return False   # the next level of a chain: its start bundle reads a member's result
    if isinstance(bucket, _Plan):
        entry = bucket.entry_of(m.module)
        return entry is not None and entry == bucket.entry_of(open_bucket.members[0].module)
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


class _Plan:
    """A bucket plan (``options.bucket_plan``'s tuple of entries) and its lookup: the entry a
    module path belongs to, by the longest prefix of it that an entry names (cached per path)."""

    def __init__(self, entries: tuple[tuple[str, ...], ...]):
        self.entries = entries
        self.index = {path: i for i, paths in enumerate(entries) for path in paths}
        self._found: dict[str, int | None] = {}
        self.matched: set[int | None] = set()   # entries some member belongs to (membership only)

    def log_unmatched(self) -> None:
        """One INFO line naming the entries no collective of the graph belongs to (a misspelt
        module, or modules this graph does not hold: a forward graph's plan entry for the loss)."""
        unmatched = [paths for i, paths in enumerate(self.entries) if i not in self.matched]
        if unmatched:
            log.info("overlapc: bucket plan entries no collective of this graph belongs to: %s",
                     "; ".join(", ".join(paths) for paths in unmatched))

    def entry_of(self, module: str) -> int | None:
        """The index of the entry naming ``module`` or its longest prefix ("layers.3" for
        "layers.3.attention.wq"), or None."""
        if module not in self._found:
            parts = module.split(".") if module else []
            self._found[module] = next((self.index[p] for p in (".".join(parts[:n]) for n in range(len(parts), 0, -1))
                                        if p in self.index), None)
        return self._found[module]


def _keeps_hiding(open_bucket: _Bucket, m: Member, kernels: Kernels, largest: int) -> bool:
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


def _fits_headroom(open_bucket: _Bucket, m: Member, headroom: Headroom, coalesced: bool = False) -> bool:
    """Whether a bucket of ``open_bucket``'s members and ``m`` keeps the peak of the serial
    order that ``headroom`` measured, counting what the bucket holds beyond its members
    gathered one at a time (conservatively: none of the members' own bytes taken off). An
    all-gather bucket of B bytes: at its copy-out the flat result and the copy (2B, less the
    first member's own result, which the serial order holds there), then the copy until the
    last member's consumer (B). A reduce-scatter or all-reduce bucket: from its first
    member's input to its last, the inputs held for the pack and the packed copy (2B);
    ``coalesced`` (one ``*_coalesced`` op, no pack), the inputs alone (B)."""
    total = open_bucket.nbytes + m.nbytes
    if m.c.kind == "all_gather":
        first = open_bucket.soonest if open_bucket.soonest.target <= m.target else m
        last_target = max(open_bucket.last_target, m.target)
        return (headroom.least(first.target, first.target) >= 2 * total - first.nbytes
                and headroom.least(first.target, last_target) >= total)
    first_ready = max(0, min(open_bucket.first_ready, m.ready))
    return headroom.least(first_ready, max(first_ready, open_bucket.ready, m.ready)) >= (1 if coalesced else 2) * total


def block_of(path: str) -> str:
    """The block a module path belongs to: up to its first numeric segment
    ("layers.3.attention.wq" -> "layers.3"), else its top-level module ("" for "")."""
    parts = path.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index + 1])
    return parts[0]

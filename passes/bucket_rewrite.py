"""The bucket pass's rewrite: each bucket ``bucket.py`` planned becomes one collective, its
copy-in (``overlapc.pack``) and copy-out (``overlapc.unpack_columns``, or views), the
members' waits replaced and their starts erased. The layout and placement rules are
``bucket.py``'s docstring, "Rewrite". ``Member`` is what the plan and the rewrite share:
a collective that may join a bucket."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator

import torch
import torch.fx as fx

from overlapc.passes import bucket_ops, meta  # noqa: F401 (bucket_ops registers torch.ops.overlapc)
from overlapc.passes.collectives import Collective, module_path, source_of
from overlapc.passes.rewrite import FakeValues, new_node
from overlapc.passes.structure import Structure, apply_order


aten = torch.ops.aten
F = torch.ops._c10d_functional
OPS = torch.ops.overlapc   # bucket_ops' copy-in and copy-out


@dataclasses.dataclass
class Member:
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
    after: tuple[fx.Node, ...] = ()   # starts of the collectives whose results its start bundle reads (a chain)

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


def call_argument(node: fx.Node, index: int, name: str):
    """Argument ``name`` of a collective call, at ``index`` when passed by position."""
    return node.args[index] if index < len(node.args) else node.kwargs[name]


def _as_bytes(members: list[Member]) -> bool:
    """Whether an all-gather bucket of ``members`` moves bytes: they have several dtypes.
    Each member's shard is packed as its bytes (``overlapc.pack`` with ``as_bytes``), one
    all-gather of uint8 moves them all, and each gathered block is viewed back as its dtype:
    the same bytes in the same places, so the values are bit-identical."""
    return len({str(m.value.dtype) for m in members}) > 1


def _flat_size(m: Member, as_bytes: bool) -> int:
    """``m``'s shard in units of its bucket's flat buffer: elements, or bytes."""
    return m.value.numel() * (m.value.element_size() if as_bytes else 1)


class Rewrite:
    """New nodes and moved nodes of every bucket, placed by sort key and applied at once.

    Original node at position p: key (p, 0, 0). A node placed "before position a":
    (a, -1, n) with n counting placements, so placements keep the order they were made in."""

    def __init__(self, gm: fx.GraphModule, s: Structure, coalesced: bool = False):
        self.gm, self.s, self.graph = gm, s, gm.graph
        self.coalesced = coalesced   # reduce-scatter and all-reduce buckets as one *_coalesced op
        self.key: dict[fx.Node, tuple[int, int, int]] = {n: (i, 0, 0) for i, n in enumerate(s.nodes)}
        self.count = itertools.count()
        self.fake = FakeValues(gm)
        self.replaced: list[fx.Node] = []   # original waits and starts, erased at the end
        self.result_of: dict[fx.Node, fx.Node] = {}   # a replaced wait -> the node that stands for it

    def all_gather(self, members: list[Member]) -> BucketNote:
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
                          (shard, world, call_argument(first.c.start, 2, "group_name")),
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

    def _typed(self, m: Member, flat: fx.Node, anchor: int, as_bytes: bool) -> fx.Node:
        """``m``'s gathered value from ``flat``, its contiguous block of the gathered buffer
        (bytes when ``as_bytes``: viewed back as its dtype first, no copy)."""
        if as_bytes:
            flat = self._new(anchor, aten.view.dtype, (flat, m.value.dtype), like=m.wait)
        return self._new(anchor, aten.view.default, (flat, list(m.out_shape)), like=m.wait)

    def reduce_scatter(self, members: list[Member]) -> BucketNote:
        first, world = members[0], members[0].c.group_size
        anchor = self._issue_point(members)
        self._move_input_chains(members, anchor)
        reduce_op, group = call_argument(first.c.start, 1, "reduce_op"), call_argument(first.c.start, 3, "group_name")
        if self.coalesced:
            start = self._new(anchor, F.reduce_scatter_tensor_coalesced.default,
                              (self._inputs(members), reduce_op, world, group),
                              like=first.c.start, name="reduce_scatter_bucket")
            return self._coalesced_results("reduce_scatter", start, members, anchor)
        flat = self._new(anchor, OPS.pack.default, (self._inputs(members), world), like=first.c.start,
                         input_chain=True)
        sizes = [m.value.numel() // world for m in members]
        start = self._new(anchor, F.reduce_scatter_tensor.default, (flat, reduce_op, world, group),
                          like=first.c.start, name="reduce_scatter_bucket")
        wait = self._new(anchor, F.wait_tensor.default, (start,), like=first.wait)
        for m, offset, size in zip(members, itertools.accumulate([0, *sizes]), sizes):
            piece = self._new(anchor, aten.slice.Tensor, (wait, 0, offset, offset + size), like=m.wait)
            result = self._new(anchor, aten.view.default, (piece, list(m.out_shape)), like=m.wait)
            self._replace(m, result, anchor)
        return self._note("reduce_scatter", start, members)

    def all_reduce(self, members: list[Member]) -> BucketNote:
        first = members[0]
        anchor = self._issue_point(members)
        self._move_input_chains(members, anchor)
        reduce_op, group = call_argument(first.c.start, 1, "reduce_op"), call_argument(first.c.start, 2, "group_name")
        if self.coalesced:
            start = self._new(anchor, F.all_reduce_coalesced.default, (self._inputs(members), reduce_op, group),
                              like=first.c.start, name="all_reduce_bucket")
            return self._coalesced_results("all_reduce", start, members, anchor)
        flat = self._new(anchor, OPS.pack.default, (self._inputs(members), 1), like=first.c.start,
                         input_chain=True)
        start = self._new(anchor, F.all_reduce.default, (flat, reduce_op, group),
                          like=first.c.start, name="all_reduce_bucket")
        wait = self._new(anchor, F.wait_tensor.default, (start,), like=first.wait)
        sizes = [m.value.numel() for m in members]
        for m, offset, size in zip(members, itertools.accumulate([0, *sizes]), sizes):
            piece = self._new(anchor, aten.slice.Tensor, (wait, 0, offset, offset + size), like=m.wait)
            result = self._new(anchor, aten.view.default, (piece, list(m.out_shape)), like=m.wait)
            self._replace(m, result, anchor)
        return self._note("all_reduce", start, members)

    def _coalesced_results(self, kind: str, start: fx.Node, members: list[Member], anchor: int) -> BucketNote:
        """Member i's result is output i of the coalesced ``start``: its own wait (no copy, no view)."""
        for index, m in enumerate(members):
            item = self._new(anchor, operator.getitem, (start, index), like=m.wait, name="getitem")
            self._replace(m, self._new(anchor, F.wait_tensor.default, (item,), like=m.wait), anchor)
        return self._note(kind, start, members)

    def _copy_out_together(self, members: list[Member], rows: fx.Node, offsets: dict, anchor: int,
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

    def _reaches_output(self, m: Member) -> bool:
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

    def _issue_point(self, members: list[Member]) -> int:
        """Position of the first node after every input of ``members`` is ready, in
        their region, and not a placeholder: a reduce-scatter bucket stands before it."""
        region = self.s.region_of(members[0].c.start)
        position = max(max(m.ready for m in members) + 1,
                       self.s.barrier_pos[region - 1] + 1 if region else 0)
        while self.s.nodes[position].op == "placeholder":
            position += 1
        return position

    def _move_input_chains(self, members: list[Member], anchor: int) -> None:
        for m in members:
            for node in self.s.start_bundle[m.c.start]:
                if node is not m.c.start:
                    self._place(node, anchor)

    def _inputs(self, members: list[Member]) -> list[fx.Node]:
        """The members' inputs as the graph now stands: an input that was the wait of a
        collective bucketed before (one level up a chain) is that bucket's result."""
        return [self.result_of.get(m.input, m.input) for m in members]

    def _replace(self, m: Member, result: fx.Node, anchor: int) -> None:
        """``result`` (placed before position ``anchor``) stands for ``m``'s wait from now
        on; the views of the wait that stood before ``anchor`` move after ``result``."""
        m.wait.replace_all_uses_with(result)
        self.result_of[m.wait] = result
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
    def _note(kind: str, start: fx.Node, members: list[Member]) -> BucketNote:
        return BucketNote(start=start.name, kind=kind, group=members[0].c.group,
                          nbytes=sum(m.nbytes for m in members),
                          members=tuple(m.c.start.name for m in members),
                          modules=tuple(m.module for m in members),
                          sources=tuple(m.source for m in members))

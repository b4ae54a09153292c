"""Kernel points: where the scheduling core issues a start under ``issue="per-kernel"``.

Under the default ``issue="early"`` a start goes as soon as its inputs are placed (and
the bounds let it). Under ``"per-kernel"`` each start is held back to the hiding kernel
(``structure.Kernels``: a matmul, a convolution, attention; not a pointwise op or a
reduction, which Inductor fuses past a wait) it is to run under, one start per kernel:
collectives in the order of their first consumer, each takes the first kernel not yet
taken after its inputs and before its first consumer, in its region. The start then goes
right before that kernel, after the waits due there. A collective with no such kernel
left goes as under ``"early"``. This is the model of PyTorch's overlap scheduler (a
collective prefetched at the compute node that hides it) with its runtime estimate
replaced by overlapc's bucketing model (one kernel hides one collective): the buffers a
start allocates live for less, and a kernel that could hide several collectives hides one
(slower by estimate on the examples: docs/performance.md).

Kernels are shared by every group and kind: one start per kernel. Not held back: the
collectives of a process group that has a chain (a start that reads another collective's
result: chain points place them, and a lane of all-gathers held to kernels would hold a
chained one past its chain point), pipelined pieces (the chunk rewrite interleaves them),
collectives placed serially, and, under "serial-peak", collectives other than all-gathers
(the serial order keeps them where they stood). A start is held back no further than the
graph handed in keeps its inputs live (to each one's last reader, a collective reading it
holding it until its last wait: held back further, an input would stay live longer than
that graph keeps it), but an all-gather of graph inputs only (a parameter's shard, through
casts and views, which the training step keeps anyway). A kernel point only delays a start
past where ``"early"`` could put it, never past its first consumer; the bounds still apply
when it comes.

``KernelPoints`` plans them once, before the walk, for ``scheduler._Core``, which it is a
part of: it reads the core's state (``s``, ``spine``, ``serial``, ``budget``,
``move_starts``) and fills ``kernel_gate`` (start -> spine node) and ``kernel_gates_at``.
Deterministic: positions and graph order only.
"""
from __future__ import annotations

import bisect

import torch.fx as fx

from overlapc.passes.collectives import Collective
from overlapc.passes.inflight import piece_of


class KernelPoints:
    """The kernel-point planning of ``scheduler._Core`` (a mixin: the core's state is ``self``)."""

    def _plan_kernel_points(self, managed: list[Collective]) -> None:
        """Fill ``self.kernel_gate`` (start -> the spine node it is issued right before) and
        ``self.kernel_gates_at`` (spine node -> its starts, in graph order) when the budget
        issues "per-kernel" and starts move; empty otherwise."""
        self.kernel_gate: dict[fx.Node, fx.Node] = {}
        self.kernel_gates_at: dict[fx.Node, list[fx.Node]] = {}
        if self.budget.issue != "per-kernel" or not self.move_starts:
            return
        s, spine = self.s, self.spine
        index = {node: i for i, node in enumerate(spine)}
        spine_pos = [s.pos[node] for node in spine]
        kernels = [i for i, node in enumerate(spine) if s.kernels.at(s.pos[node])]
        free = list(range(len(kernels) + 1))   # kernel slot -> the next slot that may be free

        def first_free(slot: int) -> int:
            root = slot
            while free[root] != root:
                root = free[root]
            while free[slot] != root:   # path compression
                free[slot], slot = root, free[slot]
            return root

        links = [(c, s.coll_of_wait[s.wait_of_member[i]]) for c in managed for i in s.bundle_inputs[c.start]
                 if i in s.wait_of_member]   # (reader, upstream) of every chain
        chained = {c.group for link in links for c in link}
        spans = [(span, c) for c in managed if c.group not in chained
                 and (span := self._kernel_span(c, index, spine_pos)) is not None]
        for (lo, hi, _), c in sorted(spans, key=lambda item: (item[0][2], s.pos[item[1].start])):
            slot = first_free(bisect.bisect_left(kernels, lo))
            if slot < len(kernels) and kernels[slot] < hi:
                free[slot] = slot + 1
                node = spine[kernels[slot]]
                self.kernel_gate[c.start] = node
                self.kernel_gates_at.setdefault(node, []).append(c.start)
        for starts in self.kernel_gates_at.values():
            starts.sort(key=s.pos.__getitem__)

    def _kernel_span(self, c: Collective, index: dict[fx.Node, int], spine_pos: list[int]) \
            -> tuple[int, int, int] | None:
        """(lo, hi, due): the spine indices between which ``c`` (of a group with no chain) may
        take a kernel, after every input of its start bundle and its region's first node,
        before its first wait's spine target (``due``) and where its inputs stay live; None
        when ``c`` is not held back (module docstring). ``index``: spine node -> index;
        ``spine_pos``: index -> graph position."""
        s = self.s
        if c.start in self.serial or piece_of(c) != c.start.name:   # (a gated start's group has a chain)
            return None
        lo = 0
        for i in s.bundle_inputs[c.start]:
            if i not in index:   # another collective's member
                return None
            lo = max(lo, index[i] + 1)
        targets = [s.spine_target.get(w) for w in c.waits]
        if not targets or any(t is None for t in targets):
            return None
        hi = due = min(index[t] for t in targets)
        if self.budget.within_peak and c.kind != "all_gather":   # the serial order keeps it where it stood
            return None
        if c.kind != "all_gather" or any(i.op != "placeholder" for i in s.bundle_inputs[c.start]):
            # no later than the graph handed in keeps its inputs live anyway
            live = min((self._live_until(i) for i in s.bundle_inputs[c.start]), default=-1)
            hi = min(hi, bisect.bisect_right(spine_pos, live))
        region = s.region_of(c.start)
        if region:
            lo = max(lo, index[s.barriers[region - 1]] + 1)
        return lo, hi, due

    def _live_until(self, node: fx.Node) -> int:
        """The last graph position at which the graph handed in keeps ``node`` live: its last
        reader, or for a reader in a collective's start bundle, that collective's last wait."""
        s, last = self.s, self.s.pos[node]
        for user in node.users:
            c = s.coll_of_start.get(s.start_of_member.get(user))
            last = max([last, s.pos[user], *(s.pos[w] for w in (c.waits if c is not None else ()))])
        return last

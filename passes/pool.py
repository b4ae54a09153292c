"""Inductor's pool of freed buffers, as the memory model (``memory.Liveness``) counts it.

Inductor's wrapper (``codegen/wrapper.py``: ``FreeIfNotReusedLine``, ``AllocateLine``,
``MemoryPlanningState``) does not delete a buffer that is not a graph input where its
last reader ran: it puts it in a pool, one stack per reuse key (device, dtype, storage
bytes), and a later buffer the wrapper allocates itself (a kernel's output, an extern
kernel's ``out=``) with the same key looks at the one freed most recently (LIFO) and is
written into it (``bufY = bufX; del bufX  # reuse``, or through ``reinterpret_tensor``).
Until then the dead buffer stays allocated; one that no allocation takes is deleted
where it was freed. Buffers an op allocates itself (fallback kernels: collectives,
custom ops, aten fallbacks) never take from the pool, but are put in it when freed.

Inductor takes the buffer only when the allocation runs in the kernel right after the
free (no kernel between), or when holding it over the kernels between stays within its
own peak estimate (``AllocateLine.should_reuse_buffer``); otherwise the buffer stays on
its stack and the allocation is a new one. With its peak-memory reordering off (as
overlapc compiles) that estimate counts only the graph inputs it may free (read by the
graph, not named ``primals_*``, ``arg*``, ``tangents*``, ``*_rng_state``): a hold fits
where those inputs freed before each kernel it spans, less the holds already taken
there, cover its bytes.

Here a storage is a graph node (the one that allocated it) with a position in an order;
the pairing is decided along one order, from each storage's key (None: never pooled),
whether a node's allocation takes from the pool and whether a node runs as a kernel of
its own. Plain lists and dicts in order of position: deterministic.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate

import torch
import torch.fx as fx

# graph inputs Inductor's estimate never frees (``torch._inductor.utils.is_nonfreeable_buffers``)
_NONFREEABLE = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")


def pool_key(value, nbytes: int) -> tuple | None:
    """The reuse key of a storage holding ``value`` (its extent ``nbytes``): (dtype, device,
    bytes) for a tensor of plain (non-symbolic) sizes, None otherwise (a tuple of several
    tensors is several buffers; a symbolic size's hint is no key Inductor would share)."""
    if not isinstance(value, torch.Tensor) or nbytes <= 0:
        return None
    try:
        hash(value.shape)   # a symbolic size is not hashable
    except TypeError:
        return None
    return value.dtype, value.device, nbytes


def freeable(placeholder: fx.Node) -> bool:
    """Whether Inductor's peak estimate counts graph input ``placeholder`` as freed after its
    last reader: it is read, and its name in Inductor (the placeholder's target, which a
    re-traced graph's node names need not be) is not one of ``_NONFREEABLE``."""
    return bool(placeholder.users) and not str(placeholder.target).startswith(_NONFREEABLE)


class Pool:
    """What ``reuses`` reads of a graph besides an order (``memory.Liveness`` fills it):
    ``key``: storage -> its reuse key (pool entries only); ``takes``: node -> the key of
    the storage it allocates, for nodes whose allocation takes from the pool;
    ``kernels``: nodes that run as a kernel (scheduler node) of their own; ``inputs``:
    graph inputs Inductor's estimate frees (``freeable``)."""

    def __init__(self):
        self.key: dict[fx.Node, tuple] = {}
        self.takes: dict[fx.Node, tuple] = {}
        self.kernels: dict[fx.Node, None] = {}
        self.inputs: list[fx.Node] = []

    def copy(self) -> Pool:
        """An independent copy of the four tables."""
        twin = Pool()
        twin.key, twin.takes, twin.kernels, twin.inputs = \
            dict(self.key), dict(self.takes), dict(self.kernels), list(self.inputs)
        return twin


def reuses(pool: Pool, order: list[fx.Node], last: dict[fx.Node, int],
           size: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Storage -> the position in ``order`` of the allocation that takes its buffer from the
    pool, for each storage taken. ``last``: storage -> position after which its readers let
    it go; ``size``: storage -> bytes. An allocation looks at the storage of its key freed
    last (storages freed at one position are pooled in order of allocation, after the node
    there allocated) and takes it when no kernel runs between, or when the hold fits the
    room the freed inputs leave (module docstring); else leaves it there. O(len(order) +
    takes x log^2 len(order))."""
    key, takes = pool.key, pool.takes
    freed: list[list[fx.Node] | None] = [None] * len(order)
    for node in filter(key.__contains__, order):   # storages in order of allocation
        at = last[node]
        if freed[at] is None:
            freed[at] = [node]
        else:
            freed[at].append(node)
    ran = list(accumulate(map(pool.kernels.__contains__, order), initial=0))   # kernels before each position
    room = _Holds(pool, last, size, len(order))
    stacks: dict[tuple, list[fx.Node]] = {}
    taken: dict[fx.Node, int] = {}
    for index, node in enumerate(order):
        want = takes.get(node)
        if want is not None:
            stack = stacks.get(want)
            if stack:
                r = stack[-1]
                first = last[r] + 1
                if ran[index] == ran[first] or room.take(first, index - 1, size[r]):   # no kernel between, or room
                    taken[stack.pop()] = index
        bucket = freed[index]
        if bucket is not None:
            for r in bucket:
                stack = stacks.get(key[r])
                if stack is None:
                    stacks[key[r]] = [r]
                else:
                    stack.append(r)
    return taken


class _Holds:
    """The room Inductor's estimate leaves for holds along an order: at each position the
    bytes of freeable graph inputs freed before it, less the holds taken over it. Holds
    come in order of their last position; one is checked first against a bound (the
    inputs freed before its first position, less every hold reaching that far), and
    against the exact minimum (a ``_Room`` tree, built and filled on first need) only
    where that bound falls short."""

    def __init__(self, pool: Pool, last: dict[fx.Node, int], size: dict[fx.Node, int], n: int):
        gone = [0] * n
        for r in pool.inputs:
            if last[r] + 1 < n:
                gone[last[r] + 1] += size.get(r, 0)
        self.freed = list(accumulate(gone))   # per position: input bytes freed before it
        self.holds: list[tuple[int, int, int]] = []   # (first, last, bytes) taken, by last position
        self.ends: list[int] = []                     # their last positions
        self.sums = [0]                               # prefix sums of their bytes
        self.tree: _Room | None = None
        self.filled = 0                               # holds already in the tree

    def take(self, first: int, last: int, nbytes: int) -> bool:
        """Whether a hold of ``nbytes`` over positions first..last (``last`` at least that
        of every hold before) fits the room there; if so, it is taken."""
        if self.freed[last] < nbytes:   # no more room anywhere up to ``last`` than that
            return False
        reach = self.sums[-1] - self.sums[bisect_left(self.ends, first)]   # holds reaching ``first`` or beyond
        if self.freed[first] - reach < nbytes:
            if self.tree is None:
                self.tree = _Room(self.freed)
            for a, z, held in self.holds[self.filled:]:
                self.tree.take(a, z, held, check=False)
            self.filled = len(self.holds) + 1
            if not self.tree.take(first, last, nbytes):
                self.filled -= 1
                return False
        self.holds.append((first, last, nbytes))
        self.ends.append(last)
        self.sums.append(self.sums[-1] + nbytes)
        return True


class _Room:
    """Range minima under range additions over a list of numbers: a segment tree (each
    node the least below it plus what was added to all of it), O(log^2 n) a ``take``."""

    def __init__(self, values: list[int]):
        width = 1
        while width < len(values):
            width *= 2
        self.width = width
        self.low = low = [0] * width + values + [math.inf] * (width - len(values))
        self.added = [0] * width
        for p in range(width - 1, 0, -1):
            a, b = low[2 * p], low[2 * p + 1]
            low[p] = a if a < b else b

    def take(self, first: int, last: int, nbytes: int, check: bool = True) -> bool:
        """Whether every value at positions first..last (inclusive) is at least ``nbytes``
        (``check=False``: taken as so); if so, subtract ``nbytes`` from them."""
        low, added, width = self.low, self.added, self.width
        cover, left, right = [], first + width, last + width + 1
        while left < right:   # the O(log n) subtrees that cover first..last
            if left & 1:
                cover.append(left)
                left += 1
            if right & 1:
                right -= 1
                cover.append(right)
            left >>= 1
            right >>= 1
        for p in cover if check else ():   # each one's least, with what was added above it
            value, up = low[p], p >> 1
            while up:
                value += added[up]
                up >>= 1
            if value < nbytes:
                return False
        for p in cover:
            low[p] -= nbytes
            if p < width:
                added[p] -= nbytes
        for p in (first + width, last + width):   # their ancestors: the least below plus what was added
            p >>= 1
            while p:
                a, b = low[2 * p], low[2 * p + 1]
                low[p] = (a if a < b else b) + added[p]
                p >>= 1
        return True

"""What is fixed about a graph for one scheduling: collectives, bundles, regions, targets.

``Structure(gm)`` reads the graph in its current order and derives, for the
collectives the scheduler may move:

* start bundles: the start, the input chain that feeds only it and the
  getitems of list results. The input chain holds cheap nodes (aliases, dtype
  casts and copies: ``collectives.is_cheap``), nodes a pass marked with
  ``meta.INPUT_CHAIN`` (a bucket's copy-in) and *carried compute*: elementwise
  ops (``torch.Tag.pointwise``) on collectives' results alone (waits, through
  cheap nodes, with placeholders and attributes), such as HSDP's averaging div
  between a reduce-scatter and the all-reduce that reads it. Nothing else: a
  matmul, a reduction or compute that reads other compute stays on the spine.
  Carried compute may only move later: a bundle that carries compute must
  follow the spine node that compute followed in the given order
  (``bundle_inputs`` names that node), so it never passes compute before it;
* wait bundles: the wait and the aliasing views that read only through it;
* regions: barriers (``collectives.barrier_reason``) cut the graph
  into regions; nothing moves from one region to another (an in-place write
  into a temporary is no barrier: it stays on the spine, whose order is kept);
* each wait's target: its first real consumer, else the barrier that closes
  its region, else the output node; its spine target: the same, skipping
  consumers inside start bundles (a *chained* wait feeds another collective's
  start, which moves, so only the final order says which consumer is first);
* consumer keys: all-gathers sort by (target position, order in which the
  target reads its inputs, own position);
* the spine: every node outside the bundles (compute, placeholders, barriers,
  collectives kept in place, the output), whose relative order the scheduler
  keeps;
* hiding kernels by position (``Structure.kernels``, counted on first use): compute that runs as a
  kernel of its own, which the bucket pass's hiding rule and the core's all-gathers
  under "serial-peak" ask about.

A collective is *movable* when its op is understood, it has a wait, and its
start and waits share a region. Everything here is a pure function of the
graph's structure and order: no sets or object-keyed dicts are iterated where
order matters. Hot loops read ``node._input_nodes`` (the dict behind
``all_input_nodes``, stable since torch 1.8): building the list on every call
costs more than the rest of the pass on 100k-node graphs.
"""
from __future__ import annotations

import functools
import heapq
import operator
from itertools import accumulate

import torch
import torch.fx as fx

from overlapc.passes.collectives import (
    Collective, alias_closure, barrier_reason, is_cheap, node_value, real_consumers, role, scan,
    tensor_nbytes,
)
from overlapc.passes.meta import in_input_chain


class Structure:
    """The graph as it stands; nothing here changes while a schedule is built."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.nodes: list[fx.Node] = list(gm.graph.nodes)
        self.pos = dict(zip(self.nodes, range(len(self.nodes))))
        self.output = next(n for n in reversed(self.nodes) if n.op == "output")
        self.barriers: list[fx.Node] = []
        waits, starts = [], []
        # region[i]: number of barriers strictly before position i.
        self.region: list[int] = []
        for node in self.nodes:
            self.region.append(len(self.barriers))
            start, wait, barrier = role(node)
            if barrier is not None:
                self.barriers.append(node)
            if wait:
                waits.append(node)
            if start is not None:
                starts.append(node)
        self.barrier_pos = [self.pos[b] for b in self.barriers]
        self.is_barrier = set(self.barriers)

        self.all: list[Collective] = scan(starts, self.pos, first_consumers=False)
        self.movable: list[Collective] = [
            c for c in self.all
            if c.movable and c.waits and (not self.barriers or all(
                self.region_of(w) == self.region_of(c.start) for w in c.waits))
        ]
        self.coll_of_start = {c.start: c for c in self.movable}
        self.coll_of_wait = {w: c for c in self.movable for w in c.waits}
        # Collectives that stay where they stand (start and wait on two sides of a
        # barrier), with waits: they count against ``max_in_flight`` while open.
        # start -> the collective; (group, kind) -> positions of their starts, rising;
        # wait -> the one it completes last.
        self.pinned: dict[fx.Node, Collective] = {
            c.start: c for c in self.all if c.waits and c.start not in self.coll_of_start}
        self.pinned_starts: dict[tuple[str, str], list[int]] = {}
        self.pinned_last_wait: dict[fx.Node, Collective] = {}
        for c in self.pinned.values():
            self.pinned_starts.setdefault((c.group, c.kind), []).append(self.pos[c.start])
            self.pinned_last_wait[max(c.waits, key=self.pos.__getitem__)] = c

        self.wait_bundle: dict[fx.Node, list[fx.Node]] = {}
        self.wait_of_member: dict[fx.Node, fx.Node] = {}
        self.target: dict[fx.Node, fx.Node] = {}
        self.consumers: dict[fx.Node, list[fx.Node]] = {}
        pos = self.pos
        for c in self.movable:
            for wait in c.waits:
                end = self.region_end(wait)
                closure = alias_closure(wait, within=(lambda n, end=end: pos[n] < end) if self.barriers else None)
                if len(closure) > 1:
                    closure.sort(key=pos.__getitem__)
                self.wait_bundle[wait] = bundle = [wait, *closure]
                for member in bundle:
                    self.wait_of_member[member] = wait
                consumers = real_consumers(wait, closure)
                if len(consumers) > 1:
                    consumers.sort(key=pos.__getitem__)
                self.consumers[wait] = consumers
                self.target[wait] = self.nodes[min(pos[consumers[0]], end) if consumers else end]

        self.start_bundle: dict[fx.Node, list[fx.Node]] = {}
        self.start_of_member: dict[fx.Node, fx.Node] = {}
        for c in self.movable:
            bundle = self._input_chain(c.start)
            bundle.append(c.start)
            getitems = [u for u in c.start.users if u.target is operator.getitem]
            if getitems:
                bundle += sorted(getitems, key=pos.__getitem__)
            self.start_bundle[c.start] = bundle
            for member in bundle:
                self.start_of_member[member] = c.start
        # Nodes that may stand between a wait and its consumer: bundle members and any wait.
        self.bundled = set(self.start_of_member) | set(self.wait_of_member) | set(waits)
        # What each start bundle must follow: the nodes its members read, and the
        # spine node its carried compute followed in the given order.
        self.bundle_inputs = {start: self._must_follow(start, bundle)
                              for start, bundle in self.start_bundle.items()}
        # Whether each movable collective's held bytes count its output (``holds_output``)
        self.holds = {c.start: holds_output(c) for c in self.movable}
        self.held = {c.start: held_bytes(c, self.holds[c.start]) for c in self.movable}
        # Those whose output does not count but whose start may go ahead of compute it
        # followed (``_may_go_ahead``): start -> the position of its bundle's first member.
        self.goes_ahead: dict[fx.Node, int] = {
            c.start: pos[self.start_bundle[c.start][0]] for c in self.movable
            if not self.holds[c.start] and self._may_go_ahead(c)}
        # First consumer that no start bundle carries (else the region's end): a
        # wait read by another collective's start bundle (a chain) is due by then.
        self.spine_target: dict[fx.Node, fx.Node] = {}
        for wait, consumers in self.consumers.items():
            first = next((u for u in consumers if u not in self.bundled), None)
            end = self.region_end(wait)
            self.spine_target[wait] = self.nodes[min(self.pos[first], end) if first is not None else end]

        shared: set[fx.Node] = set()
        seen: set[fx.Node] = set()
        for target in self.spine_target.values():
            (shared if target in seen else seen).add(target)
        self._shared_targets = shared
        self._arg_order: dict[fx.Node, dict[fx.Node, int]] = {}
        self.key = {c.start: self.consumer_key(c) for c in self.movable if c.kind == "all_gather"}

    @functools.cached_property
    def held_ahead(self) -> dict[fx.Node, int]:
        """``held`` with the outputs of the collectives that may go ahead
        (``goes_ahead``) counted too: what a byte budget other than "serial-peak"
        counts in flight (that one's headroom counts such an output by itself)."""
        if not self.goes_ahead:
            return self.held
        return {start: held_bytes(c, self.holds[start] or start in self.goes_ahead)
                for start, c in self.coll_of_start.items()}

    @functools.cached_property
    def kernels(self) -> Kernels:
        """The graph's hiding kernels by position, counted on first use (``Kernels``)."""
        return Kernels(self)

    # -- positions and regions -------------------------------------------------
    def region_of(self, node: fx.Node) -> int:
        return self.region[self.pos[node]]

    def region_end(self, node: fx.Node) -> int:
        """Position of the barrier that closes ``node``'s region (or the output)."""
        index = self.region_of(node)
        return self.barrier_pos[index] if index < len(self.barrier_pos) else self.pos[self.output]

    def due(self, c: Collective) -> int:
        """Position of the latest spine target among ``c``'s waits (-1 when none has
        one): where ``c`` is complete in any schedule (a chained wait, read by a
        start bundle, is placed before its spine target)."""
        due = -1
        for wait in c.waits:
            target = self.spine_target.get(wait)
            if target is not None and self.pos[target] > due:
                due = self.pos[target]
        return due

    # -- bundles -----------------------------------------------------------------
    def _input_chain(self, start: fx.Node) -> list[fx.Node]:
        """Cheap, marked or carried-compute nodes in ``start``'s region whose every
        use is ``start`` or the chain."""
        nodes, pos, region = self.nodes, self.pos, self.region
        heap = [-pos[i] for i in start._input_nodes]   # latest first: a node's users are decided before it
        if not heap:
            return []
        heapq.heapify(heap)
        here, wait_of_member, coll_of_start = region[pos[start]], self.wait_of_member, self.coll_of_start
        chain: dict[fx.Node, None] = {}   # members, latest first (positions pop in falling order)
        seen = set()
        while heap:
            at = -heapq.heappop(heap)
            if at in seen:
                continue
            seen.add(at)
            node = nodes[at]
            if (node.op in ("placeholder", "get_attr", "output")
                    or node in wait_of_member or node in coll_of_start
                    or region[at] != here
                    or not all(u is start or u in chain for u in node.users)
                    or not (is_cheap(node) or in_input_chain(node)
                            or carries_compute(node, wait_of_member.__contains__))
                    or barrier_reason(node) is not None):
                continue
            chain[node] = None
            for i in node._input_nodes:
                heapq.heappush(heap, -pos[i])
        members = list(chain)
        members.reverse()
        return members

    def _must_follow(self, start: fx.Node, bundle: list[fx.Node]) -> list[fx.Node]:
        """In graph order: the nodes the bundle's members read that are not members
        and, when the bundle carries compute, the last spine node before its last
        carried member in the given order. Placing the bundle after that node keeps
        the carried compute behind every compute it followed: it may move later,
        never earlier."""
        inputs = self._external_inputs(bundle)
        carried = [m for m in bundle if m is not start and not is_cheap(m) and not in_input_chain(m)]
        at = self.pos[carried[-1]] if carried else 0
        while at > 0:
            at -= 1
            if self.nodes[at] not in self.bundled:
                if self.nodes[at] not in inputs:
                    inputs = sorted(inputs + [self.nodes[at]], key=self.pos.__getitem__)
                break
        return inputs

    def _may_go_ahead(self, c: Collective) -> bool:
        """Whether ``c``'s start bundle may be issued before compute that preceded it
        in the given order: a node that allocates (neither cheap nor bundled, nor a
        graph input) stands between the last node the bundle must follow and its
        first member. Its output is then allocated earlier than the given order
        allocates it and held across that compute (a dispatch all-to-all reading a
        graph input, an all-reduce traced after later compute)."""
        bundle, must = self.start_bundle[c.start], self.bundle_inputs[c.start]
        ready = self.pos[must[-1]] if must else -1
        nodes, bundled = self.nodes, self.bundled
        for at in range(self.pos[bundle[0]] - 1, ready, -1):
            node = nodes[at]
            if node.op == "call_function" and node not in bundled and not is_cheap(node):
                return True
        return False

    def _external_inputs(self, members: list[fx.Node]) -> list[fx.Node]:
        """Nodes the members read that are not members themselves, in graph order."""
        inside = set(members)
        found = {i for m in members for i in m._input_nodes if i not in inside}
        return sorted(found, key=self.pos.__getitem__) if len(found) > 1 else list(found)

    # -- consumer order ------------------------------------------------------------
    def _order_read(self, target: fx.Node) -> dict[fx.Node, int]:
        """Waits in the order ``target`` reads them (depth-first through alias bundles)."""
        if target not in self._arg_order:
            order: dict[fx.Node, int] = {}
            stack = list(reversed(target._input_nodes))
            visited = set()
            while stack:
                node = stack.pop()
                if node in visited:
                    continue
                visited.add(node)
                if node in self.coll_of_wait:
                    order.setdefault(node, len(order))
                elif node in self.wait_of_member:
                    stack.extend(reversed(node._input_nodes))
            self._arg_order[target] = order
        return self._arg_order[target]

    def wait_key(self, wait: fx.Node) -> tuple[int, int, int]:
        """Where a wait stands among waits for the same spine target: (target
        position, read order, own position). Structural, so every order ranks
        waits alike."""
        target = self.spine_target[wait]
        if target not in self._shared_targets:
            return self.pos[target], 0, self.pos[wait]
        read = self._order_read(target).get(wait, len(self.nodes))
        return self.pos[target], read, self.pos[wait]

    def in_wait_order(self, waits) -> list[fx.Node]:
        """``waits`` sorted by ``wait_key`` (a single wait without computing its key)."""
        return sorted(waits, key=self.wait_key) if len(waits) > 1 else list(waits)

    def consumer_key(self, c: Collective) -> tuple[int, int, int]:
        return min(map(self.wait_key, c.waits))


class Kernels:
    """Counts of the graph's hiding kernels by position: compute that is a kernel of its own.

    Not counted: what moves with collectives (start and wait bundles, waits), other
    collectives and barriers, aliases and casts (``collectives.is_cheap``), and pointwise
    ops and reductions: Inductor fuses those into the loops of their neighbours (and may
    move them across a wait), so a window of them alone hides nothing. Counted: matmuls,
    convolutions, attention, anything else that runs as a kernel of its own."""

    def __init__(self, s: Structure):
        fused_by_target: dict[int, bool] = {}   # call targets live as long as the graph's nodes
        bundled = s.bundled
        kernel = [node.op == "call_function" and node not in bundled and _kernel_call(node, fused_by_target)
                  for node in s.nodes]
        self._before = list(accumulate(kernel, initial=0))   # _before[i]: kernels among s.nodes[:i]

    def at(self, position: int) -> bool:
        """Whether the node at ``position`` is a hiding kernel."""
        return self._before[position + 1] > self._before[position]

    def between(self, low: int, high: int) -> int:
        """Kernels at positions strictly between ``low`` and ``high``."""
        low, high = max(low + 1, 0), min(high, len(self._before) - 1)
        return self._before[high] - self._before[low] if high > low else 0


def _kernel_call(node: fx.Node, fused_by_target: dict[int, bool]) -> bool:
    """Whether call_function ``node``, outside every bundle, is a hiding kernel (``Kernels``);
    ``fused_by_target`` caches what its call target decides."""
    if is_cheap(node):
        return False
    fused = fused_by_target.get(id(node.target))
    if fused is None:
        start, wait, barrier = role(node)
        tags = getattr(node.target, "tags", ())
        fused = fused_by_target[id(node.target)] = (
            start is not None or wait or barrier is not None
            or torch.Tag.pointwise in tags or torch.Tag.reduction in tags)
    return not fused


def held_bytes(c: Collective, holds: bool | None = None) -> int:
    """Bytes a collective holds while in flight beyond what issuing and waiting it
    back to back would: an all-gather's output and input (the gathered buffer and
    the shard, or the cast copy made for it), another collective's input (the
    c10d work keeps it until the wait) and, when that input is another
    collective's result (a chain, whose start goes to a chain point, possibly
    before where it stood), its output too. Unknown sizes count 0. ``holds``:
    ``holds_output(c)`` when the caller has it."""
    inputs = 0
    for i in c.start._input_nodes:   # tensor_nbytes of the list of their values, without building it
        value = node_value(i)
        if isinstance(value, (torch.Tensor, list, tuple)):
            nbytes = tensor_nbytes(value)
            if nbytes is None:
                inputs = 0
                break
            inputs += nbytes
    if holds is None:
        holds = holds_output(c)
    return (c.nbytes or 0) + inputs if holds else inputs


def holds_output(c: Collective) -> bool:
    """Whether ``held_bytes(c)`` counts ``c``'s output (an all-gather's, a chained
    start's, or one nothing reads: its wait is its last reader, so a wait placed
    later holds it longer); for any other kind it counts the input alone, the output
    being live anyway from the start to its reader, unless that reader moves later
    with the wait."""
    return c.kind == "all_gather" or _reads_a_wait(c.start) or _unread(c)


def _unread(c: Collective) -> bool:
    """Whether nothing but ``c``'s waits and their views reads its result."""
    return not any(real_consumers(wait, alias_closure(wait)) for wait in c.waits)


def carries_compute(node: fx.Node, is_wait) -> bool:
    """Whether ``node`` is compute a start bundle may carry: an elementwise op
    (``torch.Tag.pointwise``), no barrier, computing on collectives' results
    alone (``computes_on_waits``). HSDP's averaging div between a reduce-scatter
    and the all-reduce that reads it is one; a matmul or a reduction never is."""
    return (node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())
            and barrier_reason(node) is None and computes_on_waits(node, is_wait))


def computes_on_waits(node: fx.Node, is_wait) -> bool:
    """Whether ``node`` computes on collectives' results alone: every input is a
    wait (``is_wait``), a placeholder, an attribute or a cheap node over those, at
    least one a wait: it adds no dependency on other compute."""
    found, frontier, seen = False, list(node._input_nodes), set()
    while frontier:
        i = frontier.pop()
        if i in seen:
            continue
        seen.add(i)
        if is_wait(i):
            found = True
        elif i.op in ("placeholder", "get_attr"):
            continue
        elif is_cheap(i) and barrier_reason(i) is None:
            frontier.extend(i._input_nodes)
        else:
            return False
    return found


def _reads_a_wait(start: fx.Node) -> bool:
    """Whether ``start`` reads a wait's result through what may join its input
    chain (cheap nodes; carried compute that feeds only the chain)."""
    is_wait = lambda n: role(n)[1]   # noqa: E731
    frontier, seen = list(start._input_nodes), set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_wait(node):
            return True
        if is_cheap(node) or (all(u is start or u in seen for u in node.users)
                              and carries_compute(node, is_wait)):
            frontier.extend(node._input_nodes)
    return False


def apply_order(gm: fx.GraphModule, order: list[fx.Node]) -> None:
    """Rearrange ``gm.graph`` into ``order``, a permutation of its nodes in which
    every node follows its inputs (checked first; AssertionError otherwise).

    The caller recompiles (once, at the end: recompiling is the costly part)."""
    graph = gm.graph
    placed: set[fx.Node] = set()
    for node in order:
        if node in placed or not placed.issuperset(node._input_nodes):
            raise AssertionError(f"overlapc internal error: {node.name} placed before its inputs or twice")
        placed.add(node)
    if len(placed) != len(graph.nodes):
        raise AssertionError("overlapc internal error: new order is not a permutation of the graph")
    cursor = graph._root
    for node in order:
        if node.prev is not cursor:
            cursor.append(node)
        cursor = node

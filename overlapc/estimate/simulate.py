"""A two-stream timeline of one graph: exposed communication, step time, in-flight bytes.

Model (``simulate``): one compute stream, plus one stream per process group.
Nodes are walked in program order:

* a compute node runs on the compute stream from the stream's current time for
  its estimated cost (the stream executes in order, so its inputs are ready:
  any collective result it reads was waited before it);
* a collective start is issued at the compute stream's current time; it ends
  at ``link.end_ms(issue, its group's link free, latency, transfer)``
  (``costmodel.LinkProfile``: the one link model, which ``chunks="auto"``'s
  estimate uses too): its group's collectives move their bytes one after
  another in issue order, and its latency runs beside the transfers before it
  as far as the link's ``overlap`` says; on a calibrated link it is shorter when
  issued soon after its group's last collective ended
  (``LinkProfile.latency_after_ms``). Issuing keeps the compute stream busy
  for the link's ``start_ms`` of its bytes (the start call; 0 on the built-in
  links, measured by a calibrated CPU profile: gloo enqueues on the caller's
  thread);
* a wait blocks the compute stream until its collective ends; the time the
  stream stalls is that collective's *exposed* time. At its first wait the
  rest of the link's ``issue_ms`` (the CPU time the backend's threads and the
  completion take around the collective's run) is charged to the compute
  stream in proportion to the part of the run, from the start call's return
  to the collective's end, that the stream spent computing rather than
  stalled on a wait (the threads slow compute only where it runs beside
  them): in full for a hidden collective, not at all for one waited right
  after its start. A collective never waited, or one whose run ended within
  its start call, pays it in full.

A collective is *hidden* when its waits stall compute for less than 1% of its
duration or less than 1 us. In-flight bytes are counted by the scheduler's own
tracker (``overlapc.passes.inflight.InFlight``): what collectives issued and
not yet fully waited hold (an all-gather's output and input, another
collective's input). Peak memory is the memory tracker's
(``overlapc.passes.memory``) liveness peak along the order.

Costs come from ``overlapc.estimate.costmodel`` for the given Profile (each group's link
is ``Profile.link_for(group)``), or from the
``compute_ms(node)`` / ``comm_ms(collective)`` callables when given (tests and
what-if studies set exact costs this way; a given ``comm_ms`` is the
collective's whole time on the link, none of it latency). Deterministic; O(nodes + edges)
once costs are known.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.fx as fx

from overlapc.collectives import Collective, collectives
from overlapc.estimate import costmodel
from overlapc.passes.inflight import InFlight
from overlapc.passes.memory import peak_bytes
from overlapc.passes.structure import held_bytes

HIDDEN_FRACTION = 0.01   # stalls below this fraction of the collective's duration ...
HIDDEN_MS = 1e-3         # ... or below 1 us count as hidden


@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    """When one collective was issued, ran and ended (ms), and how long compute stalled on it."""

    collective: Collective
    issue_ms: float
    start_ms: float
    end_ms: float
    exposed_ms: float

    @property
    def name(self) -> str:
        return self.collective.start.name

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def hidden(self) -> bool:
        return self.exposed_ms < HIDDEN_MS or self.exposed_ms < HIDDEN_FRACTION * self.duration_ms


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Result of ``simulate``.

    compute: node name -> (start_ms, end_ms) on the compute stream, for every
        node other than the collectives' starts and waits, in program order.
    collectives: start node name -> CollectiveTime, in issue order.
    step_ms: when the compute stream finishes.
    exposed_ms: total compute-stream stall on waits.
    peak_in_flight_bytes: most bytes held by collectives in flight (all groups
        and kinds together) at any point of the order.
    peak_bytes: most bytes live at any point of the order (the memory tracker).
    """

    compute: dict[str, tuple[float, float]]
    collectives: dict[str, CollectiveTime]
    step_ms: float
    exposed_ms: float
    peak_in_flight_bytes: int
    peak_bytes: int

    @property
    def total(self) -> int:
        return len(self.collectives)

    @property
    def hidden(self) -> int:
        return sum(1 for t in self.collectives.values() if t.hidden)


def checked_order(gm: fx.GraphModule, order=None) -> list[fx.Node]:
    """``order`` (nodes or node names; default graph order) as nodes, checked to be a
    topological permutation of ``gm``'s nodes; ValueError otherwise."""
    nodes = list(gm.graph.nodes)
    if order is None:
        return nodes
    by_name = {n.name: n for n in nodes}
    try:
        order = [by_name[n] if isinstance(n, str) else n for n in order]
    except KeyError as error:
        raise ValueError(f"order names node {error.args[0]!r}, which is not in the graph") from None
    if len(order) != len(nodes) or set(order) != set(nodes):
        raise ValueError("order must list every node of the graph exactly once")
    pos = {node: index for index, node in enumerate(order)}
    for index, node in enumerate(order):
        for user in node.users:
            if pos[user] < index:
                raise ValueError(f"order runs {user.name} before its input {node.name}")
    return order


def _stalled(stalls: list[tuple[float, float]], begin: float, end: float) -> float:
    """How long the compute stream stalled between ``begin`` and ``end`` (``stalls`` in time
    order, not overlapping)."""
    total = 0.0
    for low, high in reversed(stalls):
        if high <= begin:
            break
        total += max(0.0, min(high, end) - max(low, begin))
    return total


def _computed_beside(stalls: list[tuple[float, float]], begin: float, end: float) -> float:
    """The fraction of ``begin``..``end`` (a collective's run after its start call) that the
    compute stream did not stall (``stalls``, ``_stalled``); 1 for an empty run."""
    if end <= begin:
        return 1.0
    return max(0.0, 1.0 - _stalled(stalls, begin, end) / (end - begin))


def _walk(order, of_start, of_wait, costs, profile, comm):
    """The two-stream model (module docstring) over ``order``; ``costs``: node -> compute ms;
    ``comm``: collective -> (latency ms, transfer ms). Returns (step ms, compute spans,
    start -> [issue, start, end, exposed, background, start call's return], the in-flight tracker)."""
    now = 0.0                                  # compute stream time
    group_free: dict[str, float] = {}          # group -> when its link is free
    compute: dict[str, tuple[float, float]] = {}
    issued: dict[fx.Node, list[float]] = {}    # start -> [issue, start, end, exposed, background]
    stalls: list[tuple[float, float]] = []     # the compute stream's waits, in time order
    waits_left = {c.start: len(c.waits) for c in of_start.values()}
    flight = InFlight({c.start: held_bytes(c) for c in of_start.values()})
    for node in order:
        c = of_start.get(node)
        if c is not None:
            issue = now
            link, nbytes = profile.link_for(c.group), costmodel.collective_bytes(c)
            now += link.start_ms(nbytes)
            latency, transfer = comm(c)
            free = group_free.get(c.group)
            end = link.end_ms(issue, free, latency, transfer)
            group_free[c.group] = end
            latency = link.latency_after_ms(issue, free, latency)
            issued[node] = [issue, max(issue, end - latency - transfer), end, 0.0,
                            link.issue_ms(nbytes) - link.start_ms(nbytes), now]
            if c.waits:
                flight.open(c)
            continue
        c = of_wait.get(node)
        if c is not None:
            record = issued[c.start]
            if record[2] > now:
                record[3] += record[2] - now
                stalls.append((now, record[2]))
                now = record[2]
            now += record[4] * _computed_beside(stalls, record[5], record[2])
            record[4] = 0.0
            waits_left[c.start] -= 1
            if waits_left[c.start] == 0:
                flight.close(c)
            continue
        cost = costs[node]
        compute[node.name] = (now, now + cost)
        now += cost
    now += sum(record[4] for record in issued.values())
    return now, compute, issued, flight


def _link_costs(profile: costmodel.Profile, comm_ms):
    """collective -> (latency ms, transfer ms): the profile's link for its group and kind,
    or (0, ``comm_ms(c)``) when exact costs are given."""
    if comm_ms is not None:
        return lambda c: (0.0, comm_ms(c))
    return lambda c: costmodel.link_ms(c, profile.link_for(c.group))


def simulate(gm: fx.GraphModule, profile: costmodel.Profile | None = None, order=None, *,
             compute_ms: Callable[[fx.Node], float] | None = None,
             comm_ms: Callable[[Collective], float] | None = None) -> Timeline:
    """Simulate ``gm`` run in ``order`` (list of its nodes or node names; default graph order).

    ``profile`` defaults to ``costmodel.profile()`` (h100 + nvlink);
    ``compute_ms`` / ``comm_ms`` replace the cost model's estimates.
    """
    profile = profile if profile is not None else costmodel.profile()
    if compute_ms is None:
        compute_ms = lambda node: costmodel.compute_ms(node, profile.device)  # noqa: E731
    order = checked_order(gm, order)
    found = collectives(gm)
    of_start = {c.start: c for c in found}
    of_wait = {w: c for c in found for w in c.waits}
    costs = {node: compute_ms(node) for node in order if node not in of_start and node not in of_wait}
    now, compute, issued, flight = _walk(order, of_start, of_wait, costs, profile, _link_costs(profile, comm_ms))

    times = {}
    for start, (issue, begin, end, exposed, _, _) in issued.items():
        times[start.name] = CollectiveTime(of_start[start], issue, begin, end, exposed)
    return Timeline(compute=compute, collectives=times, step_ms=now,
                    exposed_ms=sum(t.exposed_ms for t in times.values()),
                    peak_in_flight_bytes=flight.peak_total, peak_bytes=peak_bytes(order))

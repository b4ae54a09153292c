"""What the passes write on nodes and graphs, by name, with typed accessors.

Node annotations ride with the graph through Inductor (its post-grad pass hands
overlapc the graph and keeps ``node.meta``), so a later pass, the invariant check
or the report can read them from the graph alone:

* ``REASON``: why the scheduling core placed a collective's start or wait where it
  stands ("inputs ready", "before consumer", ...; ``scheduler.REASONS``).
* ``PIECE_OF``: on the start of a chunked collective's piece, the name of the
  start it was cut from (the pieces of one collective count as one in flight).
* ``INPUT_CHAIN``: a node a rewrite made for one collective's start alone (a
  bucket's copy-in), which the scheduler moves with that start.

Graph notes (``gm.meta``): each rewrite appends what it did, one entry per run of
identical collectives merged (``DUPLICATES``: tuples of start names), bucket
(``BUCKETS``: ``BucketNote``) or chunked pattern (``CHUNKS``: ``ChunkNote``), and the
"serial-peak" bound of the graph before those rewrites and its schedule (``SERIAL_PEAK``:
``pipeline.reference_order``, which the schedule and a later ``verify`` compare with, the
graph's own order being gone once scheduled); the pipeline saves
them before a schedule and puts them back when it rolls back.
Everything else a schedule says travels in its ``pipeline.ScheduleResult``.
"""
from __future__ import annotations

import torch.fx as fx

REASON = "overlapc_reason"
PIECE_OF = "overlapc_piece_of"
INPUT_CHAIN = "overlapc_input_chain"

DUPLICATES = "overlapc_duplicates"
BUCKETS = "overlapc_buckets"
CHUNKS = "overlapc_chunks"
REGATHER = "overlapc_regather"   # regather.RegatherChoice per block (keep_or_regather)
SERIAL_PEAK = "overlapc_serial_peak"   # [bytes]: the serial-peak bound of the graph before its rewrites
NARROW = "overlapc_narrow"   # narrow.NarrowNote per all-gather that gathers the narrow bytes
REWRITE_NOTES = (DUPLICATES, BUCKETS, CHUNKS, REGATHER, SERIAL_PEAK, NARROW)


def reason(node: fx.Node) -> str:
    """Why the core placed ``node`` (a start or wait) where it stands; "" when it did not."""
    return str(node.meta.get(REASON, ""))


def set_reason(node: fx.Node, why: str) -> None:
    node.meta[REASON] = why


def piece_of(start: fx.Node) -> str:
    """The name of the collective start ``start`` was cut from, else its own name."""
    return start.meta.get(PIECE_OF, start.name)


def set_piece_of(start: fx.Node, whole: str) -> None:
    start.meta[PIECE_OF] = whole


def in_input_chain(node: fx.Node) -> bool:
    """Whether a rewrite marked ``node`` as part of one start's input chain."""
    return bool(node.meta.get(INPUT_CHAIN))


def mark_input_chain(node: fx.Node) -> None:
    node.meta[INPUT_CHAIN] = True


def notes(gm: fx.GraphModule, key: str) -> list:
    """The rewrite notes ``gm`` holds under ``key`` (one of ``REWRITE_NOTES``); [] when none."""
    return list(gm.meta.get(key, ()))


def add_notes(gm: fx.GraphModule, key: str, found) -> None:
    """Append ``found`` to ``gm``'s notes under ``key`` (the key is created when missing)."""
    gm.meta.setdefault(key, []).extend(found)


def serial_peak(gm: fx.GraphModule) -> int | None:
    """The "serial-peak" bound of ``gm`` as it was before the pipeline's rewrites (buckets,
    chunks, dropped re-gathers) changed it and before it was scheduled, when either
    happened (``SERIAL_PEAK``); else None. The "serial-peak" budget and ``verify`` bound
    the peak by it."""
    found = gm.meta.get(SERIAL_PEAK)
    return found[0] if found else None


def set_serial_peak(gm: fx.GraphModule, peak: int) -> None:
    """Record ``peak`` as ``serial_peak(gm)`` unless one is recorded (the first, of the graph
    as handed in, stays)."""
    gm.meta.setdefault(SERIAL_PEAK, [peak])


def raise_serial_peak(gm: fx.GraphModule, peak: int) -> None:
    """Record ``peak`` as ``serial_peak(gm)`` where it is higher than the one recorded (a
    rewrite whose copies cost what they hold: ``bucket="module"``, a plan, pipelined pieces)."""
    found = serial_peak(gm)
    gm.meta[SERIAL_PEAK] = [peak if found is None else max(found, peak)]


def save_notes(gm: fx.GraphModule) -> dict[str, list]:
    """A copy of every rewrite note ``gm`` holds, for ``restore_notes``."""
    return {key: list(gm.meta[key]) for key in REWRITE_NOTES if key in gm.meta}


def restore_notes(gm: fx.GraphModule, saved: dict[str, list]) -> None:
    """``gm``'s rewrite notes as ``save_notes`` found them (a key it did not find goes)."""
    for key in REWRITE_NOTES:
        gm.meta.pop(key, None)
        if key in saved:
            gm.meta[key] = saved[key]

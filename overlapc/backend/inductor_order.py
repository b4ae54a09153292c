"""The order of collectives and compute in Inductor's generated wrapper code.

Inductor writes, per compiled graph, a Python module (the "wrapper") whose
``call`` runs the graph: it launches kernels (Triton kernels on CUDA,
``cpp_fused_*`` on CPU), calls library kernels (``extern_kernels.mm``, ...)
and ATen fallbacks, and calls the functional collectives and their waits, in
the order they will run. ``events(code)`` reads that order from the source
(``torch._inductor.utils.run_and_get_code``'s strings, or the source a
``GraphLowering`` produced); the checks below read the events. This is how
the tests and ``benchmarks/gpu_check.py`` see whether Inductor kept the order
overlapc scheduled.

Contract of ``events``:
- Input: the full source of one wrapper module (Python wrapper; a C++ wrapper
  from ``cpp_wrapper=True`` is refused with ValueError). The kernels' own
  sources (string literals) are never read.
- The body of ``call`` (a module-level function, or the method of the
  ``Runner`` class newer Inductor emits) is walked statement by statement,
  nested ``with``/``if`` blocks included. A call of a cudagraph partition
  (``self.partitions[i](...)``) is replaced by the body of ``partition_<i>``,
  so partitioned code reads in run order too (a partition uses the caller's
  buffer names).
- Events, in run order: ``start`` per collective call
  (``torch.ops._c10d_functional.<op>``: all-gather, reduce-scatter,
  all-reduce, all-to-all, broadcast; out=, in-place and coalesced variants),
  ``wait`` per ``wait_tensor``, ``compute`` per kernel launch (``<name>.run(``
  of a Triton kernel, ``cpp_fused_*(...)``, ``extern_kernels.<op>(...)``,
  ``torch.ops.<ns>.<op>`` outside the collectives), and one ``output`` for
  ``call``'s ``return``. Allocation, views, asserts, streams and ``del`` are
  not events.
- A collective's output is the assigned name, the ``out=`` argument or, for
  in-place ops, the input. Buffer aliases (``buf2 = buf1``, ``buf2 = buf1[0]``,
  ``reinterpret_tensor(buf1, ...)``) are followed, so a wait, and a read of the
  result, is tied to the start it belongs to (``Event.start``), however
  Inductor names the buffer. A bucket's copy-out (``overlapc.unpack_columns``)
  is a compute event that reads nothing, and its result stands for the bucket's
  output: a member's first use is the first read of its copy, as it was when
  Inductor fused the copy into that reader. A coalesced collective is open until
  every one of its outputs has been waited.
- Buffer writes: a compute event writes the names it assigns and every name it
  passes that no earlier statement used (Inductor allocates a buffer, then the
  first kernel that takes it writes it); ``bufB = bufA; del bufA  # reuse``
  makes ``bufB`` a new buffer in ``bufA``'s memory; any other alias (the
  arguments unpacked, a view, an output of a multi-output op) is not written.
  A kernel that mutates a buffer an earlier kernel wrote is not seen writing it.

``capture()`` records, per graph Inductor generates code for, what the code
alone does not say: the post-grad FX graph it lowered (as collective windows,
``fx_windows``) and which FX nodes each buffer computes; ``window_breaks`` then
checks that compute overlapc placed between a collective's start and its wait
is still there in the code (its docstring says exactly what it guarantees).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import re
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch.fx

# functional collective op (its name with the variant suffixes dropped) -> kind
KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "all_reduce", "all_to_all_single": "all_to_all", "broadcast": "broadcast"}
_NAMESPACES = ("_c10d_functional", "c10d_functional")
_VARIANT = re.compile(r"(_coalesced)?(_out)?_?$")
_COPY_OUT = "torch.ops.overlapc.unpack_columns"   # a bucket's copy-out (passes/bucket_ops.py)


@dataclasses.dataclass(frozen=True)
class Event:
    """One step of the wrapper's ``call``, in run order.

    kind: "start" | "wait" | "compute" | "output". op: the collective op
    ("all_gather_into_tensor_out"), "wait_tensor", the kernel or op that computes
    ("triton_poi_fused_0", "extern_kernels.mm", "aten.convolution"), or "return".
    collective, group: the collective kind ("all_gather", ...) and process group
    name of a start, and of the start a wait belongs to. buffer: a start's
    output buffer, a wait's argument. start: index (in the event list) of the
    start a wait belongs to, or of the start itself; None for a wait whose
    buffer no start produced. reads: indices of the starts whose outputs an
    event's arguments name (through aliases). writes: for a compute event, the
    buffers it writes (see ``Buffer writes`` in the module docstring). line: the
    line in the source; where: "call" or the partition function it sits in."""

    index: int
    kind: str
    op: str
    line: int
    where: str
    collective: str | None = None
    group: str | None = None
    buffer: str | None = None
    start: int | None = None
    reads: tuple[int, ...] = ()
    writes: tuple[str, ...] = ()


def collective_kind(op: str) -> str | None:
    """Kind of a functional collective op name ("all_gather_into_tensor_coalesced" -> "all_gather"),
    None for other ops (wait_tensor included)."""
    return KINDS.get(_VARIANT.sub("", op))


def _dotted(node: ast.AST) -> str:
    """'torch.ops.aten.mm.default' for an attribute chain; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    parts.append(node.id)
    return ".".join(reversed(parts))


def _names(node: ast.AST) -> list[str]:
    """Every variable name read inside ``node``, in source order."""
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]


def _arguments(call: ast.Call) -> list[str]:
    """Every variable name a call's arguments read (the called function's name left out)."""
    return [n for arg in (*call.args, *(k.value for k in call.keywords)) for n in _names(arg)]


def _find_functions(tree: ast.Module) -> tuple[ast.FunctionDef, dict[str, ast.FunctionDef]]:
    """(``call``, {"partition_0": def, ...}) of a wrapper module."""
    partitions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("partition_")}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node, partitions
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "call":
                    return item, partitions
    raise ValueError("no `call` function in this code: not an Inductor Python wrapper module "
                     "(pass the wrapper's source, e.g. the first string run_and_get_code returns)")


class _Walker:
    """Walks ``call`` (and the partitions it calls) and collects the events."""

    def __init__(self, partitions: dict[str, ast.FunctionDef], lines: list[str]):
        self.partitions = partitions
        self.events: list[Event] = []
        self.root: dict[str, int] = {}      # buffer name -> index of the start whose output it is
        self.outputs: dict[int, int] = {}   # start index -> outputs not yet waited
        self.used: set[str] = set()         # names some earlier statement assigned or passed (membership only)
        self.lines = lines                  # the source's lines, to read ``# reuse`` comments

    def walk(self, body: list[ast.stmt], where: str) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.With, ast.If, ast.For)):
                self.walk(stmt.body, where)
                self.walk(getattr(stmt, "orelse", []), where)
            elif isinstance(stmt, ast.Return) and where == "call" and stmt.value is not None:
                self._add("output", "return", stmt, where, reads=self._reads(stmt.value))
            elif isinstance(stmt, ast.Assign):
                targets = [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                self._statement(stmt.value, targets, stmt, where)
            elif isinstance(stmt, ast.Expr):
                self._statement(stmt.value, [], stmt, where)

    def _statement(self, value: ast.expr, targets: list[str], stmt: ast.stmt, where: str) -> None:
        partition = self._partition(value)
        if partition is not None:
            self.walk(self.partitions[partition].body, partition)
            return
        if not isinstance(value, ast.Call) or _dotted(value.func) == "reinterpret_tensor":
            source = _names(value)   # an alias: buf2 = buf1, buf2 = buf1[0], reinterpret_tensor(buf1, ...)
            if not self._reuses(stmt):
                self.used.update(targets)
            for target in targets:
                if len(source) >= 1 and source[0] in self.root:
                    self.root[target] = self.root[source[0]]
                else:
                    self.root.pop(target, None)
            return
        for target in targets:
            self.root.pop(target, None)
        if _dotted(value.func).startswith(_COPY_OUT) and value.args:
            source = next((self.root[n] for n in _names(value.args[0]) if n in self.root), None)
            if source is not None:
                self._add("compute", "overlapc.unpack_columns", stmt, where)   # a copy, not a use
                self.root.update((target, source) for target in targets)
                self.used.update(targets)
                return
        self._call(value, targets, stmt, where)

    def _reuses(self, stmt: ast.stmt) -> bool:
        """Whether ``stmt`` is Inductor's ``bufB = bufA; del bufA  # reuse`` (a new buffer)."""
        return 0 < stmt.lineno <= len(self.lines) and self.lines[stmt.lineno - 1].rstrip().endswith("# reuse")

    def _writes(self, call: ast.Call, targets: list[str]) -> tuple[str, ...]:
        """The names a compute call writes: its targets and the names no earlier statement used."""
        written = [*targets, *(n for n in _arguments(call) if n not in self.used)]
        return tuple(dict.fromkeys(written))

    def _compute(self, op: str, call: ast.Call, targets: list[str], stmt: ast.stmt, where: str) -> None:
        self._add("compute", op, stmt, where, reads=self._reads(call), writes=self._writes(call, targets))

    def _partition(self, value: ast.expr) -> str | None:
        """"partition_<i>" when ``value`` calls ``self.partitions[i](...)`` (or ``partitions[i]``)."""
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Subscript)):
            return None
        holder, index = value.func.value, value.func.slice
        if _dotted(holder).split(".")[-1] != "partitions" or not isinstance(index, ast.Constant):
            return None
        name = f"partition_{index.value}"
        if name not in self.partitions:
            raise ValueError(f"line {value.lineno}: calls {name}, which this code does not define")
        return name

    def _call(self, call: ast.Call, targets: list[str], stmt: ast.stmt, where: str) -> None:
        dotted = _dotted(call.func)
        parts = dotted.split(".")
        if len(parts) >= 4 and parts[:2] == ["torch", "ops"] and parts[2] in _NAMESPACES:
            self._collective_call(parts[3], call, targets, stmt, where)
        elif dotted.startswith("extern_kernels."):
            self._compute(dotted, call, targets, stmt, where)
        elif len(parts) == 2 and parts[1] == "run" and parts[0].startswith("triton_"):
            self._compute(parts[0], call, targets, stmt, where)
        elif len(parts) == 1 and parts[0].startswith(("cpp_fused", "triton_")):
            self._compute(parts[0], call, targets, stmt, where)
        elif len(parts) >= 4 and parts[:2] == ["torch", "ops"]:
            self._compute(f"{parts[2]}.{parts[3]}", call, targets, stmt, where)
        else:
            return                          # an allocation or a helper: neither an event nor a use
        self.used.update(targets)
        self.used.update(_arguments(call))

    def _collective_call(self, op: str, call: ast.Call, targets: list[str], stmt: ast.stmt, where: str) -> None:
        if op == "wait_tensor":
            buffer = (_names(call.args[0]) or [None])[0] if call.args else None
            start = self.root.get(buffer) if buffer is not None else None
            opened = self.events[start] if start is not None else None
            self._add("wait", op, stmt, where, collective=opened and opened.collective,
                      group=opened and opened.group, buffer=buffer, start=start)
            if start is not None and self.outputs.get(start, 0) > 0:
                self.outputs[start] -= 1
            return
        kind = collective_kind(op)
        if kind is None:
            self._compute(f"_c10d_functional.{op}", call, targets, stmt, where)
            return
        out = [k.value for k in call.keywords if k.arg == "out"]
        if out:
            produced = _names(out[0])
        elif op.endswith("_"):            # in place: the input is the output
            produced = _names(call.args[0]) if call.args else []
        else:
            produced = targets
        first = call.args[0] if call.args else None
        count = len(first.elts) if "coalesced" in op and isinstance(first, (ast.List, ast.Tuple)) else 1
        index = len(self.events)
        self._add("start", op, stmt, where, collective=kind, group=_group(call),
                  buffer=produced[0] if produced else None, start=index, reads=self._reads(call))
        self.outputs[index] = count
        for name in produced:
            self.root[name] = index

    def _reads(self, node: ast.AST) -> tuple[int, ...]:
        found: list[int] = []
        for name in _names(node):
            start = self.root.get(name)
            if start is not None and start not in found:
                found.append(start)
        return tuple(found)

    def _add(self, kind: str, op: str, stmt: ast.stmt, where: str, **fields) -> None:
        self.events.append(Event(len(self.events), kind, op, stmt.lineno, where, **fields))


def _group(call: ast.Call) -> str | None:
    """The group name a collective call passes: its ``group_name=`` or its last string argument."""
    for keyword in call.keywords:
        if keyword.arg in ("group_name", "tag") and isinstance(keyword.value, ast.Constant):
            return str(keyword.value.value)
    strings = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return strings[-1] if strings else None


def events(code: str) -> list[Event]:
    """The events of one wrapper module's ``call``, in run order (see the module docstring)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        raise ValueError(f"not Python wrapper code ({error.msg} at line {error.lineno}); C++ wrappers "
                         f"(cpp_wrapper=True) are not read") from None
    call, partitions = _find_functions(tree)
    walker = _Walker(partitions, code.splitlines())
    walker.walk(call.body, "call")
    return walker.events


def _waited(events: list[Event]) -> dict[int, int]:
    """start index -> index of the wait that closes it (its last output's wait)."""
    closing: dict[int, int] = {}
    for event in events:
        if event.kind == "wait" and event.start is not None:
            closing[event.start] = event.index
    return closing


def open_after(events: list[Event], kind: str | None = None, group: str | None = None,
               whole: Mapping[int, str] | None = None) -> list[int]:
    """After each event, how many collectives (of ``kind`` and ``group`` when given) are
    started and not yet closed by the wait of their last output. ``whole``: start index ->
    name of the collective it is a piece of (overlapc's chunked collectives count as one
    while any piece is open); a start it leaves out is a whole of its own."""
    closing = _waited(events)
    pieces: dict[object, int] = {}    # whole -> its open pieces
    counts = []
    for event in events:
        start = events[event.start] if event.start is not None else None
        if start is not None and (kind is None or start.collective == kind) \
                and (group is None or start.group == group):
            key = whole.get(start.index, start.index) if whole is not None else start.index
            if event.kind == "start":
                pieces[key] = pieces.get(key, 0) + 1
            elif event.kind == "wait" and closing.get(start.index) == event.index:
                pieces[key] -= 1
                if not pieces[key]:
                    del pieces[key]
        counts.append(len(pieces))
    return counts


def max_in_flight(events: list[Event], kind: str | None = None, group: str | None = None,
                  whole: Mapping[int, str] | None = None) -> int:
    """The most collectives (of ``kind`` / ``group`` when given, else all) open at once;
    ``whole`` as in ``open_after``."""
    return max(open_after(events, kind, group, whole), default=0)


def never_waited(events: list[Event]) -> list[Event]:
    """The starts no wait closes (the code leaves them in flight past its end)."""
    closing = _waited(events)
    return [e for e in events if e.kind == "start" and e.index not in closing]


def first_use(events: list[Event], start: int) -> Event | None:
    """The first event after ``start`` that reads its output (compute, another start, or the
    output), waits excluded; None when nothing does."""
    for event in events[start + 1:]:
        if event.kind != "wait" and start in event.reads:
            return event
    return None


def consumer_order_breaks(events: list[Event], kind: str = "all_gather") -> list[str]:
    """Where collectives of ``kind`` are not started in the order of their first use, per
    group: one message per start whose first use comes before the first use of a start of
    the same group issued earlier. Starts whose output nothing reads are left out. Empty
    when the order holds."""
    breaks = []
    latest: dict[str | None, tuple[Event, Event]] = {}   # group -> (start, its first use) with the latest use so far
    for start in (e for e in events if e.kind == "start" and e.collective == kind):
        use = first_use(events, start.index)
        if use is None:
            continue
        previous = latest.get(start.group)
        if previous is not None and use.index < previous[1].index:
            breaks.append(f"{start.op} of {start.buffer} (line {start.line}, group {start.group}) is first used at "
                          f"line {use.line} ({use.op}), before {previous[0].buffer} (started earlier, line "
                          f"{previous[0].line}) is first used at line {previous[1].line} ({previous[1].op})")
        else:
            latest[start.group] = (start, use)
    return breaks


def compute_between(events: list[Event]) -> dict[int, int]:
    """start index -> how many compute events run between the start and the wait that closes
    it (to the end of the code when none does)."""
    closing = _waited(events)
    result = {}
    for start in (e for e in events if e.kind == "start"):
        end = closing.get(start.index, len(events))
        result[start.index] = sum(1 for e in events[start.index + 1:end] if e.kind == "compute")
    return result


def starts(events: list[Event], kind: str | None = None) -> list[Event]:
    """The start events (of ``kind`` when given), in issue order."""
    return [e for e in events if e.kind == "start" and (kind is None or e.collective == kind)]


def summary(events: list[Event]) -> dict:
    """JSON-able counts of one wrapper's events: starts per kind, max in flight per kind and
    overall, consumer-order breaks of all-gathers, starts with no compute before their wait."""
    kinds = sorted({e.collective for e in starts(events)})
    between = compute_between(events)
    return {"starts": {k: len(starts(events, k)) for k in kinds},
            "compute": sum(1 for e in events if e.kind == "compute"),
            "max_in_flight": {**{k: max_in_flight(events, k) for k in kinds}, "all": max_in_flight(events)},
            "consumer_order_breaks": consumer_order_breaks(events),
            "never_waited": [e.buffer for e in never_waited(events)],
            "no_compute_before_wait": [f"{events[i].op} {events[i].buffer} (line {events[i].line})"
                                       for i, n in between.items() if n == 0]}


# ---------------------------------------------------------------- compute windows

_MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution.")


@dataclasses.dataclass(frozen=True)
class Window:
    """One collective's window in a post-grad FX graph: the compute nodes between its start
    and its first wait, in graph order. start: the start node's name; kind: "all_gather", ...;
    nodes: names of the call_function nodes in between that are neither a collective's start
    or wait nor an alias (view, getitem); matmuls: those that are matmuls or convolutions
    (Inductor lowers them where they stand and never inlines them); deferrable: the others
    whose readers all come after the wait (Inductor computes such an op when it lowers its
    first reader, so after the wait)."""

    start: str
    kind: str
    nodes: tuple[str, ...]
    matmuls: tuple[str, ...] = ()
    deferrable: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Lowered:
    """What ``capture`` records for one graph Inductor generated code for: its collectives'
    windows (``fx_windows`` of the graph it lowered) and, per buffer Inductor allocated, the
    FX node that buffer materialises (its origin latest in graph order; the other origins
    are nodes Inductor inlined into it)."""

    windows: tuple[Window, ...]
    buffers: Mapping[str, str]


def fx_windows(gm: torch.fx.GraphModule) -> list[Window]:
    """The window of every collective of ``gm``, in the order of their starts."""
    from overlapc.passes import collectives as found

    nodes = list(gm.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    placed = sorted(found.collectives(gm), key=lambda c: position[c.start])
    edges = {n for c in placed for n in (c.start, *c.waits)}      # membership only
    windows = []
    for collective in placed:
        end = min((position[w] for w in collective.waits), default=len(nodes))
        inside = [n for n in nodes[position[collective.start] + 1:end]
                  if n.op == "call_function" and n not in edges and not found.is_alias(n)]
        matmuls = [n for n in inside if str(n.target).startswith(_MATMULS)]
        deferrable = [n for n in inside if n not in matmuls and all(position[u] > end for u in n.users)]
        windows.append(Window(collective.start.name, collective.kind, *(tuple(n.name for n in group)
                                                                       for group in (inside, matmuls, deferrable))))
    return windows


def _materialised(lowering) -> dict[str, str]:
    """buffer name -> the FX node it materialises, for one GraphLowering after codegen."""
    position = {node: index for index, node in enumerate(lowering.module.graph.nodes)}
    homes = {}
    for name, buffer in lowering.name_to_buffer.items():
        origins = [o for o in getattr(buffer, "origins", ()) if o in position]
        if origins:
            homes[name] = max(origins, key=position.__getitem__).name
    return homes


@contextlib.contextmanager
def capture():
    """While active, every graph Inductor generates code for appends a ``Lowered`` to the
    list this yields, in compile order (the order ``run_and_get_code`` returns codes).
    Patches ``GraphLowering.codegen`` for the duration (process-wide) and reads Inductor
    internals after it ran: ``GraphLowering.module`` (the post-grad graph) and
    ``name_to_buffer`` with each IR buffer's ``origins`` (the same in torch 2.13 and
    2.14.1). An FX graph cache hit generates no code and records nothing (turn the cache
    off to see every graph)."""
    from torch._inductor.graph import GraphLowering

    seen: list[Lowered] = []
    codegen = GraphLowering.codegen

    def recording(self, *args, **kwargs):
        result = codegen(self, *args, **kwargs)
        seen.append(Lowered(tuple(fx_windows(self.module)), _materialised(self)))
        return result

    GraphLowering.codegen = recording
    try:
        yield seen
    finally:
        GraphLowering.codegen = codegen


def _span(events: list[Event], start: Event, closing: dict[int, int]) -> range:
    """Indices of the events between a start and the wait that closes it (the end when none does)."""
    return range(start.index + 1, closing.get(start.index, len(events)))


def window_breaks(events: list[Event], windows: list[Window], buffers: Mapping[str, str] | None = None) -> list[str]:
    """Where compute that the FX graph ran between a collective's start and its wait is no
    longer between them in the wrapper code ``events`` came from. ``windows``: the graph's
    ``fx_windows``, matched to the code's starts in order. Empty when every window holds.

    With ``buffers`` (``Lowered.buffers`` of the same compile), per window, a "kernel of
    the window" is a compute event whose written buffers all materialise window nodes:
    - moved: a kernel of the window runs outside it, unless all it computes is deferrable
      (``Window.deferrable``) and it runs after the wait (Inductor computes those at
      their reader; not a reordering);
    - lost: no compute event runs between the start and the wait, while some compute
      event materialises a window node that is not deferrable.
    So every window that holds a matmul, or an op read inside the window, keeps compute,
    and no reordering moves its kernels out. Not checked (``fused_out`` names them): a
    kernel that materialises window nodes together with nodes outside the window (Inductor
    fused them; it runs where its other nodes allow), window nodes inlined into a kernel of
    a node outside, deferrable nodes computed after the wait, and buffers no compute event
    is seen writing (a kernel that mutates an earlier buffer), and window kernels that run
    before a start whose input copy, or an earlier start's, Inductor fused with compute
    outside that window (the fused kernel, and the starts after it, wait for them).
    Without ``buffers`` (the code alone): a window holding a matmul or convolution
    (``Window.matmuls``) is lost when no compute event runs in it.
    A start count that differs from the windows' is one break."""
    found = starts(events)
    if len(found) != len(windows):
        return [f"{len(found)} collective starts in the code, {len(windows)} in the FX graph"]
    closing = _waited(events)
    computed = None if buffers is None else [(e, [buffers[b] for b in e.writes if b in buffers])
                                             for e in events if e.kind == "compute"]
    breaks = []
    delayed_by = None   # the latest fused input copy of this start or an earlier one (starts keep their order)
    for window, start in zip(windows, found):
        span = _span(events, start, closing)
        label = f"{window.kind} {window.start} (line {start.line})"
        empty = not any(events[i].kind == "compute" for i in span)
        if computed is not None:
            fill = _input_fill(start, computed)
            if fill is not None and fill[1] and not set(window.nodes).issuperset(fill[1]):
                delayed_by = fill[0].index
            breaks += [f"{label}: {b}" for b in _buffer_breaks(window, start, span, empty, computed, delayed_by)]
        elif empty and window.matmuls:
            breaks.append(f"{label}: lost: no compute before its wait, where the FX graph ran {list(window.matmuls)}")
    return breaks


def _input_fill(start: Event, computed: list[tuple[Event, list[str]]]):
    """(event, FX nodes it materialises) of the last compute event before ``start`` that
    writes the start's buffer (an in-place collective's input copy), or None."""
    before = [(e, homes) for e, homes in computed if e.index < start.index and start.buffer in e.writes]
    return before[-1] if before else None


def _buffer_breaks(window: Window, start: Event, span: range, empty: bool,
                   computed: list[tuple[Event, list[str]]], delayed_by: int | None = None) -> list[str]:
    """``window_breaks``' rules with buffers, for one window; ``computed``: each compute
    event with the FX nodes its written buffers materialise. ``delayed_by``: the index of
    the kernel that fills the start's buffer when Inductor fused that copy with compute
    outside the window: kernels of the window before it ran before the start because the
    fusion delayed the start, which no setting prevents (listed by ``fused_out``, not
    counted)."""
    inside, deferrable = set(window.nodes), set(window.deferrable)     # membership only
    breaks = []
    kept = sorted({h for _, homes in computed for h in homes if h in inside and h not in deferrable})
    if empty and kept:
        breaks.append(f"lost: no compute before its wait, where the FX graph ran {kept}")
    for event, homes in computed:
        if not homes or not inside.issuperset(homes) or event.index in span:
            continue
        if event.index > span.stop and deferrable.issuperset(homes):
            continue
        if delayed_by is not None and event.index < delayed_by:
            continue
        side = "before its start" if event.index < start.index else "after its wait"
        breaks.append(f"moved: {event.op} (line {event.line}, computing {homes}) runs {side}")
    return breaks


def fused_out(events: list[Event], windows: list[Window], buffers: Mapping[str, str]) -> list[str]:
    """Window compute Inductor runs outside the window without a reordering pass, which
    ``window_breaks`` does not count (see there): per window, the kernels outside it that
    materialise window nodes (fused with other nodes, or deferrable ones computed at their
    reader), and, for a window left without compute, the window nodes no kernel
    materialises (inlined into a reader outside). Same matching as ``window_breaks``."""
    closing = _waited(events)
    homes = set(buffers.values())
    said = []
    for window, start in zip(windows, starts(events)):
        span = _span(events, start, closing)
        inside = set(window.nodes)
        for event in (e for e in events if e.kind == "compute" and e.index not in span):
            mine = [buffers[b] for b in event.writes if buffers.get(b) in inside]
            if mine:
                said.append(f"{window.kind} {window.start}: {mine} computed by {event.op} (line {event.line})")
        if not any(events[i].kind == "compute" for i in span):
            inlined = [n for n in window.nodes if n not in homes]
            if inlined:
                said.append(f"{window.kind} {window.start}: {inlined} inlined into kernels outside; none in the window")
    return said


def window_summary(events: list[Event], lowered: Lowered) -> dict:
    """JSON-able account of one wrapper's compute windows (``lowered``: what ``capture``
    recorded for the same compile): how many collectives have FX compute in their window,
    how many of those still have compute between start and wait in the code, the
    ``window_breaks`` and the ``fused_out`` notes."""
    closing = _waited(events)
    windows = list(lowered.windows)
    with_compute = [(w, s) for w, s in zip(windows, starts(events)) if w.nodes]
    kept = sum(any(events[i].kind == "compute" for i in _span(events, s, closing)) for _, s in with_compute)
    return {"with_compute": len(with_compute), "kept": kept,
            "breaks": window_breaks(events, windows, lowered.buffers),
            "fused_out": fused_out(events, windows, lowered.buffers)}

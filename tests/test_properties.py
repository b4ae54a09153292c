"""Property tests: random layered graphs with random collectives, random limits.

After scheduling: the graph lints, every node keeps its inputs, the scheduled
graph computes the same values as the original (collectives replaced by local
stand-ins with the same shapes), and, checked here independently of
overlapc.verify and of overlapc's scheduling code (``independent_checks``),
barriers included: consumer order, waits before their first real consumer (an
all-gather's just before it), the count and byte budget without exception, and
peak live bytes (counted here, ``live_peak``) <= the original order's peak and
the serial order's (built here, ``serial_order``: each all-gather right before
its wait, everything else waited right after its start) + the bytes in flight;
scheduling is deterministic.
"""
import itertools
import operator

import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings, strategies as st

import overlapc
from graphs import F, ag, trace, wait
from overlapc.passes.bucket_ops import pack

N_MAX = 6


@st.composite
def programs(draw):
    n = draw(st.integers(1, N_MAX))
    flags = lambda p=0.5: draw(st.lists(st.booleans(), min_size=n, max_size=n))  # noqa: E731
    return dict(
        n=n,
        group=draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),   # index into the groups
        cast=flags(), view=flags(), rs=flags(), ar=flags(), out=flags(),
        barrier=flags(),
        upfront=draw(st.booleans()),
        wait_early=draw(st.booleans()),
        perm=draw(st.permutations(list(range(n)))),
        use_barriers=draw(st.integers(0, 3)) == 0,
    )


def build(p, groups):
    """The program ``p`` as a function; ``groups``: the two process group names."""
    group = [groups[i] for i in p["group"]]

    def fn(x, *ws):
        started, waited, outs = {}, {}, []

        def start(i):
            w = ws[i].to(torch.bfloat16) if p["cast"][i] else ws[i]
            started[i] = ag(w, group[i])

        if p["upfront"]:
            for i in p["perm"]:
                start(i)
            if p["wait_early"]:
                for i in p["perm"]:
                    waited[i] = wait(started[i])
        for i in range(p["n"]):
            if i not in started:
                start(i)
            if i not in waited:
                waited[i] = wait(started[i])
            full = waited[i].float() if p["cast"][i] else waited[i]
            full = full.view(16, 16).t() if p["view"][i] else full.t()
            x = torch.tanh(x @ full)
            if p["rs"][i]:
                outs.append(wait(F.reduce_scatter_tensor(x, "sum", 8, group[i])))
            if p["ar"][i]:
                x = x + wait(F.all_reduce(x, "sum", group[i]))
            if p["use_barriers"] and p["barrier"][i]:
                torch.ops.aten.add_(ws[0], 0)   # a write into a graph input: a barrier
            if p["out"][i]:
                outs.append(waited[i])
        return (x, *outs)
    return fn


PACK = torch.ops.overlapc.pack.default


class LocalCollectives(fx.Interpreter):
    """Runs a graph with collectives replaced by local ops of the same shapes. Rank r's
    shard of an all-gather is the local one times 2**r: exact in every float dtype, so a
    cast commutes with the gather as with a real one (the narrow-gather rewrite casts first).
    A byte bucket's shard (``overlapc.pack`` of parts of several dtypes, as bytes) is the
    pack of its parts times 2**r, so that each part is gathered as it would be alone; other
    bytes (float8 carried as uint8) are the same on every rank."""

    def run_node(self, n):
        self.node = n
        if n.target is PACK:   # its parts, kept for the gather (``_byte_shard``)
            self.parts = getattr(self, "parts", {})
            self.parts[n] = [self.env[part] for part in n.args[0]]
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if target == F.all_gather_into_tensor.default:
            if args[0].dtype == torch.uint8:
                return torch.cat([self._byte_shard(self.node.args[0], args[0], r) for r in range(args[1])])
            return torch.cat([args[0] * 2.0 ** r for r in range(args[1])])
        if target == F.reduce_scatter_tensor.default:
            return args[0].chunk(args[2])[0] * 3
        if target == F.all_reduce.default:
            return args[0] * 0.5
        if target == F.wait_tensor.default:
            return args[0].clone()
        return super().call_function(target, args, kwargs)


    def _byte_shard(self, source: fx.Node, value: torch.Tensor, r: int) -> torch.Tensor:
        if source.target is not PACK or not source.args[2]:
            return value
        parts = [part * 2.0 ** r for part in self.parts[source]]
        return pack(parts, source.args[1], True)


def inputs_for(p):
    torch.manual_seed(1)
    return [torch.randn(16, 16)] + [torch.randn(2, 16) for _ in range(p["n"])]


def order(gm):
    return [n.name for n in gm.graph.nodes]


_CHEAP = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._to_copy.default,
          torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default,
          torch.ops.prims.convert_element_type.default}


def _over_waits(node):
    """(reaches a wait, only through cheap nodes and placeholders)"""
    if node.target == F.wait_tensor.default:
        return True, True
    if node.op == "placeholder":
        return False, True
    if node.target not in _CHEAP:
        return False, False
    found = [_over_waits(i) for i in node.all_input_nodes]
    return any(f for f, _ in found), all(ok for _, ok in found)


def _chained(start):
    """Whether a start reads another collective's result through cheap nodes, or
    through one elementwise node computing on such results and placeholders alone
    (a matmul or a reduction in between stays compute: the start is not chained)."""
    for i in start.all_input_nodes:
        found, ok = _over_waits(i)
        if found and ok:
            return True
        if i.op == "call_function" and torch.Tag.pointwise in getattr(i.target, "tags", ()):
            inner = [_over_waits(j) for j in i.all_input_nodes]
            if any(f for f, _ in inner) and all(ok for _, ok in inner):
                return True
    return False


def held(c, ahead=frozenset()):
    """Bytes a collective holds in flight: an all-gather's output and input; any
    other's input, and its output too when it is chained (reads another
    collective's result), since its start may go ahead of where it stood, or when
    its start went ahead of compute (``ahead``: such starts, ``went_ahead``)."""
    inputs = sum(i.meta["val"].numel() * i.meta["val"].element_size() for i in c.start.all_input_nodes)
    return (c.nbytes if c.kind == "all_gather" or _chained(c.start) or c.start in ahead else 0) + inputs


def went_ahead(rows, before, nodes, pos):
    """Starts of ``rows`` now placed before compute (a call_function that is neither a
    collective's start or wait, a getitem, a view nor a node feeding starts only) that
    stood before them in ``before``: their outputs are allocated earlier than the order
    handed in allocated them."""
    starts, memo = {c.start for c in rows}, {}
    edges = starts | {w for c in rows for w in c.waits}
    compute = [n for n in before if n.op == "call_function" and n not in edges and n.target is not operator.getitem
               and n.target not in _ALIASES and not _feeds_only(n, starts, memo)]
    at_before = {n: i for i, n in enumerate(before)}
    return frozenset(c.start for c in rows if any(
        at_before[n] < at_before[c.start] and pos[n] > pos[c.start] for n in compute))


def piece(c):
    """The collective ``c`` is a piece of (``mark_pieces``), else its own start's name."""
    return c.start.meta.get("overlapc_piece_of", c.start.name)


def mark_pieces(gm):
    """Mark the movable collectives of each group and kind, two by two in graph
    order, as the pieces of one chunked collective (as the chunk pass marks its
    pieces), so the count bound sees them as one."""
    seen = {}
    for c in overlapc.collectives(gm):
        if c.movable:
            i = seen[(c.group, c.kind)] = seen.get((c.group, c.kind), -1) + 1
            c.start.meta["overlapc_piece_of"] = f"whole_{c.group}_{c.kind}_{i // 2}"


_ALIASES = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.t.default,
            torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.expand.default,
            torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.alias.default,
            torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default, torch.ops.aten.split.Tensor,
            torch.ops.aten.split_with_sizes.default, torch.ops.aten.view.dtype, operator.getitem}
_BARRIERS = {torch.ops.aten.add_.Tensor, torch.ops.aten.copy_.default}   # the tests' barriers: writes into inputs


def _aliases(node):
    """Whether ``node``'s output is a view of its first input (a wait returns its start's buffer,
    an in-place op its destination)."""
    return node.target in _ALIASES or node.target in _BARRIERS or node.target == F.wait_tensor.default


def _nbytes(node):
    """Bytes the node's storage spans: per tensor, 1 + sum((size - 1) * stride) elements."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor) and v.numel():
            total += (1 + sum((n - 1) * abs(st) for n, st in zip(v.shape, v.stride()))) * v.element_size()
    return total


def _is_pointwise(node):
    """Pure elementwise (tagged pointwise, or a dtype cast): Inductor emits it as a loop body."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target._schema.is_mutable:
        return False
    return torch.Tag.pointwise in node.target.tags or node.target == torch.ops.aten._to_copy.default


def _reads_in_a_loop(node):
    """``node`` reads its inputs inside its own loop: elementwise, a reduction, a cat, or a
    view (not a wait, not a barrier) whose users all do."""
    if _is_pointwise(node) or node.target == torch.ops.aten.cat.default:
        return True
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.reduction in node.target.tags:
        return True
    return node.target in _ALIASES and bool(node.users) and all(_reads_in_a_loop(u) for u in node.users)


def _storages(nodes):
    """(root, through): node -> the storage it writes (itself, or the input it aliases or
    overwrites); and, for a node Inductor computes inside its readers' loops (fused away,
    allocating nothing: an elementwise node whose readers all read in a loop; several
    readers only if it reads <= 4 storages), the storages it reads, which its readers
    then read."""
    root, through = {}, {}
    for n in _topological(nodes):
        reads = []
        for i in n.all_input_nodes:
            for r in through.get(root[i], [root[i]]):
                if r not in reads:
                    reads.append(r)
        if n.all_input_nodes and _aliases(n):
            root[n] = root[n.all_input_nodes[0]]
        elif _is_pointwise(n) and n.users and (len(n.users) == 1 or len(reads) <= 4) \
                and all(_reads_in_a_loop(u) for u in n.users):
            root[n], through[n] = n, reads
        else:
            root[n] = _overwritten(n, root, through) or n
    return root, through


def _overwritten(node, root, through):
    """The input whose buffer an elementwise kernel writes its output into: a non-collective
    compute node's own storage (not fused away, not reused), read only here, same dtype,
    95-100% of the output's bytes."""
    if not _is_pointwise(node) or not node.users or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    for i in node.all_input_nodes:
        mine, theirs = node.meta["val"], i.meta.get("val")
        own = root[i] is i and i not in through and i.op == "call_function" and i.target not in _STARTS
        if own and len(i.users) == 1 and isinstance(theirs, torch.Tensor) and theirs.dtype == mine.dtype \
                and 0 < 0.95 * _nbytes(i) <= _nbytes(node) <= _nbytes(i):
            return i
    return None


_STARTS = {F.all_gather_into_tensor.default, F.reduce_scatter_tensor.default, F.all_reduce.default,
           F.all_to_all_single.default}


def live_peak(nodes, rows):
    """Peak live bytes of ``nodes`` (an order of one graph), counted here as Inductor's code
    allocates them: a node that is not an alias allocates its output, unless it is fused
    away or overwrites an input (``_storages``); a storage is freed after the last node that
    reads it or an alias of it (the output node reads the results: they live to the end;
    a graph input nothing reads lives to the end too); a collective's inputs (``rows``) are
    held until its last wait."""
    pos = {n: i for i, n in enumerate(nodes)}
    root, through = _storages(nodes)
    held_until = {c.start: max(pos[w] for w in c.waits) for c in rows}
    last = {n: len(nodes) - 1 for n in nodes if n.op == "placeholder" and not n.users}
    for n in nodes:
        until = held_until.get(n, pos[n])
        for i in n.all_input_nodes:
            for r in through.get(root[i], [root[i]]):
                last[r] = max(last.get(r, -1), until)
    change = [0] * (len(nodes) + 1)
    for n in nodes:
        if root[n] is n and n not in through:
            change[pos[n]] += _nbytes(n)
            change[max(last.get(n, pos[n]), pos[n]) + 1] -= _nbytes(n)
    peak = running = 0
    for delta in change:
        running += delta
        peak = max(peak, running)
    return peak


def _topological(nodes):
    """``nodes`` sorted so that every node follows its inputs (the graph order does)."""
    order, seen = [], set()
    for n in nodes[0].graph.nodes:
        assert all(i in seen for i in n.all_input_nodes), n.name
        seen.add(n)
        order.append(n)
    return order


def _feeds_only(node, starts, memo):
    """Whether every use of ``node`` is a collective start or a node that feeds only starts."""
    if node not in memo:
        memo[node] = bool(node.users) and node.op == "call_function" and node.target not in _BARRIERS \
            and all(u in starts or _feeds_only(u, starts, memo) for u in node.users)
    return memo[node]


def serial_order(nodes, rows):
    """The memory reference, built here: each all-gather's start (with what feeds only it)
    right before its first wait; every other collective's waits right after its start."""
    starts = {c.start for c in rows}
    move_late = {}   # node -> the wait it goes right before
    wait_early = {}  # start -> its waits
    for c in rows:
        if c.kind == "all_gather":
            first_wait = min(c.waits, key=nodes.index)
            chain = [c.start] + [u for u in c.start.users if u.target is operator.getitem]
            frontier, memo = list(c.start.all_input_nodes), {}
            while frontier:   # what computes only for this start, up to waits and other starts
                n = frontier.pop()
                if n not in chain and n.target != F.wait_tensor.default and n not in starts \
                        and _feeds_only(n, {c.start}, memo) and all(u in chain for u in n.users):
                    chain.append(n)
                    frontier.extend(n.all_input_nodes)
            for n in chain:
                move_late[n] = first_wait
        else:
            wait_early[c.start] = sorted(c.waits, key=nodes.index)
    early = {w for ws in wait_early.values() for w in ws}
    before = {}
    for n in nodes:
        if n in move_late:
            before.setdefault(move_late[n], []).append(n)
    out = []
    for n in nodes:
        if n in move_late or n in early:
            continue
        out.extend(before.get(n, ()))
        out.append(n)
        out.extend(wait_early.get(n, ()))
    assert len(out) == len(nodes) and set(out) == set(nodes)
    placed = set()
    for n in out:
        assert all(i in placed for i in n.all_input_nodes), n.name
        placed.add(n)
    return out


def _first_consumers(nodes, pos, region, region_end, c):
    """Position of the first real consumer of ``c``'s result in ``nodes``: the first
    user (through aliases) that is not an alias, or the output node, or the end of
    its region."""
    found, frontier = [], list(c.waits)
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.target in _ALIASES:
                frontier.append(u)
            else:
                found.append(pos[u])
    return min(found + [region_end[region[pos[c.start]]]])


def _placeable(gm, nodes, pos):
    """(region per position: barriers before it; the collectives with waits; those of them
    that may move: collectives whose start and wait lie on two sides of a barrier stay put)."""
    region = list(itertools.accumulate((n.target in _BARRIERS for n in nodes), initial=0))[:-1]
    found = [c for c in overlapc.collectives(gm) if c.waits]
    rows = [c for c in found if c.movable and all(region[pos[w]] == region[pos[c.start]] for w in c.waits)]
    return region, found, rows


def check_count_with_pinned(nodes, region, found, limit):
    """Guarantee 2 with collectives that stay where they stand: at every compute node
    (not a collective, a wait or a view), per group and kind, the collectives open
    across it (start before, last wait after; a chunked one's pieces as one) number at
    most ``limit``, or are all pinned (start and last wait in two regions:
    ``region[i]``, barriers before position ``i``) where those alone reach it."""
    if limit is None:
        return
    pos = {n: i for i, n in enumerate(nodes)}
    spans = []   # (group, kind, first, last, piece, pinned)
    for c in found:
        last = max(pos[w] for w in c.waits)
        spans.append((c.group, c.kind, pos[c.start], last, piece(c), region[pos[c.start]] != region[last]))
    collective_nodes = {c.start for c in found} | {w for c in found for w in c.waits}
    for i, node in enumerate(nodes):
        if node.op != "call_function" or node in collective_nodes or node.target in _ALIASES:
            continue
        open_here, pinned_here = {}, {}
        for group, kind, first, last, whole, pinned in spans:
            if first < i < last:
                open_here.setdefault((group, kind), set()).add(whole)
                if pinned:
                    pinned_here.setdefault((group, kind), set()).add(whole)
        for key, wholes in open_here.items():
            pinned = len(pinned_here.get(key, ()))
            assert len(wholes) <= max(limit, pinned), (node.name, key, sorted(wholes), pinned, limit)


def serial_peak(gm):
    """Peak live bytes (``live_peak``) of ``gm``'s serial order (``serial_order``), built and
    counted here."""
    nodes = list(gm.graph.nodes)
    _, found, rows = _placeable(gm, nodes, {n: i for i, n in enumerate(nodes)})
    return live_peak(serial_order(nodes, rows), found)


def independent_checks(gm, cfg, before=None):
    """The guarantees, recomputed here from the graph without overlapc's scheduling
    code (``overlapc.collectives`` names the collectives; first consumers, regions,
    bounds, held bytes, live bytes and the serial reference are computed here).
    ``before``: the nodes in their order before scheduling; not compared with where a
    rewrite (buckets, narrow gathers) replaced some of them."""
    nodes = list(gm.graph.nodes)
    if before is not None and not set(before) <= set(nodes):
        before = None
    pos = {n: i for i, n in enumerate(nodes)}
    region, found, rows = _placeable(gm, nodes, pos)
    region_end = {}
    for i in reversed(range(len(nodes))):
        closes = nodes[i].target in _BARRIERS or nodes[i].op == "output"
        region_end[region[i]] = i if closes else region_end.get(region[i], i)
    first = {c.start: _first_consumers(nodes, pos, region, region_end, c) for c in rows}
    # consumer order per group and region
    for group in sorted({c.group for c in rows}):
        for r in sorted(set(region)):
            gathers = sorted((c for c in rows if c.kind == "all_gather" and c.group == group
                              and region[pos[c.start]] == r), key=lambda c: pos[c.start])
            firsts = [first[c.start] for c in gathers]
            assert firsts == sorted(firsts), (group, [(c.start.name, f) for c, f in zip(gathers, firsts)])
    # waits: before the first consumer; an all-gather's only waits, starts and their input chains away
    starts = {c.start for c in rows}
    memo = {}
    for c in rows:
        for w in c.waits:
            assert pos[w] < first[c.start], (w.name, nodes[first[c.start]].name)
            if c.kind == "all_gather":
                between = nodes[pos[w] + 1:first[c.start]]
                assert all(n.target in (F.wait_tensor.default, operator.getitem) or n.target in _ALIASES
                           or n in starts or _feeds_only(n, starts, memo) for n in between), \
                    (w.name, [n.name for n in between])
    # the bound, without exception: per group and kind at most max_in_flight open (pieces
    # of one collective count once); per group the held bytes within the budget unless the
    # collective issued is the only one open ("auto": checked on the outcome below)
    budget = cfg.max_in_flight_bytes
    # outputs allocated early count in flight (under "serial-peak" its headroom holds them: the stricter bound)
    ahead = went_ahead(rows, before, nodes, pos) if before is not None and budget != "serial-peak" else frozenset()
    held_now = {c.start: held(c, ahead) for c in rows}
    if budget == "auto":   # a chunked collective's pieces together (the limits count no early output)
        whole = {}
        for c in rows:
            whole[(c.group, piece(c))] = whole.get((c.group, piece(c)), 0) + held(c)
        twice_largest = {g: 2 * max(b for (h, _), b in whole.items() if h == g) for g in {c.group for c in rows}}
    live, peak_total = {}, 0
    waits_left = {c.start: len(c.waits) for c in rows}
    of_start = {c.start: c for c in rows}
    of_wait = {w: c for c in rows for w in c.waits}
    for node in nodes:
        c = of_start.get(node)
        if c is not None:
            live.setdefault(c.group, []).append(c)
            same_kind = {piece(o) for o in live[c.group] if o.kind == c.kind}   # pieces count once
            if cfg.max_in_flight is not None:
                assert len(same_kind) <= cfg.max_in_flight, (node.name, len(same_kind), cfg.max_in_flight)
            total = sum(held_now[o.start] for o in live[c.group])
            if isinstance(budget, int) and total > budget:
                others = [o.start.name for o in live[c.group] if piece(o) != piece(c)]
                assert not others, (node.name, total, budget, others)
            peak_total = max(peak_total, sum(held_now[o.start] for g in live for o in live[g]))
        c = of_wait.get(node)
        if c is not None:
            waits_left[c.start] -= 1
            if not waits_left[c.start]:
                live[c.group].remove(c)
    check_count_with_pinned(nodes, region, found, cfg.max_in_flight)
    # memory: no more than the original order's peak, nor the serial order's, plus what was in flight
    peak = live_peak(nodes, found)
    references = [live_peak(serial_order(nodes, rows), found)]
    if before is not None:
        references.append(live_peak(before, found))
    for reference in references:
        assert peak <= reference + peak_total, (peak, references, peak_total)
        if cfg.max_in_flight_bytes == "auto":   # and no more than the auto budgets allow above it
            assert peak <= reference + sum(twice_largest.values()), (peak, references)


@settings(max_examples=int(__import__("os").environ.get("OVERLAPC_EXAMPLES", "120")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=programs(), limit=st.sampled_from([1, 2, 3, None]), byte_limit=st.sampled_from([None, 2048, 4096, "auto"]),
       pieces=st.booleans(), issue=st.sampled_from(["early", "per-kernel"]))
def test_random_graphs_keep_every_guarantee(fake_pg, two_groups, p, limit, byte_limit, pieces, issue):
    # the core alone (bucketing rewrites nodes; tests/test_bucket.py checks it)
    cfg = overlapc.OverlapConfig(max_in_flight=limit, max_in_flight_bytes=byte_limit, bucket=None, issue=issue,
                                 on_error="raise")
    shapes = [(16, 16)] + [(2, 16)] * p["n"]
    groups = (fake_pg.group_name, two_groups[0].group_name)
    gm = trace(build(p, groups), *shapes)
    if pieces:
        mark_pieces(gm)
    expected = LocalCollectives(gm).run(*inputs_for(p))
    args_before = {n.name: (repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes}
    before = list(gm.graph.nodes)

    overlapc.schedule(gm, cfg)

    gm.graph.lint()
    assert {n.name: (repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes} == args_before
    got = LocalCollectives(gm).run(*inputs_for(p))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    overlapc.verify(gm, cfg)
    independent_checks(gm, cfg, before)

    again = trace(build(p, groups), *shapes)
    if pieces:
        mark_pieces(again)
    overlapc.schedule(again, cfg)
    assert order(again) == order(gm)

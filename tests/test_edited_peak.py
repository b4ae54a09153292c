"""memory.EditedPeak (keep-or-regather's per-block trials) and memory.RangeTable against
full recounts: the same peaks as ``peak_bytes`` on the order without the dropped nodes,
after every edit and every undo, and keep-or-regather builds the graph's liveness a
fixed number of times, however many blocks it tries."""
import random

import pytest
import torch
import torch.fx as fx

from overlapc.passes import memory, regather

F = torch.ops._c10d_functional
aten = torch.ops.aten


def joint(layers: int, dim: int = 32, world: int = 4) -> fx.GraphModule:
    """A forward that gathers each layer's weight and a backward that gathers it again;
    the backward reads the gathered weight through a view, a fused pointwise chain and a
    reduction (what re-pointing a reader must carry through), and some layers hold a
    large temporary (so that keeping some weights raises the peak and others not)."""
    graph = fx.Graph()

    def node(target, args, shape, dtype=torch.float32, fqn=None):
        n = graph.call_function(target, args)
        n.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        if fqn is not None:
            n.meta["custom"] = {"module_fqn": fqn}
        return n

    def gather(weight, fqn):
        cast = node(aten._to_copy.default, (weight,), (dim // world, dim), torch.bfloat16)
        start = node(F.all_gather_into_tensor.default, (cast, world, "0"), (dim, dim), torch.bfloat16, fqn)
        return node(F.wait_tensor.default, (start,), (dim, dim), torch.bfloat16)

    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8, dim, device="meta")
    weights, inputs = [], []
    for i in range(layers):
        w = graph.placeholder(f"w{i}")
        w.meta["val"] = torch.empty(dim // world, dim, device="meta")
        weights.append(w)
        up = node(aten._to_copy.default, (gather(w, f"layers.{i}"),), (dim, dim))
        inputs.append(x)
        x = node(aten.relu.default, (node(aten.mm.default, (x, node(aten.t.default, (up,), (dim, dim))), (8, dim)),),
                 (8, dim))
        if i % 3 == 1:
            rows = 8 * (10 + 3 * i)
            big = node(aten.repeat.default, (x, [10 + 3 * i, 1]), (rows, dim))
            x = node(aten.add.Tensor, (x, node(aten.sum.default, (big,), ())), (8, dim))
    grad = node(aten.ones_like.default, (x,), (8, dim))
    for i in reversed(range(layers)):
        done = gather(weights[i], f"layers.{i}")
        view = node(aten.t.default, (done,), (dim, dim), torch.bfloat16)
        scaled = node(aten.mul.Tensor, (view, 2), (dim, dim), torch.bfloat16)   # fused into the sum below
        grad = node(aten.mm.default, (grad, node(aten._to_copy.default, (done,), (dim, dim))), (8, dim))
        if i % 3 == 0:
            big = node(aten.repeat.default, (grad, [12 + 2 * i, 1]), (8 * (12 + 2 * i), dim))
            grad = node(aten.add.Tensor, (grad, node(aten.sum.default, (big,), ())), (8, dim))
        # the gathered weight's last reader: through the view and the fused multiply only
        grad = node(aten.add.Tensor, (grad, node(aten.sum.default, (scaled,), (), torch.bfloat16)), (8, dim))
        grad = node(aten.add.Tensor, (grad, inputs[i]), (8, dim))
    graph.output((grad,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _recount(nodes, dropped):
    return memory.peak_bytes([n for n in nodes if n not in dropped])


def _tables(liveness: memory.Liveness) -> tuple:
    return tuple(dict(table) for table in (liveness.root, liveness.size, liveness.reads, liveness.held_until,
                                           liveness.inlined, liveness._fusable)) + (list(liveness.unread),)


@pytest.mark.parametrize("layers", [4, 7])
@pytest.mark.parametrize("forked", [False, True])
def test_every_edit_and_undo_gives_the_recounted_peak(layers, forked):
    """Also from a Liveness the caller built (the pipeline's headroom's): forked, so the
    caller's is left as it was, and the peaks are the recounted ones as from a fresh one."""
    gm = joint(layers)
    nodes = list(gm.graph.nodes)
    shared = memory.Liveness(nodes) if forked else None
    before = _tables(shared) if forked else None
    tracker = memory.EditedPeak(nodes, shared)
    if forked:
        assert _tables(tracker.liveness) == before == _tables(memory.Liveness(nodes))
    assert tracker.peak == memory.peak_bytes(nodes)
    budget = tracker.peak
    kept = 0
    for _, pairs in regather._pairs_by_block(gm, nodes):
        saved = [(user, user.args, user.kwargs) for p in pairs for user in p.late_wait.users]
        for p in pairs:
            p.late_wait.replace_all_uses_with(p.early_wait)
        peak = tracker.edit(regather._dead_after(pairs), [user for user, _, _ in saved])
        assert peak == _recount(nodes, tracker.dropped)
        if peak > budget:
            tracker.undo()
            for user, args, kwargs in saved:
                user.args, user.kwargs = args, kwargs
            assert tracker.peak == _recount(nodes, tracker.dropped)
        else:
            kept += 1
    assert 0 < kept < layers   # both paths ran: some blocks kept, some re-gathered
    if forked:
        assert _tables(shared) == before


def test_keep_or_regather_builds_the_liveness_twice_whatever_the_blocks(monkeypatch):
    built = []
    original = memory.Liveness.__init__

    def counting(self, nodes):
        built.append(len(nodes))
        original(self, nodes)
    monkeypatch.setattr(memory.Liveness, "__init__", counting)
    for layers in (3, 12):
        built.clear()
        result = regather.keep_or_regather(joint(layers), recompile=False)
        assert len(result.choices) == layers
        assert len(built) == 2   # the graph before (tracked) and after (the final peak)


@pytest.mark.parametrize("combine", [min, max])
def test_range_table_answers_as_a_scan(combine):
    rng = random.Random(0)
    for size in (1, 2, 15, 16, 17, 33, 100, 300):
        values = [rng.randint(-100, 100) for _ in range(size)]
        table = memory.RangeTable(values, combine)
        for _ in range(300):
            first = rng.randrange(size)
            last = rng.randrange(first, size)
            assert table.query(first, last) == combine(values[first:last + 1])

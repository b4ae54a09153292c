"""Keep or re-gather (overlapc.passes.regather): per block, under a memory budget.

A two-block joint graph gathers each weight in the forward and again in the
backward (FSDP's reshard-after-forward). Where the graph's peak lies before
the blocks, the last block's gathered weight fits under it for the time
between its forward and backward use: its re-gather goes, the first block's
(whose weight would be alive across a large temporary) stays. Where the peak
lies between the last block's forward and backward (a large loss), keeping
either weight would raise it: both re-gathers stay. Peaks are recounted here
from the graph, not taken from the pass.
"""
import torch

from overlapc.collectives import collectives
from overlapc.passes.regather import keep_or_regather
from graphs import ag, trace, wait
from test_properties import LocalCollectives


def build(early_peak, loss_peak):
    def fn(x, w0, w1):
        if early_peak:
            x = x + x.repeat(128, 1).sum(0)                   # 128 KiB, freed before the blocks
        h0 = torch.tanh(x @ wait(ag(w0)).t())                  # block 0 forward (16 KiB weight)
        h0 = h0 + h0.repeat(120, 1).mean(0)                    # 120 KiB while block 0's weight would be kept
        h1 = torch.tanh(h0 @ wait(ag(w1)).t())                 # block 1 forward
        if loss_peak:
            h1 = h1 * h1.repeat(128, 1).amax(0)                # 128 KiB between block 1's forward and backward
        g1 = h1 @ wait(ag(w1))                                 # block 1 backward: re-gathered
        return g1 @ wait(ag(w0))                               # block 0 backward: re-gathered
    return fn


def traced(early_peak, loss_peak):
    gm = trace(build(early_peak, loss_peak), (4, 64), (8, 64), (8, 64))
    for c in collectives(gm):   # graph_trainer's convention for the module of a node
        c.start.meta["custom"] = {"module_fqn": "layers.0" if c.start.args[0].name.startswith("w0") else "layers.1"}
    return gm


def _live_peak(gm):
    """Peak bytes: every non-view result from its node to its last reader (a wait
    aliases its all-gather's buffer, allocated at the start); inputs from the top."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    base = {}
    for n in nodes:
        views = n.target in (torch.ops.aten.t.default, torch.ops.aten.view.default,
                             torch.ops._c10d_functional.wait_tensor.default)
        base[n] = base[n.args[0]] if views else n
    last = {b: pos[b] for b in set(base.values())}
    for n in nodes:
        for i in n.all_input_nodes:
            last[base[i]] = max(last[base[i]], pos[n])
    for n in nodes:
        if n.target == torch.ops._c10d_functional.wait_tensor.default:   # the input is held until the wait
            for i in n.args[0].all_input_nodes:
                last[base[i]] = max(last[base[i]], pos[n])
    size = {b: b.meta["val"].numel() * b.meta["val"].element_size()
            for b in last if isinstance(b.meta.get("val"), torch.Tensor)}
    return max(sum(s for b, s in size.items() if (0 if b.op == "placeholder" else pos[b]) <= i <= last[b])
               for i in range(len(nodes)))


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(4, 64), torch.randn(8, 64), torch.randn(8, 64)]


def _gathers(gm):
    return [c.start.args[0].name for c in collectives(gm) if c.kind == "all_gather"]


def test_the_last_blocks_regather_goes_where_the_headroom_allows(fake_pg):
    gm = traced(early_peak=True, loss_peak=False)
    expected = LocalCollectives(gm).run(*_inputs())
    peak_before = _live_peak(gm)

    result = keep_or_regather(gm)

    assert [(c.block, c.kept) for c in result.choices] == [("layers.1", True), ("layers.0", False)]
    assert _gathers(gm) == ["w0_1", "w1_1", "w0_1"]          # block 1 gathered once, block 0 twice
    assert result.budget == result.peak_before
    assert _live_peak(gm) <= peak_before                      # within the budget: the graph's own peak
    for a, b in zip(expected, LocalCollectives(gm).run(*_inputs())):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_both_gathers_stay_where_keeping_would_raise_the_peak(fake_pg):
    gm = traced(early_peak=False, loss_peak=True)
    before = [n.name for n in gm.graph.nodes]

    result = keep_or_regather(gm)

    assert [(c.block, c.kept) for c in result.choices] == [("layers.1", False), ("layers.0", False)]
    assert all(c.peak > result.budget for c in result.choices)
    assert [n.name for n in gm.graph.nodes] == before and _gathers(gm) == ["w0_1", "w1_1", "w1_1", "w0_1"]
    # a budget with room for block 1's weight (16 KiB) over the peak keeps it
    kept = keep_or_regather(gm, budget=_live_peak(gm) + 16 * 1024)
    assert [(c.block, c.kept) for c in kept.choices][0] == ("layers.1", True)

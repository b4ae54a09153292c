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
import pytest
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


# -- through overlapc.schedule (OverlapConfig.regather="auto") --------------------------------

def _schedule(gm, **options):
    import overlapc
    cfg = overlapc.OverlapConfig(**{"regather": "auto", "bucket": None, "max_in_flight_bytes": "serial-peak",
                                    "on_error": "raise", **options})
    overlapc.schedule(gm, cfg)
    overlapc.verify(gm, cfg)
    return gm


def test_schedule_drops_the_last_blocks_regather_within_the_budget(fake_pg, caplog):
    gm = traced(early_peak=True, loss_peak=False)
    expected = LocalCollectives(gm).run(*_inputs())
    budget = _live_peak(gm)   # the graph's own peak

    with caplog.at_level("INFO", logger="overlapc"):
        _schedule(gm)

    assert sorted(_gathers(gm)) == ["w0_1", "w0_1", "w1_1"]    # block 1 gathered once, block 0 twice
    assert [(c.block, c.kept) for c in gm.meta["overlapc_regather"]] == [("layers.1", True), ("layers.0", False)]
    assert _live_peak(gm) <= budget
    kept_line = next(r.getMessage() for r in caplog.records if "kept for the backward" in r.getMessage())
    assert "1 of 2 blocks: layers.1 (16384 B, 1 re-gathers dropped)" in kept_line   # w1 gathered: 8 x 8 x 64 floats
    for a, b in zip(expected, LocalCollectives(gm).run(*_inputs())):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_schedule_keeps_both_gathers_where_keeping_would_raise_the_peak(fake_pg):
    gm = traced(early_peak=False, loss_peak=True)
    expected = LocalCollectives(gm).run(*_inputs())
    budget = _live_peak(gm)

    _schedule(gm)

    assert sorted(_gathers(gm)) == ["w0_1", "w0_1", "w1_1", "w1_1"]
    assert not any(c.kept for c in gm.meta["overlapc_regather"])
    assert _live_peak(gm) <= budget
    for a, b in zip(expected, LocalCollectives(gm).run(*_inputs())):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_regather_always_is_the_default_and_changes_nothing(fake_pg):
    import overlapc
    assert overlapc.OverlapConfig().regather == "always"
    gm = traced(early_peak=True, loss_peak=False)
    overlapc.schedule(gm, overlapc.OverlapConfig(bucket=None, on_error="raise"))
    assert sorted(_gathers(gm)) == ["w0_1", "w0_1", "w1_1", "w1_1"] and "overlapc_regather" not in gm.meta


@pytest.mark.degrades   # the failure it injects degrades the schedule before anything else
def test_a_failed_schedule_rolls_the_dropped_regather_back(fake_pg, monkeypatch):
    import overlapc
    from overlapc.passes import pipeline

    def broken(*args, **kwargs):
        raise overlapc.ScheduleError("core broke")
    monkeypatch.setattr(pipeline, "_reorder", broken)
    gm = traced(early_peak=True, loss_peak=False)
    before = [n.name for n in gm.graph.nodes]
    expected = LocalCollectives(gm).run(*_inputs())
    with pytest.warns(UserWarning, match="core broke"):
        overlapc.schedule(gm, overlapc.OverlapConfig(regather="auto", bucket=None))
    assert [n.name for n in gm.graph.nodes] == before and "overlapc_regather" not in gm.meta
    for a, b in zip(expected, LocalCollectives(gm).run(*_inputs())):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["never", "keep", None, True])
def test_bad_regather_values_are_refused(bad):
    import overlapc
    with pytest.raises(ValueError, match=r"OverlapConfig.regather must be one of \('always', 'auto'\)"):
        overlapc.OverlapConfig(regather=bad)


def test_the_report_says_which_blocks_were_kept(fake_pg):
    from overlapc.explain import report
    gm = _schedule(traced(early_peak=True, loss_peak=False))
    records = report.rewrites(gm)
    text = report.rewrites_text({"rewrites": records, "collectives": 3})
    lines = text.splitlines()
    assert lines[0].startswith("collectives 4 -> 3: 1 backward re-gathers dropped"), lines
    assert "regather layers.1: forward gathers kept for the backward (16.0KiB), 1 re-gathers dropped" in lines
    assert "regather layers.0: re-gathered (keeping its gathers would raise the peak)" in lines

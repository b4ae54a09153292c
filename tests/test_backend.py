"""The torch.compile backend on graphs with functional collectives (fake process group).

Multi-process training through the backend lives in test_training.py.
"""
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch._inductor.utils import run_and_get_code

import overlapc
from overlapc.backend import SchedulePass


@pytest.fixture(autouse=True)
def no_compile_cache():
    """A cached graph skips the pass (its code already holds the schedule), and
    the cache outlives a test run: every test here compiles afresh. (torch's
    config modules are patched with their own ``patch()``: pytest's monkeypatch
    deletes such attributes on undo since pytest 9.2.)"""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


class GatheredMLP(torch.nn.Module):
    """Each layer all-gathers its weight shard (autograd: reduce-scatter in backward)."""

    def __init__(self, layers=4, width=64, world=8):
        super().__init__()
        self.shards = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(width // world, width) * 0.1) for _ in range(layers)])

    def forward(self, x):
        for shard in self.shards:
            full = fc.all_gather_single_autograd(shard, 0, dist.group.WORLD)
            x = torch.relu(x @ full.t())
        return x


_BUF = re.compile(r"(buf\d+)")


def collective_events(code):
    """(kind, buffer) for every all-gather issue, wait and compute line, in order."""
    events = []
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        if "_c10d_functional.all_gather_into_tensor.default(" in line:
            events.append(("issue", line.split("=")[0].strip()))
        elif "_c10d_functional.reduce_scatter_tensor.default(" in line:
            events.append(("rs", line.split("=")[0].strip()))
        elif "_c10d_functional.wait_tensor.default(" in line:
            events.append(("wait", _BUF.search(line.split("wait_tensor.default(")[1]).group(1)))
        elif line.startswith("extern_kernels.") or (line.startswith("cpp_fused") and "(" in line):
            events.append(("compute", line))
    return events


def serial_pairs(events):
    """The all-gather issues and waits of ``events``, checked to be strictly serial:
    issue b, wait b, issue c, wait c, ... Returns the buffers in order."""
    flow = [e for e in events if e[0] in ("issue", "wait")]
    issued = [b for kind, b in flow if kind == "issue"]
    assert flow == [e for b in issued for e in (("issue", b), ("wait", b))], flow
    return issued


def compile_and_run(model, options=None, backward=True):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="overlapc", options=options)
    x = torch.randn(16, 64)

    def step():
        out = compiled(x)
        if backward:
            out.sum().backward()
        return out

    return run_and_get_code(step)


def test_inductor_code_keeps_consumer_order_bound_and_overlap(fake_pg):
    # "auto" bytes: this forward's peak is at its last layer, where "serial-peak" (the
    # default) waits the last all-gather at once; what is checked here is Inductor's code
    _, codes = compile_and_run(GatheredMLP(), {"max_in_flight": 2, "max_in_flight_bytes": "auto",
                                               "on_error": "raise"})
    forward, backward = codes
    events = collective_events(forward)
    issued = [b for kind, b in events if kind == "issue"]
    waited = [b for kind, b in events if kind == "wait"]
    assert len(issued) == 4 and waited == issued          # consumer order: waited as issued
    in_flight, peak = set(), 0
    for index, (kind, buf) in enumerate(events):
        if kind == "issue":
            in_flight.add(buf)
            peak = max(peak, len(in_flight))
        elif kind == "wait" and buf in in_flight:
            in_flight.discard(buf)
    assert peak == 2
    for buf in issued[1:]:                                # compute hides every later all-gather
        start = events.index(("issue", buf))
        end = events.index(("wait", buf))
        assert any(kind == "compute" for kind, _ in events[start:end]), buf
    back = collective_events(backward)
    scattered = [b for kind, b in back if kind == "rs"]
    assert len(scattered) == 4
    open_, rs_peak = set(), 0
    for kind, buf in back:                                # reduce-scatters: as late as the bound allows
        if kind == "rs":
            open_.add(buf)
            rs_peak = max(rs_peak, len(open_))
        elif kind == "wait":
            open_.discard(buf)
    assert rs_peak == 2
    last_compute = max(i for i, (kind, _) in enumerate(back) if kind == "compute")
    assert all(back.index(("wait", b)) > last_compute for b in scattered[-2:])   # the last two at the end


def test_plain_inductor_serialises_the_same_model(fake_pg):
    """The baseline the backend fixes: each all-gather waited before the next is issued."""
    torch._dynamo.reset()
    compiled = torch.compile(GatheredMLP(), backend="inductor")
    _, (forward, _) = run_and_get_code(lambda: compiled(torch.randn(16, 64)).sum().backward())
    assert len(serial_pairs(collective_events(forward))) == 4


def test_disable_env_turns_scheduling_off(fake_pg, monkeypatch, caplog):
    monkeypatch.setenv("OVERLAPC_DISABLE", "1")
    with caplog.at_level(logging.INFO, logger="overlapc"):
        _, (forward, _) = compile_and_run(GatheredMLP())
    assert not any("moved" in r.getMessage() for r in caplog.records)
    assert len(serial_pairs(collective_events(forward))) == 4
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and " off (" in r.getMessage()]
    assert said and all("off (OVERLAPC_DISABLE is set)" in m and "without scheduling" in m for m in said), said


def test_a_module_compiled_in_place_gets_the_nothing_to_schedule_warning(fake_pg, caplog):
    """``model.compile(backend="overlapc")`` on an FSDP2 model (its collectives in hooks,
    outside the graphs) warns as ``torch.compile(model)`` does; before, only an
    OptimizedModule on the stack was recognised, and the in-place form stayed silent."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):   # compute between the layers: Dynamo compiles it (the hooks break around it)
            return self.b(torch.relu(self.a(torch.tanh(x))) * 2)

    torch.manual_seed(0)
    model, mesh = Two(), init_device_mesh("cpu", (8,))
    for layer in (model.a, model):   # b stays with the root: the root's graph reads its parameters
        fully_shard(layer, mesh=mesh)
    torch._dynamo.reset()
    model.compile(backend="overlapc", options={"inner": "aot_eager"})
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        model(torch.randn(4, 16)).sum().backward()
    said = [r.getMessage() for r in caplog.records if "nothing to schedule in FSDPTwo" in r.getMessage()]
    assert len(said) == 1 and "FSDP2 fully_shard module(s)" in said[0], [r.getMessage() for r in caplog.records]


def test_one_info_summary_per_graph_and_config_logged(fake_pg, caplog):
    with caplog.at_level(logging.INFO, logger="overlapc"):
        compile_and_run(GatheredMLP(), {"max_in_flight": 1})
    messages = [r.getMessage() for r in caplog.records if r.name == "overlapc"]
    assert sum("max_in_flight=1" in m for m in messages) == 1
    assert sum("moved" in m and "collectives" in m for m in messages) == 2   # forward and backward


@pytest.mark.degrades   # the failure it injects degrades the schedule before anything else
def test_failure_falls_back_to_the_unscheduled_graph(fake_pg, monkeypatch):
    import overlapc.passes.pipeline as pipeline

    def broken(gm, *args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(pipeline, "_run_passes", broken)   # schedule() calls it through the module
    with pytest.warns(UserWarning, match="unscheduled.*injected failure"):
        _, (forward, _) = compile_and_run(GatheredMLP())
    assert len(serial_pairs(collective_events(forward))) == 4   # Inductor's own serial order


@pytest.mark.degrades   # the failure it injects degrades the schedule before anything else
def test_raise_mode_raises_schedule_error(fake_pg, monkeypatch):
    import overlapc.passes.pipeline as pipeline
    monkeypatch.setattr(pipeline, "_run_passes", lambda *a, **k: 1 / 0)
    with pytest.raises(torch._inductor.exc.InductorError) as error:   # Inductor wraps what its pass raises
        compile_and_run(GatheredMLP(), {"on_error": "raise"})
    inner = error.value.inner_exception
    assert type(inner) is overlapc.ScheduleError
    assert str(inner) == "ZeroDivisionError: division by zero"
    assert isinstance(inner.__cause__, ZeroDivisionError)


def test_option_typo_is_a_value_error_naming_the_closest_option(fake_pg):
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as error:
        compile_and_run(GatheredMLP(), {"max_in_fligt": 1})
    inner = error.value.inner_exception
    assert type(inner) is ValueError
    assert str(inner).startswith("unknown overlapc option 'max_in_fligt'; did you mean 'max_in_flight'?")


def test_inductor_mode_option_patches_inductor_alongside_overlapc(fake_pg, monkeypatch, caplog):
    """torch.compile refuses mode= with options=; options["inductor_mode"] carries it."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import list_mode_options

    seen = []
    original = compile_fx_module.compile_fx

    def recording(gm, inputs, *args, **kwargs):
        seen.append(dict(kwargs.get("config_patches") or {}))
        return original(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    mode = "max-autotune-no-cudagraphs"
    model = GatheredMLP()
    expected = model(torch.ones(16, 64))
    with caplog.at_level(logging.INFO, logger="overlapc"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="overlapc", options={"inductor_mode": mode, "on_error": "raise"})
        out = compiled(torch.ones(16, 64))
    assert torch.allclose(out, expected)
    assert seen    # seen[0]: overlapc's call (compile_fx then calls itself with the patches applied)
    assert {k: seen[0][k] for k in list_mode_options(mode)} == list_mode_options(mode)   # the mode's settings
    assert seen[0]["reorder_for_peak_memory"] is False                                     # and overlapc's
    assert type(seen[0]["post_grad_custom_post_pass"]) is SchedulePass
    assert sum("moved" in r.getMessage() for r in caplog.records) == 1   # the pass ran on the graph


@pytest.mark.parametrize("options, message", [
    ({"inductor_mode": "fastest"}, "unknown inductor_mode 'fastest'"),
    ({"inductor_mode": "default", "inner": "aot_eager"}, "inductor_mode='default' needs inner='inductor'"),
    ({"profile": "no/such/profile.json"}, "no profile file 'no/such/profile.json'"),
])
def test_bad_mode_or_profile_is_a_value_error(fake_pg, options, message):
    from overlapc.backend import overlapc_backend
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(ValueError, match=re.escape(message)):
        overlapc_backend(gm, [torch.randn(2)], options=options)


def test_profile_option_sets_the_dump_estimates(fake_pg, tmp_path):
    compiled = torch.compile(GatheredMLP(), backend="overlapc", options={
        "dump_dir": str(tmp_path), "inner": "aot_eager", "profile": "cpu:ethernet"})
    torch._dynamo.reset()
    compiled(torch.randn(16, 64)).sum().backward()
    torch._dynamo.reset()
    (forward,) = [g for g in os.listdir(tmp_path / "rank0") if g.startswith("fw_")]   # numbered per process
    text = (tmp_path / "rank0" / forward / "report.txt").read_text()
    assert text.startswith(f"{forward}: 4 collectives (cpu, ethernet)")
    assert text.splitlines()[-1] == "estimates: built-in cpu:ethernet"


def test_graph_cache_key_changes_with_the_config():
    one = SchedulePass(overlapc.OverlapConfig(max_in_flight=1)).uuid()
    assert one == SchedulePass(overlapc.OverlapConfig(max_in_flight=1)).uuid()
    assert one != SchedulePass(overlapc.OverlapConfig(max_in_flight=2)).uuid()


def test_aot_eager_inner_schedules_too(fake_pg, caplog):
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="overlapc"):
        compiled = torch.compile(GatheredMLP(), backend="overlapc", options={"inner": "aot_eager"})
        compiled(torch.randn(16, 64)).sum().backward()
    assert sum("moved" in r.getMessage() for r in caplog.records) == 2


_FRESH = """
import sys, torch
assert "overlapc" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
fn = torch.compile(lambda x: torch.relu(x) + 1, backend="overlapc")
x = torch.randn(8)
assert torch.equal(fn(x), torch.relu(x) + 1)
print("ok")
"""


def test_backend_is_found_in_a_fresh_process_without_importing_overlapc():
    done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=""))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_importing_overlapc_registers_nothing_twice():
    done = subprocess.run([sys.executable, "-c", "import overlapc, overlapc.backend\n" + _FRESH],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_drop_dead_compute_erases_unread_compute_and_keeps_collectives(fake_pg):
    from graphs import ag, trace, wait
    from overlapc.backend import drop_dead_compute

    def fn(x, w, buf):
        torch.mm(x, w).relu()          # read by nothing
        buf.add_(1)                    # mutates an input: stays
        wait(ag(x))                    # a collective whose result nothing reads: stays
        return wait(ag(x)).relu()

    gm = trace(fn, (4, 4), (4, 4), (4,))
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.mm.default in targets
    assert drop_dead_compute(gm) == 2
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.mm.default not in targets and torch.ops.aten.relu.default in targets
    assert torch.ops.aten.add_.Tensor in targets
    assert targets.count(torch.ops._c10d_functional.all_gather_into_tensor.default) == 2


def test_captured_tp_backward_recomputes_nothing_dead(fake_pg):
    # torch 2.13's partitioner leaves the matmul feeding a saved reduce-scatter in
    # the backward with no users; the aot_eager path drops it as Inductor would.
    from overlapc.backend import capture
    from overlapc.collectives import role
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import tp_sp
    model, inputs = tp_sp.build(heads=8, depth=1)
    for record in capture(model, inputs, {"enabled": False}):
        dead = [n.name for n in record.gm.graph.nodes if n.op == "call_function" and not n.users
                and not n.is_impure() and role(n)[0] is None and not role(n)[1]]
        assert dead == [], (record.name, dead)


def test_log_lines_name_rank_and_graph_and_other_ranks_stay_quiet_below_debug(fake_pg, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="overlapc"):
        compile_and_run(GatheredMLP(), {"inner": "aot_eager"})
    lines = [r.getMessage() for r in caplog.records if r.name == "overlapc"]
    summaries = [m for m in lines if "moved" in m]
    assert [m.split(":")[0][:12] for m in summaries] == ["[rank 0] fw_", "[rank 0] bw_"], lines
    assert any(m.startswith("[rank 0] compiling graph ") for m in lines), lines
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    for level, expected in ((logging.INFO, []), (logging.DEBUG, ["fw_", "bw_"])):
        caplog.clear()
        with caplog.at_level(level, logger="overlapc"):
            compile_and_run(GatheredMLP(), {"inner": "aot_eager"})
        said = [r.getMessage() for r in caplog.records if r.name == "overlapc" and "moved" in r.getMessage()]
        assert [m.removeprefix("[rank 1] ")[:3] for m in said] == expected, said


class SequenceParallelMLP(torch.nn.Module):
    """All-gather the sequence shard, up, gelu, down, reduce-scatter (TP+SP's MLP)."""

    def __init__(self, width=64, hidden=128):
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(width, hidden) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(hidden, width) * 0.1)

    def forward(self, x):
        full = fc.all_gather_single_autograd(x, 0, dist.group.WORLD)
        y = torch.nn.functional.gelu(full @ self.up) @ self.down
        return fc.reduce_scatter_tensor_autograd(y, "sum", 0, dist.group.WORLD)


def test_inductor_code_keeps_the_chunk_pipeline_order(fake_pg):
    """chunks=2 through Inductor: the generated forward issues piece 1's all-gather
    before piece 0's compute and waits it only after that compute, and piece 0's
    reduce-scatter goes out before piece 1's compute (Inductor keeps the pipeline)."""
    torch._dynamo.reset()
    compiled = torch.compile(SequenceParallelMLP(), backend="overlapc",
                             options={"chunks": 2, "on_error": "raise"})
    x = torch.randn(16, 64)
    _, (forward, _backward) = run_and_get_code(lambda: compiled(x).sum().backward())
    events = collective_events(forward)
    kinds = [kind for kind, _ in events]
    assert kinds.count("issue") == 2 and kinds.count("rs") == 2, events
    gathers = [buf for kind, buf in events if kind == "issue"]
    scatters = [i for i, (kind, _) in enumerate(events) if kind == "rs"]
    second_issue = events.index(("issue", gathers[1]))
    first_wait, second_wait = events.index(("wait", gathers[0])), events.index(("wait", gathers[1]))
    compute_0 = [i for i in range(first_wait, second_wait) if kinds[i] == "compute"]
    assert second_issue < first_wait and compute_0, events      # piece 1 in flight over piece 0's compute
    assert scatters[0] < second_wait, events                    # piece 0's reduce-scatter overlaps piece 1
    assert any(kinds[i] == "compute" for i in range(scatters[0], scatters[1])), events

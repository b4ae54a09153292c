"""overlapc.torch_compat: the tested torch releases are stated once and agree
everywhere; Inductor's order-moving passes are off for the torch at hand; an
untested torch is said once."""
import logging
import os
import re

import pytest
import torch

from overlapc import torch_compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_pyproject_makefile_and_ci_name_the_tested_releases():
    tested = list(torch_compat.TESTED_TORCH)
    pyproject = re.search(r"^tested-torch = \[(.*)\]$", _read("pyproject.toml"), re.M).group(1)
    assert re.findall(r'"([^"]+)"', pyproject) == tested
    assert re.search(r"^TESTED_TORCH := (.*)$", _read("Makefile"), re.M).group(1).split() == tested
    assert re.search(r'TORCH_RELEASES:-"([^"]*)"', _read(".ci/run")).group(1).split() == tested


def test_inductor_patches_turn_off_what_the_installed_inductor_has():
    from torch._inductor import config
    patches = torch_compat.inductor_patches()
    known = config.get_config_copy()
    assert patches and all(key in known for key in patches)
    assert patches["reorder_for_peak_memory"] is False
    assert patches["allow_buffer_reuse"] is False   # the wrapper frees where overlapc's memory model does
    # 2.14 added a pass, on by default, that moves starts earlier and waits later.
    if "aten_distributed_optimizations.enable_simple_overlap" in known:
        assert patches["aten_distributed_optimizations.enable_simple_overlap"] is False
    with config.patch(patches):    # valid for the installed config as it is
        assert config.reorder_for_peak_memory is False


def test_an_untested_torch_is_said_once(monkeypatch, caplog):
    monkeypatch.setitem(torch_compat._warned, "version", False)
    monkeypatch.setattr(torch, "__version__", "9.9.9+cpu")
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        torch_compat.warn_if_untested()
        torch_compat.warn_if_untested()
    said = [r.getMessage() for r in caplog.records if "not among the tested releases" in r.getMessage()]
    assert len(said) == 1 and "9.9.9" in said[0] and "2.14.1" in said[0], said


def test_a_tested_torch_is_not_said(monkeypatch, caplog):
    monkeypatch.setitem(torch_compat._warned, "version", False)
    monkeypatch.setattr(torch, "__version__", torch_compat.TESTED_TORCH[-1] + "+cu130")
    with caplog.at_level(logging.WARNING, logger="overlapc"):
        torch_compat.warn_if_untested()
    assert "tested releases" not in caplog.text


def test_the_joint_pre_pass_runs_the_users_pass_then_overlapcs(monkeypatch):
    """Both the list form (torch >= 2.13) and the one-pass form of older Inductor."""
    import torch._inductor.custom_graph_pass as custom_graph_pass
    ran = []
    user, ours = (lambda graph: ran.append(("user", graph))), (lambda graph: ran.append(("ours", graph)))
    if hasattr(custom_graph_pass, "get_custom_graph_passes"):
        assert torch_compat.with_joint_pre_pass(user, ours) == [user, ours]
        assert torch_compat.with_joint_pre_pass(None, ours) == [ours]
        monkeypatch.delattr(custom_graph_pass, "get_custom_graph_passes")
    assert torch_compat.with_joint_pre_pass(None, ours) is ours
    torch_compat.with_joint_pre_pass(user, ours)("g")
    assert ran == [("user", "g"), ("ours", "g")]


_PROCESS_WIDE = r'''
import importlib, json, logging, pkgutil, sys, tempfile, os
import torch

def state():
    """What overlapc may change process-wide, read without overlapc's own bookkeeping."""
    return {"overlapc_logger": [type(f).__name__ for f in logging.getLogger("overlapc").filters],
            "torch_wrap_logger": [type(f).__name__
                                  for f in logging.getLogger("torch._higher_order_ops.wrap").filters],
            "cpu_all_gather_kernel": "\nCPU:" in torch._C._dispatch_dump("_c10d_functional::all_gather_into_tensor")}

untouched = state()
import overlapc
for module in pkgutil.walk_packages(overlapc.__path__, "overlapc."):
    if not module.name.startswith("overlapc.integrations") and not module.name.endswith(".__main__"):   # optional dependencies; __main__ runs the CLI
        importlib.import_module(module.name)
imported = state()

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"),
                        rank=0, world_size=1)
plain = torch.nn.Linear(4, 4)
torch.compile(plain, backend="overlapc", options={"inner": "aot_eager"})(torch.randn(2, 4)).sum().backward()
compiled = state()
model = overlapc.fsdp.shard(torch.nn.Linear(4, 4), init_device_mesh("cpu", (1,)))
sharded = state()
dist.destroy_process_group()
print(json.dumps({"untouched": untouched, "imported": imported, "compiled": compiled, "sharded": sharded}))
'''


def test_importing_installs_nothing_process_wide_compiling_does(tmp_path):
    """Importing every overlapc module leaves loggers and torch's dispatcher as they were;
    compiling with backend="overlapc" on gloo installs the rank tags and the gloo
    all-gather kernel, and fsdp.shard the checkpoint-warning filter on torch's logger.
    (That shard installs the kernel too: tests/test_fsdp_modules.py, where nothing else does.)"""
    import json
    import subprocess
    import sys

    script = tmp_path / "process_wide.py"
    script.write_text(_PROCESS_WIDE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    nothing = {"overlapc_logger": [], "torch_wrap_logger": [], "cpu_all_gather_kernel": False}
    assert seen["untouched"] == nothing and seen["imported"] == nothing, seen
    assert seen["compiled"] == {**nothing, "overlapc_logger": ["_RankAndGraph"], "cpu_all_gather_kernel": True}, seen
    assert seen["sharded"] == {"overlapc_logger": ["_RankAndGraph"], "torch_wrap_logger": ["_QuietOwnRegions"],
                               "cpu_all_gather_kernel": True}, seen


def test_inductor_keeps_order_holds_when_reordering_is_turned_back_on_inside():
    """A caller's reorder_for_peak_memory=True inside keeps the config on, but Inductor's
    peak-memory pass tries only the given order; the cache key is tagged; all undone after."""
    from torch._inductor import config, memory

    from overlapc.torch_compat import inductor_keeps_order

    original, tag = memory.reorder_for_peak_memory, torch.compiler.config.cache_key_tag
    seen = {}

    def spy(*args, methods=("default",), **kwargs):
        seen["methods"] = list(methods)
        return list(args[0])

    memory.reorder_for_peak_memory = spy
    try:
        with inductor_keeps_order():
            assert config.reorder_for_peak_memory is False
            assert torch.compiler.config.cache_key_tag.endswith("overlapc.keep_order")
            with config.patch(reorder_for_peak_memory=True):   # what graph_trainer's pass does
                from torch._inductor.memory import reorder_for_peak_memory   # looked up as Inductor does
                assert reorder_for_peak_memory(["b", "a"], {}, {}, set(), set()) == ["b", "a"]
        assert seen["methods"] == []
        assert memory.reorder_for_peak_memory is spy and torch.compiler.config.cache_key_tag == tag
        with pytest.raises(RuntimeError):
            with inductor_keeps_order():
                raise RuntimeError("a failing compile")
        assert memory.reorder_for_peak_memory is spy
    finally:
        memory.reorder_for_peak_memory = original


class _RecordingPolicy:
    """Saves everything; logs each decision and each result it is handed, in order."""

    def __init__(self):
        self.log = []

    def __call__(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy
        if not ctx.is_recompute:
            self.log.append(("decide", op.__name__))
        return CheckpointPolicy.MUST_SAVE

    def record_outputs(self, out):
        self.log.append(("result", tuple(out.shape)))


@pytest.mark.parametrize("force_before_the_op", [False, True], ids=["installed_torch", "before_the_op"])
def test_a_checkpoint_policy_learns_each_result_right_after_its_decision(monkeypatch, force_before_the_op):
    """Both paths of output_aware_checkpoint_contexts: torch >= 2.13 hands the result in the
    policy's context; 2.11-2.12 (forced here on a newer torch) ask the policy before the op
    runs, and the result comes once it has. Either way each decided op's result follows its
    decision."""
    from torch.utils.checkpoint import checkpoint
    if force_before_the_op:
        monkeypatch.setattr(torch_compat, "_policies_see_outputs", lambda: False)
    policy = _RecordingPolicy()
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    out = checkpoint(lambda a, b: (a @ b).relu().sum(), x, w, use_reentrant=False,
                     context_fn=lambda: torch_compat.output_aware_checkpoint_contexts(policy))
    out.backward()
    assert policy.log == [("decide", "mm.default"), ("result", (4, 5)),
                          ("decide", "relu.default"), ("result", (4, 5)),
                          ("decide", "sum.default"), ("result", ())]
    assert torch.allclose(w.grad, x.detach().t() @ ((x.detach() @ w.detach()) > 0).float())

"""overlapc.torch_compat: the tested torch releases are stated once and agree
everywhere; Inductor's order-moving passes are off for the torch at hand; an
untested torch is said once."""
import logging
import os
import re

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

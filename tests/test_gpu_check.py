"""benchmarks/gpu_check.py: its --dry-run on CPU, failure recording, and running without an install.

The dry run compiles and runs everything the GPU run does, on CPU, in a
subprocess (it sets up process groups and patches the import system). Its
``calibrate`` part is left out here: it is ``calibrate.run_in_group(...,
alone=True)``, which test_calibrate's compute-only test runs already, and it
costs two more Inductor compiles.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_checks_order_memory_and_trace_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--parts", "order,memory,trace",
                           "--json", str(out), "--deadline-s", "900"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["passed"] is True and doc["schema"] == "overlapc.gpu_check/2"
    prov = doc["provenance"]      # benchmarks/provenance.py's record, plus what gpu_check adds
    assert prov["torch"] == torch.__version__ and prov["device"] == "cpu" and prov["dry_run"] is True
    assert prov["date"] and prov["command"].startswith("python benchmarks/gpu_check.py --dry-run")
    assert prov["commit"] and prov["machine"]["cpus"] == os.cpu_count()
    assert list(doc["parts"]) == ["order", "memory", "trace"]
    order = doc["parts"]["order"]
    assert order["ok"] and not order["problems"] and len(order["graphs"]) == 2
    forward, backward = order["graphs"]
    assert forward["starts"]["all_gather"] >= 2 and backward["starts"]["reduce_scatter"] >= 2
    for graph in order["graphs"]:
        assert all(n <= order["max_in_flight"] for kind, n in graph["max_in_flight"].items() if kind != "all")
        assert graph["consumer_order_breaks"] == [] and graph["never_waited"] == []
        windows = graph["windows"]          # the compute overlapc placed in each window is still there
        assert windows["breaks"] == [] and windows["kept"] == windows["with_compute"] >= 1
    assert max(forward["max_in_flight"]["all_gather"], backward["max_in_flight"]["reduce_scatter"]) == 2
    memory = doc["parts"]["memory"]
    assert memory["ok"] and len(memory["rounds"]["overlapc"]["step_ms"]) == len(memory["rounds"]["inductor"]["step_ms"])
    trace = doc["parts"]["trace"]
    assert trace["ok"] and trace["format"] == "cpu" and trace["collectives"] > 0
    assert trace["matched_to_dump"] == trace["collectives"]     # every collective tied to overlapc's rows
    assert Path(trace["trace"]).exists()
    assert "order: ok" in done.stdout and "trace: ok" in done.stdout


def test_a_failing_or_overlong_part_is_recorded_and_the_next_part_runs(tmp_path, monkeypatch):
    gpu_check = _load()

    def broken(ctx):
        raise RuntimeError("injected")

    def slow(ctx):
        time.sleep(30)
        return {"ok": True}

    monkeypatch.setitem(gpu_check.PARTS, "order", broken)
    monkeypatch.setitem(gpu_check.PARTS, "memory", slow)
    monkeypatch.setitem(gpu_check.PARTS, "trace", lambda ctx: {"ok": True, "value": 7})
    monkeypatch.setitem(gpu_check.BUDGETS, "memory", 1)
    args = gpu_check.argparse.Namespace(dry_run=True)
    report = gpu_check.Report(tmp_path / "g.json", args)
    ctx = {"budget_scale": 1.0}
    deadline = time.monotonic() + 300
    results = [gpu_check.run_part(name, ctx, report, {}, deadline) for name in ("order", "memory", "trace")]
    assert results == [False, False, True]
    parts = json.loads((tmp_path / "g.json").read_text())["parts"]
    assert parts["order"]["error"] == "RuntimeError: injected" and "broken" in parts["order"]["traceback"]
    assert parts["memory"]["error"] == "PartTimeout: part ran past its budget of 1 s" and parts["memory"]["seconds"] < 10
    assert parts["trace"] == {"ok": True, "value": 7, "seconds": parts["trace"]["seconds"]}


def test_runs_from_a_checkout_without_an_install(tmp_path):
    """With no installed overlapc, the script maps overlapc.passes to the checkout's passes/ folder."""
    probe = textwrap.dedent(f"""
        import importlib.util, sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                            and "editable" not in type(f).__module__]
        sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "")]
        sys.path_importer_cache.clear()
        if importlib.util.find_spec("overlapc") is not None:
            print("STILL-INSTALLED"); sys.exit(0)
        spec = importlib.util.spec_from_file_location("gpu_check", {str(SCRIPT)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        import overlapc.passes.scheduler, overlapc.backend.inductor_order, overlapc.fsdp
        print(module.IMPORTED_FROM, overlapc.passes.scheduler.__file__, overlapc.backend.inductor_order.__file__)
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    if "STILL-INSTALLED" in done.stdout:
        pytest.skip("overlapc is installed as a regular package here; nothing to hide")
    source, scheduler, order = done.stdout.split()
    assert source == "checkout"
    assert Path(scheduler) == ROOT / "passes" / "scheduler.py"
    assert Path(order) == ROOT / "overlapc" / "backend" / "inductor_order.py"

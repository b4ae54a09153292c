"""The overlapc CLI: dump, report, timeline, demo dispatch, and bad input.

Commands run in-process through ``overlapc.cli.main`` at world size 8, rank 0:
the CLI makes (and destroys) its own fake process group, or reuses the
session's ``fake_pg`` (also world size 8) when an earlier test made it. One
test runs ``python -m overlapc.cli`` in a subprocess.
"""
import argparse
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import overlapc
import overlapc.cli as cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLGATHER = os.path.join(REPO, "examples", "allgather.py") + ":build"
WORLD = ["--world-size", "8"]


LOAD = """import importlib.util, sys
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
"""


def example(name: str):
    """examples/<name>.py as a module."""
    scope = {}
    exec(LOAD, scope)
    return scope["load"](f"example_{name}", os.path.join(REPO, "examples", name + ".py"))


def small_target(tmp_path, name: str, **sizes) -> str:
    """A target file calling examples/<name>.py's build with smaller sizes (fast capture)."""
    path = tmp_path / f"small_{name}.py"
    path.write_text(LOAD + f"_build = load('example_{name}', {os.path.join(REPO, 'examples', name + '.py')!r}).build\n"
                    f"def build():\n    return _build(**{sizes!r})\n")
    return f"{path}:build"


def run(capsys, *argv):
    """(exit code, stdout, stderr) of one in-process CLI call."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_dump_writes_four_files_per_graph_deterministically(tmp_path, capsys):
    outputs = []
    for name in ("a", "b"):
        code, _, err = run(capsys, "dump", ALLGATHER, *WORLD, "--out", tmp_path / name)
        assert code == 0, err
        assert "capturing forward/backward" in err and "scheduled fw_0: 4 collectives" in err
        outputs.append({os.path.relpath(os.path.join(folder, f), tmp_path / name):
                        open(os.path.join(folder, f), "rb").read()
                        for folder, _, files in os.walk(tmp_path / name) for f in files})
    expected = {f"{g}/{f}" for g in ("fw_0", "bw_0")
                for f in ("before.txt", "after.txt", "report.txt", "report.json")}
    assert set(outputs[0]) == expected
    assert outputs[0] == outputs[1]
    document = json.loads(outputs[0]["fw_0/report.json"])
    assert document["schema"] == "overlapc.report/1" and len(document["collectives"]) == 4
    assert b"all_gather_into_tensor" in outputs[0]["fw_0/after.txt"]
    assert outputs[0]["fw_0/report.txt"].startswith(b"fw_0: 4 collectives")


def test_report_json_schema(capsys):
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--format", "json", "--quiet",
                         "--max-in-flight", "none", "--device", "cpu", "--link", "ethernet")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["schema"] == cli.REPORT_SCHEMA
    assert (doc["target"], doc["world_size"], doc["rank"]) == (ALLGATHER, 8, 0)
    assert doc["config"] == {"max_in_flight": None, "max_in_flight_bytes": "serial-peak", "bucket": "auto",
                             "bucket_op": "pack", "chunks": 1, "regather": "always", "issue": "early",
                             "narrow_gathers": True, "enabled": True}
    assert doc["profile"]["device"]["name"] == "cpu" and doc["profile"]["link"]["name"] == "ethernet"
    assert [g["name"] for g in doc["graphs"]] == ["fw_0", "bw_0"]
    for graph in doc["graphs"]:
        assert len(graph["rows"]) == 4 and graph["summary"]["collectives"] == 4
        assert {"name", "kind", "group", "verdict", "reason", "exposed_ms"} <= set(graph["rows"][0])
        assert {"hidden_before", "hidden_after", "exposed_ms_before", "exposed_ms_after",
                "peak_in_flight_bytes_after", "step_ms_after"} <= set(graph["summary"])
        assert all(r["verdict"] in ("hidden", "exposed") for r in graph["rows"])


def test_report_text_on_the_fsdp_examples(tmp_path, capsys):
    mlp = small_target(tmp_path, "mlp", dim=64, hidden=128, depth=2, tokens=64)
    code, out, err = run(capsys, "report", mlp, *WORLD, "--graph", "fw", "--max-in-flight-bytes", "64KiB",
                         "--bucket", "none", "--wide")
    assert code == 0, err
    assert "schedule: max_in_flight=3, max_in_flight_bytes=65536" in out and "regather=always" in out
    assert "fw_0: 12 collectives (h100, nvlink)" in out and "bw_0" not in out
    assert "hidden" in out and "exposed (" in out and "blocks.1.up" in out
    assert "estimated exposed" in out and "peak in flight per group: all_gather" in out and "; step " in out
    assert "reduce_scatter" not in out   # forward only: no line for a kind it lacks
    assert "collectives 12 ->" not in out and "bucket " not in out   # --bucket none: no rewrite lines
    code, out, err = run(capsys, "report", mlp, *WORLD, "--graph", "fw", "--wide")   # default bucket="auto"
    assert code == 0, err
    # per block: norm weight and bias and the up-projection's bias merge; the big weights stay alone
    assert "fw_0: 8 collectives" in out and "collectives 12 -> 8: 6 merged into 2 buckets" in out
    assert "bucket all_gather_bucket (all_gather, group 0, " in out and "blocks.1.norm, blocks.1.norm" in out
    code, out, err = run(capsys, "report", mlp, *WORLD, "--graph", "fw")   # compact: parameters by module
    assert code == 0 and "collectives 12 -> 8: 6 merged into 2 buckets" in out
    assert "bucket all_gather_bucket_1 (AG, 1.0KiB, 3 members): blocks.1.{norm.{weight, bias}, up.bias}" in out
    llama = small_target(tmp_path, "llama", vocab=64, dim=32, heads=2, hidden=64, depth=1, seq=16)
    code, out, err = run(capsys, "report", llama, *WORLD, "--graph", "bw", "--quiet")
    assert code == 0, err
    assert "bw_0:" in out and "reduce_scatter" in out and "fw_0" not in out


@pytest.mark.parametrize("name, advice", [("tp_sp", "run it with --world-size 2 or 4, or build"),
                                          ("tp_llama", "run it with --world-size 2, or build")])
def test_tp_examples_name_the_world_sizes_that_split_them(fake_pg, name, advice):
    """At world size 8 (the fake group's; what the README runs examples/llama.py at) the TP
    examples' 4 heads do not split: build says which sizes and what to run instead of
    failing inside Dynamo's trace."""
    with pytest.raises(ValueError, match="over the 8 tensor-parallel ranks") as raised:
        example(name).build()
    assert f"examples/{name}.py splits" in str(raised.value) and "heads (4)" in str(raised.value)
    assert advice in str(raised.value)


def test_timeline_trace_is_well_formed(tmp_path, capsys):
    path = tmp_path / "trace.json"
    code, _, err = run(capsys, "timeline", ALLGATHER, *WORLD, "-o", path, "--quiet")
    assert code == 0 and err == ""
    trace = json.loads(path.read_text())
    assert trace["otherData"]["schema"] == cli.TIMELINE_SCHEMA
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(processes.values()) == ["bw_0 after", "bw_0 before", "fw_0 after", "fw_0 before"]
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["name"]
        assert e["pid"] in processes and (e["pid"], e["tid"]) in threads and "node" in e["args"]
    # h100 + nvlink: 10 us + the gathered 128 x 128 fp32 x ring 7/8 over 360 GB/s, in us
    gather_us = round((10e-3 + 128 * 128 * 4 * 7 / 8 / 360e9 * 1e3) * 1e3, 3)
    assert {e["dur"] for e in complete if e["cat"] == "comm" and e["pid"] in (1, 2)} == {gather_us}
    for pid in processes:
        assert threads[(pid, 0)] == "compute" and threads[(pid, 1)] == "comm group 0"
        cats = {e["cat"] for e in complete if e["pid"] == pid}
        assert {"compute", "comm"} <= cats
    gathers = [e for e in complete if e["pid"] == 2 and e["cat"] == "comm"]
    assert len(gathers) == 4 and all(e["name"].startswith("all_gather_into_tensor") for e in gathers)
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--format", "json", "--quiet")
    assert code == 0, err
    summaries = [g["summary"] for g in json.loads(out)["graphs"]]
    for pid, key in ((1, "exposed_ms_before"), (2, "exposed_ms_after")):   # stalls drawn = stalls reported
        stalls = [e["dur"] for e in complete if e["pid"] == pid and e["cat"] == "exposed"]
        assert stalls and sum(stalls) == pytest.approx(summaries[0][key] * 1e3, abs=1e-2)


def _bad_return_target(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def build():\n    return 42\n")
    return f"{path}:build"


def _target(tmp_path, source: str) -> str:
    """A target file holding ``source``, as ``path:build``."""
    path = tmp_path / "target.py"
    path.write_text("import torch\n" + source)
    return f"{path}:build"


def _json(tmp_path, document):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return path


def _unwritable(tmp_path):
    (tmp_path / "file").write_text("")
    return ["--out", tmp_path / "file" / "sub"]


@pytest.mark.parametrize("case, make_argv, expected", [
    ("missing file", lambda t: ["report", t / "nope.py:build", *WORLD], "no such file"),
    ("no such function", lambda t: ["report", ALLGATHER.replace(":build", ":buld"), *WORLD],
     "has no function 'buld'; did you mean 'build'?"),
    ("not (model, inputs)", lambda t: ["report", _bad_return_target(t), *WORLD],
     "must return (model, example_inputs), got int"),
    ("build raises", lambda t: ["report", _target(t, "def build():\n    raise RuntimeError('boom')\n"), *WORLD],
     "target.py:build raised RuntimeError at "),
    ("build takes an argument", lambda t: ["report", _target(t, "def build(n):\n    return n\n"), *WORLD],
     "target.py:build must take no arguments: missing a required argument: 'n'"),
    ("inputs a dict", lambda t: ["report", _target(t, "def build():\n    return torch.nn.ReLU(), "
                                                      "{'x': torch.ones(2)}\n"), *WORLD],
     "target.py:build's example_inputs must be a tuple or list of the model's positional inputs, got dict"),
    ("world size < 1", lambda t: ["report", ALLGATHER, "--world-size", "0"], "world size must be >= 1"),
    ("rank out of range", lambda t: ["report", ALLGATHER, *WORLD, "--rank", "8"], "rank 8 is not in [0, 8)"),
    ("unwritable output", lambda t: ["dump", ALLGATHER, *WORLD, *_unwritable(t)], "cannot write to"),
    ("bad flag value", lambda t: ["report", ALLGATHER, *WORLD, "--max-in-flight", "0"], "--max-in-flight"),
    ("no such profile", lambda t: ["report", ALLGATHER, *WORLD, "--profile", t / "none.json"], "no profile file"),
    ("unknown built-in profile", lambda t: ["report", ALLGATHER, *WORLD, "--profile", "tpu:nvlink"],
     "unknown profile 'tpu:nvlink'"),
    ("profile of another schema", lambda t: ["report", ALLGATHER, *WORLD, "--profile", _json(t, {"schema": "x"})],
     "schema must be 'overlapc.profile/1', got 'x'"),
    ("calibrate world size", lambda t: ["calibrate", "--world-size", "0", "-o", t / "p.json"],
     "world size must be >= 1"),
    ("calibrate into a folder", lambda t: ["calibrate", "-o", t], "is a folder"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, make_argv, expected):
    code, out, err = run(capsys, *make_argv(tmp_path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("overlapc ") and expected in err, err


def test_report_header_names_the_profile_and_profile_beats_device(capsys):
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--graph", "fw", "--quiet")
    assert code == 0, err
    assert "\nprofile: built-in h100:nvlink (the default)\n" in out
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--graph", "fw", "--profile", "cpu:ethernet",
                         "--device", "a100", "--link", "ib")
    assert code == 0 and "using --profile cpu:ethernet; --device/--link ignored" in err
    assert "\nprofile: built-in cpu:ethernet\n" in out and "fw_0: 4 collectives (cpu, ethernet)" in out
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--quiet", "--device", "a100", "--latency-us", "5")
    assert code == 0 and "\nprofile: built-in a100:nvlink, with latency_us=5\n" in out


def test_demo_dispatches_lazily(monkeypatch):
    seen = []
    stand_in = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "overlapc.cli.demo", stand_in)
    monkeypatch.setattr(cli, "demo", stand_in, raising=False)   # set once a test imported the real one
    assert cli.main(["demo", "--steps", "3"]) == 0 and seen == [["--steps", "3"]]


def test_backend_dump_dir_writes_rank_folders(tmp_path, fake_pg):
    model, inputs = example("allgather").build()
    compiled = torch.compile(model, backend="overlapc",
                             options={"dump_dir": str(tmp_path), "inner": "aot_eager"})
    compiled(*inputs).sum().backward()
    torch._dynamo.reset()
    graphs = sorted(os.listdir(tmp_path / "rank0"))
    assert [g.split("_")[0] for g in graphs] == ["bw", "fw"]
    for graph in graphs:
        assert sorted(os.listdir(tmp_path / "rank0" / graph)) == [
            "after.txt", "before.txt", "report.json", "report.txt"]


def test_python_dash_m_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-m", "overlapc.cli", "report", ALLGATHER, "--world-size", "2",
                           "--rank", "1", "--format", "json", "--quiet"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert (doc["world_size"], doc["rank"]) == (2, 1)
    assert doc["graphs"][0]["rows"][0]["nbytes"] == 128 * 128 * 4


_OUTPUTS = '''import collections, dataclasses, sys
import torch
sys.path.insert(0, {examples!r})
import allgather


class ModelOutput(collections.OrderedDict):
    """Stand-in for transformers' ModelOutput: a dataclass that is also an ordered dict of its set fields."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


@dataclasses.dataclass
class CausalLMOutput(ModelOutput):
    loss: torch.Tensor = None
    logits: torch.Tensor = None


@dataclasses.dataclass
class Plain:
    hidden: torch.Tensor
    steps: int


class Refuse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("this op has no backward")


class Wrapped(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.inner, self.kind = allgather.build(dim=32, depth=2, tokens=16)[0], kind

    def forward(self, x):
        logits = self.inner(x)
        if self.kind == "model_output":
            return CausalLMOutput(loss=logits.pow(2).mean(), logits=logits)
        if self.kind == "dataclass":
            return Plain(hidden=logits, steps=3)
        if self.kind == "dict":
            return {{"logits": logits, "count": torch.ones(2, dtype=torch.long)}}
        if self.kind == "refuse":
            return Refuse.apply(logits)
        return logits.argmax(-1)          # integers: nothing to differentiate


def build(kind):
    return Wrapped(kind), (torch.randn(16, 32),)
'''


@pytest.mark.parametrize("kind, said", [
    ("model_output", "backward from output['loss']"),
    ("dataclass", "backward from the sum of output.hidden"),
    ("dict", "backward from the sum of output['logits']"),
])
def test_structured_outputs_get_a_backward_and_say_from_what(tmp_path, capsys, kind, said):
    path = tmp_path / "outputs.py"
    path.write_text(_OUTPUTS.format(examples=os.path.join(REPO, "examples"))
                    + f"\ndef build_{kind}():\n    return build({kind!r})\n")
    code, out, err = run(capsys, "report", f"{path}:build_{kind}", *WORLD)
    assert code == 0, err
    assert said in err.splitlines()
    assert "fw_0: 2 collectives" in out and "bw_0: 2 collectives" in out


def test_no_backward_is_said_with_its_reason(tmp_path, capsys):
    path = tmp_path / "outputs.py"
    path.write_text(_OUTPUTS.format(examples=os.path.join(REPO, "examples"))
                    + "\ndef build_ints():\n    return build('ints')\n")
    code, out, err = run(capsys, "report", f"{path}:build_ints", *WORLD, "--graph", "bw")
    assert code == 2 and out == ""
    assert err.splitlines()[-1].endswith("produced no bw graph (no backward: no floating tensor of the output "
                                         "requires grad (output: torch.int64))"), err
    code, out, err = run(capsys, "report", f"{path}:build_ints", *WORLD, "--graph", "fw", "--quiet")
    assert code == 0 and "fw_0: 2 collectives" in out
    path.write_text(path.read_text() + "\ndef build_refuse():\n    return build('refuse')\n")
    code, out, err = run(capsys, "report", f"{path}:build_refuse", *WORLD, "--graph", "bw")
    assert code == 2 and err.splitlines()[-1].endswith(
        "produced no bw graph (no backward: backward from the sum of output raised RuntimeError: "
        "this op has no backward)"), err


def _target_file(tmp_path, text):
    path = tmp_path / "target.py"
    path.write_text(text)
    return f"{path}:build"


@pytest.mark.parametrize("case, make_argv, expected", [
    ("syntax error", lambda t: ["report", _target_file(t, "import torch\ndef build(:\n    pass\n"), *WORLD],
     "target.py:2: SyntaxError: invalid syntax"),
    ("import error", lambda t: ["report", _target_file(t, "import os\nimport no_such_module_xyz\n"), *WORLD],
     "target.py:2: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("name not importable", lambda t: ["report", _target_file(t, "from os import no_such_name\n"), *WORLD],
     "target.py:1: ImportError: cannot import name 'no_such_name'"),
    ("count with a size suffix", lambda t: ["report", ALLGATHER, *WORLD, "--max-in-flight", "2KiB"],
     "--max-in-flight: expected an int >= 1 (a count, no KiB/MiB/GiB suffix) or 'none', got '2KiB'"),
    ("negative count", lambda t: ["report", ALLGATHER, *WORLD, "--max-in-flight", "-1"],
     "expected an int >= 1 (a count, no KiB/MiB/GiB suffix) or 'none', got '-1'"),
    ("misspelt bucket", lambda t: ["report", ALLGATHER, *WORLD, "--bucket", "modul"],
     "--bucket: expected 'auto', 'module', 'none' or a byte size >= 1 (e.g. 65536, 64KiB, 16MiB, 1GiB), "
     "got 'modul'; did you mean 'module'?"),
    ("bucket plan not JSON", lambda t: ["report", ALLGATHER, *WORLD, "--bucket", "[layers.0]"],
     "--bucket: a plan is a JSON list of module paths or lists of them, e.g. '[\"layers.0\", [\"norm\", "
     "\"output\"]]'; '[layers.0]' is not JSON"),
    ("bucket plan with a module twice", lambda t: ["report", ALLGATHER, *WORLD, "--bucket", '["a", ["a"]]'],
     "--bucket: module 'a' is in plan entries 0 and 1"),
    ("bad byte budget", lambda t: ["report", ALLGATHER, *WORLD, "--max-in-flight-bytes", "12 MB"],
     "--max-in-flight-bytes: expected 'auto', 'serial-peak', 'graph-peak', 'none' or a byte size >= 1"),
    ("misspelt byte mode", lambda t: ["report", ALLGATHER, *WORLD, "--max-in-flight-bytes", "serial_peek"],
     "got 'serial_peek'; did you mean 'serial-peak'?"),
    ("bad regather", lambda t: ["report", ALLGATHER, *WORLD, "--regather", "never"],
     "--regather: expected 'always' or 'auto', got 'never'"),
    ("misspelt issue", lambda t: ["report", ALLGATHER, *WORLD, "--issue", "per_kernel"],
     "--issue: expected 'early' or 'per-kernel', got 'per_kernel'; did you mean 'per-kernel'?"),
    ("bad chunks", lambda t: ["report", ALLGATHER, *WORLD, "--chunks", "0"],
     "--chunks: expected an int >= 1 (1 = off) or 'auto', got '0'"),
    ("misspelt chunks", lambda t: ["report", ALLGATHER, *WORLD, "--chunks", "atuo"],
     "--chunks: expected an int >= 1 (1 = off) or 'auto', got 'atuo'; did you mean 'auto'?"),
])
def test_more_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, make_argv, expected):
    code, out, err = run(capsys, *make_argv(tmp_path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("overlapc report: error: ") and expected in err, err


def test_a_bucket_plan_given_as_json_buckets_one_entry_per_bucket(capsys):
    code, out, err = run(capsys, "report", LLAMA, "--world-size", "8", "--bucket", '["layers.0", ["layers.1"]]')
    assert code == 0, err
    assert "bucket=(('layers.0',), ('layers.1',))" in out
    assert "18 merged into 2 buckets" in out and "layers.0.{attention_norm.weight" in out, out


def test_bucket_option_typo_gets_did_you_mean():
    with pytest.raises(ValueError, match=r"got 'modul'; did you mean 'module'\?"):
        overlapc.OverlapConfig.from_options({"bucket": "modul"})


LLAMA = os.path.join(REPO, "examples", "llama.py") + ":build"


def test_report_fits_120_columns_and_wide_gives_every_column(capsys):
    code, out, err = run(capsys, "report", LLAMA, *WORLD)
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    header = [line for line in lines if line.startswith("collective ")]
    assert len(header) == 2 and header[0].split()[:4] == ["collective", "kind", "group", "bytes"]
    assert "by estimate with h100:nvlink" in out and "estimated exposed" in out
    # a bucket of all-gathers names the parameters it gathers, grouped by module
    assert "bucket all_gather_bucket_1 (AG, 945.0KiB, 3 members): layers.0.{attention.o.weight, " \
           "ffn_norm.weight, ffn.gate.weight}" in out
    code, wide, err = run(capsys, "report", LLAMA, *WORLD, "--wide", "--quiet")
    assert code == 0 and err == ""
    assert max(len(line) for line in wide.splitlines()) > 120
    assert [line.split() for line in wide.splitlines() if line.startswith("collective ")][0] == [
        "collective", "kind", "group", "bytes", "dtype", "issue", "wait", "compute", "comm_ms", "exposed_ms",
        "verdict", "placed", "module"]
    rows = sum(1 for line in lines if line.startswith(("all_gather", "reduce_scatter")))
    assert rows == sum(1 for line in wide.splitlines() if line.startswith(("all_gather", "reduce_scatter")))


def test_report_quiet_prints_the_summaries_only(capsys):
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--quiet")
    assert code == 0 and err == ""
    assert "fw_0: 4 collectives" in out and "bw_0: 4 collectives" in out and "estimated exposed" in out
    assert "all_gather_into_tensor" not in out and "issued at" not in out


def _parsers():
    parser = cli.parser.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, commands.choices


def test_help_teaches_every_command(capsys):
    import overlapc.cli.demo as demo
    parser, commands = _parsers()
    assert "pydoc" not in parser.format_help() and "examples:" in parser.format_help()
    commands = {**commands, "demo": demo._arguments()}
    for name, sub in commands.items():
        text = sub.format_help()
        assert sub.description and sub.description.strip(), name
        examples = [line.strip() for line in text.split("examples:")[1].splitlines() if line.strip()]
        assert 2 <= len(examples) <= 3, (name, examples)
        for example in examples:
            assert name in example.split(), (name, example)
            for target in (w for w in example.split() if w.startswith("examples/")):
                path, _, function = target.partition(":")
                assert os.path.isfile(os.path.join(REPO, path)), target
                assert f"def {function}(" in open(os.path.join(REPO, path)).read(), target
        for action in sub._actions:
            if action.dest == "help" or not action.option_strings:
                continue
            assert action.help and ("default" in action.help or action.required), (name, action.dest)
    _, commands = _parsers()
    assert "writes" in commands["dump"].description or "write" in commands["dump"].description
    device = next(a for a in commands["report"]._actions if a.dest == "device")
    assert "FLOP" in device.help and "default h100" in device.help
    fmt = next(a for a in commands["report"]._actions if a.dest == "format")
    assert "json" in fmt.help and "default text" in fmt.help
    for line in parser.format_help().split("examples:")[1].splitlines():
        if "examples/" in line:
            target = next(w for w in line.split() if w.startswith("examples/"))
            assert os.path.isfile(os.path.join(REPO, target.partition(":")[0])), line


def test_demo_refuses_bad_options_before_starting_ranks(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--bucket", "bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "overlapc demo: error: OverlapConfig.bucket must be" in err and "'bogus'" in err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--profile", os.path.join(REPO, "README.md")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "overlapc demo: error: --profile: " in err and "README.md" in err


def test_report_html_writes_the_schedule_page_beside_the_rows(tmp_path, capsys):
    page = tmp_path / "schedule.html"
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--quiet", "--html", page)
    assert code == 0 and err == "" and "fw_0: 4 collectives" in out
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "fw_0" in html and "bw_0" in html
    assert "http://" not in html and "https://" not in html     # self-contained
    code, _, err = run(capsys, "report", ALLGATHER, *WORLD, "--html", page, "--format", "json")
    assert code == 0 and page.read_text() == html                # deterministic


@pytest.mark.parametrize("argv, expected", [
    (["--trace", "trace.json"], "--trace draws a measured run on the HTML page: give --html FILE as well"),
    (["--html", "."], ". is a folder; --html takes a file name"),
])
def test_report_html_bad_input_is_one_line_and_exit_2(capsys, argv, expected):
    code, out, err = run(capsys, "report", ALLGATHER, *WORLD, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err, err


def test_report_takes_every_byte_mode_and_regather(capsys):
    """The CLI's flags reach every value OverlapConfig accepts for them: the
    serial-peak and graph-peak byte modes, keep-or-regather's auto, per-kernel issue, coalesced buckets and
    narrow gathers off."""
    for mode in ("serial-peak", "graph-peak"):
        code, out, err = run(capsys, "report", ALLGATHER, *WORLD, "--graph", "fw", "--max-in-flight-bytes",
                             mode, "--regather", "auto", "--issue", "per-kernel", "--bucket-op", "coalesced",
                             "--no-narrow-gathers", "--format", "json")
        assert code == 0, err
        config = json.loads(out)["config"]
        assert (config["max_in_flight_bytes"], config["regather"], config["issue"], config["bucket_op"],
                config["narrow_gathers"]) == (mode, "auto", "per-kernel", "coalesced", False)

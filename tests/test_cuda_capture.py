"""The graphs a GPU profile's estimates read are the ones the CUDA compile makes.

``overlapc report``/``dump``/``timeline``/``--html`` capture through
``overlapc.backend.cuda_capture`` when the profile's device is a GPU (the default h100)
and through CPU dispatch when it is cpu (``--dispatch`` chooses explicitly);
every output names the dispatch. The CLI runs in-process (``overlapc.cli.main``)
on examples/llama.py at world size 8; the fake H100 patches process-wide and
restores everything on exit.
"""
import contextlib
import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F

import overlapc.cli as cli
from overlapc.estimate import costmodel
from overlapc.backend import cuda_capture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(REPO, "examples", "llama.py") + ":build"
WORLD = ["--world-size", "8"]


def run(capsys, *argv):
    """(exit code, stdout, stderr) of one in-process CLI call."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Per dispatch ("cuda": the default h100 profile; "cpu": ``--device cpu``): the JSON
    report, the HTML page and the dumped backward of examples/llama.py."""
    pytest.importorskip("triton", reason="the CUDA-shaped capture's fake H100 stubs Triton's driver")
    folder = tmp_path_factory.mktemp("llama")
    results = {}
    for dispatch, flags in (("cuda", []), ("cpu", ["--device", "cpu"])):
        page = folder / f"{dispatch}.html"
        dump = folder / f"{dispatch}-dump"
        report = folder / f"{dispatch}.json"
        with open(report, "w") as out, contextlib.redirect_stdout(out):
            assert cli.main(["report", LLAMA, *WORLD, *flags, "--quiet", "--format", "json",
                             "--html", str(page)]) == 0
        assert cli.main(["dump", LLAMA, *WORLD, *flags, "--quiet", "--graph", "bw", "--out", str(dump)]) == 0
        results[dispatch] = {"report": json.loads(report.read_text()), "page": page.read_text(),
                             "bw": (dump / "bw_0" / "before.txt").read_text(),
                             "bw_report": json.loads((dump / "bw_0" / "report.json").read_text()),
                             "bw_text": (dump / "bw_0" / "report.txt").read_text()}
    return results


def test_the_default_h100_report_captures_the_cuda_graphs(llama):
    cuda, cpu = llama["cuda"], llama["cpu"]
    assert "_scaled_dot_product_efficient_attention_backward" in cuda["bw"]
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" not in cuda["bw"]
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in cpu["bw"]
    assert "_scaled_dot_product_efficient_attention" not in cpu["bw"]
    # the partitioner saves other tensors: the estimates see other graphs
    assert [g["summary"] for g in cuda["report"]["graphs"]] != [g["summary"] for g in cpu["report"]["graphs"]]
    # ... the forward's collectives and buckets as on CPU, each still named by its module across
    # the re-trace (the backward issues its reduce-scatters in another order, so buckets differ)
    fw_cuda, fw_cpu = (graphs["report"]["graphs"][0] for graphs in (cuda, cpu))
    assert [(r["kind"], r["module"]) for r in fw_cuda["rows"]] == [(r["kind"], r["module"]) for r in fw_cpu["rows"]]
    assert all(row["module"] for graph in cuda["report"]["graphs"] for row in graph["rows"])


def test_every_output_names_the_dispatch(llama):
    described = "cuda (fake H100, efficient attention, min-cut partitioner)"
    cuda, cpu = llama["cuda"], llama["cpu"]
    assert cuda["report"]["dispatch"] == {"device": "cuda", "attention": ["efficient"], "partitioner": "min-cut",
                                          "described": described}
    assert cpu["report"]["dispatch"]["described"] == "cpu"
    assert f"dispatch: {described}" in cuda["page"] and "dispatch: cpu" in cpu["page"]
    assert cuda["bw_report"]["dispatch"]["described"] == described and cpu["bw_report"]["dispatch"]["device"] == "cpu"
    assert cuda["bw_text"].endswith(f"dispatch: {described}\n") and cpu["bw_text"].endswith("dispatch: cpu\n")


def test_the_text_header_and_timeline_name_the_dispatch(tmp_path, capsys):
    target = _small_llama(tmp_path)
    code, out, err = run(capsys, "report", target, *WORLD, "--quiet", "--dispatch", "cuda", "--device", "cpu")
    assert code == 0, err
    assert "\ndispatch: cuda (fake H100, efficient attention, min-cut partitioner)\n" in out
    code, _, err = run(capsys, "timeline", target, *WORLD, "--quiet", "--profile", "cpu:ethernet",
                       "-o", tmp_path / "trace.json")
    assert code == 0, err
    assert json.loads((tmp_path / "trace.json").read_text())["otherData"]["dispatch"]["described"] == "cpu"


def test_without_triton_the_cuda_capture_says_what_to_install(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else
                        find_spec(name, *a))
    code, out, err = run(capsys, "report", LLAMA, *WORLD)
    assert code == 2 and out == ""
    assert "pip install triton" in err and "--dispatch cpu" in err and len(err.strip().splitlines()) == 1


def _small_llama(tmp_path) -> str:
    path = tmp_path / "small_llama.py"
    path.write_text(f"import importlib.util\nspec = importlib.util.spec_from_file_location('small_llama_example', "
                    f"{LLAMA.rsplit(':', 1)[0]!r})\nmodule = importlib.util.module_from_spec(spec)\n"
                    "spec.loader.exec_module(module)\n"
                    "def build():\n    return module.build(vocab=64, dim=32, heads=4, hidden=64, depth=1, seq=16)\n")
    return f"{path}:build"


# ---------------------------------------------------------------- the H100's dispatch, unit by unit

def _qkv(dtype, heads=4, head_dim=64, kv_heads=None):
    q = torch.empty(2, heads, 16, head_dim, dtype=dtype, device="meta")
    k = torch.empty(2, kv_heads or heads, 16, head_dim, dtype=dtype, device="meta")
    return q, k, k


@pytest.mark.parametrize("dtype, mask, expected", [
    (torch.float32, False, "efficient"),     # flash needs fp16/bf16
    (torch.bfloat16, False, "flash"),
    (torch.bfloat16, True, "efficient"),     # flash takes no mask
    (torch.float64, False, "math"),
])
def test_sdpa_backend_follows_the_h100_checks(dtype, mask, expected):
    q, k, v = _qkv(dtype)
    attn_mask = torch.empty(16, 16, dtype=torch.bool, device="meta") if mask else None
    assert cuda_capture.sdpa_backend(q, k, v, attn_mask) == expected


def test_sdpa_backend_respects_the_enabled_backends_and_head_dims():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _qkv(torch.float32)
    with sdpa_kernel(SDPBackend.MATH):
        assert cuda_capture.sdpa_backend(q, k, v) == "math"
    assert cuda_capture.sdpa_backend(*_qkv(torch.float32, head_dim=62)) == "math"   # not aligned to 4
    assert cuda_capture.sdpa_backend(*_qkv(torch.bfloat16, head_dim=512)) == "efficient"   # flash: <= 256
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="no enabled attention kernel"):
        cuda_capture.sdpa_backend(q, k, v)


def test_device_dispatch_applies_inside_only():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True) * w

    def ops(fn):
        graph = make_fx(fn, tracing_mode="fake")(torch.randn(1, 2, 4, 8), torch.randn(8))
        return {n.target.name().split("::")[1] for n in graph.graph.nodes
                if isinstance(n.target, torch._ops.OpOverload)}

    chosen = []
    with cuda_capture.device_dispatch(chosen):
        inside = ops(step)
    outside = ops(step)
    assert "_scaled_dot_product_efficient_attention" in inside and chosen == ["efficient"]
    assert "_scaled_dot_product_flash_attention_for_cpu" in outside and "_scaled_dot_product_flash_attention_for_cpu" \
        not in inside


@pytest.mark.parametrize("spec, choice, expected", [
    ("h100:nvlink", "auto", "cuda"), ("a100:ib", "auto", "cuda"), ("cpu:ethernet", "auto", "cpu"),
    ("cpu:ethernet", "cuda", "cuda"), ("h100:nvlink", "cpu", "cpu"),
])
def test_dispatch_follows_the_profiles_device_unless_chosen(spec, choice, expected):
    assert cuda_capture.dispatch_for(costmodel.resolve(spec), choice) == expected


def test_a_calibrated_gpu_profile_gets_the_cuda_dispatch():
    gpu = costmodel.Profile(costmodel.DeviceProfile("NVIDIA H100 80GB HBM3", 600.0, 2500.0),
                            costmodel.LINKS["nvlink"], name="profile.json")
    assert cuda_capture.dispatch_for(gpu) == "cuda"
    with pytest.raises(ValueError, match="dispatch must be one of auto, cuda, cpu"):
        cuda_capture.dispatch_for(gpu, "gpu")

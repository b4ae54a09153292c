"""A sharded model compiled in pieces is said once, with where and what it costs.

2 gloo ranks on 127.0.0.1 (multiproc.py), the Llama of examples/llama.py sharded
with overlapc.fsdp. Overlap stops at every graph's edge, so when Dynamo skips
the model's forward (a graph break inside the loop over blocks), each block
is compiled on its own, or a compiled function runs part of the model, rank 0
logs one WARNING naming the cut (file:line) and
the parameters whose all-gathers can no longer be prefetched; a model compiled
whole gets none. Every graph compiled gets an INFO line, FX graph cache hits
included.
"""
import logging
import os
import sys

import pytest
import torch

from multiproc import init_gloo, run_ranks

TIMEOUT = 600.0
HERE = os.path.abspath(__file__)


def _llama_class():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
    from llama import Llama
    return Llama


def _make(kind: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc.fsdp

    Llama = _llama_class()

    class BreakInLoop(Llama):
        def forward(self, tokens):
            x = self.embed(tokens)
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i == 0:
                    torch._dynamo.graph_break()
            return self.output(self.norm(x))

    torch.manual_seed(0)
    cls = BreakInLoop if kind == "break" else Llama
    return overlapc.fsdp.shard(cls(vocab=128, dim=64, heads=4, hidden=128, depth=2),
                               init_device_mesh("cpu", (dist.get_world_size(),)))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _job(rank, world_size, port, kinds, inner):
    """{kind: the "overlapc" log lines of training a model of that kind} on this rank, the kinds one
    after another in this process (Dynamo reset between them; each model is new)."""
    init_gloo(rank, world_size, port)
    from torch._inductor import config as inductor_config
    inductor_config.compile_threads = 1
    logger = logging.getLogger("overlapc")
    logger.setLevel(logging.INFO)
    lines = {}
    for kind in kinds:
        torch._dynamo.reset()
        records = _Records()
        logger.addHandler(records)
        try:
            _train(kind, inner, rank)
        finally:
            logger.removeHandler(records)
        lines[kind] = records.lines
    return lines


def _train(kind, inner, rank):
    model = _make(kind)
    options = {"inner": inner}
    if kind == "per_block":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend="overlapc", options=options)
        step = model
    elif kind == "function":   # a compiled function that runs the first block only; the rest eager
        first = torch.compile(lambda tokens: model.layers[0](model.embed(tokens)), backend="overlapc",
                              options=options)

        def step(tokens):
            x = first(tokens)
            for layer in model.layers[1:]:
                x = layer(x)
            return model.output(model.norm(x))
    else:
        step = torch.compile(model, backend="overlapc", options=options)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        step(torch.randint(0, 128, (2, 16), generator=g)).float().pow(2).mean().backward()


@pytest.fixture(scope="module")
def aot_eager():
    """{kind: (rank 0's lines, rank 1's lines)}: every kind under inner="aot_eager", in one 2-rank job."""
    kinds = ("break", "per_block", "function", "whole")
    rank0, rank1 = run_ranks(_job, world_size=2, args=(kinds, "aot_eager"), timeout=TIMEOUT)
    return {kind: (rank0[kind], rank1[kind]) for kind in kinds}


def _warnings(lines, text="are cut at"):
    return [m for level, m in lines if level == "WARNING" and text in m]


def test_graph_break_inside_the_block_loop_is_one_warning(aot_eager):
    rank0, rank1 = aot_eager["break"]
    cut = _warnings(rank0)
    assert len(cut) == 1, cut
    # where: the loop's call of the block in the forward Dynamo skipped, and Dynamo's reason
    assert f"{HERE}:" in cut[0] and "Dynamo runs BreakInLoop.forward uncompiled" in cut[0], cut[0]
    assert "graph_break" in cut[0], cut[0]
    # what it costs: the parameters outside this graph, named by module
    assert "the all-gathers of layers, norm, output cannot be issued" in cut[0], cut[0]
    assert _warnings(rank1) == []


def test_per_block_compile_is_one_warning(aot_eager):
    rank0, rank1 = aot_eager["per_block"]
    cut = _warnings(rank0)
    assert len(cut) == 1, cut
    assert "layers.0 is compiled on its own" in cut[0], cut[0]
    assert "llama.py:" in cut[0], cut[0]   # the line in Llama.forward calling the block
    assert "the all-gathers of embed, layers.1, norm, output cannot be issued" in cut[0], cut[0]
    assert _warnings(rank1) == []


def test_compiled_function_over_part_of_the_model_is_one_warning(aot_eager):
    rank0, rank1 = aot_eager["function"]
    cut = _warnings(rank0)
    assert len(cut) == 1, cut
    assert "the compiled function <lambda> reads only embed, layers.0's parameters" in cut[0], cut[0]
    assert f"{HERE}:" in cut[0], cut[0]
    assert "the all-gathers of layers.1, norm, output cannot be issued" in cut[0], cut[0]
    assert _warnings(rank1) == []


def test_whole_model_compile_is_not_a_cut(aot_eager):
    rank0, _ = aot_eager["whole"]
    assert _warnings(rank0) == []
    assert [m for _, m in rank0 if "] fw_" in m and "moved" in m], rank0   # graphs are numbered per process


def test_every_graph_of_a_per_block_compile_has_an_info_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    rank0 = run_ranks(_job, world_size=2, args=(("per_block",), "inductor"), timeout=TIMEOUT)[0]["per_block"]
    compiled = [m for _, m in rank0 if "compiling graph" in m]
    assert len(compiled) == 2, compiled   # one Dynamo graph per block
    for index in range(len(compiled)):
        for name in (f"fw_{index}", f"bw_{index}"):
            said = [m for level, m in rank0 if level == "INFO" and f"] {name}: " in m]
            assert len(said) == 1, (name, said, rank0)
    hits = [m for _, m in rank0 if "from the FX graph cache: schedule as compiled before" in m]
    assert hits, rank0   # the second block's graphs are the first one's

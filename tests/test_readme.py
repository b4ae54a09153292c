"""README.md's Python blocks run as written, in order, in one namespace, under
the fake process group (world size 8) that stands in for torchrun's. Names a
block leaves to the reader are given here: ``rank`` (this process's) and
``train_step`` (one step of the model "Use it" compiled)."""
import os
import re

import torch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@torch._inductor.config.patch(fx_graph_cache=False)
def test_readme_python_blocks_run(fake_pg, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)        # files the blocks write (profiler traces) land here
    with open(README, encoding="utf-8") as readme:
        blocks = re.findall(r"^```python\n(.*?)^```", readme.read(), flags=re.S | re.M)
    assert blocks, "README.md has no ```python block"
    scope = {"__name__": "readme", "rank": 0,
             "train_step": lambda: scope["compiled"](torch.randn(8, 64)).sum().backward()}
    torch._dynamo.reset()
    for block in blocks:
        exec(compile(block, README, "exec"), scope)
    torch._dynamo.reset()
    assert scope["rows"] and scope["rows"][0].kind == "all_gather"     # the standalone part ran
    assert all(p.grad is not None for p in scope["model"].parameters())  # and the compiled step

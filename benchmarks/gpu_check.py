"""One command for the first GPU: does overlapc hold on real CUDA?

    python benchmarks/gpu_check.py --json results/gpu_check.json      # one GPU, < 8 minutes on an H100
    python benchmarks/gpu_check.py --dry-run --json /tmp/g.json       # the same on CPU (the test suite runs this)

Runs from the repository root without installing overlapc (see ``_make_importable``).
One process. Parts, each with its own time budget; a part that fails or runs out of
time is recorded with its error and the next one runs:

1. ``order``: the Llama example (examples/llama.py), sharded with ``overlapc.fsdp``
   over the fake process group of world size 8 on CUDA tensors, compiled with
   backend="overlapc" (max_in_flight=2) through Inductor's real CUDA path; the
   generated wrapper code of the forward and backward is read with
   ``overlapc.backend.inductor_order``: consumer order of the all-gathers, most
   collectives in flight per kind (<= max_in_flight), every start waited,
   starts with no compute before their wait, and each collective's compute
   window (``window_breaks``: the compute overlapc placed between a start and
   its wait is still between them; what fusion runs outside is listed, not failed).
2. ``memory``: ``torch.cuda.max_memory_allocated`` over a training step (forward,
   loss, backward) of that scheduled model, of the same model scheduled with
   overlapc's defaults and with the ``max_in_flight_bytes="auto"`` budget, and
   compiled with plain Inductor, interleaved rounds (allocation does not depend
   on the fake group's missing data movement). Each, and the ratios scheduled /
   plain. ``--memory-snapshots`` adds one recorded step per variant (the CUDA
   allocator's history, to find where a peak comes from).
3. ``trace``: an MLP whose layers all-gather their weights with functional
   collectives over a real NCCL group of world size 1 (127.0.0.1 TCPStore),
   compiled with backend="overlapc" (``dump_dir``), profiled with
   torch.profiler (CPU + CUDA); the Chrome trace read by ``overlapc analyze``
   (``overlapc.explain.analyze``), plus the kernels seen on streams other than the
   compute stream. (NCCL on one rank may copy instead of launching nccl kernels.)
4. ``calibrate``: ``overlapc calibrate --quick`` in that NCCL group (compute only:
   one rank), writing a profile next to the JSON.

Output: one JSON (``--json``; rewritten after every part; schema
"overlapc.gpu_check/2": /1 had its own provenance keys, ``git_commit`` among
them) with provenance (benchmarks/provenance.py's record: commit, torch, CUDA,
machine, date, command; plus the device the parts ran on) and per part ``ok`` / ``error`` /
``seconds`` and its numbers; beside it ``<stem>_code/`` (the order part's wrapper code),
``<stem>_trace.json``, ``<stem>_dump/``, ``<stem>_profile.json``; a summary on
stdout. ``--dry-run``: the same parts
on CPU (fake group on CPU tensors: Inductor's C++ code; gloo instead of NCCL;
no device memory numbers). Exit code 0 when every part passed.

Written for torch >= 2.11 (the GPU image's version): nothing newer is needed.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.abc
import importlib.util
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = {"order": 160, "memory": 100, "trace": 70, "calibrate": 200}   # caps in seconds, each within the deadline
DEADLINE_S = 470     # the whole run; a watchdog writes the JSON and exits at this point
MAX_IN_FLIGHT = 2


class _PassesFinder(importlib.abc.MetaPathFinder):
    """Finds ``overlapc.passes`` in the repository's ``passes/`` folder (pyproject maps it
    there when installed); its submodules then come from that package's ``__path__``."""

    def find_spec(self, name, path=None, target=None):
        if name != "overlapc.passes":
            return None
        folder = ROOT / "passes"
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _make_importable() -> str:
    """Import overlapc from an installed copy if there is one, else from this checkout
    (ROOT on sys.path, plus the finder above for ``overlapc.passes``). Returns which."""
    if importlib.util.find_spec("overlapc") is not None:
        return "installed"
    sys.path.insert(0, str(ROOT))
    sys.meta_path.insert(0, _PassesFinder())
    return "checkout"


IMPORTED_FROM = _make_importable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _say(message: str) -> None:
    print(f"gpu_check: {message}", flush=True)


# ---------------------------------------------------------------- provenance and output

def _shared_provenance():
    """benchmarks/provenance.py's ``provenance``, loaded by path: putting benchmarks/ on
    sys.path would let its llama.py shadow examples/llama.py in a test process."""
    spec = importlib.util.spec_from_file_location("overlapc_benchmarks_provenance",
                                                  ROOT / "benchmarks" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.provenance


def provenance(args: argparse.Namespace) -> dict:
    """Where and when the numbers come from: the record every benchmark writes
    (commit, dirty, torch, cuda, python, machine, date, command), plus ``device``
    (the device the parts ran on: "cpu" for a dry run), ``gpus``, ``dry_run``,
    ``overlapc_from`` (installed or checkout) and ``cwd``."""
    cuda = torch.cuda.is_available()
    return _shared_provenance()({
        "device": torch.cuda.get_device_name(0) if cuda and not args.dry_run else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0, "dry_run": args.dry_run,
        "overlapc_from": IMPORTED_FROM, "cwd": os.getcwd()})


class Report:
    """The JSON document, rewritten (atomically) after every change."""

    def __init__(self, path: Path, args: argparse.Namespace):
        self.path = path
        self.doc = {"schema": "overlapc.gpu_check/2", "provenance": provenance(args), "parts": {}}
        self.lock = threading.Lock()

    def record(self, part: str, result: dict) -> None:
        with self.lock:
            self.doc["parts"][part] = result
            self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        temporary.write_text(json.dumps(self.doc, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(temporary, self.path)


class PartTimeout(BaseException):
    """A part ran past its budget (a BaseException, so no ``except Exception`` inside torch swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PartTimeout in the main thread after ``seconds`` (SIGALRM; a call blocked
    inside C code is interrupted only when it returns: the watchdog covers that)."""
    def expire(signum, frame):
        raise PartTimeout(f"part ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def start_watchdog(report: Report, deadline: float, current: dict) -> None:
    """At ``deadline`` (time.monotonic), record the running part as timed out, write the
    JSON and exit the process (code 3), whatever the main thread is blocked in."""
    def watch():
        while time.monotonic() < deadline:
            time.sleep(1.0)
        part = current.get("part")
        if part:
            report.record(part, {"ok": False, "error": "killed by the watchdog at the deadline (--deadline-s)",
                                 "seconds": time.monotonic() - current.get("since", deadline)})
        report.doc["aborted"] = f"deadline reached during part {part!r}"
        report.write()
        print(f"gpu_check: deadline reached during {part!r}; JSON written to {report.path}", flush=True)
        os._exit(3)

    threading.Thread(target=watch, name="gpu_check-watchdog", daemon=True).start()


# ---------------------------------------------------------------- process groups and models

def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fake_group(world_size: int = 8) -> None:
    """The fake process group (no communication) as the default group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def real_group(backend: str) -> None:
    """A world-size-1 group of ``backend`` ("nccl" or "gloo") on a 127.0.0.1 TCPStore."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_check_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_sizes(dry_run: bool) -> dict:
    if dry_run:
        return {"vocab": 256, "dim": 64, "heads": 2, "hidden": 128, "depth": 2, "batch": 1, "seq": 32}
    return {"vocab": 1024, "dim": 1024, "heads": 8, "hidden": 2816, "depth": 4, "batch": 1, "seq": 512}


def sharded_llama(device: torch.device, sizes: dict):
    """examples/llama.py's Llama on ``device``, sharded over the default group, and its tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc.fsdp
    llama = _load_example("llama")
    torch.manual_seed(0)
    model = llama.Llama(sizes["vocab"], sizes["dim"], sizes["heads"], sizes["hidden"], sizes["depth"]).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = overlapc.fsdp.shard(model, mesh)
    tokens = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), device=device)
    return model, tokens


def overlapc_compile(model: torch.nn.Module, **options):
    """torch.compile with overlapc's backend, passed as a callable: without an install,
    the "overlapc" backend name (an entry point) is unknown to torch."""
    import functools

    from overlapc.backend import overlapc_backend
    return torch.compile(model, backend=functools.partial(overlapc_backend, options=options))


def train_step(compiled, tokens: torch.Tensor) -> None:
    logits = compiled(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- the parts

def part_order(ctx: dict) -> dict:
    """Compile the scheduled Llama; read its forward and backward wrapper code."""
    from torch._inductor.utils import run_and_get_code

    from overlapc.backend import inductor_order

    fake_group(8)
    device = ctx["device"]
    model, tokens = sharded_llama(device, ctx["sizes"])
    torch._dynamo.reset()
    compiled = overlapc_compile(model, max_in_flight=MAX_IN_FLIGHT, on_error="raise")
    begin = time.monotonic()
    with inductor_order.capture() as lowered, torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(lambda: train_step(compiled, tokens))
    _sync(device)
    compile_s = time.monotonic() - begin
    ctx["scheduled"] = (model, compiled, tokens)
    graphs, problems = [], []
    if len(lowered) != len(codes):
        problems.append(f"{len(codes)} wrappers but {len(lowered)} lowered graphs recorded: windows not checked")
    for number, code in enumerate(codes):
        found = inductor_order.events(code)
        summary = inductor_order.summary(found)
        if len(lowered) == len(codes):
            summary["windows"] = inductor_order.window_summary(found, lowered[number])
            problems += [f"graph {number}: window {b}" for b in summary["windows"]["breaks"]]
        graphs.append({"graph": number, "wrapper_lines": code.count("\n"), **summary})
        for kind, count in summary["max_in_flight"].items():
            if kind != "all" and count > MAX_IN_FLIGHT:
                problems.append(f"graph {number}: {count} {kind} in flight > max_in_flight={MAX_IN_FLIGHT}")
        problems += [f"graph {number}: {b}" for b in summary["consumer_order_breaks"]]
        problems += [f"graph {number}: never waited: {b}" for b in summary["never_waited"]]
    if len(codes) < 2 or not any(g["starts"] for g in graphs):
        problems.append(f"expected a forward and a backward with collectives, got {len(codes)} wrapper(s) "
                        f"with starts {[g['starts'] for g in graphs]}")
    if ctx["keep_code"]:
        folder = ctx["json"].with_name(ctx["json"].stem + "_code")
        folder.mkdir(parents=True, exist_ok=True)
        for number, code in enumerate(codes):
            (folder / f"graph{number}.py").write_text(code, encoding="utf-8")
        ctx["code_folder"] = str(folder)
    return {"ok": not problems, "problems": problems, "code": ctx.get("code_folder"), "compile_s": compile_s,
            "sizes": ctx["sizes"],
            "max_in_flight": MAX_IN_FLIGHT, "graphs": graphs}


def _plain_inductor(model: torch.nn.Module, reorder_for_peak_memory: bool):
    """torch.compile with Inductor alone, its peak-memory reordering on or off
    (off: what overlapc's compiles run with, to tell its share of a gap apart)."""
    if reorder_for_peak_memory:
        return torch.compile(model, backend="inductor")
    return torch.compile(model, backend="inductor", options={"reorder_for_peak_memory": False})


# the memory part's variants: name -> how to compile a fresh sharded model
MEMORY_VARIANTS = {
    "overlapc": lambda m: overlapc_compile(m, max_in_flight=MAX_IN_FLIGHT),
    "inductor": lambda m: _plain_inductor(m, True),
    "overlapc_defaults": lambda m: overlapc_compile(m),
    "overlapc_auto_bytes": lambda m: overlapc_compile(m, max_in_flight=MAX_IN_FLIGHT, max_in_flight_bytes="auto"),
    "overlapc_no_bucket": lambda m: overlapc_compile(m, max_in_flight=MAX_IN_FLIGHT, bucket=None),
    "inductor_no_memory_reorder": lambda m: _plain_inductor(m, False),
}
DEFAULT_MEMORY_VARIANTS = ("overlapc", "inductor", "overlapc_defaults", "overlapc_auto_bytes")


def part_memory(ctx: dict) -> dict:
    """Peak device memory of a training step per variant (``ctx["memory_variants"]``,
    "overlapc" and "inductor" always among them), interleaved rounds; each
    variant's peak above the step's start and its ratio to plain Inductor's."""
    device = ctx["device"]
    if "scheduled" not in ctx:
        fake_group(8)
        model, tokens = sharded_llama(device, ctx["sizes"])
        ctx["scheduled"] = (model, overlapc_compile(model, max_in_flight=MAX_IN_FLIGHT), tokens)
    model, scheduled, tokens = ctx.pop("scheduled")   # freed with this part
    variants = {"overlapc": (model, scheduled)}
    for name in ctx["memory_variants"]:
        if name not in variants:
            fresh, _ = sharded_llama(device, ctx["sizes"])
            variants[name] = (fresh, MEMORY_VARIANTS[name](fresh))
    samples = {name: {"peak_bytes": [], "above_start_bytes": [], "step_ms": []} for name in variants}
    for name, (module, compiled) in variants.items():   # compile and warm up
        train_step(compiled, tokens)
        module.zero_grad(set_to_none=True)
    _sync(device)
    for _ in range(3 if ctx["dry_run"] else 5):
        for name, (module, compiled) in variants.items():
            _measure_step(device, module, compiled, tokens, samples[name])
    if ctx["memory_snapshots"] and device.type == "cuda":
        for name, (module, compiled) in variants.items():
            _snapshot_step(ctx, name, module, compiled, tokens)
    result = {"ok": True, "sizes": ctx["sizes"], "max_in_flight": MAX_IN_FLIGHT, "rounds": samples,
              "note": "fake process group: collectives move no data, so step times are compute only"}
    for name in variants:
        result[f"{name}_median_step_ms"] = statistics.median(samples[name]["step_ms"])
    if device.type == "cuda":
        over = {name: max(samples[name]["above_start_bytes"]) for name in variants}
        result["peak_above_start_bytes"] = over
        result["ratio_to_inductor"] = {name: over[name] / over["inductor"] for name in over if over["inductor"]}
        result.update(overlapc_peak_above_start_bytes=over["overlapc"], inductor_peak_above_start_bytes=over["inductor"],
                      ratio=result["ratio_to_inductor"].get("overlapc"))
    else:
        result["note"] += "; dry run: no device memory numbers"
    return result


def _measure_step(device: torch.device, module, compiled, tokens, rounds: dict[str, list]) -> None:
    """One training step of ``compiled``: its time and (CUDA) its peak memory, into ``rounds``."""
    module.zero_grad(set_to_none=True)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    begin = time.perf_counter()
    train_step(compiled, tokens)
    _sync(device)
    rounds["step_ms"].append((time.perf_counter() - begin) * 1e3)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        rounds["peak_bytes"].append(peak)
        rounds["above_start_bytes"].append(peak - start)


def _snapshot_step(ctx: dict, name: str, module, compiled, tokens) -> None:
    """One more step of variant ``name`` with the CUDA allocator's history recorded (Python
    stacks: the generated wrapper's lines name the buffers), written as a pickle beside the
    JSON (``<stem>_snapshot_<name>.pickle``) for ``torch.cuda.memory`` snapshot tools."""
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        train_step(compiled, tokens)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(ctx["json"].with_name(f"{ctx['json'].stem}_snapshot_{name}.pickle")))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


class GatheredMLP(torch.nn.Module):
    """Layers that all-gather their weight shard over the default group (functional
    collectives, autograd: a reduce-scatter of the gradient in the backward)."""

    def __init__(self, dim: int, depth: int, world: int):
        super().__init__()
        self.shards = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(dim // world, dim) * dim ** -0.5) for _ in range(depth))

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        for shard in self.shards:
            x = torch.relu(x @ gather(shard, 0, dist.group.WORLD).t())
        return x


def part_trace(ctx: dict) -> dict:
    """Profile a compiled step in a real world-size-1 group; read the trace with overlapc analyze."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from overlapc.explain import analysis_output, analyze

    device = ctx["device"]
    real_group("gloo" if ctx["dry_run"] else "nccl")
    dim, depth, tokens = (64, 3, 64) if ctx["dry_run"] else (2048, 6, 8192)
    torch.manual_seed(0)
    model = GatheredMLP(dim, depth, 1).to(device)
    x = torch.randn(tokens, dim, device=device)
    dump = ctx["json"].with_name(ctx["json"].stem + "_dump")
    torch._dynamo.reset()
    compiled = overlapc_compile(model, max_in_flight=MAX_IN_FLIGHT, dump_dir=str(dump), check_ranks=False)

    def step():
        compiled(x).square().mean().backward()

    step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=3, repeat=1)) as prof:
        for _ in range(4):
            step()
            _sync(device)
            prof.step()
    trace = ctx["json"].with_name(ctx["json"].stem + "_trace.json")
    prof.export_chrome_trace(str(trace))
    analysis = analyze.analyze(str(trace), dump=str(dump))
    doc = analysis_output.to_json(analysis)
    events = json.loads(trace.read_text())["traceEvents"]
    streams: dict[str, set] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            streams.setdefault(str((e.get("args") or {}).get("stream")), set()).add(str(e.get("name"))[:80])
    nccl = sorted({name for names in streams.values() for name in names if name.lower().startswith("nccl")})
    matched = sum(1 for m in doc["collectives"] if m["graph"])
    problems = []
    if not doc["collectives"]:
        problems.append("analyze found no collectives")
    elif not matched:
        problems.append("analyze matched no collective to overlapc's dump")
    return {"ok": not problems, "problems": problems, "trace": str(trace), "dump": str(dump),
            "format": doc["format"], "steps": doc["steps"], "collectives": len(doc["collectives"]),
            "matched_to_dump": matched, "nccl_kernels": nccl,
            "streams": {s: sorted(names)[:12] for s, names in sorted(streams.items())},
            "text": analysis_output.format_text(analysis).splitlines()[:40]}


def part_calibrate(ctx: dict) -> dict:
    """``overlapc calibrate --quick`` in the world-size-1 group (compute only)."""
    from overlapc import calibrate

    if not dist.is_initialized():
        real_group("gloo" if ctx["dry_run"] else "nccl")
    out = ctx["json"].with_name(ctx["json"].stem + "_profile.json")
    doc = calibrate.run_in_group(str(out), quick=True, fallback_link="nvlink", say=_say,
                                 alone=ctx["device"].type != "cuda")
    return {"ok": out.exists(), "profile": str(out), "device": doc["device"], "link": doc["link"],
            "measured_on": doc["measured"].get("device_type")}


PARTS = {"order": part_order, "memory": part_memory, "trace": part_trace, "calibrate": part_calibrate}


def run_part(name: str, ctx: dict, report: Report, current: dict, deadline: float) -> bool:
    left = deadline - time.monotonic() - 10
    variants = len(ctx.get("memory_variants", ())) if name == "memory" else 0
    budget = min(BUDGETS[name] * ctx["budget_scale"] * max(1.0, variants / len(DEFAULT_MEMORY_VARIANTS)), left)
    current.update(part=name, since=time.monotonic())
    _say(f"part {name} (budget {budget:.0f} s) ...")
    begin = time.monotonic()
    try:
        if left < 5:
            raise PartTimeout("no time left before the deadline (--deadline-s)")
        with time_limit(budget):
            result = PARTS[name](ctx)
    except BaseException as error:   # noqa: BLE001 - recorded; the next part still runs
        if isinstance(error, KeyboardInterrupt):
            raise
        result = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000],
                  "traceback": traceback.format_exc()[-6000:]}
    result["seconds"] = round(time.monotonic() - begin, 1)
    current.update(part=None)
    report.record(name, result)
    _say(f"part {name}: {'ok' if result.get('ok') else 'FAILED'} in {result['seconds']} s"
         + (f" ({result.get('error') or '; '.join(result.get('problems', []))[:300]})" if not result.get("ok") else ""))
    return bool(result.get("ok"))


def summary_lines(doc: dict) -> list[str]:
    lines = [f"{doc['provenance']['device']} torch {doc['provenance']['torch']} "
             f"commit {str(doc['provenance']['commit'])[:12]}"]
    for name, part in doc["parts"].items():
        status = "ok" if part.get("ok") else "FAILED"
        detail = ""
        if name == "order" and "graphs" in part:
            detail = "; ".join(f"graph {g['graph']}: starts {g['starts']} in flight {g['max_in_flight']}"
                               + (f", windows kept {g['windows']['kept']}/{g['windows']['with_compute']}"
                                  if "windows" in g else "") for g in part["graphs"])
        elif name == "memory" and part.get("ratio") is not None:
            detail = "peak above start: " + ", ".join(
                f"{name} {nbytes / 2**20:.1f} MiB ({part['ratio_to_inductor'][name]:.3f}x inductor)"
                for name, nbytes in part["peak_above_start_bytes"].items())
        elif name == "trace" and "collectives" in part:
            detail = (f"{part['format']} trace, {part['collectives']} collectives "
                      f"({part['matched_to_dump']} matched), nccl kernels: {part['nccl_kernels'][:3]}")
        elif name == "calibrate" and "device" in part:
            detail = f"{part['device'].get('name')}: {part['device'].get('tflops', 0):.3g} TFLOP/s"
        lines.append(f"{name}: {status} ({part.get('seconds')} s) {detail or part.get('error', '')[:200]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"),
                        help="where to write the JSON (default benchmarks/results/gpu_check.json)")
    parser.add_argument("--dry-run", action="store_true", help="everything on CPU: no device needed")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                        help=f"stop (JSON written) after this many seconds (default {DEADLINE_S})")
    parser.add_argument("--memory-variants", default=",".join(DEFAULT_MEMORY_VARIANTS),
                        help=f"the memory part's variants, comma-separated, of {','.join(MEMORY_VARIANTS)} "
                        "(overlapc and inductor are always measured)")
    parser.add_argument("--memory-snapshots", action="store_true",
                        help="CUDA only: after the memory part's rounds, one more step per variant with the "
                        "allocator's history recorded, written as <json stem>_snapshot_<variant>.pickle")
    parser.add_argument("--no-code", dest="keep_code", action="store_false",
                        help="do not write the order part's wrapper code beside the JSON (<json stem>_code/)")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; valid: {', '.join(PARTS)}")
    memory_variants = list(dict.fromkeys(["overlapc", "inductor", *filter(None, args.memory_variants.split(","))]))
    if any(v not in MEMORY_VARIANTS for v in memory_variants):
        parser.error(f"unknown memory variant(s) {[v for v in memory_variants if v not in MEMORY_VARIANTS]}; "
                     f"valid: {', '.join(MEMORY_VARIANTS)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run on a machine without a GPU")
    path = Path(args.json).resolve()
    report = Report(path, args)
    report.write()
    deadline = time.monotonic() + args.deadline_s
    current: dict = {}
    start_watchdog(report, deadline, current)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = {"device": device, "dry_run": args.dry_run, "json": path, "sizes": llama_sizes(args.dry_run),
           "keep_code": args.keep_code, "memory_variants": memory_variants,
           "memory_snapshots": args.memory_snapshots,
           "budget_scale": 3.0 if args.dry_run else 1.0}
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)   # nothing cached from an earlier run
        passed = [run_part(name, ctx, report, current, deadline) for name in parts]
    if dist.is_initialized():
        dist.destroy_process_group()
    report.doc["passed"] = all(passed)
    report.write()
    for line in summary_lines(report.doc):
        _say(line)
    _say(f"JSON: {path}")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the rank benchmarks (step_time.py, tp_moe.py) share: the shaped link the
worker runs on, the step probes, and result files that carry their provenance.

    from harness import run_worker_on_shaped_link, profile_step, concurrent_step, write_json

The ranks themselves are launched by ``overlapc.launch`` (the project's one
rank launcher); this module only re-executes a benchmark's ``--worker`` in a
network namespace whose loopback is shaped (see step_time.py's docstring).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from provenance import provenance


def write_json(path: str, obj: dict) -> None:
    """``obj`` as indented JSON at ``path``, a ``provenance`` record first
    (benchmarks/provenance.py: commit, torch, machine, date, command)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"provenance": provenance(), **obj}, f, indent=2, default=str)


def _can_shape() -> str | None:
    """None when a shaped namespace can be made, else the reason it cannot."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool!r} on PATH"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def run_worker_on_shaped_link(args, argv: list[str], script: str, label: str, say) -> int:
    """Re-run ``script --worker argv`` in a fresh network namespace whose loopback is
    shaped to ``args.rate`` (plain loopback when ``args.no_shape`` or shaping is not
    possible, said in the log); the namespace is deleted at the end, on error and on
    SIGINT/SIGTERM, and a worker past ``args.timeout`` + 120 s is killed. ``args``
    has ``rate``, ``no_shape`` and ``timeout``; ``say`` writes a log line."""
    reason = "--no-shape" if args.no_shape else _can_shape()
    ns = None
    child = None

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cmd = [sys.executable, os.path.abspath(script), "--worker", *argv]
        env = dict(os.environ)
        if reason is None:
            ns = f"overlapc_{label}_{os.getpid()}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                "rate", args.rate, "burst", "256kb", "limit", "64mb")
            link = f"loopback in netns {ns} shaped by tc tbf rate {args.rate} burst 256kb limit 64mb"
            cmd = ["ip", "netns", "exec", ns, *cmd]
            env["GLOO_SOCKET_IFNAME"] = "lo"
        else:
            link = f"plain loopback, NOT shaped ({reason})"
        say(f"link: {link}")
        cmd += ["--link", link]
        child = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            return child.wait(timeout=args.timeout + 120)
        except subprocess.TimeoutExpired:
            say(f"ERROR: worker still running after {args.timeout + 120:.0f} s; killing it")
            return 124
    finally:
        if child is not None and child.poll() is None:
            _kill_group(child.pid)
        if ns is not None:
            result = _sh("ip", "netns", "del", ns, check=False)
            say(f"deleted netns {ns}" if result.returncode == 0 else f"WARNING: ip netns del {ns}: {result.stderr.strip()}")
        for s, h in old.items():
            signal.signal(s, h)


def _kill_group(pgid: int) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


_COLLECTIVE_EVENTS = {f"_c10d_functional::{op}" for op in
                      ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")}


def profile_step(step, trace: str | None = None) -> tuple[int, int]:
    """(peak bytes, functional collectives started) of one call of ``step``, from
    torch.profiler's CPU events (profile_memory): allocations and frees of this
    process in time order, summed; the peak of that sum. A TorchDispatchMode
    would not do: with one active, the compiled function runs eagerly. ``trace``:
    also write the profile there as a Chrome trace (for ``overlapc.explain.analyze``)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    if trace:
        prof.export_chrome_trace(trace)
    live = peak = collectives = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        name = event.name()
        if name == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
        elif name in _COLLECTIVE_EVENTS:
            collectives += 1
    return peak, collectives


def concurrent_step(first, second):
    """A step that runs ``second`` on another thread while ``first`` runs on this one
    (same arguments); returns ``first``'s result, raises either's error."""
    import threading

    def step(*args):
        errors: list = []

        def run_second():
            try:
                second(*args)
            except BaseException as exc:  # noqa: BLE001  (re-raised on the calling thread)
                errors.append(exc)
        thread = threading.Thread(target=run_second, name="concurrent_step")
        thread.start()
        result = first(*args)
        thread.join()
        if errors:
            raise errors[0]
        return result
    return step

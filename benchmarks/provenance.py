"""Where a benchmark's numbers come from: one record every result file carries.

    from provenance import provenance   # benchmarks/ is the script's own directory
    document = {"provenance": provenance(), ...}

``provenance(extra)`` returns a JSON-ready dict: ``commit`` (git HEAD, or
"unknown" outside a checkout), ``dirty`` (uncommitted changes under overlapc/,
passes/ or benchmarks/), ``torch``, ``cuda`` (None on a CPU build), ``python``,
``machine`` (host, platform, CPU count, GPU name or "cpu"), ``date`` (UTC, ISO
8601) and ``command`` (the command line, shell-quoted, script path relative to the repository), plus any
``extra`` keys (a benchmark's settings). It never raises for a missing git.
"""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _command() -> str:
    script = sys.argv[0]
    if os.path.isabs(script) and script.startswith(REPO):
        script = os.path.relpath(script, REPO)
    return shlex.join(["python", script, *sys.argv[1:]])


def provenance(extra: dict | None = None) -> dict:
    """The record described in the module docstring, with ``extra`` merged last."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record = {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--", "overlapc", "passes", "benchmarks")),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "machine": {"host": socket.gethostname(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "device": gpu},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(),
    }
    record.update(extra or {})
    return record

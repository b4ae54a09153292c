"""Run a test function in N real processes (gloo on 127.0.0.1) and always finish.

    results = run_ranks(fn, world_size=2, args=(...,), timeout=120.0)

calls ``fn(rank, world_size, port, *args)`` in ``world_size`` fresh "spawn"
processes and returns their return values in rank order. ``fn`` must be a
module-level function; it is passed to the children by module file and name,
so a test module in tests/ (no __init__.py) is importable there.

It never hangs: a rank that raises is re-raised here with its traceback text;
a rank that dies (non-zero exit, a signal) or is still running at ``timeout``
fails the call with an AssertionError naming the rank, and every rank is killed.
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing import connection, get_context

_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # hung ranks dump their stacks on it


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """One torch thread per rank, then the default gloo group over tcp://127.0.0.1:port.

    gloo's per-collective timeout is generous (240 s): ranks compile on their own,
    and on a loaded 2-core machine one rank's compile can keep its peer waiting
    over a minute. Hangs are caught by ``run_ranks``' deadline, not by gloo."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=240),
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteTraceback(Exception):
    """Carries a rank's traceback text; set as __cause__ of the re-raised error."""

    def __str__(self) -> str:
        return self.args[0]


def _trampoline(conn, where, rank, world_size, port, args):
    """Child entry point: import fn by (directory, module, name), run it, send back the outcome."""
    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    # As in the parent (pyproject's filterwarnings): a graph left unscheduled fails the test.
    warnings.filterwarnings("error", message="overlapc left the graph unscheduled")
    try:
        directory, module, name = where
        if directory not in sys.path:
            sys.path.insert(0, directory)
        fn = getattr(importlib.import_module(module), name)
        value = fn(rank, world_size, port, *args)
        message = ("ok", pickle.dumps(value))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:  # noqa: BLE001 - unpicklable exception: send the text only
            payload = None
        message = ("raised", (payload, text))
    try:
        conn.send(message)  # before teardown: a peer stuck in a collective must not delay the report
        conn.close()
    finally:
        _destroy_process_group()
        # Leave without interpreter finalization: on torch 2.14 a rank whose result was
        # already sent sometimes aborted there ("terminate called without an active
        # exception", SIGABRT) while torch's gloo and autograd threads were torn down.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _destroy_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown must not hide the result
        pass


def _locate(fn) -> tuple[str, str, str]:
    module = sys.modules[fn.__module__]
    name = fn.__qualname__
    if "<" in name or "." in name:
        raise ValueError(f"run_ranks needs a module-level function, got {fn.__module__}.{name}")
    module_file = getattr(module, "__file__", None)
    if module_file is None:
        raise ValueError(f"cannot locate the module of {name} for the child processes")
    module_name = fn.__module__
    if module_name == "__main__":
        module_name = os.path.splitext(os.path.basename(module_file))[0]
    return os.path.dirname(os.path.abspath(module_file)), module_name, name


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def run_ranks(fn, world_size: int = 2, args: tuple = (), timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, port, *args)`` on ranks 0..world_size-1; return results by rank."""
    where = _locate(fn)
    ctx = get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_trampoline,
            args=(send, where, rank, world_size, port, args),
            name=f"rank{rank}",
            daemon=True,
        )
        p.start()
        send.close()  # the child holds the only write end: EOF means it is gone
        procs.append(p)
        conns.append(recv)

    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = [r for r in range(world_size) if r not in results]
                _dump_stacks([procs[r] for r in missing])
                raise AssertionError(
                    f"rank(s) {missing} hung: no result after {timeout:.0f} s "
                    f"(stacks dumped to stderr; all ranks killed)"
                )
            waitables = [c for r, c in enumerate(conns) if r not in results]
            waitables += [p.sentinel for r, p in enumerate(procs) if r not in results]
            connection.wait(waitables, timeout=min(0.5, deadline - now))
            for rank in range(world_size):
                if rank in results:
                    continue
                conn, proc = conns[rank], procs[rank]
                if conn.poll():
                    try:
                        status, payload = conn.recv()
                    except EOFError:  # closed without a message: the rank is gone
                        proc.join(timeout=5)
                        how = "closed its pipe" if proc.exitcode is None else _describe_exit(proc.exitcode)
                        raise AssertionError(
                            f"rank {rank} died: {how} before returning a result (other ranks killed)"
                        ) from None
                    else:
                        if status == "ok":
                            results[rank] = pickle.loads(payload)
                            continue
                        _reraise(rank, *payload)
                # A child writes its whole message before it exits, so an exited
                # rank with nothing left in its pipe never sent one.
                if proc.exitcode is not None and not conn.poll():
                    raise AssertionError(
                        f"rank {rank} died: {_describe_exit(proc.exitcode)} "
                        f"before returning a result (other ranks killed)"
                    )
        for rank, proc in enumerate(procs):
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                raise AssertionError(f"rank {rank} returned a result but did not exit")
            if proc.exitcode != 0:
                raise AssertionError(
                    f"rank {rank} returned a result, then {_describe_exit(proc.exitcode)}"
                )
        return [results[r] for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in conns:
            conn.close()


def _reraise(rank: int, payload: bytes | None, text: str):
    cause = RemoteTraceback(f"\n--- traceback of rank {rank} ---\n{text}")
    exc = pickle.loads(payload) if payload is not None else None
    if exc is None or not isinstance(exc, Exception):
        raise RuntimeError(f"rank {rank} raised:\n{text}") from cause
    raise exc from cause


def _dump_stacks(procs) -> None:
    if _DUMP_SIGNAL is None:
        return
    for proc in procs:
        if proc.is_alive():
            try:
                os.kill(proc.pid, _DUMP_SIGNAL)
            except OSError:
                pass
    time.sleep(1.0)

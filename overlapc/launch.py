"""Run a function on N local ranks (gloo on 127.0.0.1) and always finish: the
project's one rank launcher (tests, benchmarks, ``overlapc calibrate``, the demo).

    from overlapc import launch
    results = launch.run(fn, world_size=2, args=(...,), timeout=120.0,
                         on_message=lambda rank, message: print(rank, message))

calls ``fn(rank, world_size, *args)`` in ``world_size`` fresh "spawn"
processes, each with the default process group already joined (gloo over
``tcp://127.0.0.1:<a free port>``, one torch thread; ``gloo=False`` leaves the
group to ``fn``: ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE``
are set as torchrun sets them, and ``init_gloo`` joins it). Returns the
return values in rank order. ``fn`` must be a module-level function (it is
found in the child by its module's file and name, so a script or a test
module that is no package is found too); ``args`` and the results are pickled.

Contract: it never hangs and never leaves a rank behind.
- A rank that raises: its exception is re-raised here (the same type when it
  pickles, else RuntimeError), its ``__cause__`` a ``RemoteTraceback`` holding
  the rank's traceback text; the other ranks are killed.
- A rank that dies (a signal, a non-zero exit, an exit without a result):
  ``RankFailure`` naming the rank and how it ended; the others are killed.
- Ranks still running at ``timeout`` seconds after the start: their Python
  stacks are dumped to stderr (faulthandler, on SIGUSR1), then ``RankFailure``
  naming them; every rank is killed.
- ``progress(message)`` in a rank sends ``message`` (anything picklable) to the
  parent, which calls ``on_message(rank, message)`` as it arrives, in the order
  each rank sent them (a rank with no ``on_message`` has its messages dropped).
- A rank leaves with ``os._exit`` once its result is sent and its group
  destroyed: on torch 2.14 interpreter finalization sometimes aborted
  (SIGABRT, "terminate called without an active exception") after a correct
  result, while torch's gloo and autograd threads were torn down.

Why multiprocessing's "spawn" context and not torch.multiprocessing.start_processes:
start_processes returns no results and reports a rank's exception as text
(ProcessRaisedException) through an error file, so results and progress need a
pipe per rank anyway; with that pipe the exception itself travels back, its
type intact, and one ``connection.wait`` over pipes and process sentinels sees
results, messages and deaths alike. A hung rank needs its stacks dumped and its
name said, which ``ProcessContext.join(timeout)`` does not do either.
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
from datetime import timedelta
from multiprocessing import connection, get_context
from typing import Any, Callable

_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # hung ranks dump their stacks on it
_channel: list = []   # in a launched rank: its pipe to the parent


class RankFailure(RuntimeError):
    """A rank died or hung. ``ranks``: the ranks named; ``how``: "died" or "hung"."""

    def __init__(self, message: str, ranks: list[int], how: str):
        super().__init__(message)
        self.ranks, self.how = ranks, how


class RemoteTraceback(Exception):
    """Carries a rank's traceback text; the ``__cause__`` of a re-raised rank exception."""

    def __init__(self, rank: int, text: str):
        super().__init__(f"\n--- traceback of rank {rank} ---\n{text}")
        self.rank = rank

    def __str__(self) -> str:
        return self.args[0]


PORT_TRIES = 3   # attempts of ``run``, each on a new port, while the picked one turns out taken


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout: float = 240.0) -> None:
    """One torch thread, then the default gloo group over tcp://127.0.0.1:port.

    gloo's per-collective ``timeout`` is generous by default (240 s): ranks
    compile on their own, and on a loaded 2-core machine one rank's compile can
    keep its peer waiting over a minute. Hangs are caught by ``run``'s
    deadline, not by gloo."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout))


def progress(message: Any) -> bool:
    """Send ``message`` to the launcher's ``on_message``; False (and nothing sent)
    outside a launched rank, so code that runs in both places may call it."""
    if not _channel:
        return False
    _channel[0].send(("message", message))
    return True


def run(fn: Callable, world_size: int = 2, args: tuple = (), *, timeout: float = 120.0,
        gloo: bool = True, gloo_timeout: float = 240.0,
        on_message: Callable[[int, Any], None] | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ranks 0..world_size-1; return the results by rank.
    See the module docstring for what happens when a rank raises, dies or hangs. A rank
    that finds the picked port taken when it joins (EADDRINUSE: another process bound it
    between ``free_port`` and the join) ends the attempt; up to ``PORT_TRIES`` attempts,
    each on a new port, the ranks of a failed one all ended first."""
    attempt = 1
    while True:
        try:
            return _run_once(fn, world_size, args, timeout, gloo, gloo_timeout, on_message, free_port())
        except Exception as error:
            if "EADDRINUSE" not in str(error) or attempt == PORT_TRIES:
                raise
            attempt += 1


def _run_once(fn, world_size, args, timeout, gloo, gloo_timeout, on_message, port) -> list:
    where = _locate(fn)
    ctx = get_context("spawn")
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_entry, name=f"rank{rank}", daemon=True,
                               args=(send, where, rank, world_size, port, gloo, gloo_timeout, args))
            proc.start()
            send.close()  # the child holds the only write end: EOF means it is gone
            procs.append(proc)
            conns.append(recv)
        return _Watch(procs, conns, on_message, timeout).results()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in conns:
            conn.close()


class _Watch:
    """The parent's side: wait on every rank's pipe and sentinel until all results are in."""

    def __init__(self, procs, conns, on_message, timeout: float):
        self.procs, self.conns, self.on_message = procs, conns, on_message
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.got: dict[int, object] = {}

    def results(self) -> list:
        world_size = len(self.procs)
        while len(self.got) < world_size:
            pending = [r for r in range(world_size) if r not in self.got]
            left = self.deadline - time.monotonic()
            if left <= 0:
                _dump_stacks([self.procs[r] for r in pending])
                raise RankFailure(f"rank(s) {pending} hung: no result after {self.timeout:.0f} s "
                                  f"(stacks dumped to stderr; all ranks killed)", pending, "hung")
            connection.wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending],
                            timeout=min(0.5, left))
            for rank in pending:
                self._drain(rank)
        self._join_all()
        return [self.got[r] for r in range(world_size)]

    def _drain(self, rank: int) -> None:
        conn, proc = self.conns[rank], self.procs[rank]
        while rank not in self.got and conn.poll():
            try:
                status, payload = conn.recv()
            except EOFError:  # closed without a result: the rank is gone
                proc.join(timeout=5)
                how = "closed its pipe" if proc.exitcode is None else _describe_exit(proc.exitcode)
                raise RankFailure(f"rank {rank} died: {how} before returning a result (other ranks killed)",
                                  [rank], "died") from None
            if status == "message":
                if self.on_message is not None:
                    self.on_message(rank, payload)
            elif status == "ok":
                self.got[rank] = pickle.loads(payload)
            else:
                _reraise(rank, *payload)
        # A rank writes each message whole before it exits, so an exited rank
        # with nothing left in its pipe never sent its result.
        if rank not in self.got and proc.exitcode is not None and not conn.poll():
            raise RankFailure(f"rank {rank} died: {_describe_exit(proc.exitcode)} before returning "
                              f"a result (other ranks killed)", [rank], "died")

    def _join_all(self) -> None:
        for rank, proc in enumerate(self.procs):
            proc.join(timeout=max(1.0, self.deadline - time.monotonic()))
            if proc.exitcode is None:
                raise RankFailure(f"rank {rank} returned a result but did not exit", [rank], "hung")
            if proc.exitcode != 0:
                raise RankFailure(f"rank {rank} returned a result, then {_describe_exit(proc.exitcode)}",
                                  [rank], "died")


def failure_text(error: BaseException) -> str:
    """What ``run`` raised, as text for a log or a result file: the dead or hung
    rank(s), or the raising rank, its exception and its traceback."""
    cause = error.__cause__
    if isinstance(cause, RemoteTraceback):
        return f"rank {cause.rank} raised {error!r}:{cause}"
    return str(error)


def _rank_entry(conn, where, rank: int, world_size: int, port: int, gloo: bool, gloo_timeout: float,
                args: tuple) -> None:
    """Child entry point: join the group, import fn by (directory, module, name), run it, send the outcome."""
    faulthandler.enable()  # a crashing rank (SIGSEGV, SIGABRT) prints its Python stack
    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    _channel.append(conn)
    try:
        if gloo:
            init_gloo(rank, world_size, port, gloo_timeout)
        directory, module, name = where
        if directory not in sys.path:
            sys.path.insert(0, directory)
        fn = getattr(importlib.import_module(module), name)
        outcome = ("ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        outcome = ("raised", (_pickled(exc), traceback.format_exc()))
    try:
        conn.send(outcome)  # before teardown: a peer stuck in a collective must not delay the report
        conn.close()
    finally:
        if outcome[0] == "ok":   # after an error, peers may never join the teardown's collectives
            _destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if outcome[0] == "ok" else 1)   # no interpreter finalization (module docstring)


def _pickled(exc: BaseException) -> bytes | None:
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
        return payload
    except Exception:  # noqa: BLE001 - unpicklable exception: the text goes alone
        return None


def _destroy_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown must not hide the result
        pass


def _locate(fn) -> tuple[str, str, str]:
    """(sys.path entry, module name, function name) that import ``fn`` in a fresh process.
    A script run as __main__ is imported by its file name from its directory."""
    name, module_name = fn.__qualname__, fn.__module__
    if "<" in name or "." in name:
        raise ValueError(f"launch.run needs a module-level function, got {module_name}.{name}")
    module_file = getattr(sys.modules[module_name], "__file__", None)
    if module_file is None:
        raise ValueError(f"cannot locate the module of {module_name}.{name} for the child processes")
    directory = os.path.dirname(os.path.abspath(module_file))
    if module_name == "__main__":
        return directory, os.path.splitext(os.path.basename(module_file))[0], name
    if os.path.basename(module_file) == "__init__.py":
        directory = os.path.dirname(directory)
    for _ in range(module_name.count(".")):   # a package's module: the folder above the top package
        directory = os.path.dirname(directory)
    return directory, module_name, name


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _reraise(rank: int, payload: bytes | None, text: str):
    cause = RemoteTraceback(rank, text)
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

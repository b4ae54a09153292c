"""Targets: loading ``path/to/file.py:function`` or ``module:function``, under a fake process group."""
from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback

from overlapc.cli.parser import UsageError


def load_target(target: str):
    """The function named by ``path/to/file.py:function`` or ``module:function``."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise UsageError(f"target must be path/to/file.py:function or module:function, got {target!r}")
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not os.path.isfile(where):
            raise UsageError(f"no such file: {where}")
        module_name = "overlapc_target_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(where))[0])
        spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module   # dataclasses and pickling look modules up here
        with _import_errors(where):
            spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:   # as `python -m` does; the console script does not
            sys.path.insert(0, os.getcwd())
        try:
            with _import_errors(where):
                module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            if error.name is None or not (where == error.name or where.startswith(error.name + ".")):
                raise
            raise UsageError(f"no module named {error.name}") from None
    function = getattr(module, name, None)
    if not callable(function):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(name, found, n=1)
        raise UsageError(f"{where} has no function {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    return function


@contextlib.contextmanager
def _import_errors(where: str):
    """A SyntaxError or ImportError while importing the target becomes one UsageError
    line with the file:line it happened at (a missing target module itself passes)."""
    try:
        yield
    except SyntaxError as error:
        raise UsageError(f"{where} does not import: {error.filename}:{error.lineno}: "
                         f"SyntaxError: {error.msg}") from None
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and error.name is not None and \
                (where == error.name or where.startswith(error.name + ".")):
            raise   # the target module itself is missing: _load says so
        frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
        at = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
        raise UsageError(f"{where} does not import: {at}{type(error).__name__}: {error}") from None


def build_model(build, target: str) -> tuple:
    """``build()`` of a loaded target, checked: (model, example_inputs), the inputs a tuple
    or list. UsageError, one line, when it needs arguments, raises (the exception and the
    file:line of the target's frame that raised it) or returns anything else."""
    try:
        inspect.signature(build).bind()
    except TypeError as error:
        raise UsageError(f"{target} must take no arguments: {error}") from None
    except ValueError:   # no signature (a builtin): call it and see
        pass
    try:
        built = build()
    except Exception as error:   # the user's code: one line naming it, not a traceback
        frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
        at = f" at {frames[-1].filename}:{frames[-1].lineno}" if len(frames) > 1 else ""
        raise UsageError(f"{target} raised {type(error).__name__}{at}: {error}") from None
    if not (isinstance(built, (tuple, list)) and len(built) == 2 and callable(built[0])):
        raise UsageError(f"{target} must return (model, example_inputs), got {describe(built)}")
    if not isinstance(built[1], (tuple, list)):
        raise UsageError(f"{target}'s example_inputs must be a tuple or list of the model's positional "
                         f"inputs, got {describe(built[1])}")
    return built


def describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """A fake default process group for the duration; an existing one is reused if it matches."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise UsageError(f"a process group of world size {dist.get_world_size()}, rank "
                             f"{dist.get_rank()} already exists in this process")
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def html_for_target(target: str, world_size: int, *, rank: int = 0, options: dict | None = None,
                    profile=None, trace: str | None = None, dump: str | None = None) -> str:
    """The page for ``overlapc report TARGET --world-size N``'s graphs: capture ``target``
    ("path/to/file.py:function" or "module:function", returning ``(model, inputs)``) under a
    fake process group of ``world_size`` ranks, captured as the profile's device dispatches
    (``cuda_capture.dispatch_for``: CUDA-shaped for a GPU profile, the default), schedule with
    ``options`` (OverlapConfig fields) and draw it (``html_for_records``). Errors as the
    CLI's (``UsageError``)."""
    from overlapc.backend import cuda_capture
    from overlapc.config import OverlapConfig
    from overlapc.estimate import costmodel
    from overlapc.explain.html_report import html_for_records

    cfg = OverlapConfig.from_options(options)
    device = cuda_capture.dispatch_for(costmodel.resolve(profile))
    build = load_target(target)
    with fake_process_group(world_size, rank):
        model, inputs = build_model(build, target)
        records, dispatch = cuda_capture.capture_as(device, model, inputs, options)
        notes = [f"target {target}, world size {world_size}, rank {rank}; max_in_flight={cfg.max_in_flight}, "
                 f"max_in_flight_bytes={cfg.max_in_flight_bytes}, bucket={cfg.bucket}, chunks={cfg.chunks}",
                 f"dispatch: {dispatch.describe()}"]
        return html_for_records(records, profile, cfg, trace=trace, dump=dump,
                                title=f"overlapc schedule: {target}", notes=notes)
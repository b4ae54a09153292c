"""A sharded model compiled in pieces (``warn_if_cut``): per-block compiles, graph breaks,
a forward Dynamo skipped. One WARNING per model, naming the pieces and what to do."""
from __future__ import annotations

import logging
import os
import sys
import weakref

import torch
import torch.fx as fx

import overlapc
from overlapc.passes import pipeline

log = logging.getLogger("overlapc")
MODULE_CALLS = ("__call__", "_call_impl", "_wrapped_call_impl")   # frames of an nn.Module call
_cut_warned: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()   # roots warned about once
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OVERLAPC_DIRS = tuple(os.path.dirname(p) + os.sep for p in (overlapc.__file__, pipeline.__file__))
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def warn_if_cut(gm: fx.GraphModule) -> bool:
    """One WARNING (rank 0) per model when Dynamo graph ``gm`` holds only part of a
    sharded model: a module compiled on its own (``model.layers[i] =
    torch.compile(block)``), a module Dynamo compiled alone because it skipped
    the model's forward (a graph break inside a loop over blocks), or a compiled
    function that reads only some of the model's parameters. Overlap stops at
    every graph's edge, so it names where the cut is (file:line), what was
    compiled, and which parameters' all-gathers can no longer be prefetched.
    Returns True when ``gm`` is such a piece. A graph of the whole model (or of
    its forward's pieces around a graph break: ``_Model.graph_break`` says those)
    is not."""
    try:
        params = _graph_parameters(gm)
        if not params:
            return False
        stack_modules = _stack_modules()
        frame_locals, code, reachable = _compiled_frame()
        root = _root_module(params, stack_modules, reachable)
        compiled = _unwrap(frame_locals.get("self"))
        if root is None or compiled is root:
            return False
        ids = {id(p) for p in params}
        sharded = [(n.replace("._orig_mod", ""), id(p)) for n, p in root.named_parameters() if _is_dtensor(p)]
        mine = [n for n, i in sharded if i in ids]
        if len(mine) == len(sharded):
            return False
        sharded = [n for n, _ in sharded]
    except Exception as error:   # noqa: BLE001 - a diagnosis must never break a compile
        log.debug("overlapc: could not tell whether the graph holds the whole model: %s", error)
        return False
    if root not in _cut_warned:
        _cut_warned.add(root)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            log.warning("overlapc: %s", _cut_message(root, mine, sharded, compiled, code, stack_modules))
    return True


def _cut_message(root, mine: list[str], sharded: list[str], compiled, code, stack_modules) -> str:
    part = ", ".join(_cover(mine, sharded)[:6])
    others = _cover([n for n in sharded if n not in set(mine)], sharded)
    model = type(root).__name__
    wrapped = [m for m, optimized in stack_modules if optimized]
    if compiled is not None and wrapped and wrapped[0] is compiled:
        how = f"{part} is compiled on its own (torch.compile on the module, not on {model})"
    elif root in wrapped:
        how = (f"Dynamo runs {model}.forward uncompiled and compiles each module it calls on its own"
               f"{_dynamo_skip_reason()}")
    else:
        how = f"the compiled {'module' if compiled is not None else 'function'} " \
              f"{getattr(code, 'co_name', '?')} reads only {part}'s parameters"
    return (f"graphs of {model} are cut at {_user_line()}: {how}. This graph holds {len(mine)} of the model's "
            f"{len(sharded)} sharded parameters ({part}); overlap stops at its edges: the all-gathers of "
            f"{', '.join(others[:6])}{', ...' if len(others) > 6 else ''} cannot be issued during its compute "
            f"(they start when their own graph, or the eager code around it, starts), and what runs "
            f"uncompiled gathers without prefetch. Compile the whole model (torch.compile(model), no graph "
            f"break inside the loop over blocks: torch._dynamo.explain(model)(*inputs) lists them) to let "
            f"overlapc schedule across blocks")


def _graph_parameters(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The DTensor parameters Dynamo graph ``gm`` takes as inputs (real objects, by identity)."""
    found = []
    for node in gm.graph.find_nodes(op="placeholder"):
        example = getattr(node.meta.get("grapharg"), "example", None)
        if isinstance(example, torch.nn.Parameter) and _is_dtensor(example):
            found.append(example)
    return found


def _is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(value, DTensor)


def _unwrap(module):
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return module._orig_mod
    return module if isinstance(module, torch.nn.Module) else None


def _stack_modules() -> list[tuple[torch.nn.Module, bool]]:
    """(module, called through an OptimizedModule) of every module call on the Python
    stack, innermost first (only module-call frames have their locals read)."""
    found: list[tuple[torch.nn.Module, bool]] = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in MODULE_CALLS:
            module = frame.f_locals.get("self")
            optimized = isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            module = _unwrap(module)
            if module is not None:
                if found and found[-1][0] is module:
                    found[-1] = (module, found[-1][1] or optimized)
                else:
                    found.append((module, optimized))
        frame = frame.f_back
    return found


def _compiled_frame() -> tuple[dict, object, list]:
    """(locals, code, the modules it can reach by name: locals, closure cells, globals)
    of the frame Dynamo is compiling, from its ``_compile`` call on the stack (torch
    2.13 and 2.14 name it and its arguments so); ({}, None, []) when not found."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_compile" and frame.f_code.co_filename.endswith(
                os.path.join("_dynamo", "convert_frame.py")):
            values = frame.f_locals
            frame_locals = dict(values.get("locals") or {})
            cells = [getattr(c, "cell_contents", None) for c in values.get("closure") or ()]
            reachable = [*frame_locals.values(), *cells, *(values.get("globals") or {}).values()]
            modules = [m for m in map(_unwrap, reachable) if m is not None]
            return frame_locals, values.get("code"), modules
        frame = frame.f_back
    return {}, None, []


def _root_module(params: list[torch.Tensor], stack_modules, reachable: list):
    """The outermost module (calling the compiled code, or reachable from the compiled
    frame) whose parameters include all of ``params``; None when there is none."""
    wanted = {id(p) for p in params}
    candidates = [m for m, _ in reversed(stack_modules)] + reachable
    for module in candidates:
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    return None


def _cover(chosen: list[str], everything: list[str], prefix: tuple = ()) -> list[str]:
    """The fewest module paths (or parameter names) whose parameters, among
    ``everything``, are exactly ``chosen``: ["embed", "layers.0"]. In ``everything``'s order."""
    chosen_set = set(chosen)
    groups: dict[str, list[str]] = {}
    for name in everything:
        parts = name.split(".")
        if tuple(parts[:len(prefix)]) == prefix and len(parts) > len(prefix):
            groups.setdefault(parts[len(prefix)], []).append(name)
    paths = []
    for key, names in groups.items():
        mine = [n for n in names if n in chosen_set]
        if len(mine) == len(names):
            paths.append(".".join((*prefix, key)))
        elif mine:
            paths += _cover(mine, names, (*prefix, key))
    return paths


def _user_line() -> str:
    """file:line of the innermost frame on the stack outside torch, overlapc and the
    standard library: the user code that called the compiled piece."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _STDLIB_DIR, *_OVERLAPC_DIRS)) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "an unknown line"


def _dynamo_skip_reason() -> str:
    """Dynamo's latest reason for skipping a frame (its graph-break counters), as
    "; Dynamo: frame skipped: forward (file line N) after: <first reason>", or ""."""
    import re
    reasons = list(torch._dynamo.utils.counters.get("unimplemented", {}))
    for text in reversed(reasons):
        skipped = re.search(r"frame skipped: (\S+) \((.+) line (\d+)\)", text)
        if skipped:
            first = text.strip().splitlines()[0][:160]
            return f" (Dynamo skipped {skipped.group(1)} at {skipped.group(2)}:{skipped.group(3)} after: {first})"
    return ""

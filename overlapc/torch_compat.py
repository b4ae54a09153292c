"""What differs between the torch versions overlapc runs on, in one place.

overlapc is tested on the torch releases in ``TESTED_TORCH``; on any other it
still runs and says once (WARNING on the "overlapc" logger) which releases are
tested. Settings that depend on the version are keyed on what the installed
torch actually has (a config key, an attribute), never on version strings.
"""
from __future__ import annotations

import logging

import torch
import torch._inductor.custom_graph_pass as custom_graph_pass

log = logging.getLogger("overlapc")

# Releases the suite runs on (CI: one clean virtual environment each).
TESTED_TORCH = ("2.13.0", "2.14.1")

# Inductor passes that move collective starts or waits, and the value that
# turns each off. Inductor must keep the order overlapc placed:
# - reorder_for_peak_memory puts each hoisted all-gather back next to its wait;
# - reorder_for_compute_comm_overlap runs Inductor's own comm reordering;
# - aten_distributed_optimizations.enable_simple_overlap (new in 2.14, on by
#   default, CPU and CUDA) swaps starts earlier and waits later, which raised
#   overlapc's 2 all-gathers in flight to 4;
# - aten_distributed_optimizations.enable_overlap_scheduling (off by default)
#   is Inductor's whole overlap scheduler.
_ORDER_MOVING_PASSES = {
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
    "aten_distributed_optimizations.enable_simple_overlap": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
}

_warned = {"version": False}


def inductor_patches() -> dict[str, object]:
    """Inductor config patches (``torch._inductor.config.patch`` keys, dotted
    for nested sections) that turn off every pass of the installed Inductor
    that would move collectives or waits. Keys the installed torch does not
    have are left out, so the dict is valid for ``config.patch`` as it is."""
    from torch._inductor import config
    known = config.get_config_copy()
    return {key: value for key, value in _ORDER_MOVING_PASSES.items() if key in known}


def with_joint_pre_pass(existing, added):
    """Inductor's ``joint_custom_pre_pass`` value that runs the user's
    ``existing`` pass(es), then ``added``. torch >= 2.13 takes a list
    (``get_custom_graph_passes``); older Inductor takes one pass, so two are
    chained in one ``CustomGraphPass``."""
    if hasattr(custom_graph_pass, "get_custom_graph_passes"):
        return [*custom_graph_pass.get_custom_graph_passes(existing), added]
    return added if existing is None else _Chained(existing, added)


class _Chained(custom_graph_pass.CustomGraphPass):
    """Two joint-graph passes run in order, for an Inductor that takes only one."""

    def __init__(self, first, second):
        self.passes = (first, second)

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self):
        ids = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if None in ids else f"overlapc.Chained {ids}"


def is_opaque_input(placeholder) -> bool:
    """Whether a joint graph's placeholder is an opaque object (a DTensor's
    DeviceMesh). torch < 2.13 passes no opaque objects into graphs: False."""
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:
        return False
    return is_opaque_node(placeholder)


def release() -> str:
    """The installed torch's release, without a local build tag ("2.14.1")."""
    return torch.__version__.split("+")[0]


def warn_if_untested() -> None:
    """Say once per process when the installed torch is not one overlapc is tested on."""
    if _warned["version"] or release() in TESTED_TORCH:
        return
    _warned["version"] = True
    log.warning("overlapc: torch %s is not among the tested releases (%s); scheduling runs as usual, "
                "but Inductor passes new in this release may move collectives: report what you see",
                torch.__version__, ", ".join(TESTED_TORCH))

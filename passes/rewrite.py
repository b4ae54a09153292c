"""What the rewriting passes (chunk, bucket) share: fake values and node creation; and
``hoist_attributes``, which the pipeline runs first.

    fake = FakeValues(gm)
    with fake.mode:                # optional: entered once for many new nodes, not per node
        node = new_node(gm.graph, fake, target, args, kwargs, like=old, name="x")

A created node carries ``meta["val"]`` computed by running the op on fake
inputs, and the provenance of ``like`` (module stack, stack trace), so the
memory tracker, the cost model and the report read it like any other node.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from overlapc.passes.bucket_ops import FAKE_IMPLS
from overlapc.passes.collectives import node_value

__all__ = ["FakeValues", "hoist_attributes", "new_node"]

# meta a new node copies from the node it stands for
_PROVENANCE = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "source_fn_stack", "original_aten",
               "seq_nr", "custom")


class FakeValues:
    """``meta["val"]`` for nodes a pass creates: the op run on fake inputs, in the
    graph's own fake mode when it has one (a fresh one otherwise)."""

    def __init__(self, gm: fx.GraphModule):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode
        try:
            self.mode = detect_fake_mode(_one_per_fake_mode(gm))
        except Exception:  # make_fx in real mode: one fake mode per value
            self.mode = None
        self.mode = self.mode or FakeTensorMode()

    def of(self, node: fx.Node):
        from torch._subclasses.fake_tensor import FakeTensor
        val = node_value(node)
        if isinstance(val, FakeTensor) and val.fake_mode is self.mode:
            return val
        if isinstance(val, torch.Tensor):
            with self.mode:
                return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        return val

    def run(self, target, args, kwargs):
        """``target`` run on the fake values of ``args`` and ``kwargs`` in the fake mode (its
        registered fake implementation called directly for overlapc's own operators)."""
        a, k = tree_map(lambda x: self.of(x) if isinstance(x, fx.Node) else x, (args, kwargs))
        with self.mode:
            return FAKE_IMPLS.get(target, target)(*a, **k)


def _one_per_fake_mode(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The graph's tensor values, a plain FakeTensor only when it is the first of its fake
    mode: ``detect_fake_mode`` of these answers (or fails) as of them all, at a fraction
    of the cost (it flattens every value it is given)."""
    from torch._subclasses.fake_tensor import FakeTensor
    seen: set[int] = set()
    vals = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if type(val) is FakeTensor:
            if id(val.fake_mode) in seen:
                continue
            seen.add(id(val.fake_mode))
        if isinstance(val, torch.Tensor):
            vals.append(val)
    return vals


def new_node(graph: fx.Graph, fake: FakeValues, target, args, kwargs=None, *, like: fx.Node | None = None,
             name: str | None = None) -> fx.Node:
    """A call_function node of ``target`` (inserted wherever the graph's insert point
    is: callers place it by key), with its fake value and ``like``'s provenance."""
    kwargs = kwargs or {}
    node = graph.create_node("call_function", target, tuple(args), kwargs, name=name)
    node.meta["val"] = fake.run(target, args, kwargs)
    if like is not None:
        for key in _PROVENANCE:
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def hoist_attributes(graph: fx.Graph) -> list[fx.Node]:
    """Move every ``get_attr`` node (a parameter or buffer read off the module, as
    ``torch.fx.symbolic_trace`` writes them: each just before its first reader) up to
    just after the placeholders, in their order; return the nodes moved. Without
    this a collective of a parameter cannot be issued before the attribute's read,
    which the scheduler does not move. Reading an attribute computes nothing and
    reads no other node, so every order stays valid and the values are the same."""
    anchor = None
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        anchor = node
    moved = []
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        if anchor is None:
            first = next(iter(graph.nodes))
            if first is not node:
                first.prepend(node)
                moved.append(node)
        elif anchor.next is not node:
            anchor.append(node)
            moved.append(node)
        anchor = node
    return moved

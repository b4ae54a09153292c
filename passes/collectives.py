"""Recognise functional collectives in an FX graph and classify every node
(``overlapc.passes.collectives``, public as ``overlapc.collectives``).

A collective is a start node (``_c10d_functional.all_gather_into_tensor`` and
friends) paired with the ``wait_tensor`` nodes that complete it (through
``getitem`` for the coalesced ops that return lists). Around them, nodes are
classified for the passes:

* aliasing ops (views, transposes, getitem, ...) are skipped when looking for
  the *first real consumer* of a collective's result;
* cheap ops (aliasing ops plus dtype casts and copies) may travel with a
  collective start as its input chain;
* barriers (anything that may communicate or have side effects that overlapc
  does not understand) are never crossed by a collective start or wait. A
  write in place or into ``out=`` is a barrier only when what it writes can be
  seen outside it (a graph input or output, a collective's input or result, a
  view of those); into a temporary it is compute, which keeps its order.
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.fx as fx

_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")

# op name -> kind, for ops whose start and wait may move.
_MOVABLE_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
}
# Collectives that are reported but stay exactly where they are: they mutate a
# buffer other nodes may read directly, or their peers are not all ranks.
_FIXED_KINDS = {
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of collective: its short label in tables, the ring algorithm's phases
    (``costmodel.ring_factor``; None: not a ring collective) and the lower-case spellings
    profiler traces give its ops ("c10d::_allgather_base_", "gloo:all_reduce")."""

    short: str
    ring_phases: int | None
    spellings: tuple[str, ...]


# The one table of collective kinds (report order). The op tables above map ops to these
# names; ``costmodel`` reads the ring phases, ``overlapc calibrate`` measures the ring kinds,
# ``overlapc analyze`` reads traces by the spellings, the report prints the short labels.
KINDS = {
    "all_gather": Kind("AG", 1, ("all_gather", "allgather")),
    "reduce_scatter": Kind("RS", 1, ("reduce_scatter",)),
    "all_reduce": Kind("AR", 2, ("all_reduce", "allreduce")),
    "all_to_all": Kind("A2A", 1, ("all_to_all", "alltoall")),
    "broadcast": Kind("BC", None, ("broadcast",)),
}


def op_kind(op: str | None) -> str | None:
    """The kind of a collective op named ``op`` ("all_gather_into_tensor" -> "all_gather",
    as ``collective_op`` names it), None for other names."""
    return _MOVABLE_KINDS.get(op) or _FIXED_KINDS.get(op) if op else None


_ALIAS_PACKETS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze",
    "unsqueeze", "slice", "select", "alias", "detach", "as_strided", "narrow", "flatten",
    "unflatten", "view_as", "expand_as", "_reshape_alias", "split", "split_with_sizes",
    "chunk", "unbind", "numpy_T", "mT", "real", "imag", "view_as_real", "view_as_complex",
}
_CAST_PACKETS = {"_to_copy", "to", "clone", "contiguous", "convert_element_type", "_to_dtype"}
_ALIAS_METHODS = {"view", "reshape", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze",
                  "flatten", "unflatten", "view_as", "expand_as", "narrow", "split", "chunk", "detach"}
_CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type", "contiguous", "clone"}


@dataclasses.dataclass(frozen=True, eq=False)
class Collective:
    """One collective: its start node, the waits that complete it, and what it moves.

    ``first_consumer`` is an index into the graph's node list at the time
    ``collectives()`` was called: the earliest real consumer of any of its
    waits (views and getitem skipped; the output node counts), or None when
    nothing reads the result.
    """

    kind: str
    op: str
    start: fx.Node
    waits: tuple[fx.Node, ...]
    group: str
    group_size: int | None
    nbytes: int | None
    dtype: torch.dtype | None
    first_consumer: int | None
    movable: bool


_PARTS_BY_ID: dict[int, tuple[object, tuple[str, str]]] = {}
_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def _target_parts(target) -> tuple[str, str] | None:
    """(namespace, op name) of a torch op, else None. Cached by identity (torch
    ops live for the process; hashing an OpOverload runs slow Python code)."""
    if not isinstance(target, _OP_TYPES):
        return None
    entry = _PARTS_BY_ID.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1]
    if isinstance(target, torch._ops.OpOverload):
        parts = target.namespace, target._schema.name.split("::")[-1]
    else:
        parts = target._qualified_op_name.split("::")[0], target._qualified_op_name.split("::")[-1]
    _PARTS_BY_ID[id(target)] = (target, parts)
    return parts


def collective_op(node: fx.Node) -> str | None:
    """Name of the functional collective a node starts (e.g. 'all_reduce'), else None."""
    if node.op != "call_function":
        return None
    parts = _target_parts(node.target)
    if parts is None or parts[0] not in _FUNCTIONAL_NAMESPACES:
        return None
    if parts[1] in _MOVABLE_KINDS or parts[1] in _FIXED_KINDS:
        return parts[1]
    return None


def is_wait(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    parts = _target_parts(node.target)
    return parts is not None and parts[1] == "wait_tensor" and parts[0] in _FUNCTIONAL_NAMESPACES


def is_alias(node: fx.Node) -> bool:
    """True for ops whose output aliases their first input (no compute)."""
    if node.op == "call_function":
        return _call_kind(node.target)[0]
    if node.op == "call_method":
        return node.target in _ALIAS_METHODS
    return False


def is_cheap(node: fx.Node) -> bool:
    """Aliasing ops plus dtype casts and copies: may travel with a collective start."""
    if node.op == "call_function":
        return _call_kind(node.target)[1]
    if node.op == "call_method":
        return node.target in _ALIAS_METHODS or node.target in _CAST_METHODS
    return False


_KIND_BY_ID: dict[int, tuple[object, tuple[bool, bool]]] = {}


def _call_kind(target) -> tuple[bool, bool]:
    """(``is_alias``, ``is_cheap``) of a call_function node of ``target``: the target
    decides both; cached by identity (the entry keeps the target alive: ids are not
    reused while it lives)."""
    entry = _KIND_BY_ID.get(id(target))
    if entry is None or entry[0] is not target:
        alias = _alias_target(target)
        parts = _target_parts(target)
        cast = parts is not None and parts[0] in ("aten", "prims") and parts[1] in _CAST_PACKETS
        entry = _KIND_BY_ID[id(target)] = (target, (alias, alias or cast))
    return entry[1]


def _alias_target(target) -> bool:
    """Whether a call_function of ``target`` aliases its first input (uncached)."""
    if target is operator.getitem:
        return True
    parts = _target_parts(target)
    if parts is not None:
        return parts[0] == "aten" and parts[1] in _ALIAS_PACKETS
    return getattr(target, "__name__", None) in _ALIAS_METHODS and \
        getattr(target, "__module__", "") in ("torch", "torch.functional")


_ROLE_BY_ID: dict[int, tuple[object, tuple[str | None, bool, str | None], bool]] = {}


def role(node: fx.Node) -> tuple[str | None, bool, str | None]:
    """(collective op it starts or None, is it a wait, barrier reason or None).

    What the call target decides is one cached lookup per target: the passes ask
    this of every node. Only an op that writes in place or into ``out=`` adds a
    look at this node's neighbourhood (``_visible_write``): it is a barrier when
    what it writes can be seen outside it, and compute otherwise."""
    if node.op != "call_function":
        return None, False, _non_call_barrier_reason(node)
    entry = _ROLE_BY_ID.get(id(node.target))
    if entry is None or entry[0] is not node.target:  # the entry keeps the target alive
        reason, per_node = _call_barrier_reason(node.target)
        entry = _ROLE_BY_ID[id(node.target)] = (
            node.target, (collective_op(node), is_wait(node), reason), per_node)
    if not entry[2]:
        return entry[1]
    where = _visible_write(node)
    return entry[1][0], entry[1][1], None if where is None else f"{entry[1][2]} writes into {where}"


def barrier_reason(node: fx.Node) -> str | None:
    """Why nothing may move across this node, or None when it is an ordinary node."""
    return role(node)[2]


def barrier_reason_when_compute_moves(node: fx.Node) -> str | None:
    """``barrier_reason`` for a pass that reorders compute too (the chunk pass):
    every in-place or out= write is then a barrier, since a write into a
    temporary is compute only while compute keeps its order."""
    reason = role(node)[2]
    if reason is None and node.op == "call_function" and _ROLE_BY_ID[id(node.target)][2]:
        return f"{_ROLE_BY_ID[id(node.target)][1][2]} (writes in place)"
    return reason


def _non_call_barrier_reason(node: fx.Node) -> str | None:
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.endswith("__"):
            return f"in-place method {name}"
        return None
    if node.op == "call_module":
        return "impure module" if node.is_impure(impure_random=False) else None
    return None


# Mutating ops that change what a tensor is (its storage or geometry), not only
# its values: what they write cannot be followed through the graph.
_RESTRUCTURING_OPS = {"set_", "resize_", "resize_as_", "_resize_output_", "as_strided_", "swap_"}


def _call_barrier_reason(target) -> tuple[str | None, bool]:
    """(barrier reason or None, whether the reason holds only when what the node
    writes is visible: an aten / prims op writing in place or into ``out=``)."""
    from torch._library.utils import is_impure
    if target is operator.getitem:
        return None, False
    parts = _target_parts(target)
    if parts is not None:
        namespace, opname = parts
        if namespace in _FUNCTIONAL_NAMESPACES:
            if opname in _MOVABLE_KINDS or opname == "wait_tensor":
                return None, False
            if opname in _FIXED_KINDS:
                return f"collective {opname} is kept in place", False
            return f"communication op {namespace}.{opname}", False
        if namespace == "c10d":
            return f"communication op {namespace}.{opname}", False
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable:
            per_node = (namespace in ("aten", "prims") and isinstance(target, torch._ops.OpOverload)
                        and opname not in _RESTRUCTURING_OPS)
            return f"mutating op {namespace}.{opname}", per_node
        if namespace == "overlapc":
            return None, False   # the bucket pass's pure copies (passes/bucket_ops.py)
        if namespace not in ("aten", "prims"):
            return f"custom op {namespace}.{opname}", False
        return ("side-effectful op" if is_impure(target, impure_random=False) else None), False
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher-order op {target.name()}", False
    return ("side-effectful call" if is_impure(target, impure_random=False) else None), False


# -- in-place writes: visible or not -------------------------------------------
_ALIAS_ARGS_BY_ID: dict[int, tuple[object, tuple | None]] = {}
_ALIAS_FAMILY_LIMIT = 256   # nodes followed before a write counts as visible


def _alias_args(target) -> tuple[tuple[tuple[int, str | None], ...], tuple[tuple[int, str | None], ...]] | None:
    """((index, name) of the arguments the op's result may alias, of those it
    writes), from the schema's alias annotations (``Tensor(a)``, ``Tensor(a!)``);
    None when the target has no schema, so its aliasing is unknown."""
    entry = _ALIAS_ARGS_BY_ID.get(id(target))
    if entry is None or entry[0] is not target:
        if target is operator.getitem:
            found = (((0, None),), ())
        elif isinstance(target, torch._ops.OpOverload):
            arguments = list(enumerate(target._schema.arguments))
            found = (tuple((i, a.name) for i, a in arguments if a.alias_info is not None),
                     tuple((i, a.name) for i, a in arguments if a.alias_info is not None and a.alias_info.is_write))
        else:
            found = None
        entry = _ALIAS_ARGS_BY_ID[id(target)] = (target, found)
    return entry[1]


def _arg_values(node: fx.Node, positions) -> list:
    """The values ``node`` passes at ``positions`` (lists flattened, absent ones left out)."""
    values = []
    for index, name in positions:
        if name is not None and name in node.kwargs:
            value = node.kwargs[name]
        elif index < len(node.args):
            value = node.args[index]
        else:
            continue
        values.extend(value if isinstance(value, (list, tuple)) else [value])
    return [v for v in values if v is not None]


def _visible_write(node: fx.Node) -> str | None:
    """What makes the tensor ``node`` writes in place visible outside it, or None.

    The written tensor's alias family is followed through the graph: arguments
    its members alias (views, in-place results, getitem) and users that alias or
    write a member. The write is visible, and ``node`` a barrier, when a member
    is a graph input or attribute, a graph output, a collective's input or
    result, or is read by a node that may move with a collective (a cast or copy
    that can join a start's input chain, a copy of a collective's result), or
    when the family cannot be followed (an op without a schema, too many
    members). Otherwise only compute that keeps its order reads the memory."""
    members: dict[fx.Node, None] = {}
    todo: list[fx.Node] = []
    for value in _arg_values(node, _alias_args(node.target)[1]):
        if not isinstance(value, fx.Node):
            return f"a value that is not a graph node ({type(value).__name__})"
        members.setdefault(value)
        todo.append(value)
    while todo:
        member = todo.pop()
        why = _outside(member)
        if why is not None:
            return why
        for value in _arg_values(member, _alias_args(member.target)[0]):
            if isinstance(value, fx.Node) and value not in members:
                members[value] = None
                todo.append(value)
        for user in member.users:
            if user in members:
                continue
            if user.op == "output":
                return f"graph output {member.name}"
            if collective_op(user) is not None or is_wait(user):
                return f"{member.name}, which collective {user.name} reads"
            if user.op != "call_function":
                return f"{member.name}, read by {user.name} ({user.op} {user.target}), whose aliasing is not known"
            aliases = _alias_args(user.target)
            if aliases is None:
                return f"{user.name} ({user.target}), whose aliasing is not known"
            if any(v is member for v in _arg_values(user, aliases[0])):
                members[user] = None
                todo.append(user)
            elif is_cheap(user) or user.meta.get("overlapc_input_chain"):
                return f"{member.name}, read by {user.name}, which may move with a collective"
        if len(members) > _ALIAS_FAMILY_LIMIT:
            return f"more than {_ALIAS_FAMILY_LIMIT} aliases of {node.name}"
    return None


def _outside(member: fx.Node) -> str | None:
    """Why a member of a written alias family is visible by itself, or None."""
    if member.op in ("placeholder", "get_attr"):
        return f"graph input {member.name}"
    if member.op != "call_function" or _alias_args(member.target) is None:
        return f"{member.name} ({member.op} {member.target}), whose aliasing is not known"
    if collective_op(member) is not None or is_wait(member):
        return f"{member.name}, a collective's result"
    if is_cheap(member) and _copies_a_collective(member):
        return f"{member.name}, a copy of a collective's result"
    return None


def _copies_a_collective(node: fx.Node, limit: int = 16) -> bool:
    """Whether ``node`` reads a collective's result through cheap nodes alone (it
    may then join a chain that moves with that collective)."""
    frontier, seen = list(node._input_nodes), set()
    while frontier and len(seen) < limit:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        if collective_op(current) is not None or is_wait(current):
            return True
        if is_cheap(current):
            frontier.extend(current._input_nodes)
    return bool(frontier)


_ARG_INDEX: dict[tuple[int, str], tuple[object, int | None, object]] = {}


def _schema_arg(node: fx.Node, name: str):
    """The argument ``name`` of an OpOverload call, from its schema (index cached per op)."""
    if name in node.kwargs:
        return node.kwargs[name]
    target = node.target
    entry = _ARG_INDEX.get((id(target), name))
    if entry is None or entry[0] is not target:
        index, default = None, None
        if isinstance(target, torch._ops.OpOverload):
            for i, argument in enumerate(target._schema.arguments):
                if argument.name == name:
                    index, default = i, argument.default_value
        entry = _ARG_INDEX[(id(target), name)] = (target, index, default)
    _, index, default = entry
    if index is None:
        return None
    return node.args[index] if index < len(node.args) else default


def group_of(node: fx.Node) -> str:
    """Process group name a collective runs on (as a string)."""
    group = _schema_arg(node, "group_name")
    return str(group)


def size_hint(size, unbacked: bool = False) -> int | None:
    """A concrete int for an int or SymInt size, never adding a guard: a SymInt
    gives its optimisation hint (the size it had when traced). Sizes overlapc
    compares, sums or budgets go through here, so a dynamic dim stays dynamic;
    a decision made on the hint must be valid for every size (or not taken).

    A data-dependent (unbacked) size has no hint: None, unless ``unbacked`` asks
    for torch's heuristic guess (estimates only). Also None for anything that
    is not a size. ``int(symint)``, ``symint == n`` or ``symint % k`` would
    guard instead: a graph compiled for one size, recompiled for the next."""
    if type(size) is int:
        return size
    if not isinstance(size, torch.SymInt):
        return int(size) if isinstance(size, int) else None
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, optimization_hint
    try:
        if not unbacked and free_unbacked_symbols(size):
            return None
        return int(optimization_hint(size))
    except Exception:  # noqa: BLE001 - no hint torch can give without a guard: unknown
        return None


def tensor_nbytes(value) -> int | None:
    """Bytes of a (fake) tensor or a list of them, from shapes (size hints for
    symbolic sizes: no guard is added). In a list or tuple, entries that are no
    tensor (None, ints: an efficient-attention backward returns grad q, k, v and
    a None) hold 0 bytes; None when a tensor's size is unknown (data-dependent)
    or ``value`` is no tensor and no list."""
    if isinstance(value, (list, tuple)):
        parts = [tensor_nbytes(v) for v in value if isinstance(v, (torch.Tensor, list, tuple))]
        return None if any(p is None for p in parts) else sum(parts)
    if not isinstance(value, torch.Tensor):
        return None
    numel = size_hint(value.numel())
    return None if numel is None else numel * value.element_size()


def node_value(node: fx.Node):
    """The example value recorded on a node by make_fx / AOTAutograd / ShapeProp."""
    if "val" in node.meta:
        return node.meta["val"]
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    return None


def wait_nodes(start: fx.Node) -> tuple[fx.Node, ...]:
    """The wait_tensor nodes completing ``start`` (directly, or through getitem)."""
    waits = []
    for user in start.users:
        if is_wait(user):
            waits.append(user)
        elif user.op == "call_function" and user.target is operator.getitem:
            waits.extend(u for u in user.users if is_wait(u))
    return tuple(waits)


def alias_closure(wait: fx.Node, within=None) -> list[fx.Node]:
    """Aliasing nodes that read the wait's result only through other aliases.

    A node belongs when it is an aliasing op whose first input is the wait or a
    member and whose other node inputs are placeholders or attributes: such
    nodes can travel with the wait. ``within(node)``, when given, must also
    hold for every member.
    """
    members: list[fx.Node] = []
    inside = {wait}
    frontier = [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in inside or not is_alias(user) or (within is not None and not within(user)):
                continue
            inputs = list(user._input_nodes)
            if not inputs or inputs[0] not in inside:
                continue
            if any(i not in inside and i.op not in ("placeholder", "get_attr") for i in inputs[1:]):
                continue
            inside.add(user)
            members.append(user)
            frontier.append(user)
    return members


def real_consumers(wait: fx.Node, closure: list[fx.Node]) -> list[fx.Node]:
    """Users of the wait or its alias closure that are not themselves in the closure."""
    if not closure:   # the common case: the wait's users
        return list(wait.users)
    inside = {wait, *closure}
    return list(dict.fromkeys(user for node in (wait, *closure) for user in node.users if user not in inside))


def _dtype_of(value) -> torch.dtype | None:
    if isinstance(value, (list, tuple)):
        return _dtype_of(value[0]) if value else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def collectives(gm: fx.GraphModule) -> list[Collective]:
    """Every functional collective in ``gm``, in graph order."""
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"overlapc.collectives expects a torch.fx.GraphModule, got {type(gm).__name__}")
    nodes = list(gm.graph.nodes)
    return scan(nodes, {node: index for index, node in enumerate(nodes)})


def scan(nodes: list[fx.Node], position: dict[fx.Node, int], first_consumers: bool = True) -> list[Collective]:
    """collectives() over a node list; ``first_consumers=False`` leaves
    ``first_consumer`` None (callers that find consumers themselves)."""
    rows = []
    for node in nodes:
        name = collective_op(node)
        if name is None:
            continue
        waits = wait_nodes(node)
        consumers = []
        if first_consumers:
            for wait in waits:
                consumers.extend(position[c] for c in real_consumers(wait, alias_closure(wait)))
        value = node_value(node)
        group_size = _schema_arg(node, "group_size")
        rows.append(Collective(
            kind=_MOVABLE_KINDS.get(name) or _FIXED_KINDS[name],
            op=name,
            start=node,
            waits=waits,
            group=group_of(node),
            group_size=group_size if isinstance(group_size, int) else None,
            nbytes=tensor_nbytes(value),
            dtype=_dtype_of(value),
            first_consumer=min(consumers) if consumers else None,
            movable=name in _MOVABLE_KINDS,
        ))
    return rows


def module_path(node: fx.Node) -> str:
    """The user's module behind ``node`` ("blocks.1.attn.wq"), or the parameter's
    qualified name when no module is left, or "" (rules: ``overlapc/report.py``'s
    docstring, "Module"; the bucket pass groups collectives by it too).
    Paths are relative to the compiled module (Dynamo's ``L['self']`` is dropped).
    The module comes from Dynamo's / make_fx's ``nn_module_stack`` (``fwd_nn_module_stack``
    in backward graphs) or, where a tracer records no stack (torchtitan's
    graph_trainer), from ``meta["custom"]["module_fqn"]``."""
    stack = _module_stack(node) or _nearest_stack(node)
    if not stack:
        return ""
    kept: list[str] = []
    parameter = ""
    for value in stack.values():
        path, kind = (value[0], value[1]) if isinstance(value, (tuple, list)) else (value, None)
        path = _DYNAMO_ROOT.sub("", str(path))
        named = _parametrized(path)
        if named is not None:
            parameter = named
            continue
        if not _PLAIN.match(path) or _is_parametrization(kind):
            continue
        path = ".".join(part for part in path.split(".") if part not in _WRAPPER_SEGMENTS)
        if kept and kept[-1] and path != kept[-1] and not path.startswith(kept[-1] + "."):
            continue   # a module shared between owners: named after its first user, not this one
        kept.append(path)
    module = next((p for p in reversed(kept) if p), "")
    return module or parameter


SOURCE_KEY = "overlapc_source"   # placeholder meta: the Dynamo source it stands for ("blocks.0.norm1.weight")
_ATTRIBUTE = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")


def name_inputs(gm: fx.GraphModule, input_names: list[str]) -> None:
    """Record on each placeholder of an AOTAutograd graph ``gm`` the Dynamo graph input it
    stands for (``meta[SOURCE_KEY]``: ``input_source``). Placeholders without an input
    descriptor (a backward's saved tensors) are left alone."""
    for node in gm.graph.find_nodes(op="placeholder"):
        name = input_source(node, input_names)
        if name:
            node.meta[SOURCE_KEY] = name


def input_source(placeholder: fx.Node, input_names: list[str]) -> str:
    """The Dynamo graph input an AOTAutograd placeholder stands for, by its source relative
    to the compiled module ("blocks.0.norm1.weight"), or "": read from the placeholder's AOT
    descriptor (``meta["desc"]``: a plain input, or a subclass's inner tensor of one) and
    ``input_names`` (the Dynamo graph's inputs by source, ``L['self']._modules['blocks']...``)."""
    index = getattr(input_descriptor(placeholder), "idx", None)
    if not isinstance(index, int) or not 0 <= index < len(input_names):
        return ""
    return _DYNAMO_ROOT.sub("", _ATTRIBUTE.sub(r".\1", input_names[index]))   # L['self']._modules['0'] -> 0


def input_descriptor(placeholder: fx.Node):
    """The AOT descriptor of the input behind ``placeholder`` (a subclass's inner tensor
    walked back to its base), or None."""
    desc = placeholder.meta.get("desc")
    while desc is not None and not hasattr(desc, "idx") and hasattr(desc, "base"):
        desc = desc.base
    return desc


def moved_input(start: fx.Node) -> fx.Node | None:
    """The node a collective moves, through the casts and views feeding its start."""
    node = start.args[0] if start.args else None
    while isinstance(node, fx.Node) and node.op == "call_function" and is_cheap(node) and node.args:
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def source_of(start: fx.Node) -> str:
    """The graph input a collective moves, by the name ``name_inputs`` recorded, else ""."""
    node = moved_input(start)
    return node.meta.get(SOURCE_KEY, "") if node is not None and node.op == "placeholder" else ""


_DYNAMO_ROOT = re.compile(r"^[LG]\['[^']*'\]\.?")   # L['self'], L['fn'], G['model'] ...
_PLAIN = re.compile(r"^(\w+(\.\w+)*)?$")
_WRAPPER_SEGMENTS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
# torchtitan SimpleFSDP: dict(type(<module>).__dict__)['weight'].fget.__closure__[0].cell_contents
_PROPERTY = re.compile(r"^dict\(type\((?P<module>[^()]*)\)\.__dict__\)\['(?P<name>\w+)'\]")
# torch.nn.utils.parametrize: <module>.parametrizations.weight(.0 | [0])
_PARAMETRIZE = re.compile(r"^(?:(?P<module>.*)\.)?parametrizations\.(?P<name>\w+)(?:\.\d+|\[\d+\])?$")


def _parametrized(path: str) -> str | None:
    """"module.name" when ``path`` is a parametrization of parameter ``name`` of ``module``, else None."""
    match = _PROPERTY.match(path) or _PARAMETRIZE.match(path)
    if match is None:
        return None
    module = _DYNAMO_ROOT.sub("", match.group("module") or "")
    module = ".".join(part for part in module.split(".") if part and part not in _WRAPPER_SEGMENTS)
    return f"{module}.{match.group('name')}" if module else match.group("name")


def _is_parametrization(kind) -> bool:
    try:
        from torch.nn.utils.parametrize import ParametrizationList
        return isinstance(kind, type) and issubclass(kind, ParametrizationList)
    except ImportError:   # pragma: no cover - torch without parametrize
        return False


def _module_stack(node: fx.Node) -> dict | None:
    """The node's module stack, or a one-entry stack made of the module path a
    tracer recorded in ``meta["custom"]["module_fqn"]`` (graph_trainer's convention)."""
    stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack")
    if stack:
        return stack
    custom = node.meta.get("custom")
    fqn = custom.get("module_fqn") if isinstance(custom, dict) else None
    return {"module_fqn": (fqn, None)} if isinstance(fqn, str) and fqn else None


def _nearest_stack(node: fx.Node, limit: int = 64) -> dict | None:
    """The module stack of the nearest node ``node`` reads (breadth first, at most ``limit``
    nodes): a backward collective reduces a gradient computed by its module's nodes."""
    seen, queue = {node}, list(node.all_input_nodes)
    while queue and len(seen) <= limit:
        current = queue.pop(0)
        if current in seen:
            continue
        seen.add(current)
        stack = _module_stack(current)
        if stack:
            return stack
        queue.extend(current.all_input_nodes)
    return None

"""PyTorch's own reordering and bucketing tests, re-created as overlapc conformance cases.

Each ``Case`` is one upstream test (pytorch/pytorch, test/distributed/<file>::<test>):
its graph written here as a function over functional collectives (shapes scaled
down), the input shapes and dtypes, and ``expect``, a check over the schedule
that states what upstream's asserts check (FileCheck order, counts). No code is
copied from upstream; the graphs follow its tests' descriptions.

Graph functions read the process group at trace time (``group()``, ``world()``),
so the same case traces under the fake process group (world 8) and on real gloo
ranks (world 2). ``Schedule`` is what a check sees: the call_function nodes of
the graph before and after scheduling, as (name, op label) pairs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

F = torch.ops._c10d_functional

# Upstream files, short names used in the table.
ATEN = "test_aten_comm_compute_reordering.py"
COMPUTE = "test_compute_comm_reordering.py"
COLLECTIVES = "test_inductor_collectives.py"
SIMPLE = "test_simple_overlap.py"
UNIT = "test_overlap_bucketing_unit.py"

STARTS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor", "all_reduce",
          "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")
WAIT = "wait_tensor"
# Nodes that may move with a collective's start under overlapc's rules (DESIGN, guarantee 4):
# views and casts on its input chain.
MOVABLE = ("view", "_unsafe_view", "slice", "t", "transpose", "permute", "expand", "reshape", "alias",
           "getitem", "split", "split_with_sizes", "unsqueeze", "squeeze", "_to_copy", "convert_element_type",
           "flatten", "narrow", "select", "as_strided")


def group() -> str:
    """The default process group's name (at trace time)."""
    return dist.group.WORLD.group_name


def world() -> int:
    return dist.get_world_size()


_second: list = []


def second_group() -> str:
    """A second group over all ranks, made once per process (every rank makes it in the
    same order: the cases trace in one order)."""
    if not _second:
        _second.append(dist.new_group(list(range(world()))))
    return _second[0].group_name


_own: list = []


def own_group() -> str:
    """A group of this rank alone (upstream's single-process tests run at group size 1), made
    once per process: every rank makes every rank's, in the same order (``new_subgroups``)."""
    if not _own:
        _own.append(dist.new_subgroups(group_size=1)[0])
    return _own[0].group_name


def ag(x, name=None, size=None):
    return F.all_gather_into_tensor(x, size or world(), name or group())


def rs(x, name=None, size=None):
    return F.reduce_scatter_tensor(x, "sum", size or world(), name or group())


def ar(x, name=None):
    return F.all_reduce(x, "sum", name or group())


def wait(x):
    return F.wait_tensor(x)


def label(node: fx.Node) -> str:
    """The op's name without namespace and overload: "mm", "all_reduce", "wait_tensor"."""
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The call_function nodes of one graph before and after scheduling, in order."""

    before: tuple[tuple[str, str], ...]
    after: tuple[tuple[str, str], ...]
    sources: tuple[tuple[str, tuple[str, ...]], ...]   # per start, after: (label, placeholders it reads)
    placeholders: tuple[str, ...]
    provenance: tuple[tuple, ...] = ()   # per start and wait, after: (label, nn_module_stack, custom meta)

    @classmethod
    def of(cls, before: fx.GraphModule, after: fx.GraphModule) -> "Schedule":
        names = tuple(n.name for n in after.graph.find_nodes(op="placeholder"))
        return cls(_ops(before), _ops(after), _start_sources(after), names, _provenance(after))

    def unchanged(self) -> bool:
        return self.before == self.after

    def count(self, op: str) -> int:
        return sum(1 for _, lab in self.after if lab == op)

    def starts(self) -> int:
        return sum(1 for _, lab in self.after if lab in STARTS)

    def in_order(self, *patterns: str) -> bool:
        """FileCheck's check chain: each pattern found after the previous match. A pattern
        is an op label ("mm"), "start" (any collective start) or "%name" (a node name)."""
        at = 0
        for pattern in patterns:
            at = self._find(pattern, at)
            if at is None:
                return False
            at += 1
        return True

    def index(self, pattern: str) -> int:
        found = self._find(pattern, 0)
        if found is None:
            raise KeyError(pattern)
        return found

    def issue_order(self, op_prefix: str) -> list[str]:
        """Placeholders read by starts whose label begins with ``op_prefix``, start by start."""
        return [p for lab, sources in self.sources if lab.startswith(op_prefix) for p in sources]

    def compute_order_kept(self) -> bool:
        """Compute nodes present before and after (not collectives, waits, views or casts)
        keep their relative order: overlapc's guarantee 5, checked independently of verify."""
        def compute(ops):
            return [name for name, lab in ops if lab not in STARTS and lab != WAIT and lab not in MOVABLE]
        before, after = compute(self.before), compute(self.after)
        both = set(before) & set(after)
        return [n for n in before if n in both] == [n for n in after if n in both]

    def _find(self, pattern: str, at: int) -> int | None:
        for i in range(at, len(self.after)):
            name, lab = self.after[i]
            if (pattern[0] == "%" and name == pattern[1:]) or lab == pattern or (pattern == "start" and lab in STARTS):
                return i
        return None


def _provenance(gm: fx.GraphModule) -> tuple[tuple, ...]:
    """(label, its ``nn_module_stack`` meta, its ``custom`` meta) of each start and wait."""
    return tuple((label(n), n.meta.get("nn_module_stack"), n.meta.get("custom"))
                 for n in gm.graph.nodes if n.op == "call_function" and (label(n) in STARTS or label(n) == WAIT))


def _ops(gm: fx.GraphModule) -> tuple[tuple[str, str], ...]:
    return tuple((n.name, label(n)) for n in gm.graph.nodes if n.op == "call_function")


def _start_sources(gm: fx.GraphModule) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """For each collective start, in order: the placeholders it reads, in the order
    their paths reach it (a bucket reads its members' inputs in its pack order)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and label(node) in STARTS:
            out.append((label(node), tuple(_placeholders(node))))
    return tuple(out)


def _placeholders(node: fx.Node) -> list[str]:
    found, stack, seen = [], list(reversed(node.all_input_nodes)), set()
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "placeholder":
            found.append(n.name)
        elif label(n) not in STARTS:   # stop at an upstream collective
            stack.extend(reversed(n.all_input_nodes))
    return found


@dataclasses.dataclass(frozen=True)
class Case:
    """One upstream test: ``fn`` over inputs of ``shapes`` (dtype per input, float32
    by default); ``expect(schedule) -> bool`` is upstream's expectation, ``says`` it in words."""

    name: str
    upstream: str          # "<file>::<test>"
    says: str
    fn: Callable
    shapes: tuple
    expect: Callable[[Schedule], bool]
    dtypes: tuple = ()
    setup: str | None = None   # key of UPSTREAM_SETUPS mirroring upstream's test; None: no equivalent
    annotate: Callable[[fx.GraphModule], None] | None = None   # tags nodes after tracing, as upstream's harness

    def inputs(self, seed: int = 0) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        dtypes = self.dtypes or (torch.float32,) * len(self.shapes)
        return [torch.randn(*s, generator=g).to(d) for s, d in zip(self.shapes, dtypes)]


# ---------------------------------------------------------------- graphs


def sink_waits(a):
    reduced = wait(ar(a))
    b = a @ a
    return reduced @ b


def raise_comms(a):
    b = a @ a
    c = torch.relu(b)
    d = c @ c
    e = wait(ar(b + 1))
    return d @ e


def raise_comms_of_matmul(a):
    b = a @ a
    c = torch.relu(b)
    d = c @ c
    e = wait(ar(b))
    return d @ e


def sink_waits_raise_comms(a):
    b = a @ a
    c = torch.relu(b)
    d = c @ c
    e = wait(ar(b))
    f = torch.relu(d)
    g = f @ f
    return e @ g


def reorder_compute_for_overlap(a):
    r = wait(ar(a))
    g = a @ a
    c = torch.relu(a)
    d = c @ c
    f = d * c * r
    fr = wait(ar(f))
    return ((d + r + fr) @ g,)


def grouped_scheduler_node(a):
    div = (a + a) / a
    r = wait(ar(div))
    mul = a * a
    return (mul @ r,)


def default_comms_ordering(g1, g2, g3):
    h1, h2, h3 = ar(g1), ar(g2), ar(g3)
    return wait(h3), wait(h2), wait(h1)


def three_gathers_used(a, b, c):
    return (wait(ag(a)) + 3) + (wait(ag(b)) + 4) + (wait(ag(c)) + 5)


def three_reduce_scatters(a, b, c):
    return torch.cat([wait(rs(a)), wait(rs(b)), wait(rs(c))])


def dependent_hiding_nodes(a, b):
    g1 = wait(ag(a))
    mm1 = a @ a
    mm2 = g1[:4] @ b
    g2 = wait(ag(b))
    return g1.sum() * g2.sum() * mm1 * mm2


def depends_on_hiding_node(a):
    g1 = wait(ag(a))
    mm1 = a @ a
    g2 = wait(ag(mm1 * 2))
    return g1.sum() * g2.sum() * mm1


def four_gathers_two_mms(a, b, c, d):
    g1, g2, g3, g4 = wait(ag(a)), wait(ag(b)), wait(ag(c[:4])), wait(ag(d[:4]))
    e = a * 5
    mm1 = e @ e.T
    f = b * 6
    mm2 = f @ f.T
    return g1.sum() * 1.1 + g2.sum() * 1.2 + g3.sum() * 1.3 + g4.sum() * 1.4 + mm1.sum() + mm2.sum()


def four_gathers_blocking(a, b, c, d):
    g1, g2, g3, g4 = wait(ag(a)), wait(ag(b)), wait(ag(c[:4])), wait(ag(d[:4]))
    e = a * 5
    mm1 = e @ e.T
    between = g1[:8, :8] + g2[:8, :8]
    mm2 = (mm1 + between) @ c[:8]
    return g1.sum() * 1.1 + g2.sum() * 1.2 + g3.sum() * 1.3 + g4.sum() * 1.4 + mm1.sum() + mm2.sum()


def four_gathers_split(a, b, c, d):
    g1, g2, g3, g4 = wait(ag(a)), wait(ag(b)), wait(ag(c[:4])), wait(ag(d[:4]))
    e = a * 5
    mm1 = e @ e.T
    between = torch.nn.functional.pad(g1[:2, :2] + g2[:2, :2], (0, 6, 0, 6))
    f = b * 6
    mm2 = (mm1 + between) @ f.T
    return g1.sum() * 1.1 + g2.sum() * 1.2 + g3.sum() * 1.3 + g4.sum() * 1.4 + mm1.sum() + mm2.sum()


def exposed_with_hidden(a, b, c):
    g1, g2, g3 = wait(ag(a)), wait(ag(b)), wait(ag(c))
    mm1 = a[:2] @ a[:2].T
    return g1.sum() + g2.sum() + g3.sum() + mm1.sum()


def three_gathers_summed(a, b, c):
    return wait(ag(a)).sum() + wait(ag(b)).float().sum() + wait(ag(c)).float().sum()


def three_all_reduces(a, b, c):
    return wait(ar(a)).sum() + wait(ar(b)).sum() + wait(ar(c)).sum()


def gather_after_compute(a, b):
    mm = a @ b
    return mm + wait(ag(a)).reshape(4, -1)[:, :4]


def gather_then_compute(a, b):
    g = wait(ag(a))
    mm = a @ b
    return mm + g.reshape(4, -1)[:, :4]


def two_gathers_one_group(a, b):
    mm1 = a @ b
    h1 = ag(a)
    mm2 = b @ a
    h2 = ag(b)
    return (wait(h1) + wait(h2)).reshape(4, -1)[:, :4] + mm1 + mm2


def already_optimal(a, b):
    h = ag(a)
    mm = a @ b
    return mm + wait(h).reshape(4, -1)[:, :4]


def no_collectives(a, b):
    return a @ b + a


def gather_of_compute(a, b):
    return wait(ag(a @ b))


def two_started_two_mms(a, b):
    h1, h2 = ag(a), ag(b)
    mm1, mm2 = a @ a, b @ b
    return wait(h1).sum() + wait(h2).sum() + mm1.sum() + mm2.sum()


def nested_hiding(a, b):
    h1, h2 = ag(a), ag(b)
    mm2 = b[:2, :2] @ b[:2, :2]
    g2 = wait(h2)
    mm1 = (a + g2[:4, :4]) @ a
    g1 = wait(h1)
    return g1.sum() + g2.sum() + mm1.sum() + mm2.sum()


def gather_rs_gather(a, b, c):
    h1 = ag(a)
    mm1 = a @ a
    g1 = wait(h1)
    h = rs(b)
    mm2 = b[:4, :4] @ b[:4, :4]
    r = wait(h)
    h2 = ag(c)
    mm3 = c @ c
    g2 = wait(h2)
    return g1.sum() + r.sum() + g2.sum(), mm1, mm2, mm3


def two_all_reduces_two_mms(a, b):
    h1, h2 = ar(a), ar(b)
    mm1, mm2 = a @ a, b @ b
    return wait(h1).sum() + wait(h2).sum() + mm1.sum() + mm2.sum()


def chained_all_reduces(a, b, c, d):
    s0, s1 = wait(ar(a)), wait(ar(b))
    r0, r1 = wait(ar(s0 + c)), wait(ar(s1 + d))
    return r0.sum() + r1.sum()


def all_reduces_and_reduce_scatters(a, b):
    h1, h2, h3, h4 = ar(a), ar(b), rs(a), rs(b)
    return wait(h1).sum() + wait(h2).sum() + wait(h3).sum() + wait(h4).sum()


def two_reduce_scatters(a, b):
    h1, h2 = rs(a), rs(b)
    return wait(h1).sum() + wait(h2).sum()


def two_gathers(a, b):
    h1, h2 = ag(a), ag(b)
    return wait(h1).sum() + wait(h2).sum()


def one_reduce_scatter(a):
    return wait(rs(a)).sum()


def two_dtypes_two_mms(a, b):
    h1, h2 = ag(a), ag(b)
    mm1 = a @ a
    mm2 = b.float() @ b.float()
    return wait(h1).sum() + wait(h2).float().sum() + mm1.sum() + mm2.sum()


def shared_hiding_node(a, b):
    h1, h2 = ag(a), ag(b)
    mm1, mm2, mm3 = a @ a, b @ b, (a + b) @ (a + b)
    return wait(h1).sum() + wait(h2).sum() + mm1.sum() + mm2.sum() + mm3.sum()


def convert_as_hiding_node(a, b, c):
    h1 = ag(a)
    b16 = b.to(torch.float16)
    g1 = wait(h1)
    h2, h3 = ag(b16), ag(c)
    mm = g1 @ g1.T
    return g1, wait(h2), wait(h3), mm


def gather_under_pointwise(a, b):
    h = ag(a)
    p = a @ b + 1.0
    return (p.sum() + wait(h).sum(),)


def cross_group_prefetch(a, b):
    g1 = wait(ag(a))
    mm1 = g1[:4, :4] @ g1[:4, :4]
    g2 = wait(ag(b, second_group()))
    mm2 = g2[:4, :4] @ g2[:4, :4]
    return mm1 + mm2


def waits_then_chain_a_first(a, b):
    ha, hb = ag(a), ag(b)
    wa = wait(ha)
    wb = wait(hb)
    return wa.sum() + wait(ag(wb, second_group())).sum()


def waits_then_chain_b_first(a, b):
    ha, hb = ag(a), ag(b)
    wb = wait(hb)
    wa = wait(ha)
    return wa.sum() + wait(ag(wb, second_group())).sum()


def off_path_reduce_scatters(a, b):
    gathered = wait(ag(b))
    mm1 = a @ gathered[:8, :8]
    h1 = rs(mm1)
    mm2 = a @ a
    h2 = rs(mm2)
    mm3 = a @ a
    return mm3.sum() + wait(h1).sum() + wait(h2).sum()


def small_and_large_gather(a, b, c):
    mm = a @ a
    hs, hl = ag(b), ag(c)
    small, large = wait(hs), wait(hl)
    return mm.sum() + small.sum() + large.sum()


def gather_under_chain(a):
    h = ag(a)
    p = ((a + 1) * 2) - 3
    return wait(h).sum() + p.sum()


def prefetch_across_gap(a, b, w):
    h = ag(a)
    first = b @ w
    second = first @ w
    return second.sum() + (wait(h) @ w).sum()


def chained_gathers(x):
    return wait(ag(wait(ag(x))))


def bucketed_peak_memory(x, w, p0, p1, p2, p3):
    """At group size 1, as upstream's single-process test runs it."""
    own = own_group()
    y = x @ w
    c0, c1 = p0.to(torch.bfloat16), p1.to(torch.bfloat16)
    h0, h1 = ag(c0, own, 1), ag(c1, own, 1)   # both starts of a pair before either wait, as upstream
    g0, g1 = wait(h0), wait(h1)
    h0, h1 = rs(c0, own, 1), rs(c1, own, 1)
    r0, r1 = wait(h0), wait(h1)
    y = y + (2 * x) @ (2 * w)
    c2, c3 = p2.to(torch.bfloat16), p3.to(torch.bfloat16)
    h2, h3 = ag(c2, own, 1), ag(c3, own, 1)
    g2, g3 = wait(h2), wait(h3)
    h2, h3 = rs(c2, own, 1), rs(c3, own, 1)
    r2, r3 = wait(h2), wait(h3)
    return y, g0, g1, g2, g3, r0, r1, r2, r3


def two_dtype_gathers_after_mm(x, w, p0, p1):
    y = x @ w
    g0 = wait(ag(p0)) * 2
    g1 = wait(ag(p1))
    return y, g0, g1


def converted_gathers_around_mm(a, b, c, d):
    h1 = ag(a.to(torch.bfloat16))
    h2 = ag(b.to(torch.bfloat16))
    mm = c @ d
    h3 = ag(c.to(torch.bfloat16))
    h4 = ag(d.to(torch.bfloat16))
    return wait(h1).sum() + wait(h2).sum() + wait(h3).sum() + wait(h4).sum() + mm.sum()


def converted_gathers_around_chains(a, b, c, d):
    h1 = ag(a.to(torch.bfloat16))
    h2 = ag(b.to(torch.bfloat16))
    x = (((c + 1) * 2) - 3) / 4
    w1, w2 = wait(h1), wait(h2)
    h3 = ag(c.to(torch.bfloat16))
    h4 = ag(d.to(torch.bfloat16))
    y = (d + 1) * 2
    return w1.sum() + w2.sum() + wait(h3).sum() + wait(h4).sum() + x.sum() + y.sum()


def early_user_of_chained_all_reduce(a, b, c, d):
    first0 = wait(ar(a))
    early = -first0
    first1 = wait(ar(b + 1))
    second0 = wait(ar(first0 + c))
    second1 = wait(ar(first1 + d))
    return early.sum() + second0.sum() + second1.sum()


def relu_mm_and_independent_all_reduce(a, b):
    c = torch.relu(a)
    d = c @ c
    return d * wait(ar(b))


def two_gathers_three_transposed_mms(a, b):
    h1, h2 = ag(a), ag(b)
    mm1, mm2, mm3 = a @ a.T, b @ b.T, (a + b) @ (a + b).T
    return wait(h1).sum() + wait(h2).sum() + mm1.sum() + mm2.sum() + mm3.sum()


def gathers_of_converted_and_wide(a, b, c, d):
    return wait(ag(a.to(torch.float16))), wait(ag(b.to(torch.float16))), wait(ag(c)), wait(ag(d))


def four_reduce_scatters(a, b, c, d):
    return wait(rs(a)), wait(rs(b)), wait(rs(c)), wait(rs(d))


def lone_gather_into_mm(x, w):
    return wait(ag(x)) @ w


def parametrized_bias_and_weight(bias, weight, x):
    """After AOTAutograd's CSE: the bias parametrization gathered at two reads (the
    `self.bias is not None` test and the add) is one all-gather with two waits; a pass
    waits the second again."""
    h = ag(bias)
    wait(h)
    b = wait(wait(h))
    return x * b.sum() + wait(ag(weight)).sum()


def fsdp_and_tp_gathers(p1, p2, t1, t2):
    g1, g2 = wait(ag(p1)), wait(ag(p2))
    return g1, g2, wait(ag(t1 + t2, second_group()))


def converted_parameter_gathers(p1, p2):
    return wait(ag(p1.to(torch.bfloat16))), wait(ag(p2.to(torch.bfloat16)))


def gather_mm_gather(a, b):
    h1 = ag(a)
    mm1 = a @ b
    h2 = ag(b)
    return wait(h1).sum() + wait(h2).sum() + mm1.sum()


def coalesced_reduce_scatter_between_mms(a, b, c, d):
    mm1 = a @ a
    outs = F.reduce_scatter_tensor_coalesced([x.view(-1) for x in (a, b, c, d)], "sum", world(), group())
    mm2 = a @ a
    return mm1.sum() + mm2.sum() + sum(wait(o).sum() for o in outs)


def coalesced_reduce_scatter_of_three(a, b, c):
    mm1 = a @ a
    outs = F.reduce_scatter_tensor_coalesced([x.view(-1) for x in (a, b, c)], "sum", world(), group())
    mm2 = a @ a
    return mm1.sum() + mm2.sum() + sum(wait(o).sum() for o in outs)


def gathers_waited_twice(x):
    """An all-gather of an all-gather's result, the second waited again (a wait of a wait)."""
    return wait(wait(ag(wait(ag(x)))))


def gather_under_add_mul(a):
    h = ag(a)
    b = (a + 1) * 2
    return wait(h).sum() + b.sum()


def coalesced_reduce_scatter_between_adds(inp):
    x = inp + 1
    pieces = F.reduce_scatter_tensor_coalesced([x, inp], "sum", world(), group())
    y = x + 2
    r0, r1 = wait(pieces[0]), wait(pieces[1])
    other = torch.ones_like(inp) + 22
    return r0, y, other, r1


def gathers_with_a_chain(x, w, a0, a1, a2, a3):
    """At group size 1, as upstream's single-process test runs it."""
    own = own_group()
    y = x @ w
    c1 = a1.to(torch.bfloat16)
    g2 = wait(ag(a2, own, 1))
    c0 = (g2 + a0).to(torch.bfloat16)
    g0 = wait(ag(c0, own, 1)) * 2
    g1 = wait(ag(c1, own, 1))
    return y, g0, g1, g2, wait(ag(a3, own, 1))


def gather_feeding_gather(x, w, a0, a1):
    y = x @ w
    g0 = wait(ag(a0.to(torch.bfloat16))) * 2
    return y, g0, wait(ag(a1.to(torch.bfloat16) + g0[:a1.shape[0]]))


def two_converted_reduce_scatters(x, w, r0, r1):
    y = x @ w
    h0, h1 = rs(r0.to(torch.bfloat16)), rs(r1.to(torch.bfloat16))
    return y, wait(h0), wait(h1)


def two_all_reduces_after_mm(x, w, r0, r1):
    y = x @ w
    h0, h1 = ar(r0), ar(r1)
    return y, wait(h0), wait(h1)


def in_two_modules(custom: bool = False):
    """Upstream's manual-bucketing harness: the first two collectives and their waits
    (``..._tensor``, ``..._tensor_1``, ``wait_tensor``, ``wait_tensor_1``) belong to module_1,
    the next two to module_2 (``nn_module_stack``); ``custom``: also annotated as
    ``fx.traceback.annotate`` would (``meta["custom"]``, overlapc reads ``module_fqn``)."""
    def annotate(gm: fx.GraphModule) -> None:
        for kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"):
            nodes = [n for n in gm.graph.nodes if n.op == "call_function" and label(n) == kind]
            for index, node in enumerate(nodes[:4]):
                module = "module_1" if index < 2 else "module_2"
                node.meta["nn_module_stack"] = {"test": (module, "")}
                if custom:
                    node.meta["custom"] = {"module_fqn": "my_" + module}
    return annotate


def _annotated_like_first_member(s) -> bool:
    """The one bucket's start and wait carry its first member's module annotations."""
    first = ({"test": ("module_1", "")}, {"module_fqn": "my_module_1"})
    return [tuple(p) for _, *p in s.provenance] == [first, first]


def _all_issued_first(starts: int):
    """``starts`` starts, every one before the first wait."""
    return lambda s: s.starts() == starts and not s.in_order(WAIT, "start")


def _no_bucket_between_first_two_gathers(s) -> bool:
    """Upstream's ``check("= ...all_gather_into_tensor").check_not("...all_gather_into_tensor_out")
    .check("= ...all_gather_into_tensor")``: two plain all-gathers (a bucket's start is the
    rewrite's ``all_gather_bucket``) with no bucket issued between them."""
    plain = [i for i, (name, lab) in enumerate(s.after) if lab == "all_gather_into_tensor" and "bucket" not in name]
    return len(plain) >= 2 and not any("bucket" in name for name, _ in s.after[plain[0]:plain[1]])


def _one_bucket(s) -> bool:
    return s.starts() == 1 and s.count(WAIT) == 1


# ---------------------------------------------------------------- upstream's setups

# The overlapc options that mirror what an upstream test configures (issue 41 counts
# agreement per case under these). Upstream's schedulers have no count limit; their
# memory caps (``max_in_flight_gb=5``, a peak increase of at most max(1 GB, 5%)) never
# bind on graphs of a few KiB, so "no limit" mirrors them; a test that sets a limit
# that binds gets it here.
OVERLAP_SCHEDULER = "overlap-scheduler"
# OverlapScheduler / schedule_overlap_bucketing with collective_bucketing off (its default):
# no buckets, no count limit, no binding memory limit. It prefetches a collective at the
# compute node whose estimated time hides it, one after another: overlapc's
# issue="per-kernel" (one start per hiding kernel, in consumer order).
REORDER_PASSES = "reorder-passes"
# test_compute_comm_reordering's sink_waits / raise_comms / reorder_compute_for_overlap passes:
# a collective raised as early as its inputs allow (overlapc's issue="early"), no buckets,
# no count limit, no binding memory limit.
EVERY_NODE_TIMED = "overlap-scheduler-every-node-timed"
# test_custom_estimator_for_non_compute_nodes: the OverlapScheduler with a custom estimator
# that times every node (the relu too), so each node hides what is in flight: per-kernel
# with every node a kernel, which is issue="early" (overlapc's kernels are matmul-class
# only, structure.Kernels); no buckets, no limits.
SCHEDULER_BUCKETS = "scheduler-buckets"
# Bucketing on with a cap far above the graph (collective_bucketing=True, the
# OverlapPreservingBucketer and ManualOverlapPreservingBucketer called directly,
# bucket_all_gathers_fx="all_custom_ops_multidtype"): overlapc's byte-target mode, which
# cuts by size only, at DEFAULT_BUCKET_BYTES (64 MiB); no count or memory limit; issued as
# the OverlapScheduler issues, issue="per-kernel" (the fx bucketing passes' tests count
# buckets and waits only).
SCHEDULER_BUCKETS_COALESCED = "scheduler-buckets-coalesced"
# test_reduce_scatter_coalesced_mode: the OverlapPreservingBucketer with bucket_mode="coalesced"
# (one reduce_scatter_tensor_coalesced over the members, no cat): scheduler-buckets with
# bucket_op="coalesced".
PEAK_MEMORY = "peak-memory"
# Reordering that refuses to raise peak memory (test_simple_overlap's enable_simple_overlap
# reverts a swap that raises it; test_inductor_collectives' reorder_communication_preserving_
# peak_memory): the "serial-peak" byte budget, no buckets, no count limit. (Upstream
# measures against the graph as handed in, overlapc against its serial order.)
PEAK_MEMORY_TWO_PER_BUCKET = "peak-memory-two-per-bucket"
# test_reorder_peak_memory_bucketed: the same reordering, with fx bucketing capped at 2 MiB
# (bucket_size_determinator) over collectives of 1 MiB each at group size 1 (upstream sizes a
# member by the larger of its input and output, as overlapc's byte target does): "serial-peak"
# with a byte target of two members (8 KiB here).
PLAN_PER_MODULE, PLAN_ONE_BUCKET, PLAN_EMPTY = "plan-per-module", "plan-one-bucket", "plan-empty"
# ManualOverlapScheduler with module_bucket_plans ["module_1", "module_2"], [["module_1",
# "module_2"]] and []: overlapc's bucket plans, the same lists; no count or memory limit. It
# prefetches by the plan, not by estimate: issue="early".
ONE_IN_FLIGHT = "one-in-flight"
# test_prefetch_prioritizes_larger_hidden_time: max_in_flight_gb=2e-7 (200 B) over all-gathers
# of 128 B each, "to limit in-flight collectives to one": a count of one here (the case's
# all-gathers differ in size, so no one byte number admits exactly one of either), no
# buckets, no byte limit; the OverlapScheduler: issue="per-kernel".
NO_EQUIVALENT = None
# The setup has no overlapc equivalent: counted as a disagreement, not scheduled.
NO_BUCKETING = "no-bucketing"
# Inductor's fx bucketing left at its default ("none") and no reordering pass configured
# (test_all_gather_bucket's newest version, test_grouped_scheduler_node): no buckets, no
# limits; overlapc still schedules (it has no "off" but disabling itself).

UPSTREAM_SETUPS = {
    OVERLAP_SCHEDULER: {"bucket": None, "chunks": 1, "max_in_flight": None, "max_in_flight_bytes": None,
                        "issue": "per-kernel"},
    REORDER_PASSES: {"bucket": None, "chunks": 1, "max_in_flight": None, "max_in_flight_bytes": None},
    EVERY_NODE_TIMED: {"bucket": None, "chunks": 1, "max_in_flight": None, "max_in_flight_bytes": None},
    SCHEDULER_BUCKETS: {"bucket": 64 * 1024 * 1024, "chunks": 1, "max_in_flight": None, "max_in_flight_bytes": None,
                        "issue": "per-kernel"},
    PLAN_PER_MODULE: {"bucket": ["module_1", "module_2"], "chunks": 1, "max_in_flight": None,
                      "max_in_flight_bytes": None},
    PLAN_ONE_BUCKET: {"bucket": [["module_1", "module_2"]], "chunks": 1, "max_in_flight": None,
                      "max_in_flight_bytes": None},
    PLAN_EMPTY: {"bucket": [], "chunks": 1, "max_in_flight": None, "max_in_flight_bytes": None},
    SCHEDULER_BUCKETS_COALESCED: {"bucket": 64 * 1024 * 1024, "bucket_op": "coalesced", "chunks": 1,
                                  "max_in_flight": None, "max_in_flight_bytes": None, "issue": "per-kernel"},
    NO_BUCKETING: {"bucket": None, "chunks": 1, "max_in_flight": None, "max_in_flight_bytes": None},
    PEAK_MEMORY: {"bucket": None, "chunks": 1, "max_in_flight": None, "max_in_flight_bytes": "graph-peak"},
    PEAK_MEMORY_TWO_PER_BUCKET: {"bucket": 8192, "chunks": 1, "max_in_flight": None,
                                 "max_in_flight_bytes": "graph-peak"},
    ONE_IN_FLIGHT: {"bucket": None, "chunks": 1, "max_in_flight": 1, "max_in_flight_bytes": None,
                    "issue": "per-kernel"},
}


# ---------------------------------------------------------------- the cases

SQ = ((8, 8),)
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _issued_in_input_order(prefix):
    return lambda s: s.issue_order(prefix) == list(s.placeholders)


def _wait_after_mm(s):
    return s.index(WAIT) > s.index("mm")


def _one_start_before_mm_one_wait_after_mm(s):
    """Upstream's ``check_count(all_gather, 1, exactly=True).check_count(mm, 2, exactly=True)
    .check_count(wait, 1, exactly=True)``: FileCheck counts from one match to the next check's,
    so one start before the first mm and one wait after the second, the last wait."""
    labels = [lab for _, lab in s.after]
    mms = [i for i, lab in enumerate(labels) if lab == "mm"]
    starts = sum(1 for lab in labels[:mms[0]] if lab in STARTS)
    return len(mms) == 2 and starts == 1 and labels[mms[1]:].count(WAIT) == 1


def _manual(name: str, test: str, says: str, fn, expect, setup: str, custom: bool = False) -> "Case":
    """A TestManualOverlapBucketing case: four (8, 8) inputs, tagged with two modules."""
    return Case(name, f"{ATEN}::{test}", says, fn, ((8, 8),) * 4, expect, setup=setup,
                annotate=in_two_modules(custom=custom))


CASES = [
    # test/distributed/test_aten_comm_compute_reordering.py: compiled with a post-grad pass that runs
    # schedule_overlap_bucketing with its defaults (bucketing off) and a cost model in which a matmul
    # hides one collective; the bucketing tests set aten_distributed_optimizations.collective_bucketing.
    Case("aten_sink_waits", f"{ATEN}::test_sink_waits",
         "all-reduce, then a@a, then its wait, then the mm that reads it",
         sink_waits, SQ, lambda s: s.in_order("all_reduce", "mm", WAIT, "mm"), setup=OVERLAP_SCHEDULER),
    Case("aten_raise_comms", f"{ATEN}::test_raise_comms",
         "the all-reduce of b+1 is raised above the 2nd mm (below the 1st); its wait sits before the 3rd",
         raise_comms, SQ, lambda s: s.in_order("%mm", "all_reduce", "%mm_1", WAIT, "%mm_2"), setup=OVERLAP_SCHEDULER),
    Case("aten_sink_waits_raise_comms", f"{ATEN}::test_sink_waits_raise_comms",
         "exact order mm, relu, all_reduce, mm_1, relu_1, mm_2, wait, mm_3",
         sink_waits_raise_comms, SQ,
         lambda s: s.in_order("%mm", "%relu", "all_reduce", "%mm_1", "%relu_1", "%mm_2", WAIT, "%mm_3"),
         setup=OVERLAP_SCHEDULER),
    Case("aten_reorder_compute_for_overlap_mul", f"{ATEN}::test_reorder_compute_for_overlap_mul",
         "all_reduce, mm, mm, wait, mul, all_reduce, wait, mm",
         reorder_compute_for_overlap, SQ,
         lambda s: s.in_order("all_reduce", "mm", "mm", WAIT, "mul", "all_reduce", WAIT, "mm"),
         setup=OVERLAP_SCHEDULER),
    Case("aten_inductor_default_comms_ordering", f"{ATEN}::test_inductor_default_comms_ordering",
         "the three all-reduces stay in input order (arg0, arg1, arg2)",
         default_comms_ordering, ((10, 10), (11, 11), (12, 12)), _issued_in_input_order("all_reduce"),
         setup=OVERLAP_SCHEDULER),
    Case("aten_overlap_scheduling_via_config", f"{ATEN}::test_overlap_scheduling_via_config",
         "all_reduce, mm, wait, mm (the wait sunk below the first matmul)",
         sink_waits, SQ, lambda s: s.in_order("all_reduce", "mm", WAIT, "mm"), setup=OVERLAP_SCHEDULER),
    Case("aten_basic_all_gather_bucketing", f"{ATEN}::test_basic_all_gather_bucketing",
         "one all-gather: the three independent ones bucketed",
         three_gathers_used, ((4, 4),) * 3, lambda s: s.starts() == 1, setup=SCHEDULER_BUCKETS),
    Case("aten_reduce_scatter_bucketing", f"{ATEN}::test_reduce_scatter_bucketing",
         "one reduce-scatter: the three bucketed",
         three_reduce_scatters, ((8, 4),) * 3, lambda s: s.starts() == 1, setup=SCHEDULER_BUCKETS),
    Case("aten_no_bucketing_with_dependent_hiding_nodes", f"{ATEN}::test_no_bucketing_with_dependent_hiding_nodes",
         "two all-gathers: ag2's hiding mm reads ag1",
         dependent_hiding_nodes, ((4, 4),) * 2, lambda s: s.starts() == 2, setup=SCHEDULER_BUCKETS),
    Case("aten_no_bucketing_when_collective_depends_on_hiding_node",
         f"{ATEN}::test_no_bucketing_when_collective_depends_on_hiding_node",
         "two all-gathers: ag2's input is ag1's hiding mm",
         depends_on_hiding_node, ((4, 4),), lambda s: s.starts() == 2, setup=SCHEDULER_BUCKETS),
    Case("aten_bucketing_wait_sink", f"{ATEN}::test_bucketing_wait_sink",
         "one all-gather bucket, both mms after it, its wait below them",
         four_gathers_two_mms, ((8, 8),) * 4, lambda s: s.starts() == 1 and s.in_order("start", "mm", "mm", WAIT),
         setup=SCHEDULER_BUCKETS),
    Case("aten_bucketing_split_for_overlap_blocking_no_deps",
         f"{ATEN}::test_bucketing_split_for_overlap_blocking_no_deps",
         "one all-gather before mm1, one wait after mm2, the last (FileCheck's counts run to the next check: "
         "two buckets, the second issued after mm1)",
         four_gathers_blocking, ((8, 8),) * 4, _one_start_before_mm_one_wait_after_mm, setup=SCHEDULER_BUCKETS),
    Case("aten_bucketing_split_for_overlap", f"{ATEN}::test_bucketing_split_for_overlap",
         "two buckets (ag1+ag2, ag3+ag4): bucket, mm1, bucket, mm2",
         four_gathers_split, ((8, 8),) * 4, lambda s: s.starts() == 2 and s.in_order("start", "mm", "start", "mm"),
         setup=SCHEDULER_BUCKETS),
    Case("aten_bucket_exposed_with_hidden_single_overlap", f"{ATEN}::test_bucket_exposed_with_hidden_single_overlap",
         "one bucket of all three (one wait), issued before the mm, waited after it",
         exposed_with_hidden, ((8, 8),) * 3, lambda s: s.count(WAIT) == 1 and s.in_order("start", "mm", WAIT),
         setup=SCHEDULER_BUCKETS),
    Case("aten_bucketing_split_for_overlap_blocking_deps_inductor",
         f"{ATEN}::test_bucketing_split_for_overlap_blocking_deps_inductor",
         "two buckets, each: all-gather, one mm, its wait",
         four_gathers_blocking, ((8, 8),) * 4,
         lambda s: s.starts() == 2 and s.in_order("start", "mm", WAIT, "start", "mm", WAIT), setup=SCHEDULER_BUCKETS),
    Case("aten_multidtype_bucketing", f"{ATEN}::test_multidtype_bucketing",
         "one wait: fp32, bf16 and fp16 all-gathers in one bucket",
         three_gathers_summed, ((4, 4),) * 3, lambda s: s.count(WAIT) == 1, dtypes=(F32, BF16, F16),
         setup=SCHEDULER_BUCKETS),
    Case("aten_basic_all_reduce_bucketing", f"{ATEN}::test_basic_all_reduce_bucketing",
         "one wait: the three all-reduces bucketed",
         three_all_reduces, ((4, 4),) * 3, lambda s: s.count(WAIT) == 1, setup=SCHEDULER_BUCKETS),
    Case("aten_schedulable_wait", f"{ATEN}::test_schedulable_wait",
         "the two waits of the two all-gathers are theirs; the wait of a wait is none (here: it goes, the chain "
         "keeps its order)", gathers_waited_twice, ((4, 4),),
         lambda s: s.count(WAIT) == 2 and s.in_order("start", WAIT, "start", WAIT), setup=OVERLAP_SCHEDULER),
    Case("aten_custom_estimator_for_non_compute_nodes", f"{ATEN}::test_custom_estimator_for_non_compute_nodes",
         "the all-reduce of b issued above the relu (a node the estimator times), waited after it",
         relu_mm_and_independent_all_reduce, SQ * 2, lambda s: s.in_order("all_reduce", "relu", WAIT),
         setup=EVERY_NODE_TIMED),
    Case("aten_multiple_hiding_nodes_bucketing", f"{ATEN}::test_multiple_hiding_nodes_bucketing",
         "one bucket (one wait) issued before all three mms, waited after them",
         two_gathers_three_transposed_mms, SQ * 2,
         lambda s: s.count(WAIT) == 1 and s.in_order("start", "mm", "mm", "mm", WAIT), setup=SCHEDULER_BUCKETS),
    Case("aten_bucketing_with_convert_dtype", f"{ATEN}::test_bucketing_with_convert_dtype",
         "one wait: fp32->fp16, fp64->fp16, fp16 and fp64 all-gathers in one bucket (upstream also checks "
         "that Inductor's code keeps no separate cast kernel: not re-created)",
         gathers_of_converted_and_wide, ((4, 4),) * 4, lambda s: s.count(WAIT) == 1, dtypes=(F32, F64, F16, F64),
         setup=SCHEDULER_BUCKETS),
    # TestManualOverlapBucketing: ManualOverlapScheduler with a bucket plan over the modules its
    # harness tags by node name (``in_two_modules``).
    _manual("aten_manual_all_gather_separate_buckets",
            "test_manual_reordering_bucketing_pass_all_gather_separate_buckets",
            "plan [module_1, module_2]: two buckets, both issued before either wait",
            four_gathers_blocking, _all_issued_first(2), PLAN_PER_MODULE),
    _manual("aten_manual_all_gather_no_bucket", "test_manual_bucketing_reordering_pass_all_gather_no_bucket",
            "plan []: the four all-gathers, all issued before any wait",
            four_gathers_blocking, _all_issued_first(4), PLAN_EMPTY),
    _manual("aten_manual_all_gather_single_bucket", "test_manual_bucketing_reordering_pass_all_gather_single_bucket",
            "plan [[module_1, module_2]]: one bucket of the four", four_gathers_blocking, _one_bucket, PLAN_ONE_BUCKET),
    _manual("aten_manual_all_gather_single_bucket_annotated",
            "test_bucketing_reordering_pass_all_gather_single_bucket_custom_module_stack_fn",
            "modules from annotations: one bucket of the four; its start and wait carry the first member's "
            "module stack and annotation", four_gathers_blocking,
            lambda s: _one_bucket(s) and _annotated_like_first_member(s), PLAN_ONE_BUCKET, custom=True),
    _manual("aten_manual_reduce_scatter_separate_buckets",
            "test_manual_bucketing_reordering_pass_reduce_scatter_separate_buckets",
            "plan [module_1, module_2]: two reduce-scatter buckets, both issued before either wait",
            four_reduce_scatters, _all_issued_first(2), PLAN_PER_MODULE),
    _manual("aten_manual_reduce_scatter_single_bucket",
            "test_manual_bucketing_reordering_pass_reduce_scatter_single_bucket",
            "plan [[module_1, module_2]]: one reduce-scatter bucket", four_reduce_scatters, _one_bucket,
            PLAN_ONE_BUCKET),
    _manual("aten_manual_reduce_scatter_no_bucket", "test_manual_bucketing_reordering_pass_reduce_scatter_no_bucket",
            "plan []: the four reduce-scatters, all issued before any wait",
            four_reduce_scatters, _all_issued_first(4), PLAN_EMPTY),

    # test/distributed/test_compute_comm_reordering.py: reorder_for_compute_comm_overlap with the
    # sink_waits / raise_comms / reorder_compute_for_overlap passes: no buckets, no memory bound.
    Case("compute_sink_waits", f"{COMPUTE}::test_sink_waits",
         "all_reduce, mm, wait, mm",
         sink_waits, SQ, lambda s: s.in_order("all_reduce", "mm", WAIT, "mm"), setup=REORDER_PASSES),
    # Upstream reduces the matmul's result itself (the aten file's twin reduces b + 1). Its
    # FileCheck also puts the relu before the all_reduce_, because Inductor writes that
    # all_reduce_ in place into the matmul's buffer, which the relu reads (upstream's comment);
    # a functional all_reduce has no such write: the check is the order it states, the
    # all-reduce "raised above the 2nd matmul but below the 1st", waited before the 3rd.
    Case("compute_raise_comms", f"{COMPUTE}::test_raise_comms",
         "the all-reduce of mm's result raised above the 2nd mm (below the 1st); its wait before the 3rd",
         raise_comms_of_matmul, SQ, lambda s: s.in_order("%mm", "all_reduce", "%mm_1", WAIT, "%mm_2"),
         setup=REORDER_PASSES),
    Case("compute_sink_waits_raise_comms", f"{COMPUTE}::test_sink_waits_raise_comms",
         "mm, all_reduce, relu, mm, relu, mm, wait, mm",
         sink_waits_raise_comms, SQ,
         lambda s: s.in_order("%mm", "all_reduce", "%relu", "%mm_1", "%relu_1", "%mm_2", WAIT, "%mm_3"),
         setup=REORDER_PASSES),
    Case("compute_reorder_compute_for_overlap", f"{COMPUTE}::test_reorder_compute_for_overlap",
         "all_reduce, relu, mm, mm, wait, mul, all_reduce, wait, add, mm",
         reorder_compute_for_overlap, SQ,
         lambda s: s.in_order("all_reduce", "relu", "mm", "mm", WAIT, "mul", "all_reduce", WAIT, "add", "mm"),
         setup=REORDER_PASSES),
    Case("compute_reorder_compute_for_overlap_custom_runtime_estimation",
         f"{COMPUTE}::test_reorder_compute_for_overlap_custom_runtime_estimation",
         "as test_reorder_compute_for_overlap",
         reorder_compute_for_overlap, SQ,
         lambda s: s.in_order("all_reduce", "relu", "mm", "mm", WAIT, "mul", "all_reduce", WAIT, "add", "mm"),
         setup=REORDER_PASSES),
    Case("compute_grouped_scheduler_node", f"{COMPUTE}::test_grouped_scheduler_node",
         "add/div, then the all-reduce, then mul",
         grouped_scheduler_node, SQ, lambda s: s.in_order("div", "all_reduce", "mul"), setup=NO_BUCKETING),
    Case("compute_inductor_default_comms_ordering", f"{COMPUTE}::test_inductor_default_comms_ordering",
         "nothing moves: the three all-reduces in input order, then their waits in reverse "
         "(upstream reduces with avg, which gloo lacks: sum here)",
         default_comms_ordering, ((10, 10), (11, 11), (12, 12)), lambda s: s.unchanged(), setup=REORDER_PASSES),

    # test/distributed/test_simple_overlap.py: enable_simple_overlap (adjacent swaps, a swap that
    # raises peak memory is reverted), no buckets.
    Case("simple_collective_moved_before_compute", f"{SIMPLE}::test_collective_moved_before_compute",
         "the all-gather moves above the mm (or stays, if moving raises peak memory)",
         gather_after_compute, ((4, 4),) * 2, lambda s: s.in_order("start", "mm", WAIT) or s.unchanged(),
         setup=PEAK_MEMORY),
    Case("simple_wait_moved_after_compute", f"{SIMPLE}::test_wait_moved_after_compute",
         "the wait moves below the mm",
         gather_then_compute, ((4, 4),) * 2, _wait_after_mm, setup=PEAK_MEMORY),
    Case("simple_pg_ordering_preserved", f"{SIMPLE}::test_pg_ordering_preserved",
         "the all-gather of a stays before the all-gather of b",
         two_gathers_one_group, ((4, 4),) * 2, _issued_in_input_order("all_gather"), setup=PEAK_MEMORY),
    Case("simple_no_change_when_already_optimal", f"{SIMPLE}::test_no_change_when_already_optimal",
         "nothing moves",
         already_optimal, ((4, 4),) * 2, Schedule.unchanged, setup=PEAK_MEMORY),
    Case("simple_no_pairs_is_noop", f"{SIMPLE}::test_no_pairs_is_noop",
         "no collectives: nothing moves",
         no_collectives, ((4, 4),) * 2, Schedule.unchanged, setup=PEAK_MEMORY),
    Case("simple_dependency_respected_for_collective_move", f"{SIMPLE}::test_dependency_respected_for_collective_move",
         "the all-gather of mm stays after mm",
         gather_of_compute, ((4, 4),) * 2, lambda s: s.in_order("mm", "start"), setup=PEAK_MEMORY),

    # test/distributed/test_overlap_bucketing_unit.py: the bucketing tests call OverlapPreservingBucketer
    # (or the manual one) on hand-annotated hiding nodes, bucket caps far above the graph; the
    # scheduling tests run OverlapScheduler / schedule_overlap_bucketing with collective_bucketing=False
    # and max_in_flight_gb=5 (or the defaults), the cycle tests with collective_bucketing=True.
    Case("unit_can_bucket_independent_collectives", f"{UNIT}::test_can_bucket_independent_collectives",
         "one all-gather bucket",
         two_started_two_mms, ((4, 4),) * 2, lambda s: s.starts() == 1, setup=SCHEDULER_BUCKETS),
    Case("unit_cant_bucket_nested_hiding_intervals", f"{UNIT}::test_cant_bucket_nested_hiding_intervals",
         "two all-gathers (ag2's interval nested in ag1's)",
         nested_hiding, ((4, 4),) * 2, lambda s: s.starts() == 2, setup=SCHEDULER_BUCKETS),
    Case("unit_cant_bucket_ag_with_rs_hiding_interval_between_hidden",
         f"{UNIT}::test_cant_bucket_ag_with_rs_hiding_interval_between[final_mm_hidden=True]",
         "mm order kept; two all-gathers (the reduce-scatter's hiding interval lies between)",
         gather_rs_gather, ((4, 4), (8, 4), (4, 4)),
         lambda s: s.in_order("%mm", "%mm_1", "%mm_2") and s.count("all_gather_into_tensor") == 2,
         setup=SCHEDULER_BUCKETS),
    Case("unit_cant_bucket_ag_with_rs_hiding_interval_between_exposed",
         f"{UNIT}::test_cant_bucket_ag_with_rs_hiding_interval_between[final_mm_hidden=False]",
         "mm order kept; one all-gather bucket (the reduce-scatter is exposed)",
         gather_rs_gather, ((4, 4), (8, 4), (4, 4)),
         lambda s: s.in_order("%mm", "%mm_1", "%mm_2") and s.count("all_gather_into_tensor") == 1,
         setup=SCHEDULER_BUCKETS),
    Case("unit_can_bucket_all_reduce", f"{UNIT}::test_can_bucket_all_reduce",
         "one all-reduce bucket, both mms kept",
         two_all_reduces_two_mms, ((4, 4),) * 2, lambda s: s.count("all_reduce") == 1 and s.count("mm") == 2,
         setup=SCHEDULER_BUCKETS),
    Case("unit_manual_bucket_splits_dependent_all_reduce", f"{UNIT}::test_manual_bucket_splits_dependent_all_reduce",
         "two all-reduce buckets: the independent sumexps, then the dependent results",
         chained_all_reduces, ((4, 4),) * 4, lambda s: s.count("all_reduce") == 2, setup=SCHEDULER_BUCKETS),
    Case("unit_no_cross_type_bucketing_ar_and_rs", f"{UNIT}::test_no_cross_type_bucketing_ar_and_rs",
         "one all-reduce bucket and one reduce-scatter bucket, never mixed",
         all_reduces_and_reduce_scatters, ((8, 4),) * 2,
         lambda s: s.count("all_reduce") == 1 and s.count("reduce_scatter_tensor") == 1, setup=SCHEDULER_BUCKETS),
    Case("unit_reduce_scatter_coalesced_mode", f"{UNIT}::test_reduce_scatter_coalesced_mode",
         "one reduce_scatter_tensor_coalesced, no cat",
         two_reduce_scatters, ((8, 4),) * 2,
         lambda s: s.count("reduce_scatter_tensor_coalesced") == 1 and s.count("cat") == 0,
         setup=SCHEDULER_BUCKETS_COALESCED),
    Case("unit_all_gather_coalesced_mode_falls_back", f"{UNIT}::test_all_gather_coalesced_mode_falls_back",
         "one all-gather bucket, no all_gather_into_tensor_coalesced",
         two_gathers, ((4, 4),) * 2,
         lambda s: s.starts() == 1 and s.count("all_gather_into_tensor_coalesced") == 0, setup=SCHEDULER_BUCKETS),
    Case("unit_reduce_scatter_coalesced_mode_single_rs", f"{UNIT}::test_reduce_scatter_coalesced_mode_single_rs",
         "a lone reduce-scatter stays one reduce_scatter_tensor",
         one_reduce_scatter, ((8, 4),), lambda s: s.count("reduce_scatter_tensor") == 1, setup=SCHEDULER_BUCKETS),
    Case("unit_can_bucket_multidtype_collectives", f"{UNIT}::test_can_bucket_multidtype_collectives",
         "one all-gather bucket of an fp32 and a bf16 tensor",
         two_dtypes_two_mms, ((4, 4),) * 2, lambda s: s.starts() == 1, dtypes=(F32, BF16), setup=SCHEDULER_BUCKETS),
    Case("unit_can_bucket_with_multiple_hiding_nodes", f"{UNIT}::test_can_bucket_with_multiple_hiding_nodes",
         "one all-gather bucket, three mms kept",
         shared_hiding_node, ((4, 4),) * 2, lambda s: s.starts() == 1 and s.count("mm") == 3, setup=SCHEDULER_BUCKETS),
    Case("unit_can_bucket_with_convert_dtype_as_hiding_nodes",
         f"{UNIT}::test_can_bucket_with_convert_dtype_as_hiding_nodes",
         "ag1 alone and waited, then one bucket of ag2 (fp16) + ag3 (fp32)",
         convert_as_hiding_node, ((4, 4),) * 3, lambda s: s.starts() == 2 and s.in_order("start", WAIT, "start"),
         setup=SCHEDULER_BUCKETS),
    Case("unit_deterministic_mode_no_benchmark_error", f"{UNIT}::test_deterministic_mode_no_benchmark_error",
         "schedules without error (the all-gather stays ahead of the mm)",
         gather_under_pointwise, ((16, 16),) * 2, lambda s: s.in_order("start", "mm", WAIT), setup=OVERLAP_SCHEDULER),
    Case("unit_cross_pg_prefetch_during_exposed_wait", f"{UNIT}::test_cross_pg_prefetch_during_exposed_wait",
         "the second group's all-gather is issued before the first one's wait",
         cross_group_prefetch, ((4, 4),) * 2, lambda s: s.in_order("start", "start", WAIT), setup=OVERLAP_SCHEDULER),
    Case("unit_active_wait_not_scheduled_recursively_b_first",
         f"{UNIT}::test_active_wait_is_not_scheduled_recursively[wait_a_first=False]",
         "schedules and lints (upstream asserts no order): a chain all-gather -> all-gather on another group, "
         "all three issued", waits_then_chain_b_first, ((4, 4),) * 2, lambda s: s.starts() == 3,
         setup=OVERLAP_SCHEDULER),
    Case("unit_active_wait_not_scheduled_recursively_a_first",
         f"{UNIT}::test_active_wait_is_not_scheduled_recursively[wait_a_first=True]",
         "schedules and lints (upstream asserts no order): a chain all-gather -> all-gather on another group, "
         "all three issued", waits_then_chain_a_first, ((4, 4),) * 2, lambda s: s.starts() == 3,
         setup=OVERLAP_SCHEDULER),
    Case("unit_two_queue_scheduling_off_path_nodes", f"{UNIT}::test_two_queue_scheduling_off_path_nodes",
         "a reduce-scatter start lies before the last mm (off-path starts do not drift to the end)",
         off_path_reduce_scatters, ((8, 8),) * 2, lambda s: s.in_order("reduce_scatter_tensor", "%mm_2"),
         setup=OVERLAP_SCHEDULER),
    Case("unit_prefetch_prioritizes_larger_hidden_time", f"{UNIT}::test_prefetch_prioritizes_larger_hidden_time",
         "with one in flight, the mm hides the larger all-gather (upstream: by estimate; here: by size), "
         "not the smaller",
         small_and_large_gather, ((8, 8), (4, 4), (32, 32)),
         lambda s: s.in_order("%all_gather_into_tensor_1", "mm", "%wait_tensor_1")
         and not s.in_order("%all_gather_into_tensor", "mm", "%wait_tensor"), setup=ONE_IN_FLIGHT),
    Case("unit_fusible_nodes_hide_collective", f"{UNIT}::test_fusible_nodes_hide_collective",
         "all-gather, add, mul, sub, wait (the pointwise chain hides it)",
         gather_under_chain, ((64, 64),), lambda s: s.in_order("start", "add", "mul", "sub", WAIT),
         setup=OVERLAP_SCHEDULER),
    Case("unit_fusion_regions_hide_collective", f"{UNIT}::test_fusion_regions_hide_collective",
         "all-gather, add, mul, sub, wait",
         gather_under_chain, ((64, 64),), lambda s: s.in_order("start", "add", "mul", "sub", WAIT),
         setup=OVERLAP_SCHEDULER),
    Case("unit_no_memory_limit_prefetches_across_compute_gap",
         f"{UNIT}::test_no_memory_limit_prefetches_across_compute_gap",
         "the all-gather is issued before both matmuls, waited after them",
         prefetch_across_gap, ((8, 16), (8, 16), (16, 16)),
         lambda s: s.in_order("start", "%mm", "%mm_1", WAIT, "%mm_2"), setup=OVERLAP_SCHEDULER),

    Case("unit_no_self_dependency_cycle_with_dtype_conversion",
         f"{UNIT}::test_no_self_dependency_cycle_with_dtype_conversion",
         "bucketing bf16-cast all-gathers around an mm leaves a valid graph (here: all four issued, a..d)",
         converted_gathers_around_mm, ((4, 4),) * 4, _issued_in_input_order("all_gather"), setup=SCHEDULER_BUCKETS),
    Case("unit_no_cycle_with_fusion_regions_and_bucketing", f"{UNIT}::test_no_cycle_with_fusion_regions_and_bucketing",
         "bucketing around pointwise chains leaves a valid graph (here: all four issued, a..d)",
         converted_gathers_around_chains, ((4, 4),) * 4, _issued_in_input_order("all_gather"), setup=SCHEDULER_BUCKETS),
    Case("unit_wait_user_repair_runs_once_after_all_bucket_groups",
         f"{UNIT}::test_wait_user_repair_runs_once_after_all_bucket_groups",
         "two all-reduce buckets (first0+first1, second0+second1); the early user of first0 after its wait",
         early_user_of_chained_all_reduce, ((4, 4),) * 4,
         lambda s: s.count("all_reduce") == 2 and s.in_order(WAIT, "neg"), setup=SCHEDULER_BUCKETS),
    Case("unit_no_memory_limit", f"{UNIT}::test_no_memory_limit",
         "with no memory cap the lone all-gather stays exposed (nothing can hide it): waited right after its start",
         lone_gather_into_mm, ((8, 16), (16, 16)), lambda s: s.index(WAIT) == s.index("start") + 1,
         setup=OVERLAP_SCHEDULER),
    Case("unit_assume_bucketed_latency_exceeds_exposed_time",
         f"{UNIT}::test_assume_bucketed_latency_exceeds_exposed_time",
         "schedules without error (upstream asserts no order): both inputs gathered",
         gather_mm_gather, ((4, 4),) * 2, lambda s: sorted(s.issue_order("all_gather")) == sorted(s.placeholders),
         setup=OVERLAP_SCHEDULER),
    Case("unit_identify_collectives_coalesced", f"{UNIT}::test_identify_collectives_coalesced",
         "one collective: the coalesced reduce-scatter of three, its three waits all of it "
         "(upstream asserts the pairing before scheduling; here: after, the start and its waits stay)",
         coalesced_reduce_scatter_of_three, ((8, 8),) * 3,
         lambda s: s.count("reduce_scatter_tensor_coalesced") == 1 and s.count(WAIT) == 3
         and s.in_order("reduce_scatter_tensor_coalesced", WAIT, WAIT, WAIT), setup=OVERLAP_SCHEDULER),
    Case("unit_precomputed_estimations_via_custom_runtime",
         f"{UNIT}::test_precomputed_estimations_via_custom_runtime (enable_fusion_regions False and True, one case)",
         "one collective: the all-gather, then its wait", gather_under_add_mul, ((64, 64),),
         lambda s: s.starts() == 1 and s.in_order("start", WAIT), setup=OVERLAP_SCHEDULER),
    Case("unit_overlap_scheduler_coalesced_runs", f"{UNIT}::test_overlap_scheduler_coalesced_runs",
         "schedules a coalesced reduce-scatter without error: it and its four waits stay",
         coalesced_reduce_scatter_between_mms, ((8, 8),) * 4,
         lambda s: s.count("reduce_scatter_tensor_coalesced") == 1 and s.count(WAIT) == 4, setup=OVERLAP_SCHEDULER),
    Case("unit_deduplicates_parametrization_waits", f"{UNIT}::test_deduplicates_parametrization_waits",
         "a gather CSE left with two waits (one waited again) and another: one all-gather, one wait",
         parametrized_bias_and_weight, ((4,), (4,), (4,)), lambda s: s.starts() == 1 and s.count(WAIT) == 1,
         setup=SCHEDULER_BUCKETS),
    Case("unit_pre_bucketing_only_merges_fsdp_collectives",
         f"{UNIT}::test_pre_bucketing_only_merges_fsdp_collectives",
         "the two parameter all-gathers bucketed; the TP all-gather (another group) stays alone",
         fsdp_and_tp_gathers, ((4, 4),) * 4,
         lambda s: sorted(sorted(p) for _, p in s.sources) == sorted([sorted(s.placeholders[:2]),
                                                                      sorted(s.placeholders[2:])]),
         setup=SCHEDULER_BUCKETS),
    Case("unit_pre_bucketing_handles_dtype_cast", f"{UNIT}::test_pre_bucketing_handles_dtype_cast",
         "the two bf16-cast parameter all-gathers bucketed",
         converted_parameter_gathers, ((4, 4),) * 2, lambda s: s.starts() == 1, setup=SCHEDULER_BUCKETS),

    # test/distributed/test_inductor_collectives.py: reorder_respects_wait_dep runs sink_waits and
    # reorder_communication_preserving_peak_memory; all_gather_bucket_multidtype buckets every
    # all-gather (bucket_all_gathers_fx="all", bucket_all_gathers_bucket_mode="custom_ops_multidtype"),
    # no reordering.
    Case("collectives_reorder_respects_wait_dep", f"{COLLECTIVES}::test_reorder_respects_wait_dep",
         "all_gather, wait, all_gather, wait (the chain is kept)",
         chained_gathers, ((4, 4),), lambda s: s.in_order("start", WAIT, "start", WAIT), setup=PEAK_MEMORY),
    # Buckets capped at 2 MiB (bucket_size_determinator=lambda _: 2) over 1 MiB collectives, and
    # peak-memory-preserving reordering, at group size 1: PEAK_MEMORY_TWO_PER_BUCKET.
    Case("collectives_reorder_peak_memory_bucketed", f"{COLLECTIVES}::test_reorder_peak_memory_bucketed",
         "two all-gather buckets and two reduce-scatter buckets, all issued before the 1st mm",
         bucketed_peak_memory, ((4, 48), (48, 64), (64, 32), (32, 64), (64, 32), (32, 64)),
         lambda s: s.count("all_gather_into_tensor") == 2 and s.count("reduce_scatter_tensor") == 2
         and s.in_order("all_gather_into_tensor", "all_gather_into_tensor", "%mm")
         and s.in_order("reduce_scatter_tensor", "reduce_scatter_tensor", "%mm"), setup=PEAK_MEMORY_TWO_PER_BUCKET),
    Case("collectives_all_gather_bucket_multidtype", f"{COLLECTIVES}::test_all_gather_bucket_multidtype",
         "one all-gather bucket of a bf16 and an fp32 tensor",
         two_dtype_gathers_after_mm, ((4, 48), (48, 64), (48, 64), (48, 64)),
         lambda s: s.count("all_gather_into_tensor") == 1, dtypes=(F32, F32, BF16, F32), setup=SCHEDULER_BUCKETS),
    # Single-process tests (world 1) that read Inductor's code; here their FX schedules.
    Case("collectives_reorder_peak_memory", f"{COLLECTIVES}::test_reorder_peak_memory",
         "nothing moves: x, the coalesced reduce-scatter of x and inp, then its two waits in order",
         coalesced_reduce_scatter_between_adds, ((8, 4),),
         lambda s: s.in_order("%add", "reduce_scatter_tensor_coalesced", "%wait_tensor", "%wait_tensor_1"),
         setup=PEAK_MEMORY),
    # The newest version (a mirror of pytorch/pytorch, cyyever/pytorch@bfbe682b) parametrizes
    # bucket_all_gathers_bucket_mode ("default", "custom_ops": one case) and leaves the fx
    # bucketing pass off, and asserts no bucket; the older one turned it on
    # (bucket_all_gathers_fx="all", "all_custom_ops") and expected the bf16 pair bucketed, which
    # overlapc's hiding rule refuses (docs/conformance.md, "dtype-mode").
    Case("collectives_all_gather_bucket", f"{COLLECTIVES}::test_all_gather_bucket",
         "fx bucketing off: a plain all-gather (ag_2, which ag_0 reads), no bucket, a plain all-gather",
         gathers_with_a_chain, ((4, 48), (48, 64), (48, 64), (48, 64), (48, 64), (48, 64)),
         _no_bucket_between_first_two_gathers, setup=NO_BUCKETING),
    Case("collectives_all_gather_bucket_path", f"{COLLECTIVES}::test_all_gather_bucket_path",
         "two waits: the second all-gather reads the first, no bucket",
         gather_feeding_gather, ((4, 48), (48, 64), (48, 64), (48, 64)), lambda s: s.count(WAIT) == 2,
         setup=SCHEDULER_BUCKETS),
    Case("collectives_reduce_scatter_bucket", f"{COLLECTIVES}::test_reduce_scatter_bucket",
         "one reduce-scatter: the two bf16 ones bucketed",
         two_converted_reduce_scatters, ((4, 48), (48, 64), (48, 64), (48, 32)),
         lambda s: s.count("reduce_scatter_tensor") == 1, setup=SCHEDULER_BUCKETS),
    Case("collectives_all_reduce_bucket", f"{COLLECTIVES}::test_all_reduce_bucket",
         "one all-reduce: the two bucketed",
         two_all_reduces_after_mm, ((4, 48), (48, 64), (48, 64), (48, 32)),
         lambda s: s.count("all_reduce") == 1, setup=SCHEDULER_BUCKETS),
]

CONFIGS = {"defaults": {}, "no-buckets": {"bucket": None, "chunks": 1}, "module": {"bucket": "module"}}


def trace(case: Case) -> fx.GraphModule:
    """make_fx of the case on fake tensors, in the current process group."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(case.fn, tracing_mode="fake")(*case.inputs())
    if case.annotate is not None:
        case.annotate(gm)
    return gm


def schedule(case: Case, options: dict) -> tuple[fx.GraphModule, fx.GraphModule, Schedule]:
    """(unscheduled graph, scheduled copy, their Schedule) under overlapc ``options``;
    scheduled with on_error="raise" and verified, so a fallback cannot pass unseen."""
    import copy

    import overlapc

    before = trace(case)
    after = copy.deepcopy(before)
    config = overlapc.OverlapConfig.from_options({**options, "on_error": "raise"}, env={})
    overlapc.schedule(after, config)
    overlapc.verify(after, config)
    return before, after, Schedule.of(before, after)

"""PyTorch's own reordering tests as a conformance suite (issue 41, item 1).

Each case of ``conformance_cases.CASES`` re-creates one upstream test's graph and
records what its asserts expect. Per case and configuration (``CONFIGS``: the
defaults, no buckets, ``bucket="module"``) the schedule must pass
``overlapc.verify`` (scheduled with on_error="raise"), and its agreement with
upstream must be what ``EXPECTED`` says: a listed disagreement that now agrees
fails too, so the list stays honest. An agreement also needs compute kept in
its order (``Schedule.compute_order_kept``, overlapc's own guarantee 5, counted
here independently of verify); a case that breaks it is listed as
``COMPUTE_ORDER``. Issue 41 counts agreement per case under the overlapc options
that mirror the upstream test's own setup (``Case.setup``): ``UPSTREAM_EXPECTED``
lists those disagreements the same way. Values are compared with the unscheduled
graph on 2 gloo ranks in one launch (the fake process group returns garbage).

``python tests/test_conformance.py`` prints the agreement table of
docs/conformance.md.
"""
import pytest
import torch
from torch.utils._pytree import tree_leaves

import conformance_cases as cc
from multiproc import init_gloo, run_ranks

# Why overlapc's schedule differs from upstream's expectation (docs/conformance.md says more).
MEMORY_FIRST = "memory-first"                 # deliberate: upstream's order raises the serial order's peak
POINTWISE_WINDOW = "pointwise-window"         # deliberate: pointwise ops alone hide no all-gather (fused past the wait)
AUTO_CAP = "auto-cap"                         # deliberate: bucket="auto" caps a bucket at the largest member
BUCKETS_OFF = "buckets-off"                   # deliberate: the configuration turns buckets off
BUCKET_GRANULARITY = "bucket-granularity"     # deliberate: upstream splits a block's collectives in two buckets
RAISE_COMMS = "raise-comms"                   # deliberate: a start's compute producer is not moved earlier
COMPUTE_REORDER = "compute-reorder"           # deliberate: compute is not reordered to feed a collective
PREFETCH_PRIORITY = "prefetch-priority"       # deliberate: prefetch in consumer order, not by estimated gain
COALESCED_OP = "coalesced-op"                 # deliberate: the configurations pack (bucket_op="pack"), no *_coalesced
COMPUTE_ORDER = "compute-order"               # never expected: a compute node moved (README guarantee 0)
BUCKETS_ON = "buckets-on"                     # deliberate: the configuration buckets what upstream's plan leaves apart
# Seen under upstream's own setups (below), same-graph also under bucket="module":
SAME_GRAPH = "same-graph"                     # deliberate: upstream expects two schedules of one graph
CHAINED_BUCKETS = "chained-buckets"           # deliberate: packed buckets keep chains apart (their copies cost)


def _all(category):
    return {name: category for name in cc.CONFIGS}


def _unbucketed(module=None):
    """Bucket-count cases: the defaults' "auto" and bucket=None leave them unbucketed."""
    return {"defaults": AUTO_CAP, "no-buckets": BUCKETS_OFF, **({"module": module} if module else {})}


EXPECTED = {
    "aten_raise_comms": _all(RAISE_COMMS),
    "aten_sink_waits_raise_comms": _all(MEMORY_FIRST),
    "aten_basic_all_gather_bucketing": _unbucketed(),
    "aten_reduce_scatter_bucketing": _unbucketed(),
    "aten_bucketing_wait_sink": _unbucketed(),
    "aten_bucketing_split_for_overlap_blocking_no_deps": {"no-buckets": BUCKETS_OFF},   # "auto" merges ag3+ag4
    "aten_bucketing_split_for_overlap": _unbucketed(BUCKET_GRANULARITY),
    "aten_bucket_exposed_with_hidden_single_overlap": _unbucketed(),
    "aten_bucketing_split_for_overlap_blocking_deps_inductor": _unbucketed(BUCKET_GRANULARITY),
    "aten_multidtype_bucketing": _unbucketed(),
    "aten_basic_all_reduce_bucketing": _unbucketed(),
    "compute_raise_comms": _all(MEMORY_FIRST),
    "compute_sink_waits_raise_comms": _all(MEMORY_FIRST),
    "compute_reorder_compute_for_overlap": _all(COMPUTE_REORDER),
    "compute_reorder_compute_for_overlap_custom_runtime_estimation": _all(COMPUTE_REORDER),
    "compute_inductor_default_comms_ordering": {"defaults": MEMORY_FIRST, "no-buckets": MEMORY_FIRST,
                                                "module": BUCKETS_ON},
    "simple_no_change_when_already_optimal": _all(MEMORY_FIRST),
    "unit_can_bucket_independent_collectives": _unbucketed(),
    "unit_cant_bucket_ag_with_rs_hiding_interval_between_hidden": {"module": SAME_GRAPH},
    "unit_cant_bucket_ag_with_rs_hiding_interval_between_exposed": _unbucketed(),
    "unit_can_bucket_all_reduce": _unbucketed(),
    "unit_manual_bucket_splits_dependent_all_reduce": _unbucketed(CHAINED_BUCKETS),
    "unit_no_cross_type_bucketing_ar_and_rs": _unbucketed(),
    "unit_reduce_scatter_coalesced_mode": _all(COALESCED_OP),
    "unit_all_gather_coalesced_mode_falls_back": _unbucketed(),
    "unit_can_bucket_multidtype_collectives": _unbucketed(),
    "unit_can_bucket_with_multiple_hiding_nodes": _unbucketed(),
    "unit_can_bucket_with_convert_dtype_as_hiding_nodes": _unbucketed(),
    "unit_deterministic_mode_no_benchmark_error": _all(MEMORY_FIRST),
    "unit_fusible_nodes_hide_collective": _all(POINTWISE_WINDOW),
    "unit_fusion_regions_hide_collective": _all(POINTWISE_WINDOW),
    "unit_prefetch_prioritizes_larger_hidden_time": _all(PREFETCH_PRIORITY),
    "unit_wait_user_repair_runs_once_after_all_bucket_groups": _unbucketed(CHAINED_BUCKETS),
    "collectives_reorder_peak_memory_bucketed": _unbucketed(BUCKET_GRANULARITY),
    "collectives_all_gather_bucket_multidtype": _unbucketed(),
    "aten_custom_estimator_for_non_compute_nodes": _all(MEMORY_FIRST),
    "aten_multiple_hiding_nodes_bucketing": _unbucketed(),
    "aten_bucketing_with_convert_dtype": _unbucketed(),
    "aten_manual_all_gather_separate_buckets": _unbucketed(MEMORY_FIRST),
    "aten_manual_all_gather_no_bucket": {"defaults": BUCKETS_ON, "no-buckets": MEMORY_FIRST, "module": BUCKETS_ON},
    "aten_manual_all_gather_single_bucket": _unbucketed(BUCKET_GRANULARITY),
    "aten_manual_all_gather_single_bucket_annotated": _unbucketed(BUCKET_GRANULARITY),
    "aten_manual_reduce_scatter_separate_buckets": _unbucketed(MEMORY_FIRST),
    "aten_manual_reduce_scatter_single_bucket": _unbucketed(BUCKET_GRANULARITY),
    "aten_manual_reduce_scatter_no_bucket": {"defaults": MEMORY_FIRST, "no-buckets": MEMORY_FIRST,
                                             "module": BUCKETS_ON},
    "unit_deduplicates_parametrization_waits": _unbucketed(),
    "unit_pre_bucketing_only_merges_fsdp_collectives": _unbucketed(),
    "unit_pre_bucketing_handles_dtype_cast": _unbucketed(),
    "collectives_reduce_scatter_bucket": _unbucketed(),
    "collectives_all_reduce_bucket": _unbucketed(),
}


# Per case under the overlapc options that mirror upstream's own test setup
# (``Case.setup``, ``conformance_cases.UPSTREAM_SETUPS``): how issue 41 counts agreement.
# Every disagreement listed with its category, as above; NO_EQUIVALENT where the setup has
# no overlapc counterpart (counted as a disagreement).
NO_EQUIVALENT = "no-equivalent"               # upstream's setup has no overlapc counterpart
UPSTREAM_EXPECTED: dict[str, str] = {
    "aten_raise_comms": RAISE_COMMS,
    "compute_reorder_compute_for_overlap": COMPUTE_REORDER,
    "compute_reorder_compute_for_overlap_custom_runtime_estimation": COMPUTE_REORDER,
    "unit_cant_bucket_ag_with_rs_hiding_interval_between_hidden": SAME_GRAPH,
    "unit_prefetch_prioritizes_larger_hidden_time": PREFETCH_PRIORITY,
    "unit_manual_bucket_splits_dependent_all_reduce": CHAINED_BUCKETS,
    "unit_wait_user_repair_runs_once_after_all_bucket_groups": COMPUTE_ORDER,
    "collectives_reorder_peak_memory_bucketed": COMPUTE_REORDER,
}


def upstream_outcome(case: cc.Case) -> str:
    """The case's outcome under its upstream setup: as ``outcome``, or NO_EQUIVALENT."""
    if case.setup is None:
        return NO_EQUIVALENT
    return outcome(case, cc.schedule(case, cc.UPSTREAM_SETUPS[case.setup])[2])


def outcome(case: cc.Case, schedule: cc.Schedule) -> str:
    """"agree", COMPUTE_ORDER (compute moved, whatever upstream expects) or "disagree"."""
    if not schedule.compute_order_kept():
        return COMPUTE_ORDER
    return "agree" if case.expect(schedule) else "disagree"


def expected_outcome(case_name: str, config: str) -> str:
    category = EXPECTED.get(case_name, {}).get(config)
    if category is None:
        return "agree"
    return COMPUTE_ORDER if category == COMPUTE_ORDER else "disagree"


def expected_upstream_outcome(case_name: str) -> str:
    category = UPSTREAM_EXPECTED.get(case_name)
    if category is None:
        return "agree"
    return category if category in (NO_EQUIVALENT, COMPUTE_ORDER) else "disagree"


def test_every_upstream_file_is_covered_and_the_list_names_real_cases():
    files = {case.upstream.split("::")[0] for case in cc.CASES}
    assert files == {cc.ATEN, cc.COMPUTE, cc.COLLECTIVES, cc.SIMPLE, cc.UNIT}
    names = [case.name for case in cc.CASES]
    assert len(names) == len(set(names)) >= 40
    assert set(EXPECTED) <= set(names), sorted(set(EXPECTED) - set(names))
    assert all(set(by_config) <= set(cc.CONFIGS) for by_config in EXPECTED.values())
    assert set(UPSTREAM_EXPECTED) <= set(names), sorted(set(UPSTREAM_EXPECTED) - set(names))
    assert all(case.setup is None or case.setup in cc.UPSTREAM_SETUPS for case in cc.CASES)
    assert {name for name, category in UPSTREAM_EXPECTED.items() if category == NO_EQUIVALENT} == {
        case.name for case in cc.CASES if case.setup is None}


@pytest.mark.parametrize("case", cc.CASES, ids=lambda case: case.name)
def test_schedule_agrees_with_upstream_as_listed(fake_pg, case):
    for config, options in cc.CONFIGS.items():
        _, _, schedule = cc.schedule(case, options)   # verify passed inside, with on_error="raise"
        got, want = outcome(case, schedule), expected_outcome(case.name, config)
        if want == "agree":
            assert got == "agree", (f"{case.name} [{config}]: new disagreement ({got}) with {case.upstream}: "
                                    f"{case.says}; order {[name for name, _ in schedule.after]}")
        else:
            assert got == want, (f"{case.name} [{config}]: listed as {EXPECTED[case.name][config]} but now {got}: "
                                 f"remove it from EXPECTED (and docs/conformance.md)")

    got, want = upstream_outcome(case), expected_upstream_outcome(case.name)
    assert got == want, (f"{case.name} [upstream setup {case.setup}]: {got}, listed as "
                         f"{UPSTREAM_EXPECTED.get(case.name, 'agree')}: "
                         "update UPSTREAM_EXPECTED and docs/conformance.md")


def test_each_bucket_carries_its_first_members_module_stack_and_annotation(fake_pg):
    """What upstream's custom_module_stack_fn test asserts of its bucket beyond the count (its
    single bucket is a listed disagreement): a bucket's start and wait carry the module stack
    and ``custom`` annotation of its first member, here one bucket per module."""
    case = next(case for case in cc.CASES if case.name == "aten_manual_all_gather_single_bucket_annotated")
    schedule = cc.schedule(case, cc.UPSTREAM_SETUPS[cc.PLAN_PER_MODULE])[2]
    carried = sorted(schedule.provenance, key=repr)
    expected = [(kind, {"test": (m, "")}, {"module_fqn": "my_" + m})
                for m in ("module_1", "module_2") for kind in ("all_gather_into_tensor", cc.WAIT)]
    assert carried == sorted(expected, key=repr), carried


# ---------------------------------------------------------------- values on 2 gloo ranks


def _job_values(rank, world_size, port):
    """Every case under every configuration and its upstream setup: scheduled outputs equal the unscheduled
    graph's, bit for bit, on this rank's inputs. Returns the mismatches."""
    init_gloo(rank, world_size, port)
    from overlapc.torch_compat import route_gloo_all_gathers

    route_gloo_all_gathers()
    mismatches = []
    for case in cc.CASES:
        inputs = case.inputs(seed=1 + rank)
        setups = [(f"upstream setup {case.setup}", cc.UPSTREAM_SETUPS[case.setup])] if case.setup else []
        for config, options in [*cc.CONFIGS.items(), *setups]:
            before, after, _ = cc.schedule(case, options)
            with torch.no_grad():
                expected, got = tree_leaves(before(*inputs)), tree_leaves(after(*inputs))
            if len(expected) != len(got):
                mismatches.append(f"{case.name} [{config}]: {len(got)} outputs, {len(expected)} expected")
            for i, (e, g) in enumerate(zip(expected, got)):
                if not (e.dtype == g.dtype and torch.equal(e, g)):
                    mismatches.append(f"{case.name} [{config}] output {i}")
    return mismatches


def test_scheduled_values_equal_unscheduled_on_two_gloo_ranks():
    for rank, mismatches in enumerate(run_ranks(_job_values, world_size=2, timeout=240)):
        assert mismatches == [], f"rank {rank}: {mismatches}"


# ---------------------------------------------------------------- the table of docs/conformance.md


def table() -> str:
    """The agreement table (markdown), computed under the fake process group: a cell per
    configuration, then the case under its upstream setup (the count issue 41 asks for)."""
    rows = ["| case | upstream test | upstream expects | " + " | ".join(cc.CONFIGS) + " | upstream's setup |",
            "|---|---|---|" + "---|" * (len(cc.CONFIGS) + 1)]
    agreed = total = per_case = 0
    for case in cc.CASES:
        cells = []
        for config, options in cc.CONFIGS.items():
            got = outcome(case, cc.schedule(case, options)[2])
            agreed += got == "agree"
            total += 1
            cells.append("agree" if got == "agree" else EXPECTED.get(case.name, {}).get(config, f"NEW {got}"))
        got = upstream_outcome(case)
        per_case += got == "agree"
        verdict = "agree" if got == "agree" else UPSTREAM_EXPECTED.get(case.name, f"NEW {got}")
        cells.append(f"{case.setup or 'none'}: {verdict}")
        file, test = case.upstream.split("::")
        rows.append(f"| {case.name} | {file} `{test}` | {case.says} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + (f"\n\nPer case under upstream's setup: {per_case} of {len(cc.CASES)} agree "
                              f"({100 * per_case / len(cc.CASES):.0f}%). Per configuration: {agreed} of {total} "
                              f"({100 * agreed / total:.0f}%).\n")


if __name__ == "__main__":
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    print(table())

"""Collective capture, the local launcher and the report helpers of `evenzero repro`."""

from __future__ import annotations

import pytest

from evenzero.repro.localrun import LaunchError, LaunchOptions, launch
from evenzero.repro.report import condensed, loss_agreement, max_rel_diff, seed_rows


def _capture_worker(ctx, _payload):
    import torch
    import torch.distributed as dist

    from evenzero.plan_report import collective_record as record
    from evenzero.repro.capture import CaptureOptions, CollectiveCapture

    pair = dist.new_group([1, 3])
    a2a = dist.new_group([0, 1])
    labels = {frozenset(range(4)): "dense", frozenset([1, 3]): "ep_size_2"}
    cap = CollectiveCapture(CaptureOptions(labels, exclude_all_to_all_ranks=frozenset([0, 1])))
    t = torch.ones(12)
    with cap.active("backward"):
        dist.all_reduce(t)
        dist.reduce(t[:5], dst=2)
        # Deprecated alias and its replacement: each call must be recorded once.
        dist.reduce_scatter_tensor(torch.empty(3), t)
        dist.reduce_scatter_single(torch.empty(3), t)
        if ctx.rank in (1, 3):
            dist.reduce(t[:7], dst=3, group=pair)
        if ctx.rank in (0, 1):
            dist.all_to_all_single(torch.empty(4), torch.ones(4), group=a2a)  # MoE dispatch
        with cap.phase_as("step"):
            dist.all_gather_into_tensor(torch.empty(8), torch.ones(2))
    dist.all_reduce(t)  # outside the block: not recorded, and originals restored
    assert dist.all_reduce.__name__ == "all_reduce"
    return [record(c) for c in cap.take()] if ctx.rank == 0 else None


def test_capture_records_ops_groups_roots_and_phases():
    calls = launch(_capture_worker, None, LaunchOptions(4, "gloo", timeout_s=120))
    ops = [(c["phase"], c["op"], c["group"], c["group_size"], c["root"], c["numel"]) for c in calls]
    assert ops == [
        ("backward", "all_reduce", "dense", 4, None, 12),
        ("backward", "reduce", "dense", 4, 2, 5),
        ("backward", "reduce_scatter", "dense", 4, None, 12),
        ("backward", "reduce_scatter", "dense", 4, None, 12),
        ("step", "all_gather", "dense", 4, None, 8),
    ]


def _pair_worker(ctx, _payload):
    import torch
    import torch.distributed as dist

    from evenzero.plan_report import collective_record as record
    from evenzero.repro.capture import CaptureOptions, CollectiveCapture

    pair = dist.new_group([0, 1])
    cap = CollectiveCapture(CaptureOptions({frozenset([0, 1]): "experts"}))
    with cap.active():
        dist.reduce(torch.ones(7), dst=1, group=pair)
        dist.broadcast(torch.ones(2), src=1, group=pair)
    return [record(c) for c in cap.calls]


def test_capture_maps_global_root_to_group_rank():
    calls = launch(_pair_worker, None, LaunchOptions(2, "gloo", timeout_s=120))
    assert [(c["op"], c["group"], c["root"], c["numel"]) for c in calls] == [
        ("reduce", "experts", 1, 7), ("broadcast", "experts", 1, 2)]


def _failing_worker(ctx, _payload):
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    import torch.distributed as dist

    dist.barrier()  # rank 0 would wait forever for rank 1: the launcher must not
    return "unreachable"


def test_launcher_reports_a_failing_rank_instead_of_hanging():
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: boom on purpose"):
        launch(_failing_worker, None, LaunchOptions(2, "gloo", timeout_s=120))


def test_condensed_runs():
    assert condensed([5, 5, 5, 1000, 7, 7]) == "3 x 5, 1,000, 2 x 7"
    assert condensed([]) == ""


def test_loss_agreement_flags_a_diverging_exact_system():
    base = [1.0, 0.9, 0.8]
    systems = [{"name": "evenzero", "losses": base},
               {"name": "ddp", "losses": [1.0, 0.9, 0.8 * (1 + 3e-5)]},
               {"name": "deepspeed", "losses": [1.0, 0.95, 0.9]}]
    ok, lines = loss_agreement(systems)
    assert not ok
    assert "from 1.0000 to 0.8000" in lines[0] and "falling" in lines[0]
    assert "FAIL" in lines[1] and "informational" in lines[2]
    systems[1]["losses"] = [1.0, 0.9, 0.8 * (1 + 3e-6)]
    assert loss_agreement(systems)[0]
    assert max_rel_diff([2.0], [1.0]) == 1.0


def test_seed_rows_keep_only_reduces_in_issue_order():
    sys = {"backward_collectives": [
        {"op": "reduce", "root": 7, "offset": 0, "numel": 1000, "group": "dense"},
        {"op": "all_reduce", "root": None, "offset": 0, "numel": 5, "group": "dense"},
        {"op": "reduce", "root": 3, "offset": 1000, "numel": 8000, "group": "dense"}]}
    assert seed_rows(sys) == [(7, 0, 1000, "dense"), (3, 1000, 8000, "dense")]

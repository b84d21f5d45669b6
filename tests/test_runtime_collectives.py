"""Collectives on a group of one rank are never issued: a 1-rank run trains exactly like
single-process torch and no c10d collective runs, from construction to the last step;
an expert group of one rank beside a dense group of two issues nothing of its own."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dist_helpers import CheckResults, run_checks
from test_runtime_models import MLP, assert_same_params, mlp_batch, mlp_loss, train_pair

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})


def _no_collectives(run):
    """Run `run()` and fail if it issued any c10d op (counted at the dispatcher, so
    whatever Python wrapper issued it: collectives, barriers, object gathers)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountC10d(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    with CountC10d() as counted:
        out = run()
    assert counted.calls == [], counted.calls
    return out


def check_single_rank(rank, world, engine_kw, micro=2, clip=0.3, atol=1e-6, use_no_sync=True):
    assert world == 1
    model, ref, opt, norms = _no_collectives(partial(
        train_pair, rank, world, MLP, mlp_loss, mlp_batch, *ADAMW, engine_kw, steps=3,
        micro=micro, clip=clip, use_no_sync=use_no_sync))
    assert_same_params(model, ref, atol=atol)
    for got, want in norms:
        assert abs(got - want) <= max(1e-5, atol) * want, norms
    n = len(opt.plan.backward())
    assert opt.trace[:n] == opt.plan.backward(), "recorded as planned, though not issued"
    assert {c.algorithm for c in opt.trace} == {"local"}, opt.trace
    # The implementation evenzero chose is its own: the groups show torch's defaults.
    assert opt.config.optimizer_impl == "fused", opt.config
    assert all(g["fused"] is None and g["foreach"] is None for g in opt.param_groups)
    report = opt.memory_report()
    if (engine_kw.get("stage", 2) == 2 and engine_kw.get("strategy", "evenzero") == "evenzero"
            and "reduce_dtype" not in engine_kw):  # bucketless: no pool at all
        assert report.gradient_buffers == 0 and report.bucket_pool == 0, report


def check_expert_group_of_one(rank, world):
    """2 ranks, 2 experts: each expert's data-parallel group is one rank."""
    from evenzero import ZeroOptimizer
    from evenzero.moe import MoE, expert_parallel_groups

    torch.manual_seed(0)
    groups = expert_parallel_groups(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, 2, groups, ffn_dim=4))
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, bucket_numel=64,
                        expert_groups={groups.group_name: groups.edp_group})
    for step in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    by_group = {}
    for c in opt.trace:
        by_group.setdefault((c.group, c.group_size), set()).add(c.algorithm)
    assert by_group[(groups.group_name, 1)] == {"local"}, by_group
    assert "local" not in by_group[("dense", 2)], by_group


CHECKS = {
    "stage2": partial(check_single_rank, engine_kw={"stage": 2, "bucket_numel": 100}),
    "stage1": partial(check_single_rank, engine_kw={"stage": 1, "bucket_numel": 100}),
    "auto_bucket": partial(check_single_rank, engine_kw={}),
    "synced_accumulation": partial(check_single_rank, engine_kw={"bucket_numel": 100},
                                   clip=None, use_no_sync=False),
    "overlap_param_gather": partial(check_single_rank, engine_kw={
        "bucket_numel": 100, "overlap_param_gather": True}),
    "deepspeed_schedule": partial(check_single_rank, engine_kw={
        "strategy": "deepspeed-0.6", "bucket_numel": 100}),
    # Gradients rounded to bf16 as they would travel: through a bucket, not bucketless.
    "reduce_in_bf16": partial(check_single_rank, engine_kw={
        "bucket_numel": 100, "reduce_dtype": torch.bfloat16}, atol=1e-3),
}


def single_rank_job(rank: int, world: int) -> dict[str, str | None]:
    return run_checks({name: partial(check, rank, world) for name, check in CHECKS.items()})


def expert_job(rank: int, world: int) -> dict[str, str | None]:
    return run_checks({"expert_group_of_one": partial(check_expert_group_of_one, rank, world)})


RESULTS = CheckResults(single_rank_job, timeout=240)
EXPERT_RESULTS = CheckResults(expert_job, timeout=240)


@pytest.mark.parametrize("check", list(CHECKS))
def test_a_single_rank_issues_no_collective_and_trains_like_torch(check):
    RESULTS.assert_passed(check, 1)


def test_an_expert_group_of_one_rank_issues_nothing():
    EXPERT_RESULTS.assert_passed("expert_group_of_one", 2)

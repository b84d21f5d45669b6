"""ZeroOptimizer trains exactly like single-process training on the global batch.

One spawned gloo job per world size runs every check (spawning dominates the cost);
each check reports its own traceback so a failure names what broke.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from dist_helpers import CheckResults, run_checks
from test_runtime_models import (
    MLP,
    Quirky,
    assert_same_params,
    mlp_batch,
    mlp_loss,
    quirky_batch,
    quirky_loss,
    train_pair,
)
from test_runtime_wholestep import (
    check_bad_input,
    check_equal_to_torch,
    check_same_collectives_as_adamw,
)

ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01})
SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def _plan_matches_trace(opt, backward_repeats: int = 1) -> None:
    backward = opt.plan.backward()
    n = len(backward) * backward_repeats
    assert opt.trace[:n] == backward * backward_repeats, (opt.trace, opt.plan.collectives)
    if opt.plan.strategy == "evenzero":
        # The step's collectives are planned too: the grad-check all-reduce and the gathers.
        assert opt.trace[n:] == opt.plan.step(), (opt.trace[n:], opt.plan.step())


def check_adamw_clip(rank, world, stage):
    model, ref, opt, norms = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *ADAMW,
                                        {"stage": stage, "bucket_numel": 100}, steps=3, clip=0.3)
    assert_same_params(model, ref)
    for got, want in norms:
        assert abs(got - want) <= 1e-5 * want, norms
    assert any(want > 0.3 for _, want in norms), "clip never engaged; lower the threshold"
    _plan_matches_trace(opt)
    assert len(opt.plan.buckets) > 1
    algorithms = {c.algorithm for c in opt.trace if c.op == "reduce_scatter"}
    # gloo's documented choice; a group of one issues nothing
    assert algorithms == ({"all_to_all+sum"} if world > 1 else {"local"}), algorithms
    report = opt.memory_report()
    total = sum(g.numel for g in opt.plan.groups)
    shard_bytes = sum(opt.plan.shard_numel(g.name) for g in opt.plan.groups) * 4
    assert report.gradient_shards == shard_bytes
    # fp32 parameters: the masters are this rank's slices of the flat parameter buffers.
    assert report.master_weights == 0
    # AdamW's two moments, flat, and one `step` scalar per layout piece.
    assert report.optimizer_state == 2 * shard_bytes + 4 * len(opt.plan.layouts), report
    # So a write to a parameter is a write to its master, with no step in between.
    params = dict(model.named_parameters())
    for p in params.values():
        p.data.mul_(-3.0)
    for g in opt.plan.groups:
        master = opt.master_shard(g.name)
        for r in opt.plan.shard_ranges(g.name, opt.group_rank(g.name)):
            torch.testing.assert_close(master[r.shard_offset:r.shard_offset + r.numel],
                                       params[r.param].detach().reshape(-1)[r.start:r.start + r.numel],
                                       rtol=0, atol=0)
    if stage == 2:
        bound = (total / world + opt.plan.padding()) * 4 + 2 * max(b.numel for b in opt.plan.buckets) * 4
        assert report.gradients <= bound, (report, bound)
        assert report.gradient_buffers == 0 and report.pending_grads == 0, report
    else:
        assert report.gradient_buffers == sum(b.numel for b in opt.plan.buckets) * 4, report


def check_accumulate(rank, world, stage, use_no_sync):
    model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *SGD,
                                    {"stage": stage, "bucket_numel": 64}, steps=3, micro=2,
                                    use_no_sync=use_no_sync)
    assert_same_params(model, ref)
    _plan_matches_trace(opt, backward_repeats=1 if use_no_sync else 2)


def check_quirky(rank, world, stage):
    model, ref, opt, _ = train_pair(rank, world, Quirky, quirky_loss, quirky_batch, *ADAMW,
                                    {"stage": stage, "bucket_numel": 40}, steps=3)
    assert_same_params(model, ref)
    names = {s.name for b in opt.plan.layouts for s in b.params}
    assert "frozen.weight" not in names and "head.weight" not in names  # frozen; tied to emb
    assert opt.spec.arrival_source == "measured"
    assert opt.plan.arrival == ("mid.bias", "mid.weight", "emb.weight")
    torch.testing.assert_close(model.frozen.weight, ref.frozen.weight)
    assert model.head.weight is model.emb.weight
    _plan_matches_trace(opt)


def check_deepspeed_schedule(rank, world, stage):
    model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *ADAMW,
                                    {"stage": stage, "strategy": "deepspeed-0.6",
                                     "bucket_numel": 100}, steps=3)
    assert_same_params(model, ref)
    _plan_matches_trace(opt)
    ops = {c.op for c in opt.trace[:len(opt.plan.backward())]}
    assert ops == {"reduce"}, ops


def allreduce_in_halves(spec, world_size, options):
    """A hand-built plan: evenzero's layout, each bucket all-reduced as two segments."""
    from evenzero.strategies.evenzero import plan_evenzero

    p = plan_evenzero(spec, world_size, options)
    backward = []
    for c in p.backward():
        half = c.numel // 2
        backward.append(dataclasses.replace(c, op="all_reduce",
                                            segments=((half, c.numel - half), (0, half))))
    return dataclasses.replace(p, strategy="allreduce-halves",
                               collectives=tuple(backward) + p.step())


def check_handbuilt_plan(rank, world, stage):
    model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *SGD,
                                    {"stage": stage, "strategy": allreduce_in_halves,
                                     "bucket_numel": 100}, steps=2)
    assert_same_params(model, ref)
    assert opt.plan.strategy == "allreduce-halves"
    _plan_matches_trace(opt)


def check_optimizer_variants(rank, world):
    """foreach and fused implementations step flat shards like per-parameter ones."""
    for cls, kw in ((torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
                    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
                    (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}),
                    (torch.optim.Adagrad, {"lr": 0.1})):
        model, ref, _, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, cls, kw,
                                      {"bucket_numel": 100}, steps=2)
        assert_same_params(model, ref)


def check_replan_moves_optimizer_state(rank, world):
    """State that exists before the first backward (a loaded checkpoint) follows its
    parameters when the measured arrival order re-lays the shards out."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = Quirky()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, bucket_numel=40)
    before = opt.plan
    loaded = {}
    for g in before.groups:
        shard = opt.shard_state(g.name)
        master = shard["flats"]["master"]
        loaded[g.name] = {**shard, "flats": {"master": master,
                                             "momentum_buffer": master.detach() * 2 + 1}}
    opt.load_shard_state(loaded, None, None)
    quirky_loss(model, quirky_batch(0, 4)).backward()
    assert opt.plan.layouts != before.layouts, "the test needs a re-layout"
    for g in opt.plan.groups:
        master = opt.master_shard(g.name)
        assert master.numel() == opt.plan.shard_numel(g.name)
        buf = opt.shard_state(g.name)["flats"]["momentum_buffer"]
        owned = torch.zeros_like(master, dtype=torch.bool)
        for r in opt.plan.shard_ranges(g.name, opt.group_rank(g.name)):
            owned[r.shard_offset:r.shard_offset + r.numel] = True
        torch.testing.assert_close(buf[owned], master[owned] * 2 + 1)
        params = dict(model.named_parameters())
        for r in opt.plan.shard_ranges(g.name, opt.group_rank(g.name)):
            torch.testing.assert_close(master[r.shard_offset:r.shard_offset + r.numel],
                                       params[r.param].detach().reshape(-1)[r.start:r.start + r.numel])


def check_native_reduce_scatter(rank, world):
    """The NCCL code path (native reduce_scatter_tensor), forced on gloo."""
    model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *ADAMW,
                                    {"bucket_numel": 100,
                                     "reduce_scatter_algorithm": "reduce_scatter_tensor"}, steps=2)
    assert_same_params(model, ref)
    assert ({c.algorithm for c in opt.trace if c.op == "reduce_scatter"}
            == ({"reduce_scatter_tensor"} if world > 1 else {"local"}))
    _plan_matches_trace(opt)


class _Probe(torch.autograd.Function):
    """Identity whose backward runs when the input's gradient is computed, i.e. last."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None


def check_overlap(rank, world, stage):
    """After the measuring first step, buckets are reduced during backward, not after it."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=stage, bucket_numel=64)
    launched = []  # buckets launched when backward reaches fc2's input (fc1 still to come)
    model.fc2.register_forward_pre_hook(lambda _m, args: (_Probe.apply(
        args[0], lambda: launched.append(len(opt._recorder.pending))),))
    for step in range(3):
        mlp_loss(model, mlp_batch(step, 4)).backward()
        opt.step()
        opt.zero_grad()
    total = len(opt.plan.backward())
    assert total > 2
    assert launched[0] == 0, "the measuring step must not communicate in hooks"
    assert all(0 < n < total for n in launched[1:]), (launched, total)


CHECKS = {
    "overlap_stage1": lambda r, w: check_overlap(r, w, 1),
    "overlap_stage2": lambda r, w: check_overlap(r, w, 2),
    "adamw_clip_stage1": lambda r, w: check_adamw_clip(r, w, 1),
    "adamw_clip_stage2": lambda r, w: check_adamw_clip(r, w, 2),
    "accumulate_no_sync_stage1": lambda r, w: check_accumulate(r, w, 1, True),
    "accumulate_no_sync_stage2": lambda r, w: check_accumulate(r, w, 2, True),
    "accumulate_synced_stage2": lambda r, w: check_accumulate(r, w, 2, False),
    "tied_frozen_unused_stage1": lambda r, w: check_quirky(r, w, 1),
    "tied_frozen_unused_stage2": lambda r, w: check_quirky(r, w, 2),
    "deepspeed_schedule_stage1": lambda r, w: check_deepspeed_schedule(r, w, 1),
    "deepspeed_schedule_stage2": lambda r, w: check_deepspeed_schedule(r, w, 2),
    "handbuilt_allreduce_plan_stage2": lambda r, w: check_handbuilt_plan(r, w, 2),
    "foreach_fused_and_other_optimizers": check_optimizer_variants,
    "native_reduce_scatter_stage2": check_native_reduce_scatter,
    "replan_moves_optimizer_state": check_replan_moves_optimizer_state,
}
# Muon + AdamW (tests/test_runtime_wholestep.py) rides in this job: one spawn per world.
CHECKS.update({"muon_equal_to_torch": check_equal_to_torch,
               "muon_same_collectives_as_adamw": check_same_collectives_as_adamw,
               "muon_bad_input": check_bad_input})


def equivalence_job(rank: int, world: int) -> dict[str, str | None]:
    return run_checks({name: partial(check, rank, world) for name, check in CHECKS.items()})


RESULTS = CheckResults(equivalence_job, timeout=240)


@pytest.mark.parametrize("world", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("check", list(CHECKS))
def test_matches_single_process_training(world, check):
    RESULTS.assert_passed(check, world)

"""Mixed precision: 16-bit parameters with fp32 master shards, reduce dtypes, fp16 loss scaling."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from dist_helpers import CheckResults, run_checks
from evenzero.runtime.precision import LossScaleConfig, LossScaler
from test_runtime_models import MLP, assert_same_params, mlp_batch, mlp_loss, part, train_pair


def _local(rank, world, step, size=4):
    return tuple(part(t, rank, world) for t in mlp_batch(step, size * world))


def check_bf16_params_fp32_masters(rank, world):
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    ref = MLP()  # fp32 reference from the same init, rounded to bf16 like the model
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            p.copy_(q.float())
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.05, bucket_numel=100)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(2):
        x, y = _local(rank, world, step)
        mlp_loss(model, (x.bfloat16(), y.bfloat16())).float().backward()
        opt.step()
        opt.zero_grad()
        mlp_loss(ref, mlp_batch(step, 4 * world)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for g in opt.plan.groups:
        master = opt.master_shard(g.name)
        assert master.dtype == torch.float32
        # The gathered bf16 parameters are the rounded fp32 masters.
        for r in opt.plan.shard_ranges(g.name, opt.group_rank(g.name)):
            value = dict(model.named_parameters())[r.param].detach().reshape(-1)
            torch.testing.assert_close(value[r.start:r.start + r.numel],
                                       master[r.shard_offset:r.shard_offset + r.numel].bfloat16(),
                                       rtol=0, atol=0)
    assert {c.itemsize for c in opt.trace if c.phase == "backward"} == {2}
    # bf16 parameters keep fp32 masters of their own (fp32 ones are the parameters' memory).
    shard_bytes = sum(opt.plan.shard_numel(g.name) for g in opt.plan.groups) * 4
    assert opt.memory_report().master_weights == shard_bytes
    # bf16 gradients cost precision, not correctness: close to the fp32 reference.
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.float(), ref_params[name], rtol=3e-2, atol=3e-2)


def check_reduce_dtype_bf16(rank, world):
    model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, torch.optim.SGD,
                                    {"lr": 0.05}, {"reduce_dtype": "bfloat16", "bucket_numel": 100},
                                    steps=2)
    assert {c.itemsize for c in opt.trace if c.phase == "backward"} == {2}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_same_params(model, ref, rtol=2e-2, atol=2e-3)


def check_fp16_dynamic_loss_scaling(rank, world):
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP().half()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.05, bucket_numel=100,
                        loss_scale_config=LossScaleConfig(init_scale=1024.0, growth_interval=2))
    assert opt.loss_scaler.enabled and opt.loss_scaler.scale == 1024.0
    scales, skipped = [], []
    for step in range(4):
        x, y = _local(rank, world, step)
        before = [p.detach().clone() for p in model.parameters()]
        loss = mlp_loss(model, (x.half(), y.half()))
        if step == 1 and rank == world - 1:
            loss = loss * float("inf")  # an overflow on one rank only
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scaler.scale)
        skipped.append(opt.last_step_skipped)
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert changed != opt.last_step_skipped, (step, changed)
    # Step 1 overflowed somewhere, so every rank skipped it and halved the scale; two
    # good steps later the scale grew back.
    assert skipped == [False, True, False, False], skipped
    assert scales == [1024.0, 512.0, 512.0, 1024.0], scales
    assert opt.step_count == 3
    everyone = [None] * world
    dist.all_gather_object(everyone, [p.detach().float().sum().item() for p in model.parameters()])
    assert all(e == everyone[0] for e in everyone), "ranks diverged"


class RecastGate(torch.nn.Module):
    """The seed case's bug: a bf16 model whose gate re-casts its weight to fp32 in forward.

    In DeepSpeed that replaced the parameter's AccumulateGrad node, detaching ZeRO's hook,
    and the gate's gradient was never reduced. Here the hook sits on the Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.wg = torch.nn.Linear(8, 8, bias=False)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        self.wg.weight.data = self.wg.weight.data.float()
        h = torch.relu(self.wg(x.float())).to(self.out.weight.dtype)
        return self.out(h)


def check_recast_in_forward_keeps_gradient(rank, world):
    from evenzero import ZeroOptimizer

    for stage in (1, 2):
        torch.manual_seed(0)
        model = RecastGate().to(torch.bfloat16)
        start = model.wg.weight.detach().clone()
        opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.5, stage=stage, bucket_numel=32)
        for step in range(3):
            x, y = _local(rank, world, step)
            mlp_loss(model, (x.bfloat16(), y.bfloat16())).float().backward()
            opt.step()
            opt.zero_grad()
        weight = model.wg.weight.detach()
        assert weight.dtype == torch.bfloat16, "the parameter is re-pointed at its bf16 view"
        assert not torch.equal(weight, start), f"stage {stage}: the gate's gradient was lost"
        everyone = [torch.empty_like(weight) for _ in range(world)]
        dist.all_gather(everyone, weight.contiguous())
        assert all(torch.equal(w, weight) for w in everyone), "ranks diverged"


def check_a_replaced_loss_scaler_is_the_one_used(rank, world):
    """`opt.loss_scaler` replaced after construction (as the DeepSpeed drop-in does): the
    reduction divides by the new scaler's scale, with no re-plan in between."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.05, bucket_numel=100)
    opt.loss_scaler = LossScaler(True, LossScaleConfig(init_scale=8.0), dynamic=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        opt.backward(mlp_loss(model, _local(rank, world, step)))
        opt.step()
        opt.zero_grad()
        mlp_loss(ref, mlp_batch(step, 4 * world)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.wait_for_params()
    assert_same_params(model, ref)


CHECKS = {
    "replaced_loss_scaler": check_a_replaced_loss_scaler_is_the_one_used,
    "recast_in_forward_keeps_gradient": check_recast_in_forward_keeps_gradient,
    "bf16_params_fp32_masters": check_bf16_params_fp32_masters,
    "reduce_dtype_bf16": check_reduce_dtype_bf16,
    "fp16_dynamic_loss_scaling": check_fp16_dynamic_loss_scaling,
}


def precision_job(rank, world):
    return run_checks({name: partial(check, rank, world) for name, check in CHECKS.items()})


RESULTS = CheckResults(precision_job, timeout=180)


@pytest.mark.parametrize("check", list(CHECKS))
def test_mixed_precision(check):
    RESULTS.assert_passed(check, 2)


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 5))
def test_loss_scaler_halves_on_overflow_and_grows_after_good_steps(overflows, interval):
    cfg = LossScaleConfig(init_scale=2.0**10, growth_interval=interval, min_scale=1.0)
    scaler = LossScaler(True, cfg)
    expected, good = 2.0**10, 0
    for overflow in overflows:
        scaler.update(overflow)
        if overflow:
            expected, good = max(1.0, expected / 2), 0
        else:
            good += 1
            if good == interval:
                expected, good = expected * 2, 0
        assert scaler.scale == expected
    restored = LossScaler(True, cfg)
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.good_steps) == (scaler.scale, scaler.good_steps)


def test_disabled_scaler_is_identity():
    scaler = LossScaler(False)
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss) is loss and scaler.scale == 1.0
    scaler.update(True)
    assert scaler.scale == 1.0

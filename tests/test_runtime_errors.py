"""Bad input gives the same clear error on every rank, never a hang or a silent wrong answer.

All cases share one spawned 2-rank gloo job; the harness's timeout turns a hang into a
failure. Each case must raise on *every* rank (checked per rank by the parent).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import CheckResults, expected_cases_job
from test_runtime_models import MLP, Branchy, mlp_batch, mlp_loss, part


def _opt(model, cls=torch.optim.SGD, *groups, **kw):
    from evenzero import ZeroOptimizer

    return ZeroOptimizer(model, cls, *groups, **({"lr": 0.1} | kw))


def _zce():
    from evenzero.runtime import ZeroConfigError
    return ZeroConfigError


def _zre():
    from evenzero.runtime import ZeroRuntimeError
    return ZeroRuntimeError


def case_models_differ(rank, world):
    model = MLP(h=16 if rank == 0 else 17)
    _opt(model)


def case_settings_differ(rank, world):
    _opt(MLP(), bucket_numel=64 if rank == 0 else 128)


def case_not_elementwise(rank, world):
    _opt(MLP(), torch.optim.LBFGS)


def case_custom_optimizer_declared_elementwise(rank, world):
    class MySGD(torch.optim.SGD):
        pass
    model = MLP()
    opt = _opt(model, MySGD, elementwise=True)
    mlp_loss(model, tuple(part(t, rank, world) for t in mlp_batch(0, 8))).backward()
    opt.step()


def case_step_without_backward(rank, world):
    _opt(MLP()).step()


def case_step_after_only_no_sync(rank, world):
    model = MLP()
    opt = _opt(model)
    with opt.no_sync():
        mlp_loss(model, mlp_batch(0, 4)).backward()
    opt.step()


def case_group_without_this_rank(rank, world):
    only_zero = dist.new_group([0])
    model = MLP()
    _opt(model, torch.optim.SGD, [{"params": list(model.parameters()), "process_group": only_zero}])


def case_mixed_devices(rank, world):
    model = MLP()
    model.fc2.weight = nn.Parameter(torch.empty(16, 16, device="meta"))
    _opt(model)


def case_expert_without_group(rank, world):
    model = MLP()
    model.head.weight.allreduce = False
    model.head.weight.group_name = "ep_size_2"
    _opt(model)


def case_nothing_trainable(rank, world):
    _opt(MLP().requires_grad_(False))


def case_bad_stage_on_one_rank(rank, world):
    _opt(MLP(), stage=3 if rank == 1 else 2)


def case_clip_inf_norm(rank, world):
    model = MLP()
    opt = _opt(model)
    mlp_loss(model, mlp_batch(0, 4)).backward()
    opt.clip_grad_norm_(1.0, norm_type=float("inf"))


def case_clip_nan_max_norm(rank, world):
    model = MLP()
    opt = _opt(model)
    mlp_loss(model, mlp_batch(0, 4)).backward()
    opt.clip_grad_norm_(float("nan"))


def case_clip_negative_max_norm(rank, world):
    model = MLP()
    opt = _opt(model)
    mlp_loss(model, mlp_batch(0, 4)).backward()
    opt.clip_grad_norm_(-1.0)


def case_clip_inf_max_norm_measures_like_torch(rank, world):
    # torch.nn.utils.clip_grad_norm_(params, inf) returns the norm and leaves the grads.
    model = MLP()
    opt = _opt(model)
    mlp_loss(model, mlp_batch(0, 4)).backward()
    before = [st.grad.clone() for st in opt.groups.values()]
    norm = opt.clip_grad_norm_(float("inf"))
    assert torch.isfinite(norm) and norm > 0
    assert all(torch.equal(b, st.grad) for b, st in zip(before, opt.groups.values(), strict=True))
    opt.step()


def case_fractional_buckets_in_flight_on_one_rank(rank, world):
    _opt(MLP(), max_buckets_in_flight=1.5 if rank == 1 else 2)


def case_infinite_loss_scale(rank, world):
    _opt(MLP(), loss_scale=float("inf"))


def case_grad_on_one_rank_only(rank, world):
    model = Branchy()
    opt = _opt(model)
    x, y = mlp_batch(0, 4)
    mlp_loss(lambda x: model(x, use_extra=rank == 0), (x, y)).backward()
    opt.step()


def case_partial_grads_allowed(rank, world):
    model = Branchy()
    opt = _opt(model, allow_partial_grads=True)
    before = model.extra.weight.detach().clone()
    x, y = mlp_batch(0, 4)
    mlp_loss(lambda x: model(x, use_extra=rank == 0), (x, y)).backward()
    opt.step()
    everyone = [torch.empty_like(before) for _ in range(world)]
    dist.all_gather(everyone, model.extra.weight.detach().contiguous())
    assert all(torch.equal(everyone[0], w) for w in everyone), "ranks diverged"
    assert not torch.equal(before, model.extra.weight), "rank 0's gradient was dropped"


def case_unplanned_gradient(rank, world):
    # DeepSpeed's plan has no collective for a param that gave no gradient when measured;
    # the engine must refuse the gradient rather than drop it (the seed case's lost gate).
    model = Branchy()
    opt = _opt(model, strategy="deepspeed-0.6")
    for use_extra in (False, True):
        mlp_loss(lambda x, u=use_extra: model(x, use_extra=u), mlp_batch(0, 4)).backward()
        opt.step()
        opt.zero_grad()


def case_param_replaced_after_construction(rank, world):
    model = MLP()
    opt = _opt(model)
    model.head.bias = nn.Parameter(torch.zeros(4))
    mlp_loss(model, mlp_batch(0, 4)).backward()
    opt.step()


def case_problem_on_one_rank_is_raised_on_all(rank, world):
    # Only rank 1 replaces a parameter; the problem is found there alone at the end of
    # backward. Raising there only would leave rank 0 waiting in the step's all-reduce.
    from evenzero.runtime import ZeroRuntimeError

    model = MLP()
    opt = _opt(model)
    if rank == 1:
        model.head.bias = nn.Parameter(torch.zeros(4))
    mlp_loss(model, mlp_batch(0, 4)).backward()
    try:
        opt.step()
    except ZeroRuntimeError as e:
        expected = "does not manage it" if rank == 1 else "1 other rank(s) found a problem"
        assert expected in str(e), str(e)
    else:
        raise AssertionError("step() did not raise")


def case_zero_size_parameter_keeps_its_empty_gradient(rank, world):
    # Found by the differential fuzzer (tests/fuzz): an empty parameter used in forward got
    # an (empty) gradient, which the end-of-backward check took for an unmanaged one.
    model = MLP()
    model.empty = nn.Parameter(torch.zeros(0))
    opt = _opt(model)
    x, y = mlp_batch(0, 4)
    mlp_loss(lambda x: model(x) + model.empty.sum(), (x, y)).backward()
    opt.step()
    assert model.empty.grad is not None and model.empty.grad.numel() == 0  # as under DDP


EXPECTED = {
    # case name: (error type, fragments the message must contain); None: must succeed.
    "models_differ": (_zce(), "'fc1.weight'", "differs across ranks", "ranks [1]"),
    "settings_differ": (_zce(), "bucket_numel", "differs across ranks"),
    "not_elementwise": (_zce(), "LBFGS is not a known elementwise optimizer", "elementwise=True"),
    "step_without_backward": (_zre(), "without a backward"),
    "step_after_only_no_sync": (_zre(), "no_sync"),
    "group_without_this_rank": (_zce(), "rank 1:", "does not contain this rank"),
    "mixed_devices": (_zce(), "several devices", "cpu", "meta"),
    "expert_without_group": (_zce(), "'head.weight'", "expert_groups"),
    "nothing_trainable": (_zce(), "no trainable parameters"),
    "bad_stage_on_one_rank": (_zce(), "rank 1:", "stage must be 1 or 2"),
    "clip_inf_norm": (_zce(), "norm_type=2"),
    "clip_nan_max_norm": (_zce(), "max_norm must be a number >= 0"),
    "clip_negative_max_norm": (_zce(), "max_norm must be a number >= 0"),
    "clip_inf_max_norm_measures_like_torch": None,
    "fractional_buckets_in_flight_on_one_rank": (_zce(), "rank 1:", "max_buckets_in_flight must be an integer"),
    "infinite_loss_scale": (_zce(), "loss_scale must be", "finite positive"),
    "grad_on_one_rank_only": (_zre(), "'extra.weight'", "1 of 2 ranks", "allow_partial_grads=True"),
    "unplanned_gradient": (_zre(), "'extra.", "no collective"),
    "param_replaced_after_construction": (_zre(), "'head.bias'", "does not manage"),
    "zero_size_parameter_keeps_its_empty_gradient": None,
    "partial_grads_allowed": None,
    "problem_on_one_rank_is_raised_on_all": None,
    "custom_optimizer_declared_elementwise": None,
}


def errors_job(rank, world):
    return expected_cases_job(globals(), EXPECTED, rank, world)


RESULTS = CheckResults(errors_job, timeout=180)


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_is_a_clear_error_on_every_rank(case):
    RESULTS.assert_passed(case, 2)

"""The step's parameter all-gather overlapped with the next forward, and a rank whose
backward reaches no managed parameter (it must not leave the others waiting)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_helpers import CheckResults, run_checks, run_distributed
from test_runtime_models import MLP, assert_same_params, mlp_batch, mlp_loss, part, train_pair

OVERLAP = {"bucket_numel": 64, "overlap_param_gather": True}


def check_trains_like_reference(rank, world):
    """Overlapped gathers change nothing numerically, and the trace is still the plan."""
    model, ref, opt, norms = train_pair(rank, world, MLP, mlp_loss, mlp_batch, torch.optim.AdamW,
                                        {"lr": 1e-2, "weight_decay": 0.01}, OVERLAP, steps=3,
                                        clip=0.3)
    assert_same_params(model, ref)
    assert len(opt.plan.layouts) > 1
    n = len(opt.plan.backward())
    assert opt.trace[:n] == opt.plan.backward()
    assert opt.trace[n:] == opt.plan.step()


def check_waits_where_params_are_read(rank, world):
    """Forward pre-hooks, state_dict() and opt.module each see the gathered values."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    twin = MLP()
    twin.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, **OVERLAP)
    ref = ZeroOptimizer(twin, torch.optim.SGD, lr=0.1, bucket_numel=64)
    for step in range(3):
        x, y = (part(t, rank, world) for t in mlp_batch(step, 4 * world))
        # Forward right after the step: only the pre-hooks make it see the new values.
        losses = [mlp_loss(m, (x, y)) for m in (model, twin)]
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        for loss, o in zip(losses, (opt, ref), strict=True):
            loss.backward()
            o.step()
            o.zero_grad()
        assert opt._gathers.pending, "the step should return with its gathers in flight"
        if step == 0:
            state = model.state_dict()
            assert not opt._gathers.pending
            for k, v in twin.state_dict().items():
                torch.testing.assert_close(state[k], v, rtol=0, atol=0)
        elif step == 1:
            params = dict(opt.module.named_parameters())
            assert not opt._gathers.pending
            for k, v in twin.named_parameters():
                torch.testing.assert_close(params[k], v, rtol=0, atol=0)
    opt.wait_for_params()
    assert_same_params(model, twin, rtol=0, atol=0)


class ReadsOutsideForward(MLP):
    """Uses fc2's weight without calling fc2, so fc2's pre-hook never runs."""

    def forward(self, x):
        h = F.linear(torch.relu(self.fc1(x)), self.fc2.weight, self.fc2.bias)
        return self.head(torch.relu(h))


def check_early_read_is_an_error(rank, world):
    from evenzero import ZeroOptimizer
    from evenzero.runtime import ZeroRuntimeError

    torch.manual_seed(0)
    model = ReadsOutsideForward()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, **OVERLAP)
    batch = tuple(part(t, rank, world) for t in mlp_batch(0, 4 * world))
    mlp_loss(model, batch).backward()
    opt.step()
    opt.zero_grad()
    mlp_loss(model, batch).backward()
    # Found at the end of backward, raised at the step's all-reduce on every rank.
    with pytest.raises(ZeroRuntimeError, match=r"fc2\.(weight|bias).*wait_for_params"):
        opt.step()
    opt.zero_grad()
    opt.wait_for_params()  # the documented fix: the same forward after the wait is fine
    mlp_loss(model, batch).backward()
    opt.step()


class SkipsParams(nn.Module):
    """On `skip`, the output depends on the input only: no managed parameter gets a grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, skip: bool = False):
        return x * 2.0 if skip else self.fc(x)


def check_idle_rank(rank, world, idle: int, allow: bool):
    from evenzero import ZeroOptimizer
    from evenzero.runtime import ZeroRuntimeError

    torch.manual_seed(0)
    model = SkipsParams()
    ref = SkipsParams()
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.5, allow_partial_grads=allow)
    for step in range(2):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        x.requires_grad_(True)
        model(x, skip=rank == idle).square().mean().backward()
        if not allow:
            with pytest.raises(ZeroRuntimeError, match=rf"fc\.(weight|bias).* on {world - 1} of "
                                                       rf"{world} ranks.*allow_partial_grads"):
                opt.step()
            return
        opt.step()
        opt.zero_grad()
        # Reference: the mean over ranks of the per-rank gradients, the idle rank's zero.
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            if r == idle:
                continue
            xr = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + r))
            ref.zero_grad()
            ref(xr).square().mean().backward()
            for g, p in zip(grads, ref.parameters(), strict=True):
                g += p.grad / world
        with torch.no_grad():
            for g, p in zip(grads, ref.parameters(), strict=True):
                p -= 0.5 * g
    assert_same_params(model, ref)
    assert opt.step_count == 2


def check_gathers_start_while_the_step_runs(rank, world):
    """Each layout's gather is launched as soon as its shard is stepped, before the next
    layout is stepped (every layout its own batch here), and the default step still
    returns with every parameter READY; the result is torch's."""
    from evenzero.runtime import engine
    from evenzero.runtime.lifecycle import ParamState
    from evenzero.runtime.maskedstep import MaskedStep
    from evenzero.runtime.prefetch import ParamGathers

    events: list[str] = []
    real = engine.STEP_BATCH_NUMEL, ParamGathers.launch, MaskedStep._step_tensors

    def launch(self, c, trace):
        events.append("gather")
        return real[1](self, c, trace)

    def step_tensors(self, tensors, grads):
        events.append("step")
        return real[2](self, tensors, grads)

    engine.STEP_BATCH_NUMEL, ParamGathers.launch, MaskedStep._step_tensors = 1, launch, step_tensors
    try:
        model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, torch.optim.AdamW,
                                        {"lr": 1e-2}, {"bucket_numel": 64}, steps=2)
    finally:
        engine.STEP_BATCH_NUMEL, ParamGathers.launch, MaskedStep._step_tensors = real
    layouts = len(opt.plan.layouts)
    assert layouts > 1
    assert events[-2 * layouts:] == ["step", "gather"] * layouts, events
    assert opt._gathers.state is ParamState.READY
    assert_same_params(model, ref)


CHECKS = {
    "gathers_overlap_the_step": check_gathers_start_while_the_step_runs,
    "trains_like_reference": check_trains_like_reference,
    "waits_where_params_are_read": check_waits_where_params_are_read,
    "early_read_is_an_error": check_early_read_is_an_error,
}


def overlap_job(rank: int, world: int) -> dict[str, str | None]:
    return run_checks({name: partial(check, rank, world) for name, check in CHECKS.items()})


RESULTS = CheckResults(overlap_job, timeout=120)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("check", list(CHECKS))
def test_overlapped_param_gather(world, check):
    RESULTS.assert_passed(check, world)


def idle_job(rank: int, world: int) -> None:
    # Each case is a fresh optimizer; the idle rank is 0 (whose arrival order is adopted
    # by everyone) as well as another rank.
    for idle in (world - 1, 0):
        for allow in (True, False):
            check_idle_rank(rank, world, idle, allow)
            dist.barrier()


def test_rank_whose_backward_reaches_no_parameter_does_not_hang():
    # Without the output hook the busy ranks wait in their bucket collectives forever;
    # the timeout turns that into a failure that names where they were stuck.
    run_distributed(idle_job, 3, timeout=60)

"""No hang: outputs of any structure, and a backward that raises on one rank only.

Both used to hang: a module returning a dataclass hid its output tensors from the hook
that runs the end of backward on a rank whose backward reaches no parameter, and a rank
that raised in backward and called zero_grad() (as the error advised) left the other
ranks waiting in their bucket collectives. The safety nets around backward are here too:
step() during backward and torch.autograd.grad, which is not a training backward.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict, namedtuple
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import CheckResults, run_checks
from evenzero.runtime.hooks import output_tensors
from test_runtime_models import MLP, assert_same_params, mlp_batch, mlp_loss, part

# --------------------------------------------------------------------------- structures


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: dict


Pair = namedtuple("Pair", ["logits", "extra"])


@dataclasses.dataclass
class ModelOutputLike(OrderedDict):
    """Like Hugging Face's ModelOutput: an OrderedDict subclass that is also a dataclass."""

    logits: torch.Tensor | None = None
    hidden: tuple | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


class Tokens(tuple):
    """A tuple subclass torch's pytree does not know."""


STRUCTURES = {
    "dataclass": lambda y: Output(y, {"scale": 2.0}),
    "namedtuple": lambda y: Pair(y, None),
    "model_output": lambda y: ModelOutputLike(logits=y, hidden=(y * 0,)),
    "nested": lambda y: [{"out": Tokens((y,))}, "text", 3],
}


def logits_of(out) -> torch.Tensor:
    return output_tensors(out)[0]


def test_output_tensors_are_found_in_any_structure():
    y = torch.ones(2, requires_grad=True)
    z = torch.zeros(3)
    assert output_tensors(y) == [y]
    assert [t is y for t in output_tensors(Output(y, {"z": z}))].count(True) == 1
    assert len(output_tensors(Output(y, {"z": z}))) == 2
    assert output_tensors(Pair(y, [z]))[0] is y
    found = output_tensors(ModelOutputLike(logits=y, hidden=(z, y)))
    assert {id(t) for t in found} == {id(y), id(z)} and len(found) == 2  # y once
    assert output_tensors([{"a": Tokens((y,))}, "s", 1, None]) == [y]
    assert output_tensors(("no", "tensors")) == []


class Structured(nn.Module):
    """Returns its output inside `structure`; on `skip` the output depends on the input
    only, so that rank's backward reaches no managed parameter (as MoE routing can)."""

    def __init__(self, structure: str) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.structure = structure

    def forward(self, x, skip: bool = False):
        y = x * 2.0 if skip else self.fc(x)
        return STRUCTURES[self.structure](y)


def check_idle_rank_with_structured_output(rank, world, structure: str):
    from evenzero import ZeroOptimizer
    from evenzero.runtime import ZeroRuntimeError

    torch.manual_seed(0)
    model = Structured(structure)
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1)
    x = torch.randn(3, 6, requires_grad=True)
    logits_of(model(x, skip=rank == 1)).square().mean().backward()
    with pytest.raises(ZeroRuntimeError, match=r"fc\.(weight|bias).* on 1 of 2 ranks"):
        opt.step()
    opt.zero_grad()
    # And the next step, on which every rank uses the layer, trains normally.
    logits_of(model(x)).square().mean().backward()
    opt.step()


# --------------------------------------------------------------------------- raising


class RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises when told to, half-way through the model's."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise RuntimeError("injected failure in backward")
        return grad, None


class Fragile(MLP):
    """An MLP whose backward raises between the head and fc2 when asked to, so the head's
    bucket is already reduced when it does."""

    def forward(self, x, fail: bool = False):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.head(RaiseInBackward.apply(h, fail))


def sgd_pair(model_class):
    """A ZeroOptimizer model and a single-process SGD reference with the same weights."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = model_class()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, bucket_numel=64)
    return model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.1)


def step_both(opt, ref, ref_opt, batch) -> None:
    """Step the sharded model (its backward done) and the reference on the whole batch."""
    opt.step()
    opt.zero_grad()
    mlp_loss(ref, batch).backward()
    ref_opt.step()
    ref_opt.zero_grad()


def check_recovers_when_one_rank_raises(rank, world, bad_rank: int, bad_step: int, then: str):
    """`bad_rank` raises in backward at `bad_step`; it recovers with `then` (zero_grad, a
    plain forward, or step, which raises); the other ranks' step raises. Afterwards every
    rank trains on exactly the steps that succeeded, like a single process would."""
    from evenzero.runtime import ZeroRuntimeError

    model, opt, ref, ref_opt = sgd_pair(Fragile)
    assert len(opt.plan.buckets) > 1
    for step in range(4):
        batch = mlp_batch(step, 4 * world)
        mine = tuple(part(t, rank, world) for t in batch)
        fail = step == bad_step and rank == bad_rank
        try:
            mlp_loss(lambda x, f=fail: model(x, fail=f), mine).backward()
        except RuntimeError as e:
            assert fail and "injected failure" in str(e), e
            if then == "zero_grad":
                opt.zero_grad()
            elif then == "step":
                with pytest.raises(ZeroRuntimeError, match="the last backward raised on this rank"):
                    opt.step()
            continue  # "forward": the next forward settles it
        if step == bad_step:
            with pytest.raises(ZeroRuntimeError, match="other rank.* found a problem"):
                opt.clip_grad_norm_(10.0)
            with pytest.raises(ZeroRuntimeError, match="call zero_grad"):
                opt.step()  # refused locally: no collective, no hang
            opt.zero_grad()
            continue
        step_both(opt, ref, ref_opt, batch)
    opt.wait_for_params()
    assert_same_params(model, ref)


def check_step_during_backward_is_refused(rank, world):
    from evenzero.runtime import ZeroRuntimeError

    model, opt, ref, ref_opt = sgd_pair(MLP)
    batch = mlp_batch(0, 4 * world)
    mine = tuple(part(t, rank, world) for t in batch)
    out = model(mine[0])
    out.register_hook(lambda g: opt.step())
    with pytest.raises(ZeroRuntimeError, match=r"step\(\) called during backward"):
        torch.nn.functional.mse_loss(out, mine[1]).backward()
    opt.zero_grad()
    for step in range(1, 3):
        batch = mlp_batch(step, 4 * world)
        mlp_loss(model, tuple(part(t, rank, world) for t in batch)).backward()
        step_both(opt, ref, ref_opt, batch)
    opt.wait_for_params()
    assert_same_params(model, ref)


def check_autograd_grad_is_not_a_training_backward(rank, world):
    from evenzero import ZeroOptimizer
    from evenzero.runtime import ZeroRuntimeError

    torch.manual_seed(0)
    model = MLP()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, bucket_numel=64)
    x, y = (part(t, rank, world) for t in mlp_batch(0, 4 * world))
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(mlp_loss(model, (x, y)), x)
    grads = torch.autograd.grad(mlp_loss(model, (x, y)), list(model.parameters()))
    assert gx.shape == x.shape and len(grads) == len(list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ZeroRuntimeError, match="without a backward"):
        opt.step()
    mlp_loss(model, (x, y)).backward()
    opt.step()
    assert opt.trace[:len(opt.plan.backward())] == opt.plan.backward()


CHECKS = {
    **{f"idle_rank_{s}_output": partial(check_idle_rank_with_structured_output, structure=s)
       for s in STRUCTURES},
    "rank1_raises_then_zero_grad": partial(check_recovers_when_one_rank_raises, bad_rank=1,
                                           bad_step=1, then="zero_grad"),
    "rank0_raises_in_first_backward_then_forward": partial(
        check_recovers_when_one_rank_raises, bad_rank=0, bad_step=0, then="forward"),
    "rank1_raises_then_step": partial(check_recovers_when_one_rank_raises, bad_rank=1,
                                      bad_step=2, then="step"),
    "step_during_backward_is_refused": check_step_during_backward_is_refused,
    "autograd_grad_is_not_a_training_backward": check_autograd_grad_is_not_a_training_backward,
}


def recovery_job(rank: int, world: int) -> dict[str, str | None]:
    return run_checks({name: partial(check, rank, world) for name, check in CHECKS.items()},
                      barrier=True)


RESULTS = CheckResults(recovery_job, timeout=180)


@pytest.mark.parametrize("check", list(CHECKS))
def test_no_hang_and_the_same_result_on_every_rank(check):
    RESULTS.assert_passed(check, 2)


def test_backward_raising_under_no_sync_fails_the_next_step_everywhere():
    from dist_helpers import run_distributed

    run_distributed(no_sync_job, 2, timeout=120)


def no_sync_job(rank: int, world: int) -> None:
    from evenzero import ZeroOptimizer
    from evenzero.runtime import ZeroRuntimeError

    torch.manual_seed(0)
    model = Fragile()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, bucket_numel=64)
    x, y = (part(t, rank, world) for t in mlp_batch(0, 4 * world))
    mlp_loss(model, (x, y)).backward()  # the measuring step
    opt.step()
    opt.zero_grad()
    with opt.no_sync():
        try:
            mlp_loss(lambda v: model(v, fail=rank == 1), (x, y)).backward()
        except RuntimeError:
            assert rank == 1
            opt.zero_grad()  # drops this rank's micro-batch; rank 0 still holds its own
    mlp_loss(model, (x, y)).backward()
    expected = "the last backward raised on this rank" if rank == 1 else "other rank.* found"
    with pytest.raises(ZeroRuntimeError, match=expected):
        opt.step()
    opt.zero_grad()
    mlp_loss(model, (x, y)).backward()
    opt.step()
    everyone = [torch.empty_like(model.head.weight) for _ in range(world)]
    dist.all_gather(everyone, model.head.weight.detach().contiguous())
    assert all(torch.equal(everyone[0], w) for w in everyone), "ranks diverged"

"""ZeroOptimizer keeps the PyTorch contract (issue 8): what a torch user does behaves as
in single-process torch.optim on the full batch.

One spawned gloo job per world size runs every check; each compares the model with a
single-process torch model trained with the same user code on the whole global batch,
at 1e-5 relative. The errors half of the contract is in test_runtime_contract_errors.py.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import CheckResults, run_checks
from test_runtime_models import MLP, Branchy, assert_same_params, mlp_batch, mlp_loss, part

ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


class Pair:
    """A ZeroOptimizer model on this rank's slice and a torch model on the whole batch."""

    def __init__(self, rank, world, make_model=MLP, opt_cls=torch.optim.AdamW, opt_kw=ADAMW,
                 groups=None, ref_groups=None, **engine):
        from evenzero import ZeroOptimizer

        self.rank, self.world = rank, world
        torch.manual_seed(0)
        self.model = make_model()
        self.ref = copy.deepcopy(self.model)
        self.opt = ZeroOptimizer(self.model, opt_cls, groups, **opt_kw, **engine)
        self.ref_opt = opt_cls(ref_groups(self.ref) if ref_groups else self.ref.parameters(),
                               **opt_kw)

    def backward(self, step, per_rank=4, **forward_kw):
        x, y = mlp_batch(step, per_rank * self.world)
        mine = part(x, self.rank, self.world), part(y, self.rank, self.world)
        nn.functional.mse_loss(self.model(mine[0], **forward_kw), mine[1]).backward()
        nn.functional.mse_loss(self.ref(x, **forward_kw), y).backward()

    def step(self):
        self.opt.step()
        self.ref_opt.step()

    def both(self, fn):
        fn(self.model)
        fn(self.ref)

    def check(self):
        self.opt.wait_for_params()
        assert_same_params(self.model, self.ref)


# --------------------------------------------------------------------------- 1. an Optimizer


def _hf_cosine(step, warmup, total, cycles=0.5):
    """transformers.get_cosine_schedule_with_warmup's lambda (optimization.py, v4.x)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))


SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.3),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.05, total_steps=6),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(o, 0.7)], milestones=[2]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
    "hf_cosine_with_warmup": lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, functools.partial(_hf_cosine, warmup=2, total=6)),
}


def check_schedulers(rank, world):
    for name, make in SCHEDULERS.items():
        pair = Pair(rank, world)
        assert isinstance(pair.opt, torch.optim.Optimizer)
        scheds = [make(pair.opt), make(pair.ref_opt)]
        for step in range(5):
            pair.backward(step)
            pair.step()
            for s in scheds:
                s.step(1.0) if name == "ReduceLROnPlateau" else s.step()
            pair.opt.zero_grad()
            pair.ref_opt.zero_grad()
            assert [g["lr"] for g in pair.opt.param_groups] == \
                [g["lr"] for g in pair.ref_opt.param_groups], name
        pair.check()


def check_hyperparameter_changes_take_effect(rank, world):
    pair = Pair(rank, world)
    for step in range(3):
        pair.backward(step)
        pair.step()
        pair.both(lambda m: m.zero_grad())
        for opt in (pair.opt, pair.ref_opt):
            opt.param_groups[0]["lr"] *= 0.5
            opt.param_groups[0]["weight_decay"] = 0.3 * step
            opt.param_groups[0]["betas"] = (0.8, 0.95)
    pair.check()


def check_param_groups_are_the_users(rank, world):
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    opt = ZeroOptimizer(model, torch.optim.AdamW, [
        {"params": list(model.fc1.parameters()), "lr": 0.1},
        {"params": list(model.fc2.parameters()) + list(model.head.parameters()),
         "weight_decay": 0.0}], lr=0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]  # AdamW's default
    assert opt.param_groups[0]["params"] == list(model.fc1.parameters())
    assert opt.defaults["betas"] == (0.9, 0.999)
    from evenzero.checkpoint.protocol import ShardedOptimizer

    assert isinstance(opt, ShardedOptimizer)  # what evenzero.checkpoint relies on


def check_step_closure(rank, world):
    pair = Pair(rank, world)
    x, y = mlp_batch(0, 4 * world)
    mine = part(x, rank, world), part(y, rank, world)

    def closure(model, batch):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        return loss

    got = pair.opt.step(partial(closure, pair.model, mine))
    want = pair.ref_opt.step(partial(closure, pair.ref, (x, y)))
    assert got is not None and want is not None
    pair.check()


# --------------------------------------------------------------------------- 4. clearing


ZERO_GRADS = {
    "opt.zero_grad()": lambda p: (p.opt.zero_grad(), p.ref_opt.zero_grad()),
    "opt.zero_grad(set_to_none=False)": lambda p: (p.opt.zero_grad(set_to_none=False),
                                                  p.ref_opt.zero_grad(set_to_none=False)),
    "model.zero_grad()": lambda p: p.both(lambda m: m.zero_grad()),
    "model.zero_grad(set_to_none=False)": lambda p: p.both(lambda m: m.zero_grad(False)),
    "p.grad = None": lambda p: p.both(lambda m: [setattr(q, "grad", None)
                                                 for q in m.parameters()]),
    "never cleared": lambda p: None,
}


def check_gradients_cleared_however_the_user_clears(rank, world, stage):
    for name, clear in ZERO_GRADS.items():
        pair = Pair(rank, world, opt_cls=torch.optim.SGD, opt_kw={"lr": 0.05, "momentum": 0.5},
                    stage=stage)
        for step in range(3):
            pair.backward(step)
            pair.step()
            clear(pair)
        try:
            pair.check()
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def check_accumulation_across_no_sync_and_steps(rank, world, stage):
    pair = Pair(rank, world, stage=stage)
    for step in range(3):
        with pair.opt.no_sync():
            pair.backward(10 * step, per_rank=2)
        pair.backward(10 * step + 1, per_rank=2)
        pair.step()
        if step != 1:  # once, gradients are kept into the next step, as torch allows
            pair.both(lambda m: m.zero_grad())
    pair.check()


def check_what_p_grad_holds(rank, world, stage):
    from evenzero.runtime.shardedgrad import ShardedGrad

    pair = Pair(rank, world, stage=stage)
    x, y = mlp_batch(0, 4)
    with pair.opt.no_sync():
        nn.functional.mse_loss(pair.model(x), y).backward()
    local = {n: p.grad for n, p in pair.model.named_parameters()}
    nn.functional.mse_loss(pair.ref(x), y).backward()
    for n, p in pair.ref.named_parameters():
        assert type(local[n]) is torch.Tensor, type(local[n])
        torch.testing.assert_close(local[n], p.grad)  # under no_sync: local, dense, as DDP
    nn.functional.mse_loss(pair.model(x), y).backward()
    assert all(isinstance(p.grad, ShardedGrad) for p in pair.model.parameters())
    assert "sharded" in repr(pair.model.fc1.weight.grad)


# --------------------------------------------------------------------------- 2. missing grads


def check_missing_gradient_is_not_stepped(rank, world, stage):
    # extra gets a gradient at steps 0 and 3 only: AdamW must neither decay it nor move
    # its moments in between, and its bias correction counts its own two steps.
    pair = Pair(rank, world, make_model=Branchy, stage=stage)
    for step in range(5):
        pair.backward(step, use_extra=step in (0, 3))
        pair.step()
        pair.both(lambda m: m.zero_grad())
        pair.check()
    sd = pair.opt.state_dict()
    steps = {int(s["step"]) for s in sd["state"].values()}
    assert steps <= {2, 5} and 5 in steps, steps


def check_zeroed_gradient_is_stepped(rank, world):
    # set_to_none=False leaves zeros, and torch steps zeros (AdamW decays).
    pair = Pair(rank, world, make_model=Branchy)
    for step in range(3):
        pair.backward(step, use_extra=step == 0)
        pair.step()
        pair.both(lambda m: m.zero_grad(set_to_none=False))
    pair.check()


def check_freezing_after_construction(rank, world):
    pair = Pair(rank, world)
    for step in range(4):
        if step == 1:
            pair.both(lambda m: m.fc1.requires_grad_(False))
        pair.backward(step)
        pair.step()
        pair.both(lambda m: m.zero_grad())
    pair.check()


# --------------------------------------------------------------------------- 3. writes


WRITES = {
    "load_state_dict": lambda m: m.load_state_dict(MLP().state_dict()),
    "copy_": lambda m: m.fc2.weight.data.copy_(torch.full_like(m.fc2.weight, 0.1)),
    "in place": lambda m: torch.no_grad()(lambda: m.fc1.weight.mul_(-1.0))(),
    "p.data.clamp_ (WGAN)": lambda m: [p.data.clamp_(-0.05, 0.05) for p in m.parameters()],
    "p.data = tensor": lambda m: setattr(m.head.weight, "data", torch.ones_like(m.head.weight)),
}


def check_writes_between_steps_are_kept(rank, world, stage):
    for name, write in WRITES.items():
        pair = Pair(rank, world, stage=stage)
        for step in range(3):
            pair.backward(step)
            pair.step()
            pair.both(lambda m: m.zero_grad())
            pair.opt.wait_for_params()
            torch.manual_seed(step)
            write(pair.model)
            torch.manual_seed(step)
            write(pair.ref)
        try:
            pair.backward(3)
            pair.step()
            pair.check()
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def check_bf16_master_keeps_precision_unless_written(rank, world):
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=1e-3)
    for step in range(2):
        x, y = mlp_batch(step, 4)
        nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        opt.step()
        opt.zero_grad()
    shards = opt.state_dict()["evenzero"]["shards"]
    master = next(iter(shards.values()))["master"]
    assert not torch.equal(master, master.bfloat16().float())  # precision beyond bf16
    with torch.no_grad():
        model.head.bias.fill_(2.0)
    x, y = mlp_batch(5, 4)
    nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
    opt.step()
    opt.wait_for_params()
    assert (model.head.bias.float() - 2.0).abs().max() < 0.05  # stepped from 2.0


# --------------------------------------------------------------------------- 5. construction


def check_rank_zero_values_are_broadcast(rank, world):
    from evenzero import ZeroOptimizer

    torch.manual_seed(rank)  # every rank initialises differently
    model = MLP()
    model.register_buffer("running", torch.full((3,), float(rank)))
    torch.manual_seed(0)
    ref = MLP()
    box = [copy.deepcopy(model.state_dict()) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref.load_state_dict({k: v for k, v in box[0].items() if k != "running"})
    opt = ZeroOptimizer(model, torch.optim.AdamW, **ADAMW)
    assert model.running.tolist() == [0.0] * 3
    assert_same_params(model, ref, rtol=0, atol=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    x, y = mlp_batch(0, 4 * world)
    mlp_loss(model, (part(x, rank, world), part(y, rank, world))).backward()
    mlp_loss(ref, (x, y)).backward()
    opt.step()
    ref_opt.step()
    opt.wait_for_params()
    assert_same_params(model, ref)


def check_close_then_rebuild(rank, world):
    from evenzero import ZeroOptimizer

    pair = Pair(rank, world)
    pair.backward(0)
    pair.step()
    pair.opt.close()
    assert all(p.grad is None for p in pair.model.parameters())
    second = ZeroOptimizer(pair.model, torch.optim.AdamW, **ADAMW)
    pair.both(lambda m: m.zero_grad())
    pair.opt = second
    pair.ref_opt = torch.optim.AdamW(pair.ref.parameters(), **ADAMW)  # fresh state, as here
    pair.backward(1)
    pair.step()
    pair.check()
    # `del` releases the model too: its hooks do not keep the optimizer alive.
    del second, pair.opt
    gc.collect()
    pair.opt = ZeroOptimizer(pair.model, torch.optim.AdamW, **ADAMW)


# --------------------------------------------------------------------------- state_dict


SGD_MOMENTUM = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
"""An optimizer without scalar state: a stepped parameter saves `{}`, as a fresh one."""


def check_state_dict_resumes_exactly(rank, world, stage, opt_cls=torch.optim.AdamW, opt_kw=None):
    from evenzero import ZeroOptimizer

    opt_kw = ADAMW if opt_kw is None else opt_kw
    pair = Pair(rank, world, make_model=Branchy, opt_cls=opt_cls, opt_kw=opt_kw, stage=stage)
    sched = torch.optim.lr_scheduler.StepLR(pair.opt, 1, gamma=0.5)
    for step in range(2):
        pair.backward(step, use_extra=step == 0)
        pair.step()
        sched.step()
        pair.opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": pair.model.state_dict(), "opt": pair.opt.state_dict(),
                "sched": sched.state_dict()}, buf)

    def finish(model, opt, sched):
        for step in range(2, 4):
            x, y = mlp_batch(step, 4 * world)
            mlp_loss(model, (part(x, rank, world), part(y, rank, world))).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        opt.wait_for_params()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    want = finish(pair.model, pair.opt, sched)
    torch.manual_seed(1)  # another initialisation: everything must come from the files
    model = Branchy()
    opt = ZeroOptimizer(model, opt_cls, stage=stage, **opt_kw)
    sched2 = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # adds initial_lr first
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    got = finish(model, opt, sched2)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


def check_checkpoint_reshards_per_parameter_steps(rank, world):
    """Saved on 2 ranks, loaded on all of them: each parameter keeps its own step count
    (extra missed steps, so Adam's bias correction differs from the others')."""
    import tempfile

    from evenzero import ZeroOptimizer, checkpoint

    box = [tempfile.mkdtemp(prefix="contract-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    two = dist.new_group([0, 1])
    torch.manual_seed(0)
    ref = Branchy()
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    uses = [True, False, False, True, False]

    def train(model, opt, steps, size, index):
        for step in steps:
            x, y = mlp_batch(step, 12)
            if model is not None:
                mine = part(x, index, size), part(y, index, size)
                mlp_loss_extra = nn.functional.mse_loss(model(mine[0], uses[step]), mine[1])
                mlp_loss_extra.backward()
                opt.step()
                opt.zero_grad()
            nn.functional.mse_loss(ref(x, uses[step]), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()

    model = opt = None
    if rank < 2:
        torch.manual_seed(0)
        model = Branchy()
        opt = ZeroOptimizer(model, torch.optim.AdamW, process_group=two, **ADAMW)
    train(model, opt, range(3), 2, rank)
    if rank < 2:
        checkpoint.save(opt, box[0])
        opt.close()
    dist.barrier()
    torch.manual_seed(7)
    model = Branchy()
    opt = ZeroOptimizer(model, torch.optim.AdamW, bucket_numel=40, **ADAMW)
    checkpoint.load(opt, box[0])
    train(model, opt, range(3, 5), world, rank)
    opt.wait_for_params()
    assert_same_params(model, ref)


# --------------------------------------------------------------------------- the jobs


def _checks(rank, world, names):
    table = {
        "schedulers": partial(check_schedulers, rank, world),
        "hyperparameters": partial(check_hyperparameter_changes_take_effect, rank, world),
        "param_groups": partial(check_param_groups_are_the_users, rank, world),
        "closure": partial(check_step_closure, rank, world),
        "clearing-1": partial(check_gradients_cleared_however_the_user_clears, rank, world, 1),
        "clearing-2": partial(check_gradients_cleared_however_the_user_clears, rank, world, 2),
        "accumulation-1": partial(check_accumulation_across_no_sync_and_steps, rank, world, 1),
        "accumulation-2": partial(check_accumulation_across_no_sync_and_steps, rank, world, 2),
        "p_grad-1": partial(check_what_p_grad_holds, rank, world, 1),
        "p_grad-2": partial(check_what_p_grad_holds, rank, world, 2),
        "missing-1": partial(check_missing_gradient_is_not_stepped, rank, world, 1),
        "missing-2": partial(check_missing_gradient_is_not_stepped, rank, world, 2),
        "zeroed": partial(check_zeroed_gradient_is_stepped, rank, world),
        "freezing": partial(check_freezing_after_construction, rank, world),
        "writes-1": partial(check_writes_between_steps_are_kept, rank, world, 1),
        "writes-2": partial(check_writes_between_steps_are_kept, rank, world, 2),
        "bf16": partial(check_bf16_master_keeps_precision_unless_written, rank, world),
        "broadcast": partial(check_rank_zero_values_are_broadcast, rank, world),
        "close": partial(check_close_then_rebuild, rank, world),
        "state_dict-1": partial(check_state_dict_resumes_exactly, rank, world, 1),
        "state_dict-2": partial(check_state_dict_resumes_exactly, rank, world, 2),
        "state_dict-sgd": partial(check_state_dict_resumes_exactly, rank, world, 2,
                                  *SGD_MOMENTUM),
        "checkpoint_steps": partial(check_checkpoint_reshards_per_parameter_steps, rank, world),
    }
    return {n: table[n] for n in names}


WORLD2 = ["schedulers", "hyperparameters", "param_groups", "closure", "clearing-1", "clearing-2",
          "accumulation-1", "accumulation-2", "p_grad-1", "p_grad-2", "missing-1", "missing-2",
          "zeroed", "freezing", "writes-1", "writes-2", "bf16", "broadcast", "close",
          "state_dict-1", "state_dict-2", "state_dict-sgd"]
WORLD3 = ["missing-2", "clearing-2", "writes-2", "broadcast", "state_dict-2", "checkpoint_steps"]


def contract_job(rank, world):
    return run_checks(_checks(rank, world, WORLD2 if world == 2 else WORLD3), barrier=True)


RESULTS = CheckResults(contract_job, timeout=300)


@pytest.mark.parametrize("check", WORLD2)
def test_contract_world2(check):
    RESULTS.assert_passed(check, 2)


@pytest.mark.parametrize("check", WORLD3)
def test_contract_world3(check):
    RESULTS.assert_passed(check, 3)

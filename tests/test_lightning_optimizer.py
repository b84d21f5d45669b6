"""The user's torch optimizer and LR schedulers, turned into a `ZeroOptimizer` they drive
(`evenzero.lightning.optimizer`), and setup problems raised on every rank
(`evenzero.lightning.agreement`). Two gloo ranks, no Lightning Trainer."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("lightning", reason="evenzero.lightning needs lightning==2.6.6 "
                                        "(pip install -e '.[integrations]')")

from dist_helpers import run_distributed  # noqa: E402


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _schedulers(opt):
    import torch

    sched = torch.optim.lr_scheduler
    chained = sched.SequentialLR(opt, [sched.LinearLR(opt, 0.2, total_iters=2),
                                       sched.StepLR(opt, step_size=2, gamma=0.5)], milestones=[2])
    return [chained, sched.ChainedScheduler([sched.ExponentialLR(opt, 0.9)], optimizer=opt)]


def _groups(model, **first):
    return [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1, "name": "w",
             **first},
            {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0, "name": "b"}]


def _schedulers_drive_the_zero_optimizer(rank, world):
    import torch

    from evenzero.lightning.optimizer import repoint_schedulers, zero_optimizer_from
    from evenzero.runtime import ZeroConfig

    ref_model, model = _model(), _model()
    ref = torch.optim.AdamW(_groups(ref_model), lr=0.05)
    ref_scheds = _schedulers(ref)
    user = torch.optim.AdamW(_groups(model), lr=0.05)
    scheds = _schedulers(user)
    zero = zero_optimizer_from(model, user, ZeroConfig(bucket_numel=64))
    repoint_schedulers(scheds, user, zero)
    assert user.param_groups is zero.param_groups
    assert [g["name"] for g in zero.param_groups] == ["w", "b"]
    assert all(s.optimizer is zero for s in scheds)
    assert all(c.optimizer is zero for s in scheds for c in s._schedulers)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))  # same batch everywhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if the step is not tracked
        for _ in range(5):
            for m, o, ss in ((ref_model, ref, ref_scheds), (model, zero, scheds)):
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
                for s in ss:
                    s.step()
    lrs = [[g["lr"] for g in o.param_groups] for o in (ref, zero)]
    assert lrs[0] == lrs[1], lrs
    diff = max((a - b).abs().max().item()
               for a, b in zip(ref_model.parameters(), model.parameters(), strict=True))
    assert diff <= 1e-6, diff
    zero.close()




def _conversion_problems(rank, world):
    import torch

    from evenzero.lightning.agreement import raise_on_every_rank
    from evenzero.lightning.optimizer import conversion_problem
    from evenzero.runtime import ZeroConfigError

    model = _model()
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    frozen = torch.optim.SGD([{"params": model[0].parameters()},
                              {"params": model[2].parameters()}], lr=0.1)
    assert "param group 0" in conversion_problem(model, frozen)
    used = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    model[2].weight.grad = torch.ones_like(model[2].weight)
    used.step()
    assert "already holds optimizer state" in conversion_problem(model, used)
    assert "not a torch.optim.Optimizer" in conversion_problem(model, object())
    assert conversion_problem(model, torch.optim.SGD(model[2].parameters(), lr=0.1)) is None
    # A problem found on rank 1 only is raised on rank 0 too (not left in a collective).
    with pytest.raises(ZeroConfigError) as e:
        raise_on_every_rank("bad setup here" if rank == 1 else None)
    assert str(e.value) == ("bad setup here" if rank == 1 else "rank 1: bad setup here")
    raise_on_every_rank(None)


def _checks(rank, world):
    _schedulers_drive_the_zero_optimizer(rank, world)
    _conversion_problems(rank, world)


def test_schedulers_drive_the_zero_optimizer_and_problems_are_agreed():
    # One job: each spawned rank imports Lightning (evenzero.lightning's package), seconds.
    run_distributed(_checks, 2, timeout=300)


def test_import_evenzero_does_not_import_lightning():
    import subprocess
    import sys

    code = ("import sys, evenzero, evenzero.runtime, evenzero.checkpoint, evenzero.deepspeed\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'lightning_fabric'))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

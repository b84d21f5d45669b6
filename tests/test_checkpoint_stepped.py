"""Checkpoints keep which parameters were stepped: SGD with momentum keeps no scalar state,
yet torch starts its momentum buffer from the gradient only at a parameter's first step.

A run saved mid-training and loaded into a fresh optimizer (same or another world size,
or through the consolidated export) must continue exactly like the uninterrupted run,
including a parameter that has never had a gradient (it must still start fresh).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist_helpers import run_distributed

SGD = {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "weight_decay": 0.01}
SAVED_AT, MORE = 2, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.late = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        # `late` gets its first gradient only after the save.
        return self.fc2(h) + (self.late(h) if step > SAVED_AT else 0.0)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    per = 12 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _build(bucket: int):
    import evenzero

    torch.manual_seed(0)
    model = Net()
    return model, evenzero.ZeroOptimizer(model, torch.optim.SGD, bucket_numel=bucket, **SGD)


def _train(model, opt, steps, rank: int, world: int) -> None:
    for step in steps:
        x, y = _batch(step, rank, world)
        F.cross_entropy(model(x, step), y).backward()
        opt.step()
        opt.zero_grad()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save(rank: int, world: int, root: str) -> None:
    from evenzero import checkpoint
    from evenzero.checkpoint.consolidate import export_consolidated

    model, opt = _build(bucket=64)
    _train(model, opt, range(1, SAVED_AT + 1), rank, world)
    checkpoint.save(opt, root + "/sharded")
    export_consolidated(opt, root + "/whole")
    opt.close()


def _resume(rank: int, world: int, root: str, how: str) -> dict[str, torch.Tensor]:
    from evenzero import checkpoint
    from evenzero.checkpoint.consolidate import import_consolidated

    model, opt = _build(bucket=40)  # another bucket size: another layout
    if how == "sharded":
        checkpoint.load(opt, root + "/sharded")
    else:
        import_consolidated(opt, root + "/whole")
    _train(model, opt, range(SAVED_AT + 1, SAVED_AT + MORE + 1), rank, world)
    opt.wait_for_params()
    return {n: p.tolist() for n, p in _params(model).items()}  # plain data between processes


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    for step in range(1, SAVED_AT + MORE + 1):
        x, y = _batch(step, 0, 1)
        F.cross_entropy(model(x, step), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_resume_keeps_sgd_momentum_and_never_stepped_parameters(tmp_path):
    want = _reference()
    run_distributed(_save, 2, (str(tmp_path),), timeout=180)
    for world, how in ((2, "sharded"), (3, "sharded"), (2, "consolidated")):
        got = run_distributed(_resume, world, (str(tmp_path), how), timeout=180)[0]
        for name, value in want.items():
            torch.testing.assert_close(torch.tensor(got[name]), value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, w=world, h=how: f"{h} at {w} "
                                       f"ranks, {n}: {m}")

"""evenzero never draws from the user's random generators (issue 21).

The README loop under DDP and under evenzero with its defaults (`bucket_numel="auto"`,
so the run-time refinement and its quick calibration run) leaves torch's CPU and CUDA
RNG states, numpy's and Python's equal after every step; a run resumed with the
README's recipe (the RNG and the data position in the checkpoint's `extra`) is
bit-identical to an uninterrupted one. The model has dropout and the data is drawn from
the global generator, as in a user's script, so a stray draw changes the losses too.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import run_distributed

STEPS = 6


def build_model() -> nn.Module:
    # Under 65,536 elements: every bucket size the auto choice can try is one bucket.
    # A resume where the refined size cuts several buckets (and would lay the shards out
    # otherwise without the checkpoint's plan choices) is tests/test_checkpoint_planchoices.py.
    return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.25), nn.ReLU(), nn.Linear(64, 8))


def rng_states() -> dict:
    states = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state()[1].copy(),
              "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def readme_loop(rank: int, world_size: int, system: str) -> tuple[list[dict], list[float]]:
    """The README's loop (clip, step, zero_grad), data drawn from the global generator."""
    import evenzero

    torch.manual_seed(rank)
    np.random.seed(rank)
    random.seed(rank)
    model = build_model()
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        forward = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        forward = model
        opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    states, losses = [rng_states()], []
    for _ in range(STEPS):
        batch = torch.randn(16, 32)
        loss = forward(batch).pow(2).mean()
        loss.backward()
        if system == "ddp":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append(rng_states())
    if system != "ddp":
        note = opt.plan.notes[-1]
        assert "refined at run time" in note and "(1 bucket)" in note, opt.plan.notes
        opt.close()
    return states, losses


def same_rng_under_ddp_and_evenzero(rank: int, world_size: int) -> None:
    ddp_states, ddp_losses = readme_loop(rank, world_size, "ddp")
    ez_states, ez_losses = readme_loop(rank, world_size, "evenzero")
    for step, (a, b) in enumerate(zip(ddp_states, ez_states, strict=True)):
        for kind in a:
            if kind == "cuda":
                same = all(torch.equal(x, y) for x, y in zip(a[kind], b[kind], strict=True))
            elif kind == "numpy":
                same = np.array_equal(a[kind], b[kind])
            elif kind == "python":
                same = a[kind] == b[kind]
            else:
                same = torch.equal(a[kind], b[kind])
            assert same, f"rank {rank}: {kind} RNG state differs from DDP's after step {step}"
    # The same dropout masks and batches: the same training, to float rounding.
    assert ez_losses == pytest.approx(ddp_losses, rel=1e-5)


def test_readme_loop_leaves_the_rng_as_ddp_does():
    run_distributed(same_rng_under_ddp_and_evenzero, 2, timeout=240)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrating_cuda_compute_leaves_the_rng():
    run_distributed(_measure_compute_on_cuda, 1, timeout=240)


def _measure_compute_on_cuda(rank: int, world_size: int) -> None:
    from evenzero.calibration import measure_compute

    before = rng_states()
    measure_compute(torch.device("cuda", 0))
    after = rng_states()
    assert all(torch.equal(x, y) for x, y in zip(before["cuda"], after["cuda"], strict=True))
    assert torch.equal(before["cpu"], after["cpu"])


def calibration_leaves_the_rng(rank: int, world_size: int) -> None:
    from evenzero.calibration import measure_compute

    torch.manual_seed(7)
    before = rng_states()
    measure_compute(torch.device("cpu"))  # what `evenzero.calibration.measure` times
    after = rng_states()
    assert torch.equal(before["cpu"], after["cpu"]), "measure_compute drew from torch's RNG"


def test_calibration_leaves_the_rng():
    run_distributed(calibration_leaves_the_rng, 2, timeout=240)


# --------------------------------------------------------------------------- resume


def train(opt, forward, start: int, stop: int, ckpt: str | None, save_at: int | None,
          sched) -> list[float]:
    """The README's resume loop: a step draws its batch from the global generator."""
    from evenzero import checkpoint

    losses = []
    for step in range(start, stop):
        batch = torch.randn(16, 32)
        loss = forward(batch).pow(2).mean()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save_at is not None and step + 1 == save_at:
            checkpoint.save(opt, ckpt, extra={"scheduler": sched.state_dict(),
                                              "data": {"next_batch": step + 1},
                                              "rng": torch.get_rng_state()})
    return losses


def resumed_equals_uninterrupted(rank: int, world_size: int, where: str) -> None:
    import evenzero
    from evenzero import checkpoint

    total, stop_at = 10, 6

    def start(seed: int):
        torch.manual_seed(seed)
        model = build_model()
        opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return model, opt, sched

    model, opt, sched = start(rank)
    reference = train(opt, model, 0, total, None, None, sched)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt.close()

    model, opt, sched = start(rank)
    first = train(opt, model, 0, stop_at, f"{where}/ckpt", stop_at, sched)
    opt.close()
    dist.barrier()

    # A new start, as a restarted job makes one: other weights, another RNG state.
    model, opt, sched = start(1000 + rank)
    resumed = checkpoint.load(opt, f"{where}/ckpt")
    sched.load_state_dict(resumed.extra["scheduler"])
    torch.set_rng_state(resumed.extra["rng"])
    begin = resumed.extra["data"]["next_batch"]
    assert begin == stop_at
    rest = train(opt, model, begin, total, None, None, sched)
    # The saving run's refined bucket size, taken over from the checkpoint: not refined again.
    assert opt.plan.notes and "the loaded checkpoint's" in opt.plan.notes[-1], opt.plan.notes
    opt.close()
    assert first + rest == reference, (rank, first + rest, reference)
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), f"rank {rank}: {k} differs after the resumed run"


def test_resume_with_defaults_is_bit_identical(tmp_path):
    run_distributed(resumed_equals_uninterrupted, 2, args=(str(tmp_path),), timeout=300)

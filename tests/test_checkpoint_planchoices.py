"""A checkpoint carries what its run settled about the plan (`evenzero.checkpoint.planchoices`).

With the default `bucket_numel="auto"`, a run resumed through `evenzero.checkpoint.load` at
the saving world size executes the saving run's plan (its refined bucket size, its
measured arrival order) and refines nothing, so with the README's resume recipe (RNG and
data position in `extra`) and clipping on it trains bit for bit as the run that was never
interrupted (issue 21). At another world size the run refines its own bucket size; a fixed
`bucket_numel` is kept.

The refinement is forced, so the checks are deterministic: rank 0's choice
(`autotune.decide`) is SAVED in the runs that save and OTHER in the runs that load. Without
the adoption the resumed run lays out OTHER's buckets, the step check sums the chunked
gradient norm in another order and the clipped steps differ in the last bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import CheckResults, run_checks

SAVED, OTHER, FIXED = 512, 2048, 1024
"""Bucket sizes (elements): every one cuts the model below (10,346 elements) into several
buckets, where the construction-time choice is one. SAVED's and OTHER's shards cut the
step check's 256-element norm rows differently, so their clipped steps differ in the
last bits (a model whose sizes are multiples of 256 would hide that)."""
TOTAL, STOP = 8, 4
"""Steps of the uninterrupted run, and the step the interrupted one saves at."""


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(37, 97), nn.Dropout(0.25), nn.ReLU(), nn.Linear(97, 61),
                         nn.ReLU(), nn.Linear(61, 11))


class Forced:
    """Within the block, rank 0's refinement chooses `numel`; `calls` counts its choices."""

    def __init__(self, numel: int) -> None:
        self.numel, self.calls = numel, 0

    def __enter__(self) -> Forced:
        from evenzero.runtime import autotune

        self.real = autotune.decide

        def decide(spec, world_size, timings, cost, options):
            self.calls += 1
            return self.numel, f"bucket_numel auto: {self.numel} elements, forced by the test"

        autotune.decide = decide
        return self

    def __exit__(self, *exc) -> None:
        from evenzero.runtime import autotune

        autotune.decide = self.real


def start(seed: int, group=None, **engine):
    """A new start, as a (re)started job makes one: its own weights and RNG state."""
    import evenzero

    torch.manual_seed(seed)
    model = build_model()
    opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01,
                                 process_group=group, **engine)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train(model, opt, sched, first: int, stop: int, ckpt: str | None = None,
          save_at: int | None = None) -> list[float]:
    """The README's resume loop, clipped: a step draws its batch (and dropout) from the
    global generator; at `save_at` it saves the scheduler, data position and RNG."""
    from evenzero import checkpoint

    losses = []
    for step in range(first, stop):
        loss = model(torch.randn(16, 37)).pow(2).mean()
        loss.backward()
        opt.clip_grad_norm_(0.05)  # below every step's norm: every step is clipped
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save_at is not None and step + 1 == save_at:
            checkpoint.save(opt, ckpt, extra={"scheduler": sched.state_dict(),
                                              "data": {"next_batch": step + 1},
                                              "rng": torch.get_rng_state()})
    return losses


def resume(opt, sched, ckpt: str):
    """The README's recipe; returns (manifest, first step to run)."""
    from evenzero import checkpoint

    resumed = checkpoint.load(opt, ckpt)
    sched.load_state_dict(resumed.extra["scheduler"])
    torch.set_rng_state(resumed.extra["rng"])
    return resumed, resumed.extra["data"]["next_batch"]


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_resumed_run_is_bit_identical(rank: int, root: str) -> None:
    ckpt = f"{root}/same-world"
    with Forced(SAVED):
        model, opt, sched = start(rank)
        reference = train(model, opt, sched, 0, TOTAL)
        final, plan = params(model), opt.plan
        opt.close()
        model, opt, sched = start(rank)
        first = train(model, opt, sched, 0, STOP, ckpt, STOP)
        opt.close()
    assert plan.bucket_numel == SAVED and len(plan.buckets) > 1, plan
    with Forced(OTHER) as forced:
        model, opt, sched = start(1000 + rank)
        manifest, begin = resume(opt, sched, ckpt)
        rest = train(model, opt, sched, begin, TOTAL)
    assert begin == STOP
    assert first + rest == reference, (rank, first + rest, reference)
    for k, v in params(model).items():
        assert torch.equal(v, final[k]), f"rank {rank}: {k} differs after the resumed run"
    assert forced.calls == 0, "the resumed run refined its bucket size again"
    assert opt.plan == dataclasses.replace(plan, notes=opt.plan.notes)  # the same plan
    assert "the loaded checkpoint's" in opt.plan.notes[-1], opt.plan.notes
    assert manifest.bucket_numel == SAVED and manifest.arrival == plan.arrival
    opt.close()


def check_another_world_size_refines_its_own(rank: int, root: str) -> None:
    ckpt = f"{root}/one-rank"
    alone = dist.new_group([0])  # every rank takes part in making a group
    if rank == 0:
        model, opt, sched = start(0, alone)
        train(model, opt, sched, 0, 3, ckpt, 3)
        opt.close()
    dist.barrier()
    with Forced(OTHER) as forced:
        model, opt, sched = start(1000 + rank)
        manifest, begin = resume(opt, sched, ckpt)
        train(model, opt, sched, begin, begin + 3)
    # One rank refines nothing, so its bucket size was settled, and it is not adopted.
    assert manifest.world_size == 1 and manifest.bucket_numel is not None
    assert manifest.bucket_numel != OTHER
    assert opt.plan.bucket_numel == OTHER, opt.plan.notes
    assert "refined at run time" in opt.plan.notes[-1], opt.plan.notes
    assert forced.calls == (rank == 0)
    opt.close()


def check_fixed_bucket_numel_is_kept(rank: int, root: str) -> None:
    ckpt = f"{root}/fixed"
    with Forced(SAVED):
        model, opt, sched = start(rank)
        train(model, opt, sched, 0, 3, ckpt, 3)
        saved = opt.plan
        opt.close()
    with Forced(OTHER) as forced:
        model, opt, sched = start(1000 + rank, bucket_numel=FIXED)
        manifest, begin = resume(opt, sched, ckpt)
        after_load = opt.plan
        train(model, opt, sched, begin, begin + 2)
    assert manifest.bucket_numel == SAVED
    assert after_load.bucket_numel == opt.plan.bucket_numel == FIXED
    assert after_load.arrival == saved.arrival  # the measured order is taken over still
    assert "fixed by bucket_numel=1024" in opt.plan.notes[-1], opt.plan.notes
    assert forced.calls == 0
    opt.close()


def check_saved_before_refinement_refines_again(rank: int, root: str) -> None:
    """Saved after one backward: the arrival order was measured, the bucket size not yet
    refined; the resumed run refines its own, as the saving run would have."""
    ckpt = f"{root}/early"
    with Forced(SAVED):
        model, opt, sched = start(rank)
        train(model, opt, sched, 0, 1, ckpt, 1)
        saved = opt.plan
        opt.close()
    with Forced(OTHER) as forced:
        model, opt, sched = start(1000 + rank)
        manifest, begin = resume(opt, sched, ckpt)
        train(model, opt, sched, begin, begin + 3)
    assert manifest.bucket_numel is None and manifest.arrival == saved.arrival
    assert opt.plan.bucket_numel == OTHER and forced.calls == (rank == 0)
    assert "refined at run time" in opt.plan.notes[-1], opt.plan.notes
    opt.close()


def check_a_failure_on_one_rank_replans_no_rank(rank: int, root: str) -> None:
    """The ranks agree that every one found the checkpoint before any re-plans: a problem
    on rank 1 alone is raised on both, and neither plan has changed."""
    import evenzero.checkpoint as checkpoint_package
    from evenzero import checkpoint
    from evenzero.checkpoint import CheckpointError

    ckpt = f"{root}/agreed"
    with Forced(SAVED):
        model, opt, sched = start(rank)
        train(model, opt, sched, 0, 3, ckpt, 3)
        opt.close()
    model, opt, sched = start(1000 + rank)
    before, real = opt.plan, checkpoint_package.choices_to_adopt

    def failing(*args):
        raise CheckpointError("this rank read a damaged arrival order")

    checkpoint_package.choices_to_adopt = failing if rank == 1 else real
    try:
        with pytest.raises(CheckpointError, match="rank 1: this rank read a damaged arrival"):
            checkpoint.load(opt, ckpt)
    finally:
        checkpoint_package.choices_to_adopt = real
    assert opt.plan is before
    resume(opt, sched, ckpt)  # the same load goes through once every rank can read it
    assert opt.plan.bucket_numel == SAVED
    opt.close()


CHECKS = {"bit_identical": check_resumed_run_is_bit_identical,
          "another_world_size": check_another_world_size_refines_its_own,
          "fixed": check_fixed_bucket_numel_is_kept,
          "before_refinement": check_saved_before_refinement_refines_again,
          "agreed_failure": check_a_failure_on_one_rank_replans_no_rank}


def job(rank: int, world: int, root: str) -> dict[str, str | None]:
    return run_checks({name: (lambda c=c: c(rank, root)) for name, c in CHECKS.items()},
                      barrier=True)


RESULTS = CheckResults(job, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("planchoices"))


@pytest.mark.parametrize("check", list(CHECKS))
def test_plan_choices_on_resume(check, root):
    RESULTS.assert_passed(check, 2, root)


# --------------------------------------------------------------------------- no processes


def _manifest(world: int, strategy: str = "evenzero", bucket_numel: int | None = SAVED,
              arrival: tuple[str, ...] | None = ("b", "a")):
    from evenzero.checkpoint.format import Manifest

    return Manifest(5, 5, world, strategy, "test", "torch.optim.adamw.AdamW", (), (), (),
                    bucket_numel=bucket_numel, arrival=arrival)


def test_what_a_load_adopts():
    from types import SimpleNamespace

    from evenzero.checkpoint import CheckpointError
    from evenzero.checkpoint.planchoices import choices_to_adopt
    from evenzero.checkpoint.state import RankPlace
    from evenzero.spec import ModelSpec, ParamSpec
    from evenzero.strategies import plan

    opt = SimpleNamespace(plan=plan(ModelSpec((ParamSpec("a", (300,)), ParamSpec("b", (70,)))), 2))
    place = RankPlace(0, 2, torch.device("cpu"), None, {})
    assert choices_to_adopt(_manifest(2), opt, place, "ckpt") == {"bucket_numel": SAVED,
                                                                  "arrival": ("b", "a")}
    assert choices_to_adopt(_manifest(2, bucket_numel=None), opt, place, "ckpt") == {
        "bucket_numel": None, "arrival": ("b", "a")}
    # Another world: its choices were made for it. Another strategy: another plan.
    assert choices_to_adopt(_manifest(4), opt, place, "ckpt") is None
    assert choices_to_adopt(_manifest(2, "deepspeed-0.6"), opt, place, "ckpt") is None
    assert choices_to_adopt(_manifest(2, bucket_numel=None, arrival=None), opt, place,
                            "ckpt") is None
    with pytest.raises(CheckpointError, match=r"ckpt: the saved arrival order names parameter\(s\) "
                                              r"\['c'\] that this run does not train"):
        choices_to_adopt(_manifest(2, arrival=("b", "c", "a")), opt, place, "ckpt")

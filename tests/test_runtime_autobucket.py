"""ZeroOptimizer's default bucket size, "auto": chosen at construction, refined once after
the first backwards from what the job measures, agreed by every rank, recorded in
`opt.plan`; training across the re-layout is the same as single-process torch.

One spawned gloo job per world size runs every check (`run_checks`).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dist_helpers import CheckResults, run_checks
from test_runtime_equivalence import ADAMW, SGD, _Probe
from test_runtime_models import MLP, assert_same_params, mlp_batch, mlp_loss, part, train_pair

FORCED = 64
"""The size the checks force the refinement to choose: several buckets of the MLP (484
elements), where the construction-time choice is one."""


class _Forced:
    """Within the block, rank 0's refinement chooses FORCED (after making its real choice,
    so that path runs too), and every plan the optimizer executes (at construction, then
    each one installed) is recorded."""

    def __enter__(self):
        from evenzero.runtime import autotune
        from evenzero.runtime.engine import ShardEngine

        self.real = autotune.decide, ShardEngine.__init__, ShardEngine.install
        self.installed, self.real_choice = [], []
        real_decide, real_init, real_install = self.real

        def decide(spec, world_size, timings, cost, options):
            numel, _ = real_decide(spec, world_size, timings, cost, options)
            self.real_choice.append(numel)
            return FORCED, f"bucket_numel auto: {FORCED} elements, forced by the test"

        def init(engine, plan, *args, **kwargs):
            self.installed.append(plan)
            return real_init(engine, plan, *args, **kwargs)

        def install(engine, plan, previous):
            self.installed.append(plan)
            return real_install(engine, plan, previous)

        autotune.decide, ShardEngine.__init__, ShardEngine.install = decide, init, install
        return self

    def __exit__(self, *exc):
        from evenzero.runtime import autotune
        from evenzero.runtime.engine import ShardEngine

        autotune.decide, ShardEngine.__init__, ShardEngine.install = self.real


def check_relayout_trains_like_torch(rank, world, stage):
    with _Forced() as forced:
        model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *ADAMW,
                                        {"stage": stage}, steps=4)
    assert_same_params(model, ref)
    first, last = forced.installed[0], forced.installed[-1]
    assert first.bucket_numel != FORCED and len(first.buckets) == 1, first
    assert last.layouts != first.layouts, "the check needs a re-layout after a step"
    assert opt.plan is last and opt.plan.bucket_numel == FORCED and len(opt.plan.buckets) > 1
    assert opt.plan.notes[-1].startswith(f"bucket_numel auto: {FORCED} elements, forced")
    assert "refined at run time on rank 0" in opt.plan.notes[-1]
    assert bool(forced.real_choice) == (rank == 0)  # rank 0 alone decides


def check_relayout_under_accumulation(rank, world, stage):
    with _Forced():
        model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *SGD,
                                        {"stage": stage}, steps=3, micro=2)
    assert_same_params(model, ref)
    assert opt.plan.bucket_numel == FORCED


def check_timed_backwards_do_not_overlap(rank, world):
    """The first two backwards reduce at their end (pure compute is timed); from the
    third on, buckets are reduced during backward."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    with _Forced():
        opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1)
        launched = []  # buckets launched when backward reaches fc2's input
        model.fc2.register_forward_pre_hook(lambda _m, args: (_Probe.apply(
            args[0], lambda: launched.append(len(opt._recorder.pending))),))
        for step in range(4):
            mlp_loss(model, mlp_batch(step, 4)).backward()
            opt.step()
            opt.zero_grad()
    total = len(opt.plan.backward())
    assert launched[:2] == [0, 0], launched
    assert all(0 < n < total for n in launched[2:]), (launched, total)


def check_real_choice_is_agreed(rank, world):
    """No forcing: the quick calibration runs, rank 0 chooses, every rank plans alike."""
    import torch.distributed as dist

    model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *ADAMW, {}, steps=3)
    assert_same_params(model, ref)
    note = opt.plan.notes[-1]
    assert note.startswith("bucket_numel auto: ") and "refined at run time" in note, note
    assert f"cost model measured by this job on its {world} ranks" in note
    assert "measured gradient arrivals" in note
    every: list = [None] * world
    dist.all_gather_object(every, (opt.plan.bucket_numel, opt.plan.buckets, note))
    assert all(e == every[0] for e in every), every
    assert opt.plan.bucket_numel is not None


def check_explicit_size_wins(rank, world):
    from evenzero.runtime import autotune

    real, autotune.decide = autotune.decide, None  # calling it would raise
    try:
        model, ref, opt, _ = train_pair(rank, world, MLP, mlp_loss, mlp_batch, *SGD,
                                        {"bucket_numel": 100}, steps=3)
    finally:
        autotune.decide = real
    assert_same_params(model, ref)
    assert opt.plan.bucket_numel == 100 and not any("auto" in n for n in opt.plan.notes)
    # The README's `opt.plan.notes[-1]` says where the size came from, a number too.
    assert opt.plan.notes[-1].startswith("bucket_numel 100 elements (") and \
        "fixed by bucket_numel=100" in opt.plan.notes[-1]


def _train_step(model, opt, step, rank, world):
    x, y = mlp_batch(step, 4 * world)
    mlp_loss(model, (part(x, rank, world), part(y, rank, world))).backward()
    opt.step()
    opt.zero_grad()


def check_state_dict_carries_the_size(rank, world):
    """A rank's state dict is laid out for the refined size: an "auto" optimizer that
    loads it adopts that size (and refines nothing), and goes on exactly alike."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    with _Forced():
        opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)
        for step in range(3):
            _train_step(model, opt, step, rank, world)
    assert opt.plan.bucket_numel == FORCED
    opt.wait_for_params()
    other = MLP()
    other.load_state_dict(model.state_dict())
    again = ZeroOptimizer(other, torch.optim.AdamW, lr=1e-2)
    assert again.plan.bucket_numel != FORCED
    again.load_state_dict(opt.state_dict())
    assert again.plan.bucket_numel == FORCED and again.plan.layouts == opt.plan.layouts
    assert again.plan.notes[-1].endswith("the loaded state dict's")
    for step in range(3, 6):
        _train_step(model, opt, step, rank, world)
        _train_step(other, again, step, rank, world)
    again.wait_for_params()
    opt.wait_for_params()
    assert_same_params(other, model, rtol=0, atol=0)
    assert again.plan.bucket_numel == FORCED  # nothing refined after the load


def check_user_rng_untouched(rank, world):
    """Construction, training and the refinement's quick calibration draw nothing from
    the user's random number generator (a job's data order and dropout depend on it)."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    state = torch.get_rng_state()
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        _train_step(model, opt, step, rank, world)
    assert "refined at run time" in opt.plan.notes[-1], opt.plan.notes
    assert torch.equal(torch.get_rng_state(), state), "the library drew from torch's global RNG"


CHECKS = {
    "user_rng": check_user_rng_untouched,
    "relayout_stage1": partial(check_relayout_trains_like_torch, stage=1),
    "relayout_stage2": partial(check_relayout_trains_like_torch, stage=2),
    "accumulate_stage1": partial(check_relayout_under_accumulation, stage=1),
    "accumulate_stage2": partial(check_relayout_under_accumulation, stage=2),
    "timed_backwards": check_timed_backwards_do_not_overlap,
    "real_choice": check_real_choice_is_agreed,
    "explicit_wins": check_explicit_size_wins,
    "state_dict": check_state_dict_carries_the_size,
}


def _job(rank: int, world: int):
    return run_checks({name: partial(check, rank, world) for name, check in CHECKS.items()})


RESULTS = CheckResults(_job, timeout=240)


@pytest.mark.parametrize("check", list(CHECKS))
def test_auto_bucket_at_two_ranks(check):
    RESULTS.assert_passed(check, 2)


def test_config_reads_auto_and_none_alike():
    from evenzero.runtime import ZeroConfig, ZeroConfigError

    assert ZeroConfig().bucket_numel == "auto" and ZeroConfig().auto_bucket
    assert ZeroConfig(bucket_numel=None).auto_bucket
    assert not ZeroConfig(bucket_numel=2**20).auto_bucket
    with pytest.raises(ZeroConfigError, match='"auto" or a positive integer'):
        ZeroConfig(bucket_numel="automatic")


def test_repro_bucket_numel_0_is_the_runtime_default():
    import argparse

    from evenzero.repro import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--bucket-numel", "0", "--world-size", "8"]))
    assert config.bucket_numel is None  # EvenzeroSystem then passes no bucket_numel: "auto"

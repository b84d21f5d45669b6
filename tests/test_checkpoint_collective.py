"""Checkpoints of the real ZeroOptimizer at world size 2 on gloo: the rest of the training
state (extra=, tags, schedulers, rewinding), and every error raised on every rank when
only one rank meets it (a rank-local problem must never leave the other one waiting).

One spawned job runs every check (`run_checks`); each check runs on both ranks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ckpt_train_job import JobOptions, RankGroups, batch, build, train
from dist_helpers import CheckResults, run_checks


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def masters(opt) -> dict[str, torch.Tensor]:
    return {g.name: opt.master_shard(g.name).clone() for g in opt.plan.groups}


def optimizer_state(opt) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.shard_state("dense")["flats"].items() if k != "master"}


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def noisy_train(model, opt, sched, start: int, stop: int) -> None:
    """Training that consumes the RNG (dropout-like noise) and steps a scheduler."""
    rank = dist.get_rank(opt.world_group)
    for step in range(start, stop):
        x, y = batch(step, rank)
        x = x + 0.01 * torch.randn_like(x)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def expect_error(fn, *patterns: str) -> str:
    """Call `fn`; it must raise a CheckpointError matching every pattern."""
    from evenzero.checkpoint import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        for p in patterns:
            assert re.search(p, str(e)), f"{p!r} not in {e}"
        return str(e)
    raise AssertionError(f"no CheckpointError (expected {patterns})")


# --------------------------------------------------------------------------- the training state


def full_resume(rank: int, root: Path) -> None:
    """Step, scheduler, data position and RNG saved with extra= and restored: the resumed
    run continues exactly as the uninterrupted one."""
    from evenzero import checkpoint

    torch.manual_seed(100 + rank)
    model, opt = build(JobOptions())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    noisy_train(model, opt, sched, 0, 3)
    checkpoint.save(opt, root, extra={"scheduler": sched.state_dict(),
                                      "data": {"epoch": 0, "index": 3 * 8},
                                      "rng": {"torch": torch.get_rng_state()}, "rank": rank})
    noisy_train(model, opt, sched, 3, 6)
    want, want_lr = masters(opt), [g["lr"] for g in opt.param_groups]

    torch.manual_seed(999)  # a restarted process: another RNG state, a fresh scheduler
    model, opt = build(JobOptions())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    manifest = checkpoint.load(opt, root)
    sched.load_state_dict(manifest.extra["scheduler"])
    torch.set_rng_state(manifest.extra["rng"]["torch"])
    assert manifest.extra["rank"] == rank and manifest.extra["data"] == {"epoch": 0, "index": 24}
    assert manifest.step == opt.step_count == 3 and sched.last_epoch == 3
    noisy_train(model, opt, sched, manifest.step, 6)
    assert_equal(masters(opt), want)
    assert [g["lr"] for g in opt.param_groups] == want_lr


def scheduler_keys_do_not_make_a_checkpoint_different(rank: int, root: Path) -> None:
    """A checkpoint saved without a scheduler loads into an optimizer with one (which adds
    initial_lr to the groups) and the other way round; saved values win, keys only in the
    running groups are kept, as torch's load_state_dict keeps the saved groups."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    train(model, opt, 0, 2)
    opt.param_groups[0]["lr"] = 0.005
    checkpoint.save(opt, root / "plain")
    model, opt = build(JobOptions())
    torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    checkpoint.load(opt, root / "plain")
    assert opt.param_groups[0]["lr"] == 0.005 and opt.param_groups[0]["initial_lr"] == 0.01

    torch.optim.lr_scheduler.LambdaLR(opt, warmup)  # initial_lr is kept: 0.01
    checkpoint.save(opt, root / "scheduled")
    model, opt = build(JobOptions())
    checkpoint.load(opt, root / "scheduled")
    assert opt.param_groups[0]["initial_lr"] == 0.01 and opt.param_groups[0]["lr"] == 0.0025


def tags_save_and_load_by_name(rank: int, root: Path) -> None:
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    train(model, opt, 0, 1)
    first = masters(opt)
    path = checkpoint.save(opt, root, tag="global_step1", extra={"n": 1})
    assert path == root / "global_step1" and (path / "manifest.json").is_file()
    train(model, opt, 1, 2)
    checkpoint.save(opt, root, tag="best", extra={"n": 2})
    train(model, opt, 2, 3)
    checkpoint.save(opt, root, tag="best", extra={"n": 3})  # replaces it
    third = masters(opt)
    assert checkpoint.latest(root) is None  # tags are loaded by name, not ordered by step
    model, opt = build(JobOptions())
    assert checkpoint.load(opt, root, tag="global_step1").extra == {"n": 1}
    assert_equal(masters(opt), first)
    m = checkpoint.load(opt, root, tag="best")
    assert (m.extra, m.step) == ({"n": 3}, 3)
    assert_equal(masters(opt), third)
    expect_error(lambda: checkpoint.load(opt, root, tag="worst"),
                 r"no checkpoint tagged 'worst'")


def extra_follows_the_rank_across_world_sizes(rank: int, root: Path, singles: list) -> None:
    """Saved at 2 ranks, loaded on 1: the loading rank 0 gets saving rank 0's state. Saved
    at 1, loaded at 2: rank 1, which the saving world lacked, gets rank 0's."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    checkpoint.save(opt, root / "two", extra={"saved_by": rank})
    model, alone = build(JobOptions(), RankGroups(singles[rank]))
    assert checkpoint.load(alone, root / "two").extra == {"saved_by": 0}
    checkpoint.save(alone, root / f"one-{rank}", extra={"saved_by": rank})
    dist.barrier()
    assert checkpoint.load(opt, root / "one-1").extra == {"saved_by": 1}
    model, opt = build(JobOptions())
    checkpoint.save(opt, root / "none")  # no extra: None back
    assert checkpoint.load(opt, root / "none").extra is None


def rewind_to_before_the_first_step(rank: int, root: Path) -> None:
    """A checkpoint saved before any step has no optimizer state: loading it into a trained
    optimizer empties the state, as torch's load_state_dict does, and training from there
    equals a fresh run."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    checkpoint.save(opt, root, step=0)
    train(model, opt, 0, 2)
    assert optimizer_state(opt)
    checkpoint.load(opt, root / "step-000000")
    assert optimizer_state(opt) == {} and opt.step_count == 0
    train(model, opt, 0, 2)
    fresh_model, fresh = build(JobOptions())
    train(fresh_model, fresh, 0, 2)
    assert_equal(masters(opt), masters(fresh))
    assert_equal(optimizer_state(opt), optimizer_state(fresh))


# --------------------------------------------------------------------------- errors on every rank


def saved_pair(opt, model, root: Path) -> tuple[Path, Path]:
    """Checkpoints at steps 2 and 4 under `root`, and rank 1's private copy of `root` that
    it may damage (a rank that sees other files, as on node-local disks)."""
    from evenzero import checkpoint

    train(model, opt, 0, 2)
    checkpoint.save(opt, root / "shared")
    train(model, opt, 2, 4)
    checkpoint.save(opt, root / "shared")
    if dist.get_rank() == 1:
        shutil.copytree(root / "shared", root / "private")
    dist.barrier()
    return root / "shared", root / ("private" if dist.get_rank() == 1 else "shared")


def edit_manifest(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def bad_save_arguments_on_one_rank(rank: int, root: Path) -> None:
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    cases = [({"step": -1}, r"save\(step=-1\): the step must be a non-negative integer"),
             ({"step": 2.5}, r"save\(step=2.5\): the step must be a non-negative integer, not "
                             r"float"),
             ({"step": True}, r"save\(step=True\)"),
             ({"tag": "../x"}, r"checkpoint tag '\.\./x' is not a plain directory name"),
             ({"tag": ".hidden"}, r"checkpoint tag '\.hidden' is not a plain directory name"),
             ({"extra": {"np": object()}}, r"extra\['np'\]: cannot store a value of type "
                                           r"builtins.object")]
    for i, (bad, message) in enumerate(cases):
        kwargs = {"step": 5, **bad} if rank == 1 else {"step": 5}
        expect_error(lambda i=i, kwargs=kwargs: checkpoint.save(opt, root / str(i), **kwargs),
                     r"rank 1: " + message)
        assert checkpoint.latest(root / str(i)) is None
    expect_error(lambda: checkpoint.save(opt, root / "differ", step=5 + rank),
                 r"ranks passed different steps or tags to save\(\)")
    expect_error(lambda: checkpoint.save(opt, root / "differ", tag=f"t{rank}"),
                 r"ranks passed different steps or tags to save\(\)")


def disk_full_on_one_rank(rank: int, root: Path) -> None:
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    train(model, opt, 0, 2)
    checkpoint.save(opt, root)
    before = masters(opt)
    train(model, opt, 2, 3)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with mock.patch("os.fsync", full) if rank == 1 else contextlib.nullcontext():
        message = expect_error(lambda: checkpoint.save(opt, root),
                               r"rank 1: writing .*\.tmp-step-000003/rank-00001\.safetensors "
                               r"failed: the disk is full")
    assert "no file" not in message
    assert checkpoint.latest(root) == root / "step-000002"
    assert checkpoint.load(opt, root).step == 2
    assert_equal(masters(opt), before)


DAMAGE = {
    "garbage JSON": (lambda p: p.write_text('{"format": "evenzero-check'),
                     r"manifest is not valid JSON"),
    "unknown format_version": (lambda p: edit_manifest(p, lambda d: d.update(format_version=9)),
                               r"format version 9, this evenzero reads version 1"),
    "runs overlap": (lambda p: edit_manifest(p, lambda d: d["params"]["head.bias"]["ranges"].append(
        d["params"]["head.bias"]["ranges"][0])), r"parameter 'head.bias' has runs that do not "
                                                 r"tile it"),
    "path in file name": (lambda p: edit_manifest(p, lambda d: d["files"][0].update(
        name="../step-000002/rank-00000.safetensors")), r"files\[0\].name '\.\./step-000002/"
                                                        r"rank-00000.safetensors' is not a plain"),
    "lr NaN": (lambda p: edit_manifest(p, lambda d: d["optimizer"]["groups"][0]["hyperparameters"]
                                       .update(lr=float("nan"))), r"option 'lr' is nan, not finite"),
    "lr text": (lambda p: edit_manifest(p, lambda d: d["optimizer"]["groups"][0]["hyperparameters"]
                                        .update(lr="fast")), r"option 'lr' is 'fast' in the "
                                                             r"checkpoint but 0.01 here"),
    "step_count negative": (lambda p: edit_manifest(p, lambda d: d.update(step_count=-7)),
                            r"step_count is -7, below 0"),
}


def damaged_newest_checkpoint_on_one_rank(rank: int, root: Path) -> None:
    """Rank 1's newest checkpoint is damaged: every rank gets rank 1's error naming the
    file, nothing changes, and no rank falls back to the older checkpoint."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    shared, mine = saved_pair(opt, model, root)
    train(model, opt, 4, 5)
    before = masters(opt)
    manifest = mine / "step-000004" / "manifest.json"
    original = manifest.read_text() if rank == 1 else ""
    for damage, message in DAMAGE.values():
        if rank == 1:
            damage(manifest)
        dist.barrier()
        expect_error(lambda: checkpoint.load(opt, mine),
                     r"rank 1: .*private/step-000004(/manifest.json)?: .*" + message)
        assert_equal(masters(opt), before)
        if rank == 1:
            manifest.write_text(original)
    # Every rank damaged: still an error, not step 2.
    if rank == 0:
        damage, message = DAMAGE["garbage JSON"]
        damage(shared / "step-000004" / "manifest.json")
    dist.barrier()
    expect_error(lambda: checkpoint.load(opt, shared), r"rank 0: .*step-000004/manifest.json: "
                                                       r"manifest is not valid JSON")


def damaged_user_state_on_one_rank(rank: int, root: Path) -> None:
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    path = checkpoint.save(opt, root / "shared", extra={"rank": rank, "t": torch.ones(3)})
    mine = path
    if rank == 1:
        mine = root / "private" / path.name
        shutil.copytree(path, mine)
        data = bytearray((mine / "user-state-rank-00001.safetensors").read_bytes())
        data[-1] ^= 1
        (mine / "user-state-rank-00001.safetensors").write_bytes(bytes(data))
    expect_error(lambda: checkpoint.load(opt, mine),
                 r"rank 1: .*user-state-rank-00001.safetensors: sha256 mismatch")


# --------------------------------------------------------------------------- a crash anywhere


class Crash(BaseException):
    """The process died here."""


def crash_everywhere(rank: int, root: Path, singles: list) -> None:
    """Each rank alone (world size 1): re-save a step (rank 0) or a tag (rank 1) through
    `checkpoint.save`, crashing before its k-th file-system operation, for every k. The
    newest checkpoint then loads with the old or the new state, and the next save
    recovers without losing it."""
    from evenzero import checkpoint

    tag = "best" if rank == 1 else None
    root = root / f"rank-{rank}"
    model, opt = build(JobOptions(), RankGroups(singles[rank]))
    train(model, opt, 0, 1)
    checkpoint.save(opt, root / "setup", 1, tag=tag)
    old = masters(opt)
    train(model, opt, 1, 2)
    new = masters(opt)
    ops = ("rename", "fsync", "mkdir", "unlink", "rmdir")
    k, crashed = 0, True
    while crashed:
        here = root / f"k{k}"
        shutil.copytree(root / "setup", here)
        done = [0]

        def op(real, *args, done=done, k=k, **kwargs):
            if done[0] == k:
                raise Crash
            done[0] += 1
            return real(*args, **kwargs)

        patches = [mock.patch(f"os.{name}", partial(op, getattr(os, name))) for name in ops]
        crashed = False
        try:
            for p in patches:
                p.start()
            checkpoint.save(opt, here, 1, tag=tag)
        except Crash:
            crashed = True
        finally:
            for p in patches:
                p.stop()
        _, fresh = build(JobOptions(), RankGroups(singles[rank]))
        checkpoint.load(fresh, here, tag=tag)
        loaded = masters(fresh)
        assert all(torch.equal(loaded[g], old[g]) for g in old) or \
            all(torch.equal(loaded[g], new[g]) for g in new), k
        checkpoint.save(fresh, here, 1, tag=tag)  # recovers, then replaces
        assert sorted(p.name for p in here.iterdir()) == ["best" if tag else "step-000001"]
        k += 1
    assert k > 10, k


# --------------------------------------------------------------------------- the job

CHECKS = {
    "full_resume": full_resume,
    "scheduler_keys": scheduler_keys_do_not_make_a_checkpoint_different,
    "tags": tags_save_and_load_by_name,
    "extra_across_world_sizes": extra_follows_the_rank_across_world_sizes,
    "rewind": rewind_to_before_the_first_step,
    "bad_save_arguments": bad_save_arguments_on_one_rank,
    "disk_full": disk_full_on_one_rank,
    "damaged_newest": damaged_newest_checkpoint_on_one_rank,
    "damaged_user_state": damaged_user_state_on_one_rank,
    "crash_everywhere": crash_everywhere,
}
NEEDS_SINGLES = {"extra_across_world_sizes", "crash_everywhere"}


def collective_job(rank: int, world: int, root: str) -> dict[str, str | None]:
    singles = [dist.new_group([r]) for r in range(world)]
    checks = {}
    for name, check in CHECKS.items():
        args = (rank, Path(root) / name) + ((singles,) if name in NEEDS_SINGLES else ())
        checks[name] = partial(check, *args)
    return run_checks(checks, barrier=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt-collective")
    return CheckResults(collective_job, timeout=300), str(root)


@pytest.mark.parametrize("check", list(CHECKS))
def test_checkpoint_collective(results, check):
    checker, root = results
    checker.assert_passed(check, 2, root)

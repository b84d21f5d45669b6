"""Background saves (`save(..., blocking=False)`) of the real ZeroOptimizer on gloo ranks.

The files are the ones a blocking save writes; the state is the one of the instant
`save` returned, however far training went on meanwhile; the training's collectives
and the save's run at the same time without meeting; `wait()`, the next save, `load`
and the interpreter's exit wait for the writer; a write that fails on one rank is the
same error on every rank; and a rank killed while writing loses no earlier checkpoint
and never has its torn one loaded.

A writer held at a gate (`GatedWrites`) makes "while it writes" deterministic: the
background thread blocks inside its first file write until the test opens the gate.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckpt_train_job import JobOptions, build, make_groups, train
from dist_helpers import CheckResults, run_checks, run_distributed

JOB = Path(__file__).with_name("ckpt_background_job.py")


def masters(opt) -> dict[str, torch.Tensor]:
    return {g.name: opt.master_shard(g.name).clone() for g in opt.plan.groups}


def moments(opt) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.shard_state("dense")["flats"].items() if k != "master"}


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class GatedWrites:
    """Patches `checkpoint.files.write_file`: a write from a background thread waits at
    the gate (and counts as started); `fail` makes this rank's writes raise ENOSPC."""

    def __init__(self, fail: bool = False) -> None:
        from evenzero.checkpoint import files

        self.files, self.real = files, files.write_file
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = fail

    def __enter__(self) -> GatedWrites:
        def write(path, tensors, rank, metadata=None):
            if threading.current_thread() is not threading.main_thread():
                self.started.set()
                assert self.gate.wait(60), "the test never opened the gate"
            if self.fail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.real(path, tensors, rank, metadata)

        self.files.write_file = write
        return self

    def __exit__(self, *exc) -> None:
        self.files.write_file = self.real
        self.gate.set()


def expect_error(fn, *fragments: str) -> str:
    from evenzero.checkpoint import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        missing = [f for f in fragments if f not in str(e)]
        assert not missing, f"{missing} not in {e}"
        return str(e)
    raise AssertionError(f"no CheckpointError (expected {fragments})")


# --------------------------------------------------------------------------- checks


def same_files_as_blocking(rank: int, root: Path) -> None:
    """A background save writes what a blocking one writes, byte for byte."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    train(model, opt, 0, 2)
    extra = {"rank": rank, "t": torch.arange(3.0)}
    blocking = checkpoint.save(opt, root / "blocking", extra=extra)
    path = checkpoint.save(opt, root / "background", extra=extra, blocking=False)
    assert checkpoint.wait() == path == root / "background" / "step-000002"
    assert checkpoint.wait() is None  # nothing in flight any more
    a = json.loads((blocking / "manifest.json").read_text())
    b = json.loads((path / "manifest.json").read_text())
    assert a == b
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in blocking.iterdir())
    want = masters(opt), moments(opt)
    model, opt = build(JobOptions())
    manifest = checkpoint.load(opt, path)
    assert manifest.extra["rank"] == rank and torch.equal(manifest.extra["t"], torch.arange(3.0))
    assert_equal(masters(opt), want[0])
    assert_equal(moments(opt), want[1])


def state_of_the_instant(rank: int, root: Path) -> None:
    """Training goes on (steps with their collectives) while the files are written;
    the checkpoint holds the state when `save` returned, `extra` as it was passed."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    train(model, opt, 0, 2)
    at_save = masters(opt), moments(opt), model.steps_seen.clone()
    rng = torch.tensor([1.0, 2.0])
    with GatedWrites() as gated:
        path = checkpoint.save(opt, root, extra={"rng": rng}, blocking=False)
        rng.add_(10)  # the caller's tensor changes after save returned
        assert gated.started.wait(30)
        train(model, opt, 2, 4)  # while this rank's writer is held inside a write
        assert not path.exists() and not gated.gate.is_set()
        gated.gate.set()
        assert checkpoint.wait() == path
    assert not torch.equal(masters(opt)["dense"], at_save[0]["dense"])
    model, opt = build(JobOptions())
    manifest = checkpoint.load(opt, root)
    assert manifest.step == 2 and opt.step_count == 2
    assert_equal(masters(opt), at_save[0])
    assert_equal(moments(opt), at_save[1])
    assert torch.equal(model.steps_seen, at_save[2])
    assert torch.equal(manifest.extra["rng"], torch.tensor([1.0, 2.0]))


def next_save_load_and_latest_wait(rank: int, root: Path) -> None:
    """One save in flight: the next save, `load` and `latest` wait for it."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    train(model, opt, 0, 1)
    with GatedWrites() as gated:
        first = checkpoint.save(opt, root, blocking=False)
        train(model, opt, 1, 2)
        assert gated.started.wait(30)
        threading.Timer(0.5, gated.gate.set).start()
        second = checkpoint.save(opt, root, blocking=False)  # waits for the first
        assert gated.gate.is_set() and first.is_dir()
        assert checkpoint.latest(root) == second  # waits for the second
    assert (first.name, second.name) == ("step-000001", "step-000002")
    with GatedWrites() as gated:
        checkpoint.save(opt, root, 7, blocking=False)
        threading.Timer(0.5, gated.gate.set).start()
        assert checkpoint.load(opt, root).step == 7  # the newest, once published
    assert checkpoint.wait() is None


def write_error_on_one_rank(rank: int, root: Path) -> None:
    """Rank 1's disk is full: `wait()` raises rank 1's error on both ranks, once; a
    failed background save raised by the next save (and by `load`) the same way; the
    previous checkpoint stays the newest and loads."""
    from evenzero import checkpoint

    model, opt = build(JobOptions())
    train(model, opt, 0, 1)
    checkpoint.save(opt, root)
    for surfaced_by in ("wait", "save", "load"):
        with GatedWrites(fail=rank == 1) as gated:
            gated.gate.set()
            checkpoint.save(opt, root, 5, blocking=False)
            train(model, opt, 1, 2)
            call = {"wait": checkpoint.wait,
                    "save": lambda: checkpoint.save(opt, root / "other", blocking=False),
                    "load": lambda: checkpoint.load(opt, root)}[surfaced_by]
            expect_error(call, "background save of", "step-000005", "rank 1: writing",
                         os.strerror(errno.ENOSPC))
        assert checkpoint.wait() is None  # raised once
        assert not (root / "other").exists()
        assert checkpoint.latest(root) == root / "step-000001"
    assert checkpoint.load(opt, root).step == 1
    path = checkpoint.save(opt, root, 6, blocking=False)  # the writer works again
    assert checkpoint.wait() == path and checkpoint.latest(root) == path


CHECKS = {
    "same_files_as_blocking": same_files_as_blocking,
    "state_of_the_instant": state_of_the_instant,
    "next_save_load_and_latest_wait": next_save_load_and_latest_wait,
    "write_error_on_one_rank": write_error_on_one_rank,
}


def background_job(rank: int, world: int, root: str) -> dict[str, str | None]:
    checks = {name: partial(check, rank, Path(root) / name) for name, check in CHECKS.items()}
    results = run_checks(checks, barrier=True)
    from evenzero import checkpoint

    checkpoint.wait()  # a failed check may leave a save in flight
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt-background")
    return CheckResults(background_job, timeout=300), str(root)


@pytest.mark.parametrize("check", list(CHECKS))
def test_background_save(results, check):
    checker, root = results
    checker.assert_passed(check, 2, root)


# --------------------------------------------------------------------------- more ranks


def many_saves_while_training(rank: int, world: int, root: str) -> dict:
    """At 4 ranks, a background save every step for several steps, each written while
    the next steps run (writes slowed down), then the same on an optimizer over ranks
    0-2 only (rank 3 idles): every checkpoint is its step's state."""
    from evenzero import checkpoint
    from evenzero.checkpoint import files

    real = files.write_file

    def slow(path, tensors, rank, metadata=None):
        threading.Event().wait(0.05)
        return real(path, tensors, rank, metadata)

    files.write_file = slow
    worlds = make_groups([3, 4], 1)
    out = {}
    for size in (4, 3):
        group = worlds[size]
        if group.world is None:
            dist.barrier()
            continue
        model, opt = build(JobOptions(), group)
        want = {}
        for step in range(4):
            train(model, opt, step, step + 1)
            want[step + 1] = masters(opt)
            checkpoint.save(opt, Path(root) / str(size), blocking=False)
        last = checkpoint.wait()
        assert last == Path(root) / str(size) / "step-000004"
        model, fresh = build(JobOptions(), group)
        for step, state in want.items():
            checkpoint.load(fresh, Path(root) / str(size) / f"step-{step:06d}")
            assert_equal(masters(fresh), state)
        out[size] = sorted(p.name for p in (Path(root) / str(size)).iterdir())
        dist.barrier()
    files.write_file = real
    return out


@pytest.mark.slow
def test_background_saves_while_training_at_4_ranks(tmp_path):
    out = run_distributed(many_saves_while_training, 4, (str(tmp_path),), timeout=300)
    steps = [f"step-{s:06d}" for s in range(1, 5)]
    assert all(r[4] == steps for r in out)
    assert all(r[3] == steps for r in out[:3]) and 3 not in out[3]


# --------------------------------------------------------------------------- whole processes


def run_job(out: Path, mode: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", str(JOB), str(out), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(JOB.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def resume_check(rank: int, world: int, ckpt: str) -> dict:
    """What a restarted job sees: the newest complete checkpoint, equal to a fresh run's
    state at its step; then a save under the same root clears the torn staging."""
    from evenzero import checkpoint

    latest = checkpoint.latest(ckpt)
    model, opt = build(JobOptions())
    step = checkpoint.load(opt, ckpt).step
    ref_model, ref = build(JobOptions())
    train(ref_model, ref, 0, step)
    assert_equal(masters(opt), masters(ref))
    assert_equal(moments(opt), moments(ref))
    checkpoint.save(opt, ckpt, blocking=False)
    checkpoint.wait()
    return {"latest": latest.name, "step": step,
            "after": sorted(p.name for p in Path(ckpt).iterdir())}


@pytest.mark.slow
def test_killed_during_a_background_write_keeps_the_previous_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed inside its background write of step 4 while both ranks train
    on: step 2 stays the newest checkpoint, every rank resumes from it with its exact
    state, and the torn step 4 is never loaded (and is cleared by the next save)."""
    done = run_job(tmp_path, "kill")
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    ckpt = tmp_path / "ckpt"
    assert (tmp_path / "killed-while-writing").exists(), done.stderr[-3000:]
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".tmp-step-000004", "step-000002"], names
    out = run_distributed(resume_check, 2, (str(ckpt),), timeout=180)
    assert out[0] == out[1]
    assert (out[0]["latest"], out[0]["step"]) == ("step-000002", 2)
    assert out[0]["after"] == ["step-000002"]


@pytest.mark.slow
def test_a_clean_exit_waits_for_the_background_write(tmp_path):
    """The job's last save is a background one and the script just ends (no wait(), no
    destroy_process_group): the interpreter waits for the writer and it is published."""
    done = run_job(tmp_path, "exit")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (tmp_path / "returned-before-publish").exists()
    out = run_distributed(resume_check, 2, (str(tmp_path / "ckpt"),), timeout=180)
    assert (out[0]["latest"], out[0]["step"]) == ("step-000004", 4)

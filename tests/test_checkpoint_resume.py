"""Kill and resume under torchrun: a rank SIGKILLed mid-step or mid-save costs only the
steps since the last complete checkpoint, and the job ends exactly where an
uninterrupted one does (the job trains that reference itself, in the same processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

JOB = Path(__file__).with_name("ckpt_train_job.py")


def torchrun(out: Path, *args: str, restarts: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(JOB), str(out),
           "--steps", "10", "--every", "2", *args]
    # A worker store shared with the rendezvous hands the second restart stale peer
    # addresses (pytorch/pytorch#135712): gloo then fails to connect or waits forever.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(JOB.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def assert_final_equals_reference(out: Path) -> None:
    final, ref = load_file(out / "final" / "model.safetensors"), \
        load_file(out / "reference" / "model.safetensors")
    assert final.keys() == ref.keys()
    for k in ref:
        assert torch.equal(final[k], ref[k]), k
    assert int(final["steps_seen"]) == 10
    fo = torch.load(out / "final" / "optimizer.pt", weights_only=True)
    ro = torch.load(out / "reference" / "optimizer.pt", weights_only=True)
    assert fo["param_groups"] == ro["param_groups"]
    for name, st in ro["state"].items():
        for k, v in st.items():
            assert torch.equal(fo["state"][name][k], v), f"{name}.{k}"


SPARE_RESTARTS = 2
"""Restarts beyond the planned kills. A gloo restart on a loaded 2-core machine can itself
die in the transport (a peer reset while the previous attempt's sockets wind down: seen
once in CI-like runs here); the job must then resume again from the newest complete checkpoint,
which `assert_attempts` still checks."""


def assert_attempts(out: Path, expected: list[str]) -> None:
    """The planned attempts happened in order; any spare restart resumed from a checkpoint
    step no older than the last planned one."""
    log = (out / "attempts.log").read_text().splitlines()
    assert log[:len(expected)] == expected, log
    last = int(expected[-1].split()[-1])
    for line in log[len(expected):]:
        assert int(line.split()[-1]) in range(last, 11, 2), log


def assert_checkpoints_clean(out: Path) -> None:
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    assert names == [f"step-{s:06d}" for s in (2, 4, 6, 8, 10)], names


def test_killed_mid_save_resumes_from_previous_checkpoint(tmp_path):
    # Rank 1 writes half of its step-6 shard and dies: step-4 is the newest complete one.
    torchrun(tmp_path, "--crash", "save:6:0", restarts=1 + SPARE_RESTARTS)
    assert_attempts(tmp_path, ["attempt 0 start 0", "attempt 1 start 4"])
    assert_checkpoints_clean(tmp_path)
    assert_final_equals_reference(tmp_path)


@pytest.mark.slow
def test_killed_mid_step_then_mid_save_stage1(tmp_path):
    torchrun(tmp_path, "--stage", "1", "--crash", "step:5:0", "--crash", "save:8:1",
             restarts=2 + SPARE_RESTARTS)
    assert_attempts(tmp_path, ["attempt 0 start 0", "attempt 1 start 4", "attempt 2 start 6"])
    assert_checkpoints_clean(tmp_path)
    assert_final_equals_reference(tmp_path)

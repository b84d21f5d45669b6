"""Run the Lightning user scripts (`lightning_trainer_job.py`, `lightning_fabric_job.py`)
from tests, and read what they wrote.

Lightning launches the other ranks itself (it re-runs the script with LOCAL_RANK set),
so a job is one `python script.py ...` process. It runs in its own session: at the
timeout the whole process group (Lightning's children included) is killed and the test
fails with the output, so a hang never hangs CI.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
TRAINER_JOB = HERE / "lightning_trainer_job.py"
FABRIC_JOB = HERE / "lightning_fabric_job.py"
SRC = HERE.parent / "src"


LAUNCHER_VARS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                           "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                           "PL_GLOBAL_SEED", "PL_TRAINER_GPUS"})


class LightningJobError(AssertionError):
    """The job failed or timed out; the message carries its output."""


def run_job(script: Path, args: Sequence[str], timeout: float = 900.0) -> str:
    """Run a user script; returns its output, raises LightningJobError on failure."""
    # As from a fresh shell: no launcher's variables that an earlier test in this process
    # may have left (Lightning would take them for its own launch's).
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "OMPI_", "PMI_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))})
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=str(HERE.parent),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise LightningJobError(f"{script.name} {' '.join(args)} did not finish in {timeout:.0f} "
                                f"s; output:\n{text[-6000:]}") from None
    if proc.returncode != 0:
        raise LightningJobError(f"{script.name} {' '.join(args)} exited with {proc.returncode}; "
                                f"output:\n{text[-6000:]}")
    return text


def run_trainer_job(out: Path, devices: int, runs: list[dict], timeout: float = 900.0) -> Path:
    """Run `runs` (see lightning_trainer_job.py) on `devices` CPU ranks; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "devices": devices, "runs": runs}))
    run_job(TRAINER_JOB, ["--spec", str(spec)], timeout)
    return out


def result(out: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((out / f"{name}-rank{rank}.json").read_text())


def losses(record: list[dict]) -> list[float]:
    return [r["loss"] for r in record]


def global_losses(out: Path, name: str, world: int) -> list[float]:
    """Each micro-batch's loss over the global batch: the mean of the ranks' (equal-size
    per-rank batches)."""
    per_rank = [losses(result(out, name, r)["record"]) for r in range(world)]
    return [sum(v) / world for v in zip(*per_rank, strict=True)]


def flat(params: list[list[float]]) -> list[float]:
    return list(itertools.chain.from_iterable(params))


def max_rel(expected: Sequence[float], got: Sequence[float]) -> float:
    """Largest relative difference; inf for a length mismatch or a NaN on either side."""
    if len(expected) != len(got) or not expected:
        return math.inf
    worst = 0.0
    for e, g in zip(expected, got, strict=True):
        if math.isnan(e) or math.isnan(g):
            return math.inf
        worst = max(worst, abs(e - g) / max(abs(e), 1e-12))
    return worst


def max_abs(expected: Sequence[float], got: Sequence[float]) -> float:
    if len(expected) != len(got):
        return math.inf
    return max((abs(e - g) if not (math.isnan(e) or math.isnan(g)) else math.inf
                for e, g in zip(expected, got, strict=True)), default=0.0)

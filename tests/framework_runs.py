"""Launching the framework acceptance scripts (tests/integration_scripts/) the way users
launch them, once under real DeepSpeed and once under `evenzero run`; only the launch
command differs. Used by tests/test_integration_*.py (all marked slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
SCRIPTS = TESTS / "integration_scripts"
SYNTHETIC_TORCHVISION = SCRIPTS / "synthetic_torchvision"

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="real DeepSpeed is not installed (CI installs deepspeed==0.19.8): "
                              "nothing to compare with")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(pythonpath: Sequence[Path] = (), **extra: str) -> dict[str, str]:
    """The test process's environment for a launch: this checkout's evenzero importable,
    the CPU, one thread per rank, no network for Hugging Face."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    paths = [*map(str, pythonpath), str(SRC), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def launch(command: Sequence[str], *, evenzero: bool, env: dict[str, str], cwd: Path,
           timeout: float = 900, python: str = sys.executable) -> str:
    """Run `command` (prefixed by `evenzero run` when `evenzero`); returns its output and
    fails the test with its tail when it fails."""
    cmd = ([python, "-m", "evenzero.cli", "run", *command] if evenzero else list(command))
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(line for line in output.splitlines() if not line.startswith("W"))
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail[-6000:]}")
    return output


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), str(script), *args]


def records(prefix: Path, world: int) -> list[dict]:
    """The per-rank JSON records a script wrote as PREFIX.rank<r>.json."""
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world)]


def max_relative(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b) and len(a) > 0, (len(a), len(b))
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))

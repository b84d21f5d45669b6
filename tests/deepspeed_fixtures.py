"""Real DeepSpeed checkpoints for the tests, made once per test session and shared.

Both DeepSpeed checkpoint test modules ask `checkpoint(run, tmp_path_factory)`; the
process-wide cache makes each `Run` train and save once (a 2-rank DeepSpeed job takes a
few seconds) however many tests use it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from deepspeed_ckpt_job import Run, train_deepspeed
from dist_helpers import run_distributed

NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
needs_deepspeed = pytest.mark.skipif(
    NO_DEEPSPEED, reason="DeepSpeed is not installed (pip install deepspeed; CI installs it)")

SAVED_WORLD = 2
_CACHE: dict[str, tuple[Path, dict[str, Any]]] = {}


def checkpoint(run: Run, tmp_path_factory: Any) -> tuple[Path, dict[str, Any]]:
    """(checkpoint directory, DeepSpeed's losses before and after the save) of `run`."""
    key = repr(run)
    if key not in _CACHE:
        out = tmp_path_factory.mktemp("deepspeed") / "ckpt"
        result = run_distributed(train_deepspeed, SAVED_WORLD, (run, str(out)), timeout=300)[0]
        _CACHE[key] = (out, result)
    return _CACHE[key]

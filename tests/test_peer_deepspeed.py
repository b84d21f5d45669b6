"""DeepSpeed's own ZeRO-1/2 unit tests (vendored in tests/peer/deepspeed) under the stand-in,
with real DeepSpeed as the control: `tests/peer/run_deepspeed.py` runs them.

The default run takes a small sample that needs no spawned ranks (DeepSpeed's harness
spawns a process group per test, 20-60 s each on 2 shared cores); the whole set is slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "peer" / "run_deepspeed.py"

SAMPLE = (
    "unit/v1/moe/test_moe.py::test_top1gating_drop_capacity_exceeds_num_tokens",
    "unit/v1/moe/test_moe.py::test_topkgating_position_preserves_min_capacity",
    "unit/v1/moe/test_moe.py::test_topkgating_probs_capacity_exceeds_num_tokens",
    "unit/v1/moe/test_moe.py::test_top1gating_preserves_tensor_parallel_capacity",
)


def _run(tmp_path: Path, *args: str, timeout: float) -> dict:
    out = tmp_path / "peer.json"
    proc = subprocess.run([sys.executable, str(RUNNER), "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_vendored_sample_passes_under_the_standin(tmp_path):
    result = _run(tmp_path, "--under", "standin", *SAMPLE, timeout=240)
    outcomes = result["outcomes"]["standin"]
    assert len(outcomes) == len(SAMPLE)  # the sample's ids all ran
    failed = {i: o for i, o in outcomes.items() if o[0] != "passed"}
    assert not failed, failed


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="the control needs DeepSpeed installed (pip install -e .[deepspeed])")
def test_vendored_zero12_tests_pass_where_deepspeed_does(tmp_path):
    """Issue 28/30 acceptance: of the applicable tests real DeepSpeed passes on CPU, at least
    95% pass under the stand-in (the rest are listed in tests/peer/deepspeed/README.md)."""
    result = _run(tmp_path, timeout=6 * 3600)
    summary = result["summary"]
    assert summary["applicable (control passes, not refused)"] > 0
    assert summary["ratio"] >= 0.95, summary["stand-in fails where the control passes"]

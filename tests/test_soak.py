"""Flat over long runs: 2,000 steps of the seed model's structure at 4 ranks, two
micro-batches a step, a checkpoint every 200 steps and one resume, in the README's loop
and in the DeepSpeed drop-in's engine loop. After warm-up (two checkpoints) each rank's
resident memory grows by at most 2% and its open file descriptors stay the same.
The job is `benchmarks/soak.py`, which also draws the curve for BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
MAX_GROWTH = 0.02


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["zero", "deepspeed"])
def test_memory_and_descriptors_stay_flat_over_2000_steps(tmp_path, loop):
    soak = load_soak()
    result = soak.run(loop, world_size=4, steps=2000, out=tmp_path, every=200, accum=2,
                      resume_at=1000)
    soak.print_summary(result)
    for rank, summary in result["ranks"].items():
        assert summary["growth"] <= MAX_GROWTH, (rank, summary)
        assert len(summary["fds"]) == 1, (rank, summary)
        events = {s["event"] for s in result["samples"][rank]}
        assert events == {"step", "save", "resume"}, events

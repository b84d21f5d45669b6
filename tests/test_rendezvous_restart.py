"""The README's loop survives killed ranks: `torchrun --max-restarts 2` at 4 gloo ranks, a
rank SIGKILLed in its forward, its backward or a save, then another one later. The job
restarts twice (on torch's default shared store, without
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE`), resumes each time from the newest complete
checkpoint, says so, and ends with exactly the parameters, optimizer state and losses of
a run that was never interrupted."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

JOB = Path(__file__).with_name("readme_loop_job.py")
STEPS, EVERY, WORLD = 16, 4, 4


def torchrun(out: Path, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(WORLD), "--max-restarts", str(restarts), "--monitor-interval", "0.1", str(JOB),
           "--out", str(out), "--steps", str(STEPS), "--every", str(EVERY), *args]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    done = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


_references: dict[tuple[str, ...], Path] = {}


def reference(tmp_path_factory, *args: str) -> Path:
    """The same job never interrupted (one per set of options)."""
    if args not in _references:
        out = tmp_path_factory.mktemp("reference")
        torchrun(out, *args)
        _references[args] = out
    return _references[args]


def resumed_at(crash: str) -> int:
    """The step the next attempt resumes at: the newest checkpoint complete before the
    crash (a crash inside a save loses that save)."""
    kind, step, *_ = crash.split(":")
    done = int(step) + 1 if kind == "save" else int(step)
    return (done - 1) // EVERY * EVERY if kind == "save" else done // EVERY * EVERY


def losses(out: Path) -> dict[int, float]:
    """Each step's loss, as last logged (a step redone after a restart is logged again)."""
    found = {}
    for line in (out / "log.txt").read_text().splitlines():
        if line.startswith("step "):
            _, step, _, loss, *_ = line.split()
            found[int(step)] = float(loss)
    return found


def assert_same_end(out: Path, ref: Path, rel: float) -> None:
    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        if rel == 0:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=rel, atol=0, msg=what)

    final, expected = load_file(out / "final" / "model.safetensors"), \
        load_file(ref / "final" / "model.safetensors")
    assert final.keys() == expected.keys()
    for k in expected:
        close(final[k], expected[k], k)
    fo = torch.load(out / "final" / "optimizer.pt", weights_only=True)
    ro = torch.load(ref / "final" / "optimizer.pt", weights_only=True)
    assert fo["param_groups"] == ro["param_groups"]
    for name, st in ro["state"].items():
        for k, v in st.items():
            close(fo["state"][name][k], v, f"{name}.{k}")
    got, want = losses(out), losses(ref)
    assert got.keys() == want.keys() == set(range(STEPS))
    for s in want:
        assert math.isclose(got[s], want[s], rel_tol=rel), (s, got[s], want[s])


SCENARIOS = {
    # Rank 2 dies in step 6's backward; in the next attempt rank 1 dies half-way through
    # writing its shard of checkpoint 12, so that attempt's newest complete one is 8.
    "backward-then-save": ("backward:6:0:2", "save:11:1:1"),
    # Rank 0 (the one that writes the manifest) dies in step 5's forward, then rank 3 in
    # step 13's backward.
    "forward-then-backward": ("forward:5:0:0", "backward:13:1:3"),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario,dtype", [("backward-then-save", "fp32"),
                                            ("forward-then-backward", "fp32"),
                                            ("backward-then-save", "bf16")])
def test_killed_twice_resumes_and_ends_like_an_uninterrupted_run(tmp_path, tmp_path_factory,
                                                                  scenario, dtype):
    options = ("--bf16",) if dtype == "bf16" else ()
    crashes = SCENARIOS[scenario]
    done = torchrun(tmp_path, *options, *[a for c in crashes for a in ("--crash", c)],
                    restarts=2)
    starts = [0] + [resumed_at(c) for c in crashes]
    attempts = [line for line in (tmp_path / "log.txt").read_text().splitlines()
                if line.startswith("attempt")]
    assert attempts == [f"attempt {a} world {WORLD} start {s} from "
                        f"{f'step-{s:06d}' if s else '-'}" for a, s in enumerate(starts)]
    for a, s in enumerate(starts[1:], start=1):
        assert (f"[readme loop] attempt {a}: world {WORLD}, resumed from step-{s:06d}, at "
                f"step {s}") in done.stdout
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [f"step-{s:06d}" for s in range(EVERY, STEPS + 1, EVERY)], names
    # fp32 is bit for bit; bf16 parameters are rounded from the same fp32 masters.
    assert_same_end(tmp_path, reference(tmp_path_factory, *options),
                    rel=0.0 if dtype == "fp32" else 1e-6)

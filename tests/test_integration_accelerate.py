"""Acceptance: an Accelerate training loop with `DeepSpeedPlugin` (ZeRO-2, accumulation 2,
clipping; tests/integration_scripts/accelerate_loop.py): `accumulate`, `backward`,
`clip_grad_norm_`, `save_state` / `load_state` and `get_state_dict`, under real DeepSpeed
and under `evenzero run`, only the launch command differing.

Tolerance: every micro-batch loss, gradient norm and final weight to 1e-6 relative
(1.2e-7 seen: the client torch AdamW steps DeepSpeed's flat fp32 partitions, evenzero's
shards, whose float32 arithmetic rounds in another order); a resume in a new process from
`save_state` is bitwise the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch

from framework_runs import (
    HAS_DEEPSPEED,
    SCRIPTS,
    environment,
    launch,
    max_relative,
    needs_deepspeed,
    records,
    torchrun,
)

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install "
                    "evenzero[integrations]; CI installs it)")
pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "accelerate_loop.py"
SAVE_AT = 8


def loop(out, evenzero: bool, *extra: str):
    out.mkdir()
    launch(torchrun(2, SCRIPT, "--out", str(out), "--save-at", str(SAVE_AT), *extra),
           evenzero=evenzero, env=environment(), cwd=out)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    return {"evenzero": loop(root / "evenzero", True),
            "deepspeed": loop(root / "deepspeed", False) if HAS_DEEPSPEED else None}


def final(out) -> dict:
    return torch.load(out / "final_state_dict.pt", weights_only=True)


@needs_deepspeed
def test_losses_norms_and_state_dict_equal_real_deepspeed(runs):
    for o, t in zip(records(runs["evenzero"] / "record", 2),
                    records(runs["deepspeed"] / "record", 2), strict=True):
        assert o["distributed_type"] == t["distributed_type"] == "DistributedType.DEEPSPEED"
        assert len(o["losses"]) == 16 and len(o["norms"]) == 8
        assert max_relative(o["losses"], t["losses"]) <= 1e-6
        assert max_relative(o["norms"], t["norms"]) <= 1e-6
    ours, theirs = final(runs["evenzero"]), final(runs["deepspeed"])
    assert list(ours) == list(theirs)
    assert all(torch.allclose(ours[k], theirs[k], rtol=1e-6, atol=1e-7) for k in ours)


def test_load_state_in_a_new_process_continues_exactly(runs, tmp_path):
    out = loop(tmp_path / "resumed", True, "--resume", str(runs["evenzero"] / "state"))
    for full, resumed in zip(records(runs["evenzero"] / "record", 2),
                             records(out / "record", 2), strict=True):
        assert resumed["start"] == SAVE_AT
        assert resumed["losses"] == full["losses"][SAVE_AT:]
        assert resumed["norms"] == full["norms"][SAVE_AT // 2:]
    ours, again = final(runs["evenzero"]), final(out)
    assert all(torch.equal(ours[k], again[k]) for k in ours)

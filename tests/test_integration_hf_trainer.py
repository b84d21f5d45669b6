"""Acceptance: Hugging Face Trainer with `--deepspeed` and a ZeRO-2 JSON using "auto"
values (tests/integration_scripts/), a small Llama built from its config, gradient
accumulation 2 and `max_grad_norm`, `save_steps`, then `resume_from_checkpoint` in a new
process at 2, 1 and 4 ranks. The same script runs under real DeepSpeed 0.19.8 and under
`evenzero run`; only the launch command differs.

On a CPU-only machine the script gets `--use_cpu`: Accelerate's DeepSpeed path needs an
accelerator to start its process group (accelerate/state.py `_prepare_backend`), and
`--use_cpu` makes it start the CPU (gloo) one that DeepSpeed then uses; without it each
process would train alone. Both runs get it.

Tolerances: the fp32 runs agree exactly on every micro-batch loss (one rank's loss is
computed from the same weights and data), and the weights after the last step to
float32 rounding (7.5e-9 seen; 1e-6 allowed), which is the order of the gradient-norm
arithmetic (DeepSpeed sums squares per group in another order).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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

pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                    "evenzero[integrations]; CI installs it)")
pytest.importorskip("accelerate", reason="accelerate is not installed")
safetensors = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "hf_trainer_llama.py"
CONFIG = SCRIPTS / "ds_zero2_auto.json"
GLOBAL_MICRO = 4
"""Sequences per micro-batch over all ranks (per-device batch x ranks)."""


def trainer_args(out: Path, world: int, *extra: str) -> list[str]:
    return ["--use_cpu", "--deepspeed", str(CONFIG), "--output_dir", str(out),
            "--max_steps", "6", "--save_steps", "2", "--per_device_train_batch_size",
            str(GLOBAL_MICRO // world), "--gradient_accumulation_steps", "2",
            "--max_grad_norm", "0.5", "--learning_rate", "1e-3", "--warmup_steps", "2",
            "--logging_steps", "1", "--report_to", "none", "--seed", "42",
            "--dataloader_num_workers", "0", "--record", str(out / "rec"), *extra]


def train(out: Path, world: int, evenzero: bool, *extra: str) -> Path:
    launch(torchrun(world, SCRIPT, *trainer_args(out, world, *extra)), evenzero=evenzero,
           env=environment(), cwd=out.parent)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"evenzero": train(root / "evenzero", 2, True),
            "deepspeed": train(root / "deepspeed", 2, False) if HAS_DEEPSPEED else None}


def weights(out: Path) -> dict:
    return safetensors.load_file(out / "model.safetensors")


def max_weight_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@needs_deepspeed
def test_losses_and_weights_equal_real_deepspeed(runs):
    ours, theirs = records(runs["evenzero"] / "rec", 2), records(runs["deepspeed"] / "rec", 2)
    for o, t in zip(ours, theirs, strict=True):
        assert len(o["micro_losses"]) == 12 and o["global_step"] == t["global_step"] == 6
        assert max_relative(o["micro_losses"], t["micro_losses"]) <= 1e-6
        norms = [(h["grad_norm"], g["grad_norm"]) for h, g in
                 zip(o["log_history"], t["log_history"], strict=True) if "grad_norm" in h]
        assert len(norms) == 6 and max_relative(*zip(*norms, strict=True)) <= 1e-6
        lrs = [(h["learning_rate"], g["learning_rate"]) for h, g in
               zip(o["log_history"], t["log_history"], strict=True) if "learning_rate" in h]
        assert all(a == b for a, b in lrs)
    assert max_weight_diff(weights(runs["evenzero"]), weights(runs["deepspeed"])) <= 1e-6


@pytest.mark.parametrize("world", [2, 1, 4])
def test_resume_in_a_new_process_at_any_world_size(runs, world, tmp_path):
    """From the 2-rank run's checkpoint-2, with the same global batch: the resumed run
    ends where the uninterrupted one ended (bitwise at the saving world size)."""
    source = runs["evenzero"] / "checkpoint-2"
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(source, ckpt)
    out = train(tmp_path / "resumed", world, True, "--resume_from_checkpoint", str(ckpt))
    resumed = records(out / "rec", world)[0]
    full = records(runs["evenzero"] / "rec", 2)[0]
    assert resumed["global_step"] == 6
    after = lambda r: [(h["step"], h["loss"]) for h in r["log_history"]  # noqa: E731
                       if "loss" in h and h["step"] > 2]
    assert [s for s, _ in after(resumed)] == [3, 4, 5, 6]
    diff = max_weight_diff(weights(out), weights(runs["evenzero"]))
    if world == 2:
        assert diff == 0.0 and after(resumed) == after(full)
    else:
        assert diff <= 1e-6
        assert max_relative([v for _, v in after(resumed)], [v for _, v in after(full)]) <= 1e-6


@needs_deepspeed
def test_resume_a_deepspeed_written_checkpoint_under_evenzero_at_one_rank(runs, tmp_path):
    """A checkpoint real DeepSpeed wrote (its ZeRO-2 files) resumes under evenzero at
    another world size, which DeepSpeed itself refuses."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(runs["deepspeed"] / "checkpoint-2", ckpt)
    out = train(tmp_path / "resumed", 1, True, "--resume_from_checkpoint", str(ckpt))
    assert max_weight_diff(weights(out), weights(runs["deepspeed"])) <= 1e-6


def test_zero_to_fp32_of_a_trainer_checkpoint_is_its_saved_model(runs):
    from evenzero.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for out in filter(None, runs.values()):
        ckpt = out / "checkpoint-4"
        assert max_weight_diff(get_fp32_state_dict_from_zero_checkpoint(ckpt),
                               safetensors.load_file(ckpt / "model.safetensors")) == 0.0

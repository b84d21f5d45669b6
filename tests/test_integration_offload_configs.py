"""Acceptance (issue 26): the shipped ZeRO-2 CPU-offload configs run unchanged under
`evenzero run` with the HF Trainer on a small Llama built from its config
(tests/integration_scripts/hf_trainer_llama.py), and their losses match real DeepSpeed
0.19.8 on the same config with offload off (`offload_optimizer.device: none`: DeepSpeed's
CPU Adam does not build on this machine). The vendored files and their sources are in
tests/integration_scripts/shipped_offload/ (SOURCE.md).

Accelerate's template hard-codes `fp16.enabled: true`, which the Trainer refuses on the
CPU; it runs with `fp16.enabled` set to "auto" (fp32 here), the one change, and it is
made in a copy. TRL's file is an Accelerate config: it runs through `accelerate launch`
with the same script (as tests/test_integration_trl.py runs TRL's zero2.yaml).

Tolerance: that of tests/test_integration_hf_trainer.py (fp32: every micro-batch loss
equal to 1e-6 relative; it is exact there, and the offloaded step is bit-identical to
the plain one, tests/test_runtime_offload.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from framework_runs import (
    HAS_DEEPSPEED,
    SCRIPTS,
    environment,
    free_port,
    launch,
    max_relative,
    needs_deepspeed,
    records,
    torchrun,
)

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")
pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "hf_trainer_llama.py"
SHIPPED = SCRIPTS / "shipped_offload"
JSON_CONFIGS = ("accelerate_zero_stage2_offload_config.json", "llamafactory_ds_z2_offload_config.json",
                "axolotl_zero2.json", "msswift_zero2_offload.json")
TRL_CONFIG = SHIPPED / "trl_zero2_offload.yaml"
WORLD = 2
LOSS_RTOL = 1e-6


def trainer_args(out: Path) -> list[str]:
    return ["--use_cpu", "--output_dir", str(out), "--max_steps", "4",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--max_grad_norm", "0.5", "--learning_rate", "1e-3", "--warmup_steps", "2",
            "--logging_steps", "1", "--report_to", "none", "--seed", "42",
            "--save_strategy", "no", "--dataloader_num_workers", "0",
            "--record", str(out / "rec")]


def runnable(name: str, out: Path, offload: bool) -> Path:
    """The shipped config as the run gets it: unchanged, but for accelerate's fp16 (see
    the module docstring) and, for the DeepSpeed reference, offload turned off."""
    raw = json.loads((SHIPPED / name).read_text())
    if name.startswith("accelerate_"):
        raw["fp16"]["enabled"] = "auto"
    elif offload:
        return SHIPPED / name
    if not offload:
        raw["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    path = out / name
    path.write_text(json.dumps(raw))
    return path


def run(root: Path, name: str, evenzero: bool) -> Path:
    out = root / f"{name}-{'evenzero' if evenzero else 'deepspeed'}"
    out.mkdir()
    config = runnable(name, out, offload=evenzero)
    launch(torchrun(WORLD, SCRIPT, "--deepspeed", str(config), *trainer_args(out)),
           evenzero=evenzero, env=environment(), cwd=out)
    return out


def run_trl(root: Path, evenzero: bool) -> Path:
    out = root / f"trl-{'evenzero' if evenzero else 'deepspeed'}"
    out.mkdir()
    config = TRL_CONFIG
    if not evenzero:
        config = out / "zero2.yaml"
        config.write_text(TRL_CONFIG.read_text().replace("offload_optimizer_device: cpu",
                                                         "offload_optimizer_device: none"))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), "--mixed_precision", "no",
               str(SCRIPT), *trainer_args(out)]
    launch(command, evenzero=evenzero, env=environment(), cwd=out)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped-offload")
    out = {}
    for name in JSON_CONFIGS:
        out[name] = (run(root, name, True), run(root, name, False) if HAS_DEEPSPEED else None)
    out["trl"] = (run_trl(root, True), run_trl(root, False) if HAS_DEEPSPEED else None)
    return out


@pytest.mark.parametrize("name", [*JSON_CONFIGS, "trl"])
def test_shipped_offload_config_trains_under_evenzero(runs, name):
    for rank, rec in enumerate(records(runs[name][0] / "rec", WORLD)):
        assert rec["world_size"] == WORLD and rec["rank"] == rank
        steps = [h for h in rec["log_history"] if "loss" in h]
        assert len(steps) == 4 and all(h["grad_norm"] > 0 for h in steps), name
        assert rec["cpu_offload"] is True, name  # the engine ran offloaded


@needs_deepspeed
@pytest.mark.parametrize("name", [*JSON_CONFIGS, "trl"])
def test_losses_equal_real_deepspeed_with_offload_off(runs, name):
    ours, theirs = runs[name]
    for o, t in zip(records(ours / "rec", WORLD), records(theirs / "rec", WORLD), strict=True):
        assert len(o["micro_losses"]) == len(t["micro_losses"]) == 8
        assert max_relative(o["micro_losses"], t["micro_losses"]) <= LOSS_RTOL, name

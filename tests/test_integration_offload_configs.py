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
import subprocess
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
OFFLOAD_LOSS_RTOL = 1e-6
"""Against real DeepSpeed's CPU Adam: its C++ `Step_1` and the stand-in's torch form of
it (evenzero.deepspeed.fused_adam) agree to float rounding."""


def accumulation(name: str) -> int:
    """Accelerate's template fixes `gradient_accumulation_steps: 1`, and the Trainer refuses
    arguments that disagree with the config: that run accumulates nothing."""
    return 1 if name.startswith("accelerate_") else 2


def trainer_args(out: Path, accumulate: int = 2) -> list[str]:
    return ["--use_cpu", "--output_dir", str(out), "--max_steps", "4",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", str(accumulate),
            "--max_grad_norm", "0.5", "--learning_rate", "1e-3", "--warmup_steps", "2",
            "--logging_steps", "1", "--report_to", "none", "--seed", "42",
            "--save_strategy", "no", "--dataloader_num_workers", "0",
            "--record", str(out / "rec")]


def runnable(name: str, out: Path, offload: bool) -> Path:
    """The shipped config as the run gets it: unchanged, but for accelerate's fp16 (see
    the module docstring) and, for a DeepSpeed reference without offload, offload off."""
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


def run(root: Path, name: str, kind: str) -> Path:
    """kind: "evenzero" (offload on), "deepspeed" (offload off), "deepspeed-offload"."""
    out = root / f"{name}-{kind}"
    out.mkdir()
    config = runnable(name, out, offload=kind != "deepspeed")
    launch(torchrun(WORLD, SCRIPT, "--deepspeed", str(config),
                    *trainer_args(out, accumulation(name))),
           evenzero=kind == "evenzero", env=environment(), cwd=out)
    return out


def run_trl(root: Path, kind: str) -> Path:
    out = root / f"trl-{kind}"
    out.mkdir()
    config = TRL_CONFIG
    if kind == "deepspeed":
        config = out / "zero2.yaml"
        config.write_text(TRL_CONFIG.read_text().replace("offload_optimizer_device: cpu",
                                                         "offload_optimizer_device: none"))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), "--mixed_precision", "no",
               str(SCRIPT), *trainer_args(out)]
    launch(command, evenzero=kind == "evenzero", env=environment(), cwd=out)
    return out


def cpu_adam_builds() -> bool:
    """Whether real DeepSpeed's CPU Adam kernel builds (or is built) here."""
    if not HAS_DEEPSPEED:
        return False
    probe = ("import torch\nfrom deepspeed.ops.adam import DeepSpeedCPUAdam\n"
             "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])")
    proc = subprocess.run([sys.executable, "-c", probe], env=environment(), capture_output=True,
                          timeout=900)
    return proc.returncode == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped-offload")
    kinds = ["evenzero"] + (["deepspeed"] if HAS_DEEPSPEED else [])
    kinds += ["deepspeed-offload"] if cpu_adam_builds() else []
    out = {}
    for name in JSON_CONFIGS:
        out[name] = {k: run(root, name, k) for k in kinds}
    out["trl"] = {k: run_trl(root, k) for k in kinds}
    return out


@pytest.mark.parametrize("name", [*JSON_CONFIGS, "trl"])
def test_shipped_offload_config_trains_under_evenzero(runs, name):
    for rank, rec in enumerate(records(runs[name]["evenzero"] / "rec", WORLD)):
        assert rec["world_size"] == WORLD and rec["rank"] == rank
        steps = [h for h in rec["log_history"] if "loss" in h]
        assert len(steps) == 4 and all(h["grad_norm"] > 0 for h in steps), name
        assert rec["cpu_offload"] is True, name  # the engine ran offloaded


@needs_deepspeed
@pytest.mark.parametrize("name", [*JSON_CONFIGS, "trl"])
def test_losses_equal_real_deepspeed_with_offload_off(runs, name):
    _compare(runs[name], "deepspeed", name, LOSS_RTOL)


@needs_deepspeed
@pytest.mark.parametrize("name", [*JSON_CONFIGS, "trl"])
def test_losses_equal_real_deepspeed_with_offload_on(runs, name):
    if "deepspeed-offload" not in runs[name]:
        pytest.skip("real DeepSpeed's CPU Adam does not build here")
    for rec in records(runs[name]["deepspeed-offload"] / "rec", WORLD):
        assert rec["cpu_offload"] is True
    _compare(runs[name], "deepspeed-offload", name, OFFLOAD_LOSS_RTOL)


def _compare(run_dirs, reference: str, name: str, rtol: float) -> None:
    micro = 4 * (accumulation(name) if name != "trl" else 2)
    for o, t in zip(records(run_dirs["evenzero"] / "rec", WORLD),
                    records(run_dirs[reference] / "rec", WORLD), strict=True):
        assert len(o["micro_losses"]) == len(t["micro_losses"]) == micro
        assert o["micro_losses"][:accumulation(name)] == t["micro_losses"][:accumulation(name)]
        assert max_relative(o["micro_losses"], t["micro_losses"]) <= rtol, name

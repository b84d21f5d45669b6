"""`deepspeed.utils.zero_to_fp32` on the checkpoints a `save_checkpoint` directory can
hold: evenzero's (the drop-in engine's, 2 ranks, fp32 ZeRO-2 and bf16 ZeRO-1) against the
run's fp32 masters, and real DeepSpeed's ZeRO-1/2 ones against DeepSpeed's own tool
(same names, order, dtypes and values, tied aliases sharing one tensor)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_ckpt_job import Run, TiedNet, deepspeed_config, micro_batch
from deepspeed_fixtures import checkpoint, needs_deepspeed
from dist_helpers import run_distributed
from evenzero.deepspeed.utils import zero_to_fp32

SRC = Path(__file__).resolve().parent.parent / "src"


def save_with_evenzero(rank: int, world: int, run: Run, out: str) -> dict | None:
    import torch.nn.functional as F

    import evenzero.deepspeed as deepspeed
    from evenzero.checkpoint import consolidated_state_dict

    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=TiedNet(), config=deepspeed_config(run, world))
    gas = engine.gradient_accumulation_steps()
    for s in range(3):
        for m in range(gas):
            x, y = micro_batch(s, world, rank, gas, m, run.dtype())
            engine.backward(F.mse_loss(engine(x).float(), y))
            engine.step()
    engine.save_checkpoint(out)
    _, _, masters = consolidated_state_dict(engine.zero)
    module = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    torch.distributed.barrier()
    if rank != 0:
        return None
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(out)
    dtype = run.dtype()
    return {"names": list(got), "tied": got["head.weight"] is got["inp.weight"],
            # Trained parameters: the fp32 masters, not the model's (bf16) copies.
            "masters": {n: got[n].dtype == torch.float32 and torch.equal(got[n], m)
                        for n, m in masters.items()},
            "buffer": torch.equal(got["scale"], module["scale"].float()),
            # Frozen weights as saved, in the model's dtype.
            "frozen": {n: got[n].dtype == dtype and torch.equal(got[n], module[n])
                       for n in ("frozen.weight", "frozen.bias")}}


RUNS = {"fp32-zero2": Run(stage=2), "bf16-zero1": Run(stage=1, precision="bf16")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, rank 0's checks) of each run, trained and saved once."""
    cache: dict[str, tuple[Path, dict]] = {}

    def get(name: str) -> tuple[Path, dict]:
        if name not in cache:
            root = tmp_path_factory.mktemp(name) / "ckpt"
            result = run_distributed(save_with_evenzero, 2, (RUNS[name], str(root)),
                                     timeout=300)[0]
            cache[name] = (root, result)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(RUNS))
def test_evenzero_checkpoint_gives_the_fp32_masters(name, saved):
    _, result = saved(name)
    # DeepSpeed's order: persistent buffers, frozen parameters, trained ones, tied aliases.
    assert result["names"] == ["scale", "frozen.weight", "frozen.bias", "inp.weight", "inp.bias",
                               "mid.weight", "head.bias", "head.weight"]
    assert result["tied"] and result["buffer"]
    assert all(result["masters"].values()) and len(result["masters"]) == 4, result["masters"]
    assert all(result["frozen"].values()), result["frozen"]


def test_recovery_script_and_conversion_write_the_same_state_dict(saved, tmp_path):
    pytest.importorskip("huggingface_hub", reason="sharded output needs huggingface_hub, as "
                        "DeepSpeed's tool does")
    root, _ = saved("fp32-zero2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH",
                                                                                   "")])}
    proc = subprocess.run([sys.executable, str(root / "zero_to_fp32.py"), str(root),
                           str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    direct = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root)
    assert list(written) == list(direct)
    assert all(torch.equal(written[k], direct[k]) for k in direct)
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(root, tmp_path / "bf16", dtype="bf16",
                                                       max_shard_size=None)
    half = torch.load(tmp_path / "bf16" / "pytorch_model.bin", weights_only=True)
    assert half["mid.weight"].dtype == torch.bfloat16
    assert torch.equal(half["mid.weight"], direct["mid.weight"].bfloat16())


def test_missing_latest_and_tag_fail_as_in_deepspeed(tmp_path):
    with pytest.raises(ValueError, match="Unable to find 'latest' file"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="global_step9")


@needs_deepspeed
@pytest.mark.parametrize("run", [Run(stage=2), Run(stage=1, precision="bf16"),
                                 Run(stage=2, decay_groups=True)],
                         ids=["fp32-zero2", "bf16-zero1", "two-groups"])
def test_deepspeed_checkpoint_equals_deepspeeds_own_tool(run, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    theirs = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    root, _ = checkpoint(run, tmp_path_factory)
    ours = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root)
    ref = theirs.get_fp32_state_dict_from_zero_checkpoint(str(root))
    assert list(ours) == list(ref)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype and torch.equal(ours[name], ref[name]), name
    assert ours["head.weight"] is ours["inp.weight"]


def test_module_is_importable_without_deepspeed():
    assert importlib.util.find_spec("evenzero.deepspeed.utils.zero_to_fp32") is not None

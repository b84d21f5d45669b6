"""DeepSpeed checkpoints that must not load: damaged, mismatched, unsupported, unsafe.

Every damaged variant of a real DeepSpeed checkpoint is loaded on 2 gloo ranks in one
job: each must raise the same `CheckpointError` on both ranks and leave the optimizer,
model and scheduler exactly as they were. The unpickling, optimizer and loss-scaler
checks are also tested without processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_ckpt_job import Run, damaged_loads, write_marker_if_unpickled
from deepspeed_fixtures import checkpoint, needs_deepspeed
from dist_helpers import run_distributed
from evenzero.checkpoint import CheckpointError, is_deepspeed_checkpoint
from evenzero.checkpoint.deepspeed.allowlist import load_file
from evenzero.checkpoint.deepspeed.optim_state import loss_scaler_state, optimizer_values
from evenzero.checkpoint.deepspeed.reader import FlatGroup
from evenzero.cli import main

TAG = "global_step4"
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


class RunsCode:
    """Unpickles by calling `write_marker_if_unpickled(path)`: what a malicious file does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (write_marker_if_unpickled, (self.marker,))


def _resave_model_states(tag: Path, change) -> None:
    states = torch.load(tag / MODEL, weights_only=True)
    change(states)
    torch.save(states, tag / MODEL)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _variants(base: Path, stage1: Path, root: Path, marker: Path) -> dict[str, tuple]:
    """name -> (mutation of a copy of `base`'s tag directory, Resume overrides, expected
    words of the error)."""
    def zero3_files(t: Path) -> None:
        for r in range(2):
            shutil.copy(t / MODEL, t / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        (t / MODEL).unlink()

    return {
        "missing-rank-file": (lambda t: (t / OPTIM.format(1)).unlink(), {},
                              [OPTIM.format(1), "missing", "all 2"]),
        "truncated-optimizer-file": (lambda t: _truncate(t / OPTIM.format(0)), {},
                                     [OPTIM.format(0), "truncated"]),
        "truncated-model-states": (lambda t: _truncate(t / MODEL), {}, [MODEL, "truncated"]),
        "renamed-parameter": (None, {"mid_name": "middle"}, ["'middle.weight'", "different model"]),
        "other-shapes": (None, {"dim": 6}, ["shape", "different model"]),
        "zero3-files": (zero3_files, {}, ["ZeRO-3", "zero_to_fp32"]),
        "zero3-config": (lambda t: _resave_model_states(
            t, lambda s: s["ds_config"]["zero_optimization"].update(stage=3)), {}, ["ZeRO-3"]),
        "tensor-parallel": (lambda t: shutil.copy(t / MODEL, t / "mp_rank_01_model_states.pt"),
                            {}, ["tensor/pipeline-parallel", "mp_rank_01"]),
        "moe-expert-files": (lambda t: shutil.copy(
            t / MODEL, t / "layer_0_expert_0_mp_rank_00_model_states.pt"), {}, ["MoE"]),
        "unpickling-runs-code": (lambda t: _resave_model_states(
            t, lambda s: s.update(evil=RunsCode(str(marker)))), {},
            ["write_marker_if_unpickled", "allow-list"]),
        "optimizer-file-of-another-run": (lambda t: shutil.copy(
            stage1 / TAG / OPTIM.format(1), t / OPTIM.format(1)), {}, ["different ZeRO stages"]),
        "extra-rank-file": (lambda t: shutil.copy(t / OPTIM.format(1), t / OPTIM.format(2)), {},
                            ["dp_world_size=2", "mixed"]),
        "no-latest": (lambda t: (t.parent / "latest").unlink(), {}, ["latest", "tag="]),
        "bad-tag-on-one-rank": (None, {"tag": "global_step999", "tag_on_rank": 1},
                                ["rank 1", "global_step999"]),
        "other-scheduler": (None, {"torch_scheduler": True}, ["StepLR", "WarmupDecayLR"]),
    }


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    base, _ = checkpoint(Run(), tmp_path_factory)
    stage1, _ = checkpoint(Run(stage=1), tmp_path_factory)
    root = tmp_path_factory.mktemp("damaged")
    marker = root / "code-ran"
    variants = _variants(base, stage1, root, marker)
    cases = {}
    for name, (mutate, overrides, _) in variants.items():
        path = root / name
        shutil.copytree(base, path)
        if mutate is not None:
            mutate(path / TAG)
        cases[name] = (str(path), overrides)
    out = run_distributed(damaged_loads, 2, (Run(), cases), timeout=300)
    return variants, out, marker


@needs_deepspeed
@pytest.mark.parametrize("case", list(_variants(Path(), Path(), Path(), Path())))
def test_damaged_checkpoint_is_refused_on_every_rank_untouched(case, damaged):
    variants, out, marker = damaged
    errors = [rank[case] for rank in out]
    assert errors[0] is not None, f"{case} loaded"
    assert not errors[0].startswith("STATE CHANGED"), errors[0]
    assert errors[0] == errors[1], errors
    for word in variants[case][2]:
        assert word in errors[0], (word, errors[0])
    assert not marker.exists()


# --------------------------------------------------------------------------- no processes


def test_pickle_with_a_disallowed_type_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"module": {}, "x": RunsCode(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="write_marker_if_unpickled.*allow-list"):
        load_file(tmp_path / "evil.pt")
    assert not marker.exists()
    import argparse

    torch.save({"client": argparse.Namespace(lr=1)}, tmp_path / "ns.pt")
    with pytest.raises(CheckpointError, match="argparse.Namespace"):
        load_file(tmp_path / "ns.pt")
    assert load_file(tmp_path / "ns.pt", allow=[argparse.Namespace])["client"].lr == 1


def _group(hyper, state=("exp_avg", "exp_avg_sq")) -> FlatGroup:
    parts = {"master": (torch.zeros(3),), **{k: (torch.zeros(3),) for k in state}}
    return FlatGroup(0, (("w", (3,)),), {"w": (0, 3)}, parts, {"step": 3}, hyper)


def test_optimizer_that_keeps_other_state_is_refused():
    current = {"params": [], **torch.optim.Adagrad([torch.zeros(1)]).defaults}
    with pytest.raises(CheckpointError, match="Adagrad keeps"):
        optimizer_values([_group({"lr": 0.1})], torch.optim.Adagrad, current, {}, "here")


def test_adam_weight_decay_kind_must_match():
    # FusedAdam groups do not record the decay kind; ds_config does (adam_w_mode).
    current = {"params": [], **torch.optim.AdamW([torch.zeros(1)], weight_decay=0.1).defaults}
    config = {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}
    fused = _group({"lr": 0.1, "bias_correction": True, "weight_decay": 0.1, "step": 0})
    with pytest.raises(CheckpointError, match="torch.optim.Adam"):
        optimizer_values([fused], torch.optim.AdamW, current, config, "here")
    kinds, scalars, hyper = optimizer_values([fused], torch.optim.AdamW, current,
                                             {"optimizer": {"type": "AdamW"}}, "here")
    # FusedAdam's int step becomes torch's 0-d float tensor; lr comes from the file.
    assert kinds == ["exp_avg", "exp_avg_sq"] and hyper["lr"] == 0.1
    assert isinstance(scalars["step"], torch.Tensor) and float(scalars["step"]) == 3.0
    with pytest.raises(CheckpointError, match="bias_correction"):
        optimizer_values([_group({"bias_correction": False})], torch.optim.AdamW, current, {},
                         "here")


@needs_deepspeed
@pytest.mark.parametrize("overflows", [(), (3,), (0, 1, 5), (9,)])
def test_dynamic_loss_scale_grows_on_deepspeeds_step(overflows, monkeypatch):
    """After the mapping, evenzero's scale follows DeepSpeed's step for step (no
    overflow after the resume; DeepSpeed's hysteresis is not modelled: delayed_shift=1)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    # Its overflow log asks for the rank; there is no process group here.
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)

    from evenzero.runtime.precision import LossScaleConfig, LossScaler

    ds = DynamicLossScaler(init_scale=2**10, scale_window=4, min_scale=1, delayed_shift=1,
                           consecutive_hysteresis=False)
    for i in range(10):
        ds.update_scale(i in overflows)
    ez = LossScaler(True, LossScaleConfig(growth_interval=4, min_scale=1.0))
    ez.load_state_dict(loss_scaler_state(vars(ds), ez, len(overflows), "here"))
    for _ in range(12):
        assert ez.scale == ds.cur_scale
        ds.update_scale(False)
        ez.update(False)
    with pytest.raises(CheckpointError, match="growth_interval=4"):
        loss_scaler_state(vars(ds), LossScaler(True, LossScaleConfig(growth_interval=9)), 0, "x")


# --------------------------------------------------------------------------- CLI


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["convert-deepspeed", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "does not exist" in err
    (tmp_path / "z3" / TAG).mkdir(parents=True)
    (tmp_path / "z3" / "latest").write_text(TAG)
    (tmp_path / "z3" / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    assert main(["convert-deepspeed", str(tmp_path / "z3"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ZeRO-3" in err
    assert main(["convert-deepspeed"]) == 2
    assert "DS_DIR" in capsys.readouterr().err


@needs_deepspeed
def test_cli_converts_without_deepspeed_or_torch_distributed(tmp_path_factory, tmp_path):
    ckpt, _ = checkpoint(Run(), tmp_path_factory)
    assert is_deepspeed_checkpoint(ckpt) and is_deepspeed_checkpoint(ckpt / TAG)
    assert not is_deepspeed_checkpoint(tmp_path)
    # DeepSpeed cannot be imported in the converting process.
    code = ("import sys; sys.modules['deepspeed'] = None; from evenzero.cli import main; "
            "rc = main(sys.argv[1:]); import torch.distributed as d; "
            "assert not d.is_initialized(); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "convert-deepspeed", str(ckpt),
                           str(tmp_path / "out"), "--tag", TAG],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "step-000004" / "manifest.json").is_file()
    assert not is_deepspeed_checkpoint(tmp_path / "out")


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("run, words", [(Run(stage=3), "ZeRO-3"), (Run(moe=True), "MoE")],
                         ids=["zero3", "moe"])
def test_real_unsupported_checkpoints_are_refused(run, words, tmp_path_factory):
    """Real ZeRO-3 and MoE checkpoints of DeepSpeed 0.19.8: refused with the reason."""
    from evenzero.checkpoint.deepspeed.reader import read_deepspeed

    ckpt, _ = checkpoint(run, tmp_path_factory)
    assert is_deepspeed_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=words):
        read_deepspeed(ckpt)


def test_deepspeed_groups_with_other_options_do_not_merge():
    current = {"params": [], **torch.optim.AdamW([torch.zeros(1)]).defaults}
    decay, no_decay = _group({"weight_decay": 0.1}), _group({"weight_decay": 0.0})
    with pytest.raises(CheckpointError, match="different options"):
        optimizer_values([decay, no_decay], torch.optim.AdamW, current, {}, "here")
    _, _, hyper = optimizer_values([decay, decay], torch.optim.AdamW, current, {}, "here")
    assert hyper["weight_decay"] == 0.1

"""Resuming real DeepSpeed 0.19.8 ZeRO-1/2 checkpoints under evenzero, at any world size.

DeepSpeed trains `TiedNet` on 2 ranks (AdamW, WarmupDecayLR, gradient accumulation 2,
clipping), saves after 4 steps and goes on for 4 more. evenzero builds the model from
another seed, loads the checkpoint with `load_deepspeed` into a plain `ZeroOptimizer`
and trains the same 4 steps with the same global batch on W ranks: its losses must be
DeepSpeed's. Before the load nothing of evenzero's state is right (weights, buffer,
frozen layer, lr, betas), so equal losses need every piece of the checkpoint.

Tolerances (measured max |loss difference| over 4 steps in brackets): fp32 at the saved
world size 1e-5 (1.5e-8), at other world sizes 1e-4 (3.5e-8: sums in another order);
DeepSpeed's FusedAdam resumed with torch's AdamW 1e-5 (8.5e-8); fp16 1e-4 (5.7e-6) and
bf16 5e-4 (1.6e-4): DeepSpeed accumulates 16-bit gradients in 16 bits, evenzero in fp32.
"""

from __future__ import annotations

import json
import math

import pytest

from deepspeed_ckpt_job import (
    CLIP,
    SAVED_AT,
    Resume,
    Run,
    exclude_frozen_loads,
    partial_loads,
    resume_evenzero,
)
from deepspeed_fixtures import checkpoint, needs_deepspeed
from dist_helpers import run_distributed
from evenzero.checkpoint.deepspeed.offline import convert_deepspeed

pytestmark = needs_deepspeed

GAS = {1: 4, 2: 2, 3: 2, 4: 1}
"""Gradient accumulation per world size for DeepSpeed's global batch of 12 (2 ranks x 3
samples x 2 micro-batches)."""

CASES = {
    # id: (run, evenzero world size, loss tolerance, slow)
    "zero2-2ranks": (Run(), 2, 1e-5, False),
    "zero2-4ranks-and-converted": (Run(), 4, 1e-4, False),
    "zero1-3ranks": (Run(stage=1), 3, 1e-4, True),
    "zero2-1rank": (Run(), 1, 1e-4, True),
    "zero2-3ranks": (Run(), 3, 1e-4, True),
    "zero1-2ranks": (Run(stage=1), 2, 1e-5, True),
    "zero1-4ranks": (Run(stage=1), 4, 1e-4, True),
    "zero1-1rank": (Run(stage=1), 1, 1e-4, True),
    "bf16-2ranks": (Run(precision="bf16"), 2, 5e-4, True),
    "bf16-4ranks": (Run(precision="bf16"), 4, 5e-4, True),
    "bf16-3ranks-and-converted": (Run(precision="bf16"), 3, 5e-4, True),
    "fp16-2ranks": (Run(precision="fp16"), 2, 1e-4, True),
    "fp16-4ranks-and-converted": (Run(precision="fp16"), 4, 1e-4, True),
    "fusedadam-2ranks": (Run(optimizer="fused"), 2, 1e-5, True),
    "fusedadam-3ranks": (Run(optimizer="fused"), 3, 1e-4, True),
    "two-groups-3ranks-and-converted": (Run(decay_groups=True), 3, 1e-4, True),
    # bf16 + ZeRO-1 + fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, whose
    # files keep the tail padding (98 and 14 elements: 2 padding each at 2 ranks).
    "bf16-optimizer-two-groups-3ranks": (Run(stage=1, precision="bf16", decay_groups=True,
                                             config_extra={"data_types": {
                                                 "grad_accum_dtype": "fp32"}}), 3, 5e-4, True),
    "bf16-roundrobin-alignment-3ranks": (Run(precision="bf16", zero_extra={
        "round_robin_gradients": True, "parameter_alignment": True}), 3, 5e-4, True),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if CASES[c][3] else c
                                  for c in CASES])
def test_resume_continues_like_deepspeed(case, tmp_path_factory, tmp_path):
    run, world, tolerance, _ = CASES[case]
    ckpt, deepspeed = checkpoint(run, tmp_path_factory)
    converted = None
    if "converted" in case:
        converted = str(convert_deepspeed(ckpt, tmp_path / "converted"))
    out = run_distributed(resume_evenzero, world,
                          (run, Resume(gas=GAS[world], stage=run.stage), str(ckpt), converted),
                          timeout=300)
    assert min(deepspeed["norms"]) > CLIP  # every step was clipped
    losses = out[0]["losses"]
    diffs = [abs(a - b) for a, b in zip(losses, deepspeed["after"], strict=True)]
    assert max(diffs) <= tolerance, (diffs, losses, deepspeed["after"])
    # The state that made them equal came from the checkpoint, on every rank alike.
    for r in out:
        assert r["losses"] == losses
        assert r["info"]["global_steps"] == SAVED_AT and r["step_count"] == SAVED_AT
        assert r["lbi"] == SAVED_AT - 1 == r["info"]["lr_scheduler"]["last_batch_iteration"]
        assert math.isclose(r["lr"][0], 0.01) and tuple(r["betas"]) == (0.9, 0.999)
        assert r["client_epoch"] == 7 and r["info"]["dp_world_size"] == 2
        assert r["info"]["zero_stage"] == run.stage and r["info"]["clip_grad"] == 0.05
        assert r["info"]["global_samples"] == SAVED_AT * 12
    if run.precision == "fp16":
        # DeepSpeed's dynamic scale (2**10, no overflow in 4 steps) is evenzero's now.
        assert out[0]["scale"] == out[0]["info"]["loss_scaler"]["cur_scale"] == 1024
    if converted is not None:
        # `evenzero convert-deepspeed` output, loaded with evenzero's own loader, gives
        # exactly the state load_deepspeed gave.
        assert all(r["converted_equal"] for r in out)
        assert out[0]["converted_step_count"] == SAVED_AT
        summary = json.loads((tmp_path / "converted" / "deepspeed.json").read_text())
        assert summary["lr_scheduler"] == {"last_batch_iteration": SAVED_AT - 1}
        assert summary["client_state"] == {"epoch": 7, "note": "from deepspeed"}
        assert summary["global_steps"] == SAVED_AT and summary["tag"] == f"global_step{SAVED_AT}"


@pytest.mark.slow
def test_elastic_checkpoint_loads_the_same_state(tmp_path_factory):
    """`elastic_checkpoint: true` stores the optimizer state cut per group and no param
    groups; the same training saved rigidly must load to the same masters and moments."""
    rigid, _ = checkpoint(Run(), tmp_path_factory)
    elastic, _ = checkpoint(Run(zero_extra={"elastic_checkpoint": True}), tmp_path_factory)
    from evenzero.checkpoint.deepspeed.reader import read_deepspeed

    a, b = read_deepspeed(rigid), read_deepspeed(elastic)
    assert b.groups[0].hyperparameters is None
    for (name, _), _ in zip(a.groups[0].params, b.groups[0].params, strict=True):
        for kind in a.groups[0].parts:
            assert a.groups[0].flat(name, kind).equal(b.groups[0].flat(name, kind)), (name, kind)


def test_weights_only_and_module_only_loads(tmp_path_factory):
    """DeepSpeed's `load_optimizer_states=False` rebuilds the masters from the saved
    weights and keeps the optimizer (state, lr) as it is but loads the counters and the
    scheduler; `load_module_only=True` loads the weights and nothing else."""
    ckpt, _ = checkpoint(Run(), tmp_path_factory)
    out = run_distributed(partial_loads, 2, (Run(), str(ckpt)), timeout=300)
    assert out[0] == out[1]
    weights, module = out[0]["weights"], out[0]["module_only"]
    assert weights["weights_equal"] and module["weights_equal"]
    assert weights["optimizer_state"] == module["optimizer_state"] == 0
    assert weights["lr_kept"] and module["lr_kept"]
    assert (weights["step_count"], weights["lbi"]) == (SAVED_AT, SAVED_AT - 1)
    assert (module["step_count"], module["lbi"]) == (0, -1)
    # engine.load_checkpoint's client_state: what DeepSpeed did not consume.
    assert "optimizer" in weights["client_keys"] and "global_steps" not in weights["client_keys"]
    assert {"global_steps", "skipped_steps", "epoch"} <= set(module["client_keys"])
    assert "lr_scheduler" not in module["client_keys"]


@pytest.mark.slow
def test_checkpoint_without_frozen_parameters_needs_non_strict(tmp_path_factory):
    """`save_checkpoint(exclude_frozen_parameters=True)` leaves the frozen layer out: a
    strict load refuses (as DeepSpeed's), `load_module_strict=False` keeps this model's."""
    ckpt, _ = checkpoint(Run(exclude_frozen=True), tmp_path_factory)
    out = run_distributed(exclude_frozen_loads, 2, (Run(), str(ckpt)), timeout=300)
    assert out[0] == out[1]
    assert "'frozen.weight'" in out[0]["strict"] and "load_module_strict=False" in out[0]["strict"]
    assert out[0]["frozen_kept"] and out[0]["trained_loaded"] and out[0]["step_count"] == SAVED_AT

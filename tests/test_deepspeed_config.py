"""Config reading, optimizer mapping and the fp16 loss scale, against DeepSpeed 0.19.8
where DeepSpeed can be run in-process; refusals name the key."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenzero.deepspeed.batch import batch_sizes
from evenzero.deepspeed.config import DeepSpeedConfigError, parse_config
from evenzero.deepspeed.fused_adam import FusedAdam
from evenzero.deepspeed.loss_scaler import DeepSpeedLossScaler, LossScaleAtMinimum
from evenzero.deepspeed.optimizers import (
    as_groups,
    optimizer_from_config,
    split_moe_groups,
)

BASE = {"train_micro_batch_size_per_gpu": 2}


def _deepspeed_batch(raw: dict, world: int, monkeypatch) -> tuple:
    """DeepSpeed's own batch triple, or its error text."""
    config = pytest.importorskip("deepspeed.runtime.config",
                                 reason="DeepSpeed is not installed (pip install deepspeed)")
    monkeypatch.setattr(config.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(config.dist, "get_world_size", lambda: world)
    try:
        c = config.DeepSpeedConfig(dict(raw))
    except AssertionError as e:
        return ("error", str(e).split(" ")[0])
    return (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps)


def _our_batch(raw: dict, world: int) -> tuple:
    try:
        b = batch_sizes(raw, world)
    except DeepSpeedConfigError as e:
        return ("error", str(e).split(" ")[0])
    return (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("keys", [
    {"train_batch_size": 8}, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
    {"train_batch_size": 8, "gradient_accumulation_steps": 4},
    {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
    {"train_micro_batch_size_per_gpu": 3},
    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3},
    {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
    {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4},
    {"gradient_accumulation_steps": 2},
])
def test_batch_rules_equal_deepspeed(keys, world, monkeypatch):
    assert _our_batch(keys, world) == _deepspeed_batch(keys, world, monkeypatch)


REFUSED = [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "offload_optimizer.device"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "bogus": 1}}},
     "offload_optimizer.bogus"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}, "offload_param"),
    ({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
     "zero_quantized_gradients"),
    ({"zero_optimization": {"stage": 2, "not_a_zero_key": 1}}, "not_a_zero_key"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast"),
    ({"compile": {"deepcompile": True}}, "compile"),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine"),
    ({"data_efficiency": {"enabled": True}}, "data_efficiency"),
    ({"amp": {"enabled": True}}, "amp"),
    ({"elasticity": {"enabled": True}}, "elasticity"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16_master_weights_and_grads"),
    ({"fp16": {"enabled": True, "scale_power": 3}}, "fp16.scale_power"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "simultaneously"),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op"),
    ({"managed_gradient_accumulation": "no"}, "managed_gradient_accumulation"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
     "data_types.grad_accum_dtype"),
    ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
    ({"communication_data_type": "int8"}, "communication_data_type"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor"),
]


@pytest.mark.parametrize(("extra", "key"), REFUSED, ids=[k for _, k in REFUSED])
def test_unsupported_keys_are_errors_naming_the_key(extra, key):
    with pytest.raises(DeepSpeedConfigError, match=key.replace(".", r"\.")):
        parse_config({**BASE, **extra}, 1)


def test_stage12_keys_deepspeed_runs_are_parsed_with_their_meaning():
    cfg = parse_config({**BASE, "gradient_allreduce_op": "SUM",
                        "managed_gradient_accumulation": False,
                        "gradient_predivide_factor": 2.0,
                        "zero_optimization": {"stage": 1},
                        "checkpoint": {"tag_validation": "fail"},
                        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, 1)
    assert cfg.gradient_allreduce_op == "sum"
    assert cfg.managed_gradient_accumulation is False
    assert cfg.tag_validation == "FAIL"
    assert parse_config(BASE, 1).tag_validation == "WARN"  # DeepSpeed's default
    # DeepSpeed's ZeRO-2 asserts on a predivide factor while reduce-scattering (its default).
    with pytest.raises(AssertionError, match="gradient_predivide_factor"):
        parse_config({**BASE, "gradient_predivide_factor": 2.0,
                      "zero_optimization": {"stage": 2}}, 1)
    with pytest.raises(AssertionError, match="nccl_start_alignment_factor"):
        parse_config({**BASE, "zero_optimization": {"stage": 2, "allgather_bucket_size": 3}}, 1)
    with pytest.raises(DeepSpeedConfigError, match="tag_validation value of NOPE"):
        parse_config({**BASE, "checkpoint": {"tag_validation": "nope"}}, 1)


@pytest.mark.parametrize(("extra", "key"), [
    ({"optimizer": {"type": "Lamb", "params": {}}}, "lamb"),
    ({"optimizer": {"type": "OneBitAdam", "params": {}}}, "OneBitAdam"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "max_grad_norm"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "amsgrad"),
    ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, "momentum"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": (0.9, 0.9)}}}, "betas"),
])
def test_unsupported_optimizers_are_errors_naming_the_key(extra, key):
    cfg = parse_config({**BASE, **extra}, 1)
    with pytest.raises(DeepSpeedConfigError, match=key):
        optimizer_from_config(cfg.optimizer)


def test_hf_auto_values_outside_hf_name_every_key_and_who_fills_them():
    """Issue 29: `"enabled": "auto"` used to fail as "bfloat16 and fp16 modes cannot be
    simultaneously enabled" (`bool("auto")`), which says nothing about "auto"."""
    raw = {**BASE, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    with pytest.raises(DeepSpeedConfigError) as e:
        parse_config(raw, 2)
    assert str(e.value).startswith(
        "config key 'fp16.enabled' = \"auto\" (and bf16.enabled, "
        "zero_optimization.reduce_bucket_size): \"auto\" values are filled in only by HF "
        "Trainer and Accelerate")
    assert "simultaneously" not in str(e.value)
    # The same keys with values are fine.
    assert parse_config({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                         "fp16": {"enabled": False}}, 2).precision.fp16 is False


def test_no_op_keys_are_accepted_and_say_why():
    raw = {**BASE, "zero_optimization": {"stage": 2, "overlap_comm": True,
                                         "contiguous_gradients": True, "reduce_scatter": True,
                                         "allgather_bucket_size": 5e8,
                                         "round_robin_gradients": True,
                                         "reduce_bucket_size": 5e5,
                                         "offload_optimizer": {"device": "none"}},
           "wall_clock_breakdown": True, "tensor_parallel": {"autotp_size": 1},
           "made_up_key": 1}
    cfg = parse_config(raw, 1)
    assert cfg.zero.stage == 2 and cfg.zero.reduce_bucket_size == 500000
    keys = dict(cfg.no_ops)
    for k in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_bucket_size",
              "round_robin_gradients"):
        assert f"zero_optimization.{k}" in keys and keys[f"zero_optimization.{k}"]
    assert "wall_clock_breakdown" in keys
    assert cfg.unknown_keys == ("made_up_key",)  # DeepSpeed ignores them; initialize warns


def test_defaults_follow_deepspeed():
    cfg = parse_config(BASE, 2)
    assert cfg.gradient_clipping == 1.0  # deepspeed/runtime/constants.py@0.19.8:203
    assert cfg.zero.stage == 0 and not cfg.precision.fp16 and cfg.optimizer is None
    assert (cfg.batch.train_batch_size, cfg.batch.gradient_accumulation_steps) == (4, 1)


@pytest.mark.parametrize(("section", "cls", "kwargs"), [
    # DeepSpeed's FusedAdam: AdamW unless adam_w_mode is false (AdamW forces it).
    ({"type": "Adam", "params": {"lr": 0.01}}, FusedAdam, {"lr": 0.01, "adam_w_mode": True}),
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, FusedAdam,
     {"weight_decay": 0.1, "adam_w_mode": False}),
    ({"type": "AdamW", "params": {"adam_w_mode": False, "betas": [0.8, 0.9]}}, FusedAdam,
     {"betas": (0.8, 0.9), "adam_w_mode": True}),
    # torch_adam: torch's own defaults apply (AdamW's weight_decay 0.01).
    ({"type": "Adam", "params": {"torch_adam": True, "lr": 0.01}}, torch.optim.AdamW,
     {"lr": 0.01, "foreach": None}),
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, torch.optim.Adam,
     {"foreach": None}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD,
     {"lr": 0.1, "momentum": 0.9}),
    ({"type": "Adagrad", "params": {"lr": 0.1}}, torch.optim.Adagrad, {"lr": 0.1}),
])
def test_optimizer_sections_map_to_the_torch_optimizer_deepspeed_runs(section, cls, kwargs):
    choice = optimizer_from_config(parse_config({**BASE, "optimizer": section}, 1).optimizer)
    assert choice.cls is cls and dict(choice.kwargs) == kwargs


def test_fused_adam_signature_and_defaults_are_deepspeeds():
    fused = pytest.importorskip("deepspeed.ops.adam.fused_adam", reason="DeepSpeed not installed")
    import inspect

    theirs = inspect.signature(fused.FusedAdam.__init__).parameters
    ours = inspect.signature(FusedAdam.__init__).parameters
    assert [(k, v.default) for k, v in ours.items()] == [(k, v.default) for k, v in theirs.items()]


def test_fused_adam_is_torch_adam_up_to_rounding():
    """The kernel's update is torch's Adam/AdamW update: over a few steps they agree to
    float rounding (torch's decoupled decay drifts only over many steps)."""
    for adam_w_mode, cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        start = torch.randn(500, generator=torch.Generator().manual_seed(0))
        a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
        ours, torchs = FusedAdam([a], adam_w_mode=adam_w_mode, **kw), cls([b], **kw)
        for step in range(10):
            g = torch.randn(500, generator=torch.Generator().manual_seed(step + 1))
            a.grad, b.grad = g.clone(), g.clone()
            ours.step()
            torchs.step()
        assert (a - b).abs().max().item() < 1e-6


@pytest.mark.slow
def test_fused_adam_kernel_arithmetic_equals_deepspeeds():
    """Against DeepSpeed's CPU FusedAdam kernel (JIT-built on first use): a few float32
    ulps after 300 steps, with and without bias correction, both decay modes, no drift."""
    fused = pytest.importorskip("deepspeed.ops.adam.fused_adam", reason="DeepSpeed not installed")
    for adam_w_mode in (True, False):
        for bias_correction in (True, False):
            start = torch.randn(1000, generator=torch.Generator().manual_seed(0))
            a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
            kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1,
                  "bias_correction": bias_correction, "adam_w_mode": adam_w_mode}
            ds, ours = fused.FusedAdam([a], **kw), FusedAdam([b], **kw)
            for step in range(300):
                g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
                a.grad, b.grad = g.clone(), g.clone()
                ds.step()
                ours.step()
            assert (a - b).abs().max().item() < 1e-6


def test_moe_groups_split_like_deepspeed():
    utils = pytest.importorskip("deepspeed.moe.utils", reason="DeepSpeed is not installed")
    params = [torch.nn.Parameter(torch.zeros(i + 1)) for i in range(5)]
    for p in params[1:4]:
        p.allreduce, p.group_name = False, "ep_size_2"
    for groups in ([{"params": params, "name": "dense-params", "lr": 0.1}],
                   [{"params": params[:3], "name": "a"}, {"params": params[3:], "name": "b"}]):
        want = utils.split_params_into_different_moe_groups_for_optimizer(
            [dict(g, params=list(g["params"])) for g in groups])
        got = split_moe_groups([dict(g, params=list(g["params"])) for g in groups])
        assert [{**g, "params": [id(p) for p in g["params"]]} for g in got] == \
               [{**g, "params": [id(p) for p in g["params"]]} for g in want]
    assert split_moe_groups(as_groups(params))[0]["name"] == "dense-params"


# --------------------------------------------------------------------------- loss scaler

def _deepspeed_scaler(monkeypatch, **kw):
    ls = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler",
                             reason="DeepSpeed is not installed (pip install deepspeed)")
    monkeypatch.setattr(ls.dist, "get_rank", lambda: 0)
    return ls.DynamicLossScaler(**kw), ls


@settings(max_examples=60, deadline=None)
@given(overflows=st.lists(st.booleans(), min_size=1, max_size=60),
       power=st.integers(0, 16), window=st.integers(1, 5), hysteresis=st.integers(1, 4),
       consecutive=st.booleans(), min_scale=st.sampled_from([1, 0.25, 4]))
def test_loss_scale_sequence_equals_deepspeeds(overflows, power, window, hysteresis,
                                               consecutive, min_scale):
    mp = pytest.MonkeyPatch()
    try:
        kw = {"init_scale": 2.0 ** power, "scale_window": window, "min_scale": min_scale,
              "delayed_shift": hysteresis, "consecutive_hysteresis": consecutive}
        theirs, _ = _deepspeed_scaler(mp, **kw)
        ours = DeepSpeedLossScaler(dynamic=True, **kw)
        for overflow in overflows:
            outcomes = []
            for scaler in (theirs, ours):
                try:
                    scaler.update_scale(overflow)
                    outcomes.append((scaler.cur_scale, scaler.cur_hysteresis, scaler.cur_iter,
                                     scaler.last_overflow_iter))
                except Exception as e:  # noqa: BLE001 - DeepSpeed raises a bare Exception
                    outcomes.append(("raised", "minimum" in str(e)))
            assert outcomes[0] == outcomes[1]
            if outcomes[0][0] == "raised":
                break
    finally:
        mp.undo()


def test_loss_scale_at_minimum_raises_like_deepspeed():
    s = DeepSpeedLossScaler(init_scale=1, dynamic=True, min_scale=1, delayed_shift=1)
    with pytest.raises(LossScaleAtMinimum, match="already at minimum"):
        s.update_scale(True)


def test_loss_scaler_from_config_and_state_round_trip():
    cfg = parse_config({**BASE, "fp16": {"enabled": True, "initial_scale_power": 5,
                                         "loss_scale_window": 3, "hysteresis": 3,
                                         "min_loss_scale": 2}}, 1)
    s = DeepSpeedLossScaler.from_precision(cfg.precision)
    assert (s.cur_scale, s.scale_window, s.delayed_shift, s.min_scale, s.dynamic) == \
           (32.0, 3, 3, 2, True)
    for o in (True, False, True, True):
        s.update_scale(o)
    t = DeepSpeedLossScaler.from_precision(cfg.precision)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    static = DeepSpeedLossScaler.from_precision(parse_config(
        {**BASE, "fp16": {"enabled": True, "loss_scale": 128}}, 1).precision)
    assert (static.cur_scale, static.dynamic) == (128.0, False)
    with pytest.raises(ValueError, match="dynamic"):
        static.load_state_dict(s.state_dict())


def test_importing_does_not_import_deepspeed():
    """`import evenzero.deepspeed` must not import DeepSpeed (nor need it installed),
    `deepspeed.moe.layer` included (evenzero's implementation of DeepSpeed's layer)."""
    import subprocess
    import sys

    code = ("import sys, evenzero.deepspeed as ds; assert 'deepspeed' not in sys.modules; "
            "ds.comm.get_rank(); ds.WarmupLR; ds.initialize; ds.moe.layer.MoE; "
            "ds.moe.utils.split_params_into_different_moe_groups_for_optimizer; "
            "assert 'deepspeed' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------- offload (issue 26)


def test_offload_optimizer_cpu_is_accepted_with_deepspeeds_keys():
    from evenzero.deepspeed.fused_adam import DeepSpeedCPUAdam
    from evenzero.deepspeed.optimizers import optimizer_from_client

    raw = {**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "pin_memory": False, "buffer_count": 4, "fast_init": False,
        "ratio": 1.0}}}
    cfg = parse_config(raw, 1)
    assert (cfg.zero.offload_optimizer, cfg.zero.pin_memory) == ("cpu", False)
    no_ops = dict(cfg.no_ops)
    assert "NVMe" in no_ops["zero_optimization.offload_optimizer.buffer_count"]
    assert "zero_optimization.offload_optimizer.fast_init" in no_ops
    assert parse_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu"}}}, 1).zero.pin_memory is True  # DeepSpeed 0.19.8's default
    legacy = parse_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}}, 1)
    assert legacy.zero.offload_optimizer == "cpu"
    assert parse_config({**BASE, "zero_force_ds_cpu_optimizer": False}, 1).force_ds_cpu_optimizer \
        is False
    # Adam/AdamW under offload is DeepSpeed's CPU Adam, its mode kept
    for kind, params, mode in (("AdamW", {}, True), ("Adam", {"adam_w_mode": False}, False)):
        choice = optimizer_from_config(parse_config(
            {**BASE, "optimizer": {"type": kind, "params": {"lr": 1e-3, **params}}}, 1).optimizer,
            offload=True)
        assert choice.cls is DeepSpeedCPUAdam and choice.kwargs["adamw_mode"] is mode
    client = DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], adamw_mode=False)
    assert optimizer_from_client(client).kwargs["adamw_mode"] is False


@pytest.mark.parametrize("adamw", [True, False])
def test_deepspeed_cpu_adam_is_torch_adam_up_to_rounding(adamw):
    from evenzero.deepspeed.fused_adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    w = torch.randn(64)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = DeepSpeedCPUAdam([a], lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)([b], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(64)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)

"""evenzero.deepspeed's LR schedules give DeepSpeed's sequences exactly (in-process,
against deepspeed.runtime.lr_schedules@0.19.8 on twin optimizers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenzero.deepspeed import schedulers as ours

theirs = pytest.importorskip("deepspeed.runtime.lr_schedules",
                             reason="DeepSpeed is not installed (pip install deepspeed)")

STEPS = 25


def _optimizer(kind: str = "adamw", lr=0.1, tensor_lr: bool = False) -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    groups = [{"params": [a]}, {"params": [b], "lr": 0.05}]
    lr = torch.tensor(lr) if tensor_lr else lr
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    return torch.optim.AdamW(groups, lr=lr)


def _trace(module, name: str, params: dict, kind: str = "adamw", tensor_lr: bool = False,
           resume_at: int | None = None) -> list:
    """Group LRs (and betas) after construction and after every step; with `resume_at`,
    the job "restarts" there: a fresh optimizer and schedule load the first one's
    state_dict, as `engine.load_checkpoint` does."""
    opt = _optimizer(kind, tensor_lr=tensor_lr)
    sched = getattr(module, name)(opt, **params)

    def row():
        return [(float(g["lr"]), g.get("betas")) for g in opt.param_groups]

    out = [row()]
    for i in range(STEPS):
        if resume_at is not None and i == resume_at:
            state = sched.state_dict()
            opt = _optimizer(kind, tensor_lr=tensor_lr)
            sched = getattr(module, name)(opt, **params)
            sched.load_state_dict(state)
        sched.step()
        out.append(row() + [sched.get_last_lr()])
    return out


CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
                  "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_min_lr": [0.01, 0.0], "warmup_num_steps": 1}),
    ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "cubic"}),  # unknown: log
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                       "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 6}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                        "cos_min_ratio": 0.01, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 3}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                  "decay_lr_rate": 0.5, "decay_step_size": 2, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": [0.01, 0.02], "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                  "cycle_second_step_size": 3, "cycle_first_stair_count": 2}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                  "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2}),
    ("LRRangeTest", {"lr_range_test_min_lr": [0.01, 0.002], "lr_range_test_step_size": 3,
                     "lr_range_test_staircase": True, "lr_range_test_step_rate": 2.0}),
]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                        enumerate(CASES)])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_sequence_equals_deepspeed(name, params, kind):
    assert _trace(ours, name, params, kind) == _trace(theirs, name, params, kind)


@pytest.mark.parametrize(("name", "params"), CASES[:1] + CASES[6:7] + CASES[8:9])
def test_resumed_from_state_dict_equals_deepspeed(name, params):
    """state_dict/load_state_dict: a schedule rebuilt mid-run continues identically."""
    assert _trace(ours, name, params, resume_at=7) == _trace(theirs, name, params, resume_at=7)
    assert _trace(ours, name, params, resume_at=7) == _trace(ours, name, params)


@pytest.mark.parametrize(("name", "params"), [CASES[0], CASES[6], CASES[11]])
def test_tensor_learning_rates_filled_in_place(name, params):
    assert _trace(ours, name, params, tensor_lr=True) == _trace(theirs, name, params,
                                                                 tensor_lr=True)


@settings(max_examples=40, deadline=None)
@given(lo=st.floats(0, 0.05), hi=st.floats(0.05, 1.0), warmup=st.integers(1, 12),
       total=st.integers(1, 30), kind=st.sampled_from(["log", "linear"]))
def test_warmup_schedules_for_any_parameters(lo, hi, warmup, total, kind):
    for name, params in (
            ("WarmupLR", {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": warmup,
                          "warmup_type": kind}),
            ("WarmupDecayLR", {"total_num_steps": total, "warmup_min_lr": lo,
                               "warmup_max_lr": hi, "warmup_num_steps": warmup,
                               "warmup_type": kind}),
            ("WarmupCosineLR", {"total_num_steps": total, "warmup_min_ratio": lo / hi,
                                "warmup_num_steps": warmup, "cos_min_ratio": lo,
                                "warmup_type": kind})):
        assert _trace(ours, name, params) == _trace(theirs, name, params)


def test_same_errors_and_last_lr_contract():
    for module in (ours, theirs):
        with pytest.raises(ValueError, match="warmup_num_steps"):
            module.WarmupLR(_optimizer(), warmup_num_steps=0)
        with pytest.raises(ValueError, match="expected 2 value"):
            module.WarmupLR(_optimizer(), warmup_min_lr=[0.1, 0.2, 0.3])
        with pytest.raises(AssertionError, match="need to call step"):
            module.OneCycle(_optimizer(), 0.01, 0.1).get_last_lr()


def test_config_names_torch_schedulers_too():
    opt = _optimizer()
    sched = ours.schedule_from_config("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match="does not recognize LR scheduler Warmup"):
        ours.schedule_from_config("Warmup", {}, opt)

"""DeepSpeed's learning-rate schedules, value for value.

Same contract as deepspeed/runtime/lr_schedules.py@0.19.8, which is not torch's
`LRScheduler`: `last_batch_iteration` starts at -1, the constructor writes `get_lr()`
into the optimizer's groups, `step(x=None)` sets the iteration to `x` (or one more) and
writes `get_lr()` again, `get_lr()` is a pure function of the iteration, and
`state_dict()` is `{'last_batch_iteration': ...}` (loading it does not rewrite the LR).
The engine steps a schedule once per applied optimizer step, after the step, so step k
of the optimizer runs with the LR of iteration k-2 (the constructor's for k = 1).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from evenzero.deepspeed.log import warning_rank0

WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside `optimizer` (deepspeed/runtime/lr_schedules.py@0.19.8:293)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def update_lr(param_groups: list[dict], lrs: list) -> list:
    """Write `lrs` into the groups (tensor LRs in place) and return what they hold."""
    for group, lr in zip(param_groups, lrs, strict=False):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    """A scalar for every group, or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got "
                             f"{len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


class DeepSpeedSchedule:
    """The part every DeepSpeed schedule shares: iteration counter, step, state."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int
    _last_lr: list | None = None

    def get_lr(self) -> list:
        raise NotImplementedError

    def get_last_lr(self) -> list:
        if self._last_lr is None:
            raise AssertionError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


def _warmup_steps(warmup_num_steps: Any) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) \
            or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
    return max(2, warmup_num_steps)


def _warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        warning_rank0("Using unknown warmup_type: %s. The increasing function is set to "
                       "default (log)", warmup_type)
        return WARMUP_LOG_RATE
    return warmup_type


class WarmupLR(DeepSpeedSchedule):
    """min_lr -> max_lr over warmup_num_steps (log or linear), then max_lr
    (deepspeed/runtime/lr_schedules.py@0.19.8:703)."""

    def __init__(self, optimizer: Any, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        steps = _warmup_steps(warmup_num_steps)
        self.optimizer = torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = per_group(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = per_group(self.optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small
                          for big, small in zip(self.max_lrs, self.min_lrs, strict=False)]
        self.warmup_num_steps = steps
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=False)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay back to min_lr at total_num_steps
    (deepspeed/runtime/lr_schedules.py@0.19.8:791)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warning_rank0("total_num_steps %s is less than warmup_num_steps %s",
                          total_num_steps, warmup_num_steps)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedSchedule):
    """The groups' LRs times a ratio: warmup_min_ratio -> 1, then cosine to cos_min_ratio
    (deepspeed/runtime/lr_schedules.py@0.19.8:842)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        steps = _warmup_steps(warmup_num_steps)
        self.optimizer = torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = steps
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warning_rank0("total_num_steps %s is less than warmup_num_steps %s",
                          total_num_steps, warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"]
                        for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LOG_RATE:
                ratio = self.inverse_log_warm_up * math.log(t + 1)
            else:
                ratio = t / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = t - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [org * ratio for org in self.org_lrs]


class LRRangeTest(DeepSpeedSchedule):
    """min_lr * (1 + rate * (t+1)/step_size), continuous or staircase
    (deepspeed/runtime/lr_schedules.py@0.19.8:313)."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.optimizer = torch_optimizer(optimizer)
        self.min_lr = per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size,
                                                                       int) \
                or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got "
                             f"{lr_range_test_step_size}")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.last_batch_iteration = last_batch_iteration
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        x = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(x) if self.staircase else x

    def get_lr(self) -> list:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


class OneCycle(DeepSpeedSchedule):
    """1Cycle LR (and beta1) policy, then optional decay
    (deepspeed/runtime/lr_schedules.py@0.19.8:414). Momentum cycling writes
    `betas = (beta1, 0.99)`: DeepSpeed forces beta2 to 0.99."""

    def __init__(self, optimizer: Any, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        self.optimizer = torch_optimizer(optimizer)
        self._init_cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                         cycle_second_stair_count, decay_step_size)
        self.min_lrs = per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            update_lr(self.optimizer.param_groups, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(self.decay_lr_rate, 0):
            self.skip_lr_decay = True
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._init_momentum(cycle_min_mom, cycle_max_mom, decay_mom_rate, last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration

    def _init_cycle(self, first, second, first_stairs, second_stairs, decay_step_size) -> None:
        first = float(first)
        second = float(second) if second is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = first_stairs
        self.second_stair_count = first_stairs if second_stairs is None else second_stairs
        self.decay_step_size = decay_step_size
        skip = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = self.skip_mom_decay = skip

    def _init_momentum(self, min_mom, max_mom, decay_mom_rate, last_batch_iteration) -> None:
        if "betas" not in self.optimizer.defaults:
            warning_rank0("cycle_momentum is disabled because optimizer %s does not support "
                           "momentum, no betas attribute in defaults",
                           type(self.optimizer).__name__)
            self.cycle_momentum = False
            return
        self.decay_mom_rate = decay_mom_rate
        self.min_moms = [(m, 0.99) for m in per_group(self.optimizer, min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in per_group(self.optimizer, max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            for momentum, group in zip(self.min_moms, self.optimizer.param_groups, strict=False):
                group["betas"] = momentum
        if math.isclose(self.decay_mom_rate, 0):
            self.skip_mom_decay = True

    def _scale_factor(self) -> float:
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantised from the integer offset, as DeepSpeed does, so a float scale just
            # under a stair boundary does not drop a whole stair.
            it = b % self.total_size
            if it <= self.first_step_size:
                position = it * stairs / self.first_step_size
            else:
                position = (self.total_size - it) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale
                    for lo, hi in zip(self.min_lrs, self.max_lrs, strict=False)]
        if self.skip_lr_decay:
            return self.min_lrs
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_lr_rate * interval
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                    for lo, hi in zip(self.min_moms, self.max_moms, strict=False)]
        if self.skip_mom_decay:
            return self.max_moms
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_mom_rate * interval
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, self.get_mom(), strict=False):
                group["betas"] = momentum


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
                                           LRRangeTest)}


def schedule_from_config(name: str, params: dict, optimizer: torch.optim.Optimizer) -> Any:
    """`scheduler.type` is one of DeepSpeed's schedules, else a torch.optim.lr_scheduler
    class (deepspeed/runtime/engine.py@0.19.8:1923)."""
    if name in SCHEDULES:
        return SCHEDULES[name](optimizer, **params)
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"DeepSpeed does not recognize LR scheduler {name}; use one of "
                         f"{sorted(SCHEDULES)} or a torch.optim.lr_scheduler class name")
    return cls(optimizer, **params)

"""DeepSpeed's FusedAdam, with the arithmetic of the kernel it runs on a CPU job.

A config `{"type": "Adam"}` (without `torch_adam`) makes DeepSpeed build FusedAdam, which
on the CPU (DS_BUILD_OPS=0) is a JIT-built C++ kernel, `Adam_Optimizer::Step_1`
(deepspeed/ops/csrc/adam/cpu_adam_impl.cpp@0.19.8 and
deepspeed/ops/csrc/includes/cpu_adam.h@0.19.8), in float32:

    bc1 = 1 - beta1**t                 bc2 = 1 / sqrt(1 - beta2**t)   (1, 1 without correction)
    g  = g + wd * p                    (Adam mode, when wd > 0)
    m  = m * beta1 + g * (1 - beta1)
    v  = v * beta2 + g * g * (1 - beta2)
    p  = p + (-lr * wd) * p            (AdamW mode, when wd > 0)
    p  = p + (m / (sqrt(v) * bc2 + eps)) * (-lr / bc1)

torch.optim.AdamW computes the same update but decays with `p *= (1 - lr*wd)`, whose
factor rounds to float32 with the same relative error every step: over long runs the
weights drift apart by a systematic ~1e-8 per step. This optimizer keeps DeepSpeed's form,
so the two agree to float rounding without drift. It is elementwise (each element's
update depends on that element alone), so `ZeroOptimizer` may step flat shards with it.
State keys are torch Adam's (`step`, `exp_avg`, `exp_avg_sq`).
"""

from __future__ import annotations

import math

import torch


class FusedAdam(torch.optim.Optimizer):
    """`deepspeed.ops.adam.FusedAdam`'s signature and CPU-kernel arithmetic."""

    evenzero_update = "elementwise"
    """Declared for `ZeroOptimizer` (it steps any flat shard), also where it steps a
    group of its own (Muon's Adam half, `evenzero.deepspeed.muon`)."""
    keeps_state_with_params = True
    """Its state is made like the tensors it steps, so `offload_optimizer` may step it on
    the host (`evenzero.runtime.offload.host_steppable`)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients, please "
                                       "consider SparseAdam instead")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                _kernel_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                             float(lr), float(beta1), float(beta2), float(eps), float(wd),
                             bool(group["bias_correction"]), self.adam_w_mode)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none or set_to_none)


class DeepSpeedCPUAdam(FusedAdam):
    """`deepspeed.ops.adam.DeepSpeedCPUAdam`'s signature; on the CPU DeepSpeed runs the same
    `Step_1` kernel for it (deepspeed/ops/adam/cpu_adam.py@0.19.8)."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True) -> None:
        del fp32_optimizer_states  # state is always fp32 here
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas,
                         eps=eps, adam_w_mode=adamw_mode, weight_decay=weight_decay,
                         amsgrad=amsgrad)


def _f32(x: float) -> float:
    """`x` rounded to float32, as the kernel holds its scalars."""
    return float(torch.tensor(x, dtype=torch.float32))


def _kernel_step(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 step: int, lr: float, beta1: float, beta2: float, eps: float, wd: float,
                 bias_correction: bool, adam_w_mode: bool) -> None:
    """One `Step_1` over `p` (deepspeed/ops/csrc/adam/cpu_adam_impl.cpp@0.19.8:36-85)."""
    b1, b2 = _f32(beta1), _f32(beta2)
    bc1 = bc2 = 1.0
    if bias_correction:
        bc1 = _f32(1 - _f32(b1 ** step))
        bc2 = _f32(1 / math.sqrt(_f32(1 - _f32(b2 ** step))))
    step_size = _f32(-1 * _f32(lr) / bc1)
    w_decay = _f32(-1 * _f32(lr) * _f32(wd))
    param = p if p.dtype == torch.float32 else p.float()
    g = grad.float()
    if wd > 0 and not adam_w_mode:
        g = param * _f32(wd) + g
    m.mul_(b1).add_(g * _f32(1 - b1))
    v.mul_(b2).add_(g * g * _f32(1 - b2))
    update = m / (v.sqrt() * bc2 + _f32(eps))
    if wd > 0 and adam_w_mode:
        param.add_(param * w_decay)
    param.add_(update * step_size)
    if param is not p:
        p.copy_(param)

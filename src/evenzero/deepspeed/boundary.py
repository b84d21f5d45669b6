"""One optimizer step at an accumulation boundary, with DeepSpeed's arithmetic.

ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:3013-3216), in order:

1. the global norm of the (loss-scaled) gradients, and overflow = the norm is not finite;
2. the loss scale is updated with that outcome *before* unscaling;
3. overflow: the step is skipped and the gradients dropped;
4. otherwise every gradient is multiplied by `1/combined`, where `combined` is the new
   scale, times `max(1, (norm_scaled/new_scale + 1e-6)/clip)` when clipping;
5. the optimizer steps the fp32 masters.

Here step 1 is `ZeroOptimizer.clip_grad_norm_(inf)` (it only reads the norm, from the
step's one all-reduce). `ZeroOptimizer`'s gradient shards hold true gradients: each was
divided by the scale of its backward (the old scale) as it was reduced. So step 4
multiplies the shards by `old_scale / combined`, which leaves them as DeepSpeed's
`scaled / combined`, and step 5 is `ZeroOptimizer.step()`.

Stage 0 (plain data parallelism in DeepSpeed) runs on ZeRO-1 here: with an elementwise
optimizer sharding its state changes nothing in the result. DeepSpeed's stage-0 fp32 step
clips with `min(1, clip/(norm+1e-6))` (deepspeed/runtime/utils.py@0.19.8:356-425), which is
exactly `ZeroOptimizer.clip_grad_norm_`, and never skips a step. Its stage-0 bf16 wrapper
skips non-finite steps and clips like ZeRO, so it takes the ZeRO path.

Where DeepSpeed would apply a non-finite update (stage 0; bf16 with
`check_grad_overflow: false`; fp32 ZeRO with `compute_grad_norm: false`) the step raises
on every rank instead: the overflow flag comes from the shared all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from evenzero.deepspeed.loss_scaler import DeepSpeedLossScaler


class NonFiniteGradients(RuntimeError):
    """DeepSpeed would have applied a non-finite update; evenzero stops instead."""


@dataclass(frozen=True)
class StepPolicy:
    clip: float
    """`gradient_clipping`; 0 disables it."""
    stage0: bool
    """DeepSpeed stage-0 semantics: engine-side clipping, no overflow skipping."""
    skip_nonfinite: bool
    """DeepSpeed skips non-finite steps with this config (fp16, bf16 with the check on,
    fp32 ZeRO computing the norm); False raises `NonFiniteGradients` instead."""
    why_not: str = ""
    """Which setting makes DeepSpeed apply non-finite updates (for the error)."""


@dataclass(frozen=True)
class StepOutcome:
    overflow: bool
    norm: float
    """Global norm of the unscaled gradients before clipping (inf on overflow)."""


def boundary_step(zero: Any, scaler: DeepSpeedLossScaler, policy: StepPolicy,
                  step_index: int) -> StepOutcome:
    """Clip, unscale and step `zero` (or skip the step), updating `scaler`."""
    bridge = zero.loss_scaler
    prev = scaler.cur_scale
    bridge.scale = prev
    if policy.stage0:
        max_norm = policy.clip if policy.clip > 0 else math.inf
        norm = float(zero.clip_grad_norm_(max_norm))
    else:
        norm = float(zero.clip_grad_norm_(math.inf))
    overflow = not math.isfinite(norm)
    if overflow and not policy.skip_nonfinite:
        zero.zero_grad()
        raise NonFiniteGradients(
            f"non-finite gradients at optimizer step {step_index}: DeepSpeed would apply them "
            f"with this config ({policy.why_not}) and the model would become NaN; evenzero "
            f"stops instead, on every rank. Use fp16 loss scaling, bf16.check_grad_overflow, "
            f"or ZeRO stage 1/2 with gradient-norm computation, which skip such steps")
    scaler.update_scale(overflow)
    if overflow:
        zero.step()  # skips the update and drops the gradients
    else:
        if not policy.stage0:
            combined = scaler.cur_scale
            if policy.clip > 0:
                # DeepSpeed computes this in float32 tensors; in double it differs by an ulp.
                coef = max(1.0, ((norm * prev / scaler.cur_scale) + 1e-6) / policy.clip)
                combined = coef * scaler.cur_scale
            if combined != prev:
                for st in zero.groups.values():
                    st.grad.mul_(prev / combined)
        zero.step()
    bridge.scale = scaler.cur_scale
    return StepOutcome(overflow, norm)

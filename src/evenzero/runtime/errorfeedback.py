"""Error feedback: each rank's quantization residual, kept across steps and plans.

With `grad_compression_error_feedback=True` every compressed bucket has an fp32 residual
of the bucket's size on every rank (`runtime/compression.py` adds it before encoding and
stores what the encoding lost). `ErrorFeedback` owns those buffers:

* across re-plans (`bind`): a new plan's buckets get the residual of each parameter
  from the old ones, by name, so the measured arrival order or a refined bucket size
  loses nothing (padding and parameters new to compression start at zero);
* across loss-scale changes (`residual`): the residual is in the units of the bucket,
  the loss-scaled gradient, so it is rescaled when the scale moves; a step skipped for
  an overflow drops it (`drop`: it was computed from non-finite gradients);
* across checkpoints (`per_param` / `load_per_param`): one fp32 run per parameter, this
  rank's own. What a residual means at another world size is in
  `evenzero.checkpoint.residuals`.

Memory: 4 bytes per element of every compressed bucket (padding included) on every
rank, reported by `memory_report().error_feedback` and planned as
`MemoryModel.residual_numel`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from evenzero.plan import Plan
from evenzero.wire import RESIDUAL_ITEMSIZE


class ErrorFeedback:
    """The residuals of one optimizer's compressed buckets on this rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.slots: dict[tuple[str, int], tuple] = {}
        self.scale = 1.0
        """The loss scale the residuals are in."""

    @staticmethod
    def keeps(plan: Plan) -> dict[tuple[str, int], int]:
        """(group, bucket index) -> numel of the buckets that keep a residual under `plan`."""
        if not plan.execution.error_feedback:
            return {}
        numel = {(b.group, b.index): b.numel for b in plan.buckets}
        return {(c.group, c.buffer_index): numel[(c.group, c.buffer_index)]
                for c in plan.backward() if c.compression}

    def bind(self, plan: Plan) -> None:
        """Residual buffers for `plan`'s compressed buckets, carrying every parameter's
        residual over from the current ones."""
        carried = self.per_param() if self.buffers else {}
        self.buffers, self.slots = {}, {}
        by_key = {(b.group, b.index): b for b in plan.buckets}
        for key, numel in self.keeps(plan).items():
            self.buffers[key] = torch.zeros(numel, dtype=torch.float32, device=self.device)
            self.slots[key] = by_key[key].params
        if carried:
            self.load_per_param(carried)

    def residual(self, group: str, index: int, loss_scale: float) -> torch.Tensor | None:
        """The residual of a bucket, in units of a gradient scaled by `loss_scale`; None
        if the bucket keeps none."""
        buf = self.buffers.get((group, index))
        if buf is None:
            return None
        if loss_scale != self.scale:
            for b in self.buffers.values():
                b.mul_(loss_scale / self.scale)
            self.scale = loss_scale
        return buf

    def drop(self) -> None:
        """Forget every residual (a step skipped for non-finite gradients)."""
        for b in self.buffers.values():
            b.zero_()

    def per_param(self) -> dict[str, torch.Tensor]:
        """Each parameter's residual (views, in units of the unscaled gradient when the
        loss scale is 1; `scale` says the scale otherwise)."""
        out = {}
        for key, buf in self.buffers.items():
            for s in self.slots[key]:
                out[s.name] = buf[s.offset:s.offset + s.numel]
        return out

    def unscaled(self) -> dict[str, torch.Tensor]:
        """Each parameter's residual as a CPU fp32 copy in units of the unscaled
        gradient (what a checkpoint stores)."""
        return {n: (t / self.scale).cpu() for n, t in self.per_param().items()}

    def load_per_param(self, residuals: Mapping[str, torch.Tensor], unscaled: bool = False) -> None:
        """Set each named parameter's residual (others: zero). `unscaled`: the values are
        in units of the unscaled gradient and are scaled to the current loss scale."""
        factor = self.scale if unscaled else 1.0
        for key, buf in self.buffers.items():
            buf.zero_()
            for s in self.slots[key]:
                value = residuals.get(s.name)
                if value is None:
                    continue
                if value.numel() != s.numel:
                    raise ValueError(f"error-feedback residual of {s.name!r} has "
                                     f"{value.numel()} elements, the parameter {s.numel}")
                run = buf[s.offset:s.offset + s.numel]
                run.copy_(value.reshape(-1))
                if factor != 1.0:
                    run.mul_(factor)

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values()) * RESIDUAL_ITEMSIZE

    @property
    def active(self) -> bool:
        return bool(self.buffers)

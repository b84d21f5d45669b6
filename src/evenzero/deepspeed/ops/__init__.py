"""`deepspeed.ops`: only `ops.adam` (FusedAdam / DeepSpeedCPUAdam, their CPU kernel's
arithmetic in PyTorch). The other op families are refused on import by name
(`evenzero.deepspeed.refusals`)."""

from __future__ import annotations

from evenzero.deepspeed.ops import adam

__all__ = ["adam"]

"""`deepspeed.ops.adam`: `FusedAdam` and `DeepSpeedCPUAdam` (`evenzero.deepspeed.fused_adam`).
Accelerate imports it in this form (`import deepspeed.ops.adam`)."""

from __future__ import annotations

from evenzero.deepspeed.fused_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

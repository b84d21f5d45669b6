"""`deepspeed.ops`: `ops.adam` (FusedAdam / DeepSpeedCPUAdam, their CPU kernel's arithmetic
in PyTorch), `ops.op_builder` (importable builders, none compatible) and
`__compatible_ops__` (True only for the two Adam ops provided in PyTorch). The other op families are refused on import by
name (`evenzero.deepspeed.refusals`)."""

from __future__ import annotations

from evenzero.deepspeed.ops import adam
from evenzero.deepspeed.ops.op_builder import compatible_ops

__compatible_ops__ = compatible_ops()

__all__ = ["__compatible_ops__", "adam"]

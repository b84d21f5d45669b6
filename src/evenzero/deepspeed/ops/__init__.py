"""`deepspeed.ops`: `ops.adam` (FusedAdam / DeepSpeedCPUAdam, their CPU kernel's arithmetic
in PyTorch), `ops.op_builder` (importable builders, none compatible) and
`__compatible_ops__` (every op False). The other op families are refused on import by
name (`evenzero.deepspeed.refusals`)."""

from __future__ import annotations

from evenzero.deepspeed.ops import adam
from evenzero.deepspeed.ops.op_builder import ALL_OPS

# DeepSpeed probes each builder; none is built here, so none is compatible.
__compatible_ops__ = dict.fromkeys(ALL_OPS, False)

__all__ = ["__compatible_ops__", "adam"]

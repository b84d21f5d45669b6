"""`deepspeed.checkpoint`: only `checkpoint.utils.clone_tensors_for_torch_save`, which
Accelerate's `get_state_dict` imports. (evenzero's own checkpoints are
`evenzero.checkpoint`; DeepSpeed's universal-checkpoint tools are not needed, since
those load at any world size.)"""

from __future__ import annotations

from evenzero.deepspeed.checkpoint import utils

__all__ = ["utils"]

"""`deepspeed.utils`, as far as training scripts and frameworks use it: `logger`,
`log_dist`, `RepeatingLoader`, and the submodules `utils.logging` and
`utils.zero_to_fp32` (importable, and reachable as attributes)."""

from __future__ import annotations

import importlib
from typing import Any

from evenzero.deepspeed.dataloader import RepeatingLoader
from evenzero.deepspeed.log import logger
from evenzero.deepspeed.utils.logging import (
    log_dist,
    log_dist_once,
    set_log_level_from_string,
)
from evenzero.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from evenzero.deepspeed.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

SUBMODULES = ("logging", "tensor_fragment", "torch", "z3_leaf_module", "zero_to_fp32")


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"deepspeed.utils.{name} is not provided by evenzero.deepspeed "
                         f"(only logger, log_dist, log_dist_once, set_log_level_from_string, "
                         f"RepeatingLoader and the submodules {', '.join(SUBMODULES)} are)")


__all__ = ["RepeatingLoader", "get_z3_leaf_modules", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_get_local_fp32_param",
           "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_fp32_param",
           "safe_set_full_grad", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
           "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized", "log_dist", "log_dist_once", "logger",
           "set_log_level_from_string", "set_z3_leaf_module", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "z3_leaf_module"]

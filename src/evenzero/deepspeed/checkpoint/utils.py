"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save`
(deepspeed/checkpoint/utils.py@0.19.8:41) and `get_model_ckpt_name_for_rank`."""

from __future__ import annotations

import os
from typing import Any

import torch

MODEL_FILE_PREFIX = "mp_rank_"
MODEL_FILE_SUFFIX = "_model_states.pt"


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """DeepSpeed's name of a tag's model-states file (deepspeed/checkpoint/utils.py@0.19.8:11).
    evenzero's checkpoints keep the module's weights in their own layout (see
    `engine.save_checkpoint`), so the file exists only in a DeepSpeed-written checkpoint."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: Any = torch.device("cpu")) -> Any:  # noqa: B008
    """A copy of `item` with every tensor in it (nested in lists, tuples and dicts) cloned
    onto `device`, detached: views no longer hold their whole storage when saved."""
    if torch.is_tensor(item):
        if isinstance(device, str):
            device = torch.device(device)
        if device == item.device:
            return item.detach().clone()
        return item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]

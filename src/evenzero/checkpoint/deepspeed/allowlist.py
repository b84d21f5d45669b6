"""The pickle allow-list: DeepSpeed's checkpoint files read without running code from them.

DeepSpeed writes `torch.save` pickles and loads them with `weights_only=False`
(deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py:37 @ v0.19.8), which
runs whatever the file names. We load them with torch's restricted unpickler
(`weights_only=True`) and allow, beyond torch's own tensors, dtypes, `torch.Size` and
`OrderedDict`, exactly the few DeepSpeed types a ZeRO-1/2 checkpoint holds:

* `deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler`, pickled whole
  into the optimizer state (deepspeed/runtime/zero/stage_1_and_2.py:3370 @ v0.19.8);
* `deepspeed.runtime.zero.config.ZeroStageEnum`, the saved `zero_stage`;
* `deepspeed.utils.tensor_fragment.fragment_address`, in `param_slice_mappings`.

They are mapped to the local stand-ins below by their pickled names, so reading needs
no DeepSpeed installed and never imports it. A stand-in only receives attribute values
(the unpickler sets `__dict__`); none has behaviour that a file could trigger. Anything
else in a file is refused with a `CheckpointError` that names the type; a caller who
trusts a type (e.g. a custom object in `client_state`) passes it in `allow`.
"""

from __future__ import annotations

import enum
import pickle
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint.format import CheckpointError


class LossScalerState:
    """Stand-in for DeepSpeed's `LossScaler` / `DynamicLossScaler`: attributes only
    (cur_scale, dynamic, and for the dynamic one cur_iter, last_overflow_iter, ...)."""

    def state(self) -> dict[str, Any]:
        return dict(vars(self))


class ZeroStageEnum(int, enum.Enum):
    """Stand-in for `deepspeed.runtime.zero.config.ZeroStageEnum` (an int Enum pickled by
    value; deepspeed/runtime/zero/config.py @ v0.19.8)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class FragmentAddress:
    """Stand-in for `deepspeed.utils.tensor_fragment.fragment_address`."""

    numel: int = 0
    start: int = 0


STAND_INS: tuple[tuple[type, str], ...] = (
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
)
"""The DeepSpeed types a ZeRO-1/2 checkpoint may hold, as (stand-in, pickled name)."""

_REFUSED = re.compile(r"GLOBAL ([\w.]+)|unrecognized function ([^\s]+)|but got (<[^>]+>|\S+)")


def load_file(path: Path, allow: Sequence[Any] = ()) -> Any:
    """`torch.load` of one DeepSpeed file, restricted to the allow-list (plus `allow`).

    Tensors are memory-mapped, so only the parts a caller reads come off the disk.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        with torch.serialization.safe_globals([*STAND_INS, *allow]):
            # Memory-mapped when the file allows (the zip format of torch >= 1.6).
            mmap = zipfile.is_zipfile(path)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: {_refusal(str(e))}") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        text = str(e).split(". ")[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: not a readable torch checkpoint file ({text}); it is "
                              f"truncated or damaged, copy it again from where it was saved"
                              ) from None


def _refusal(message: str) -> str:
    found = _REFUSED.search(message)
    what = next((g for g in found.groups() if g), None) if found else None
    if what is None:
        first = next((line for line in message.splitlines() if line.strip()), message)
        return (f"refused to unpickle it ({first.strip()}); evenzero loads DeepSpeed files "
                f"with torch's weights_only unpickler and never runs code from them")
    return (f"holds an object of type {what}, which is not on the allow-list of DeepSpeed "
            f"checkpoint types; evenzero never runs code from a checkpoint. Only if you trust "
            f"this file and that type (e.g. your own class in client_state), pass the class in "
            f"allow=[...]")


def scaler_state(value: Any) -> dict[str, Any] | None:
    """The saved loss scaler's attributes as a dict (None when there is none)."""
    if value is None:
        return None
    if isinstance(value, LossScalerState):
        return value.state()
    raise CheckpointError(f"loss_scaler is a {type(value).__name__}, expected DeepSpeed's "
                          f"LossScaler or DynamicLossScaler")

"""Lightning checkpoints as evenzero sharded checkpoints.

A checkpoint path (`epoch=3-step=400.ckpt`, `last.ckpt`, `fabric.save("run/ckpt", ...)`)
becomes a directory, as under Lightning's FSDP and DeepSpeed strategies:

    epoch=3-step=400.ckpt/
        evenzero-lightning.json      marks the directory as ours (written first)
        checkpoint/                  evenzero.checkpoint.save(opt, path, tag="checkpoint")
            manifest.json, rank files, user-state-rank-*.safetensors

Every rank writes its own shard of the fp32 masters and optimizer state; the model's
weights are not written separately (they are the masters, in the model's dtype, and
the buffers, which rank 0 writes; non-tensor `get_extra_state()` entries go with the
state below). Lightning's own state (epoch, global step, loops,
callbacks, LR schedulers, hyperparameters, ...) goes into the checkpoint's `extra`
under "lightning" (Fabric's: under "fabric"), stored without pickle, so loading runs no
code from the file. Loading works at any world size: `evenzero.checkpoint.load`
reshards by parameter name.

Writing into a directory that is neither empty nor marked as ours is refused (it is
not ours to replace); a file at the path (a checkpoint another strategy wrote) is
renamed aside until the new checkpoint is complete, then removed, as a torch.save over
it would replace it. A re-save of the same path (`last.ckpt`) keeps the previous copy
loadable until the new one is complete (evenzero.checkpoint's atomic publish).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

import evenzero.checkpoint as sharded

MARKER = "evenzero-lightning.json"
TAG = "checkpoint"
FORMAT = 1


def local_path(path: str | os.PathLike) -> tuple[Path | None, str | None]:
    """(path, None), or (None, why) for a location evenzero cannot write to."""
    text = os.fspath(path)
    if "://" in text:
        if not text.startswith("file://"):
            return None, (f"{text}: evenzero writes sharded checkpoints to a local or mounted "
                          f"filesystem shared by all ranks, not to a URL; save to a path and "
                          f"copy the directory")
        text = text[len("file://"):]
    return Path(text), None


def is_sharded(path: Path) -> bool:
    """Whether `path` is a checkpoint directory written here."""
    return (path / MARKER).is_file()


def prepare(path: Path) -> tuple[Path | None, str | None]:
    """On rank 0, before a save: make `path` a marked directory. Returns (the file set
    aside, to remove once the save is complete, or None; the reason it cannot, or None)."""
    try:
        aside = None
        if path.is_dir():
            if any(path.iterdir()) and not is_sharded(path):
                return None, (f"{path} is a directory that is not an evenzero checkpoint; saving "
                              f"there would write into it. Choose another path, or move it away")
        elif path.exists() or path.is_symlink():
            if not path.is_file():
                return None, f"{path} exists and is not a regular file or directory"
            aside = path.with_name(f".{path.name}.replaced-by-evenzero")
            os.replace(path, aside)
        path.mkdir(parents=True, exist_ok=True)
        marker = path / MARKER
        if not marker.is_file():
            marker.write_text(json.dumps({"format": FORMAT, "checkpoint": TAG}) + "\n")
        return aside, None
    except OSError as e:
        return None, f"{path}: cannot prepare the checkpoint directory ({e})"


UNSTORABLE = ("evenzero stores Lightning's checkpoint entries (hyperparameters, callback, loop and "
              "scheduler state, what on_save_checkpoint adds) as plain values, without pickle: "
              "make that entry a plain value (e.g. str() of a path), or drop it in "
              "on_save_checkpoint")


def save(zero: Any, path: Path, extra: Any) -> Path:
    """Every rank: the sharded checkpoint with `extra` (after `prepare` on rank 0)."""
    try:
        return sharded.save(zero, path, extra=extra, tag=TAG)
    except sharded.CheckpointError as e:
        if "extra[" not in str(e):
            raise
        raise sharded.CheckpointError(f"{e}. {UNSTORABLE}") from e


def load(zero: Any, path: Path) -> Any:
    """Every rank: load the sharded checkpoint under `path` into `zero` (and its model);
    returns this rank's `extra`."""
    manifest = sharded.load(zero, path, tag=TAG)
    return manifest.extra


MODULE_EXTRA = "module_extra_state"
"""Where the non-tensor entries of the module's state dict go (`get_extra_state()`
values): evenzero's shards hold the tensors only."""


def with_module_extra(extra: dict[str, Any], module: Any) -> dict[str, Any]:
    """`extra` plus the module's state-dict entries that are not tensors, if any."""
    loose = {k: v for k, v in module.state_dict().items() if not isinstance(v, torch.Tensor)}
    return {**extra, MODULE_EXTRA: loose} if loose else extra


def restore_module_extra(extra: Any, module: Any) -> None:
    """Give the module back what `with_module_extra` saved (`set_extra_state`)."""
    loose = extra.get(MODULE_EXTRA) if isinstance(extra, dict) else None
    if loose:
        module.load_state_dict(loose, strict=False)


def section(extra: Any, key: str, path: Path) -> Any:
    """The `key` part of a loaded `extra` ("lightning" or "fabric")."""
    if not isinstance(extra, dict) or key not in extra:
        other = sorted(extra) if isinstance(extra, dict) else type(extra).__name__
        raise sharded.CheckpointError(f"{path}: the checkpoint has no {key!r} state (it holds "
                                      f"{other}); it was not written by the evenzero "
                                      f"{'Trainer' if key == 'lightning' else 'Fabric'} strategy")
    return extra[key]

"""The user's own training state in a checkpoint: `save(opt, dir, extra=...)`.

DeepSpeed's `client_state`, without pickle. `extra` is any nesting of dict, list,
tuple, str, int, float, bool, None and torch tensors: a scheduler's `state_dict()`, the
data position, random-number states. Each rank passes its own and writes it to its own
`user-state-rank-NNNNN.safetensors` in the checkpoint being saved: the tensors as
safetensors tensors (named "0", "1", ... in tree order), the structure as JSON
(`evenzero.checkpoint.values`) in the file's `__metadata__`. The file is checksummed in
the manifest like every other and published with it; loading it builds only those
types, so a checkpoint from elsewhere cannot run code.

What comes back: the same structure and types, tuples as tuples and dict keys as saved;
mappings as plain dicts; tensors on the CPU (as `torch.get_rng_state()` and
`torch.cuda.set_rng_state` want them), contiguous and detached, one copy per occurrence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint import files as checkpoint_io
from evenzero.checkpoint.format import CheckpointError, FileRecord, Manifest
from evenzero.checkpoint.values import decode_value, encode_value

TREE_KEY = "evenzero.user_state"
"""The `__metadata__` entry holding the JSON structure."""
MAX_TREE_BYTES = 64 * 2**20
"""Safetensors readers refuse headers over 100 MB; the structure stays well below."""


def user_state_file(rank: int) -> str:
    return f"user-state-rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class EncodedUserState:
    """One rank's `extra`, ready to write: its tensors and its JSON structure."""

    tensors: Mapping[str, torch.Tensor]
    """Tensor "0", "1", ... in tree order."""
    tree: str
    """The structure as JSON (`evenzero.checkpoint.values`), tensors by key."""


def encode_user_state(extra: Any, copy_tensors: bool = False) -> EncodedUserState:
    """Encode `extra`; errors name the offending entry. `copy_tensors`: keep CPU copies,
    not the tensors passed, so later changes to them do not reach the file (a
    background save)."""
    tensors: dict[str, torch.Tensor] = {}

    def keep(t: torch.Tensor, where: str) -> str:
        if t.layout != torch.strided or t.is_quantized:
            raise CheckpointError(f"{where}: a {t.layout} tensor cannot be stored in a checkpoint; "
                                  f"store a dense tensor (t.to_dense())")
        key = str(len(tensors))
        tensors[key] = t.detach().to("cpu", copy=True) if copy_tensors else t.detach()
        return key

    text = json.dumps(encode_value(extra, "extra", keep))
    if len(text) > MAX_TREE_BYTES:
        raise CheckpointError(f"extra: its structure is {len(text) / 2**20:.0f} MiB of JSON "
                              f"(safetensors headers hold up to {MAX_TREE_BYTES >> 20} MiB); "
                              f"store large lists as tensors (torch.tensor(values))")
    return EncodedUserState(tensors, text)


def write_encoded_user_state(directory: Path, rank: int, user: EncodedUserState) -> FileRecord:
    """Write an encoded `extra` as this rank's user-state file in `directory`."""
    return checkpoint_io.write_file(directory / user_state_file(rank), user.tensors, rank,
                                    {TREE_KEY: user.tree})


def write_user_state(directory: Path, rank: int, extra: Any) -> FileRecord:
    """Write this rank's `extra` into `directory`; errors name the offending entry."""
    return write_encoded_user_state(directory, rank, encode_user_state(extra))


def read_user_state(directory: Path, manifest: Manifest, rank: int) -> Any:
    """This rank's saved `extra` (rank 0's when the saving world had no rank `rank`)."""
    source = rank if rank < manifest.world_size else 0
    name = manifest.user_state.get(source)
    if name is None:
        return None
    record = next(f for f in manifest.files if f.name == name)
    checkpoint_io.verify_file(directory, record)
    path = directory / name
    with checkpoint_io.RangeReader(directory) as reader:
        tensors = reader.read_all(name)
        text = reader.metadata(name).get(TREE_KEY)
    if text is None:
        raise CheckpointError(f"{path}: no {TREE_KEY!r} entry in its metadata; the file is not "
                              f"the user state the manifest lists")
    try:
        return decode_value(json.loads(text), stored=tensors.__getitem__)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed user state ({type(e).__name__}: {e}); the "
                              f"checkpoint is damaged, load an older one") from None

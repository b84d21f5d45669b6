"""Checkpoint files on disk: durable writes, checksums, verified reads, atomic publish.

A checkpoint is written into `.tmp-step-NNNNNN/` and renamed to `step-NNNNNN/` only
after every file (manifest last) is fsynced, so a `step-*` directory with a manifest is
always complete; a crash mid-save leaves a `.tmp-*` directory that no loader looks at.
Reads go through safetensors, which parses a JSON header and raw buffers and never
executes code from the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from evenzero.checkpoint.format import MANIFEST, CheckpointError, FileRecord, Manifest
from evenzero.spec import dtype_name

HASH_CHUNK = 16 * 2**20
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"


SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                      "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                      "bool": "BOOL"}


def write_file(path: Path, tensors: dict[str, Any], rank: int) -> FileRecord:
    """Write `tensors` as a safetensors file, fsync it, and return its checksum record.

    The file is streamed tensor by tensor and hashed on the way, instead of going through
    `safetensors.torch.save`, which needs every tensor copied into one bytes object first
    (two extra copies of the shard, and the copy cost dominated saving). The layout is the
    safetensors one (little-endian u64 header size, JSON header padded to 8 bytes, raw
    buffers in header order), so any safetensors reader loads it.
    """
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are written little-endian; this host is big-endian")
    header: dict[str, Any] = {}
    offset = 0
    for key, t in tensors.items():
        dtype = dtype_name(t.dtype)
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path.name}: tensor {key!r} has dtype {dtype}, which a "
                                  f"checkpoint cannot store")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        for t in tensors.values():
            raw = _raw_bytes(t)
            f.write(raw)
            digest.update(raw)
            size += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(path.name, rank, digest.hexdigest(), size)


def _raw_bytes(t: Any) -> memoryview:
    """The tensor's bytes as stored (CPU, contiguous); a view when it already is."""
    import torch

    flat = t.detach().reshape(-1).contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_file(directory: Path, record: FileRecord) -> None:
    """Check presence, size and sha256 of one file; the error names it and its writer."""
    path = directory / record.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file written by rank {record.rank} is missing; "
                              f"the checkpoint is incomplete, load an older one") from None
    if size != record.nbytes:
        raise CheckpointError(f"{path}: {size} bytes but the manifest says {record.nbytes}; "
                              f"the file is truncated or overwritten, load an older checkpoint")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != record.sha256:
        raise CheckpointError(f"{path}: sha256 mismatch (file is corrupted); "
                              f"load an older checkpoint")


class RangeReader:
    """Reads slices of stored 1-D tensors, opening each file once (memory-mapped)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def read(self, file: str, key: str, lo: int, hi: int):
        from safetensors import safe_open

        handle = self._open.get(file)
        if handle is None:
            handle = self._stack.enter_context(
                safe_open(str(self.directory / file), framework="pt", device="cpu"))
            self._open[file] = handle
        try:
            piece = handle.get_slice(key)
        except Exception:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{self.directory / file}: tensor {key!r} is missing; the "
                                  f"file does not match the manifest") from None
        return piece[lo:hi]

    def read_all(self, file: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(self.directory / file))


# --------------------------------------------------------------------------- directories


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no manifest; the checkpoint was not completed") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON ({e.msg} at line {e.lineno}); "
                              f"the checkpoint is damaged, load an older one") from None
    return Manifest.from_json(data, str(path))


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Published checkpoint directories under `root`, newest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found, reverse=True)


def newest_complete(root: Path) -> Path | None:
    """The newest `step-*` directory whose manifest parses; None if there is none.

    Only the manifest is checked here: a directory that has one was published after all
    its files were fsynced, so damage past that point is corruption and must be reported
    by the loader rather than silently skipped.
    """
    for _, path in step_dirs(root):
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        return path
    return None


def resolve(path: Path) -> Path:
    """`path` itself if it is a checkpoint, else the newest complete one under it."""
    if (path / MANIFEST).exists():
        return path
    found = newest_complete(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint (no step-*/{MANIFEST}); "
                              f"check the directory, or start from scratch")
    return found


def prepare_tmp(root: Path, tmp: Path) -> None:
    """Create the staging directory, clearing what crashed saves left behind."""
    root.mkdir(parents=True, exist_ok=True)
    for child in root.iterdir():
        if child.name.startswith(TMP_PREFIX) and child.is_dir():
            shutil.rmtree(child)
    tmp.mkdir()


def publish(tmp: Path, final: Path) -> None:
    """Make a fully written staging directory visible under its final name."""
    fsync_dir(tmp)
    if final.exists():
        # Re-saving a step (after resuming from an older checkpoint): move the old one
        # aside first, since rename cannot replace a non-empty directory.
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)

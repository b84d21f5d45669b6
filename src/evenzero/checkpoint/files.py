"""Checkpoint files on disk: durable writes, checksums, verified reads, atomic publish.

Reads go through safetensors, which parses a JSON header and raw buffers and never
executes code from the file.

Publishing keeps the last good copy. Directory names under a checkpoint root:

    step-000123/, TAG/          published: complete, loadable
    .next-step-000123/          published: complete, and newer than step-000123/
    .tmp-step-000123/           staging: being written, never loaded, removed by the next save
    .old-step-000123.<id>/      an older copy whose replacement is published; removed

A save writes and fsyncs everything into the staging directory (manifest last), then
makes it visible with renames onto names that do not exist, so each rename is atomic:

    new name:   .tmp-X -> X
    re-save:    .tmp-X -> .next-X    (two complete copies; readers take the new one)
                X -> .old-X.<id>     (the new one is visible as .next-X)
                .next-X -> X
                remove .old-X.<id>

and the parent directory is fsynced after each, so the order survives a power cut. At
every instant the previous copy or the new one is visible and complete; the next save
first finishes whatever a crash interrupted (`settle`). Readers never skip a published
copy: damage there is reported (`evenzero.checkpoint.load`), only staging is ignored.
Format-1 savers moved the old copy to `.tmp-old-X` before renaming the new one in; a
crash in between left that as the only complete copy, so it is read (and restored to
`X`) when `X` is missing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import uuid
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from evenzero.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    FileRecord,
    Manifest,
)
from evenzero.spec import dtype_name

HASH_CHUNK = 16 * 2**20
STEP_DIR = re.compile(r"step-(\d+)")
STAGING = ".tmp-"
NEXT = ".next-"
OLD = ".old-"
LEGACY_OLD = ".tmp-old-"
"""Where format-1 savers kept the old copy during a re-save (see the module docstring)."""


SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                      "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                      "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}


def write_file(path: Path, tensors: Mapping[str, Any], rank: int,
               metadata: Mapping[str, str] | None = None) -> FileRecord:
    """Write `tensors` as a safetensors file, fsync it, and return its checksum record.

    The file is streamed tensor by tensor and hashed on the way, instead of going through
    `safetensors.torch.save`, which needs every tensor copied into one bytes object first
    (two extra copies of the shard, and the copy cost dominated saving). The layout is the
    safetensors one (little-endian u64 header size, JSON header padded to 8 bytes, raw
    buffers in header order), so any safetensors reader loads it. `metadata` goes into the
    header's `__metadata__` (string values only, as safetensors requires).
    """
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are written little-endian; this host is big-endian")
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
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
    with _writing(path), open(path, "wb") as f:
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
    with _writing(path), open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Name the file and the cause when a write fails: a full disk raises OSError from
    write(), flush() or fsync(), none of which carries a file name."""
    try:
        yield
    except OSError as err:
        cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EROFS: "the file system is read-only"}.get(err.errno, "")
        raise CheckpointError(f"writing {path} failed: {cause or err.strerror or err} "
                              f"({type(err).__name__} errno {err.errno}); nothing was published, "
                              f"the previous checkpoint is intact") from err


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

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        handle = self._open.get(file)
        if handle is None:
            try:
                handle = self._stack.enter_context(
                    safe_open(str(self.directory / file), framework="pt", device="cpu"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{self.directory / file}: not a readable safetensors "
                                      f"file ({e})") from None
            self._open[file] = handle
        return handle

    def read(self, file: str, key: str, lo: int, hi: int):
        try:
            piece = self._handle(file).get_slice(key)
        except CheckpointError:
            raise
        except Exception:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{self.directory / file}: tensor {key!r} is missing; the "
                                  f"file does not match the manifest") from None
        return piece[lo:hi]

    def read_all(self, file: str) -> dict[str, Any]:
        handle = self._handle(file)
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118

    def metadata(self, file: str) -> dict[str, str]:
        return self._handle(file).metadata() or {}


# --------------------------------------------------------------------------- directories


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no manifest; a published checkpoint always has one, so "
                              f"this one is damaged or not an evenzero checkpoint") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the manifest ({e}); the checkpoint is "
                              f"damaged, load an older one") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON ({e.msg} at line {e.lineno}); "
                              f"the checkpoint is damaged, load an older one") from None
    return Manifest.from_json(data, str(path))


TAG = re.compile(r"[^./\\\x00-\x1f][^/\\\x00-\x1f]*")
"""A tag names one directory: no separator or control character, not empty, not hidden
(which also rules out `.` and `..`, and our own staging names)."""


def check_tag(tag: Any) -> str:
    """`tag` if it is a plain directory name for `save(..., tag=)`, else a clear error."""
    if not isinstance(tag, str) or not TAG.fullmatch(tag):
        raise CheckpointError(f"checkpoint tag {tag!r} is not a plain directory name: no path "
                              f"separators or control characters, not empty, not starting "
                              f"with '.' (so not '.' or '..')")
    return tag


def published_copy(root: Path, name: str) -> Path | None:
    """The newest complete copy of checkpoint `name` under `root`, or None."""
    for candidate in (NEXT + name, name):
        path = root / candidate
        if path.is_dir():
            return path
    legacy = root / (LEGACY_OLD + name)
    return legacy if legacy.is_dir() else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Published `step-*` checkpoints under `root` by their own names, newest first."""
    if not root.is_dir():
        return []
    steps = set()
    for child in root.iterdir():
        for prefix in ("", NEXT, LEGACY_OLD):
            name = child.name[len(prefix):]
            m = STEP_DIR.fullmatch(name) if child.name.startswith(prefix) else None
            if m and child.is_dir():
                steps.add((int(m.group(1)), name))
    return sorted(((step, root / name) for step, name in steps), reverse=True)


def newest(root: Path) -> Path | None:
    """The newest published `step-*` checkpoint under `root`, or None.

    Only names are looked at: a published directory was complete when it was renamed
    into place, so damage past that point must be reported by the loader, not skipped in
    favour of an older checkpoint. The path is the checkpoint's own name (`step-N`), also
    while a crashed publish leaves its copy under another (`resolve` finds it).
    """
    found = step_dirs(root)
    return found[0][1] if found else None


def resolve(path: Path, tag: str | None = None) -> Path:
    """The checkpoint directory that `load(path, tag=tag)` means.

    With `tag`, `path/tag`; else `path` itself if it is a checkpoint, else the newest
    published `step-*` under it.
    """
    if tag is not None:
        found = published_copy(path, check_tag(tag))
        if found is None:
            raise CheckpointError(f"{path / tag}: no checkpoint tagged {tag!r} under {path}")
        return found
    copy = published_copy(path.parent, path.name) or path
    if (copy / MANIFEST).exists():
        return copy
    found = newest(copy)
    if found is not None:
        return published_copy(copy, found.name) or found
    if STEP_DIR.fullmatch(copy.name) or any(copy.glob("*.safetensors")):
        read_manifest(copy)  # raises: a checkpoint without its manifest
    raise CheckpointError(f"{path}: no complete checkpoint (no step-*/{MANIFEST}); "
                          f"check the directory, or start from scratch")


def prepare_staging(root: Path, name: str) -> Path:
    """Create `root/.tmp-<name>/` for a new save, first finishing or clearing what crashed
    saves left behind (`settle`)."""
    root.mkdir(parents=True, exist_ok=True)
    settle(root)
    final = root / name
    if final.exists() and not (final / MANIFEST).is_file():
        raise CheckpointError(f"{final} exists and is not an evenzero checkpoint (no {MANIFEST}), "
                              f"so saving would replace it; nothing was written: save under "
                              f"another step or tag, or move it away")
    for child in root.iterdir():
        if child.name.startswith(STAGING) and child.is_dir():
            shutil.rmtree(child)
    staging = root / (STAGING + name)
    staging.mkdir()
    return staging


def settle(root: Path) -> None:
    """Finish interrupted publishes under `root` and remove superseded copies.

    Each step only ever removes a copy when a newer complete one stays visible.
    """
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        if child.name.startswith(NEXT):
            _promote(child, root / child.name.removeprefix(NEXT))
        elif child.name.startswith(LEGACY_OLD):
            name = child.name.removeprefix(LEGACY_OLD)
            if published_copy(root, name) == child:
                _rename(child, root / name)  # the only complete copy: put it back
            else:
                shutil.rmtree(child)
    for child in root.iterdir():
        if child.name.startswith(OLD) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def publish(staging: Path, final: Path) -> None:
    """Make a fully written staging directory visible as `final` (module docstring)."""
    fsync_dir(staging)
    root = final.parent
    if (root / (NEXT + final.name)).exists():
        _promote(root / (NEXT + final.name), final)
    if not final.exists():
        _rename(staging, final)
        return
    following = root / (NEXT + final.name)
    _rename(staging, following)
    _promote(following, final)


def _promote(following: Path, final: Path) -> None:
    """Replace `final` by the complete, newer copy `following` (`.next-<final>`)."""
    old = final.with_name(f"{OLD}{final.name}.{uuid.uuid4().hex[:8]}")
    if final.exists():
        _rename(final, old)
    _rename(following, final)
    shutil.rmtree(old, ignore_errors=True)


def _rename(src: Path, dst: Path) -> None:
    """An atomic rename onto a name that does not exist, made durable before the next."""
    os.rename(src, dst)
    fsync_dir(dst.parent)

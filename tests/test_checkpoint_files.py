"""Publishing checkpoints without processes: the last good copy survives a crash anywhere.

A "crash" is a `Crash` raised in place of the k-th file-system operation (rename, fsync,
mkdir, unlink, rmdir: a crash inside `shutil.rmtree` leaves a half-deleted directory),
for every k of a save; everything done before it stays on disk, as after a kill -9.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from evenzero.checkpoint.files import (
    newest,
    prepare_staging,
    publish,
    read_manifest,
    resolve,
    settle,
    verify_file,
)
from evenzero.checkpoint.format import CheckpointError, Manifest
from evenzero.strategies import plan
from test_checkpoint_format import SHAPES, full_values, save_plain, small_spec

SPEC = small_spec(SHAPES[:3])
PLAN = plan(SPEC, 2)


class Crash(BaseException):
    """The process died here (not an Exception: nothing may catch it)."""


OPERATIONS = ((os, "rename"), (os, "fsync"), (os, "mkdir"), (os, "unlink"), (os, "rmdir"))


@contextmanager
def crash_at(monkeypatch, k: int | None):
    """Raise `Crash` instead of the k-th file-system operation (None: never); yields a
    one-element list counting the operations done."""
    done = [0]

    def wrap(real):
        def op(*args, **kwargs):
            if done[0] == k:
                raise Crash
            done[0] += 1
            return real(*args, **kwargs)
        return op

    with monkeypatch.context() as m:
        for module, name in OPERATIONS:
            m.setattr(module, name, wrap(getattr(module, name)))
        yield done


def save(root: Path, name: str, seed: int) -> Manifest:
    """One save as `evenzero.checkpoint.save` does it on rank 0: stage, write, publish."""
    staging = prepare_staging(root, name)
    manifest = save_plain(PLAN, SPEC, full_values(SPEC, 1, seed), staging)
    publish(staging, root / name)
    return manifest


def visible(root: Path, name: str | None) -> Manifest:
    """The manifest a loader finds (by tag `name`, or the newest step), every file verified."""
    if name is None:  # the newest step under its own name, also mid-publish
        assert newest(root) == root / "step-000004"
    path = resolve(root, name) if name else resolve(root)
    manifest = read_manifest(path)
    for record in manifest.files:
        verify_file(path, record)
    return manifest


@pytest.mark.parametrize("name", ["step-000004", "best"])
def test_resave_keeps_a_complete_copy_through_a_crash_anywhere(tmp_path, monkeypatch, name):
    """Re-save `name` (a rolling step or a tag) with a crash before each operation; then
    let the next save recover, itself crashing before each of its operations. At every
    point the old or the new copy is complete and loadable, never the old one once the
    new one was visible, and the other checkpoint is untouched."""
    tag = None if name.startswith("step-") else name

    def setup(root: Path) -> tuple[Manifest, Manifest]:
        return save(root, "step-000002", seed=2), save(root, name, seed=10)

    setup(tmp_path / "count")
    with crash_at(monkeypatch, None) as done:
        new = save(tmp_path / "count", name, seed=11)
    operations = done[0]
    assert operations >= 10
    for k in range(operations + 1):
        root = tmp_path / f"k{k}"
        other, old = setup(root)
        with crash_at(monkeypatch, k), pytest.raises((Crash, _Done)):
            save(root, name, seed=11)
            raise _Done
        seen = visible(root, tag)
        assert seen in (old, new), k
        for j in range(operations):
            with crash_at(monkeypatch, j), pytest.raises((Crash, _Done)):
                settle(root)
                raise _Done
            now = visible(root, tag)
            assert now == seen if seen == new else now in (old, new), (k, j)
            seen = now
        final = save(root, name, seed=12)
        assert visible(root, tag) == final
        assert read_manifest(root / "step-000002") == other
        assert sorted(p.name for p in root.iterdir()) == sorted({"step-000002", name})
        shutil.rmtree(root)


class _Done(Exception):
    """settle() finished before the planned crash."""


def test_staging_is_skipped_but_a_damaged_published_checkpoint_is_not(tmp_path):
    for step in (2, 4):
        save(tmp_path, f"step-{step:06d}", seed=step)
    # A crash mid-save leaves a staging directory: never a checkpoint.
    (tmp_path / ".tmp-step-000006").mkdir()
    (tmp_path / ".tmp-step-000006" / "manifest.json").write_text('{"format": "evenzero-chec')
    assert newest(tmp_path) == resolve(tmp_path) == tmp_path / "step-000004"
    assert resolve(tmp_path / "step-000002") == tmp_path / "step-000002"
    # A published one is complete by construction; damage is reported, not skipped.
    (tmp_path / "step-000008").mkdir()
    (tmp_path / "step-000008" / "manifest.json").write_text('{"format": "evenzero-chec')
    assert newest(tmp_path) == resolve(tmp_path) == tmp_path / "step-000008"
    with pytest.raises(CheckpointError, match=r"step-000008/manifest.json: manifest is not "
                                              r"valid JSON"):
        read_manifest(resolve(tmp_path))
    (tmp_path / "step-000008" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"step-000008/manifest.json: no manifest; a "
                                              r"published checkpoint always has one"):
        read_manifest(resolve(tmp_path))
    with pytest.raises(CheckpointError, match=r"step-000008/manifest.json: no manifest"):
        resolve(tmp_path / "step-000008")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve(tmp_path / "nothing-here")
    # The next save clears staging only.
    save(tmp_path, "step-000010", seed=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000002", "step-000004", "step-000008", "step-000010"]


def test_format1_resave_interrupted_between_its_renames_is_recovered(tmp_path):
    """Format-1 savers renamed step-X to .tmp-old-step-X, then the new copy in: a crash in
    between left only .tmp-old-step-X complete (and a full .tmp-step-X of unknown state).
    It is loaded, and the next save puts it back instead of deleting it."""
    old = save(tmp_path, "step-000004", seed=4)
    os.rename(tmp_path / "step-000004", tmp_path / ".tmp-old-step-000004")
    staging = tmp_path / ".tmp-step-000004"
    staging.mkdir()
    save_plain(PLAN, SPEC, full_values(SPEC, 1, 5), staging)
    assert visible(tmp_path, None) == old
    save(tmp_path, "step-000006", seed=6)
    assert read_manifest(tmp_path / "step-000004") == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000006"]


@pytest.mark.parametrize("tag", ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "/abs", "a\0b",
                                 "a\nb", 7, None.__class__])
def test_bad_tags_are_refused(tmp_path, tag):
    from evenzero.checkpoint.files import check_tag

    with pytest.raises(CheckpointError, match=r"checkpoint tag .* is not a plain directory name"):
        check_tag(tag)
    with pytest.raises(CheckpointError, match=r"is not a plain directory name"):
        resolve(tmp_path, tag)


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path):
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"best exists and is not an evenzero checkpoint"):
        save(tmp_path, "best", seed=1)
    assert (tmp_path / "best" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("tag", ["global_step100", "best", "epoch 3", "v1+ft.2"])
def test_tags_are_any_single_directory_name(tmp_path, tag):
    manifest = save(tmp_path, tag, seed=3)
    assert visible(tmp_path, tag) == manifest and (tmp_path / tag / "manifest.json").is_file()

"""Saves that do not stop training: `evenzero.checkpoint.save(..., blocking=False)`.

A background save has two halves (torchtitan's `async_mode` and DCP's `async_save` make
the same cut):

* on the calling thread, while training waits: the ranks agree on the checkpoint's name
  and every rank copies its state off the live tensors into CPU buffers
  (`writer.snapshot`); `save` returns as soon as that copy is taken;
* on one background thread per process: the files are written, fsynced and published
  exactly as a blocking save does (`writer.publish`), while training goes on. The thread
  runs at a lower CPU priority (Linux), taking the cycles training leaves.

**Collectives.** The publish's agreements are collectives. Issued on the training's
process group from another thread, they would interleave with the training's own
collectives in a different order on each rank, which deadlocks or mixes data. So the
background half agrees over a process group of its own: a gloo group over the
optimizer's ranks, created once, at the first background save, which every rank of the
job reaches (creating it is a collective, over the whole job when the optimizer spans
every rank and over the optimizer's ranks otherwise). The training never uses it.

**Memory.** One save is in flight per process: a save, `wait()` or `load` first waits
for the one before. Its snapshot lives in CPU buffers that every background save
reuses (pinned when the state is on a GPU), so they stay at the size of one
snapshot: per rank, 4 bytes x (1 + the elementwise optimizer-state tensors: 2 for
Adam/AdamW) x this rank's shard elements (the plan's `shard_numel`, over its groups),
which is about 12 bytes per parameter / world size for AdamW, plus on rank 0 a copy of
the model's buffers and frozen parameters, plus a copy of the tensors in `extra=`.
`buffer_bytes()` says how many bytes are held now.

**Failures.** The outcome of every step is agreed by the ranks, so each rank's thread
ends with the same result; a failure is raised, the same `CheckpointError` on every
rank, at the next `save`, `wait()` or `load`. A crash (SIGKILL) while writing leaves
only a staging directory, which is never loaded and which the next save removes; the
previous checkpoint stays published. A clean interpreter exit waits for the thread
(it is not a daemon) and prints a failure nobody collected. Destroying the process
groups (`dist.destroy_process_group()`) under a running background save breaks it:
call `evenzero.checkpoint.wait()` first.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from evenzero.checkpoint.format import CheckpointError
from evenzero.checkpoint.state import RankPlace


class SnapshotBuffers:
    """CPU tensors a background save copies the live state into, reused save after save.

    A buffer is kept per key (plan group and state kind, or model entry) and replaced
    only when the shape or dtype of what it copies changes; `settle` drops the
    buffers the last snapshot did not use, so the held memory stays that of one snapshot.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[str, ...], torch.Tensor] = {}
        self._used: set[tuple[str, ...]] = set()
        self._devices: set[torch.device] = set()

    def copy(self, key: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        """A CPU copy of `tensor` in the buffer for `key` (valid once `settle` returned)."""
        source = tensor.detach()
        buf = self._held.get(key)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            buf = torch.empty(source.shape, dtype=source.dtype,
                              pin_memory=source.device.type == "cuda")
            self._held[key] = buf
        on_gpu = source.device.type == "cuda"
        if on_gpu and source.device not in self._devices:
            # Whatever any stream still queues for this state comes first.
            torch.cuda.synchronize(source.device)
            self._devices.add(source.device)
        buf.copy_(source, non_blocking=on_gpu)
        self._used.add(key)
        return buf

    def settle(self) -> None:
        """Wait for the copies from GPUs, and forget buffers this snapshot did not use."""
        for device in self._devices:
            torch.cuda.synchronize(device)
        self._devices.clear()
        for key in set(self._held) - self._used:
            del self._held[key]
        self._used.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held.values())


@dataclass
class _Save:
    """One background save."""

    final: Path
    """Where it publishes."""
    root: Path
    thread: threading.Thread | None = None
    error: BaseException | None = None
    reported: bool = False
    done: threading.Event = field(default_factory=threading.Event)


WRITER_NICENESS = 10
"""How much lower the writer thread's CPU priority is than the training's (Linux)."""

_lock = threading.Lock()
_inflight: _Save | None = None
_buffers = SnapshotBuffers()
_groups: dict[tuple[int, ...], tuple[object, object]] = {}
"""Global ranks -> (the default process group it was made under, the save group)."""
_exit_hook = False


def buffers() -> SnapshotBuffers:
    """The snapshot buffers of this process (one save in flight, so one set)."""
    return _buffers


def buffer_bytes() -> int:
    """Bytes of CPU memory held for background-save snapshots in this process."""
    return _buffers.nbytes()


def save_place(place: RankPlace) -> RankPlace:
    """`place` with the background saves' own process group (gloo, on the CPU); creates
    it the first time, a collective that every rank of the optimizer must reach."""
    if place.world_size == 1 or place.group is None:
        return dataclasses.replace(place, group=None, device=torch.device("cpu"))
    ranks = tuple(dist.get_process_group_ranks(place.group))
    default = dist.group.WORLD
    held = _groups.get(ranks)
    if held is None or held[0] is not default:
        if list(ranks) != sorted(ranks):
            # new_group numbers members in rank order; agreements need the same numbers.
            raise CheckpointError(f"save(blocking=False): the optimizer's process group lists "
                                  f"global ranks {list(ranks)} out of order; build it with "
                                  f"dist.new_group(sorted(ranks)), or save with blocking=True")
        if len(ranks) == dist.get_world_size():
            group = dist.new_group(backend="gloo")
        else:
            # Only the optimizer's ranks reach this save; the others must not be waited for.
            group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        _groups[ranks] = held = (default, group)
    return dataclasses.replace(place, group=held[1], device=torch.device("cpu"))


def start(write: Callable[[], Path], final: Path, root: Path) -> None:
    """Run `write` (which publishes `final` under `root`) on the background thread."""
    global _inflight, _exit_hook
    job = _Save(final=final, root=root)

    def run() -> None:
        _yield_cpu()
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - kept for wait(), on every rank alike
            job.error = e
        finally:
            job.done.set()

    job.thread = threading.Thread(target=run, name=f"evenzero-checkpoint {final.name}",
                                  daemon=False)
    with _lock:
        if _inflight is not None and not _inflight.done.is_set():
            raise RuntimeError("a background save is already running; wait() for it first")
        _inflight = job
        if not _exit_hook:
            atexit.register(_report_at_exit)
            _exit_hook = True
    job.thread.start()


def wait(raise_error: bool = True) -> Path | None:
    """Block until this process's background save (if any) is done; return where it
    published (None if there was none). A failure is raised once, as a `CheckpointError`
    that every rank raises alike; with `raise_error=False` it stays pending."""
    global _inflight
    job = _inflight
    if job is None:
        return None
    job.done.wait()
    if job.thread is not None:
        job.thread.join()
    if job.error is not None:
        if not raise_error:
            return None
        with _lock:
            if _inflight is job:
                _inflight = None
        job.reported = True
        raise CheckpointError(f"the background save of {job.final} failed: "
                              f"{_describe(job.error)}") from job.error
    with _lock:
        if _inflight is job:
            _inflight = None
    return job.final


def pending_under(root: Path) -> bool:
    """Whether a background save into `root` is in flight (or unfinished business)."""
    job = _inflight
    if job is None:
        return False
    try:
        return job.root.resolve() == Path(root).resolve()
    except OSError:
        return False


def _yield_cpu() -> None:
    """Lower this thread's CPU priority, so that the training's threads run first and the
    writer takes the cycles they leave (on a CPU-bound job its hashing and copying would
    otherwise slow the steps down). Linux schedules each thread on its own, so this
    touches no other thread; elsewhere a priority is the whole process's: left alone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        me = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, me)
        os.setpriority(os.PRIO_PROCESS, me, min(19, now + WRITER_NICENESS))
    except (OSError, AttributeError):
        pass  # a priority we may not change is not worth failing a save for


def _describe(err: BaseException) -> str:
    return str(err) or type(err).__name__


def _report_at_exit() -> None:
    """At exit (after the interpreter joined the thread): say what failed unseen."""
    job = _inflight
    if job is None:
        return
    job.done.wait()
    if job.error is not None and not job.reported:
        print(f"evenzero.checkpoint: the background save of {job.final} failed and was never "
              f"waited for: {_describe(job.error)}", file=sys.stderr)

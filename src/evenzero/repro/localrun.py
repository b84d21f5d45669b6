"""Run one function on W local processes that form a torch.distributed job.

Used by `evenzero repro`, the benchmarks and the tests. Each process joins a process
group (NCCL on its own GPU when at least W GPUs are visible, else gloo on the CPU),
runs `worker(context, payload)` and rank 0's return value comes back to the caller.
Progress events flow back through a queue so the parent can draw a progress bar, and a
rank that dies or raises ends the whole job with its error: never a hang.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from evenzero.commands import MAX_LOCAL_RANKS

MAX_STEPS = 100_000
"""Most steps per system a side-by-side job takes (results are kept per step)."""


class LaunchError(RuntimeError):
    """A rank failed or the job ran past its time limit; the message says which and why."""


@dataclass(frozen=True)
class RanksJoined:
    """Sent to `on_event` by the launcher each time a rank has joined the process group."""

    joined: int
    world_size: int


@dataclass(frozen=True)
class LaunchOptions:
    """How the local job is started."""

    world_size: int
    """Number of local processes (ranks)."""
    backend: str = "auto"
    """"gloo", "nccl", or "auto" (NCCL when at least `world_size` GPUs are visible)."""
    timeout_s: float = 900.0
    """Wall-clock limit for the whole job; past it every rank is terminated."""
    threads_per_rank: int | None = None
    """torch intra-op threads per rank; None shares the machine's cores evenly."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables set in each rank before the worker runs."""
    log_dir: str | None = None
    """Each rank's stdout and stderr go to <log_dir>/rank<r>.log (libraries such as
    DeepSpeed print from every rank); None makes a fresh temporary directory."""


@dataclass(frozen=True)
class RankContext:
    """What a worker knows about its place in the job."""

    rank: int
    world_size: int
    backend: str
    device: str
    """"cpu" or "cuda:<local rank>"."""
    events: Any = field(repr=False, default=None)
    """Queue back to the parent; use `emit`."""

    def emit(self, data: Any) -> None:
        """Send a progress event to the parent (only rank 0's events are shown)."""
        if self.rank == 0 and self.events is not None:
            self.events.put(("event", self.rank, data))


def resolve_backend(requested: str, world_size: int) -> str:
    if requested not in ("auto", "gloo", "nccl"):
        raise LaunchError(f"unknown backend {requested!r}; use gloo, nccl or auto")
    if requested != "auto":
        return requested
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def launch(worker: Callable[[RankContext, Any], Any], payload: Any, options: LaunchOptions,
           on_event: Callable[[Any], None] | None = None) -> Any:
    """Run `worker` on `options.world_size` ranks; return rank 0's result.

    `on_event` receives what rank 0 emits, and a `RanksJoined` each time a rank is up."""
    import torch.multiprocessing as mp

    if options.world_size < 1:
        raise LaunchError(f"world size must be at least 1, got {options.world_size}")
    backend = resolve_backend(options.backend, options.world_size)
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    port = _free_port()
    threads = options.threads_per_rank or max(1, (os.cpu_count() or 1) // options.world_size)
    log_dir = options.log_dir or tempfile.mkdtemp(prefix="evenzero-ranks-")
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(rank, options.world_size, port, backend, threads, dict(options.env),
                               os.path.join(log_dir, f"rank{rank}.log"), worker, payload, events))
             for rank in range(options.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + options.timeout_s
    result: Any = None
    finished: set[int] = set()
    joined = 0
    try:
        while len(finished) < options.world_size:
            if time.monotonic() > deadline:
                raise LaunchError(f"local job did not finish within {options.timeout_s:.0f} s; "
                                  f"raise the limit or use fewer steps / a smaller world size")
            try:
                kind, rank, data = events.get(timeout=0.5)
            except queue.Empty:
                _check_alive(procs, finished)
                continue
            if kind == "event" and on_event is not None:
                on_event(data)
            elif kind == "joined":
                joined += 1
                if on_event is not None:
                    on_event(RanksJoined(joined, options.world_size))
            elif kind == "done":
                finished.add(rank)
                if rank == 0:
                    result = data
            elif kind == "error":
                raise LaunchError(f"rank {rank} failed: {data} (full log: {log_dir}/rank{rank}.log)")
        for p in procs:
            p.join(timeout=30)
        if options.log_dir is None:  # a failed job keeps its logs: the error names them
            shutil.rmtree(log_dir, ignore_errors=True)
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        events.close()


def _check_alive(procs: list, finished: set[int]) -> None:
    for rank, p in enumerate(procs):
        if rank not in finished and p.exitcode is not None:
            raise LaunchError(f"rank {rank} exited with code {p.exitcode} without reporting a "
                              f"result (killed for memory? try a smaller world size)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, threads: int,
               env: dict[str, str], log_path: str, worker: Callable, payload: Any,
               events: Any) -> None:
    # At the file-descriptor level, so prints from C++ (gloo, compiled ops) go there too.
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    if backend == "gloo":
        # DeepSpeed picks its accelerator at import time; on a CPU job it must be "cpu".
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    torch.set_num_threads(threads)
    device = "cpu"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                device_id=torch.device(device) if backend == "nccl" else None)
        events.put(("joined", rank, None))
        context = RankContext(rank, world_size, backend, device, events)
        result = worker(context, payload)
        events.put(("done", rank, result if rank == 0 else None))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent, or it waits
        traceback.print_exc()
        where = traceback.extract_tb(e.__traceback__)[-1]
        events.put(("error", rank, f"{type(e).__name__}: {e} [{os.path.basename(where.filename)}:"
                                   f"{where.lineno}]"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def add_launch_arguments(parser: Any, *, world_size: int, steps: int, systems: tuple[str, ...],
                         default_systems: tuple[str, ...], bucket_numel: int) -> None:
    """The options every side-by-side command shares (`evenzero repro`, `evenzero bench`)."""
    from evenzero.commands import int_in
    from evenzero.spec import MAX_NUMEL

    parser.add_argument("--world-size", type=int_in(1, MAX_LOCAL_RANKS, "local processes"),
                        default=world_size, help=f"local ranks (default {world_size})")
    parser.add_argument("--steps", type=int_in(1, MAX_STEPS), default=steps,
                        help=f"measured steps per system (default {steps})")
    parser.add_argument("--warmup", type=int_in(0, MAX_STEPS), default=2,
                        help="untimed warm-up steps (default 2)")
    parser.add_argument("--systems", default=",".join(default_systems),
                        help=f"comma-separated subset of {', '.join(systems)}")
    auto = ("the runtime's default, \"auto\": chosen from the predicted timeline, refined "
            "from the first backwards")
    parser.add_argument("--bucket-numel", type=int_in(0, MAX_NUMEL), default=bucket_numel,
                        help=f"evenzero bucket size in elements (default: {auto})" if not
                        bucket_numel else f"evenzero bucket size in elements (default "
                                          f"{bucket_numel}; 0 = {auto})")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                        help="process-group backend (default: NCCL if enough GPUs, else gloo)")


def parse_launch_arguments(args: Any, systems: tuple[str, ...]) -> tuple[str, ...]:
    """Validate the shared options; returns the chosen systems. Raises ValueError."""
    chosen = tuple(dict.fromkeys(s.strip() for s in args.systems.split(",") if s.strip()))
    unknown = [s for s in chosen if s not in systems]
    if unknown or not chosen:
        raise ValueError(f"--systems: unknown system(s) {unknown}; choose from {', '.join(systems)}")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be at least 1 and --warmup at least 0")
    if args.bucket_numel < 0:
        raise ValueError(f"--bucket-numel must be a positive number of elements (or 0 for the "
                         f"runtime's default), got {args.bucket_numel}")
    return chosen

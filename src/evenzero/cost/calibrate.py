"""Measure a cost model on the current process group.

`measure()` times each collective op over a sweep of message sizes on the current process
group and fits t = alpha + f*S/busbw per op (`evenzero.cost.fit_op`), so that predictions
can be checked against this machine. `run_local()` does it on W local gloo ranks, and
`run_from_env()` under torchrun, for `evenzero calibrate`.

Each sample is the fastest of `repeats` calls, each started right after a barrier, taken
as the slowest rank's time (an all-reduce MAX) so that every rank fits the same numbers.
The fastest call, not the median: on a shared host, scheduler noise lands on random calls
and is not a property of the collective.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist

from evenzero.cost import OPS, CostModel, CostModelError, OpCost, Sample, fit_op

DEFAULT_SIZES = (2**10, 2**14, 2**16, 2**18, 2**20, 2**22)
"""Full-buffer sizes in elements: from latency-bound to bandwidth-bound on gloo."""


# torch 2.13 renamed the flat-tensor collectives and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CalibrationError(RuntimeError):
    """Calibration cannot run here; the message says what to do instead."""


def _call(op: str, numel: int, group, device, dtype) -> callable:
    n = dist.get_world_size(group)
    if op == "all_reduce":
        buf = torch.ones(numel, device=device, dtype=dtype)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "reduce":
        buf = torch.ones(numel, device=device, dtype=dtype)
        root = dist.get_global_rank(group, 0) if group is not None else 0
        return lambda: dist.reduce(buf, dst=root, group=group)
    if op == "reduce_scatter":
        inp = torch.ones(numel, device=device, dtype=dtype)
        out = torch.empty(numel // n, device=device, dtype=dtype)
        return lambda: _reduce_scatter(out, inp, group=group)
    if op == "all_gather":
        inp = torch.ones(numel // n, device=device, dtype=dtype)
        out = torch.empty(numel, device=device, dtype=dtype)
        return lambda: _all_gather(out, inp, group=group)
    raise CalibrationError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def sweep(group=None, sizes: Sequence[int] = DEFAULT_SIZES, ops: Sequence[str] = OPS,
          repeats: int = 5, dtype: torch.dtype = torch.float32) -> tuple[Sample, ...]:
    """Time every op at every size on `group` (default: the world). Collective: every
    rank of the group must call it with the same arguments."""
    if not dist.is_available() or not dist.is_initialized():
        raise CalibrationError("torch.distributed is not initialised; call "
                               "dist.init_process_group first, or run `evenzero calibrate "
                               "--world-size W` to spawn local ranks")
    n = dist.get_world_size(group)
    if n < 2:
        raise CalibrationError("calibration needs a group of at least 2 ranks")
    check_sweep(sizes, repeats)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    itemsize = torch.empty((), dtype=dtype).element_size()
    samples = []
    for op in ops:
        for size in sizes:
            numel = -(-int(size) // n) * n  # RS input and AG output must split evenly
            call = _call(op, numel, group, device, dtype)
            call()  # warm-up: first calls pay connection and allocation setup
            times = []
            for _ in range(repeats):
                dist.barrier(group=group)
                _sync(device)
                t0 = perf_counter()
                call()
                _sync(device)
                times.append(perf_counter() - t0)
            slowest = torch.tensor([min(times)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            samples.append(Sample(op, n, numel * itemsize, float(slowest.item())))
    return tuple(samples)


def check_sweep(sizes: Sequence[int], repeats: int) -> None:
    if len({int(s) for s in sizes}) < 2 or min(sizes) <= 0:
        raise CalibrationError(f"sizes must hold at least two different positive element "
                               f"counts to fit a line, got {list(sizes)}")
    if repeats < 1:
        raise CalibrationError(f"repeats must be at least 1, got {repeats}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_model(samples: Sequence[Sample], name: str = "measured",
              description: str = "") -> CostModel:
    """One flat-alpha variant per op, fitted on `samples` (all from one group size)."""
    sizes = {s.group_size for s in samples}
    if len(sizes) != 1:
        raise CostModelError(f"samples come from several group sizes {sorted(sizes)}; fit each apart")
    (n,) = sizes
    variants = {}
    for op in OPS:
        mine = [s for s in samples if s.op == op]
        if not mine:
            raise CostModelError(f"no samples for {op}; calibrate every op")
        variants[op] = OpCost((fit_op(mine, "measured"),))
    return CostModel(name=name, description=description or f"measured on {n} ranks",
                     reference_ranks=n, gpus_per_node=n,
                     sources="evenzero calibrate: least-squares fit of t = alpha + f*S/busbw",
                     **variants)


def measure(group=None, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
            name: str = "measured") -> CostModel:
    """Sweep and fit on `group` (default: the world); every rank gets the same model."""
    return _measure(group, sizes, repeats, name)[0]


def _measure(group, sizes: Sequence[int], repeats: int,
             name: str) -> tuple[CostModel, tuple[Sample, ...]]:
    samples = sweep(group, sizes, OPS, repeats)
    backend = dist.get_backend(group)
    desc = f"{backend} on {dist.get_world_size(group)} ranks, host {platform.node()}"
    return fit_model(samples, name, desc), samples


# --------------------------------------------------------------------------- local ranks


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_worker(rank: int, world_size: int, port: int, sizes: Sequence[int], repeats: int,
                  out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # W processes share a few cores: intra-op threads would fight gloo's own threads and
    # turn scheduler stalls into "latency".
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        model, samples = _measure(None, sizes, repeats, f"gloo-local-{world_size}")
        if rank == 0:
            Path(out_path).write_text(json.dumps(
                {"model": model.to_json(), "samples": [vars(s) for s in samples]}))
    finally:
        dist.destroy_process_group()


def run_local(world_size: int, sizes: Sequence[int] = DEFAULT_SIZES,
              repeats: int = 5) -> tuple[CostModel, tuple[Sample, ...]]:
    """Spawn `world_size` gloo ranks on this host and measure them."""
    if world_size < 2:
        raise CalibrationError(f"--world-size must be at least 2, got {world_size}")
    check_sweep(sizes, repeats)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calibration.json"
        mp.spawn(_local_worker, args=(world_size, _free_port(), tuple(sizes), repeats, str(out)),
                 nprocs=world_size, join=True)
        data = json.loads(out.read_text())
    return CostModel.from_json(data["model"]), tuple(Sample(**s) for s in data["samples"])


def run_from_env(sizes: Sequence[int] = DEFAULT_SIZES,
                 repeats: int = 5) -> tuple[CostModel, tuple[Sample, ...]] | None:
    """Under torchrun (RANK/WORLD_SIZE set): measure the world; None on ranks other than 0."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    try:
        result = _measure(None, sizes, repeats, f"{backend}-{dist.get_world_size()}")
        return result if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


__all__ = ["DEFAULT_SIZES", "CalibrationError", "check_sweep", "fit_model", "measure", "run_from_env",
           "run_local", "sweep"]

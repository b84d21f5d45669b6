"""Measure a cost model, compute included, on the current process group.

What is timed is what the runtime issues and what the step timeline needs:

* the collectives the runtime calls: all_reduce, reduce, all_gather_into_tensor and the
  reduce-scatter *as the runtime does it on this backend*: on gloo `all_to_all_single`
  followed by the local sum over the received chunks (`evenzero.runtime.collectives`
  picks it there: gloo's own reduce_scatter_tensor is slower than an all-reduce), the
  native `reduce_scatter_tensor` elsewhere;
* at several group sizes: the world and, concurrently, disjoint subgroups of each
  smaller power-of-two size {i, i+E, ...} (E = W/size), which is how expert-data-parallel
  groups run. The fitted model prices those sizes with their own numbers and any other
  size by a line through the measured latencies;
* the compute of one rank while every rank computes (cores and memory bandwidth are
  shared exactly as in training): matmul throughput, copy bandwidth, the seconds per
  element of a torch AdamW step, and how much a collective in flight slows compute.

Each collective sample is the fastest of `repeats` calls, each started right after a
barrier, taken as the slowest rank's time (an all-reduce MAX over the world) so that
every rank fits the same numbers. The fastest call, not the median: on a shared host,
scheduler noise lands on random calls and is not a property of the collective.
`run_local()` measures W local gloo ranks, `run_from_env()` a torchrun job.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from time import perf_counter

import torch
import torch.distributed as dist

from evenzero.cost import OPS, CostModel, CostModelError, OpCost, Sample, Variant, fit_op
from evenzero.cost.compute import DeviceCompute

DEFAULT_SIZES = (2**10, 2**14, 2**16, 2**18, 2**20, 2**22)
"""Full-buffer sizes in elements: from latency-bound to bandwidth-bound on gloo."""
ALL_TO_ALL_SUM = "all_to_all+sum"
"""The reduce-scatter evenzero's runtime runs on gloo (`runtime.collectives`)."""
MATMUL_SHAPE = {"cpu": ((64, 1024, 1024), torch.float32), "cuda": ((8192, 4096, 4096), torch.bfloat16)}
"""(tokens, in, out) and dtype of the timed matmul per device: on CPU a layer at the tens
of tokens per rank CPU runs train with; on GPUs a large bf16 layer, as they train."""
COPY_NUMEL = 2**23
"""Elements copied to time memory bandwidth (32 MiB of fp32, beyond the caches)."""
OPTIMIZER_NUMEL = 2**22
"""Elements of the flat parameter an AdamW step is timed on."""

# torch 2.13 renamed the flat-tensor collectives and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CalibrationError(RuntimeError):
    """Calibration cannot run here; the message says what to do instead."""


def reduce_scatter_algorithm(group=None) -> str:
    """The reduce-scatter the runtime issues on `group`'s backend."""
    return ALL_TO_ALL_SUM if "gloo" in str(dist.get_backend(group)) else "reduce_scatter_tensor"


def _call(op: str, numel: int, group, device, dtype,
          rs_algorithm: str | None = None) -> Callable[[], None]:
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
        if (rs_algorithm or reduce_scatter_algorithm(group)) == ALL_TO_ALL_SUM:
            scratch = torch.empty(numel, device=device, dtype=dtype)
            return lambda: (dist.all_to_all_single(scratch, inp, group=group),
                            scratch.view(n, -1).sum(0))
        out = torch.empty(numel // n, device=device, dtype=dtype)
        return lambda: _reduce_scatter(out, inp, group=group)
    if op == "all_gather":
        inp = torch.ones(numel // n, device=device, dtype=dtype)
        out = torch.empty(numel, device=device, dtype=dtype)
        return lambda: _all_gather(out, inp, group=group)
    raise CalibrationError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def _fastest(call: Callable[[], None], group, device, repeats: int) -> float:
    """This rank's fastest of `repeats` timed calls, each right after a barrier."""
    call()  # warm-up: first calls pay connection and allocation setup
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = perf_counter()
        call()
        _sync(device)
        times.append(perf_counter() - t0)
    return min(times)


def _device(group) -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device())
            if "nccl" in str(dist.get_backend(group)) else torch.device("cpu"))


def _slowest_rank(values: list[float], device, group=None) -> list[float]:
    """Element-wise max over `group` (the world), so every rank fits the same numbers."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def default_group_sizes(world_size: int) -> tuple[int, ...]:
    """The world and every smaller power of two >= 2 that divides it."""
    sizes, n = {world_size}, 2
    while n < world_size:
        if world_size % n == 0:
            sizes.add(n)
        n *= 2
    return tuple(sorted(sizes))


def _subgroup(size: int):
    """This rank's group among the disjoint groups {i, i+E, ...} of `size` ranks (every
    rank creates all of them, as torch.distributed requires)."""
    world = dist.get_world_size()
    if size == world:
        return None
    e = world // size
    mine = None
    for i in range(e):
        g = dist.new_group(list(range(i, world, e)))
        if dist.get_rank() % e == i:
            mine = g
    return mine


def sweep(group=None, sizes: Sequence[int] = DEFAULT_SIZES, ops: Sequence[str] = OPS,
          repeats: int = 5, dtype: torch.dtype = torch.float32,
          group_sizes: Sequence[int] | None = None, *, device: torch.device | None = None,
          rs_algorithm: str | None = None) -> tuple[Sample, ...]:
    """Time every op at every size, on the world (`group` must be None then) and on the
    disjoint subgroups of each of `group_sizes` (default `default_group_sizes`), or on
    `group` alone. Collective over the world (over `group` when given): every rank calls
    it with the same arguments. `device` (default: CUDA for NCCL, else the CPU) holds the
    messages; `rs_algorithm` overrides the backend's reduce-scatter ("all_to_all+sum" or
    "reduce_scatter_tensor"), for a runtime configured with another one."""
    if not dist.is_available() or not dist.is_initialized():
        raise CalibrationError("torch.distributed is not initialised; call "
                               "dist.init_process_group first, or run `evenzero calibrate "
                               "--world-size W` to spawn local ranks")
    check_sweep(sizes, repeats)
    world = dist.get_world_size()
    if group is not None:
        plan = [(dist.get_world_size(group), group)]
    else:
        wanted = group_sizes or default_group_sizes(world)
        bad = [n for n in wanted if n < 2 or world % n]
        if bad:
            raise CalibrationError(f"group sizes {bad} do not divide the world of {world} ranks "
                                   f"(or are < 2)")
        plan = [(n, _subgroup(n)) for n in wanted]
    device = device or _device(group)
    itemsize = torch.empty((), dtype=dtype).element_size()
    keys, local = [], []
    for n, g in plan:
        for op in ops:
            for size in sizes:
                numel = -(-int(size) // n) * n  # RS input and AG output must split evenly
                local.append(_fastest(_call(op, numel, g, device, dtype, rs_algorithm), g,
                                      device, repeats))
                keys.append((op, n, numel * itemsize))
    times = _slowest_rank(local, device, group)
    return tuple(Sample(op, n, nbytes, t) for (op, n, nbytes), t in zip(keys, times, strict=True))


def check_sweep(sizes: Sequence[int], repeats: int) -> None:
    if len({int(s) for s in sizes}) < 2 or min(sizes) <= 0:
        raise CalibrationError(f"sizes must hold at least two different positive element "
                               f"counts to fit a line, got {list(sizes)}")
    if repeats < 1:
        raise CalibrationError(f"repeats must be at least 1, got {repeats}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- compute


def _rate(work: Callable[[], None], device, seconds: float = 0.2) -> float:
    """Calls per second of `work`, run for about `seconds` after one warm-up call."""
    work()
    _sync(device)
    calls, t0 = 0, perf_counter()
    while True:
        work()
        calls += 1
        _sync(device)
        elapsed = perf_counter() - t0
        if elapsed >= seconds and calls >= 3:
            return calls / elapsed


def measure_compute(device: torch.device | None = None, name: str = "measured") -> DeviceCompute:
    """One rank's compute while every rank of the world computes the same (collective)."""
    device = device or _device(None)
    (t, k, m), dtype = MATMUL_SHAPE["cuda" if device.type == "cuda" else "cpu"]
    # Drawn from a private CPU generator: calibrating inside a job must leave the user's
    # random streams, CPU and CUDA, as they were (issue 21).
    gen = torch.Generator().manual_seed(0)

    def draw(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device)

    a, b = draw(t, k, dtype=dtype), draw(k, m, dtype=dtype)
    src = draw(COPY_NUMEL)
    dst = torch.empty_like(src)
    param = torch.nn.Parameter(draw(OPTIMIZER_NUMEL))
    param.grad = draw(OPTIMIZER_NUMEL)
    adamw = torch.optim.AdamW([param], lr=1e-3)
    small_a, small_b = a[:, :256].contiguous(), b[:256, :256].contiguous()
    dist.barrier()
    matmul = _rate(lambda: torch.mm(a, b), device)
    copy = _rate(lambda: dst.copy_(src), device)
    step = _rate(adamw.step, device)
    # Small matmuls beside a collective in flight, against the same alone: what overlap
    # really gets on this host (gloo's threads and copies share cores and memory).
    alone = _rate(lambda: torch.mm(small_a, small_b), device)
    message = torch.ones(2**22, device=device)
    dist.barrier()
    work = dist.all_reduce(message, async_op=True)
    calls, t0 = 0, perf_counter()
    while not work.is_completed():
        torch.mm(small_a, small_b)
        calls += 1
    _sync(device)
    elapsed = perf_counter() - t0
    work.wait()
    during = calls / elapsed if calls else alone
    rates = _slowest_rank([-matmul, -copy, -step, -alone, -during], device)
    matmul, copy, step, alone, during = (-r for r in rates)  # the slowest rank: lowest rate
    memory_gbs = copy * 2 * COPY_NUMEL * 4 / 1e9
    return DeviceCompute(
        name, tflops=matmul * 2 * t * k * m / 1e12, memory_gbs=memory_gbs,
        optimizer_bytes_per_element=memory_gbs * 1e9 / (step * OPTIMIZER_NUMEL),
        comm_slowdown=min(4.0, max(0.0, alone / during - 1)),
        sources=f"evenzero calibrate: {t}x{k}x{m} {str(dtype).removeprefix('torch.')} matmul, "
                f"{COPY_NUMEL:,}-element copy, torch AdamW step on {OPTIMIZER_NUMEL:,} "
                f"elements, matmuls beside an all-reduce; slowest rank, every rank busy, "
                f"{torch.get_num_threads()} thread(s) per rank")


# --------------------------------------------------------------------------- fitting


def fit_model(samples: Sequence[Sample], name: str = "measured", description: str = "",
              compute: DeviceCompute | None = None, rs_variant: str = "measured") -> CostModel:
    """Per op: one variant per measured group size, and one for any other size whose
    latency follows a line through the measured ones (flat if one size was measured).
    The world is the largest group size. A size whose timings did not grow with the
    message (noise) gets no variant of its own; if none did, the fit is refused."""
    world = max(s.group_size for s in samples)
    measured = ", ".join(str(n) for n in sorted({s.group_size for s in samples}))
    variants = {}
    for op in OPS:
        mine = [s for s in samples if s.op == op]
        if not mine:
            raise CostModelError(f"no samples for {op}; calibrate every op")
        label = rs_variant if op == "reduce_scatter" else "measured"
        exact, failed = [], None
        for n in sorted({s.group_size for s in mine}):
            try:
                v = fit_op([s for s in mine if s.group_size == n])
            except CostModelError as e:  # noise at one size: the line through the others prices it
                failed = e
                continue
            exact.append(Variant(label, v.alpha_us, v.busbw_gbs, group_size=n))
        if not exact:
            raise failed
        anchor = exact[-1]
        variants[op] = OpCost((*exact, Variant(
            label, anchor.alpha_us, anchor.busbw_gbs, scaling="linear",
            step_us=_alpha_slope([(v.group_size, v.alpha_us) for v in exact]))))
    return CostModel(name=name, description=description or f"measured on {world} ranks",
                     reference_ranks=world, gpus_per_node=world, compute=compute,
                     fitted_ranks=(world,),
                     sources="evenzero calibrate: least-squares fit of t = alpha + f*S/busbw "
                             f"per op and group size ({measured} ranks)",
                     **variants)


def _alpha_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of alpha over group size, clamped at 0 (latency does not fall
    with more peers; a negative slope is noise)."""
    if len(points) < 2:
        return 0.0
    mx = sum(n for n, _ in points) / len(points)
    my = sum(a for _, a in points) / len(points)
    den = sum((n - mx) ** 2 for n, _ in points)
    return max(0.0, sum((n - mx) * (a - my) for n, a in points) / den)


def measure(group=None, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
            name: str = "measured", group_sizes: Sequence[int] | None = None) -> CostModel:
    """Sweep, time compute and fit on the world (or `group` alone, without compute);
    every rank gets the same model."""
    return _measure(group, sizes, repeats, name, group_sizes)[0]


def _measure(group, sizes: Sequence[int], repeats: int, name: str,
             group_sizes: Sequence[int] | None = None) -> tuple[CostModel, tuple[Sample, ...]]:
    samples = sweep(group, sizes, OPS, repeats, group_sizes=group_sizes)
    compute = measure_compute(_device(group), name=f"{name} compute") if group is None else None
    backend = dist.get_backend(group)
    desc = (f"{backend} on {dist.get_world_size(group)} ranks, host {platform.node()}, "
            f"{torch.get_num_threads()} thread(s) per rank")
    return fit_model(samples, name, desc, compute, reduce_scatter_algorithm(group)), samples


# --------------------------------------------------------------------------- local ranks


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_threads(world_size: int) -> int:
    """torch threads per local rank: the host's cores shared evenly, as local training
    jobs do (`evenzero.repro.localrun`), so compute is measured as it will run."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _local_worker(rank: int, world_size: int, port: int, sizes: Sequence[int], repeats: int,
                  out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(local_threads(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
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
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    try:
        result = _measure(None, sizes, repeats, f"{backend}-{dist.get_world_size()}")
        return result if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


__all__ = ["ALL_TO_ALL_SUM", "DEFAULT_SIZES", "CalibrationError", "check_sweep", "default_group_sizes",
           "fit_model", "local_threads", "measure", "measure_compute", "reduce_scatter_algorithm",
           "run_from_env", "run_local", "sweep"]

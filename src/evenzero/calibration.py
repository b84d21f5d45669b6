"""Measure a cost model, compute and step costs included, on the current process group.

This is the half of calibration that runs collectives and kernels; fitting the timings
is the planner's (`evenzero.cost.fit`), which never imports torch.distributed. It sits
above the planner and below the runtime: `evenzero calibrate` and the runtime's
refinement of the bucket size (`evenzero.runtime.autotune`) both measure through it.

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
  shared exactly as in training): matmul throughput, copy bandwidth, how much a
  collective in flight slows compute, and the step's own work (`measure_step_costs`):
  an AdamW step in each of torch's implementations (single-tensor, foreach, fused), the
  global gradient norm in fp32 chunks and of an fp64 copy, and the Python time per
  parameter of a step over many small parameters.

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

from evenzero.cost.compute import LARGE_TENSOR_NUMEL, SMALL_TENSOR_NUMEL, DeviceCompute
from evenzero.cost.fit import Sample, fit_model
from evenzero.cost.model import OPS, CostModel
from evenzero.plan import OPTIMIZER_IMPLS

DEFAULT_SIZES = (2**10, 2**14, 2**16, 2**18, 2**20, 2**22)
"""Full-buffer sizes in elements: from latency-bound to bandwidth-bound on gloo."""
ALL_TO_ALL_SUM = "all_to_all+sum"
"""The reduce-scatter evenzero's runtime runs on gloo (`runtime.collectives`)."""
MATMUL_SHAPE = {"cpu": ((64, 1024, 1024), torch.float32), "cuda": ((8192, 4096, 4096), torch.bfloat16)}
"""(tokens, in, out) and dtype of the timed matmul per device: on CPU a layer at the tens
of tokens per rank CPU runs train with; on GPUs a large bf16 layer, as they train."""
COPY_NUMEL = 2**23
"""Elements copied to time memory bandwidth (32 MiB of fp32, beyond the caches)."""
OPTIMIZER_NUMEL = LARGE_TENSOR_NUMEL
"""Elements an AdamW step is timed on: one tensor, and as many small ones."""
NORM_CHUNK = 2**20
"""Elements per chunk of the fp32 norm (`torch._foreach_norm` over the chunks)."""
SMALL_PARAMS = 256
"""One-element parameters a step is timed over for the per-parameter overhead."""

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


def _timed_all_reduce(message: torch.Tensor, device: torch.device) -> float:
    """Seconds of one all-reduce of `message` with nothing else running."""
    dist.barrier()
    _sync(device)
    t0 = perf_counter()
    dist.all_reduce(message)
    _sync(device)
    return perf_counter() - t0


def measure_compute(device: torch.device | None = None, name: str = "measured") -> DeviceCompute:
    """One rank's compute and step costs while every rank of the world computes the same
    (collective: every rank calls it)."""
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
    small_a, small_b = a[:, :256].contiguous(), b[:256, :256].contiguous()
    dist.barrier()
    matmul = _rate(lambda: torch.mm(a, b), device)
    copy = _rate(lambda: dst.copy_(src), device)
    # Small matmuls beside a collective in flight, against the same alone: what overlap
    # really gets on this host (gloo's threads and copies share cores and memory).
    alone = _rate(lambda: torch.mm(small_a, small_b), device)
    message = torch.ones(2**22, device=device)
    # And the other way: the same all-reduce alone, against its time beside the matmuls.
    comm_alone = min(_timed_all_reduce(message, device) for _ in range(2))
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
    steps = measure_step_costs(device)
    names = sorted(steps)
    link, host_step = measure_host_link(device, src) if device.type == "cuda" else (0.0, 0.0)
    rates = _slowest_rank([-matmul, -copy, -alone, -during, comm_alone, elapsed]
                          + [-1 / steps[n] for n in names] + [-link, host_step], device)
    link, host_step = -rates[-2], rates[-1]  # slowest link, longest host step
    rates = rates[:-2]
    matmul, copy, alone, during = (-r for r in rates[:4])  # the slowest rank: lowest rate
    comm_alone, comm_beside = rates[4:6]  # and the longest call
    seconds = {n: -1 / r for n, r in zip(names, rates[6:], strict=True)}
    memory_gbs = copy * 2 * COPY_NUMEL * 4 / 1e9

    def per_element(key: str, elements: int) -> float:
        return seconds[key] * memory_gbs * 1e9 / elements

    default = "foreach" if device.type == "cuda" else "single_tensor"
    impls = {impl: per_element(impl, OPTIMIZER_NUMEL) for impl in OPTIMIZER_IMPLS
             if impl in seconds}
    # The single-tensor step over small tensors also paid its per-tensor loop, which the
    # timeline charges apart (`tensor_overhead_us`): left out of its bytes per element.
    loop = OPTIMIZER_NUMEL // SMALL_TENSOR_NUMEL * seconds["per_tensor"]
    if "single_tensor_small" in seconds:
        timed = seconds["single_tensor_small"]
        seconds["single_tensor_small"] = max(timed - loop, 0.1 * timed)
    small = {impl: per_element(f"{impl}_small", OPTIMIZER_NUMEL) for impl in OPTIMIZER_IMPLS
             if f"{impl}_small" in seconds}
    return DeviceCompute(
        name, tflops=matmul * 2 * t * k * m / 1e12, memory_gbs=memory_gbs,
        optimizer_bytes_per_element=impls[default], default_optimizer_impl=default,
        single_tensor_bytes_per_element=impls.get("single_tensor"),
        foreach_bytes_per_element=impls.get("foreach"),
        fused_bytes_per_element=impls.get("fused"),
        single_tensor_small_bytes_per_element=small.get("single_tensor"),
        foreach_small_bytes_per_element=small.get("foreach"),
        fused_small_bytes_per_element=small.get("fused"),
        norm_fp32_bytes_per_element=per_element("norm_fp32", OPTIMIZER_NUMEL),
        norm_fp64_bytes_per_element=per_element("norm_fp64", OPTIMIZER_NUMEL),
        tensor_overhead_us=seconds["per_tensor"] * 1e6,
        param_overhead_us=seconds["per_param"] * 1e6,
        host_link_gbs=link * COPY_NUMEL * 4 / 1e9 if link > 0 else None,
        host_step_ns_per_element=host_step * 1e9 / OPTIMIZER_NUMEL if host_step > 0 else None,
        comm_slowdown=min(4.0, max(0.0, alone / during - 1)),
        collective_slowdown=min(4.0, max(0.0, comm_beside / comm_alone - 1)),
        sources=f"evenzero calibrate: {t}x{k}x{m} {str(dtype).removeprefix('torch.')} matmul, "
                f"{COPY_NUMEL:,}-element copy, torch AdamW step on {OPTIMIZER_NUMEL:,} "
                f"elements per implementation ({', '.join(impls)}), in one tensor and in "
                f"{SMALL_TENSOR_NUMEL:,}-element ones, fp32-chunk and fp64 norms, a "
                f"single-tensor step and a visit over {SMALL_PARAMS} one-element parameters, "
                f"matmuls beside an all-reduce and that all-reduce alone; slowest rank, "
                f"every rank busy, {torch.get_num_threads()} thread(s) per rank")


def measure_host_link(device: torch.device, src: torch.Tensor) -> tuple[float, float]:
    """`offload_optimizer`'s figures on a CUDA device, every rank at once: copies per
    second of `src` (fp32 on the device) to pinned host memory and back (the slower
    way), and seconds of a fused CPU AdamW step over `OPTIMIZER_NUMEL` elements."""
    pinned = torch.empty(src.numel(), dtype=src.dtype, pin_memory=True)
    down = _rate(lambda: pinned.copy_(src, non_blocking=True), device)
    up = _rate(lambda: src.copy_(pinned, non_blocking=True), device)
    gen = torch.Generator().manual_seed(0)
    master = torch.nn.Parameter(torch.randn(OPTIMIZER_NUMEL, generator=gen))
    master.grad = torch.randn(OPTIMIZER_NUMEL, generator=gen)
    adamw = torch.optim.AdamW([master], lr=1e-3, fused=True)
    step = 1 / _rate(adamw.step, torch.device("cpu"))
    return min(down, up), step


def measure_step_costs(device: torch.device) -> dict[str, float]:
    """Seconds of the work a step does besides its collectives, on this rank alone:
    an AdamW step over `OPTIMIZER_NUMEL` elements per torch implementation (one that
    the device lacks is left out), in one tensor and ("<impl>_small") in tensors of
    `SMALL_TENSOR_NUMEL` elements, the global norm of that many gradient elements in
    fp32 chunks combined in fp64 and of an fp64 copy; "per_tensor": seconds per tensor
    of a single-tensor AdamW step over `SMALL_PARAMS` one-element parameters (its
    per-tensor Python loop); "per_param": seconds per parameter of a Python visit that
    reads its gradient and data pointers (a step's own per-parameter checks)."""
    out: dict[str, float] = {}
    # A private generator: the user's random streams stay as they were (issue 21).
    gen = torch.Generator().manual_seed(0)

    def draw(numel: int) -> torch.Tensor:
        return torch.randn(numel, generator=gen).to(device)

    for impl in OPTIMIZER_IMPLS:
        flags = {"foreach": impl == "foreach", "fused": impl == "fused"}
        for key, numel in ((impl, OPTIMIZER_NUMEL), (f"{impl}_small", SMALL_TENSOR_NUMEL)):
            params = [torch.nn.Parameter(draw(numel))
                      for _ in range(OPTIMIZER_NUMEL // numel)]
            for q in params:
                q.grad = draw(q.numel())
            try:
                adamw = torch.optim.AdamW(params, lr=1e-3, **flags)
                adamw.step()
            except (RuntimeError, ValueError):  # e.g. no fused kernel for this device
                break
            out[key] = 1 / _rate(adamw.step, device)
            del adamw, params
    grad = draw(OPTIMIZER_NUMEL)
    chunks = list(grad.split(NORM_CHUNK))
    out["norm_fp32"] = 1 / _rate(lambda: torch.linalg.vector_norm(
        torch.stack(torch._foreach_norm(chunks)).double()), device)
    out["norm_fp64"] = 1 / _rate(lambda: torch.linalg.vector_norm(grad.double()), device)
    small = [torch.nn.Parameter(draw(1)) for _ in range(SMALL_PARAMS)]
    for q in small:
        q.grad = draw(q.numel())
    loop = torch.optim.AdamW(small, lr=1e-3, foreach=False)
    out["per_tensor"] = 1 / _rate(loop.step, device) / SMALL_PARAMS
    seen: dict[int, int] = {}

    def visit() -> None:  # what a step's own per-parameter check reads
        for q in small:
            g = q.grad
            if g is not None and g.data_ptr() != seen.get(id(q)):
                seen[id(q)] = q.data_ptr()

    out["per_param"] = 1 / _rate(visit, device) / SMALL_PARAMS
    return out


# --------------------------------------------------------------------------- a model


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
           "local_threads", "measure", "measure_compute", "measure_step_costs",
           "reduce_scatter_algorithm",
           "run_from_env", "run_local", "sweep"]

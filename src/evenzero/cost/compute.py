"""Compute time of one training step on one rank, for the timeline.

The timeline (`evenzero.cost.timeline`) needs a `ComputeProfile`: the backward compute
that ends with each parameter's gradient, in arrival order, and the forward compute.
It comes from one of two places:

* FLOPs and bytes (`estimate_profile`), for presets and JSON specs at plan time. Each
  parameter's layer is costed as the slower of its arithmetic at the device's matmul
  throughput and its memory traffic at the device's bandwidth (a roofline), for the
  tokens it processes (`ModelSpec.tokens` x `ParamSpec.token_share`):

  | layer | backward FLOPs | elements moved |
  |---|---|---|
  | linear `[out, in]` | 4 t numel (dX = dY W and dW = dY^T X, 2 t numel each) | 2 numel + t (2 in + out) |
  | embedding `[rows, dim]` | t dim (scatter-add of t rows) | numel + 2 t dim (zeroed table, rows read and added) |
  | elementwise (norm, bias) | 8 t numel | 2 numel + 3 t numel |

  plus `ParamSpec.extra_backward_flops_per_token` (attention's products). Forward is
  charged half of backward per layer (one product instead of two; the usual 1:2 rule).
* Times the runtime measured (`profile_from_times`, `profile_from_arrivals`): seconds
  per parameter, or the timestamps of the gradient hooks in a backward that reduced
  nothing (evenzero's first backward only records the arrival order).

`DeviceCompute` holds the throughput figures and what a step's own work costs (the
optimizer per implementation, the gradient norm, per-parameter Python work); a
`CostModel` carries one (presets from datasheets and published measurements,
`evenzero calibrate` from measurements on this host).

Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from evenzero.plan import NORMS, OPTIMIZER_IMPLS
from evenzero.spec import ModelSpec, ParamSpec

SMALL_TENSOR_NUMEL = 2**16
"""Elements of the tensors the small-tensor optimizer figures hold for (256 KiB of fp32:
the passes of a multi-pass step stay in a CPU's caches)."""
LARGE_TENSOR_NUMEL = 2**22
"""Elements from which a tensor's passes go to memory (16 MiB of fp32); the plain
optimizer figures hold for tensors this large."""
DEFAULT_TOKENS = 4096
"""Tokens per micro-batch assumed for a spec that gives none (one 4K-token sequence)."""
FORWARD_SHARE = 0.5
"""Forward compute as a fraction of backward: one matmul per layer instead of two."""


@dataclass(frozen=True)
class DeviceCompute:
    """What one rank computes per second, and what a step's own work costs on it.

    Memory-bound work (copies, the optimizer, the gradient norm) is priced as bytes moved
    per element at `memory_gbs`; each kind has its own bytes per element because real
    implementations make several passes and allocate temporaries (torch's single-tensor
    AdamW on CPU moves ~4x what a fused kernel does). `evenzero calibrate` measures them
    all (`evenzero.calibration.measure_compute`)."""

    name: str
    """Label shown in reports."""
    tflops: float
    """Sustained matmul throughput of one rank, TFLOP/s (1e12 FLOP/s)."""
    memory_gbs: float
    """Sustained memory bandwidth of one rank, GB/s (1e9 B/s), as a copy achieves it:
    memory-bound layers, copies of gradients into buckets and between parameters and
    masters; every other bytes-per-element figure is relative to it."""
    optimizer_bytes_per_element: float = 28.0
    """Bytes the optimizer step moves per element it updates, as torch runs it when no
    implementation is chosen (`default_optimizer_impl`), on tensors of at least
    `LARGE_TENSOR_NUMEL` elements. A fused AdamW reads the fp32 master, gradient and
    both moments and writes master and moments: 7 x 4 bytes."""
    default_optimizer_impl: str = "foreach"
    """The implementation torch.optim picks when none is chosen: foreach for CUDA
    tensors, single_tensor otherwise, never fused (torch/optim/optimizer.py
    `_default_to_fused_or_foreach`, torch 2.13)."""
    single_tensor_bytes_per_element: float | None = None
    """The single-tensor implementation's bytes per element; None: as the default's."""
    foreach_bytes_per_element: float | None = None
    """The foreach implementation's bytes per element; None: as the default's."""
    fused_bytes_per_element: float | None = None
    """The fused implementation's bytes per element; None: as the default's."""
    single_tensor_small_bytes_per_element: float | None = None
    """The single-tensor implementation on tensors of `SMALL_TENSOR_NUMEL` elements,
    whose passes stay in the caches; None: as on large tensors."""
    foreach_small_bytes_per_element: float | None = None
    """The foreach implementation on tensors of `SMALL_TENSOR_NUMEL` elements."""
    fused_small_bytes_per_element: float | None = None
    """The fused implementation on tensors of `SMALL_TENSOR_NUMEL` elements."""
    norm_fp32_bytes_per_element: float = 4.0
    """A global gradient norm from fp32 norms of chunks (`torch._foreach_norm`),
    combined in fp64: one read of the fp32 gradient."""
    norm_fp64_bytes_per_element: float = 20.0
    """A global gradient norm of an fp64 copy (`vector_norm(g.double())`): read 4 bytes,
    write 8, read 8 again."""
    tensor_overhead_us: float = 0.0
    """Host time per tensor of a single-tensor optimizer step: its Python loop issues
    each tensor's ops one by one (foreach and fused group the tensors into a few calls,
    so their per-tensor cost is left out)."""
    param_overhead_us: float = 0.0
    """Host time per parameter of a step's own Python work: a visit that reads a few
    attributes of the parameter and its gradient (presence, the user's writes)."""
    comm_slowdown: float = 0.0
    """While a collective is in progress compute runs 1 / (1 + this) as fast. 0 where
    communication has its own engines; on CPU, gloo's threads share the cores."""
    collective_slowdown: float = 0.0
    """The other direction: while compute runs, a collective in progress runs 1 / (1 +
    this) as fast. On a host whose cores the ranks already fill (gloo), the collective's
    copies and reductions wait for cores the compute holds, so the two share the time
    instead of overlapping; 0 where communication has engines of its own (NCCL's kernels
    on their own SMs, nearly)."""
    host_link_gbs: float | None = None
    """`offload_optimizer`: GB/s of pinned copies between this device and its host, each
    way (PCIe, NVLink-C2C); None: the device is the host, and a link copy is a memory copy."""
    host_step_ns_per_element: float | None = None
    """`offload_optimizer`: ns per element of the optimizer step on this device's host
    (fused CPU AdamW, with every rank of the host stepping at once); None: the device is
    the host, and its own optimizer figures price the step."""
    sources: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        for f in ("tflops", "memory_gbs", "optimizer_bytes_per_element",
                  "norm_fp32_bytes_per_element", "norm_fp64_bytes_per_element"):
            _check(f, getattr(self, f), positive=True)
        for impl in OPTIMIZER_IMPLS:
            for name in (f"{impl}_bytes_per_element", f"{impl}_small_bytes_per_element"):
                if getattr(self, name) is not None:
                    _check(name, getattr(self, name), positive=True)
        _check("tensor_overhead_us", self.tensor_overhead_us, positive=False)
        _check("param_overhead_us", self.param_overhead_us, positive=False)
        _check("comm_slowdown", self.comm_slowdown, positive=False)
        _check("collective_slowdown", self.collective_slowdown, positive=False)
        for f in ("host_link_gbs", "host_step_ns_per_element"):
            if getattr(self, f) is not None:
                _check(f, getattr(self, f), positive=True)
        if self.default_optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"default_optimizer_impl must be one of {OPTIMIZER_IMPLS}, got "
                             f"{self.default_optimizer_impl!r}")

    def seconds(self, flops: float, nbytes: float) -> float:
        """Roofline: the slower of the arithmetic and the memory traffic."""
        return max(flops / (self.tflops * 1e12), nbytes / (self.memory_gbs * 1e9))

    def copy_seconds(self, nbytes: float) -> float:
        """One copy of `nbytes` (read once, written once)."""
        return 2 * nbytes / (self.memory_gbs * 1e9)

    def moved_seconds(self, nbytes: float) -> float:
        """Memory traffic of `nbytes` read and written in all."""
        return nbytes / (self.memory_gbs * 1e9)

    def optimizer_bytes(self, impl: str | None = None) -> float:
        """Bytes per element of `impl` ("single_tensor", "foreach", "fused"); None: the
        implementation torch picks by default here."""
        if impl is None or impl == self.default_optimizer_impl:
            return self.optimizer_bytes_per_element
        if impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer implementation {impl!r} is not one of {OPTIMIZER_IMPLS}")
        figure = getattr(self, f"{impl}_bytes_per_element")
        return self.optimizer_bytes_per_element if figure is None else figure

    def optimizer_bytes_at(self, impl: str | None, numel: int) -> float:
        """Bytes per element of `impl` on a tensor of `numel` elements: the small-tensor
        figure up to `SMALL_TENSOR_NUMEL`, the large one from `LARGE_TENSOR_NUMEL`, and
        in between along a straight line in log(numel)."""
        large = self.optimizer_bytes(impl)
        small = getattr(self, f"{impl or self.default_optimizer_impl}_small_bytes_per_element")
        if small is None or numel >= LARGE_TENSOR_NUMEL:
            return large
        if numel <= SMALL_TENSOR_NUMEL:
            return small
        share = math.log(numel / SMALL_TENSOR_NUMEL) / math.log(LARGE_TENSOR_NUMEL / SMALL_TENSOR_NUMEL)
        return small + (large - small) * share

    def optimizer_seconds(self, elements: int, impl: str | None = None,
                          tensor_numels: Sequence[int] = ()) -> float:
        """One optimizer step with `impl` over `elements` master elements, held in tensors
        of `tensor_numels` elements (default: one large tensor)."""
        if not tensor_numels:
            return self.moved_seconds(elements * self.optimizer_bytes(impl))
        return self.moved_seconds(sum(n * self.optimizer_bytes_at(impl, n) for n in tensor_numels))

    def host_link_seconds(self, nbytes: float) -> float:
        """`nbytes` copied across the host link (one way)."""
        if self.host_link_gbs is None:
            return self.copy_seconds(nbytes)
        return nbytes / (self.host_link_gbs * 1e9)

    def host_step_seconds(self, elements: int, impl: str | None = None,
                          tensor_numels: Sequence[int] = ()) -> float:
        """The optimizer step on the host over `elements` elements (`offload_optimizer`)."""
        if self.host_step_ns_per_element is None:
            return self.optimizer_seconds(elements, impl, tensor_numels)
        return elements * self.host_step_ns_per_element * 1e-9

    def norm_seconds(self, elements: int, norm: str | None) -> float:
        """The global gradient norm over `elements` ("fp32" or "fp64"; None: none)."""
        if norm is None or elements == 0:
            return 0.0
        if norm not in NORMS:
            raise ValueError(f"norm {norm!r} is not one of {NORMS}")
        return self.moved_seconds(elements * getattr(self, f"norm_{norm}_bytes_per_element"))

    def bookkeeping_seconds(self, params: int, tensors: int = 0, impl: str | None = None) -> float:
        """Host time of one step's per-parameter work: a visit of each of `params`
        parameters, and the per-tensor loop over `tensors` when the optimizer runs its
        single-tensor implementation (`impl`; None: the default here)."""
        loop = (impl or self.default_optimizer_impl) == "single_tensor"
        return (params * self.param_overhead_us
                + (tensors * self.tensor_overhead_us if loop else 0.0)) * 1e-6

    def with_optimizer_bytes(self, impl: str | None, value: float) -> DeviceCompute:
        """A copy with `impl`'s bytes per element set (None: the default implementation)."""
        if impl is None or impl == self.default_optimizer_impl:
            return replace(self, optimizer_bytes_per_element=value)
        if impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer implementation {impl!r} is not one of {OPTIMIZER_IMPLS}")
        return replace(self, **{f"{impl}_bytes_per_element": value})

    def with_param(self, key: str, raw: Any) -> DeviceCompute:
        """A copy with one field set from text (`--cost-param compute.tflops=50`)."""
        names = [f.name for f in fields(self) if f.name not in ("name", "sources")]
        if key not in names:
            raise ValueError(f"compute field {key!r} is not one of {', '.join(names)}")
        if key == "default_optimizer_impl":
            return replace(self, default_optimizer_impl=str(raw))
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{raw!r} is not a number") from None
        return replace(self, **{key: value})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceCompute:
        """Format 1 files (before the step costs) lack the per-implementation and norm
        figures: they take the defaults, and their one optimizer figure, measured with
        torch's default AdamW, prices every implementation."""
        if not isinstance(data, Mapping):
            raise ValueError("expected an object")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(str(e)) from None


def _check(name: str, v: Any, positive: bool) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if positive else v >= 0):
        raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} "
                         f"number, got {v!r}")


@dataclass(frozen=True)
class ComputeProfile:
    """One rank's compute in one training step, as the timeline plays it."""

    backward: tuple[tuple[str, float], ...]
    """(parameter, seconds of backward compute that ends when its gradient is ready),
    in gradient-arrival order. Parameters that produce no gradient are absent."""
    forward_s: float
    """Forward compute, seconds."""
    tail_s: float = 0.0
    """Backward compute after the last gradient (e.g. the input's gradient)."""
    source: str = ""
    """One line on where the times come from, for reports."""

    def __post_init__(self) -> None:
        if any(not t >= 0 for _, t in self.backward) or not self.forward_s >= 0 \
                or not self.tail_s >= 0:
            raise ValueError("compute times must be non-negative seconds")

    @property
    def backward_s(self) -> float:
        return sum(t for _, t in self.backward) + self.tail_s


# --------------------------------------------------------------------------- FLOPs


def layer_kind(p: ParamSpec) -> str:
    """`p.layer`, or inferred from the shape: 2-D or more is a matmul weight."""
    if p.layer:
        return p.layer
    return "linear" if len(p.shape) >= 2 else "elementwise"


def backward_work(p: ParamSpec, tokens: float) -> tuple[float, float]:
    """(FLOPs, bytes) of the backward of `p`'s layer over `tokens` tokens (module doc)."""
    n = p.numel
    t = tokens * p.token_share
    kind = layer_kind(p)
    if n == 0:
        flops, moved = 0.0, 0.0
    elif kind == "linear":
        rows = p.shape[0]
        cols = n // rows
        flops, moved = 4.0 * t * n, 2.0 * n + t * (2 * cols + rows)
    elif kind == "embedding":
        dim = n // p.shape[0] if p.shape and p.shape[0] else n
        flops, moved = t * dim, n + 2.0 * t * dim
    else:
        flops, moved = 8.0 * t * n, 2.0 * n + 3.0 * t * n
    return flops + tokens * p.extra_backward_flops_per_token, moved * p.itemsize


def estimate_profile(spec: ModelSpec, device: DeviceCompute,
                     tokens: int | None = None) -> ComputeProfile:
    """Compute times from FLOPs and bytes: `tokens`, else the spec's, else DEFAULT_TOKENS."""
    t = tokens or spec.tokens
    assumed = t is None
    t = t or DEFAULT_TOKENS
    backward = []
    forward = 0.0
    for name in spec.arrival_order:
        seconds = device.seconds(*backward_work(spec.param(name), t))
        backward.append((name, seconds))
        forward += FORWARD_SHARE * seconds
    # Layers whose parameters produce no gradient still run forward.
    arrived = set(spec.arrival_order)
    forward += sum(FORWARD_SHARE * device.seconds(*backward_work(p, t))
                   for p in spec.params if p.name not in arrived)
    where = (f"{t:,} tokens per micro-batch (assumed: the model gives none; set tokens)"
             if assumed else f"{t:,} tokens per micro-batch")
    return ComputeProfile(tuple(backward), forward, 0.0,
                          f"FLOPs estimate, {where}, on {device.name}")


# --------------------------------------------------------------------------- measured


def profile_from_times(spec: ModelSpec, seconds: Mapping[str, float],
                       forward_s: float | None = None, tail_s: float = 0.0,
                       source: str = "measured") -> ComputeProfile:
    """A profile from `{param_name: seconds of backward compute ending with its gradient}`.

    The order is the spec's arrival order; a name the mapping lacks gets 0 s, a name the
    spec lacks is an error (the model changed?). `forward_s` defaults to
    `FORWARD_SHARE` x backward."""
    unknown = sorted(set(seconds) - {p.name for p in spec.params})
    if unknown:
        raise ValueError(f"compute times name parameters the model does not have: {unknown[:3]}")
    backward = tuple((n, float(seconds.get(n, 0.0))) for n in spec.arrival_order)
    total = sum(t for _, t in backward) + tail_s
    return ComputeProfile(backward, FORWARD_SHARE * total if forward_s is None else forward_s,
                          tail_s, source)


def profile_from_arrivals(events: Sequence[tuple[str, float]], backward_start: float,
                          backward_end: float | None = None, forward_s: float | None = None,
                          source: str = "measured gradient arrivals") -> ComputeProfile:
    """A profile from gradient-hook timestamps of one backward that reduced nothing.

    `events` are (parameter, time) in the order the hooks fired, e.g. from
    `register_post_accumulate_grad_hook` with `time.perf_counter()`; `backward_start` is
    when backward began (the loss's `backward()` call), `backward_end` when it returned.
    Each parameter is charged the time since the previous hook. A parameter seen twice
    keeps its first arrival (its later accumulations are part of the next interval)."""
    backward = []
    seen: set[str] = set()
    last = backward_start
    for name, t in events:
        if t < last:
            raise ValueError(f"arrival of {name!r} at {t} is before the previous event at "
                             f"{last}; pass events in the order the hooks fired")
        if name in seen:
            continue
        seen.add(name)
        backward.append((name, t - last))
        last = t
    tail = max(0.0, backward_end - last) if backward_end is not None else 0.0
    total = sum(t for _, t in backward) + tail
    return ComputeProfile(tuple(backward), FORWARD_SHARE * total if forward_s is None else forward_s,
                          tail, source)


def median_profile(profiles: Iterable[ComputeProfile]) -> ComputeProfile:
    """Per-parameter median of several profiles of the same arrival order (several
    backwards), so one noisy backward does not decide."""
    from statistics import median

    ps = list(profiles)
    if not ps:
        raise ValueError("median_profile needs at least one profile")
    order = [n for n, _ in ps[0].backward]
    if any([n for n, _ in p.backward] != order for p in ps[1:]):
        raise ValueError("profiles differ in arrival order; take the median of like backwards")
    backward = tuple((n, median(p.backward[i][1] for p in ps)) for i, n in enumerate(order))
    return ComputeProfile(backward, median(p.forward_s for p in ps),
                          median(p.tail_s for p in ps), f"{ps[0].source}, median of {len(ps)}")


__all__ = ["DEFAULT_TOKENS", "FORWARD_SHARE", "LARGE_TENSOR_NUMEL", "SMALL_TENSOR_NUMEL",
           "ComputeProfile", "DeviceCompute", "backward_work", "estimate_profile", "layer_kind", "median_profile", "profile_from_arrivals",
           "profile_from_times"]

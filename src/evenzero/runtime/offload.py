"""`offload_optimizer="cpu"`: the host side of a group shard, and the link to it.

With offload, a group's fp32 masters, gradient shard and optimizer state live in host
memory (`shards.Placement.offloaded`), as in DeepSpeed's ZeRO-Offload
(deepspeed/runtime/zero/stage_1_and_2.py@v0.19.8, `cpu_offload`): the device keeps the
parameters and the bucket pool only. Two kinds of traffic cross the host link, both
through one `HostLink` per group shard:

* gradients, device to host: as each bucket's reduction completes, its reduced elements
  are copied into host staging (`land`) and added into the host gradient shard once the
  copy is done. On CUDA the copy runs on a side stream into pinned staging and the add
  happens at a later `land` or at the end of the backward (`drain`), so the host adds
  overlap the rest of the backward; the compute stream waits for the copy only before
  the reduction's buffers are reused.
* parameters, host to device: each layout's updated masters are rounded on the host
  into pinned staging of the parameter dtype and copied to the device (`publish`), just
  before that layout's all-gather is launched, so the copies and gathers of stepped
  layouts overlap the host step of the next ones.

With parameters on the CPU the same code runs with host-to-host copies: for CPU training
offload moves nothing anywhere (it only costs the copies), and it is how the data flow is
tested without an accelerator.

`check_offload` holds the construction-time refusals: an inner optimizer whose state
cannot live on the host, and more host memory (pinned or not) than the host has.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from evenzero.runtime.checks import ZeroConfigError

HOST = torch.device("cpu")

STATE_SLOTS: Mapping[type, int] = {
    torch.optim.SGD: 1, torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.Adamax: 2,
    torch.optim.NAdam: 2, torch.optim.RAdam: 2, torch.optim.Adagrad: 1,
    torch.optim.Adadelta: 2, torch.optim.RMSprop: 3, torch.optim.Rprop: 2, torch.optim.ASGD: 2,
}
"""Shard-sized state tensors of each host-steppable optimizer (the most it keeps: RMSprop
with momentum and centered), for the host memory check."""


HOST_STATE_ATTRIBUTE = "keeps_state_with_params"
"""A class attribute that, True, declares an optimizer's state is made like the tensors
it steps (`zeros_like(p)`), so it may live on the host (DeepSpeedCPUAdam's stand-in sets it)."""


def host_steppable(optimizer_class: type) -> bool:
    """Whether `optimizer_class` keeps its state with the tensors it is given, wherever they
    live: torch.optim's elementwise optimizers (and subclasses) step CPU tensors with
    their CPU kernels, and a class may declare it (`HOST_STATE_ATTRIBUTE`). Another class
    may be CUDA-only (apex's FusedAdam, bitsandbytes' 8-bit states), which would fail on
    the host or silently move state back."""
    return (any(issubclass(optimizer_class, c) for c in STATE_SLOTS)
            or getattr(optimizer_class, HOST_STATE_ATTRIBUTE, False) is True)


def state_slots(optimizer_class: type) -> int:
    for base, slots in STATE_SLOTS.items():
        if issubclass(optimizer_class, base):
            return slots
    return 2


def host_bytes_available() -> int:
    """Memory this host can still give (Linux `MemAvailable`; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


@dataclass(frozen=True)
class HostNeed:
    """Host bytes one rank's offloaded shards take (estimated before allocating)."""

    pinned: int
    """Masters and the link's staging (pinned when the parameters are on CUDA)."""
    pageable: int
    """The gradient shard and the optimizer state."""

    @property
    def total(self) -> int:
        return self.pinned + self.pageable


def host_need(shard_numels: Iterable[tuple[int, int]], master_bytes: int,
              optimizer_class: type) -> HostNeed:
    """`shard_numels`: (elements of a group's shard on this rank, parameter dtype bytes)."""
    slots = state_slots(optimizer_class)
    pinned = pageable = 0
    for numel, param_bytes in shard_numels:
        # masters + publish staging (param dtype) + gradient landing staging (at most a shard)
        pinned += numel * (master_bytes + param_bytes + master_bytes)
        pageable += numel * master_bytes * (1 + slots)
    return HostNeed(pinned, pageable)


def check_offload(offload: str | None, pin: bool, optimizer_class: type, need: HostNeed,
                  available: int) -> None:
    """Refuse what offload cannot run, before anything is allocated (raised inside the
    construction's agreed checks, so every rank raises it)."""
    if offload is None:
        return
    if not host_steppable(optimizer_class):
        raise ZeroConfigError(
            f"offload_optimizer={offload!r} steps the optimizer on the host, and "
            f"{optimizer_class.__name__} is not known to keep its state in host memory "
            f"(it may be CUDA-only); use a torch.optim optimizer such as torch.optim.AdamW "
            f"(its fused CPU step runs there), set {HOST_STATE_ATTRIBUTE} = True on the class "
            f"if its state is made like its parameters, or drop offload_optimizer")
    gib = 1 << 30
    if need.total > available:
        what = (f"pins about {need.pinned / gib:.2f} GiB (pin_memory=True) and takes about "
                f"{need.pageable / gib:.2f} GiB more" if pin else
                f"takes about {need.total / gib:.2f} GiB")
        raise ZeroConfigError(
            f"offload_optimizer={offload!r} {what} of host memory on this rank (masters, "
            f"gradient shard, optimizer state and the copies' staging), and this host has "
            f"{available / gib:.2f} GiB available; use more ranks (each holds 1/N), fewer "
            f"ranks per host, pin_memory=False, or drop offload_optimizer")


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pin)


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return host_empty(numel, dtype, pin).zero_()


Apply = Callable[[list[torch.Tensor]], None]
"""Receives the host copies of the tensors handed to `HostLink.land`, in order."""


class HostLink:
    """The copies between one group shard's host tensors and the device (module docstring).

    `device` is where the parameters live; on the CPU every copy is synchronous."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device = device
        self.pin = pin and device.type == "cuda"
        self._pending: list[tuple[list[torch.Tensor], list[torch.Tensor], Apply, object]] = []
        """(staging buffers, the copies in them, what applies them, the copy's event)."""
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._staged: dict[int, tuple[torch.Tensor, object]] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bytes_to_host = 0
        """Bytes copied device to host since construction (gradients, parameter reads)."""
        self.bytes_to_device = 0
        """Bytes copied host to device since construction (published parameters)."""

    # ------------------------------------------------------------------ gradients

    def land(self, sources: Sequence[torch.Tensor], apply: Apply) -> None:
        """Copy `sources` (device tensors the caller may reuse once this returns on the
        CPU, once the compute stream passes the copy on CUDA) into host staging, then
        `apply` the copies (now on the CPU; later on CUDA, in the order landed)."""
        bases = [self._stage(s) for s in sources]
        staged = [b[:s.numel()] for b, s in zip(bases, sources, strict=True)]
        self.bytes_to_host += sum(s.numel() * s.element_size() for s in sources)
        if self._stream is None:
            for dst, src in zip(staged, sources, strict=True):
                dst.copy_(src)
            self._pending.append((bases, staged, apply, None))
        else:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)
            with torch.cuda.stream(self._stream):
                for dst, src in zip(staged, sources, strict=True):
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            # The sources are reduction buffers the next bucket reuses.
            compute.wait_event(done)
            self._pending.append((bases, staged, apply, done))
        self._apply_ready()

    def drain(self) -> None:
        """Apply every landed copy (the end of a backward: the host gradient shard is
        complete when this returns)."""
        for _, _, _, done in self._pending:
            if done is not None:
                done.synchronize()
        self._apply_ready()

    def discard(self) -> None:
        """Forget landed copies not yet applied (gradients zeroed before they were)."""
        for bases, _, _, done in self._pending:
            if done is not None:
                done.synchronize()
            self._release(bases)
        self._pending = []

    def pending(self) -> int:
        return len(self._pending)

    def _apply_ready(self) -> None:
        while self._pending:
            bases, staged, apply, done = self._pending[0]
            if done is not None and not done.query():
                return
            self._pending.pop(0)
            apply(staged)
            self._release(bases)

    def _stage(self, source: torch.Tensor) -> torch.Tensor:
        """A free staging buffer of at least `source`'s size (the smallest that fits)."""
        n = source.numel()
        free = self._free.setdefault(source.dtype, [])
        for i, buf in enumerate(free):
            if buf.numel() >= n:
                return free.pop(i)
        return host_empty(n, source.dtype, self.pin)

    def _release(self, bases: Iterable[torch.Tensor]) -> None:
        for t in bases:
            self._free.setdefault(t.dtype, []).append(t)
        for free in self._free.values():
            free.sort(key=torch.Tensor.numel)

    # ------------------------------------------------------------------ parameters

    def publish(self, key: int, owned: torch.Tensor, master: torch.Tensor) -> None:
        """`owned` (this rank's slice of a flat parameter buffer, on the device) := the
        host `master`, rounded to the parameter dtype on the host first (half the bytes
        on the link for bf16 parameters, and the same rounding as a direct copy)."""
        held = self._staged.get(key)
        if held is None or held[0].numel() != owned.numel() or held[0].dtype != owned.dtype:
            held = (host_empty(owned.numel(), owned.dtype, self.pin), None)
        stage, done = held
        if done is not None:
            done.synchronize()  # its previous copy must have left before it is rewritten
        stage.copy_(master)
        owned.copy_(stage, non_blocking=self.pin)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._staged[key] = (stage, event)
        self.bytes_to_device += stage.numel() * stage.element_size()

    def fetch(self, owned: torch.Tensor) -> torch.Tensor:
        """A host copy of device tensor `owned` (to compare with the masters)."""
        self.bytes_to_host += owned.numel() * owned.element_size()
        return owned.to(HOST, copy=True)

    def staging_nbytes(self) -> int:
        """Host bytes the link holds for its copies."""
        free = sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
        landed = sum(t.numel() * t.element_size() for bases, _, _, _ in self._pending for t in bases)
        published = sum(s.numel() * s.element_size() for s, _ in self._staged.values())
        return free + landed + published

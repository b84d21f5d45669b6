"""The engine's knobs, and which optimizers may step a flat shard."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from evenzero.runtime.checks import ZeroConfigError
from evenzero.runtime.collectives import NATIVE, REDUCE_SCATTER_ALGORITHMS
from evenzero.runtime.innerstep import IMPLS
from evenzero.runtime.precision import LossScaleConfig, as_dtype
from evenzero.strategies import AUTO
from evenzero.wire import WireError, check_block, check_mode

# Each rank steps only its flat 1/N shard, which equals stepping every parameter only if
# the update of an element depends on that element's own gradient and state alone.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
)


def _not_int(value: Any) -> bool:
    """True unless `value` is a real integer (bool and float are refused)."""
    return isinstance(value, bool) or not isinstance(value, int)


@dataclass(frozen=True)
class ZeroConfig:
    """How `ZeroOptimizer` shards, reduces and steps. Every field can also be passed to
    `ZeroOptimizer(...)` as a keyword argument."""

    stage: int = 2
    """1: each rank keeps full-size gradient buffers (gradients land and accumulate in
    them in place); each bucket is reduced during backward as soon as it is complete, as in
    stage 2, and only optimizer state and master weights are sharded. 2: each bucket's
    gradients are copied out and reduced as it fills, and only this rank's 1/N shard of
    the gradients is kept."""
    bucket_numel: int | str | None = "auto"
    """Bucket size in elements, or "auto" (the default; None means the same). With
    "auto", evenzero's plan uses the size with the shortest predicted step within a
    memory budget (in-flight bucket buffers at most a quarter of the model's gradient
    bytes, within [64 MiB, 1 GiB]: `evenzero.cost.autobucket`): at construction from
    FLOPs estimates and a cost preset for the device, then refined once, at the end of
    the second synced backward (the backwards until then reduce at their end, so their
    gradient-arrival times are pure compute), from those times and a quick calibration
    of the process groups (well under a second); every rank adopts rank 0's choice.
    `opt.plan.bucket_numel` is the size in use and `opt.plan.notes[-1]` says why. A
    number fixes the size (nothing is measured for it). Other strategies
    ("deepspeed-0.6", ...) read "auto" as their own default."""
    strategy: str | Callable[..., Any] = "evenzero"
    """Planner whose schedule is executed: "evenzero"; "deepspeed-0.6" (or any sharded
    strategy name) to run that schedule in this engine for comparisons; or a callable
    `(spec, world_size, options) -> Plan` for a custom plan."""
    alignment_bytes: int = 128
    """Every rank's shard of a bucket starts on this many bytes."""
    reduce_dtype: torch.dtype | str | None = None
    """Dtype gradients travel in; None means each group's parameter dtype."""
    master_dtype: torch.dtype | str = torch.float32
    """Dtype of the master weights, gradient shards and optimizer state."""
    loss_scale: str | float | None = None
    """"dynamic", a fixed number, or None: dynamic for fp16 parameters, off otherwise."""
    loss_scale_config: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Growth and backoff of the dynamic loss scale."""
    elementwise: bool | None = None
    """True declares a custom optimizer elementwise (so it may step flat shards)."""
    whole_tensor: tuple[str, ...] = ()
    """Parameters whose inner optimizer updates whole tensors (Muon's matrices): filled in
    by `ZeroOptimizer` from the groups' optimizers (`update_kind`), so that the plan lays
    them out matrix-aligned; what is passed here is replaced."""
    allow_partial_grads: bool = False
    """True: a gradient produced on some ranks only counts as zero on the others (like
    DDP's find_unused_parameters). False: the step raises and names the parameter."""
    reduce_scatter_algorithm: str | None = None
    """Override the per-backend choice: "reduce_scatter_tensor" or "all_to_all+sum"."""
    max_buckets_in_flight: int = 2
    """Buckets reduced concurrently; the oldest is waited for when more are ready."""
    overlap_param_gather: bool = False
    """True: `step()` only launches the parameter all-gathers and returns; each module
    waits for the gathers of its own parameters in its forward pre-hook, so they overlap
    the next forward (seed model, 8 CPU ranks: ~5% off forward+backward+step). A
    parameter must then be read inside the forward of a module that holds it, or after
    `opt.wait_for_params()` (writes too: `p.data.clamp_()` right after the step);
    `state_dict()`, `opt.module` and the optimizer's methods wait
    by themselves. False (default): `step()` returns with every parameter gathered, so
    code that reads parameters directly after the step sees the new values."""

    grad_compression: str | None = None
    """How each bucket's gradients travel (`evenzero.wire`). None (default): exact values
    in the gradients' own dtype (fp32, or the parameters' dtype, or `reduce_dtype`).
    "bf16": bf16 on the wire (half of fp32's bytes), summed in fp32 by the receiving rank.
    "int8": int8 with one fp32 scale per `grad_compression_block` elements (3.94x fewer
    bytes than fp32 at 256), summed in fp32. Either is one all-to-all of equal pieces per
    bucket (`opt.plan` shows it); only a synchronising backward sends, so gradients
    accumulated under `no_sync()` stay exact. A group of one rank sends nothing and
    stays exact (the plan's notes say so)."""
    grad_compression_block: int = 256
    """"int8": elements that share one fp32 scale, a power of two from 32 to 65536."""
    grad_compression_error_feedback: bool = False
    """With `grad_compression`: keep on every rank what compression lost (an fp32 value
    per gradient element, in `memory_report()` and checkpoints) and add it to the next
    synchronising backward's gradients, so the error does not accumulate over steps."""

    # --- perf (issue 17): the inner optimizer's implementation (runtime/innerstep.py)
    optimizer_impl: str | None = None
    """How the inner optimizer steps the master shards: "single_tensor", "foreach" or
    "fused" (torch.optim's implementations), or None: the optimizer's own `foreach=` /
    `fused=` arguments if given, else the implementation measured fastest for the
    shards' device and dtype (on CPU fused AdamW, Adam, SGD and Adagrad, foreach RAdam,
    NAdam, RMSprop and Rprop; torch's default elsewhere). After construction
    `opt.config.optimizer_impl` holds what runs (None if parameter groups differ) and
    `opt.plan.notes` says it; "single_tensor" is torch's own CPU default."""
    # --- end perf

    # --- offload (issue 26): runtime/offload.py
    offload_optimizer: str | None = None
    """"cpu": each group shard's fp32 masters, gradient shard and optimizer state live in
    host memory and the optimizer steps there (DeepSpeed's ZeRO-Offload); the device keeps
    the parameters and the bucket pool. Gradients are copied to the host as each bucket's
    reduction completes, and each layout's new parameters are copied back just before its
    all-gather. Results are bit-identical to no offload. With parameters on the CPU it
    moves nothing (host-to-host copies only). None (default): no offload. "nvme" is
    refused (evenzero offloads to host memory only)."""
    pin_memory: bool = True
    """With `offload_optimizer`: page-lock the host tensors that cross the link (masters
    and the copies' staging) so the copies run asynchronously; only when the parameters
    are on CUDA (ignored otherwise). Checked against the host's available memory."""
    # --- end offload

    def __post_init__(self) -> None:
        if _not_int(self.stage) or self.stage not in (1, 2):
            raise ZeroConfigError(f"stage must be 1 or 2, got {self.stage!r}")
        if self.bucket_numel not in (None, AUTO) and (_not_int(self.bucket_numel)
                                                      or self.bucket_numel <= 0):
            raise ZeroConfigError(f"bucket_numel must be \"auto\" or a positive integer number "
                                  f"of elements, got {self.bucket_numel!r}; e.g. "
                                  f"bucket_numel=2**20")
        if (_not_int(self.alignment_bytes) or self.alignment_bytes <= 0
                or self.alignment_bytes & (self.alignment_bytes - 1)):
            raise ZeroConfigError(f"alignment_bytes must be a power of two number of bytes, got "
                                  f"{self.alignment_bytes!r}; e.g. alignment_bytes=128")
        if _not_int(self.max_buckets_in_flight) or self.max_buckets_in_flight < 1:
            raise ZeroConfigError(f"max_buckets_in_flight must be an integer of at least 1, got "
                                  f"{self.max_buckets_in_flight!r}; e.g. max_buckets_in_flight=2")
        if self.optimizer_impl not in (None, *IMPLS):  # perf (issue 17)
            raise ZeroConfigError(f"optimizer_impl must be one of {IMPLS} or None, got "
                                  f"{self.optimizer_impl!r}")
        if self.reduce_scatter_algorithm not in (None, *REDUCE_SCATTER_ALGORITHMS):
            raise ZeroConfigError(f"reduce_scatter_algorithm must be one of "
                                  f"{REDUCE_SCATTER_ALGORITHMS}, got {self.reduce_scatter_algorithm!r}")
        if not (isinstance(self.strategy, str) or callable(self.strategy)):
            raise ZeroConfigError(f"strategy must be a strategy name such as 'evenzero' or a "
                                  f"planner callable, got {self.strategy!r}")
        self._check_compression()
        if self.offload_optimizer == "nvme":  # offload (issue 26)
            raise ZeroConfigError("offload_optimizer='nvme' is not supported: evenzero offloads "
                                  "the optimizer to host memory only; use "
                                  "offload_optimizer='cpu', or None")
        if self.offload_optimizer not in (None, "cpu"):
            raise ZeroConfigError(f"offload_optimizer must be 'cpu' or None, got "
                                  f"{self.offload_optimizer!r}")
        for name in ("allow_partial_grads", "overlap_param_gather", "pin_memory",
                     "grad_compression_error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ZeroConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.elementwise is not None and not isinstance(self.elementwise, bool):
            raise ZeroConfigError(f"elementwise must be True, False or None, got "
                                  f"{self.elementwise!r}")
        self._check_loss_scale()
        try:
            if self.reduce_dtype is not None:
                as_dtype(self.reduce_dtype, "reduce_dtype")
            as_dtype(self.master_dtype, "master_dtype")
        except ValueError as e:
            raise ZeroConfigError(str(e)) from None

    def _check_compression(self) -> None:
        try:
            check_mode(self.grad_compression)
            check_block(self.grad_compression_block)
        except WireError as e:
            raise ZeroConfigError(str(e)) from None
        if self.grad_compression_error_feedback is True and self.grad_compression is None:
            raise ZeroConfigError("grad_compression_error_feedback=True needs "
                                  "grad_compression=\"int8\" or \"bf16\": exact gradients "
                                  "leave no residual to feed back")
        if self.grad_compression is not None and self.reduce_scatter_algorithm == NATIVE:
            raise ZeroConfigError(
                f"grad_compression={self.grad_compression!r} sums the received pieces in fp32 "
                f"after an all-to-all, which reduce_scatter_algorithm={NATIVE!r} cannot do (it "
                f"sums in the wire dtype); drop reduce_scatter_algorithm, or use "
                f"reduce_dtype=torch.bfloat16 without grad_compression for a native bf16 "
                f"reduce-scatter")

    def _check_loss_scale(self) -> None:
        scale = self.loss_scale
        if isinstance(scale, str):
            if scale != "dynamic":
                raise ZeroConfigError(f"loss_scale must be 'dynamic', a number or None, got "
                                      f"{scale!r}")
        elif scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                    or not math.isfinite(scale) or scale <= 0):
            raise ZeroConfigError(f"loss_scale must be 'dynamic', None or a finite positive number, "
                                  f"got {scale!r}; e.g. loss_scale=1024.0, or 'dynamic'")
        if not isinstance(self.loss_scale_config, LossScaleConfig):
            raise ZeroConfigError(f"loss_scale_config must be an evenzero.runtime.LossScaleConfig, "
                                  f"got {type(self.loss_scale_config).__name__}")

    @property
    def auto_bucket(self) -> bool:
        """Whether the bucket size is evenzero's to choose ("auto" or None)."""
        return self.bucket_numel in (None, AUTO)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))


ELEMENTWISE = "elementwise"
"""An update of each element from that element's gradient and state alone (AdamW): steps
any flat shard."""
WHOLE_TENSOR = "whole_tensor"
"""An update that needs each parameter's whole tensor (Muon): steps the parameters a rank
owns whole, in a matrix-aligned layout (`evenzero.strategies.wholetensor`)."""
UPDATE_ATTRIBUTE = "evenzero_update"
"""Class attribute by which an optimizer declares its update: `ELEMENTWISE` or
`WHOLE_TENSOR` (docs/muon.md)."""
WHOLE_TENSOR_OPTIMIZERS = (torch.optim.Muon,)
"""torch's optimizers whose update needs whole tensors (subclasses included)."""


def update_kind(optimizer_class, declared: bool | None = None) -> str:
    """`ELEMENTWISE` or `WHOLE_TENSOR` for `optimizer_class`: its `evenzero_update`
    attribute, else `declared` (`ZeroConfig.elementwise`), else what torch's own classes
    are; refuses a class it cannot tell, naming both ways to declare it."""
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class,
                                                                torch.optim.Optimizer):
        raise ZeroConfigError(f"optimizer_class must be a torch.optim.Optimizer subclass such as "
                              f"torch.optim.AdamW, got {optimizer_class!r}")
    name = optimizer_class.__name__
    attr = getattr(optimizer_class, UPDATE_ATTRIBUTE, None)
    if attr is not None:
        if attr not in (ELEMENTWISE, WHOLE_TENSOR):
            raise ZeroConfigError(f"{name}.{UPDATE_ATTRIBUTE} = {attr!r} is neither "
                                  f"{ELEMENTWISE!r} nor {WHOLE_TENSOR!r}; set one of them")
        return attr
    if declared is True or optimizer_class in ELEMENTWISE_OPTIMIZERS:
        return ELEMENTWISE
    if issubclass(optimizer_class, WHOLE_TENSOR_OPTIMIZERS):
        return WHOLE_TENSOR
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ZeroConfigError(
        f"{name} is not a known elementwise optimizer: ZeroOptimizer steps "
        f"each rank's flat 1/N shard on its own, which is only correct when every element's "
        f"update depends on that element alone ({names}). Use one of those, or pass "
        f"elementwise=True if {name} really is elementwise; an optimizer whose update needs "
        f"each parameter whole (like torch.optim.Muon) declares it with "
        f"{name}.{UPDATE_ATTRIBUTE} = {WHOLE_TENSOR!r}")


def check_elementwise(optimizer_class, declared: bool | None) -> None:
    """Refuse optimizers that are neither elementwise nor declared whole-tensor (they
    would be wrong on shards)."""
    update_kind(optimizer_class, declared)

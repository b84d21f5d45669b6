"""Options and helpers shared by every planner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evenzero.plan import (
    BACKWARD,
    OPTIMIZER_IMPLS,
    STEP,
    Bucket,
    Collective,
    GroupInfo,
    Plan,
    PlanError,
    StepWork,
)
from evenzero.spec import DTYPE_BYTES, ModelSpec
from evenzero.wire import DEFAULT_BLOCK, WireError, check_block, check_mode

if TYPE_CHECKING:
    from evenzero.cost.compute import ComputeProfile
    from evenzero.cost.model import CostModel

AUTO = "auto"
"""`PlanOptions.bucket_numel` value: pick the size with the timeline (evenzero only)."""


@dataclass(frozen=True)
class PlanOptions:
    """Knobs a user can turn; None means the strategy's own default."""

    bucket_numel: int | str | None = None
    """Bucket size in elements (DeepSpeed: reduce_bucket_size; DDP: converted from 25 MB).
    "auto" (evenzero's default; other strategies read it as None): the size with the
    shortest predicted step within the memory budget (`evenzero.cost.autobucket`)."""
    round_robin: bool = False
    """DeepSpeed `round_robin_gradients`: interleave the flat layout across ranks."""
    alignment_bytes: int = 128
    """evenzero: every shard starts on this many bytes."""
    reduce_dtype: str | None = None
    """Dtype of gradient messages; None means each group's parameter dtype."""
    max_buckets_in_flight: int = 2
    """evenzero: buckets reduced concurrently (the runtime's `max_buckets_in_flight`)."""
    cost_model: CostModel | None = None
    """evenzero auto bucket size: the cost model to predict with; None: the default
    preset for the world size (`evenzero.cost.presets.default_cost_preset`)."""
    compute: ComputeProfile | None = None
    """evenzero auto bucket size: measured compute times; None: FLOPs estimates."""
    bucket_memory_bytes: int | None = None
    """evenzero auto bucket size: bytes the bucket buffers in flight may take; None: the
    default budget (`evenzero.cost.autobucket.default_memory_budget`)."""
    stage: int = 2
    """ZeRO stage the runtime executes (`ZeroConfig.stage`): 2 keeps a gradient shard
    between backward and step, 1 keeps the full gradients."""
    overlap_param_gather: bool = False
    """The step's parameter all-gathers run in the next forward (`ZeroConfig` and
    `Execution` field of the same name) instead of before `step()` returns."""
    master_dtype: str = "float32"
    """Dtype of the master weights and optimizer state (`ZeroConfig.master_dtype`)."""
    optimizer_impl: str | None = None
    """How the optimizer steps: "single_tensor", "foreach" or "fused" (torch.optim's
    implementations; `StepWork.optimizer_impl`). None: each system's own default
    (evenzero's runtime: `strategies.evenzero.DEFAULT_OPTIMIZER_IMPL`; a user's torch
    optimizer under DDP or FSDP2: torch's default for the device)."""
    grad_compression: str | None = None
    """evenzero: how each bucket's reduce-scatter sends the gradients (`evenzero.wire`):
    None (exact values), "bf16" or "int8". Other strategies send what they send."""
    compression_block: int = DEFAULT_BLOCK
    """evenzero, "int8": elements per fp32 scale."""
    error_feedback: bool = False
    """evenzero, compressed: each rank keeps its quantization residual (one fp32 value
    per gradient element) and adds it to the next synchronising backward's gradient."""
    whole_tensor: tuple[str, ...] = ()
    """evenzero: parameters whose update needs the whole tensor (Muon's matrices). Empty
    (element-wise optimizers): today's layout, no padding added. Otherwise their groups
    are laid out matrix-aligned (`evenzero.strategies.wholetensor`): each of these
    parameters inside one rank's equal slice of its bucket, Newton-Schulz work balanced
    over the ranks, still one equal reduce-scatter per bucket."""
    ns_steps: int = 5
    """Newton-Schulz iterations of each whole-tensor update (Muon's `ns_steps`): the
    FLOPs `StepWork.matrix_flops` charges and the layout balances."""
    offload_optimizer: str | None = None
    """evenzero and DeepSpeed: "cpu" keeps the masters, gradient shard and optimizer state
    in host memory and steps there (ZeRO-Offload); None keeps them on the device."""

    def __post_init__(self) -> None:
        b = self.bucket_numel
        if b is not None and b != AUTO and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise PlanError(f"bucket size must be a positive number of elements or \"auto\", "
                            f"got {b!r}; pass e.g. --bucket-numel 33554432")
        m = self.max_buckets_in_flight
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PlanError(f"max_buckets_in_flight must be a positive integer, got {m!r}")
        if self.bucket_memory_bytes is not None and not self.bucket_memory_bytes > 0:
            raise PlanError(f"bucket memory budget must be a positive number of bytes, got "
                            f"{self.bucket_memory_bytes!r}")
        if self.alignment_bytes <= 0:
            raise PlanError(f"alignment must be positive, got {self.alignment_bytes} bytes")
        if isinstance(self.stage, bool) or self.stage not in (1, 2):
            raise PlanError(f"stage must be 1 or 2, got {self.stage!r}")
        if self.master_dtype not in DTYPE_BYTES:
            raise PlanError(f"master dtype {self.master_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.optimizer_impl not in (None, *OPTIMIZER_IMPLS):
            raise PlanError(f"optimizer implementation {self.optimizer_impl!r} is not one of "
                            f"{OPTIMIZER_IMPLS}")
        if self.reduce_dtype is not None and self.reduce_dtype not in DTYPE_BYTES:
            raise PlanError(f"reduce dtype {self.reduce_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        try:
            check_mode(self.grad_compression)
            check_block(self.compression_block)
        except WireError as e:
            raise PlanError(str(e)) from None
        if not isinstance(self.error_feedback, bool):
            raise PlanError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if (not isinstance(self.whole_tensor, tuple)
                or not all(isinstance(n, str) for n in self.whole_tensor)):
            raise PlanError(f"whole_tensor must be a tuple of parameter names, got "
                            f"{self.whole_tensor!r}")
        n = self.ns_steps
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 100:
            raise PlanError(f"ns_steps must be an integer in [0, 100) as torch.optim.Muon "
                            f"accepts, got {n!r}")
        if self.error_feedback and self.grad_compression is None:
            raise PlanError("grad_compression_error_feedback=True needs a compressed wire: "
                            "set grad_compression=\"int8\" (or \"bf16\"); exact values leave "
                            "no residual to feed back")
        if self.offload_optimizer not in (None, "cpu"):
            raise PlanError(f"offload_optimizer must be \"cpu\" or None, got "
                            f"{self.offload_optimizer!r} (NVMe offload is not modelled)")

    @property
    def fixed_bucket_numel(self) -> int | None:
        """The bucket size the user fixed, or None (unset or "auto")."""
        return None if self.bucket_numel == AUTO else self.bucket_numel


MAX_WORLD_SIZE = 2**17
"""Largest world size that plans listing a call per rank accept (131,072 ranks).

DeepSpeed's plans issue one reduce (or one all-reduce segment) per piece of a flush that
lands on one rank, so their size grows with the world: llama-70b's deepspeed-0.6 plan
has ~130K calls at this bound (~120 MB, about a second), 1M calls at 2**20 (~850 MB), and
cannot be built at 10**9. The bound is 8x the 16,384 GPUs of Llama 3 405B's pre-training
job and above every data-parallel group in use. evenzero, Megatron, FSDP2 and DDP plans
hold one call per bucket and take any world size; `evenzero plan` applies the bound to
every strategy so that one limit is documented."""


def check_world_size(world_size: int, limit: int | None = None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world size must be a positive integer, got {world_size!r}")
    if limit is not None and world_size > limit:
        raise PlanError(f"world size {world_size:,} is over the {limit:,} ranks that can be "
                        f"planned (its plan lists calls per rank); plan at most {limit:,}")


def group_infos(spec: ModelSpec, world_size: int) -> tuple[GroupInfo, ...]:
    """Group sizes on `world_size` ranks; rejects world sizes the groups cannot tile."""
    check_world_size(world_size)
    out = []
    for g in spec.groups:
        e = g.expert_parallel_size
        if world_size % e:
            raise PlanError(f"world size {world_size} is not divisible by expert_parallel_size {e} "
                            f"of group {g.name!r}; use a world size that is a multiple of {e}")
        params = spec.group_params(g.name)
        if not params:
            continue
        out.append(GroupInfo(g.name, world_size // e, e, sum(p.numel for p in params),
                             group_dtype(spec, g.name)))
    return tuple(out)


def group_dtype(spec: ModelSpec, group: str) -> str:
    dtypes = spec.group_dtypes(group)
    if len(dtypes) > 1:
        raise PlanError(f"group {group!r} mixes parameter dtypes {list(dtypes)}; "
                        f"put each dtype in its own group")
    return dtypes[0]


def message_itemsize(spec: ModelSpec, group: str, options: PlanOptions) -> int:
    return DTYPE_BYTES[options.reduce_dtype or group_dtype(spec, group)]


def arrival_positions(spec: ModelSpec) -> dict[str, int]:
    return {n: i for i, n in enumerate(spec.arrival_order)}


def group_arrival(spec: ModelSpec, group: str) -> tuple[list[str], list[str]]:
    """(params of `group` in arrival order, params of `group` that produce no gradient)."""
    pos = arrival_positions(spec)
    params = spec.group_params(group)
    arrived = sorted((p.name for p in params if p.name in pos), key=pos.__getitem__)
    missing = [p.name for p in params if p.name not in pos]
    return arrived, missing


def completion_order(spec: ModelSpec, buckets: list[Bucket]) -> list[Bucket]:
    """Buckets sorted by when their last gradient arrives; never-complete ones last."""
    pos = arrival_positions(spec)
    never = len(pos)
    group_rank = {g.name: i for i, g in enumerate(spec.groups)}

    def key(b: Bucket) -> tuple[int, int, int]:
        last = max((pos.get(s.name, never) for s in b.params), default=never)
        return (last, group_rank[b.group], b.index)

    return sorted(buckets, key=key)


def all_gathers(spec: ModelSpec, infos: tuple[GroupInfo, ...], layouts: list[Bucket]) -> list[Collective]:
    """One equal all-gather per layout, on the layout's group."""
    size = {g.name: g.size for g in infos}
    itemsize = {g.name: DTYPE_BYTES[group_dtype(spec, g.name)] for g in infos}
    return [Collective(STEP, "all_gather", b.group, size[b.group], None, b.index, 0, b.numel,
                       itemsize=itemsize[b.group]) for b in layouts]


def step_work(plan: Plan, spec: ModelSpec, options: PlanOptions, *, norm: str | None = None,
              optimizer_impl: str | None = None,
              tensors: Callable[[GroupInfo, int], list[int]] | None = None,
              copied: Callable[[GroupInfo], bool] = lambda g: False, copy_passes: int = 1,
              visits_params: bool = False) -> StepWork:
    """The step's own compute on one rank (`StepWork`): the optimizer over the rank's
    shards (everything, for an unsharded plan) with the user's implementation, else
    `optimizer_impl` (None: torch's default), on the tensors `tensors(group, elements)`
    lists (default: one flat tensor per group); the norm, if any, over the same
    elements; `copy_passes` passes over parameter and master for the groups `copied`
    says keep a separate master; one visit of every parameter by the step's own Python
    work if `visits_params`."""
    master = DTYPE_BYTES[options.master_dtype]
    elements = {g.name: plan.shard_numel(g.name) if plan.sharded else g.numel for g in plan.groups}
    copies = sum(copy_passes * elements[g.name] * (master + DTYPE_BYTES[g.dtype])
                 for g in plan.groups if copied(g))
    total = sum(elements.values())
    numels = tuple(n for g in plan.groups
                   for n in (tensors(g, elements[g.name]) if tensors else [elements[g.name]])
                   if n > 0)
    return StepWork(total, options.optimizer_impl or optimizer_impl, norm,
                    total if norm else 0, copies, numels,
                    len(spec.params) if visits_params else 0)


def per_param(spec: ModelSpec) -> Callable[[GroupInfo, int], list[int]]:
    """`step_work`'s `tensors` for an optimizer over the parameters themselves (DDP; a
    sharded one scales each by its share: FSDP2 and Megatron step each parameter's
    shard)."""
    def tensors(g: GroupInfo, elements: int) -> list[int]:
        numels = [p.numel for p in spec.group_params(g.name) if p.numel > 0]
        whole = sum(numels)
        if whole == elements or not whole:
            return numels
        shares = [n * elements // whole for n in numels]
        shares[-1] += elements - sum(shares)
        return shares

    return tensors


def check_has_params(spec: ModelSpec) -> None:
    if not spec.params:
        raise PlanError("the model has no trainable parameters; give it at least one "
                        "(or check requires_grad)")


__all__ = ["AUTO", "BACKWARD", "MAX_WORLD_SIZE", "STEP", "PlanOptions", "group_infos"]

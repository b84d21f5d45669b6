"""Construction: validate everything locally, agree across ranks, then plan.

Local problems (a process group without this rank, parameters on mixed devices, an
optimizer that is not elementwise, ...) are not raised on the spot: a rank that raised
alone would leave the others waiting in the first collective. They ride along with the
rank's model description into `checks.agree`, which raises the same error everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from evenzero.plan import Plan, PlanError
from evenzero.runtime.checks import (
    RankDescription,
    ZeroConfigError,
    agree,
    check_group_partition,
)
from evenzero.runtime.collectives import broadcast, control_device
from evenzero.runtime.config import (
    WHOLE_TENSOR,
    WHOLE_TENSOR_OPTIMIZERS,
    ZeroConfig,
    check_elementwise,
    update_kind,
)
from evenzero.runtime.groups import (
    GroupingError,
    TrainGroup,
    build_groups,
    check_process_group,
    model_spec,
    trainable,
)
from evenzero.runtime.innerstep import plan_note
from evenzero.runtime.offload import check_offload, host_bytes_available, host_need
from evenzero.runtime.precision import as_dtype
from evenzero.runtime.teardown import claimed
from evenzero.spec import ModelSpec, dtype_name, is_expert
from evenzero.strategies import PlanOptions, executable_plan, get_strategy


@dataclass(frozen=True)
class Setup:
    """What construction established, identical in shape on every rank."""

    named: tuple[tuple[str, torch.nn.Parameter], ...]
    """Trainable parameters in registration order."""
    groups: tuple[TrainGroup, ...]
    """Parameter groups, in the order the optimizer sees them."""
    group_ranks: Mapping[str, int]
    """This rank's rank in each group's process group."""
    group_sizes: Mapping[str, int]
    """Size of each group's process group."""
    spec: ModelSpec
    """The planner's description of the model (arrival: reverse registration)."""
    device: torch.device
    """Device of every parameter."""
    control_device: torch.device
    """Device of the small control tensors (`collectives.control_device`)."""


def _check_devices(named) -> torch.device:
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise GroupingError(f"parameters are on several devices ({', '.join(devices)}); move the "
                            f"whole model to one device before building ZeroOptimizer")
    device = named[0][1].device
    if device.type == "meta":
        raise GroupingError("parameters are on the meta device; materialise them first "
                            "(module.to_empty(device=...) and initialise the weights)")
    return device


def _members(group: TrainGroup, world_group) -> tuple[int, ...]:
    """The group's members as ranks of the data-parallel world group."""
    out = []
    for g in dist.get_process_group_ranks(group.process_group):
        try:
            out.append(dist.get_group_rank(world_group, g))
        except (ValueError, RuntimeError):
            raise GroupingError(f"the process group of parameter group {group.name!r} contains "
                                f"global rank {g}, which is outside the data-parallel group") from None
    return tuple(out)


def _check_edp_pattern(name: str, members: tuple[int, ...], me: int, world: int) -> None:
    """A group of S < W ranks must be DeepSpeed's expert-data-parallel group {i, i+E, ...}
    (E = W/S), the layout the plan describes (`GroupInfo.ranks_of`). Passing the
    expert-parallel group instead would reduce different experts together, silently."""
    e = world // len(members)
    expected = tuple(range(me % e, world, e))
    if tuple(sorted(members)) != expected:
        raise GroupingError(f"parameter group {name!r}: its process group is ranks "
                            f"{sorted(members)}, but with {len(members)} of {world} ranks it must "
                            f"be the expert-data-parallel group {list(expected)} (ranks holding the "
                            f"same experts); evenzero.moe.expert_parallel_groups(E).edp_group is it")


def _settings(config: ZeroConfig, optimizer_class, defaults: Mapping[str, Any]) -> tuple:
    items = {f: repr(getattr(config, f)) for f in sorted(ZeroConfig.field_names())}
    for f in ("reduce_dtype", "master_dtype"):  # "bf16" and torch.bfloat16 are the same setting
        value = getattr(config, f)
        items[f] = dtype_name(as_dtype(value, f)) if value is not None else "None"
    if callable(config.strategy):  # a function's repr holds its address, which differs by rank
        items["strategy"] = getattr(config.strategy, "__qualname__", type(config.strategy).__name__)
    items["optimizer"] = getattr(optimizer_class, "__qualname__", repr(optimizer_class))
    items["optimizer_kwargs"] = repr(sorted(defaults.items()))
    return tuple(items.items())


def _check_offload(config: ZeroConfig, optimizer_class, groups: Iterable[TrainGroup],
                   sizes: Mapping[str, int], device: torch.device) -> None:
    """offload_optimizer's refusals, from the shards' sizes before anything is allocated
    (`runtime/offload.py`)."""
    if config.offload_optimizer is None:
        return
    master = as_dtype(config.master_dtype, "master_dtype")
    item = torch.empty((), dtype=master).element_size()
    shards = [(-(-sum(p.numel() for p in g.params) // sizes[g.name]),
               g.params[0].element_size()) for g in groups if g.params]
    pin = config.pin_memory and device.type == "cuda"
    check_offload(config.offload_optimizer, pin, optimizer_class,
                  host_need(shards, item, optimizer_class), host_bytes_available())


def establish(module: torch.nn.Module, optimizer_class, param_groups: Iterable[Mapping] | None,
              config: ZeroConfig, expert_groups: Mapping[str, Any] | None, world_group,
              defaults: Mapping[str, Any], config_error: str | None = None) -> Setup:
    """Validate the inputs on every rank and agree; raises `ZeroConfigError` everywhere.
    `config_error` is a problem already found with this rank's settings."""
    world = dist.get_world_size(world_group)
    error = config_error
    named = trainable(module)
    groups: tuple[TrainGroup, ...] = ()
    ranks: dict[str, int] = {}
    sizes: dict[str, int] = {}
    members: list[tuple[int, ...]] = []
    device = None
    try:
        if error:
            raise ZeroConfigError(error)
        taken = claimed(named)
        if taken is not None:
            raise ZeroConfigError(f"the model is already managed by a live ZeroOptimizer "
                                  f"(parameter {taken!r}); call close() on that one (or drop "
                                  f"every reference to it) before building another")
        check_elementwise(optimizer_class, config.elementwise)
        groups = build_groups(module, world_group, param_groups, expert_groups)
        check_whole_tensor_groups(groups, optimizer_class, config)
        device = _check_devices(named)
        for g in groups:
            ranks[g.name] = check_process_group(g, world_group)
            sizes[g.name] = dist.get_world_size(g.process_group)
            members.append(_members(g, world_group))
            _check_edp_pattern(g.name, members[-1], dist.get_rank(world_group), world)
        _check_offload(config, optimizer_class, groups, sizes, device)
    except (GroupingError, ZeroConfigError) as e:
        error = str(e)
    group_of = {n: g.name for g in groups for n in g.names}
    # Buffers are described too: construction broadcasts them, so they must match.
    desc = RankDescription(
        params=tuple((n, tuple(p.shape), dtype_name(p.dtype), group_of.get(n, "?")) for n, p in named)
        + tuple((n, tuple(b.shape), dtype_name(b.dtype), "(buffer)")
                for n, b in module.named_buffers()),
        groups=tuple((g.name, sizes.get(g.name, 0)) for g in groups) if not error else (),
        settings=_settings(config, optimizer_class, {**defaults, **{
            f"{g.name}.{k}": v for g in groups for k, v in g.options.items()}, **{
            f"{g.name}.optimizer": g.optimizer.__qualname__ for g in groups if g.optimizer}}),
        error=error)
    comm = control_device(world_group, device)
    agree(desc, world_group, comm)
    check_group_partition(members, world_group, comm, [g.name for g in groups])
    spec = model_spec(type(module).__name__, named, groups, world, sizes)
    return Setup(tuple(named), groups, ranks, sizes, spec, device, comm)


def broadcast_initial_state(module: torch.nn.Module, groups: Iterable[TrainGroup],
                            world_group) -> None:
    """Every rank starts from the first rank's values, as DDP's construction broadcasts
    rank 0's (torch/nn/parallel/distributed.py@v2.13.0, `_sync_module_states`): each
    group's trainable parameters from the first rank of its process group (an expert
    group's from the first rank of its expert-data-parallel group), and frozen
    parameters and buffers from rank 0 of the world, except those of modules that hold
    expert parameters (they differ by expert-parallel rank by design)."""
    trained: set[int] = set()
    with torch.no_grad():
        for g in groups:
            _broadcast_flat(list(g.params), g.process_group)
            trained.update(id(p) for p in g.params)
        rest = []
        for m in module.modules():
            own = list(m.parameters(recurse=False))
            if any(is_expert(p) for p in own):
                continue
            rest += [p for p in own if id(p) not in trained]
            rest += list(m.buffers(recurse=False))
        seen: set[int] = set()
        _broadcast_flat([t for t in rest if not (id(t) in seen or seen.add(id(t)))], world_group)


def _broadcast_flat(tensors: list[torch.Tensor], group) -> None:
    """One broadcast per dtype of the tensors flattened, from the group's first rank."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        if flat.dtype == torch.bool:  # not every backend moves bools
            flat = flat.to(torch.uint8)
        broadcast(flat, 0, group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def group_update(group: TrainGroup, optimizer_class, config: ZeroConfig) -> str:
    """Whether `group`'s inner optimizer is elementwise or updates whole tensors."""
    if group.optimizer is None:
        return update_kind(optimizer_class, config.elementwise)
    return update_kind(group.optimizer)


def check_whole_tensor_groups(groups: Iterable[TrainGroup], optimizer_class,
                              config: ZeroConfig) -> None:
    """Every group's optimizer is identified, and a Muon group holds matrices only
    (torch.optim.Muon's own rule: it refuses any parameter that is not 2-D)."""
    for g in groups:
        cls = g.optimizer or optimizer_class
        if group_update(g, optimizer_class, config) != WHOLE_TENSOR:
            continue
        if not issubclass(cls, WHOLE_TENSOR_OPTIMIZERS):
            continue
        for n, p in zip(g.names, g.params, strict=True):
            if p.dim() != 2:
                raise GroupingError(
                    f"parameter {n!r} of shape {list(p.shape)} is in group {g.name!r}, which "
                    f"{cls.__name__} steps, but {cls.__name__} updates 2-D matrices only "
                    f"(torch.optim.Muon refuses it too); put it in a group with "
                    f"\"optimizer\": torch.optim.AdamW (embeddings, heads, norms, biases)")


def whole_tensor_names(groups: Iterable[TrainGroup], optimizer_class,
                       config: ZeroConfig) -> tuple[str, ...]:
    """The parameters of the groups whose optimizer updates whole tensors."""
    return tuple(n for g in groups if group_update(g, optimizer_class, config) == WHOLE_TENSOR
                 for n in g.names)


PLAN_OPTION_OF: Mapping[str, str] = {
    "stage": "stage",
    "bucket_numel": "bucket_numel",
    "alignment_bytes": "alignment_bytes",
    "reduce_dtype": "reduce_dtype",
    "master_dtype": "master_dtype",
    "max_buckets_in_flight": "max_buckets_in_flight",
    "overlap_param_gather": "overlap_param_gather",
    "optimizer_impl": "optimizer_impl",
    "grad_compression": "grad_compression",
    "grad_compression_block": "compression_block",
    "grad_compression_error_feedback": "error_feedback",
    "whole_tensor": "whole_tensor",
    "offload_optimizer": "offload_optimizer",
}
"""`ZeroConfig` field -> the `PlanOptions` field it sets (`plan_options`), so `opt.plan`,
its memory estimate and the auto bucket size describe the run being executed."""

NOT_PLAN_OPTIONS: Mapping[str, str] = {
    "strategy": "chooses the planner itself (`executable_plan`)",
    "loss_scale": "scales the loss; the schedule is the same",
    "loss_scale_config": "scales the loss; the schedule is the same",
    "elementwise": "a check of the optimizer class at construction",
    "allow_partial_grads": "how a missing gradient is treated at the step check",
    "reduce_scatter_algorithm": "the backend's implementation of the planned reduce-scatter "
                                "(recorded in each traced `Collective.algorithm`)",
    "pin_memory": "whether the offloaded host tensors are page-locked (copy speed, not "
                  "the schedule or the bytes moved)",
}
"""`ZeroConfig` fields that are not plan options, and why. Every field is in exactly one
of the two tables (tests/test_runtime_setup.py)."""


def plan_options(config: ZeroConfig, device: torch.device | None = None) -> PlanOptions:
    """The planner's options for the runtime's config (`PLAN_OPTION_OF`); the inner
    optimizer's implementation is the one `runtime/innerstep.py` chose at construction
    (`config.optimizer_impl`). With `bucket_numel="auto"` the construction-time choice
    is priced on a cost preset for the device the gradients live on
    (`runtime_cost_preset`); the runtime refines it after the first backwards."""
    reduce = dtype_name(as_dtype(config.reduce_dtype, "reduce_dtype")) if config.reduce_dtype else None
    return PlanOptions(bucket_numel=config.bucket_numel, alignment_bytes=config.alignment_bytes,
                       reduce_dtype=reduce, max_buckets_in_flight=config.max_buckets_in_flight,
                       cost_model=runtime_cost_preset(device) if device is not None else None,
                       stage=config.stage, overlap_param_gather=config.overlap_param_gather,
                       master_dtype=dtype_name(as_dtype(config.master_dtype, "master_dtype")),
                       optimizer_impl=config.optimizer_impl,
                       grad_compression=config.grad_compression,
                       compression_block=config.grad_compression_block,
                       error_feedback=config.grad_compression_error_feedback,
                       whole_tensor=tuple(config.whole_tensor),
                       offload_optimizer=config.offload_optimizer)


def check_compressed(plan: Plan, config: ZeroConfig) -> None:
    """`grad_compression` runs on a plan whose buckets are one reduce-scatter each, the
    compressed ones marked (evenzero's); another strategy's plan would silently send
    exact values."""
    sizes = {g.name: g.size for g in plan.groups}
    plain = [c for c in plan.backward() if sizes.get(c.group, 1) > 1
             and c.compression != config.grad_compression]
    if plain:
        name = config.strategy if isinstance(config.strategy, str) else "the custom planner"
        raise ZeroConfigError(f"grad_compression={config.grad_compression!r} is evenzero's "
                              f"compressed reduce-scatter, but {name!r} plans {plain[0].op} calls "
                              f"without it; use strategy='evenzero' or grad_compression=None")


def check_whole_owned(plan: Plan, config: ZeroConfig) -> None:
    """Every whole-tensor parameter lies inside one rank's slice of its layout (evenzero's
    matrix-aligned layout); raised identically on every rank, before any buffer exists."""
    whole = set(config.whole_tensor)
    if not whole:
        return
    for lay in plan.layouts:
        share = lay.numel // plan.group(lay.group).size
        for s in lay.params:
            if s.name in whole and s.offset // share != (s.offset + s.numel - 1) // share:
                name = config.strategy if isinstance(config.strategy, str) else "the custom planner"
                raise ZeroConfigError(
                    f"parameter {s.name!r} ({s.numel:,} elements) needs a whole-tensor update, "
                    f"but the {name!r} plan splits it across ranks; use strategy='evenzero', "
                    f"which lays such parameters out matrix-aligned")


def tunes_bucket_size(strategy: str | Any) -> bool:
    """Whether the configured strategy's bucket size may be refined at run time (the
    registry says so; a custom planner callable's is its own)."""
    return isinstance(strategy, str) and get_strategy(strategy).tunes_bucket_size


def runtime_cost_preset(device: torch.device):
    """Collectives of CPU tensors run on gloo (`gloo-local`, fitted on local ranks); CUDA
    tensors on NCCL (None: the planner's preset for the world size)."""
    from evenzero.cost.presets import PRESETS

    return PRESETS["gloo-local"] if device.type == "cpu" else None


def make_plan(spec: ModelSpec, world_size: int, config: ZeroConfig,
              group_sizes: Mapping[str, int], device: torch.device | None = None,
              bucket_numel: int | None = None, note: str | None = None) -> Plan:
    """Plan with the configured strategy and check it fits the process groups we have.
    `bucket_numel` overrides an "auto" config (the runtime's refined size), and `note`
    is then added to the plan's notes."""
    options = plan_options(config, device)
    if bucket_numel is not None:
        options = replace(options, bucket_numel=bucket_numel)
    plan = executable_plan(spec, world_size, config.strategy, options)
    impl = plan_note(config.optimizer_impl)  # first: notes[-1] is the bucket size's
    if impl:
        plan = replace(plan, notes=(impl, *plan.notes))
    if note is None and not config.auto_bucket:  # notes[-1] always says where the size came from
        count = len(plan.buckets)
        note = (f"bucket_numel {config.bucket_numel:,} elements ({count} bucket"
                f"{'' if count == 1 else 's'}): fixed by bucket_numel={config.bucket_numel}; "
                f"nothing measured or refined")
    if note:
        plan = replace(plan, notes=(*plan.notes, note))
    if config.grad_compression is not None:
        check_compressed(plan, config)
    if not plan.sharded:
        raise ZeroConfigError(f"strategy {config.strategy!r} keeps full optimizer state on every "
                              f"rank; ZeroOptimizer runs sharded plans such as 'evenzero'")
    check_whole_owned(plan, config)
    if plan.world_size != world_size:
        raise PlanError(f"plan is for {plan.world_size} ranks but the world has {world_size}")
    for g in plan.groups:
        if g.size != group_sizes[g.name]:
            raise PlanError(f"plan gives group {g.name!r} {g.size} ranks but its process group "
                            f"has {group_sizes[g.name]}")
    return plan

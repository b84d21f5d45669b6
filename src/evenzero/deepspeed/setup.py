"""`initialize(...)`: from a DeepSpeed script's arguments to a running engine.

Order as in `deepspeed.initialize` and `DeepSpeedEngine.__init__`
(deepspeed/__init__.py@0.19.8:433-610, deepspeed/runtime/engine.py@0.19.8:513-778):
process group, config (with the batch rules for this world size), parameters cast to
fp16/bf16 (buffers keep their dtype), module to the device, MoE process groups, every
parameter broadcast from its source rank, data loader, optimizer, LR schedule.

The optimizer is always a `ZeroOptimizer`: stage 1 or 2 as configured, and stage 0
(plain data parallelism in DeepSpeed) on stage 1, which gives the same result for an
elementwise optimizer with the optimizer state sharded (fp32, and bf16 with DeepSpeed's
initial zero-gradient step; fp16 at stage 0 is refused). A client optimizer object is
kept as the optimizer that steps the shards (its param groups now hold them, as
DeepSpeed's ZeRO swaps in its flat partitions), so a client LR scheduler built on it,
or a script that sets `opt.param_groups[i]['lr']`, keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from evenzero.deepspeed.boundary import StepPolicy
from evenzero.deepspeed.config import (
    DeepSpeedConfigError,
    EngineConfig,
    load_config,
    parse_config,
)
from evenzero.deepspeed.dataloader import DeepSpeedDataLoader
from evenzero.deepspeed.engine import DeepSpeedEngine
from evenzero.deepspeed.engine_optimizer import EngineOptimizer
from evenzero.deepspeed.launch import default_backend, init_distributed, placement
from evenzero.deepspeed.log import info_rank0, warning_rank0
from evenzero.deepspeed.loss_scaler import DeepSpeedLossScaler, ZeroScaleBridge
from evenzero.deepspeed.moe import broadcast_parameters, deepspeed_moe_layers, expert_groups
from evenzero.deepspeed.muon import split_groups
from evenzero.deepspeed.optimizers import (
    OptimizerChoice,
    as_groups,
    declared_elementwise,
    optimizer_from_client,
    optimizer_from_config,
    split_moe_groups,
    zero_param_groups,
)
from evenzero.deepspeed.schedulers import schedule_from_config

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """`deepspeed.initialize`: returns `(engine, optimizer, training_dataloader, lr_scheduler)`,
    with None for what is not configured."""
    if model is None:
        raise AssertionError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise DeepSpeedConfigError("model parallelism (mpu / mesh_param) is not supported by "
                                   "evenzero.deepspeed; it runs data parallelism only")
    if type(model).__name__ in ("PipelineModule", "DualPipeVModule"):
        raise DeepSpeedConfigError("pipeline parallelism (PipelineModule) is not supported by "
                                   "evenzero.deepspeed")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required,
                     verbose=False)
    raw = load_config(_config_source(args, config, config_params))
    cfg = parse_config(raw, dist.get_world_size())
    for key, why in cfg.no_ops:
        info_rank0("config key %s is accepted and changes nothing here: %s", key, why)
    if cfg.unknown_keys:
        # DeepSpeed ignores keys it does not know; so does evenzero, but says so.
        warning_rank0("ignoring config keys DeepSpeed does not know either: %s",
                      ", ".join(cfg.unknown_keys))
    place = placement(args)
    _prepare_module(model, cfg, place.device)
    groups = expert_groups(model, default_backend() if place.device.type == "cpu" else "nccl",
                           cfg.use_data_before_expert_parallelism)
    broadcast_parameters(model, groups)
    loader = None
    if training_data is not None:
        loader = DeepSpeedDataLoader(training_data, cfg.batch.micro_batch_per_gpu,
                                     rank=place.global_rank, world_size=place.world_size,
                                     collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last)
    engine_opt, name, scheduler = None, None, None
    if optimizer is not None or cfg.optimizer is not None:
        engine_opt, name = _build_optimizer(model, cfg, optimizer, model_parameters, groups,
                                            lr_scheduler is not None)
        scheduler = _build_scheduler(cfg, lr_scheduler, engine_opt.optimizer)
    elif cfg.zero.stage > 0:
        raise AssertionError(f"zero stage {cfg.zero.stage} requires an optimizer")
    moe = deepspeed_moe_layers(model)
    engine = DeepSpeedEngine(model, cfg, place, engine_opt, scheduler, loader, _policy(cfg), name,
                             moe_layers=len(moe), num_experts=[m.num_experts for m in moe])
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = place.local_rank
    return engine, engine_opt, loader, scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """deepspeed/__init__.py@0.19.8:514-535, including the deprecated `deepscale_config`."""
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        warning_rank0("--deepscale_config is deprecated, please use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise AssertionError("Not sure how to proceed, we were given both a deepscale_config "
                                 "and deepspeed_config")
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise AssertionError("Not sure how to proceed, we were given deepspeed configs in the "
                                 "deepspeed arguments and deepspeed.initialize() function call")
        config = from_args
    if config is None:
        raise AssertionError("DeepSpeed requires --deepspeed_config to specify configuration file")
    return config


@torch.no_grad()
def _prepare_module(model: torch.nn.Module, cfg: EngineConfig, device: torch.device) -> None:
    """Parameters (not buffers) to fp16/bf16, then the module to the device
    (deepspeed/runtime/engine.py@0.19.8:1851-1875)."""
    dtype = torch.float16 if cfg.precision.fp16 else (
        torch.bfloat16 if cfg.precision.bf16 else None)
    if dtype is not None:
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    model.to(device)


def _policy(cfg: EngineConfig) -> StepPolicy:
    p, zero = cfg.precision, cfg.zero
    if zero.stage == 0 and p.bf16:
        # DeepSpeed's stage-0 bf16 wrapper skips non-finite steps and clips like ZeRO
        # (deepspeed/runtime/fp16/unfused_optimizer.py@0.19.8).
        return StepPolicy(cfg.gradient_clipping, False, True)
    if zero.stage == 0:
        return StepPolicy(cfg.gradient_clipping, True, False, "ZeRO stage 0 never skips a step")
    if p.bf16 and not p.bf16_check_grad_overflow:
        return StepPolicy(cfg.gradient_clipping, False, False, "bf16.check_grad_overflow: false")
    if not p.fp16 and not p.bf16 and not zero.compute_grad_norm:
        return StepPolicy(cfg.gradient_clipping, False, False,
                          "zero_optimization.compute_grad_norm: false without fp16")
    return StepPolicy(cfg.gradient_clipping, False, True)


def _check_stage0(cfg: EngineConfig, model: torch.nn.Module, groups: dict) -> None:
    if cfg.zero.stage != 0:
        return
    if cfg.precision.fp16:
        # DeepSpeed 0.19.8's engine.backward scales the loss only for ZeRO optimizers, but
        # its stage-0 FP16 wrappers still unscale the gradients: every update comes out
        # divided by the loss scale (measured: SGD lr 1 moved a weight by 1/256 at scale
        # 2**8, by 1 at stage 1). That is not something to reproduce.
        raise DeepSpeedConfigError(
            "zero_optimization.stage 0 with fp16 is not supported: DeepSpeed 0.19.8 does not "
            "scale the loss on this path but unscales the gradients, so its updates are "
            "divided by the loss scale; use stage 1 (fp16 loss scaling as DeepSpeed's ZeRO)")
    if groups and cfg.gradient_clipping > 0:
        raise DeepSpeedConfigError(
            "zero_optimization.stage 0 with MoE layers and gradient_clipping > 0 is not "
            "supported: DeepSpeed's stage-0 clipping averages per-rank norms that each see only "
            "that rank's experts; use stage 1 or 2 (global norm), or gradient_clipping: 0")


def _check_offload_client(cfg: EngineConfig, client: Any) -> None:
    """DeepSpeed refuses a client optimizer under ZeRO-Offload unless it is its CPU Adam
    or `zero_force_ds_cpu_optimizer` is false (deepspeed/runtime/engine.py@0.19.8:2342)."""
    from evenzero.deepspeed.fused_adam import DeepSpeedCPUAdam

    if (cfg.zero.offload_optimizer is None or client is None or not cfg.force_ds_cpu_optimizer
            or isinstance(client, DeepSpeedCPUAdam)):
        return
    raise DeepSpeedConfigError(
        f"You are using ZeRO-Offload with a client provided optimizer ({type(client)}) which "
        f"DeepSpeed refuses: use deepspeed.ops.adam.DeepSpeedCPUAdam, or set an optimizer in "
        f"your ds-config, or set \"zero_force_ds_cpu_optimizer\": false to step "
        f"{type(client).__name__} on the host (evenzero steps torch.optim optimizers there "
        f"with their CPU kernels)")


def _build_optimizer(model: torch.nn.Module, cfg: EngineConfig, client: Any, model_parameters: Any,
                     groups: dict, client_scheduler: bool) -> tuple[EngineOptimizer, str | None]:
    from evenzero.runtime import ZeroConfig, ZeroOptimizer

    _check_stage0(cfg, model, groups)
    if client is not None and not isinstance(client, torch.optim.Optimizer):
        if not callable(client):
            raise AssertionError(f"Client Optimizer is of unexpected type {type(client)}")
        client = client(list(model.parameters()) if model_parameters is None
                        else list(model_parameters))
    if client is not None:
        # DeepSpeed drops empty groups from the client optimizer itself
        # (deepspeed/runtime/engine.py@0.19.8:2425).
        client.param_groups[:] = [g for g in client.param_groups if len(g["params"]) != 0]
        choice: OptimizerChoice = optimizer_from_client(client)
        param_groups = [dict(g) for g in client.param_groups]
        name = None
    else:
        choice = optimizer_from_config(cfg.optimizer, cfg.zero.offload_optimizer is not None)
        params = model.parameters() if model_parameters is None else model_parameters
        param_groups = as_groups(params)
        if choice.muon_adam is not None:
            names = {id(p): n for n, p in model.named_parameters()}
            param_groups = split_groups(param_groups, names, choice.muon_adam[1],
                                        choice.muon_adam[0])
        if groups:
            param_groups = split_moe_groups(param_groups)
        name = choice.name
    _check_adagrad(cfg, choice, param_groups, client is not None and client_scheduler)
    _check_offload_client(cfg, client)
    zero_groups = zero_param_groups(param_groups, groups)
    zcfg = ZeroConfig(stage=max(1, cfg.zero.stage), bucket_numel=cfg.zero.reduce_bucket_size,
                      elementwise=declared_elementwise(choice.cls), **wire_settings(cfg),
                      offload_optimizer=cfg.zero.offload_optimizer, pin_memory=cfg.zero.pin_memory)
    zero = ZeroOptimizer(model, choice.cls, zero_groups, config=zcfg, **choice.kwargs)
    if client is not None:
        _adopt_client(zero, client)
    if cfg.zero.stage == 0 and cfg.precision.bf16:
        _initial_zero_gradient_step(zero)
    scaler = DeepSpeedLossScaler.from_precision(cfg.precision)
    zero.loss_scaler = ZeroScaleBridge(scaler)
    view = EngineOptimizer(zero, scaler)
    view.client = client
    return view, name


def wire_settings(cfg: EngineConfig) -> dict[str, Any]:
    """`communication_data_type` as evenzero settings. DeepSpeed casts each bucket to it
    and reduces in it (deepspeed/runtime/zero/stage_1_and_2.py@v0.19.8
    `allreduce_and_scatter` / `average_tensor`: `tensor.to(communication_data_type)`).
    "bf16" over fp32 or fp16 gradients means bf16 on the wire: evenzero's
    `grad_compression="bf16"`, the same bytes, summed in fp32 where DeepSpeed sums in
    bf16 (never less exact). Over bf16 gradients it is their own dtype, and fp16/fp32
    are a plain message dtype: `reduce_dtype`."""
    comm = cfg.communication_data_type
    if comm == "bf16" and not cfg.precision.bf16:
        return {"grad_compression": "bf16"}
    return {"reduce_dtype": DTYPES.get(comm or "")}


def _check_adagrad(cfg: EngineConfig, choice: OptimizerChoice, groups: list[dict],
                   client_scheduler: bool) -> None:
    """DeepSpeed's ZeRO replaces an Adagrad optimizer by a new torch Adagrad built from its
    defaults (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:946-947): per-group options and
    a client scheduler bound to the client's object stop applying. Refused rather than
    followed silently either way."""
    if cfg.zero.stage == 0 or not issubclass(choice.cls, torch.optim.Adagrad):
        return
    overrides = [k for g in groups for k, v in g.items()
                 if k not in ("params", "name", "moe") and choice.kwargs.get(k, v) != v]
    if client_scheduler or overrides:
        raise DeepSpeedConfigError(
            "Adagrad under ZeRO stage 1/2 with per-group options or a client LR scheduler is "
            "not supported: DeepSpeed rebuilds Adagrad from its defaults there, so neither "
            "applies; use one set of Adagrad options and a config scheduler")


@torch.no_grad()
def _initial_zero_gradient_step(zero: Any) -> None:
    """DeepSpeed's stage-0 mixed-precision wrappers step the optimizer once with zero
    gradients when they are built (`initialize_optimizer_states`,
    deepspeed/runtime/fp16/fused_optimizer.py@0.19.8:125 and unfused_optimizer.py:412), so
    Adam's step count starts at 1 and decoupled weight decay is applied once to the fp32
    masters (not to the model's bf16 weights until the first real step). Same here: every
    parameter is stepped once on zeros."""
    zero.step_masters_on_zero_grads()


def _adopt_client(zero: Any, client: torch.optim.Optimizer) -> None:
    """The client's optimizer object keeps driving the options: its `param_groups` become
    the `ZeroOptimizer`'s (the same dicts), so a scheduler bound to the client object
    moves the learning rate that is stepped, as under DeepSpeed, where the client object
    is the one stepping (deepspeed/runtime/engine.py@0.19.8:1700-1720)."""
    if len(zero.param_groups) != len(client.param_groups):
        raise DeepSpeedConfigError(
            f"the client optimizer has {len(client.param_groups)} param groups but "
            f"{len(zero.param_groups)} hold trainable parameters; remove groups that hold only "
            f"frozen parameters")
    client.param_groups = zero.param_groups
    client.state.clear()


def _build_scheduler(cfg: EngineConfig, client: Any, optimizer: torch.optim.Optimizer) -> Any:
    """deepspeed/runtime/engine.py@0.19.8:1883-1897: a client object as is, a client
    callable called with the optimizer, else the config's `scheduler` section."""
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if cfg.scheduler is None:
        return None
    return schedule_from_config(cfg.scheduler.type, dict(cfg.scheduler.params), optimizer)

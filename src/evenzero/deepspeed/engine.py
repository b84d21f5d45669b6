"""`DeepSpeedEngine`: DeepSpeed's training-loop contract on top of `ZeroOptimizer`.

What a script sees follows deepspeed/runtime/engine.py@0.19.8:

* `engine(*a, **kw)` runs the module; its outputs get a gradient hook dividing by
  `gradient_accumulation_steps`, so a plain `loss.backward()` accumulates like
  `engine.backward(loss)` (deepspeed/runtime/engine.py:3179-3187).
* `backward(loss)` divides the loss by the accumulation steps on every micro-batch,
  multiplies it by the fp16 loss scale and runs backward; it returns the divided loss.
  At stages 0/1 the micro-batches before the boundary accumulate locally (no
  communication, like DeepSpeed's stage 0/1); at stage 2 every micro-batch is reduced,
  one equal reduce-scatter per bucket, as DeepSpeed's stage 2 reduces every micro-batch.
* `step()` counts a micro-step; at a boundary (`(micro_steps + 1) % gas == 0`) it clips,
  unscales and steps (`evenzero.deepspeed.boundary`), zeroes the gradients, steps the LR
  schedule unless the step overflowed, and advances `global_steps`/`global_samples`
  (also on overflow, as DeepSpeed does).

The module, optimizer and data loader are set up in `evenzero.deepspeed.setup`.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from evenzero.deepspeed.boundary import StepPolicy, boundary_step
from evenzero.deepspeed.config import EngineConfig
from evenzero.deepspeed.engine_optimizer import EngineOptimizer, drop_local_grads
from evenzero.deepspeed.launch import Placement
from evenzero.deepspeed.log import logger
from evenzero.deepspeed.refusals import unsupported as refusal
from evenzero.runtime.shardedgrad import ShardedGrad


class DeepSpeedEngine(torch.nn.Module):
    """Built by `evenzero.deepspeed.initialize`; see the module docstring."""

    def __init__(self, module: torch.nn.Module, config: EngineConfig, place: Placement,
                 optimizer: EngineOptimizer | None, lr_scheduler: Any,
                 training_dataloader: Any, policy: StepPolicy, optimizer_name: str | None,
                 moe_layers: int = 0, num_experts: list[int] | None = None) -> None:
        super().__init__()
        self._modules["module"] = module
        self.__dict__["module"] = module
        self.__dict__["_config"] = config
        self.config = dict(config.raw)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self._policy = policy
        self._optimizer_name = optimizer_name
        self.local_rank, self.global_rank = place.local_rank, place.global_rank
        self.world_size = self.dp_world_size = place.world_size
        self.mp_world_size = 1
        self.device = place.device
        self.has_moe_layers = moe_layers > 0
        self.num_experts = list(num_experts or [])
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._step_applied = False
        self._global_grad_norm: Any = None
        self._is_gradient_accumulation_boundary: bool | None = None
        self._in_engine_backward = False
        self._manual_backward_expected = False
        self.inside_no_sync_ctxt = False
        self._coalescing = False
        self._running_step = False
        self._is_compiled = False
        self.sparse_tensor_module_names: set[str] = set()
        """DeepSpeed's modules with sparse gradients (`sparse_gradients`): none here."""
        if self.optimizer is not None:
            self._report_progress(0)

    # ------------------------------------------------------------------ config accessors

    def train_batch_size(self) -> int:
        return self._config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def zero_optimization(self) -> bool:
        return self._config.zero.stage > 0

    def zero_optimization_stage(self) -> int:
        return self._config.zero.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self._config.zero.stage >= 2

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer is offloaded to the host (`offload_optimizer.device: cpu`)."""
        return self._config.zero.offload_optimizer == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return self.zero_cpu_offload()

    def fp16_enabled(self) -> bool:
        return self._config.precision.fp16

    def bfloat16_enabled(self) -> bool:
        return self._config.precision.bf16

    def fp16_auto_cast(self) -> bool:
        return self._config.precision.auto_cast

    def dynamic_loss_scale(self) -> bool:
        return self._config.precision.dynamic_loss_scale

    def loss_scale(self) -> float:
        return self._config.precision.loss_scale

    def gradient_clipping(self) -> float:
        return self._policy.clip

    def tag_validation(self) -> str:
        """checkpoint.tag_validation: WARN (DeepSpeed's default), IGNORE or FAIL."""
        return self._config.tag_validation

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.tag_validation != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.tag_validation == "FAIL"

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def optimizer_name(self) -> str | None:
        return self._optimizer_name

    def scheduler_name(self) -> str | None:
        return self._config.scheduler.type if self._config.scheduler else None

    def communication_data_type(self) -> torch.dtype:
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        if self._config.communication_data_type:
            return names[self._config.communication_data_type]
        return torch.float16 if self.fp16_enabled() else (
            torch.bfloat16 if self.bfloat16_enabled() else torch.float32)

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def get_model_parallel_rank(self) -> int:
        return 0

    # ------------------------------------------------------------------ optimizer state

    @property
    def zero(self) -> Any:
        """The `evenzero.ZeroOptimizer` (plan, trace, memory_report, ...)."""
        return self.optimizer.zero if self.optimizer is not None else None

    def get_lr(self) -> list:
        return self._optimizer_param("lr")

    def get_mom(self) -> list:
        if self._optimizer_name in ("SGD", "RMSprop"):
            return self._optimizer_param("momentum")
        return self._optimizer_param("betas")

    def _optimizer_param(self, key: str) -> list:
        if self.optimizer is None:
            return []
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Any:
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ------------------------------------------------------------------ forward / backward

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.training = mode
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.fp16_auto_cast():
            inputs = _cast_half(inputs)
        out = self.module(*inputs, **kwargs)
        if self.optimizer is not None and torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._output_grad)
        return out

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A backward through this forward's outputs that `engine.backward` did not start:
        divide by the accumulation steps, as DeepSpeed's output hooks do."""
        if self._in_engine_backward:
            return grad
        if self.dynamic_loss_scale() and not self._manual_backward_expected:
            raise RuntimeError("Loss scaling is required for this configuration, but backward() "
                               "was called directly without scaling the loss. Please use one of "
                               "the following: 1. engine.backward(loss) 2. "
                               "engine.scale(loss).backward()")
        return grad * (self._reduce_factor() / self.gradient_accumulation_steps())

    def _reduce_factor(self) -> float:
        """What the data-parallel mean is multiplied by: the world size for
        `gradient_allreduce_op: "sum"` (a sum is the mean times the ranks), else 1."""
        return float(self.dp_world_size) if self._config.gradient_allreduce_op == "sum" else 1.0

    def managed_gradient_accumulation(self) -> bool:
        return self._config.managed_gradient_accumulation

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the fp16 loss scale, for `engine.scale(loss).backward()`."""
        self.require_optimizer("scale")
        _check_loss(loss)
        self._manual_backward_expected = True
        return self.zero.scale_loss(loss)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        self.require_optimizer("backward")
        _check_loss(loss)
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        gas_scaled = loss
        factor = self._reduce_factor()
        scaled = self.zero.scale_loss(loss * factor if factor != 1.0 else loss)
        # Unmanaged accumulation has no boundary before step(); each backward reduces into
        # the shards (the sum of reduced micro-batches is the reduced sum DeepSpeed's step
        # computes at stages 0/1).
        local = (self.inside_no_sync_ctxt or
                 (self._config.zero.stage < 2 and self.managed_gradient_accumulation()
                  and not self.is_gradient_accumulation_boundary()))
        self._in_engine_backward = True
        try:
            if local and not self.inside_no_sync_ctxt:
                with self.zero.no_sync():
                    scaled.backward(retain_graph=retain_graph)
            else:
                scaled.backward(retain_graph=retain_graph)
        finally:
            self._in_engine_backward = False
        return gas_scaled

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate without communication (stages 0 and 1)."""
        if self.zero_optimization_partition_gradients():
            raise AssertionError(f"no_sync context manager is incompatible with gradient "
                                 f"partitioning logic of ZeRO stage {self._config.zero.stage}")
        if self.inside_no_sync_ctxt:
            raise AssertionError("no_sync context manager reentry is unsupported")
        self.inside_no_sync_ctxt = True
        try:
            with self.zero.no_sync():
                yield
        finally:
            self.inside_no_sync_ctxt = False

    # ------------------------------------------------------------------ step

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        if not self.managed_gradient_accumulation():
            # The caller owns the boundary: it is step() (deepspeed/runtime/engine.py@0.19.8:3456).
            return self._running_step
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        if not self.managed_gradient_accumulation():
            raise AssertionError("set_gradient_accumulation_boundary() is not supported with "
                                 "managed_gradient_accumulation=False; the caller owns the "
                                 "boundary by calling step()")
        self._is_gradient_accumulation_boundary = is_boundary

    @contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed's one-reduction-per-step context (deepspeed/runtime/engine.py@0.19.8:
        3239): backwards inside accumulate locally; leaving it reduces what they left, once,
        for the next `step()`, which must not run inside."""
        if not self.managed_gradient_accumulation():
            raise AssertionError("coalesce_grad_reduction is not supported with "
                                 "managed_gradient_accumulation=False; the caller already owns "
                                 "the accumulation boundary via step()")
        self.require_optimizer("coalesce_grad_reduction")
        if self._config.zero.stage not in (1, 2):
            raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got "
                                      f"stage {self._config.zero.stage}")
        if self.inside_no_sync_ctxt:
            raise AssertionError("coalesce_grad_reduction cannot be nested inside another "
                                 "no_sync context")
        self.inside_no_sync_ctxt = True
        self._coalescing = True
        try:
            with self.zero.no_sync():
                yield
        finally:
            self.inside_no_sync_ctxt = False
            self._coalescing = False
        self._reduce_local_grads()

    def _reduce_local_grads(self) -> None:
        """Reduce the gradients that backwards under `no_sync` left in `param.grad`: a
        backward through zeros fires each parameter's reduction on `grad + 0`, which is the
        accumulated gradient bit for bit."""
        params = [p for p in self.module.parameters()
                  if p.requires_grad and p.grad is not None and not isinstance(p.grad, ShardedGrad)]
        if not params:
            return
        zero = sum((p * 0).sum() for p in params)
        self._in_engine_backward = True
        try:
            self.zero.scale_loss(zero).backward()
        finally:
            self._in_engine_backward = False

    def empty_partition_cache(self) -> None:
        """ZeRO-3 frees its gathered-parameter cache here; at stages 1 and 2 nothing is
        partitioned, so only the allocator's cache is released (as DeepSpeed does too)."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def zero_grad(self) -> None:
        """Drop the parameters' local gradients (DeepSpeed's `engine.zero_grad`), frozen
        ones included; reduced shards are kept (`drop_local_grads`)."""
        drop_local_grads(self.module.parameters())

    def step(self, lr_kwargs: dict | None = None) -> None:
        if self.inside_no_sync_ctxt:
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context "
                                 "manager")
        self.require_optimizer("step")
        self._step_applied = False
        self._running_step = True
        try:
            if self.is_gradient_accumulation_boundary():
                self._take_model_step(lr_kwargs)
        finally:
            self._running_step = False
        self._manual_backward_expected = False
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict | None) -> None:
        outcome = boundary_step(self.zero, self.optimizer.loss_scaler, self._policy,
                                self.global_steps + 1)
        self.zero.zero_grad()
        self.optimizer.overflow = outcome.overflow
        self._step_applied = not outcome.overflow
        if not self._policy.stage0:
            self._global_grad_norm = (float("inf") if outcome.overflow
                                      else torch.tensor(outcome.norm, dtype=torch.float32))
        if outcome.overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            try:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            except TypeError:
                # deepspeed/runtime/engine.py@0.19.8:3546: Megatron-style schedules
                self.lr_scheduler.step(self.train_batch_size())
        spp = self.steps_per_print()
        if spp is not None and (self.global_steps + 1) % spp == 0:
            self._report_progress(self.global_steps + 1)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._record_param_steps()

    def _report_progress(self, step: int) -> None:
        if self.global_rank == 0:
            logger.info("step=%s, skipped=%s, lr=%s, mom=%s", step, self.skipped_steps,
                        self.get_lr(), self.get_mom())

    def require_optimizer(self, what: str) -> None:
        """DeepSpeed's assertion for calls that need the optimizer (its engine's wording)."""
        if self.optimizer is None:
            raise AssertionError(f"must provide optimizer during init in order to use {what}")

    def restore_gradient_clipping(self, clip: float) -> None:
        """A ZeRO checkpoint's `clip_grad` replaces the config's, as DeepSpeed's load does
        (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:3667-3793)."""
        self._policy = dataclasses.replace(self._policy, clip=float(clip))

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        from evenzero.deepspeed.engine_checkpoint import save_engine

        return save_engine(self, save_dir, tag, client_state or {}, save_latest,
                           exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The module's weights in their training dtype, one file written by rank 0
        (DeepSpeed's `save_16bit_model`; at stages 1 and 2 every rank holds them whole).
        Every rank calls it."""
        import os

        import torch.distributed as dist

        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        if not dist.is_initialized() or dist.get_rank() == 0:
            state = {k: v.detach().cpu() for k, v in self.module.state_dict().items()
                     if not (exclude_frozen_parameters and k in frozen)}
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        if dist.is_initialized():
            dist.barrier()
        return True

    save_fp16_model = save_16bit_model

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None):
        from evenzero.deepspeed.engine_checkpoint import load_engine

        out = load_engine(self, load_dir, tag, load_module_strict, load_optimizer_states,
                          load_lr_scheduler_states, load_module_only, custom_load_fn)
        self._record_param_steps()
        return out

    def _record_param_steps(self) -> None:
        """Give each parameter the optimizer's `step` in the inner optimizer's `state`, where
        DeepSpeed's tests and users read it (`optimizer.optimizer.state[p]["step"]`). The
        sharded optimizer keeps one step per shard piece; every piece steps together, so
        the count of applied steps is every parameter's."""
        if self.optimizer is None:
            return
        applied = self.global_steps - self.skipped_steps
        state = self.optimizer.optimizer.state
        for group in self.optimizer.optimizer.param_groups:
            for p in group["params"]:
                if applied > 0 and p.requires_grad:
                    state[p]["step"] = torch.tensor(float(applied))

    # ------------------------------------------------------------------ module passthrough

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped module, as DeepSpeed's engine passes them through."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if module is not None:
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(f"'{type(self).__name__}' object has no attribute "
                                 f"'{name}'") from None

    def destroy(self) -> None:
        """Nothing to release (DeepSpeed frees its buffers here)."""

    # ------------------------------------------------------------------ torch.compile

    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's `engine.compile` (deepspeed/runtime/engine.py@0.19.8:5859): compiles the
        wrapped module in place (`module.compile(backend=..., **compile_kwargs)`), once;
        Accelerate calls it when a dynamo backend is configured. The gradient hooks that
        reduce the buckets sit on the parameters, outside the compiled graph. DeepCompile
        schedules and compiled autograd are refused by name."""
        if schedule is not None:
            raise refusal("engine.compile(schedule=...)", "DeepCompile schedules are not "
                          "supported")
        if compiled_autograd_enabled:
            raise refusal("engine.compile(compiled_autograd_enabled=True)",
                          "compiled autograd would trace the gradient-reduction hooks")
        if self._is_compiled:
            return
        if backend is None:
            from evenzero.deepspeed.accelerator import get_accelerator

            backend = get_accelerator().get_compile_backend()
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            logger.warning("The `backend` in `compile_kwargs` will be overridden. Use the "
                           "`backend` argument instead.")
        kwargs["backend"] = backend
        self.module.compile(**kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled


def _check_loss(loss: Any) -> None:
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None):
        raise AssertionError("loss must be a scalar tensor. If you need to pass output "
                             "gradients, backward() of output tensors")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _cast_half(value: Any) -> Any:
    """fp16 `auto_cast`: floating inputs to half (deepspeed/runtime/engine.py@0.19.8:3039)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_half(v) for v in value)
    if isinstance(value, dict):
        return {k: _cast_half(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.half()
    return value

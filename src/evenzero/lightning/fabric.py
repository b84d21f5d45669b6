"""`Fabric(strategy="evenzero")`: Fabric's DDP strategy with a `ZeroOptimizer`.

    fabric = Fabric(accelerator="cpu", devices=2, strategy="evenzero")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    with fabric.no_backward_sync(model, enabled=accumulating):
        fabric.backward(loss)                        # opt.scale_loss(loss).backward()
    fabric.clip_gradients(model, optimizer, max_norm=1.0)   # opt.clip_grad_norm_
    optimizer.step(); optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})

From Fabric's DDPStrategy (lightning/fabric/strategies/ddp.py@2.6.6) it keeps the launch,
process group, ranks and collectives. The module and its optimizer are set up together
(`fabric.setup(model, optimizer)`, optionally `scheduler=`): the optimizer becomes a
`ZeroOptimizer` of the same class and groups, which `fabric.setup` returns, and the
scheduler is re-bound to it. `fabric.setup_module` alone (inference) broadcasts rank 0's
weights, as DDP's wrapper would, and wraps nothing.

`fabric.save` / `fabric.load` of a state holding the set-up model and its optimizer write
and read a sharded directory (`evenzero.lightning.checkpoint`) at any world size; the
other entries (step counters, RNG states, other modules' and stateful objects' state
dicts) go into it without pickle. Single-file checkpoints (Fabric's DDP format, or
saves without an evenzero optimizer) keep Fabric's own behaviour.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from evenzero.checkpoint import CheckpointError
from evenzero.lightning import checkpoint as lckpt
from evenzero.lightning.agreement import raise_on_every_rank
from evenzero.lightning.optimizer import (
    conversion_problem,
    repoint_schedulers,
    unwrap_optimizer,
    zero_optimizer_from,
)
from evenzero.lightning.options import STRATEGY_NAMES, zero_config, zero_options
from evenzero.lightning.precision import CLIP_BY_VALUE_REFUSED
from evenzero.runtime import ZeroConfigError, ZeroOptimizer


class NoSyncControl:
    """Fabric's `no_backward_sync` for the strategy's module: `opt.no_sync()`."""

    def __init__(self, strategy: FabricStrategyMixin) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        zero = self._strategy.zero_optimizer
        if not enabled or zero is None:
            return nullcontext()
        if module is not self._strategy.zero_module:
            raise TypeError("fabric.no_backward_sync(module): the evenzero strategy controls the "
                            "module that was set up together with its optimizer; pass that one")
        return zero.no_sync()


class FabricStrategyMixin:
    """The evenzero Fabric strategy's behaviour over Fabric's DDPStrategy."""

    precision_wrapper: type
    base_arguments = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                      "precision", "process_group_backend", "timeout", "start_method")

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        base = {k: kwargs.pop(k) for k in self.base_arguments if k in kwargs}
        self._zero_options = zero_options(config, kwargs, type(self).__name__)
        self._zero: ZeroOptimizer | None = None
        self._zero_module: torch.nn.Module | None = None
        super().__init__(**base)
        self._backward_sync_control = NoSyncControl(self)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (params, description) in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=description, override=True,
                                       **params)

    @property
    def zero_optimizer(self) -> ZeroOptimizer | None:
        return self._zero

    @property
    def zero_module(self) -> torch.nn.Module | None:
        return self._zero_module

    @property
    def precision(self) -> Any:
        if self._precision is None:
            self._precision = self.precision_wrapper(self.precision_wrapper.known_plugins[0]())
        return self._precision

    @precision.setter
    def precision(self, plugin: Any) -> None:
        if plugin is not None and not isinstance(plugin, self.precision_wrapper):
            plugin = self.precision_wrapper(plugin)
        self._precision = plugin

    # ------------------------------------------------------------------ setup

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[Any],
                                    scheduler: Any = None) -> tuple[Any, list[Any], Any]:
        problem = None
        if len(optimizers) != 1:
            problem = (f"fabric.setup() got {len(optimizers)} optimizers; the evenzero strategy "
                       f"shards one optimizer per model: use one optimizer with a param group "
                       f"per part")
        else:
            problem = conversion_problem(module, unwrap_optimizer(optimizers[0]))
        raise_on_every_rank(problem)
        if self._zero is not None:
            self._zero.close()
        user = unwrap_optimizer(optimizers[0])
        plugin = self.precision
        config = zero_config(self._zero_options, plugin.precision, plugin.grad_scaler)
        zero = zero_optimizer_from(module, user, config)
        if scheduler is not None:
            repoint_schedulers([scheduler], user, zero)
        self._zero, self._zero_module = zero, module
        plugin.zero = zero
        return module, [zero], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Inference: rank 0's parameters and buffers everywhere (DDP's construction), no
        wrapper."""
        if dist.is_available() and dist.is_initialized():
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    # gloo moves no bools
                    carrier = t.data.to(torch.uint8) if t.dtype == torch.bool else t.data
                    dist.broadcast(carrier, 0)
                    if carrier is not t.data:
                        t.data.copy_(carrier)
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        raise NotImplementedError(self._err_msg_joint_setup_required())

    # ------------------------------------------------------------------ clipping

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        return self.precision.clip_by_norm(optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: Any,
                             clip_val: float) -> None:
        raise ZeroConfigError(CLIP_BY_VALUE_REFUSED)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict | None = None) -> None:  # noqa: A002 - Fabric's name
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is "
                            f"not supported: sharded checkpoints are written by evenzero")
        if self._zero is None or not isinstance(state, dict):
            return super().save_checkpoint(path, state, storage_options, filter)
        problem = None
        try:
            keys = self._own_keys(state, "fabric.save")
        except ZeroConfigError as e:
            keys, problem = None, str(e)
        if filter:
            problem = problem or ("fabric.save(..., filter=...) is not supported with the evenzero "
                                  "strategy: the model and optimizer are saved as whole shards")
        raise_on_every_rank(problem)
        rest = {k: _state_of(v) for k, v in state.items() if k not in keys}
        aside = None
        where, problem = lckpt.local_path(path)
        if self.global_rank == 0 and problem is None:
            aside, problem = lckpt.prepare(where)
        where, problem = self.broadcast((str(where), problem))
        if problem:
            raise CheckpointError(problem)
        extra = {"fabric": {"model": keys[0], "optimizer": keys[1], "state": rest}}
        lckpt.save(self._zero, Path(where), lckpt.with_module_extra(extra, self._zero_module))
        if aside is not None:
            aside.unlink(missing_ok=True)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        where, problem = lckpt.local_path(self.broadcast(str(path)))
        if problem:
            raise CheckpointError(problem)
        if not lckpt.is_sharded(where):
            return super().load_checkpoint(path, state, strict, weights_only)
        if self._zero is None:
            raise CheckpointError(f"{where} is an evenzero sharded checkpoint; set up the model "
                                  f"together with its optimizer (fabric.setup(model, optimizer)) "
                                  f"before loading it")
        if not isinstance(state, dict) or not state:
            raise CheckpointError(f"fabric.load({str(where)!r}) of an evenzero sharded checkpoint "
                                  f"needs the state to restore: fabric.load(path, {{'model': model, "
                                  f"'optimizer': optimizer, ...}})")
        self._own_keys(state, "fabric.load")
        extra = lckpt.load(self._zero, where)
        lckpt.restore_module_extra(extra, self._zero_module)
        saved = lckpt.section(extra, "fabric", where)
        rest = dict(saved["state"])
        own = {saved["model"], saved["optimizer"]}
        wanted = [k for k in state if k not in own and unwrap_optimizer(state[k]) is not self._zero
                  and state[k] is not self._zero_module]
        missing = [k for k in wanted if k not in rest]
        if strict and missing:
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist "
                           f"in the loaded checkpoint. To disable strict loading, set "
                           f"`strict=False`.")
        for key in wanted:
            if key not in rest:
                continue
            obj = state[key]
            if isinstance(obj, torch.nn.Module):
                self.load_module_state_dict(obj, rest.pop(key), strict=strict)
            elif hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
                obj.load_state_dict(rest.pop(key))
            else:
                state[key] = rest.pop(key)
        return rest

    def _own_keys(self, state: dict[str, Any], what: str) -> tuple[str, str]:
        """The keys of the set-up model and its optimizer in `state` (both required)."""
        model = [k for k, v in state.items() if v is self._zero_module]
        optim = [k for k, v in state.items() if unwrap_optimizer(v) is self._zero]
        if len(model) != 1 or len(optim) != 1:
            raise ZeroConfigError(
                f"{what}: the state must hold the model set up with the evenzero strategy and its "
                f"optimizer, once each (found the model under {model}, the optimizer under "
                f"{optim}): their shards are one checkpoint, so they are saved and restored "
                f"together")
        return model[0], optim[0]


def _state_of(value: Any) -> Any:
    """What Fabric saves for an entry that is not the sharded model or optimizer."""
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        return value.state_dict()
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return value.state_dict()
    return value

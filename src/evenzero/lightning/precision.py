"""Lightning's precision plugins, with the backward, clipping and step going through the
`ZeroOptimizer`.

The strategy wraps whatever plugin Lightning picked for `precision=` (Precision,
HalfPrecision, MixedPrecision, DoublePrecision). The module side stays that plugin's:
converting the module to bf16/fp16/fp64, the init contexts, autocast around forward,
input and output casts. The gradient side is evenzero's:

* backward runs on `opt.scale_loss(loss)`: with fp16 that is the optimizer's dynamic
  loss scale (the optimizer refuses a step after an unscaled backward), otherwise the
  loss itself. MixedPrecision's torch GradScaler is not used: it would unscale and
  check `p.grad`, which after a synchronised backward is a `ShardedGrad` placeholder;
  `opt.step()` unscales the reduced shards and skips the step on overflow instead;
* clipping by norm is `opt.clip_grad_norm_(max_norm)`, the global norm over every rank's
  shard (what torch's clip computes over DDP's full gradients). Clipping by value is
  refused: it would need the gradient elements, which each rank holds 1/N of;
* the plugin has no state of its own to checkpoint: the loss scale is saved with the
  optimizer's shards.

Lightning's MixedPrecision plugin does the same dance around its GradScaler
(lightning/pytorch/plugins/precision/amp.py@2.6.6:67-99): run the closure, skip the step
when the closure skipped backward, else step.

`TrainerPrecisionMixin` / `FabricPrecisionMixin` hold the behaviour; the concrete classes
(`lightning` and standalone packages) add the package's Precision base class.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any

import torch

from evenzero.lightning.optimizer import unwrap_optimizer
from evenzero.lightning.options import SUPPORTED_PRECISIONS
from evenzero.runtime import ZeroConfigError, ZeroOptimizer

CLIP_BY_VALUE_REFUSED = (
    "gradient clipping by value (gradient_clip_algorithm='value' / clip_val=) is not supported "
    "by the evenzero strategy: after the backward each rank holds only its 1/N shard of the "
    "reduced gradients. Clip by norm instead (gradient_clip_val=... with the default "
    "gradient_clip_algorithm='norm', or fabric.clip_gradients(..., max_norm=...)), which "
    "evenzero computes over all ranks")


class PrecisionWrapper:
    """The parts shared by the Trainer and Fabric plugins."""

    known_plugins: tuple[type, ...] = ()
    """The package's own plugin classes this wrapper may hold (set by concrete classes)."""

    def __init__(self, inner: Any) -> None:
        if type(inner) not in self.known_plugins or inner.precision not in SUPPORTED_PRECISIONS:
            names = ", ".join(c.__name__ for c in self.known_plugins)
            raise ZeroConfigError(
                f"the evenzero strategy does not support the precision plugin "
                f"{type(inner).__name__} (precision={inner.precision!r}); use precision= one of "
                f"{list(SUPPORTED_PRECISIONS)} (Lightning's {names})")
        self.inner = inner
        self.precision = inner.precision
        self.zero: ZeroOptimizer | None = None
        """Set by the strategy once it has built the optimizer."""

    @property
    def grad_scaler(self) -> Any:
        """The torch GradScaler Lightning configured (16-mixed), read for its schedule."""
        return getattr(self.inner, "scaler", None)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.inner.convert_module(module)

    def tensor_init_context(self) -> AbstractContextManager:
        return self.inner.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.inner.module_init_context()

    def forward_context(self) -> AbstractContextManager:
        return self.inner.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def teardown(self) -> None:
        self.inner.teardown()

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.zero.scale_loss(tensor) if self.zero is not None else tensor

    def _managed(self, optimizer: Any) -> ZeroOptimizer | None:
        zero = unwrap_optimizer(optimizer)
        return zero if isinstance(zero, ZeroOptimizer) else None

    def clip_by_norm(self, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False) -> torch.Tensor:
        """The global gradient norm before clipping; gradients scaled to `max_norm`."""
        zero = self._managed(optimizer)
        if zero is None:
            raise ZeroConfigError(f"clipping gradients of a {type(optimizer).__name__}: the "
                                  f"evenzero strategy clips the optimizer it built from the "
                                  f"one you passed; clip that one")
        norm = zero.clip_grad_norm_(max_norm, norm_type)
        # As torch's clip_grad_norm_(error_if_nonfinite=True); an fp16 overflow is not an
        # error there: the loss scale backs off and the step is skipped.
        if error_if_nonfinite and not zero.loss_scaler.enabled and not math.isfinite(float(norm)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                               f"`parameters` is non-finite, so it cannot be clipped. To disable "
                               f"this error and scale the gradients by the non-finite norm "
                               f"anyway, set `error_if_nonfinite=False`")
        return norm


class TrainerPrecisionMixin(PrecisionWrapper):
    """The Trainer's plugin (lightning.pytorch.plugins.precision.Precision API)."""

    # pre_backward is the base class's: the on_before_backward hooks, and no GradScaler.

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        model.backward(self._scaled(tensor), *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        if self._managed(optimizer) is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = self._wrap_closure(model, optimizer, closure)
        if model.automatic_optimization and closure_result is None:
            # training_step returned None: no backward, and torch's step without
            # gradients changes nothing. Every rank must skip together, as under DDP.
            return None
        return optimizer.step(**kwargs)

    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0,
                       gradient_clip_algorithm: Any = "norm") -> None:
        if clip_val is None or clip_val <= 0:
            return
        if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
            raise ZeroConfigError(CLIP_BY_VALUE_REFUSED)
        self.clip_by_norm(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.clip_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        raise ZeroConfigError(CLIP_BY_VALUE_REFUSED)


class FabricPrecisionMixin(PrecisionWrapper):
    """Fabric's plugin (lightning.fabric.plugins.precision.Precision API); its step is the
    base class's `optimizer.step()`."""

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        self._scaled(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        return None  # the reduced shards are unscaled already

"""`Trainer(strategy="evenzero")`: Lightning's DDP strategy with a `ZeroOptimizer`
instead of the DistributedDataParallel wrapper.

From DDPStrategy (lightning/pytorch/strategies/ddp.py@2.6.6) it keeps the launch, the
process group, ranks, samplers, barrier, broadcast and reduce. What changes, at the
points Lightning offers for it:

* `configure_ddp`: nothing is wrapped; the module's own hooks (installed by the
  optimizer) reduce the gradients, one equal reduce-scatter per bucket;
* `setup_optimizers`: `configure_optimizers()` runs as usual, then its optimizer becomes
  a `ZeroOptimizer` of the same class, groups and options, and its LR schedulers are
  re-bound to it (`evenzero.lightning.optimizer`). One optimizer per model;
* `training_step` goes through the module's `__call__` (Lightning's forward redirection,
  as DDP does), so the optimizer's forward hooks see each training forward;
* `block_backward_sync` (gradient accumulation) is `opt.no_sync()`;
* precision, clipping and the step: `evenzero.lightning.precision`;
* checkpoints are sharded directories at any world size
  (`evenzero.lightning.checkpoint`): `save_checkpoint`, and `load_checkpoint` after
  setup (`restore_checkpoint_after_setup`), which loads the optimizer and the weights
  itself (`lightning_restore_optimizer` is False for them). A single-file checkpoint
  (from `strategy="ddp"`, or a weights-only save) loads too, optimizer state included.

`TrainerStrategyMixin` holds all of it; `EvenZeroStrategy` adds the DDPStrategy of the
`lightning` package (`evenzero.lightning.unified`) or of the standalone
`pytorch_lightning` package (`evenzero.lightning.standalone`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from evenzero.checkpoint import CheckpointError, load_consolidated_state_dict
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

FIT = "fit"
"""`TrainerFn.FITTING`'s value (a str enum in both Lightning packages)."""


class TrainerStrategyMixin:
    """The evenzero Trainer strategy's behaviour over Lightning's DDPStrategy."""

    precision_wrapper: type
    """The package's `EvenZeroPrecision` (set by the concrete class)."""
    mock_optimizer: type | None = None
    """The package's `_MockOptimizer` (configure_optimizers returned None)."""
    base_arguments = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                      "precision_plugin", "process_group_backend", "timeout", "start_method")

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        base = {k: kwargs.pop(k) for k in self.base_arguments if k in kwargs}
        self._zero_options = zero_options(config, kwargs, type(self).__name__)
        self._zero: ZeroOptimizer | None = None
        self._restore_optimizer_from_file = False
        super().__init__(**base)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (params, description) in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=description, override=True,
                                       **params)

    @property
    def zero_optimizer(self) -> ZeroOptimizer | None:
        """The `ZeroOptimizer` being trained (None before fit's setup)."""
        return self._zero

    # ------------------------------------------------------------------ precision

    @property
    def precision_plugin(self) -> Any:
        if self._precision_plugin is None:
            self._precision_plugin = self.precision_wrapper(self.precision_wrapper.known_plugins[0]())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if plugin is not None and not isinstance(plugin, self.precision_wrapper):
            plugin = self.precision_wrapper(plugin)
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ setup

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == FIT:
            algorithm = trainer.gradient_clip_algorithm
            value = str(getattr(algorithm, "value", algorithm))
            if trainer.gradient_clip_val and value == "value":
                raise ZeroConfigError(f"Trainer(gradient_clip_algorithm='value'): "
                                      f"{CLIP_BY_VALUE_REFUSED}")
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: the ZeroOptimizer's hooks on the module
        reduce the gradients."""

    def setup_optimizers(self, trainer: Any) -> None:
        self._close_zero()
        super().setup_optimizers(trainer)
        optimizers = [o for o in self.optimizers
                      if self.mock_optimizer is None or not isinstance(o, self.mock_optimizer)]
        module = self.lightning_module
        problem = None
        if len(optimizers) > 1:
            problem = (f"configure_optimizers() returned {len(optimizers)} optimizers; the "
                       f"evenzero strategy shards one optimizer per model. Use one optimizer "
                       f"with a param group per part (each group keeps its own options), or "
                       f"strategy='ddp'")
        elif optimizers:
            problem = conversion_problem(module, unwrap_optimizer(optimizers[0]))
        raise_on_every_rank(problem)
        if not optimizers:
            return  # no optimizer: nothing to shard (Lightning trains without a step)
        user = unwrap_optimizer(optimizers[0])
        plugin = self.precision_plugin
        config = zero_config(self._zero_options, plugin.precision, plugin.grad_scaler)
        zero = zero_optimizer_from(module, user, config)
        repoint_schedulers([c.scheduler for c in self.lr_scheduler_configs], user, zero)
        self._zero = plugin.zero = zero
        self.optimizers = [zero]

    def _close_zero(self) -> None:
        """Release the module from a previous fit's optimizer, so a new one may be built."""
        if self._zero is not None:
            self._zero.close()
        self._zero = None
        if self._precision_plugin is not None:
            self._precision_plugin.zero = None

    # ------------------------------------------------------------------ training

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._zero is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        with self.precision_plugin.train_step_context():
            # Through module.__call__, so the optimizer's forward hooks run: they settle a
            # backward that raised on this rank and time the forward for the bucket size.
            return self._forward_redirection(module, module, "training_step", *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulation: backwards inside keep their gradients local (`opt.no_sync()`)."""
        if self._zero is None:
            yield None
            return
        with self._zero.no_sync():
            yield None

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self._restore_optimizer_from_file

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._zero is not None and unwrap_optimizer(optimizer) is self._zero:
            return {}  # saved as shards by save_checkpoint
        return super().optimizer_state(optimizer)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._zero is not None:
            self._zero.wait_for_params()
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is "
                            f"not supported: sharded checkpoints are written by evenzero, not by "
                            f"a CheckpointIO plugin")
        if self._zero is None or "optimizer_states" not in checkpoint:
            self._save_file(checkpoint, filepath)
            return
        path, problem = lckpt.local_path(filepath)
        aside = None
        if self.global_rank == 0 and problem is None:
            aside, problem = lckpt.prepare(path)
        where, problem = self.broadcast((str(path), problem))
        if problem:
            raise CheckpointError(problem)
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        extra = lckpt.with_module_extra({"lightning": state}, self.lightning_module)
        lckpt.save(self._zero, Path(where), extra)
        if aside is not None:
            aside.unlink(missing_ok=True)

    def _save_file(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """A regular Lightning file (weights only, or no optimizer), from rank 0, with
        rank 0's error raised everywhere instead of leaving the others at the barrier."""
        problem = None
        if self.global_rank == 0:
            try:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath)
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                problem = f"saving {filepath}: {type(e).__name__}: {e}"
        problem = self.broadcast(problem)
        if problem:
            raise CheckpointError(problem)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        path, problem = lckpt.local_path(self.broadcast(str(checkpoint_path)))
        if problem:
            raise CheckpointError(problem)
        self._restore_optimizer_from_file = False
        fitting = self.lightning_module.trainer.state.fn == FIT
        if not lckpt.is_sharded(path):
            if path.is_dir():
                raise CheckpointError(f"{path} is a directory but not an evenzero checkpoint (no "
                                      f"{lckpt.MARKER}); the evenzero strategy loads its own "
                                      f"checkpoint directories and single-file Lightning "
                                      f"checkpoints")
            loaded = super().load_checkpoint(path, weights_only)
            self._restore_optimizer_from_file = (fitting and self._zero is not None
                                                 and "optimizer_states" in loaded)
            return loaded
        if self._zero is not None:
            return self._load_sharded(path)
        return self._load_without_training(path)

    def _load_sharded(self, path: Path) -> dict:
        extra = lckpt.load(self._zero, path)
        lckpt.restore_module_extra(extra, self.lightning_module)
        return lckpt.section(extra, "lightning", path)

    def _load_without_training(self, path: Path) -> dict:
        """validate/test/predict from a sharded checkpoint, or fit without an optimizer:
        the shards are read through a ZeroOptimizer built as fit builds it, then
        released."""
        trainer = self.lightning_module.trainer
        try:
            self.setup_optimizers(trainer)
        except ZeroConfigError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"loading {path}: the weights of an evenzero checkpoint are read through the "
                f"optimizer that configure_optimizers() builds, and it raised "
                f"{type(e).__name__}: {e}") from e
        if self._zero is None:
            raise CheckpointError(f"loading {path}: configure_optimizers() returned no optimizer; "
                                  f"the weights of an evenzero checkpoint are read through it")
        try:
            return self._load_sharded(path)
        finally:
            self._close_zero()
            self._reset_optimizers_and_schedulers()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" not in checkpoint:
            return  # a sharded checkpoint: load_checkpoint() restored the weights
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """A single-file checkpoint's torch optimizer state (reached only for those)."""
        states = checkpoint["optimizer_states"]
        if len(states) != 1:
            raise CheckpointError(f"the checkpoint holds {len(states)} optimizer states; the "
                                  f"evenzero strategy trains one optimizer")
        zero = self._zero
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        order = [names[id(p)] for g in zero.param_groups for p in g["params"]]
        saved = states[0]

        def name(i: Any) -> Any:
            return order[i] if isinstance(i, int) and 0 <= i < len(order) else i

        by_name = {"state": {name(k): v for k, v in saved["state"].items()},
                   "param_groups": [{**g, "params": [name(i) for i in g["params"]]}
                                    for g in saved["param_groups"]]}
        load_consolidated_state_dict(zero, dict(checkpoint["state_dict"]), by_name)

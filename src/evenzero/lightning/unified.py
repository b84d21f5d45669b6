"""The evenzero strategies for the `lightning` package (lightning.pytorch, lightning.fabric)."""

from __future__ import annotations

from lightning.fabric.plugins import precision as fabric_precision
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins import precision as trainer_precision
from lightning.pytorch.strategies import DDPStrategy

from evenzero.lightning.fabric import FabricStrategyMixin
from evenzero.lightning.precision import FabricPrecisionMixin, TrainerPrecisionMixin
from evenzero.lightning.strategy import TrainerStrategyMixin


class EvenZeroPrecision(TrainerPrecisionMixin, trainer_precision.Precision):
    """Lightning's precision plugin for `precision=`, with evenzero's backward, clipping
    and step (`evenzero.lightning.precision`)."""

    known_plugins = (trainer_precision.Precision, trainer_precision.HalfPrecision,
                     trainer_precision.MixedPrecision, trainer_precision.DoublePrecision)


class EvenZeroStrategy(TrainerStrategyMixin, DDPStrategy):
    """`Trainer(strategy="evenzero")`; `EvenZeroStrategy(stage=1, bucket_numel=...)` takes
    any `evenzero.runtime.ZeroConfig` field (`evenzero.lightning.strategy`)."""

    precision_wrapper = EvenZeroPrecision
    mock_optimizer = _MockOptimizer


class EvenZeroFabricPrecision(FabricPrecisionMixin, fabric_precision.Precision):
    """Fabric's precision plugin for `precision=`, with evenzero's backward."""

    known_plugins = (fabric_precision.Precision, fabric_precision.HalfPrecision,
                     fabric_precision.MixedPrecision, fabric_precision.DoublePrecision)


class EvenZeroFabricStrategy(FabricStrategyMixin, FabricDDPStrategy):
    """`Fabric(strategy="evenzero")` (`evenzero.lightning.fabric`)."""

    precision_wrapper = EvenZeroFabricPrecision

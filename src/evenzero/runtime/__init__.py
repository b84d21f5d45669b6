"""The training engine: `ZeroOptimizer` executes a `Plan` with torch.distributed."""

from __future__ import annotations

from evenzero.runtime.checks import ZeroConfigError, ZeroRuntimeError
from evenzero.runtime.collectives import control_device
from evenzero.runtime.config import ELEMENTWISE_OPTIMIZERS, ZeroConfig
from evenzero.runtime.gradstats import GradStats
from evenzero.runtime.lifecycle import TrainingState
from evenzero.runtime.memory import MemoryReport
from evenzero.runtime.optimizer import ZeroOptimizer
from evenzero.runtime.precision import LossScaleConfig, LossScaler
from evenzero.runtime.stall import StalledRankError

__all__ = ["ELEMENTWISE_OPTIMIZERS", "GradStats", "LossScaleConfig", "LossScaler",
           "MemoryReport", "StalledRankError", "TrainingState", "ZeroConfig", "ZeroConfigError",
           "ZeroOptimizer", "ZeroRuntimeError", "control_device"]

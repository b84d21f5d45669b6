"""`import evenzero.lightning`: Lightning's Trainer and Fabric train with evenzero.

    import lightning as L
    import evenzero.lightning                  # registers strategy="evenzero"

    trainer = L.Trainer(accelerator="gpu", devices=8, strategy="evenzero")
    fabric = L.Fabric(accelerator="gpu", devices=8, strategy="evenzero")

Importing this module registers, in the Trainer's `StrategyRegistry` and in Fabric's
strategy registry, "evenzero" (ZeRO-2), "evenzero_stage_1" and "evenzero_stage_2". For
other settings pass an instance: `EvenZeroStrategy(stage=1, bucket_numel=2**22,
reduce_dtype=torch.bfloat16)` takes any `evenzero.runtime.ZeroConfig` field (as does
`EvenZeroFabricStrategy`). What each part does: `strategy` (Trainer), `fabric`,
`precision`, `optimizer` (the user's optimizer and schedulers), `checkpoint` (sharded
checkpoint directories).

Lightning comes as the `lightning` package (lightning.pytorch, lightning.fabric) and as
the standalone `pytorch_lightning` / `lightning_fabric` packages, separate class
hierarchies. The strategies are registered for `lightning` when it is installed, and for
the standalone packages when they are already imported (import them before this
module) or when `lightning` is not installed; their classes are in
`evenzero.lightning.standalone`. The module-level classes here are the `lightning`
package's when it is installed.

Nothing here is imported by `import evenzero`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


_UNIFIED = _installed("lightning")
_STANDALONE = _installed("pytorch_lightning") and _installed("lightning_fabric") and (
    not _UNIFIED or "pytorch_lightning" in sys.modules or "lightning_fabric" in sys.modules)
if not (_UNIFIED or _STANDALONE):
    raise ImportError("evenzero.lightning needs Lightning: pip install lightning==2.6.6 (or "
                      "pytorch-lightning==2.6.6)")

if _STANDALONE:
    from evenzero.lightning import standalone

    standalone.EvenZeroStrategy.register_strategies(
        importlib.import_module("pytorch_lightning.strategies").StrategyRegistry)
    standalone.EvenZeroFabricStrategy.register_strategies(
        importlib.import_module("lightning_fabric.strategies").STRATEGY_REGISTRY)

if _UNIFIED:
    from evenzero.lightning import unified

    unified.EvenZeroStrategy.register_strategies(
        importlib.import_module("lightning.pytorch.strategies").StrategyRegistry)
    unified.EvenZeroFabricStrategy.register_strategies(
        importlib.import_module("lightning.fabric.strategies").STRATEGY_REGISTRY)
    _classes = unified
else:
    _classes = standalone

EvenZeroStrategy = _classes.EvenZeroStrategy
EvenZeroPrecision = _classes.EvenZeroPrecision
EvenZeroFabricStrategy = _classes.EvenZeroFabricStrategy
EvenZeroFabricPrecision = _classes.EvenZeroFabricPrecision

__all__ = ["EvenZeroFabricPrecision", "EvenZeroFabricStrategy", "EvenZeroPrecision",
           "EvenZeroStrategy"]

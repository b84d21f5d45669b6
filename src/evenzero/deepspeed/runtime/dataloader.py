"""`deepspeed.runtime.dataloader`: `DeepSpeedDataLoader` and `RepeatingLoader`."""

from __future__ import annotations

from evenzero.deepspeed.dataloader import DeepSpeedDataLoader, RepeatingLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]

"""`deepspeed.runtime.engine`: where DeepSpeed defines `DeepSpeedEngine` (frameworks
import it from here for isinstance checks and type hints)."""

from __future__ import annotations

from evenzero.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]

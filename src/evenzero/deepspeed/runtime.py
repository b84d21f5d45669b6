"""`deepspeed.runtime`, as far as training scripts reach into it: the LR schedules
(`deepspeed.runtime.lr_schedules.WarmupLR`, ...) and the data loaders."""

from __future__ import annotations

from evenzero.deepspeed import dataloader, schedulers

lr_schedules = schedulers


def __getattr__(name: str):
    raise AttributeError(f"deepspeed.runtime.{name} is not provided by evenzero.deepspeed "
                         f"(only lr_schedules and dataloader are)")


__all__ = ["dataloader", "lr_schedules"]

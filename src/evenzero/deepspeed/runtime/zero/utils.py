"""`deepspeed.runtime.zero.utils`: the exception DeepSpeed's ZeRO raises on a ZeRO setting it
cannot run."""

from __future__ import annotations


class ZeRORuntimeException(Exception):
    """DeepSpeed's error for a ZeRO setting it cannot run (caught by scripts and tests)."""


__all__ = ["ZeRORuntimeException"]

"""`deepspeed.utils.torch`: DeepSpeed's torch-version checks."""

from __future__ import annotations

import torch


def _major_minor(version: str) -> float:
    major, minor = version.split("+")[0].split(".")[:2]
    return float(f"{int(major)}.{int(minor)}")


def required_torch_version(min_version: float | None = None,
                           max_version: float | None = None) -> bool:
    """Whether the running torch's major.minor lies in [min_version, max_version], compared
    as DeepSpeed does (deepspeed/utils/torch.py@0.19.8: a float of major.minor)."""
    current = _major_minor(torch.__version__)
    if min_version is not None and current < min_version:
        return False
    return not (max_version is not None and current > max_version)


def jit_script_compat(fn):
    """DeepSpeed's `torch.jit.script` wrapper; scripting is not needed here."""
    return fn


__all__ = ["jit_script_compat", "required_torch_version"]

"""`deepspeed.utils.z3_leaf_module`: marks modules that ZeRO-3 must gather as a whole. The
mark is DeepSpeed's attribute on the module (`_z3_leaf`), set and read here as DeepSpeed
does (deepspeed/utils/z3_leaf_module.py@0.19.8), so code that marks models for either
engine runs unchanged. At ZeRO stage 1 and 2 (all evenzero runs) it changes nothing: every
rank holds every parameter."""

from __future__ import annotations

import torch

LEAF_FLAG = "_z3_leaf"
"""DeepSpeed's attribute name for the mark (other libraries read it too)."""


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return bool(getattr(model, LEAF_FLAG, False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    setattr(model, LEAF_FLAG, flag)


def _matches(module: torch.nn.Module, leaf: type | str) -> bool:
    if isinstance(leaf, str):
        cls = type(module)
        return leaf in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    return isinstance(module, leaf)


def _set(model: torch.nn.Module, leaf_module_classes: list, flag: bool,
         raise_if_not_found: bool) -> list[torch.nn.Module]:
    marked = [m for m in model.modules() if any(_matches(m, c) for c in leaf_module_classes)]
    if not marked and raise_if_not_found:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {model}")
    for module in marked:
        set_z3_leaf_module(module, flag)
    return marked


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list,
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark the modules of the given classes (or class names) as leaves; returns them."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list,
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _set(model, leaf_module_classes, False, raise_if_not_found)


__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "z3_leaf_module"]

"""Python values as exact JSON: optimizer options, scalar state, the user's own state.

`encode_value` turns a tree of dict/list/tuple/str/int/float/bool/None and torch tensors
into JSON that `decode_value` turns back into the same types: tuples stay tuples (Adam's
betas), dicts with keys that are not strings keep them (a torch optimizer's `state`),
and tensors are either inlined (small ones, e.g. Adam's `step`) or handed to a `store`
callback that keeps them elsewhere (the user state's safetensors file) and leaves a
reference. Nothing here can execute code from a file: decoding only builds those types.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from evenzero.checkpoint.format import CheckpointError
from evenzero.spec import dtype_name

SMALL_TENSOR_NUMEL = 64
"""Tensors up to this size that are not shard-shaped (Adam's `step`) go into the JSON."""

TENSOR, TUPLE, DICT, STORED = "__tensor__", "__tuple__", "__dict__", "__stored__"
TAGS = frozenset({TENSOR, TUPLE, DICT, STORED})
"""A JSON object with exactly one of these keys is an encoded value, not a user dict."""

SCALARS = (str, int, float, bool, type(None))


def encode_value(value: Any, where: str = "value",
                 store: Callable[[Any, str], str] | None = None) -> Any:
    """`value` as JSON; `where` names it in errors (e.g. `extra['data']`).

    `store(tensor, where)` keeps a tensor elsewhere and returns its key; without it,
    tensors of up to SMALL_TENSOR_NUMEL elements are inlined and larger ones refused.
    """
    import torch

    if isinstance(value, SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        if store is not None:
            return {STORED: store(value, where)}
        if value.numel() > SMALL_TENSOR_NUMEL:
            raise CheckpointError(f"{where}: tensor of shape {list(value.shape)} is too large to "
                                  f"store as a scalar; only shard-shaped optimizer state is sharded")
        return {TENSOR: {"dtype": dtype_name(value.dtype),
                         "shape": list(value.shape),
                         "values": value.detach().cpu().flatten().tolist()}}
    if isinstance(value, tuple):
        return {TUPLE: [encode_value(v, f"{where}[{i}]", store) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{where}[{i}]", store) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and
                                                           next(iter(value)) in TAGS):
            return {k: encode_value(v, f"{where}[{k!r}]", store) for k, v in value.items()}
        for k in value:
            if not isinstance(k, SCALARS + (tuple,)):
                raise CheckpointError(f"{where}: dict key {k!r} of type {type(k).__name__} cannot "
                                      f"be stored; use str, int, float, bool, None or tuple keys")
        return {DICT: [[encode_value(k, f"{where} key {k!r}"),
                        encode_value(v, f"{where}[{k!r}]", store)] for k, v in value.items()]}
    kind = type(value)
    hint = ("; convert numpy values with .tolist() or torch.from_numpy()"
            if kind.__module__.split(".")[0] == "numpy" else "")
    raise CheckpointError(f"{where}: cannot store a value of type "
                          f"{kind.__module__}.{kind.__qualname__} in a checkpoint; use dict, "
                          f"list, tuple, str, int, float, bool, None or torch tensors{hint}")


def decode_value(value: Any, device: Any = None,
                 stored: Callable[[str], Any] | None = None) -> Any:
    """The value `encode_value` encoded; `stored(key)` gives back a stored tensor.

    Raises TypeError, ValueError or KeyError on JSON that `encode_value` cannot have
    written; callers name the file.
    """
    import torch

    if isinstance(value, list):
        return [decode_value(v, device, stored) for v in value]
    if not isinstance(value, dict):
        if not isinstance(value, SCALARS):
            raise TypeError(f"unexpected JSON value of type {type(value).__name__}")
        return value
    if len(value) == 1 and next(iter(value)) in TAGS:
        (tag, body), = value.items()
        if tag == TENSOR:
            dtype = getattr(torch, str(body["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown tensor dtype {body['dtype']!r} in manifest")
            out = torch.tensor(body["values"], dtype=dtype).reshape(body["shape"])
            return out if device is None else out.to(device)
        if tag == TUPLE:
            return tuple(decode_value(v, device, stored) for v in _list(body))
        if tag == DICT:
            return {_hashable(decode_value(k, device, stored)): decode_value(v, device, stored)
                    for k, v in _pairs(body)}
        if stored is None:
            raise ValueError("a stored-tensor reference where none is expected")
        return stored(str(body))
    return {k: decode_value(v, device, stored) for k, v in value.items()}


def _list(body: Any) -> list:
    if not isinstance(body, list):
        raise TypeError(f"expected a list, got {type(body).__name__}")
    return body


def _pairs(body: Any) -> list:
    pairs = _list(body)
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError("a dict must be stored as [key, value] pairs")
    return pairs


def _hashable(key: Any) -> Any:
    hash(key)  # raises TypeError for a key that no dict can hold
    return key


def non_finite(value: Any, where: str) -> str | None:
    """The first place in a decoded value holding NaN or infinity, or None."""
    import torch

    if isinstance(value, float):
        return None if math.isfinite(value) else where
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return where
        return None
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, Mapping):
        items = value.items()
    else:
        return None
    for k, v in items:
        found = non_finite(v, f"{where}[{k!r}]")
        if found:
            return found
    return None

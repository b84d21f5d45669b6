"""Model specs from the documented JSON format (`evenzero plan my_model.json`).

Files are read strictly (`evenzero.userjson`); every error is a `SpecError` that names
the offending field, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from evenzero.spec import (
    COMPUTE_KEYS,
    DENSE,
    DTYPE_BYTES,
    LAYERS,
    MAX_NUMEL,
    GroupSpec,
    ModelSpec,
    ParamSpec,
    SpecError,
)
from evenzero.userjson import brief, read_json_file


def from_json(data: Mapping[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """Parse the documented JSON format; every error names the offending field.

    A path is read strictly (`evenzero.userjson`): not UTF-8, NaN, duplicate keys, huge
    literals and the like are a `SpecError` naming the file, never another exception.
    """
    if isinstance(data, (str, Path)):
        path = Path(data)
        data = read_json_file(path, SpecError, "model file")
        name = name or path.stem
    if not isinstance(data, Mapping):
        raise SpecError(f"top level: expected an object with \"params\", got {_kind(data)}")
    unknown = set(data) - {"params", "groups", "arrival", "tokens"}
    if unknown:
        raise SpecError(f"top level: unknown key(s) {brief(sorted(unknown))}; expected params, "
                        f"groups, arrival, tokens")
    tokens = data.get("tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise SpecError(f"tokens: expected a positive integer (tokens per micro-batch on one "
                        f"rank), got {brief(tokens)}")
    raw_params = data.get("params")
    if not isinstance(raw_params, list) or not raw_params:
        raise SpecError("params: expected a non-empty list of {\"name\", \"shape\"} objects")
    raw_groups = data.get("groups", {DENSE: {}})
    if not isinstance(raw_groups, Mapping):
        raise SpecError(f"groups: expected an object mapping group name to options, got "
                        f"{_kind(raw_groups)}")
    groups = []
    for gname, opts in raw_groups.items():
        _check_name(f"groups[{brief(gname)}]", gname)
        if not isinstance(opts, Mapping):
            raise SpecError(f"groups[{gname!r}]: expected an object, got {_kind(opts)}")
        bad = set(opts) - {"expert_parallel_size"}
        if bad:
            raise SpecError(f"groups[{gname!r}]: unknown option(s) {brief(sorted(bad))}; "
                            f"expected expert_parallel_size")
        e = opts.get("expert_parallel_size", 1)
        if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= MAX_NUMEL:
            raise SpecError(f"groups[{gname!r}].expert_parallel_size: expected a positive "
                            f"integer, got {brief(e)}")
        groups.append(GroupSpec(gname, e))
    params = []
    for i, rp in enumerate(raw_params):
        where = f"params[{i}]"
        if not isinstance(rp, Mapping):
            raise SpecError(f"{where}: expected an object, got {_kind(rp)}")
        pname = rp.get("name")
        if not isinstance(pname, str) or not pname:
            raise SpecError(f"{where}.name: expected a non-empty string, got {brief(pname)}")
        _check_name(f"{where}.name", pname)
        where = f"params[{i}] ({pname if len(pname) <= 60 else pname[:57] + '...'})"
        bad = set(rp) - {"name", "shape", "group", "dtype", *COMPUTE_KEYS}
        if bad:
            raise SpecError(f"{where}: unknown key(s) {brief(sorted(bad))}; expected name, "
                            f"shape, group, dtype")
        shape = rp.get("shape")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                              for d in shape):
            raise SpecError(f"{where}.shape: expected a list of non-negative integers, got "
                            f"{brief(shape)}")
        if math.prod(shape) > MAX_NUMEL:
            raise SpecError(f"{where}.shape: {brief(shape)} has more than 2**63 - 1 elements, "
                            f"more than a tensor can hold")
        group = rp.get("group", DENSE)
        if not isinstance(group, str):
            raise SpecError(f"{where}.group: expected a string, got {brief(group)}")
        if group not in raw_groups:
            raise SpecError(f"{where}.group: unknown group {brief(group)}; declare it under "
                            f"\"groups\"")
        dtype = rp.get("dtype", "float32")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise SpecError(f"{where}.dtype: {brief(dtype)} is not one of {sorted(DTYPE_BYTES)}")
        layer = rp.get("layer", "")
        if layer not in LAYERS:
            raise SpecError(f"{where}.layer: {brief(layer)} is not one of {[x for x in LAYERS if x]}")
        extra = rp.get("extra_backward_flops_per_token", 0.0)
        if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not extra >= 0:
            raise SpecError(f"{where}.extra_backward_flops_per_token: expected a non-negative "
                            f"number, got {brief(extra)}")
        share = rp.get("token_share", 1.0)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise SpecError(f"{where}.token_share: expected a number in [0, 1], got {brief(share)}")
        params.append(ParamSpec(pname, tuple(shape), group, dtype, layer, float(extra), float(share)))
    arrival = data.get("arrival")
    if arrival is not None and (not isinstance(arrival, list)
                                or any(not isinstance(a, str) for a in arrival)):
        raise SpecError(f"arrival: expected a list of parameter names, got {brief(arrival)}")
    return ModelSpec(tuple(params), tuple(groups), tuple(arrival) if arrival is not None else None,
                     "given" if arrival is not None else "reverse-registration", name or "model",
                     tokens)


def _check_name(where: str, name: str) -> None:
    # Names end up in tables, notes and one-line errors: control characters (newlines,
    # terminal escapes) or unpaired surrogates would break those, and no module has them.
    if not name.isprintable():
        raise SpecError(f"{where}: {brief(name)} has control or unprintable characters")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)



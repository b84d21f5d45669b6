"""Models as parameter specs: names, shapes, groups and gradient-arrival order.

A spec comes from an `nn.Module` built on the meta device (no memory is used), from a
JSON file, or from a preset (`evenzero.model_presets`). The planner needs nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DENSE = "dense"
LAYERS = ("", "linear", "embedding", "elementwise")
"""`ParamSpec.layer` values; "" infers the kind from the shape (see `evenzero.cost.compute`)."""
COMPUTE_KEYS = ("layer", "extra_backward_flops_per_token", "token_share")
"""Optional per-parameter JSON keys that only compute estimates read."""


def dtype_name(dtype: Any) -> str:
    """A torch dtype's name without the "torch." prefix ("bfloat16"). Needs no torch import,
    so the planner, the runtime and the checkpoints all spell dtypes this one way."""
    return str(dtype).removeprefix("torch.")


MAX_NUMEL = 2**63 - 1
"""Most elements a parameter (and a whole model) may have: torch's int64 numel."""


class SpecError(ValueError):
    """A malformed model description; the message names the offending field."""


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter."""

    name: str
    """Name as in `named_parameters()`."""
    shape: tuple[int, ...]
    """Shape of the parameter on one rank."""
    group: str = DENSE
    """Parameter group; groups with `expert_parallel_size` are reduced over expert-DP ranks."""
    dtype: str = "float32"
    """Storage dtype of the model parameter (float32, bfloat16, float16)."""
    layer: str = ""
    """Kind of layer, for compute estimates: "linear" (a matmul weight), "embedding",
    "elementwise" (norms, biases); "" infers it: 2-D or more is linear, else elementwise."""
    extra_backward_flops_per_token: float = 0.0
    """Backward FLOPs per token of parameter-free work charged just before this
    parameter's gradient (a preset puts attention's score products on a projection)."""
    token_share: float = 1.0
    """Fraction of the micro-batch's tokens this parameter's layer processes: 1 for dense
    layers; about ep_size / num_experts for an expert of a top-1 MoE."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class GroupSpec:
    """A parameter group and how it is data-parallel."""

    name: str
    expert_parallel_size: int = 1
    """E > 1: the group is data-parallel over world/E ranks {i, i+E, ...}."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the planner needs to know about a model."""

    params: tuple[ParamSpec, ...]
    """Trainable parameters in optimizer (registration) order."""
    groups: tuple[GroupSpec, ...] = (GroupSpec(DENSE),)
    arrival: tuple[str, ...] | None = None
    """Names in gradient-arrival order; a name missing here produces no gradient.
    None means the reverse of `params`."""
    arrival_source: str = "given"
    """Where `arrival` came from: given, measured (meta backward) or reverse-registration."""
    name: str = "model"
    tokens: int | None = None
    """Tokens one rank processes per micro-batch (sequences x length), for compute
    estimates; None: unknown (the timeline then assumes a default and says so)."""

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise SpecError(f"params: duplicate parameter name {n!r}")
            seen.add(n)
        group_names = {g.name for g in self.groups}
        if len(group_names) != len(self.groups):
            raise SpecError("groups: duplicate group name")
        for p in self.params:
            if p.group not in group_names:
                raise SpecError(f"params[{p.name!r}].group: unknown group {p.group!r}; "
                                f"declare it under \"groups\" (known: {sorted(group_names)})")
            if p.dtype not in DTYPE_BYTES:
                raise SpecError(f"params[{p.name!r}].dtype: {p.dtype!r} is not one of "
                                f"{sorted(DTYPE_BYTES)}")
            if any((not isinstance(d, int)) or d < 0 for d in p.shape):
                raise SpecError(f"params[{p.name!r}].shape: {list(p.shape)} must be non-negative integers")
            if p.layer not in LAYERS:
                raise SpecError(f"params[{p.name!r}].layer: {p.layer!r} is not one of "
                                f"{[x for x in LAYERS if x]}")
            if (isinstance(p.extra_backward_flops_per_token, bool)
                    or not isinstance(p.extra_backward_flops_per_token, (int, float))
                    or not p.extra_backward_flops_per_token >= 0):
                raise SpecError(f"params[{p.name!r}].extra_backward_flops_per_token: must be a "
                                f"non-negative number, got {p.extra_backward_flops_per_token!r}")
            if (isinstance(p.token_share, bool) or not isinstance(p.token_share, (int, float))
                    or not 0 <= p.token_share <= 1):
                raise SpecError(f"params[{p.name!r}].token_share: must be a number in [0, 1], "
                                f"got {p.token_share!r}")
        if self.tokens is not None and (isinstance(self.tokens, bool)
                                        or not isinstance(self.tokens, int) or self.tokens < 1):
            raise SpecError(f"tokens: must be a positive integer (tokens per micro-batch on one "
                            f"rank), got {self.tokens!r}")
        total = sum(p.numel for p in self.params)
        if total > MAX_NUMEL:
            raise SpecError("params: more than 2**63 - 1 elements in all, more than one "
                            "flat buffer can index")
        for g in self.groups:
            if not isinstance(g.expert_parallel_size, int) or g.expert_parallel_size < 1:
                raise SpecError(f"groups[{g.name!r}].expert_parallel_size: must be a positive "
                                f"integer, got {g.expert_parallel_size!r}")
        if self.arrival is not None:
            known = set(names)
            seen = set()
            for n in self.arrival:
                if n not in known:
                    raise SpecError(f"arrival: unknown parameter name {n!r}")
                if n in seen:
                    raise SpecError(f"arrival: duplicate name {n!r}")
                seen.add(n)

    @property
    def arrival_order(self) -> tuple[str, ...]:
        if self.arrival is None:
            return tuple(p.name for p in reversed(self.params))
        return self.arrival

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def group_params(self, name: str) -> tuple[ParamSpec, ...]:
        return self._by_group.get(name, ())

    def group_dtypes(self, name: str) -> tuple[str, ...]:
        """The distinct parameter dtypes of group `name`, sorted."""
        return self._dtypes_by_group.get(name, ())

    @cached_property
    def _dtypes_by_group(self) -> dict[str, tuple[str, ...]]:
        return {g: tuple(sorted({p.dtype for p in ps})) for g, ps in self._by_group.items()}

    @cached_property
    def _by_group(self) -> dict[str, tuple[ParamSpec, ...]]:
        # Planners ask once per collective (its message dtype); a scan of every param each
        # time made DeepSpeed's plan O(ranks x params).
        out: dict[str, list[ParamSpec]] = {}
        for p in self.params:
            out.setdefault(p.group, []).append(p)
        return {g: tuple(ps) for g, ps in out.items()}

    def param(self, name: str) -> ParamSpec:
        return self._by_name[name]

    @cached_property
    def _by_name(self) -> dict[str, ParamSpec]:
        return {p.name: p for p in self.params}

    def with_arrival(self, arrival: Iterable[str], source: str = "given") -> ModelSpec:
        return replace(self, arrival=tuple(arrival), arrival_source=source)

    def with_tokens(self, tokens: int | None) -> ModelSpec:
        """The same model, with `tokens` per micro-batch for compute estimates."""
        return replace(self, tokens=tokens)

    def without_grads(self, names: Iterable[str]) -> ModelSpec:
        """The same model where `names` never produce a gradient."""
        drop = set(names)
        for n in drop:
            self.param(n)
        return self.with_arrival([n for n in self.arrival_order if n not in drop], self.arrival_source)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "params": [_param_json(p) for p in self.params],
            "groups": {g.name: ({"expert_parallel_size": g.expert_parallel_size}
                                if g.expert_parallel_size > 1 else {}) for g in self.groups},
            "arrival": list(self.arrival_order),
        }
        if self.tokens is not None:
            out["tokens"] = self.tokens
        return out


def _param_json(p: ParamSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": p.name, "shape": list(p.shape), "group": p.group, "dtype": p.dtype}
    if p.layer:
        out["layer"] = p.layer
    if p.extra_backward_flops_per_token:
        out["extra_backward_flops_per_token"] = p.extra_backward_flops_per_token
    if p.token_share != 1.0:
        out["token_share"] = p.token_share
    return out


# --------------------------------------------------------------------------- nn.Module


def is_expert(param: Any) -> bool:
    """DeepSpeed's MoE marker: an expert parameter has `param.allreduce = False` and is
    reduced over its expert-data-parallel group (deepspeed/moe/utils.py@v0.19.8:27
    `is_moe_param`)."""
    return getattr(param, "allreduce", True) is False


def mark_expert(param: Any, group_name: str) -> None:
    """Set DeepSpeed's MoE marker on `param`, as deepspeed/moe/experts.py@v0.19.8:25 does."""
    param.allreduce = False
    param.group_name = group_name


def expert_group_name(param: Any, default: str = "experts") -> str | None:
    """The expert group of a marked parameter (`param.group_name`), or None for a dense one."""
    if is_expert(param):
        return str(getattr(param, "group_name", default))
    return None


@dataclass(frozen=True)
class ModuleSpecOptions:
    """How `from_module` groups parameters."""

    expert_parallel_size: int = 1
    """E for parameters marked as experts (allreduce=False or name matched)."""
    expert_pattern: str | None = None
    """Substring that marks expert params by name, for modules without the DeepSpeed marker."""


def from_module(module: Any, example_input: Callable[[], Any] | Any | None = None,
                loss_fn: Callable[[Any], Any] | None = None,
                options: ModuleSpecOptions = ModuleSpecOptions(),
                name: str | None = None) -> ModelSpec:
    """Describe `module` (ideally built on `torch.device("meta")`).

    With `example_input` (a tensor, a tuple of args, or a zero-argument callable returning
    either), one forward and backward run on meta tensors and post-accumulate-grad hooks
    record the real arrival order. Without it, or if that fails, the order falls back to
    reverse registration and `arrival_source` says so.
    """
    import torch

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise SpecError("module has no trainable parameters")
    # Embedding tables are 2-D but cost a gather, not a matmul (evenzero.cost.compute).
    embedding = {f"{m}.{n}" if m else n for m, mod in module.named_modules()
                 if isinstance(mod, torch.nn.Embedding) for n, _ in mod.named_parameters(recurse=False)}
    groups: dict[str, GroupSpec] = {DENSE: GroupSpec(DENSE)}
    params = []
    for n, p in named:
        g = expert_group_name(p)
        if g is None and options.expert_pattern and options.expert_pattern in n:
            g = "experts"
        if g is None:
            g = DENSE
        elif g not in groups:
            groups[g] = GroupSpec(g, options.expert_parallel_size)
        dtype = dtype_name(p.dtype)
        params.append(ParamSpec(n, tuple(p.shape), g, dtype,
                                "embedding" if n in embedding else ""))
    used_groups = tuple(g for g in groups.values() if any(p.group == g.name for p in params))

    arrival = None
    source = "reverse-registration"
    if example_input is not None:
        try:
            arrival = _measure_arrival(module, named, example_input, loss_fn, torch)
            source = "measured"
        except Exception as e:  # noqa: BLE001 - any failure means we fall back, and say so
            source = f"reverse-registration (meta backward failed: {type(e).__name__}: {e})"
    if arrival is None:
        arrival = [n for n, _ in reversed(named)]
    return ModelSpec(tuple(params), used_groups, tuple(arrival), source,
                     name or type(module).__name__)


def _measure_arrival(module, named, example_input, loss_fn, torch) -> list[str]:
    order: list[str] = []
    handles = []
    for n, p in named:
        handles.append(p.register_post_accumulate_grad_hook(lambda _p, n=n: order.append(n)))
    try:
        inp = example_input() if callable(example_input) else example_input
        args = inp if isinstance(inp, tuple) else (inp,)
        out = module(*args)
        loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        for _, p in named:
            p.grad = None
    return order


def _default_loss(out):
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().sum()

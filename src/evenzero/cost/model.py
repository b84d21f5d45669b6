"""The alpha-beta cost model of collectives (`CostModel`) and its file format.

A collective on a group of n ranks with a buffer of S bytes takes

    t = alpha(n) + f(op, n) * S / busbw

with S the full buffer (reduce-scatter input, all-gather output, all-reduce or reduce
buffer) and f the nccl-tests bus factor: 2(n-1)/n for all-reduce, (n-1)/n for
reduce-scatter and all-gather, 1 for reduce (NVIDIA/nccl-tests doc/PERFORMANCE.md, and
src/all_reduce.cu, reduce_scatter.cu, all_gather.cu, reduce.cu @a0b82b2). With this
definition one reduce of S bytes and one reduce-scatter of S bytes cost the same bandwidth
time, so what separates DeepSpeed's uneven reduces from one equal reduce-scatter is the
number of calls times alpha: exactly what the model has to get right.

An op has one or more variants (ring, tree, low-latency protocol); the model charges the
cheapest variant that applies to the message size, as NCCL's tuner does
(`ncclTopoGetAlgoTime`, NVIDIA/nccl src/graph/tuning.cc @v2.30.7-1). A variant measured
at one group size (`Variant.group_size`, what `evenzero calibrate` writes) is used for
exactly that size; the others scale alpha with the group size per `Variant.scaling`.
A model may carry its device's compute throughput (`CostModel.compute`) for the step
timeline (`evenzero.cost.timeline`).

Files (`to_json`, `from_json`) carry `format`: 2 since the step costs were added to the
compute figures (`DeviceCompute`); a file without it is format 1 and still loads, its
compute figures taking the defaults for what it lacks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from evenzero.cost.compute import DeviceCompute

OPS = ("all_reduce", "reduce_scatter", "all_gather", "reduce")
SCALINGS = ("flat", "ring", "tree", "linear")
FORMAT = 2
"""Version of the cost model file format `to_json` writes (1: before the step costs)."""


class CostModelError(ValueError):
    """A bad cost-model parameter or preset; the message names the fix."""


def bus_factor(op: str, group_size: int) -> float:
    """nccl-tests' busbw/algbw factor: how many times S crosses the slowest link."""
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if op == "reduce":
        return 1.0
    raise CostModelError(f"unknown collective op {op!r}; expected one of {', '.join(OPS)}")


def bytes_sent_per_rank(op: str, group_size: int, nbytes: int) -> float:
    """Bytes one rank puts on the wire for one call (ring algorithms).

    Reduce is a ring chain: every rank but the root forwards S once, so a non-root rank
    sends S; we charge S to every rank (the root's 0 is not the bottleneck)."""
    if group_size <= 1:
        return 0.0
    return bus_factor(op, group_size) * nbytes


@dataclass(frozen=True)
class Variant:
    """One algorithm/protocol of an op, with its own latency and bandwidth."""

    name: str
    """Label shown in reports, e.g. "ring", "tree", "ring-ll", "nvls", "measured"."""
    alpha_us: float
    """Per-call latency in microseconds at the model's `reference_ranks`."""
    busbw_gbs: float
    """Bus bandwidth in GB/s (1e9 bytes), nccl-tests' definition."""
    max_bytes: int | None = None
    """Largest message (bytes) this variant is used for; None means any size."""
    scaling: str = "flat"
    """How alpha grows with group size: "flat" (constant), "ring" (one hop per rank,
    network hops dearer: NCCL's ring latency, tuning.cc L384-436), "tree" (log2 of
    nodes: NCCL's tree) or "linear" (alpha_us + step_us per rank beyond
    `reference_ranks`: a fit over measured group sizes)."""
    step_us: float = 0.0
    """"linear" scaling: microseconds of alpha per rank of group size."""
    group_size: int | None = None
    """The group size this variant was measured at; it then prices that size only.
    None: any size, with alpha scaled per `scaling`."""

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha_us, (int, float)) and self.alpha_us >= 0):
            raise CostModelError(f"{self.name}.alpha_us must be a non-negative number, "
                                 f"got {self.alpha_us!r}")
        if not (isinstance(self.busbw_gbs, (int, float)) and self.busbw_gbs > 0):
            raise CostModelError(f"{self.name}.busbw_gbs must be a positive number, "
                                 f"got {self.busbw_gbs!r}")
        if self.scaling not in SCALINGS:
            raise CostModelError(f"{self.name}.scaling must be one of {', '.join(SCALINGS)}, "
                                 f"got {self.scaling!r}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise CostModelError(f"{self.name}.max_bytes must be positive or None")
        if not (isinstance(self.step_us, (int, float)) and self.step_us >= 0):
            raise CostModelError(f"{self.name}.step_us must be a non-negative number, "
                                 f"got {self.step_us!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool)
                                            or not isinstance(self.group_size, int)
                                            or self.group_size < 2):
            raise CostModelError(f"{self.name}.group_size must be None or an integer >= 2, "
                                 f"got {self.group_size!r}")


@dataclass(frozen=True)
class OpCost:
    """The variants of one collective op; the cheapest applicable one is charged."""

    variants: tuple[Variant, ...]
    """At least one variant with max_bytes=None and group_size=None, so that every size
    has a price."""

    def __post_init__(self) -> None:
        if not any(v.max_bytes is None and v.group_size is None for v in self.variants):
            raise CostModelError("every op needs one variant without max_bytes or group_size")

    def measured_sizes(self) -> frozenset[int]:
        """Group sizes with variants measured at exactly that size."""
        return frozenset(v.group_size for v in self.variants if v.group_size is not None)


@dataclass(frozen=True)
class CostModel:
    """Latency and bandwidth of each collective op on one kind of cluster."""

    name: str
    """Preset name, shown in table titles."""
    description: str
    """What hardware the numbers describe."""
    all_reduce: OpCost
    """Costs of all_reduce."""
    reduce_scatter: OpCost
    """Costs of reduce_scatter (S = the full input)."""
    all_gather: OpCost
    """Costs of all_gather (S = the full output)."""
    reduce: OpCost
    """Costs of reduce (S = the buffer; NCCL runs it as a ring chain)."""
    reference_ranks: int = 8
    """Group size at which the variants' alpha_us hold; other sizes scale per `scaling`."""
    gpus_per_node: int = 8
    """Ranks per node, to count network hops when alpha scales with group size."""
    base_us: float = 7.0
    """Fixed part of a ring's latency (NCCL's ring baseLat + launch, tuning.cc L149-175)."""
    intra_step_us: float = 1.0
    """Latency per intra-node ring step (NVLink hwLat, tuning.cc L149-175)."""
    inter_step_us: float = 3.5
    """Latency per network ring step (NET hwLat + netOverhead, tuning.cc L149-175)."""
    sources: str = ""
    """Where the numbers come from."""
    compute: DeviceCompute | None = None
    """Compute throughput of one rank on this hardware, for the step timeline; None: the
    model describes communication only."""
    fitted_ranks: tuple[int, ...] = ()
    """World sizes the numbers were measured at (a calibration, the gloo anchors); empty
    for presets built from published figures with a documented scaling rule. Used at any
    other world size, the model is an extrapolation and says so (`extrapolation_warning`)."""
    all_gather_copies_output: bool = False
    """The backend's all-gather fills a temporary and then copies the whole output out
    (gloo: `ProcessGroupGloo::_allgather_base` runs `AsyncAllgatherWork`, which gathers
    into one flat tensor and copies it into the outputs, pytorch
    torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), and the `all_gather` variants
    price the exchange alone: the timeline then adds a copy of the output at the
    device's copy bandwidth to each all-gather. False where the variants price the
    whole call: NCCL gathers in place, and a calibration times the call itself."""

    def __post_init__(self) -> None:
        for f in ("reference_ranks", "gpus_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CostModelError(f"{f} must be a positive integer, got {v!r}")
        for f in ("base_us", "intra_step_us", "inter_step_us"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise CostModelError(f"{f} must be a non-negative number of microseconds, got {v!r}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.fitted_ranks):
            raise CostModelError(f"fitted_ranks must be positive integers, got {self.fitted_ranks!r}")

    def extrapolation_warning(self, world_size: int) -> str | None:
        """One line when the model was fitted at other world sizes than `world_size`."""
        if not self.fitted_ranks or world_size in self.fitted_ranks:
            return None
        at = " and ".join(str(n) for n in sorted(self.fitted_ranks))
        # What to run instead is the command layer's to say (`evenzero plan`): which
        # world sizes can be calibrated depends on where it runs.
        return (f"cost model {self.name} was fitted at {at} ranks, not {world_size}: its "
                f"latencies are extrapolated")

    def op(self, name: str) -> OpCost:
        if name not in OPS:
            raise CostModelError(f"unknown collective op {name!r}; expected one of {', '.join(OPS)}")
        return getattr(self, name)

    def _shape_us(self, scaling: str, n: int) -> float:
        """Latency shape of a ring or tree at group size n; only ratios of it are used."""
        g = self.gpus_per_node
        nodes = -(-n // g)
        if scaling == "ring":
            return self.base_us + (n - nodes) * self.intra_step_us + (nodes - 1) * self.inter_step_us
        # NCCL's tree: chains inside a node, a log2 tree between nodes (tuning.cc).
        return 6.8 + 2 * ((min(n, g) - 1) * 0.6 + math.log2(nodes) * 5.0)

    def alpha_us(self, variant: Variant, group_size: int) -> float:
        if variant.scaling == "flat" or group_size == self.reference_ranks:
            return variant.alpha_us
        if variant.scaling == "linear":
            return max(0.0, variant.alpha_us + variant.step_us * (group_size - self.reference_ranks))
        ratio = self._shape_us(variant.scaling, group_size) / self._shape_us(
            variant.scaling, self.reference_ranks)
        return variant.alpha_us * ratio

    def choose(self, op: str, group_size: int, nbytes: int) -> tuple[Variant | None, float]:
        """(cheapest variant, seconds) for one call; a group of one rank costs nothing."""
        if group_size <= 1:
            return None, 0.0
        f = bus_factor(op, group_size)
        best: tuple[Variant | None, float] = (None, math.inf)
        cost = self.op(op)
        # Measured at this very size: those numbers, not an extrapolation.
        size = group_size if group_size in cost.measured_sizes() else None
        for v in cost.variants:
            if v.group_size != size or (v.max_bytes is not None and nbytes > v.max_bytes):
                continue
            t = self.alpha_us(v, group_size) * 1e-6 + f * nbytes / (v.busbw_gbs * 1e9)
            if t < best[1]:
                best = (v, t)
        return best

    def time(self, op: str, group_size: int, nbytes: int) -> float:
        """Seconds for one call of `op` over `group_size` ranks on `nbytes` bytes."""
        return self.choose(op, group_size, nbytes)[1]

    def replace(self, alpha_us: float | None = None, busbw_gbs: float | None = None) -> CostModel:
        """Every variant of every op charges a flat `alpha_us` and/or uses `busbw_gbs`."""
        updates: dict[str, Any] = {}
        if alpha_us is not None:
            updates["*.alpha_us"] = alpha_us
            updates["*.scaling"] = "flat"
        if busbw_gbs is not None:
            updates["*.busbw_gbs"] = busbw_gbs
        return self.with_params(updates)

    def with_params(self, assignments: Mapping[str, Any]) -> CostModel:
        """Override parameters by dotted key.

        Keys: a model field (`reference_ranks`, `gpus_per_node`, `intra_step_us`, ...);
        `OP.FIELD` for every variant of an op (`reduce.alpha_us`); `OP.VARIANT.FIELD` for
        one variant (`all_reduce.tree.alpha_us`); `*` for OP means every op.
        """
        model = self
        for key, raw in assignments.items():
            model = model._assign(key, raw)
        return model

    def _assign(self, key: str, raw: Any) -> CostModel:
        parts = key.split(".")
        top = {f.name for f in fields(self)} - set(OPS) - {"name", "description", "sources",
                                                           "compute", "fitted_ranks",
                                                           "all_gather_copies_output"}
        if parts[0] == "compute":
            if self.compute is None:
                raise CostModelError(f"cost parameter {key!r}: cost model {self.name} has no "
                                     f"compute figures to override")
            try:
                return replace(self, compute=self.compute.with_param(".".join(parts[1:]), raw))
            except ValueError as e:
                raise CostModelError(f"cost parameter {key!r}: {e}") from None
        if len(parts) == 1:
            if parts[0] not in top:
                raise CostModelError(f"unknown cost parameter {key!r}; use one of {sorted(top)}, "
                                     f"OP.FIELD or OP.VARIANT.FIELD")
            return replace(self, **{parts[0]: _coerce(key, raw, type(getattr(self, parts[0])))})
        if len(parts) not in (2, 3):
            raise CostModelError(f"cost parameter {key!r} must look like OP.FIELD or OP.VARIANT.FIELD")
        op_key, fname = parts[0], parts[-1]
        variant_name = parts[1] if len(parts) == 3 else None
        ops = OPS if op_key == "*" else (op_key,)
        vfields = {"alpha_us": float, "busbw_gbs": float, "max_bytes": int, "scaling": str,
                   "step_us": float}
        if fname not in vfields:
            raise CostModelError(f"cost parameter {key!r}: field {fname!r} is not one of "
                                 f"{', '.join(vfields)}")
        value = _coerce(key, raw, vfields[fname])
        updates = {}
        for op in ops:
            cost = self.op(op)
            names = [v.name for v in cost.variants]
            if variant_name is not None and variant_name not in names:
                if op_key == "*":
                    continue
                raise CostModelError(f"cost parameter {key!r}: {op} has no variant "
                                     f"{variant_name!r}; it has {', '.join(names)}")
            variants = tuple(replace(v, **{fname: value})
                             if variant_name in (None, v.name) else v for v in cost.variants)
            updates[op] = OpCost(variants)
        return replace(self, **updates)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT}
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name not in (*OPS, "compute", "fitted_ranks")})
        out["fitted_ranks"] = list(self.fitted_ranks)
        if self.compute is not None:
            out["compute"] = self.compute.to_json()
        for op in OPS:
            out[op] = [{f.name: getattr(v, f.name) for f in fields(v)}
                       for v in self.op(op).variants]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostModel:
        if not isinstance(data, Mapping):
            raise CostModelError("cost model JSON: expected an object")
        version = data.get("format", 1)
        if isinstance(version, bool) or version not in range(1, FORMAT + 1):
            raise CostModelError(f"cost model JSON: format {version!r} is not one this evenzero "
                                 f"reads (1 to {FORMAT}); a newer evenzero wrote it, or re-run "
                                 f"`evenzero calibrate --json`")
        data = {k: v for k, v in data.items() if k != "format"}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise CostModelError(f"cost model JSON: unknown key(s) {sorted(unknown)}")
        missing = [op for op in (*OPS, "name") if op not in data]
        if missing:
            raise CostModelError(f"cost model JSON: missing key(s) {missing}")
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in OPS}
        kwargs.setdefault("description", "")
        if kwargs.get("compute") is not None:
            try:
                kwargs["compute"] = DeviceCompute.from_json(kwargs["compute"])
            except ValueError as e:
                raise CostModelError(f"cost model JSON: compute: {e}") from None
        ranks = kwargs.get("fitted_ranks", ())
        if not isinstance(ranks, (list, tuple)):
            raise CostModelError("cost model JSON: fitted_ranks must be a list of world sizes")
        kwargs["fitted_ranks"] = tuple(ranks)
        for op in OPS:
            raw = data[op]
            if not isinstance(raw, list) or not raw:
                raise CostModelError(f"cost model JSON: {op} must be a non-empty list of variants")
            try:
                kwargs[op] = OpCost(tuple(Variant(**v) for v in raw))
            except TypeError as e:
                raise CostModelError(f"cost model JSON: {op}: {e}") from None
        return cls(**kwargs)


def _coerce(key: str, raw: Any, kind: type) -> Any:
    if kind is str:
        return str(raw)
    if raw is None or (isinstance(raw, str) and raw.lower() == "none"):
        return None
    try:
        number = float(raw)
    except (TypeError, ValueError):
        raise CostModelError(f"cost parameter {key!r}: {raw!r} is not a number") from None
    if not math.isfinite(number):
        raise CostModelError(f"cost parameter {key!r}: {raw!r} is not a finite number")
    if kind is int:  # int(float("1.5")) would silently price with 1
        if not number.is_integer():
            raise CostModelError(f"cost parameter {key!r}: {raw!r} is not a whole number")
        return int(number)
    return kind(number)


__all__ = ["FORMAT", "OPS", "SCALINGS", "CostModel", "CostModelError", "OpCost", "Variant",
           "bus_factor", "bytes_sent_per_rank"]

"""Fitting cost models to timed collectives: the pure half of calibration.

`evenzero.calibration` (and the runtime's quick calibration) times collectives on real
process groups and hands the timings here as `Sample`s; `fit_op` fits one op's
alpha-beta line at one group size and `fit_model` a whole `CostModel` from a sweep.
No torch here: every rank fits the same numbers to the same model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from evenzero.cost.compute import DeviceCompute
from evenzero.cost.model import OPS, CostModel, CostModelError, OpCost, Variant, bus_factor


@dataclass(frozen=True)
class Sample:
    """One timed collective: the input to a fit."""

    op: str
    """Collective op."""
    group_size: int
    """Ranks in the group."""
    nbytes: int
    """Full buffer size S in bytes."""
    seconds: float
    """Time of one call (slowest rank)."""


def fit_op(samples: Iterable[Sample], name: str = "measured") -> Variant:
    """Least-squares fit of t = alpha + f*S/busbw over samples of one op and group size.

    Residuals are relative (weights 1/t^2): the sizes span orders of magnitude and timing
    noise is roughly proportional to the time, so an unweighted fit would let the largest
    message alone decide alpha. Refuses a fit whose slope is not positive (times that do
    not grow with size carry no bandwidth information); clamps a negative intercept to
    zero and refits through the origin, since latency cannot be negative."""
    pts = [(bus_factor(s.op, s.group_size) * s.nbytes, s.seconds) for s in samples]
    if len({x for x, _ in pts}) < 2:
        raise CostModelError("a fit needs at least two different message sizes")
    if any(y <= 0 for _, y in pts):
        raise CostModelError("a fit needs positive timings")
    w = [1 / (y * y) for _, y in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts, strict=True))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - slope * sx) / sw
    if alpha < 0:
        alpha, slope = 0.0, sxy / sxx
    if slope <= 0:
        raise CostModelError("timings did not grow with message size, so bandwidth cannot be "
                             "fitted; sweep larger sizes (e.g. --sizes up to 4194304)")
    return Variant(name, alpha * 1e6, 1e-9 / slope)


def fit_model(samples: Sequence[Sample], name: str = "measured", description: str = "",
              compute: DeviceCompute | None = None, rs_variant: str = "measured") -> CostModel:
    """Per op: one variant per measured group size, and one for any other size whose
    latency follows a line through the measured ones (flat if one size was measured).
    The world is the largest group size. A size whose timings did not grow with the
    message (noise) gets no variant of its own; if none did, the fit is refused."""
    world = max(s.group_size for s in samples)
    measured = ", ".join(str(n) for n in sorted({s.group_size for s in samples}))
    variants = {}
    for op in OPS:
        mine = [s for s in samples if s.op == op]
        if not mine:
            raise CostModelError(f"no samples for {op}; calibrate every op")
        label = rs_variant if op == "reduce_scatter" else "measured"
        exact, failed = [], None
        for n in sorted({s.group_size for s in mine}):
            try:
                v = fit_op([s for s in mine if s.group_size == n])
            except CostModelError as e:  # noise at one size: the line through the others prices it
                failed = e
                continue
            exact.append(Variant(label, v.alpha_us, v.busbw_gbs, group_size=n))
        if not exact:
            raise failed
        anchor = exact[-1]
        variants[op] = OpCost((*exact, Variant(
            label, anchor.alpha_us, anchor.busbw_gbs, scaling="linear",
            step_us=_alpha_slope([(v.group_size, v.alpha_us) for v in exact]))))
    return CostModel(name=name, description=description or f"measured on {world} ranks",
                     reference_ranks=world, gpus_per_node=world, compute=compute,
                     fitted_ranks=(world,),
                     sources="evenzero calibrate: least-squares fit of t = alpha + f*S/busbw "
                             f"per op and group size ({measured} ranks)",
                     **variants)


def _alpha_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of alpha over group size, clamped at 0 (latency does not fall
    with more peers; a negative slope is noise)."""
    if len(points) < 2:
        return 0.0
    mx = sum(n for n, _ in points) / len(points)
    my = sum(a for _, a in points) / len(points)
    den = sum((n - mx) ** 2 for n, _ in points)
    return max(0.0, sum((n - mx) * (a - my) for n, a in points) / den)


__all__ = ["Sample", "fit_model", "fit_op"]

"""Fitting a collective's alpha-beta line to timed calls (what calibration produces)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from evenzero.cost import CostModelError, Variant, bus_factor


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

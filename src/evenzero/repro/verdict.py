"""Whether evenzero meets a step-time target against another system, from one noisy run.

Every measured step ran each system back to back on the same batch, so the ratio of
evenzero's step to the other system's *in the same step* cancels what the machine did
meanwhile (a neighbour's burst, a thermal dip) better than a ratio of two medians taken
over different moments. The verdict is about the median of those per-step ratios, and it
says how sure it is: a distribution-free confidence interval for that median (order
statistics of the sorted ratios, exact binomial coverage, no assumption on the noise's
shape). Then

* **met**: the whole interval is at or under the target;
* **missed**: the whole interval is over it;
* **inconclusive: the spread crosses the target**: the run cannot tell, and says so
  instead of reporting whichever side its median happened to fall on.

A run that cannot tell yet measures more (`next_steps`): the count of measured steps
doubles, for evenzero and the systems whose verdict is still open only, until every
verdict is decided or the step limit is reached. Each look uses `CONFIDENCE` on its own;
with at most a handful of looks (8, 16, 32 by default) the chance that noise alone
decides either way stays near 1 - `CONFIDENCE` times their number, a few percent, so two
runs on the same machine give the same word unless the true ratio sits just at the edge
of what the run can resolve.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

REFERENCE = "evenzero"
TARGETS: Mapping[str, float] = {"deepspeed": 0.7, "ddp": 0.9}
"""evenzero's median forward+backward+step must be at most this fraction of the system's."""
CONFIDENCE = 0.99
"""Coverage of each look's interval for the median per-step ratio."""
MET, MISSED, INCONCLUSIVE = "met", "missed", "inconclusive"


@dataclass(frozen=True)
class Verdict:
    """evenzero against one system."""

    peer: str
    target: float
    ratios: tuple[float, ...]
    """evenzero's step over the peer's, per measured step both ran, in step order."""
    median: float
    low: float
    """The interval for the median (nan when too few steps for `CONFIDENCE`)."""
    high: float
    word: str
    """`MET`, `MISSED` or `INCONCLUSIVE`."""

    @property
    def steps(self) -> int:
        return len(self.ratios)

    @property
    def decided(self) -> bool:
        return self.word != INCONCLUSIVE


def step_ratios(reference_ms: Sequence[float], other_ms: Sequence[float]) -> list[float]:
    """Per-step ratios over the steps both ran. A system that stopped early ran the first
    steps of evenzero's (it is dropped from the later rounds, never added back)."""
    return [a / b for a, b in zip(reference_ms, other_ms, strict=False) if b > 0]


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The order-statistic interval [x(k), x(n+1-k)] for the median of `values`, with the
    largest k whose exact coverage (Binomial(n, 1/2)) is at least `confidence`; (nan, nan)
    when even the full range covers less (fewer than 8 values at 99%)."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    k = 0
    # P(Binomial(n, 1/2) <= k - 1): the chance that the median lies below x(k).
    below = 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return float("nan"), float("nan")
    return ordered[k - 1], ordered[n - k]


def judge(peer: str, target: float, reference_ms: Sequence[float],
          other_ms: Sequence[float]) -> Verdict:
    ratios = step_ratios(reference_ms, other_ms)
    median = statistics.median(ratios) if ratios else float("nan")
    low, high = median_interval(ratios)
    if high <= target:
        word = MET
    elif low > target:
        word = MISSED
    else:  # the interval crosses the target, or there is none yet (nan compares False)
        word = INCONCLUSIVE
    return Verdict(peer, target, tuple(ratios), median, low, high, word)


def verdicts(step_ms: Mapping[str, Sequence[float]]) -> list[Verdict]:
    """One verdict per target whose system ran beside evenzero, in `TARGETS` order."""
    reference = step_ms.get(REFERENCE)
    if reference is None:
        return []
    return [judge(peer, target, reference, step_ms[peer])
            for peer, target in TARGETS.items() if peer in step_ms]


def next_steps(step_ms: Mapping[str, Sequence[float]], max_steps: int) -> tuple[list[str], int]:
    """(systems to measure further, how many more steps) after a look; ([], 0) when every
    verdict is decided or evenzero has `max_steps` measured steps. The systems are
    evenzero and those whose verdict is open, in `step_ms` order; the count doubles the
    measured steps, up to `max_steps`."""
    measured = len(step_ms.get(REFERENCE, ()))
    open_peers = {v.peer for v in verdicts(step_ms) if not v.decided}
    if not open_peers or measured >= max_steps:
        return [], 0
    more = min(max(measured, 1), max_steps - measured)
    return [name for name in step_ms if name == REFERENCE or name in open_peers], more


__all__ = ["CONFIDENCE", "INCONCLUSIVE", "MET", "MISSED", "REFERENCE", "TARGETS", "Verdict",
           "judge", "median_interval", "next_steps", "step_ratios", "verdicts"]

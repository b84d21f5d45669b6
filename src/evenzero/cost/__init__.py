"""What a plan costs: time and memory per rank, predicted before a job runs.

One module per concept, lowest first:

* `model`: the alpha-beta `CostModel` of collectives and its file format;
* `compute`: a rank's compute (`DeviceCompute`: throughput and the step's own work)
  and one step's compute profile (FLOPs estimates or measured times);
* `fit`: fitting a `CostModel` to timed collectives (what calibration produces; the
  timing itself is `evenzero.calibration`, above the planner);
* `presets`: cost models from published figures, and loading a saved one;
* `memory`: bytes per rank from a plan's `MemoryModel`;
* `predict`: each collective of a plan priced alone;
* `timeline`: one step played on two lanes, compute and communication;
* `autobucket`: the bucket size with the shortest predicted step, over any planner's
  cut of the model (`evenzero.strategies.evenzero` passes its own).

Pure Python, no torch: the cost package reads plans and specs and nothing above them.
"""

from __future__ import annotations

from evenzero.cost.fit import Sample, fit_model, fit_op
from evenzero.cost.model import (
    OPS,
    CostModel,
    CostModelError,
    OpCost,
    Variant,
    bus_factor,
    bytes_sent_per_rank,
)
from evenzero.cost.predict import CollectiveCost, PlanCost, predict

__all__ = ["OPS", "CollectiveCost", "CostModel", "CostModelError", "OpCost", "PlanCost", "Sample",
           "Variant", "bus_factor", "bytes_sent_per_rank", "fit_model", "fit_op", "predict"]

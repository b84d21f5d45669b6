"""`deepspeed.moe`: DeepSpeed 0.19.8's mixture-of-experts layer and its helpers, implemented
in evenzero, so `deepspeed.moe.layer.MoE(...)` and
`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(...)` work after
`import evenzero.deepspeed as deepspeed` whether or not DeepSpeed is installed.

Submodules as in DeepSpeed: `layer` (MoE), `sharded_moe` (TopKGate, MOELayer, the gating
functions), `experts` (Experts), `utils` (is_moe_param, the param-group split),
`mappings`; and evenzero's own `gating` (the routing decisions), `groups` (the expert
process groups by name) and `engine_setup` (what the engine does for MoE layers at
`initialize`, also for a model built with real DeepSpeed's layer).
"""

from __future__ import annotations

from evenzero.deepspeed.moe import experts, layer, mappings, sharded_moe, utils
from evenzero.deepspeed.moe.engine_setup import (
    broadcast_parameters,
    deepspeed_moe_layers,
    evenzero_moe_layers,
    expert_groups,
)

__all__ = ["broadcast_parameters", "deepspeed_moe_layers", "evenzero_moe_layers",
           "expert_groups", "experts", "layer", "mappings", "sharded_moe", "utils"]

"""`deepspeed.moe.layer.MoE`: DeepSpeed 0.19.8's mixture-of-experts layer, without DeepSpeed
(deepspeed/moe/layer.py@0.19.8:17-132).

    self.moe = deepspeed.moe.layer.MoE(hidden_size=84, expert=nn.Linear(84, 84), num_experts=2,
                                       ep_size=2, k=1, min_capacity=0, noisy_gate_policy="RSample")
    out, l_aux, exp_counts = self.moe(x)

The same module tree, parameter names and construction order as DeepSpeed's (the gate's
`wg`, then with `use_residual` the `coefficient` Linear, each drawing its initial values
from the global RNG; the experts are deep copies of `expert`), so `torch.manual_seed` then
building the model gives DeepSpeed's weights, and the same forward (see `sharded_moe` and
`gating`). `set_deepspeed_parallelism`, which the engine calls at `initialize`, creates the
expert-parallel and expert-data-parallel groups (`groups`).

Two arguments change nothing here, as in DeepSpeed without them: `use_tutel` (Tutel's
kernels compute the same routing; a warning says it runs without them) and
`enable_expert_tensor_parallelism` (DeepSpeed applies it only with a tensor-parallel `mpu`,
which evenzero does not run).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from evenzero.deepspeed.log import info_rank0
from evenzero.deepspeed.moe.experts import Experts
from evenzero.deepspeed.moe.gating import check_noisy_gate_policy
from evenzero.deepspeed.moe.groups import create_expert_groups, group_name
from evenzero.deepspeed.moe.sharded_moe import MOELayer, TopKGate


class MoE(nn.Module):
    """DeepSpeed's MoE layer; see the module docstring and DeepSpeed's argument docs.

    Returns `(output, l_aux, exp_counts)` from `forward`: the layer's output (same shape as
    its input), the auxiliary load-balancing loss (fp32 scalar, to add to the loss with a
    coefficient of your choice) and the tokens routed to each expert."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"MoE ep_size={ep_size!r} must be a positive integer")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"MoE num_experts={num_experts!r} must be a positive integer")
        if num_experts % ep_size:
            raise AssertionError(f"Number of experts ({num_experts}) should be divisible by "
                                 f"expert parallel size ({ep_size})")
        check_noisy_gate_policy(noisy_gate_policy)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        info_rank0("Creating MoE layer with num_experts: %d | num_local_experts: %d | "
                   "expert_parallel_size: %d", num_experts, self.num_local_experts, ep_size)

        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                        min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                        top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, self.ep_size,
                                      self.num_local_experts, use_tutel=use_tutel)
        if self.use_residual:
            # The dense branch is the expert module itself (not a copy), as in DeepSpeed.
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (or reuse) this layer's process groups and hand the expert-parallel one to
        the all_to_all; the engine calls it on every rank at `initialize`."""
        groups = create_expert_groups(self.ep_size, use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups.ep_group)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts

"""`deepspeed.moe.experts.Experts`: this rank's copies of the expert module
(deepspeed/moe/experts.py@0.19.8:13-38).

Each local expert is a deep copy of the module given, its parameters marked as DeepSpeed
marks them (`param.allreduce = False`, `param.group_name`), so the engine reduces them over
their expert-data-parallel group instead of the whole world.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from evenzero.spec import mark_expert


class Experts(nn.Module):

    def __init__(self, expert: nn.Module, num_local_experts: int = 1,
                 expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for local in self.deepspeed_experts:
            for param in local.parameters():
                mark_expert(param, expert_group_name)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` is [source rank, local expert, capacity, model]: local expert j runs on
        slice j of dim 1 (keeping the dim, as DeepSpeed's chunks do); a tuple output's
        first element is its result (a bias returned beside it is ignored, as in DeepSpeed)."""
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1),
                                 self.deepspeed_experts, strict=False):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]
            outputs.append(out)
        return torch.cat(outputs, dim=1)

"""Expert parallelism: process groups and a small top-1 mixture-of-experts layer.

With E-way expert parallelism on W ranks, the experts are split over the E ranks of an
expert-parallel (EP) group {kE, ..., kE+E-1}; tokens travel to their expert's rank with
`all_to_all`. The same experts are replicated on the W/E ranks of an expert-data-parallel
(EDP) group {i, i+E, ...}, over which their gradients are reduced (DeepSpeed's default
"E + D" layout). DeepSpeed's `use_data_before_expert_parallel_` ("D + E") swaps the roles:
with D = W/E, EDP groups are {iD, ..., iD+D-1} and EP groups {j, j+D, ...}
(deepspeed/utils/groups.py@0.19.8:427-471 builds both with the same rank sets).

Expert parameters carry DeepSpeed's marker (`param.allreduce = False`,
`param.group_name = "ep_size_E"`), so `ZeroOptimizer(..., expert_groups={name: edp})`
puts them in their own group.

`MoE(dim, num_experts, groups=None)` holds every expert on one process and is the
single-process reference: for the same gate weights it routes the same way and yields
the same outputs and gradients as the distributed layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from evenzero.spec import mark_expert


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel and expert-data-parallel process groups."""

    ep_group: Any
    """Ranks that together hold all experts: {kE, ..., kE+E-1} (E + D layout)."""
    edp_group: Any
    """Ranks holding the same experts, over which their gradients are reduced: {i, i+E, ...}
    (E + D layout)."""
    ep_rank: int
    """This rank's position in its EP group (which slice of experts it holds)."""
    edp_rank: int
    """This rank's position in its EDP group."""
    ep_size: int
    """E, the expert-parallel size."""

    @property
    def group_name(self) -> str:
        """DeepSpeed's name for the expert parameter group."""
        return f"ep_size_{self.ep_size}"


def expert_parallel_groups(ep_size: int, data_before_expert: bool = False) -> ExpertGroups:
    """Create every EP and EDP group (same order on every rank) and return this rank's.

    `data_before_expert=True` is DeepSpeed's "D + E" layout (`use_data_before_expert_parallel_`);
    the default is its "E + D" layout. A collective: every rank of the world calls it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"expert-parallel size {ep_size!r} must be a positive divisor of the "
                         f"world size {world}")
    dp = world // ep_size
    if data_before_expert:
        ep_sets = [range(j, world, dp) for j in range(dp)]
        edp_sets = [range(i * dp, (i + 1) * dp) for i in range(ep_size)]
        ep_rank, edp_rank = rank // dp, rank % dp
    else:
        ep_sets = [range(k * ep_size, (k + 1) * ep_size) for k in range(dp)]
        edp_sets = [range(i, world, ep_size) for i in range(ep_size)]
        ep_rank, edp_rank = rank % ep_size, rank // ep_size
    ep = edp = None
    for ranks in ep_sets:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            ep = group
    for ranks in edp_sets:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            edp = group
    return ExpertGroups(ep, edp, ep_rank, edp_rank, ep_size)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with split sizes; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class Gate(nn.Module):
    """Top-1 router; the weight is `gate.wg.weight` as in DeepSpeed's TopKGate."""

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.wg(x), dim=-1)
        prob, expert = probs.max(dim=-1)
        return prob, expert


class Expert(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class MoE(nn.Module):
    """Top-1 mixture of experts; `groups=None` holds all experts locally (the reference)."""

    def __init__(self, dim: int, num_experts: int, groups: ExpertGroups | None = None,
                 ffn_dim: int | None = None) -> None:
        super().__init__()
        ep = groups.ep_size if groups is not None else 1
        if num_experts < 1 or num_experts % ep:
            raise ValueError(f"num_experts {num_experts} must be a positive multiple of the "
                             f"expert-parallel size {ep}")
        self.dim, self.num_experts, self.groups = dim, num_experts, groups
        self.ep_size, self.num_local = ep, num_experts // ep
        self.ep_rank = groups.ep_rank if groups is not None else 0
        self.gate = Gate(dim, num_experts)
        self.experts = nn.ModuleList(Expert(dim, ffn_dim or dim) for _ in range(self.num_local))
        if groups is not None:
            for p in self.experts.parameters():
                mark_expert(p, groups.group_name)

    @property
    def global_expert_ids(self) -> range:
        """Global indices of the experts this rank holds, in `self.experts` order."""
        return range(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)

    @torch.no_grad()
    def copy_from_full(self, full: MoE) -> None:
        """Take the gate and this rank's experts from a layer holding every expert."""
        if full.num_experts != self.num_experts or full.num_local != self.num_experts:
            raise ValueError("copy_from_full needs a layer with all experts local (groups=None) "
                             "and the same number of experts")
        self.gate.load_state_dict(full.gate.state_dict())
        for j, e in enumerate(self.global_expert_ids):
            self.experts[j].load_state_dict(full.experts[e].state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        prob, expert = self.gate(x)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.num_experts)
        routed = x[order]
        if self.ep_size > 1:
            group = self.groups.ep_group
            # Each rank learns how many tokens every peer sends to each of its experts.
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=group)
            per_source = recv_counts.view(self.ep_size, self.num_local)
            send = counts.view(self.ep_size, self.num_local).sum(1).tolist()
            recv = per_source.sum(1).tolist()
            tokens = _AllToAll.apply(routed, recv, send, group)
        else:
            per_source = counts.view(1, self.num_local)
            tokens = routed
        out = self._run_experts(tokens, per_source)
        if self.ep_size > 1:
            out = _AllToAll.apply(out, send, recv, group)
        combined = out[torch.argsort(order)]
        return (combined * prob.unsqueeze(-1).to(combined.dtype)).reshape(shape)

    def _run_experts(self, tokens: torch.Tensor, per_source: torch.Tensor) -> torch.Tensor:
        """Tokens arrive grouped by (source rank, local expert); every expert runs, even on
        zero tokens, so every expert parameter gets a gradient on every rank."""
        sizes = per_source.flatten().tolist()
        chunks = list(tokens.split(sizes))
        sources = per_source.shape[0]
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for j, expert in enumerate(self.experts):
            ids = [s * self.num_local + j for s in range(sources)]
            y = expert(torch.cat([chunks[i] for i in ids]))
            for i, part in zip(ids, y.split([sizes[i] for i in ids]), strict=True):
                out[i] = part
        return torch.cat(out)

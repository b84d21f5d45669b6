"""`deepspeed.moe.sharded_moe`: the gate module (`TopKGate`) and the layer that sends each
token to its expert and back (`MOELayer`), with DeepSpeed 0.19.8's semantics
(deepspeed/moe/sharded_moe.py@0.19.8:97-755).

`MOELayer.forward` (sharded_moe.py@0.19.8:649-755): the gate gives every (token, route) an
expert and a slot; the tokens are gathered into an `[experts, capacity, model]` buffer,
exchanged with one `all_to_all` over the expert-parallel group (each rank receives the
slots of its own experts from every rank of the group), run through the local experts,
exchanged back, and each token's expert outputs are summed weighted by their gate values
(in fp32). The same tensor operations as DeepSpeed's, so the same values, gradients
included. Without tensor parallelism (evenzero has none) DeepSpeed's token dropping and
gathering across tensor-parallel ranks are identities and are left out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from evenzero.deepspeed.log import warning_rank0
from evenzero.deepspeed.moe.gating import (
    _capacity,
    check_noisy_gate_policy,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)
from evenzero.deepspeed.moe.groups import create_expert_groups

TUTEL_INSTALLED = False
"""DeepSpeed's flag for its optional Tutel kernels; evenzero has none (`use_tutel` runs
without them, as DeepSpeed does when Tutel is not installed)."""


class _AllToAll(torch.autograd.Function):
    """Equal-split `all_to_all_single` over `group`; its gradient is the same exchange
    (sharded_moe.py@0.19.8:97-109)."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:  # noqa: A002 - DeepSpeed's name
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


class TopKGate(nn.Module):
    """The router: `wg` (a bias-free Linear, model_dim -> num_experts) scores the tokens in
    fp32, then top-1, top-2 or top-k gating (sharded_moe.py@0.19.8:509-596).

    `gate(x)` returns `(l_aux, combine_weights, dispatch_mask, exp_counts)`;
    `gate(x, used_token, True)` the sparse routes `MOELayer` uses."""

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8,
                 noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (k > 2 and k > num_experts):
            raise ValueError(f"TopKGate k={k!r}: k must be 1, 2, or an integer from 3 up to the "
                             f"number of experts ({num_experts})")
        check_noisy_gate_policy(noisy_gate_policy)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group: Any) -> None:
        # DeepSpeed refuses any second assignment (sharded_moe.py@0.19.8:555-557); the same
        # group again (initialize called twice on one model) changes nothing and is let be.
        if self.ep_group is not None and self.ep_group is not ep_group:
            raise AssertionError("Attempting to override an existing ep_group")
        self.ep_group = ep_group

    def forward(self, input: Tensor, used_token: Tensor | None = None,  # noqa: A002
                sparse_routes: bool = False, use_tutel: bool = False) -> tuple:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = torch.nn.functional.linear(x, weight=self.wg.weight.float(), bias=None)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens,
                              self.use_rts, self.ep_group, sparse_routes, use_tutel)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, sparse_routes)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens,
                          self.ep_group, sparse_routes=sparse_routes)


# --------------------------------------------------------------------------- dispatch

def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Each (route, token)'s flat slot in the [e * c] buffer; dropped routes (expert -1)
    share one scratch slot past the end (sharded_moe.py@0.19.8:177-185)."""
    flat_slot = indices.long() * capacity + locations.long()
    scratch = torch.full_like(flat_slot, num_experts * capacity)
    return torch.where(indices >= 0, flat_slot, scratch)


def _sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The [e, c, m] expert buffer: one gather through the inverted routing; empty slots
    read a zero row (sharded_moe.py@0.19.8:188-201)."""
    num_tokens, d_model = tokens.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long,
                        device=slots.device)
    token_ids = torch.arange(num_tokens, device=slots.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, d_model)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, d_model)


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """Each token's expert outputs weighted by its fp32 gate values and summed over its
    routes in fp32, then cast back (sharded_moe.py@0.19.8:204-213)."""
    d_model = expert_output.size(-1)
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.size(0), num_tokens, d_model)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (sharded_moe.py@0.19.8:599-755). `l_aux` and
    `exp_counts` hold the last forward's auxiliary loss and per-expert token counts
    (counted before the capacity limit)."""

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        if use_tutel:
            warning_rank0("use_tutel=True: Tutel optimization requested but not available in "
                          "evenzero; proceeding without Tutel, as DeepSpeed does when Tutel is "
                          "not installed (the same routing, computed by torch)")

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _ensure_ep_group(self) -> None:
        """A forward before `deepspeed.initialize` set the groups: create them now (every rank
        runs the forward, so every rank creates them), in DeepSpeed's default layout."""
        if self.ep_group is not None or self.ep_size == 1:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"this MoE layer has ep_size={self.ep_size}: its all_to_all needs "
                f"torch.distributed initialized (deepspeed.init_distributed() or "
                f"deepspeed.initialize(...)) before its forward")
        self._set_ep_group(create_expert_groups(self.ep_size).ep_group)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:  # noqa: A002 - DeepSpeed's
        self._ensure_ep_group()
        d_model = input[0].shape[-1]
        tokens = input[0].reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else None
        (self.l_aux, capacity, num_experts, indices, locations, gates,
         self.exp_counts) = self.gate(tokens, used_token, True, self.use_tutel)
        num_tokens, model_dim = tokens.size(0), tokens.size(1)
        capacity = int(capacity)

        slots = _route_slots(indices, locations, num_experts, capacity)
        dispatched = _sparse_encode(tokens, slots, num_experts, capacity)
        if self.ep_size > 1:
            dispatched = _AllToAll.apply(self.ep_group, dispatched)
        else:
            dispatched = dispatched.contiguous()
        # [source rank, local expert, capacity, model]
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        if self.ep_size > 1:
            expert_output = _AllToAll.apply(self.ep_group, expert_output)
        else:
            expert_output = expert_output.contiguous()
        combined = _sparse_decode(expert_output.view(num_experts * capacity, model_dim), slots,
                                  gates, num_tokens)
        return combined.reshape(input[0].shape)


__all__ = ["MOELayer", "TUTEL_INSTALLED", "TopKGate", "_capacity", "gumbel_rsample",
           "multiplicative_jitter", "top1gating", "top2gating", "topkgating"]

"""DeepSpeed's MoE gating: which expert(s) each token goes to, at which slot of the expert's
capacity, with which weight, and the auxiliary load-balancing loss.

The functions keep DeepSpeed 0.19.8's names, arguments and return values
(deepspeed/moe/sharded_moe.py@0.19.8:152-506): `top1gating`, `top2gating` and
`topkgating` (k >= 3). With `sparse_routes=True` (what `MOELayer` asks for) they return
`(l_aux, capacity, num_experts, indices [k, s], locations [k, s], gates [k, s], exp_counts)`,
where a route dropped by the capacity limit has expert index -1; otherwise
`(l_aux, combine_weights [s, e, c], dispatch_mask [s, e, c], exp_counts)`.

Same seeds, same losses: the noise comes from the global torch RNG through the same
`torch.distributions` draws, in the same order and shapes as DeepSpeed's (RSample's Gumbel
noise, then the random-token-selection uniform; Jitter's uniform before both, in
`TopKGate`), and every step that decides a route or a capacity is the same tensor
operation, so ties (`argmax`, `topk` over equal scores) break the same way. Everything here
runs in fp32 (`TopKGate` casts the input and its weight).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributions import Gumbel, Uniform

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""What `noisy_gate_policy` accepts (deepspeed/moe/layer.py@0.19.8:69); "None" is no noise."""


def check_noisy_gate_policy(policy: Any) -> None:
    if policy not in NOISY_GATE_POLICIES:
        raise AssertionError(f"Unsupported noisy_gate_policy: {policy!r} (DeepSpeed's MoE accepts "
                             f"None, 'None', 'Jitter' or 'RSample')")


# --------------------------------------------------------------------------- noise

def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """`x` times uniform noise in [1 - epsilon, 1 + epsilon) (sharded_moe.py@0.19.8:55-76)."""
    if epsilon == 0:
        return x
    noise = Uniform(low=torch.tensor(1.0 - epsilon, device=device),
                    high=torch.tensor(1.0 + epsilon, device=device), validate_args=False)
    return x * noise.rsample(x.shape)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel noise (sharded_moe.py@0.19.8:79-86)."""
    gumbel = Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device),
                    validate_args=False)
    return gumbel.rsample(shape)


def _random_token_scores(shape: torch.Size, device: torch.device) -> Tensor:
    """Uniform [0, 1) scores for random token selection (sharded_moe.py@0.19.8:267-274)."""
    uniform = Uniform(low=torch.tensor(0.0, device=device), high=torch.tensor(1.0, device=device),
                      validate_args=False)
    return uniform.rsample(shape)


# --------------------------------------------------------------------------- capacity

def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """Slots per expert: ceil(tokens / experts * factor), at least `min_capacity`
    (sharded_moe.py@0.19.8:152-162). The product is float32, as DeepSpeed's: the factor is
    a float32 tensor."""
    num_tokens, num_experts = gates.shape[0], gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    return torch.maximum(capacity, min_capacity.to(torch.int64))


def _is_parallel(group: Any) -> bool:
    """DeepSpeed's `pg_utils.is_parallel`: None means no expert parallelism."""
    return group is not None and dist.get_world_size(group) > 1


def _capacity_without_drops(exp_counts: Tensor, ep_group: Any) -> Tensor:
    """`drop_tokens=False`: the largest expert load over the expert-parallel group, so the
    all_to_all buffers agree (sharded_moe.py@0.19.8:249-257, 367-377, 465-475)."""
    capacity = torch.max(exp_counts).to(exp_counts.device)
    if _is_parallel(ep_group):
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ep_group)
    # DeepSpeed rounds up to the tensor-parallel size, 1 here (no tensor parallelism); the
    # float32 round trip is kept so the value is DeepSpeed's in every case.
    return torch.ceil(capacity / 1).mul(1).to(capacity.dtype)


def _load_balancing_loss(gates: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(mean gate probability, fraction of tokens) per expert: the factors of `l_aux`."""
    return torch.mean(gates, dim=0), torch.mean(mask.float(), dim=0)


def _stack_routes(routes: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """[s, k] per-route values as the [k, s] block the dispatch uses
    (sharded_moe.py@0.19.8:165-174)."""
    routes = routes.t().contiguous()
    return routes if dtype is None else routes.to(dtype)


# --------------------------------------------------------------------------- top-1

def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int,
               used_token: Tensor | None = None, noisy_gate_policy: str | None = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
               sparse_routes: bool = False, use_tutel: bool = False) -> tuple:
    """Top-1 gating (sharded_moe.py@0.19.8:216-319). `use_tutel` is accepted and changes
    nothing: Tutel's `fast_cumsum_sub_one` is the cumulative sum taken here."""
    noisy_logits = None
    if noisy_gate_policy == "RSample":
        noisy_logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    capacity = _capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity))

    expert = torch.argmax(noisy_logits if noisy_logits is not None else gates, dim=1)
    num_experts = int(gates.shape[1])
    mask = F.one_hot(expert, num_classes=num_experts)
    if used_token is not None:
        mask = torch.einsum("s,se->se", used_token, mask)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    if not drop_tokens:
        capacity = torch.minimum(_capacity_without_drops(exp_counts, ep_group),
                                 torch.tensor(mask.size(0)).to(exp_counts.device))

    me, ce = _load_balancing_loss(gates, mask)
    l_aux = torch.sum(me * ce) * num_experts

    # Random token selection: which tokens an over-full expert keeps. Drawn whether or not
    # anything is dropped, as DeepSpeed draws it.
    scores = mask * _random_token_scores(mask.shape, logits.device) if use_rts else mask
    if logits.shape[0] < min_capacity:
        raise AssertionError(
            f"No. of tokens (batch-size) should be greater than min_capacity: this MoE layer got "
            f"{logits.shape[0]} tokens with min_capacity={min_capacity}. Either set min_capacity "
            f"to 0 or increase your batch size.")
    selection = int(torch.minimum(capacity, torch.tensor(mask.size(0)).to(capacity.device)))
    kept = torch.topk(scores, k=selection, dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, kept, 1)
    locations = torch.cumsum(mask, dim=0) - 1
    location = torch.sum(locations * mask, dim=1)

    if sparse_routes:
        # A dropped token's expert becomes -1: min(expert, kept * E - 1).
        expert = torch.min(expert, mask.sum(dim=1) * num_experts - 1)
        gate = (gates * mask).sum(dim=1)
        return (l_aux, capacity, num_experts, expert.to(torch.int32).unsqueeze(0),
                location.to(torch.int32).unsqueeze(0), gate.unsqueeze(0), exp_counts)

    gates = gates * mask.float()
    location_sc = F.one_hot(location, num_classes=int(capacity)).float()
    combine_weights = torch.einsum("se,sc->sec", gates, location_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


# --------------------------------------------------------------------------- top-2

def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None,
               top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False) -> tuple:
    """Top-2 gating (sharded_moe.py@0.19.8:322-412). The second expert is sampled with
    Gumbel noise added to `logits` in place (also in eval mode), as DeepSpeed does; the
    noisy-gate policy plays no part here."""
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(first, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits += gumbel_rsample(logits.shape, device=logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)

    # Second choices queue behind every first choice of the same expert.
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    me, ce = _load_balancing_loss(gates, mask1)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(logits.device)

    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
        mask1 *= torch.lt(locations1, capacity)
        mask2 *= torch.lt(locations2, capacity)
    else:
        capacity = _capacity_without_drops(exp_counts, ep_group)

    location1 = torch.sum(locations1 * mask1, dim=1)
    location2 = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.float(), mask2.float()
    gate1 = torch.einsum("se,se->s", gates, mask1_float)
    gate2 = torch.einsum("se,se->s", gates, mask2_float)
    denom = torch.clamp(gate1 + gate2, min=torch.finfo(gate1.dtype).eps)
    gate1 /= denom
    gate2 /= denom

    if sparse_routes:
        first = torch.where(mask1.any(dim=1), first, torch.full_like(first, -1))
        second = torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))
        return (l_aux, capacity, num_experts, torch.stack([first, second]).to(torch.int32),
                torch.stack([location1, location2]).to(torch.int32),
                torch.stack([gate1, gate2]), exp_counts)

    slots = int(capacity)
    combine1 = torch.einsum("se,sc->sec", torch.einsum("s,se->se", gate1, mask1_float),
                            F.one_hot(location1, num_classes=slots).float())
    combine2 = torch.einsum("se,sc->sec", torch.einsum("s,se->se", gate2, mask2_float),
                            F.one_hot(location2, num_classes=slots).float())
    combine_weights = combine1 + combine2
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


# --------------------------------------------------------------------------- top-k, k >= 3

def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group: Any = None, drop_policy: str = "probs",
               sparse_routes: bool = False) -> tuple:
    """Top-k gating, what `TopKGate` runs for k >= 3 (sharded_moe.py@0.19.8:415-506).
    `drop_policy="probs"` keeps each expert's most probable tokens, "position" its first."""
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    me, ce = _load_balancing_loss(gates, mask)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k

    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
        if drop_policy == "probs":
            scores = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            selection = int(torch.minimum(capacity, torch.tensor(gates.size(0)).to(capacity.device)))
            _, kept = torch.topk(scores, k=selection, dim=0, sorted=False)
            mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, kept, True)
            locations = torch.cumsum(mask, dim=0) - 1
        elif drop_policy == "position":
            locations = torch.cumsum(mask, dim=0) - 1
            mask *= torch.lt(locations, capacity)
        else:
            raise ValueError(f"Invalid drop_policy: {drop_policy} (DeepSpeed's topkgating accepts "
                             f"'probs' or 'position')")
    else:
        capacity = _capacity_without_drops(exp_counts, ep_group)
        locations = torch.cumsum(mask, dim=0) - 1

    gates_masked = gates * mask
    denom = torch.clamp(torch.sum(gates_masked, dim=-1, keepdim=True),
                        min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom

    if sparse_routes:
        route_kept = mask.gather(1, top_idx)
        route_expert = torch.where(route_kept, top_idx, torch.full_like(top_idx, -1))
        route_location = locations.gather(1, top_idx) * route_kept
        return (l_aux, capacity, num_experts, _stack_routes(route_expert, torch.int32),
                _stack_routes(route_location, torch.int32),
                _stack_routes(gates_masked.gather(1, top_idx)), exp_counts)

    location_sc = F.one_hot(locations * mask, num_classes=int(capacity)).float()
    combine_weights = torch.einsum("se,sec->sec", gates_masked, location_sc)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts

"""Expert parallelism: an all_to_all MoE layer trained with ZeroOptimizer on expert groups
equals single-process training of the same layer holding every expert.

Expert gradients are reduced over the expert-data-parallel group but divided by the
WORLD size (the reference is the mean loss over the global batch; DeepSpeed #6546).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_helpers import CheckResults, run_checks
from test_runtime_models import part

DIM, EXPERTS = 6, 4
EXPERT_LR = 3e-3


class SeedLike(nn.Module):
    """The seed case's shape: fc1, fc2, moe registered; forward x -> moe -> fc1 -> fc2."""

    def __init__(self, groups) -> None:
        from evenzero.moe import MoE

        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.moe = MoE(DIM, EXPERTS, groups, ffn_dim=5)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.moe(x))))


def _batch(step: int, size: int):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(size, DIM, generator=g), torch.randn(size, DIM, generator=g)


def _reference_name(name: str, moe) -> str:
    """The reference parameter that a local parameter corresponds to."""
    if name.startswith("moe.experts."):
        _, _, j, rest = name.split(".", 3)
        return f"moe.experts.{moe.global_expert_ids[int(j)]}.{rest}"
    return name


def run_moe(rank, world, ep_size, stage, convention, steps=3):
    from evenzero import ZeroOptimizer
    from evenzero.moe import expert_parallel_groups

    groups = expert_parallel_groups(ep_size)
    torch.manual_seed(0)
    ref = SeedLike(None)
    model = SeedLike(groups)
    with torch.no_grad():
        model.fc1.load_state_dict(ref.fc1.state_dict())
        model.fc2.load_state_dict(ref.fc2.state_dict())
    model.moe.copy_from_full(ref.moe)
    kw = {"lr": 1e-2, "weight_decay": 0.01}
    if convention == "marker":
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, bucket_numel=64,
                            expert_groups={groups.group_name: groups.edp_group}, **kw)
        expert_group = groups.group_name
    else:
        experts = list(model.moe.experts.parameters())
        dense = [p for p in model.parameters() if all(p is not q for q in experts)]
        opt = ZeroOptimizer(model, torch.optim.AdamW, [
            {"params": dense},
            {"params": experts, "process_group": groups.edp_group, "name": "experts",
             "lr": EXPERT_LR},
        ], stage=stage, bucket_numel=64, **kw)
        expert_group = "experts"
        assert [g["lr"] for g in opt.param_groups] == [kw["lr"], EXPERT_LR]
    ref_experts = list(ref.moe.experts.parameters())
    ref_dense = [p for p in ref.parameters() if all(p is not q for q in ref_experts)]
    expert_lr = EXPERT_LR if convention == "param_groups" else kw["lr"]
    ref_opt = torch.optim.AdamW([{"params": ref_dense},
                                 {"params": ref_experts, "lr": expert_lr}], **kw)
    info = opt.plan.group(expert_group)
    assert (info.size, info.expert_parallel_size) == (world // ep_size, ep_size), info
    for step in range(steps):
        x, y = _batch(step, 3 * world)
        F.mse_loss(model(part(x, rank, world)), part(y, rank, world)).backward()
        norm = opt.clip_grad_norm_(10.0)
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 10.0)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[_reference_name(name, model.moe)].detach(),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    backward = opt.plan.backward()
    assert opt.trace[:len(backward)] == backward
    assert {c.group for c in backward} == {"dense", expert_group}
    assert all(c.group_size == world // ep_size for c in backward if c.group == expert_group)
    dist.barrier()


def refuse_expert_parallel_group(rank, world, ep_size):
    """Passing the EP group where the EDP group belongs would average different experts."""
    from evenzero import ZeroOptimizer
    from evenzero.moe import expert_parallel_groups
    from evenzero.runtime import ZeroConfigError

    groups = expert_parallel_groups(ep_size)
    model = SeedLike(groups)
    with pytest.raises(ZeroConfigError, match="must be the expert-data-parallel group"):
        ZeroOptimizer(model, torch.optim.SGD, lr=0.1,
                      expert_groups={groups.group_name: groups.ep_group})


def broadcast_from_first_rank_of_each_group(rank, world, ep_size):
    """Every rank initialises differently: dense parameters and buffers start from rank
    0's values, expert parameters from the first rank of their expert-data-parallel group
    (rank r % E), as DeepSpeed's engine broadcasts them; each expert stays its own."""
    from evenzero import ZeroOptimizer
    from evenzero.moe import expert_parallel_groups

    groups = expert_parallel_groups(ep_size)
    torch.manual_seed(100 + rank)
    model = SeedLike(groups)
    before = [None] * world
    dist.all_gather_object(before, {n: p.detach().clone() for n, p in model.named_parameters()})
    ZeroOptimizer(model, torch.optim.SGD, lr=0.1,
                  expert_groups={groups.group_name: groups.edp_group}).close()
    for name, p in model.named_parameters():
        source = rank % ep_size if name.startswith("moe.experts.") else 0
        assert torch.equal(p.detach(), before[source][name]), (name, source)


CASES = {
    "broadcast": (2, "broadcast"),
    "marker_stage2": (2, "marker"),
    "param_groups_stage1": (1, "param_groups"),
    "param_groups_stage2": (2, "param_groups"),
    "expert_parallel_group_refused": (2, "refused"),
}


def moe_case(rank, world, ep_size, stage, convention):
    if convention == "refused":
        refuse_expert_parallel_group(rank, world, ep_size)
    elif convention == "broadcast":
        broadcast_from_first_rank_of_each_group(rank, world, ep_size)
    else:
        run_moe(rank, world, ep_size, stage, convention)


def moe_job(rank, world, ep_size):
    return run_checks({name: partial(moe_case, rank, world, ep_size, stage, convention)
                       for name, (stage, convention) in CASES.items()})


RESULTS = CheckResults(moe_job, timeout=240)


@pytest.mark.parametrize("world,ep_size", [(4, 2), pytest.param(8, 4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_reference_with_all_experts(world, ep_size, case):
    RESULTS.assert_passed(case, world, ep_size)

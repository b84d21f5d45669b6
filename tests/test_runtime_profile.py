"""The profiler sees evenzero's regions: a seed-like step (dense layers and experts on
two gloo ranks) profiled with torch.profiler shows every "evenzero::" label."""

from __future__ import annotations

import torch

from dist_helpers import run_distributed

LABELS = ("evenzero::backward_hook", "evenzero::bucket_copy", "evenzero::launch",
          "evenzero::wait", "evenzero::accumulate", "evenzero::step_check",
          "evenzero::step", "evenzero::gather", "evenzero::gather_wait")


def profile_job(rank: int, world: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from evenzero import ZeroOptimizer
    from evenzero.moe import expert_parallel_groups
    from evenzero.repro.seedmodel import SeedModel, SeedModelConfig, seed_batch, seed_loss

    config = SeedModelConfig(dim=16, num_experts=4, ep_size=2, tokens_per_rank=4)
    groups = expert_parallel_groups(config.ep_size)
    model = SeedModel(config, groups)
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, bucket_numel=256,
                        expert_groups={config.expert_group_name: groups.edp_group})
    for step in range(2):  # the first backward only measures the arrival order
        x, y = seed_batch(config, step, rank, world)
        if step == 1:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                seed_loss(model(x), y).backward()
                opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
            names = {e.name for e in prof.events()}
        else:
            seed_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return sorted(n for n in names if n.startswith("evenzero::"))


def test_profile_of_a_seed_like_step_shows_every_label():
    for rank, names in enumerate(run_distributed(profile_job, 2, timeout=120)):
        missing = [label for label in LABELS if label not in names]
        assert not missing, f"rank {rank}: no {missing} in {names}"

"""Consolidated export of a model with two expert groups of different expert-parallel size.

Rank r of the E+D layout holds experts r mod E of each group, so the export needs one
writer per combination (r mod 2, r mod 4): four directories at world size 4. Choosing
"rank 0 of every expert-data-parallel group" as the writer would miss ranks 2 and 3.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from evenzero.repro.localrun import LaunchOptions, RankContext, launch


class TwoExpertGroups(nn.Module):
    def __init__(self, g2, g4) -> None:
        from evenzero.moe import MoE

        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe2 = MoE(8, 4, g2)
        self.moe4 = MoE(8, 4, g4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe4(self.moe2(self.inp(x)))


def export_worker(ctx: RankContext, root: Path) -> list[str]:
    import torch.distributed as dist

    from evenzero import ZeroOptimizer, checkpoint
    from evenzero.moe import expert_parallel_groups

    g2, g4 = expert_parallel_groups(2), expert_parallel_groups(4)
    torch.manual_seed(0)
    model = TwoExpertGroups(g2, g4)
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2,
                        expert_groups={"ep_size_2": g2.edp_group, "ep_size_4": g4.edp_group})
    torch.manual_seed(1 + ctx.rank)
    model(torch.randn(16, 8)).pow(2).mean().backward()
    opt.step()
    checkpoint.export_consolidated(opt, root)
    dist.barrier()
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_export_writes_every_expert_rank_combination(tmp_path):
    out = launch(export_worker, tmp_path, LaunchOptions(4, backend="gloo", timeout_s=120,
                                                        threads_per_rank=1))
    assert out == ["ep-0-0", "ep-0-2", "ep-1-1", "ep-1-3"]
    for label in out:
        assert any((tmp_path / label).iterdir()), label

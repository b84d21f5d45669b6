"""The README's training loop as a script, for the clean-exit tests under torchrun.

    torchrun --standalone --nproc-per-node 2 tests/readme_loop_job.py [--bf16] [--overlap]
        [--end {nothing,destroy,del,save}]

It ends the way real jobs end: falling off the end of the script (`nothing`), with
`dist.destroy_process_group()` (`destroy`), dropping the optimizer first (`del`), or
saving a checkpoint as the last thing (`save`). Every rank must exit with status 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import evenzero


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--overlap", action="store_true", help="overlap_param_gather=True")
    parser.add_argument("--end", choices=("nothing", "destroy", "del", "save"),
                        default="nothing")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 8)).to(dtype)
    opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01,
                                 stage=2, bucket_numel=2**10,
                                 overlap_param_gather=args.overlap)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        batch = torch.randn(16, 32, generator=generator).to(dtype)
        loss = model(batch).float().mean()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    if args.end == "save":
        # One directory for every rank of this torchrun job, removed once all have written.
        where = Path(tempfile.gettempdir()) / f"evenzero-exit-{os.environ['TORCHELASTIC_RUN_ID']}"
        from evenzero import checkpoint

        checkpoint.save(opt, where)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where, ignore_errors=True)
    if args.end == "del":
        del opt
    if args.end in ("destroy", "del"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

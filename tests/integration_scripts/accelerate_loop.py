"""An Accelerate training loop with a `DeepSpeedPlugin` (ZeRO-2), written as Accelerate's
docs show it: `accumulate`, `backward`, `clip_grad_norm_`, `save_state` / `load_state`,
`get_state_dict`. The same file runs under real DeepSpeed and under evenzero:

    torchrun --nproc-per-node 2 accelerate_loop.py --out DIR
    evenzero run torchrun --nproc-per-node 2 accelerate_loop.py --out DIR

`--save-at K` saves the state after K batches; `--resume DIR` loads it in a new process
and continues after those batches. Writes DIR/record.rank<r>.json (every micro-batch
loss, the gradient norms) and, from the main process, DIR/final_state_dict.pt
(`accelerator.get_state_dict`).
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from torch import nn


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 4))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", default="")
    p.add_argument("--micro-batch", type=int, default=4)
    args = p.parse_args()

    # On a CPU-only machine Accelerate's DeepSpeed path needs the CPU process group set up
    # first (its accelerator probe finds no GPU); on GPUs this line is left out.
    PartialState(cpu=True)
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=2, gradient_clipping=0.5)
    accelerator = Accelerator(deepspeed_plugin=plugin)

    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 16, generator=g)
    y = torch.randn(128, 4, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=args.micro_batch, shuffle=False)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    start = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start = args.save_at
    losses, norms = [], []
    batches = accelerator.skip_first_batches(loader, start) if start else loader
    for i, (xb, yb) in enumerate(batches, start=start):
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                norms.append(float(norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if args.save_at and not args.resume and i + 1 == args.save_at:
            accelerator.save_state(os.path.join(args.out, "state"))

    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state, os.path.join(args.out, "final_state_dict.pt"))
    with open(os.path.join(args.out, f"record.rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "start": start,
                   "world_size": accelerator.num_processes,
                   "distributed_type": str(accelerator.distributed_type)}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()

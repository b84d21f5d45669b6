"""A Lightning Fabric training loop, run with `strategy="ddp"` or `strategy="evenzero"`.

Written the way Fabric users write one: `fabric.launch()`, `fabric.setup(model, optimizer,
scheduler=...)`, `fabric.setup_dataloaders`, gradient accumulation with
`fabric.no_backward_sync`, `fabric.backward`, `fabric.clip_gradients(max_norm=...)`,
`optimizer.step()`, `scheduler.step()`, and `fabric.save` / `fabric.load` of
`{"model", "optimizer", "scheduler", "step"}`. The only lines evenzero needs are
`import evenzero.lightning` and the strategy name.

    python tests/lightning_fabric_job.py --out DIR --devices 2 --strategy ddp evenzero

Each strategy (one after another, in the same processes) trains twice: straight through, saving a
checkpoint after `--save-at` optimizer steps, and again from that checkpoint with a
fresh model, optimizer and scheduler (`fabric.load`). `<out>/<strategy>-rank<r>.json`
holds every micro-batch's loss, every step's gradient norm and the final parameters of
both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import evenzero.lightning  # noqa: F401 - registers strategy="evenzero"

DIM, HIDDEN, SAMPLES, GLOBAL_BATCH, ACCUMULATE, EPOCHS = 16, 32, 96, 12, 2, 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(SAMPLES, DIM, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def build(fabric: L.Fabric):
    fabric.seed_everything(3)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.25 * s))
    return fabric.setup(model, optimizer, scheduler=scheduler)


def train(fabric, model, optimizer, scheduler, loader, start: int, save_at: int | None,
          path: Path, precision_loss) -> dict:
    record = {"loss": [], "norm": [], "lr": [], "trace": []}
    step = 0
    micro = 0
    for _ in range(EPOCHS):
        for x, y in loader:
            micro += 1
            if micro <= start * ACCUMULATE:
                continue  # the data before the checkpoint
            accumulating = micro % ACCUMULATE != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = precision_loss(model(x), y)
                fabric.backward(loss / ACCUMULATE)
            record["loss"].append(loss.item())
            if accumulating:
                continue
            norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
            record["norm"].append(float(norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step = micro // ACCUMULATE
            record["lr"].append(optimizer.param_groups[0]["lr"])
            zero = getattr(fabric.strategy, "zero_optimizer", None)
            if zero is not None:  # backward collectives issued in this step, and planned
                record["trace"].append((sum(1 for c in zero.trace if c.phase == "backward"),
                                        len(zero.plan.backward())))
            if save_at is not None and step == save_at:
                fabric.save(path, {"model": model, "optimizer": optimizer,
                                   "scheduler": scheduler, "step": step})
    record["params"] = [p.detach().double().flatten().tolist() for p in model.parameters()]
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", nargs="+", default=["evenzero"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--save-at", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for strategy in args.strategy:
        run(strategy, args)


def run(strategy: str, args: argparse.Namespace) -> None:
    out = Path(args.out)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy,
                      precision=args.precision)
    fabric.launch()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{strategy}.ckpt"
    loader = fabric.setup_dataloaders(
        DataLoader(dataset(), batch_size=GLOBAL_BATCH // args.devices, shuffle=False))

    def mse(pred, y):
        return F.mse_loss(pred.float(), y.float())

    model, optimizer, scheduler = build(fabric)
    straight = train(fabric, model, optimizer, scheduler, loader, 0, args.save_at, path, mse)
    fabric.barrier()

    model, optimizer, scheduler = build(fabric)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(path, state)
    resumed = train(fabric, model, optimizer, scheduler, loader, state["step"], None, path, mse)
    # Inference: fabric.setup(model) without an optimizer starts every rank from rank 0's
    # weights, as DDP's wrapper does.
    torch.manual_seed(fabric.global_rank)
    evaluator = fabric.setup(nn.Linear(DIM, 1))
    first = [p.detach().clone() for p in evaluator.parameters()]
    fabric.barrier()
    synced = all(torch.equal(a, b) for a, b in zip(first, fabric.broadcast(first, 0), strict=True))
    result = {"straight": straight, "resumed": resumed, "resumed_from": state["step"],
              "remainder": sorted(remainder), "inference_synced": synced}
    (out / f"{strategy}-rank{fabric.global_rank}.json").write_text(json.dumps(result))
    fabric.barrier()


if __name__ == "__main__":
    main()

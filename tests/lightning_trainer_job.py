"""A Lightning Trainer script, run with `strategy="ddp"` or `strategy="evenzero"`.

Written the way Lightning users write one: a LightningModule with `configure_optimizers`
returning an optimizer (two param groups) and an LR scheduler dict, a DataLoader,
`Trainer(accelerator="cpu", devices=N, strategy=..., precision=...,
accumulate_grad_batches=..., gradient_clip_val=..., callbacks=[ModelCheckpoint(...)])`
and `trainer.fit(model, loader, ckpt_path=...)`. The only lines evenzero needs are
`import evenzero.lightning` and the strategy name.

    python tests/lightning_trainer_job.py --spec spec.json

With LIGHTNING_PACKAGE=pytorch_lightning the script uses the standalone
`pytorch_lightning` package instead of `lightning.pytorch` (imported before evenzero's).

Lightning launches the other ranks itself (it re-runs this script). The spec lists
runs, done one after another in the same processes; each writes
`<out>/<name>-rank<r>.json` with the losses of every micro-batch, the learning rates,
the final parameters and, for evenzero, the collectives of each step. A run with
`"expect_error": true` records the exception instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("LIGHTNING_PACKAGE") == "pytorch_lightning":
    import pytorch_lightning as L
else:
    import lightning.pytorch as L

import evenzero.lightning  # noqa: E402 - registers strategy="evenzero"

Callback, ModelCheckpoint = L.callbacks.Callback, L.callbacks.ModelCheckpoint

DIM, HIDDEN, SAMPLES = 16, 32, 96


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


class Regressor(L.LightningModule):
    def __init__(self, scheduler: str = "onecycle", lr: float = 0.02, total_steps: int = 8,
                 optimizers: int = 1, return_none_at: int = -1, manual: bool = False,
                 note: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                                 nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.record: list[dict] = []
        self.tested: list[float] = []
        self.seen = 0  # module state outside parameters and buffers (get_extra_state)

    def get_extra_state(self):
        return {"seen": self.seen}

    def set_extra_state(self, state) -> None:
        self.seen = state["seen"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += 1
        loss = F.mse_loss(self(x).float(), y.float())
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.record.append({"loss": loss.item(), "step": self.trainer.global_step,
                            "lr": self.trainer.optimizers[0].param_groups[0]["lr"]})
        if not self.automatic_optimization:
            opt = self.optimizers()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()
            return loss
        if batch_idx == self.hparams.return_none_at:
            return None
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.tested.append(F.mse_loss(self(x).float(), y.float()).item())

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
        lr = self.hparams.lr
        groups = [{"params": decay, "weight_decay": 0.05, "name": "decay"},
                  {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
        if self.hparams.optimizers == 2:
            return [opt, torch.optim.SGD(self.parameters(), lr=lr)]
        kind = self.hparams.scheduler
        if kind == "none":
            return opt
        if kind == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr,
                                                        total_steps=self.hparams.total_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if kind == "lambda":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if kind == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if kind == "plateau":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0,
                                                               threshold=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch",
                                                       "monitor": "train_loss_epoch"}}
        raise ValueError(kind)


class StepTrace(Callback):
    """After each optimizer step under evenzero: how many backward collectives the step
    issued (its trace) and how many the plan has (one reduce-scatter per bucket)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self._seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        zero = getattr(trainer.strategy, "zero_optimizer", None)
        if zero is None or trainer.global_step == self._seen:
            return
        self._seen = trainer.global_step
        issued = sum(1 for c in zero.trace if c.phase == "backward")
        self.steps.append((issued, len(zero.plan.backward())))


def run(spec: dict, out: Path, devices: int) -> None:
    L.seed_everything(spec.get("seed", 7), verbose=False)
    model = Regressor(scheduler=spec.get("scheduler", "onecycle"),
                      total_steps=spec.get("total_steps", 8),
                      optimizers=spec.get("optimizers", 1),
                      return_none_at=spec.get("return_none_at", -1),
                      manual=spec.get("manual", False),
                      note=Path(spec["note_path"]) if spec.get("note_path") else None)
    batch = spec.get("global_batch", 12) // devices
    loader = DataLoader(dataset(), batch_size=batch, shuffle=False)
    trace = StepTrace()
    callbacks: list[Callback] = [trace]
    if spec.get("save_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["save_dir"], save_top_k=-1,
                                         every_n_epochs=1, save_last=spec.get("save_last", False)))
    strategy = spec["strategy"]
    if isinstance(strategy, dict):  # {"evenzero": {ZeroConfig fields}}
        (name, options), = strategy.items()
        options = {k: getattr(torch, v) if k.endswith("dtype") else v for k, v in options.items()}
        strategy = (evenzero.lightning.standalone if L.__name__ == "pytorch_lightning"
                    else evenzero.lightning).EvenZeroStrategy(**options)
    plugins = []
    precision = spec.get("precision", "32-true")
    if precision == "16-mixed-cpu":  # fp16 autocast and a GradScaler on the CPU
        plugins, precision = [L.plugins.precision.MixedPrecision("16-mixed", "cpu")], None

    def make_trainer(strategy, callbacks):
        return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                         precision=precision, plugins=plugins,
                         max_epochs=spec.get("epochs", 2),
                         accumulate_grad_batches=spec.get("accumulate", 2),
                         gradient_clip_val=spec.get("clip"),
                         gradient_clip_algorithm=spec.get("clip_algorithm"),
                         callbacks=callbacks, logger=False,
                         enable_checkpointing=bool(spec.get("save_dir")),
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out))

    trainer = make_trainer(strategy, callbacks)
    result: dict = {"error": None}
    try:
        if spec.get("test_only"):
            trainer.test(model, loader, ckpt_path=spec["test_only"], verbose=False)
        else:
            trainer.fit(model, loader, ckpt_path=spec.get("resume"))
        if spec.get("save_path"):
            trainer.save_checkpoint(spec["save_path"],
                                    weights_only=spec.get("save_weights_only", False))
        if spec.get("test_ckpt"):
            trainer.test(model, loader, ckpt_path=spec["test_ckpt"], verbose=False)
        if spec.get("refit"):  # a new Trainer trains the same model on; the first is dropped
            trainer = make_trainer(spec["strategy"], [trace])
            trainer.fit(model, loader)
    except Exception as e:  # noqa: BLE001 - recorded for the test to read
        if not spec.get("expect_error"):
            raise
        result["error"] = f"{type(e).__name__}: {e}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    result.update(record=model.record, trace=trace.steps, tested=model.tested, seen=model.seen,
                  params=[p.detach().double().flatten().tolist() for p in model.parameters()],
                  global_step=trainer.global_step, epoch=trainer.current_epoch)
    (out / f"{spec['name']}-rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for run_spec in spec["runs"]:
        run(run_spec, out, spec["devices"])
    print(f"done rank {os.environ.get('LOCAL_RANK', '0')}", file=sys.stderr)


if __name__ == "__main__":
    main()

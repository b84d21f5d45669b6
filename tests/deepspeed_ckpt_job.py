"""Real DeepSpeed training that saves a checkpoint, and evenzero resuming it.

Imported by tests/test_checkpoint_deepspeed*.py; every function runs on gloo ranks
spawned by `dist_helpers.run_distributed`.

`train_deepspeed` trains `TiedNet` with real DeepSpeed 0.19.8 (ZeRO-1/2, AdamW,
WarmupDecayLR, gradient accumulation, clipping; optionally bf16/fp16) for `saved_at`
steps, saves, and goes on for `steps` more, recording each step's global mean loss.
`resume_evenzero` builds the same model from a *different* seed (and a zeroed buffer),
a plain `ZeroOptimizer` and DeepSpeed's scheduler, loads the checkpoint with
`load_deepspeed` and trains the same steps with DeepSpeed's loop semantics: loss /
gradient_accumulation_steps per micro-batch, clipping, optimizer step, scheduler step.

Each step's global batch is a function of the step alone; a rank takes equal chunks of
it, so any (world size, micro-batch, accumulation) with the same global batch computes
the same mean gradient and the same mean loss.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DIM = 7
GLOBAL_BATCH = 12
LR = 1e-2
CLIP = 0.05
SAVED_AT = 4
"""Optimizer steps DeepSpeed takes before saving."""


class TiedNet(nn.Module):
    """Trained, frozen and tied parameters, a persistent and a non-persistent buffer."""

    def __init__(self, dim: int = DIM, mid_name: str = "mid") -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        setattr(self, mid_name, nn.Linear(dim, dim, bias=False))
        self.mid_name = mid_name
        self.head = nn.Linear(dim, dim)
        self.head.weight = self.inp.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("shift", torch.full((dim,), 0.1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x * self.scale.to(x.dtype) + self.shift.to(x.dtype)))
        h = torch.tanh(self.frozen(h)) + h
        h = torch.tanh(getattr(self, self.mid_name)(h))
        return self.head(h)


class MoENet(nn.Module):
    """A DeepSpeed MoE layer (2 experts over 2 ranks) between two dense layers."""

    def __init__(self, dim: int = DIM) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = MoE(dim, nn.Linear(dim, dim), num_experts=2, ep_size=2, k=1, min_capacity=0,
                       drop_tokens=False, use_rts=False)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.moe(torch.tanh(self.inp(x)))
        return self.head(h)


@dataclass(frozen=True)
class Run:
    """One DeepSpeed run, and how evenzero resumes it."""

    stage: int = 2
    precision: str = "fp32"
    """fp32, bf16 or fp16 (fp16 on CPU needs DeepSpeed's CPU accelerator patched)."""
    optimizer: str = "torch"
    """torch: DeepSpeed's `torch_adam` (torch.optim.AdamW); fused: DeepSpeed's FusedAdam."""
    zero_extra: dict = field(default_factory=dict)
    """Extra `zero_optimization` settings."""
    config_extra: dict = field(default_factory=dict)
    """Extra top-level config settings."""
    steps: int = 4
    """Steps after the save that both sides train and compare."""
    moe: bool = False
    """Train `MoENet` (DeepSpeed's MoE layer) instead of `TiedNet`."""
    decay_groups: bool = False
    """Two optimizer groups: matrices with weight decay, vectors without."""
    exclude_frozen: bool = False
    """Save with `exclude_frozen_parameters=True` (frozen weights only in the fragments)."""

    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            self.precision]


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    trained = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trained if p.dim() == 2], "weight_decay": 0.05},
            {"params": [p for p in trained if p.dim() != 2], "weight_decay": 0.0}]


def deepspeed_config(run: Run, world: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (2 * world),
        "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "zero_optimization": {"stage": run.stage, **run.zero_extra},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.05,
                                                  "torch_adam": run.optimizer == "torch"}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"total_num_steps": 16, "warmup_num_steps": 3,
                                 "warmup_min_lr": 1e-3, "warmup_max_lr": LR,
                                 "warmup_type": "linear"}},
    }
    config.update(run.config_extra)
    if run.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if run.precision == "fp16":
        # A window longer than the run: DeepSpeed divides the gradients of a step whose
        # scale grows by the grown scale (engine reference, "Quirk"), evenzero does not.
        config["fp16"] = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 100}
    return config


def micro_batch(step: int, world: int, rank: int, gas: int, micro: int,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch `micro` of global step `step`."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    y = torch.sin(x * 2.0) + 0.1 * torch.randn(GLOBAL_BATCH, DIM, generator=g)
    rows = GLOBAL_BATCH // (world * gas)
    chunk = micro * world + rank
    sl = slice(chunk * rows, (chunk + 1) * rows)
    return x[sl].to(dtype), y[sl]


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _deepspeed_env(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1", DS_ACCELERATOR="cpu")


def deepspeed_rank(rank: int, world: int, fp16: bool) -> Any:
    """Set this gloo rank up for real DeepSpeed on the CPU; returns the deepspeed module."""
    import importlib
    import logging

    _deepspeed_env(rank, world)
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    # The shared-memory all-reduce kernel is a C++ build of about a minute on a cold
    # cache; gloo does the same reductions. (`import deepspeed.comm.torch as m` would
    # bind torch itself: deepspeed.comm has an attribute named torch.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if fp16:
        # DeepSpeed's CPU accelerator refuses fp16 where mkldnn lacks fp16 kernels; the
        # ops these models use run in fp16 on any CPU.
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        CPU_Accelerator.is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return deepspeed


def train_deepspeed(rank: int, world: int, run: Run, out: str) -> dict[str, Any]:
    """Train SAVED_AT steps, save to `out`, train `run.steps` more; the losses after."""
    deepspeed = deepspeed_rank(rank, world, run.precision == "fp16")
    torch.manual_seed(0)
    model = MoENet() if run.moe else TiedNet()
    parameters = decay_groups(model) if run.decay_groups else model.parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters,
                                      config=deepspeed_config(run, world))
    gas = engine.gradient_accumulation_steps()

    def step(s: int) -> float:
        total = 0.0
        for m in range(gas):
            x, y = micro_batch(s, world, rank, gas, m, run.dtype())
            loss = F.mse_loss(engine(x).float(), y)
            total += float(loss.detach()) / gas
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        return _mean_over_ranks(total)

    norms: list[float] = []
    before = [step(s) for s in range(SAVED_AT)]
    engine.save_checkpoint(out, client_state={"epoch": 7, "note": "from deepspeed"},
                           exclude_frozen_parameters=run.exclude_frozen)
    after = [step(s) for s in range(SAVED_AT, SAVED_AT + run.steps)]
    return {"before": before, "after": after, "lr": engine.get_lr(), "norms": norms}


@dataclass(frozen=True)
class Resume:
    """How evenzero resumes: its world, micro-batch layout and optimizer options."""

    gas: int
    stage: int = 2
    optimizer_class: Any = torch.optim.AdamW
    mid_name: str = "mid"
    dim: int = DIM
    tag: str | None = None
    tag_on_rank: int | None = None
    """Use `tag` only on this rank (the others read `latest`)."""
    torch_scheduler: bool = False
    """A torch StepLR instead of DeepSpeed's WarmupDecayLR (keeps other state)."""


def build_evenzero(run: Run, resume: Resume):
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    import evenzero
    from evenzero.runtime.precision import LossScaleConfig

    torch.manual_seed(123)
    model = TiedNet(resume.dim, resume.mid_name).to(run.dtype())
    with torch.no_grad():
        model.scale.zero_()
    kwargs: dict[str, Any] = {}
    if run.precision == "fp16":
        kwargs = {"loss_scale": "dynamic",
                  "loss_scale_config": LossScaleConfig(growth_interval=100, min_scale=1.0)}
    # lr and betas deliberately differ from the run's: they must come from the checkpoint.
    groups = decay_groups(model) if run.decay_groups else None
    opt = evenzero.ZeroOptimizer(model, resume.optimizer_class, groups, lr=0.5, betas=(0.5, 0.5),
                                 weight_decay=0.05, stage=resume.stage, bucket_numel=40,
                                 **kwargs)
    params = deepspeed_config(run, 1)["scheduler"]["params"]
    scheduler = (torch.optim.lr_scheduler.StepLR(opt, 1) if resume.torch_scheduler
                 else WarmupDecayLR(opt, **params))
    return model, opt, scheduler


def train_evenzero(model, opt, scheduler, run: Run, resume: Resume, first: int,
                   steps: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    fp16 = run.precision == "fp16"
    losses = []
    for s in range(first, first + steps):
        total = 0.0
        for m in range(resume.gas):
            x, y = micro_batch(s, world, rank, resume.gas, m, run.dtype())
            sync = opt.no_sync() if m < resume.gas - 1 else contextlib.nullcontext()
            with sync:
                loss = F.mse_loss(model(x).float(), y)
                total += float(loss.detach()) / resume.gas
                scaled = loss / resume.gas
                opt.backward(scaled) if fp16 else scaled.backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        if not opt.last_step_skipped:
            scheduler.step()
        losses.append(_mean_over_ranks(total))
    return losses


def resume_evenzero(rank: int, world: int, run: Run, resume: Resume, ckpt: str,
                    converted: str | None = None) -> dict[str, Any]:
    """Load with `load_deepspeed`, train `run.steps`; with `converted`, also load that
    evenzero checkpoint into a fresh optimizer and report whether the state is equal."""
    from evenzero.checkpoint import load, load_deepspeed

    model, opt, scheduler = build_evenzero(run, resume)
    tag = resume.tag if resume.tag_on_rank in (None, rank) else None
    info = load_deepspeed(opt, ckpt, tag, lr_scheduler=scheduler)
    out: dict[str, Any] = {"lr": [g["lr"] for g in opt.param_groups],
                           "betas": opt.param_groups[0]["betas"],
                           "lbi": scheduler.last_batch_iteration, "step_count": opt.step_count,
                           "info": {k: getattr(info, k) for k in (
                               "tag", "global_steps", "global_samples", "skipped_steps",
                               "lr_scheduler", "clip_grad", "zero_stage", "dp_world_size",
                               "loss_scaler")},
                           "client_epoch": info.client_state.get("epoch"),
                           "scale": opt.loss_scaler.scale}
    if converted is not None:
        state = snapshot(opt)
        model2, opt2, _ = build_evenzero(run, resume)
        load(opt2, converted)
        out["converted_equal"] = same_state(state, snapshot(opt2))
        out["converted_step_count"] = opt2.step_count
    out["losses"] = train_evenzero(model, opt, scheduler, run, resume, SAVED_AT, run.steps)
    return out


def snapshot(opt) -> dict[str, Any]:
    """Everything a load may change, copied."""
    opt.wait_for_params()
    return {"model": {k: v.clone() for k, v in opt.module.state_dict().items()},
            "masters": {g: opt.master_shard(g).clone() for g in opt.groups},
            "rank_state": copy.deepcopy(opt.state_dict()),
            "step_count": opt.step_count, "scale": opt.loss_scaler.state_dict()}


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def damaged_loads(rank: int, world: int, run: Run, cases: dict[str, tuple[str, dict]]
                  ) -> dict[str, str | None]:
    """Each case: (checkpoint dir, Resume overrides); the load must raise CheckpointError
    on every rank and leave the optimizer exactly as it was. Returns each case's error
    text (None: it loaded)."""
    from evenzero.checkpoint import CheckpointError, load_deepspeed

    out: dict[str, str | None] = {}
    for name, (ckpt, overrides) in cases.items():
        resume = replace(Resume(gas=2), **overrides)
        model, opt, scheduler = build_evenzero(run, resume)
        before = snapshot(opt)
        lbi = scheduler.state_dict()
        tag = resume.tag if resume.tag_on_rank in (None, rank) else None
        try:
            load_deepspeed(opt, ckpt, tag, lr_scheduler=scheduler)
            out[name] = None
        except CheckpointError as e:
            out[name] = str(e)
            if not same_state(before, snapshot(opt)) or scheduler.state_dict() != lbi:
                out[name] = "STATE CHANGED: " + str(e)
        dist.barrier()
    return out


def write_marker_if_unpickled(path: str) -> None:
    """Target of the crafted pickle: proof that code from the file ran."""
    Path(path).write_text("code from the checkpoint ran")


def partial_loads(rank: int, world: int, run: Run, ckpt: str) -> dict[str, Any]:
    """`load_optimizer_states=False` and `load_module_only=True`, as DeepSpeed does them."""
    from evenzero.checkpoint import load_deepspeed
    from evenzero.checkpoint.deepspeed.reader import read_deepspeed

    saved = read_deepspeed(ckpt, optimizer_states=False).module
    out: dict[str, Any] = {}
    for mode in ("weights", "module_only"):
        model, opt, scheduler = build_evenzero(run, Resume(gas=2))
        lr = opt.param_groups[0]["lr"]
        info = load_deepspeed(opt, ckpt, load_optimizer_states=mode != "weights",
                              load_module_only=mode == "module_only", lr_scheduler=scheduler)
        now = opt.module.state_dict()
        out[mode] = {
            "weights_equal": now.keys() == saved.keys() and all(
                torch.equal(now[k], saved[k].to(now[k].dtype)) for k in saved),
            "optimizer_state": sum(len(opt.shard_state(g)["flats"]) - 1 for g in opt.groups), "lr_kept": opt.param_groups[0]["lr"] == lr,
            "step_count": opt.step_count, "lbi": scheduler.last_batch_iteration,
            "client_keys": sorted(info.client_state)}
    return out


def exclude_frozen_loads(rank: int, world: int, run: Run, ckpt: str) -> dict[str, Any]:
    from evenzero.checkpoint import CheckpointError, load_deepspeed
    from evenzero.checkpoint.deepspeed.reader import read_deepspeed

    saved = read_deepspeed(ckpt, optimizer_states=False).module
    model, opt, scheduler = build_evenzero(run, Resume(gas=2))
    frozen = model.frozen.weight.detach().clone()
    out: dict[str, Any] = {}
    try:
        load_deepspeed(opt, ckpt, lr_scheduler=scheduler)
        out["strict"] = "loaded"
    except CheckpointError as e:
        out["strict"] = str(e)
    load_deepspeed(opt, ckpt, lr_scheduler=scheduler, load_module_strict=False)
    out["frozen_kept"] = torch.equal(model.frozen.weight, frozen)
    out["trained_loaded"] = torch.equal(model.inp.weight, saved["inp.weight"])
    out["step_count"] = opt.step_count
    return out

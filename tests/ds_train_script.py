"""A DeepSpeed training script, run under real DeepSpeed or under evenzero.deepspeed.

The only difference between the two runs is the import (`load_deepspeed`):

    import deepspeed                          # --impl deepspeed
    import evenzero.deepspeed as deepspeed    # --impl evenzero

Everything else is written the way DeepSpeed users write it: `add_config_arguments`,
`--local_rank`, `init_distributed`, `initialize(args=..., model=..., model_parameters=...,
training_data=..., config=...)`, then `engine(x)`, `engine.backward(loss)`,
`engine.step()` over the returned data loader, `get_lr()`, `global_steps`, and
`save_checkpoint` / `load_checkpoint`.

    torchrun --nproc-per-node 2 tests/ds_train_script.py --impl evenzero --case zero2_adam \
        --out result.json

Tests call `train(deepspeed, case)` directly inside spawned ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, CLASSES, SAMPLES = 8, 16, 4, 48


def load_deepspeed(impl: str):
    if impl == "deepspeed":
        import deepspeed
    else:
        import evenzero.deepspeed as deepspeed
    return deepspeed


def _base(stage: int, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True}
    cfg.update(extra)
    return cfg


def _adam(**params) -> dict:
    return {"type": "Adam", "params": {"lr": 5e-3, "torch_adam": True, "weight_decay": 0.01,
                                       **params}}


CASES: dict[str, dict] = {
    # ZeRO-2, Adam(W) via torch_adam, accumulation 2, active clipping, linear warmup.
    "zero2_adam": _base(2, gradient_clipping=0.3, optimizer=_adam(),
                        scheduler={"type": "WarmupLR", "params": {
                            "warmup_min_lr": 1e-3, "warmup_max_lr": 8e-3,
                            "warmup_num_steps": 4, "warmup_type": "linear"}}),
    # ZeRO-1, Adam in L2 mode, log warmup then linear decay, no clipping.
    "zero1_adam_l2": _base(1, gradient_clipping=0.0,
                           optimizer=_adam(adam_w_mode=False, weight_decay=0.05),
                           scheduler={"type": "WarmupDecayLR", "params": {
                               "total_num_steps": 8, "warmup_min_lr": 1e-3,
                               "warmup_max_lr": 6e-3, "warmup_num_steps": 3}}),
    # ZeRO-2, SGD with momentum, cosine schedule, default clipping (1.0), no accumulation.
    "zero2_sgd_cosine": _base(2, gradient_accumulation_steps=1, optimizer={
        "type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        scheduler={"type": "WarmupCosineLR", "params": {
            "total_num_steps": 10, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01, "warmup_type": "linear"}}),
    # ZeRO-1, OneCycle (cycles Adam's beta1), accumulation 3, clipping.
    "zero1_onecycle": _base(1, train_batch_size=24, train_micro_batch_size_per_gpu=4,
                            gradient_accumulation_steps=None, gradient_clipping=0.5,
                            optimizer=_adam(weight_decay=0.0),
                            scheduler={"type": "OneCycle", "params": {
                                "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                "cycle_first_step_size": 2, "decay_lr_rate": 0.5,
                                "decay_step_size": 1}}),
    # ZeRO-2, LR range test (staircase), AdamW type.
    "zero2_lrrange": _base(2, gradient_clipping=1.0, optimizer={
        "type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        scheduler={"type": "LRRangeTest", "params": {
            "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2,
            "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}}),
    # Stage 0 (plain data parallelism), clipping, log warmup.
    "zero0_adam": _base(0, gradient_clipping=0.2, optimizer=_adam(),
                        scheduler={"type": "WarmupLR", "params": {
                            "warmup_min_lr": 0.0, "warmup_max_lr": 5e-3,
                            "warmup_num_steps": 5, "warmup_type": "log"}}),
    # Client optimizer (two param groups) and client LR scheduler, ZeRO-2.
    "client_optimizer": _base(2, gradient_clipping=0.4),
    # Client optimizer `deepspeed.ops.adam.FusedAdam` (DeepSpeed's CPU op vs evenzero's).
    "client_fused_adam": _base(2, gradient_clipping=0.3),
    # DeepSpeed's FusedAdam (no torch_adam): needs DeepSpeed's CPU op built.
    "zero2_fused_adam": _base(2, gradient_clipping=0.3, optimizer={
        "type": "Adam", "params": {"lr": 5e-3, "weight_decay": 0.01}}),
    # fp32 ZeRO skips a step whose gradients are not finite (the LR schedule holds).
    "zero2_nan_step": _base(2, gradient_clipping=0.3, optimizer=_adam(),
                            scheduler={"type": "WarmupLR", "params": {
                                "warmup_min_lr": 1e-3, "warmup_max_lr": 8e-3,
                                "warmup_num_steps": 4, "warmup_type": "linear"}}),
    # `optimizer.zero_grad()` after every micro-step: DeepSpeed's ZeRO keeps the gradients
    # already reduced into its partitions (stage 2) and drops the local ones (stage 1).
    "zero1_zero_grad": _base(1, gradient_clipping=0.0, optimizer=_adam()),
    "zero2_zero_grad": _base(2, gradient_clipping=0.0, optimizer=_adam()),
    # Plain `loss.backward()` (DeepSpeed divides by the accumulation steps in output hooks).
    "zero2_torch_backward": _base(2, gradient_clipping=0.3, optimizer=_adam()),
    # MoE with deepspeed.moe.layer.MoE, expert-parallel size 2 and 1.
    "moe_ep2": _base(2, gradient_clipping=0.5, optimizer=_adam()),
    "moe_ep1": _base(1, gradient_clipping=0.5, optimizer=_adam()),
    # fp16 with dynamic loss scaling: starts far too high, so the first steps overflow
    # (hysteresis, skipped steps, LR held), then grows every 2 good steps.
    "fp16_zero2": _base(2, fp16={"enabled": True, "initial_scale_power": 18,
                                 "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 1},
                        gradient_clipping=0.5, optimizer=_adam(),
                        scheduler={"type": "WarmupLR", "params": {
                            "warmup_min_lr": 1e-3, "warmup_max_lr": 8e-3,
                            "warmup_num_steps": 4, "warmup_type": "linear"}}),
    # bf16 parameters, fp32 masters, at stage 2 and at stage 0.
    "bf16_zero0": _base(0, bf16={"enabled": True}, gradient_clipping=0.5, optimizer=_adam()),
    "bf16_zero2": _base(2, bf16={"enabled": True}, gradient_clipping=0.5, optimizer=_adam()),
}
CASES["zero2_fused_adam"]["scheduler"] = CASES["zero2_adam"]["scheduler"]


def _resume_case(stage: int, **extra) -> dict:
    """A fixed global batch of 16 (micro-batch 4; the accumulation steps follow the world
    size, 2 at 2 ranks, 1 at 4), so the same config runs at both."""
    cfg = _base(stage, train_batch_size=16, gradient_clipping=0.3, optimizer={
        "type": "AdamW", "params": {"lr": 8e-3, "weight_decay": 0.05, "torch_adam": True}},
        scheduler={"type": "WarmupDecayLR", "params": {
            "total_num_steps": 12, "warmup_min_lr": 1e-3, "warmup_max_lr": 8e-3,
            "warmup_num_steps": 4, "warmup_type": "linear"}}, **extra)
    del cfg["gradient_accumulation_steps"]
    return cfg


# Save with real DeepSpeed after SAVE_EPOCHS, resume (DeepSpeed or evenzero.deepspeed) from
# the checkpoint for the rest (`save_and_continue`, `resume`).
RESUME_CASES = {
    "resume_zero2": _resume_case(2),
    "resume_zero1": _resume_case(1),
    # fp16 from a far too high scale: overflows (hysteresis 2, then spent), growth every 2
    # good steps; the save falls between an overflow and the next growth.
    "resume_fp16": _resume_case(2, fp16={"enabled": True, "initial_scale_power": 20,
                                         "loss_scale_window": 2, "hysteresis": 2,
                                         "min_loss_scale": 1}),
    "resume_bf16": _resume_case(2, bf16={"enabled": True}),
}
CASES.update(RESUME_CASES)
OVERFLOW_AT = {"resume_fp16": 6}
"""Optimizer step on which rank 0's loss is made infinite: an overflow right after the
load, at any world size, where the saved hysteresis (spent) halves the scale at once."""
EPOCHS = 3
# Cases that hand `training_data` to initialize (DeepSpeed's loader forks two workers per
# epoch, which is slow); the others build their own DistributedSampler loader, as many
# DeepSpeed scripts do.
# DeepSpeed's Muon (type "Muon"): Muon on fc1/fc2 weights (use_muon), its Adam on the rest.
CASES["zero2_muon"] = _base(2, optimizer={"type": "Muon", "params": {
    "lr": 0.02, "weight_decay": 0.01, "adam_lr": 5e-3}})
CASES["zero0_muon"] = {**CASES["zero2_muon"], "zero_optimization": {"stage": 0}}

TRAINING_DATA_CASES = ("zero2_adam",)


class Net(nn.Module):
    """A small classifier with a frozen layer and a buffer, to exercise both paths."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x + self.offset.to(x.dtype)))
        h = self.norm(h)
        return self.fc2(F.relu(self.frozen(h)))


class MoENet(nn.Module):
    """fc -> deepspeed.moe.layer.MoE -> head; built from the deepspeed module passed in,
    as a DeepSpeed script builds it (`deepspeed.moe.layer.MoE`)."""

    def __init__(self, deepspeed, ep_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
        self.moe = deepspeed.moe.layer.MoE(HIDDEN, expert, num_experts=2, ep_size=ep_size, k=1,
                                           capacity_factor=1.0, min_capacity=0,
                                           noisy_gate_policy=None, drop_tokens=False,
                                           use_rts=False)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _aux, _counts = self.moe(F.relu(self.fc1(x)))
        return self.fc2(h)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, DIM, generator=g) * 2
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def build_model(deepspeed, case: str) -> nn.Module:
    torch.manual_seed(0)
    if case.startswith("moe_"):
        model = MoENet(deepspeed, ep_size=int(case.removeprefix("moe_ep")))
        # Expert parameters differ per rank (each holds its own experts).
        with torch.no_grad():
            for p in model.moe.parameters():
                if not getattr(p, "allreduce", True):
                    p.add_(0.1 * torch.distributed.get_rank())
        return model
    return Net()


def initialize(deepspeed, case: str, args=None):
    config = copy.deepcopy(CASES[case])
    model = build_model(deepspeed, case)
    kwargs = {}
    if case == "client_optimizer":
        decay = [p for n, p in model.named_parameters() if p.requires_grad and "bias" not in n]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and "bias" in n]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=4e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
        kwargs = {"optimizer": opt, "lr_scheduler": sched}
    elif case == "client_fused_adam":
        opt = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=5e-3, weight_decay=0.01)
        kwargs = {"optimizer": opt}
    elif case.startswith("moe_"):
        split = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
        kwargs = {"model_parameters": split(
            {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"})}
    else:
        kwargs = {"model_parameters": [p for p in model.parameters() if p.requires_grad]}
    if case in TRAINING_DATA_CASES:
        kwargs["training_data"] = dataset()
    return deepspeed.initialize(args=args, model=model, config=config, **kwargs)


def own_loader(engine) -> torch.utils.data.DataLoader:
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=engine.world_size, rank=engine.global_rank)
    return torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                       sampler=sampler)


def train(deepspeed, case: str, args=None, epochs: int = EPOCHS) -> dict:
    engine, optimizer, loader, scheduler = initialize(deepspeed, case, args)
    loader = loader if loader is not None else own_loader(engine)
    dtype = (torch.bfloat16 if engine.bfloat16_enabled() else
             torch.float16 if engine.fp16_enabled() else None)
    losses, lrs, boundaries, scales, norms = [], [engine.get_lr()], [], [], []
    for _ in range(epochs):
        for x, y in loader:
            x = x.to(engine.device)
            if dtype is not None:
                x = x.to(dtype)
            loss = F.cross_entropy(engine(x).float(), y.to(engine.device))
            if case == "zero2_nan_step" and len(losses) == 5:
                loss = loss * float("nan")
            boundaries.append(engine.is_gradient_accumulation_boundary())
            if case.endswith("torch_backward"):
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
            if case.endswith("_zero_grad"):
                optimizer.zero_grad()
            losses.append(loss.item())
            lrs.append(engine.get_lr())
            scales.append(getattr(engine.optimizer, "cur_scale", 1.0))
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
    return {"losses": losses, "lrs": lrs, "boundaries": boundaries, "scales": scales,
            "grad_norms": norms,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "batch": [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps()],
            "loader_len": len(loader), "params": _params(engine.module),
            "scheduler": type(scheduler).__name__ if scheduler is not None else None}


SAVE_EPOCHS, RESUME_EPOCHS = 2, 4
"""`save_and_continue` saves after SAVE_EPOCHS epochs (3 optimizer steps each at the
global batch of 16); training goes on to RESUME_EPOCHS."""
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def save_and_continue(deepspeed, case: str, save_dir: str) -> dict:
    """Train, `engine.save_checkpoint(save_dir, client_state=...)`, train on."""
    engine, *_ = initialize(deepspeed, case)
    before = train_epochs(engine, range(SAVE_EPOCHS), OVERFLOW_AT.get(case))
    engine.save_checkpoint(save_dir, client_state={
        "epoch": SAVE_EPOCHS, "note": "saved by ds_train_script", "data": torch.arange(3)})
    after = train_epochs(engine, range(SAVE_EPOCHS, RESUME_EPOCHS), OVERFLOW_AT.get(case))
    return {"before": before, "after": after, "params": _params(engine.module)}


def resume(deepspeed, case: str, load_dir: str, **load_options) -> dict:
    """A fresh engine: `engine.load_checkpoint(load_dir, **load_options)`, then the epochs
    left, the first one taken from the client state."""
    engine, _, _, scheduler = initialize(deepspeed, case)
    path, client = engine.load_checkpoint(load_dir, **load_options)
    loaded = {"path": path, "client": _plain(client), "global_steps": engine.global_steps,
              "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
              "lr": engine.get_lr(), "scheduler": scheduler.state_dict(),
              "scaler": scaler_fields(engine)}
    after = train_epochs(engine, range(client["epoch"], RESUME_EPOCHS), OVERFLOW_AT.get(case))
    return {"loaded": loaded, "after": after, "params": _params(engine.module),
            "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps}


def train_epochs(engine, epochs: range, overflow_at: int | None = None) -> dict:
    """Train over this script's loader, `sampler.set_epoch` per epoch; per optimizer step:
    the global mean loss, the LR, the loss scaler and the gradient norm."""
    loader = own_loader(engine)
    dtype = (torch.bfloat16 if engine.bfloat16_enabled() else
             torch.float16 if engine.fp16_enabled() else None)
    gas = engine.gradient_accumulation_steps()
    out: dict[str, list] = {"losses": [], "lrs": [], "scalers": [], "grad_norms": []}
    total = 0.0
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(engine.device) if dtype is None else x.to(engine.device, dtype)
            loss = F.cross_entropy(engine(x).float(), y.to(engine.device))
            boundary = engine.is_gradient_accumulation_boundary()
            total += loss.item() / gas
            if engine.global_steps == overflow_at and engine.global_rank == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            if boundary:
                mean = torch.tensor([total], dtype=torch.float64)
                torch.distributed.all_reduce(mean)
                out["losses"].append(mean.item() / torch.distributed.get_world_size())
                out["lrs"].append(engine.get_lr())
                out["scalers"].append(scaler_fields(engine))
                out["grad_norms"].append(float(engine.get_global_grad_norm()))
                total = 0.0
    return out


def scaler_fields(engine) -> dict:
    """The fp16 loss scaler's state (`engine.optimizer.loss_scaler` in both)."""
    scaler = engine.optimizer.loss_scaler
    if not scaler.dynamic:
        return {"cur_scale": scaler.cur_scale}
    return {f: getattr(scaler, f) for f in SCALER_FIELDS}


def _plain(value):
    """Picklable plain values (tensors and sizes as lists) to compare across processes."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, torch.Size)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _params(module: nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().float().flatten().tolist() for n, p in module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=("deepspeed", "evenzero"), required=True)
    parser.add_argument("--case", choices=sorted(CASES), default="zero2_adam")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    deepspeed = load_deepspeed(parser.parse_known_args()[0].impl)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    result = train(deepspeed, args.case, args, args.epochs)
    result["args_local_rank"] = args.local_rank
    if deepspeed.comm.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()

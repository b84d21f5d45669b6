"""A DeepSpeed MoE training script, run under real DeepSpeed or under evenzero.deepspeed.

The only difference between the runs is the import (`load_deepspeed`); the model is built
from `deepspeed.moe.layer.MoE` of the module imported and its parameters are split with
`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`, as DeepSpeed
scripts do. Each case is a set of MoE layer options; `cifar_moe` is DeepSpeedExamples'
`training/cifar/cifar10_deepspeed.py` network and config as `run_ds_moe.sh` runs it
(2 experts, `--ep-world-size 2`, `--top-k 1`, `--noisy-gate-policy RSample`,
`--moe-param-group`), on synthetic CIFAR-shaped data.

    torchrun --nproc-per-node 2 tests/ds_moe_script.py --impl evenzero --case top1_ep2 \
        --out result.json [--block-deepspeed]

`--block-deepspeed` makes `import deepspeed` fail before anything is imported, as in an
environment without DeepSpeed. Tests call `train(deepspeed, case)` inside spawned ranks.
"""

from __future__ import annotations

import argparse
import copy
import importlib.abc
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

DIM, SEQ, CLASSES, SAMPLES = 8, 6, 4, 48
AUX_COEF = 0.01


def _config(stage: int = 2, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
           "gradient_clipping": 0.5, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "torch_adam": True,
                                                    "weight_decay": 0.01}}}
    cfg.update(extra)
    return cfg


CASES: dict[str, dict] = {
    # Top-1, 4 experts over 2 ranks, capacity drops (factor 1, no minimum), random token
    # selection, Gumbel noise on the routing (RSample).
    "top1_ep2_rsample": {"num_experts": 4, "ep_size": 2, "k": 1, "capacity_factor": 1.0,
                         "min_capacity": 0, "noisy_gate_policy": "RSample"},
    # Top-1 without expert parallelism, Jitter noise, no drops, a different eval capacity.
    "top1_ep1_jitter": {"num_experts": 2, "ep_size": 1, "k": 1, "noisy_gate_policy": "Jitter",
                        "drop_tokens": False, "eval_capacity_factor": 2.0},
    # Top-1 with a minimum capacity above what the factor gives, no random selection.
    "top1_ep2_min_capacity": {"num_experts": 2, "ep_size": 2, "k": 1, "capacity_factor": 0.25,
                              "min_capacity": 5, "use_rts": False},
    # Top-2, residual MoE, capacity drops (factor 0.5), the second expert sampled.
    "top2_ep2_residual": {"num_experts": 4, "ep_size": 2, "k": 2, "capacity_factor": 0.5,
                          "min_capacity": 2, "use_residual": True},
    # Top-2 without drops (capacity agreed over the expert-parallel group with all_reduce
    # MAX), the second expert taken greedily.
    "top2_ep2_no_drop": {"num_experts": 2, "ep_size": 2, "k": 2, "drop_tokens": False,
                         "top2_2nd_expert_sampling": False},
    # Top-1 with ep_size 1 and 2 layers in one model (two expert groups).
    "two_groups": {"num_experts": 2, "ep_size": 1, "k": 1, "second_ep_size": 2,
                   "min_capacity": 0},
    # DeepSpeedExamples' CIFAR network and config (see the module docstring).
    "cifar_moe": {},
}
CONFIGS = {name: _config() for name in CASES}
CONFIGS["top1_ep1_jitter"] = _config(stage=1)
# cifar10_deepspeed.py's get_ds_config at 2 ranks, fp32 ZeRO-2; `torch_adam` so that
# DeepSpeed runs torch's Adam instead of building its CPU Adam kernel first.
CONFIGS["cifar_moe"] = {
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                             "weight_decay": 3e-7, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False,
    "bf16": {"enabled": False}, "fp16": {"enabled": False},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                          "overlap_comm": True, "contiguous_gradients": True},
}
EPOCHS = 2


class _NoDeepSpeed(importlib.abc.MetaPathFinder):
    """Makes `import deepspeed` (and its submodules) fail as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


def block_deepspeed() -> None:
    if any(n == "deepspeed" or n.startswith("deepspeed.") for n in sys.modules):
        raise RuntimeError("deepspeed is already imported")
    sys.meta_path.insert(0, _NoDeepSpeed())


def load_deepspeed(impl: str):
    if impl == "deepspeed":
        import deepspeed
    else:
        import evenzero.deepspeed as deepspeed
    return deepspeed


class MoENet(nn.Module):
    """fc -> MoE [-> second MoE] -> mean over the sequence -> head; returns the logits and
    the sum of the layers' auxiliary losses and their expert counts."""

    def __init__(self, deepspeed, options: dict) -> None:
        super().__init__()
        options = dict(options)
        second = options.pop("second_ep_size", None)
        self.fc1 = nn.Linear(DIM, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))
        layers = [deepspeed.moe.layer.MoE(DIM, expert, **options)]
        if second is not None:
            layers.append(deepspeed.moe.layer.MoE(DIM, nn.Linear(DIM, DIM), **{
                **options, "ep_size": second}))
        self.moe = nn.ModuleList(layers)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor):
        h, aux, counts = F.relu(self.fc1(x)), [], []
        for layer in self.moe:
            h, l_aux, exp_counts = layer(h)
            aux.append(l_aux)
            counts.append(exp_counts)
        return self.head(h.mean(dim=1)), sum(aux), counts


class CifarNet(nn.Module):
    """cifar10_deepspeed.py's `Net` with `--moe`: the MoE layers are built exactly as
    there (`deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, ...)`)."""

    def __init__(self, deepspeed, num_experts=(2,), ep_size=2, top_k=1, min_capacity=0,
                 noisy_gate_policy="RSample", mlp_type="standard") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        fc3 = nn.Linear(84, 84)
        self.moe_layer_list = nn.ModuleList([
            deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, num_experts=n_e, ep_size=ep_size,
                                    use_residual=mlp_type == "residual", k=top_k,
                                    min_capacity=min_capacity, noisy_gate_policy=noisy_gate_policy)
            for n_e in num_experts])
        self.fc4 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        aux, counts = [], []
        for layer in self.moe_layer_list:
            x, l_aux, exp_counts = layer(x)
            aux.append(l_aux)
            counts.append(exp_counts)
        return self.fc4(x), sum(aux), counts


def dataset(case: str) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    if case == "cifar_moe":
        x = torch.rand(64, 3, 32, 32, generator=g) * 2 - 1
        y = torch.randint(0, 10, (64,), generator=g)
    else:
        x = torch.randn(SAMPLES, SEQ, DIM, generator=g) * 2
        y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def build_model(deepspeed, case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "cifar_moe":
        return CifarNet(deepspeed)
    return MoENet(deepspeed, CASES[case])


def initialize(deepspeed, case: str, model: nn.Module | None = None):
    model = build_model(deepspeed, case) if model is None else model
    # cifar10_deepspeed.py's create_moe_param_groups.
    params = {"params": [p for p in model.parameters()], "name": "parameters"}
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(params)
    return deepspeed.initialize(model=model, model_parameters=groups,
                                config=copy.deepcopy(CONFIGS[case]))


def train(deepspeed, case: str, model: nn.Module | None = None, epochs: int = EPOCHS) -> dict:
    engine, *_ = initialize(deepspeed, case, model)
    data = dataset(case)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=engine.world_size,
                                                  rank=engine.global_rank)
    loader = torch.utils.data.DataLoader(
        data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    out: dict[str, list] = {"losses": [], "l_aux": [], "exp_counts": []}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits, l_aux, counts = engine(x)
            loss = F.cross_entropy(logits, y) + AUX_COEF * l_aux
            engine.backward(loss)
            engine.step()
            out["losses"].append(loss.item())
            out["l_aux"].append(l_aux.item())
            out["exp_counts"].append([c.tolist() for c in counts])
    engine.eval()
    with torch.no_grad():
        logits, l_aux, counts = engine(data.tensors[0][:8])
    out["eval"] = {"logits": logits.flatten().tolist(), "l_aux": l_aux.item(),
                   "exp_counts": [c.tolist() for c in counts]}
    out["params"] = {n: p.detach().float().flatten().tolist()
                     for n, p in engine.module.named_parameters()}
    out["global_steps"] = engine.global_steps
    out["rng_after"] = torch.rand(4).tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impl", choices=("deepspeed", "evenzero"), required=True)
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--block-deepspeed", action="store_true")
    args = parser.parse_args()
    if args.block_deepspeed:
        block_deepspeed()
    deepspeed = load_deepspeed(args.impl)
    deepspeed.init_distributed(dist_backend="gloo")
    result = train(deepspeed, args.case)
    result["deepspeed_imported"] = "deepspeed" in sys.modules
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()

"""evenzero.deepspeed's engine on its own (no DeepSpeed needed): the contract a script
relies on, and the errors that replace DeepSpeed behaviour evenzero will not reproduce.
Every check runs on 2 gloo ranks; an error must be raised on both."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_helpers import CheckResults, run_checks


def _config(stage: int = 2, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cfg.update(extra)
    return cfg


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(100 * i + dist.get_rank())
    return torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)


def _engine(config: dict, model: nn.Module | None = None, **kw):
    import evenzero.deepspeed as deepspeed

    model = model or _model()
    kw.setdefault("model_parameters", model.parameters())
    return deepspeed.initialize(model=model, config=config, **kw)[0]


def _loss(engine, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return F.mse_loss(engine(x.to(next(engine.parameters()).dtype)).float(), y)


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def check_sgd_step_is_the_mean_gradient() -> None:
    """Against plain autograd on the whole global batch: SGD lr 0.1, accumulation 2, both
    ranks: the update is lr times the gradient of the mean loss over all micro-batches."""
    import torch.distributed as dist

    for stage in (0, 1, 2):
        engine = _engine(_config(stage))
        ref = _model()
        losses = []
        for i in range(2):
            loss = _loss(engine, i)
            engine.backward(loss)
            engine.step()
            for r in range(dist.get_world_size()):
                g = torch.Generator().manual_seed(100 * i + r)
                x, y = torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)
                losses.append(F.mse_loss(ref(x), y))
        (sum(losses) / len(losses)).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
        for a, b in zip(_params(engine), ref.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-6), (stage, (a - b).abs().max())
        assert engine.global_steps == 1 and engine.micro_steps == 2


def check_manual_boundary_equals_counted() -> None:
    """`set_gradient_accumulation_boundary` + one step() == the counted micro-steps."""
    counted, manual = _engine(_config(1)), _engine(_config(1))
    for i in range(2):
        counted.backward(_loss(counted, i))
        counted.step()
    for i in range(2):
        manual.set_gradient_accumulation_boundary(i == 1)
        manual.backward(_loss(manual, i))
    manual.step()
    for a, b in zip(_params(counted), _params(manual), strict=True):
        assert torch.equal(a, b)


def check_no_sync() -> None:
    engine = _engine(_config(2))
    with pytest.raises(AssertionError, match="incompatible with gradient partitioning"):
        with engine.no_sync():
            pass
    engine = _engine(_config(1, gradient_accumulation_steps=1))
    with engine.no_sync():
        engine.backward(_loss(engine, 0))
        with pytest.raises(AssertionError, match="inside no_sync"):
            engine.step()
    engine.backward(_loss(engine, 1))
    engine.step()
    assert engine.global_steps == 1


def check_fp16_direct_backward_needs_scale() -> None:
    cfg = _config(2, gradient_accumulation_steps=1, fp16={"enabled": True})
    engine = _engine(cfg)
    with pytest.raises(RuntimeError, match="Loss scaling is required"):
        _loss(engine, 0).backward()
    engine.zero.zero_grad()
    engine.scale(_loss(engine, 1)).backward()
    engine.step()
    assert engine.global_steps == 1 and engine.optimizer.cur_scale == 2.0 ** 16


def check_optimizer_view() -> None:
    engine = _engine(_config(2))
    opt = engine.optimizer
    assert opt.optimizer is engine.zero and opt.param_groups is engine.zero.param_groups
    assert engine.get_lr() == [0.1] and engine.get_mom() == [0]
    with pytest.raises(RuntimeError, match=r"engine.step\(\)"):
        opt.step()
    # This rank's shard, as DeepSpeed's ZeRO optimizer returns its partition (Lightning
    # saves it on every checkpoint); test_deepspeed_framework_api.py loads it back.
    assert set(opt.state_dict()) == {"state", "param_groups", "evenzero"}


def check_client_optimizer_keeps_user_lr_changes() -> None:
    """A script that sets the LR on its own optimizer object, DeepSpeed-style."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = _config(2)
    del cfg["optimizer"]
    engine = _engine(cfg, model, optimizer=opt)
    opt.param_groups[0]["lr"] = 0.0
    before = _params(engine)
    for i in range(2):
        engine.backward(_loss(engine, i))
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(engine), strict=True))
    assert engine.get_lr() == [0.0] and engine.optimizer.optimizer is opt


def check_client_fused_adam_equals_config_adam() -> None:
    """`deepspeed.ops.adam.FusedAdam` as the client optimizer (evenzero's, under the alias)
    trains exactly like `{"type": "Adam"}` in the config."""
    import evenzero.deepspeed as deepspeed

    cfg = _config(2, optimizer={"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}})
    by_config = _engine(cfg)
    model = _model()
    client = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=0.01, weight_decay=0.1)
    del cfg["optimizer"]
    by_client = _engine(cfg, model, optimizer=client)
    for engine in (by_config, by_client):
        for i in range(4):
            engine.backward(_loss(engine, i))
            engine.step()
    assert by_client.optimizer.optimizer is client
    for a, b in zip(_params(by_config), _params(by_client), strict=True):
        assert torch.equal(a, b)


def check_offload_config_trains_as_without_and_refuses_a_client_like_deepspeed() -> None:
    """`offload_optimizer: {device: cpu}`: Adam is DeepSpeed's CPU Adam, the masters live on
    the host, and the run equals the one without offload bit for bit; a torch client
    optimizer is refused unless `zero_force_ds_cpu_optimizer` is false (issue 26)."""
    from evenzero.deepspeed import DeepSpeedConfigError
    from evenzero.deepspeed.fused_adam import DeepSpeedCPUAdam

    adam = {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}
    plain = _engine(_config(2, optimizer=adam))
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    offloaded = _engine(_config(2, optimizer=adam, zero_optimization=zero))
    assert offloaded.zero_cpu_offload() and not plain.zero_cpu_offload()
    assert offloaded.zero.inner_optimizer_class is DeepSpeedCPUAdam
    assert all(g.placement.offloaded for g in offloaded.zero.groups.values())
    for engine in (plain, offloaded):
        for i in range(4):
            engine.backward(_loss(engine, i))
            engine.step()
    for a, b in zip(_params(plain), _params(offloaded), strict=True):
        assert torch.equal(a, b)
    cfg = _config(2, zero_optimization=zero)
    del cfg["optimizer"]
    model = _model()
    with pytest.raises(DeepSpeedConfigError, match="ZeRO-Offload with a client"):
        _engine(cfg, model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    model = _model()
    _engine({**cfg, "zero_force_ds_cpu_optimizer": False}, model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))


def check_client_scheduler_callable() -> None:
    engine = _engine(_config(2), lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(
        o, step_size=1, gamma=0.5))
    for i in range(4):
        engine.backward(_loss(engine, i))
        engine.step()
    assert engine.get_lr() == [0.025]


def check_nonfinite_update_refused_where_deepspeed_applies_it() -> None:
    from evenzero.deepspeed.boundary import NonFiniteGradients

    for cfg in (_config(0), _config(2, bf16={"enabled": True, "check_grad_overflow": False})):
        engine = _engine({**cfg, "gradient_accumulation_steps": 1})
        engine.backward(_loss(engine, 0) * float("nan"))
        with pytest.raises(NonFiniteGradients, match="would apply them"):
            engine.step()


def check_refused_setups_fail_on_every_rank() -> None:
    from evenzero.deepspeed import DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError, match="stage 0 with fp16"):
        _engine(_config(0, fp16={"enabled": True}))
    model = _model()
    with pytest.raises(Exception, match="is in no parameter group"):  # subset: clear error
        _engine(_config(2), model, model_parameters=list(model[0].parameters()))
    model = _model()
    adagrad = _config(2, optimizer={"type": "Adagrad", "params": {"lr": 0.1}})
    with pytest.raises(DeepSpeedConfigError, match="DeepSpeed rebuilds Adagrad"):
        _engine(adagrad, model, model_parameters=[
            {"params": list(model[0].parameters()), "lr": 0.5},
            {"params": list(model[2].parameters())}])
    _engine(adagrad)  # one set of options: as DeepSpeed
    with pytest.raises(AssertionError, match="requires an optimizer"):
        cfg = _config(1)
        del cfg["optimizer"]
        _engine(cfg)


def check_config_from_args_and_json_path(tmp: str) -> None:
    import argparse

    import evenzero.deepspeed as deepspeed

    path = os.path.join(tmp, "ds.json")
    if int(os.environ["RANK"]) == 0:
        with open(path, "w") as f:
            json.dump(_config(2), f)
    torch.distributed.barrier()
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    model = _model()
    engine, *_ = deepspeed.initialize(args=args, model=model,
                                      model_parameters=model.parameters())
    assert args.local_rank == int(os.environ["LOCAL_RANK"]) == engine.local_rank
    assert engine.train_batch_size() == 2 * 2 * torch.distributed.get_world_size()
    with pytest.raises(AssertionError, match="Not sure how to proceed"):
        deepspeed.initialize(args=args, model=_model(), config=_config(2))


def check_evenzero_moe_layer() -> None:
    """evenzero's own MoE layer brings its expert groups; experts go to their group."""
    from evenzero.moe import MoE, expert_parallel_groups

    groups = expert_parallel_groups(2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), MoE(4, 2, groups, ffn_dim=3))
    engine = _engine(_config(2), model)
    for i in range(2):
        x, _ = _batch(i)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    assert list(engine.zero.groups) == ["dense-params", groups.group_name]  # DeepSpeed names
    assert math.isfinite(float(engine.get_global_grad_norm()))


def _job(rank: int, world: int, tmp: str) -> dict[str, str | None]:
    os.environ["LOCAL_RANK"] = str(rank)
    checks = {name: fn for name, fn in globals().items() if name.startswith("check_")}
    checks["check_config_from_args_and_json_path"] = (
        lambda: check_config_from_args_and_json_path(tmp))
    return run_checks(checks, barrier=True)


JOB = CheckResults(_job, timeout=300)
CHECKS = sorted(n for n in globals() if n.startswith("check_"))


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ds_engine"))


@pytest.mark.parametrize("check", CHECKS)
def test_engine(check, shared_tmp):
    JOB.assert_passed(check, 2, shared_tmp)

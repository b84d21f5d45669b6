"""The ZeRO-1/2 surface DeepSpeed's own unit tests use (issue 30), at 2 gloo ranks under the
stand-in: the config keys DeepSpeed 0.19.8 runs, the three cases that must raise on every
rank at once (never hang), tag validation, `safe_get/set_full_*`, `coalesce_grad_reduction`,
unmanaged accumulation. One spawned job runs every `check_*`; each is its own pytest case."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import evenzero.deepspeed as deepspeed
from dist_helpers import CheckResults, run_checks
from evenzero.deepspeed.config import DeepSpeedConfigError

FAST_S = 1.0
"""A refusal must come within this long on every rank (DeepSpeed raises at once)."""


class LinearLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return (self.weight * inputs).sum()


class Mlp(torch.nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.a = torch.nn.Linear(dim, dim)
        self.b = torch.nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _config(stage: int = 2, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def _init(model: torch.nn.Module, config: dict, optimizer=None):
    kwargs = {"model_parameters": model.parameters()} if optimizer is None else {
        "optimizer": optimizer}
    engine, *_ = deepspeed.initialize(model=model, config=config, **kwargs)
    return engine


def _raises_fast(error: type[BaseException], fragment: str, fn) -> None:
    start = time.monotonic()
    with pytest.raises(error) as info:
        fn()
    assert fragment in str(info.value), str(info.value)
    assert time.monotonic() - start < FAST_S


def _batch(seed: int, dim: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    return torch.randn(4, dim, generator=g)


# --------------------------------------------------------------------------- the three hangs


def check_unaligned_allgather_bucket_raises_on_every_rank() -> None:
    for stage in (1, 2):
        cfg = _config(stage, zero_optimization={"allgather_bucket_size": 1001})
        _raises_fast(AssertionError, "allgather_bucket_size must be a multiple of "
                     "nccl_start_alignment_factor", lambda cfg=cfg: _init(LinearLoss(), cfg))
    engine = _init(LinearLoss(), _config(2, zero_optimization={"allgather_bucket_size": 1000}))
    assert engine.optimizer.nccl_start_alignment_factor == 2


def check_invalid_tag_validation_raises_on_every_rank() -> None:
    cfg = _config(2, checkpoint={"tag_validation": "foo"})
    _raises_fast(DeepSpeedConfigError, "invalid tag_validation value of FOO",
                 lambda: _init(LinearLoss(), cfg))
    for mode in ("warn", "Ignore", "FAIL"):  # DeepSpeed upper-cases the value
        _init(LinearLoss(), _config(2, checkpoint={"tag_validation": mode}))


def check_save_checkpoint_empty_dir_raises_on_every_rank(tmp: str) -> None:
    engine = _init(LinearLoss(), _config(2))
    before = set(os.listdir("."))
    for save_dir in ("", None):
        _raises_fast(ValueError, "save_dir must be a non-empty string",
                     lambda d=save_dir: engine.save_checkpoint(d))
    assert set(os.listdir(".")) == before  # nothing written into the working directory
    assert engine.save_16bit_model(os.path.join(tmp, "w16"), "w.bin")
    saved = torch.load(os.path.join(tmp, "w16", "w.bin"))
    torch.testing.assert_close(saved["weight"], engine.module.weight.detach())


def check_tag_mismatch_obeys_tag_validation(tmp: str) -> None:
    rank = dist.get_rank()
    for mode in ("WARN", "IGNORE", "FAIL"):
        engine = _init(LinearLoss(), _config(2, checkpoint={"tag_validation": mode}))
        save = os.path.join(tmp, f"tags-{mode}")
        if mode == "FAIL":
            _raises_fast(AssertionError, "is not consistent across all ranks",
                         lambda e=engine, s=save: e.save_checkpoint(s, tag=f"tag-{rank}"))
            continue
        engine.save_checkpoint(save, tag=f"tag-{rank}")
        dist.barrier()
        # One checkpoint, under rank 0's tag, that loads back.
        assert sorted(os.listdir(save)) == ["latest", "tag-0", "zero_to_fp32.py"]
        path, _ = engine.load_checkpoint(save)
        assert path is not None and path.endswith("tag-0")


# --------------------------------------------------------------------------- keys


def check_gradient_allreduce_op_sum_and_predivide() -> None:
    inputs = torch.tensor([1.0, 2.0])
    cases = [("mean", 1.0, {}), ("sum", 2.0, {}), ("SUM", 2.0, {}),
             ("mean", 1.0, {"gradient_predivide_factor": 2.0}),
             ("sum", 2.0, {"gradient_predivide_factor": 2.0})]
    for stage in (1, 2):
        for op, scale, extra in cases:
            model = LinearLoss()
            cfg = _config(stage, gradient_allreduce_op=op, zero_allow_untested_optimizer=True,
                          zero_optimization={"reduce_scatter": False}, **extra)
            cfg.pop("optimizer")
            engine = _init(model, cfg, torch.optim.SGD(model.parameters(), lr=1.0))
            engine.backward(engine(inputs))
            engine.step()
            torch.testing.assert_close(engine.module.weight.detach(), -inputs * scale)
    _raises_fast(DeepSpeedConfigError, "Invalid gradient_allreduce_op",
                 lambda: _init(LinearLoss(), _config(2, gradient_allreduce_op="max")))
    # DeepSpeed's ZeRO-2 refuses a predivide factor while it reduce-scatters.
    _raises_fast(AssertionError, "gradient_predivide_factor != 1.0",
                 lambda: _init(LinearLoss(), _config(2, gradient_predivide_factor=2.0)))


def check_grad_accum_dtype_fp32_with_bf16() -> None:
    cfg = _config(2, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    engine = _init(Mlp().to(torch.bfloat16), cfg)
    for i in range(2):
        engine.backward(engine(_batch(i).to(torch.bfloat16)))
        engine.step()
    assert engine.global_steps == 2
    with pytest.raises(DeepSpeedConfigError, match="grad_accum_dtype"):
        _init(Mlp(), _config(2, data_types={"grad_accum_dtype": "bf16"}))


def check_unmanaged_accumulation_steps_every_call() -> None:
    for stage in (1, 2):
        torch.manual_seed(0)
        managed = _init(Mlp(), _config(stage, gradient_accumulation_steps=2))
        torch.manual_seed(0)
        unmanaged = _init(Mlp(), _config(stage, gradient_accumulation_steps=2,
                                         managed_gradient_accumulation=False))
        assert not unmanaged.is_gradient_accumulation_boundary()
        with pytest.raises(AssertionError, match="managed_gradient_accumulation=False"):
            unmanaged.set_gradient_accumulation_boundary(True)
        with pytest.raises(AssertionError, match="managed_gradient_accumulation=False"):
            with unmanaged.coalesce_grad_reduction():
                pass
        # Two backwards, then one step(): the same update as the managed engine's two
        # micro-steps, and every step() applies it.
        for i in range(2):
            managed.backward(managed(_batch(i)))
            managed.step()
            unmanaged.backward(unmanaged(_batch(i)))
        unmanaged.step()
        assert managed.global_steps == unmanaged.global_steps == 1
        for a, b in zip(managed.module.parameters(), unmanaged.module.parameters(), strict=True):
            torch.testing.assert_close(a, b)
        unmanaged.backward(unmanaged(_batch(5)))
        unmanaged.step()
        assert unmanaged.global_steps == 2


# --------------------------------------------------------------------------- names


def _reference_grads(model: torch.nn.Module, seeds: list[int]) -> dict[str, torch.Tensor]:
    """The data-parallel mean gradient of a plain copy of `model` over `seeds`' batches."""
    ref = Mlp()
    ref.load_state_dict(model.state_dict())
    for s in seeds:
        ref(_batch(s)).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size() * len(seeds)
    return {n: p.grad for n, p in ref.named_parameters()}


def check_safe_get_and_set_full() -> None:
    from evenzero.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
    )

    for stage in (1, 2):
        torch.manual_seed(0)
        engine = _init(Mlp(), _config(stage))
        expected = _reference_grads(engine.module, [0])
        engine.backward(engine(_batch(0)))
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(safe_get_full_fp32_param(p), p.detach())
            torch.testing.assert_close(safe_get_full_grad(p), expected[name])
        p = engine.module.a.weight
        safe_set_full_grad(p, torch.ones_like(p))
        torch.testing.assert_close(safe_get_full_grad(p), torch.ones_like(p))
        engine.step()
        inner = engine.optimizer.optimizer
        assert all(int(inner.state[q]["step"]) == 1 for q in engine.module.parameters())
        assert len(engine.optimizer.single_partition_of_fp32_groups) == 1
        exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
        # Adam's first moment after one step is (1 - beta1) * grad.
        torch.testing.assert_close(exp_avg, 0.1 * torch.ones_like(p))
        safe_set_full_optimizer_state(p, torch.zeros_like(p), "exp_avg")
        assert safe_get_full_optimizer_state(p, "exp_avg").abs().max() == 0
        target = torch.full_like(p, 0.5)
        safe_set_full_fp32_param(p, target)
        torch.testing.assert_close(safe_get_full_fp32_param(p), target)
        torch.testing.assert_close(p.detach(), target)
        assert safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2))) is None
        with pytest.raises(AssertionError, match="only defined for ZeRO-3"):
            safe_get_local_fp32_param(p)


def check_coalesce_grad_reduction() -> None:
    from evenzero.deepspeed.utils import safe_get_full_grad

    for stage in (1, 2):
        torch.manual_seed(0)
        engine = _init(Mlp(), _config(stage, gradient_accumulation_steps=1))
        expected = _reference_grads(engine.module, [0, 1])
        with engine.coalesce_grad_reduction():
            for i in range(2):
                engine.backward(engine(_batch(i)), scale_wrt_gas=False)
            with pytest.raises(AssertionError, match="inside no_sync"):
                engine.step()
            # Inside, the gradient is still this rank's own (DeepSpeed returns param.grad).
            local = safe_get_full_grad(engine.module.b.bias)
            assert local is engine.module.b.bias.grad
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(safe_get_full_grad(p) / 2, expected[name])
        engine.step()
        assert engine.global_steps == 1
        with engine.coalesce_grad_reduction(), pytest.raises(AssertionError), engine.no_sync():
            pass  # no_sync inside coalesce_grad_reduction is refused, as in DeepSpeed
    engine.empty_partition_cache()


def check_reduce_scatter_fn() -> None:
    from evenzero.deepspeed import comm

    world = dist.get_world_size()
    full = torch.arange(2 * world, dtype=torch.float32)
    out = torch.empty(2)
    comm.reduce_scatter_fn(out, full)
    rank = dist.get_rank()
    torch.testing.assert_close(out, full[2 * rank:2 * rank + 2] * world)


def _job(rank: int, world: int, tmp: str) -> dict[str, str | None]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.chdir(tmp)
    checks = {name: fn for name, fn in globals().items() if name.startswith("check_")}
    for name in ("check_save_checkpoint_empty_dir_raises_on_every_rank",
                 "check_tag_mismatch_obeys_tag_validation"):
        checks[name] = (lambda fn=checks[name]: fn(tmp))
    return run_checks(checks, barrier=True)


JOB = CheckResults(_job, timeout=300)
CHECKS = sorted(n for n in globals() if n.startswith("check_"))


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ds_zero12"))


@pytest.mark.parametrize("check", CHECKS)
def test_zero12_surface(check, shared_tmp):
    JOB.assert_passed(check, 2, shared_tmp)


# --------------------------------------------------------------------------- imports (no ranks)


def test_modules_deepspeeds_tests_import_import_and_refuse_at_use():
    import evenzero.deepspeed.git_version_info as info
    import evenzero.deepspeed.ops as ops
    from evenzero.deepspeed.ops.aio import AsyncIOBuilder
    from evenzero.deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder
    from evenzero.deepspeed.pipe import LayerSpec, PipelineModule
    from evenzero.deepspeed.refusals import UnsupportedError
    from evenzero.deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from evenzero.deepspeed.runtime.zero import ZeroParamStatus
    from evenzero.deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from evenzero.deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from evenzero.deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from evenzero.deepspeed.runtime.zero.utils import ZeRORuntimeException
    from evenzero.deepspeed.utils.torch import required_torch_version

    assert info.version == "0.19.8" and info.torch_info["version"] == "0.0"
    assert ops.__compatible_ops__[FusedAdamBuilder.NAME] and ops.__compatible_ops__["cpu_adam"]
    assert not ops.__compatible_ops__[FusedLambBuilder.NAME]
    assert not ops.__compatible_ops__[AsyncIOBuilder.NAME]
    assert CPUAdamBuilder().is_compatible()
    for refused in (lambda: FusedLambBuilder().load(), lambda: PipelineModule(layers=[]),
                    lambda: LayerSpec(torch.nn.Linear, 2, 2), lambda: BF16_Optimizer(),
                    lambda: DeepSpeedZeroOptimizer_Stage3(), lambda: DeepSpeedZeroConfig(stage=3),
                    lambda: DeepSpeedZeroConfig(stage=2, offload_optimizer={"device": "cpu"})):
        with pytest.raises(UnsupportedError):
            refused()
    cfg = DeepSpeedZeroConfig.from_dict({"stage": 2, "overlap_comm": True,
                                         "stage3_max_live_parameters": 1})
    assert cfg.stage == 2 and cfg.overlap_comm and cfg.reduce_bucket_size == 500_000_000
    assert ZeroParamStatus.AVAILABLE.value == 1 and issubclass(ZeRORuntimeException, Exception)
    assert DeepSpeedZeroOptimizer.__name__ == "EngineOptimizer"
    assert required_torch_version(min_version=1.8)
    assert not required_torch_version(max_version=1.0)


def test_z3_leaf_marks_are_deepspeeds_attribute():
    from evenzero.deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    marked = set_z3_leaf_modules(model, [torch.nn.Linear])
    assert marked == [model[0], model[2]] == get_z3_leaf_modules(model)
    assert set_z3_leaf_modules(model, ["ReLU"]) == [model[1]]
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, [torch.nn.Conv1d])

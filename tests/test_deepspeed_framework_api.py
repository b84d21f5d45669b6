"""What Hugging Face Accelerate/Trainer, TRL and Lightning call on the engine and its
optimizer beyond a plain DeepSpeed loop: `engine.compile`, `set_gradient_accumulation_
boundary`, `get_global_grad_norm`, `optimizer.overflow`, `optimizer.state_dict()` (this
rank's shard, loadable at the same world size), the ZeRO-3 API (`zero.GatheredParameters`
a no-op, `zero.Init` refused), and refusals of unsupported features on every rank."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "gradient_clipping": 0.5, "steps_per_print": 10**9,
          "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "torch_adam": True}}}


def _engine(rank: int, config: dict | None = None):
    import evenzero.deepspeed as deepspeed

    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))
    return deepspeed.initialize(model=model, config=config or CONFIG)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)


def _accelerate_style_step(engine, step: int, rank: int) -> float:
    """Accelerate's DeepSpeedEngineWrapper: boundary set by the caller, step at the end."""
    loss = 0.0
    for micro in range(2):
        x, y = _batch(2 * step + micro, rank)
        out = F.mse_loss(engine(x), y)
        engine.set_gradient_accumulation_boundary(is_boundary=micro == 1)
        engine.backward(out)
        if micro == 1:
            engine.step()
        loss += out.item()
    return loss


def state_dict_job(rank: int, world: int) -> dict:
    engine, optimizer, _, _ = _engine(rank)
    for step in range(2):
        _accelerate_style_step(engine, step, rank)
    norm = engine.get_global_grad_norm()
    saved = copy.deepcopy(optimizer.state_dict())  # tensors are not copies, as in torch
    weights = [p.detach().clone() for p in engine.module.parameters()]
    after = [_accelerate_style_step(engine, 2, rank)]
    optimizer.load_state_dict(saved)
    with torch.no_grad():
        for p, w in zip(engine.module.parameters(), weights, strict=True):
            p.copy_(w)
    again = [_accelerate_style_step(engine, 2, rank)]
    engine.compile(backend="aot_eager")
    compiled = [_accelerate_style_step(engine, 3, rank)]
    return {"norm": float(norm), "overflow": optimizer.overflow, "after": after,
            "again": again, "compiled": engine.is_compiled, "compiled_loss": compiled,
            "keys": sorted(saved)}


def test_optimizer_state_dict_round_trip_and_compile():
    results = run_distributed(state_dict_job, 2, timeout=300)
    for r in results:
        assert r["norm"] > 0 and r["overflow"] is False
        assert r["after"] == r["again"]  # the state dict restored this rank's shard exactly
        assert r["compiled"] and r["keys"] == ["evenzero", "param_groups", "state"]


def refusal_job(rank: int, world: int) -> dict:
    import evenzero.deepspeed as deepspeed

    out = {}
    cases = {
        "offload": {**CONFIG, "zero_optimization": {"stage": 2, "offload_param":
                                                    {"device": "cpu"}}},
        "stage3": {**CONFIG, "zero_optimization": {"stage": 3}},
        "tensor_parallel": {**CONFIG, "tensor_parallel": {"autotp_size": 2}},
    }
    for name, config in cases.items():
        try:
            _engine(rank, config)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out[name] = str(e)
    for name, call in {"zero.Init": lambda: deepspeed.zero.Init(),
                       "init_inference": lambda: deepspeed.init_inference(None),
                       "tp_model_init": lambda: deepspeed.tp_model_init(None, 2, None),
                       "PipelineModule": lambda: deepspeed.PipelineModule([])}.items():
        try:
            call()
            out[name] = None
        except NotImplementedError as e:
            out[name] = str(e)
    return out


def test_unsupported_features_are_refused_by_name_on_every_rank():
    results = run_distributed(refusal_job, 2, timeout=300)
    for r in results:
        assert "offload_param" in r["offload"]
        assert "zero_optimization.stage" in r["stage3"]
        assert "tensor_parallel" in r["tensor_parallel"]
        assert "deepspeed.zero.Init" in r["zero.Init"] and "ZeRO stage 3" in r["zero.Init"]
        assert "deepspeed.init_inference" in r["init_inference"]
        assert "deepspeed.tp_model_init" in r["tp_model_init"]
        assert "deepspeed.PipelineModule" in r["PipelineModule"]


def test_zero3_api_names_as_deepspeed_has_them_for_unpartitioned_parameters():
    import evenzero.deepspeed as deepspeed

    p = torch.nn.Parameter(torch.ones(3))
    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
        p.data.add_(1)  # a no-op context, as DeepSpeed's is for non-ZeRO-3 parameters
    assert torch.equal(p.data, torch.full((3,), 2.0))
    with deepspeed.zero.Init(enabled=False):  # DeepSpeed's no-op form
        torch.nn.Linear(2, 2)
    assert deepspeed.zero.ZeroParamStatus.AVAILABLE.value == 1
    with pytest.raises(AttributeError, match="ZeRO stage 3"):
        deepspeed.zero.TiledLinear  # noqa: B018
    # deepspeed.pipe imports (model files import LayerSpec at the top); using it refuses.
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        deepspeed.pipe.PipelineModule(layers=[])

"""`deepspeed.checkpointing`: DeepSpeed's activation checkpointing on torch's non-reentrant
checkpoint, with DeepSpeed's results (compared with DeepSpeed 0.19.8's own when
installed) and what cannot be honoured refused by name."""

from __future__ import annotations

import pytest
import torch

from evenzero.deepspeed import checkpointing


def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4))


def run(checkpoint, inputs_require_grad: bool, seed: int = 1):
    model = block()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2),
                    requires_grad=inputs_require_grad)
    torch.manual_seed(seed)
    out = checkpoint(model, x) if checkpoint else model(x)
    if out.requires_grad:
        out.square().sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out.detach(), grads, None if x.grad is None else x.grad.clone()


def test_gradients_and_dropout_replay_equal_the_plain_forward():
    out, grads, xgrad = run(checkpointing.checkpoint, True)
    ref_out, ref_grads, ref_xgrad = run(None, True)
    assert torch.equal(out, ref_out) and torch.equal(xgrad, ref_xgrad)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_inputs_without_grad_give_parameters_no_grad_as_in_deepspeed():
    out, grads, _ = run(checkpointing.checkpoint, False)
    assert not out.requires_grad and all(g is None for g in grads)
    _, grads, _ = run(checkpointing.non_reentrant_checkpoint, False)
    assert all(g is not None for g in grads)


def test_outputs_come_back_as_deepspeed_returns_them():
    x = torch.randn(2, requires_grad=True)
    single = checkpointing.checkpoint(lambda t: (t * 2,), x)
    assert torch.is_tensor(single)
    pair = checkpointing.checkpoint(lambda t, scale=1.0: (t * scale, t + 1), x, scale=3.0)
    assert isinstance(pair, tuple) and torch.equal(pair[0].detach(), x.detach() * 3)


def test_same_results_as_deepspeeds_checkpoint(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    theirs = pytest.importorskip("deepspeed.runtime.activation_checkpointing.checkpointing",
                                 reason="DeepSpeed is not installed")
    for requires_grad in (True, False):
        out, grads, xgrad = run(checkpointing.checkpoint, requires_grad)
        ref_out, ref_grads, ref_xgrad = run(theirs.checkpoint, requires_grad)
        assert torch.equal(out, ref_out)
        assert (xgrad is None and ref_xgrad is None) or torch.equal(xgrad, ref_xgrad)
        for a, b in zip(grads, ref_grads, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_configure_accepts_lightnings_call_and_refuses_what_it_cannot_honour(monkeypatch):
    monkeypatch.setattr(checkpointing, "_configured", False)
    assert not checkpointing.is_configured()
    # Lightning's DeepSpeedStrategy, with its default activation_checkpointing section.
    checkpointing.configure(mpu_=None, partition_activations=False,
                            contiguous_checkpointing=False, checkpoint_in_cpu=False,
                            profile=False)
    assert checkpointing.is_configured()
    for kwargs, name in (({"partition_activations": True}, "partition_activations"),
                         ({"checkpoint_in_cpu": True}, "checkpoint_in_cpu"),
                         ({"contiguous_checkpointing": True}, "contiguous_checkpointing")):
        with pytest.raises(NotImplementedError, match=name):
            checkpointing.configure(None, **kwargs)
    config = {"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": True}}
    with pytest.raises(NotImplementedError, match="activation_checkpointing.cpu_checkpointing"):
        checkpointing.configure(None, deepspeed_config=config)

    class MPU:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(NotImplementedError, match="model parallelism"):
        checkpointing.configure(MPU())
    with pytest.raises(AttributeError, match="model-parallel RNG tracker"):
        checkpointing.get_cuda_rng_tracker  # noqa: B018

"""`deepspeed.accelerator.get_accelerator()` on the CPU: what DeepSpeed 0.19.8's
CPU_Accelerator answers (compared with it when DeepSpeed is installed), and the choice of
accelerator."""

from __future__ import annotations

import pytest
import torch

from evenzero.deepspeed.accelerator import get_accelerator, real_accelerator, set_accelerator
from evenzero.deepspeed.accelerator.cpu_accelerator import CPU_Accelerator, parse_cpu_list
from evenzero.deepspeed.launch import LaunchError

QUERIES = [("device_name", ()), ("device_name", (1,)), ("device", ()),
           ("current_device_name", ()), ("current_device", ()), ("device_count", ()),
           ("communication_backend_name", ()), ("is_bf16_supported", ()),
           ("is_fp16_supported", ()), ("is_available", ()), ("supported_dtypes", ()),
           ("is_synchronized_device", ()), ("synchronize", ()), ("set_device", (0,)),
           ("empty_cache", ()), ("on_accelerator", (torch.zeros(1),)),
           ("get_compile_backend", ()), ("visible_devices_envs", ()), ("initial_seed", ())]


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_SIZE", "3")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return monkeypatch


def test_cpu_accelerator_answers_as_deepspeeds(env):
    cpu = pytest.importorskip("deepspeed.accelerator.cpu_accelerator",
                              reason="DeepSpeed is not installed")
    theirs, ours = cpu.CPU_Accelerator(), CPU_Accelerator()
    for name, args in QUERIES:
        a, b = getattr(ours, name)(*args), getattr(theirs, name)(*args)
        if name.startswith("is_"):  # DeepSpeed's is_fp16_supported falls through to None
            a, b = bool(a), bool(b)
        assert a == b or (isinstance(b, list) and sorted(map(str, a)) == sorted(map(str, b))), name
    assert ours.device_count() == 3  # LOCAL_SIZE, set by the launcher
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "total_memory",
                 "available_memory"):
        assert getattr(ours, name)() > 0
    assert set(ours.memory_stats()) == set(theirs.memory_stats())


def test_cpu_accelerator_without_deepspeed(env):
    acc = CPU_Accelerator()
    assert (acc.device_name(0), acc.current_device_name(), acc.current_device()) == \
        ("cpu", "cpu", "1")
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported()
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed_all(3)
    assert torch.equal(a, torch.rand(2))
    with pytest.raises(NotImplementedError, match="op builders"):
        acc.create_op_builder("CPUAdamBuilder")
    assert parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]


def test_choice_follows_ds_accelerator(monkeypatch):
    monkeypatch.setattr(real_accelerator, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator()._name == "cpu"
    assert get_accelerator() is get_accelerator()
    monkeypatch.setattr(real_accelerator, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(LaunchError, match="DS_ACCELERATOR=xpu"):
        get_accelerator()
    with pytest.raises(ValueError, match="cpu or cuda only"):
        set_accelerator(object())

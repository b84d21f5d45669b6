"""DeepSpeed's "Muon" optimizer config under evenzero.deepspeed (deepspeed/muon.py): the
use_muon split, the defaults, and the update (single process; the 2-rank run against real
DeepSpeed is the `zero0_muon` case of tests/test_deepspeed_compat.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evenzero.deepspeed.config import DeepSpeedConfigError, NamedSection
from evenzero.deepspeed.fused_adam import FusedAdam
from evenzero.deepspeed.muon import (
    DeepSpeedMuon,
    FusedAdamL2,
    halves,
    muon_update,
    split_groups,
    uses_muon,
)
from evenzero.deepspeed.optimizers import optimizer_from_config
from evenzero.runtime.config import ELEMENTWISE, WHOLE_TENSOR, update_kind


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.conv = nn.Conv1d(2, 2, 3)
        self.lm_head = nn.Linear(8, 10, bias=False)


def test_split_follows_use_muon():
    m = Model()
    names = {id(p): n for n, p in m.named_parameters()}
    assert [n for n, p in m.named_parameters() if uses_muon(n, p)] == ["fc.weight", "conv.weight"]
    muon, adam, mode = halves({"lr": 0.01, "adam_lr": 1e-3, "weight_decay": 0.1})
    assert muon == {"lr": 0.01, "momentum": 0.95, "weight_decay": 0.1, "ns_method": "gram"}
    assert adam == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.1}
    groups = split_groups([{"params": list(m.parameters())}], names, mode, adam)
    assert [g["name"] for g in groups] == ["muon-params", "adam-params"]
    assert groups[1]["optimizer"] is FusedAdam and groups[1]["lr"] == 1e-3
    assert {names[id(p)] for p in groups[0]["params"]} == {"fc.weight", "conv.weight"}
    l2 = split_groups([{"params": list(m.parameters())}], names, False, adam)
    assert l2[1]["optimizer"] is FusedAdamL2


def test_defaults_and_bad_keys():
    choice = optimizer_from_config(NamedSection("Muon", {}))
    assert choice.cls is DeepSpeedMuon and choice.name == "muon"
    assert choice.kwargs == {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0,
                             "ns_method": "gram"}
    with pytest.raises(DeepSpeedConfigError, match="nesterov"):
        optimizer_from_config(NamedSection("Muon", {"nesterov": False}))
    with pytest.raises(DeepSpeedConfigError, match="ns_method"):
        optimizer_from_config(NamedSection("Muon", {"ns_method": "svd"}))
    assert update_kind(DeepSpeedMuon) == WHOLE_TENSOR
    assert update_kind(FusedAdam) == update_kind(FusedAdamL2) == ELEMENTWISE


@pytest.mark.slow  # importing DeepSpeed's Muon compiles its kernels (~50 s)
@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", [(16, 8), (4, 16), (8, 8)])
def test_update_is_deepspeeds(method, shape):
    original = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")
    g = torch.Generator().manual_seed(0)
    grad, buf = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    want_buf = buf.clone()
    want = original.muon_update(grad.clone(), want_buf, 0.95, ns_method=method)
    got_buf = buf.clone()
    got = muon_update(grad.clone(), got_buf, 0.95, method)
    torch.testing.assert_close(got_buf, want_buf)
    # "gram" runs in fp32 on the CPU; "standard" in bf16, where DeepSpeed's compiled kernel
    # fuses the iteration's products differently (a wrong formula is off by O(1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if method == "gram" else 6e-2)

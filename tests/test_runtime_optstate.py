"""A rank's optimizer state dict: torch's shape, and what must match to load it."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from evenzero.runtime.optstate import RankIdentity, layout_fingerprint, mismatch, pack
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan


def _plan(bucket=64, world=2):
    spec = ModelSpec((ParamSpec("w", (8, 8), "dense"), ParamSpec("b", (8,), "dense")),
                     (GroupSpec("dense"),), ("b", "w"))
    return plan(spec, world, "evenzero", PlanOptions(bucket_numel=bucket))


def _state(who):
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]
    return pack(groups, {0: {"step": torch.tensor(3.0)}},
                {"dense": {"master": torch.ones(40), "exp_avg": torch.zeros(40)}}, who, 3,
                {"enabled": False, "scale": 1.0})


def test_fingerprint_follows_the_layout():
    assert layout_fingerprint(_plan()) == layout_fingerprint(_plan())
    assert layout_fingerprint(_plan()) != layout_fingerprint(_plan(bucket=200))
    assert layout_fingerprint(_plan()) != layout_fingerprint(_plan(world=4))


def test_state_dict_is_torch_shaped_and_survives_weights_only_load():
    who = RankIdentity(2, 1, layout_fingerprint(_plan()), ("b", "w"))
    sd = _state(who)
    assert set(sd) == {"state", "param_groups", "evenzero"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert mismatch(back, who, [2]) is None
    assert torch.equal(back["evenzero"]["shards"]["dense"]["master"], torch.ones(40))


def test_scheduler_keys_do_not_matter_and_each_difference_is_named():
    who = RankIdentity(2, 1, layout_fingerprint(_plan()), ("b", "w"))
    sd = _state(who)
    sd["param_groups"][0]["initial_lr"] = 0.1
    assert mismatch(sd, who, [2]) is None
    cases = {
        "world size 2, this run has 4": dataclasses.replace(who, world_size=4),
        "saved by rank 1 and this is rank 0": dataclasses.replace(who, rank=0),
        "different shard layout": dataclasses.replace(who, layout="0" * 16),
    }
    for words, here in cases.items():
        msg = mismatch(sd, here, [2])
        assert msg is not None and words in msg, msg
        if "rank 0" not in words:
            assert "evenzero.checkpoint" in msg
    assert "hold [2] parameters" in mismatch(sd, who, [1, 1])
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict()
    assert "plain torch optimizer" in mismatch(plain, who, [1])
    assert "not an optimizer state dict" in mismatch({"x": 1}, who, [1])
    sd["evenzero"]["format"] = 99
    assert "format" in mismatch(sd, who, [2])


@pytest.mark.parametrize("damage", ["world_size", "layout"])
def test_damaged_section_is_named(damage):
    who = RankIdentity(2, 1, layout_fingerprint(_plan()), ("b", "w"))
    sd = _state(who)
    del sd["evenzero"][damage]
    assert "damaged" in mismatch(sd, who, [2])


def test_runtime_and_checkpoint_do_not_import_each_other():
    """They meet through checkpoint/protocol.py only (no import either way, lazy ones too)."""
    import ast
    from pathlib import Path

    import evenzero

    root = Path(evenzero.__file__).parent
    for here, other in (("runtime", "checkpoint"), ("checkpoint", "runtime")):
        for path in (root / here).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.startswith(f"evenzero.{other}") for n in names), (path, names)

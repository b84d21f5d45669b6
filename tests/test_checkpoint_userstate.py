"""The user's `extra=` state without processes: exact round trip, clear refusals, no pickle."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from evenzero.checkpoint.format import CheckpointError, Manifest
from evenzero.checkpoint.userstate import (
    TREE_KEY,
    read_user_state,
    user_state_file,
    write_user_state,
)


def manifest_for(records, world: int) -> Manifest:
    return Manifest(3, 3, world, "evenzero", "test", "torch.optim.adamw.AdamW", (), (),
                    tuple(records), user_state={r.rank: r.name for r in records})


def round_trip(tmp_path: Path, value, rank: int = 0):
    record = write_user_state(tmp_path, rank, value)
    return read_user_state(tmp_path, manifest_for([record], rank + 1), rank)


def assert_same(got, want, where="extra"):
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want.cpu()), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, where


def test_training_state_round_trips_exactly(tmp_path):
    sched = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), lambda s: 0.5 ** s)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    plain.zero_grad()
    plain.param_groups[0]["params"][0].grad = torch.ones(3)
    plain.step()
    extra = {
        "scheduler": sched.state_dict(),
        "data": {"epoch": 3, "index": 1200, "order": [5, 1, 4]},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": torch.from_numpy(np.random.get_state()[1].copy())},
        "discriminator": plain.state_dict(),          # int keys, nested tensors
        "ema": torch.randn(4, 5).t(),                 # not contiguous
        "dtypes": [torch.tensor(7, dtype=torch.int64), torch.ones(2, dtype=torch.bfloat16),
                   torch.tensor([True, False]), torch.zeros(0), torch.tensor([2**32 - 1],
                                                                            dtype=torch.uint32)],
        "odd keys": {(1, "a"): None, 2.5: "x", None: True, "__tuple__": 1},
        "floats": (float("inf"), float("nan"), -0.0, 1 / 3),
        "big": 2**80, "text": "ünïcode\n", "looks tagged": {"__stored__": "0"},
    }
    got = round_trip(tmp_path, extra)
    assert_same(got, extra)
    # The structure is JSON in the header: nothing in the file is pickled.
    with safe_open(str(tmp_path / user_state_file(0)), "pt") as f:
        tree = json.loads(f.metadata()[TREE_KEY])
    assert tree["data"] == {"epoch": 3, "index": 1200, "order": [5, 1, 4]}


@pytest.mark.parametrize("value,message", [
    ({"rng": np.random.get_state()}, r"extra\['rng'\]\[1\]: cannot store a value of type "
                                     r"numpy.ndarray .* torch.from_numpy"),
    ({"step": np.int64(3)}, r"extra\['step'\]: cannot store a value of type numpy.int64"),
    ({"fn": print}, r"extra\['fn'\]: cannot store a value of type builtins"),
    ({"set": {1, 2}}, r"extra\['set'\]: cannot store a value of type builtins.set"),
    ({"d": {torch.tensor(1): 2}}, r"extra\['d'\]: dict key tensor\(1\) of type Tensor"),
    ({"sparse": torch.eye(3).to_sparse()}, r"extra\['sparse'\]: a torch.sparse_coo tensor "
                                           r"cannot be stored"),
    ([torch.zeros(2, dtype=torch.complex64)], r"has dtype complex64, which a checkpoint cannot"),
])
def test_unstorable_state_is_refused_naming_the_entry(tmp_path, value, message):
    with pytest.raises(CheckpointError, match=message):
        write_user_state(tmp_path, 0, value)


def test_each_rank_gets_its_own_state_and_new_ranks_get_rank_0s(tmp_path):
    records = [write_user_state(tmp_path, r, {"rank": r, "rng": torch.full((3,), r)})
               for r in range(2)]
    m = manifest_for(records, 3)
    assert [read_user_state(tmp_path, manifest_for(records, 2), r)["rank"] for r in range(3)] \
        == [0, 1, 0]
    only_rank_1 = Manifest(*[getattr(m, f) for f in ("step", "step_count", "world_size", "strategy",
                                                     "library_version", "optimizer_class",
                                                     "groups", "params", "files")],
                           user_state={1: records[1].name})
    assert read_user_state(tmp_path, only_rank_1, 0) is None
    assert read_user_state(tmp_path, only_rank_1, 1)["rank"] == 1


def test_damaged_user_state_is_an_error_naming_the_file(tmp_path):
    record = write_user_state(tmp_path, 0, {"a": torch.ones(2)})
    m = manifest_for([record], 1)
    path = tmp_path / record.name
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"user-state-rank-00000.safetensors: sha256 mismatch"):
        read_user_state(tmp_path, m, 0)
    # A consistent file whose structure refers to a tensor it lacks (forged, re-hashed).
    from evenzero.checkpoint.files import write_file

    forged = write_file(path, {}, 0, {TREE_KEY: json.dumps({"a": {"__stored__": "0"}})})
    with pytest.raises(CheckpointError, match=r"user-state-rank-00000.safetensors: malformed "
                                              r"user state \(KeyError"):
        read_user_state(tmp_path, manifest_for([forged], 1), 0)


def test_a_structure_too_large_for_a_safetensors_header_is_refused(tmp_path, monkeypatch):
    from evenzero.checkpoint import userstate

    monkeypatch.setattr(userstate, "MAX_TREE_BYTES", 2**20)
    write_user_state(tmp_path, 0, {"order": list(range(100_000))})
    with pytest.raises(CheckpointError, match=r"extra: its structure is 2 MiB of JSON .* store "
                                              r"large lists as tensors"):
        write_user_state(tmp_path, 0, {"order": list(range(200_000, 500_000))})

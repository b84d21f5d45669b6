"""`staging.stage()` checks what any `ShardSource` gives before anything is written, and
the background save's snapshot buffers stay one snapshot's size; no processes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from evenzero.checkpoint.background import SnapshotBuffers
from evenzero.checkpoint.format import MASTER, CheckpointError
from evenzero.checkpoint.staging import StagedGroup, stage
from evenzero.checkpoint.state import RankPlace, ShardTarget
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan

SRC = Path(__file__).resolve().parents[1] / "src" / "evenzero"


class PlannedOnly:
    """The members `stage()` reads: a plan on 2 ranks, this being rank `rank`."""

    def __init__(self, rank: int, scaler: dict | None = None) -> None:
        spec = ModelSpec((ParamSpec("a", (40, 30)), ParamSpec("b", (700,))), (GroupSpec("dense"),))
        self.plan = plan(spec, 2, options=PlanOptions(bucket_numel=1000))
        self.rank, self.scaler = rank, scaler

    def group_rank(self, group: str) -> int:
        return self.rank

    def loss_scaler_state(self):
        return self.scaler

    def check_loss_scaler_state(self, state) -> None:
        if state.get("scale", 1.0) <= 0:
            raise ValueError("scale must be positive")


class Given:
    """A source returning `make(target)` for every group."""

    where = "test source"

    def __init__(self, make, scaler=None) -> None:
        self.make, self.scaler = make, scaler
        self.targets: list[ShardTarget] = []

    def group(self, target: ShardTarget) -> StagedGroup:
        self.targets.append(target)
        return self.make(target)

    def model_extras(self):
        return {}

    def loss_scaler(self):
        return self.scaler

    def step_count(self):
        return 3


def place(rank: int) -> RankPlace:
    return RankPlace(rank, 2, torch.device("cpu"), None, {"dense": 0})


def good(target: ShardTarget, **change) -> StagedGroup:
    n = target.shard_numel
    parts = {"flats": {MASTER: torch.zeros(n), "exp_avg": torch.ones(n)},
             # "elsewhere" is not in this shard (a source may know more than the shard)
             "param_scalars": {p: {"step": 1.0} for p in ("a", "b", "elsewhere")},
             "stepped": frozenset({"a", "b", "elsewhere"}), "hyperparameters": {"lr": 0.1}}
    parts.update(change)
    return StagedGroup(**parts)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_source_is_asked_for_this_ranks_shard_and_limited_to_it(rank):
    opt = PlannedOnly(rank)
    source = Given(good)
    staged = stage(opt, place(rank), source)
    (target,) = source.targets
    assert target.ranges == tuple(opt.plan.shard_ranges("dense", rank))
    assert target.shard_numel == opt.plan.shard_numel("dense")
    mine = set(target.params)
    assert mine == {r.param for r in opt.plan.shard_ranges("dense", rank)} and mine
    g = staged.groups["dense"]
    assert set(g.param_scalars) == mine and g.stepped == frozenset(mine)
    assert list(g.flats) == [MASTER, "exp_avg"] and staged.step_count == 3
    assert staged.targets["dense"] == target and staged.loss_scaler is None


@pytest.mark.parametrize("change, message", [
    (lambda t: {"flats": {"exp_avg": torch.zeros(t.shard_numel)}}, r"no master weights"),
    (lambda t: {"flats": {MASTER: torch.zeros(t.shard_numel, dtype=torch.bfloat16)}},
     r"master weights of group 'dense' are torch.bfloat16; evenzero checkpoints store fp32"),
    (lambda t: {"flats": {MASTER: torch.zeros(t.shard_numel + 1)}},
     r"test source: group 'dense': master has shape \[\d+\], this rank's shard \d+ elements"),
    (lambda t: {"param_scalars": {}}, r"no optimizer state for parameter\(s\)"),
])
def test_what_a_source_gives_is_checked(change, message):
    with pytest.raises(CheckpointError, match=message):
        stage(PlannedOnly(0), place(0), Given(lambda t: good(t, **change(t))))


def test_a_loss_scale_the_optimizer_refuses_is_an_error_naming_the_source():
    with pytest.raises(CheckpointError, match=r"test source: loss scaler: scale must be positive"):
        stage(PlannedOnly(0, {"scale": 2.0}), place(0), Given(good, {"scale": -1.0}))
    # An optimizer without loss scaling takes none.
    assert stage(PlannedOnly(0), place(0), Given(good, {"scale": 2.0})).loss_scaler is None


def test_snapshot_buffers_are_reused_and_stay_one_snapshot():
    buffers = SnapshotBuffers()
    live = torch.arange(6.0)
    first = buffers.copy(("shard", "dense", MASTER), live)
    buffers.copy(("extra", "bn.running_mean"), torch.ones(2))
    buffers.settle()
    live.add_(1)
    assert torch.equal(first, torch.arange(6.0))  # a copy, not the live tensor
    assert buffers.nbytes() == (6 + 2) * 4
    again = buffers.copy(("shard", "dense", MASTER), live)
    buffers.settle()  # the extra was not copied this time: its buffer goes
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, live)
    assert buffers.nbytes() == 6 * 4
    resized = buffers.copy(("shard", "dense", MASTER), torch.zeros(3))
    buffers.settle()
    assert resized.numel() == 3 and buffers.nbytes() == 3 * 4


def imports_of(package: Path) -> set[str]:
    out = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
    return out


def test_runtime_and_checkpoint_meet_only_through_the_protocol():
    assert not {m for m in imports_of(SRC / "checkpoint") if m.startswith("evenzero.runtime")}
    assert not {m for m in imports_of(SRC / "runtime") if m.startswith("evenzero.checkpoint")}

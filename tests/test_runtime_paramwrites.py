"""Writes to parameters between steps reach the master shard (no processes)."""

from __future__ import annotations

import pytest
import torch

from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.checks import ZeroRuntimeError
from evenzero.runtime.paramwrites import adopt_replaced, pick_up
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec, dtype_name
from evenzero.strategies import PlanOptions, plan
from test_runtime_models import MLP


def _setup(dtype=torch.float32, world=2, rank=1):
    torch.manual_seed(0)
    model = MLP().to(dtype)
    named = dict(model.named_parameters())
    spec = ModelSpec(tuple(ParamSpec(n, tuple(p.shape), "dense", dtype_name(p.dtype))
                           for n, p in named.items()),
                     (GroupSpec("dense"),), tuple(reversed(named)))
    p = plan(spec, world, "evenzero", PlanOptions(bucket_numel=96, alignment_bytes=4))
    flat = FlatParams(p, named, {"dense": rank})
    master = torch.zeros(p.shard_numel("dense"))
    refresh_masters(p, flat, master)
    return model, p, flat, master, rank


def refresh_masters(p, flat, master, scratch=None) -> bool:
    """What `GroupShard.pick_up_writes` does for fp32 masters of a group's layouts."""
    written = False
    for s in p.layout_shards("dense"):
        written |= pick_up(master[s.shard_offset:s.shard_offset + s.numel],
                           flat.owned_slice("dense", s.layout), scratch)
    return written


def _expected(p, rank, model) -> torch.Tensor:
    values = {n: t.detach().float().reshape(-1) for n, t in model.named_parameters()}
    out = torch.zeros(p.shard_numel("dense"))
    for r in p.shard_ranges("dense", rank):
        out[r.shard_offset:r.shard_offset + r.numel] = values[r.param][r.start:r.start + r.numel]
    return out


def _write_load_state_dict(model):
    other = MLP()
    model.load_state_dict({k: v.to(next(model.parameters()).dtype)
                           for k, v in other.state_dict().items()})


def _write_copy(model):
    with torch.no_grad():
        model.fc2.weight.copy_(torch.full_like(model.fc2.weight, 0.25))


def _write_in_place(model):
    with torch.no_grad():
        model.fc1.weight.mul_(-2.0)


def _write_data_clamp(model):
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)


def _write_data_assign(model):
    model.head.weight.data = torch.full_like(model.head.weight, 3.0)
    model.fc1.bias.data = model.fc1.bias.data.double()  # a dtype re-cast too


WRITES = [_write_load_state_dict, _write_copy, _write_in_place, _write_data_clamp,
          _write_data_assign]


@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.removeprefix("_write_"))
def test_every_kind_of_write_reaches_the_master(write):
    model, p, flat, master, rank = _setup()
    before = master.clone()
    write(model)
    adopt_replaced(flat)
    refresh_masters(p, flat, master)
    assert not torch.equal(master, before)
    torch.testing.assert_close(master, _expected(p, rank, model), rtol=0, atol=0)
    # The parameters point into the flat buffers again, in the buffer dtype.
    buf_ptrs = {n: flat.buffers[(g, i)][o:].data_ptr()
                for n, (g, i, o) in ((s.name, p.locate(s.name)) for lay in p.layouts
                                     for s in lay.params)}
    for n, prm in model.named_parameters():
        assert prm.data_ptr() == buf_ptrs[n] and prm.dtype == torch.float32


def test_low_precision_master_keeps_its_precision_where_not_written():
    model, p, flat, master, rank = _setup(torch.bfloat16)
    # Masters carry bits the bf16 parameters cannot hold, as after a few steps.
    master += torch.rand(master.shape) * 1e-4
    master.copy_(torch.where(master.to(torch.bfloat16).float() == _expected(p, rank, model),
                             master, _expected(p, rank, model)))
    precise = master.clone()
    _write_copy(model)
    refresh_masters(p, flat, master)
    written = {r.shard_offset + i for r in p.shard_ranges("dense", rank) if r.param == "fc2.weight"
               for i in range(r.numel)}
    idx = torch.tensor(sorted(written), dtype=torch.long)
    keep = torch.ones_like(master, dtype=torch.bool)
    keep[idx] = False
    assert torch.equal(master[keep], precise[keep])
    # Written elements hold the written value; one whose master already rounded to it
    # cannot be told from an unwritten one and keeps its master (same bf16 value).
    assert torch.all(master[idx].to(torch.bfloat16) == 0.25)
    moved = precise[idx].to(torch.bfloat16) != 0.25
    assert moved.any() and torch.all(master[idx][moved] == 0.25)


def test_the_cheap_check_changes_nothing_without_writes_and_only_written_chunks():
    torch.manual_seed(1)
    master = torch.randn(1000)
    owned = master.to(torch.bfloat16)          # what the last gather left
    precise = master.clone()
    scratch = torch.empty(64, dtype=torch.bfloat16)  # many chunks
    assert not pick_up(master, owned, scratch)
    assert torch.equal(master, precise)        # every bit of precision kept
    owned[700] = 5.0
    owned[3] = 0.0                             # a write in another chunk
    assert pick_up(master, owned, scratch)
    changed = (master != precise).nonzero().flatten().tolist()
    assert changed == [3, 700] and master[700] == 5.0
    assert torch.equal(master[:3], precise[:3]) and torch.equal(master[701:], precise[701:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_sync_free_merge_gives_the_checked_result(dtype):
    """The accelerator path (no host sync per chunk) merges every chunk unconditionally:
    the same masters as the checked path, written elements and kept precision alike."""
    torch.manual_seed(2)
    master = torch.randn(1000)
    owned = master.to(dtype)
    owned[[3, 700]] = torch.tensor([0.0, 5.0], dtype=dtype)
    owned[500] = float("nan")
    checked, merged = master.clone(), master.clone()
    scratch = torch.empty(64, dtype=dtype)
    assert pick_up(checked, owned, scratch, sync_free=False)
    assert pick_up(merged, owned, scratch, sync_free=True) is None
    assert torch.equal(checked.view(torch.int32), merged.view(torch.int32))
    assert (merged != master).nonzero().flatten().tolist() == [3, 500, 700]


def test_pick_up_fp32_is_a_copy_and_nan_propagates():
    m = torch.zeros(4)
    pick_up(m, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert m.tolist() == [1, 2, 3, 4]
    m16 = torch.tensor([1.0001, 2.0, 3.0, 4.0])
    pick_up(m16, torch.tensor([1.0, 2.0, float("nan"), 5.0], dtype=torch.bfloat16))
    assert m16[0].item() == pytest.approx(1.0001) and m16[1] == 2 and m16[2].isnan()
    assert m16[3] == 5


def test_moving_or_resizing_a_parameter_is_refused():
    model, p, flat, master, rank = _setup()
    model.fc1.weight.data = torch.zeros(3)
    with pytest.raises(ZeroRuntimeError, match="fc1.weight.*resized"):
        adopt_replaced(flat)

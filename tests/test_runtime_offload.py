"""runtime/offload.py: `offload_optimizer="cpu"` is the same run as no offload, bit for bit.

With CPU parameters the offloaded data flow runs with host-to-host copies (the masters
apart from the parameters, gradients landed through staging, parameters published
through staging), so equality with the plain run checks every move of the data."""

from __future__ import annotations

import pytest
import torch
from tests.dist_helpers import run_distributed

from evenzero.runtime import ZeroConfig, ZeroConfigError, ZeroOptimizer
from evenzero.runtime.collectives import REDUCE_SCATTERS
from evenzero.runtime.offload import HostLink, HostNeed, check_offload, host_need


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.GELU(), torch.nn.Linear(40, 40),
                               torch.nn.GELU(), torch.nn.Linear(40, 6)).to(dtype)


def _run(rank: int, dtype: torch.dtype, offload: str | None, stage: int, steps: int = 3):
    model = _model(dtype)
    head = list(model[4].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = ZeroOptimizer(model, torch.optim.AdamW,
                        [{"params": body}, {"params": head, "lr": 3e-3, "weight_decay": 0.0}],
                        lr=1e-2, weight_decay=0.05, bucket_numel=700, stage=stage,
                        offload_optimizer=offload)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(10 + rank)
    losses, norms = [], []
    for _ in range(steps):
        for micro in range(2):  # accumulation: one reduced backward per micro-batch
            x = torch.randn(8, 12, generator=g).to(dtype)
            y = torch.randn(8, 6, generator=g).to(dtype)
            if micro == 0:
                with opt.no_sync():
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
            else:
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            losses.append(float(loss.detach()))
        norms.append(float(opt.clip_grad_norm_(0.5)))
        opt.step()
        sched.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    report = opt.memory_report()
    opt.close()
    return losses, norms, params, state, report


CASES = ((torch.float32, 2), (torch.bfloat16, 2))
SLOW_CASES = (*CASES, (torch.float32, 1))


def _build(dtype: torch.dtype, offload: str | None):
    model = _model(dtype)
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.05, bucket_numel=700,
                        offload_optimizer=offload)
    return model, opt


def _steps(model, opt, rank: int, first: int, n: int, dtype: torch.dtype) -> None:
    for i in range(first, first + n):
        g = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(8, 12, generator=g).to(dtype)
        torch.nn.functional.mse_loss(model(x), torch.zeros(8, 6, dtype=dtype)).backward()
        opt.step()
        opt.zero_grad()


def _checkpoints_cross(rank: int, path: str) -> list[str]:
    """An offloaded run and a plain one read each other's checkpoints: each resumed run
    equals the run that never stopped, bit for bit."""
    from evenzero import checkpoint

    wrong = []
    dtype = torch.bfloat16
    model, opt = _build(dtype, None)
    _steps(model, opt, rank, 0, 4, dtype)
    straight = [p.detach().clone() for p in model.parameters()]
    opt.close()
    for saver, loader in ((None, "cpu"), ("cpu", None)):
        model, opt = _build(dtype, saver)
        _steps(model, opt, rank, 0, 2, dtype)
        checkpoint.save(opt, path, tag=f"from-{saver}")
        opt.close()
        model, opt = _build(dtype, loader)
        checkpoint.load(opt, path, tag=f"from-{saver}")
        _steps(model, opt, rank, 2, 2, dtype)
        if not all(torch.equal(a, b) for a, b in zip(straight, model.parameters(), strict=True)):
            wrong.append(f"saved with offload={saver}, loaded with offload={loader}: differs")
        opt.close()
    return wrong


def _equal_job(rank: int, world: int, cases=CASES, refusals: bool = False,
               path: str | None = None) -> list[str]:
    """Every difference between the plain and the offloaded run (compared on the rank:
    tensors do not travel back), then, with `refusals`, the refusals' messages."""
    wrong = []
    for dtype, stage in cases:
        key = f"{dtype} stage {stage}"
        plain = _run(rank, dtype, None, stage)
        off = _run(rank, dtype, "cpu", stage)
        if plain[0] != off[0] or plain[1] != off[1]:
            wrong.append(f"{key}: losses or norms differ")
        if not all(torch.equal(a, b) for a, b in zip(plain[2], off[2], strict=True)):
            wrong.append(f"{key}: parameters differ")
        if not _same(plain[3], off[3]):
            wrong.append(f"{key}: state_dict differs")
        report = off[4]
        if not (report.offloaded > 0 and plain[4].offloaded == 0
                and report.by_device == (("cpu", report.total),)):
            wrong.append(f"{key}: memory report {report}")
    if path is not None:
        wrong += _checkpoints_cross(rank, path)
    if refusals:
        wrong += _memory_agrees_with_plan(rank, world)
        errors = _refusals(rank)
        if "offload_optimizer='cpu' steps the optimizer on the host" not in errors["optimizer"]:
            wrong.append(f"optimizer refusal: {errors['optimizer']}")
        if "GiB available" not in errors["host"]:
            wrong.append(f"host memory refusal: {errors['host']}")
    return wrong


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and sorted(map(repr, a)) == sorted(map(repr, b))
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_offload_is_bit_identical_at_two_ranks(tmp_path):
    """Also: checkpoints cross between offloaded and plain runs; memory_report() agrees
    with the plan; the refusals reach every rank (one spawn of two ranks for all)."""
    assert run_distributed(_equal_job, 2, (CASES, True, str(tmp_path)), timeout=240) == [[], []]


@pytest.mark.slow
def test_offload_is_bit_identical_at_four_ranks():
    """With stage 1 too, and memory_report() against the plan at 4 ranks."""
    assert run_distributed(_equal_job, 4, (SLOW_CASES, True), timeout=600) == [[]] * 4


def _memory_agrees_with_plan(rank: int, world: int) -> list[str]:
    """memory_report() against the plan's estimate on a GPT, within 5%: the "device" is
    the CPU here, so device bytes are the parameters' and the buckets'; the host bytes
    are what offload holds."""
    from evenzero.cost.memory import estimate_memory
    from evenzero.repro.gptmodel import GPT, GPTConfig

    cfg = GPTConfig(vocab=256, seq=16, dim=64, layers=2, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, bucket_numel=1 << 14,
                        offload_optimizer="cpu")
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(rank))
    model(idx).float().square().mean().backward()
    opt.step()
    report, est = opt.memory_report(), estimate_memory(opt.plan)
    device = report.parameters + report.gradient_buffers + report.bucket_pool
    # The plan's in-flight buckets, plus the scratch the backend's reduce-scatter takes
    # from the same pool (gloo's all-to-all + sum: a bucket-sized receive buffer), which
    # the planner, not knowing the backend, leaves out.
    scratch = REDUCE_SCATTERS[opt.reduce_scatter_algorithm].scratch_numel(
        max(b.numel for b in opt.plan.buckets), world) * 4 * opt.plan.memory.buckets_in_flight
    planned_device = report.parameters + est.total_bytes + scratch
    opt.close()
    wrong = []
    if abs(device - planned_device) > 0.05 * planned_device:
        wrong.append(f"device bytes {device} vs plan {planned_device} ({est.basis})")
    if abs(report.offloaded - est.host_bytes) > 0.05 * est.host_bytes:
        wrong.append(f"host bytes {report.offloaded} vs plan {est.host_bytes} ({report})")
    return wrong


# ---------------------------------------------------------------------- the link


def test_host_link_applies_landed_copies_in_order_and_reuses_staging():
    link = HostLink(torch.device("cpu"), pin=True)  # pinning needs CUDA: ignored here
    assert not link.pin
    shard = torch.zeros(6)
    src = torch.arange(6.0)
    link.land([src[:3], src[3:]], lambda c: (shard[:3].add_(c[0]), shard[3:].add_(c[1])))
    src.fill_(100.0)  # the caller may reuse its buffers once land returns
    link.land([src[:3]], lambda c: shard[:3].mul_(0).add_(c[0], alpha=0.5))
    link.drain()
    assert shard.tolist() == [50.0, 50.0, 50.0, 3.0, 4.0, 5.0]
    assert link.pending() == 0 and link.bytes_to_host == 9 * 4
    held = link.staging_nbytes()
    link.land([src[:3]], lambda c: None)
    assert link.staging_nbytes() == held  # a free buffer that fits is taken again


def test_host_link_publish_rounds_on_the_host():
    link = HostLink(torch.device("cpu"), pin=False)
    master = torch.tensor([1.0 + 2 ** -10, 3.0, -2.5])
    owned = torch.zeros(3, dtype=torch.bfloat16)
    link.publish(0, owned, master)
    assert torch.equal(owned, master.to(torch.bfloat16))
    assert link.bytes_to_device == 6


# ---------------------------------------------------------------------- bad input


class _DeviceOnlyAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})


def test_refusals_name_the_setting():
    with pytest.raises(ZeroConfigError, match="nvme.*offload_optimizer='cpu'"):
        ZeroConfig(offload_optimizer="nvme")
    with pytest.raises(ZeroConfigError, match="offload_optimizer must be 'cpu' or None"):
        ZeroConfig(offload_optimizer="gpu")
    with pytest.raises(ZeroConfigError, match="pin_memory must be True or False"):
        ZeroConfig(offload_optimizer="cpu", pin_memory="yes")
    need = host_need([(1000, 2)], 4, torch.optim.AdamW)
    assert need == HostNeed(pinned=1000 * 10, pageable=1000 * 12)
    with pytest.raises(ZeroConfigError, match="_DeviceOnlyAdam is not known to keep its state"):
        check_offload("cpu", True, _DeviceOnlyAdam, need, 1 << 40)
    with pytest.raises(ZeroConfigError, match=r"pins about 0\.00 GiB \(pin_memory=True\).*"
                                              r"has 0\.00 GiB available"):
        check_offload("cpu", True, torch.optim.AdamW, need, 100)
    check_offload("cpu", True, torch.optim.AdamW, need, 1 << 40)
    check_offload(None, True, _DeviceOnlyAdam, need, 0)


def _refusals(rank: int) -> dict[str, str]:
    import evenzero.runtime.setup as setup

    errors = {}
    model = _model(torch.float32)
    try:
        ZeroOptimizer(model, _DeviceOnlyAdam, offload_optimizer="cpu", elementwise=True)
    except ZeroConfigError as e:
        errors["optimizer"] = str(e)
    # Only rank 1's host is short: every rank must still raise, none may hang.
    if rank == 1:
        setup.host_bytes_available = lambda: 1000
    try:
        ZeroOptimizer(model, torch.optim.AdamW, offload_optimizer="cpu")
    except ZeroConfigError as e:
        errors["host"] = str(e)
    return {k: errors.get(k, "not refused") for k in ("optimizer", "host")}


def _save_offloaded(rank: int, world: int, path: str) -> list[list[float]]:
    from evenzero import checkpoint

    model, opt = _build(torch.float32, "cpu")
    _steps(model, opt, rank, 0, 2, torch.float32)
    checkpoint.save(opt, path, tag="w2")
    opt.close()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def _load_at(rank: int, world: int, path: str, offload: str | None) -> list[list[float]]:
    from evenzero import checkpoint

    model, opt = _build(torch.float32, offload)
    checkpoint.load(opt, path, tag="w2")
    out = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    _steps(model, opt, rank, 2, 1, torch.float32)  # and it trains on from there
    opt.close()
    return out


@pytest.mark.slow
def test_offloaded_checkpoint_loads_at_another_world_size(tmp_path):
    saved = run_distributed(_save_offloaded, 2, (str(tmp_path),), timeout=180)[0]
    for offload in (None, "cpu"):
        assert run_distributed(_load_at, 1, (str(tmp_path), offload), timeout=180)[0] == saved

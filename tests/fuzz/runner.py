"""Run one case under DDP and under evenzero on the same ranks, and compare after every step.

Both copies of the model start from the same seed and see the same local batches. The
reference is DDP (`find_unused_parameters` as the case draws it) with a torch optimizer
stepping fp32 masters (the parameters themselves when they are fp32; an fp32 copy of a
bf16 parameter otherwise, rounded back after each step, which is what evenzero promises
for low-precision parameters). A bf16-reduced fp32 model uses DDP's own bf16 comm hook.

After every step the ranks compare, in this order: every backward's output (the forward saw
the same weights), the gradient norm (clipping, or `clip_grad_norm_(inf)`), the
parameters, the fp32 masters and the optimizer state (evenzero's consolidated by name).
With `overlap_param_gather` only the losses and norms are compared until the end of the
case, so that the next forward is what waits for the gathers.

fp32 cases must agree within `FP32_RTOL` of each tensor's largest magnitude. bf16 cases
(bf16 parameters or a bf16 reduction) are held to what bf16 costs DDP itself: the case
also runs under an all-fp32 DDP from the same rounded weights, and evenzero may differ
from the bf16 DDP by `BF16_FACTOR` times that difference, with a floor of a few bf16
roundings. (Two bf16 DDPs that differ only in bucket order agree bitwise on gloo, so
they measure nothing.)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import traceback
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .case import Case, Step, needs_find_unused
from .model import FuzzNet, block_params

FP32_RTOL = 1e-6
BF16_FLOOR = 2.0 ** -6
# A bf16 weight near a rounding boundary lands one ulp (2^-7 near 1) apart after steps
# that agree to 1e-7 in fp32; times an input of ~2.5 that is 0.02 in the output (seed 960).
BF16_OUTPUT_FLOOR = 2.0 ** -5
BF16_FACTOR = 4.0

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
}
DTYPES = {None: None, "fp32": "float32", "bf16": "bfloat16"}
FAULT_DOUBLE_FIRST_BACKWARD = "fault: evenzero's side counts the first backward twice"


class Mismatch(AssertionError):
    """evenzero and DDP disagree; the message says where."""


def _batch(case: Case, step: int, micro: int, back: int, rank: int, world: int):
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + step * 1009 + micro * 31 + back)
    n = case.per_rank * world
    x = torch.randn(n, case.model.in_width, generator=g)
    y = torch.randn(n, case.model.out_width, generator=g)
    rows = slice(rank * case.per_rank, (rank + 1) * case.per_rank)
    return x[rows], y[rows]


def _backward(net: nn.Module, x, y, skip, scale: float) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns the output (compared instead of
    the loss, whose relative error near a fit says little)."""
    out = net(x, skip=skip)
    (((out.float() - y) ** 2).mean() * scale).backward()
    return out.detach()


def _bf16_allreduce(state, bucket):
    """DDP's bf16_compress_hook, which torch only allows on NCCL: the bucket averaged in
    bf16 and written back in its own dtype."""
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(low, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


class Reference:
    """DDP and a torch optimizer over fp32 masters."""

    def __init__(self, case: Case, net: FuzzNet, bf16_reduce: bool) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.net = net
        self.ddp = DDP(net, find_unused_parameters=case.find_unused or needs_find_unused(case),
                       bucket_cap_mb=case.ddp_bucket_mb)
        if bf16_reduce:
            self.ddp.register_comm_hook(None, _bf16_allreduce)
        self.named = dict(net.named_parameters())
        self.masters = {n: p if p.dtype == torch.float32 else
                        p.detach().float().clone().requires_grad_(p.requires_grad)
                        for n, p in self.named.items()}
        self.case = case

    def build_optimizer(self, impl: str | None) -> None:
        """The torch optimizer over the masters, in the implementation evenzero's inner
        optimizer runs (fused and single-tensor Adam differ in the last bits)."""
        cls, kw = OPTIMIZERS[self.case.optimizer]
        how = {None: {}, "single_tensor": {"foreach": False}, "foreach": {"foreach": True},
               "fused": {"fused": True}}[impl]
        if impl == "fused" and self.case.optimizer == "sgd_momentum":
            # torch 2.13's fused SGD raises TypeError once one parameter has a momentum
            # buffer and another gets its first gradient (sgd.py `_fused_sgd`: all or none);
            # evenzero's flat shards do not meet it. foreach SGD computes the same values.
            how = {"foreach": True}
        self.opt = cls(list(self.masters.values()), lr=self.case.lr,
                       weight_decay=self.case.weight_decay, **kw, **how)

    def masters_with_grads(self) -> list[torch.Tensor]:
        for n, p in self.named.items():
            m = self.masters[n]
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        return [m for m in self.masters.values() if m.grad is not None]

    def step(self) -> None:
        self.masters_with_grads()
        self.opt.step()
        with torch.no_grad():
            for n, p in self.named.items():
                if self.masters[n] is not p:
                    p.copy_(self.masters[n])

    def zero_grad(self, set_to_none: bool) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        self.net.zero_grad(set_to_none=set_to_none)

    def written(self, params: list[nn.Parameter]) -> None:
        """A `p.data` write reaches the master as the rounded value the parameter holds."""
        ids = {id(p) for p in params}
        with torch.no_grad():
            for n, p in self.named.items():
                if id(p) in ids and self.masters[n] is not p:
                    self.masters[n].copy_(p.float())

    def state(self) -> dict[str, dict[str, Any]]:
        by_id = {id(m): n for n, m in self.masters.items()}
        return {by_id[id(m)]: s for m, s in self.opt.state.items() if s}


class Evenzero:
    """The evenzero side: the model and its ZeroOptimizer (rebuilt by reloads)."""

    def __init__(self, case: Case, net: FuzzNet, expert_groups, overrides=None,
                 process_group=None) -> None:
        self.case, self.net, self.expert_groups = case, net, expert_groups
        self.process_group = process_group
        self.overrides = dict(overrides or {})
        """The config changes of the last checkpoint reshard: a later state_dict round
        trip rebuilds the optimizer as it is now."""
        self.opt = self._build(self.overrides)

    def _build(self, overrides: dict[str, Any]):
        from evenzero import ZeroOptimizer
        from evenzero.moe import MoE

        cls, kw = OPTIMIZERS[self.case.optimizer]
        engine = {**self.case.engine.kwargs(), **overrides}
        engine["reduce_dtype"] = DTYPES[engine["reduce_dtype"]]
        # A parameter frozen when the optimizer is built gets no shard (evenzero says so if
        # it is unfrozen later): rebuild with every parameter trainable, as its error advises.
        params = list(self.net.parameters())
        frozen = [p for p in params if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)
        # evenzero refuses one group of mixed dtypes and names the fix: a group per dtype.
        experts = {id(p) for m in self.net.modules() if isinstance(m, MoE) for p in m.experts.parameters()}
        dense = [p for p in params if id(p) not in experts]
        groups, expert_groups = None, self.expert_groups if experts else None
        if len({p.dtype for p in dense}) > 1:
            groups = [{"params": [p for p in dense if p.dtype == d]}
                      for d in (torch.float32, torch.bfloat16)]
            if experts:  # with param_groups, experts are a group with their process group
                (name, edp), = self.expert_groups.items()
                for d in (torch.float32, torch.bfloat16):
                    mine = [p for p in params if id(p) in experts and p.dtype == d]
                    if mine:
                        groups.append({"params": mine, "process_group": edp,
                                       "name": f"{name}-{str(d)[6:]}"})
                expert_groups = None
        try:
            return ZeroOptimizer(self.net, cls, groups, lr=self.case.lr,
                                 weight_decay=self.case.weight_decay,
                                 process_group=self.process_group,
                                 expert_groups=expert_groups, **kw, **engine)
        finally:
            for p in frozen:
                p.requires_grad_(False)

    def reload(self, step: Step, directory: str, solo: Any) -> None:
        """state_dict round trip, or a checkpoint saved at W ranks, loaded at 1 rank (each
        rank alone, compared bitwise) and into a new optimizer with another layout."""
        import evenzero.checkpoint as ckpt

        if step.reload == "state_dict":
            sd = copy.deepcopy(self.opt.state_dict())
            self.opt.close()
            self.opt = self._build(self.overrides)
            self.opt.load_state_dict(sd)
            return None
        ckpt.save(self.opt, directory)
        problem = self._load_alone(directory, solo) if solo is not None else None
        self.opt.close()
        self.overrides = dict(step.reshard)
        self.opt = self._build(self.overrides)
        ckpt.load(self.opt, directory)
        return problem

    def _load_alone(self, directory: str, solo: Any) -> str | None:
        """Load the W-rank checkpoint on this rank's own one-rank group and compare the
        consolidated masters and optimizer state with the running optimizer's, bitwise."""
        import evenzero.checkpoint as ckpt
        from evenzero.checkpoint import consolidated_state_dict
        from evenzero.moe import ExpertGroups

        _, want_state, want_masters = consolidated_state_dict(self.opt)
        experts = solo_experts = None
        if self.expert_groups:
            (name, _), = self.expert_groups.items()
            solo_experts = ExpertGroups(solo, solo, 0, 0, 1)
            experts = {name: solo}
        torch.manual_seed(self.case.seed + 1)  # other weights: a load that does nothing shows
        net = FuzzNet(self.case.model, solo_experts)
        for p, q in zip(net.parameters(), self.net.parameters(), strict=True):
            p.requires_grad_(q.requires_grad)
        alone = Evenzero(self.case, net, experts, process_group=solo)
        try:
            ckpt.load(alone.opt, directory)
            _, state, masters = consolidated_state_dict(alone.opt)
        finally:
            alone.opt.close()
        for n, m in want_masters.items():
            if not torch.equal(masters.get(n, torch.empty(0)), m):
                return f"master {n} differs after loading the {dist.get_world_size()}-rank checkpoint on 1 rank"
        for n, st in want_state["state"].items():
            for k, v in st.items():
                w = state["state"].get(n, {}).get(k)
                same = (torch.equal(torch.as_tensor(w), torch.as_tensor(v)) if w is not None
                        else v is None)
                if not same:
                    return (f"optimizer state {n}.{k} differs after loading the "
                            f"{dist.get_world_size()}-rank checkpoint on 1 rank")
        return None


# ------------------------------------------------------------------------------ compare


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf, 0.0
    if a.numel() == 0:
        return 0.0, 0.0
    scale = max(float(a.abs().max()), float(b.abs().max()))
    return float((a - b).abs().max()), scale


class Tolerance:
    """How far evenzero may be from the reference, judged over all parameters of one kind
    together (the flat vector of parameters, of masters, of each optimizer state): fp32
    within `FP32_RTOL` of the vector's largest magnitude; bf16 within `BF16_FACTOR` times
    how far the fp32 twin is from the bf16 DDP, with a floor of a few bf16 roundings.

    Disagreements are recorded, not raised, so that every rank reaches the same collective
    (`settle`); the first one is the case's verdict."""

    def __init__(self, precision: str) -> None:
        self.precision = precision
        self.first: str | None = None
        self.worst: dict[str, float] = {}
        """Per kind ("output", "master", ...): the largest diff / allowed seen (< 1 passes)."""

    def fail(self, message: str) -> None:
        if self.first is None:
            self.first = message

    def check(self, what: str, items: list[tuple[str, Any, Any, Any]], slack: float = 0.0) -> None:
        """`items`: (name, evenzero's tensor, DDP's, the fp32 twin's or None). `slack`: an
        absolute allowance on top (Adam's weights, see `adam_slack`)."""
        diffs = [(_diff(g, w)[0], n, w) for n, g, w, _ in items]
        if any(math.isinf(d) for d, _, _ in diffs):
            bad = next(n for d, n, _ in diffs if math.isinf(d))
            return self.fail(f"{what} {bad}: shapes differ")
        scale = max((_diff(g, w)[1] for _, g, w, _ in items), default=0.0)
        allowed = FP32_RTOL
        if self.precision == "bf16" and all(t is not None for *_, t in items):
            own = max((_diff(t, w)[0] for _, _, w, t in items), default=0.0)
            allowed = max(BF16_FLOOR, BF16_FACTOR * own / scale if scale else 0.0)
            # As close to the fp32 DDP as the bf16 DDP is passes too (a bf16 model with
            # reduce_dtype=fp32 is more exact than DDP's bf16 all-reduce).
            diffs = [(min(d, _diff(g, t)[0]), n, w)
                     for (d, n, w), (_, g, _, t) in zip(diffs, items, strict=True)]
        diff, name, want = max(diffs, key=lambda x: x[0], default=(0.0, "", None))
        if what.endswith(":"):  # a per-backward output or the step's norm: O(1) values
            scale = max(scale, 1.0)
            if self.precision == "bf16" and name == "output":
                allowed = max(allowed, BF16_OUTPUT_FLOOR)
        kind = name if what.endswith(":") else what.split(": ")[-1]
        bound = allowed * scale + slack
        ratio = diff / bound if bound else (math.inf if diff else 0.0)
        self.worst[kind] = max(self.worst.get(kind, 0.0), ratio)
        if diff > allowed * scale + slack:
            self.fail(f"{what} {name}: max |evenzero - ddp| = {diff:.3g} > {allowed:.2g} x "
                      f"{scale:.3g} (the largest magnitude of any {what}; shape "
                      f"{tuple(want.shape)})")

    def settle(self, world: int) -> None:
        """Every rank learns every rank's first disagreement; raises Mismatch on all."""
        firsts: list[Any] = [None] * world
        dist.all_gather_object(firsts, self.first)
        bad = [(r, m) for r, m in enumerate(firsts) if m is not None]
        if bad:
            r, m = bad[0]
            raise Mismatch(f"{m} (rank {r}{', and others' if len(bad) > 1 else ''})")


ADAM_SLACK = 1e-3


def adam_slack(case: Case, step: int) -> float:
    """Adam's update g / (sqrt(v) + eps) turns a last-bit difference of a gradient near
    eps (a sum that cancels across ranks, added in another order) into up to ~1e-4 of
    the learning rate per step (measured: seeds 651, 812): on Adam's weights 1e-3 of lr
    per step is allowed on top of 1e-6 relative. A lost, doubled or stale gradient moves a weight by a
    sizeable part of lr and still fails."""
    if case.optimizer not in ("adam", "adamw"):
        return 0.0
    # In bf16 a gradient near zero can change sign between bf16 and fp32 accumulation, and
    # Adam's first steps are +-lr whatever the magnitude (seed 960: gradient norms within
    # 0.1 of their allowance, `exp_avg` within 0.6, one weight 2 lr apart). The optimizer
    # state, linear in the gradients, is what catches a wrong gradient there.
    per_step = 2.0 if case.precision == "bf16" else ADAM_SLACK
    return per_step * case.lr * (step + 1)


def _compare_state(tol: Tolerance, step: int, ez: Evenzero, refs: list[Reference]) -> None:
    from evenzero.checkpoint import consolidated_state_dict

    ref, twin = refs[0], refs[1] if len(refs) > 1 else None
    slack = adam_slack(ez.case, step)
    tol.check(f"step {step}: parameter", [
        (n, p, ref.named[n], twin and twin.named[n]) for n, p in ez.net.named_parameters()], slack)
    _, optim, masters = consolidated_state_dict(ez.opt)
    tol.check(f"step {step}: master", [
        (n, m, ref.masters[n], twin and twin.masters[n]) for n, m in masters.items()], slack)
    # An empty parameter has nothing to step; torch keeps a step count for it, evenzero
    # does not manage it at all.
    empty = {n for n, p in ref.named.items() if p.numel() == 0}
    want = {n: s for n, s in ref.state().items() if n not in empty}
    twin_state = twin.state() if twin else {}
    got = {n: s for n, s in optim["state"].items() if s}
    if set(got) != set(want):
        return tol.fail(f"step {step}: optimizer state held for {sorted(got)}, DDP's "
                        f"optimizer for {sorted(want)}")
    kinds: dict[str, list] = {}
    for n, s in want.items():
        for k, v in s.items():
            g = got[n].get(k)
            if v is None:
                continue
            if g is None:
                return tol.fail(f"step {step}: optimizer state {n}.{k} missing")
            if k == "step":
                if float(g) != float(v):
                    return tol.fail(f"step {step}: {n}.step {float(g)} != {float(v)}")
            else:
                kinds.setdefault(k, []).append((n, g, v, twin_state.get(n, {}).get(k)))
    for k, items in kinds.items():
        tol.check(f"step {step}: optimizer state {k}", items)


# --------------------------------------------------------------------------------- run


def _set_frozen(nets: list[FuzzNet], case: Case, frozen: tuple[int, ...]) -> None:
    for net in nets:
        for i in range(len(case.model.blocks)):
            for p in block_params(net, i):
                p.requires_grad_(i not in frozen)


def _write(net: FuzzNet, blocks: tuple[int, ...], step: int) -> list[nn.Parameter]:
    params = [p for i in blocks for p in block_params(net, i)]
    with torch.no_grad():
        for p in params:
            p.data.mul_(0.5).add_(0.01 * (step + 1))
    return params


def _pair(values: list) -> tuple[Any, Any]:
    """(DDP's value, the fp32 twin's or None)."""
    return values[0], values[1] if len(values) > 1 else None


def train(case: Case, rank: int, world: int, expert_groups, workdir: str,
          tol: Tolerance | None = None, solo: Any = None) -> None:
    """Train the case under DDP and evenzero side by side; raises Mismatch."""
    torch.manual_seed(case.seed)
    bf16_reduce = case.engine.reduce_dtype == "bf16"
    ref = Reference(case, FuzzNet(case.model), bf16_reduce)
    refs = [ref]
    if case.precision == "bf16":
        # A second DDP, all fp32 from the same (rounded) weights, measures how far bf16
        # takes DDP itself; evenzero may be that far from the bf16 DDP, times a factor.
        twin = FuzzNet(dataclasses.replace(case.model, dtype="fp32"))
        twin.load_state_dict({k: v.float() for k, v in ref.net.state_dict().items()})
        refs.append(Reference(case, twin, False))
    torch.manual_seed(case.seed)
    ez = Evenzero(case, FuzzNet(case.model, expert_groups), expert_groups and
                  {expert_groups.group_name: expert_groups.edp_group})
    for r in refs:
        r.build_optimizer(ez.opt.config.optimizer_impl)
    tol = tol or Tolerance(case.precision)
    # A top-1 router turns a one-ulp bf16 weight difference into another expert for a
    # token: bf16 MoE outputs are compared through the weights and state only.
    routed_bf16 = case.precision == "bf16" and any(b.kind == "moe" for b in case.model.blocks)
    nets = [r.net for r in refs] + [ez.net]
    for s, st in enumerate(case.steps):
        if st.reload:
            problem = ez.reload(st, os.path.join(workdir, f"s{s}"), solo)
            if problem:
                tol.fail(f"step {s}: {problem}")
            for r in refs:
                r.opt.load_state_dict(copy.deepcopy(r.opt.state_dict()))
        if st.write or st.freeze:
            ez.opt.wait_for_params()  # documented: direct reads and writes wait for the step
        _set_frozen(nets, case, st.freeze)
        if st.write:
            for r in refs:
                r.written(_write(r.net, st.write, s))
            _write(ez.net, st.write, s)
        scale = 1.0 / (len(st.micro) * len(st.micro[0]))
        for m, backs in enumerate(st.micro):
            quiet = st.no_sync and m < len(st.micro) - 1
            for k, b in enumerate(backs):
                x, y = _batch(case, s, m, k, rank, world)
                skip = frozenset(set(b.skip) | {i for i in b.skip_one_rank
                                                 if (i + s) % world == rank})
                want = []
                for r in refs:
                    with r.ddp.no_sync() if quiet else nullcontext():
                        want.append(_backward(r.ddp, x, y, skip, scale))
                # A planted bug (tests/test_fuzz.py shows the fuzzer catches it): evenzero's
                # side counts the step's first backward twice.
                doubled = FAULT_DOUBLE_FIRST_BACKWARD in case.notes and m == k == 0
                with ez.opt.no_sync() if quiet else nullcontext():
                    got = _backward(ez.net, x, y, skip, scale * (2 if doubled else 1))
                if not routed_bf16:
                    tol.check(f"step {s} micro {m} backward {k}:", [("output", got, *_pair(want))])
        norm_of = st.clip if st.clip is not None else (math.inf if st.measure_norm else None)
        if norm_of is not None:
            want = [torch.nn.utils.clip_grad_norm_(r.masters_with_grads(), norm_of) for r in refs]
            got = ez.opt.clip_grad_norm_(norm_of)
            tol.check(f"step {s}:", [("gradient norm", got, *_pair(want))])
        for r in refs:
            r.step()
        ez.opt.step()
        if not case.engine.overlap_param_gather:
            _compare_state(tol, s, ez, refs)
        tol.settle(world)
        for r in refs:
            r.zero_grad(st.set_to_none)
        ez.opt.zero_grad(set_to_none=st.set_to_none)
    ez.opt.wait_for_params()
    _compare_state(tol, len(case.steps) - 1, ez, refs)
    tol.settle(world)
    ez.opt.close()


def run_case(case: Case, rank: int, world: int, expert_groups, workdir: str,
             solo: Any = None) -> dict[str, Any]:
    """One case on this rank: {"status": "ok" | "mismatch" | "error", "detail": str}.
    `solo`: this rank's own one-rank process group (checkpoints are also loaded there)."""
    tol = Tolerance(case.precision)
    try:
        train(case, rank, world, expert_groups, workdir, tol, solo)
        return {"status": "ok", "detail": "", "worst": tol.worst}
    except Mismatch as e:
        return {"status": "mismatch", "detail": str(e), "worst": tol.worst}
    except Exception as e:  # noqa: BLE001 - a refusal or a crash, reported with its type
        tb = traceback.format_exc(limit=-8)
        return {"status": "error", "detail": f"{type(e).__name__}: {e}", "traceback": tb}


def agree(result: dict[str, Any], world: int) -> dict[str, Any]:
    """Every rank's result for the case, merged: the worst status, with each rank's detail."""
    results: list[Any] = [None] * world
    dist.all_gather_object(results, result)
    order = {"ok": 0, "mismatch": 1, "error": 2}
    worst = max(results, key=lambda r: order[r["status"]])
    merged = dict(worst)
    merged["ranks"] = [r["status"] for r in results]
    closest: dict[str, float] = {}
    for r in results:
        for k, v in r.get("worst", {}).items():
            closest[k] = max(closest.get(k, 0.0), v)
    merged["worst"] = closest
    if worst["status"] == "error" and any(r["status"] != "error" for r in results):
        merged["detail"] = "raised on some ranks only: " + worst["detail"]
    return merged

"""A fuzz case: a model, a training schedule and an evenzero configuration, drawn from a seed.

Everything is plain data (ints, floats, strings, tuples) so that a case prints as a Python
literal, round-trips through `to_dict`/`from_dict`, and shrinks by rebuilding dataclasses
with fewer parts (`shrink.py`). The same seed always draws the same case.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

# Block kinds. "linear" and "conv" change nothing about the width unless drawn to;
# "scale" has a 1-D parameter, "conv" a 3-D one, "zero" a zero-size one; "shared" runs an
# earlier square linear block again (a reused submodule); "moe" is evenzero.moe.MoE.
KINDS = ("linear", "conv", "scale", "zero", "shared", "moe")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
MAX_PARAMS = 100_000


@dataclass(frozen=True)
class Block:
    kind: str
    width: int
    """Output width (the input width is the previous block's output)."""
    bias: bool = True
    skippable: bool = False
    """A square block run as x + f(x): a micro-batch may leave it out (unused parameters)."""
    shares: int = -1
    """For "shared": the index of the block it runs again."""
    experts: int = 0
    fp32: bool = False
    """In a "mixed" model: this block keeps fp32 parameters while the rest is bf16."""


@dataclass(frozen=True)
class ModelDraw:
    in_width: int
    blocks: tuple[Block, ...]
    out_width: int
    dtype: str = "fp32"
    """"fp32", "bf16", or "mixed" (bf16 with some fp32 blocks)."""


@dataclass(frozen=True)
class Backward:
    """One forward and backward of a micro-batch."""

    skip: tuple[int, ...] = ()
    """Skippable blocks this backward leaves out on every rank."""
    skip_one_rank: tuple[int, ...] = ()
    """Skippable blocks left out on one rank only (rank = (block + step) % world)."""


@dataclass(frozen=True)
class Step:
    micro: tuple[tuple[Backward, ...], ...]
    """Micro-batches, each one or more backwards; all but the last micro-batch run under
    no_sync() when `no_sync` is set, else every backward synchronises (plain accumulation)."""
    no_sync: bool = False
    clip: float | None = None
    measure_norm: bool = False
    """Without clipping: read the gradient norm with clip_grad_norm_(inf) to compare it."""
    set_to_none: bool = True
    freeze: tuple[int, ...] = ()
    """Blocks whose parameters are frozen (requires_grad=False) before this step; the rest
    are trainable (so a block frozen in one step and not in the next is unfrozen)."""
    write: tuple[int, ...] = ()
    """Blocks whose parameters get a `p.data` write before this step."""
    reload: str = ""
    """Before this step: "" nothing, "state_dict" a state_dict() round trip into a new
    optimizer, "checkpoint" a checkpoint save, loaded by each rank alone on a one-rank group
    (W -> 1 reshard, compared bitwise) and into a new optimizer with `reshard`."""
    reshard: tuple[tuple[str, Any], ...] = ()
    """For "checkpoint": the config fields the new optimizer changes (stage, bucket_numel)."""


@dataclass(frozen=True)
class EngineDraw:
    stage: int = 2
    bucket_numel: int | str = "auto"
    reduce_dtype: str | None = None
    optimizer_impl: str | None = None
    overlap_param_gather: bool = False
    allow_partial_grads: bool = False

    def kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class Case:
    seed: int
    model: ModelDraw
    steps: tuple[Step, ...]
    engine: EngineDraw
    optimizer: str = "sgd"
    lr: float = 0.05
    weight_decay: float = 0.0
    per_rank: int = 3
    ddp_bucket_mb: float = 25.0
    find_unused: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def precision(self) -> str:
        """"fp32" when every gradient is summed in fp32, else "bf16"."""
        low = self.model.dtype != "fp32" or self.engine.reduce_dtype == "bf16"
        return "bf16" if low else "fp32"


def needs_find_unused(case: Case) -> bool:
    """Whether DDP needs find_unused_parameters=True for this case (a block left out or
    frozen): without it DDP never finishes that bucket and its reference is wrong."""
    return any(s.freeze or any(b.skip or b.skip_one_rank for mb in s.micro for b in mb)
               for s in case.steps)


# ------------------------------------------------------------------------ serialisation


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(x) for x in obj]
    return obj


def _tup(x: Any) -> Any:
    return tuple(_tup(v) for v in x) if isinstance(x, list) else x


def from_dict(d: dict[str, Any]) -> Case:
    m = d["model"]
    model = ModelDraw(m["in_width"], tuple(Block(**b) for b in m["blocks"]), m["out_width"],
                      m["dtype"])
    steps = tuple(Step(**{**s, "micro": tuple(tuple(Backward(**{k: tuple(v) for k, v in b.items()})
                                                    for b in mb) for mb in s["micro"]),
                         "freeze": tuple(s["freeze"]), "write": tuple(s["write"]),
                         "reshard": tuple(tuple(kv) for kv in s["reshard"])})
                  for s in d["steps"])
    rest = {k: _tup(v) for k, v in d.items() if k not in ("model", "steps", "engine")}
    return Case(model=model, steps=steps, engine=EngineDraw(**d["engine"]), **rest)


# ------------------------------------------------------------------------------ drawing


def param_count(model: ModelDraw) -> int:
    total, width = 0, model.in_width
    for b in model.blocks:
        if b.kind == "linear":
            total += width * b.width + (b.width if b.bias else 0)
        elif b.kind == "conv":
            total += b.width * 3 + (b.width if b.bias else 0)
        elif b.kind == "scale":
            total += width
        elif b.kind == "moe":
            total += width * b.experts + b.experts * (2 * width * b.width + b.width + width)
        width = out_width(b, width)
    return total + width * model.out_width + model.out_width


def out_width(b: Block, width: int) -> int:
    """The width after block `b` (only "linear" changes it)."""
    return b.width if b.kind == "linear" else width


def _draw_width(rng: random.Random, big: bool) -> int:
    return rng.choice((1, 2, 3, 5, 8, 13)) if not big else rng.choice((16, 32, 64, 100, 128))


def draw_model(rng: random.Random, allow_moe: bool = True) -> ModelDraw:
    big = rng.random() < 0.15  # a few cases reach tens of thousands of elements
    in_width = _draw_width(rng, big)
    blocks: list[Block] = []
    width = in_width
    for _ in range(rng.randint(1, 5)):
        kinds = [k for k in KINDS if allow_moe or k != "moe"]
        if not any(b.kind == "linear" and b.width == width == _in_width(in_width, blocks, j)
                   for j, b in enumerate(blocks)):
            kinds.remove("shared")
        kind = rng.choice(kinds)
        if kind == "linear":
            w = width if rng.random() < 0.5 else _draw_width(rng, big)
            b = Block("linear", w, bias=rng.random() < 0.7, skippable=w == width and rng.random() < 0.5)
        elif kind == "conv":
            b = Block("conv", rng.choice((1, 2, 4)), bias=rng.random() < 0.5,
                      skippable=rng.random() < 0.5)
        elif kind == "scale":
            b = Block("scale", width, skippable=rng.random() < 0.3)
        elif kind == "zero":
            b = Block("zero", 0)
        elif kind == "shared":
            src = rng.choice([j for j, x in enumerate(blocks) if x.kind == "linear" and x.width == width
                              and _in_width(in_width, blocks, j) == width])
            b = Block("shared", width, shares=src, skippable=rng.random() < 0.5)
        else:
            b = Block("moe", rng.choice((2, 4)), experts=rng.choice((1, 2, 3)),
                      skippable=rng.random() < 0.3)
        blocks.append(b)
        width = out_width(b, width)
    dtype = rng.choices(("fp32", "bf16", "mixed"), (0.7, 0.15, 0.15))[0]
    if dtype == "mixed":
        blocks = [dataclasses.replace(b, fp32=rng.random() < 0.5) for b in blocks]
    model = ModelDraw(in_width, tuple(blocks), rng.choice((1, 2, 3, 4)), dtype)
    if param_count(model) > MAX_PARAMS:
        return draw_model(rng, allow_moe)
    return model


def _in_width(in_width: int, blocks: list[Block] | tuple[Block, ...], j: int) -> int:
    width = in_width
    for b in blocks[:j]:
        width = out_width(b, width)
    return width


def _draw_backward(rng: random.Random, skippable: list[int], unused: bool) -> Backward:
    if not unused or not skippable:
        return Backward()
    skip = tuple(i for i in skippable if rng.random() < 0.3)
    one = tuple(i for i in skippable if i not in skip and rng.random() < 0.3)
    return Backward(skip, one)


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    model = draw_model(rng)
    skippable = [i for i, b in enumerate(model.blocks) if b.skippable]
    trainable = [i for i, b in enumerate(model.blocks) if b.kind not in ("zero", "shared")]
    unused = rng.random() < 0.4
    freezing = rng.random() < 0.25
    writes = rng.random() < 0.25
    reloads = rng.random() < 0.25
    steps = []
    for s in range(rng.randint(1, 4)):
        accum = rng.choice((1, 1, 2, 3, 4))
        backs = rng.choice((1, 1, 1, 2, 3))
        micro = tuple(tuple(_draw_backward(rng, skippable, unused) for _ in range(backs))
                      for _ in range(accum))
        clip = rng.choice((None, None, 0.05, 1.0, 100.0))
        reload, reshard = "", ()
        if reloads and s > 0 and rng.random() < 0.5:
            reload = rng.choice(("state_dict", "checkpoint"))
            if reload == "checkpoint":
                reshard = (("stage", rng.choice((1, 2))),
                           ("bucket_numel", rng.choice((7, 64, 10**7))))
        steps.append(Step(
            micro=micro, no_sync=accum > 1 and rng.random() < 0.6, clip=clip,
            measure_norm=clip is None and rng.random() < 0.5, set_to_none=rng.random() < 0.7,
            freeze=tuple(i for i in trainable if freezing and s > 0 and rng.random() < 0.3),
            write=tuple(i for i in trainable if writes and s > 0 and rng.random() < 0.3),
            reload=reload, reshard=reshard))
    impl = rng.choice((None, None, "single_tensor", "foreach", "fused"))
    optimizer = rng.choice(OPTIMIZERS)
    one_rank = any(b.skip_one_rank for st in steps for mb in st.micro for b in mb)
    engine = EngineDraw(
        stage=rng.choice((1, 2)),
        bucket_numel=rng.choice((1, 3, 16, 100, 1000, 10**7, "auto")),
        reduce_dtype=rng.choices((None, "fp32", "bf16"), (0.7, 0.15, 0.15))[0],
        optimizer_impl=impl,
        overlap_param_gather=rng.random() < 0.3,
        allow_partial_grads=one_rank or rng.random() < 0.2,
    )
    needs_unused = unused or freezing or any(b.kind == "moe" for b in model.blocks)
    return Case(
        seed=seed, model=model, steps=tuple(steps), engine=engine, optimizer=optimizer,
        lr=rng.choice((0.01, 0.05)) if optimizer.startswith("sgd") else rng.choice((1e-3, 1e-2)),
        weight_decay=rng.choice((0.0, 0.0, 0.01)), per_rank=rng.choice((1, 2, 3, 5)),
        ddp_bucket_mb=rng.choice((0.0001, 0.01, 25.0)),
        find_unused=needs_unused or rng.random() < 0.2)


def features(case: Case) -> list[str]:
    """Names of the habits a case exercises, for coverage counts."""
    f = {f"stage{case.engine.stage}", f"opt:{case.optimizer}", f"dtype:{case.model.dtype}",
         f"bucket:{'auto' if case.engine.bucket_numel == 'auto' else 'tiny' if int(case.engine.bucket_numel) < 20 else 'mid' if int(case.engine.bucket_numel) < 10**6 else 'one'}"}
    f.update(f"block:{b.kind}" for b in case.model.blocks)
    if case.engine.reduce_dtype:
        f.add(f"reduce_dtype:{case.engine.reduce_dtype}")
    if case.engine.optimizer_impl:
        f.add(f"impl:{case.engine.optimizer_impl}")
    if case.engine.overlap_param_gather:
        f.add("overlap_param_gather")
    if any(b.kind in ("linear", "scale", "conv") for b in case.model.blocks):
        f.add("params:1d" if any(b.kind == "scale" for b in case.model.blocks) else "params:2d")
    if any(b.kind == "conv" for b in case.model.blocks):
        f.add("params:3d")
    n = param_count(case.model)
    f.add("size:>=10k" if n >= 10_000 else "size:<10k")
    for s in case.steps:
        if len(s.micro) > 1:
            f.add("accum:no_sync" if s.no_sync else "accum:plain")
        if any(len(mb) > 1 for mb in s.micro):
            f.add("backwards>1")
        if any(b.skip for mb in s.micro for b in mb):
            f.add("unused:all_ranks")
        if any(b.skip_one_rank for mb in s.micro for b in mb):
            f.add("unused:one_rank")
        if s.clip is not None:
            f.add("clip")
        if not s.set_to_none:
            f.add("zero_grad:keep")
        if s.freeze:
            f.add("freeze")
        if s.write:
            f.add("p.data_write")
        if s.reload:
            f.add(f"reload:{s.reload}")
    if any(set(a.freeze) - set(b.freeze) for a, b in zip(case.steps, case.steps[1:], strict=False)):
        f.add("unfreeze")
    return sorted(f)


def coverage_sample(seeds: range, n: int) -> list[Case]:
    """`n` cases from `seeds` chosen greedily to cover the most features, smaller models and
    fewer backwards first among equals: a short fixed sample that still touches every habit."""
    pool = [draw_case(s) for s in seeds]
    covered: set[str] = set()
    chosen: list[Case] = []

    def cost(c: Case) -> int:
        return param_count(c.model) // 2000 + sum(len(mb) for s in c.steps for mb in s.micro)

    for _ in range(n):
        best = max(pool, key=lambda c: (len(set(features(c)) - covered), -cost(c)))
        chosen.append(best)
        covered |= set(features(best))
        pool.remove(best)
    return chosen

"""Shrink a failing case to a small one that fails the same way, and print it as a script.

`shrink(case, fails)` tries, round after round, every one-step simplification of the case
(drop a step, a micro-batch, a backward, a block; turn one feature off; make the engine
and the model plainer) and keeps the first that still fails. `first_failing` runs a list
of candidates on one spawn of the ranks and stops at the first that fails. The seed stays: it fixes the
weights and the data of whatever model remains.
"""

from __future__ import annotations

import dataclasses
import pprint
from collections.abc import Callable, Iterator, Sequence

from .case import Backward, Block, Case, EngineDraw, ModelDraw, Step, out_width, to_dict


def _valid(model: ModelDraw) -> bool:
    width = model.in_width
    for i, b in enumerate(model.blocks):
        if b.kind == "shared":
            src = model.blocks[b.shares] if 0 <= b.shares < i else None
            if src is None or src.kind != "linear" or src.width != width:
                return False
        if b.skippable and out_width(b, width) != width:
            return False
        width = out_width(b, width)
    for b in model.blocks:  # a shared block's source must be square
        if b.kind == "shared" and _in_width(model, b.shares) != model.blocks[b.shares].width:
            return False
    return True


def _in_width(model: ModelDraw, j: int) -> int:
    width = model.in_width
    for b in model.blocks[:j]:
        width = out_width(b, width)
    return width


def _drop_block(case: Case, i: int) -> Case | None:
    def remap(idx: Sequence[int]) -> tuple[int, ...]:
        return tuple(j - (j > i) for j in idx if j != i)

    blocks = [dataclasses.replace(b, shares=b.shares - (b.shares > i)) if b.kind == "shared" else b
              for j, b in enumerate(case.model.blocks) if j != i]
    if any(b.kind == "shared" and b.shares == i for b in case.model.blocks):
        return None
    model = dataclasses.replace(case.model, blocks=tuple(blocks))
    if not _valid(model):
        return None
    steps = tuple(dataclasses.replace(
        s, freeze=remap(s.freeze), write=remap(s.write),
        micro=tuple(tuple(Backward(remap(b.skip), remap(b.skip_one_rank)) for b in mb)
                    for mb in s.micro)) for s in case.steps)
    return dataclasses.replace(case, model=model, steps=steps)


def _with_step(case: Case, s: int, step: Step | None) -> Case:
    steps = list(case.steps)
    if step is None:
        del steps[s]
    else:
        steps[s] = step
    return dataclasses.replace(case, steps=tuple(steps))


def candidates(case: Case) -> Iterator[Case]:
    """Every one-step simplification of `case`, biggest first."""
    n = len(case.steps)
    if n > 1:
        yield dataclasses.replace(case, steps=case.steps[: n // 2])
        for s in range(n):
            yield _with_step(case, s, None)
    for i in reversed(range(len(case.model.blocks))):
        smaller = _drop_block(case, i)
        if smaller is not None:
            yield smaller
    for s, st in enumerate(case.steps):
        if len(st.micro) > 1:
            for m in range(len(st.micro)):
                yield _with_step(case, s, dataclasses.replace(
                    st, micro=st.micro[:m] + st.micro[m + 1:]))
        if len(st.micro[0]) > 1:
            yield _with_step(case, s, dataclasses.replace(st, micro=tuple(mb[:-1] for mb in st.micro)))
        plainer = {"clip": None, "measure_norm": False, "set_to_none": True, "freeze": (),
                   "write": (), "reload": "", "reshard": (), "no_sync": False}
        for k, v in plainer.items():
            if getattr(st, k) != v:
                extra = {"reshard": ()} if k == "reload" else {}
                yield _with_step(case, s, dataclasses.replace(st, **{k: v}, **extra))
        if any(b != Backward() for mb in st.micro for b in mb):
            yield _with_step(case, s, dataclasses.replace(
                st, micro=tuple(tuple(Backward() for _ in mb) for mb in st.micro)))
    plain = EngineDraw()
    for f in dataclasses.fields(EngineDraw):
        if getattr(case.engine, f.name) != getattr(plain, f.name):
            yield dataclasses.replace(case, engine=dataclasses.replace(
                case.engine, **{f.name: getattr(plain, f.name)}))
    if case.model.dtype != "fp32":
        yield dataclasses.replace(case, model=dataclasses.replace(
            case.model, dtype="fp32", blocks=tuple(dataclasses.replace(b, fp32=False)
                                                   for b in case.model.blocks)))
    for i, b in enumerate(case.model.blocks):
        for simpler in _simpler_blocks(b):
            blocks = case.model.blocks[:i] + (simpler,) + case.model.blocks[i + 1:]
            model = dataclasses.replace(case.model, blocks=blocks)
            if _valid(model):
                yield dataclasses.replace(case, model=model)
    for f, v in (("optimizer", "sgd"), ("per_rank", 1), ("weight_decay", 0.0),
                 ("find_unused", False), ("ddp_bucket_mb", 25.0)):
        if getattr(case, f) != v:
            yield dataclasses.replace(case, **{f: v})
    if case.model.out_width > 1:
        yield dataclasses.replace(case, model=dataclasses.replace(case.model, out_width=1))


def _simpler_blocks(b: Block) -> Iterator[Block]:
    if b.skippable:
        yield dataclasses.replace(b, skippable=False)
    if b.kind == "moe" and b.experts > 1:
        yield dataclasses.replace(b, experts=1)
    if b.bias and b.kind in ("linear", "conv"):
        yield dataclasses.replace(b, bias=False)
    if b.kind in ("conv", "moe") and b.width > 1:
        yield dataclasses.replace(b, width=1)


def shrink(case: Case, first_failing: Callable[[list[Case]], int | None], max_rounds: int = 60,
           per_round: int = 40, log: Callable[[str], None] = lambda _: None) -> Case:
    """The smallest case reached by single simplifications that all still fail."""
    for r in range(max_rounds):
        tries = []
        for c in candidates(case):
            if c != case and c not in tries:
                tries.append(c)
            if len(tries) == per_round:
                break
        if not tries:
            break
        found = first_failing(tries)
        if found is None:
            break
        smaller = tries[found]
        log(f"round {r}: {size(case)} -> {size(smaller)}")
        case = smaller
    return case


def size(case: Case) -> int:
    """A rough measure of how much a case does (what shrinking lowers)."""
    backs = sum(len(mb) for s in case.steps for mb in s.micro)
    feats = sum(bool(s.clip) + (not s.set_to_none) + bool(s.freeze) + bool(s.write) + bool(s.reload)
                + s.no_sync + s.measure_norm for s in case.steps)
    return len(case.steps) * 10 + backs + 3 * len(case.model.blocks) + feats


def script(case: Case, world: int, detail: str) -> str:
    """A runnable reproduction: `python repro.py` from the repository root."""
    literal = pprint.pformat(to_dict(case), width=96, sort_dicts=False)
    return f'''"""evenzero vs DDP at {world} ranks, found by the differential fuzzer (tests/fuzz).

{detail}

Run from the repository root: python THIS_FILE.py
"""
import sys

sys.path[:0] = ["src", "tests"]

from fuzz.case import from_dict  # noqa: E402
from fuzz.pool import run_cases  # noqa: E402

CASE = {literal}

if __name__ == "__main__":
    result = run_cases([from_dict(CASE)], world={world})[0]
    print(result["status"], result["detail"])
    sys.exit(result["status"] != "ok")
'''

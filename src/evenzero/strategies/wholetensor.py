"""Matrix-aligned equal shards: layouts for optimizers that update whole tensors (Muon).

Muon (torch/optim/_muon.py@v2.13.0) orthogonalises each 2-D parameter's momentum with a
Newton-Schulz iteration, which needs the whole matrix. evenzero's default layout cuts a
bucket at equal element counts, so a matrix may straddle two ranks' shards; DeepSpeed
0.19.8 then all-reduces the straddling matrices and runs the iteration on each rank
holding a piece (runtime/zero/stage_1_and_2.py@v0.19.8, `use_muon` in
`get_flat_partition`). Here the planner instead places every whole-tensor parameter of a
bucket inside one rank's equal slice of it:

* the matrices go to the ranks' slices by greedy longest-processing-time on their
  Newton-Schulz cost (`newton_schulz_flops`), heaviest first, each to the rank with the
  least work so far (ties: fewer elements, then the lower rank);
* the element-wise parameters of the same bucket fill the room the matrices leave
  (first fit, in arrival order), and may sit anywhere, since their update is per element;
* every slice is padded to the bucket's equal size, so the bucket is still one equal
  reduce-scatter, and each owner ends the backward holding complete, reduced matrices.

A bucket's slice is never smaller than its largest matrix: the bucket size the options
ask for grows to `group size x largest matrix` where it is smaller (and `Plan.notes`
says so), so a matrix never needs two ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from evenzero.plan import Slot, align_up
from evenzero.spec import GroupSpec, ModelSpec

DEFAULT_NS_STEPS = 5
"""torch.optim.Muon's Newton-Schulz iterations per step (torch/optim/_muon.py@v2.13.0)."""


def newton_schulz_flops(shape: Sequence[int], steps: int = DEFAULT_NS_STEPS) -> int:
    """FLOPs of one Muon update of a matrix of `shape`: per iteration, with k = min(m, n)
    and K = max(m, n), X Xᵀ (2k²K), A·A (2k³) and B·X (2k²K)
    (torch/optim/_muon.py@v2.13.0 `_zeropower_via_newtonschulz`)."""
    m, n = shape
    k, big = min(m, n), max(m, n)
    return steps * (4 * k * k * big + 2 * k ** 3)


@dataclass(frozen=True)
class AlignedBucket:
    """One bucket laid out matrix-aligned."""

    numel: int
    """Elements of the bucket, padding included (group size x slice)."""
    slots: tuple[Slot, ...]
    """Its parameters, in offset order."""
    flops: tuple[int, ...]
    """Newton-Schulz FLOPs of each rank's slice."""
    whole_numel: tuple[int, ...]
    """Elements of whole-tensor parameters in each rank's slice."""


def align_bucket(names: Sequence[str], numel: Mapping[str, int],
                 flops: Mapping[str, int], size: int, align: int,
                 carried: Sequence[int] = ()) -> AlignedBucket:
    """Lay out one bucket's `names` (arrival order) over `size` ranks: the parameters in
    `flops` (whole-tensor ones, with their Newton-Schulz cost) each inside one rank's
    slice, the others filling the rest; each slice a multiple of `align` elements.
    `carried`: each rank's work in the group's earlier buckets, which breaks ties so
    that no rank is the favourite of every bucket."""
    carried = list(carried) or [0] * size
    whole = [n for n in names if n in flops]
    rest = [n for n in names if n not in flops]
    order = sorted(range(len(whole)), key=lambda i: (-flops[whole[i]], -numel[whole[i]], i))
    total = sum(numel[n] for n in names)
    biggest = max((numel[n] for n in whole), default=0)
    # The smallest slice (in steps of 1/64 of the largest matrix, bisected) for which
    # longest-processing-time, choosing only among the ranks with room left, places every
    # matrix: padding is what the slices hold beyond the bucket's elements, so a tight
    # slice bounds it.
    step = max(biggest // 64, align)
    low = align_up(max(biggest, -(-total // size), 1), align)

    def attempt(k: int) -> list[list[str]] | None:
        return _lpt(whole, order, numel, flops, size, low + k * step, carried)

    placed = attempt(0)
    if placed is None:
        lo, hi = 0, 64
        placed = attempt(hi)
        while placed is None:  # a slice of every matrix together always fits
            lo, hi = hi, hi * 2
            placed = attempt(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = attempt(mid)
            if found is None:
                lo = mid
            else:
                hi, placed = mid, found
    work = [sum(flops[n] for n in ns) for ns in placed]
    load = [sum(numel[n] for n in ns) for ns in placed]
    share = align_up(max(max(load), -(-total // size), 1), align)
    while True:
        fill = _first_fit(rest, numel, [share - x for x in load])
        if fill is not None:
            break
        # An element-wise parameter fits no slice's room: widen every slice by what it
        # lacks (the loop ends: each pass widens the largest room).
        worst = max(numel[n] for n in rest)
        share = align_up(share + max(align, worst - (share - min(load))), align)
    slots = []
    for r in range(size):
        off = r * share
        for n in placed[r] + fill[r]:
            slots.append(Slot(n, off, numel[n]))
            off += numel[n]
    return AlignedBucket(share * size, tuple(slots), tuple(work), tuple(load))


def _lpt(whole: Sequence[str], order: Sequence[int], numel: Mapping[str, int],
         flops: Mapping[str, int], size: int, cap: int,
         carried: Sequence[int]) -> list[list[str]] | None:
    """Longest-processing-time: each matrix, heaviest first, to the rank with the least
    Newton-Schulz work (ties: fewer elements, less work in earlier buckets, lower rank)
    among those with `cap` elements of room for it; None if one fits nowhere."""
    work, load = [0] * size, [0] * size
    placed: list[list[str]] = [[] for _ in range(size)]
    for i in order:
        n = whole[i]
        fits = [r for r in range(size) if load[r] + numel[n] <= cap]
        if not fits:
            return None
        r = min(fits, key=lambda r: (work[r], load[r], carried[r], r))
        placed[r].append(n)
        work[r] += flops[n]
        load[r] += numel[n]
    return placed


def _first_fit(names: Sequence[str], numel: Mapping[str, int],
               room: list[int]) -> list[list[str]] | None:
    """Element-wise parameters into the slices' room, first fit; None if one fits none."""
    room = list(room)
    out: list[list[str]] = [[] for _ in room]
    for n in names:
        r = next((r for r, left in enumerate(room) if left >= numel[n]), None)
        if r is None:
            return None
        out[r].append(n)
        room[r] -= numel[n]
    return out


def muon_params(spec: ModelSpec) -> tuple[str, ...]:
    """The parameters torch's recipe gives Muon (torch/optim/_muon.py@v2.13.0 docstring,
    and Keller Jordan's: hidden matrices only): 2-D, not an embedding, not the output
    head; the rest (embeddings, head, norms, biases) get AdamW."""
    return tuple(p.name for p in spec.params
                 if len(p.shape) == 2 and p.numel > 0 and p.layer != "embedding"
                 and not _is_head(p.name))


def muon_split(spec: ModelSpec) -> tuple[ModelSpec, tuple[str, ...]]:
    """`spec` as `ZeroOptimizer(model, torch.optim.Muon, [muon group, AdamW group])` runs
    it, and the parameters Muon steps: each group's `muon_params` stay in it, its other
    parameters move to a group of their own ("<group>-adamw"), since every runtime group
    has one inner optimizer."""
    whole = set(muon_params(spec))
    groups, moved = [], {}
    for g in spec.groups:
        names = [p.name for p in spec.group_params(g.name)]
        if not any(n in whole for n in names):
            groups.append(g)
            continue
        groups.append(g)
        if not all(n in whole for n in names):
            moved[g.name] = f"{g.name}-adamw"
            groups.append(GroupSpec(moved[g.name], g.expert_parallel_size))
    params = [replace(p, group=moved[p.group]) if p.name not in whole and p.group in moved
              else p for p in spec.params]
    return (replace(spec, params=tuple(params), groups=tuple(groups)),
            tuple(p.name for p in spec.params if p.name in whole))


def _is_head(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    return any(part in ("lm_head", "head", "output") for part in leaf[:-1]) or name == "head"


def balance_note(group: str, flops: Sequence[int], padding: int, numel: int) -> str:
    """`Plan.notes`'s line for a group laid out matrix-aligned."""
    busy = list(flops)
    mean = sum(busy) / len(busy) if busy else 0.0
    ratio = max(busy) / mean if mean else 1.0
    pct = 100.0 * padding / numel if numel else 0.0
    return (f"group {group}: matrix-aligned shards (whole-tensor update); padding "
            f"{padding:,} elements ({pct:.2f}% of the group's {numel:,}); Newton-Schulz work "
            f"per rank max/mean {ratio:.3f} (max {max(busy) / 1e9 if busy else 0:.3f} GFLOP "
            f"per step)")


__all__ = ["DEFAULT_NS_STEPS", "AlignedBucket", "align_bucket", "balance_note",
           "muon_params", "muon_split", "newton_schulz_flops"]

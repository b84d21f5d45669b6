"""DeepSpeed's flat ZeRO partitions, put back together per parameter.

For every optimizer group, DeepSpeed concatenates the trainable parameters in
`param_shapes` order (with `param_alignment_paddings` between them), pads the flat
buffer at the tail to a multiple of 2 * dp, and gives rank r the slice [r*P, (r+1)*P)
(deepspeed/runtime/zero/stage_1_and_2.py:387-500,586 @ v0.19.8). Each rank file holds its
fp32 master slice and the inner optimizer's state of that slice; with the tail padding
cut off, the slices of ranks 0..dp-1 concatenate to the unpadded flat buffer, from which
`FlatGroup.flat` cuts any parameter at any offset: the saved data-parallel size stops
mattering here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint.format import MASTER, CheckpointError

MOE_FIX = ("MoE checkpoints (expert parameters in layer_*_expert_* files, optimizer groups over "
           "expert-data-parallel ranks) are not supported; resume the run with DeepSpeed, or "
           "start evenzero from the weights")


@dataclass(frozen=True)
class FlatGroup:
    """One DeepSpeed optimizer group: its parameters in flat order and the saved slices."""

    index: int
    params: tuple[tuple[str, tuple[int, ...]], ...]
    """(name, shape) in flat order, as recorded in `param_shapes`."""
    spans: Mapping[str, tuple[int, int]]
    """Parameter name -> [start, end) in the unpadded flat buffer."""
    parts: Mapping[str, tuple[torch.Tensor, ...]]
    """Kind ("master", "exp_avg", ...) -> each rank's 1-D slice, tail padding cut."""
    scalars: Mapping[str, Any]
    """Optimizer state that is not per element (Adam's `step`)."""
    hyperparameters: Mapping[str, Any] | None
    """The inner optimizer's param group without "params" (None: not saved, elastic)."""

    def flat(self, name: str, kind: str, start: int = 0, numel: int | None = None
             ) -> torch.Tensor:
        """Elements [start, start + numel) of a parameter (default: all) of one kind, flat
        fp32 (a copy): a rank reads only the runs of its own shard."""
        first, end = self.spans[name]
        lo = first + start
        hi = end if numel is None else lo + numel
        out = torch.empty(hi - lo, dtype=torch.float32)
        start = 0
        for part in self.parts[kind]:
            end = start + part.numel()
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - lo:b - lo] = part[a - start:b - start]
            start = end
        return out


def flat_groups(path: Path, ranks: list[str], saved: list[Mapping[str, Any]],
                param_shapes: Sequence[Mapping[str, Any]], dp: int) -> tuple[FlatGroup, ...]:
    """Every group of `param_shapes`, from the optimizer files of ranks 0..dp-1 (`saved`),
    checked against each other and against the parameter sizes."""
    out = []
    first = saved[0]
    for i, shapes in enumerate(param_shapes):
        params = tuple((n, tuple(int(d) for d in s)) for n, s in shapes.items())
        for file, sd in zip(ranks, saved, strict=True):
            where = path / file
            counts = sd.get("partition_count") or []
            if len(sd.get("single_partition_of_fp32_groups") or []) != len(param_shapes):
                raise CheckpointError(f"{where}: {len(sd.get('single_partition_of_fp32_groups') or [])}"
                                      f" optimizer groups, the model states list "
                                      f"{len(param_shapes)}; files from two runs are mixed here")
            if i < len(counts) and int(counts[i]) != dp:
                raise CheckpointError(f"{where}: group {i} is partitioned over {counts[i]} ranks, "
                                      f"not the {dp} data-parallel ranks; {MOE_FIX}")
        pads = _alignment_paddings(path / ranks[0], first, i, len(params))
        spans, pos = {}, 0
        for (name, shape), pad in zip(params, pads, strict=True):
            spans[name] = (pos, pos + math.prod(shape))
            pos += math.prod(shape) + pad
        masters = tuple(_unpadded_master(sd, i) for sd in saved)
        total = sum(m.numel() for m in masters)
        if total != pos:
            raise CheckpointError(f"{path}: optimizer group {i} holds {total} elements over "
                                  f"{dp} files, but param_shapes needs {pos}; the files do not "
                                  f"belong to this model states file or are damaged")
        parts, scalars, hyper = _group_state(path, ranks, saved, i, masters)
        out.append(FlatGroup(i, params, spans, {MASTER: masters, **parts}, scalars, hyper))
    return tuple(out)


def _alignment_paddings(where: Path, sd: Mapping[str, Any], i: int, count: int) -> list[int]:
    """Zeros DeepSpeed put after each parameter of group `i` (`parameter_alignment`)."""
    every = sd.get("param_alignment_paddings")
    if not every:
        return [0] * count
    pads = [int(p) for p in every[i]]
    if len(pads) != count:
        raise CheckpointError(f"{where}: {len(pads)} alignment paddings for the {count} "
                              f"parameters of group {i}; the file does not belong to this "
                              f"model states file")
    return pads


def _unpadded_master(sd: Mapping[str, Any], i: int) -> torch.Tensor:
    """Group `i`'s fp32 slice without the tail padding. The ZeRO optimizer saves it cut
    (stage_1_and_2.py:3385); BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation,
    no `zero_stage` key) saves it whole (deepspeed/runtime/bf16_optimizer.py:633)."""
    master = sd["single_partition_of_fp32_groups"][i].reshape(-1)
    if "zero_stage" in sd:
        return master
    return master[:master.numel() - int(sd["group_paddings"][i])]


def _group_state(path: Path, ranks: list[str], saved: list[Mapping[str, Any]], i: int,
                 masters: tuple[torch.Tensor, ...]) -> tuple[dict, dict, dict | None]:
    """(per-element state by kind, scalar state, hyperparameters) of group `i`."""
    per_rank: list[dict[str, Any]] = []
    hyper = None
    for file, sd, master in zip(ranks, saved, masters, strict=True):
        base = sd.get("base_optimizer_state")
        where = path / file
        if isinstance(base, Mapping):  # the default (rigid) format: the inner state_dict()
            group = base["param_groups"][i]
            state = dict(base["state"].get(group["params"][0], {}))
            pad = int(sd["group_paddings"][i])
            if group.get("moe"):
                raise CheckpointError(f"{where}: optimizer group {i} holds expert parameters; "
                                      f"{MOE_FIX}")
            if hyper is None:
                hyper = {k: v for k, v in group.items() if k != "params"}
        elif isinstance(base, Sequence):  # elastic_checkpoint: cut per group, no groups
            state, pad = dict(base[i]), 0
        else:
            raise CheckpointError(f"{where}: no base_optimizer_state; the file is damaged")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and key != "step":
                if value.numel() != master.numel() + pad:
                    raise CheckpointError(f"{where}: optimizer state {key!r} of group {i} has "
                                          f"{value.numel()} elements, expected "
                                          f"{master.numel() + pad}; the file is damaged")
                state[key] = value[:master.numel()]
        per_rank.append(state)
    keys = set(per_rank[0])
    parts, scalars = {}, {}
    for r, state in enumerate(per_rank):
        if set(state) != keys:
            raise CheckpointError(f"{path / ranks[r]}: optimizer state keys {sorted(state)} differ "
                                  f"from rank 0's {sorted(keys)}; files from two runs are mixed")
    for key in sorted(keys):
        values = [s[key] for s in per_rank]
        if key != "step" and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in values):
            parts[key] = tuple(values)
            continue
        for r, v in enumerate(values):
            if not same_value(v, values[0]):
                raise CheckpointError(f"{path / ranks[r]}: optimizer state {key!r} of group {i} "
                                      f"is {v}, rank 0 has {values[0]}; files from two runs "
                                      f"are mixed here")
        scalars[key] = values[0]
    return parts, scalars, hyper


def same_value(a: Any, b: Any) -> bool:
    """Equal values, tensors compared by content (a saved `step` may be either)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)

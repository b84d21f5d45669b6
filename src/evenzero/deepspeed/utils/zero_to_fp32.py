"""`deepspeed.utils.zero_to_fp32` (deepspeed/utils/zero_to_fp32.py@0.19.8): one plain fp32
state dict from a ZeRO-1/2 checkpoint, on one process, without torch.distributed.

    state_dict = get_fp32_state_dict_from_zero_checkpoint("ckpt/")        # tag from ckpt/latest
    convert_zero_checkpoint_to_fp32_state_dict("ckpt/", "out/")          # out/pytorch_model.bin
    python -m deepspeed.utils.zero_to_fp32 ckpt/ out/ [-t TAG] [--safe_serialization]

It reads both kinds of checkpoint a `save_checkpoint` directory can hold:

* evenzero's (written by the drop-in engine's `save_checkpoint`): the fp32 masters of
  every parameter from the rank files, and the buffers and frozen parameters rank 0 saved;
* real DeepSpeed's ZeRO-1/2 ones: the fp32 partitions of every rank's optimizer file,
  through `evenzero.checkpoint`'s DeepSpeed reader (allow-listed unpickling, no code run).

Like DeepSpeed's, the result holds the persistent buffers (floating ones in fp32), then the
frozen parameters (DeepSpeed's ZeRO-1 files do not keep them, so neither does the result
for those), then the trained parameters in fp32, then each tied alias pointing at its
source tensor. `lazy_mode=True` returns the same tensors (already read; `.contiguous()`
works on them as on DeepSpeed's lazy ones). MoE checkpoints are refused, as DeepSpeed's
tool fails on them too.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from evenzero.deepspeed.log import logger

LATEST = "latest"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike,
                                             tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The consolidated fp32 state dict of the checkpoint `checkpoint_dir/tag` (`tag` from
    `checkpoint_dir/latest` when None)."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        with open(latest) as f:
            tag = f.read().strip()
    path = Path(checkpoint_dir) / str(tag)
    if not path.is_dir():
        raise FileNotFoundError(f"Directory '{path}' doesn't exist")
    from evenzero.checkpoint import is_deepspeed_checkpoint

    if is_deepspeed_checkpoint(checkpoint_dir, str(tag)):
        return _from_deepspeed(Path(checkpoint_dir), str(tag), exclude_frozen_parameters)
    return _from_evenzero(path, exclude_frozen_parameters)


def _from_deepspeed(root: Path, tag: str, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    from evenzero.checkpoint.deepspeed import read_deepspeed

    files = read_deepspeed(root, tag)
    states = files.states
    out: dict[str, torch.Tensor] = {}
    for name in states.get("buffer_names") or ():
        if name in files.module:
            out[name] = _upcast(files.module[name])
    if not exclude_frozen:
        for name, value in (states.get("frozen_param_fragments") or {}).items():
            out[name] = value
    for group in files.groups:
        for name, shape in group.params:
            out[name] = group.flat(name, "master").view(shape)
    _alias(out, files.shared)
    return out


def _from_evenzero(path: Path, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """The masters of every parameter (`evenzero.checkpoint.read_consolidated`), plus
    rank 0's model extras; `buffer_names` and `shared_params` come from the engine state
    `save_checkpoint` keeps (a checkpoint written by `evenzero.checkpoint.save` directly
    has none: its extras are then returned as saved)."""
    from evenzero.checkpoint import read_consolidated

    whole = read_consolidated(path)
    engine = whole.user_state if isinstance(whole.user_state, Mapping) else {}
    buffers = engine.get("buffer_names")
    out: dict[str, torch.Tensor] = {}
    if buffers is None:
        out.update(whole.extras)
    else:
        for name in buffers:
            if name in whole.extras:
                out[name] = _upcast(whole.extras[name])
        if not exclude_frozen:
            out.update({k: v for k, v in whole.extras.items() if k not in set(buffers)})
    for name in _trained_order(list(whole.params), engine.get("param_shapes")):
        out[name] = whole.params[name]
    _alias(out, engine.get("shared_params") or {})
    return out


def _trained_order(names: list[str], shapes: Any) -> list[str]:
    """The stored parameters in DeepSpeed's order (optimizer groups, then group order),
    when the engine recorded it; else as stored."""
    if not shapes:
        return names
    rank = {name: i for i, name in enumerate(n for group in shapes for n in group)}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _alias(out: dict[str, torch.Tensor], shared: Mapping[str, str]) -> None:
    for alias, source in shared.items():
        if source in out:
            out[alias] = out[source]


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"Unsupported output dtype {dtype!r}; use float32, float16 or bfloat16")


def to_torch_tensor(state_dict: Mapping[str, torch.Tensor], return_empty_tensor: bool = False,
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Contiguous tensors (floating ones in `dtype`); tied names share one tensor."""
    converted: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if id(tensor) in converted:
            out[name] = out[converted[id(tensor)]]
            continue
        converted[id(tensor)] = name
        target = dtype if tensor.is_floating_point() else None
        if return_empty_tensor:
            out[name] = torch.empty(tensor.shape, dtype=target or tensor.dtype)
        else:
            t = tensor.contiguous()
            out[name] = t.to(dtype=target) if target else t
    return out


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike,
                                          output_dir: str | os.PathLike,
                                          dtype: Any = torch.float32,
                                          max_shard_size: str | int | None = "5GB",
                                          safe_serialization: bool = False,
                                          tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> None:
    """Write the consolidated state dict to `output_dir`: `pytorch_model.bin` (or
    `model.safetensors`), sharded with an index file above `max_shard_size`, as
    DeepSpeed's tool writes it (sharding needs `huggingface_hub`, as there)."""
    dtype = _resolve_dtype(dtype)
    if safe_serialization:
        from safetensors.torch import save_file
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                          exclude_frozen_parameters)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    if max_shard_size is not None:
        from huggingface_hub import split_torch_state_dict_into_shards

        pattern = weights_name.replace(".bin", "{suffix}.bin").replace(
            ".safetensors", "{suffix}.safetensors")
        split = split_torch_state_dict_into_shards(
            to_torch_tensor(state_dict, return_empty_tensor=True, dtype=dtype),
            filename_pattern=pattern, max_shard_size=max_shard_size)
        shards, sharded = split.filename_to_tensors, split.is_sharded
    else:
        shards, sharded, split = {weights_name: list(state_dict)}, False, None
    os.makedirs(output_dir, exist_ok=True)
    for shard_file, names in shards.items():
        shard = to_torch_tensor({n: state_dict[n] for n in names}, dtype=dtype)
        target = os.path.join(output_dir, shard_file)
        if safe_serialization:
            save_file(shard, target, metadata={"format": "pt"})
        else:
            torch.save(shard, target)
    if sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        name = "model.safetensors.index.json" if safe_serialization else \
            "pytorch_model.bin.index.json"
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike,
                                               output_dir: str | os.PathLike,
                                               max_shard_size: str | int | None = "5GB",
                                               safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's older name)."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32,
                                          max_shard_size, safe_serialization, tag,
                                          exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move `model` to the CPU and load the consolidated fp32 weights into it
    (`strict=False`, as DeepSpeed does); returns it."""
    logger.info("Extracting fp32 weights")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    logger.info("Overwriting model with fp32 weights")
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> None:
    """DeepSpeed's zero_to_fp32.py command line."""
    p = argparse.ArgumentParser(prog="zero_to_fp32")
    p.add_argument("checkpoint_dir", type=str,
                   help="path to the desired checkpoint folder, e.g., path/checkpoint-12")
    p.add_argument("output_dir", type=str,
                   help="directory to the pytorch fp32 state_dict output files")
    p.add_argument("--max_shard_size", type=str, default="5GB")
    p.add_argument("--safe_serialization", default=False, action="store_true")
    p.add_argument("-t", "--tag", type=str, default=None)
    p.add_argument("--exclude_frozen_parameters", action="store_true")
    p.add_argument("-d", "--debug", action="store_true")
    args = p.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "main", "to_torch_tensor"]

if __name__ == "__main__":
    main()

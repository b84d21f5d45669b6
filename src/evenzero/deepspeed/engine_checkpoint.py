"""`engine.save_checkpoint` / `engine.load_checkpoint` on evenzero's sharded format, under
DeepSpeed's directory conventions (deepspeed/runtime/engine.py@0.19.8:4395-4966):

    save_dir/latest          the tag, no newline (written atomically by rank 0)
    save_dir/<tag>/          default tag "global_step{global_steps}"; an evenzero
                             checkpoint (`evenzero.checkpoint.save(..., tag=tag)`)

The engine's own state rides along as the checkpoint's user state, saved by rank 0 and
given back to every rank, as DeepSpeed keeps it in rank 0's model-states file: the LR
schedule's `state_dict()`, `global_steps`, `global_samples`, `skipped_steps`, the
data-parallel size, the config and the clipping value; `client_state` is merged over it
at the top level, so a client key can overwrite an engine key, exactly as in DeepSpeed.
The fp16 loss scaler is saved with the optimizer (the manifest's loss-scaler state).

Unlike DeepSpeed's ZeRO files, these load at any world size, optimizer state included.
`client_state` must hold what a checkpoint can store without pickle (dict, list, tuple,
str, int, float, bool, None, tensors); anything else is an error naming the type.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from evenzero.checkpoint.format import MASTER
from evenzero.deepspeed.log import info_rank0, logger, warning_rank0

LATEST = "latest"
ENGINE_MARK = "evenzero_deepspeed"
# Keys DeepSpeed does not hand back as client state (deepspeed/runtime/engine.py@0.19.8:4712).
ENGINE_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
               "data_sampler", "random_ltd")


def save_engine(engine: Any, save_dir: str, tag: Any, client_state: dict, save_latest: bool,
                exclude_frozen_parameters: bool) -> bool:
    """Every rank calls it (a collective), as in DeepSpeed."""
    from evenzero import checkpoint

    del exclude_frozen_parameters  # frozen parameters are always saved (they are small extras)
    # Checked before any collective, so every rank raises it (DeepSpeed's check and wording,
    # deepspeed/runtime/engine.py@0.19.8:4885); "" would write into the working directory.
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    engine.require_optimizer("save_checkpoint")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    tag = agreed_tag(tag, engine.tag_validation())
    state = {
        ENGINE_MARK: 1,
        "lr_scheduler": (engine.lr_scheduler.state_dict()
                         if engine.lr_scheduler is not None else None),
        "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "dp_world_size": engine.dp_world_size,
        "mp_world_size": 1, "ds_config": engine.config, "clip_grad": engine.gradient_clipping(),
        # What DeepSpeed's model-states file also records and its zero_to_fp32 reads
        # (deepspeed/runtime/engine.py@0.19.8:5406-5488): persistent buffers, tied aliases
        # and the trained parameters in optimizer-group order.
        "buffer_names": buffer_names(engine.module), "shared_params": shared_params(engine.module),
        "param_shapes": param_shapes(engine.module, engine.optimizer.param_groups),
    }
    state.update(client_state)
    extra = state if dist.get_rank() == 0 else None
    path = checkpoint.save(engine.zero, save_dir, engine.global_steps, extra=extra, tag=tag)
    if dist.get_rank() == 0:
        if save_latest:
            _write_latest(Path(save_dir), tag)
        _write_recovery_script(Path(save_dir))
    dist.barrier()
    info_rank0("saved checkpoint %s", path)
    return True


def buffer_names(module: Any) -> list[str]:
    """The module's persistent buffers, in `state_dict` order."""
    buffers = {name for name, _ in module.named_buffers()}
    return [name for name in module.state_dict() if name in buffers]


def param_shapes(module: Any, groups: list[dict]) -> list[dict[str, list[int]]]:
    """Per optimizer group, {name: shape} of its trained parameters in group order."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [{names[id(p)]: list(p.shape) for p in g["params"]
             if p.requires_grad and id(p) in names} for g in groups]


def shared_params(module: Any) -> dict[str, str]:
    """Tied parameters: {alias: the name the parameter is trained and saved under}."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


RECOVERY_SCRIPT = "zero_to_fp32.py"
_RECOVERY_TEXT = '''#!/usr/bin/env python
# Written by evenzero's engine.save_checkpoint, as DeepSpeed writes its own zero_to_fp32.py:
#     python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] ...
# consolidates this directory's checkpoint into a plain fp32 state dict (needs evenzero).
from evenzero.deepspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''


def _write_recovery_script(root: Path) -> None:
    """DeepSpeed copies its zero_to_fp32.py next to ZeRO checkpoints
    (deepspeed/runtime/engine.py@0.19.8:5530-5567); this one runs evenzero's."""
    script = root / RECOVERY_SCRIPT
    try:
        if not script.exists() or script.read_text() != _RECOVERY_TEXT:
            script.write_text(_RECOVERY_TEXT)
    except OSError as e:
        warning_rank0("could not write %s: %s", script, e)


def agreed_tag(tag: str, mode: str) -> str:
    """The tag every rank saves under (a collective). A tag that differs across ranks
    fails under tag_validation FAIL on every rank, with DeepSpeed's message
    (deepspeed/runtime/engine.py@0.19.8:4850-4867); under WARN it is logged, under IGNORE
    not. DeepSpeed then writes each rank's files under its own tag, a checkpoint that
    cannot be loaded whole; an evenzero checkpoint is one directory, written under rank 0's
    tag, and the warning names it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tag
    tags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) == 1:
        return tag
    msg = (f"[rank={dist.get_rank()}] The checkpoint tag name '{tag}' is not consistent across "
           f"all ranks. Including rank unique information in checkpoint tag could cause issues "
           f"when restoring with different world sizes.")
    if mode == "FAIL":
        raise AssertionError(msg)
    if mode == "WARN":
        logger.warning("%s The checkpoint is saved once, under rank 0's tag %r.", msg, tags[0])
    return str(tags[0])


def _write_latest(root: Path, tag: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_engine(engine: Any, load_dir: str, tag: Any, load_module_strict: bool,
                load_optimizer_states: bool, load_lr_scheduler_states: bool,
                load_module_only: bool, custom_load_fn: Any) -> tuple[str | None, dict | None]:
    from evenzero import checkpoint

    engine.require_optimizer("load_checkpoint")
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint(custom_load_fn=...) is not supported: the module is "
                         "restored from the sharded fp32 masters")
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            warning_rank0("Unable to find latest file at %s, if trying to load latest "
                           "checkpoint please ensure this file exists or pass an explicit "
                           "checkpoint tag when loading a checkpoint.", latest)
            return None, None
        tag = latest.read_text().strip()
    tag = str(tag)
    if checkpoint.is_deepspeed_checkpoint(root, tag):
        return load_deepspeed_checkpoint(engine, load_dir, tag, load_optimizer_states,
                                         load_lr_scheduler_states, load_module_only,
                                         load_module_strict)
    keep_optimizer = load_module_only or not load_optimizer_states
    before = _optimizer_snapshot(engine) if keep_optimizer else None
    manifest = checkpoint.load(engine.zero, root, tag=tag)
    if before is not None:
        _restore_optimizer(engine, before)
    state = _broadcast_from_rank0(manifest.extra)
    if not isinstance(state, dict) or ENGINE_MARK not in state:
        raise ValueError(f"{root / tag}: not saved by engine.save_checkpoint (no engine state); "
                         f"load it with evenzero.checkpoint.load")
    if load_module_only:
        excluded = ["module"]
    else:
        if load_lr_scheduler_states and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        engine.global_steps = state["global_steps"]
        engine.global_samples = state.get("global_samples",
                                          engine.global_steps * engine.train_batch_size())
        engine.skipped_steps = state["skipped_steps"]
        if load_optimizer_states:
            # DeepSpeed's ZeRO load restores the saved clip_grad over the config's
            # (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:3667-3793).
            engine.restore_gradient_clipping(state["clip_grad"])
        excluded = list(ENGINE_KEYS)
    if load_lr_scheduler_states:
        excluded.append("lr_scheduler")
    if load_optimizer_states:
        excluded.append("optimizer")
    client = {k: v for k, v in state.items() if k not in excluded and k != ENGINE_MARK}
    return str(root / tag), client


def load_deepspeed_checkpoint(engine: Any, load_dir: str, tag: str, load_optimizer_states: bool,
                              load_lr_scheduler_states: bool, load_module_only: bool,
                              load_module_strict: bool = True):
    """A checkpoint written by DeepSpeed itself, at any data-parallel size: masters, Adam
    moments and step, loss scale, scheduler, counters and client_state, read safely by
    `evenzero.checkpoint.load_deepspeed` (nothing of the run is touched if it fails)."""
    from evenzero import checkpoint
    from evenzero.checkpoint.deepspeed.reader import MODEL_STATES

    ckpt = checkpoint.load_deepspeed(
        engine.zero, load_dir, tag, load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
        load_module_strict=load_module_strict,
        lr_scheduler=engine.lr_scheduler if load_lr_scheduler_states else None)
    if not load_module_only:
        engine.global_steps = ckpt.global_steps
        engine.global_samples = ckpt.global_samples
        engine.skipped_steps = ckpt.skipped_steps
        if load_optimizer_states and ckpt.clip_grad is not None:
            # DeepSpeed's ZeRO load restores the saved clip_grad over the config's
            # (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:3667-3793).
            engine.restore_gradient_clipping(ckpt.clip_grad)
    # DeepSpeed returns the model-states file it read, joined onto `load_dir` as the caller
    # spelled it ("./ckpt" stays "./ckpt/..."), not the tag directory
    # (deepspeed/runtime/engine.py@0.19.8:4336-4358,4383-4393,4591).
    return os.path.join(load_dir, tag, MODEL_STATES), ckpt.client_state


def _optimizer_snapshot(engine: Any) -> dict[str, Any]:
    """This rank's optimizer state except the masters (through the checkpoint protocol)."""
    zero = engine.zero
    shards = {}
    for g in zero.plan.groups:
        shard = zero.shard_state(g.name)
        shards[g.name] = {
            "flats": {k: v.clone() for k, v in shard["flats"].items() if k != MASTER},
            "param_scalars": copy.deepcopy(dict(shard["param_scalars"])),
            "hyperparameters": copy.deepcopy(dict(shard["hyperparameters"]))}
    return {"shards": shards, "scaler": zero.loss_scaler_state()}


def _restore_optimizer(engine: Any, before: dict[str, Any]) -> None:
    """Keep the running optimizer state, hyperparameters and loss scale (DeepSpeed rebuilds
    only the fp32 masters from the loaded weights when optimizer states are not loaded)."""
    zero = engine.zero
    shards = {name: {**saved, "flats": {MASTER: zero.shard_state(name)["flats"][MASTER],
                                        **saved["flats"]}}
              for name, saved in before["shards"].items()}
    zero.load_shard_state(shards, None, before["scaler"])


def _broadcast_from_rank0(value: Any) -> Any:
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]

"""pytest plugin (not vendored; evenzero's): keeps the ZeRO-1/2 ids of the vendored DeepSpeed
tests and records, for every id it drops, the feature evenzero refuses by name.

Loaded by `tests/peer/run_deepspeed.py` with `-p zero12_select` under both DeepSpeed and the
stand-in, so that the control and the stand-in run the same ids. The dropped ids are written
to the JSON file named by the environment variable `ZERO12_DESELECTED` (id -> reason), and
the ids it keeps, in run order, to the one named by `ZERO12_SELECTED`.
"""

from __future__ import annotations

import json
import os

ZERO3 = "ZeRO-3 (refused by name: parameter partitioning)"
OFFLOAD = "ZeRO-Offload (refused by name: optimizer/parameter offload)"

# Test classes whose config fixes ZeRO-3 inside the test body rather than in a parameter.
ZERO3_CLASS_WORDS = ("stage3", "zero3", "zeroinfinity", "zero_3", "partitionparameters",
                     "zeroparam", "zerotiedweights", "zerooffload")


def refusal(item) -> str | None:
    """Why `item` is outside what evenzero stands in for, or None when it applies."""
    callspec = getattr(item, "callspec", None)
    params = dict(callspec.params) if callspec is not None else {}
    for key in ("zero_stage", "stage"):
        if params.get(key) == 3:
            return ZERO3
    device = params.get("offload_device")
    if device is not None and str(getattr(device, "value", device)) not in ("none", "None"):
        return OFFLOAD
    if params.get("use_cpu_offload") is True or params.get("offload_optimizer") is True:
        return OFFLOAD
    owner = (item.cls.__name__ if item.cls is not None else "").lower()
    if any(word in owner for word in ZERO3_CLASS_WORDS):
        return ZERO3
    return None


def pytest_collection_modifyitems(session, config, items):
    kept, dropped = [], {}
    for item in items:
        reason = refusal(item)
        if reason is None:
            kept.append(item)
        else:
            dropped[item.nodeid] = reason
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in dropped])
    items[:] = kept
    path = os.environ.get("ZERO12_DESELECTED")
    if path:
        with open(path, "w") as f:
            json.dump(dropped, f, indent=1, sort_keys=True)
    path = os.environ.get("ZERO12_SELECTED")
    if path:
        with open(path, "w") as f:
            json.dump([item.nodeid for item in kept], f, indent=1)

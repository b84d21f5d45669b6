"""`evenzero run`: `import deepspeed` is evenzero.deepspeed in the command and its
children, module for module, with DeepSpeed's version to importlib.metadata, over an
installed DeepSpeed; DeepSpeed modules evenzero does not have fail naming why. Each
check runs in a child process (the stand-in replaces `deepspeed` in `sys.modules`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

CHILD = r"""
import importlib, importlib.metadata, importlib.util, json, sys
out = {}
spec = importlib.util.find_spec("deepspeed")
out["origin"] = spec.origin
out["version"] = importlib.metadata.version("deepspeed")
import deepspeed, evenzero.deepspeed as ez
out["package_same"] = deepspeed is ez
import deepspeed.ops.adam
import deepspeed.runtime.lr_schedules
import deepspeed.launcher.runner
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from deepspeed.runtime.engine import DeepSpeedEngine
names = ["ops", "ops.adam", "runtime", "runtime.lr_schedules", "runtime.engine", "launcher.runner",
         "accelerator", "checkpoint.utils", "utils", "utils.zero_to_fp32", "comm", "zero",
         "checkpointing"]
for n in names:
    importlib.import_module("deepspeed." + n)
out["same"] = {n: sys.modules["deepspeed." + n] is sys.modules["evenzero.deepspeed." + n]
               for n in names}
out["attribute_same"] = deepspeed.ops.adam is ez.ops.adam and deepspeed.zero is ez.zero
out["spec_kept"] = ez.ops.adam.__spec__.name
out["engine_class"] = DeepSpeedEngine is ez.DeepSpeedEngine
out["schedules"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
out["real_loaded"] = sorted(m for m, mod in sys.modules.items()
                            if "site-packages/deepspeed/" in str(getattr(mod, "__file__", "")))
errors = {}
for n in ("deepspeed.ops.adagrad", "deepspeed.runtime.zero.tiling",
          "deepspeed.runtime.pipe", "deepspeed.no_such_module"):
    try:
        importlib.import_module(n)
        errors[n] = None
    except ModuleNotFoundError as e:
        errors[n] = str(e)
        out.setdefault("error_types", set()).add(type(e).__name__)
out["errors"] = errors
out["error_types"] = sorted(out.get("error_types", ()))
print("RESULT" + json.dumps(out))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK"))}
    env.update(PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def evenzero_run(*command: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evenzero.cli", "run", *command], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_deepspeed_resolves_to_evenzero_module_for_module():
    proc = evenzero_run(sys.executable, "-c", CHILD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["version"] == "0.19.8"
    assert Path(out["origin"]).parent.name == "deepspeed" and "evenzero-deepspeed-" in out["origin"]
    assert out["package_same"] and out["attribute_same"] and out["engine_class"]
    assert all(out["same"].values()), out["same"]
    assert out["spec_kept"] == "evenzero.deepspeed.ops.adam"  # one module, its own spec
    assert out["schedules"] == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                "WarmupCosineLR"]
    assert out["real_loaded"] == []  # an installed DeepSpeed is never imported
    errors = out["errors"]
    assert "offload_optimizer" in errors["deepspeed.ops.adagrad"]
    assert "ZeRO stage 3" in errors["deepspeed.runtime.zero.tiling"]
    assert "pipeline parallelism" in errors["deepspeed.runtime.pipe"]
    assert "not this module" in errors["deepspeed.no_such_module"]
    # What `evenzero run` tells from a crash (evenzero.deepspeed.uncaught).
    assert out["error_types"] == ["RefusedModuleError"]
    notices = [line for line in proc.stderr.splitlines() if "stands in for DeepSpeed" in line]
    assert len(notices) == 1 and notices[0].startswith("evenzero run:")


def test_children_inherit_the_standin_and_the_exit_status():
    """A grandchild process sees it too, and the command's exit status comes back."""
    inner = ("import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', "
             "'import deepspeed, sys; sys.exit(7 if deepspeed.__name__ == \"evenzero.deepspeed\" "
             "else 1)']))")
    proc = evenzero_run(sys.executable, "-c", inner)
    assert proc.returncode == 7, proc.stderr[-2000:]


def test_python_dash_m_runs_deepspeed_tools(tmp_path):
    """`python -m deepspeed.utils.zero_to_fp32` (DeepSpeed's documented form) runs ours."""
    proc = evenzero_run(sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(tmp_path),
                        str(tmp_path / "out"))
    assert proc.returncode != 0 and "Unable to find 'latest' file" in proc.stderr


def test_run_refuses_bad_commands_with_one_line():
    proc = evenzero_run()
    assert proc.returncode == 2 and "expected a command" in proc.stderr
    proc = evenzero_run("no-such-command-evenzero")
    assert proc.returncode == 2 and "command not found" in proc.stderr
    proc = evenzero_run("deepspeed", "--num_nodes", "2", "train.py")
    assert proc.returncode == 2 and "--num_nodes 2" in proc.stderr and "multi-node" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1

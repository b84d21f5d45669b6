"""`deepspeed.git_version_info`: what DeepSpeed's setup.py records about a build. Test
harnesses and bug-report scripts read it (`version`, `torch_info`, `installed_ops`). Here no
op is built (`ops.op_builder`): none is installed, and only the Adam ops evenzero provides
in PyTorch are compatible."""

from __future__ import annotations

import torch

from evenzero.deepspeed.ops.op_builder import ALL_OPS, compatible_ops
from evenzero.deepspeed.standin import VERSION

version = VERSION
git_hash = "[evenzero]"
git_branch = "[evenzero]"
accelerator_name = "cpu" if not torch.cuda.is_available() else "cuda"
installed_ops = dict.fromkeys(ALL_OPS, False)
compatible_ops = compatible_ops()
# "0.0" is the value DeepSpeed's readers take as "detect at run time" (its
# git_version_info.py@0.19.8 writes the same for an uninstalled checkout).
torch_info = {"version": "0.0", "cuda_version": "0.0", "nccl_version": "0.0", "hip_version": "0.0"}

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops",
           "torch_info", "version"]

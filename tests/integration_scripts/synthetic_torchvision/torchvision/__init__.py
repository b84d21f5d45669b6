"""A stand-in for torchvision in the integration tests: `datasets.CIFAR10` is a small
synthetic dataset (nothing is downloaded), `transforms` has what the DeepSpeedExamples
CIFAR script uses. It replaces only the script's data source.

`SYNTHETIC_CIFAR10_TRAIN` / `SYNTHETIC_CIFAR10_TEST` set the dataset sizes (default 256 /
40). With `EVENZERO_LOSS_PROBE=PATH` set, every `nn.CrossEntropyLoss` value computed with
gradients enabled is written, unrounded, to PATH.rank<RANK>.json at exit
(`loss_probe`), since the script itself prints its running loss to 3 decimals only.
With `EVENZERO_TEST_SEED=N` set, torch's RNG is seeded with N on import: the CIFAR script
seeds nothing, so two runs (DeepSpeed's and evenzero's) would otherwise start from
different random weights.
"""

import os

import torch

from torchvision import datasets, transforms

__version__ = "0.0+synthetic"

if os.environ.get("EVENZERO_TEST_SEED"):
    torch.manual_seed(int(os.environ["EVENZERO_TEST_SEED"]))

if os.environ.get("EVENZERO_LOSS_PROBE"):
    import loss_probe

    loss_probe.install(os.environ["EVENZERO_LOSS_PROBE"])

__all__ = ["datasets", "transforms"]

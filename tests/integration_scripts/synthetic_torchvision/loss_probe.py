"""Records the training losses a script computes with `nn.CrossEntropyLoss`, unrounded,
for the integration tests to compare runs (see `torchvision/__init__.py`)."""

import atexit
import json
import os

import torch

_losses = []


def install(path: str) -> None:
    original = torch.nn.CrossEntropyLoss.forward

    def forward(self, input, target):
        loss = original(self, input, target)
        if torch.is_grad_enabled():
            _losses.append(loss.detach().float().item())
        return loss

    torch.nn.CrossEntropyLoss.forward = forward
    rank = os.environ.get("RANK", "0")
    atexit.register(_write, f"{path}.rank{rank}.json")


def _write(path: str) -> None:
    with open(path, "w") as f:
        json.dump(_losses, f)

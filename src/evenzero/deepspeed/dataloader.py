"""`training_data` as DeepSpeed serves it (deepspeed/runtime/dataloader.py@0.19.8):
batches of `train_micro_batch_size_per_gpu` from a `DistributedSampler` over the
data-parallel ranks with torch's defaults (shuffle, seed 0, and no `set_epoch`, so every
epoch repeats the same order, as in DeepSpeed), two worker processes, and a fresh
torch `DataLoader` on every `iter()`. Same sampler, same batches: a script sees the
data DeepSpeed would have shown it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


def check_dataset(dataset: Any) -> None:
    if not isinstance(dataset, (Dataset, IterableDataset)):
        raise ValueError("Training data must be a torch Dataset")


class DeepSpeedDataLoader:
    def __init__(self, dataset: Any, batch_size: int, *, rank: int, world_size: int,
                 collate_fn: Callable | None = None, drop_last: bool = False,
                 num_workers: int = 2, data_sampler: Any = None, shuffle: bool = True) -> None:
        check_dataset(dataset)
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.num_local_io_workers = num_workers
        self.dataloader_drop_last = drop_last
        self.data_sampler = data_sampler if data_sampler is not None else DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle)
        # Pinning needs an accelerator; DeepSpeed asks for it, torch warns without one.
        self.pin_memory = torch.cuda.is_available()
        n = len(self.data_sampler)
        self.len = n // batch_size if drop_last else math.ceil(n / batch_size)
        self.post_process_func = None
        self.dataloader: DataLoader | None = None
        self.data: Iterator | None = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> DeepSpeedDataLoader:
        kw = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        self.dataloader = DataLoader(self.dataset, batch_size=self.batch_size,
                                     pin_memory=self.pin_memory, sampler=self.data_sampler,
                                     num_workers=self.num_local_io_workers,
                                     drop_last=self.dataloader_drop_last, **kw)
        self.data = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self.data is None:
            iter(self)
        return next(self.data)


class RepeatingLoader:
    """Restarts the wrapped loader when it is exhausted (deepspeed/runtime/dataloader.py)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)

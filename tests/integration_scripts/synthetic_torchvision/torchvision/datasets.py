"""`torchvision.datasets.CIFAR10` as a synthetic dataset: 3x32x32 uint8 images (HWC, as
CIFAR-10's arrays are) whose class shows in the mean of one colour channel, fixed by a
seed, so every run and every rank sees the same data."""

import os

import torch


class CIFAR10(torch.utils.data.Dataset):
    def __init__(self, root, train=True, transform=None, target_transform=None,
                 download=False):
        n = int(os.environ.get("SYNTHETIC_CIFAR10_TRAIN" if train else "SYNTHETIC_CIFAR10_TEST",
                               256 if train else 40))
        g = torch.Generator().manual_seed(10 if train else 11)
        self.targets = torch.randint(0, 10, (n,), generator=g).tolist()
        images = torch.randint(0, 200, (n, 32, 32, 3), generator=g, dtype=torch.int64)
        for i, label in enumerate(self.targets):
            images[i, :, :, label % 3] += 5 * label
        self.data = images.clamp(0, 255).to(torch.uint8)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        img, target = self.data[index], self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

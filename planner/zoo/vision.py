"""Convolutional models: a ResNet (residual blocks with BatchNorm) and a U-Net (long skip
connections, cuts crossed by several tensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.zoo.common import Example, make


class _BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a shortcut (a 1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        if stride != 1 or c_in != c_out:
            self.shortcut: nn.Module = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, ``blocks`` residual blocks (the middle one halves the resolution), pool, linear."""

    def __init__(self, blocks: int, channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        layers = []
        c = channels
        for i in range(blocks):
            down = i == blocks // 2 and blocks > 1
            layers.append(_BasicBlock(c, 2 * c if down else c, stride=2 if down else 1))
            c = 2 * c if down else c
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def resnet(
    blocks: int = 4,
    channels: int = 32,
    batch: int = 8,
    image: int = 32,
    num_classes: int = 10,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A small CIFAR-style ResNet with BatchNorm2d.

    Each residual block has one articulation point (its output), and inside a block the cut is
    crossed by two tensors (the branch and the shortcut). BatchNorm in train mode updates its
    running statistics in forward, so a plan that recomputes it must not update them twice.
    Input ``(images,)`` of shape ``(batch, 3, image, image)``; output logits
    ``(batch, num_classes)``.
    """

    def build() -> Example:
        model = ResNet(blocks, channels, num_classes)
        return model, (torch.randn(batch, 3, image, image),)

    return make(build, seed, device)


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1),
        nn.ReLU(),
    )


class UNet(nn.Module):
    """Encoder (double conv + max-pool) x depth, bottleneck, decoder (up-conv, cat, double conv)."""

    def __init__(self, depth: int, channels: int, in_channels: int = 3, out_channels: int = 2):
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        c = in_channels
        for w in widths[:-1]:
            self.down.append(_double_conv(c, w))
            c = w
        self.bottleneck = _double_conv(c, widths[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for w_skip, w_low in zip(reversed(widths[:-1]), reversed(widths[1:])):
            self.up.append(nn.ConvTranspose2d(w_low, w_skip, 2, stride=2))
            self.dec.append(_double_conv(2 * w_skip, w_skip))
        self.head = nn.Conv2d(channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)  # stays live until the matching decoder level
            x = F.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet(
    depth: int = 3,
    channels: int = 16,
    batch: int = 4,
    image: int = 64,
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> Example:
    """A small U-Net (no normalisation) with long skip connections.

    Every encoder level's features are concatenated into the matching decoder level, so most
    cuts are crossed by several tensors and only the nodes before the first skip and after
    the last ``cat`` are articulation points. Input ``(images,)`` of shape
    ``(batch, 3, image, image)`` (``image`` divisible by ``2**depth``); output per-pixel logits
    ``(batch, 2, image, image)``.
    """
    if image % 2**depth:
        raise ValueError(f"image={image} must be divisible by 2**depth={2**depth}")

    def build() -> Example:
        return UNet(depth, channels), (torch.randn(batch, 3, image, image),)

    return make(build, seed, device)

"""EfficientNet-B0 ... B7 (Tan & Le 2019), written here so tracing needs no torchvision.

The B0 network is seven stages of MBConv blocks (inverted bottlenecks: 1x1 expansion, depthwise k x k conv,
squeeze-and-excitation on a quarter of the block's input channels, 1x1 projection, residual when the shape
allows), between a 3x3 stride-2 stem of 32 channels and a 1x1 head of 1280 channels. B1-B7 scale the widths
(rounded to multiples of 8) and the block counts (rounded up) by the compound coefficients of the paper; each
variant has its own training resolution (``RESOLUTION``). SiLU activations; in training mode every residual
block drops its branch per sample (stochastic depth: drop probability rising linearly from 0 at the first block
to 0.2 at the last) and dropout precedes the classifier, as torchvision's models do.
Parameter counts match torchvision's ``efficientnet_b0`` ... ``efficientnet_b7``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# stage: (expansion, kernel, stride, output channels, blocks) of B0
STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
# variant: (width multiplier, depth multiplier, dropout before the classifier)
SCALING = {"efficientnet-b0": (1.0, 1.0, 0.2), "efficientnet-b1": (1.0, 1.1, 0.2),
           "efficientnet-b2": (1.1, 1.2, 0.3), "efficientnet-b3": (1.2, 1.4, 0.3),
           "efficientnet-b4": (1.4, 1.8, 0.4), "efficientnet-b5": (1.6, 2.2, 0.4),
           "efficientnet-b6": (1.8, 2.6, 0.5), "efficientnet-b7": (2.0, 3.1, 0.5)}
RESOLUTION = {"efficientnet-b0": 224, "efficientnet-b1": 240, "efficientnet-b2": 260, "efficientnet-b3": 300,
              "efficientnet-b4": 380, "efficientnet-b5": 456, "efficientnet-b6": 528, "efficientnet-b7": 600}
SURVIVAL = 0.8


def _divisible(c: float, by: int = 8) -> int:
    """Round a scaled width to a multiple of ``by``, never more than 10 % below it (the paper's code)."""
    out = max(by, int(c + by / 2) // by * by)
    return out + by if out < 0.9 * c else out


class _ConvBN(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, k, stride, (k - 1) // 2, groups=groups, bias=False),
                                   nn.BatchNorm2d(c_out)]
        if act:
            layers.append(nn.SiLU(inplace=True))
        super().__init__(*layers)


class _SE(nn.Module):
    """Squeeze-and-excitation with 1x1 convs: pool -> reduce (SiLU) -> expand (sigmoid) -> scale the input."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeeze, 1)
        self.expand = nn.Conv2d(squeeze, channels, 1)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.act(self.reduce(torch.mean(x, (2, 3), keepdim=True)))
        return x * torch.sigmoid(self.expand(s))


class MBConv(nn.Module):
    """Inverted bottleneck with a depthwise conv; residual (with stochastic depth) when stride 1 and c_in == c_out."""

    def __init__(self, c_in: int, c_out: int, expansion: int, k: int, stride: int, survival: float) -> None:
        super().__init__()
        mid = c_in * expansion
        layers: list[nn.Module] = [] if expansion == 1 else [_ConvBN(c_in, mid, 1)]
        layers += [_ConvBN(mid, mid, k, stride, groups=mid), _SE(mid, max(1, c_in // 4)), _ConvBN(mid, c_out, 1, act=False)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out
        self.survival = survival

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if not self.residual:
            return out
        if self.training and self.survival < 1.0:   # per-sample drop of the branch
            keep = torch.empty((x.shape[0], 1, 1, 1), dtype=x.dtype, device=x.device).bernoulli_(self.survival)
            out = out * keep / self.survival
        return out + x


class EfficientNet(nn.Module):
    """EfficientNet for ``num_classes``-way classification of (B, 3, H, W) images."""

    def __init__(self, width: float, depth: float, dropout: float, num_classes: int = 1000) -> None:
        super().__init__()
        stem = _divisible(32 * width)
        blocks: list[nn.Module] = []
        counts = [math.ceil(n * depth) for *_, n in STAGES]
        total, i, c_in = sum(counts), 0, stem
        for (expansion, k, stride, c, _), n in zip(STAGES, counts):
            c_out = _divisible(c * width)
            for j in range(n):
                blocks.append(MBConv(c_in, c_out, expansion, k, stride if j == 0 else 1,
                                     1.0 - (1.0 - SURVIVAL) * i / total))
                c_in, i = c_out, i + 1
        head = _divisible(1280 * width)
        self.features = nn.Sequential(_ConvBN(3, stem, 3, 2), *blocks, _ConvBN(c_in, head, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(head, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        x = torch.mean(self.features(x), (2, 3))
        return self.fc(self.dropout(x))  # (B, num_classes)


def efficientnet(name: str, num_classes: int = 1000) -> EfficientNet:
    width, depth, dropout = SCALING[name]
    return EfficientNet(width, depth, dropout, num_classes)

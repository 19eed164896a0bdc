"""The ResNet family (He et al. 2016; torchvision's v1.5 layout: stride on the 3x3 conv of a bottleneck),
written here so tracing needs no torchvision. Shapes and parameter counts match torchvision's models.

ResNeXt (Xie et al. 2017) is the same bottleneck with a grouped 3x3 conv: ``32x4d`` = 32 groups of width 4 at
the first stage (bottleneck width 128, doubling per stage). SE-ResNeXt adds squeeze-and-excitation (Hu et al.
2018) to every bottleneck: global average pool -> Linear(C, C/16) -> ReLU -> Linear(C/16, C) -> sigmoid -> scale
the block's output before the residual add, as NVIDIA DeepLearningExamples' ``se-resnext101-32x4d`` does."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _shortcut(c_in, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class SqueezeExcitation(nn.Module):
    """Channel gates from the globally pooled features: (B, C, H, W) -> (B, C, 1, 1) in (0, 1)."""

    def __init__(self, channels: int, reduction: int = 16) -> None:
        super().__init__()
        self.squeeze = nn.Linear(channels, channels // reduction)
        self.expand = nn.Linear(channels // reduction, channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.relu(self.squeeze(torch.mean(x, (2, 3))))
        return torch.sigmoid(self.expand(s))[:, :, None, None]


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (grouped for ResNeXt, stride here: v1.5) -> 1x1 expand to ``planes x 4`` channels."""

    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int = 1, groups: int = 1, width_per_group: int = 64,
                 se_reduction: int | None = None) -> None:
        super().__init__()
        width = planes * width_per_group // 64 * groups
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.se = None if se_reduction is None else SqueezeExcitation(planes * 4, se_reduction)
        self.downsample = _shortcut(c_in, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.se is not None:
            out = out * self.se(out)
        return self.relu(out + identity)


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module | None:
    if stride == 1 and c_in == c_out:
        return None
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


class ResNet(nn.Module):
    """ResNet for ``num_classes``-way classification of (B, 3, H, W) images."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], num_classes: int = 1000,
                 **block_kwargs: int | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = 64
        stages = []
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), layers)):
            blocks = []
            for j in range(n):
                blocks.append(block(c_in, width, 2 if (j == 0 and i > 0) else 1, **block_kwargs))
                c_in = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))  # (B, num_classes)


_RESNEXT_32X4D = {"groups": 32, "width_per_group": 4}

# preset -> (block, blocks per stage, block keyword arguments)
RESNET_LAYERS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], list[int], dict[str, int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2], {}),
    "resnet34": (BasicBlock, [3, 4, 6, 3], {}),
    "resnet50": (Bottleneck, [3, 4, 6, 3], {}),
    "resnet101": (Bottleneck, [3, 4, 23, 3], {}),
    "resnet152": (Bottleneck, [3, 8, 36, 3], {}),
    "resnext50-32x4d": (Bottleneck, [3, 4, 6, 3], _RESNEXT_32X4D),
    "resnext101-32x4d": (Bottleneck, [3, 4, 23, 3], _RESNEXT_32X4D),
    "se-resnext101-32x4d": (Bottleneck, [3, 4, 23, 3], {**_RESNEXT_32X4D, "se_reduction": 16}),
}


def resnet(name: str, num_classes: int = 1000) -> ResNet:
    block, layers, kwargs = RESNET_LAYERS[name]
    return ResNet(block, layers, num_classes, **kwargs)

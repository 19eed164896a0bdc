"""The per-family utilization MLP: features -> utilization in (0, 1], plus a learned launch overhead."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """Hyper-parameters of one family's model (also the training schedule)."""

    hidden: tuple[int, ...] = (64, 64)      # a few layers, a few thousand weights
    dropout: float = 0.0
    lr: float = 2e-3
    weight_decay: float = 1e-4
    epochs: int = 60
    batch_size: int = 1024
    patience: int = 10                      # early-stopping epochs without validation improvement
    init_overhead_ms: float = 0.01          # launch overhead before training (the data floor is ~0.01-0.03 ms)
    seed: int = 0
    extra: dict = field(default_factory=dict)


class UtilizationMLP(nn.Module):
    """utilization = sigmoid(MLP(normalised features)); latency = roofline / utilization + overhead.

    The sigmoid keeps utilization in (0, 1), so a prediction never beats the roofline bound; the overhead
    (softplus of one learned scalar, in ms) models the launch floor every kernel pays.
    """

    def __init__(self, in_features: int, hidden: tuple[int, ...] = (64, 64), dropout: float = 0.0,
                 init_overhead_ms: float = 0.01) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.GELU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)
        self.in_features = in_features
        # softplus^-1(init): overhead starts at init_overhead_ms
        raw = torch.log(torch.expm1(torch.tensor(float(init_overhead_ms))))
        self.raw_overhead = nn.Parameter(raw.reshape(1))
        self.register_buffer("mean", torch.zeros(in_features))
        self.register_buffer("std", torch.ones(in_features))
        # training range of each raw feature: inputs are clamped to it, so a kernel or a GPU beyond what
        # was measured is described by the nearest measured boundary (utilization saturates, no wild
        # extrapolation of the network)
        self.register_buffer("lo", torch.full((in_features,), -torch.inf))
        self.register_buffer("hi", torch.full((in_features,), torch.inf))

    @property
    def overhead_ms(self) -> torch.Tensor:
        return nn.functional.softplus(self.raw_overhead)

    def utilization(self, x: torch.Tensor) -> torch.Tensor:
        """(n, in_features) raw features -> (n,) utilization in (0, 1)."""
        z = (torch.maximum(torch.minimum(x, self.hi), self.lo) - self.mean) / self.std
        return torch.sigmoid(self.net(z).squeeze(-1)).clamp_min(1e-4)

    def forward(self, x: torch.Tensor, roofline_ms: torch.Tensor) -> torch.Tensor:
        """Predicted latency in ms."""
        return roofline_ms / self.utilization(x) + self.overhead_ms

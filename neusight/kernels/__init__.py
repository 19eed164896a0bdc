"""Kernel families, FLOP/byte formulas and the aten-op registry."""

from neusight.kernels.base import Family, Kernel

__all__ = ["Family", "Kernel"]

"""Kernel families and the Kernel record that the op registry produces and the predictor consumes."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Family(str, enum.Enum):
    """What kind of GPU kernel an aten op launches; each family has its own tile rule and predictor.

    Dims conventions (``Kernel.dims``), fixed here once:

    - LINEAR, BMM, CONV: ``(B, M, N, K)`` = B independent GEMMs of (M x N) @ (N x K) -> (M x K);
      **N is the reduction dimension** (the convention of the NeuSight kernel CSVs). A conv is given by
      its implicit-GEMM shape: M = batch x output pixels, N = C_in/groups x R x S, K = C_out/groups,
      B = groups.
    - every other family: ``(rows, cols)``, the kernel's tensor seen as rows x cols with cols the
      innermost (normalised / reduced / contiguous) dimension; rows x cols = elements processed.
    """

    LINEAR = "linear"
    BMM = "bmm"
    CONV = "conv"
    ELEMENTWISE = "elementwise"
    SOFTMAX = "softmax"
    LAYERNORM = "layernorm"
    BATCHNORM = "batchnorm"
    POOLING = "pooling"
    REDUCTION = "reduction"
    EMBEDDING = "embedding"
    MEMORY = "memory"
    VIEW = "view"

    @property
    def is_gemm(self) -> bool:
        return self in (Family.LINEAR, Family.BMM, Family.CONV)


# NVIDIA's convolution performance guide ("Channels In And Out"): a convolution runs efficiently on tensor cores when
# its input and output channels are multiples of 8 in FP16 / BF16 and of 4 in TF32; the forecast runs the others on
# the CUDA cores, at the FP32 rates (Baidu DeepBench's FP16 convolutions with 1 or 3 input channels ran, summed,
# 3-5x slower than the same shapes in FP32 on V100 and T4, where those with aligned channels ran 3-5x faster:
# docs/deepbench.md).
TC_CHANNEL_ALIGN = {"float16": 8, "bfloat16": 8, "tf32": 4}


# Fused attention kernels (flash, memory-efficient, or a chain torch.compile rewrites into one): a bmm row with its
# score GEMM's dims (B·H, Lq, D, Lk) that does the work of all its GEMMs (neusight.kernels.ops_gemm._attention).
ATTENTION_KERNEL, ATTENTION_BWD_KERNEL = "attention", "attention_bwd"
FUSED_ATTENTION = (ATTENTION_KERNEL, ATTENTION_BWD_KERNEL)
# The GEMMs each runs per block of scores: the forward's scores and output; the backward's recomputed scores, then
# the value, probability, query and key gradients.
ATTENTION_GEMMS = {ATTENTION_KERNEL: 2, ATTENTION_BWD_KERNEL: 5}
ATTENTION_BWD_RATIO = ATTENTION_GEMMS[ATTENTION_BWD_KERNEL] / ATTENTION_GEMMS[ATTENTION_KERNEL]   # 2.5

# GEMM kernels whose roofline takes their own byte count, not the dtype's size times the operands' elements
# (kernel-name prefixes): operands stored narrower than their math (FP8 operands with a BF16 output; weights of 8 or
# 4 bits dequantized in the kernel and NVFP4's FP4 operands, every kind of neusight.graph.quant.WEIGHT_QUANT), and
# fused attention, whose score matrix, the output of the GEMM it is modelled as, never reaches DRAM (it reads q, k,
# v and writes the output once).
EXACT_BYTES_GEMMS = ("scaled_mm", "scaled_grouped_mm", "int8_weight_", "int4_weight_", "mxfp4_weight_", "nvfp4_gemm",
                     "nvfp4_grouped_gemm", *FUSED_ATTENTION)


def channel_alignment(c_in: int, c_out: int) -> int:
    """The largest of 1, 2, 4, 8 dividing both channel counts."""
    return next(a for a in (8, 4, 2, 1) if c_in % a == 0 and c_out % a == 0)


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel: what the predictor needs to know about it, nothing about tensors.

    Attributes
    ----------
    family : Family
    name : str
        A short kernel kind, e.g. ``"gemm"``, ``"conv_dgrad"``, ``"add"``, ``"softmax_bwd"``.
    dims : tuple[int, ...]
        Family-specific shape, see :class:`Family`.
    flops : float
        Floating-point operations (a multiply-add counts 2).
    bytes : float
        Minimum DRAM traffic: every input read once, every output written once.
    dtype : str
        Compute dtype, e.g. ``"float32"``.
    algo_flops : float, optional
        The fewest FLOPs a fast algorithm the libraries pick needs (Winograd for 3x3 stride-1
        convolutions); the roofline's compute leg uses it. None = ``flops``.
    channel_align : int, optional
        Convolutions only: the largest of 1, 2, 4, 8 that divides both the input and the output channel counts
        (of the whole convolution, not per group). A convolution is forecast on tensor cores only from
        :data:`TC_CHANNEL_ALIGN` of its precision; None for every other kernel.
    nchw_operands : tuple[int, int, int], optional
        Convolutions that run in PyTorch's default NCHW layout (neither the input nor the weight channels-last):
        the element counts of the forward convolution's (input, weight, output), which cuDNN transposes to NHWC
        and back when it runs the convolution on tensor cores (:mod:`neusight.graph.layout`); None for NHWC
        (``channels_last``) convolutions and every other kernel.
    """

    family: Family
    name: str
    dims: tuple[int, ...]
    flops: float
    bytes: float
    dtype: str = "float32"
    algo_flops: float | None = None
    channel_align: int | None = None
    nchw_operands: tuple[int, int, int] | None = None

    @property
    def min_flops(self) -> float:
        return self.flops if self.algo_flops is None else self.algo_flops

    def __post_init__(self) -> None:
        if self.flops < 0 or self.bytes < 0:
            raise ValueError(f"kernel {self.name}: flops and bytes must be >= 0, got {self.flops}, {self.bytes}")

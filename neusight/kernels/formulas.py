"""Shape-only FLOP and minimum-byte formulas, one per kernel kind; the op registry and the dataset
loader both build their :class:`Kernel` records here, so a kernel means the same in training data and in
a traced model.

Byte counts are the DRAM minimum: each input read once, each output written once (caches may do better
on reuse; the predictor learns the rest).
"""

from __future__ import annotations

import math

from neusight.kernels.base import Family, Kernel, channel_alignment

_ITEMSIZE = {
    "float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "float4_e2m1": 0.5,
}


def itemsize(dtype: str) -> float:
    """Bytes per element of a dtype named like ``"float32"`` (``torch.float32`` works too); FP4 values
    (``"float4_e2m1"``, as an NVFP4 GEMM's operands are labelled) half a byte each."""
    key = str(dtype).removeprefix("torch.")
    try:
        return _ITEMSIZE[key]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_ITEMSIZE)}") from None


def gemm(b: int, m: int, n: int, k: int, *, dtype: str = "float32", family: Family = Family.LINEAR,
         shared_b: bool = False, bias: bool = False, beta_c: bool = False, name: str = "gemm") -> Kernel:
    """B GEMMs of (M x N) @ (N x K) -> (M x K); N is the reduction dimension.

    flops = 2·B·M·N·K (+ B·M·K for a bias or a beta·C add).
    bytes = size · (B·M·N + B'·N·K + B·M·K (+ K for bias, + B·M·K for beta·C)), B' = 1 when the
    right operand is shared across the batch (a Linear weight), else B.
    """
    size = itemsize(dtype)
    flops = 2.0 * b * m * n * k
    elems = b * m * n + (1 if shared_b else b) * n * k + b * m * k
    if bias:
        flops += b * m * k
        elems += k
    if beta_c:
        flops += b * m * k
        elems += b * m * k
    return Kernel(family, name, (b, m, n, k), flops, float(elems * size), str(dtype))


def conv2d_implicit_gemm(batch: int, c_in: int, h: int, w: int, c_out: int, r: int, s: int, *,
                         stride: tuple[int, int] = (1, 1), padding: tuple[int, int] = (0, 0),
                         dilation: tuple[int, int] = (1, 1), groups: int = 1, dtype: str = "float32",
                         name: str = "conv_fwd") -> Kernel:
    """Forward 2-D convolution as an implicit GEMM.

    P = floor((H + 2·pad - dil·(R-1) - 1) / stride) + 1 (same for Q); per group
    M = batch·P·Q, N = (C_in/groups)·R·S, K = C_out/groups; flops = 2·groups·M·N·K.
    bytes = input + weight + output, each once.
    """
    p = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    q = (w + 2 * padding[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    if p <= 0 or q <= 0:
        raise ValueError(f"conv output would be empty: input {h}x{w}, kernel {r}x{s}, stride {stride}, padding {padding}")
    m, n, k = batch * p * q, (c_in // groups) * r * s, c_out // groups
    size = itemsize(dtype)
    elems = batch * c_in * h * w + c_out * (c_in // groups) * r * s + batch * c_out * p * q
    flops = 2.0 * groups * m * n * k
    algo = flops / winograd_speedup(r, s, stride, dilation, groups)
    return Kernel(Family.CONV, name, (groups, m, n, k), flops, float(elems * size), str(dtype), algo,
                  channel_alignment(c_in, c_out))


# Winograd F(2x2, 3x3) computes a 2x2 output tile of a 3x3 convolution with 16 multiplies instead of 36:
# 2.25x fewer FLOPs (Lavin & Gray 2016). cuDNN picks it (or FFT) for 3x3 stride-1 layers; the shared conv
# sweeps contain rows up to 2.25x faster than the direct-convolution roofline and none faster.
WINOGRAD_3X3_SPEEDUP = 2.25


def winograd_speedup(r: int, s: int, stride: tuple[int, int], dilation: tuple[int, int], groups: int) -> float:
    """FLOP reduction a fast algorithm can reach for this convolution (1 = none known)."""
    if (r, s) == (3, 3) and tuple(stride) == (1, 1) and tuple(dilation) == (1, 1) and groups == 1:
        return WINOGRAD_3X3_SPEEDUP
    return 1.0


def rowwise(family: Family, name: str, rows: int, cols: int, *, flops_per_elem: float, bytes_total: float,
            dtype: str = "float32") -> Kernel:
    """A kernel over rows x cols elements with a given FLOP density and a precomputed byte count."""
    return Kernel(family, name, (int(rows), int(cols)), float(flops_per_elem) * rows * cols, float(bytes_total), str(dtype))


def elementwise(name: str, numel: int, *, n_tensor_inputs: int, n_outputs: int = 1, flops_per_elem: float = 1.0,
                cols: int | None = None, dtype: str = "float32") -> Kernel:
    """An n-ary elementwise kernel over ``numel`` output elements.

    bytes = size · numel · (n_tensor_inputs + n_outputs): a broadcast operand is charged in full, an NB
    approximation on the safe side (a broadcast bias read from L2 costs less).
    """
    cols = numel if cols is None or cols <= 0 else cols
    rows = max(1, math.ceil(numel / cols)) if numel else 0
    size = itemsize(dtype)
    return rowwise(Family.ELEMENTWISE, name, rows, cols, flops_per_elem=flops_per_elem,
                   bytes_total=size * numel * (n_tensor_inputs + n_outputs), dtype=dtype)


def softmax(rows: int, cols: int, *, backward: bool = False, dtype: str = "float32") -> Kernel:
    """Softmax over the last dim: forward reads x, writes y (~5 flops/elem: max, sub, exp, sum, div);
    backward reads y and dy, writes dx (~4 flops/elem)."""
    size = itemsize(dtype)
    if backward:
        return rowwise(Family.SOFTMAX, "softmax_bwd", rows, cols, flops_per_elem=4, bytes_total=3 * size * rows * cols, dtype=dtype)
    return rowwise(Family.SOFTMAX, "softmax", rows, cols, flops_per_elem=5, bytes_total=2 * size * rows * cols, dtype=dtype)


def layernorm(rows: int, cols: int, *, backward: bool = False, affine: bool = True, dtype: str = "float32") -> Kernel:
    """LayerNorm over the last dim. Forward: read x (+ gamma, beta), write y, mean, rstd (~8 flops/elem).
    Backward (input grad; the parameter grads reduce in the same pass in PyTorch's kernels, charged
    here): read dy, x, mean, rstd, gamma, write dx (+ dgamma, dbeta), ~14 flops/elem."""
    size = itemsize(dtype)
    params = 2 * cols if affine else 0
    if backward:
        elems = 3 * rows * cols + 2 * rows + params * 2
        return rowwise(Family.LAYERNORM, "layernorm_bwd", rows, cols, flops_per_elem=14, bytes_total=size * elems, dtype=dtype)
    elems = 2 * rows * cols + 2 * rows + params
    return rowwise(Family.LAYERNORM, "layernorm", rows, cols, flops_per_elem=8, bytes_total=size * elems, dtype=dtype)


# FLOPs per output element of elementwise ops (keyed by the aten name without a trailing "_"). Only the
# transcendental-heavy ones differ from 1; all of them are memory-bound on every GPU we model, so these
# matter for arithmetic intensity only. gelu: the tanh approximation ~ 8 mul/add + tanh; pow by a scalar: ~2.
ELEMENTWISE_FLOPS: dict[str, float] = {
    "gelu": 10.0, "gelu_backward": 14.0, "tanh": 4.0, "tanh_backward": 2.0, "sigmoid": 4.0, "sigmoid_backward": 2.0,
    "silu": 5.0, "silu_backward": 8.0, "exp": 2.0, "log": 2.0, "log1p": 2.0, "expm1": 2.0, "erf": 4.0, "pow": 2.0,
    "sqrt": 2.0, "rsqrt": 2.0, "div": 1.0, "reciprocal": 1.0, "sin": 4.0, "cos": 4.0, "softplus": 4.0, "mish": 8.0,
    "elu": 3.0, "addcmul": 2.0, "addcdiv": 2.0, "lerp": 2.0, "native_dropout": 2.0, "native_dropout_backward": 1.0,
    "relu": 1.0, "threshold_backward": 1.0, "fill": 0.0, "zero": 0.0, "uniform": 2.0, "normal": 4.0, "bernoulli": 2.0,
    "sgn": 6.0,   # a complex z / |z|
    "glu": 5.0, "glu_backward": 8.0,   # a sigmoid and a product
    "log_sigmoid_forward": 5.0, "log_sigmoid_backward": 5.0, "erfinv": 8.0, "erfc": 4.0, "tan": 4.0,
    "asin": 4.0, "acos": 4.0, "atan": 4.0, "sinh": 4.0, "cosh": 4.0, "asinh": 4.0, "acosh": 4.0, "atanh": 4.0,
    "log2": 2.0, "log10": 2.0, "exp2": 2.0, "lgamma": 8.0, "digamma": 8.0,
}

"""GEMM-family builders: mm, addmm, bmm, baddbmm, linear, matmul leftovers, and convolutions."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from neusight.graph.records import OpCall, TensorMeta
from neusight.kernels import formulas
from neusight.kernels.base import (ATTENTION_BWD_KERNEL, ATTENTION_BWD_RATIO, ATTENTION_KERNEL, Family, Kernel,
                                   channel_alignment)
from neusight.kernels.registry import register

aten = torch.ops.aten


def _col_major(t: TensorMeta) -> bool:
    """A 2-D operand stored column-major (a transposed view, e.g. ``W.t()``): cuBLAS reads it as is, with
    its transpose flag set, instead of copying it."""
    rows, cols = t.shape
    return len(t.stride) == 2 and cols > 1 and t.stride[0] == 1 and t.stride[1] >= max(rows, 1)


def gemm_layout(a: TensorMeta, b: TensorMeta) -> str:
    """cuBLAS's operand layout of ``a @ b`` (2-D, row-major PyTorch): ``"tn"``, ``"nn"``, ``"nt"`` or ``"tt"``,
    the suffix of its kernel names. cuBLAS is column-major, so PyTorch computes C^T = b^T a^T: the first letter
    is b's transpose flag, the second a's. nn.Linear's forward (x @ W^T) is ``tn``, its input gradient
    (dy @ W) ``nn``, its weight gradient (dy^T @ x) ``nt``; a GPT-2 Conv1D forward (x @ W) is ``nn``."""
    return ("t" if _col_major(b) else "n") + ("t" if _col_major(a) else "n")


@register(aten.mm)
def _mm(c: OpCall) -> list[Kernel]:
    """(M x N) @ (N x K)."""
    a, b = c.args[0], c.args[1]
    return [formulas.gemm(1, a.shape[0], a.shape[1], b.shape[1], dtype=a.dtype, shared_b=True,
                          name=f"mm_{gemm_layout(a, b)}")]


@register(aten.addmm)
def _addmm(c: OpCall) -> list[Kernel]:
    """bias + (M x N) @ (N x K); cuBLAS folds a broadcast bias into the epilogue (beta = 1)."""
    bias, a, b = c.args[0], c.args[1], c.args[2]
    full_c = bias.numel == a.shape[0] * b.shape[1]
    return [formulas.gemm(1, a.shape[0], a.shape[1], b.shape[1], dtype=a.dtype, shared_b=True,
                          bias=not full_c, beta_c=full_c, name=f"addmm_{gemm_layout(a, b)}")]


@register(aten._scaled_mm)
def _scaled_mm(c: OpCall) -> list[Kernel]:
    """FP8 (M x N) @ (N x K) with per-tensor or per-row scales (``torch._scaled_mm``, FP32 accumulate): the
    operands are read in their FP8 bytes, the output written in ``out_dtype`` (an optional bias added in the
    epilogue). The kernel's dtype is the operands' FP8 type, so it runs at the FP8 tensor peak."""
    a, b, out = c.args[0], c.args[1], c.outputs[0]
    bias = c.args[4] if len(c.args) > 4 else c.kwargs.get("bias")
    k = formulas.gemm(1, a.shape[0], a.shape[1], b.shape[1], dtype=a.dtype, shared_b=True,
                      bias=isinstance(bias, TensorMeta), name=f"scaled_mm_{gemm_layout(a, b)}")
    nbytes = (a.numel * a.itemsize + b.numel * b.itemsize + out.numel * out.itemsize
              + (bias.numel * bias.itemsize if isinstance(bias, TensorMeta) else 0))
    return [dataclasses.replace(k, bytes=float(nbytes))]


@register(aten._scaled_grouped_mm)
def _scaled_grouped_mm(c: OpCall) -> list[Kernel]:
    """FP8 grouped GEMM of a mixture of experts' layer: rows (sum over the groups) x in @ experts x (in x out),
    traced with equal groups (balanced routing), so a batched GEMM of (experts x rows / experts x in) @ (in x out);
    FP8 operands, the output in ``out_dtype``."""
    a, b, out = c.args[0], c.args[1], c.outputs[0]
    groups = b.shape[0]
    rows = a.shape[0] // groups
    k = formulas.gemm(groups, rows, a.shape[1], b.shape[2], dtype=a.dtype, family=Family.BMM,
                      name="scaled_grouped_mm")
    nbytes = a.numel * a.itemsize + b.numel * b.itemsize + out.numel * out.itemsize
    return [dataclasses.replace(k, bytes=float(nbytes))]


@register(aten.bmm)
def _bmm(c: OpCall) -> list[Kernel]:
    """(B x M x N) @ (B x N x K)."""
    a, b = c.args[0], c.args[1]
    return [formulas.gemm(a.shape[0], a.shape[1], a.shape[2], b.shape[2], dtype=a.dtype, family=Family.BMM, name="bmm")]


@register(aten.baddbmm)
def _baddbmm(c: OpCall) -> list[Kernel]:
    """beta * C + alpha * (B x M x N) @ (B x N x K)."""
    a, b = c.args[1], c.args[2]
    beta = c.kwargs.get("beta", c.args[3] if len(c.args) > 3 else 1)
    return [formulas.gemm(a.shape[0], a.shape[1], a.shape[2], b.shape[2], dtype=a.dtype, family=Family.BMM,
                          beta_c=beta != 0, name="baddbmm")]


@register(aten.linear)
def _linear(c: OpCall) -> list[Kernel]:
    """x (..., N) @ W^T (N -> K) (+ bias): one GEMM over all leading dims."""
    x, w = c.args[0], c.args[1]
    bias = c.args[2] if len(c.args) > 2 else c.kwargs.get("bias")
    m = math.prod(x.shape[:-1])
    return [formulas.gemm(1, m, x.shape[-1], w.shape[0], dtype=x.dtype, shared_b=True,
                          bias=isinstance(bias, TensorMeta), name="linear_tn")]


def _conv_params(c: OpCall, first: int, x: TensorMeta) -> tuple:
    """(stride, padding, dilation, transposed, groups) from aten.convolution-style positional args, each of the
    first three one entry per spatial dim of ``x``: aten takes a single entry for all of them (``padding="valid"``
    reaches it as ``[0]``, as in SigLIP's patch embedding)."""
    a = c.args
    spatial = len(x.shape) - 2

    def per_dim(v: Any) -> tuple:
        v = tuple(v)
        return v * spatial if len(v) == 1 else v

    return (per_dim(a[first]), per_dim(a[first + 1]), per_dim(a[first + 2]), bool(a[first + 3]),
            int(a[first + 5]))


def _conv_kernel(x: TensorMeta, w: TensorMeta, stride, padding, dilation, groups, name: str) -> Kernel:
    """Forward-shaped implicit GEMM of a 1-, 2- or 3-D convolution (extra spatial dims fold into M and N)."""
    spatial = len(x.shape) - 2
    if spatial == 1:
        return formulas.conv2d_implicit_gemm(x.shape[0], x.shape[1], 1, x.shape[2], w.shape[0], 1, w.shape[2],
                                             stride=(1, stride[0]), padding=(0, padding[0]),
                                             dilation=(1, dilation[0]), groups=groups, dtype=x.dtype, name=name)
    if spatial == 2:
        return formulas.conv2d_implicit_gemm(x.shape[0], x.shape[1], x.shape[2], x.shape[3], w.shape[0], w.shape[2],
                                             w.shape[3], stride=stride, padding=padding, dilation=dilation,
                                             groups=groups, dtype=x.dtype, name=name)
    # NB: 3-D: treat the leading spatial dim as extra batch through an equivalent 2-D shape (same FLOPs).
    k2 = formulas.conv2d_implicit_gemm(x.shape[0], x.shape[1] * w.shape[2], x.shape[3], x.shape[4], w.shape[0],
                                       w.shape[3], w.shape[4], stride=stride[1:], padding=padding[1:],
                                       dilation=dilation[1:], groups=groups, dtype=x.dtype, name=name)
    d_out = (x.shape[2] + 2 * padding[0] - dilation[0] * (w.shape[2] - 1) - 1) // stride[0] + 1
    g, m, n, k = k2.dims
    return Kernel(Family.CONV, name, (g, m * d_out, n, k), k2.flops * d_out, k2.bytes, x.dtype, k2.flops * d_out,
                  channel_alignment(x.shape[1], w.shape[0]))


def _channels_last(t: TensorMeta) -> bool:
    """A 4-D (5-D) tensor whose strides say NHWC (NDHWC), as PyTorch's ``suggest_memory_format`` reads them: going
    through the dims C, W, H (, D), N, each stride is at least the span of the dims before it. Strides that fit
    both layouts (a contiguous N x C x 1 x 1) read as the default NCHW, as PyTorch reads them."""
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(len(t.shape))
    if order is None or len(t.stride) != len(t.shape) or t.stride[1] == 0:
        return False
    span = 0
    for d in order:
        if t.shape[d] == 0 or t.stride[d] < span or (d == 0 and span == t.stride[1]):
            return False
        span = t.stride[d] * (t.shape[d] if t.shape[d] > 1 else 1)
    return True


def _nchw_operands(x: TensorMeta, w: TensorMeta, y: TensorMeta) -> tuple[int, int, int] | None:
    """(input, weight, output) element counts of a convolution cuDNN is handed in NCHW, None for one it runs in
    NHWC: PyTorch picks channels-last for a 2-D (3-D) convolution when its input or its weight is channels-last
    (``cudnn_conv_suggest_memory_format``); 1-D convolutions are NCHW always."""
    if len(w.shape) in (4, 5) and (_channels_last(x) or _channels_last(w)):
        return None
    return (x.numel, w.numel, y.numel)


STRIDED_SUFFIX = "_strided"   # conv_dgrad_strided, conv_wgrad_strided: gradients of a conv with stride > 1
DEPTHWISE_PREFIX = "conv_dw_"   # kernel names of depthwise convolutions: conv_dw_fwd, conv_dw_dgrad, conv_dw_wgrad


def _is_depthwise(x: TensorMeta, groups: int, transposed: bool = False) -> bool:
    """A 2-D convolution with one input channel per group (MobileNet / EfficientNet depthwise layers)."""
    return len(x.shape) == 4 and groups > 1 and x.shape[1] == groups and not transposed


def _depthwise_kernels(x: TensorMeta, w: TensorMeta, y: TensorMeta, stride, padding, dilation, groups: int,
                       parts: tuple[str, ...]) -> list[Kernel]:
    """A depthwise convolution is a stencil, not a GEMM: each output element reads R x S inputs of its own
    channel (1 x R x S "GEMM" per pixel), which PyTorch runs as direct CUDA kernels (FP32 NCHW:
    ``conv_depthwise2d``). So its forward and data gradient are window ops over the channel planes (the
    pooling family: memory-bound kernels, predicted by the elementwise model on their bytes) and its weight
    gradient a reduction of x * dy over batch and pixels per weight. ``parts``: any of fwd, dgrad, wgrad.
    Each has the implicit GEMM's FLOPs: 2 x R x S per output element (x the channel multiplier)."""
    flops = _conv_kernel(x, w, stride, padding, dilation, groups, "conv").flops
    size = formulas.itemsize(x.dtype)
    nbytes = float(size * (x.numel + w.numel + y.numel))   # every part reads two of x, w, y and writes the third
    n, taps = x.shape[0], math.prod(w.shape[1:])
    shapes = {"fwd": (Family.POOLING, n * y.shape[1], math.prod(y.shape[2:])),
              "dgrad": (Family.POOLING, n * x.shape[1], math.prod(x.shape[2:])),
              "wgrad": (Family.REDUCTION, w.shape[0] * taps, n * math.prod(y.shape[2:]))}
    out = []
    for part in parts:
        family, rows, cols = shapes[part]
        out.append(formulas.rowwise(family, f"{DEPTHWISE_PREFIX}{part}", rows, cols, flops_per_elem=flops / max(1, rows * cols),
                                    bytes_total=nbytes, dtype=x.dtype))
    return out


@register(aten.convolution, aten._convolution, aten.cudnn_convolution)
def _convolution(c: OpCall) -> list[Kernel]:
    """Forward convolution (+ a bias add kernel when a bias is given)."""
    x, w, bias = c.args[0], c.args[1], c.args[2] if len(c.args) > 2 else None
    stride, padding, dilation, transposed, groups = _conv_params(c, 3, x)
    layout = _nchw_operands(x, w, c.outputs[0])
    if transposed:
        # a transposed conv is the data gradient of the conv that maps its output back to its input: that conv's
        # GEMM, over the output y, with the transposed conv's weight (C_in, C_out / groups, ...) as its own
        # (out channels, in channels / groups, ...)
        k = _conv_kernel(c.outputs[0], w, stride, padding, dilation, groups, "conv_transpose")
        ks = [dataclasses.replace(k, nchw_operands=layout)]
    elif _is_depthwise(x, groups):
        ks = _depthwise_kernels(x, w, c.outputs[0], stride, padding, dilation, groups, ("fwd",))
    else:
        ks = [dataclasses.replace(_conv_kernel(x, w, stride, padding, dilation, groups, "conv_fwd"),
                                  nchw_operands=layout)]
    if isinstance(bias, TensorMeta):
        out = c.outputs[0]
        ks.append(formulas.elementwise("conv_bias", out.numel, n_tensor_inputs=1, cols=math.prod(out.shape[2:]) or 1,
                                       dtype=out.dtype))
    return ks


@register(aten.convolution_backward)
def _convolution_backward(c: OpCall) -> list[Kernel]:
    """Data gradient and weight gradient as two GEMMs of the forward's FLOPs; a bias gradient is a reduction."""
    dy, x, w = c.args[0], c.args[1], c.args[2]
    stride, padding, dilation, transposed, groups = _conv_params(c, 4, x)
    mask = c.args[10] if len(c.args) > 10 else (True, True, True)
    if _is_depthwise(x, groups, transposed):
        parts = tuple(name for name, on in zip(("dgrad", "wgrad"), mask[:2]) if on)
        ks = _depthwise_kernels(x, w, dy, stride, padding, dilation, groups, parts)
        return ks + ([_bias_grad(dy)] if len(mask) > 2 and mask[2] else [])
    # the GEMM of the underlying conv: over x, or for a transposed conv over its output (dy), as in _convolution
    fwd = _conv_kernel(dy if transposed else x, w, stride, padding, dilation, groups, "conv")
    layout = _nchw_operands(x, w, dy)
    g, m, n, k = fwd.dims
    size = formulas.itemsize(x.dtype)
    # A strided convolution's gradients are kernels of their own in cuDNN (the data gradient scatters into
    # an input larger than the output): named apart so the predictor can tell them (CONV_BACKWARD_CLASSES).
    # A transposed conv's data gradient is an ordinary strided forward convolution: no strided-gradient kernel.
    suffix = STRIDED_SUFFIX if max(stride) > 1 else ""
    ks = []
    # NB: cuDNN has Winograd variants for the data and the weight gradient of 3x3 stride-1 layers too.
    if mask[0]:  # dX (M x N) = dY (M x K) @ W^T (K x N): reduction over K; transposed: the underlying forward
        ks.append(Kernel(Family.CONV, "conv_dgrad" + ("" if transposed else suffix),
                         (g, m, n, k) if transposed else (g, m, k, n), fwd.flops,
                         float(size * (dy.numel + w.numel + x.numel)), x.dtype, fwd.algo_flops, fwd.channel_align,
                         layout))
    if mask[1]:  # dW (N x K) = X^T (N x M) @ dY (M x K): reduction over M
        ks.append(Kernel(Family.CONV, "conv_wgrad" + suffix, (g, n, m, k), fwd.flops,
                         float(size * (dy.numel + x.numel + w.numel)), x.dtype, fwd.algo_flops, fwd.channel_align,
                         layout))
    if len(mask) > 2 and mask[2]:
        ks.append(_bias_grad(dy))
    return ks


def _bias_grad(dy: TensorMeta) -> Kernel:
    """A conv's bias gradient: dy summed over batch and pixels per channel."""
    cols = math.prod(dy.shape[2:]) or 1
    return Kernel(Family.REDUCTION, "conv_bgrad", (dy.numel // cols, cols), float(dy.numel),
                  float(formulas.itemsize(dy.dtype) * (dy.numel + dy.shape[1])), dy.dtype)


def _attention(q: TensorMeta, k: TensorMeta, v: TensorMeta, causal: bool, extra: list[TensorMeta],
               outs: list[TensorMeta], backward: bool, name: str) -> Kernel:
    """Fused attention over (B, H, Lq, D) x (B, H, Lk, D): forward = two GEMMs, 4·B·H·Lq·Lk·D FLOPs
    (halved when causal, since masked tiles are skipped); backward recomputes the scores: 5 GEMMs, 2.5x.
    Dims are the score GEMM's: (B·H, Lq, D, Lk); with grouped-query keys and values (fewer heads than the queries)
    (B·H_kv, Lq·group, D, Lk), each key and value head serving its group of query heads as one GEMM, as flash
    kernels pack them, so that the GEMM model reads each cached key and value once. Bytes: q, k, v, out (+ bias,
    log-sum-exp) once. The predictor tiles it as flash kernels run and adds its softmax's time
    (neusight.predictor.features._gemm, neusight.tiles.softmax_seconds_per_score)."""
    bh_q, bh = math.prod(q.shape[:-2]), math.prod(k.shape[:-2])
    group = bh_q // bh if bh and bh_q % bh == 0 else 1
    bh = bh_q // group
    lq, d, lk = q.shape[-2] * group, q.shape[-1], k.shape[-2]
    flops = 4.0 * bh * lq * lk * d * (0.5 if causal else 1.0) * (ATTENTION_BWD_RATIO if backward else 1.0)
    nbytes = sum(t.view_nbytes for t in [q, k, v] + extra + outs)
    return Kernel(Family.BMM, name, (bh, lq, d, lk), flops, float(nbytes), q.dtype)


@register(aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
          aten._scaled_dot_product_cudnn_attention)
def _sdpa(c: OpCall) -> list[Kernel]:
    """Fused scaled-dot-product attention (memory-efficient / flash / cuDNN kernels)."""
    q, k, v = c.args[:3]
    # is_causal's position: flash (q, k, v, dropout_p, is_causal, ...); the memory-efficient and cuDNN kernels
    # (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, ...)
    at = 4 if c.op.startswith("aten._scaled_dot_product_flash_attention") else 6
    causal = bool(c.args[at]) if len(c.args) > at else bool(c.kwargs.get("is_causal", False))
    extra = [t for t in c.args[3:] if isinstance(t, TensorMeta)]
    return [_attention(q, k, v, causal, extra, list(c.outputs[:2]), False, ATTENTION_KERNEL)]


@register(aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_flash_attention_backward,
          aten._scaled_dot_product_cudnn_attention_backward)
def _sdpa_bwd(c: OpCall) -> list[Kernel]:
    """Backward of fused attention: reads dO, q, k, v, O, lse; writes dq, dk, dv (+ dbias)."""
    do, q, k, v = c.args[:4]
    causal = bool(c.kwargs.get("is_causal", False)) or any(a is True for a in c.args[6:])
    extra = [do] + [t for t in c.args[4:] if isinstance(t, TensorMeta)]
    return [_attention(q, k, v, causal, extra, list(c.outputs), True, ATTENTION_BWD_KERNEL)]


def conv2d_pass_kernels(batch: int, c_in: int, h: int, w: int, c_out: int, r: int, s: int, *,
                        stride: tuple[int, int] = (1, 1), padding: tuple[int, int] = (0, 0),
                        dtype: str = "float32") -> dict[str, Kernel]:
    """The forward, data-gradient and weight-gradient kernels of one 2-D convolution (no bias, dilation 1,
    one group), exactly as a traced model gets them: {"fwd": ..., "dgrad": ..., "wgrad": ...}. For kernel
    benchmarks that time the three passes of a shape (Baidu DeepBench)."""
    def meta(shape: tuple[int, ...]) -> TensorMeta:
        numel = math.prod(shape)
        return TensorMeta(tuple(shape), dtype, (), 0, numel * formulas.itemsize(dtype))

    p = (h + 2 * padding[0] - (r - 1) - 1) // stride[0] + 1
    q = (w + 2 * padding[1] - (s - 1) - 1) // stride[1] + 1
    if min(batch, c_in, h, w, c_out, r, s, *stride) <= 0 or min(padding) < 0 or p <= 0 or q <= 0:
        raise ValueError(f"impossible convolution: input {batch}x{c_in}x{h}x{w}, {c_out} filters of {r}x{s}, "
                         f"stride {stride}, padding {padding} (output {p}x{q})")
    x, wt, y = meta((batch, c_in, h, w)), meta((c_out, c_in, r, s)), meta((batch, c_out, p, q))
    conv = ([*stride], [*padding], [1, 1], False, [0, 0], 1)
    fwd = _convolution(OpCall("aten.convolution.default", torch.ops.aten.convolution, (x, wt, None, *conv), {}, (y,)))
    bwd = _convolution_backward(OpCall("aten.convolution_backward.default", torch.ops.aten.convolution_backward,
                                       (y, x, wt, None, *conv, (True, True, False)), {}, (x, wt)))
    return {"fwd": fwd[0], "dgrad": bwd[0], "wgrad": bwd[1]}

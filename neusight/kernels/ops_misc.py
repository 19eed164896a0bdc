"""Builders for every non-GEMM family: views (free), elementwise, softmax, norms, pooling, reductions,
embedding, copies and factories, and the optimizers' foreach kernels.

Byte counts: every tensor input read once at its own size (a broadcast operand counts its own elements,
not the output's), every output written once. FLOPs per element come from ``formulas.ELEMENTWISE_FLOPS``.
"""

from __future__ import annotations

import math

import torch

from neusight.graph.records import OpCall, TensorMeta
from neusight.kernels import formulas
from neusight.kernels.base import Family, Kernel
from neusight.kernels.registry import aten_packets, register

aten = torch.ops.aten


def _ops(*names: str) -> list:
    """Overload packets by name, skipping any this torch build does not have."""
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def _nbytes(ts: list[TensorMeta]) -> float:
    return float(sum(t.view_nbytes for t in ts))


def _rows_cols(t: TensorMeta, dim: int | None = -1) -> tuple[int, int]:
    """View a tensor as rows x cols with cols = size of ``dim`` (the last by default)."""
    n = t.numel
    if not t.shape:
        return 1, 1
    cols = t.shape[dim if dim is not None else -1] or 1
    return max(1, n // cols), cols


def _short(c: OpCall) -> str:
    return c.op.split(".")[1]


# ------------------------------------------------------------------------------------------------ views
VIEW_OPS = _ops("view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "unsqueeze",
                "squeeze", "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "narrow", "alias",
                "detach", "as_strided", "as_strided_", "diagonal", "unfold", "view_as", "expand_as", "movedim", "lift_fresh",
                "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
                "_to_dense", "numpy_T", "view_as_real", "view_as_complex", "dropout", "_conj", "conj", "_neg_view",
                "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk")


@register(*VIEW_OPS)
def _view(c: OpCall) -> list[Kernel]:
    """Views and allocations without initialisation launch no kernel."""
    return []


# ------------------------------------------------------------------------------------------ elementwise
# aten ops that draw random numbers (what they make cannot be recomputed from their inputs)
RANDOM_OPS = ("uniform_", "normal_", "bernoulli_", "bernoulli", "exponential_", "random_", "rand", "randn",
              "rand_like", "randn_like", "randint", "native_dropout")
ELEMENTWISE_OPS = _ops(
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "pow", "pow_", "neg", "neg_", "abs", "abs_",
    "exp", "exp_", "log", "log_", "log1p", "expm1", "sqrt", "sqrt_", "rsqrt", "rsqrt_", "reciprocal", "sin", "cos",
    "tanh", "tanh_", "sigmoid", "sigmoid_", "relu", "relu_", "gelu", "gelu_", "silu", "silu_", "erf", "floor", "ceil",
    "round", "sign", "threshold", "threshold_backward", "gelu_backward", "tanh_backward", "sigmoid_backward",
    "silu_backward", "hardtanh", "hardtanh_", "hardtanh_backward", "leaky_relu", "leaky_relu_", "leaky_relu_backward",
    "elu", "elu_backward", "softplus", "softplus_backward", "mish", "hardswish", "hardsigmoid", "clamp", "clamp_",
    "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "minimum", "maximum", "eq", "ne", "lt", "le", "gt", "ge",
    "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "bitwise_and_", "bitwise_or_", "logical_and",
    "logical_or", "logical_not", "logical_and_", "logical_or_", "logical_xor", "sign_", "floor_divide",
    "where", "masked_fill", "masked_fill_", "remainder", "fmod", "lerp", "lerp_", "addcmul", "addcmul_", "addcdiv",
    "addcdiv_", "square", "isnan", "isinf", "nan_to_num", "logit", "trunc", "frac", "fill_", "zero_",
    *RANDOM_OPS, "_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl",
    "_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward",
    "native_dropout_backward", "_masked_scale", "masked_scatter", "masked_scatter_backward", "triu", "tril", "polar",
    "atan2", "sgn", "sgn_",
    "glu", "glu_backward", "_prelu_kernel", "_prelu_kernel_backward", "_weight_norm_interface",
    "_weight_norm_interface_backward", "log_sigmoid_forward", "log_sigmoid_backward", "erfinv", "erfinv_", "erfc",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "log2", "log10", "exp2", "lgamma",
    "digamma", "sinc", "hypot", "xlogy", "special_xlog1py",
)


@register(*ELEMENTWISE_OPS)
def _elementwise(c: OpCall) -> list[Kernel]:
    """n-ary elementwise over the output's elements; bytes = each tensor input at its own size + outputs."""
    ins, outs = c.tensor_args(), c.outputs
    if not outs:
        return []
    main = max(outs, key=lambda t: t.numel)
    rows, cols = _rows_cols(main)
    fpe = formulas.ELEMENTWISE_FLOPS.get(_short(c).rstrip("_"), 1.0)
    if c.op.startswith("aten.fill_") or c.op.startswith("aten.zero_"):
        ins = []  # a fill writes only
    return [formulas.rowwise(Family.ELEMENTWISE, _short(c), rows, cols, flops_per_elem=fpe,
                             bytes_total=_nbytes(ins) + _nbytes(list(outs)), dtype=main.dtype)]


@register(*_ops("_fft_r2c", "_fft_c2r", "_fft_c2c"))
def _fft(c: OpCall) -> list[Kernel]:
    """A cuFFT transform over ``dim`` (``torch.fft.*``): one kernel reading its input and writing its output once
    (NB: cuFFT runs a transform that fits in shared memory in one pass, larger ones in several; one pass is
    charged), 5·n·log2(n) FLOPs per complex transform of n points, half that for a real input or output; the
    family of memory-bound kernels, whose roofline takes the larger of its FLOP and byte bounds."""
    x, outs = c.tensor_args()[0], c.outputs
    if not outs or not x.numel:
        return []
    out = outs[0]
    dims = [d % max(1, len(x.shape)) for d in c.args[1]]
    real = c.op.startswith(("aten._fft_r2c", "aten._fft_c2r"))
    # the transform's length: the real side's sizes (c2r: the output's, given by last_dim_size)
    side = out if c.op.startswith("aten._fft_c2r") else x
    n = math.prod(side.shape[d] for d in dims) or 1
    transforms = side.numel // n
    flops = transforms * 5.0 * n * math.log2(max(n, 2)) * (0.5 if real else 1.0)
    return _elementwise_total(c, out, flops, x.view_nbytes + out.view_nbytes, _real_dtype(x.dtype))


@register(*_ops("_cdist_forward", "_cdist_backward"))
def _cdist(c: OpCall) -> list[Kernel]:
    """``torch.cdist``'s direct kernel (PyTorch takes it over its matmul form for small sets or p != 2): every
    pair of rows, a difference, a power and a sum per feature (3 FLOPs; 4 in the backward, which also reads the
    distances); bytes = inputs + outputs. ``_cdist_forward(x1, x2, p, mode)`` makes (..., P, R);
    ``_cdist_backward(grad, x1, x2, p, cdist)`` makes x1's gradient."""
    ins, outs = c.tensor_args(), c.outputs
    if not outs:
        return []
    backward = c.op.startswith("aten._cdist_backward")
    pairs = ins[0] if backward else outs[0]
    x1 = ins[1] if backward else ins[0]
    flops = (4.0 if backward else 3.0) * pairs.numel * (x1.shape[-1] if x1.shape else 1)
    return _elementwise_total(c, outs[0], flops, _nbytes(ins) + _nbytes(list(outs)), outs[0].dtype)


@register(*_ops("_trilinear"))
def _trilinear(c: OpCall) -> list[Kernel]:
    """``nn.Bilinear``'s (and ``F.bilinear``'s) product of three broadcast tensors summed over some dims:
    ``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, ...)``, each ``i`` unsqueezed at its ``expand``
    dims. 3 FLOPs per element of the broadcast product (two multiplies, one add); bytes = inputs + output. NB:
    one kernel, where ATen runs it as a few batched matmuls: a bound on the safe side of their FLOPs."""
    ins, outs = c.tensor_args(), c.outputs
    if not outs or len(ins) < 3:
        return []
    shapes = []
    for t, expand in zip(ins[:3], c.args[3:6]):
        shape = list(t.shape)
        for d in sorted(expand):
            shape.insert(d, 1)
        shapes.append(shape)
    product = math.prod(max(sizes) for sizes in zip(*shapes)) if shapes[0] else 1
    return _elementwise_total(c, outs[0], 3.0 * product, _nbytes(ins) + _nbytes(list(outs)), outs[0].dtype)


def _elementwise_total(c: OpCall, out: TensorMeta, flops: float, nbytes: float, dtype: str) -> list[Kernel]:
    """One kernel of the memory-bound (elementwise) family over ``out``'s rows x cols, with ``flops`` in all (for
    kernels whose work is not a fixed count per output element: transforms, pairwise distances, products)."""
    rows, cols = _rows_cols(out)
    return [formulas.rowwise(Family.ELEMENTWISE, _short(c), rows, cols, flops_per_elem=flops / max(1, rows * cols),
                             bytes_total=float(nbytes), dtype=dtype)]


def _real_dtype(dtype: str) -> str:
    """The real dtype of a complex one's parts (``complex64`` -> ``float32``); other dtypes as they are."""
    return {"complex32": "float16", "complex64": "float32", "complex128": "float64"}.get(
        str(dtype).removeprefix("torch."), str(dtype))


FOREACH_OPS = [p for p in aten_packets("_foreach_") if p.__name__ not in ("_foreach_norm",)]


@register(*FOREACH_OPS)
def _foreach(c: OpCall) -> list[Kernel]:
    """NB: a multi-tensor-apply launch over a list of tensors; charged as one elementwise kernel over all
    their elements (CUDA splits it into a few launches of ~100 tensors each, ignored here)."""
    lists = [a for a in list(c.args) + list(c.kwargs.values()) if isinstance(a, (list, tuple)) and a and isinstance(a[0], TensorMeta)]
    if not lists:
        return []
    numel = sum(t.numel for t in lists[0])
    size = formulas.itemsize(lists[0][0].dtype)
    inplace = c.op.split(".")[1].endswith("_")
    writes = 1 if (inplace or c.outputs) else 0
    reads = 0 if _short(c) in ("_foreach_zero_", "_foreach_fill_") else len(lists)    # a memset reads nothing
    fpe = formulas.ELEMENTWISE_FLOPS.get(_short(c).removeprefix("_foreach_").rstrip("_"), 1.0)
    cols = max(t.shape[-1] if t.shape else 1 for t in lists[0])
    return [formulas.rowwise(Family.ELEMENTWISE, _short(c), max(1, numel // cols), cols, flops_per_elem=fpe,
                             bytes_total=float(size * numel * (reads + writes)), dtype=lists[0][0].dtype)]


@register(*_ops("_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"))
def _grad_scaler(c: OpCall) -> list[Kernel]:
    """torch.cuda.amp.GradScaler's kernels: the unscale pass (one multi-tensor launch multiplying every gradient by
    1 / scale and checking it for inf / NaN: each gradient read and written once) and the scale update (a few
    scalars)."""
    lists = [a for a in c.args if isinstance(a, (list, tuple)) and a and isinstance(a[0], TensorMeta)]
    if not lists:   # _amp_update_scale_: one thread's worth of scalar arithmetic
        return [formulas.rowwise(Family.ELEMENTWISE, _short(c), 1, 1, flops_per_elem=4.0, bytes_total=16.0,
                                 dtype="float32")]
    grads = lists[0]
    numel = sum(t.numel for t in grads)
    cols = max(t.shape[-1] if t.shape else 1 for t in grads)
    return [formulas.rowwise(Family.ELEMENTWISE, _short(c), max(1, numel // cols), cols, flops_per_elem=2.0,
                             bytes_total=float(formulas.itemsize(grads[0].dtype) * numel * 2), dtype=grads[0].dtype)]


@register(*_ops("_fused_adam_", "_fused_adamw_"))
def _fused_adam(c: OpCall) -> list[Kernel]:
    """Fused Adam(W): one multi-tensor pass reading parameter, gradient and both moments and writing back the
    parameter and the moments (28 bytes per FP32 parameter), about 16 FLOPs per element."""
    lists = [a for a in c.args if isinstance(a, (list, tuple)) and a and isinstance(a[0], TensorMeta)]
    params = lists[0] if lists else []
    if not params:
        return []
    numel = sum(t.numel for t in params)
    size = formulas.itemsize(params[0].dtype)
    cols = max(t.shape[-1] if t.shape else 1 for t in params)
    return [formulas.rowwise(Family.ELEMENTWISE, _short(c), max(1, numel // cols), cols, flops_per_elem=16.0,
                             bytes_total=float(size * numel * 7), dtype=params[0].dtype)]


# ----------------------------------------------------------------------------------- softmax and norms
@register(*_ops("_softmax", "_log_softmax", "_safe_softmax"))
def _softmax(c: OpCall) -> list[Kernel]:
    x = c.args[0]
    rows, cols = _rows_cols(x, c.args[1])
    return [formulas.softmax(rows, cols, dtype=x.dtype)]


@register(*_ops("_softmax_backward_data", "_log_softmax_backward_data"))
def _softmax_bwd(c: OpCall) -> list[Kernel]:
    dy = c.args[0]
    rows, cols = _rows_cols(dy, c.args[2])
    return [formulas.softmax(rows, cols, backward=True, dtype=dy.dtype)]


@register(*_ops("native_layer_norm", "native_group_norm", "_fused_rms_norm", "rms_norm"))
def _layer_norm(c: OpCall) -> list[Kernel]:
    """Normalisation over the trailing ``normalized_shape`` (group norm: over each group)."""
    x = c.args[0]
    if c.op.startswith("aten.native_group_norm"):
        n, ch, hw, groups = c.args[3], c.args[4], c.args[5], c.args[6]
        rows, cols = n * groups, (ch // groups) * hw
    else:
        cols = math.prod(c.args[1])
        rows = max(1, x.numel // max(cols, 1))
    affine = any(isinstance(a, TensorMeta) for a in c.args[2:4])
    return [formulas.layernorm(rows, cols, affine=affine, dtype=x.dtype)]


@register(*_ops("native_layer_norm_backward", "native_group_norm_backward", "_fused_rms_norm_backward"))
def _layer_norm_bwd(c: OpCall) -> list[Kernel]:
    dy = c.args[0]
    if c.op.startswith("aten.native_group_norm"):
        n, ch, hw, groups = c.args[5], c.args[6], c.args[7], c.args[8]
        rows, cols = n * groups, (ch // groups) * hw
    else:
        cols = math.prod(c.args[2])
        rows = max(1, dy.numel // max(cols, 1))
    return [formulas.layernorm(rows, cols, backward=True, dtype=dy.dtype)]


BATCHNORM_OPS = _ops("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                     "cudnn_batch_norm", "_native_batch_norm_legit_functional")


@register(*BATCHNORM_OPS)
def _batch_norm(c: OpCall) -> list[Kernel]:
    """Per-channel statistics over N x H x W. Training reads x twice (statistics, then normalise),
    inference once; y is written once."""
    x = c.args[0]
    training = bool(c.args[5]) if c.op.startswith(("aten.native_batch_norm", "aten.cudnn_batch_norm")) else \
        not c.op.startswith("aten._native_batch_norm_legit_no_training")
    ch = x.shape[1] if len(x.shape) > 1 else 1
    size = formulas.itemsize(x.dtype)
    reads = 2 if training else 1
    return [formulas.rowwise(Family.BATCHNORM, "batchnorm", ch, x.numel // ch, flops_per_elem=6 if training else 4,
                             bytes_total=float(size * (x.numel * (reads + 1) + 4 * ch)), dtype=x.dtype)]


@register(*_ops("native_batch_norm_backward", "cudnn_batch_norm_backward", "batch_norm_backward"))
def _batch_norm_bwd(c: OpCall) -> list[Kernel]:
    """Reads dy and x for the reductions and again for dx; writes dx."""
    dy = c.args[0]
    ch = dy.shape[1] if len(dy.shape) > 1 else 1
    size = formulas.itemsize(dy.dtype)
    return [formulas.rowwise(Family.BATCHNORM, "batchnorm_bwd", ch, dy.numel // ch, flops_per_elem=10,
                             bytes_total=float(size * (dy.numel * 5 + 6 * ch)), dtype=dy.dtype)]


# ------------------------------------------------------------------------------------------- pooling
@register(*_ops("max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool2d", "avg_pool3d",
                "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d", "max_pool2d",
                "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward", "avg_pool2d_backward",
                "avg_pool3d_backward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
                "adaptive_max_pool2d_backward"))
def _pooling(c: OpCall) -> list[Kernel]:
    """Window ops: rows = N x C planes, cols = larger of input/output plane; one FLOP per input element
    read per window (approximately window x output elements)."""
    ins, outs = c.tensor_args(), list(c.outputs)
    big = max(ins + outs, key=lambda t: t.numel)
    planes = math.prod(big.shape[:2]) if len(big.shape) > 2 else 1
    return [formulas.rowwise(Family.POOLING, _short(c), planes, max(1, big.numel // planes), flops_per_elem=1.0,
                             bytes_total=_nbytes(ins) + _nbytes(outs), dtype=big.dtype)]


# ---------------------------------------------------------------------------------------- reductions
REDUCTION_OPS = _ops("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "std", "var_mean",
                     "std_mean", "norm", "linalg_vector_norm", "any", "all", "logsumexp", "cumsum", "cumprod",
                     "nll_loss_forward", "nll_loss2d_forward", "count_nonzero", "_foreach_norm", "topk", "sort")


def _scan_dim(c: OpCall) -> int:
    """The dimension a scan / sort / top-k runs along: ``dim`` is the second argument of cumsum, cumprod and sort,
    the third of topk (after ``k``), or a keyword (sort.stable)."""
    pos = 2 if c.op.startswith("aten.topk") else 1
    dim = c.kwargs.get("dim", c.args[pos] if len(c.args) > pos else -1)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else -1


@register(*REDUCTION_OPS)
def _reduction(c: OpCall) -> list[Kernel]:
    """Reads every input element once, writes the (smaller) result: rows = output elements,
    cols = input elements reduced into each."""
    ins, outs = c.tensor_args(), list(c.outputs)
    if not ins:
        return []
    x = max(ins, key=lambda t: t.numel)
    out_n = max([t.numel for t in outs] + [1])
    if c.op.startswith(("aten.cumsum", "aten.cumprod", "aten.sort", "aten.topk")):
        rows, cols = _rows_cols(x, _scan_dim(c))
    else:
        rows, cols = out_n, max(1, x.numel // out_n)
    return [formulas.rowwise(Family.REDUCTION, _short(c), rows, cols, flops_per_elem=1.0,
                             bytes_total=_nbytes(ins) + _nbytes(outs), dtype=x.dtype)]


# ----------------------------------------------------------------------------------------- embedding
@register(*_ops("embedding", "_embedding_bag"))
def _embedding(c: OpCall) -> list[Kernel]:
    """Gather ``n_indices`` rows of the table: reads indices and the gathered rows, writes them."""
    w, idx = c.args[0], c.args[1]
    out = c.outputs[0]
    dim = w.shape[-1]
    return [formulas.rowwise(Family.EMBEDDING, "embedding", idx.numel, dim, flops_per_elem=0.0,
                             bytes_total=float(idx.view_nbytes + 2 * out.view_nbytes), dtype=w.dtype)]


@register(*_ops("embedding_dense_backward", "embedding_backward", "_embedding_bag_backward"))
def _embedding_bwd(c: OpCall) -> list[Kernel]:
    """Zero the table gradient, then scatter-add the rows of dy (sort by index first on CUDA)."""
    dy, idx = c.args[0], c.args[1]
    out = c.outputs[0]
    dim = dy.shape[-1]
    return [formulas.rowwise(Family.EMBEDDING, "embedding_bwd", idx.numel, dim, flops_per_elem=1.0,
                             bytes_total=float(dy.view_nbytes + 2 * idx.view_nbytes + out.view_nbytes), dtype=dy.dtype)]


# ---------------------------------------------------------------------------- copies and factories
COPY_OPS = _ops("clone", "_to_copy", "copy_", "copy", "contiguous", "cat", "stack", "constant_pad_nd", "repeat",
                "flip", "roll", "index", "_unsafe_index", "index_select", "gather", "scatter", "scatter_", "scatter_add",
                "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add", "index_add_", "index_put",
                "index_put_", "index_copy", "masked_select",
                "slice_backward", "select_backward", "index_select_backward", "unfold_backward", "new_zeros", "new_ones",
                "new_full", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "arange", "scalar_tensor",
                "lift_fresh_copy", "nll_loss_backward", "nll_loss2d_backward", "one_hot", "linspace", "tensor_split",
                "pad", "reflection_pad2d", "replication_pad2d", "_unsafe_index_put", "diagonal_backward",
                "as_strided_scatter", "slice_scatter", "select_scatter", "masked_fill_backward",
                # resampling and rearranging (each output element reads a few neighbours): memory-bound copies
                "resolve_conj", "resolve_neg", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle", "im2col", "col2im",
                *(f"{kind}{suffix}" for kind in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                                                 "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                                                 "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
                                                 "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bilinear2d_aa",
                                                 "_upsample_bicubic2d_aa", "grid_sampler_2d", "grid_sampler_3d",
                                                 "reflection_pad1d", "reflection_pad3d", "replication_pad1d",
                                                 "replication_pad3d")
                  for suffix in ("", "_backward")),
                "reflection_pad2d_backward", "replication_pad2d_backward")


@register(*COPY_OPS)
def _copy(c: OpCall) -> list[Kernel]:
    """Pure data movement: read the tensor inputs (gathers read only what they gather), write outputs."""
    ins, outs = c.tensor_args(), list(c.outputs)
    if not outs:
        return []
    main = max(outs, key=lambda t: t.numel)
    name = _short(c)
    if name in ("index", "_unsafe_index", "index_select", "gather"):
        src = ins[0]
        reads = _nbytes(ins[1:]) + main.view_nbytes  # indices + the gathered elements
    elif name in ("zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones",
                  "new_full", "arange", "scalar_tensor", "linspace", "one_hot"):
        reads = 0.0
        src = main
    else:
        reads = _nbytes(ins)
        src = main
    del src
    rows, cols = _rows_cols(main)
    return [formulas.rowwise(Family.MEMORY, name, rows, cols, flops_per_elem=0.0,
                             bytes_total=reads + _nbytes(outs), dtype=main.dtype)]

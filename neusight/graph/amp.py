"""Automatic mixed precision (``torch.autocast``) as CUDA runs it, on the meta device.

``torch.autocast`` has no meta backend (``device_type="cuda"`` is switched off without a GPU, ``"meta"`` is
refused), so the tracer emulates it one level up: a ``TorchFunctionMode`` that casts the floating-point
arguments of each call the way CUDA autocast does, by the op lists of PyTorch's AMP documentation ("CUDA Ops
that can autocast to float16", "... to float32", "... promote to the widest input type"). Every other op runs
in the dtype of its inputs, as under autocast. The casts are ordinary ops, so they appear as the copy kernels
autocast launches and autograd differentiates through them (the backward casts gradients back to FP32).
Casts of leaf tensors that require grad (the parameters) are cached for the region, as autocast caches them:
each weight is cast once per forward however often it is used.

Seen by the mode is the outermost Python-level call (``F.linear``, ``torch.matmul``, ``F.softmax``,
``F.cross_entropy``, ``F.layer_norm``...), which covers the models the tracer builds; a Python function that calls
GEMMs internally without going through one of those names runs in the dtype it is given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from neusight.errors import InputError

__all__ = ["AMP_DTYPES", "MODEL_DTYPES", "Autocast", "amp_dtype", "model_dtype"]

AMP_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
              "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

# dtype= of a traced model: the precisions the spec files give rates for (FP64 has none, so no float64 models)
MODEL_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, **AMP_DTYPES}

# CUDA ops that autocast to the lower precision (function / method names as the mode sees them)
LOWER = frozenset({
    "__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "linear",
    "matmul", "mm", "mv", "prelu", "scaled_dot_product_attention",
})
# CUDA ops that autocast to float32
FP32 = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss",
})
# CUDA ops that run in the widest floating type of their inputs
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sample", "index_put",
                     "scatter_add", "tensordot", "cat", "stack"})
_LOW = (torch.float16, torch.bfloat16)


def amp_dtype(amp: Any) -> torch.dtype | None:
    """``amp=`` of neusight.trace / predict as a torch dtype: None / False -> None (no autocast), True -> float16,
    "float16" / "fp16" / "half" / "bfloat16" / "bf16" (or the torch dtype)."""
    if amp is None or amp is False:
        return None
    if amp is True:
        return torch.float16
    if isinstance(amp, torch.dtype) and amp in _LOW:
        return amp
    key = str(amp).removeprefix("torch.").lower()
    if key in AMP_DTYPES:
        return AMP_DTYPES[key]
    raise InputError(f"amp={amp!r} is not a mixed-precision dtype. Fix: amp='float16' (or True), amp='bfloat16', "
                     "or leave it out for no autocast")


def model_dtype(dtype: Any) -> torch.dtype:
    """``dtype=`` of neusight.trace / predict as a torch dtype: float32 (also "fp32", "float"), float16 ("fp16",
    "half") or bfloat16 ("bf16"), as a name or a torch dtype. Anything else is an InputError naming the value."""
    if isinstance(dtype, torch.dtype):
        if dtype in MODEL_DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.").lower() in MODEL_DTYPES:
        return MODEL_DTYPES[dtype.removeprefix("torch.").lower()]
    why = ("the GPU spec files give no FP64 rates" if str(dtype).removeprefix("torch.") in ("float64", "double")
           else "not a model precision")
    raise InputError(f"dtype={str(dtype).removeprefix('torch.')!r}: {why}. Fix: dtype='float32' (the default), "
                     "'float16' or 'bfloat16' (or amp='float16' / 'bfloat16' for mixed precision)")


class Autocast(TorchFunctionMode):
    """``torch.autocast("cuda", dtype)`` for meta tensors (see the module docstring)."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.dtype = dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cast(self, obj: Any, to: torch.dtype, src: tuple[torch.dtype, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.dtype not in src or obj.dtype == to:
                return obj
            if obj.is_leaf and obj.requires_grad:      # parameters: one cast per region, as autocast caches them
                hit = self._cache.get(id(obj))
                if hit is None or hit[0] is not obj or hit[1].dtype != to:
                    hit = self._cache[id(obj)] = (obj, obj.to(to))
                return hit[1]
            return obj.to(to)
        if isinstance(obj, (list, tuple)):
            cast = [self._cast(o, to, src) for o in obj]
            return type(obj)(cast) if isinstance(obj, tuple) else cast
        return obj

    def cast_args(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``func``'s arguments as autocast hands them to it (unchanged for a function outside its lists)."""
        name = getattr(func, "__name__", "")
        if kwargs.get("out") is not None:     # calls that supply out= are allowed but not autocast (torch.amp docs)
            return args, kwargs
        if name in LOWER:
            to, src = self.dtype, (torch.float32,)
        elif name in FP32:
            to, src = torch.float32, _LOW
        elif name in PROMOTE:
            floats = [t.dtype for t in _flat_tensors((args, kwargs)) if t.is_floating_point()]
            if not floats or len(set(floats)) == 1:
                return args, kwargs
            to = next(d for d in (torch.float64, torch.float32, *_LOW) if d in floats)
            src = tuple(d for d in (*_LOW, torch.float32) if d != to)
        else:
            return args, kwargs
        return self._cast(args, to, src), {k: self._cast(v, to, src) for k, v in kwargs.items()}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = self.cast_args(func, args, kwargs or {})
        return func(*args, **kwargs)


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat_tensors(o)]
    return []

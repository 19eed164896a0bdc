"""Output tensors of frequent aten ops, made without running their meta kernels.

The tracer only needs each op's outputs as meta tensors of the right shape, dtype and strides. Many meta kernels
are Python decompositions (torch._refs / torch._decomp) that cost 0.1-1 ms per call (layer norm and its
backward, dropout, pointwise ops with type promotion, the optimizers' foreach ops), most of a trace's time. For
the cases listed here the outputs follow from the inputs by rule, so :data:`FAST` builds them directly; every
other op, and every case a rule does not cover (non-contiguous inputs, unusual arguments), runs its real meta
kernel. A rule returns ``NotImplemented`` to decline.

``VERIFY = True`` runs the real kernel as well and raises if the outputs differ in shape, dtype or strides
(tests trace whole models that way).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from neusight.kernels.registry import aten_packets

aten = torch.ops.aten

VERIFY = False
VERIFIED = 0    # calls checked against the meta kernel while VERIFY is on

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dense(*ts: Any) -> bool:
    """All meta, floating and contiguous: the layouts whose outputs are plainly contiguous too."""
    return all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.dtype in _FLOATS and t.is_contiguous()
               for t in ts)


def _empty(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _binary(args: tuple, kwargs: dict) -> Any:
    """add / sub / mul / div of a contiguous tensor and a contiguous tensor (broadcast) or a Python number."""
    if kwargs or len(args) != 2:
        return NotImplemented
    a, b = args
    tensors = [t for t in (a, b) if isinstance(t, torch.Tensor)]
    if not _dense(*tensors) or not isinstance(a, torch.Tensor):
        return NotImplemented
    if isinstance(b, torch.Tensor):
        if b.dim() == 0 or a.dim() == 0:
            return NotImplemented            # 0-dim tensors promote like scalars: leave it to the kernel
        shape = torch.broadcast_shapes(a.shape, b.shape)
    elif isinstance(b, (int, float)) and not isinstance(b, bool):
        shape = a.shape
    else:
        return NotImplemented
    return _empty(shape, torch.result_type(a, b))


def _binary_inplace(args: tuple, kwargs: dict) -> Any:
    if kwargs or len(args) != 2 or not isinstance(args[0], torch.Tensor):
        return NotImplemented
    out = _binary(args, kwargs)
    if out is NotImplemented or out.shape != args[0].shape or out.dtype != args[0].dtype:
        return NotImplemented
    return args[0]


def _like_first(args: tuple, kwargs: dict) -> Any:
    """Unary pointwise ops and backward ops whose result is shaped like their first (gradient) argument."""
    x = args[0] if args else None
    if not _dense(x) or any(isinstance(a, torch.Tensor) and (a.shape != x.shape or a.dtype != x.dtype)
                            for a in list(args[1:]) + list(kwargs.values())):
        return NotImplemented
    return _empty(x.shape, x.dtype)


def _pow_scalar(args: tuple, kwargs: dict) -> Any:
    if kwargs or len(args) != 2 or not _dense(args[0]) or not isinstance(args[1], (int, float)):
        return NotImplemented
    return _empty(args[0].shape, args[0].dtype)


def _layer_norm(args: tuple, kwargs: dict) -> Any:
    x, normalized = args[0], args[1]
    if kwargs or not _dense(x) or x.dtype != torch.float32:
        return NotImplemented
    axis = x.dim() - len(normalized)
    stat = list(x.shape[:axis]) + [1] * len(normalized)
    return _empty(x.shape, x.dtype), _empty(stat, torch.float32), _empty(stat, torch.float32)


def _layer_norm_backward(args: tuple, kwargs: dict) -> Any:
    grad, x, _, _, _, weight, bias, mask = args
    if kwargs or not _dense(grad, x) or x.dtype != torch.float32:
        return NotImplemented
    if (mask[1] and not _dense(weight)) or (mask[2] and not _dense(bias)):
        return NotImplemented
    return (_empty(x.shape, x.dtype) if mask[0] else None, _empty(weight.shape, weight.dtype) if mask[1] else None,
            _empty(bias.shape, bias.dtype) if mask[2] else None)


def _dropout(args: tuple, kwargs: dict) -> Any:
    x, _, train = args
    if kwargs or not _dense(x) or not train:
        return NotImplemented
    return _empty(x.shape, x.dtype), _empty(x.shape, torch.bool)


def _dropout_backward(args: tuple, kwargs: dict) -> Any:
    grad = args[0]
    return _empty(grad.shape, grad.dtype) if not kwargs and _dense(grad) else NotImplemented


def _softmax(args: tuple, kwargs: dict) -> Any:
    x, _, half_to_float = args
    if kwargs or not _dense(x) or half_to_float:
        return NotImplemented
    return _empty(x.shape, x.dtype)


def _softmax_backward(args: tuple, kwargs: dict) -> Any:
    grad, out, _, input_dtype = args
    if kwargs or not _dense(grad, out) or grad.dtype != input_dtype:
        return NotImplemented
    return _empty(grad.shape, grad.dtype)


def _addmm(args: tuple, kwargs: dict) -> Any:
    bias, m1, m2 = args[:3]
    if len(args) > 3 or set(kwargs) - {"beta", "alpha"} or not all(isinstance(m, torch.Tensor) for m in (m1, m2)):
        return NotImplemented
    if m1.dim() != 2 or m2.dim() != 2 or m1.dtype != m2.dtype or m1.dtype not in _FLOATS or m1.shape[1] != m2.shape[0]:
        return NotImplemented
    return _empty((m1.shape[0], m2.shape[1]), m1.dtype)


def _foreach(inplace: bool) -> Callable[[tuple, dict], Any]:
    def rule(args: tuple, kwargs: dict) -> Any:
        first = args[0] if args else None
        if not isinstance(first, (list, tuple)) or not first or not all(_dense(t) for t in first):
            return NotImplemented
        return None if inplace else [_empty(t.shape, t.dtype) for t in first]
    return rule


FAST: dict[Any, Callable[[tuple, dict], Any]] = {
    **{getattr(aten, op).Tensor: _binary for op in ("add", "sub", "mul", "div")},
    **{getattr(aten, op).Tensor: _binary_inplace for op in ("add_", "sub_", "mul_", "div_")},
    aten.pow.Tensor_Scalar: _pow_scalar,
    **{getattr(aten, op).default: _like_first for op in ("tanh", "exp", "sqrt", "rsqrt", "neg", "relu", "sigmoid",
                                                         "tanh_backward", "threshold_backward")
       if hasattr(aten, op)},
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.native_dropout.default: _dropout,
    aten.native_dropout_backward.default: _dropout_backward,
    aten._softmax.default: _softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten.addmm.default: _addmm,
}
for _packet in aten_packets("_foreach_"):
    if _packet.__name__ not in ("_foreach_norm", "_foreach_max"):
        for _overload in _packet.overloads():
            if not _overload.endswith("out"):
                FAST[getattr(_packet, _overload)] = _foreach(_packet.__name__.endswith("_"))


def _gru_cell(args: tuple, kwargs: dict) -> Any:
    """_thnn_fused_gru_cell(input_gates, hidden_gates, hx, ...) -> (hy, workspace of 5 x H per row)."""
    hx = args[2]
    return _empty(hx.shape, hx.dtype), _empty((*hx.shape[:-1], 5 * hx.shape[-1]), hx.dtype)


def _gru_cell_backward(args: tuple, kwargs: dict) -> Any:
    """_thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias) -> gradients of both gates, hx and the biases."""
    grad_hy, has_bias = args[0], args[2]
    rows, hidden = grad_hy.shape[:-1], grad_hy.shape[-1]
    gates = (*rows, 3 * hidden)
    bias = (3 * hidden,) if has_bias else (0,)
    return (_empty(gates, grad_hy.dtype), _empty(gates, grad_hy.dtype), _empty(grad_hy.shape, grad_hy.dtype),
            _empty(bias, grad_hy.dtype), _empty(bias, grad_hy.dtype))


# Ops with no meta kernel at all in this torch, whose CUDA kernels the tracer emulates (neusight.graph.tracer
# routes nn.GRU to PyTorch's fused CUDA GRU cell): their outputs are always made by rule (nothing to verify).
NO_META: dict[Any, Callable[[tuple, dict], Any]] = {
    aten._thnn_fused_gru_cell.default: _gru_cell,
    aten._thnn_fused_gru_cell_backward.default: _gru_cell_backward,
}


def run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` on meta tensors, by its :data:`FAST` rule where one applies."""
    if func in NO_META:
        return NO_META[func](args, kwargs)
    rule = FAST.get(func)
    out = rule(args, kwargs) if rule is not None else NotImplemented
    if out is NotImplemented:
        return func(*args, **kwargs)
    if VERIFY:
        global VERIFIED
        _check(func, out, func(*args, **kwargs))
        VERIFIED += 1
    return out


def _check(func: Any, fast: Any, real: Any) -> None:
    if isinstance(real, torch.Tensor) or isinstance(fast, torch.Tensor):
        ok = (isinstance(real, torch.Tensor) and isinstance(fast, torch.Tensor) and real.shape == fast.shape
              and real.dtype == fast.dtype and real.stride() == fast.stride())
        if not ok:
            raise AssertionError(f"fastmeta rule of {func} made {_desc(fast)}, the meta kernel {_desc(real)}")
    elif isinstance(real, (list, tuple)) and isinstance(fast, (list, tuple)) and len(real) == len(fast):
        for f, r in zip(fast, real):
            _check(func, f, r)
    elif not (real is None and fast is None) and not (isinstance(real, (list, tuple)) and not real and fast is None):
        raise AssertionError(f"fastmeta rule of {func} made {_desc(fast)}, the meta kernel {_desc(real)}")


def _desc(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
    return repr(type(t).__name__) if not isinstance(t, (list, tuple)) else f"[{', '.join(_desc(x) for x in t)}]"

"""State-space and linear-attention layers as the fused kernels of mamba_ssm / causal_conv1d / fla run them.

transformers declares each such layer's core (a Mamba selective scan, Mamba-2's chunked scan, a causal depthwise
conv1d, gated-delta-rule and KDA linear attention, their one-token decode updates) as a PyTorch reference function
decorated with ``use_kernel_func_from_hub_with_fallback("<name>", "<package>")``: with the package installed the
call goes to its fused CUDA / Triton kernels, without it to the reference code, which launches a few kernels per
chunk or per token (a Python loop; thousands of kernels per layer at long sequences).

``ssm_kernels="fused"`` (the default) traces every such call as one fused kernel, forward and backward, the way a
GPU with those packages runs it; ``"reference"`` keeps the reference code's kernels (a GPU without them):

- forward: the reference function runs on the meta device (for its output shapes and its FLOPs) inside a region
  of the tracer that replaces the ops it launched by one kernel. Its FLOPs are the reference's; its bytes are what
  the call reads and returns (its tensor arguments and results), none of the intermediates.
- backward (training): one kernel again, of the forward's shape and three times its FLOPs (``BACKWARD_FLOPS_FACTOR``:
  the fused backward kernels recompute their chunk states rather than keep them, then form two gradient products
  per forward product), reading the saved inputs and the output gradients and writing the input gradients. The
  reference's own backward is not run. Only the inputs are kept for backward (activation memory).
- the kernel's family: where the reference does matrix products (the chunked scans and delta rules; every side
  at least ``MMA_MIN_DIM``), a batched GEMM of the reference's largest product, repeated to all its matrix-product
  FLOPs, in the call's own precision (the references upcast to FP32; the fused kernels multiply in the inputs'
  precision with FP32 accumulation); else a streaming kernel over its largest tensor (pooling, the stencil family,
  where the causal depthwise convolution is in it, else elementwise).

Where a fused path has no reference at all (Mamba's ``mamba_inner_fn`` and Mamba-2's
``mamba_split_conv1d_scan_combined``, which run a whole mixer in training and return None without the package),
the model's own fallback runs, whose conv1d and scan become fused kernels each, as inside those functions; Mamba-2's
gated RMS norm, which that function runs as one Triton kernel, is traced as one kernel in training (see
``WHOLE_MIXER``). The fused packages' real kernel counts (fla splits a chunked delta rule into ~5-7 Triton kernels)
and efficiencies are not known here: no measurement of them was available, so these forecasts are unvalidated.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn

from neusight.errors import InputError
from neusight.graph.records import TensorMeta
from neusight.graph.tracer import _tensors
from neusight.kernels.base import Family, Kernel

SSM_KERNELS = ("fused", "reference")
FUSED_OP_PREFIX = "neusight.fused."
# A product of the reference code counts as a matrix product of the fused kernel (tensor-core / MMA work) when each of
# its dimensions is at least an MMA fragment's smallest side; the references' per-token matrix-vector products (a
# selective scan's state read-out, a decode step's update) are streaming work, and the only convolution in these
# layers is the causal depthwise conv1d, a stencil.
MMA_MIN_DIM = 8
REFERENCE_NOTE = ("transformers' PyTorch reference code for the layers it can hand to fused CUDA kernels ({what}) is "
                  "traced (ssm_kernels=reference), as on a GPU without {packages} installed: many small kernels; with "
                  "those packages those layers run as a few fused kernels, faster than forecast here")
FUSED_NOTE = ("state-space / linear-attention layers traced as the fused kernels of {packages} ({names}): one kernel "
              "per call, forward and backward (ssm_kernels=fused; unvalidated: no measurement of those kernels); "
              "ssm_kernels=reference traces transformers' PyTorch reference code instead, as on a GPU without them")


def check_ssm_kernels(value: str) -> None:
    if value not in SSM_KERNELS:
        raise InputError(f"ssm_kernels={value!r} is not one of {', '.join(SSM_KERNELS)}. Fix: ssm_kernels=fused (the "
                         "fused kernels of mamba_ssm / causal_conv1d / fla) or ssm_kernels=reference (transformers' "
                         "PyTorch reference code)")


def _fallback_of(obj: Any) -> tuple[str, str] | None:
    """(kernel name, package) when ``obj`` is transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper
    around a PyTorch reference function, else None."""
    if not callable(obj) or not inspect.isfunction(getattr(obj, "__wrapped__", None)) or not inspect.isfunction(obj):
        return None
    try:
        free = inspect.getclosurevars(obj).nonlocals
    except (TypeError, ValueError):
        return None
    name, package = free.get("func_name"), free.get("package")
    if isinstance(name, str) and isinstance(package, str) and "torch_function" in free:
        return name, package
    return None


def fallbacks(module: nn.Module) -> dict[tuple[str, str], tuple[str, str]]:
    """{(python module, global name): (kernel name, package)} of the fused-kernel fallbacks the modeling files of
    ``module``'s layers call."""
    found: dict[tuple[str, str], tuple[str, str]] = {}
    for mod_name in sorted({type(m).__module__ for m in module.modules()}):
        mod = sys.modules.get(mod_name)
        if mod is None or not mod_name.startswith("transformers."):
            continue
        for attr, obj in vars(mod).items():
            hit = _fallback_of(obj)
            if hit is not None:
                found[(mod_name, attr)] = hit
    return found


def _unique(ts: list[TensorMeta]) -> list[TensorMeta]:
    seen, out = set(), []
    for t in ts:
        key = (t.storage, t.shape, t.stride)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def fused_kernel(name: str, inner: list[Kernel], inputs: list[TensorMeta], outputs: list[TensorMeta],
                 family: Family | None = None) -> Kernel:
    """The one kernel a fused call runs in place of the reference code's ``inner`` kernels (see the module doc);
    ``family`` forces a row-wise family (the gated RMS norm: layer norm)."""
    ext = _unique(inputs + outputs)
    nbytes = float(sum(t.view_nbytes for t in ext))
    flops = float(sum(k.flops for k in inner))
    floats = [t for t in inputs if t.dtype.startswith(("float", "bfloat"))] or ext
    dtype = max(floats, key=lambda t: t.numel).dtype
    gemms = [k for k in inner if k.family in (Family.LINEAR, Family.BMM) and min(k.dims[1:]) >= MMA_MIN_DIM]
    if gemms and family is None:
        big = max(gemms, key=lambda k: k.flops)
        _, m, n, k = big.dims
        per = 2.0 * m * n * k
        count = max(1, round(sum(g.flops for g in gemms) / per)) if per > 0 else 1
        return Kernel(Family.BMM, name, (count, m, n, k), flops, nbytes, dtype)
    largest = max(ext, key=lambda t: t.numel)
    cols = max(1, largest.shape[-1] if largest.shape else 1)
    rows = max(1, math.ceil(largest.numel / cols))
    if family is None:
        stencil = any(k.family in (Family.POOLING, Family.CONV) for k in inner)
        family = Family.POOLING if stencil else Family.ELEMENTWISE
    return Kernel(family, name, (rows, cols), flops, nbytes, dtype)


# A fused backward recomputes its forward (chunk states, scan prefixes) and computes the gradients of the inputs, two
# products per forward product as for a GEMM: three times the forward's FLOPs. Where the reference's own backward is
# a guide, it agrees: run under autograd with its forward recomputed (the small Mamba-2 and Qwen3-Next configurations
# of tests/test_trace.py, 2026-11-27), it came to 3.0x its forward for Mamba-2's chunked scan, 3.4x for the gated
# delta rule and 2.8x for the causal conv1d. That of the per-token scans is no guide (autograd materialises a
# full-size gradient for every step's slice: ~200x for Mamba's selective scan).
BACKWARD_FLOPS_FACTOR = 3


def backward_kernel(forward: Kernel, inputs: list[TensorMeta], outputs: list[TensorMeta]) -> Kernel:
    """The backward kernel of a fused call whose forward ran ``forward``: its shape with ``BACKWARD_FLOPS_FACTOR``
    times the work (a batched GEMM: that many times the products), reading the saved inputs and the output
    gradients (``inputs``) and writing the input gradients (``outputs``)."""
    nbytes = float(sum(t.view_nbytes for t in _unique(inputs + outputs)))
    dims = forward.dims
    if forward.family is Family.BMM:
        dims = (dims[0] * BACKWARD_FLOPS_FACTOR, *dims[1:])
    return Kernel(forward.family, forward.name + "_bwd", dims, forward.flops * BACKWARD_FLOPS_FACTOR, nbytes,
                  forward.dtype)


class _Fused(torch.autograd.Function):
    """One fused call with a gradient: forward and backward each recorded as one kernel."""

    @staticmethod
    def forward(ctx: Any, spec: dict, *tensors: torch.Tensor) -> Any:
        ctx.spec = spec
        ctx.save_for_backward(*tensors)
        ctx.info = dict(spec["info"])   # (autograd runs a Function's forward without grad)
        return spec["run"](spec["name"], tensors, spec["call"], ctx.info)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        spec, saved, info = ctx.spec, ctx.saved_tensors, ctx.info
        want = ctx.needs_input_grad[1:]

        def gradients(*ts: torch.Tensor) -> tuple:
            return tuple(torch.empty_like(t) if w else None for t, w in zip(ts, want))

        forward = info.get("kernel")
        if forward is None:            # the forward launched nothing (a region inside another one)
            return (None, *gradients(*saved))
        def make(name: str, inner: list[Kernel], ins: list[TensorMeta], outs: list[TensorMeta]) -> Kernel:
            return backward_kernel(forward, ins, outs)

        out = spec["run"](spec["name"] + "_bwd", tuple(saved) + tuple(g for g in grads if isinstance(g, torch.Tensor)),
                          gradients, {"make": make}, args=saved)
        return (None, *out)


def _fused_wrapper(original: Callable, name: str, region: Callable, params: tuple[torch.Tensor, ...] = (),
                   family: Family | None = None, when: Callable[[], bool] | None = None) -> Callable:
    """``original`` (transformers' fallback wrapper, or a module's forward) traced as one fused kernel per call;
    ``params``: tensors it reads that are not arguments (a module's weights: they get their gradients through the
    fused backward); ``family``: see :func:`fused_kernel`; ``when``: fuse only while this is true."""
    info = {} if family is None else {"make": functools.partial(fused_kernel, family=family)}

    def run(kernel_name: str, inputs: tuple, fn: Callable, info: dict, args: tuple | None = None) -> Any:
        with region(kernel_name, inputs, info) as outputs:
            out = fn(*(inputs if args is None else args))
            found: list[torch.Tensor] = []
            _tensors(out, found)
            outputs.extend(found)
        return out

    def fused(*args: Any, **kwargs: Any) -> Any:
        if when is not None and not when():
            return original(*args, **kwargs)
        flat: list[torch.Tensor] = []
        _tensors(args, flat)
        _tensors(tuple(kwargs.values()), flat)
        slots = [id(t) for t in flat]

        def call(*ts: torch.Tensor) -> Any:
            swap = dict(zip(slots, ts[:len(slots)]))
            rebuilt_args = _swap(args, swap)
            rebuilt_kwargs = {k: _swap(v, swap) for k, v in kwargs.items()}
            return original(*rebuilt_args, **rebuilt_kwargs)

        flat += [p for p in params if isinstance(p, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
            return _Fused.apply({"name": name, "run": run, "call": call, "info": info}, *flat)
        return run(name, tuple(flat), call, dict(info))

    fused.__wrapped__ = original
    fused.neusight_fused = name
    return fused


def _swap(obj: Any, swap: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return swap.get(id(obj), obj)
    if isinstance(obj, tuple):
        return tuple(_swap(o, swap) for o in obj)
    if isinstance(obj, list):
        return [_swap(o, swap) for o in obj]
    return obj


@contextlib.contextmanager
def fused_calls(module: nn.Module, mode: str, region: Callable) -> Iterator[dict[str, str]]:
    """While active, the fused-kernel fallbacks ``module``'s layers call run as one fused kernel each
    (``mode="fused"``; ``region(name, inputs)`` is the tracer's kernel-collapsing context), or as their reference
    code (``"reference"``: nothing patched). Yields {kernel name: package} of the fallbacks found."""
    check_ssm_kernels(mode)
    found = fallbacks(module)
    names = {fn: pkg for fn, pkg in found.values()}
    if mode == "reference" or not found:
        yield names
        return
    saved = {}
    norms = _gated_norms(module) if WHOLE_MIXER in names else []
    if norms:
        names[GATED_NORM] = names[WHOLE_MIXER]
    try:
        for (mod_name, attr), (fn, _) in found.items():
            mod = sys.modules[mod_name]
            saved[(mod_name, attr)] = getattr(mod, attr)
            setattr(mod, attr, _fused_wrapper(saved[(mod_name, attr)], fn, region))
        for norm in norms:
            norm.forward = _fused_wrapper(norm.forward, GATED_NORM, region, tuple(norm.parameters(recurse=False)),
                                          Family.LAYERNORM, when=lambda n=norm: n.training)
        yield names
    finally:
        for (mod_name, attr), obj in saved.items():
            setattr(sys.modules[mod_name], attr, obj)
        for norm in norms:
            del norm.forward


# Mamba-2's mixer in training (no cache), with mamba_ssm installed: ``mamba_split_conv1d_scan_combined`` runs the
# causal conv1d, the chunked scan and the gated RMS norm (mamba_ssm's ``rmsnorm_fn``: one Triton kernel forward, one
# backward) and the output projection. Its reference returns None, so the model's fallback runs instead, whose
# conv1d and scan are fused calls already; its gated norm (``*RMSNormGated``, PyTorch code) is traced as that one
# norm kernel while the module is in training. In inference transformers runs that PyTorch norm even with the package.
WHOLE_MIXER = "mamba_split_conv1d_scan_combined"
GATED_NORM = "rmsnorm_gated"


def _gated_norms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if type(m).__name__.endswith("RMSNormGated")
            and type(m).__module__.startswith("transformers.") and "forward" not in vars(m)]


def ssm_note(mode: str, packages: dict[str, str], ops: list[str]) -> str | None:
    """The note of a trace in ``mode`` whose layers call the fused-kernel fallbacks ``packages`` ({kernel:
    package}) and whose ops are ``ops`` (aten names): which reference code it traced, or which fused kernels ran;
    None for a model without such layers (or, fused, when none of them ran)."""
    if not packages:
        return None
    if mode == "reference":
        by_package: dict[str, set[str]] = {}
        for fn, package in packages.items():
            by_package.setdefault(package, set()).add(fn)
        what = "; ".join(f"{pkg}: {', '.join(sorted(fns))}" for pkg, fns in sorted(by_package.items()))
        return REFERENCE_NOTE.format(what=what, packages=" / ".join(sorted(by_package)))
    ran = sorted({op[len(FUSED_OP_PREFIX):].removesuffix("_bwd") for op in ops if op.startswith(FUSED_OP_PREFIX)})
    if not ran:
        return None
    return FUSED_NOTE.format(packages=" / ".join(sorted({packages.get(n, "?") for n in ran})), names=", ".join(ran))

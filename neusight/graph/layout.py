"""Tensor layouts of convolutions: what cuDNN does with PyTorch's default NCHW on tensor cores.

cuDNN's tensor-core convolution kernels work on NHWC data. PyTorch keeps activations NCHW unless the model and
its input are converted (``model.to(memory_format=torch.channels_last)``), so on a GPU with tensor cores every
FP16 / BF16 convolution handed over in NCHW is run as: transpose its inputs to NHWC, the NHWC kernel, transpose
its output back (NVIDIA's "Convolutional Layers User's Guide", "Tensor Layouts In Memory: NCHW vs NHWC"; the
PyTorch channels-last tutorial and ``torch.nn.utils.convert_conv2d_weight_memory_format``, which names FP16 on
compute capability 7.0+). Those transposes are kernels of their own, memory-bound, and they are what a
channels-last model saves.

:func:`with_layout_transposes` adds them to a forecast's kernel table: per such convolution kernel, one
transpose per operand (forward: input and weight in, output back; data gradient: output gradient and weight in,
input gradient back; weight gradient: input and output gradient in, weight gradient back), each read once and
written once, forecast by the elementwise model on its bytes like any copy. Nothing is fitted.

Under ``torch.compile`` (``fused=True``) Inductor decides the layout itself (:func:`inductor_channels_last`): where its
heuristic picks channels-last for a graph's convolutions, no transposes are charged.

What is not modelled: TF32 convolutions (FP32 models on Ampere and later) are taken to run NCHW natively: NVIDIA's
TensorFlow engineers reverted NHWC-by-default for TF32 because cuDNN's NCHW kernels were faster in some cases
(tensorflow/tensorflow PR #56744); AMD's MIOpen (NCHW kernels of its own), depthwise convolutions (PyTorch's own
kernels), and cuDNN picking an NCHW kernel over transposes for some shapes.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from neusight.devices import Device
from neusight.errors import InputError
from neusight.kernels import formulas
from neusight.kernels.base import Family

MEMORY_FORMATS = ("contiguous", "channels_last")   # torch.contiguous_format (NCHW, PyTorch's default), channels_last
TO_NHWC, TO_NCHW = "nchw_to_nhwc", "nhwc_to_nchw"   # the transposes' kernel names
TRANSPOSE_KERNELS = (TO_NHWC, TO_NCHW)
# which operand a convolution kernel reads (in) and writes (out), by index into nchw_operands (input, weight, output)
_OPERANDS = {"conv_dgrad": ((2, 1), 0), "conv_wgrad": ((0, 2), 1)}
_FORWARD = ((0, 1), 2)
# the precisions whose convolutions run on tensor cores, with the spec-sheet peak that says a GPU has them
_TENSOR_CORE_PEAK = {"float16": "fp16_tensor_tflops", "bfloat16": "bf16_tensor_tflops"}
FIRST_TENSOR_CORE_CC = {"float16": 7.0, "bfloat16": 8.0}   # Volta's FP16, Ampere's BF16 tensor cores

LAYOUT_NOTE = ("{n} FP16 / BF16 convolution kernels get their operands in PyTorch's default NCHW layout: cuDNN's "
               "tensor-core kernels transpose them to NHWC and back, {m} transpose kernels, {ms:.2f} ms of this "
               "forecast (memory_format='channels_last', the model and its input converted with "
               "model.to(memory_format=torch.channels_last), saves them)")


# Inductor's layout optimization (torch/_inductor/graph.py, GraphLowering.decide_layout_opt, torch 2.x): a graph's
# convolutions go channels-last unless it has few of them among its nodes, or, in training, one of them is a grouped
# convolution with more than one input channel per group, one has a spatial kernel and at most half as many output
# as input channels, or all have at most 64 channels in and out; in inference it weighs each kind of convolution's
# FLOPs by the channels-last speed-up PyTorch benchmarked for it (below 1: faster) and goes channels-last if the
# weighted sum is no larger.
INDUCTOR_NODES_PER_CONV = 300
INDUCTOR_CL_SPEED = {"grouped": 1.358, "small": 0.783, "in_out": 0.725, "default": 0.823}
INDUCTOR_NOTE = ("torch.compile runs this graph's convolutions channels-last (Inductor's layout optimization): the "
                 "{n} FP16 / BF16 convolution kernels that eager PyTorch hands cuDNN in NCHW need no transposes here")


def _conv_kind(weight_shape: tuple[int, ...], groups: int) -> str:
    """Inductor's kind of a convolution, from its weight (C_out, C_in / groups, kernel...) and groups."""
    c_out, c_in = weight_shape[0], weight_shape[1]
    if groups > 1 and c_in > 1:
        return "grouped"
    if c_out <= 64 and c_in <= 64:
        return "small"
    if c_out * 2 <= c_in and len(weight_shape) > 2 and weight_shape[2] > 1:
        return "in_out"
    return "default"


def inductor_channels_last(g: Any) -> bool:
    """Whether ``torch.compile`` runs the convolutions of graph ``g`` channels-last: Inductor's layout heuristic on
    the forward pass's convolutions (kinds as in :func:`_conv_kind`; nodes counted as the forward's aten ops)."""
    forward = [r for r in g.ops if r.phase == "forward"]
    convs = [r for r in forward if r.call.op.startswith("aten.convolution.")]
    if not convs or len(forward) >= INDUCTOR_NODES_PER_CONV * len(convs):
        return False
    kinds = [(_conv_kind(tuple(r.call.args[1].shape), int(r.call.args[8])), sum(k.flops for k in r.kernels))
             for r in convs]
    if g.mode != "training":
        total = sum(f for _, f in kinds)
        return sum(INDUCTOR_CL_SPEED[kind] * f for kind, f in kinds) <= total
    names = {kind for kind, _ in kinds}
    return not ({"grouped", "in_out"} & names) and names != {"small"}


def check_memory_format(memory_format: Any) -> str:
    """The trace's memory format, checked: ``"contiguous"`` (NCHW, PyTorch's default) or ``"channels_last"``."""
    text = str(memory_format).removeprefix("torch.")
    if text not in MEMORY_FORMATS:
        raise InputError(f"memory_format={memory_format!r} is not a memory format the forecast knows. Fix: "
                         "'contiguous' (NCHW, PyTorch's default) or 'channels_last' (NHWC, as "
                         "model.to(memory_format=torch.channels_last) runs a CNN)")
    return text


def transposing(k: pd.DataFrame, device: Device, tensor_cores: pd.Series) -> pd.Series:
    """The convolution kernels of ``k`` that cuDNN runs through NCHW -> NHWC transposes on ``device``: NCHW
    operands, FP16 / BF16 math on NVIDIA tensor cores (``tensor_cores``: the rows whose channels let them use
    them)."""
    if "nchw_operands" not in k or device.vendor != "nvidia":
        return pd.Series(False, index=k.index)
    dtype = k["dtype"].astype(str)
    has_tc = dtype.map(lambda d: d in _TENSOR_CORE_PEAK and getattr(device, _TENSOR_CORE_PEAK[d]) is not None
                       and device.cc >= FIRST_TENSOR_CORE_CC[d])
    return (k["family"] == Family.CONV.value) & k["nchw_operands"].map(lambda o: isinstance(o, tuple)) \
        & has_tc & tensor_cores


def charged(g: Any, k: pd.DataFrame, device: Device, tensor_cores: pd.Series, fused: bool) -> tuple[pd.Series, int]:
    """The convolution kernels of ``k`` (a kernel table of graph ``g``) that pay cuDNN's transposes on ``device``:
    :func:`transposing`'s, none where ``fused`` and torch.compile runs ``g`` channels-last
    (:func:`inductor_channels_last`); and how many that spared."""
    sel = transposing(k, device, tensor_cores)
    if fused and sel.any() and inductor_channels_last(g):
        return pd.Series(False, index=k.index), int(sel.sum())
    return sel, 0


def with_layout_transposes(k: pd.DataFrame, sel: pd.Series) -> tuple[pd.DataFrame, pd.Series, int]:
    """``k`` with cuDNN's layout transposes after each convolution kernel ``sel`` marks (:func:`charged`; they
    take its op index, phase and module), a mask of the added rows, and how many convolution kernels got them."""
    if not sel.any():
        return k, pd.Series(False, index=k.index), 0
    rows, order = [], []
    for i, row in k[sel].iterrows():
        ins, out = _OPERANDS.get(str(row["kernel"]).removesuffix("_strided"), _FORWARD)
        for j, name in [(j, TO_NHWC) for j in ins] + [(out, TO_NCHW)]:
            t = formulas.elementwise(name, int(row["nchw_operands"][j]), n_tensor_inputs=1, flops_per_elem=0.0,
                                     dtype=str(row["dtype"]))
            rows.append({"op_index": row["op_index"], "phase": row["phase"], "module": row["module"],
                         "aten_op": row["aten_op"], "family": t.family.value, "kernel": t.name, "dims": t.dims,
                         "dtype": t.dtype, "flops": t.flops, "algo_flops": t.flops, "bytes": t.bytes,
                         "modeled": bool(row["modeled"]), "channel_align": float("nan"), "nchw_operands": None})
            order.append(i + 0.5)   # right after its convolution
    added = pd.DataFrame(rows, index=order).assign(_added=True)
    out = pd.concat([k.set_axis(k.index.astype(float)).assign(_added=False), added]).sort_index(kind="stable")
    out = out.reset_index(drop=True).astype({"flops": "float64", "algo_flops": "float64", "bytes": "float64"})
    return out.drop(columns="_added"), out["_added"].astype(bool), int(sel.sum())

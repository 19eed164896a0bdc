"""FP8 linear layers (``fp8=True``): the model's ``nn.Linear`` GEMMs as FP8 matrix multiplies (``torch._scaled_mm``,
FP32 accumulate) with dynamic per-tensor scaling, as torchao runs them in eager PyTorch.

- Training: torchao's ``Float8Linear`` (its "tensorwise" recipe). The weights, their gradients and the optimizer
  stay in the model's precision; each forward casts the input and the weight to e4m3, each backward casts the
  output gradient to e5m2 and the saved (high-precision) input and weight to e4m3 again, then runs the input
  gradient and the weight gradient as FP8 GEMMs too, with the transposed copies their operand layouts need.
- Inference: FP8 weights, quantized once and stored in one byte per value (as FP8 checkpoints are served); each
  call casts its input to e4m3. A mixture of experts' routed experts hold FP8 weights too, each projection one FP8
  grouped GEMM over the experts (``torch._scaled_grouped_mm``, as serving stacks' FP8 MoE kernels run them); in
  training they stay in the model's precision.

A cast is the eager sequence of torchao's dynamic scaling: max |x| (two kernels), the scale, the tensor scaled in
FP32, saturated and cast (memory-bound kernels that ``fused=True``, i.e. ``torch.compile``, merges as it does for
torchao). ``fp8="static"`` (inference) casts with a fixed per-tensor input scale instead, as FP8 checkpoints
calibrated offline carry one (``input_scale``: TensorRT-LLM's and ModelOpt's FP8, vLLM's and SGLang's static FP8
checkpoints): no max |x|, only the scaled, saturated cast, which ``fused=True`` merges into the kernel that makes
the input. Layers left in their precision: the output embedding (LM head), as torchao's recipes and torchtitan
leave it, and every layer whose input or output features are not a multiple of 16 (``torch._scaled_mm`` needs
them). Only exact ``nn.Linear`` modules are converted (transformers' GPT-2 ``Conv1D`` is not a Linear). No FP8
kernel measurement trains the predictor: FP8 GEMMs are bounded by the FP8 tensor peak of the spec sheet with the
utilization the models learned from FP32 kernels.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from neusight.errors import InputError
from neusight.graph.moe import dense_experts_kept, is_routed_experts

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SCALED_MM_MULTIPLE = 16     # torch._scaled_mm: both GEMM dims of the weight must be multiples of 16
FP8_NOTE = ("FP8 linear layers ({how}): {n} nn.Linear GEMMs as FP8 matrix multiplies (torch._scaled_mm, {scaling}; "
            "with fused=true the casts fuse as under torch.compile){skipped}; no FP8 kernel was measured to train the "
            "predictor: they are bounded by the GPU's FP8 tensor peak with utilizations learned from FP32 kernels")
SCALING = {False: "dynamic per-tensor scaling, as torchao runs them in eager PyTorch",
           True: "static per-tensor scaling: each input cast with the fixed scale an FP8 checkpoint carries, no max "
                 "|x| per call, as TensorRT-LLM and vLLM run calibrated FP8 checkpoints"}


def _cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor scaling: amax = max |t|, scale = the FP8 type's max / amax, ``t`` scaled in FP32, saturated
    and cast. Returns the FP8 tensor and the inverse scale ``torch._scaled_mm`` takes."""
    fmax = torch.finfo(dtype).max
    amax = torch.max(torch.abs(t))
    scale = fmax / torch.clamp(amax.to(torch.float32), min=1e-12)
    data = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return data, scale.reciprocal()


def _static_cast(t: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Static per-tensor scaling: ``t`` divided by its fixed (calibrated) scale in FP32, saturated and cast."""
    fmax = torch.finfo(dtype).max
    return (t.to(torch.float32) / scale).clamp(-fmax, fmax).to(dtype)


class _Float8Matmul(torch.autograd.Function):
    """x @ W^T with FP8 operands in the forward and the backward pass (torchao's tensorwise recipe)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = _cast(x2, E4M3)
        w8, sw = _cast(weight, E4M3)
        ctx.save_for_backward(x, weight)     # high precision, cast again in backward
        y = torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])                         # (M, out)
        g8, sg = _cast(g2, E5M2)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            w8, sw = _cast(weight, E4M3)
            # (M, out) @ (out, in): the second operand column-major, a transposed copy of the FP8 weight
            gx = torch._scaled_mm(g8, w8.t().contiguous().t(), sg, sw, out_dtype=grad.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x8, sx = _cast(x.reshape(-1, x.shape[-1]), E4M3)
            # (out, M) @ (M, in): the first operand row-major, the second column-major: two transposed copies
            gw = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), sg, sx, out_dtype=weight.dtype)
        return gx, gw


def _training_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = _Float8Matmul.apply(x, self.weight)
    return y if self.bias is None else y + self.bias.to(y.dtype)


def _inference_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """FP8 weights; the input cast per call, with its own max |x| (dynamic) or the layer's fixed scale (static)."""
    x2 = x.reshape(-1, x.shape[-1])
    fixed = getattr(self, "neusight_input_scale", None)
    x8, sx = _cast(x2, E4M3) if fixed is None else (_static_cast(x2, fixed, E4M3), fixed)
    y = torch._scaled_mm(x8, self.weight.t(), sx, self.neusight_weight_scale, out_dtype=x.dtype)
    y = y.reshape(*x.shape[:-1], self.weight.shape[0])
    return y if self.bias is None else y + self.bias.to(y.dtype)


def apply_fp8(module: nn.Module, training: bool, static: bool = False) -> str:
    """Run every eligible ``nn.Linear`` of ``module`` (on the meta device) as an FP8 layer, in place (module
    docstring); inference layers get FP8 weights, and with ``static`` a fixed input scale each (no max |x| per
    call). Returns the note for the forecast; InputError when no layer is eligible."""
    from neusight.graph.quant import linear_layers

    head, layers, misaligned = linear_layers(
        module, lambda m: m.in_features % SCALED_MM_MULTIPLE == 0 and m.out_features % SCALED_MM_MULTIPLE == 0)
    routed = [m for m in module.modules() if is_routed_experts(m)]
    if routed and not training:
        _fp8_experts(routed, static)
    converted = 0
    for mod in layers:
        if training:
            mod.forward = types.MethodType(_training_forward, mod)
        else:
            w = mod.weight
            mod.weight = nn.Parameter(torch.empty(w.shape, dtype=E4M3, device="meta"), requires_grad=False)
            mod.register_buffer("neusight_weight_scale", torch.ones((), device="meta"))
            if static:
                mod.register_buffer("neusight_input_scale", torch.ones((), device="meta"))
            mod.forward = types.MethodType(_inference_forward, mod)
        converted += 1
    if not converted:
        raise InputError(f"fp8=True runs nn.Linear layers as FP8 GEMMs; {type(module).__name__} has none that qualify "
                         f"({misaligned} with features that are not multiples of {SCALED_MM_MULTIPLE}; the LM head and "
                         "other layer types, such as GPT-2's Conv1D, are not converted). Fix: a model built of "
                         "nn.Linear layers (Llama, Mistral, OPT, BERT, ...), or leave fp8 out")
    skipped = []
    if isinstance(head, nn.Linear):
        skipped.append("the LM head")
    if routed and training:
        skipped.append("the routed experts (stacked 3-D weights, not nn.Linear layers)")
    if misaligned:
        skipped.append(f"{misaligned} layer{'s' if misaligned != 1 else ''} with features not a multiple of "
                       f"{SCALED_MM_MULTIPLE}")
    dense = dense_experts_kept(module, "FP8")
    if dense:
        skipped.append(dense)
    how = "torchao Float8Linear, tensorwise" if training else "FP8 weights, inputs cast per call"
    note = FP8_NOTE.format(how=how, n=converted, scaling=SCALING[static],
                           skipped=f"; kept in the model's precision: {', '.join(skipped)}" if skipped else "")
    if routed and not training:
        note += (f"; the routed experts of {len(routed)} layers hold FP8 weights too, each projection one FP8 grouped "
                 "GEMM over the experts (torch._scaled_grouped_mm, as serving stacks' FP8 MoE kernels run them, in "
                 "place of the experts kernels named above)")
    return note


def _fp8_experts(routed: list[nn.Module], static: bool = False) -> None:
    """Inference: routed experts' stacked weights stored in e4m3, their projections as FP8 grouped GEMMs
    (:func:`neusight.graph.moe._fp8_grouped_mm`; ``static``: inputs cast with a fixed scale), whatever experts
    implementation the model had."""
    from neusight.graph.moe import _grouped_experts_forward

    for mod in routed:
        mod.neusight_fp8_static = static
        for name in ("gate_up_proj", "up_proj", "down_proj"):
            w = getattr(mod, name, None)
            if isinstance(w, nn.Parameter) and w.dim() == 3:
                e, a, b = w.shape
                # the grouped GEMM takes each expert's weight (in, out) column-major: experts stored (experts, in,
                # out) (is_transposed, gpt-oss's, Llama 4's) hold their FP8 copy as (experts, out, in), seen transposed
                fp8 = (torch.empty(e, b, a, dtype=E4M3, device="meta").transpose(1, 2)
                       if getattr(mod, "is_transposed", False) else torch.empty(e, a, b, dtype=E4M3, device="meta"))
                setattr(mod, name, nn.Parameter(fp8, requires_grad=False))
        mod.forward = types.MethodType(_grouped_experts_forward, mod)


def check_fp8_device(device: Any) -> None:
    """Refuse FP8 on a GPU without FP8 tensor cores, naming it."""
    if device is not None and getattr(device, "fp8_tensor_tflops", None) is None:
        raise InputError(f"fp8=True needs FP8 tensor cores; {device.key} ({device.name}) has none (fp8_tensor_tflops "
                         "is not in its spec). Fix: a GPU with them (Ada: L4, L40S, RTX 4090; Hopper: H100, H200; "
                         "Blackwell: B200; AMD CDNA3: MI300X), or leave fp8 out")

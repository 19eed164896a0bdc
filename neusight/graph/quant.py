"""Weight-only quantized inference (``weight_quant="int8"`` / ``"int4"`` / ``"mxfp4"``): the model's ``nn.Linear``
weights stored in 8 or 4 bits, each projection one GEMM kernel that dequantizes its weight tiles as it loads them.

That is how serving stacks run such checkpoints: Marlin, AWQ and GPTQ kernels (vLLM), TensorRT-LLM's weight-only
GEMMs, torchao's int4 ``tinygemm`` (``_weight_int4pack_mm``) and its int8 weight-only linear under
``torch.compile``. The GEMM computes in the activations' precision (BF16 / FP16 tensor cores) and reads the weight
in its stored bytes: one per weight (int8, one scale per output channel) or a half (int4, a scale and a zero point
per group of 128 input features), which is what makes small-batch decoding faster. Layers left in their
precision: the output embedding (LM head), as AWQ / GPTQ checkpoints keep it, and for int4 every layer whose input
features are not a multiple of the group size. A mixture of experts' routed experts are stored quantized too, each
projection one dequantizing grouped GEMM over the experts (as vLLM's quantized MoE kernels run them).

MXFP4 (OCP microscaling: 4-bit E2M1 values, a one-byte power-of-two scale per 32 inputs, 4.25 bits a weight) is how
gpt-oss's checkpoints store their routed experts and nothing else: in a mixture of experts it quantizes the routed
experts alone, in a dense model every eligible ``nn.Linear`` but the head. Its GEMMs dequantize to the activations'
precision as Triton's MXFP4 kernels do on GPUs without FP4 tensor cores; Blackwell's native FP4 products are not
modelled. Inference only; no measurement of these kernels was available, so their forecasts are unvalidated.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable

import torch
from torch import nn

from neusight.errors import InputError
from neusight.graph.moe import dense_experts_kept, is_routed_experts
from neusight.graph.records import TensorMeta
from neusight.kernels.base import Family, Kernel

WEIGHT_QUANT = ("int8", "int4", "mxfp4")
INT4_GROUP = 128            # input features per scale / zero-point pair (AWQ, GPTQ, torchao int4 defaults)
MXFP4_GROUP = 32            # input features per 8-bit power-of-two scale (OCP microscaling, MXFP4)
GROUP = {"int8": 1, "int4": INT4_GROUP, "mxfp4": MXFP4_GROUP}   # input features a layer's must be a multiple of
QUANT_NOTE = ("weight-only {bits} quantization: {n} nn.Linear weights stored in {bits} ({per}), each projection one "
              "GEMM that dequantizes its weights as it loads them, computing in {dtype} ({kernels}){experts}{skipped}; "
              "unvalidated: no measurement of such kernels was available")
_PER = {"int8": "a scale per output channel", "int4": f"a scale and a zero point per {INT4_GROUP} inputs",
        "mxfp4": f"4-bit E2M1 values with an 8-bit power-of-two scale per {MXFP4_GROUP} inputs, OCP microscaling"}
_INTEGER_KERNELS = "Marlin / AWQ / GPTQ / TensorRT-LLM-style kernels"
_KERNELS = {"int8": _INTEGER_KERNELS, "int4": _INTEGER_KERNELS, "mxfp4": "as Triton's MXFP4 kernels run on GPUs "
            "without FP4 tensor cores; Blackwell's FP4 products are not modelled"}


def linear_layers(module: nn.Module,
                  fits: Callable[[nn.Linear], bool]) -> tuple[nn.Module | None, list[nn.Linear], int]:
    """What FP8 layers and weight-only quantization convert: (the output embedding, left out; the exact ``nn.Linear``
    modules ``fits`` accepts; how many others it refused)."""
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    linears = [m for m in module.modules() if type(m) is nn.Linear and m is not head]
    chosen = [m for m in linears if fits(m)]
    return head, chosen, len(linears) - len(chosen)


def check_weight_quant(value: Any, mode: str) -> None:
    """Refuse an unknown ``weight_quant`` or one in training, naming the choices."""
    if value not in WEIGHT_QUANT:
        raise InputError(f"weight_quant={value!r} is not known. Fix: 'int8', 'int4' or 'mxfp4' (weight-only "
                         "quantization), or leave it out")
    if mode != "inference":
        raise InputError(f"weight_quant={value!r} forecasts serving a quantized checkpoint, an inference run; "
                         f"mode={mode!r}. Fix: mode='inference', or leave weight_quant out")


def _weight_bytes(out_f: int, in_f: int, bits: str, act_size: int) -> float:
    """Bytes of a quantized weight with its scales (:func:`_scales`; those in the weight's dtype at the activations'
    ``act_size``): one byte a weight in int8, half a byte in int4 and MXFP4."""
    shape, dtype = _scales(bits, in_f, out_f, None)
    scale_size = act_size if dtype is None else dtype.itemsize
    return out_f * in_f * (1 if bits == "int8" else 0.5) + math.prod(shape) * scale_size


def _quantized_forward(region: Callable, bits: str) -> Callable:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        m, in_f, out_f = math.prod(x.shape[:-1]), self.in_features, self.out_features
        size = x.element_size()
        nbytes = m * in_f * size + _weight_bytes(out_f, in_f, bits, size) + m * out_f * size

        def make(name: str, inner: list[Kernel], ins: list[TensorMeta], outs: list[TensorMeta]) -> Kernel:
            return Kernel(Family.LINEAR, name, (1, m, in_f, out_f), 2.0 * m * in_f * out_f, float(nbytes),
                          str(x.dtype).removeprefix("torch."))

        with region(f"{bits}_weight_gemm", (x, self.weight, self.neusight_scales), {"make": make}) as outputs:
            y = x.new_empty(*x.shape[:-1], out_f)        # the stand-in product; its kernel is ``make``'s
            outputs.append(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)
    return forward


def _quantized_grouped_mm(region: Callable, bits: str) -> Callable:
    """The projection of quantized routed experts: ``h`` (experts x ``share`` rows, in) against the experts' packed
    weights ``w`` (experts, stored in, out), one grouped GEMM that dequantizes as it loads (as vLLM's quantized MoE
    kernels run it), recorded through the tracer's ``region`` as a batched GEMM of equal groups."""
    def mm(h: torch.Tensor, w: torch.Tensor, share: int, scales: torch.Tensor | None = None) -> torch.Tensor:
        experts, in_f, out_f, size = w.shape[0], h.shape[-1], w.shape[-1], h.element_size()
        nbytes = h.numel() * size + experts * _weight_bytes(out_f, in_f, bits, size) + h.shape[0] * out_f * size

        def make(name: str, inner: list[Kernel], ins: list[TensorMeta], outs: list[TensorMeta]) -> Kernel:
            return Kernel(Family.BMM, name, (experts, share, in_f, out_f), 2.0 * h.shape[0] * in_f * out_f,
                          float(nbytes), str(h.dtype).removeprefix("torch."))

        with region(f"{bits}_weight_grouped_gemm", (h, w) if scales is None else (h, w, scales),
                    {"make": make}) as outputs:
            y = h.new_empty(h.shape[0], out_f)
            outputs.append(y)
        return y
    return mm


def _quantize_experts(routed: list[nn.Module], bits: str, region: Callable) -> int:
    """Routed experts' stacked weights stored in ``bits`` (int4: two per byte along the input features) with their
    scales, each projection one dequantizing grouped GEMM; the number of layers quantized (int4 needs every
    projection's input features to fill groups of 128)."""
    from neusight.graph.moe import _grouped_experts_forward

    done = 0
    for mod in routed:
        transposed = bool(getattr(mod, "is_transposed", False))
        weights = {n: w for n in ("gate_up_proj", "up_proj", "down_proj")
                   if isinstance(w := getattr(mod, n, None), nn.Parameter) and w.dim() == 3}
        ins = {n: w.shape[1 if transposed else 2] for n, w in weights.items()}
        if any(i % GROUP[bits] for i in ins.values()):
            continue
        for name, w in weights.items():
            shape = list(w.shape)
            if bits != "int8":
                shape[1 if transposed else 2] //= 2
            stored = torch.int8 if bits == "int8" else torch.uint8
            packed = nn.Parameter(torch.empty(shape, dtype=stored, device="meta"), requires_grad=False)
            setattr(mod, name, packed)
            out_f = w.shape[2 if transposed else 1]
            scales, dtype = _scales(bits, ins[name], out_f, w.dtype)
            mod.register_buffer(f"neusight_{name}_scales", torch.empty((w.shape[0], *scales), dtype=dtype,
                                                                       device="meta"))
            # the projection reads its weights' scales too (and they are resident memory): found on its weights
            packed.neusight_scales = getattr(mod, f"neusight_{name}_scales")
        mod.neusight_quantized_mm = _quantized_grouped_mm(region, bits)
        mod.forward = types.MethodType(_grouped_experts_forward, mod)
        done += 1
    return done


def _scales(bits: str, in_f: int, out_f: int, dtype: Any) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of one weight's scales: int8 one per output channel, int4 a scale and a zero point per 128
    inputs (both in the weight's ``dtype``), MXFP4 one E8M0 byte per 32 inputs."""
    if bits == "int8":
        return (out_f,), dtype
    if bits == "mxfp4":
        return (in_f // MXFP4_GROUP, out_f), torch.uint8
    return (in_f // INT4_GROUP, out_f, 2), dtype


def apply_weight_quant(module: nn.Module, bits: str, region: Callable) -> str:
    """Store every eligible ``nn.Linear`` weight of ``module`` (on the meta device) in ``bits`` and run its projection
    as one dequantizing GEMM, recorded through the tracer's ``region`` (module docstring), in place. Returns the note;
    InputError when no layer is eligible."""
    head, layers, misaligned = linear_layers(module, lambda m: m.in_features % GROUP[bits] == 0)
    routed = [m for m in module.modules() if is_routed_experts(m)]
    dense = dense_experts_kept(module, bits)
    if bits == "mxfp4" and dense and not routed:
        raise InputError(f"weight_quant='mxfp4' stores a mixture of experts' routed experts in MXFP4, but "
                         f"{type(module).__name__}'s experts run as transformers runs them, every expert on every "
                         "token (moe_kernels='auto'). Fix: moe_kernels='grouped' (or 'loop' / 'per-expert') to "
                         "forecast them routed, as serving engines run MXFP4 experts")
    experts_done = _quantize_experts(routed, bits, region)
    if bits == "mxfp4" and routed:
        return _experts_only_note(module, routed, experts_done)
    converted, dtype = 0, None
    for mod in layers:
        out_f, in_f = mod.weight.shape
        dtype = mod.weight.dtype
        shape, stored = ((out_f, in_f), torch.int8) if bits == "int8" else ((out_f, in_f // 2), torch.uint8)
        mod.weight = nn.Parameter(torch.empty(shape, dtype=stored, device="meta"), requires_grad=False)
        scales, scale_dtype = _scales(bits, in_f, out_f, dtype)
        mod.register_buffer("neusight_scales", torch.empty(scales, dtype=scale_dtype, device="meta"))
        mod.forward = types.MethodType(_quantized_forward(region, bits), mod)
        converted += 1
    if not converted:
        raise InputError(f"weight_quant={bits!r} quantizes nn.Linear weights; {type(module).__name__} has none that "
                         f"qualify ({misaligned} with input features that are not multiples of {GROUP[bits]}; the LM "
                         "head and other layer types, such as GPT-2's Conv1D, stay as they are). Fix: a model built of "
                         "nn.Linear layers (Llama, Mistral, OPT, ...), or leave weight_quant out")
    skipped = []
    if isinstance(head, nn.Linear):
        skipped.append("the LM head")
    if experts_done < len(routed):
        skipped.append(f"the routed experts of {len(routed) - experts_done} layers (input features not a multiple of "
                       f"{GROUP[bits]})")
    if misaligned:
        skipped.append(f"{misaligned} layer{'s' if misaligned != 1 else ''} whose input features are not a multiple "
                       f"of {GROUP[bits]}")
    if dense:
        skipped.append(dense)
    experts = (f"; the routed experts of {experts_done} layers are stored in {bits} too, each projection one "
               "dequantizing grouped GEMM over the experts (in place of the experts kernels named above)"
               if experts_done else "")
    return QUANT_NOTE.format(bits=bits, n=converted, per=_PER[bits], dtype=str(dtype).removeprefix("torch."),
                             kernels=_KERNELS[bits], experts=experts,
                             skipped=f"; kept in the model's precision: {', '.join(skipped)}" if skipped else "")


def _experts_only_note(module: nn.Module, routed: list[nn.Module], done: int) -> str:
    """MXFP4 in a mixture of experts: its routed experts alone, as gpt-oss's checkpoints store them (attention, router,
    embeddings and head in the model's precision); the note, or InputError when no experts layer qualifies."""
    if not done:
        raise InputError(f"weight_quant='mxfp4' stores the routed experts of {type(module).__name__} in MXFP4; none of "
                         f"its {len(routed)} experts layers has input features that are multiples of {MXFP4_GROUP}. "
                         "Fix: weight_quant='int8', or leave it out")
    dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
    left = f"; the routed experts of {len(routed) - done} layers too" if done < len(routed) else ""
    return (f"weight-only mxfp4 quantization of the routed experts of {done} layers, as gpt-oss's checkpoints store "
            f"them ({_PER['mxfp4']}): each projection one grouped GEMM over the experts that dequantizes its weights "
            f"as it loads them, computing in {str(dtype).removeprefix('torch.')} ({_KERNELS['mxfp4']}); kept in the "
            f"model's precision: attention, the router, the embeddings and the LM head{left}; unvalidated: no "
            "measurement of such kernels was available")

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
modelled (``"nvfp4"`` below).

NVFP4 (``weight_quant="nvfp4"``) is Blackwell's own 4-bit format, as TensorRT-LLM and vLLM serve NVFP4
checkpoints (NVIDIA ModelOpt): 4-bit E2M1 values with an FP8 (E4M3) scale per 16 inputs (4.5 bits a weight, plus
one FP32 scale per tensor), for the weights and the activations alike (W4A4). Each projection is two kernels: the
activations quantized to NVFP4 (a memory-bound kernel reading them in the model's dtype, writing half a byte a
value and their scales) and the GEMM on the FP4 tensor cores (FP32 accumulate, written in the model's dtype),
bounded by the GPU's ``fp4_tensor_tflops``: GPUs without FP4 tensor cores are refused. Layers as int4's (every
``nn.Linear`` but the head with input features in groups of 16; routed experts too, one FP4 grouped GEMM per
projection). Inference only; no measurement of any of these kernels was available, so their forecasts are
unvalidated.
"""

from __future__ import annotations

import math
import types
import weakref
from typing import Any, Callable, MutableMapping

import torch
from torch import nn

from neusight.errors import InputError
from neusight.graph.moe import dense_experts_kept, is_routed_experts
from neusight.graph.records import TensorMeta
from neusight.kernels.base import Family, Kernel

WEIGHT_ONLY = ("int8", "int4", "mxfp4")      # weights dequantized in the GEMM, math in the activations' dtype
WEIGHT_QUANT = (*WEIGHT_ONLY, "nvfp4")         # nvfp4: weights and activations in FP4 (W4A4), FP4 tensor cores
INT4_GROUP = 128            # input features per scale / zero-point pair (AWQ, GPTQ, torchao int4 defaults)
MXFP4_GROUP = 32            # input features per 8-bit power-of-two scale (OCP microscaling, MXFP4)
NVFP4_GROUP = 16            # input features per FP8 (E4M3) scale (NVFP4)
GROUP = {"int8": 1, "int4": INT4_GROUP, "mxfp4": MXFP4_GROUP, "nvfp4": NVFP4_GROUP}   # input features come in
FP4 = "float4_e2m1"         # the dtype an NVFP4 GEMM is labelled with: its operands' (half a byte a value)
QUANT_NOTE = ("weight-only {bits} quantization: {n} nn.Linear weights stored in {bits} ({per}), each projection one "
              "GEMM that dequantizes its weights as it loads them, computing in {dtype} ({kernels}){experts}{skipped}; "
              "unvalidated: no measurement of such kernels was available")
NVFP4_NOTE = ("NVFP4 quantization (W4A4, as TensorRT-LLM / vLLM serve NVFP4 checkpoints): {n} nn.Linear weights "
              "stored in NVFP4 ({per}), each projection quantizing its {dtype} input to NVFP4 (a memory-bound kernel) "
              "and one GEMM on the FP4 tensor cores writing {dtype}{experts}{skipped}; unvalidated: no measurement of "
              "FP4 kernels was available, they are bounded by the GPU's FP4 tensor peak with utilizations learned "
              "from FP32 kernels")
_PER = {"int8": "a scale per output channel", "int4": f"a scale and a zero point per {INT4_GROUP} inputs",
        "mxfp4": f"4-bit E2M1 values with an 8-bit power-of-two scale per {MXFP4_GROUP} inputs, OCP microscaling",
        "nvfp4": f"4-bit E2M1 values with an FP8 E4M3 scale per {NVFP4_GROUP} inputs"}
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
                         "quantization), 'nvfp4' (weights and activations in FP4, on Blackwell's FP4 tensor cores), "
                         "or leave it out")
    if mode != "inference":
        raise InputError(f"weight_quant={value!r} forecasts serving a quantized checkpoint, an inference run; "
                         f"mode={mode!r}. Fix: mode='inference', or leave weight_quant out")


def check_fp4_device(device: Any) -> None:
    """Refuse NVFP4 on a GPU without FP4 tensor cores (``device`` a Device; None: not known yet), naming it."""
    if device is not None and getattr(device, "fp4_tensor_tflops", None) is None:
        raise InputError(f"weight_quant='nvfp4' runs its GEMMs on FP4 tensor cores; {device.key} ({device.name}) has "
                         "none (fp4_tensor_tflops is not in its spec). Fix: a Blackwell GPU (B200), or "
                         "weight_quant='mxfp4' / 'int4' (4-bit weights dequantized in the GEMM, on any GPU)")


def _weight_bytes(out_f: int, in_f: int, bits: str, act_size: int) -> float:
    """Bytes of a quantized weight with its scales (:func:`_scales`; those in the weight's dtype at the activations'
    ``act_size``): one byte a weight in int8, half a byte in int4, MXFP4 and NVFP4."""
    shape, dtype = _scales(bits, in_f, out_f, None)
    scale_size = act_size if dtype is None else dtype.itemsize
    return out_f * in_f * (1 if bits == "int8" else 0.5) + math.prod(shape) * scale_size


def gemm_name(bits: str, grouped: bool = False) -> str:
    """The kernel name of a ``bits`` projection (``grouped``: routed experts' grouped GEMM)."""
    kind = "grouped_gemm" if grouped else "gemm"
    return f"nvfp4_{kind}" if bits == "nvfp4" else f"{bits}_weight_{kind}"


def _nvfp4_quantize(region: Callable, x: torch.Tensor, copies: MutableMapping) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows x in, in the model's dtype) quantized to NVFP4 by one memory-bound kernel of its own, recorded
    through the tracer's ``region``: each group of 16's amax, its E4M3 scale, the values scaled, rounded and packed
    two a byte; read once, written in 4.5 bits a value. An op of its own, so that ``fused=True`` merges it into the
    kernel making ``x`` (a norm, a gated activation), as serving engines fuse it. Returns the packed values and
    the scales. ``copies`` keeps them per input: projections of one input (q, k and v; gate and up) share one
    quantization, as the merged QKV and gate-up GEMMs of serving engines read one."""
    kept = copies.get(id(x))
    if kept is not None and kept[0]() is x:
        return kept[1]
    rows, in_f, size = math.prod(x.shape[:-1]), x.shape[-1], x.element_size()
    n = rows * in_f

    def make(name: str, inner: list[Kernel], ins: list[TensorMeta], outs: list[TensorMeta]) -> Kernel:
        return Kernel(Family.ELEMENTWISE, name, (int(rows), int(in_f)), 4.0 * n,
                      float(n * size + n * 0.5 + n // NVFP4_GROUP), str(x.dtype).removeprefix("torch."))

    with region("nvfp4_quantize", (x,), {"make": make}) as outputs:
        packed = torch.empty(*x.shape[:-1], in_f // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(*x.shape[:-1], in_f // NVFP4_GROUP, dtype=torch.float8_e4m3fn, device=x.device)
        outputs += [packed, scales]
    copies[id(x)] = weakref.ref(x), (packed, scales)     # by identity (a freed tensor's id may come again)
    return packed, scales


def _activation_bytes(rows: int, in_f: int, bits: str, size: int) -> float:
    """What a projection's GEMM reads of its input: the activations, or their NVFP4 copy with its scales."""
    return rows * in_f * 0.5 + rows * in_f // NVFP4_GROUP if bits == "nvfp4" else rows * in_f * size


def _quantized_forward(region: Callable, bits: str, copies: MutableMapping) -> Callable:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        m, in_f, out_f = math.prod(x.shape[:-1]), self.in_features, self.out_features
        size = x.element_size()
        nbytes = _activation_bytes(m, in_f, bits, size) + _weight_bytes(out_f, in_f, bits, size) + m * out_f * size

        def make(name: str, inner: list[Kernel], ins: list[TensorMeta], outs: list[TensorMeta]) -> Kernel:
            return Kernel(Family.LINEAR, name, (1, m, in_f, out_f), 2.0 * m * in_f * out_f, float(nbytes),
                          FP4 if bits == "nvfp4" else str(x.dtype).removeprefix("torch."))

        operands = _nvfp4_quantize(region, x, copies) if bits == "nvfp4" else (x,)
        with region(gemm_name(bits), (*operands, self.weight, self.neusight_scales), {"make": make}) as outputs:
            y = x.new_empty(*x.shape[:-1], out_f)        # the stand-in product; its kernel is ``make``'s
            outputs.append(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)
    return forward


def _quantized_grouped_mm(region: Callable, bits: str, copies: MutableMapping) -> Callable:
    """The projection of quantized routed experts: ``h`` (experts x ``share`` rows, in) against the experts' packed
    weights ``w`` (experts, stored in, out), one grouped GEMM that dequantizes as it loads (as vLLM's quantized MoE
    kernels run it), recorded through the tracer's ``region`` as a batched GEMM of equal groups."""
    def mm(h: torch.Tensor, w: torch.Tensor, share: int, scales: torch.Tensor | None = None) -> torch.Tensor:
        experts, in_f, out_f, size = w.shape[0], h.shape[-1], w.shape[-1], h.element_size()
        nbytes = (_activation_bytes(h.shape[0], in_f, bits, size) + experts * _weight_bytes(out_f, in_f, bits, size)
                  + h.shape[0] * out_f * size)

        def make(name: str, inner: list[Kernel], ins: list[TensorMeta], outs: list[TensorMeta]) -> Kernel:
            return Kernel(Family.BMM, name, (experts, share, in_f, out_f), 2.0 * h.shape[0] * in_f * out_f,
                          float(nbytes), FP4 if bits == "nvfp4" else str(h.dtype).removeprefix("torch."))

        operands = _nvfp4_quantize(region, h, copies) if bits == "nvfp4" else (h,)
        with region(gemm_name(bits, grouped=True), (*operands, w) if scales is None else (*operands, w, scales),
                    {"make": make}) as outputs:
            y = h.new_empty(h.shape[0], out_f)
            outputs.append(y)
        return y
    return mm


def _quantize_experts(routed: list[nn.Module], bits: str, region: Callable, copies: MutableMapping) -> int:
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
        mod.neusight_quantized_mm = _quantized_grouped_mm(region, bits, copies)
        mod.forward = types.MethodType(_grouped_experts_forward, mod)
        done += 1
    return done


def _scales(bits: str, in_f: int, out_f: int, dtype: Any) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of one weight's scales: int8 one per output channel, int4 a scale and a zero point per 128
    inputs (both in the weight's ``dtype``), MXFP4 one E8M0 byte per 32 inputs, NVFP4 one E4M3 byte per 16."""
    if bits == "int8":
        return (out_f,), dtype
    if bits == "mxfp4":
        return (in_f // MXFP4_GROUP, out_f), torch.uint8
    if bits == "nvfp4":
        return (in_f // NVFP4_GROUP, out_f), torch.float8_e4m3fn
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
    copies: MutableMapping = {}     # NVFP4 copies of the activations: id -> (a weak reference, the copy)
    experts_done = _quantize_experts(routed, bits, region, copies)
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
        mod.forward = types.MethodType(_quantized_forward(region, bits, copies), mod)
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
               + ("FP4 grouped GEMM" if bits == "nvfp4" else "dequantizing grouped GEMM")
               + " over the experts (in place of the experts kernels named above)" if experts_done else "")
    kept = f"; kept in the model's precision: {', '.join(skipped)}" if skipped else ""
    if bits == "nvfp4":
        return NVFP4_NOTE.format(n=converted, per=_PER[bits], dtype=str(dtype).removeprefix("torch."),
                                 experts=experts, skipped=kept)
    return QUANT_NOTE.format(bits=bits, n=converted, per=_PER[bits], dtype=str(dtype).removeprefix("torch."),
                             kernels=_KERNELS[bits], experts=experts, skipped=kept)


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

"""Mixture-of-experts with a fixed expert capacity, so that a meta-device trace has a definite shape.

Routing is data-dependent (which token goes to which expert), which meta tensors cannot follow. As in the
NeuSight Switch-Transformer measurements, every expert instead runs on a zero-padded buffer of
batch x expert_capacity tokens; the router (linear, softmax, argmax, cumsum) and the gather / scatter of
tokens still run, so the work no longer depends on the routing decisions.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from neusight.errors import InputError


def _fixed_capacity_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    batch, seq, hidden = hidden_states.shape                      # (B, T, h)
    _, routing_weights, _ = self.router(hidden_states)            # (B, T, 1)
    flat = hidden_states.reshape(-1, hidden)                      # (B*T, h)
    weights = routing_weights.reshape(-1, 1)                      # (B*T, 1)
    out = torch.zeros_like(flat)
    n_buf = batch * self.neusight_capacity
    # A fixed gather pattern stands in for the routing decision: buffer slot i holds token i mod B*T.
    idx = torch.arange(n_buf, device=flat.device) % flat.shape[0]  # (B*C,)
    record_dispatch(self, n_buf * len(self.experts), flat)
    for expert in self.experts.values():
        x = flat.index_select(0, idx)                             # (B*C, h) gather
        y = expert(x) * weights.index_select(0, idx)              # (B*C, h)
        out = out.index_add(0, idx, y)                            # scatter back
    return out.reshape(batch, seq, hidden)


def record_dispatch(mod: nn.Module, rows: int, hidden_states: torch.Tensor) -> None:
    """Remember, for expert parallelism, the bytes one call of an experts layer hands to its experts: ``rows`` token
    rows of ``hidden_states``' width and dtype. Under expert parallelism an all-to-all sends them to the GPUs that
    hold the chosen experts and another brings the results back (:func:`neusight.parallel.predict_parallel`); with
    balanced routing each GPU sends as many rows as its own experts receive. Read back by :func:`dispatch_calls`."""
    calls = mod.__dict__.setdefault("neusight_dispatch", [])
    calls.append(float(rows * hidden_states.shape[-1] * hidden_states.element_size()))


def clear_dispatch(model: nn.Module) -> None:
    """Forget the calls :func:`record_dispatch` saw (a KV-cache probe's forward is not part of the trace)."""
    for m in model.modules():
        m.__dict__.pop("neusight_dispatch", None)


def dispatch_calls(model: nn.Module) -> dict[str, list[float]]:
    """Module path -> bytes of every call :func:`record_dispatch` saw so far, in call order."""
    return {name: list(m.__dict__["neusight_dispatch"]) for name, m in model.named_modules()
            if m.__dict__.get("neusight_dispatch")}


def fix_switch_capacity(model: nn.Module, config: Any) -> str:
    """Replace every Switch sparse MLP's forward with the fixed-capacity one; returns a note for the result."""
    capacity = int(getattr(config, "expert_capacity", 64))
    n = 0
    for mod in model.modules():
        if type(mod).__name__ == "SwitchTransformersSparseMLP":
            mod.neusight_capacity = capacity
            mod.forward = types.MethodType(_fixed_capacity_forward, mod)
            n += 1
    return (f"mixture of experts traced with a fixed expert capacity: each of the {getattr(config, 'num_experts', '?')} "
            f"experts of {n} sparse layers runs on batch x {capacity} tokens (routing is data-dependent)")


# ---------------------------------------------------------------------------------------------------------
# Top-k routed experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2/V3, ...): transformers' standard experts module,
# weights stored per expert as 3-D tensors (experts x out x in, or x in x out when transposed), called with each
# token's chosen experts and their weights. Its own forwards either follow the routing (nonzero / where: shapes a
# meta tensor cannot know) or call torch._grouped_mm (BF16-only on the meta device). Traced here under balanced
# routing instead: each expert receives an equal share, ceil(tokens x top_k / experts), of the token-expert pairs,
# the expected load of a trained router (real routers are uneven, so a step's slowest expert runs more). With fewer
# pairs than experts (a decode step of a small batch) only as many experts as pairs run, one token each, as the
# eager loop skips the experts no token chose (and grouped_mm's groups of those experts are empty). The kernels
# follow the experts implementation (MOE_KERNELS below): the eager loop, or grouped_mm's sort, one gather, the
# projections over all experts and the weighted sum per token, as transformers.integrations.moe runs it.

def _expert_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ weight if transposed else nn.functional.linear(x, weight)
    return y if bias is None else y + bias


def _balanced_plan(self: nn.Module, tokens: int, top_k: int) -> tuple[int, int, int, tuple]:
    """(pairs, experts that run, pairs per expert, weights) of balanced routing: ``tokens x top_k`` token-expert
    pairs over the experts that run (all, or as many as there are pairs), ceil(pairs / experts) each; the weights
    as (gated, transposed, up weight, up bias, down weight, down bias) of all experts, biases None where there
    are none."""
    pairs = tokens * top_k
    active = min(int(self.num_experts), pairs)   # fewer pairs than experts (decoding a few tokens): that many run
    gated = bool(getattr(self, "has_gate", True))
    bias = bool(getattr(self, "has_bias", False))
    weights = (gated, bool(getattr(self, "is_transposed", False)), self.gate_up_proj if gated else self.up_proj,
               (self.gate_up_proj_bias if gated else self.up_proj_bias) if bias else None,
               self.down_proj, self.down_proj_bias if bias else None)
    return pairs, active, max(1, -(-pairs // active)), weights


def _balanced_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    top_k = top_k_index.shape[-1]
    pairs, active, share, (gated, transposed, up_w, up_b, down_w, down_b) = _balanced_plan(
        self, hidden_states.shape[0], top_k)
    weights = top_k_weights.reshape(-1)                            # (T*k,)
    record_dispatch(self, pairs, hidden_states)
    with torch.no_grad():                                          # the eager loop's routing mask
        nn.functional.one_hot(top_k_index, num_classes=int(self.num_experts) + 1).permute(2, 1, 0).sum(dim=(-1, -2))
    out = torch.zeros_like(hidden_states)
    for e in range(active):
        # a fixed slice of the (token, choice) pairs stands in for the routing decision
        pair = (torch.arange(share, device=hidden_states.device) + e * share) % pairs       # (share,)
        tok = torch.div(pair, top_k, rounding_mode="floor")
        h = _expert_linear(hidden_states.index_select(0, tok), up_w[e], None if up_b is None else up_b[e], transposed)
        h = self._apply_gate(h) if gated else self.act_fn(h)
        y = _expert_linear(h, down_w[e], None if down_b is None else down_b[e], transposed)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        y = y * weights.index_select(0, pair).unsqueeze(-1)
        out = out.index_add(0, tok, y.to(out.dtype))
    return out


class _PerExpertMM(torch.autograd.Function):
    """PyTorch's grouped-GEMM fallback (``_grouped_mm`` where its grouped kernel does not run, and transformers'
    own fallback below compute capability 8.0): ``x`` (rows, in) sorted by expert in equal shares of ``share`` rows,
    ``w`` (experts, in, out); one ``mm`` per expert into its rows of the output, and in backward one ``mm`` per
    expert for the input gradient and one for the weight gradient, each where autograd needs it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, share: int) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.share = share
        out = x.new_empty(x.shape[0], w.shape[-1])
        for e in range(w.shape[0]):
            rows = slice(e * share, (e + 1) * share)
            torch.mm(x[rows], w[e], out=out[rows])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        share = ctx.share
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if want_x else None
        gw = torch.empty_like(w) if want_w else None
        for e in range(w.shape[0]):
            rows = slice(e * share, (e + 1) * share)
            if gx is not None:
                torch.mm(grad[rows], w[e].transpose(0, 1), out=gx[rows])
            if gw is not None:
                torch.mm(x[rows].transpose(0, 1), grad[rows], out=gw[e])
        return gx, gw, None


def _sorted_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, grouped: bool) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts (its default experts implementation from transformers 5 on) under
    balanced routing: the token-expert pairs sorted by expert, the tokens gathered in that order, each projection
    over all experts at once (``grouped``: one grouped GEMM, traced as a batched GEMM of equal groups) or as
    PyTorch's fallback runs it (one ``mm`` per expert over its rows, :class:`_PerExpertMM`), the activation on all
    rows at once, the routing weights applied, the pairs put back in token order and summed per token."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    pairs, active, share, (gated, transposed, up_w, up_b, down_w, down_b) = _balanced_plan(self, tokens, top_k)
    rows = active * share                                          # >= pairs: the last expert's share is padded
    device = hidden_states.device
    record_dispatch(self, pairs, hidden_states)
    torch.sort(top_k_index.reshape(-1))                            # the pairs' expert order (values unused here)
    pair = torch.arange(rows, device=device) % pairs               # a fixed stand-in for that order
    x = hidden_states.index_select(0, torch.div(pair, top_k, rounding_mode="floor"))   # (rows, hidden)
    sample_weights = top_k_weights.reshape(-1).index_select(0, pair)
    torch.zeros(int(self.num_experts), dtype=torch.int32, device=device).cumsum(0)      # tokens per expert -> offsets

    def project(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        scales = getattr(w, "neusight_scales", None)    # weight-only quantized experts' scales (weight_quant=)
        if active < w.shape[0]:            # only the experts that run (slicing them all would add a gradient copy)
            w = w[:active]
        w = w if transposed else w.transpose(1, 2)                                  # (experts, in, out)
        if w.dtype == torch.float8_e4m3fn:  # FP8 experts (fp8=True, inference): one FP8 grouped GEMM
            y = _fp8_grouped_mm(h, w, share, getattr(self, "neusight_fp8_static", False))
        elif w.dtype in (torch.int8, torch.uint8):   # weight-only quantized experts (weight_quant=)
            y = self.neusight_quantized_mm(h, w, share, scales)
        elif grouped:
            y = torch.bmm(h.view(active, share, h.shape[-1]), w).view(rows, w.shape[-1])
        else:                              # in the weights' dtype, as transformers casts it (grouped_mm: no autocast)
            y = _PerExpertMM.apply(h.to(w.dtype), w, share)
        if b is None:
            return y
        expert_of_row = torch.div(torch.arange(rows, device=device), share, rounding_mode="floor")
        return y + b.index_select(0, expert_of_row)                 # each row's expert bias, gathered

    h = project(x, up_w, up_b)
    h = self._apply_gate(h) if gated else self.act_fn(h)
    y = project(h, down_w, down_b)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y * sample_weights.unsqueeze(-1)
    back = torch.arange(pairs, device=device)                      # the inverse permutation (row of each pair)
    y = y.index_select(0, back).view(tokens, top_k, hidden).sum(dim=1)
    return y.to(hidden_states.dtype)


def _fp8_grouped_mm(h: torch.Tensor, w: torch.Tensor, share: int, static: bool = False) -> torch.Tensor:
    """FP8 experts (:func:`neusight.graph.fp8.apply_fp8` in inference): the rows cast to e4m3 (dynamic scaling, or
    with a fixed scale when ``static``), then one grouped GEMM over the experts' FP8 weights ``w`` (experts, in,
    out), ``share`` rows each, with per-row and per-output-channel scales, as serving stacks' FP8 MoE kernels run
    them (``torch._scaled_grouped_mm``)."""
    from neusight.graph.fp8 import E4M3, _cast, _static_cast

    x8 = _static_cast(h, 1.0, E4M3) if static else _cast(h, E4M3)[0]
    experts, rows = w.shape[0], h.shape[0]
    offs = (torch.arange(1, experts + 1, device=h.device, dtype=torch.int32) * share)
    scale_a = torch.ones(rows, device=h.device, dtype=torch.float32)
    scale_b = torch.ones(experts, w.shape[-1], device=h.device, dtype=torch.float32)
    return torch._scaled_grouped_mm(x8, w, scale_a, scale_b, offs=offs, out_dtype=h.dtype)


def _grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    return _sorted_experts_forward(self, hidden_states, top_k_index, top_k_weights, grouped=True)


def _per_expert_mm_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    return _sorted_experts_forward(self, hidden_states, top_k_index, top_k_weights, grouped=False)


# How routed experts run (``moe_kernels``): "auto" as transformers itself runs them on the GPU forecast (its model's
# experts implementation: "grouped_mm", the default from transformers 5 on, or "eager"), or one way for every model:
# "loop" transformers' eager loop (a gather, a GEMM pair and a scatter per expert), "grouped" its grouped_mm with
# PyTorch's grouped GEMM kernel (one GEMM per projection over all experts), "per-expert" its grouped_mm where that
# kernel does not run (one mm per expert per projection over the sorted tokens).
MOE_KERNELS = ("auto", "loop", "grouped", "per-expert")
_HOW = {"loop": "one GEMM pair per expert, each on its gathered tokens (transformers' eager experts)",
        "grouped": "one grouped GEMM per projection over the experts (transformers' grouped_mm experts with PyTorch's "
                   "grouped GEMM kernel)",
        "per-expert": "the tokens sorted by expert, then one mm per expert per projection (transformers' grouped_mm "
                      "experts where PyTorch has no grouped GEMM kernel for the GPU and dtype: its per-group fallback)"}
_FORWARDS = {"loop": _balanced_experts_forward, "grouped": _grouped_experts_forward,
             "per-expert": _per_expert_mm_forward}
# PyTorch's grouped GEMM kernel (CUTLASS, aten/src/ATen/native/cuda/GroupedBlas.cpp) runs for BF16 operands on
# NVIDIA compute capability 9.x and 10.x (Hopper, Blackwell datacenter parts); every other GPU and dtype takes its
# fallback, a loop of mm over the groups.
GROUPED_GEMM_CC_MAJOR = ("9", "10")
AUTO_MARK = "moe_kernels='auto'"   # in the note of experts traced by "auto": their kernels depend on the GPU


# the last words of every balanced-routing note
_UNEVEN = "(routing is data-dependent; a real router's uneven load makes a step slower)"


def _balanced_sizes_gating_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple:
    """A top-k gate that hands its experts a Python list of token counts (JetMoE's, for its attention and MLP
    experts), under balanced routing: the GPU's work as the gate runs it (router GEMM, top-k, softmax, the count of
    tokens per expert, the sort of token-expert pairs by expert and the gather of their gates), with the count read
    back as the balanced split of the tokens x top-k pairs, since a trace of shapes has no values to read."""
    logits = self.layer(hidden_states).float()                                  # (T, E)
    top_logits, top_index = logits.topk(self.top_k, dim=1)                      # (T, k)
    top_gates = torch.softmax(top_logits, dim=1).type_as(hidden_states)
    counts = torch.zeros(top_gates.shape[0], self.num_experts, dtype=top_gates.dtype, device=top_gates.device)
    counts.scatter(1, top_index, 1).long().sum(0)                               # the GPU's count, (E,)
    pairs, experts = top_gates.shape[0] * self.top_k, int(self.num_experts)
    sizes = [pairs // experts + (1 if e < pairs % experts else 0) for e in range(experts)]
    order = top_index.flatten().sort(0)[1]                                      # (T*k,) pairs by expert
    return (order, order.div(self.top_k, rounding_mode="trunc"), top_gates.flatten()[order], sizes, logits)


def _is_zero_compute_experts(mod: nn.Module) -> bool:
    """Routed experts with zero-computation experts beside them (LongCat-Flash's: ``total_experts`` choices of which
    the last ``zero_expert_num`` return their tokens unchanged), whose forward finds the experts hit by ``nonzero``."""
    return (hasattr(mod, "zero_expert_num") and hasattr(mod, "total_experts") and hasattr(mod, "num_routed_experts")
            and getattr(mod, "down_proj", None) is not None and mod.down_proj.dim() == 3)


def _balanced_zero_compute_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`_is_zero_compute_experts` under balanced routing: the tokens x top-k pairs spread evenly over all
    ``total_experts`` choices; a routed expert runs its gated MLP on its share, a zero-computation expert passes its
    share through; each share is weighted and added back as the loop over hit experts does."""
    pairs = hidden_states.shape[0] * top_k_index.shape[-1]
    active = min(int(self.total_experts), pairs)
    share = max(1, -(-pairs // active))
    weights = top_k_weights.reshape(-1)
    out = torch.zeros_like(hidden_states)
    for e in range(active):
        pair = (torch.arange(share, device=hidden_states.device) + e * share) % pairs
        tok = torch.div(pair, top_k_index.shape[-1], rounding_mode="floor")
        y = hidden_states.index_select(0, tok)
        if e < int(self.num_routed_experts):
            gate, up = nn.functional.linear(y, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
        y = y * weights.index_select(0, pair).unsqueeze(-1)
        out = out.index_add(0, tok, y.to(out.dtype))
    return out


def fix_zero_compute_experts(model: nn.Module) -> str | None:
    """Trace every experts module with zero-computation experts (:func:`_is_zero_compute_experts`) under balanced
    routing; a note for the result, None when the model has none."""
    found = [m for m in model.modules() if _is_zero_compute_experts(m)]
    for m in found:
        m.forward = types.MethodType(_balanced_zero_compute_forward, m)
    if not found:
        return None
    kinds = sorted({(int(m.num_routed_experts), int(m.zero_expert_num)) for m in found})
    return (f"mixture of experts traced under balanced routing: in each of {len(found)} expert "
            f"layer{'s' if len(found) != 1 else ''} "
            f"({', '.join(f'{r} routed + {z} zero-computation' for r, z in kinds)} experts) every expert gets tokens x "
            "top-k / experts tokens, those of a zero-computation expert passed through unchanged (routing is "
            "data-dependent; a real router's uneven load, and its share of tokens kept from computation, change a "
            "step's time)")


def fix_size_list_gates(model: nn.Module) -> str | None:
    """Trace every top-k gate of ``model`` that reads its experts' token counts back to the host (JetMoE's
    ``JetMoeTopKGating``, whose ``.tolist()`` a meta-device trace cannot follow) under balanced routing; a note for
    the result, None when the model has none."""
    gates = [m for m in model.modules() if type(m).__name__ == "JetMoeTopKGating"]
    for m in gates:
        m.forward = types.MethodType(_balanced_sizes_gating_forward, m)
    if not gates:
        return None
    experts = sorted({int(m.num_experts) for m in gates})
    return (f"mixture of experts traced under balanced routing: each of {len(gates)} top-k "
            f"gate{'s' if len(gates) != 1 else ''} "
            f"({'/'.join(map(str, experts))} experts) hands every expert tokens x top-k / experts tokens {_UNEVEN}")


# Llama 4's mixture of experts (transformers' Llama4TextMoe) runs every expert on every token: each token is copied
# once per expert, scaled by the router's sigmoid score (zero for the experts it did not choose), and the experts
# run as one batched GEMM pair over all those copies; a shared expert beside them. That is what transformers runs,
# kept under moe_kernels="auto" with a note. Any other moe_kernels turns each such layer into the routed form that
# serving engines run: the router's top-k and their sigmoid scores, the chosen experts under balanced routing
# (fix_routed_experts, which then finds these experts like any routed ones; the score is applied to an expert's
# output there, to its input in Llama 4: the same elementwise product), the shared expert beside them.

def _is_llama4_moe(mod: nn.Module) -> bool:
    experts = getattr(mod, "experts", None)
    return (type(mod).__name__ == "Llama4TextMoe" and isinstance(experts, nn.Module)
            and getattr(experts, "gate_up_proj", None) is not None and hasattr(mod, "router")
            and hasattr(mod, "shared_expert"))


def _gate_then_up(self: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)       # Llama 4's order: the gate's half first
    return up * self.act_fn(gate)


def _routed_llama4_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)                       # (T, h)
    router_logits = nn.functional.linear(hidden_states, self.router.weight)         # (T, E)
    top_value, top_index = torch.topk(router_logits, self.top_k, dim=1)             # (T, k)
    scores = torch.sigmoid(top_value.float()).to(hidden_states.dtype)
    out = self.shared_expert(hidden_states)
    out.add_(self.experts(hidden_states, top_index, scores))
    return out, router_logits


def fix_llama4_experts(model: nn.Module, kernels: str = "auto") -> str | None:
    """Llama 4's experts layers: under ``kernels="auto"`` left as transformers runs them (every expert on every
    token; marked ``neusight_dense`` for tensor parallelism's split) with a note saying so; under any other
    :data:`MOE_KERNELS` value made routed, their experts marked for :func:`fix_routed_experts` (call it next), no
    note of their own. None when the model has no such layer."""
    check_moe_kernels(kernels)
    found = [m for m in model.modules() if _is_llama4_moe(m)]
    if not found:
        return None
    if kernels == "auto":
        for m in found:     # the layout tensor parallelism splits (neusight.parallel): weights (experts, in, out)
            m.experts.is_transposed, m.experts.has_gate, m.experts.neusight_dense = True, True, True
        n_exp = "/".join(str(e) for e in sorted({int(m.num_experts) for m in found}))
        top_k = "/".join(str(k) for k in sorted({int(m.top_k) for m in found}))
        return (f"Llama 4's experts as transformers runs them: in each of {len(found)} expert "
                f"layer{'s' if len(found) != 1 else ''} all {n_exp} experts run on every token (its copy scaled by "
                f"the router's score, zero for the experts it did not choose), {n_exp} x the FLOPs of {top_k} routed "
                "expert per token; moe_kernels='grouped', 'loop' or 'per-expert' forecasts them routed, as serving "
                "engines run them")
    for m in found:
        experts = m.experts
        experts.is_transposed, experts.has_gate, experts.neusight_routed = True, True, True
        experts._apply_gate = types.MethodType(_gate_then_up, experts)
        m.forward = types.MethodType(_routed_llama4_forward, m)
    return None


def dense_experts_kept(module: nn.Module, what: str) -> str | None:
    """For a note's list of what stays in the model's precision: Llama 4's experts run densely (``moe_kernels="auto"``,
    :func:`fix_llama4_experts`), which ``what`` (a weight format) does not convert; None when the model has none."""
    n = sum(1 for m in module.modules() if getattr(m, "neusight_dense", False))
    if not n:
        return None
    return (f"the experts of {n} layer{'s' if n != 1 else ''}, run as transformers runs them (every expert on every "
            f"token; moe_kernels='grouped' forecasts them routed, in {what})")


def depends_on_gpu(notes: list[str] | tuple[str, ...]) -> bool:
    """Whether a trace with these notes has experts whose kernels ``moe_kernels="auto"`` chose by the GPU, so that
    another GPU may need its own trace."""
    return any(AUTO_MARK in n for n in notes)


def grouped_gemm_runs(device: Any, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs as one grouped GEMM kernel on ``device`` (a Device or None) for expert
    weights of ``dtype``; False without a device."""
    if device is None or dtype != torch.bfloat16 or getattr(device, "vendor", None) != "nvidia":
        return False
    return str(device.compute_capability).split(".")[0] in GROUPED_GEMM_CC_MAJOR


def check_moe_kernels(kernels: str) -> None:
    """Refuse a ``moe_kernels`` value other than :data:`MOE_KERNELS`, naming the choices."""
    if kernels not in MOE_KERNELS:
        raise InputError(f"moe_kernels={kernels!r} is not known; use 'auto' (as transformers runs the model's experts "
                         "on the GPU forecast, the default), 'loop' (its eager loop over the experts), 'grouped' (its "
                         "grouped_mm as one grouped GEMM per projection) or 'per-expert' (its grouped_mm as PyTorch's "
                         "fallback runs it: one mm per expert)")


def is_routed_experts(mod: nn.Module) -> bool:
    """transformers' standard top-k experts module (3-D weights per expert, called with each token's chosen experts),
    as :func:`fix_routed_experts` traces. Experts called with the hidden states alone (Llama 4's, which run every
    expert on every token's scaled copy) are not, unless :func:`fix_llama4_experts` made them routed."""
    if not hasattr(mod, "num_experts"):                   # the cheap test first: most modules stop here
        return False
    params = dict(mod.named_parameters(recurse=False))
    up = params.get("gate_up_proj" if getattr(mod, "has_gate", True) else "up_proj")
    down = params.get("down_proj")
    if not (up is not None and down is not None and up.dim() == 3 and down.dim() == 3
            and up.shape[0] == down.shape[0] == int(mod.num_experts)):
        return False
    if getattr(mod, "neusight_routed", False):            # fix_llama4_experts made them routed
        return True
    try:
        takes = inspect.signature(type(mod).forward).parameters
    except (TypeError, ValueError):
        return False
    return "top_k_index" in takes or len(takes) >= 4      # self, hidden states, chosen experts, their weights


def fix_routed_experts(model: nn.Module, kernels: str = "auto", grouped_gemm: bool = False) -> str | None:
    """Trace every top-k routed experts module of ``model`` under balanced routing with ``kernels`` (one of
    :data:`MOE_KERNELS`; "auto": what the module's experts implementation runs, ``grouped_gemm`` saying whether
    PyTorch's grouped GEMM kernel runs on the GPU forecast, :func:`grouped_gemm_runs`); a note for the result, None
    when the model has none."""
    check_moe_kernels(kernels)
    found = [m for m in model.modules() if is_routed_experts(m)]
    if not found:
        return None
    used: dict[str, int] = {}
    for mod in found:
        how = kernels
        if how == "auto":
            impl = getattr(getattr(mod, "config", None), "_experts_implementation", None)
            how = "loop" if impl in (None, "eager") else ("grouped" if grouped_gemm else "per-expert")
        mod.forward = types.MethodType(_FORWARDS[how], mod)
        used[how] = used.get(how, 0) + 1
    n_exp = sorted({int(m.num_experts) for m in found})
    how = "; ".join(_HOW[k] if len(used) == 1 else f"{n} layers: {_HOW[k]}" for k, n in used.items())
    why = (f" as transformers runs them ({AUTO_MARK}: the model's experts implementation, with PyTorch's "
           "grouped GEMM kernel where the GPU and dtype have one; 'loop', 'grouped' or 'per-expert' choose one)"
           if kernels == "auto" else "")
    return (f"mixture of experts traced under balanced routing: in each of {len(found)} expert "
            f"layer{'s' if len(found) != 1 else ''} "
            f"({'/'.join(map(str, n_exp))} experts) every expert runs on tokens x top-k / experts tokens (when fewer "
            f"token choices than experts: that many experts, one token each), {how}{why} {_UNEVEN}")

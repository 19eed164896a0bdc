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
    for expert in self.experts.values():
        x = flat.index_select(0, idx)                             # (B*C, h) gather
        y = expert(x) * weights.index_select(0, idx)              # (B*C, h)
        out = out.index_add(0, idx, y)                            # scatter back
    return out.reshape(batch, seq, hidden)


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
# eager loop skips the experts no token chose.

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


def _balanced_experts_grouped(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The same balanced routing with transformers' ``grouped_mm`` experts (its default from transformers 5 on GPUs
    of compute capability 8.0 and up): the token copies gathered expert by expert, then one grouped GEMM per
    projection over all experts (traced as a batched GEMM: equal groups under balanced routing), the weights
    applied and the copies summed back."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    pairs, active, share, (gated, transposed, up_w, up_b, down_w, down_b) = _balanced_plan(self, tokens, top_k)
    up_w, down_w = up_w[:active], down_w[:active]
    up_b, down_b = (None if b is None else b[:active] for b in (up_b, down_b))

    def grouped(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = torch.bmm(x, w if transposed else w.transpose(1, 2))      # (experts, share, out)
        return y if b is None else y + b.unsqueeze(1)

    pair = torch.arange(active * share, device=hidden_states.device) % pairs
    tok = torch.div(pair, top_k, rounding_mode="floor")
    x = hidden_states.index_select(0, tok).view(active, share, hidden)   # copies sorted by expert
    h = grouped(x, up_w, up_b)
    h = self._apply_gate(h) if gated else self.act_fn(h)
    y = grouped(h, down_w, down_b)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y.reshape(active * share, hidden) * top_k_weights.reshape(-1).index_select(0, pair).unsqueeze(-1)
    return torch.zeros_like(hidden_states).index_add(0, tok, y.to(hidden_states.dtype))


MOE_KERNELS = ("loop", "grouped")   # transformers' eager loop over experts / its grouped_mm experts


def check_moe_kernels(kernels: str) -> None:
    """Refuse a ``moe_kernels`` value other than :data:`MOE_KERNELS`, naming the choices."""
    if kernels not in MOE_KERNELS:
        raise InputError(f"moe_kernels={kernels!r} is not known; use 'loop' (transformers' eager loop over the "
                         "experts) or 'grouped' (its grouped_mm: one grouped GEMM per projection)")


def is_routed_experts(mod: nn.Module) -> bool:
    """transformers' standard top-k experts module (3-D weights per expert, called with each token's chosen experts),
    as :func:`fix_routed_experts` traces. Experts called with the hidden states alone (Llama 4's, which run every
    expert on every token's scaled copy) keep their own forward."""
    if not hasattr(mod, "num_experts"):                   # the cheap test first: most modules stop here
        return False
    params = dict(mod.named_parameters(recurse=False))
    up = params.get("gate_up_proj" if getattr(mod, "has_gate", True) else "up_proj")
    down = params.get("down_proj")
    if not (up is not None and down is not None and up.dim() == 3 and down.dim() == 3
            and up.shape[0] == down.shape[0] == int(mod.num_experts)):
        return False
    try:
        takes = inspect.signature(type(mod).forward).parameters
    except (TypeError, ValueError):
        return False
    return "top_k_index" in takes or len(takes) >= 4      # self, hidden states, chosen experts, their weights


def fix_routed_experts(model: nn.Module, kernels: str = "loop") -> str | None:
    """Trace every top-k routed experts module of ``model`` under balanced routing, with ``kernels`` "loop" (one
    GEMM pair per expert, transformers' eager loop) or "grouped" (one grouped GEMM per projection, its
    ``grouped_mm``); a note for the result, None when the model has none."""
    check_moe_kernels(kernels)
    found = [m for m in model.modules() if is_routed_experts(m)]
    forward = _balanced_experts_forward if kernels == "loop" else _balanced_experts_grouped
    for mod in found:
        mod.forward = types.MethodType(forward, mod)
    if not found:
        return None
    n_exp = sorted({int(m.num_experts) for m in found})
    how = ("one GEMM pair per expert (transformers' eager loop; moe_kernels='grouped' for its grouped_mm)"
           if kernels == "loop" else "one grouped GEMM per projection over the experts (transformers' grouped_mm)")
    return (f"mixture of experts traced under balanced routing: in each of {len(found)} expert "
            f"layer{'s' if len(found) != 1 else ''} "
            f"({'/'.join(map(str, n_exp))} experts) every expert runs on tokens x top-k / experts tokens (when fewer "
            f"token choices than experts: that many experts, one token each), {how} (routing is data-dependent; a "
            "real router's uneven load makes a step slower)")

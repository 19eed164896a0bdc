"""Mixture-of-experts with a fixed expert capacity, so that a meta-device trace has a definite shape.

Routing is data-dependent (which token goes to which expert), which meta tensors cannot follow. As in the
NeuSight Switch-Transformer measurements, every expert instead runs on a zero-padded buffer of
batch x expert_capacity tokens; the router (linear, softmax, argmax, cumsum) and the gather / scatter of
tokens still run, so the work no longer depends on the routing decisions.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


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

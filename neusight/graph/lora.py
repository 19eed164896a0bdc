"""LoRA fine-tuning: frozen base weights plus trainable low-rank adapters, built on the traced model itself.

What a LoRA step runs on the GPU, as PEFT's ``LoraConfig`` sets it up by default (``lora_dropout=0``, adapters
unmerged): every target projection computes ``base(x) + lora_B(lora_A(x)) * alpha / r``, two thin GEMMs, a
scaling and an add on top of the frozen one. Every base weight is frozen, so the backward pass computes no
weight gradient for it (only the input gradients that carry the gradient down to the adapters below), keeps
fewer activations, and the optimizer holds state for the adapters alone. Written here rather than by depending on
PEFT: the module names it targets by default are public facts of each architecture. The adapters take the base
weights' dtype; PEFT upcasts them to FP32 by default on a half-precision base (``autocast_adapter_dtype``), which
makes its two thin GEMMs FP32 with casts around them: not modelled (tiny next to the base GEMMs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from neusight.errors import InputError

# model_type -> the projections LoRA adapts by default (PEFT's defaults for these architectures: the attention's
# query and value projections, or the fused QKV projection where the model has one)
_QV = ("q_proj", "v_proj")
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn",), "gpt_bigcode": ("c_attn",), "llama": _QV, "mistral": _QV, "mixtral": _QV, "opt": _QV,
    "gptj": _QV, "gpt_neo": _QV, "bart": _QV, "stablelm": _QV, "gemma": _QV, "gemma2": _QV, "qwen2": _QV,
    "bert": ("query", "value"), "roberta": ("query", "value"), "xlm-roberta": ("query", "value"),
    "switch_transformers": ("q", "v"), "t5": ("q", "v"), "mt5": ("q", "v"), "gpt_neox": ("query_key_value",),
    "falcon": ("query_key_value",), "bloom": ("query_key_value",), "codegen": ("qkv_proj",),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"),
}
# names of attention projections a model without defaults may have, to suggest as lora_targets
_ATTENTION_PROJECTIONS = ("q_proj", "v_proj", "query", "value", "q", "v", "qkv_proj", "c_attn", "query_key_value",
                          "Wqkv", "in_proj")
DEFAULT_ALPHA = 8.0      # PEFT's LoraConfig default lora_alpha


class LoRALinear(nn.Module):
    """A frozen projection (``nn.Linear`` or GPT-2's ``Conv1D``) plus the adapters ``lora_B(lora_A(x)) * scale``."""

    def __init__(self, base: nn.Module, rank: int, alpha: float) -> None:
        super().__init__()
        weight = base.weight
        # nn.Linear stores (out, in); transformers' Conv1D stores (in, out)
        n_in, n_out = (weight.shape[0], weight.shape[1]) if type(base).__name__ == "Conv1D" else (weight.shape[1],
                                                                                                   weight.shape[0])
        self.base = base
        self.lora_A = nn.Linear(n_in, rank, bias=False, device=weight.device, dtype=weight.dtype)
        self.lora_B = nn.Linear(rank, n_out, bias=False, device=weight.device, dtype=weight.dtype)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def apply_lora(module: nn.Module, rank: int, targets: Sequence[str] | None = None,
               alpha: float = DEFAULT_ALPHA) -> list[str]:
    """Freeze every parameter of ``module`` and wrap its target projections in :class:`LoRALinear` (in place).

    ``targets``: the last component of the module names to adapt (e.g. ``["q_proj", "v_proj"]``); None takes
    :data:`DEFAULT_TARGETS` of the model's ``config.model_type``. Returns the names of the wrapped modules.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"lora_rank={rank!r} is not a positive integer. Fix: e.g. lora_rank=16, or leave it out")
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if targets is None:
        if model_type not in DEFAULT_TARGETS:
            linear = {name.rpartition(".")[2] for name, m in module.named_modules() if isinstance(m, nn.Linear)}
            have = [n for n in _ATTENTION_PROJECTIONS if n in linear]
            pick = [n for n in have if n in ("q_proj", "v_proj")] or have[:2]
            hint = (f"this model's attention projections include {', '.join(have)}: e.g. "
                    f"lora_targets=[{','.join(pick)}]" if have else "e.g. lora_targets=[q_proj,v_proj], the last "
                    "part of names from model.named_modules()")
            raise InputError(f"lora_rank={rank}: no default LoRA target modules for "
                             f"{model_type or type(module).__name__}. Fix: name them, {hint} (defaults, PEFT's, exist "
                             f"for {', '.join(sorted(DEFAULT_TARGETS))})")
        targets = DEFAULT_TARGETS[model_type]
    targets = tuple(str(t) for t in targets)
    found = [(name, m) for name, m in module.named_modules()
             if name.rpartition(".")[2] in targets and getattr(m, "weight", None) is not None
             and getattr(m.weight, "dim", lambda: 0)() == 2]
    if not found:
        raise InputError(f"lora_targets={list(targets)} match no linear projection of {type(module).__name__}. Fix: "
                         "use the last part of its module names (model.named_modules()), e.g. q_proj")
    for p in module.parameters():
        p.requires_grad_(False)
    for name, m in found:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, LoRALinear(m, rank, alpha))
    return [name for name, _ in found]

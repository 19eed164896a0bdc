"""Model builders: presets, Hugging Face config JSONs, the ResNet family and any nn.Module, always built on
the meta device (no weights are ever allocated).

Presets are written here from the public architecture numbers of each family (papers and model cards).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from neusight.errors import InputError, ModelError
from neusight.graph import efficientnet as _efficientnet
from neusight.graph import resnet as _resnet

log = logging.getLogger(__name__)

# name -> (model_type, config kwargs). Sources: GPT-2 (Radford et al. 2019, HF model cards), GPT-3
# (Brown et al. 2020, Table 2.1), BERT (Devlin et al. 2019), OPT (Zhang et al. 2022, Table 1), Switch
# Transformer (Fedus et al. 2022) with 4 experts at Switch-Large-like width (the NeuSight evaluation model).
_GPT2 = dict(vocab_size=50257, activation_function="gelu_new")
_LLAMA = dict(architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False)


_CAUSAL_LM = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM"}


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int,
           model_type: str = "llama", **extra: Any) -> tuple[str, dict[str, Any]]:
    """A preset of the Llama architecture or a relative (``model_type``): width, MLP width, layers, query / key-value
    heads, vocabulary, positions, and the fields where it differs from Llama's defaults."""
    return model_type, dict(_LLAMA, architectures=[_CAUSAL_LM[model_type]], hidden_size=hidden,
                            intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=positions, **extra)


HF_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", dict(_GPT2, n_embd=768, n_layer=12, n_head=12, n_positions=1024)),
    "gpt2-medium": ("gpt2", dict(_GPT2, n_embd=1024, n_layer=24, n_head=16, n_positions=1024)),
    "gpt2-large": ("gpt2", dict(_GPT2, n_embd=1280, n_layer=36, n_head=20, n_positions=1024)),
    "gpt2-xl": ("gpt2", dict(_GPT2, n_embd=1600, n_layer=48, n_head=25, n_positions=1024)),
    # NB: Table 2.1 of the GPT-3 paper lists GPT-3 XL with d_model 2048 but 24 heads of 128 (= 3072); we
    # keep d_model = 2048 (which gives the stated 1.3B parameters) with 16 heads of 128.
    "gpt3-xl": ("gpt2", dict(_GPT2, n_embd=2048, n_layer=24, n_head=16, n_positions=2048)),
    "gpt3-2.7b": ("gpt2", dict(_GPT2, n_embd=2560, n_layer=32, n_head=32, n_positions=2048)),
    "gpt3-6.7b": ("gpt2", dict(_GPT2, n_embd=4096, n_layer=32, n_head=32, n_positions=2048)),
    "gpt3-13b": ("gpt2", dict(_GPT2, n_embd=5120, n_layer=40, n_head=40, n_positions=2048)),
    "bert-base": ("bert", dict(architectures=["BertForPreTraining"], hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                               vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu")),
    "bert-large": ("bert", dict(architectures=["BertForPreTraining"], hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                                vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu")),
    "opt-1.3b": ("opt", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
                             vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048,
                             activation_function="relu", do_layer_norm_before=True)),
    **{f"opt-{size}": ("opt", dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=a, ffn_dim=4 * h,
                                   vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=proj or h,
                                   activation_function="relu", do_layer_norm_before=size != "350m"))
       # the rest of the OPT family (Zhang et al. 2022, Table 1); OPT-350m projects 512-wide embeddings in and out
       # and normalizes after each block
       for size, h, n, a, proj in (("125m", 768, 12, 12, 0), ("350m", 1024, 24, 16, 512), ("2.7b", 2560, 32, 32, 0),
                                   ("6.7b", 4096, 32, 32, 0), ("13b", 5120, 40, 40, 0), ("30b", 7168, 48, 56, 0),
                                   ("66b", 9216, 64, 72, 0))},
    "switch-xl-4": ("switch_transformers", dict(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24,
                                                num_decoder_layers=24, num_experts=4, expert_capacity=64,
                                                num_sparse_encoder_layers=12, num_sparse_decoder_layers=12,
                                                encoder_sparse_step=2, decoder_sparse_step=2, vocab_size=32128,
                                                feed_forward_proj="relu", dropout_rate=0.1, router_jitter_noise=0.01)),
    # Switch-Base (Fedus et al. 2022, the switch-base-8 layout) with 4 experts: the NeuSight L4 "switch4" runs.
    "switch-base-4": ("switch_transformers", dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12,
                                                  num_decoder_layers=12, num_experts=4, expert_capacity=64,
                                                  num_sparse_encoder_layers=6, num_sparse_decoder_layers=6,
                                                  encoder_sparse_step=2, decoder_sparse_step=2, vocab_size=32128,
                                                  feed_forward_proj="relu", dropout_rate=0.1, router_jitter_noise=0.01)),
    # Decoder-only models with RMSNorm, SwiGLU MLPs and rotary positions, from their published configs
    # (Touvron et al. 2023, "Llama 2"; Meta's Llama 3 model card; Jiang et al. 2023, "Mistral 7B"): grouped-query
    # attention where kv heads < heads.
    "llama-2-7b": _llama(4096, 11008, 32, 32, 32, 32000, 4096),
    "llama-2-13b": _llama(5120, 13824, 40, 40, 40, 32000, 4096),
    "llama-3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 8192, rope_theta=500000.0),
    "mistral-7b": _llama(4096, 14336, 32, 32, 8, 32000, 32768, "mistral", sliding_window=4096),
    # Larger and newer members of the same family, from their published config.json files (Meta's Llama 2 / 3 /
    # 3.1 / 3.2, Alibaba's Qwen2.5 and Qwen3, Google's Gemma 2, Microsoft's Phi-3-mini-4k). Llama 3.1 / 3.2's "llama3"
    # rope scaling changes the rotary frequencies only, not a kernel, and is left out.
    "llama-2-70b": _llama(8192, 28672, 80, 64, 8, 32000, 4096),
    "llama-3-70b": _llama(8192, 28672, 80, 64, 8, 128256, 8192, rope_theta=500000.0),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072, rope_theta=500000.0),
    "llama-3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256, 131072, rope_theta=500000.0),
    "llama-3.1-405b": _llama(16384, 53248, 126, 128, 8, 128256, 131072, rope_theta=500000.0),
    "llama-3.2-1b": _llama(2048, 8192, 16, 32, 8, 128256, 131072, head_dim=64, rope_theta=500000.0,
                           tie_word_embeddings=True),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 8, 128256, 131072, head_dim=128, rope_theta=500000.0,
                           tie_word_embeddings=True),
    "qwen2.5-7b": _llama(3584, 18944, 28, 28, 4, 152064, 131072, "qwen2", rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen2.5-72b": _llama(8192, 29568, 80, 64, 8, 152064, 131072, "qwen2", rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3-8b": _llama(4096, 12288, 36, 32, 8, 151936, 40960, "qwen3", head_dim=128, rope_theta=1e6,
                       rms_norm_eps=1e-6),
    # the rest of the dense Qwen3 family (Qwen3 model cards and config.json files): the three smallest tie their
    # embeddings to the head
    **{f"qwen3-{size}": _llama(hidden, inter, layers, heads, 8, 151936, 40960, "qwen3", head_dim=128, rope_theta=1e6,
                               rms_norm_eps=1e-6, tie_word_embeddings=hidden <= 2560)
       for size, hidden, inter, layers, heads in (("0.6b", 1024, 3072, 28, 16), ("1.7b", 2048, 6144, 28, 16),
                                                  ("4b", 2560, 9728, 36, 32), ("14b", 5120, 17408, 40, 40),
                                                  ("32b", 5120, 25600, 64, 64))},
    "gemma-2-9b": ("gemma2", dict(architectures=["Gemma2ForCausalLM"], hidden_size=3584, intermediate_size=14336,
                                  num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                  vocab_size=256000, max_position_embeddings=8192,
                                  hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                                  sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                  rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "phi-3-mini": _llama(3072, 8192, 32, 32, 32, 32064, 4096, "phi3"),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", and its model card): Mistral-7B's layout with 8 SwiGLU
    # experts per layer, 2 chosen per token (traced under balanced routing, neusight.graph.moe).
    "mixtral-8x7b": _llama(4096, 14336, 32, 32, 8, 32000, 32768, "mixtral", num_local_experts=8,
                           num_experts_per_tok=2, rope_theta=1e6),
    "mixtral-8x22b": _llama(6144, 16384, 56, 48, 8, 32768, 65536, "mixtral", num_local_experts=8,
                            num_experts_per_tok=2, rope_theta=1e6),
    # DeepSeek-V2-Lite and DeepSeek-V3 (DeepSeek-AI 2024, their config.json files): multi-head latent attention
    # (keys and values through a rank-512 latent; V3 queries through a rank-1536 one) and fine-grained experts
    # (64 routed + 2 shared, 6 per token / 256 routed + 1 shared, 8 per token) after 1 / 3 dense layers. V3's
    # multi-token-prediction module (14B of the released 685B) is not in transformers' model and not here; its
    # group-limited routing is traced as balanced routing like every router.
    "deepseek-v2-lite": ("deepseek_v2", dict(architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
                                             intermediate_size=10944, moe_intermediate_size=1408,
                                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                                             first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                             vocab_size=102400, topk_method="greedy", n_group=1, topk_group=1,
                                             max_position_embeddings=163840, tie_word_embeddings=False)),
    "deepseek-v3": ("deepseek_v3", dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
                                        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                                        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                                        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                                        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                        v_head_dim=128, vocab_size=129280, n_group=8, topk_group=4,
                                        routed_scaling_factor=2.5, max_position_embeddings=163840,
                                        tie_word_embeddings=False)),
    # Released in 2025, from their published config.json files: Microsoft's Phi-4 (14.7B, Phi-3's layout), Google's
    # Gemma 3 1B-27B (their language models: 5 sliding-window layers of 512 / 1,024 tokens to each global one),
    # Alibaba's Qwen3 mixtures of experts (128 experts of which 8 per token, in every layer) and OpenAI's gpt-oss
    # (experts with biases and a clamped SwiGLU, 4 of 32 / 128 per token; attention with learned sinks, every other
    # layer over a 128-token window). gpt-oss's released experts are stored in MXFP4, which transformers
    # dequantizes where it has no MXFP4 kernel; they are traced dense in the run's dtype.
    "phi-4": _llama(5120, 17920, 40, 40, 10, 100352, 16384, "phi3", rope_theta=250000.0),
    **{f"gemma-3-{size}": ("gemma3_text", dict(architectures=["Gemma3ForCausalLM"], hidden_size=hidden,
                                               intermediate_size=inter, num_hidden_layers=layers,
                                               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                                               vocab_size=262144 if size == "1b" else 262208,
                                               max_position_embeddings=32768 if size == "1b" else 131072,
                                               hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                                               sliding_window=512 if size == "1b" else 1024, rms_norm_eps=1e-6,
                                               tie_word_embeddings=True))
       for size, hidden, inter, layers, heads, kv, head_dim, scalar in (
           ("1b", 1152, 6912, 26, 4, 1, 256, 256), ("4b", 2560, 10240, 34, 8, 4, 256, 256),
           ("12b", 3840, 15360, 48, 16, 8, 256, 256), ("27b", 5376, 21504, 62, 32, 16, 128, 168))},
    **{f"qwen3-{size}": _llama(hidden, 3 * hidden, layers, heads, 4, 151936, 40960, "qwen3_moe", head_dim=128,
                               rope_theta=1e6, rms_norm_eps=1e-6, moe_intermediate_size=moe, num_experts=128,
                               num_experts_per_tok=8, norm_topk_prob=True)
       for size, hidden, layers, heads, moe in (("30b-a3b", 2048, 48, 32, 768), ("235b-a22b", 4096, 94, 64, 1536))},
    **{f"gpt-oss-{size}": ("gpt_oss", dict(architectures=["GptOssForCausalLM"], hidden_size=2880,
                                           intermediate_size=2880, num_hidden_layers=layers, num_attention_heads=64,
                                           num_key_value_heads=8, head_dim=64, num_local_experts=experts,
                                           num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                                           max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
                                           tie_word_embeddings=False))
       for size, layers, experts in (("20b", 24, 32), ("120b", 36, 128))},
    # Meta's Llama 4 Scout and Maverick (their language models, from the published config.json files): 16 / 128
    # experts of which 1 per token beside a shared expert, in every layer / every other one (the others a dense
    # 16,384-wide MLP); three of four layers attend within chunks of 8,192 tokens with rotary positions, every fourth
    # over the whole context without them. transformers runs every expert on every token (moe_kernels= routes them).
    **{f"llama-4-{size}": ("llama4_text", dict(architectures=["Llama4ForCausalLM"], hidden_size=5120,
                                               intermediate_size=8192, intermediate_size_mlp=16384,
                                               num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                                               head_dim=128, vocab_size=202048, num_local_experts=experts,
                                               num_experts_per_tok=1, interleave_moe_layer_step=step,
                                               use_qk_norm=qk_norm, attention_chunk_size=8192,
                                               max_position_embeddings=positions, rope_theta=500000.0,
                                               rms_norm_eps=1e-5, tie_word_embeddings=False))
       for size, experts, step, qk_norm, positions in (("scout", 16, 1, True, 10485760),
                                                       ("maverick", 128, 2, False, 1048576))},
    # LLaVA-1.5 7B / 13B (Liu et al. 2024, from llava-hf's published config.json files): CLIP ViT-L/14 at 336 x 336
    # (its second-to-last layer's 576 patch features, the class token dropped), a two-layer GELU projector, Vicuna
    # v1.5 (Llama 2's layout; 64 more token embeddings, the image token among them). images= runs the encoder;
    # without it, the language model on a text-only prompt.
    **{f"llava-1.5-{size}": ("llava", dict(architectures=["LlavaForConditionalGeneration"], image_token_index=32000,
                                           vision_feature_layer=-2, vision_feature_select_strategy="default",
                                           projector_hidden_act="gelu", tie_word_embeddings=False,
                                           text_config=dict(model_type="llama", hidden_size=hidden,
                                                            intermediate_size=inter, num_hidden_layers=layers,
                                                            num_attention_heads=heads, num_key_value_heads=heads,
                                                            vocab_size=32064, max_position_embeddings=4096,
                                                            rms_norm_eps=1e-5, tie_word_embeddings=False),
                                           vision_config=dict(model_type="clip_vision_model", hidden_size=1024,
                                                              intermediate_size=4096, num_hidden_layers=24,
                                                              num_attention_heads=16, image_size=336, patch_size=14,
                                                              projection_dim=768, hidden_act="quick_gelu")))
       for size, hidden, inter, layers, heads in (("7b", 4096, 11008, 32, 32), ("13b", 5120, 13824, 40, 40))},
    # Vision Transformers (Dosovitskiy et al. 2021, Table 1: ViT-Base / ViT-Large, patch 16) at 224 x 224 with the
    # ImageNet-1k classifier.
    "vit-base": ("vit", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                             image_size=224, patch_size=16, num_labels=1000)),
    "vit-large": ("vit", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                              image_size=224, patch_size=16, num_labels=1000)),
}
PRESET_ALIASES = {"gpt3-1.3b": "gpt3-xl", "bert-base-uncased": "bert-base", "bert-large-uncased": "bert-large",
                  "gpt2-small": "gpt2", "opt-1b3": "opt-1.3b", "switch-4": "switch-xl-4",
                  "resnext50_32x4d": "resnext50-32x4d", "resnext101_32x4d": "resnext101-32x4d",
                  "se_resnext101_32x4d": "se-resnext101-32x4d", "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b",
                  "llama3-8b": "llama-3-8b", "llama2-70b": "llama-2-70b", "llama3-70b": "llama-3-70b",
                  "llama-3.3-70b": "llama-3.1-70b", "llama3.3-70b": "llama-3.1-70b",
                  "deepseek-r1": "deepseek-v3", "deepseek-v3.1": "deepseek-v3", "phi-3-mini-4k": "phi-3-mini",
                  "llama-4-scout-17b-16e": "llama-4-scout", "llama-4-maverick-17b-128e": "llama-4-maverick",
                  "phi3-mini": "phi-3-mini", "mistral-7b-v0.1": "mistral-7b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
                  "mixtral-8x22b-v0.1": "mixtral-8x22b", "vit-b-16": "vit-base", "vit-l-16": "vit-large",
                  "vit_b_16": "vit-base", "vit_l_16": "vit-large"}

HEADS = ("causal-lm", "sequence-classification", "pretraining", "masked-lm", "seq2seq", "image-classification")

# vision presets: name -> (builder, native image size, description)
CNN_PRESETS: dict[str, tuple[Callable[[str], nn.Module], int, str]] = {
    **{n: (_resnet.resnet, 224, "torchvision v1.5 layout" + ("" if n.startswith("resnet") else "; grouped 3x3 convs")
           + (", squeeze-and-excitation" if n.startswith("se-") else "")) for n in _resnet.RESNET_LAYERS},
    **{n: (_efficientnet.efficientnet, _efficientnet.RESOLUTION[n],
           "MBConv blocks: depthwise convs, squeeze-and-excitation, SiLU") for n in _efficientnet.SCALING},
}


@dataclass
class BuiltModel:
    """A model on the meta device with what it takes to feed it and to take a loss of its output."""

    name: str
    module: nn.Module
    kind: str                                   # "hf" | "vision" | "module"
    make_inputs: Callable[[int, int | None], tuple[tuple, dict]]
    loss: Callable[[Any, tuple, dict], torch.Tensor]
    needs_seq_len: bool
    max_seq_len: int | None = None
    notes: list[str] = field(default_factory=list)
    image_size: int | None = None               # vision models: the side of the square input images
    images: int | None = None                   # image-text models: images per sequence (their pixel_values)
    image_tokens: int = 0                       # ... and the positions of a sequence their features fill


def flop_counter_total(built: BuiltModel, mode: str, batch: int, seq: int | None) -> float:
    """torch's own count (``torch.utils.flop_counter.FlopCounterMode``) of ``built``'s forward pass, plus the
    loss's backward in training, on the meta device: the reference the tracer's GEMM / convolution FLOPs are
    checked against (tests, scripts/bench_models.py). Runs the model as is, without the tracer's CUDA paths."""
    from torch.utils.flop_counter import FlopCounterMode

    args, kwargs = built.make_inputs(batch, seq)
    built.module.train(mode == "training")
    checks = transformers_checks_off() if built.images else contextlib.nullcontext()
    with FlopCounterMode(display=False) as fc, checks:
        if mode == "training":
            out = built.module(*args, **kwargs)
            built.loss(out, args, kwargs).backward()
        else:
            with torch.no_grad():
                built.module(*args, **kwargs)
    return float(fc.get_total_flops())


def list_models() -> list[str]:
    """Preset names, sorted."""
    return sorted(list(HF_PRESETS) + list(CNN_PRESETS))


# "flash_attention_2" / "_3": transformers' flash-attn integrations; the package is not installed here, so the model
# is built for "sdpa" and the tracer runs its attention calls as flash-attn's kernel (neusight.graph.tracer._flash_attn)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


def _hf_attention(attn: str) -> str:
    """The attn_implementation transformers builds the model with (flash-attn's through sdpa)."""
    return "sdpa" if attn.startswith("flash_attention") else attn


def build_model(model: str | os.PathLike | nn.Module, *, head: str | None = None, attn_implementation: str = "eager",
                image_size: int | None = None, input_shapes: list[tuple[int, ...]] | None = None,
                dtype: torch.dtype = torch.float32, moe_kernels: str = "auto",
                grouped_gemm: bool = False, images: int | None = None) -> BuiltModel:
    """Build a model on the meta device from a preset name, an HF config (JSON path, ``PretrainedConfig`` or a
    dict with ``model_type``) or an nn.Module; ``images``: a multimodal model's image-text class, fed that many
    images per sequence (:func:`_hf_image_text`)."""
    if images is not None and (not isinstance(images, int) or isinstance(images, bool) or images < 1):
        raise InputError(f"images={images!r} is not a positive integer (images per sequence). Fix: e.g. images=1, "
                         "or leave images out for a text-only prompt")
    if head is not None and head not in HEADS:
        raise ModelError(f"head={head!r} is not known; use one of {', '.join(HEADS)} or None (the config's architectures)")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ModelError(f"attn_implementation={attn_implementation!r} is not supported; use one of "
                         f"{', '.join(map(repr, ATTN_IMPLEMENTATIONS))}")
    if isinstance(model, nn.Module):
        return _from_module(model, input_shapes, dtype, images)
    if isinstance(model, dict) or callable(getattr(model, "to_dict", None)):   # a config in memory
        if input_shapes:
            raise InputError(f"input_shapes={input_shapes!r} is for an nn.Module; a config builds its own inputs. "
                             "Fix: leave input_shapes out")
        cfg = dict(model) if isinstance(model, dict) else model.to_dict()
        if not cfg.get("model_type"):
            raise ModelError(f"model={type(model).__name__} has no 'model_type'; pass a transformers config "
                             "(e.g. transformers.GPT2Config(n_layer=6)) or a dict with 'model_type' and its fields")
        model_type = cfg.pop("model_type")
        name = str(cfg.get("_name_or_path") or model_type)
        return _hf(name, model_type, cfg, head, attn_implementation, dtype, image_size, moe_kernels, grouped_gemm,
                   images=images)
    name = str(model)
    if input_shapes and not (MODULE_REF.match(name) and not Path(name).expanduser().exists()):
        raise InputError(f"input_shapes={input_shapes!r} is for an nn.Module (or 'package.module:Class'); model={name!r} "
                         "builds its own inputs. Fix: leave input_shapes out")
    key = PRESET_ALIASES.get(name.lower(), name.lower())
    if key in CNN_PRESETS:
        if images is not None:
            raise InputError(f"images={images} is for multimodal models (LLaVA, Gemma 3, PaliGemma, ...); {key} is a "
                             "CNN, fed a batch of images by batch_size. Fix: leave images out")
        if head not in (None, "image-classification"):
            raise ModelError(f"head={head!r} is for Hugging Face models; {key} is a CNN preset with its own "
                             "classifier. Fix: leave head out")
        return _vision(key, image_size, dtype)
    if key in HF_PRESETS:
        model_type, kwargs = HF_PRESETS[key]
        return _hf(key, model_type, copy.deepcopy(kwargs), head, attn_implementation, dtype, image_size, moe_kernels,
                   grouped_gemm, images=images)
    path = Path(name).expanduser()
    if path.suffix == ".json" or path.exists():
        cfg = _read_config_json(path)
        return _hf(path.name if path.is_dir() else path.stem, cfg.pop("model_type"), cfg, head, attn_implementation,
                   dtype, image_size, moe_kernels, grouped_gemm, images=images)
    if MODULE_REF.match(name):
        return _from_module(_import_module_ref(name), input_shapes, dtype, images)
    cached = _cached_hub_config(name)
    if cached is not None:
        built = _hf(name, cached.pop("model_type"), cached, head, attn_implementation, dtype, image_size,
                    moe_kernels, grouped_gemm, images=images)
        built.notes.insert(0, f"{name}: its config.json from the local Hugging Face cache")
        return built
    preset = _preset_of_hub_name(name)
    if preset is not None:
        model_type, kwargs = HF_PRESETS[preset]
        built = _hf(preset, model_type, copy.deepcopy(kwargs), head, attn_implementation, dtype, image_size,
                    moe_kernels, grouped_gemm, images=images)
        built.notes.insert(0, f"{name!r} built as the preset {preset}, the same architecture (its own config.json, "
                              "as a path, would give the exact one)")
        return built
    close = difflib.get_close_matches(key, list_models() + list(PRESET_ALIASES), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    if _HUB_ID.match(name):
        raise ModelError(f"model={name!r} looks like a Hugging Face Hub id, but {_hub_config_problem(name)}, or a "
                         f"preset (neusight-predict model=list prints them).{hint}")
    raise ModelError(f"model={name!r} is neither a preset nor an existing config JSON.{hint} "
                     f"Presets: {', '.join(list_models())}; or pass the path of a Hugging Face config.json (or of "
                     "a downloaded model's directory), a Hub id whose config.json is in your Hugging Face cache, or "
                     "'package.module:ClassName' of your own nn.Module (with input_shapes).")


# words of a Hub model name that do not change its architecture: fine-tuned variants ("-Instruct", "-chat", "-it",
# "-Thinking"), the "-hf" of converted checkpoints, the "Meta-" of "Meta-Llama-3-8B", and a last word of four digits:
# the month of a retrained release ("Qwen3-30B-A3B-Instruct-2507", "DeepSeek-V3-0324")
_VARIANT_WORDS = {"hf", "instruct", "chat", "it", "base", "thinking"}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _preset_of_hub_name(name: str) -> str | None:
    """The preset a Hugging Face Hub name stands for (``meta-llama/Llama-2-7b-chat-hf`` -> ``llama-2-7b``,
    ``Qwen/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b``), or None. Only words that name a fine-tuned variant of the
    same architecture are dropped; versions are kept (Mistral 7B v0.1 and v0.3 differ)."""
    words = name.rsplit("/", 1)[-1].lower().split("-")
    if words and words[0] == "meta" and len(words) > 1:
        words = words[1:]
    if len(words) > 1 and re.fullmatch(r"\d{4}", words[-1]):
        words = words[:-1]
    kept = "-".join(w for w in words if w not in _VARIANT_WORDS)
    key = PRESET_ALIASES.get(kept, kept)
    return key if key in HF_PRESETS else None


def _cached_hub_config(name: str) -> dict[str, Any] | None:
    """The config of Hub id ``name`` (``org/model``) if its config.json is in the local Hugging Face cache (never a
    download), as a dict with ``model_type``; None otherwise."""
    if not _HUB_ID.match(name):
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception:   # noqa: BLE001 - not cached, not a Hub id, or a config transformers cannot read
        return None
    return config.to_dict()


def _hub_config_problem(name: str) -> str:
    """Why Hub id ``name`` gave no config: its config.json not in the local Hugging Face cache, or there but not
    readable by the installed transformers; with the fix, for an error message."""
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json")
    if not isinstance(cached, str):
        return (f"its config.json is not in your Hugging Face cache ({constants.HF_HUB_CACHE}), and nothing is "
                f"downloaded. Fix: fetch that one file once (hf download {name} config.json) and run again, or pass "
                "the path of the model's config.json")
    import transformers
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception as e:   # noqa: BLE001 - the reason goes into the message
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    else:   # readable now (written since the first look): nothing wrong with it
        return f"its cached config.json ({cached}) gave no model here. Fix: run again"
    return (f"its cached config.json ({cached}) cannot be read by transformers {transformers.__version__} "
            f"({reason[:200]}). Fix: pass the path of a config.json this transformers reads (a newer transformers "
            "may know the model type)")


# "package.module:Attribute": an importable nn.Module class, or a function returning a module, called with no
# arguments (the command-line way to trace your own model; with input_shapes=...).
MODULE_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _import_module_ref(ref: str) -> nn.Module:
    import importlib

    mod_name, attr = ref.split(":", 1)
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:   # a console script's path lacks the working directory, where a user's own module usually is
        sys.path.append(cwd)
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or anything the module raises while importing
        raise ModelError(f"model={ref!r}: cannot import {mod_name!r} ({type(e).__name__}: {e}). Fix: make it importable "
                         "(install it, or run from its directory / set PYTHONPATH)") from None
    finally:
        if added:
            sys.path.remove(cwd)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model={ref!r}: {mod_name!r} has no attribute {attr!r}; give 'module:ClassOrFunction'")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise ModelError(f"model={ref!r} is neither an nn.Module nor a class or function that makes one")
    try:
        made = obj()
    except Exception as e:
        raise ModelError(f"model={ref!r}: calling {attr}() with no arguments failed ({type(e).__name__}: {e}). Fix: "
                         "point at a function that builds the model with its arguments filled in") from None
    if not isinstance(made, nn.Module):
        raise ModelError(f"model={ref!r}: {attr}() returned {type(made).__name__}, not an nn.Module")
    return made


def _read_config_json(path: Path) -> dict[str, Any]:
    if path.is_dir() and (path / "config.json").is_file():   # a downloaded model's directory
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(f"model config {str(path)!r} does not exist; pass a preset name or the path of a config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"model config {str(path)!r} is not valid JSON ({e}); fix the file or pass a preset name") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ModelError(f"model config {str(path)!r} has no 'model_type' field; a Hugging Face config.json needs one")
    return cfg


# ---------------------------------------------------------------------------------------------------------
# Hugging Face models


def _is_vision(config: Any) -> bool:
    """An image model's config: input channels and an image size or no token vocabulary (ViT, DeiT, Swin,
    ConvNeXt, BEiT, whose vocabulary is of visual tokens, ...), unless transformers has a language-model class for
    it or an image-text-to-text class (Fuyu, UDOP: token ids with image patches beside them), which go the way of
    text and multimodal models."""
    if not (hasattr(config, "num_channels") and (hasattr(config, "image_size") or not hasattr(config, "vocab_size"))):
        return False
    import transformers

    return not any(type(config) in getattr(transformers, auto)._model_mapping
                   for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                                "AutoModelForImageTextToText"))


def _hf(name: str, model_type: str, kwargs: dict[str, Any], head: str | None, attn: str, dtype: torch.dtype,
        image_size: int | None = None, moe_kernels: str = "auto", grouped_gemm: bool = False,
        lm_head: dict[str, Any] | None = None, images: int | None = None) -> BuiltModel:
    import transformers
    from transformers import AutoConfig

    architectures = kwargs.pop("architectures", None)
    for k in ("transformers_version", "torch_dtype", "dtype", "_name_or_path"):
        kwargs.pop(k, None)
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError) as e:
        raise ModelError(f"model_type={model_type!r} of {name!r} is not a transformers config type ({e})") from None
    vision = _is_vision(config)
    if image_size is not None and not vision:
        raise InputError(f"image_size={image_size!r} is for image models; {name!r} ({model_type}) takes tokens: "
                         "leave image_size out and give seq_len")
    if images is not None and getattr(config, "vision_config", None) is None:
        raise InputError(f"images={images} is for multimodal models with an image encoder (LLaVA, Gemma 3, "
                         f"PaliGemma, InternVL, ...); {name!r} ({model_type}) has none. Fix: leave images out")
    if vision:
        return _hf_vision(name, model_type, config, head, architectures, attn, dtype, image_size, transformers)
    text = getattr(config, "text_config", None)
    multimodal = not hasattr(config, "vocab_size") and hasattr(text, "vocab_size") and getattr(text, "model_type", None)
    if images is not None:
        return _hf_image_text(name, model_type, config, head, attn, dtype, images, moe_kernels, grouped_gemm)
    if multimodal:
        # a multimodal model (Gemma 3, Llama 4, Qwen3.5, Mistral 3, LLaVA, ...): its language model, as a text-only
        # prompt runs it; the image / audio encoders run only on those inputs and are not traced
        towers = [k.replace("_config", "") for k in ("vision_config", "audio_config", "speech_config")
                  if getattr(config, k, None) is not None]
        sub = text.to_dict()
        # a language model with no causal-LM class of its own (Qwen2-VL's, Qwen3-VL's, ...) gets the head its
        # ...ForConditionalGeneration puts on it, tied to the embeddings as the composite config says
        tied = getattr(config, "tie_word_embeddings", None)
        head_of = {"tied": bool(getattr(text, "tie_word_embeddings", False) if tied is None else tied),
                   "owner": model_type}
        try:
            built = _hf(name, sub.pop("model_type"), sub, head, attn, dtype, None, moe_kernels, grouped_gemm,
                        lm_head=head_of)
        except ModelError as e:
            raise ModelError(f"{model_type} is multimodal and is forecast through its language model (its "
                             f"text_config, {text.model_type}), which failed: {e}") from None
        built.notes.insert(0, f"the language model of {model_type} (its text_config, {text.model_type}), as a "
                              "text-only prompt runs it; " + (f"the {' and '.join(towers)} encoder"
                              f"{'s are' if len(towers) > 1 else ' is'} not traced" if towers else
                              "nothing else of it is traced"))
        return built
    if not hasattr(config, "vocab_size"):
        parts = [k for k in ("text_config", "vision_config", "audio_config", "speech_config") if hasattr(config, k)]
        which = f" (a composite config: {', '.join(parts)})" if parts else ""
        raise ModelError(f"model {name!r} ({model_type}) has no token vocabulary{which}; text models (input_ids) and "
                         "image models (pixel_values) are supported, and a multimodal model through the language "
                         "model of its text_config, which this config lacks. Trace the part you want as an nn.Module "
                         "with input_shapes=[...]")
    cls = _hf_class(config, model_type, head, architectures, transformers)
    bare = cls is _base_class(config, transformers)   # the headless model: no output projection, no loss
    takes = inspect.signature(cls.forward).parameters
    if "input_ids" not in takes:
        needed = [n for n, p in takes.items() if n != "self" and p.default is inspect.Parameter.empty
                  and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        raise ModelError(f"{cls.__name__} (model {name!r}) takes {', '.join(needed) or 'inputs'} rather than token ids; "
                         "text models (input_ids) and image models (pixel_values) are supported, audio and other "
                         "inputs are not. Trace it as an nn.Module with input_shapes=[...] instead")
    notes: list[str] = []
    module = _build_hf(cls, config, name, attn, dtype)
    _strays_to_meta(module, dtype)
    is_seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    notes.extend(_route_experts(module, config, model_type, name, moe_kernels, grouped_gemm))
    max_len = _max_positions(config, model_type)
    vocab = config.vocab_size
    kind_name = type(module).__name__

    def make_inputs(batch: int, seq: int | None) -> tuple[tuple, dict]:
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")  # (B, T)
        kw: dict[str, Any] = {"input_ids": ids}
        if is_seq2seq:
            kw["decoder_input_ids"] = ids
            kw["decoder_attention_mask"] = torch.ones(batch, seq, dtype=torch.long, device="meta")
        return (), kw

    loss = _token_loss(vocab)

    if bare and lm_head is not None and head in (None, "causal-lm") and not is_seq2seq and \
            hasattr(module, "get_input_embeddings"):
        module = TextModelWithLMHead(module, vocab, tied=lm_head["tied"], dtype=dtype)
        notes.append(f"{kind_name} has no causal-LM class: traced with the LM head {lm_head['owner']}'s model "
                     "puts on it (" + ("tied to the token embeddings" if lm_head["tied"] else "weights of its own")
                     + "), on the positions logits_to_keep asks for")
        bare = False
    notes.insert(0, f"{kind_name} from a {model_type} config, attn_implementation={attn}")
    if bare:
        notes.insert(1, f"{kind_name} has no task head: traced without an output projection; in training the mean "
                        "of its output stands in for the loss")
    return BuiltModel(name, module, "hf", make_inputs, loss, True, max_len, notes)


def _hf_image_text(name: str, model_type: str, config: Any, head: str | None, attn: str, dtype: torch.dtype,
                   images: int, moe_kernels: str, grouped_gemm: bool) -> BuiltModel:
    """A multimodal model as its image-text class runs a prompt of ``images`` images per sequence: the image encoder
    and its projector on every image (``pixel_values`` of the encoder's fixed size), the features put into the
    token embeddings at the image tokens' positions, then the language model and its head over the whole sequence,
    as ``...ForConditionalGeneration.forward`` computes it (the image tokens are part of ``seq_len``). An encoder
    that takes more than fixed-size pixel values (image sizes, tiles, patch grids, a second prompt) is refused."""
    import transformers

    if head not in (None, "causal-lm"):
        raise InputError(f"head={head!r}: images= traces {model_type}'s image-text class, whose head is its "
                         "language model's. Fix: leave head out")
    cls = transformers.AutoModelForImageTextToText._model_mapping.get(type(config), None)
    if cls is None:
        raise ModelError(f"images={images}: transformers has no image-text-to-text class for {model_type}. Fix: "
                         "leave images out to forecast its language model on a text-only prompt")
    vision, text = config.vision_config, getattr(config, "text_config", None) or config
    size = getattr(vision, "image_size", None)
    side = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (list, tuple)) else ()
    channels = getattr(vision, "num_channels", 3)
    module = _build_hf(cls, config, name, attn, dtype)
    _strays_to_meta(module, dtype)
    notes = _route_experts(module, text, text.model_type, name, moe_kernels, grouped_gemm)
    # the class's own encoder-and-projector call (on the composite, or on its inner model: DeepSeek-VL, Janus)
    features = getattr(module, "get_image_features", None) or getattr(getattr(module, "model", None),
                                                                      "get_image_features", None)
    tokens, why = None, f"its vision config gives no image_size of two sides but {size!r}"
    if features is None:
        why = f"{cls.__name__} has no get_image_features"
    elif len(side) == 2:
        one = torch.zeros(1, channels, *side, dtype=dtype, device="meta")
        try:
            with torch.no_grad(), transformers_checks_off():
                tokens = _feature_rows(features(pixel_values=one), text.hidden_size)
            why = f"its features are not token embeddings of the language model's width, {text.hidden_size}"
        except Exception as e:   # an encoder that needs more than the pixels: say what transformers said
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not tokens:
        raise ModelError(f"images={images}: {cls.__name__}'s image encoder ({vision.model_type}) cannot be traced on "
                         f"fixed-size pixel values alone ({why}); images= covers the encoders that can (LLaVA, "
                         "Gemma 3, PaliGemma, InternVL, Aya Vision, ...). Fix: leave images out to forecast its "
                         "language model on a text-only prompt")

    def make_inputs(batch: int, seq: int | None) -> tuple[tuple, dict]:
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")   # (B, T), the image tokens among them
        pixels = torch.zeros(batch * images, channels, *side, dtype=dtype, device="meta")
        return (), {"input_ids": ids, "pixel_values": pixels}

    many = "s" if images > 1 else ""
    notes.insert(0, f"{cls.__name__} from a {model_type} config, attn_implementation={attn}: {images} image{many} of "
                    f"{side[0]}x{side[1]} per sequence through its {vision.model_type} encoder and projector, "
                    f"{tokens} positions of the sequence each (its image tokens; the rest of seq_len is text)")
    return BuiltModel(name, module, "hf", make_inputs, _token_loss(text.vocab_size), True,
                      _max_positions(text, text.model_type), notes, images=images, image_tokens=images * tokens)


def _feature_rows(out: Any, hidden: int) -> int | None:
    """How many token embeddings of width ``hidden`` ``get_image_features`` returned for one image: its tensor, its
    list of per-image tensors, or the projected features an output object carries as ``pooler_output``."""
    if not isinstance(out, (torch.Tensor, list, tuple)):
        pooled = getattr(out, "pooler_output", None)
        out = pooled if pooled is not None else getattr(out, "last_hidden_state", None)
    parts = [out] if isinstance(out, torch.Tensor) else list(out or [])
    if not parts or not all(isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == hidden for t in parts):
        return None
    return sum(t.numel() for t in parts) // hidden


@contextlib.contextmanager
def transformers_checks_off() -> Iterator[None]:
    """transformers' data checks off (``TRANSFORMERS_DISABLE_TORCH_CHECK``, its switch for production): an image-text
    model checks that its image tokens number its features, a count of values a meta tensor does not have."""
    before = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = before


def _route_experts(module: nn.Module, config: Any, model_type: str, name: str, moe_kernels: str,
                   grouped_gemm: bool) -> list[str]:
    """Set the kernels and the (balanced) routing of ``module``'s mixture-of-experts layers (:mod:`neusight.graph.moe`);
    the notes that say what was chosen. ``moe_kernels`` other than "auto" on a model without routed experts is
    refused."""
    notes: list[str] = []
    chosen = False    # whether moe_kernels chose the kernels of some experts layer
    if model_type == "switch_transformers":
        from neusight.graph.moe import fix_switch_capacity

        notes.append(fix_switch_capacity(module, config))
    else:
        from neusight.graph.moe import (fix_llama4_experts, fix_routed_experts, fix_size_list_gates,
                                        fix_zero_compute_experts)

        kernels_notes = [fix_llama4_experts(module, moe_kernels), fix_routed_experts(module, moe_kernels, grouped_gemm)]
        chosen = any(kernels_notes)
        notes.extend(n for n in kernels_notes + [fix_size_list_gates(module), fix_zero_compute_experts(module)] if n)
    if moe_kernels != "auto" and not chosen:
        raise InputError(f"moe_kernels={moe_kernels!r} chooses the kernels of top-k routed experts layers (Mixtral, "
                         f"Qwen-MoE, DeepSeek, gpt-oss, Llama 4, ...); {type(module).__name__} (model {name!r}) has "
                         "none" + (": Switch Transformers' experts run as transformers runs them"
                                   if model_type == "switch_transformers" else "") + ". Fix: leave moe_kernels out")
    return notes


def _token_loss(vocab: int) -> Callable[[Any, tuple, dict], torch.Tensor]:
    """The training loss of a token model's output: cross-entropy over its main logits against its input ids, as
    the NeuSight labels were measured."""

    def loss(out: Any, args: tuple, kw: dict) -> torch.Tensor:
        logits = getattr(out, "logits", None)
        logits = getattr(out, "prediction_logits", None) if logits is None else logits
        if logits is None:   # a bare encoder (no task head exists for it): the mean of its output stands in
            feats = getattr(out, "last_hidden_state", None)
            return (feats if feats is not None else out[0]).float().mean()
        ids = kw["input_ids"]
        if logits.dim() == 2:  # sequence classification: (B, num_labels)
            return F.cross_entropy(logits, ids[:, 0] % logits.shape[-1])
        if tuple(logits.shape[:-1]) != tuple(ids.shape):   # a head that predicts its own positions (Perceiver's
            target = torch.zeros(logits.shape[:-1].numel(), dtype=torch.long, device=logits.device)   # decoder)
        else:
            target = ids.reshape(-1) % vocab
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target)

    return loss


def _max_positions(config: Any, model_type: str) -> int | None:
    """The most positions ``config``'s model takes; None for any length (relative position buckets, XLNet's -1)."""
    max_len = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if model_type in ("t5", "switch_transformers") or not (isinstance(max_len, int) and max_len > 0):
        return None
    return max_len


class TextModelWithLMHead(nn.Module):
    """A multimodal model's language model as its ``...ForConditionalGeneration`` runs a text-only prompt, where
    transformers has no causal-LM class for the language model alone (Qwen2-VL, Qwen3-VL, GLM-OCR, ...): the text
    model, then the LM head (``hidden -> vocab``, no bias; tied to the token embeddings when the config ties them)
    on the last ``logits_to_keep`` positions (0: all), as those classes' forward does. Named and shaped like a
    causal LM (``model``, ``lm_head``, ``config``, the cache arguments), so a trace, a KV cache, LoRA, tensor
    parallelism and quantization treat it as one."""

    def __init__(self, model: nn.Module, vocab: int, *, tied: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        embed = model.get_input_embeddings()
        self.lm_head = nn.Linear(embed.weight.shape[1], vocab, bias=False, device="meta", dtype=dtype)
        if tied:
            self.lm_head.weight = embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None, cache: Any = None,
                inputs_embeds: Any = None, use_cache: Any = None, logits_to_keep: int = 0, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, keep, :]),
                                      past_key_values=getattr(out, "past_key_values", None),
                                      hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))


def _build_hf(cls: Any, config: Any, name: str, attn: str, dtype: torch.dtype) -> nn.Module:
    """``cls`` built from ``config`` on the meta device for the attention implementation ``attn``, as transformers
    admits it: a class without an SDPA path (``_supports_sdpa`` False: Gemma 2, gpt-oss, ...) refuses ``sdpa`` with
    the implementations it has, and one without a flash-attn path refuses ``flash_attention_2`` / ``_3`` (a class
    with neither, for them all but ``eager``). flash-attn is not installed here, so a flash-attn run is built for
    SDPA (:func:`_hf_attention`), whose calls the tracer runs as flash-attn's kernel; a class with flash-attn but no
    SDPA path is built eager and then switched to :data:`FLASH_VIA_SDPA` (transformers picks the attention function
    per call from ``config._attn_implementation``)."""
    sdpa = bool(getattr(cls, "_supports_sdpa", False))
    flash = bool(getattr(cls, "_supports_flash_attn", False))
    wanted = "sdpa" if attn == "sdpa" else "flash-attn" if attn.startswith("flash_attention") else None
    if wanted and not (sdpa if wanted == "sdpa" else flash):
        has = ["eager"] + (["sdpa"] if sdpa else []) + (["flash_attention_2", "flash_attention_3"] if flash else [])
        raise ModelError(f"attn_implementation={attn!r}: transformers has no {wanted} path for {cls.__name__} (model "
                         f"{name!r}); it runs attn_implementation={' | '.join(has)}. Fix: attn_implementation="
                         f"{has[-1]}")
    switch = wanted == "flash-attn" and not sdpa
    try:
        with torch.device("meta"):
            module = cls._from_config(config, attn_implementation="eager" if switch else _hf_attention(attn),
                                      dtype=dtype)
    except Exception as e:  # transformers raises many types for an unusable config
        raise ModelError(f"could not build {cls.__name__} from {name!r}: {type(e).__name__}: {e}") from None
    if switch:
        _register_flash_via_sdpa()
        module.config._attn_implementation = FLASH_VIA_SDPA
    return module


# The attention function of a model built for flash-attn whose class has no SDPA path (Gemma 2, gpt-oss): SDPA's,
# with SDPA's masks, called without the arguments only flash-attn's kernels take (Gemma 2's logit soft-capping, the
# attention sinks of gpt-oss), which change no kernel's shape; the tracer runs its calls as flash-attn's kernel.
FLASH_VIA_SDPA = "neusight_flash_via_sdpa"


def _register_flash_via_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        kwargs.pop("softcap", None)
        kwargs.pop("s_aux", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(FLASH_VIA_SDPA, attention)
    AttentionMaskInterface.register(FLASH_VIA_SDPA, sdpa_mask)


def _strays_to_meta(module: nn.Module, dtype: torch.dtype) -> None:
    """Put on the meta device, in place, the parameters a model's constructor made on the CPU although it was built
    under ``torch.device("meta")``: legacy constructors (``nn.Parameter(torch.FloatTensor(d, h, k))``, XLNet's
    attention weights) ignore the default device and always make FP32. Loaded onto a GPU they would sit beside the
    others in the model's dtype, so floating-point ones take the run's ``dtype``."""
    swapped: dict[int, nn.Parameter] = {}   # by the stray's id, so a parameter tied between modules stays tied
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is not None and p.device.type != "meta":
                if id(p) not in swapped:
                    like = torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else p.dtype)
                    swapped[id(p)] = nn.Parameter(like, requires_grad=p.requires_grad)
                sub._parameters[key] = swapped[id(p)]


def _hf_class(config: Any, model_type: str, head: str | None, architectures: list[str] | None, transformers: Any) -> Any:
    autos = {"causal-lm": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification",
             "pretraining": "AutoModelForPreTraining", "masked-lm": "AutoModelForMaskedLM",
             "seq2seq": "AutoModelForSeq2SeqLM", "image-classification": "AutoModelForImageClassification"}
    if head is not None:
        auto = getattr(transformers, autos[head])
        try:
            return _first(auto._model_mapping[type(config)])
        except KeyError:
            raise ModelError(f"head={head!r} does not exist for model_type={model_type!r}; "
                             f"choose another head or None") from None
    for arch in architectures or []:
        if hasattr(transformers, arch):
            return getattr(transformers, arch)
    for h in (("image-classification",) if _is_vision(config) else ("causal-lm", "seq2seq", "pretraining", "masked-lm")):
        mapping = getattr(transformers, autos[h])._model_mapping
        if type(config) in mapping:
            return _first(mapping[type(config)])
    base = _base_class(config, transformers)
    if base is None:
        raise ModelError(f"transformers has no model class for model_type={model_type!r} (config class "
                         f"{type(config).__name__}). Fix: pass a config whose model_type transformers can build "
                         "(AutoModel)")
    return base


def _base_class(config: Any, transformers: Any) -> Any:
    """transformers' headless model class for ``config`` (AutoModel's), or None."""
    cls = transformers.AutoModel._model_mapping.get(type(config), None)
    return None if cls is None else _first(cls)


def _first(cls: Any) -> Any:
    """An auto mapping's class for a config; where it lists several (DeiT: with and without a distillation
    teacher), the first."""
    return cls[0] if isinstance(cls, (tuple, list)) else cls


def _hf_vision(name: str, model_type: str, config: Any, head: str | None, architectures: list[str] | None, attn: str,
               dtype: torch.dtype, image_size: int | None, transformers: Any) -> BuiltModel:
    """A Hugging Face image model (ViT, DeiT, Swin, ConvNeXt, ...): square ``pixel_values`` batches of the config's
    image size (or ``image_size``, for which the model is built: position embeddings of that many patches), and a
    cross-entropy over the classifier's logits in training."""
    native = getattr(config, "image_size", 224)
    native = native[0] if isinstance(native, (tuple, list)) else native
    side = int(native) if image_size is None else image_size
    if not isinstance(side, int) or isinstance(side, bool) or side < 8:
        raise InputError(f"image_size={image_size!r} is not a usable image side for {name!r}; use e.g. {native}")
    if hasattr(config, "image_size"):
        config.image_size = side
    cls = _hf_class(config, model_type, head, architectures, transformers)
    module = _build_hf(cls, config, name, attn, dtype)
    channels = int(config.num_channels)

    def make_inputs(batch: int, seq: int | None) -> tuple[tuple, dict]:
        return (), {"pixel_values": torch.zeros(batch, channels, side, side, dtype=dtype, device="meta")}

    def loss(out: Any, args: tuple, kw: dict) -> torch.Tensor:
        logits = getattr(out, "logits", None)
        if logits is None:   # a backbone without a classifier: the mean of its features stands in for a loss
            feats = getattr(out, "last_hidden_state", None)
            return (feats if feats is not None else out[0]).float().mean()
        target = torch.zeros(logits.shape[0], dtype=torch.long, device="meta")
        return F.cross_entropy(logits.reshape(logits.shape[0], -1), target)

    notes = [f"{type(module).__name__} from a {model_type} config, {side}x{side} images, "
             f"{getattr(config, 'num_labels', '?')} classes, attn_implementation={attn}"]
    return BuiltModel(name, module, "hf", make_inputs, loss, False, None, notes, side)


# ---------------------------------------------------------------------------------------------------------
# vision and arbitrary modules


def _vision(name: str, image_size: int | None, dtype: torch.dtype) -> BuiltModel:
    builder, native, note = CNN_PRESETS[name]
    image_size = native if image_size is None else image_size
    if not isinstance(image_size, int) or image_size < 32:
        raise InputError(f"image_size={image_size!r} is too small for {name} (5 stride-2 stages); use >= 32, "
                         f"e.g. {native} (its native resolution)")
    with torch.device("meta"):
        module = builder(name).to(dtype)

    def make_inputs(batch: int, seq: int | None) -> tuple[tuple, dict]:
        return (torch.zeros(batch, 3, image_size, image_size, dtype=dtype, device="meta"),), {}

    def loss(out: torch.Tensor, args: tuple, kw: dict) -> torch.Tensor:
        target = torch.zeros(out.shape[0], dtype=torch.long, device="meta")
        return F.cross_entropy(out, target)

    return BuiltModel(name, module, "vision", make_inputs, loss, False, None,
                      [f"{name} ({note}), {image_size}x{image_size} images, 1000 classes"], image_size)


SEQ_DIM = "seq"   # a dimension of an nn.Module input that takes the run's seq_len


def _input_spec(entry: Any, i: int) -> tuple[tuple[int | str, ...], torch.dtype | None]:
    """One ``input_shapes`` entry -> (dims without the batch, dtype or None for the run's dtype). An entry is a
    shape, e.g. ``(3, 224, 224)``, or a (shape, dtype) pair, e.g. ``(('seq',), torch.long)`` for token ids;
    a dim is a positive int or "seq"."""
    def bad(why: str) -> InputError:
        return InputError(f"input_shapes[{i}]={entry!r}: {why}. Give the dims without the batch, e.g. (3, 224, 224), "
                          f"or a (dims, dtype) pair, e.g. (('seq',), torch.long) for token ids")
    dtype = None
    if (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], (tuple, list))
            and isinstance(entry[1], (torch.dtype, str))):
        entry, dtype = entry
        if isinstance(dtype, str):
            got = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(got, torch.dtype):
                raise bad(f"dtype {dtype!r} is not a torch dtype (long, int32, float16, bool, ...)")
            dtype = got
    if not isinstance(entry, (tuple, list)):
        raise bad("not a shape")
    dims: list[int | str] = []
    for d in entry:
        if d == SEQ_DIM:
            dims.append(SEQ_DIM)
        elif isinstance(d, int) and not isinstance(d, bool) and d > 0:
            dims.append(int(d))
        else:
            raise bad(f"dim {d!r} is neither a positive int nor {SEQ_DIM!r}")
    return tuple(dims), dtype


def _in_run_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The (meta copy of the) caller's module in the run's ``dtype``, so its weights and inputs agree as a GPU needs:
    a module whose floating-point parameters and buffers are all FP32 (PyTorch's default) is cast to ``dtype``, as
    the presets are built in it; one whose are all of another dtype is an InputError unless ``dtype`` is that one.
    A module of mixed dtypes (e.g. FP32 norms in a BF16 model) is traced as it is."""
    floats = {t.dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}
    if len(floats) != 1 or floats == {dtype}:
        return module
    (have,) = floats
    if have == torch.float32:
        return module.to(dtype)
    name, want = str(have).removeprefix("torch."), str(dtype).removeprefix("torch.")
    fix = (f"dtype={name!r}" if have in (torch.float16, torch.bfloat16)
           else f"cast the module to {want} (module.to(torch.{want}))")
    raise InputError(f"dtype={want!r}, but the module's parameters are {name}: its inputs would be {want} and its "
                     f"weights {name}, which a GPU's kernels do not mix. Fix: {fix}")


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of the caller's module with every parameter and buffer on the meta device; the module itself is left as
    it was (its weights, device and gradients: a trace adds LoRA adapters, shards layers, writes gradients).

    Parameters and buffers are swapped for meta tensors of the same shape, dtype and strides before the deep copy
    (so weights are never copied, and tied weights stay tied); whatever else the module holds is copied. A module
    that cannot be deep-copied is moved to the meta device in place instead, with a warning."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(module, memo)
    except Exception as e:   # noqa: BLE001 - any object a deep copy cannot handle
        log.warning("%s cannot be copied (%s: %s); moving the module itself to the meta device, which drops its "
                    "weights", type(module).__name__, type(e).__name__, e)
    try:
        return module.to(device="meta")
    except Exception as e:
        raise ModelError(f"{type(module).__name__} cannot be moved to the meta device: {e}") from None


def _from_module(module: nn.Module, input_shapes: list[Any] | None, dtype: torch.dtype,
                 images: int | None = None) -> BuiltModel:
    if images is not None:
        raise InputError(f"images={images} is for multimodal Hugging Face models; {type(module).__name__} is an "
                         "nn.Module, which takes input_shapes. Fix: leave images out and give the pixel values' shape "
                         "in input_shapes")
    if not input_shapes:
        raise InputError("an nn.Module needs input_shapes=[(dims of input 1 without batch), ...] so the tracer can "
                         "build example inputs, e.g. input_shapes=[(3, 224, 224)], or [(('seq',), torch.long)] for "
                         "token ids of seq_len tokens")
    module = _in_run_dtype(_meta_copy(module), dtype)
    specs = [_input_spec(e, i) for i, e in enumerate(input_shapes)]
    uses_seq = any(SEQ_DIM in dims for dims, _ in specs)

    def make_inputs(batch: int, seq: int | None) -> tuple[tuple, dict]:
        def dim(d: int | str) -> int:
            return int(seq) if d == SEQ_DIM else int(d)
        return tuple(torch.zeros(batch, *map(dim, dims), dtype=dt or dtype, device="meta") for dims, dt in specs), {}

    def loss(out: Any, args: tuple, kw: dict) -> torch.Tensor:
        # NB: an arbitrary module has no target: the mean of its first output stands in for a loss.
        t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
        return t.float().mean()

    def show(dims: tuple, dt: torch.dtype | None) -> str:
        shape = "(batch, " + ", ".join(map(str, dims)) + ")" if dims else "(batch,)"
        return shape + (f" {str(dt).removeprefix('torch.')}" if dt is not None else "")

    return BuiltModel(type(module).__name__, module, "module", make_inputs, loss, uses_seq, None,
                      [f"{type(module).__name__} with inputs " + ", ".join(show(d, t) for d, t in specs)])

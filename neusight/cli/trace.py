"""``neusight-trace model=gpt2-large batch_size=4 seq_len=1024 mode=training``: trace a model and print
the kernel summary per family; the full kernel table goes to CSV."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from neusight.cli.common import CONF_DIR, catch_user_errors, entry_point, quiet_third_party_logs
from neusight.cli.predict import _images_text, _step_options

log = logging.getLogger(__name__)


@dataclass
class TraceConfig:
    model: str = MISSING                 # preset, HF config JSON path, or pkg.module:Class (an nn.Module)
    batch_size: int = 1
    seq_len: Optional[int] = None        # sequence models only; default min(512, max positions)
    mode: str = "inference"              # inference | training
    head: Optional[str] = None           # causal-lm | sequence-classification | pretraining | masked-lm | seq2seq
    optimizer: Optional[str] = "adamw"   # adamw | adam | sgd | adamw-fused | adam-fused | null (training only)
    attn_implementation: str = "eager"   # eager | sdpa | flash_attention_2 | flash_attention_3
    image_size: Optional[int] = None     # vision models; null = the model's native resolution (224, EfficientNet-B4: 380)
    images: Optional[int] = None         # multimodal models (LLaVA, Gemma 3, PaliGemma, ...): images per sequence,
    #                                      encoded and put at image tokens among seq_len's positions; null = text only
    memory_format: str = "contiguous"    # CNNs' layout: contiguous (NCHW, PyTorch's default) | channels_last (NHWC)
    dtype: str = "float32"
    amp: Any = None                      # mixed precision (torch.autocast): float16 | bfloat16 | true; null = none
    fp8: Any = False                     # nn.Linear GEMMs in FP8 (Ada / Hopper / Blackwell / CDNA3): true = torchao-style
    #                                      dynamic scaling | static: a calibrated checkpoint's fixed input scales (serving)
    weight_quant: Optional[str] = None   # inference with int8 / int4 / mxfp4 weights (weight-only, dequantized in
    #                                      the GEMM; mxfp4 in a mixture of experts: its routed experts, as gpt-oss)
    #                                      | nvfp4 (weights and activations in FP4 on Blackwell's FP4 tensor cores)
    kv_cache: Optional[int] = None       # generation: tokens already in the KV cache (seq_len = new tokens per step)
    static_cache: bool = False           # generation: new tokens written in place (StaticCache), not concatenated
    kv_cache_dtype: Optional[str] = None  # with static_cache: the KV cache in fp8 (e4m3) | fp8_e5m2; null = the dtype
    gradient_checkpointing: Any = False  # training: layers recompute their forward in backward (HF); n: every n-th
    lora_rank: Optional[int] = None      # LoRA fine-tuning: adapters of this rank, base weights frozen
    lora_targets: Optional[List[str]] = None  # LoRA's target projections (null: the architecture's defaults)
    moe_kernels: str = "auto"            # routed MoE experts: auto (as transformers runs them on the GPU) | loop |
    #                                      grouped | per-expert (see neusight.trace)
    ssm_kernels: str = "fused"           # state-space / linear-attention layers: fused (mamba_ssm / causal_conv1d /
    #                                      fla kernels) | reference (transformers' PyTorch code; see neusight.trace)
    input_shapes: Optional[List[Any]] = None  # model=pkg.module:Class: its inputs without the batch, e.g. [[3,224,224]]
    #                                      or [[[seq],long]] (token ids of seq_len); see neusight.trace
    device: Optional[str] = None         # the GPU the trace is for (only moe_kernels=auto depends on it)
    csv: Optional[str] = "kernels.csv"   # relative to Hydra's run directory; null to skip


ConfigStore.instance().store(name="trace_schema", node=TraceConfig)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="trace")
@catch_user_errors
def _app(cfg: TraceConfig) -> None:
    import pandas as pd

    from neusight.graph.tracer import trace

    quiet_third_party_logs()
    g = trace(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len, mode=cfg.mode, head=cfg.head,
              optimizer=cfg.optimizer, attn_implementation=cfg.attn_implementation, image_size=cfg.image_size,
              dtype=cfg.dtype, amp=cfg.amp, kv_cache=cfg.kv_cache, device=cfg.device, **_step_options(cfg))
    s = g.summary()
    total = pd.DataFrame([s.sum()], index=["total"])
    print(f"{g.model}: {g.mode}, batch {g.batch_size}" + (f", seq {g.seq_len}" if g.seq_len else "") + _images_text(g)
          + f", {g.n_params / 1e6:.1f} M parameters, {len(g.ops)} aten ops, {len(g.kernels)} kernels")
    for note in g.notes:
        print(f"  note: {note}")
    with pd.option_context("display.float_format", "{:,.2f}".format):
        print(pd.concat([s, total]).to_string())
    if g.unmodeled:
        print(f"unmodeled ops (estimated as memory-bound): {', '.join(g.unmodeled)}")
    if cfg.csv:
        from hydra.core.hydra_config import HydraConfig

        path = cfg.csv if os.path.isabs(cfg.csv) else os.path.join(HydraConfig.get().runtime.output_dir, cfg.csv)
        g.to_csv(path)
        print(f"kernel table: {path}")


main = entry_point(_app, "neusight-trace", "trace", TraceConfig, __doc__)

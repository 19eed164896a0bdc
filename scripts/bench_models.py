"""Which models trace, and do their FLOPs agree with torch's own count? Writes docs/models.md.

    python scripts/bench_models.py                 # ~2 min on 2 cores
    python scripts/bench_models.py --out /tmp/models.md

For every preset, a catalogue of small Hugging Face configs of other architectures (dense, mixture-of-experts,
image, encoder-decoder, state-space) and a few plain nn.Modules (recurrent, convolutional, torch's own
Transformer layers), one inference pass and one training step (forward, loss, backward, AdamW) are traced at a
small size. Each row gives the kernels, the aten ops without a kernel model (charged as memory-bound), the GEMM
and convolution FLOPs of the forward and backward passes, the same count by ``torch.utils.flop_counter.
FlopCounterMode`` around the same model's forward (and backward) on the meta device, their ratio, the trace time
and the forecast on an H100 SXM. Where the ratio is off 1, the document says why (depthwise convolutions are
memory-bound window kernels here, not GEMMs; torch's count of grouped convolutions' gradients).

Nothing here is a measurement of a GPU: the rows check the tracer's coverage and FLOPs, not forecast accuracy
(docs/evaluation.md does that where labels exist).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import neusight  # noqa: E402
from neusight.cli.common import quiet_third_party_logs  # noqa: E402
from neusight.e2e_eval import markdown_table  # noqa: E402
from neusight.graph.models import HF_PRESETS, build_model, flop_counter_total, list_models  # noqa: E402
from neusight.util import atomic_write_text  # noqa: E402

OUT = REPO / "docs" / "models.md"
DEVICE = "h100-sxm5-80gb"
GEMM = ("linear", "bmm", "conv")
BATCH, SEQ = 2, 128

# small configs of architectures without a preset: (model_type, kind, config)
ENCODER = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
HF_CONFIGS = {
    "qwen2": ("dense decoder, biased q/k/v", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=8000)),
    "qwen3": ("dense decoder, q/k norms", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                vocab_size=8000)),
    "gemma": ("dense decoder, multi-query", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                                  vocab_size=8000)),
    "phi": ("dense decoder, partial rotary", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                                   num_attention_heads=4, vocab_size=8000)),
    "gpt_neox": ("dense decoder, parallel blocks", dict(hidden_size=256, intermediate_size=1024,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         vocab_size=8000)),
    "falcon": ("dense decoder, multi-query", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                                   vocab_size=8000)),
    "t5": ("encoder-decoder", dict(d_model=256, d_ff=1024, d_kv=64, num_heads=4, num_layers=2, vocab_size=8000)),
    "bart": ("encoder-decoder", dict(d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                                     vocab_size=8000)),
    "roberta": ("encoder", dict(**ENCODER, vocab_size=8000)),
    # these three branch on their inputs' values (padding, global-attention tokens, an all-ones mask): traced on
    # the branch a plain batch takes (neusight.graph.tracer, _PLAIN_BATCH)
    "deberta-v2": ("encoder, disentangled attention", dict(**ENCODER, vocab_size=8000)),
    "longformer": ("encoder, sliding-window attention", dict(**ENCODER, attention_window=64, vocab_size=8000)),
    "big_bird": ("encoder, block-sparse attention", dict(**ENCODER, vocab_size=8000)),
    # no causal-LM or pretraining class in transformers: its masked-LM one
    "modernbert": ("encoder, masked-LM head", dict(ENCODER)),
    "mixtral": ("routed MoE, 2 of 8 experts", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2,
                                                    num_local_experts=8, num_experts_per_tok=2, vocab_size=8000)),
    "qwen2_moe": ("routed MoE + shared expert", dict(hidden_size=256, intermediate_size=512,
                                                      moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                                      vocab_size=8000)),
    "olmoe": ("routed MoE, 2 of 8 experts", dict(hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                                                  vocab_size=8000)),
    "gpt_oss": ("routed MoE, biased experts", dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                    num_local_experts=8, num_experts_per_tok=2, vocab_size=8000)),
    "gemma2": ("dense decoder, logit soft-capping", dict(hidden_size=256, intermediate_size=512,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, head_dim=64, vocab_size=8000)),
    "starcoder2": ("dense decoder, sliding window", dict(hidden_size=256, intermediate_size=1024,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, vocab_size=8000)),
    "qwen3_moe": ("routed MoE, 2 of 8 experts", dict(hidden_size=256, intermediate_size=512,
                                                      moe_intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                      num_experts=8, num_experts_per_tok=2, vocab_size=8000)),
    "granitemoe": ("routed MoE, 2 of 4 experts", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                       num_attention_heads=4, num_key_value_heads=2,
                                                       num_local_experts=4, num_experts_per_tok=2, vocab_size=8000)),
    "llama4_text": ("MoE, every expert on scaled copies", dict(hidden_size=256, intermediate_size=512,
                                                                intermediate_size_mlp=512, num_hidden_layers=2,
                                                                num_attention_heads=4, num_key_value_heads=2,
                                                                head_dim=64, num_local_experts=4,
                                                                num_experts_per_tok=1, vocab_size=8000)),
    "jamba": ("hybrid state-space + attention, MoE", dict(hidden_size=256, intermediate_size=512,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, num_experts=4,
                                                           num_experts_per_tok=2, attn_layer_period=2,
                                                           attn_layer_offset=1, expert_layer_period=2,
                                                           expert_layer_offset=1, use_mamba_kernels=False,
                                                           vocab_size=8000)),
    "vit": ("image transformer", dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=3,
                                      intermediate_size=768, image_size=224, patch_size=16)),
    "swin": ("image transformer, shifted windows", dict(embed_dim=48, depths=[2, 2], num_heads=[2, 4],
                                                         image_size=224, patch_size=4, window_size=7)),
    "convnext": ("image CNN", dict(hidden_sizes=[48, 96, 192, 384], depths=[1, 1, 1, 1], image_size=224)),
    "mamba": ("state-space (fused kernels)", dict(hidden_size=256, num_hidden_layers=2, vocab_size=8000)),
    "mamba2": ("state-space, chunked scan (fused kernels)", dict(hidden_size=256, num_hidden_layers=2,
                                                                 vocab_size=8000, num_heads=8, head_dim=64,
                                                                 state_size=64, n_groups=1, chunk_size=64)),
}
# traced a second time with transformers' PyTorch reference code for their state-space layers (ssm_kernels)
REFERENCE_SSM = ("mamba", "mamba2")


class LSTMTagger(nn.Module):
    def __init__(self, cell: type = nn.LSTM) -> None:
        super().__init__()
        self.emb, self.rnn = nn.Embedding(8000, 256), cell(256, 512, num_layers=2, batch_first=True)
        self.head = nn.Linear(512, 8000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])


class TorchTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 2)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


class UNetBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SiLU(),
                                  nn.Conv2d(32, 64, 4, 2, 1))
        self.up = nn.Sequential(nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.InstanceNorm2d(32), nn.ReLU(),
                                nn.Conv2d(32, 3, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


TOKENS = [(("seq",), torch.long)]
MODULES = {
    "LSTM tagger (2 layers)": (lambda: LSTMTagger(nn.LSTM), TOKENS, "recurrent"),
    "GRU tagger (2 layers)": (lambda: LSTMTagger(nn.GRU), TOKENS, "recurrent"),
    "nn.TransformerEncoder": (TorchTransformer, [("seq", 256)], "torch's Transformer layers"),
    "conv encoder-decoder": (UNetBlock, [(3, 128, 128)], "conv, transposed conv, group / instance norm"),
}


def _gemm_flops(g: Any) -> float:
    k = g.kernels
    return float(k.loc[k["family"].isin(GEMM) & k["phase"].isin(("forward", "backward")), "flops"].sum())


def _torch_flops(built: Any, mode: str, batch: int, seq: int | None) -> float | None:
    """FlopCounterMode's count (neusight.graph.models.flop_counter_total); None when the model does not run
    outside the tracer."""
    try:
        return flop_counter_total(built, mode, batch, seq)
    except Exception:  # noqa: BLE001 - a model that only runs under the tracer's CUDA paths
        return None


def _row(name: str, kind: str, source: str, model: Any, mode: str, kw: dict, built_kw: dict) -> dict:
    t = time.perf_counter()
    try:
        g = neusight.trace(model, batch_size=BATCH, mode=mode, optimizer="adamw", **kw)
    except Exception as e:  # noqa: BLE001 - a row per model, the failure is the finding
        return {"model": name, "kind": kind, "source": source, "mode": mode, "traces": f"no: {type(e).__name__}",
                "notes": str(e).splitlines()[0][:160]}
    seconds = time.perf_counter() - t
    ours = _gemm_flops(g)
    built = build_model(model, **built_kw)
    theirs = _torch_flops(built, mode, BATCH, g.seq_len)
    p = neusight.predict_graph(g, DEVICE)
    notes = [n for n in g.notes if "traced" in n or "images" in n]
    return {"model": name, "kind": kind, "source": source, "mode": mode, "traces": "yes", "kernels": len(g.kernels),
            "unmodeled ops": ", ".join(g.unmodeled) or "-", "GEMM/conv GFLOP": ours / 1e9,
            "FlopCounterMode GFLOP": None if theirs is None else theirs / 1e9,
            "ratio": None if not theirs else ours / theirs, "trace s": seconds, f"{DEVICE} ms": p.latency_ms,
            "notes": "; ".join(n[:90] for n in notes)}


def run() -> pd.DataFrame:
    rows = []
    for name in list_models():
        vision = build_model(name).image_size is not None
        kw = {} if vision else {"seq_len": SEQ}
        for mode in ("inference", "training"):
            rows.append(_row(name, "vision" if vision else "sequence", "preset", name, mode, kw, {}))
        if HF_PRESETS.get(name, ("", {}))[1].get("vision_config"):    # a multimodal preset: with one image too
            image = {"images": 1}
            seq = SEQ + build_model(name, **image).image_tokens
            for mode in ("inference", "training"):
                rows.append(_row(f"{name} images=1", "image + sequence", "preset", name, mode,
                                 {"seq_len": seq, **image}, image))
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, (kind, cfg) in HF_CONFIGS.items():
            path = Path(tmp) / f"{model_type}.json"
            path.write_text(json.dumps({"model_type": model_type, **cfg}))
            vision = "image" in kind
            kw = {} if vision else {"seq_len": SEQ}
            for mode in ("inference", "training"):
                rows.append(_row(model_type, kind, "HF config", str(path), mode, kw, {}))
            if model_type in REFERENCE_SSM:
                ref = kind.replace("fused kernels", "reference code")
                for mode in ("inference", "training"):
                    rows.append(_row(model_type, ref, "HF config", str(path), mode, {**kw, "ssm_kernels": "reference"}, {}))
    for name, (make, shapes, kind) in MODULES.items():
        uses_seq = any("seq" in (s[0] if isinstance(s[0], tuple) else s) for s in shapes)
        kw = {"input_shapes": shapes, **({"seq_len": SEQ} if uses_seq else {})}
        for mode in ("inference", "training"):
            rows.append(_row(name, kind, "nn.Module", make(), mode, kw, {"input_shapes": shapes}))
    return pd.DataFrame(rows)


def render(df: pd.DataFrame, seconds: float) -> str:
    ok = df[df["traces"] == "yes"]
    ratio = ok["ratio"].dropna()
    lines = ["# Models: what traces, and its FLOPs against torch's count", "",
             f"Generated by `python scripts/bench_models.py` in {seconds:.0f} s (its docstring says how); regenerate "
             "it, do not edit it.", "",
             f"Batch {BATCH}, sequence {SEQ} (vision models at their native resolution); training = forward, loss, "
             f"backward and an AdamW step. {len(ok)} of {len(df)} runs trace; "
             f"{int((ok['unmodeled ops'] != '-').sum())} of them have an op without a kernel model. GEMM / "
             "convolution FLOPs of the forward and backward passes against `FlopCounterMode` on the same model: "
             f"ratio {ratio.min():.3f}-{ratio.max():.3f} over the {len(ratio)} runs torch could count "
             "(median {:.3f}). The last column is a forecast on an H100 SXM, not a measurement.".format(ratio.median()),
             ""]
    lines += ["Where the ratio is not 1:", "",
              "- Depthwise convolutions (EfficientNet, ConvNeXt; one input channel per group) run as direct window "
              "kernels on the GPU and are traced as memory-bound pooling / reduction kernels, so their FLOPs are not "
              "in the GEMM / convolution column: inference ratios of 0.91-0.96.",
              "- Training rows of models with grouped or depthwise convolutions (ResNeXt, EfficientNet, ConvNeXt, "
              "Mamba's and Jamba's causal conv1d): `FlopCounterMode` counts a grouped convolution's two gradients as (1 + groups) "
              "x its forward (checked on a 3x3 layer of 64 channels: 2x at groups 1, 5x at 4, 33x at 32), where "
              "each gradient is a GEMM of the forward's size (2x in all), so those ratios say nothing about the "
              "trace.",
              "- State-space layers traced as their fused kernels (`ssm_kernels=fused`, the default; "
              "neusight/graph/ssm.py): a fused call is one kernel holding all of its reference code's FLOPs, a batched "
              "GEMM where that code multiplies matrices (Mamba-2's chunked scan), a streaming kernel where it does not "
              "(Mamba's per-token selective scan), and its backward three times its forward's FLOPs, while "
              "`FlopCounterMode` counts the reference code's matrix products and their autograd gradients; the "
              "`reference code` rows trace that code itself.", ""]
    uncounted = sorted(set(ok.loc[ok["ratio"].isna(), "model"]))
    if uncounted:
        lines += [f"No ratio for {', '.join(uncounted)}: `FlopCounterMode` runs the model on the meta device "
                  "outside the tracer, where a branch on a tensor's value (a padding or global-attention check) "
                  "fails; the tracer takes the branch of a plain batch there.", ""]
    shown = df.copy()
    for col, fmt in (("GEMM/conv GFLOP", "{:,.2f}"), ("FlopCounterMode GFLOP", "{:,.2f}"), ("ratio", "{:.3f}"),
                     ("trace s", "{:.2f}"), (f"{DEVICE} ms", "{:,.2f}")):
        if col in shown:
            shown[col] = shown[col].map(lambda v, f=fmt: "" if pd.isna(v) else f.format(v))
    shown = shown.fillna("")
    lines += [markdown_table(shown, index=False), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    quiet_third_party_logs()
    t = time.perf_counter()
    df = run()
    text = render(df, time.perf_counter() - t)
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

"""GPU against GPU for the questions users ask: forecasts of a few common runs on common GPUs. Writes docs/hardware.md.

    python scripts/hardware_table.py                 # ~1 min on 2 cores
    python scripts/hardware_table.py --out /tmp/hardware.md

Each run is traced once, and again for a GPU on which the software stack takes another path (the experts' grouped
GEMM, the attention backend: ``neusight.graph.tracer.software_path``), as ``neusight-predict`` does, and predicted on
every GPU with the shipped predictors (``neusight.predict_graph``; AMD GPUs by data/predictor-amd), memory included: a
step that does not fit is marked. These are forecasts: the accuracy
the method reaches where it could be measured is in docs/evaluation.md (FP32 training and inference of the
NeuSight label models, CNN rows in FP32 / TF32 / AMP) and docs/unseen.md; mixed-precision, FP8 and quantized
transformers and generation have no measurement to check against.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neusight.cli.common import quiet_third_party_logs  # noqa: E402
from neusight.e2e_eval import markdown_table  # noqa: E402
from neusight.util import atomic_write_text  # noqa: E402

GPUS = ("a100-sxm4-40gb", "a100-80gb-pcie", "h100-sxm5-80gb", "h200", "b200", "v100-sxm2-32gb", "l4", "rtx-4090",
        "mi250")
# (label, model, trace keyword arguments)
RUNS = [
    ("GPT-3 2.7B training, batch 2, seq 2048, FP32, AdamW", "gpt3-2.7b",
     dict(batch_size=2, seq_len=2048, mode="training")),
    ("GPT-3 2.7B training, batch 2, seq 2048, bf16 autocast, AdamW", "gpt3-2.7b",
     dict(batch_size=2, seq_len=2048, mode="training", amp="bfloat16")),
    ("GPT-2 Large inference, batch 8, seq 1024, FP32", "gpt2-large", dict(batch_size=8, seq_len=1024, mode="inference")),
    ("BERT Large training, batch 16, seq 512, FP32, AdamW", "bert-large",
     dict(batch_size=16, seq_len=512, mode="training")),
    ("ResNet-50 training, batch 128, float (TF32 convolutions where the GPU has them), SGD", "resnet50",
     dict(batch_size=128, mode="training", optimizer="sgd")),
    ("GPT-3 2.7B training, batch 2, seq 2048, FP32, AdamW, gradient checkpointing", "gpt3-2.7b",
     dict(batch_size=2, seq_len=2048, mode="training", gradient_checkpointing=True)),
    ("Llama-2-7B LoRA fine-tuning (rank 16), batch 4, seq 512, bf16, gradient checkpointing", "llama-2-7b",
     dict(batch_size=4, seq_len=512, mode="training", dtype="bfloat16", lora_rank=16, gradient_checkpointing=True)),
    ("Llama-2-7B decode step, batch 8, context 2048, FP16", "llama-2-7b",
     dict(batch_size=8, seq_len=1, mode="inference", kv_cache=2047, dtype="float16")),
    ("Mixtral 8x7B (2 of 8 experts per token) decode step, batch 8, context 2048, bf16", "mixtral-8x7b",
     dict(batch_size=8, seq_len=1, mode="inference", kv_cache=2047, dtype="bfloat16")),
    ("Llama-3-8B inference, batch 4, seq 1024, bf16 with FP8 linear layers, under torch.compile", "llama-3-8b",
     dict(batch_size=4, seq_len=1024, mode="inference", dtype="bfloat16", fp8=True, fused=True)),
    ("Llama-3-8B inference, batch 4, seq 1024, bf16 with NVFP4 linear layers (W4A4), under torch.compile",
     "llama-3-8b", dict(batch_size=4, seq_len=1024, mode="inference", dtype="bfloat16", weight_quant="nvfp4",
                        fused=True)),
    ("Llama-3-8B decode step with int4 weights (AWQ / GPTQ-style), batch 1, context 1024, bf16", "llama-3-8b",
     dict(batch_size=1, seq_len=1, mode="inference", kv_cache=1023, dtype="bfloat16", weight_quant="int4")),
    ("Mixtral 8x7B decode step with int4 weights (its experts too), batch 8, context 2048, bf16", "mixtral-8x7b",
     dict(batch_size=8, seq_len=1, mode="inference", kv_cache=2047, dtype="bfloat16", weight_quant="int4")),
    ("gpt-oss-120b decode step as released (MXFP4 experts), batch 8, context 2048, bf16", "gpt-oss-120b",
     dict(batch_size=8, seq_len=1, mode="inference", kv_cache=2047, dtype="bfloat16", weight_quant="mxfp4")),
    ("Llama-3-8B decode step as a server runs it (SDPA attention, static KV cache), batch 32, context 4096, bf16",
     "llama-3-8b", dict(batch_size=32, seq_len=1, mode="inference", kv_cache=4095, dtype="bfloat16",
                        attn_implementation="sdpa", static_cache=True)),
    ("The same with an FP8 KV cache (kv_cache_dtype=fp8)",
     "llama-3-8b", dict(batch_size=32, seq_len=1, mode="inference", kv_cache=4095, dtype="bfloat16",
                        attn_implementation="sdpa", static_cache=True, kv_cache_dtype="fp8")),
    ("Llama 4 Scout decode step, experts routed (grouped GEMMs) and int4 like every projection, batch 8, context "
     "2048, bf16", "llama-4-scout", dict(batch_size=8, seq_len=1, mode="inference", kv_cache=2047, dtype="bfloat16",
                                         moe_kernels="grouped", weight_quant="int4")),
    ("ViT-Base/16 training, batch 128, 224 x 224, FP32 (TF32 patch convolution where the GPU has it), AdamW",
     "vit-base", dict(batch_size=128, mode="training")),
    # on several GPUs (neusight.predict_parallel): memory is one GPU's
    ("Llama-3-70B decode step on 8 GPUs (tensor parallel), batch 8, context 2048, bf16", "llama-3-70b",
     dict(batch_size=8, seq_len=1, mode="inference", kv_cache=2047, dtype="bfloat16", tp=8)),
    ("Llama-2-7B full fine-tuning on 8 GPUs (FSDP / ZeRO-3), global batch 32, seq 1024, bf16, AdamW", "llama-2-7b",
     dict(batch_size=32, seq_len=1024, mode="training", dtype="bfloat16", dp=8, zero=3)),
]


def forecast() -> pd.DataFrame:
    from neusight.api import predict_graph
    from neusight.devices import load_device
    from neusight.errors import InputError
    from neusight.graph.tracer import trace, trace_key
    from neusight.memory import estimate_memory

    from neusight.parallel import predict_parallel

    rows = []
    for label, model, kw in RUNS:
        if {"tp", "dp"} & set(kw):   # several GPUs: a forecast per GPU type (the split traces per device)
            for key in GPUS:
                p = predict_parallel(model, key, optimizer="adamw" if kw["mode"] == "training" else None, **kw)
                rows.append({"run": label, "gpu": key, "ms": p.latency_ms, "GiB": p.memory_peak_bytes / 2**30,
                             "fits": bool(p.memory_fits), "why": ""})
            continue
        kw = dict(kw)
        fused = kw.pop("fused", False)
        graphs: dict[tuple, object] = {}
        for key in GPUS:
            dev = load_device(key)
            path = trace_key(graphs, dev, kw)
            try:
                if path not in graphs:
                    graphs[path] = trace(model, device=dev, **kw)
                g = graphs[path]
                p = predict_graph(g, dev, fused=fused)
            except InputError:   # FP8 GEMMs on a GPU without FP8 tensor cores (neusight.graph.fp8.check_fp8_device),
                # NVFP4 ones without FP4 tensor cores (neusight.graph.quant.check_fp4_device), an FP8 KV cache where
                # attention runs as PyTorch's math backend (neusight.graph.tracer._fp8_kv_kernel)
                nvfp4 = kw.get("weight_quant") == "nvfp4"
                if not (kw.get("fp8") or kw.get("kv_cache_dtype") or nvfp4):
                    raise
                why = ("no FP8 tensor cores" if kw.get("fp8") else "no FP4 tensor cores" if nvfp4
                       else "no fused attention for these inputs")
                rows.append({"run": label, "gpu": key, "ms": float("nan"), "GiB": float("nan"), "fits": True,
                             "why": why})
                continue
            mem = estimate_memory(g, dev, fused=fused)
            rows.append({"run": label, "gpu": key, "ms": p.latency_ms, "GiB": mem.peak_bytes / 2**30,
                         "fits": bool(mem.fits), "why": ""})
    return pd.DataFrame(rows)


def render(df: pd.DataFrame, seconds: float) -> str:
    lines = ["# GPU against GPU: forecasts of common runs", "",
             "Generated by `python scripts/hardware_table.py` (its docstring says how) in "
             f"{seconds:.0f} s; regenerate it, do not edit it. Forecasts from spec sheets with the shipped predictors "
             "(data/predictor, trained on P4, P100, T4, V100 and A100-PCIE-40GB kernels; AMD: data/predictor-amd). "
             "How accurate such forecasts were where they could be measured: docs/evaluation.md and docs/unseen.md; "
             "mixed-precision, FP8 and quantized transformers and generation were never measured. Each cell: step "
             "time in ms and, in brackets, the speed-up over the first GPU that can run it; `(does not fit)` when the "
             "memory forecast exceeds the GPU's memory. V100 has no BF16 tensor cores: its bf16 runs are forecast at its FP32 rate.", ""]
    for run, d in df.groupby("run", sort=False):
        first = d.dropna(subset=["ms"]).iloc[0]    # the first GPU that can run it (FP8 needs FP8 tensor cores)
        base = float(first["ms"])
        cells = [f"n/a ({r.why})" if pd.isna(r.ms) else
                 f"{r.ms:,.1f} ({base / r.ms:.2f}x)" + ("" if r.fits else " (does not fit)") for r in d.itertuples()]
        t = pd.DataFrame([cells], columns=list(d["gpu"]))
        per = " per GPU" if "GPUs" in str(run) else ""
        mem = f"memory forecast on {first['gpu']}{per}: {first['GiB']:,.1f} GiB"
        lines += [f"## {run}", "", f"{mem}.", "", markdown_table(t, index=False), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "hardware.md")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    df = forecast()
    text = render(df, time.time() - t0)
    atomic_write_text(args.out, text + "\n")
    print(text)


if __name__ == "__main__":
    main()

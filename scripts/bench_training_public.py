"""Large-scale training throughput as torchtitan published it, against the multi-GPU forecast. Writes
docs/training-public.md.

    python scripts/bench_training_public.py                  # about 30 s on 2 cores
    python scripts/bench_training_public.py --out /tmp/training-public.md

torchtitan's docs/performance.md (the version read: github.com/pytorch/torchtitan@0413364349, "Llama 3 / Llama 2
performance numbers") times Llama 3 8B / 70B and Llama 2 13B / 70B training with FSDP2 (1D parallelism, full
sharding) on 64 A100 80GB GPUs in BF16, tokens per second per GPU ("WPS") and its own MFU. No end-to-end training
run of a multi-GPU job is in the shared datasets, so these rows are the only absolute check of such a forecast: the
predictor (the five training GPUs' kernels, FP32 only), the BF16 tensor peaks, the memory model and the
collectives together. Nothing is fitted to them.

How each run is forecast (``neusight.parallel.predict_parallel``): 64 x ``a100-sxm4-80gb`` (the source says "A100
(80GB)"; the SXM part is assumed, as 64-GPU clusters are built of them) in 8 nodes of 8, ``dp=64 zero=3``
(FSDP's full sharding) with its all-gathers and reduce-scatters overlapped as FSDP2 prefetches them
(``overlap_param_gather``, ``overlap_grad_reduce``), a 200 Gb/s InfiniBand HDR port per GPU between nodes
(``internode_gbps=50``: the source does not say; A100 clusters of its time have it), the Hugging Face model of
the same configuration in ``dtype=bfloat16`` (torchtitan keeps FP32 master weights and reduces gradients in FP32;
the forecast's weights, gradients and collectives are BF16), SDPA attention (flash attention on A100, as
torchtitan's), AdamW, eager (torchtitan without ``torch.compile`` then), the global batch 64 x the local one, the
sequence 8,192 (Llama 3) / 4,096 (Llama 2), torchtitan's defaults. Activation checkpointing: "no" -> none,
"full" -> every layer, "selective layer" -> every second layer (``gradient_checkpointing=2``, torchtitan's
``selective_ac_option='2'``); "selective op" (torchtitan's per-op policy: matmul outputs kept but every second,
the rest recomputed) has no equal here and is forecast as Megatron-LM's selective recompute
(``gradient_checkpointing=selective``, the attention cores recomputed), which recomputes less: those rows are
marked and left out of the exact-recipe mean.

MFU differs in definition: torchtitan's counts 6 x parameters + 12 x layers x heads x head dim x sequence FLOPs a
token (the whole attention square, the embedding's parameters included); the forecast's counts the FLOPs of the
traced matrix multiplies (causal attention as its kernel computes it, half the square; recomputation left out).
The tokens/s are the comparable numbers.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from neusight.cli.common import quiet_third_party_logs
from neusight.e2e_eval import markdown_table
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
SOURCE = ("github.com/pytorch/torchtitan@041336434916bdc0f88c1f89fda176fd3c2092e4:docs/performance.md (64 A100 80GB, "
          "FSDP2, BF16)")
GPU, GPUS, INTERNODE_GBPS = "a100-sxm4-80gb", 64, 50.0
# torchtitan's activation checkpointing -> gradient_checkpointing, and whether that is the same recipe
RECOMPUTE = {"no": (False, True), "full": (True, True), "selective layer": (2, True),
             "selective op": ("selective", False)}


@dataclass(frozen=True)
class Run:
    model: str                # preset
    local_batch: int
    seq_len: int
    checkpointing: str        # torchtitan's name (RECOMPUTE)
    tokens_per_s: float | None   # per GPU, as published; None: the source reports an out-of-memory error
    mfu_pct: float | None     # torchtitan's


RUNS = (
    Run("llama-3-8b", 1, 8192, "selective layer", 2904, 56.8),
    Run("llama-3-8b", 1, 8192, "selective op", 2973, 58.2),
    Run("llama-3-70b", 1, 8192, "full", 331, 51.7),
    Run("llama-2-13b", 2, 4096, "no", 2162, 61.1),
    Run("llama-2-13b", 2, 4096, "selective layer", 1914, 54.1),
    Run("llama-2-13b", 2, 4096, "selective op", 1904, 53.8),
    Run("llama-2-70b", 1, 4096, "selective op", 355, 50.8),
    Run("llama-2-70b", 2, 4096, "full", 353, 50.5),
    Run("llama-2-70b", 2, 4096, "selective op", None, None),     # the source's footnote: out of memory
)


def forecast() -> pd.DataFrame:
    from neusight.parallel import predict_parallel

    cache: dict = {}
    rows = []
    for r in RUNS:
        ckpt, exact = RECOMPUTE[r.checkpointing]
        p = predict_parallel(r.model, GPU, GPUS * r.local_batch, r.seq_len, "training", dp=GPUS, zero=3,
                             gradient_checkpointing=ckpt, dtype="bfloat16", attn_implementation="sdpa",
                             optimizer="adamw", internode_gbps=INTERNODE_GBPS, overlap_param_gather=True,
                             overlap_grad_reduce=True, cache=cache)
        tps = p.throughput[0] / GPUS
        comm = p.parts["dp_gather"] + p.parts["dp_allreduce"]
        rows.append({"model": r.model, "local batch": r.local_batch, "seq": r.seq_len,
                     "checkpointing (torchtitan)": r.checkpointing + ("" if exact else " (approx.)"),
                     "measured tokens/s per GPU": r.tokens_per_s, "forecast tokens/s per GPU": tps,
                     "error %": (tps / r.tokens_per_s - 1) * 100 if r.tokens_per_s else None,
                     "measured MFU % (torchtitan's)": r.mfu_pct, "forecast MFU %": 100 * p.efficiency.mfu,
                     "step ms": p.latency_ms, "compute ms": p.parts["compute"], "exposed comm ms": comm,
                     "memory per GPU GiB": p.memory_peak_bytes / 2**30,
                     "measured": "ran" if r.tokens_per_s else "out of memory",
                     "forecast": "fits" if p.memory_fits else "out of memory", "exact": exact})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "training-public.md")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    t = forecast()
    timed = t[t["error %"].notna()]
    exact = timed[timed["exact"]]
    agree = int((t["measured"].map({"ran": "fits", "out of memory": "out of memory"}) == t["forecast"]).sum())
    shown = t.drop(columns=["exact"])
    fmt = {c: (lambda v: "" if pd.isna(v) else f"{v:,.0f}") for c in shown.columns
           if c.endswith("per GPU") or c.endswith(" ms")}
    fmt.update({c: (lambda v: "" if pd.isna(v) else f"{v:+.1f}") for c in ("error %",)})
    fmt.update({c: (lambda v: "" if pd.isna(v) else f"{v:.1f}") for c in shown.columns
                if c.startswith(("measured MFU", "forecast MFU")) or c.endswith("GiB")})
    for c, f in fmt.items():
        shown[c] = shown[c].map(f)
    text = "\n".join([
        "# Large-scale training throughput against torchtitan's published runs", "",
        f"Generated by `python scripts/bench_training_public.py` in {time.time() - t0:.0f} s; regenerate it, do not "
        "edit it. The script's docstring says how each run is forecast and where the recipes differ. Nothing is "
        "fitted to these numbers.", "",
        f"Source: {SOURCE}. Forecast: {GPUS} x {GPU}, 8 nodes, `dp={GPUS} zero=3 overlap_param_gather=true "
        f"overlap_grad_reduce=true internode_gbps={INTERNODE_GBPS:g} dtype=bfloat16 attn_implementation=sdpa "
        "optimizer=adamw`.", "",
        f"- Exact recipes ({len(exact)} runs): forecast tokens/s per GPU {exact['error %'].mean():+.1f} % on "
        f"average against the measured ones (from {exact['error %'].min():+.1f} to {exact['error %'].max():+.1f} "
        "%; positive: the forecast is faster).",
        f"- All timed runs ({len(timed)}, the selective-op ones forecast with another recompute policy): "
        f"{timed['error %'].mean():+.1f} % on average, mean absolute {timed['error %'].abs().mean():.1f} %.",
        f"- Memory: the forecast agrees with the source on {agree} of {len(t)} runs (whether it ran or ran out of "
        "memory on 80 GB).", "",
        markdown_table(shown, index=False), ""])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

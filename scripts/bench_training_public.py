"""Large-scale training throughput as torchtitan and MosaicML published it, against the multi-GPU forecast.
Writes docs/training-public.md.

    python scripts/bench_training_public.py                  # about 2 min on 2 cores
    python scripts/bench_training_public.py --out /tmp/training-public.md --accuracy-out /tmp/public-training.json

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

MosaicML's llm-foundry benchmarks (scripts/train/benchmarking/README.md, 2023: MPT models of 125M to 30B
parameters, Composer's FSDP FULL_SHARD, BF16 autocast, Triton flash attention): every run of 8 GPUs (one node, so
no network assumption) of its H100 80GB BF16 and A100 80GB tables, forecast as ``dp=8 zero=3`` with its gradient
accumulation as micro-batches and its activation checkpointing (every layer or none), through a GPT-2-shaped
stand-in of each size (:func:`mpt_config`).

The runs' errors (of the forecast step time, the same-recipe ones) also go to an accuracy file
(``--accuracy-out``, default data/accuracy/public-training.json) that BF16 transformer training forecasts quote
(:mod:`neusight.accuracy`).

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


# MosaicML's MPT benchmarks (llm-foundry scripts/train/benchmarking/README.md): FSDP FULL_SHARD on one node of 8
# GPUs, BF16 autocast, their flash attention, AdamW; the rows of 8 GPUs (one node: no network assumption).
MPT_SOURCE = ("github.com/mosaicml/llm-foundry@061f2c7ce64e655100286584a7629e2a09f827ba:scripts/train/benchmarking/"
              "README.md ('H100 80GB BF16' and 'A100 80GB with 1600 Gbps node-node interconnect' tables, every row "
              "of 8 GPUs)")
MPT_SIZES = {"125m": (768, 12), "350m": (1024, 24), "760m": (1536, 24), "1b": (2048, 24), "3b": (2560, 32),
             "7b": (4096, 32), "13b": (5120, 40), "30b": (7168, 48)}     # d_model, n_layers of llm-foundry's yamls
# Every row of 8 GPUs of the two tables, as printed: size, sequence, micro-batch, gradient accumulation, global
# batch, activation checkpointing (T / F), tokens/s per GPU
MPT_TABLES = {
    "h100-sxm5-80gb": """
        30b 8192 1 21 168 T 1384 | 30b 4096 1 21 168 T 1802 | 30b 2048 3 21 504 T 2002 | 30b 1024 6 21 1008 T 2084
        13b 32768 1 3 24 T 1976 | 13b 16384 3 3 72 T 2985 | 13b 4096 10 3 240 T 4717 | 13b 2048 2 1 16 F 4792
        13b 1024 40 3 960 T 5502 | 7b 65536 1 2 16 T 1956 | 7b 32768 2 2 32 T 3318 | 7b 8192 8 2 128 T 6935
        7b 4096 16 2 256 T 8611 | 7b 2048 6 1 48 F 10643 | 7b 1024 64 2 1024 T 10203 | 3b 65536 1 2 16 T 3262
        3b 32768 3 6 144 T 5873 | 3b 16384 1 6 48 F 11152 | 3b 8192 3 6 144 F 16578 | 3b 4096 5 6 240 F 20964
        3b 1024 20 6 960 F 27046 | 3b 512 40 6 1920 F 27965 | 1b 65536 1 2 16 T 5506 | 1b 32768 1 4 32 F 12025
        1b 16384 2 4 64 F 19649 | 1b 8192 3 4 96 F 29157 | 1b 4096 7 4 224 F 38535 | 1b 2048 14 1 112 F 45455
        1b 1024 18 4 576 F 48910 | 1b 512 56 4 1792 F 52275 | 760m 32768 1 2 16 F 16291 | 760m 16384 3 2 48 F 27815
        760m 8192 6 2 96 F 41825 | 760m 4096 12 2 192 F 55459 | 760m 2048 24 2 384 F 63147
        760m 1024 48 2 768 F 78581 | 760m 512 96 2 1536 F 83749""",
    "a100-sxm4-80gb": """
        30b 8192 1 21 168 T 574 | 30b 4096 1 21 168 T 814 | 30b 2048 3 21 504 T 916 | 30b 1024 6 21 1008 T 946
        30b 512 12 21 2016 T 967 | 13b 32768 1 3 24 T 1016 | 13b 16384 3 3 72 T 1431 | 13b 8192 5 3 120 T 1795
        13b 4096 10 3 240 T 2060 | 13b 2048 2 3 48 F 2262 | 13b 1024 40 3 960 T 2330 | 7b 65536 1 2 16 T 1013
        7b 32768 2 2 32 T 1672 | 7b 16384 4 2 64 T 2453 | 7b 8192 8 2 128 T 3206 | 7b 4096 16 2 256 T 3684
        7b 2048 6 2 96 F 4641 | 7b 1024 64 2 1024 T 4357 | 3b 65536 1 2 16 T 1767 | 3b 32768 3 6 144 T 3029
        3b 16384 1 6 48 F 5529 | 3b 8192 3 6 144 F 7695 | 3b 4096 5 6 240 F 9457 | 3b 2048 10 2 160 F 10811
        3b 1024 20 6 960 F 11580 | 3b 512 40 6 1920 F 12127 | 1b 65536 1 2 16 T 3044 | 1b 32768 1 4 32 F 6275
        1b 16384 2 4 64 F 9956 | 1b 8192 3 4 96 F 13814 | 1b 4096 7 4 224 F 17807 | 1b 2048 14 4 448 F 20513
        1b 1024 18 4 576 F 22112 | 1b 512 56 4 1792 F 23148 | 760m 65536 1 2 16 T 4143 | 760m 32768 1 2 16 F 8802
        760m 16384 3 2 48 F 14274 | 760m 8192 6 2 96 F 20933 | 760m 4096 12 2 192 F 27351
        760m 2048 24 2 384 F 32434 | 760m 1024 48 2 768 F 29765 | 760m 512 96 2 1536 F 29446
        350m 65536 1 2 16 F 7524 | 350m 32768 2 2 32 F 13652 | 350m 16384 4 2 64 F 23559 | 350m 8192 8 2 128 F 36569
        350m 4096 16 2 256 F 49555 | 350m 2048 32 2 512 F 58782 | 350m 1024 64 2 1024 F 64813
        350m 512 128 2 2048 F 69330 | 125m 65536 1 2 16 F 20368 | 125m 32768 2 2 32 F 36407
        125m 16384 4 2 64 F 60040 | 125m 8192 8 2 128 F 90392 | 125m 4096 16 2 256 F 118396
        125m 2048 40 2 640 F 142830 | 125m 2048 32 2 512 F 141737 | 125m 1024 64 2 1024 F 156468
        125m 512 128 2 2048 F 165681""",
}


def mpt_runs() -> list[tuple]:
    """(GPU, size, sequence, micro-batch, accumulation, global batch, checkpointing, tokens/s per GPU) of
    :data:`MPT_TABLES`."""
    out = []
    for gpu, text in MPT_TABLES.items():
        for row in text.replace("\n", "|").split("|"):
            if row.strip():
                size, seq, micro, accum, glob, ckpt, tps = row.split()
                out.append((gpu, size, int(seq), int(micro), int(accum), int(glob), ckpt == "T", float(tps)))
    return out


def mpt_config(size: str, seq: int) -> dict:
    """A GPT-2-shaped stand-in for an MPT model of llm-foundry's benchmarks: the same width, depth, 4x GELU MLP,
    vocabulary and learned positions (their parameter counts grow with the sequence, so the benchmarks ran them),
    heads of 128 (llm-foundry's yamls set them so for flash attention), tied embeddings, no dropout (MPT's
    defaults); GPT-2's biases and SDPA attention where MPT has none and its Triton flash attention."""
    d, layers = MPT_SIZES[size]
    return {"model_type": "gpt2", "n_embd": d, "n_head": d // 128, "n_layer": layers, "n_inner": 4 * d,
            "n_positions": seq, "vocab_size": 50368, "activation_function": "gelu", "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "_name_or_path": f"mpt-{size}"}


def attention_ceiling_tflops(size: str, seq: int, checkpointing: bool, tokens_per_s: float) -> float:
    """The TFLOP/s a run's attention would have run at had it taken the whole step: its causal attention FLOPs per
    token (2 x seq x width per layer forward; the backward 2.5x that, the recomputed forward once more) times the
    measured tokens/s. An upper bound on what the run's attention kernels reached."""
    d, layers = MPT_SIZES[size]
    return 2.0 * seq * d * layers * (4.5 if checkpointing else 3.5) * tokens_per_s / 1e12


def forecast_mpt() -> pd.DataFrame:
    from neusight.parallel import predict_parallel

    cache: dict = {}
    rows = []
    for gpu, size, seq, micro, accum, glob, ckpt, measured in mpt_runs():
        if glob != 8 * micro * accum:
            raise ValueError(f"{size} {seq}: global batch {glob} is not 8 x {micro} x {accum}")
        p = predict_parallel(mpt_config(size, seq), gpu, glob, seq, "training", dp=8, microbatches=accum, zero=3,
                             gradient_checkpointing=ckpt, dtype="bfloat16", attn_implementation="sdpa",
                             optimizer="adamw", overlap_param_gather=True, overlap_grad_reduce=True, cache=cache)
        tps = p.throughput[0] / 8
        rows.append({"GPU": gpu, "model": f"mpt-{size}", "seq": seq, "micro-batch": micro, "accumulation": accum,
                     "checkpointing": "every layer" if ckpt else "no", "measured tokens/s per GPU": measured,
                     "forecast tokens/s per GPU": tps, "error %": (tps / measured - 1) * 100,
                     "forecast MFU %": 100 * p.efficiency.mfu, "memory per GPU GiB": p.memory_peak_bytes / 2**30,
                     "forecast": "fits" if p.memory_fits else "out of memory",
                     "attention ceiling": attention_ceiling_tflops(size, seq, ckpt, measured)})
    return pd.DataFrame(rows)


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


def write_records(t: pd.DataFrame, mpt: pd.DataFrame, path: Path) -> list[dict]:
    """The runs' errors as an accuracy file (:mod:`neusight.accuracy`): BF16 transformer training, eager, per GPU
    and together, the error of the forecast time of one micro-batch's step (not of the tokens/s), so that a BF16
    training forecast quotes them as the NeuSight labels' are quoted. torchtitan's runs of another recompute
    recipe are left out."""
    from neusight.accuracy import run_records, write_accuracy
    from neusight.api import load_predictor
    from neusight.devices import load_device

    exact = t[t["exact"] & t["error %"].notna()]
    runs = pd.concat([
        pd.DataFrame({"gpu": GPU, "batch": exact["local batch"], "seq": exact["seq"],
                      "measured": exact["measured tokens/s per GPU"], "forecast": exact["forecast tokens/s per GPU"],
                      "source": "torchtitan's FSDP2 runs on 64 A100 80GB, docs/training-public.md"}),
        pd.DataFrame({"gpu": mpt["GPU"], "batch": mpt["micro-batch"], "seq": mpt["seq"],
                      "measured": mpt["measured tokens/s per GPU"], "forecast": mpt["forecast tokens/s per GPU"],
                      "source": "MosaicML's MPT benchmarks, FSDP on 8 GPUs, docs/training-public.md"})],
        ignore_index=True)
    runs = runs.assign(workload="transformer", mode="training", precision="bfloat16", fused=False,
                       measured_ms=runs["batch"] * runs["seq"] / runs["measured"] * 1e3,
                       error_pct=(runs["measured"] / runs["forecast"] - 1) * 100)
    pred = load_predictor(None, load_device(GPU))
    records = run_records(runs, pred.train_devices_, vendors={g: load_device(g).vendor for g in runs["gpu"].unique()})
    for r in records:   # what these runs had that the NeuSight labels lack (neusight.accuracy.forecast_kind's words)
        r["covers"] = ["the optimizer step", "gradient checkpointing"]
    write_accuracy(path, records, command="python scripts/bench_training_public.py",
                   predictor_sha256=[pred.manifest_["weights_sha256"]])
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "training-public.md")
    ap.add_argument("--accuracy-out", type=Path, default=REPO / "data" / "accuracy" / "public-training.json",
                    help="the accuracy file BF16 training forecasts quote (neusight.accuracy)")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    t = forecast()
    mpt = forecast_mpt()
    records = write_records(t, mpt, args.accuracy_out)
    together = next(r for r in records if r["gpu"] is None)
    acc_path = args.accuracy_out.relative_to(REPO) if args.accuracy_out.is_relative_to(REPO) else args.accuracy_out
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
        "# Large-scale training throughput against published runs", "",
        f"Generated by `python scripts/bench_training_public.py` in {time.time() - t0:.0f} s; regenerate it, do not "
        "edit it. The script's docstring says how each run is forecast and where the recipes differ. Nothing is "
        "fitted to these numbers.", "",
        "## torchtitan: FSDP2 on 64 A100 80GB", "",
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
        markdown_table(shown, index=False), "",
        "## MosaicML's MPT benchmarks on one node of 8 GPUs", "",
        f"Source: {MPT_SOURCE}. Forecast: `dp=8 zero=3` with the benchmark's gradient accumulation as micro-batches "
        "(`microbatches=`), its activation checkpointing (every layer or none), `dtype=bfloat16 "
        "attn_implementation=sdpa optimizer=adamw`, the collectives overlapped; the model a GPT-2-shaped stand-in of "
        "the same width, depth, MLP, vocabulary and learned positions (`mpt_config` in the script: GPT-2's biases "
        "and PyTorch's SDPA where MPT has none and its Triton flash attention). The runs are of 2023 (PyTorch 2.0, "
        "Composer's FSDP): the H100's software was young then. The error grows with the sequence, i.e. with "
        "attention's share of the step, and MPT's own attention kernels were slow: at sequences of 32,768 and "
        "longer the measured tokens/s put them at most at "
        + ", ".join(f"{g.loc[g['seq'] >= 32768, 'attention ceiling'].max():.0f} TFLOP/s on the {gpu}"
                    for gpu, g in mpt.groupby("GPU", sort=False)) +
        " even had attention taken the whole step (causal attention FLOPs per token, the recomputed forward "
        "included, times tokens/s), where today's flash kernels, which the forecast models, run at 150-230 TFLOP/s "
        "on an A100 (FlashAttention-2, reported at 50-73 % of its peak) and 400-600 on an H100 (cuDNN's, long "
        "sequences: docs/attention-public.md).", "",
        *[f"- {gpu}: {len(g)} runs, forecast tokens/s per GPU {g['error %'].mean():+.1f} % on average (from "
          f"{g['error %'].min():+.1f} to {g['error %'].max():+.1f} %); sequences up to 2,048: "
          f"{g.loc[g['seq'] <= 2048, 'error %'].mean():+.1f} %, 8,192 and longer: "
          f"{g.loc[g['seq'] >= 8192, 'error %'].mean():+.1f} %; all ran, the forecast fits "
          f"{int((g['forecast'] == 'fits').sum())} of them in memory" for gpu, g in mpt.groupby("GPU", sort=False)],
        "", f"Accuracy file: `{acc_path}`, which BF16 transformer training forecasts quote (`measured accuracy of "
        f"this kind`): {together['runs']} runs (torchtitan's of the same recompute recipe and every MPT run), the "
        f"forecast time of a micro-batch's step {together['mean_abs_error_pct']:.1f} % off on average (signed "
        f"{together['mean_signed_error_pct']:+.1f} %: too short), worst {together['worst_abs_error_pct']:.1f} %.",
        "", markdown_table(mpt.drop(columns="attention ceiling").assign(**{c: mpt[c].map(f) for c, f in (
            ("forecast tokens/s per GPU", "{:,.0f}".format), ("measured tokens/s per GPU", "{:,.0f}".format),
            ("error %", "{:+.1f}".format), ("forecast MFU %", "{:.1f}".format),
            ("memory per GPU GiB", "{:.1f}".format))}), index=False), ""])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

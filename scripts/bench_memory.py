"""Benchmark the memory forecast and write the numbers into docs/memory.md (between the bench markers).

1. Ground truth: GPT-2 small (batch 4 x 512) and ResNet-18 (batch 16, 224x224), inference and one AdamW training
   step (GPT-2 also with gradient checkpointing, and LoRA), and two-layer GPT-2, Llama, OPT, BERT and T5 with a small
   vocabulary (batch 2 x 256; inference, GPT-2 and Llama also checkpointed training), run for real on this CPU
   (neusight.memory.measure_cpu) against the forecast (allocator="exact").
2. Korthikanti et al. 2022: saved activations per layer of GPT-2 Large (36 layers, FP32, dropout) vs
   s*b*h*(66 + 9*a*s/h) bytes (the 16-bit formula with the 2-byte tensors doubled, tests/test_memory.py).
3. Fits: GPT-3 2.7B training (batch 8 x 2048, AdamW) on an L4; every single-GPU run NeuSight measured, on its GPU.
4. Max batch examples, and Lambda's largest ResNet-50 FP32 training batches per GPU against the forecast's
   (skipped with the label runs; reads ../shared/datasets/public-benchmarks).
5. With --plots DIR the four charts for GPT-2 Large training on H100 and ResNet-50 training on A100 (latency
   made up as roofline / utilization until the predictor exists).

Usage: python scripts/bench_memory.py [--skip-cpu] [--skip-labels] [--plots DIR] [--doc docs/memory.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

import neusight
from neusight import plots
from neusight.devices import load_device
from neusight.memory import estimate_memory, find_max_batch, measure_cpu, saved_activations
from neusight.util import atomic_write_text

log = logging.getLogger("bench_memory")
REPO = Path(__file__).resolve().parents[1]
DATASET = REPO.parent / "shared" / "datasets" / "neusight-asplos25"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
MiB, GiB = 2**20, 2**30
# dataset label name -> (config JSON in DATASET/models, head for inference, head for training)
LABEL_MODELS = {"bert_large": ("bert_large", "sequence-classification", "pretraining"),
                "gpt2_large": ("gpt2_large", None, None), "gpt3_xl": ("gpt3_xl", None, None),
                "gpt3_27": ("gpt3_27", None, None), "opt_13": ("opt_13", None, None),
                "switchxl4": ("switchxl4", None, None), "switch4": ("switch-base-4", None, None)}   # L4's switch4 runs: a Switch-Base (neusight.evaluate)
LABEL = re.compile(r"^(?P<model>[a-z0-9_]+)-(?P<mode>inf|train)-(?P<seq>\d+)-(?P<batch>\d+)\.json$")


def table(df: pd.DataFrame) -> str:
    """A DataFrame as a GitHub markdown table (no extra dependency)."""
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


# Two layers at width 256 with a vocabulary of 1,000: the logits are not the step's largest tensor, so the peak falls
# inside a block, where what the program holds past a tensor's last use (attention probabilities) counts.
NARROW = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=256, n_head=4, n_positions=512, vocab_size=1000),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512),
    "opt": dict(model_type="opt", num_hidden_layers=2, hidden_size=256, ffn_dim=1024, num_attention_heads=4,
                vocab_size=1000, max_position_embeddings=512, word_embed_proj_dim=256),
    "bert": dict(model_type="bert", num_hidden_layers=2, hidden_size=256, intermediate_size=1024,
                 num_attention_heads=4, vocab_size=1000, max_position_embeddings=512),
    "t5": dict(model_type="t5", num_layers=2, num_decoder_layers=2, d_model=256, d_ff=1024, num_heads=4, d_kv=64,
               vocab_size=1000),
}


def cpu_ground_truth() -> pd.DataFrame:
    rows = []
    runs = [(model, kw, mode) for model, kw in (("gpt2", dict(batch_size=4, seq_len=512)),
                                                ("resnet18", dict(batch_size=16))) for mode in ("inference", "training")]
    runs.insert(2, ("gpt2", dict(batch_size=4, seq_len=512, gradient_checkpointing=True), "training"))
    runs.insert(3, ("gpt2", dict(batch_size=4, seq_len=512, gradient_checkpointing="selective"), "training"))
    runs.insert(4, ("gpt2", dict(batch_size=4, seq_len=512, lora_rank=8), "training"))
    runs = [(model, model, kw, mode) for model, kw, mode in runs]
    narrow = dict(batch_size=2, seq_len=256)
    runs += [(f"{name} (2 layers, width 256, vocabulary 1,000, 256 tokens)", NARROW[name], kw, mode)
             for name, kw, mode in [(n, narrow, "inference") for n in NARROW]
             + [(n, dict(narrow, gradient_checkpointing=True), "training") for n in ("gpt2", "llama")]]
    for name, model, kw, mode in runs:
        t0 = time.time()
        r = estimate_memory(neusight.trace(model, mode=mode, optimizer="adamw", **kw), allocator="exact")
        m = measure_cpu(model, mode=mode, optimizer="adamw", **kw)
        what = _recompute(kw, ", ") + (f", LoRA rank {kw['lora_rank']}" if kw.get("lora_rank") else "")
        rows.append({"model": name, "mode": mode + (f" (AdamW{what})" if mode == "training" else ""),
                     "batch": kw["batch_size"], "forecast MiB": f"{r.tensor_peak_bytes / MiB:.1f}",
                     "measured MiB": f"{m.peak_bytes / MiB:.1f}",
                     "error %": f"{100 * (r.tensor_peak_bytes / m.peak_bytes - 1):+.2f}",
                     "peak at": f"{r.where['aten_op']} ({r.where['phase']})", "s": f"{time.time() - t0:.0f}"})
        log.info("%s", rows[-1])
    return pd.DataFrame(rows)


def _recompute(kw: dict, sep: str) -> str:
    """A run's activation recompute as the tables say it ("" without)."""
    ckpt = kw.get("gradient_checkpointing")
    return "" if not ckpt else sep + ("selective recompute" if ckpt == "selective" else "gradient checkpointing")


def korthikanti(tmp: Path) -> pd.DataFrame:
    cfg = json.loads((DATASET / "models" / "gpt2_large.json").read_text())
    s, h, a, layers = 1024, cfg["n_embd"], cfg["n_head"], cfg["n_layer"]
    rows = []
    for act in ("gelu_pytorch_tanh", "gelu_new"):
        path = tmp / f"gpt2_large_{act}.json"
        path.write_text(json.dumps(dict(cfg, activation_function=act)))
        # selective recompute (Korthikanti's section 5) keeps no attention scores: the a s / h term goes
        for b, ckpt in [(b, c) for b in (1, 2) for c in (False, "selective")
                        if not c or act == "gelu_pytorch_tanh"]:
            saved = saved_activations(neusight.trace(str(path), batch_size=b, seq_len=s, mode="training",
                                                     optimizer=None, gradient_checkpointing=ckpt))
            per_layer = [int(saved[(saved.index == f"transformer.h.{i}")
                                   | saved.index.str.startswith(f"transformer.h.{i}.")].sum()) for i in range(layers)]
            mid = per_layer[layers // 2]
            ref = s * b * h * (66 + (0 if ckpt else 9 * a * s / h))
            rows.append({"GeLU": act, "b": b, "recompute": ckpt or "no",
                         "saved per layer MiB (layer 18)": f"{mid / MiB:.1f}",
                         "mean of 36 layers MiB": f"{np.mean(per_layer) / MiB:.1f}",
                         "formula MiB": f"{ref / MiB:.1f}", "ratio": f"{mid / ref:.3f}"})
            log.info("%s", rows[-1])
    return pd.DataFrame(rows)


def fits_examples() -> pd.DataFrame:
    runs = [("gpt3-2.7b", "l4", dict(batch_size=8, seq_len=2048, mode="training", optimizer="adamw")),
            ("gpt2-large", "l4", dict(batch_size=1, seq_len=1024, mode="training", optimizer=None)),
            ("gpt2-large", "l4", dict(batch_size=1, seq_len=1024, mode="training", optimizer="adamw")),
            ("gpt2-large", "h100-sxm5-80gb", dict(batch_size=4, seq_len=1024, mode="training", optimizer="adamw")),
            ("gpt3-2.7b", "h100-sxm5-80gb", dict(batch_size=2, seq_len=2048, mode="training", optimizer="adamw")),
            ("gpt3-2.7b", "h100-sxm5-80gb", dict(batch_size=2, seq_len=2048, mode="training", optimizer="adamw",
                                                gradient_checkpointing="selective")),
            ("gpt3-2.7b", "h100-sxm5-80gb", dict(batch_size=2, seq_len=2048, mode="training", optimizer="adamw",
                                                gradient_checkpointing=True)),
            ("llama-2-7b", "l4", dict(batch_size=4, seq_len=512, mode="training", optimizer="adamw",
                                      dtype="bfloat16", lora_rank=16)),
            ("llama-2-7b", "l4", dict(batch_size=4, seq_len=512, mode="training", optimizer="adamw",
                                      dtype="bfloat16", lora_rank=16, gradient_checkpointing=True))]
    rows = []
    for model, dev, kw in runs:
        r = estimate_memory(neusight.trace(model, **kw), dev)
        rows.append(_fit_row(model, dev, kw, r))
    return pd.DataFrame(rows)


def _fit_row(model: str, dev: str, kw: dict, r) -> dict:
    b = r.breakdown
    mode = kw["mode"] + (f" + LoRA rank {kw['lora_rank']}, {kw.get('dtype')}" if kw.get("lora_rank") else "") + (
        _recompute(kw, " + "))
    return {"model": model, "device": dev, "mode": mode, "optimizer": kw.get("optimizer") or "-",
            "batch x seq": f"{kw['batch_size']} x {kw.get('seq_len') or '-'}", "peak GiB": f"{r.peak_gib:.2f}",
            "device GiB": f"{r.device_memory_bytes / GiB:.0f}", "fits": "yes" if r.fits else "**no**",
            "weights+grads+opt GiB": f"{(b['weights'] + b['gradients'] + b['optimizer']) / GiB:.2f}",
            "activations GiB": f"{b['activations'] / GiB:.2f}",
            "workspace+allocator+framework GiB": f"{(b['workspace'] + b['allocator'] + b['framework']) / GiB:.2f}"}


def label_runs() -> pd.DataFrame:
    """Every single-GPU run of the NeuSight labels: did the run that was measured fit, per the forecast?"""
    rows = []
    for gpu_dir in sorted((DATASET / "labels").iterdir()):
        for label in sorted(gpu_dir.glob("*.json")):
            m = LABEL.match(label.name)   # runs with an option (-fusion, -dp4, ...) do not match
            if m is None or m["model"] not in LABEL_MODELS:
                continue
            cfg, head_inf, head_train = LABEL_MODELS[m["model"]]
            mode = "training" if m["mode"] == "train" else "inference"
            kw = dict(batch_size=int(m["batch"]), seq_len=int(m["seq"]), mode=mode, optimizer=None,
                      head=head_train if mode == "training" else head_inf)
            path = DATASET / "models" / f"{cfg}.json"
            r = estimate_memory(neusight.trace(str(path) if path.is_file() else cfg, **kw), gpu_dir.name)
            rows.append({"GPU": gpu_dir.name, "run": label.stem, "peak GiB": f"{r.peak_gib:.2f}",
                         "device GiB": f"{r.device_memory_bytes / GiB:.0f}", "fits": r.fits})
            log.info("%s", rows[-1])
    return pd.DataFrame(rows)


def label_summary(labels: pd.DataFrame) -> pd.DataFrame:
    """Per GPU: runs, how many fit, and the tightest run (highest share of the device's memory)."""
    rows = []
    for gpu, runs in labels.groupby("GPU", sort=True):
        share = runs["peak GiB"].astype(float) / runs["device GiB"].astype(float)
        tight = runs.loc[share.idxmax()]
        rows.append({"GPU": gpu, "runs": len(runs), "fit": int(runs["fits"].sum()), "tightest run": tight["run"],
                     "its peak GiB": tight["peak GiB"], "device GiB": tight["device GiB"]})
    return pd.DataFrame(rows)


def max_batches() -> pd.DataFrame:
    runs = [("gpt2-large", "l4", dict(seq_len=1024, mode="training", optimizer="adamw")),
            ("gpt2-large", "a100-sxm4-40gb", dict(seq_len=1024, mode="training", optimizer="adamw")),
            ("gpt2-large", "h100-sxm5-80gb", dict(seq_len=1024, mode="training", optimizer="adamw")),
            ("resnet50", "a100-sxm4-40gb", dict(mode="training", optimizer="sgd"))]
    rows = []
    for model, dev, kw in runs:
        t0 = time.time()
        best = find_max_batch(model, dev, **kw)
        rows.append({"model": model, "device": dev, "run": ", ".join(f"{k}={v}" for k, v in kw.items()),
                     "max batch": best, "search s": f"{time.time() - t0:.0f}"})
        log.info("%s", rows[-1])
    return pd.DataFrame(rows)


def lambda_batches() -> pd.DataFrame:
    """Lambda's ResNet-50 FP32 training runs (DeepLearningExamples main.py, SGD) use "the largest batch that
    fits" on each GPU (public-benchmarks README): the forecast should let that batch fit, and its own largest
    batch shows how far the forecast per image is from the GPU's."""
    from neusight.e2e_eval import load_cnn_benchmarks

    sel, _ = load_cnn_benchmarks(REPO.parent / "shared" / "datasets" / "public-benchmarks")
    runs = sel[sel["source_name"] == "Lambda"].drop_duplicates(["gpu", "model", "batch"])
    rows = []
    for r in runs.itertuples(index=False):
        t0 = time.time()
        m = estimate_memory(neusight.trace(r.model, batch_size=int(r.batch), mode="training", optimizer="sgd"), r.gpu)
        best = find_max_batch(r.model, r.gpu, mode="training", optimizer="sgd")
        rows.append({"GPU": r.gpu, "model": r.model, "Lambda batch": int(r.batch),
                     "forecast GiB at that batch": f"{m.peak_gib:.1f}", "device GiB": f"{m.device_memory_bytes / GiB:.1f}",
                     "fits": m.fits, "forecast max batch": best, "forecast max / Lambda": f"{best / r.batch:.2f}",
                     "s": f"{time.time() - t0:.0f}"})
        log.info("%s", rows[-1])
    return pd.DataFrame(rows)


def synthetic_prediction(kernels: pd.DataFrame, device, seed: int = 0) -> pd.DataFrame:
    """Stand-in for the predictor: roofline time / a random utilization in [0.35, 0.95] + 5 us launch."""
    k = kernels.copy()
    comp = k["flops"] / device.peak_flops("float32")
    mem = k["bytes"] / (device.mem_bandwidth_gbps * 1e9)
    k["roofline_ms"] = np.maximum(comp, mem) * 1e3
    k["bound"] = np.where(comp >= mem, "compute", "memory")
    k["utilization"] = np.random.default_rng(seed).uniform(0.35, 0.95, len(k))
    k["latency_ms"] = k["roofline_ms"] / k["utilization"] + 5e-3
    return k


def pictures(out: Path) -> list[Path]:
    written = []
    for model, dev_name, kw, stem in (
            ("gpt2-large", "h100-sxm5-80gb", dict(batch_size=4, seq_len=1024), "gpt2-large-h100"),
            ("resnet50", "a100-sxm4-40gb", dict(batch_size=64), "resnet50-a100")):
        dev = load_device(dev_name)
        g = neusight.trace(model, mode="training", optimizer="adamw", **kw)
        k = synthetic_prediction(g.kernels, dev)
        written += plots.roofline_chart(k, dev, out / f"{stem}-roofline")
        written += plots.time_roofline(k, dev, out / f"{stem}-time-roofline")
        written += plots.memory_timeline(estimate_memory(g, dev), out / f"{stem}-memory")
        written += plots.layer_breakdown(k, out / f"{stem}-layers")
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-cpu", action="store_true", help="skip the real CPU runs (minutes)")
    ap.add_argument("--skip-labels", action="store_true", help="skip the NeuSight label runs")
    ap.add_argument("--plots", type=Path, help="also render the example charts into this folder")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "memory.md")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from neusight.cli.common import quiet_third_party_logs

    quiet_third_party_logs()
    parts = [f"Generated by `python scripts/bench_memory.py` (torch {__import__('torch').__version__}, "
             f"transformers {__import__('transformers').__version__}).\n"]
    if not args.skip_cpu:
        parts += ["### Forecast vs a real run on the CPU\n", table(cpu_ground_truth()), ""]
    with tempfile.TemporaryDirectory() as tmp:
        parts += ["### Saved activations per layer vs Korthikanti et al. (GPT-2 Large, FP32, s = 1024)\n",
                  table(korthikanti(Path(tmp))), ""]
    parts += ["### Fits\n", table(fits_examples()), ""]
    if not args.skip_labels:
        labels = label_runs()
        parts += [f"### NeuSight's measured single-GPU runs (no optimizer step): {int(labels['fits'].sum())} of "
                  f"{len(labels)} fit on their GPU per the forecast\n", table(label_summary(labels)), ""]
    parts += ["### Largest batch that fits\n", table(max_batches()), ""]
    if not args.skip_labels:
        lam = lambda_batches()
        ratio = lam["forecast max / Lambda"].astype(float)
        parts += [f"### Lambda's largest batches (ResNet-50 FP32 training, measured on the GPU): {int(lam['fits'].sum())} "
                  f"of {len(lam)} fit per the forecast; forecast max batch {ratio.min():.2f}-{ratio.max():.2f} x "
                  "Lambda's\n", table(lam), ""]
    if args.plots:
        log.info("charts: %s", ", ".join(str(p) for p in pictures(args.plots)))
    doc = args.doc.read_text() if args.doc.exists() else f"# Memory\n\n{BEGIN}\n{END}\n"
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{args.doc} has no {BEGIN} ... {END} section to fill")
    head, rest = doc.split(BEGIN, 1)
    atomic_write_text(args.doc, head + BEGIN + "\n" + "\n".join(parts) + "\n" + END + rest.split(END, 1)[1])
    log.info("wrote %s", args.doc)


if __name__ == "__main__":
    main()

"""Forecasts for the GPUs the dataset leaves out (H100 80GB HBM3, A100 80GB PCIe, A100-SXM4-40GB, MI250), written
down before any measurement of them is seen. Writes docs/unseen.md.

    python scripts/forecast_unseen.py                 # ~1 min on 2 cores
    python scripts/forecast_unseen.py --out /tmp/unseen.md

Every plain and ``-fusion`` (torch.compile) label configuration of the dataset (model, mode, sequence, batch;
the union over its GPUs, NVIDIA and AMD) is predicted with the label protocol (``neusight.evaluate.predict_label``) on each left-out GPU, from its
spec file alone, with the shipped predictor of its vendor (NVIDIA: data/predictor; MI250: data/predictor-amd,
trained on the MI100 and MI210 kernel sweeps). Next to them: the measured and predicted latency of the closest GPU
that has labels (A100-PCIE-40GB for the NVIDIA parts, MI210 for the MI250, whose one GCD has MI210's CUs,
clocks and bandwidth), so the forecast speed-ups can be read against a measured base, and that GPU's own
prediction error shows how far off the same machinery was where it could be checked.

Then the multi-GPU runs: the nine Megatron-LM training configurations the dataset's collection script runs on
four NVLink GPUs (GPT-2 Large at global batch 4 and 16, sequence 1024; GPT-3 XL at batch 4, sequence 2048; each
as dp4, tp4 and pp4 with one micro-batch), forecast on 4 x A100-SXM4-40GB and 4 x H100 SXM5 as their labels time
them (``neusight.evaluate._predict_parallel_label``: the whole Megatron-LM ``train_step``). No GPU with labels
ran these, so there is no base to read them against.

Last, the older cards the public CNN benchmarks leave out (RTX 2080 Ti, GTX 1080 Ti, TITAN V): ResNet-50 FP32
training steps (forward, loss, backward, SGD; what DeepLearningExamples and Lambda time) and inference passes at
a few batch sizes, with images/s and whether the step fits in the card's memory; and the same runs on the
left-out A100 80GB and H100 as PyTorch runs "float" there by default (convolutions on TF32 tensor cores), next to
the same predictor's error on the measured A100 40GB TF32 rows. And ResNet-50 AMP training in NCHW (cuDNN's layout
transposes charged) on the left-out cards with FP16 tensor cores (A100 80GB, H100, RTX 2080 Ti, TITAN V), next to
the same predictor's error on the AMP / FP16 rows of their kin (GA100, GV100, TU102).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import pandas as pd

from neusight.cli.common import quiet_third_party_logs
from neusight.e2e_eval import markdown_table
from neusight.evaluate import find_labels, predict_label
from neusight.predictor.model import Predictor
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
DATASET = REPO.parent / "shared" / "datasets" / "neusight-asplos25"
# left-out GPU -> the GPU with labels it is read against
UNSEEN = {"h100-sxm5-80gb": "a100-pcie-40gb", "a100-80gb-pcie": "a100-pcie-40gb",
          "a100-sxm4-40gb": "a100-pcie-40gb", "mi250": "mi210"}
# the Megatron-LM runs of the dataset's collection script (model, global batch, sequence) x (dp4, tp4, pp4_1),
# on the left-out GPUs that come as 4-GPU NVLink machines
MEGATRON_RUNS = [("gpt2_large", 4, 1024), ("gpt2_large", 16, 1024), ("gpt3_xl", 4, 2048)]
MEGATRON_OPTIONS = ("dp4", "tp4", "pp4_1")
MEGATRON_GPUS = ("a100-sxm4-40gb", "h100-sxm5-80gb")
# the older cards public-benchmarks leaves out, and the CNN runs forecast on them
CNN_GPUS = ("rtx-2080-ti", "gtx-1080-ti", "titan-v")
CNN_RUNS = [("resnet50", "training", b) for b in (32, 64, 128)] + [("resnet50", "inference", b) for b in (32, 128, 256)]
# the left-out Ampere / Hopper cards, where PyTorch's "float" CNN runs TF32 convolutions (neusight.api.TF32_MODES)
CNN_TF32_GPUS = ("a100-80gb-pcie", "h100-sxm5-80gb")
# the left-out cards with FP16 tensor cores, and ResNet-50 training under AMP in NCHW (as Lambda's runs were made)
CNN_HALF_GPUS = ("a100-80gb-pcie", "h100-sxm5-80gb", "rtx-2080-ti", "titan-v")
CNN_HALF_RUNS = [("resnet50", "training", b) for b in (128, 256)]
# their kin in the public rows: GA100 (A100 40GB), GV100 (V100), TU102 (TITAN RTX, Quadro RTX 6000 / 8000)
CNN_HALF_KIN = ("a100-pcie-40gb", "a100-sxm4-40gb", "v100-sxm2-16gb", "v100-sxm2-32gb", "titan-rtx",
                "quadro-rtx-6000", "quadro-rtx-8000")


def timed_ms(run, predictor, cache) -> tuple[float, float]:
    """(predicted, roofline) ms of the timed phases of one run under the label protocol."""
    res = predict_label(run, predictor, cache)
    return res["predicted_ms"], res["roofline_ms"]


def forecast(dataset: Path = DATASET) -> pd.DataFrame:
    predictor = None    # each GPU by its vendor's shipped predictor
    runs = find_labels(dataset, vendors=("nvidia", "amd"), options=("fusion",))
    measured = {(r.device, r.model, r.mode, r.seq_len, r.batch_size, r.option): r for r in runs}
    configs = {(r.model, r.mode, r.seq_len, r.batch_size, r.option or ""): r for r in runs}  # one run per configuration
    cache: dict = {}
    rows = []
    for (model, mode, seq, batch, option), run in sorted(configs.items()):
        mode = mode + (f"+{option}" if option else "")
        for gpu, base in UNSEEN.items():
            pred, roof = timed_ms(dataclasses.replace(run, device=gpu), predictor, cache)
            ref = measured.get((base, run.model, run.mode, seq, batch, run.option))
            base_pred = timed_ms(ref, predictor, cache)[0] if ref else math.nan
            base_meas = ref.measured_ms if ref else math.nan
            rows.append({"model": model, "mode": mode, "seq": seq, "batch": batch, "gpu": gpu, "base_gpu": base,
                         "predicted_ms": pred, "roofline_ms": roof, "base_measured_ms": base_meas,
                         "base_predicted_ms": base_pred,
                         "base_error_pct": (base_pred - base_meas) / base_meas * 100,
                         "speedup_vs_base_measured": base_meas / pred})
    return pd.DataFrame(rows)


def forecast_megatron(dataset: Path = DATASET) -> pd.DataFrame:
    """The Megatron-LM runs of MEGATRON_RUNS x MEGATRON_OPTIONS on MEGATRON_GPUS, with their parts."""
    from neusight.evaluate import LabelRun, predict_label

    predictor = Predictor.load()    # NVIDIA GPUs only
    rows = []
    for gpu in MEGATRON_GPUS:
        for model, batch, seq in MEGATRON_RUNS:
            for option in MEGATRON_OPTIONS:
                run = LabelRun(gpu_dir="(not measured)", device=gpu, model=model,
                               config=str(dataset / "models" / f"{model}.json"), mode="training", seq_len=seq,
                               batch_size=batch, option=option, measured_ms=math.nan, measured_fw_ms=math.nan,
                               measured_bw_ms=math.nan, path="(not measured)")
                res = predict_label(run, predictor)
                rows.append({"gpu": gpu, "model": model, "seq": seq, "batch": batch, "option": option,
                             "predicted_ms": res["predicted_ms"], "roofline_ms": res["roofline_ms"],
                             **{k.removeprefix("part_"): v for k, v in res.items() if k.startswith("part_")}})
    return pd.DataFrame(rows)


def render_megatron(df: pd.DataFrame) -> str:
    t = df.assign(config=df["model"] + " s" + df["seq"].astype(str) + " b" + df["batch"].astype(str))
    table = t.pivot_table(index="config", columns=["gpu", "option"], values="predicted_ms", sort=False)
    table.columns = [f"{g} {o} ms" for g, o in table.columns]
    return "\n".join(["## Megatron-LM on 4 NVLink GPUs (training step)", "",
                      "Forecast ms of one Megatron-LM `train_step` (zeroing, forward with the loss, backward with "
                      "the tensor-parallel all-reduces of the input gradients beside the weight-gradient GEMMs, the "
                      "gradient buffer divided by dp and all-reduced, clipping, fused AdamW; the division is in "
                      "`optimizer_ms`) on 4 GPUs, global batch as given; dp4 = 4 replicas of "
                      "batch / 4, tp4 = each block split over 4 GPUs, pp4_1 = 4 pipeline stages, one micro-batch "
                      "(the stages run one after another). Modelled, never checked against a multi-GPU "
                      "measurement (see neusight/parallel.py for the collective model).", "",
                      markdown_table(table.reset_index(), index=False), "",
                      "Where the time goes (ms; `compute` = the forward and backward kernels of the slowest "
                      "stage's micro-batches, `pp_bubble` = the other stages' work while the pipeline fills and "
                      "drains, `pp_p2p` = every hand-off between stages; collectives at an assumed 80 % of the "
                      "NVLink bandwidth):", "",
                      markdown_table(t.assign(run=t["config"] + " " + t["option"])[
                          ["gpu", "run", "predicted_ms", *[c for c in t.columns if c.endswith("_ms")
                                                           and c not in ("predicted_ms", "roofline_ms")]]],
                                     index=False), ""])


def forecast_cnn(gpus: tuple[str, ...] = CNN_GPUS, runs: list[tuple[str, str, int]] = CNN_RUNS,
                 **trace_kwargs) -> pd.DataFrame:
    """``runs`` on ``gpus``: ``neusight.predict(model, gpu, batch_size=b, image_size=224, mode=m, optimizer="sgd",
    **trace_kwargs)`` (PyTorch's default TF32 switches: TF32 convolutions on GPUs that have TF32 tensor cores)."""
    from neusight.api import predict_graph
    from neusight.graph.tracer import trace
    from neusight.memory import estimate_memory

    rows = []
    for model, mode, batch in runs:
        g = trace(model, batch_size=batch, mode=mode, image_size=224, optimizer="sgd", **trace_kwargs)
        for gpu in gpus:
            p = predict_graph(g, gpu)
            mem = estimate_memory(g, p.device)
            rows.append({"gpu": gpu, "model": model, "mode": mode, "batch": batch, "predicted_ms": p.latency_ms,
                         "images_per_s": batch / p.latency_ms * 1e3, "fits": "yes" if mem.fits else "no"})
    return pd.DataFrame(rows)


def measured_cnn_kin(precisions: tuple[str, ...] = ("fp32",)) -> pd.DataFrame:
    """The same predictor on the public ResNet-50 rows it can be checked on (docs/evaluation.md's CNN sections):
    mean signed error per GPU and mode, the hint for the left-out cards' kin (same die or generation)."""
    from neusight.e2e_eval import load_cnn_benchmarks, predict_cnn

    sel, _ = load_cnn_benchmarks(DATASET.parent / "public-benchmarks", models=["resnet50"], precisions=precisions)
    res = predict_cnn(sel)
    return (res.groupby(["gpu", "mode"]).agg(rows=("error_pct", "size"), mean_signed_err_pct=("error_pct", "mean"),
                                              worst_err_pct=("error_pct", lambda e: e[e.abs().idxmax()]))
            .reset_index())


CNN_KIN = {"rtx-2080-ti": "TU102, like TITAN RTX and Quadro RTX 6000/8000 (Quadro RTX 5000: TU104)",
           "titan-v": "GV100, like the V100s", "gtx-1080-ti": "GP102: no end-to-end kin (P100 is GP100, P4 GP104); DeepBench's TITAN Xp and TITAN X "
                                          "Pascal are GP102 too, measured per kernel only (GEMMs and convolutions, "
                                          "docs/deepbench.md)"}


def render_cnn(df: pd.DataFrame, kin: pd.DataFrame, title: str, intro: str, kin_intro: str, tail: str = "") -> str:
    """A section of CNN forecasts and, below them, the same predictor's error on the measured rows of their kin."""
    t = df.rename(columns={"predicted_ms": "forecast ms", "images_per_s": "images/s", "fits": "fits in memory"})
    k = kin.rename(columns={"mean_signed_err_pct": "mean err %", "worst_err_pct": "worst err %"})
    return "\n".join([f"## {title}", "", intro, "", markdown_table(t, index=False), "", kin_intro, "",
                      markdown_table(k, index=False, signed=["mean err %", "worst err %"]), "",
                      *([tail, ""] if tail else [])])


# each CNN section of the document: title, the forecasts' intro, the kin table's intro, and an optional tail
CNN_SECTIONS = {
    "fp32": ("Older cards: ResNet-50, FP32",
             "Forecast of one training step (SGD) or inference pass at 224 x 224, FP32 (no tensor cores), from the spec "
             "files; the measurements these can be checked against (Lambda, DeepLearningExamples tables of these "
             "cards) are left out of public-benchmarks.",
             "Where the same predictor could be checked on ResNet-50 (the public CNN rows of docs/evaluation.md; signed "
             "error, predicted - measured):",
             "Kin of the left-out cards: " + "; ".join(f"{g}: {v}" for g, v in CNN_KIN.items()) + "."),
    "tf32": ("A100 80GB and H100: ResNet-50, TF32 (PyTorch's default for float convolutions)",
             "The same runs as PyTorch runs a float model on these GPUs by default: convolutions on TF32 tensor cores, "
             "everything else FP32 (`tf32=\"default\"`; the predictor learned FP32 kernels only, and no TF32 "
             "measurement was fitted).",
             "The same predictor on the measured TF32 ResNet-50 rows of their kin (docs/evaluation.md's TF32 section; "
             "signed error, predicted - measured):", ""),
    "half": ("Tensor-core cards: ResNet-50 AMP training, NCHW",
             "One SGD step under `torch.autocast(float16)` with GradScaler, the model in PyTorch's default NCHW layout "
             "(`memory_format=\"contiguous\"`: cuDNN's transposes to NHWC and back are charged, "
             "neusight/graph/layout.py), as Lambda ran its AMP benchmarks.",
             "The same predictor on the measured AMP and FP16 ResNet-50 rows of their kin (GA100, GV100, TU102; "
             "docs/evaluation.md's half-precision section; signed error, predicted - measured):", ""),
}


def render(df: pd.DataFrame, seconds: float) -> str:
    lines = ["# Forecasts for the left-out GPUs", "",
             "Generated by `python scripts/forecast_unseen.py` (its docstring says how); regenerate it, do not edit it. "
             f"Shipped predictors: NVIDIA GPUs by data/predictor (trained on P4, P100, T4, V100, A100-PCIE-40GB kernels "
             f"only), MI250 by data/predictor-amd (trained on MI100 and MI210 kernels, so its MI210 base error is "
             f"in-sample); spec files from "
             f"`data/devices/`. {len(df)} forecasts in {seconds:.0f} s.", "",
             "No measurement of these GPUs was used or seen: the numbers below are forecasts to be checked against "
             "their labels when those are available. `base` is the closest GPU with labels; `base err %` is the "
             "same predictor's signed error there (predicted - measured), the best available hint of how far off "
             "the forecast may be; `x base` = measured base latency / forecast (above 1: the left-out GPU is "
             "forecast faster).", ""]
    for gpu, d in df.groupby("gpu", sort=False):
        base = d["base_gpu"].iloc[0]
        t = d.assign(config=d["model"] + " " + d["mode"].str.replace("inference", "infer").str.replace("training", "train") + " s" + d["seq"].astype(str) + " b" + d["batch"].astype(str))
        t = t.set_index("config")[["predicted_ms", "roofline_ms", "base_measured_ms", "base_predicted_ms",
                                    "base_error_pct", "speedup_vs_base_measured"]]
        t.columns = ["forecast ms", "roofline ms", f"{base} measured ms", f"{base} predicted ms", "base err %",
                     "x base"]
        has = t[f"{base} measured ms"].notna()
        median_speedup = t.loc[has, "x base"].median()
        t["x base"] = t["x base"].map(lambda v: "" if math.isnan(v) else f"{v:.2f}")
        lines += [f"## {gpu} (base: {base})", "",
                  f"Median forecast speed-up over the measured {base}: {median_speedup:.2f}x over "
                  f"{int(has.sum())} configurations it was measured in; the predictor's mean signed error on {base} "
                  f"itself: {t.loc[has, 'base err %'].mean():+.1f} %.", "",
                  markdown_table(t.reset_index(), index=False, signed=["base err %"]), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", type=Path, default=DATASET)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "unseen.md")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    df = forecast(args.dataset)
    meg = forecast_megatron(args.dataset)
    cnn = forecast_cnn()
    kin = measured_cnn_kin()
    cnn_tf32 = forecast_cnn(CNN_TF32_GPUS)
    kin_tf32 = measured_cnn_kin(("tf32",))
    kin_tf32 = kin_tf32[kin_tf32["gpu"].str.startswith("a100")]
    cnn_half = forecast_cnn(CNN_HALF_GPUS, CNN_HALF_RUNS, amp="float16")
    kin_half = measured_cnn_kin(("amp", "fp16"))
    kin_half = kin_half[kin_half["gpu"].isin(CNN_HALF_KIN)]
    n_cnn = len(cnn) + len(cnn_tf32) + len(cnn_half)
    text = render(df, time.time() - t0).replace(" forecasts in ", f" + {len(meg)} multi-GPU + {n_cnn} CNN forecasts in ", 1)
    text += ("\n" + render_megatron(meg) + "\n" + render_cnn(cnn, kin, *CNN_SECTIONS["fp32"]) + "\n"
             + render_cnn(cnn_tf32, kin_tf32, *CNN_SECTIONS["tf32"]) + "\n"
             + render_cnn(cnn_half, kin_half, *CNN_SECTIONS["half"]))
    atomic_write_text(args.out, text + "\n")
    print(text)


if __name__ == "__main__":
    main()

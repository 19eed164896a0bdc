"""Benchmark: GEMM and convolution kernels of GPUs the predictor never saw, from Baidu DeepBench. Writes docs/deepbench.md.

    python scripts/bench_deepbench.py               # a few seconds
    python scripts/bench_deepbench.py --out /tmp/deepbench.md

DeepBench times ``cublasGemmEx`` back to back (one warm-up, then 400 calls between two synchronizations), on
TITAN Xp, TITAN X (Pascal and Maxwell), M40 and V100-SXM2, none of which the shipped predictor was trained on,
plus P100 and T4 (trained on, through the NeuSight sweeps), with older CUDA libraries. Back-to-back calls pay
no launch or timing overhead each, like kernels inside a model, so the forecast compared is the in-model one
(``neusight.api.e2e_kernel_ms``: roofline + the end-to-end scale x the excess, the launch floor); the isolated
prediction (one kernel timed alone, as in the NeuSight sweeps) and the roofline are shown beside it.
FP32 rows are the main table; FP16 rows (tensor cores, V100 and T4 only) test a precision the predictor was
never trained on. DeepBench's libraries are older (CUDA 7.5 to 10.1) than the NeuSight sweeps' (CUDA 12.1).

Convolutions (FP32): DeepBench also timed cuDNN's forward, data-gradient and weight-gradient kernels of the
same shapes. The shipped predictor's convolution-gradient factors are fitted on these rows
(neusight.conv_backward, by neusight-train, on the GPUs its manifest names); the tables show each pass's
in-model forecast without and with the factors, and the gradient-over-forward time ratio the factors are
fitted to, per GPU: without factors, with the shipped ones, and with factors fitted without that GPU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from neusight.api import e2e_kernel_ms
from neusight.cli.common import quiet_third_party_logs
from neusight.conv_backward import base_forecast, fit_conv_backward, fit_factors, forecast, summed_error_pct
from neusight.dataset import load_deepbench_conv, load_deepbench_gemm
from neusight.e2e_eval import markdown_table
from neusight.predictor.model import Predictor
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
CSV = REPO.parent / "shared" / "datasets" / "public-benchmarks" / "deepbench_gemm.csv"
CONV_CSV = CSV.with_name("deepbench_conv.csv")


def _errors(pred: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    e = (pred / measured - 1) * 100
    return float(np.mean(np.abs(e))), float(np.median(e))


def evaluate(precision: str, predictor: Predictor) -> pd.DataFrame:
    df = load_deepbench_gemm(CSV, precisions=(precision,))
    rows = []
    for dev, d in df.groupby("device"):
        p = predictor.predict(d, dev)
        roof, iso, over = (p[c].to_numpy(float) for c in ("roofline_ms", "latency_ms", "overhead_ms"))
        inmodel = e2e_kernel_ms(roof, iso, over, predictor.e2e_scale_, predictor.e2e_floor_)
        m = d["latency_ms"].to_numpy(float)
        row = {"gpu": dev, "trained on": "yes" if dev in predictor.train_devices_ else "no", "rows": len(d)}
        for name, pred in (("back-to-back", inmodel), ("isolated", iso), ("roofline", roof)):
            row[f"{name} MAPE"], row[f"{name} median"] = _errors(pred, m)
        big = m > 0.1
        row["back-to-back MAPE, > 0.1 ms"] = _errors(inmodel[big], m[big])[0] if big.any() else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def evaluate_conv(predictor: Predictor) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(per GPU and pass: forecast errors without / with the factors; per GPU: ratio errors; per class: factor)."""
    df = load_deepbench_conv(CONV_CSV)
    base = base_forecast(df, predictor)
    preds = {"no factors": forecast(base, predictor, {}), "factors": forecast(base, predictor, predictor.conv_backward_)}
    m = df["latency_ms"].to_numpy(float)
    rows = []
    for (dev, part), d in df.groupby(["device", "pass"], sort=True):
        i = df.index.get_indexer(d.index)
        row = {"gpu": dev, "pass": part, "rows": len(d)}
        for name, pred in preds.items():
            row[f"{name} MAPE"], row[f"{name} median"] = _errors(pred[i], m[i])
            row[f"{name} sum"] = (pred[i].sum() / m[i].sum() - 1) * 100   # what a model of these kernels would see
        rows.append(row)
    cal = predictor.manifest_.get("conv_backward_calibration") or {}
    fit_on = list(cal.get("devices") or [])
    fit = fit_conv_backward(df, predictor, fit_on, source=CONV_CSV)
    ratio = []
    for dev in sorted(df["device"].unique()):
        held = fit_factors(df, base, predictor, [d for d in fit_on if d != dev]) if dev in fit_on else fit["factors"]
        for part in ("dgrad", "wgrad", "both"):
            mine = (df["device"] == dev).to_numpy() & df["pass"].isin(["dgrad", "wgrad"] if part == "both" else [part]).to_numpy()
            ratio.append({"gpu": dev, "factors fitted on it": "yes" if dev in fit_on else "no", "gradient": part,
                          **{name: summed_error_pct(df, base, predictor, f, mine)
                             for name, f in (("no factors", {}), ("shipped factors", predictor.conv_backward_),
                                             ("fitted without this GPU", held))}})
    ratio = pd.DataFrame(ratio)
    classes = pd.DataFrame([{"class": name, "shipped factor": f"{f:.3f}",
                             "refitted here": f"{fit['factors'][name]:.3f}" if name in fit["factors"] else "",
                             "rows": fit["rows"].get(name, 0)} for name, f in predictor.conv_backward_.items()])
    return pd.DataFrame(rows), ratio, classes


def conv_fp16_ratio(predictor: Predictor) -> pd.DataFrame:
    """FP16 (tensor cores, V100 and T4; never fitted): summed gradient-over-forward ratio error per GPU and
    gradient, without and with the shipped (FP32-fitted) factors."""
    df = load_deepbench_conv(CONV_CSV, precisions=("fp16",))
    base = base_forecast(df, predictor)
    out = []
    for dev in sorted(df["device"].unique()):
        for part in ("dgrad", "wgrad", "both"):
            mine = (df["device"] == dev).to_numpy() & df["pass"].isin(["dgrad", "wgrad"] if part == "both" else [part]).to_numpy()
            out.append({"gpu": dev, "gradient": part, "no factors": summed_error_pct(df, base, predictor, {}, mine),
                        "shipped factors": summed_error_pct(df, base, predictor, predictor.conv_backward_, mine)})
    return pd.DataFrame(out)


def conv_fp16_channels(predictor: Predictor) -> pd.DataFrame:
    """FP16 convolutions (V100, T4) per GPU, pass and channel alignment (neusight.kernels.base.TC_CHANNEL_ALIGN):
    the measured FP16 / FP32 time of the same shapes, and the forecast's summed time over the measured one (in-model
    forecast, shipped gradient factors) as shipped (unaligned channels at the FP32 rates) and with every FP16
    convolution on tensor cores, as before the channel rule."""
    df = load_deepbench_conv(CONV_CSV, precisions=("fp16",))
    df = df[df["device"].isin(["v100-sxm2-16gb", "t4"])].reset_index(drop=True)
    fp32 = load_deepbench_conv(CONV_CSV, precisions=("fp32",))
    shape = ["device", "pass", "conv_n", "conv_c", "conv_h", "conv_w", "conv_k", "conv_r", "conv_s", "stride_h",
             "stride_w", "pad_h", "pad_w"]
    ref = df[shape].merge(fp32[shape + ["latency_ms"]].drop_duplicates(shape), on=shape, how="left")["latency_ms"]
    preds = {name: forecast(base_forecast(d, predictor), predictor, predictor.conv_backward_)
             for name, d in (("shipped", df), ("all on tensor cores", df.drop(columns=["channel_align"])))}
    d = df.assign(aligned=np.where(df["channel_align"] >= 8, "yes", "no"), fp32_ms=ref.to_numpy(),
                  **{name: p for name, p in preds.items()})
    rows = []
    for (dev, part, al), g in d.groupby(["device", "pass", "aligned"], sort=True):
        both = g["fp32_ms"].notna()
        rows.append({"gpu": dev, "pass": part, "channels multiple of 8": al, "rows": len(g),
                     "measured FP16 / FP32 time": f'{g.loc[both, "latency_ms"].sum() / g.loc[both, "fp32_ms"].sum():.2f}',
                     **{f"forecast / measured, {name}": f'{g[name].sum() / g["latency_ms"].sum():.2f}'
                        for name in preds}})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "deepbench.md")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    predictor = Predictor.load()
    tables = {p: evaluate(p, predictor) for p in ("fp32", "fp16")}
    signed = [c for c in tables["fp32"].columns if c.endswith("median")]
    conv, ratio, classes = evaluate_conv(predictor)
    conv_signed = [c for c in conv.columns if c.endswith(("median", "sum"))]
    fp16_ratio = conv_fp16_ratio(predictor)
    fp16_channels = conv_fp16_channels(predictor)
    text = "\n".join([
        "# DeepBench GEMMs and convolutions: kernels of GPUs the predictor never saw", "",
        f"Generated by `python scripts/bench_deepbench.py` in {time.time() - t0:.1f} s (its docstring says what is "
        "compared and why); regenerate it, do not edit it. Shipped predictor, trained on the NeuSight sweeps of "
        f"{', '.join(predictor.train_devices_)}. MAPE and median signed error in % (positive: predicted too slow).",
        "", "## FP32", "", markdown_table(tables["fp32"], index=False, signed=signed),
        "## FP16 (never trained on)", "", markdown_table(tables["fp16"], index=False, signed=signed),
        "## Convolutions (FP32): forward, data gradient, weight gradient", "",
        "cuDNN's fastest algorithm per pass (DeepBench's cuDNN 5 to 7.6). In-model forecast of each pass, without "
        "and with the shipped predictor's convolution-gradient factors (forward kernels have none). The conv "
        "model was trained on forward 3x3 stride-1 sweeps only; every other pass and shape is forecast by the GEMM "
        "model on its implicit-GEMM shape. `sum`: error of the summed time of the rows (what a model made of "
        "these kernels would see), signed.", "",
        markdown_table(conv, index=False, signed=conv_signed),
        "### Gradient-over-forward time ratio", "",
        "What the factors are fitted to: each shape's measured forward time x the forecast gradient / forward "
        "ratio, summed over a GPU's rows, against the summed measured gradient time; signed % error (positive: "
        "gradients forecast too slow relative to the forward). The ratio cancels what a GPU's speed and a "
        "library version do to both passes alike.", "",
        markdown_table(ratio, index=False, signed=["no factors", "shipped factors", "fitted without this GPU"]),
        "FP16 (tensor cores; DeepBench's V100 and T4 only), a precision the factors were not fitted on, the same "
        "ratio without and with the shipped factors:", "",
        markdown_table(fp16_ratio, index=False, signed=["no factors", "shipped factors"]),
        "### FP16 convolutions and their channel counts", "",
        "NVIDIA's convolution performance guide asks for input and output channels in multiples of 8 for an FP16 "
        "convolution to run efficiently on tensor cores; DeepBench's FP16 shapes with 1 or 3 input channels (speech "
        "spectrograms, image first layers) show it: summed, they ran 3-5x slower than the same shapes in FP32, where "
        "the aligned ones ran 3-5x faster. The forecast puts such convolutions on the CUDA cores at the FP32 rates "
        "(neusight.predictor.features.without_tensor_cores); summed forecast over summed measured time (1 = right, "
        "below 1 = too fast), as shipped and with every FP16 convolution on tensor cores. Even at the FP32 rates "
        "these rows stay forecast too fast: cuDNN 7.6's FP16 path for them was slower than its FP32 one, which no "
        "rule here models.", "",
        markdown_table(fp16_channels, index=False),
        "### Factors per class", "",
        "A class's factor multiplies the work (time beyond the launch overhead) of its gradient kernels; "
        "`refitted here` repeats the fit of `neusight-train` on the same GPUs (it matches the shipped factor "
        "unless the data or the code changed since the predictor was trained).", "",
        markdown_table(classes, index=False)])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

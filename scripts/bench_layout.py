"""Benchmark: does the operand layout of a GEMM decide which utilization model fits it? Writes docs/layout.md.

    python scripts/bench_layout.py            # ~3 min, reads ../shared in place

cuBLAS names its SGEMM kernels by operand layout (`..._tn`, `..._nn`). The kernel sweeps the predictor learns
from use one layout per family: nn.Linear (y = x W^T) for linear and torch.bmm for bmm. GPT-2-style models
(GPT-2, GPT-3 in the NeuSight labels) project with Conv1D, an `addmm(bias, x, W)` on an untransposed W: the
bmm sweep's layout, not the linear sweep's. This script counts the layouts in the sweeps' kernel names, then
predicts every `addmm` shape of the labels' per-operator CSVs (the GEMMs docs/noise.md section 3 compares)
with the shipped predictor's linear model and with its bmm model (B = 1), against the measured time. No
end-to-end calibration is involved: these are single kernels timed alone.

Then the training labels' per-operator CSVs, which time each projection's forward and backward: nn.Linear
(BERT; forward `_tn`, input gradient `_nn`, weight gradient `_nt`) and Conv1D (GPT-2; `_nn`, `_tn`, `_nt`),
each pass predicted with either model. Last, end to end: traced models name their 2-D GEMMs by layout
(`addmm_nn`, `mm_nt`, ...) and a predictor can send a layout to the bmm model (Predictor.layout_models_).
For each routing the end-to-end calibration is refitted on the training GPUs' labels, as `neusight-train`
does, and every plain NVIDIA label is forecast.
"""

from __future__ import annotations

import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_noise import FILES, LABELS, label_csvs, md, model_gemms  # noqa: E402

from neusight.api import predict_kernel_table  # noqa: E402
from neusight.dataset import load_kernel_traces  # noqa: E402
from neusight.util import atomic_write_text  # noqa: E402

OUT = REPO / "docs" / "layout.md"
LAYOUT_RE = re.compile(r"_(nn|nt|tn|tt)(?:_|>|$)")


def layout_counts() -> pd.DataFrame:
    """Kernel-name layouts per family and GPU in the training sweeps."""
    f = load_kernel_traces(FILES["sweep"])
    f = f[f["family"].isin(["linear", "bmm"])]
    lay = f["kernel_name"].astype(str).str.extract(LAYOUT_RE)[0].fillna("other")
    t = pd.crosstab([f["family"], f["device"]], lay).reset_index()
    t.columns.name = None
    return t.rename(columns={"device": "GPU"})


def model_errors() -> pd.DataFrame:
    """Per GPU: the labels' addmm GEMMs predicted as linear and as bmm kernels against their measured time."""
    g = model_gemms()
    g = g[g["family"] == "linear"].reset_index(drop=True)
    table = pd.DataFrame({"Device": g["device"], "B": 1, "M": g["M"], "N": g["N"], "K": g["K"]})
    measured = 2.0 * g["M"] * g["N"] * g["K"] / g["rate"] / 1e9
    predicted = {fam: predict_kernel_table(table.assign(OPName=fam)) for fam in ("linear", "bmm")}
    rows = []
    for dev, idx in g.groupby("device").groups.items():
        meas = measured[idx]
        row = {"GPU": dev, "shapes": str(len(idx))}
        for fam, pred in predicted.items():
            row[f"{fam} model MAPE"] = float(((pred[idx] - meas).abs() / meas).mean() * 100)
            row[f"{fam} model time-weighted"] = f"{(pred[idx].sum() / meas.sum() - 1) * 100:+.1f}"
        rows.append(row)
    return pd.DataFrame(rows)


def _linear_nodes() -> pd.DataFrame:
    """Per GPU, the distinct projections of the training labels' per-operator CSVs with their measured forward
    and backward ms: Conv1D `addmm` nodes (GPT-2) and nn.Linear module nodes (BERT, weight shape from the
    output). Dims as the kernel files: x (M x N) projected to K outputs."""
    import ast

    rows = []
    for run, df in label_csvs("training"):
        if not {"fw_latency", "bw_latency", "output_shape"} <= set(df.columns):
            continue
        for _, r in df.iterrows():
            shapes = ast.literal_eval(str(r["input_shapes"])) if str(r["input_shapes"]).startswith("[") else []
            if re.fullmatch(r"addmm(_\d+)?", str(r["Name"])) and len(shapes) == 3 and len(shapes[1]) == 2:
                (m, n), k, kind = shapes[1], shapes[2][1], "Conv1D"
            elif (r["op"] == "call_module" and re.search(r"\.(query|key|value|dense)$", str(r["target"]))
                  and len(shapes) == 1):
                out = ast.literal_eval(str(r["output_shape"]))
                m, n, k, kind = math.prod(shapes[0][:-1]), shapes[0][-1], out[-1], "nn.Linear"
            else:
                continue
            if r["fw_latency"] > 0 and r["bw_latency"] > 0:
                rows.append((run.device, kind, m, n, k, float(r["fw_latency"]), float(r["bw_latency"])))
    g = pd.DataFrame(rows, columns=["device", "kind", "M", "N", "K", "fw", "bw"])
    return g.groupby(["device", "kind", "M", "N", "K"], as_index=False)[["fw", "bw"]].median()


def pass_errors() -> pd.DataFrame:
    """Forward and backward of the training labels' projections, each GEMM predicted by the linear or the bmm
    model (B = 1): forward (M, N, K); input gradient dy (M x K) @ W (K x N); weight gradient over the M tokens
    (nn.Linear: dy^T @ x, K x N; Conv1D: x^T @ dy, N x K). The backward's small bias-gradient reduction is left
    out of the prediction. Time-weighted signed error in %."""
    g = _linear_nodes()
    lin = (g["kind"] == "nn.Linear").to_numpy()

    def pred(fam: str, m, n, k) -> np.ndarray:
        t = pd.DataFrame({"Device": g["device"], "OPName": fam, "B": 1, "M": m, "N": n, "K": k})
        return predict_kernel_table(t).to_numpy()

    m, n, k = g["M"].to_numpy(), g["N"].to_numpy(), g["K"].to_numpy()
    passes = {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (np.where(lin, k, n), m, np.where(lin, n, k))}
    p = {(ps, fam): pred(fam, *dims) for ps, dims in passes.items() for fam in ("linear", "bmm")}
    layout = {"nn.Linear": ("tn", "nn", "nt"), "Conv1D": ("nn", "tn", "nt")}
    rows = []
    for (dev, kind), idx in g.groupby(["device", "kind"]).groups.items():
        i = np.asarray(list(idx))
        fw, bw = g.loc[i, "fw"].sum(), g.loc[i, "bw"].sum()
        row = {"GPU": dev, "projection": f"{kind} ({'/'.join(layout[kind])})", "shapes": str(len(i))}
        for fam in ("linear", "bmm"):
            row[f"fwd, {fam}"] = f"{(p['fwd', fam][i].sum() / fw - 1) * 100:+.1f}"
        for dg, wg in (("linear", "linear"), ("bmm", "linear"), ("linear", "bmm"), ("bmm", "bmm")):
            bwd = (p["dgrad", dg][i] + p["wgrad", wg][i]).sum()
            row[f"bwd, dgrad {dg} + wgrad {wg}"] = f"{(bwd / bw - 1) * 100:+.1f}"
        rows.append(row)
    return pd.DataFrame(rows)


ROUTINGS = {"none (shipped)": {}, "nn -> bmm": {"nn": "bmm"}, "nt -> bmm": {"nt": "bmm"},
            "nn, nt -> bmm": {"nn": "bmm", "nt": "bmm"}}


def routing_errors() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per routing: the refitted end-to-end calibration and its leave-one-GPU-out error, and each GPU's mean
    (worst) absolute % error over the plain NVIDIA labels, inference and training apart."""
    from neusight.evaluate import calibrate, evaluate_labels, find_labels
    from neusight.predictor.model import Predictor

    runs = find_labels(LABELS)
    cal_rows, cells = [], {}
    for name, routing in ROUTINGS.items():
        pred = Predictor.load()                        # a fresh copy of the shipped predictor, not the cached one
        pred.layout_models_ = dict(routing)
        cal = calibrate(pred, runs)
        held = [v["mean_abs_err_after"] for v in cal["leave_one_gpu_out"].values()]
        cal_rows.append({"routing": name, "scale": f"{cal['scale']:.3f}", "floor": f"{cal['floor']:.1f}",
                         "leave-one-GPU-out mean": float(np.mean(held)),
                         "leave-one-GPU-out worst": float(np.max(held))})
        res = evaluate_labels(runs, pred)
        res["abs"] = res["error_pct"].abs()
        for (dev, mode), r in res.groupby(["device", "mode"]):
            cell = cells.setdefault((dev, mode), {"GPU": dev, "mode": mode, "runs": str(len(r))})
            cell[name] = f"{r['abs'].mean():.1f} ({r['abs'].max():.1f})"
    return pd.DataFrame(cal_rows), pd.DataFrame([cells[k] for k in sorted(cells)])


def main() -> None:
    t0 = time.time()
    counts_md = md(layout_counts())
    errors_md = md(model_errors())
    passes_md = md(pass_errors())
    cal, routed = routing_errors()
    cal_md, routed_md = md(cal), md(routed)
    text = f"""# GEMM operand layout: which utilization model fits a model's projections?

Generated by `python scripts/bench_layout.py` (its docstring says why); regenerate it, do not edit it. Run time:
{time.time() - t0:.0f} s. Predictor: the shipped one per GPU (`data/predictor`); the kernel sections predict single
kernels without the end-to-end calibration, the last section refits that calibration for each routing.

## Layouts in the training sweeps (`../shared/datasets/neusight-asplos25/kernels/nvidia`)

Rows per cuBLAS kernel-name layout suffix ("other": no suffix, e.g. P4's `gemv`/`vec` kernels).

{counts_md}

## The labels' GPT-2-style projections (`addmm` on an untransposed weight) predicted by each model

Every distinct `addmm` shape of the NVIDIA inference labels' per-operator CSVs (GPT-2 Large, GPT-3 XL and
2.7B; the same GEMMs as docs/noise.md section 3), predicted as a linear kernel and as a bmm kernel with B = 1,
against its measured time. MAPE in %; time-weighted = sum predicted / sum measured - 1, in %.

{errors_md}

## Forward and backward of the training labels' projections

The per-operator CSVs of the NVIDIA training labels (BERT Large and GPT-2 Large; only V100 and L4 have them)
time each projection's forward and backward (input gradient + weight gradient + a small bias-gradient sum,
which the prediction leaves out). Layouts in brackets: forward / input gradient / weight gradient. Each GEMM
predicted by the linear or the bmm model (B = 1); time-weighted signed error in %, positive = too slow.

{passes_md}

## End to end, with 2-D GEMMs routed by layout

Traced models name their 2-D GEMMs by layout (`addmm_tn` for nn.Linear, `addmm_nn` for Conv1D, `mm_nn` and
`mm_nt` for the gradients). Each routing sends those layouts to the bmm model (B = 1), the rest stay on the
linear model; the end-to-end calibration (scale on the excess over the roofline, launch floor) is refitted
on the training GPUs' labels for each, as `neusight-train` does. Leave-one-GPU-out: the calibration's own
check, mean absolute % error on each training GPU when fitted without it.

{cal_md}

Mean (worst) absolute % error per GPU over the plain NVIDIA labels:

{routed_md}
"""
    atomic_write_text(OUT, text)
    print(text)


if __name__ == "__main__":
    main()

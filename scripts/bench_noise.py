"""Benchmark: how consistent are the kernel measurements themselves? Writes docs/noise.md.

    python scripts/bench_noise.py            # ~30 s, reads ../shared in place

No predictor is involved. Two checks, per family, GPU and file (the sweep files the predictor trains on and
the large-shape files it is evaluated on):

1. Oracle spread. Kernels with many thread blocks per SM (>= MIN_BLOCKS_PER_SM, so the partial last wave
   costs at most a few per cent) run at a steady rate: a GEMM's time per FLOP, a memory-bound kernel's time
   per byte, should not change when only the batch-like dimension grows. Rows are grouped into series that
   differ only in that dimension (bmm: same M, N, K and cuBLAS kernel, B varies; linear: same N, K and kernel,
   M varies; row-wise ops: same op, H and kernel, B varies; memory-bound rows also need more bytes than
   L2_FACTOR x the L2 cache so they stream from DRAM). The error of each row against its series' median time
   per unit is what a predictor that knew every series' exact rate would still get wrong: a floor under any
   model that takes shapes and spec-sheet facts as input. It measures clock and power-state variation between
   runs (and anything else the series key leaves out).
2. Plateau rate per file. The median rate (TFLOP/s or GB/s) of those rows in the sweep file and in the
   large-shape file of the same GPU. A model trained on one GPU's sweep cannot match that GPU's large-shape
   file better than the two files agree with each other.
3. Real models' GEMMs. The labels' per-operator CSVs time each node of the model on its own: the `addmm`s
   of the GPT-2-style models (their Conv1D projections, linear) and the attention `matmul`s (bmm). Each is
   compared with the median rate of its NEAREST (3) nearest rows of the same family (L1 distance in log2
   B, M, N, K) in the same GPU's sweep and large-shape files: where the ratio is far from 1, a model's GEMMs
   do not run at the rate the kernel files show for shapes like them.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import numpy as np
import pandas as pd

from neusight.dataset import load_kernel_traces
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO.parent / "shared" / "datasets" / "neusight-asplos25" / "kernels"
OUT = REPO / "docs" / "noise.md"
FILES = {"sweep": KERNELS / "nvidia", "large": KERNELS / "nvidia-large-shapes"}
MIN_BLOCKS_PER_SM = 32     # >= 32 blocks per SM: the tail wave is a small share of the time
L2_FACTOR = 4              # memory-bound rows must move > 4 x L2 bytes to be DRAM-bound
MIN_SERIES = 3             # rows per series
PLATEAU_MIN_K = 512        # GEMMs compared across files: long enough K to be near their peak rate
GEMM = {"bmm": ("B", ["M", "N", "K"]), "linear": ("M", ["N", "K"])}
ROWWISE = ("elementwise", "softmax", "layernorm")
LABELS = REPO.parent / "shared" / "datasets" / "neusight-asplos25"
NEAREST = 3                # kernel-file rows compared with each real-model GEMM


def steady(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows that should run at a steady rate, with a `series` key, `cost` (ms per unit) and `rate`."""
    f = frame[frame["num_blocks"] / frame["dev_sm_count"] >= MIN_BLOCKS_PER_SM].copy()
    parts = []
    for family, (_, key) in GEMM.items():
        g = f[f["family"] == family].copy()
        g["series"] = g[key + ["kernel_name"]].astype(str).agg("|".join, axis=1)
        g["cost"] = g["latency_ms"] / g["flops"]
        g["rate"] = g["flops"] / g["latency_ms"] / 1e9       # TFLOP/s
        parts.append(g)
    g = f[f["family"].isin(ROWWISE)]
    g = g[g["bytes"] > L2_FACTOR * g["dev_l2_cache_mib"] * 2**20].copy()
    g["series"] = g[["op", "cols", "kernel_name"]].astype(str).agg("|".join, axis=1)
    g["cost"] = g["latency_ms"] / g["bytes"]
    g["rate"] = g["bytes"] / g["latency_ms"] / 1e6            # GB/s
    parts.append(g)
    return pd.concat(parts, ignore_index=True)


def in_series(q: pd.DataFrame) -> pd.DataFrame:
    size = q.groupby(["file", "family", "device", "series"])["cost"].transform("size")
    return q[size >= MIN_SERIES]


def oracle_table(q: pd.DataFrame) -> pd.DataFrame:
    med = q.groupby(["file", "family", "device", "series"])["cost"].transform("median")
    q = q.assign(err=100 * (q["cost"] - med).abs() / q["cost"])
    return (q.groupby(["family", "device", "file"])
             .agg(rows=("err", "size"), series=("series", "nunique"), mape=("err", "mean"),
                  p90=("err", lambda e: np.percentile(e, 90)))
             .reset_index())


def plateau_table(q: pd.DataFrame) -> pd.DataFrame:
    q = q[~q["family"].isin(list(GEMM)) | (q["K"] >= PLATEAU_MIN_K)]
    t = q.groupby(["family", "device", "file"])["rate"].median().unstack("file")
    t = t.reindex(columns=list(FILES)).dropna()
    t["large / sweep"] = t["large"] / t["sweep"]
    return t.reset_index()


def label_csvs(mode: str):
    """(run, per-operator frame) of every NVIDIA label run of ``mode`` ("inference", "training") whose CSV is
    not empty."""
    from neusight.evaluate import find_labels

    for run in find_labels(LABELS):
        csv = Path(run.path).with_suffix(".csv")
        if run.mode == mode and csv.is_file() and csv.stat().st_size > 0:
            yield run, pd.read_csv(csv)


def model_gemms() -> pd.DataFrame:
    """Every distinct GEMM shape of the NVIDIA inference labels' per-operator CSVs, per GPU, with its median
    measured rate (TFLOP/s): `addmm` nodes as linear (B = 1) and 4-d `matmul` nodes (attention) as bmm
    (B = batch x heads). Dims follow the kernel files (neusight.kernels.formulas.gemm): (M x N) @ (N x K),
    N the reduction."""
    rows = []
    for run, df in label_csvs("inference"):
        col = "latency" if "latency" in df else "fw_latency"          # some CSVs only have fw_latency
        for _, r in df[df["Name"].astype(str).str.fullmatch(r"(addmm|matmul)(_\d+)?")].iterrows():
            shapes = ast.literal_eval(str(r["input_shapes"]))
            if not r[col] > 0:
                continue
            if len(shapes) == 3 and len(shapes[1]) == 2 and len(shapes[2]) == 2:         # addmm(bias, x, W)
                (m, n), k, b, family = shapes[1], shapes[2][1], 1, "linear"
            elif len(shapes) == 2 and len(shapes[0]) == 4 and len(shapes[1]) == 4:     # (b, h, m, n) @ (b, h, n, k)
                (b0, h, m, n), k, family = shapes[0], shapes[1][3], "bmm"
                b = b0 * h
            else:
                continue
            rows.append((family, run.device, b, m, n, k, 2 * b * m * n * k / float(r[col]) / 1e9))
    g = pd.DataFrame(rows, columns=["family", "device", "B", "M", "N", "K", "rate"])
    return g.groupby(["family", "device", "B", "M", "N", "K"], as_index=False)["rate"].median()


def gemm_agreement(gemms: pd.DataFrame, files: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per family and GPU: the real-model GEMMs' rate over the median rate of their NEAREST nearest rows of the
    same family in each file (log2 B, M, N, K)."""
    out = []
    for (family, dev), g in gemms.groupby(["family", "device"]):
        x = np.log2(g[["B", "M", "N", "K"]].to_numpy(float))
        row = {"family": family, "GPU": dev, "model shapes": str(len(g)), "model rate": float(g["rate"].median())}
        for name, frame in files.items():
            f = frame[(frame["family"] == family) & (frame["device"] == dev)]
            if f.empty:
                row[f"{name} ratio"] = row[f"{name} range"] = row[f"{name} distance"] = "-"
                continue
            fx = np.log2(f[["B", "M", "N", "K"]].to_numpy(float))
            rate = (f["flops"] / f["latency_ms"] / 1e9).to_numpy()
            dist = np.abs(x[:, None, :] - fx[None, :, :]).sum(-1)
            near = np.argsort(dist, axis=1)[:, :NEAREST]
            ratio = g["rate"].to_numpy() / np.median(rate[near], axis=1)
            row[f"{name} ratio"] = f"{np.median(ratio):.2f}"
            row[f"{name} range"] = f"{ratio.min():.2f}-{ratio.max():.2f}"
            row[f"{name} distance"] = f"{np.median(np.take_along_axis(dist, near, 1).max(1)):.1f}"
        out.append(row)
    return pd.DataFrame(out)


def md(df: pd.DataFrame, floats: str = "{:.1f}") -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |",
             "| " + " | ".join("---" if c in ("family", "GPU") else "---:" for c in cols) + " |"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(floats.format(v) if isinstance(v, float) else str(v) for v in r) + " |")
    return "\n".join(lines)


def main() -> None:
    t0 = time.time()
    frames, gemm_rows = [], {}
    for name, path in FILES.items():
        f = load_kernel_traces(path)
        frames.append(steady(f).assign(file=name))
        gemm_rows[name] = f[f["family"].isin(list(GEMM))]
    q = pd.concat(frames, ignore_index=True)
    oracle = oracle_table(in_series(q))
    wide = oracle.pivot_table(index=["family", "device"], columns="file", values=["rows", "mape", "p90"])
    rows = []
    for (fam, dev), r in wide.iterrows():
        row = {"family": fam, "GPU": dev}
        for name in FILES:
            n = r.get(("rows", name), np.nan)
            row[f"{name} rows"] = "-" if pd.isna(n) else str(int(n))
            row[f"{name} MAPE"] = "-" if pd.isna(n) else f"{r[('mape', name)]:.1f}"
            row[f"{name} p90"] = "-" if pd.isna(n) else f"{r[('p90', name)]:.1f}"
        rows.append(row)
    oracle_md = md(pd.DataFrame(rows))
    plateau = plateau_table(q)
    plateau_md = md(plateau.rename(columns={"device": "GPU", "sweep": "sweep rate", "large": "large-shape rate"}),
                    floats="{:.2f}")
    agreement_md = md(gemm_agreement(model_gemms(), gemm_rows), floats="{:.1f}")
    text = f"""# How consistent are the kernel measurements?

Generated by `python scripts/bench_noise.py` (no predictor involved); regenerate it, do not edit it.
Data: `../shared/datasets/neusight-asplos25/kernels/nvidia` (sweeps, the training data) and
`../shared/datasets/neusight-asplos25/kernels/nvidia-large-shapes` (kernels of real-model size, evaluation data). Run time: {time.time() - t0:.0f} s.

## 1. Oracle spread: the error floor of any shape-and-spec model

Rows with at least {MIN_BLOCKS_PER_SM} thread blocks per SM (measured grid), grouped into series that differ only
in the batch-like dimension (bmm: B at fixed M, N, K and cuBLAS kernel; linear: M at fixed N, K and kernel;
elementwise / softmax / layer norm: B at fixed op, H and kernel, and only rows moving more than {L2_FACTOR} x the
L2 cache). Within a series the time per FLOP (GEMM) or per byte (memory-bound) should be constant. MAPE and
90th percentile (%) of each row against its series' median: what a model that knew every series' true rate
would still miss. Series need {MIN_SERIES}+ rows; "-" = no qualifying series in that file.

{oracle_md}

## 2. Plateau rate: does a GPU's sweep agree with its large-shape file?

Median rate (TFLOP/s for bmm and linear, GB/s for the memory-bound families) in each file of the rows with at
least {MIN_BLOCKS_PER_SM} blocks per SM (GEMMs also K >= {PLATEAU_MIN_K}; memory-bound rows beyond {L2_FACTOR} x L2, no series
needed). The two files sample different shapes, so a ratio near 1 is what consistent data gives, not exactly 1.
A model trained on a GPU's sweep reproduces that GPU's sweep rate; where the large-shape file runs at another
rate, it misses the large-shape file by about that ratio.

{plateau_md}

## 3. Real models' GEMMs: do they run at the kernel files' rate?

The per-operator CSVs next to the NVIDIA inference labels (`../shared/datasets/neusight-asplos25/labels`) time
each node of the model on its own. linear: their `addmm` nodes, the GPT-2-style models' projections (GPT-2
Large, GPT-3 XL and 2.7B; BERT and OPT use nn.Linear modules, whose rows carry no weight shape, and are left
out); bmm: the 4-d attention `matmul` nodes (batch x heads as B). For each distinct shape per GPU: its
measured rate (TFLOP/s, "model rate" is their median) over the median rate of the {NEAREST} rows of the same
family and GPU nearest to it (L1 distance in log2 B, M, N, K; "distance" is the median over shapes of the
farthest of the {NEAREST}) in the sweep file and in the large-shape file. Ratio = median over shapes. Above 1:
the model's GEMMs run faster than the kernel files' rows of similar shape, so a predictor that matches the
files forecasts that GPU's models too slow.

{agreement_md}
"""
    atomic_write_text(OUT, text)
    print(text)


if __name__ == "__main__":
    main()

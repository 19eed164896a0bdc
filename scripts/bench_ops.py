"""Benchmark: kernel predictions against the per-operator timings of real models. Writes docs/ops.md.

    python scripts/bench_ops.py                  # NVIDIA and AMD label runs (~1 min on 2 cores)
    python scripts/bench_ops.py --out /tmp/ops.md

Next to each end-to-end label JSON, the dataset keeps a CSV with one row per node of the model's FX graph
(embeddings, the first transformer layer, the head), each node timed on its own on the GPU. Those are kernels
of real-model shapes, measured the way the kernel sweeps were (one operator at a time), so they test the kernel
predictor out of its training distribution, on every GPU with labels: L4 never trained on, and the AMD GPUs
forecast by the AMD predictor (data/predictor-amd, trained on their kernel sweeps), as `predict()` does.

Matching: a `call_module` node (nn.Linear, LayerNorm, an activation module, ...) is compared with every kernel
the tracer attributes to that module path; a function or method node (matmul, softmax, add, ...) with the
kernels of its family inside its enclosing module (the last entry of the node's `nn_module_stack`), summed
per (module, family) on both sides because the two graphs split some ops differently. Nodes that launch no
kernel in our trace (views, `size`, eval-mode dropout) and (module, family) pairs with no counterpart on the
other side are left out; the table says how much of the measured time was matched. Copies are not compared
as a family: `torch.matmul` on a transposed view copies inside the timed matmul node, where our trace has a
separate copy kernel; they count in the per-GPU totals only. The prediction compared
is `isolated_ms`: the kernel as timed alone (launch overhead included), without the end-to-end calibration.
The main tables are the inference runs; the training runs' CSVs split each node's time into forward and backward
(`fw_latency`, `bw_latency`), compared in a section of their own with the training trace's forward and backward
kernels (the same matching, per phase): the only measurements of gradient kernels the dataset holds.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd

from neusight.api import load_predictor
from neusight.evaluate import find_labels, label_prediction
from neusight.predictor.model import TRAINING_GPUS
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
DATASET = REPO.parent / "shared" / "datasets" / "neusight-asplos25"

# FX function / method targets -> our kernel family; anything else launches no kernel of its own here
FUNCTION_FAMILY = {
    "matmul": "bmm", "bmm": "bmm", "baddbmm": "bmm", "linear": "linear", "addmm": "linear",
    "softmax": "softmax", "layer_norm": "layernorm",
    "add": "elementwise", "sub": "elementwise", "mul": "elementwise", "truediv": "elementwise",
    "gelu": "elementwise", "tanh": "elementwise", "pow": "elementwise", "where": "elementwise",
    "relu": "elementwise", "neg": "elementwise", "exp": "elementwise", "sqrt": "elementwise",
    "rsqrt": "elementwise", "masked_fill": "elementwise", "silu": "elementwise", "sigmoid": "elementwise",
    "contiguous": "memory", "clone": "memory", "cat": "memory",
}
FAMILIES = ("linear", "bmm", "softmax", "layernorm", "elementwise", "embedding")
_MODULE_RE = re.compile(r"\('([^']+)',\s*<class")


def _target_name(target: str) -> str:
    m = re.search(r"(?:method|function) (\w+)", target)
    return m.group(1) if m else target.split(".")[-1]


def measured_nodes(csv: Path, column: str | None = None) -> pd.DataFrame:
    """The CSV's kernel-launching nodes as (module, family or 'module', measured_ms): the time in ``column``
    (None: the node's whole time, ``latency``)."""
    df = pd.read_csv(csv)
    col = column or ("latency" if "latency" in df else "fw_latency")
    rows = []
    for _, r in df.iterrows():
        ms = float(r[col])
        if not np.isfinite(ms) or ms <= 0:
            continue
        if r["op"] == "call_module":
            rows.append((str(r["target"]), "module", ms))
        elif r["op"] in ("call_function", "call_method"):
            fam = FUNCTION_FAMILY.get(_target_name(str(r["target"])))
            stack = _MODULE_RE.findall(str(r["meta"]))
            if fam and stack:
                rows.append((stack[-1], fam, ms))
    return pd.DataFrame(rows, columns=["module", "kind", "measured_ms"])


def _layer_scaled_sum(csv: Path) -> float:
    """Sum of the CSV's node times with the first layer's nodes counted once per layer (0 if unknown)."""
    data = pd.read_json(csv.with_suffix(".json"), typ="series")
    df = pd.read_csv(csv)
    col = "latency" if "latency" in df else "fw_latency"
    first = df["meta"].astype(str).str.contains(r"(?:h|layer|layers|block)\.0['.]", regex=True)
    if "num_layer" not in data or not first.any():
        return 0.0
    if df["meta"].astype(str).str.contains(r"(?:h|layer|layers|block)\.1['.]", regex=True).any():
        return float(df[col].sum())          # the CSV already holds every layer
    return float(df.loc[~first, col].sum() + int(data["num_layer"]) * df.loc[first, col].sum())


def match(nodes: pd.DataFrame, kernels: pd.DataFrame, phase: str = "forward") -> pd.DataFrame:
    """One row per matched (module, family): measured and predicted isolated ms of the ``phase`` kernels."""
    k = kernels[kernels["phase"] == phase]
    k = k.assign(module=k["module"].astype(str))
    out = []
    mods = nodes[nodes["kind"] == "module"].groupby("module")["measured_ms"].sum()
    for mod, ms in mods.items():
        mine = k[(k["module"] == mod) | k["module"].str.startswith(mod + ".")]
        if len(mine):
            fam = mine.groupby("family")["isolated_ms"].sum().idxmax()
            out.append((mod, fam, ms, float(mine["isolated_ms"].sum()), float(mine["roofline_ms"].sum())))
    funcs = nodes[nodes["kind"] != "module"].groupby(["module", "kind"])["measured_ms"].sum()
    for (mod, fam), ms in funcs.items():
        mine = k[(k["module"] == mod) & (k["family"] == fam)]
        if len(mine):
            out.append((mod, fam, ms, float(mine["isolated_ms"].sum()), float(mine["roofline_ms"].sum())))
    return pd.DataFrame(out, columns=["module", "family", "measured_ms", "predicted_ms", "roofline_ms"])


def training_tables(cache: dict) -> tuple[str, int]:
    """Forward and backward (module, family) pairs of the training labels' per-node CSVs, per GPU and family."""
    parts = []
    runs = [r for r in find_labels(DATASET, vendors=("nvidia", "amd")) if r.mode == "training"]
    for run in runs:
        csv = Path(run.path).with_suffix(".csv")
        if not csv.is_file() or csv.stat().st_size == 0:
            continue
        kernels = label_prediction(run, graph_cache=cache, calibrated=False).kernels
        for phase, column in (("forward", "fw_latency"), ("backward", "bw_latency")):
            nodes = measured_nodes(csv, column)
            if not nodes.empty:
                parts.append(match(nodes, kernels, phase).assign(gpu=run.device, phase=phase,
                                                                 run=Path(run.path).stem))
    if not parts:
        return "(no training CSVs found)", 0
    pairs = pd.concat(parts, ignore_index=True)
    out = []
    for phase in ("forward", "backward"):
        t = summarize(pairs[pairs["phase"] == phase])
        t["family"] = pd.Categorical(t["family"], [f for f in FAMILIES if f in set(t["family"])])
        t = t.sort_values(["gpu", "family"])
        t["family"] = t["family"].astype(str)
        t.insert(1, "trained on", t["gpu"].map(lambda g: "yes" if g in load_predictor(None, g).train_devices_
                                                else "no"))
        out.append(f"### {phase.capitalize()}\n\n{md(t.drop(columns=['measured', 'predicted']))}")
    return "\n\n".join(out), int(pairs[["gpu", "run"]].drop_duplicates().shape[0])


def summarize(pairs: pd.DataFrame) -> pd.DataFrame:
    pairs = pairs[pairs["family"] != "memory"]
    p = pairs.assign(err=(pairs["predicted_ms"] - pairs["measured_ms"]) / pairs["measured_ms"] * 100,
                     roof=(pairs["roofline_ms"] - pairs["measured_ms"]).abs() / pairs["measured_ms"] * 100)
    g = p.groupby(["gpu", "family"])
    t = g.agg(pairs=("err", "size"), mape=("err", lambda e: e.abs().mean()), median=("err", "median"),
              **{"roofline mape": ("roof", "mean")},
              measured=("measured_ms", "sum"), predicted=("predicted_ms", "sum")).reset_index()
    t["time-weighted"] = (t["predicted"] - t["measured"]) / t["measured"] * 100
    return t


def md(df: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, df.columns)) + " |",
             "| " + " | ".join("---" if df[c].dtype == object else "---:" for c in df.columns) + " |"]
    for _, r in df.iterrows():
        cells = []
        for c, v in r.items():
            if isinstance(v, float):
                cells.append(f"{v:+.1f}" if c in ("median", "time-weighted") else f"{v:.1f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "ops.md"))
    args = ap.parse_args()
    t0 = time.time()
    runs = [r for r in find_labels(DATASET, vendors=("nvidia", "amd")) if r.mode == "inference"]
    cache: dict = {}
    parts, coverage, e2e, used = [], [], [], 0
    for run in runs:
        csv = Path(run.path).with_suffix(".csv")
        if not csv.is_file() or csv.stat().st_size == 0:
            continue
        nodes = measured_nodes(csv)
        if nodes.empty:
            continue
        used += 1
        pairs = match(nodes, label_prediction(run, graph_cache=cache, calibrated=False).kernels)
        parts.append(pairs.assign(gpu=run.device, run=Path(run.path).stem))
        coverage.append((run.device, pairs["measured_ms"].sum(), nodes["measured_ms"].sum(),
                         pairs["predicted_ms"].sum()))
        layer_sum = _layer_scaled_sum(csv)
        if layer_sum:
            e2e.append((run.device, Path(run.path).stem, run.measured_ms / layer_sum))
    pairs = pd.concat(parts, ignore_index=True)
    table = summarize(pairs)
    train_md, n_train = training_tables(cache)
    cov = pd.DataFrame(coverage, columns=["gpu", "matched", "all", "predicted"]).groupby("gpu").sum()
    # the predictor predict() picks for each GPU (the AMD one for AMD GPUs) says whether it was trained on it
    trained = {g: g in load_predictor(None, g).train_devices_ for g in table["gpu"].unique()}
    gpus = sorted(table["gpu"].unique(), key=lambda g: (g not in TRAINING_GPUS, not trained[g], g))
    table["gpu"] = pd.Categorical(table["gpu"], gpus)
    table["family"] = pd.Categorical(table["family"], [f for f in FAMILIES if f in set(table["family"])])
    table = table.sort_values(["gpu", "family"])
    table.insert(1, "trained on", table["gpu"].map(lambda g: "yes" if trained[g] else "no").astype(str))
    table["gpu"], table["family"] = table["gpu"].astype(str), table["family"].astype(str)
    cov = cov.reindex(gpus)
    cov_md = md(pd.DataFrame({"gpu": cov.index, "matched share of measured time %": 100 * cov["matched"] / cov["all"],
                              "time-weighted": 100 * (cov["predicted"] / cov["matched"] - 1)}))
    ratio = pd.DataFrame(e2e, columns=["gpu", "run", "ratio"]).pivot_table(index="run", columns="gpu", values="ratio")
    ratio = ratio.reindex(columns=[g for g in gpus if g in ratio.columns])
    ratio_md = md(ratio.reset_index().rename(columns={"run": "label run"}).map(
        lambda v: "" if isinstance(v, float) and np.isnan(v) else (f"{v:.2f}" if isinstance(v, float) else v)))
    allgpu = summarize(pairs.assign(gpu="all")).drop(columns="gpu")
    allgpu["family"] = allgpu["family"].astype(str)
    text = f"""# Kernels of real models: predictions against per-operator timings

Generated by `python scripts/bench_ops.py`; regenerate it, do not edit it. What is compared and how nodes are
matched: the script's docstring. Source: the per-node CSVs next to the inference labels of
`../shared/datasets/neusight-asplos25/labels` ({used} runs with a non-empty CSV, NVIDIA and AMD). Prediction:
the shipped predictor's `isolated_ms` (a kernel timed alone, launch overhead included; no end-to-end scale).
Run time: {time.time() - t0:.0f} s.

Per GPU and family: matched (module, family) pairs, MAPE, median signed error, the roofline's MAPE on the same
pairs (its bound alone, no utilization or launch overhead), and the time-weighted signed error (sum predicted /
sum measured - 1) in %. Positive = predicted too slow.

## Per GPU

{md(table.drop(columns=["measured", "predicted"]))}

## All GPUs

{md(allgpu.drop(columns=["measured", "predicted"]))}

## Per GPU, everything matched (copies included)

Share of the CSVs' measured time that was matched, and the time-weighted signed error (%) over it.

{cov_md}

## End-to-end time over the sum of per-operator times

`e2e_latency` of the label over (nodes outside the first layer + number of layers x nodes of the first layer;
the plain sum where a CSV holds every layer),
measured data only, no prediction. Below 1: the model runs faster than its operators timed one by one (launch
overheads overlap, small ops were dominated by timing overhead); above 1: slower (on the 70 W T4 and L4 a long
run holds lower clocks than a single timed operator).

{ratio_md}

## Training runs: forward and backward kernels

The per-node CSVs of the training labels ({n_train} runs: V100 and L4, MI100 and MI210; the first transformer
layer, the embeddings and the head) time each node's forward (`fw_latency`) and backward (`bw_latency`, the
gradients of its inputs and parameters; the accumulation into `.grad`, `acc_latency`, is left out) separately.
Matched as above, forward nodes with the training trace's forward kernels (dropout active), backward nodes with
its backward kernels of the same module and family: a check of the gradient kernels (input- and weight-gradient
GEMMs, the softmax, layer-norm, dropout and activation gradients), which the kernel sweeps never timed.

{train_md}
"""
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

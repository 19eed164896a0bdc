"""Tables, CNN benchmark comparison and plots of the end-to-end evaluation (``neusight-evaluate``).

Two kinds of ground truth, both read in place from ``../shared/datasets``:

1. NeuSight labels (``neusight-asplos25/labels``): one measured step per file; protocol (heads, what was timed)
   in :mod:`neusight.evaluate`, which predicts them. Here: selection, the per-GPU summary, and the tables in
   the layout of NeuSight's (rows model x seq x batch, columns GPUs, cells signed % error).
2. Public CNN benchmarks (``public-benchmarks/cnn_dle.csv``, ``cnn_lambda.csv``): ResNet in true FP32 on
   V100 and T4. Inference = forward (+ cross-entropy + top-k, negligible) at batch >= 32; training = the
   full step with SGD. TF32 / AMP / FP16 rows are outside issue 4's scope: forecast in sections of their own
   (TF32 as PyTorch runs FP32 convolutions on Ampere and later, AMP under an emulated torch.autocast, FP16 as a
   pure FP16 model), never fitted to.

Error everywhere: ``(predicted - measured) / measured x 100`` (signed; "abs" = its absolute value).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from neusight.errors import DataError, InputError

log = logging.getLogger(__name__)

__all__ = ["CNN_AMP", "CNN_DTYPES", "CNN_GPUS", "CNN_HALF_GPUS", "CNN_TF32", "CNN_TF32_GPUS", "HALF_PRECISIONS",
           "TF32_PRECISIONS", "cnn_device_key", "cnn_summary", "error_table", "gpu_order", "label_frame",
           "load_cnn_benchmarks", "markdown_table", "per_gpu_summary", "precision_summary", "predict_cnn", "render_markdown", "scatter_plot",
           "select_labels", "write_doc_section"]

# GPU names of the public benchmark CSVs -> device keys. NB: the DeepLearningExamples tables were measured
# on DGX-1 (V100 SXM2). Lambda's "V100-16GB" is Lambda Cloud's V100 instance (SXM2); "V100-32GB" (era v0, a
# Lambda server) is taken as SXM2 too: an assumption (a PCIe V100 clocks ~10 % lower).
# The Turing cards of Lambda's FP32 table (TITAN RTX, Quadro RTX 5000/6000/8000) run true FP32 as well; none is
# a training GPU of either predictor, and they are reported apart from the acceptance scope of issue 4.
CNN_GPUS = {"V100-SXM2-16GB": "v100-sxm2-16gb", "V100-SXM2-32GB": "v100-sxm2-32gb", "T4-16GB": "t4",
            "T4": "t4", "V100-16GB": "v100-sxm2-16gb", "V100-32GB": "v100-sxm2-32gb",
            "TITAN RTX": "titan-rtx", "Quadro RTX 5000": "quadro-rtx-5000", "Quadro RTX 6000": "quadro-rtx-6000",
            "Quadro RTX 8000": "quadro-rtx-8000"}
# The Ampere and Ada cards (with a spec file) of the benchmarks: their "float" rows are TF32 (PyTorch runs FP32
# convolutions on TF32 tensor cores there by default), their AMP / FP16 rows FP16 tensor cores.
CNN_TF32_GPUS = {"A10": "a10", "A40": "a40", "A100-PCIe-40GB": "a100-pcie-40gb", "A100-SXM4-40GB": "a100-sxm4-40gb",
                 "RTX 3080": "rtx-3080", "RTX 3090": "rtx-3090", "RTX 4090": "rtx-4090", "RTX A6000": "rtx-a6000",
                 "RTX 6000 Ada": "rtx-6000-ada"}
CNN_HALF_GPUS = {**CNN_GPUS, **CNN_TF32_GPUS}
# Any other GPU name of the benchmark CSVs (a newer table, a card the tables above do not list) is looked up in
# the device library (neusight.devices.load_device: key or alias, ignoring case, spaces and dashes) and kept when
# its precision fits the card (cnn_device_key).
REASON_NO_SPEC = "GPU without a device spec"
REASON_PRECISION = "precision the GPU does not run that way (TF32 on a card without TF32, FP32 label on a TF32 card)"
CNN_ACCEPTANCE_GPUS = ("v100-sxm2-16gb", "v100-sxm2-32gb", "t4")   # issue 4: V100 and T4
SCOPE_ACCEPTANCE, SCOPE_OTHER = "V100, T4 (issue 4)", "other FP32 GPUs"
CNN_PRECISION = "fp32"          # the only precision in issue 4's scope
# benchmark precision -> the dtype a row's model is traced in. FP16 rows are pure FP16 (GEMMs and convolutions at
# the dense FP16 tensor peak, every tensor half the bytes); AMP rows are the FP32 model under torch.autocast(float16)
# (CNN_AMP: neusight.graph.amp, with GradScaler in training). TF32 rows are FP32 traces whose convolutions run on
# TF32 tensor cores (neusight.api's tf32="default", what PyTorch does by default); FP32 rows are true FP32.
CNN_DTYPES = {"fp32": "float32", "tf32": "float32", "amp": "float32", "fp16": "float16"}
CNN_MEMORY_FORMATS = {"nchw": "contiguous", "nhwc": "channels_last"}   # benchmark layouts -> trace's memory_format
CNN_AMP = {"amp": "float16"}     # benchmark precision -> trace's amp= (every other precision: none)
HALF_PRECISIONS = ("amp", "fp16")
TF32_PRECISIONS = ("tf32",)
CNN_TF32 = {"tf32": "default"}   # benchmark precision -> predict's tf32= (every other precision: "off")
CNN_IMAGE_SIZE = 224            # rows that do not state theirs (Lambda's ResNet-50 runs)


# ---------------------------------------------------------------------------------------------------------
# NeuSight labels


def select_labels(runs: Sequence[Any], *, gpus: Sequence[str] | None = None, models: Sequence[str] | None = None,
                  modes: Sequence[str] | None = None, max_runs: int | None = None) -> list[Any]:
    """Filter :class:`neusight.evaluate.LabelRun` objects.

    ``gpus``: device keys, aliases or label folder names (``Tesla_T4``); ``models``: label model names
    (``gpt2_large``); ``modes``: ``inference`` / ``training``; ``max_runs``: the first n after filtering.
    """
    from neusight.devices import load_device

    out = list(runs)
    if gpus:
        keys = {load_device(str(g).replace("_", " ")).key for g in gpus}
        out = [r for r in out if r.device in keys]
    if models:
        known = {r.model for r in runs}
        unknown = sorted(set(models) - known)
        if unknown:
            raise InputError(f"labels.models={list(models)}: {unknown} not among the label models {sorted(known)}")
        out = [r for r in out if r.model in set(models)]
    if modes:
        bad = sorted(set(modes) - {"inference", "training"})
        if bad:
            raise InputError(f"labels.modes={list(modes)}: {bad} is not a mode; use inference and/or training")
        out = [r for r in out if r.mode in set(modes)]
    if max_runs is not None:
        if max_runs < 1:
            raise InputError(f"labels.max_runs={max_runs} selects nothing; use a positive number or null for all")
        out = out[:max_runs]
    if not out:
        raise InputError("the label filters (labels.gpus / models / modes) leave no run to evaluate")
    return out


def label_frame(results: pd.DataFrame) -> pd.DataFrame:
    """The results CSV of :func:`neusight.evaluate.evaluate_labels`, one row per run, columns in reading order."""
    df = results.rename(columns={"device": "gpu", "gpu_dir": "gpu_name", "seq_len": "seq", "batch_size": "batch",
                                 "roofline_ms": "roofline_predicted_ms"})
    if "option" in df:   # a run with an option (torch.compile: "fusion") is its own mode, e.g. "inference+fusion"
        df["mode"] = df["mode"].where(df["option"].isna(), df["mode"] + "+" + df["option"].astype(str))
    cols = ["gpu", "model", "mode", "seq", "batch", "measured_ms", "predicted_ms", "error_pct",
            "roofline_predicted_ms", "roofline_error_pct", "eager_error_pct", "measured_fw_ms", "measured_bw_ms",
            "predicted_fw_ms", "predicted_bw_ms", "gpu_name", "config", "path"]
    return df[[c for c in cols if c in df.columns]]


def gpu_order(gpus: Sequence[str], trained_on: Sequence[str] = ()) -> list[str]:
    """Training GPUs first, then the unseen ones; each group from the slowest to the fastest FP32 peak."""
    from neusight.devices import load_device

    def key(g: str) -> tuple[bool, float, str]:
        return g not in trained_on, load_device(g).fp32_tflops, g

    return sorted(dict.fromkeys(gpus), key=key)


def error_table(df: pd.DataFrame, mode: str, column: str = "error_pct", gpus: Sequence[str] | None = None) -> pd.DataFrame:
    """NeuSight's layout: rows (model, seq, batch), columns GPUs, cells the signed % error of ``column``."""
    sub = df[df["mode"] == mode]
    if sub.empty:
        return pd.DataFrame()
    t = sub.pivot_table(index=["model", "seq", "batch"], columns="gpu", values=column, aggfunc="first")
    cols = [g for g in (gpus or t.columns) if g in t.columns]
    return t[cols].sort_index()


def per_gpu_summary(df: pd.DataFrame, trained_on: Sequence[str] = (),
                    targets: tuple[float, float] | None = None) -> pd.DataFrame:
    """Per GPU and mode: runs, mean and worst absolute % error of NeuSight and of the roofline baseline, and
    with ``targets`` = (mean % on training GPUs, mean % on unseen GPUs) whether the mean meets its target and
    beats the roofline's."""
    rows = []
    for (gpu, mode), g in df.groupby(["gpu", "mode"]):
        e, r = g["error_pct"].abs(), g["roofline_error_pct"].abs()
        row = {"gpu": gpu, "mode": mode, "in_training_set": gpu in trained_on, "runs": len(g),
               "mean_abs_error_pct": e.mean(), "worst_abs_error_pct": e.max(),
               "roofline_mean_abs_error_pct": r.mean(), "roofline_worst_abs_error_pct": r.max()}
        if targets is not None:
            row["target_pct"] = float(targets[0] if gpu in trained_on else targets[1])
            row["meets_target"] = bool(e.mean() <= row["target_pct"])
            row["beats_roofline"] = bool(e.mean() < r.mean())
        rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    order = {g: i for i, g in enumerate(gpu_order(out["gpu"].unique(), trained_on))}
    return out.sort_values(["mode", "gpu"], key=lambda s: s.map(order) if s.name == "gpu" else s).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------
# GPU against GPU: what a user choosing hardware asks ("H100 or A100, and by how much?")

LABEL_CONFIG = ("model", "mode", "seq", "batch")
CNN_CONFIG = ("source_name", "model", "mode", "precision", "batch", "image_size", "measure", "version")
# a pair whose measured speed-up is below this is a tie for "which GPU is faster"
CLEAR_SPEEDUP = 1.1


def speedup_frame(df: pd.DataFrame, config: Sequence[str] = LABEL_CONFIG, trained_on: Sequence[str] = ()) -> pd.DataFrame:
    """Every pair of GPUs that ran the same configuration (the ``config`` columns present in ``df``): the
    faster GPU's measured speed-up over the slower one, the forecast speed-up (NeuSight: ``predicted_ms``;
    roofline: ``roofline_predicted_ms``) and its % error, (forecast / measured - 1) x 100. A per-GPU error
    that is the same on both GPUs cancels here; what is left is what a comparison of the two gets wrong."""
    keys = [c for c in config if c in df.columns]
    cols = ["model", "mode", "fast_gpu", "slow_gpu", "measured_speedup", "predicted_speedup", "error_pct",
            "roofline_speedup", "roofline_error_pct", "unseen_gpu"]
    rows = []
    for cfg, g in df.drop_duplicates([*keys, "gpu"]).groupby(keys, dropna=False, sort=True):
        g = g.sort_values("measured_ms", ascending=False)    # slowest first
        recs = g.to_dict("records")
        for i, slow in enumerate(recs):
            for fast in recs[i + 1:]:
                m = slow["measured_ms"] / fast["measured_ms"]
                p = slow["predicted_ms"] / fast["predicted_ms"]
                r = slow["roofline_predicted_ms"] / fast["roofline_predicted_ms"]
                rows.append({**dict(zip(keys, cfg if isinstance(cfg, tuple) else (cfg,))),
                             "fast_gpu": fast["gpu"], "slow_gpu": slow["gpu"], "measured_speedup": m,
                             "predicted_speedup": p, "error_pct": (p / m - 1) * 100,
                             "roofline_speedup": r, "roofline_error_pct": (r / m - 1) * 100,
                             "unseen_gpu": not (fast["gpu"] in trained_on and slow["gpu"] in trained_on)})
    out = pd.DataFrame(rows, columns=list(dict.fromkeys([*keys, *cols])))
    return out


def speedup_summary(sp: pd.DataFrame) -> pd.DataFrame:
    """Per mode and pair of GPUs (and per mode over all pairs): configurations, measured speed-up range, mean and
    worst absolute % error of the forecast speed-up, the roofline's mean, and how often the forecast names the
    faster GPU among the pairs whose measured speed-up is at least CLEAR_SPEEDUP."""
    rows = []
    if sp.empty:
        return pd.DataFrame()

    def row(mode, pair, g):
        clear = g[g["measured_speedup"] >= CLEAR_SPEEDUP]
        return {"mode": mode, "faster / slower GPU": pair, "configs": len(g),
                "measured speed-up": f"{g['measured_speedup'].min():.2f}-{g['measured_speedup'].max():.2f}x"
                if len(g) > 1 else f"{g['measured_speedup'].iloc[0]:.2f}x",
                "mean abs err %": g["error_pct"].abs().mean(), "worst abs err %": g["error_pct"].abs().max(),
                "roofline mean abs err %": g["roofline_error_pct"].abs().mean(),
                "faster GPU named": f"{int((clear['predicted_speedup'] > 1).sum())} of {len(clear)}"}

    for mode, gm in sp.groupby("mode", sort=True):
        for (fast, slow), g in gm.groupby(["fast_gpu", "slow_gpu"], sort=True):
            rows.append(row(mode, f"{fast} / {slow}", g))
        rows.append(row(mode, "all pairs", gm))
    return pd.DataFrame(rows)


def _speedup_md(sp: pd.DataFrame, what: str) -> str:
    if sp.empty:
        return ""
    clear = sp[sp["measured_speedup"] >= CLEAR_SPEEDUP]
    named = int((clear["predicted_speedup"] > 1).sum())
    unseen = sp[sp["unseen_gpu"]]
    text = (f"{len(sp)} pairs; mean absolute error of the forecast speed-up {sp['error_pct'].abs().mean():.1f} % "
            f"(roofline {sp['roofline_error_pct'].abs().mean():.1f} %)")
    if len(unseen):
        text += (f", {unseen['error_pct'].abs().mean():.1f} % over the {len(unseen)} pairs with a GPU the predictor "
                 "was not trained on")
    text += f"; the faster GPU named in {named} of the {len(clear)} pairs at least {CLEAR_SPEEDUP:g}x apart."
    return f"\n### {what}\n\n{text}\n\n" + markdown_table(speedup_summary(sp), index=False)


# ---------------------------------------------------------------------------------------------------------
# public CNN benchmarks


def _container_rank(c: Any) -> tuple[int, str]:
    """``pytorch-21.03`` > ``pytorch-20.12`` > ... > unstated."""
    c = str(c)
    return (1, c) if re.match(r"pytorch-\d", c) else (0, c)


def _skip(df: pd.DataFrame, reason: str) -> pd.DataFrame:
    return df.assign(reason=reason)


def cnn_device_key(gpu_name: str, precision: str) -> tuple[str | None, str]:
    """The device key a benchmark row of ``gpu_name`` in ``precision`` is forecast on, or None and the reason.

    The tables above first (they hold the names that need an assumption, e.g. Lambda's "V100-16GB"), then the
    device library. A library card is kept for FP32 rows only if it runs true FP32 (no TF32 tensor cores, or an
    AMD card: cuDNN's TF32 default is NVIDIA's), for TF32 rows only if it has TF32 tensor cores; half-precision
    rows run on any card.
    """
    from neusight.devices import load_device
    from neusight.errors import DeviceError

    half, tf32 = precision in HALF_PRECISIONS, precision in TF32_PRECISIONS
    table = CNN_HALF_GPUS if half else CNN_TF32_GPUS if tf32 else CNN_GPUS
    if gpu_name in table:
        return table[gpu_name], ""
    if gpu_name in CNN_HALF_GPUS:          # a listed card, in a precision its table does not hold
        return None, REASON_PRECISION
    try:
        dev = load_device(str(gpu_name))
    except DeviceError:
        return None, REASON_NO_SPEC
    has_tf32 = dev.vendor == "nvidia" and bool(dev.tf32_tensor_tflops)
    if (tf32 and not has_tf32) or (not half and not tf32 and has_tf32):
        return None, REASON_PRECISION
    return dev.key, ""


def load_cnn_benchmarks(folder: str | os.PathLike, *, min_batch: int = 32, models: Sequence[str] | None = None,
                        precisions: Sequence[str] = (CNN_PRECISION,), by_layout: bool = False
                        ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rows of ``cnn_dle.csv`` and ``cnn_lambda.csv`` in scope, and the skipped rows with a reason.

    In scope: ``precisions`` (default FP32, issue 4's; any of :data:`CNN_DTYPES`); GPUs in :data:`CNN_GPUS`
    (half-precision rows: :data:`CNN_HALF_GPUS`, TF32 rows: :data:`CNN_TF32_GPUS`), else any GPU of the device
    library whose precision fits (:func:`cnn_device_key`); column ``scope``: the V100 and T4 of issue 4's
    acceptance, or the others; models with a preset (``models``, default every CNN preset: ResNet, ResNeXt, SE-ResNeXt,
    EfficientNet); DLE inference at ``batch >= min_batch`` (smaller batches are host-bound), one row per
    (GPU, model, precision, batch): the ``in_head`` row when there is one, else the newest container, never a
    SUSPECT row;
    DLE training (step = batch / throughput); Lambda training (``step_ms``). ``by_layout``: one DLE row per
    memory format as well (for :func:`layout_pairs`).

    Returns
    -------
    selected : DataFrame
        ``source_name, gpu_name, gpu, scope, model, mode, precision, dtype, amp, batch, image_size, memory_format,
        measured_ms, measure, in_head, version, source``.
    skipped : DataFrame
        ``source_name, gpu_name, model, mode, precision, batch, reason``.
    """
    from neusight.graph.models import CNN_PRESETS

    folder = Path(folder)
    files = {"DeepLearningExamples": folder / "cnn_dle.csv", "Lambda": folder / "cnn_lambda.csv"}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise DataError(f"{', '.join(missing)} not found; pass the public-benchmarks folder "
                        "(../shared/datasets/public-benchmarks) as cnn.dir")
    presets = set(models) if models else set(CNN_PRESETS)
    if unknown := sorted(set(precisions) - set(CNN_DTYPES)):
        raise InputError(f"CNN precisions {unknown} are not forecast; choose among {sorted(CNN_DTYPES)}")
    keep_cols = ["source_name", "gpu_name", "model", "mode", "precision", "batch"]

    dle = pd.read_csv(files["DeepLearningExamples"]).rename(columns={"gpu": "gpu_name", "batch_size": "batch"})
    dle["source_name"] = "DeepLearningExamples"
    dle["version"] = dle["container"].astype(str)
    dle["in_head"] = dle["in_head"].astype(bool)
    dle["image_size"] = dle["image_size"].fillna(CNN_IMAGE_SIZE).astype(int)
    lam = pd.read_csv(files["Lambda"]).rename(columns={"gpu": "gpu_name", "batch_size": "batch"})
    lam["source_name"] = "Lambda"
    lam["version"] = "era " + lam["era"].astype(str) + ", " + lam["data_backend"].astype(str)
    lam["in_head"] = True
    lam["note"] = lam["note"].fillna("")
    # the layout the benchmark ran its CNN in: DLE's memory_format column (its --memory-format), Lambda's raw-log note
    # (its DLE fork's default NCHW where the note does not say)
    dle["memory_format"] = dle["memory_format"].map(CNN_MEMORY_FORMATS).fillna("contiguous")
    lam["memory_format"] = (lam["note"].str.extract(r"memory_format=(\w+)", expand=False).map(CNN_MEMORY_FORMATS)
                            .fillna("contiguous"))

    skipped, kept = [], []
    for df in (dle, lam):
        modelled = df["precision"].isin(list(CNN_DTYPES))
        skipped.append(_skip(df[~modelled], "precision not modelled: out of scope"))
        other = modelled & ~df["precision"].isin(list(precisions))
        skipped.append(_skip(df[other], "TF32 / AMP / FP16: sections of their own" if set(precisions) == {CNN_PRECISION}
                             else f"precision not in this selection ({', '.join(precisions)})"))
        df = df[modelled & ~other]
        found = [cnn_device_key(g, p) for g, p in zip(df["gpu_name"], df["precision"])]
        df = df.assign(gpu=[k for k, _ in found], _why=[why for _, why in found])
        no_gpu = df["gpu"].isna()
        laptop = no_gpu & df["gpu_name"].str.contains("laptop", case=False)
        skipped.append(_skip(df[laptop], "laptop part: clocks and power set by each laptop maker, no device spec"))
        for why in (REASON_NO_SPEC, REASON_PRECISION):
            skipped.append(_skip(df[no_gpu & ~laptop & (df["_why"] == why)], why))
        df = df.drop(columns="_why")
        df = df[~no_gpu]
        no_model = ~df["model"].isin(presets)
        skipped.append(_skip(df[no_model], "model without a preset"))
        df = df[~no_model]
        suspect = df["note"].astype(str).str.contains("SUSPECT")
        skipped.append(_skip(df[suspect], "SUSPECT in the source note"))
        df = df[~suspect]
        small = (df["mode"] == "inference") & (df["batch"] < min_batch)
        skipped.append(_skip(df[small], f"inference batch < {min_batch} (host-bound; FP32 rows: the small-batch section)"))
        kept.append(df[~small])

    dle, lam = kept
    # one DLE row per (GPU, model, mode, precision, batch): the README's current (in_head) row, else the newest
    # container (whatever its layout: the superseded rows of the other layout are compared by layout_pairs)
    ranks = [_container_rank(c) for c in dle["container"]]
    dle = dle.assign(_stated=[r[0] for r in ranks], _container=[r[1] for r in ranks])
    dle = dle.sort_values(["in_head", "_stated", "_container"], ascending=False, kind="stable")
    dup = dle.duplicated(["gpu_name", "model", "mode", "precision", "batch", *(["memory_format"] if by_layout else [])],
                         keep="first")
    skipped.append(_skip(dle[dup], "superseded by a newer or in_head row of the same GPU, model, precision and batch"))
    dle = dle[~dup].drop(columns=["_stated", "_container"])
    # inference: the table's average latency per batch (p50 in the 2019 tables without an average);
    # training: throughput only, step = batch / (images/s)
    inf = dle["mode"] == "inference"
    lat = dle["latency_avg_ms"].fillna(dle["latency_p50_ms"])
    dle["measured_ms"] = np.where(inf, lat, dle["batch"] / dle["throughput_img_s"] * 1000)
    dle["measure"] = np.where(inf, "latency_avg_ms", "batch / throughput_img_s")
    lam["measured_ms"] = lam["step_ms"]
    lam["image_size"] = CNN_IMAGE_SIZE
    lam["measure"] = "step_ms"

    cols = ["source_name", "gpu_name", "gpu", "model", "mode", "precision", "batch", "image_size", "memory_format",
            "measured_ms", "measure", "in_head", "version", "source"]
    sel = pd.concat([dle[cols], lam[cols]], ignore_index=True)
    sel.insert(3, "scope", np.where(sel["gpu"].isin(CNN_ACCEPTANCE_GPUS), SCOPE_ACCEPTANCE, SCOPE_OTHER))
    sel.insert(sel.columns.get_loc("precision") + 1, "dtype", sel["precision"].map(CNN_DTYPES))
    sel.insert(sel.columns.get_loc("dtype") + 1, "amp", sel["precision"].map(CNN_AMP))
    sel = sel.sort_values(["source_name", "mode", "gpu", "model", "batch"]).reset_index(drop=True)
    skip = pd.concat([s[[*keep_cols, "reason"]] for s in skipped if not s.empty], ignore_index=True)
    return sel, skip


def predict_cnn(rows: pd.DataFrame, predictor: Any = None, *, optimizer: str = "sgd",
                tf32: str | None = None) -> pd.DataFrame:
    """Predict every selected CNN row: what ``neusight.predict(model, gpu, batch_size=b, image_size=s,
    mode=m, optimizer="sgd", dtype=d, amp=a, tf32=t, memory_format=f)`` returns (``s`` = the row's ``image_size``,
    ``d`` its ``dtype``, default float32, ``a`` its ``amp`` (none where missing), ``t`` :data:`CNN_TF32` of its
    precision, else "off", ``f`` its ``memory_format``, default "contiguous"), with each (model, batch, mode, image
    size, dtype, amp, memory format) traced once and shared by the GPUs. ``tf32`` overrides ``t`` for every row."""
    from neusight.api import host_bound_note, predict_graph
    from neusight.graph.tracer import trace

    graphs: dict[tuple, Any] = {}
    out = []
    for r in rows.itertuples(index=False):
        size = int(getattr(r, "image_size", CNN_IMAGE_SIZE))
        dtype = str(getattr(r, "dtype", "float32"))
        amp = getattr(r, "amp", None)
        amp = None if pd.isna(amp) else str(amp)
        layout = str(getattr(r, "memory_format", "contiguous"))
        key = (r.model, int(r.batch), r.mode, size, dtype, amp, layout)
        if key not in graphs:
            graphs[key] = trace(r.model, batch_size=int(r.batch), mode=r.mode, image_size=size,
                                optimizer=optimizer if r.mode == "training" else None, dtype=dtype, amp=amp,
                                memory_format=layout)
        mode = tf32 if tf32 is not None else CNN_TF32.get(str(getattr(r, "precision", "")), "off")
        p = predict_graph(graphs[key], r.gpu, predictor, tf32=mode)
        roof = float(p.kernels["roofline_ms"].sum())
        out.append({"predicted_ms": p.latency_ms, "roofline_predicted_ms": roof,
                    "host_bound_note": host_bound_note(p.latency_ms, len(p.kernels)) is not None})
    res = rows.reset_index(drop=True).join(pd.DataFrame(out))
    res["error_pct"] = (res["predicted_ms"] - res["measured_ms"]) / res["measured_ms"] * 100
    res["roofline_error_pct"] = (res["roofline_predicted_ms"] - res["measured_ms"]) / res["measured_ms"] * 100
    return res


# a run that a source may have timed in both layouts (layout_pairs)
LAYOUT_PAIR_KEY = ["source_name", "gpu", "model", "mode", "precision", "batch", "image_size"]


def layout_pairs(res: pd.DataFrame) -> pd.DataFrame:
    """The runs a source timed in both layouts (same :data:`LAYOUT_PAIR_KEY`; NCHW and NHWC), from
    :func:`predict_cnn` results of ``load_cnn_benchmarks(..., by_layout=True)``: the measured slow-down of NCHW
    over NHWC against the forecast one."""
    key = LAYOUT_PAIR_KEY
    rows = []
    for keys, g in res.groupby(key, sort=True):
        nchw, nhwc = g[g["memory_format"] == "contiguous"], g[g["memory_format"] == "channels_last"]
        if nchw.empty or nhwc.empty:
            continue
        a, b = nchw.iloc[0], nhwc.iloc[0]
        measured, forecast_ratio = a["measured_ms"] / b["measured_ms"], a["predicted_ms"] / b["predicted_ms"]
        rows.append({**dict(zip(key, keys)), "nchw_ms": a["measured_ms"], "nhwc_ms": b["measured_ms"],
                     "nchw_version": a["version"], "nhwc_version": b["version"], "measured_ratio": measured,
                     "forecast_ratio": forecast_ratio, "ratio_error_pct": (forecast_ratio / measured - 1) * 100})
    return pd.DataFrame(rows, columns=[*key, "nchw_ms", "nhwc_ms", "nchw_version", "nhwc_version", "measured_ratio",
                                       "forecast_ratio", "ratio_error_pct"])


def cnn_summary(res: pd.DataFrame) -> pd.DataFrame:
    """Per GPU scope, source and mode (and "all" modes): rows, mean and worst absolute % error of NeuSight and
    of the roofline baseline. The acceptance scope (V100, T4) comes first."""
    by = ["scope", "source_name"]
    rows = []
    for keys, g in [*res.groupby([*by, "mode"]), *(((*k, "all"), g) for k, g in res.groupby(by))]:
        rows.append({"scope": keys[0], "source": keys[1], "mode": keys[2], "rows": len(g),
                     "gpus": ", ".join(sorted(g["gpu"].unique())),
                     "mean_abs_error_pct": g["error_pct"].abs().mean(), "worst_abs_error_pct": g["error_pct"].abs().max(),
                     "roofline_mean_abs_error_pct": g["roofline_error_pct"].abs().mean()})
    out = pd.DataFrame(rows)
    first = (out["scope"] != SCOPE_ACCEPTANCE).astype(int)
    return out.assign(_first=first).sort_values(["_first", "source", "mode"]).drop(columns="_first").reset_index(drop=True)


def precision_summary(res: pd.DataFrame) -> pd.DataFrame:
    """Per source, precision and mode (and "all" modes): rows, GPUs, mean signed, mean and worst absolute %
    error and the roofline's mean absolute error (for the half-precision rows, which have no acceptance scope)."""
    rows = []
    by = ["source_name", "precision"]
    for keys, g in [*res.groupby([*by, "mode"]), *(((*k, "all"), g) for k, g in res.groupby(by))]:
        rows.append({"source": keys[0], "precision": keys[1], "mode": keys[2], "rows": len(g),
                     "gpus": ", ".join(sorted(g["gpu"].unique())), "mean err %": g["error_pct"].mean(),
                     "mean abs err %": g["error_pct"].abs().mean(), "worst abs err %": g["error_pct"].abs().max(),
                     "roofline mean abs err %": g["roofline_error_pct"].abs().mean(),
                     **({"as FP32 mean abs err %": g["fp32_error_pct"].abs().mean()} if "fp32_error_pct" in g else {}),
                     **({"as pure FP16 mean abs err %": g["fp16_error_pct"].abs().mean()} if "fp16_error_pct" in g
                        else {}),
                     **({"as NHWC mean abs err %": g["nhwc_error_pct"].abs().mean()} if "nhwc_error_pct" in g
                        else {})})
    return pd.DataFrame(rows).sort_values(["source", "precision", "mode"]).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------
# markdown


def _cell(v: Any, signed: bool) -> str:
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return ""
        return f"{v:+.1f}" if signed else f"{v:,.1f}"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    return str(v)


def markdown_table(df: pd.DataFrame, *, index: bool = True, signed: bool | Sequence[str] = False) -> str:
    """A GitHub markdown table, floats with one decimal; ``signed`` (True or some column names) puts a sign on
    the floats of those columns."""
    if df.empty:
        return "(none)\n"
    d = df.reset_index() if index else df
    header = [str(c).replace("|", "/") for c in d.columns]
    sign = [signed is True or (not isinstance(signed, bool) and c in signed) for c in d.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in d.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v, sg).replace("|", "/") for v, sg in zip(row, sign)) + " |")
    return "\n".join(lines) + "\n"


def _summary_md(summary: pd.DataFrame) -> str:
    if summary.empty:
        return "(none)\n"
    t = summary.rename(columns={"in_training_set": "predictor trained on it", "mean_abs_error_pct": "mean abs err %",
                                "worst_abs_error_pct": "worst abs err %",
                                "roofline_mean_abs_error_pct": "roofline mean abs err %",
                                "roofline_worst_abs_error_pct": "roofline worst abs err %",
                                "target_pct": "target mean %", "meets_target": "meets target",
                                "beats_roofline": "beats roofline"})
    return markdown_table(t, index=False)


def render_markdown(labels: pd.DataFrame, trained_on: Sequence[str], *, cnn: pd.DataFrame | None = None,
                    cnn_skipped: pd.DataFrame | None = None, header: str = "", footer: str = "",
                    targets: tuple[float, float] | None = None, cnn_half: pd.DataFrame | None = None,
                    cnn_small: pd.DataFrame | None = None, cnn_tf32: pd.DataFrame | None = None,
                    cnn_layouts: pd.DataFrame | None = None) -> str:
    """The evaluation report: per-GPU summary, NeuSight-layout error tables (NeuSight and roofline), CNNs in
    FP32 and, apart, in TF32, in half precision and at small inference batches."""
    gpus = gpu_order(labels["gpu"].unique(), trained_on) if not labels.empty else []
    parts = [header.rstrip() + "\n\n" if header else ""]
    parts.append("## NeuSight labels: per GPU\n\nMean and worst absolute % error per GPU, inference and training "
                 "separately, next to the roofline baseline (the same kernels at 100 % utilization, no launch "
                 "floor).\n\n")
    if targets is not None:
        parts[-1] += (f"Targets (issue 4): mean <= {targets[0]:g} % on the predictor's training GPUs, <= {targets[1]:g} % "
                      "on unseen GPUs, and below the roofline's.\n\n")
    parts.append(_summary_md(per_gpu_summary(labels, trained_on, targets)))
    modes = ["inference", "training"] + sorted(set(labels["mode"]) - {"inference", "training"}) if not labels.empty else []
    columns = [("error_pct", "NeuSight (this predictor)"), ("roofline_error_pct", "Roofline baseline"),
               ("eager_error_pct", "Without the fusion model (the same runs as eager kernels)")]
    for column, title in columns:
        for mode in modes:
            if column not in labels:
                continue
            t = error_table(labels, mode, column, gpus)
            if t.empty:
                continue
            parts.append(f"\n### {title}: {mode}, signed % error\n\nRows: model, sequence length, batch; columns: "
                         "GPUs (training GPUs of the predictor first); cell: (predicted - measured) / measured "
                         "x 100.\n\n")
            parts.append(markdown_table(t, signed=True))
    sp_labels = speedup_frame(labels, LABEL_CONFIG, trained_on) if not labels.empty else pd.DataFrame()
    sp_cnn = speedup_frame(cnn, CNN_CONFIG, trained_on) if cnn is not None and not cnn.empty else pd.DataFrame()
    if not sp_labels.empty or not sp_cnn.empty:
        parts.append("\n## GPU against GPU: forecast speed-ups\n\nThe question of a user choosing hardware: how "
                     "much faster is one GPU than another for this run? For every configuration measured on two "
                     "GPUs (same model, mode, sequence length or image size and batch; for the CNN rows also the "
                     "same source, precision and software version), the faster GPU's measured speed-up over the "
                     "slower one against the forecast one: error = (forecast / measured speed-up - 1) x 100, so an "
                     "error the forecast makes alike on both GPUs cancels. \"faster GPU named\": of the pairs "
                     f"measured at least {CLEAR_SPEEDUP:g}x apart, how many the forecast orders right.\n")
        parts.append(_speedup_md(sp_labels, "NeuSight labels"))
        parts.append(_speedup_md(sp_cnn, "CNNs: public benchmarks (FP32)"))
    if cnn is not None and not cnn.empty:
        parts.append("\n## CNNs: public benchmarks (FP32)\n\nMean absolute % error per GPU scope and source. "
                     "DLE inference: forward + loss + top-k, average latency per batch; training: the full SGD step "
                     f"(DLE: batch / throughput on DGX-1; Lambda: `step_ms`). Scope \"{SCOPE_ACCEPTANCE}\" is issue 4's "
                     f"acceptance; \"{SCOPE_OTHER}\": Lambda's Turing cards (TITAN RTX, Quadro RTX), none of which "
                     "the predictor was trained on.\n\n")
        parts.append(markdown_table(cnn_summary(cnn).rename(columns={
            "mean_abs_error_pct": "mean abs err %", "worst_abs_error_pct": "worst abs err %",
            "roofline_mean_abs_error_pct": "roofline mean abs err %"}), index=False))
        per_model = _per_model(cnn)
        parts.append("\nPer model (all sources and GPUs; EfficientNets' depthwise convolutions have no kernel "
                     "measurement and are forecast at the memory-bound model's speed):\n\n"
                     + markdown_table(per_model, index=False, signed=("mean err %",)))
        cols = ["source_name", "gpu", "model", "mode", "batch", *(["image_size"] if "image_size" in cnn else []),
                "measured_ms", "predicted_ms", "error_pct", "roofline_error_pct", "version"]
        rows = cnn[cols].rename(columns={"source_name": "source", "error_pct": "err %",
                                         "roofline_error_pct": "roofline err %", "image_size": "image"})
        parts.append("\nEvery row in scope (signed % error):\n\n"
                     + markdown_table(rows, index=False, signed=("err %", "roofline err %")))
        if cnn_skipped is not None and not cnn_skipped.empty:
            counts = cnn_skipped.groupby(["source_name", "reason"]).size().rename("rows").reset_index()
            parts.append("\nRows not evaluated, by reason (never fitted to):\n\n" + markdown_table(counts, index=False))
    if cnn_tf32 is not None and not cnn_tf32.empty:
        parts.append(_tf32_md(cnn_tf32))
    if cnn_half is not None and not cnn_half.empty:
        parts.append(_half_md(cnn_half))
    if cnn_layouts is not None and not cnn_layouts.empty:
        parts.append(_layout_md(cnn_layouts))
    if cnn_small is not None and not cnn_small.empty:
        parts.append(_small_md(cnn_small))
    if footer:
        parts.append("\n" + footer.rstrip() + "\n")
    return "".join(parts)


def _per_model(res: pd.DataFrame) -> pd.DataFrame:
    return (res.groupby(["model", "mode"])
            .agg(rows=("error_pct", "size"), gpus=("gpu", lambda g: ", ".join(sorted(set(g)))),
                 mean_signed=("error_pct", "mean"), mean_abs=("error_pct", lambda e: e.abs().mean()),
                 roofline_mean_abs=("roofline_error_pct", lambda e: e.abs().mean()))
            .reset_index().rename(columns={"mean_signed": "mean err %", "mean_abs": "mean abs err %",
                                           "roofline_mean_abs": "roofline mean abs err %"}))


def _small_md(res: pd.DataFrame) -> str:
    from neusight.api import HOST_BOUND_US

    cols = ["source_name", "gpu", "model", "batch", "measured_ms", "predicted_ms", "error_pct", "host_bound_note",
            "version"]
    rows = res[cols].rename(columns={"source_name": "source", "error_pct": "err %",
                                     "host_bound_note": "host-bound note"})
    noted = res["host_bound_note"].astype(bool)
    line = (f"Rows with the note: mean abs err {res.loc[noted, 'error_pct'].abs().mean():.1f} % ({int(noted.sum())} "
            f"rows); without it: {res.loc[~noted, 'error_pct'].abs().mean():.1f} % ({int((~noted).sum())} rows).\n\n"
            if noted.any() and (~noted).any() else "")
    return ("\n## CNNs at small inference batches (host-bound; not modelled by default)\n\n"
            "Outside issue 4's scope (batch >= 32). DeepLearningExamples' FP32 inference rows at batches below 32, "
            "forecast as every other row. When kernels are short, the host issuing them (Python, dispatcher, "
            "launches; the benchmark's loop times forward, loss and top-k) becomes the bottleneck, which is not "
            "modelled by default: compare a model's batch-1 times across GPUs below. A forecast whose kernels average "
            f"less than {HOST_BOUND_US:g} us of GPU time each says so in a note (`host-bound note`). `host_us=` models "
            "the host at a time per launch the user gives; docs/host.md (`python scripts/bench_host.py`) checks one "
            "chosen on these rows of one GPU against the other GPU's.\n\n" + line
            + markdown_table(rows, index=False, signed=("err %",)))


def _precision_rows_md(res: pd.DataFrame) -> str:
    extra = [c for c in ("fp32_error_pct", "fp16_error_pct", "nhwc_error_pct") if c in res]
    cols = ["source_name", "gpu", "model", "mode", "precision", "batch", "image_size",
            *(["memory_format"] if "memory_format" in res else []), "measured_ms", "predicted_ms", "error_pct",
            "roofline_error_pct", *extra, "version"]
    names = {"fp32_error_pct": "as FP32 err %", "fp16_error_pct": "as pure FP16 err %", "nhwc_error_pct": "as NHWC err %"}
    rows = res[cols].rename(columns={"source_name": "source", "error_pct": "err %", "roofline_error_pct": "roofline err %",
                                     "image_size": "image", "memory_format": "layout", **names})
    if "layout" in rows:
        rows["layout"] = rows["layout"].map({v: k for k, v in CNN_MEMORY_FORMATS.items()})
    return (markdown_table(precision_summary(res), index=False, signed=("mean err %",))
            + "\nPer model (all sources and GPUs):\n\n"
            + markdown_table(_per_model(res), index=False, signed=("mean err %",))
            + "\nEvery row (signed % error):\n\n"
            + markdown_table(rows, index=False, signed=("err %", "roofline err %", *[names[c] for c in extra])))


def _tf32_md(res: pd.DataFrame) -> str:
    return ("\n## CNNs in TF32 (PyTorch's default on Ampere and later): measured, never fitted\n\n"
            "Outside issue 4's scope. The benchmarks' \"float\" rows of Ampere and Ada cards: PyTorch runs their FP32 "
            "convolutions on TF32 tensor cores by default (`torch.backends.cudnn.allow_tf32`), which is what "
            "`neusight.predict` forecasts unless told `tf32=\"off\"`: convolutions bounded by the spec sheet's dense "
            "TF32 tensor peak (those with channels in multiples of 4; the others, such as a first layer on 3-channel "
            "images, as CUDA-core convolutions at the FP32 rate: neusight.kernels.base.TC_CHANNEL_ALIGN), everything "
            "else FP32, with the utilization models learned on FP32 kernels (no TF32 kernel trains the predictor); "
            "nothing here was fitted. The `roofline err %` column is the roofline "
            "baseline of the same TF32 forecast; `as FP32` the same rows forecast in true FP32 (`tf32=\"off\"`), "
            "as before TF32 was modelled.\n\n"
            + _precision_rows_md(res))


def _half_md(res: pd.DataFrame) -> str:
    return ("\n## CNNs in half precision (AMP, FP16): measured, never fitted\n\n"
            "Outside issue 4's scope. The rows the benchmarks time in FP16 (`fp16`), forecast as pure FP16 "
            "(`dtype=\"float16\"`): GEMMs and convolutions bounded by the spec sheet's dense FP16 tensor-core peak "
            "(convolutions only with channels in multiples of 8; the others, such as a first layer on 3-channel images, "
            "as CUDA-core convolutions at the FP32 rates), every tensor half the bytes; and those timed "
            "with automatic mixed precision (`amp`), forecast as the FP32 model under `torch.autocast(float16)` "
            "(`amp=\"float16\"`, neusight/graph/amp.py: GEMMs and "
            "convolutions in FP16, softmax, norms and the loss in FP32, the casts between them, FP32 weights and "
            "optimizer, GradScaler in training). Each row in the layout the benchmark ran (`layout`: DLE's "
            "memory_format column, Lambda's raw-log note): in NCHW, cuDNN transposes every tensor-core convolution's "
            "operands to NHWC and back (neusight/graph/layout.py); `as NHWC` is the same row forecast without those "
            "transposes (`memory_format=\"channels_last\"`), as before layouts were modelled. `as pure FP16` is the "
            "same row forecast as a pure FP16 model, as before autocast was emulated. No FP16 kernel trains the "
            "predictor (it learned FP32 kernels); nothing here was fitted.\n\n"
            + _precision_rows_md(res))


def _layout_md(pairs: pd.DataFrame) -> str:
    rows = pairs.rename(columns={"source_name": "source", "image_size": "image", "nchw_ms": "NCHW ms",
                                 "nhwc_ms": "NHWC ms", "nchw_version": "NCHW version", "nhwc_version": "NHWC version",
                                 "measured_ratio": "measured NCHW / NHWC", "forecast_ratio": "forecast NCHW / NHWC",
                                 "ratio_error_pct": "ratio err %"})
    blind = pairs.assign(blind=(1 / pairs["measured_ratio"] - 1) * 100)   # a ratio of 1 against the measured one
    summary = blind.groupby(["gpu", "mode"]).agg(
        pairs=("blind", "size"), measured=("measured_ratio", "mean"), forecast=("forecast_ratio", "mean"),
        blind=("blind", lambda v: v.abs().mean()), err=("ratio_error_pct", lambda v: v.abs().mean())).reset_index()
    summary = summary.rename(columns={"measured": "mean measured ratio", "forecast": "mean forecast ratio",
                                      "blind": "layout-blind mean abs err %", "err": "this forecast mean abs err %"})
    return ("\n### The same run in NCHW and in NHWC\n\n"
            "Runs a source timed in both layouts (DLE: an older container in NCHW, a newer one channels-last; "
            "superseded rows included here only), the measured slow-down of NCHW over NHWC against the forecast one "
            "(ratio err % = forecast / measured ratio - 1). A layout-blind forecast says 1.00 for every row. The "
            "containers differ in more than the layout (cuDNN and PyTorch versions), which the measured ratio "
            "includes: T4's 2019 NCHW tables (pytorch-19.10) ran 1.5-2x faster than its 2021 channels-last ones, "
            "which no layout explains (the same era's T4 FP32 tables are flagged SUSPECT by the dataset).\n\n"
            + markdown_table(summary, index=False)
            + "\nEvery pair:\n\n"
            + markdown_table(rows, index=False, signed=("ratio err %",)))


# ---------------------------------------------------------------------------------------------------------
# plot


def scatter_plot(labels: pd.DataFrame, path: str | os.PathLike, *, cnn: pd.DataFrame | None = None,
                 trained_on: Sequence[str] = (), title: str = "") -> Path:
    """Predicted vs measured, log-log: NeuSight (left) and the roofline baseline (right), one colour per GPU,
    circles = inference, triangles = training, diamonds = public CNN benchmarks; the band is +-20 %."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    frames = [labels.assign(kind="label")]
    if cnn is not None and not cnn.empty:
        frames.append(cnn.assign(kind="cnn"))
    df = pd.concat(frames, ignore_index=True)
    gpus = gpu_order(df["gpu"].unique(), trained_on)
    colors = {g: c for g, c in zip(gpus, [f"C{i}" for i in range(10)] * 3)}
    fig = Figure(figsize=(13, 6.2), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    lo = 0.5 * min(df["measured_ms"].min(), df["predicted_ms"].min(), df["roofline_predicted_ms"].min())
    hi = 2.0 * max(df["measured_ms"].max(), df["predicted_ms"].max(), df["roofline_predicted_ms"].max())
    xs = np.geomspace(lo, hi, 50)
    for ax, column, err, name in ((axes[0], "predicted_ms", "error_pct", "NeuSight"),
                                  (axes[1], "roofline_predicted_ms", "roofline_error_pct", "roofline baseline")):
        ax.fill_between(xs, xs * 0.8, xs * 1.2, color="0.9", zorder=0)
        ax.plot(xs, xs, color="0.4", lw=1, zorder=1)
        for (gpu, mode, kind), g in df.groupby(["gpu", "mode", "kind"]):
            marker = "D" if kind == "cnn" else ("o" if mode == "inference" else "^")
            ax.scatter(g["measured_ms"], g[column], s=46, marker=marker, color=colors[gpu], edgecolor="black",
                       linewidth=0.5, alpha=0.9, zorder=3)
        means = [f"{kind_name} {g[err].abs().mean():.1f} %" for kind_name, g in
                 (("labels", df[df["kind"] == "label"]), ("ResNet", df[df["kind"] == "cnn"])) if len(g)]
        ax.set_title(f"{name}: mean |error| " + ", ".join(means), fontsize=12)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured latency (ms)", fontsize=11)
        ax.grid(True, which="both", lw=0.3, color="0.8")
        ax.set_aspect("equal")
    axes[0].set_ylabel("predicted latency (ms)", fontsize=11)
    handles = [Line2D([], [], marker="s", ls="", color=colors[g], markersize=9,
                      label=g + ("" if g in trained_on else " (unseen)")) for g in gpus]
    handles += [Line2D([], [], marker=m, ls="", color="0.5", markeredgecolor="black", markersize=8, label=lab)
                for m, lab in (("o", "label: inference"), ("^", "label: training"), ("D", "ResNet benchmark"))]
    handles.append(Line2D([], [], color="0.4", label="y = x (band: +-20 %)"))
    fig.legend(handles=handles, loc="outside right center", fontsize=10, frameon=False)
    if title:
        fig.suptitle(title, fontsize=13)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=130)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------------------
# generated docs with several sections (docs/speed.md: one per benchmark script)


def write_doc_section(path: str | os.PathLike, name: str, body: str, *, title: str = "") -> None:
    """Replace the section between ``<!-- name:begin -->`` and ``<!-- name:end -->`` of ``path`` (appended if
    absent; the file starts with ``title`` if new), atomically, leaving the other sections as they are."""
    from neusight.util import atomic_write_text

    path = Path(path)
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.is_file() else (title.rstrip() + "\n\n" if title else "")
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    atomic_write_text(path, text)

"""How far off forecasts of each kind were when they could be measured, shown next to a new forecast.

``neusight-evaluate accuracy_out=<file>`` condenses its results into one JSON file: per kind of forecast
(workload, mode, precision, torch.compile or eager, GPU inside or outside the predictor's training set) the
number of measured runs, the GPUs, the mean and worst absolute % error. The shipped files live in
``data/accuracy/`` (one per evaluation command, each naming it and the weights of the predictor it measured).
:func:`measured_accuracy` finds the record of a new forecast's kind, for the same predictor weights only, and
says what the forecast holds that no measured run did (an optimizer step, a KV cache, ...). A kind with no
record says so: nothing is extrapolated from other kinds.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from neusight.errors import DataError
from neusight.util import atomic_write_text

__all__ = ["ACCURACY_DIR", "accuracy_records", "forecast_kind", "format_accuracy", "load_accuracy",
           "measured_accuracy", "run_records", "short_accuracy", "write_accuracy"]

log = logging.getLogger(__name__)

ACCURACY_DIR = Path(__file__).resolve().parents[1] / "data" / "accuracy"
FORMAT_VERSION = 3   # 2: records carry batch_range; 3: and measured_ms_range
KEY = ("vendor", "workload", "mode", "precision", "fused", "gpu_seen", "gpu")   # gpu: one GPU's runs, or None: all
# the CNN benchmarks' precision names -> the kinds here (AMP rows ran torch.autocast in float16)
CNN_PRECISION_KIND = {"fp32": "fp32", "tf32": "tf32", "amp": "amp-float16", "fp16": "float16"}
WORKLOAD_WORDS = {"transformer": "transformer", "cnn": "CNN"}
# what a record must hold to be read (the key, then what the lookup and the line use)
RECORD_FIELDS = (*KEY, "runs", "gpus", "sources", "mean_abs_error_pct", "worst_abs_error_pct", "batch_range",
                 "measured_ms_range")
_warned: set[str] = set()   # files already warned about in this process


def _record(g: pd.DataFrame, key: dict[str, Any], sources: Sequence[str]) -> dict[str, Any]:
    e = g["error_pct"].astype(float)
    return {**key, "runs": int(len(g)), "gpus": sorted(map(str, g["gpu"].unique())), "sources": list(sources),
            "batch_range": [int(g["batch"].min()), int(g["batch"].max())],
            "measured_ms_range": [round(float(g["measured_ms"].min()), 3), round(float(g["measured_ms"].max()), 3)],
            "mean_abs_error_pct": round(float(e.abs().mean()), 2),
            "worst_abs_error_pct": round(float(e.abs().max()), 2),
            "mean_signed_error_pct": round(float(e.mean()), 2)}


def accuracy_records(labels: pd.DataFrame, trained_on: Sequence[str], *, vendors: dict[str, str],
                     cnn: Sequence[pd.DataFrame] = ()) -> list[dict[str, Any]]:
    """One record per kind of forecast measured: ``labels`` (:func:`neusight.e2e_eval.label_frame`: FP32
    transformers, modes ``inference`` / ``training`` / ``inference+fusion``) and the CNN benchmark frames
    (:func:`neusight.e2e_eval.predict_cnn`, any precision). ``vendors`` maps each GPU key to its vendor."""
    rows = []
    # one-GPU runs only: multi-GPU labels (modes like "training+dp4") are forecast by neusight.parallel, whose
    # forecasts carry no accuracy line
    labels = labels[labels["mode"].isin(["inference", "training", "inference+fusion", "training+fusion"])]
    if len(labels):
        t = labels.assign(workload="transformer", precision="fp32",
                          fused=labels["mode"].str.endswith("+fusion"),
                          mode=labels["mode"].str.replace("+fusion", "", regex=False),
                          source="NeuSight labels")
        rows.append(t[["gpu", "workload", "mode", "precision", "fused", "batch", "measured_ms", "error_pct", "source"]])
    for c in cnn:
        if c is not None and len(c):
            rows.append(c.assign(workload="cnn", fused=False, precision=c["precision"].map(CNN_PRECISION_KIND),
                                 source=c["source_name"])[["gpu", "workload", "mode", "precision", "fused",
                                                           "batch", "measured_ms", "error_pct", "source"]])
    if not rows:
        return []
    return run_records(pd.concat(rows, ignore_index=True), trained_on, vendors=vendors)


def run_records(runs: pd.DataFrame, trained_on: Sequence[str], *, vendors: dict[str, str]) -> list[dict[str, Any]]:
    """One record per kind of forecast of measured ``runs``, one row each with ``gpu``, ``workload``, ``mode``,
    ``precision``, ``fused``, ``batch``, ``measured_ms``, ``error_pct`` (the forecast time's, signed) and
    ``source``: all GPUs' runs of a kind together, and each GPU's alone (:func:`accuracy_records` for the
    evaluation's runs, ``scripts/bench_training_public.py`` for published ones)."""
    df = runs.dropna(subset=["precision", "error_pct"]).copy()
    df["vendor"] = [vendors[g] for g in df["gpu"]]
    df["gpu_seen"] = df["gpu"].isin(list(trained_on))
    out = []
    group = [k for k in KEY if k != "gpu"]
    for by, gpu_of in ((group, lambda g: None), ([*group, "gpu"], lambda g: str(g["gpu"].iloc[0]))):
        for key, g in df.groupby(by, sort=True):
            k = {**dict(zip(group, key[:len(group)])), "gpu": gpu_of(g)}
            k["fused"], k["gpu_seen"] = bool(k["fused"]), bool(k["gpu_seen"])
            out.append(_record(g, {f: k[f] for f in KEY}, sorted(g["source"].unique())))
    return out


def write_accuracy(path: str | os.PathLike, records: list[dict[str, Any]], *, command: str,
                   predictor_sha256: Sequence[str]) -> None:
    """The records as JSON, written atomically, with the command that made them and the predictor weights
    (sha256 of each ``weights.pt``) they measured."""
    atomic_write_text(path, json.dumps({"format_version": FORMAT_VERSION, "command": command,
                                        "predictor_weights_sha256": sorted(set(predictor_sha256)),
                                        "records": records}, indent=1) + "\n")


def load_accuracy(folder: str | os.PathLike | None = None, *, strict: bool = False) -> list[dict[str, Any]]:
    """Every accuracy file (``*.json``) of ``folder`` (default: the shipped ``data/accuracy``), as a list of
    ``{"command", "predictor_weights_sha256", "records"}``; a missing folder holds none. A file that is corrupt or
    of another format is a DataError with ``strict``, else left out with a warning that says how to regenerate
    it: the files annotate forecasts, so a bad one must not stop forecasting (nor the evaluation that rewrites
    it)."""
    folder = Path(folder) if folder is not None else ACCURACY_DIR
    if not folder.is_dir():
        return []
    files = []
    for path in sorted(folder.glob("*.json")):
        try:
            stat = path.stat()
            doc = _read_checked(str(path), stat.st_mtime_ns, stat.st_size)
        except OSError:
            doc = None
        if doc is None:
            msg = (f"accuracy file {str(path)!r} is corrupt or of another format; regenerate it with the command in "
                   "docs/evaluation.md (neusight-evaluate ... accuracy_out=...) or delete it")
            if strict:
                raise DataError(msg)
            if str(path) not in _warned:   # once per file and process, not once per forecast
                _warned.add(str(path))
                log.warning("%s (left out: forecasts show no measured accuracy from it)", msg)
            continue
        files.append({**doc, "path": str(path)})
    return files


@functools.lru_cache(maxsize=16)
def _read_checked(path: str, mtime_ns: int, size: int) -> dict[str, Any] | None:
    """An accuracy file's JSON if it is of this format with every record field, else None. Cached by path, time
    and size: every forecast looks the files up, and they change only when an evaluation rewrites them."""
    try:
        doc = json.loads(Path(path).read_text())
        ok = (doc.get("format_version") == FORMAT_VERSION and isinstance(doc.get("records"), list)
              and all(isinstance(r, dict) and set(RECORD_FIELDS) <= set(r) for r in doc["records"]))
    except (OSError, json.JSONDecodeError, AttributeError):
        ok = False
    return doc if ok else None


def forecast_kind(graph: Any, kernels: pd.DataFrame, device: Any, train_devices: Sequence[str], *,
                  fused: bool = False, megatron: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The kind of a forecast (the fields of :data:`KEY`) and what it holds that the measured runs do not."""
    # the measured workloads: transformers text models built by transformers (the NeuSight labels), and the CNN
    # presets (the public benchmarks); anything else (an image transformer, your own nn.Module) is "other"
    built = getattr(graph, "model_kind", "")
    workload = ("cnn" if built == "vision" else
                "transformer" if built == "hf" and getattr(graph, "image_size", None) is None else "other")
    amp = getattr(graph, "amp", None)
    dtype = str(getattr(graph, "dtype", "float32"))
    if amp:
        precision = f"amp-{str(amp).removeprefix('torch.')}"
    elif dtype != "float32":
        precision = dtype
    else:
        precision = "tf32" if (kernels["dtype"].astype(str) == "tf32").any() else "fp32"
    kind = {"vendor": device.vendor, "workload": workload, "mode": graph.mode, "precision": precision,
            "fused": bool(fused), "gpu_seen": device.key in set(train_devices), "gpu": device.key}
    extra = []
    phases = set(kernels["phase"].unique()) if "phase" in kernels else set()
    if workload == "transformer" and "optimizer" in phases:
        extra.append("the optimizer step (the transformer labels time forward and backward only)")
    for attr, what in (("kv_cache", "a KV cache"), ("lora_rank", "LoRA adapters"),
                       ("gradient_checkpointing", "gradient checkpointing")):
        if getattr(graph, attr, None):
            extra.append(what)
    if megatron:
        extra.append("Megatron-LM's kernels")
    # the measured runs' GEMMs computed in their precision from weights stored in it (an FP8 KV cache's casts are
    # not GEMMs)
    from neusight.graph.quant import WEIGHT_ONLY, gemm_name
    from neusight.tiles import GEMM_FAMILIES

    gemms = (kernels[kernels["family"].isin(GEMM_FAMILIES)] if {"family", "dtype", "kernel"} <= set(kernels.columns)
             else pd.DataFrame(columns=["dtype", "kernel"]))
    dtypes, names = gemms["dtype"].astype(str), gemms["kernel"].astype(str)
    if dtypes.str.startswith("float8").any():
        extra.append("FP8 GEMMs")
    if dtypes.str.startswith("float4").any():
        extra.append("FP4 GEMMs (NVFP4)")
    if names.str.startswith(tuple(gemm_name(bits, grouped) for bits in WEIGHT_ONLY for grouped in (False, True))).any():
        extra.append("quantized weights dequantized in the GEMMs")
    return kind, extra


def measured_accuracy(kind: dict[str, Any], weights_sha256: str | None, *, extra: Sequence[str] = (),
                      batch_size: int | None = None, latency_ms: float | None = None,
                      folder: str | os.PathLike | None = None) -> dict[str, Any]:
    """The measured record of ``kind`` for the predictor with these weights, the forecast GPU's own runs where
    it has some, else all GPUs' of the kind (inside or outside the training set, as the forecast GPU): ``{"kind",
    "record" (None when no run of the kind was measured), "not_covered" (``extra``), "command" (that measured
    it), "predictor_measured" (False when no accuracy file is about these weights)}``."""
    files = [f for f in load_accuracy(folder) if weights_sha256 in f["predictor_weights_sha256"]]
    record, command = None, None
    for gpu in (kind["gpu"], None):
        for f in files:
            for r in f["records"]:
                if record is None and all(r.get(k) == (gpu if k == "gpu" else kind[k]) for k in KEY):
                    record, command = copy.deepcopy(r), f["command"]   # the files' records are cached: a copy
    # what the forecast holds beyond the measured runs, but for what the record's runs had too (its "covers": the
    # published training runs had an optimizer step, the NeuSight labels none)
    extra = [e for e in extra if record is None or not any(e.startswith(c) for c in record.get("covers", ()))]
    if record is not None and batch_size is not None and not (
            record["batch_range"][0] <= batch_size <= record["batch_range"][1]):
        lo, hi = record["batch_range"]
        extra.append(f"batch {batch_size} (the runs measured batch {lo}" + (f" to {hi})" if hi > lo else ")"))
    if record is not None and latency_ms is not None and not (
            record["measured_ms_range"][0] <= latency_ms <= record["measured_ms_range"][1]):
        lo, hi = record["measured_ms_range"]
        took = f"{_ms(lo)} ms" if hi == lo else f"{_ms(lo)} to {_ms(hi)} ms"
        extra.append(f"a run of {_ms(latency_ms)} ms (the runs measured took {took})")
    return {"kind": dict(kind), "record": record, "not_covered": extra, "command": command,
            "predictor_measured": bool(files)}


def _ms(v: float) -> str:
    """Milliseconds to three significant digits, never in exponent form: 0.0123, 12.3, 1,235."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _kind_words(kind: dict[str, Any], on_gpu: bool = False) -> str:
    prec = {"fp32": "FP32", "tf32": "TF32", "float16": "FP16", "bfloat16": "BF16", "amp-float16": "AMP (FP16)",
            "amp-bfloat16": "AMP (BF16)"}.get(kind["precision"], kind["precision"])
    what = WORKLOAD_WORDS.get(kind["workload"], "model")
    fused = " under torch.compile" if kind["fused"] else ""
    if on_gpu:
        which = "a training GPU of the predictor" if kind["gpu_seen"] else "a GPU the predictor was not trained on"
        seen = f"on {kind['gpu']}, {which}"
    else:
        seen = "on training GPUs of the predictor" if kind["gpu_seen"] else "on GPUs the predictor was not trained on"
    return f"{prec} {what} {kind['mode']}{fused} {seen}"


def format_accuracy(acc: dict[str, Any] | None) -> str | None:
    """One line for a forecast's summary, or None when no accuracy file is about its predictor."""
    if not acc or not acc.get("predictor_measured"):
        return None
    r = acc["record"]
    if r is None:
        return f"measured accuracy: none; no run of this kind ({_kind_words(acc['kind'])}) was measured"
    words = _kind_words(acc["kind"], on_gpu=r["gpu"] is not None)
    if r["gpu"] is not None:
        line = (f"measured accuracy of this kind ({words}): mean {r['mean_abs_error_pct']:.1f} % off, "
                f"worst {r['worst_abs_error_pct']:.1f} %, over {r['runs']} run{'s' if r['runs'] != 1 else ''} "
                f"({'; '.join(r['sources'])})")
    else:
        line = (f"measured accuracy of this kind ({words}): mean {r['mean_abs_error_pct']:.1f} % off, worst "
                f"{r['worst_abs_error_pct']:.1f} %, over {r['runs']} run{'s' if r['runs'] != 1 else ''} on "
                f"{', '.join(r['gpus'])} ({'; '.join(r['sources'])})")
    if acc["not_covered"]:
        line += f"; not in those runs: {', '.join(acc['not_covered'])}"
    return line


def short_accuracy(acc: dict[str, Any] | None) -> str | None:
    """A table cell: "5.7 % (14 runs on this GPU)", "9.1 % (8 runs on l4)", "13.8 % (23 runs on 9 GPUs)" (more
    than two GPUs are counted, not named: the summary line names them), "none", or None when no accuracy file is
    about the forecast's predictor."""
    if not acc or not acc.get("predictor_measured"):
        return None
    r = acc["record"]
    if r is None:
        return "none"
    where = ("this GPU" if r["gpu"] is not None else ", ".join(r["gpus"]) if len(r["gpus"]) <= 2
             else f"{len(r['gpus'])} GPUs")
    return f"{r['mean_abs_error_pct']:.1f} % ({r['runs']} run{'s' if r['runs'] != 1 else ''} on {where})"

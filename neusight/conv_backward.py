"""How much slower cuDNN's convolution-gradient kernels run than the GEMM model predicts for their shape.

The kernel sweeps the predictor is trained on time forward convolutions and GEMMs only; a training step's
data- and weight-gradient convolutions are predicted by the GEMM model on their implicit-GEMM shape. Baidu
DeepBench timed the forward, data-gradient and weight-gradient kernels of the same convolution shapes on
seven NVIDIA GPUs, which measures what that misses: per shape, the measured gradient-over-forward time
ratio against the forecast one. Taking the ratio cancels what DeepBench's older libraries do differently
from today's to the forward and gradient kernels alike, and the GPU's speed.

One factor per class (:data:`neusight.predictor.features.CONV_BACKWARD_CLASSES`: data or weight gradient;
strided, Winograd-capable 3x3 stride-1, or other): the factor f by which the gradient kernels' work (their
time beyond the launch overhead) is multiplied so that, summed over the class's rows, the measured gradient
time equals the measured forward time x the forecast gradient / forward ratio. Summed, because a training
step is a sum of kernel times: a long kernel weighs more than a short one (an equal weight per shape, a
median of per-shape ratios, was tried first and over-shot the summed time on the GPUs it never saw: T4 +55 %,
V100 +18 %). Forecasts are the in-model ones (:func:`neusight.api.e2e_kernel_ms`), as the kernels run
inside a training step; DeepBench calls each kernel back to back, as a model does. ``neusight-train`` fits
them on DeepBench's rows of the predictor's own training GPUs (P100, T4); its other five GPUs check them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from neusight.errors import DataError
from neusight.predictor.features import CONV_BACKWARD_CLASSES, conv_backward_class
from neusight.predictor.model import CONV_BACKWARD_RANGE, Predictor, apply_conv_backward

__all__ = ["base_forecast", "fit_conv_backward", "fit_factors", "forecast", "ratio_sums",
           "summed_error_pct"]

def base_forecast(df: pd.DataFrame, predictor: Predictor) -> pd.DataFrame:
    """Per row of :func:`neusight.dataset.load_deepbench_conv`: ``roofline_ms, isolated_ms, overhead_ms``
    of the predictor without any gradient factor, and the row's ``cls`` (CONV_BACKWARD_CLASSES, "" for a
    forward kernel)."""
    parts = [predictor.predict(g, dev, conv_backward=False)[["roofline_ms", "latency_ms", "overhead_ms"]]
             for dev, g in df.groupby("device")]
    out = pd.concat(parts).loc[df.index].rename(columns={"latency_ms": "isolated_ms"})
    out["cls"] = conv_backward_class(df)
    return out


def forecast(base: pd.DataFrame, predictor: Predictor, factors: dict[str, float]) -> np.ndarray:
    """In-model forecast (ms) of every row of ``base`` with the gradient factors ``factors``."""
    from neusight.api import e2e_kernel_ms

    iso, _ = apply_conv_backward(base["cls"].to_numpy(), base["isolated_ms"].to_numpy(float),
                                 base["overhead_ms"].to_numpy(float), base["roofline_ms"].to_numpy(float), factors)
    return e2e_kernel_ms(base["roofline_ms"].to_numpy(float), iso, base["overhead_ms"].to_numpy(float),
                         float(getattr(predictor, "e2e_scale_", 1.0)), float(getattr(predictor, "e2e_floor_", 1.0)))


def ratio_sums(df: pd.DataFrame, predicted_ms: np.ndarray, rows: np.ndarray | None = None) -> tuple[float, float]:
    """(measured, estimated) summed gradient time of the gradient rows of ``df`` (boolean mask ``rows``,
    default all) whose shape has a forward time: estimated = measured forward x forecast gradient / forecast
    forward, per shape. Their ratio - 1 is the summed error of the gradient-over-forward ratio."""
    d = df.assign(_pred=np.asarray(predicted_ms, float))
    keep = (d["pass"] != "fwd").to_numpy() & (np.ones(len(d), bool) if rows is None else np.asarray(rows, bool))
    grad = d[keep]
    ref = d[d["pass"] == "fwd"].set_index(["device", "shape"])[["latency_ms", "_pred"]].reindex(
        pd.MultiIndex.from_arrays([grad["device"], grad["shape"]]))
    ok = ref["latency_ms"].notna().to_numpy()
    est = ref["latency_ms"].to_numpy()[ok] * grad["_pred"].to_numpy()[ok] / ref["_pred"].to_numpy()[ok]
    return float(grad["latency_ms"].to_numpy()[ok].sum()), float(est.sum())


def summed_error_pct(df: pd.DataFrame, base: pd.DataFrame, predictor: Predictor, factors: dict[str, float],
                     rows: np.ndarray | None = None) -> float:
    """Signed % error of the summed gradient time estimated through the forecast ratio (see ratio_sums)."""
    measured, estimated = ratio_sums(df, forecast(base, predictor, factors), rows)
    return (estimated / measured - 1) * 100 if measured > 0 else float("nan")


def _fit_one(base: pd.DataFrame, df: pd.DataFrame, predictor: Predictor, name: str, rows: np.ndarray) -> float:
    """Bisection on log f: the estimated summed time is non-decreasing in f."""
    lo, hi = np.log(CONV_BACKWARD_RANGE[0]), np.log(CONV_BACKWARD_RANGE[1])

    def excess(log_f: float) -> float:
        measured, estimated = ratio_sums(df, forecast(base, predictor, {name: float(np.exp(log_f))}), rows)
        return estimated - measured

    if excess(lo) >= 0:
        return CONV_BACKWARD_RANGE[0]
    if excess(hi) <= 0:
        return CONV_BACKWARD_RANGE[1]
    for _ in range(40):   # |hi - lo| = 3.9 / 2^40: far below any digit reported
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return float(np.exp((lo + hi) / 2))


def fit_factors(df: pd.DataFrame, base: pd.DataFrame, predictor: Predictor, devices: Iterable[str]) -> dict[str, float]:
    """One factor per class with gradient rows on ``devices`` (a class without rows gets none)."""
    on = df["device"].isin(set(devices)).to_numpy()
    factors = {}
    for name in CONV_BACKWARD_CLASSES:
        rows = on & (base["cls"] == name).to_numpy()
        if rows.any():
            factors[name] = round(_fit_one(base, df, predictor, name, rows), 4)
    return factors


def fit_conv_backward(df: pd.DataFrame, predictor: Predictor, devices: Sequence[str], *, source: str | Path = "") -> dict:
    """Fit the factors on the rows of ``devices``; check them leaving one GPU out.

    Returns ``{"factors", "devices", "rows" (per class), "source", "sha256", "summed_ratio_error_pct"}``, the
    last per GPU of ``df``: the signed % error of its summed gradient time estimated through the forecast
    ratio (:func:`ratio_sums`) without factors, with the fitted ones, and with factors fitted on ``devices``
    minus that GPU (its own rows never seen).
    """
    devices = sorted(set(devices))
    if not devices or (missing := sorted(set(devices) - set(df["device"]))):
        raise DataError(f"conv_backward devices {devices if not devices else missing} have no DeepBench conv rows "
                        f"(rows exist for {sorted(df['device'].unique())}); fix calibrate.conv_backward.devices")
    base = base_forecast(df, predictor)
    factors = fit_factors(df, base, predictor, devices)
    per_gpu = {}
    for dev in sorted(df["device"].unique()):
        held = fit_factors(df, base, predictor, [d for d in devices if d != dev]) if dev in devices else factors
        mine = (df["device"] == dev).to_numpy()
        per_gpu[dev] = {name: round(summed_error_pct(df, base, predictor, f, mine), 1)
                        for name, f in (("none", {}), ("fitted", factors), ("held_out", held))}
    on = df["device"].isin(devices).to_numpy()
    rows = {name: int((on & (base["cls"] == name).to_numpy()).sum()) for name in factors}
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest() if source and Path(source).is_file() else None
    return {"factors": factors, "devices": devices, "rows": rows, "source": str(source), "sha256": digest,
            "summed_ratio_error_pct": per_gpu}

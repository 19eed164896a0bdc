"""Kernel -> tiles, waves, roofline and MLP features, for training rows and traced kernels alike.

The feature lists are defined once here; a model's ``in_features`` is derived from them. Features
describe the kernel relative to the device (waves, tile intensity over the device's ridge point, working
set over L2, power per unit of peak), never the absolute speed of a device, so a GPU outside the
training set is described in the same terms as the ones inside it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from neusight.devices import Device
from neusight.kernels.base import Family
from neusight.tile_table import ROW_FAMILIES, TileTable
from neusight.tiles import GEMM_FAMILIES, device_rates, gemm_tiles, rowwise_tiles, sizes_of

# Chosen by leave-one-GPU-out error over the five training GPUs (docs/predictor.md): GEMM efficiency
# differs by architecture generation and by power headroom (70 W cards throttle), so two device
# descriptors enter, clamped to the training range like every feature; row-wise kernels do better without.
GEMM_FEATURES = ("log2_tile_m", "log2_tile_n", "log2_reduction", "log2_batch", "log2_waves", "wave_fill", "tile_fill",
                 "log2_intensity_ratio", "log2_bytes_over_l2", "compute_capability", "log2_watts_per_tflop",
                 "log2_algo_speedup")
ROW_FEATURES = ("log2_elems_per_block", "log2_threads", "log2_waves", "wave_fill", "log2_intensity_ratio",
                "log2_bytes_over_l2", "log2_cols", "log2_bytes")

MODEL_FAMILIES = (*GEMM_FAMILIES, *ROW_FAMILIES)

# The softmax and layer-norm sweeps stop at ~0.1 ms kernels, far below the bandwidth-saturating sizes a model
# runs; their MLPs also train on a share of the elementwise rows (``native`` = 0), which reach saturation, so
# "bigger kernels approach the bandwidth roof" is learned from data rather than extrapolated.
BORROWS_ELEMENTWISE = (Family.SOFTMAX.value, Family.LAYERNORM.value)
BORROW_FRACTION = 0.3


def model_family(family: str) -> str:
    """Which family's MLP predicts a kernel: its own, else the elementwise model on its bytes."""
    return family if family in MODEL_FAMILIES else Family.ELEMENTWISE.value


# The conv sweeps measured only forward 3x3 stride-1 convolutions (most run as Winograd or FFT). Every other
# convolution kernel (1x1, strided, 7x7, and all data / weight gradients) is an implicit GEMM of a shape the
# conv model never saw, so it is predicted by the GEMM (linear) model, trained on 32k GEMM shapes, instead:
# each model is used inside the domain its training data covers.
CONV_MODEL_KERNELS = ("conv_fwd",)


def conv_as_gemm(df: pd.DataFrame) -> pd.Series:
    """Conv rows outside the conv sweeps' domain (see CONV_MODEL_KERNELS), routed to the GEMM model."""
    conv = df["family"] == Family.CONV.value
    if "algo_flops" in df:
        fast = (df["flops"] > df["algo_flops"] * 1.0001)   # a Winograd-capable 3x3 stride-1 shape
    else:
        fast = pd.Series(True, index=df.index)
    fwd = df["kernel"].isin(CONV_MODEL_KERNELS) if "kernel" in df else pd.Series(True, index=df.index)
    return conv & ~(fast & fwd)


def feature_names(family: str) -> tuple[str, ...]:
    fam = model_family(family)
    if fam in GEMM_FAMILIES:
        return GEMM_FEATURES
    return ROW_FEATURES + (("native",) if fam in BORROWS_ELEMENTWISE else ())


def decompose(df: pd.DataFrame, device: Device, table: TileTable, *, use_measured_tiles: bool = False) -> pd.DataFrame:
    """Tiles, waves, roofline and features of every row of ``df`` on ``device``.

    ``df`` needs ``family, B, M, N, K, rows, cols, flops, bytes, dtype``. With ``use_measured_tiles`` (training),
    rows that carry a tile parsed from their kernel name (``tile_m``/``tile_n``, cuBLAS view) keep it.
    Returns a frame indexed like ``df`` with ``model_family``, tile columns, tiles, waves, roofline_ms,
    bound and the features of its family (NaN for the other family's features).
    """
    out = pd.DataFrame(index=df.index)
    out["model_family"] = df["family"].map(model_family)
    out.loc[conv_as_gemm(df), "model_family"] = Family.LINEAR.value
    parts = []
    for fam, d in df.groupby(out["model_family"], sort=False):
        parts.append(_gemm(d, fam, device, table, use_measured_tiles) if fam in GEMM_FAMILIES else _rows(d, fam, device, table))
    res = pd.concat(parts).reindex(df.index)
    res.insert(0, "model_family", out["model_family"])
    return res


def _gemm(d: pd.DataFrame, fam: str, device: Device, table: TileTable, measured: bool) -> pd.DataFrame:
    b, m, n, k = (d[c].to_numpy(float) for c in ("B", "M", "N", "K"))
    tm, tn = table.gemm_tiles(fam, b, m, n, k, device)
    if measured and "tile_m" in d:
        has = d["tile_m"].notna().to_numpy()
        tm = np.where(has, d["tile_n"].to_numpy(float), tm)   # cuBLAS view: tile_n runs along our M
        tn = np.where(has, d["tile_m"].to_numpy(float), tn)
    rates = device_rates(device, str(d["dtype"].iloc[0]))
    flops = d["flops"].to_numpy(float)
    algo = d["algo_flops"].to_numpy(float) if "algo_flops" in d else flops
    speedup = np.where(np.isfinite(algo) & (algo > 0), flops / np.where(algo > 0, algo, 1.0), 1.0)
    t = gemm_tiles(b, m, n, k, tm, tn, sizes_of(d["dtype"]), rates, speedup)
    t.index = d.index
    t["tile_m"], t["tile_n"] = tm, tn
    t["elems_per_block"], t["threads_per_block"] = np.nan, np.nan
    t["log2_tile_m"], t["log2_tile_n"] = np.log2(tm), np.log2(tn)
    t["log2_reduction"] = np.log2(np.maximum(n, 1))
    t["log2_batch"] = np.log2(np.maximum(b, 1))
    t["log2_algo_speedup"] = np.log2(speedup)
    t["log2_waves"] = np.log2(t["waves"])
    t["wave_fill"] = t["tiles"] / (t["waves"] * t["concurrent"])
    t["tile_fill"] = (b * m * k) / (t["tiles"] * tm * tn)
    t["log2_intensity_ratio"] = np.log2(t["intensity_ratio"])
    t["log2_bytes_over_l2"] = np.log2(d["bytes"].to_numpy(float) / device.l2_cache_bytes)
    t["log2_watts_per_tflop"] = np.log2(device.tdp_w / (rates.gemm_flops / 1e12))
    t["compute_capability"] = _cc(device)
    return t


def _rows(d: pd.DataFrame, fam: str, device: Device, table: TileTable) -> pd.DataFrame:
    rows = d["rows"].to_numpy(float)
    cols = d["cols"].to_numpy(float)
    epb, tpb = table.launch_geometry(fam if fam in table.indexes else Family.ELEMENTWISE.value, rows, cols)
    rates = device_rates(device, str(d["dtype"].iloc[0]))
    nbytes = d["bytes"].to_numpy(float)
    t = rowwise_tiles(rows * cols, d["flops"].to_numpy(float), nbytes, epb, tpb, rates)
    t.index = d.index
    t["tile_m"], t["tile_n"] = np.nan, np.nan
    t["elems_per_block"], t["threads_per_block"] = epb, tpb
    t["log2_elems_per_block"] = np.log2(np.maximum(epb, 1))
    t["log2_threads"] = np.log2(np.maximum(tpb, 1))
    t["log2_waves"] = np.log2(t["waves"])
    t["wave_fill"] = t["tiles"] / (t["waves"] * t["concurrent"])
    t["log2_intensity_ratio"] = np.log2(np.maximum(t["intensity_ratio"], 1e-6))
    t["log2_bytes_over_l2"] = np.log2(np.maximum(nbytes, 1) / device.l2_cache_bytes)
    t["log2_cols"] = np.log2(np.maximum(cols, 1))
    t["log2_bytes"] = np.log2(np.maximum(nbytes, 1))
    t["native"] = 1.0

    return t


def _cc(device: Device) -> float:
    """Compute capability as a number (8.9 -> 8.9); AMD gfx targets map to 0 (a separate regime)."""
    try:
        return float(device.compute_capability)
    except ValueError:
        return 0.0

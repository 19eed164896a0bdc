"""Load measured kernel latencies into one tidy DataFrame, the predictor's training table.

Two sources: trace CSVs in the shared NeuSight kernel schema (``OPName, Latency, Device, Kernel Name,
Grid x/y/z, Block x/y/z, ...`` then the shape columns of the op, see the dataset README) and the
DeepBench GEMM table. Every row gets its kernel family, its dims in the :class:`~neusight.kernels.base.Family`
convention, FLOPs and bytes from :mod:`neusight.kernels.formulas` (the same functions the op registry
uses, so a traced model and the training data mean the same thing), launch geometry, the output tile
parsed from the kernel name, and the spec of its device (``dev_*`` columns).

Malformed rows are skipped, counted per reason, logged once per file and returned in
``df.attrs["skipped"]``; a file that cannot be used at all raises :class:`~neusight.errors.DataError`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import typing
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from neusight.devices import Device, load_device
from neusight.errors import DataError, DeviceError, InputError
from neusight.kernels import formulas
from neusight.kernels.base import Family

__all__ = ["COLUMNS", "DEEPBENCH_CONV_PASSES", "ELEMENTWISE_FLOPS_PER_ELEM", "SKIP_REASONS", "load_deepbench_conv",
           "load_deepbench_gemm", "load_kernel_traces", "parse_tile"]

log = logging.getLogger(__name__)

# FLOPs per output element of the elementwise ops. NB: a counting convention, not an instruction count:
# every arithmetic op and every transcendental (exp, log, erf, tanh) counts 1. These kernels are
# memory-bound on every GPU we know, so the choice only moves the compute leg of their roofline.
ELEMENTWISE_FLOPS_PER_ELEM: dict[str, float] = {
    "add": 1, "mul": 1, "div": 1,  # div: one IEEE division (hardware: reciprocal + Newton steps)
    "pow": 3,   # x ** y = exp(y * log(x)): log, mul, exp
    "relu": 1,  # one compare-select
    "tanh": 1,  # one transcendental
    "gelu": 5,  # erf form (PyTorch default): 0.5 * x * (1 + erf(x / sqrt(2))): div, erf, add, mul, mul
}


@dataclass(frozen=True)
class _OpSpec:
    """What an OPName means: its family, tensors read (elementwise), FLOPs per element, bias."""

    family: Family
    n_inputs: int = 1
    flops_per_elem: float = 1.0
    bias: bool = False


_OPS: dict[str, _OpSpec] = {
    "linear": _OpSpec(Family.LINEAR, bias=True),  # nn.Linear(N, K, bias=True)
    "gemm": _OpSpec(Family.LINEAR),               # a plain GEMM without bias (DeepBench)
    "bmm": _OpSpec(Family.BMM),
    "conv": _OpSpec(Family.CONV),
    "softmax": _OpSpec(Family.SOFTMAX),
    "ln": _OpSpec(Family.LAYERNORM),
}
for _op in ("add", "mul", "div", "pow"):
    # binary: tensor op tensor reads two tensors; the `u` variant (tensor op Python scalar) reads one
    _OPS[_op] = _OpSpec(Family.ELEMENTWISE, 2, ELEMENTWISE_FLOPS_PER_ELEM[_op])
    _OPS[_op + "u"] = _OpSpec(Family.ELEMENTWISE, 1, ELEMENTWISE_FLOPS_PER_ELEM[_op])
for _op in ("relu", "tanh", "gelu"):
    _OPS[_op] = _OpSpec(Family.ELEMENTWISE, 1, ELEMENTWISE_FLOPS_PER_ELEM[_op])

_GEMM_SHAPE = ("B", "M", "N", "K")
_CONV_SHAPE = ("B", "Input_Channel", "Output_Channel", "Kernel_Szie", "Input_Size", "Stride", "Padding")
_ROW_SHAPE = ("B", "H")
_SHAPE_COLUMNS: dict[Family, tuple[str, ...]] = {
    Family.LINEAR: _GEMM_SHAPE, Family.BMM: _GEMM_SHAPE, Family.CONV: _CONV_SHAPE,
    Family.ELEMENTWISE: _ROW_SHAPE, Family.SOFTMAX: _ROW_SHAPE, Family.LAYERNORM: _ROW_SHAPE,
}
_ALL_SHAPE = tuple(dict.fromkeys(_GEMM_SHAPE + _CONV_SHAPE + _ROW_SHAPE))

# CSV column -> tidy column; required in every file (the shared schema always has them)
_LAUNCH = {"Grid x": "grid_x", "Grid y": "grid_y", "Grid z": "grid_z",
           "Block x": "block_x", "Block y": "block_y", "Block z": "block_z"}
_REQUIRED = ("OPName", "Latency", "Device", "Kernel Name", *_LAUNCH)
# optional: absent in the AMD files and in some NVIDIA sweeps -> NaN
_OPTIONAL = {"Warps per SM": "warps_per_sm", "Blocks per SM": "blocks_per_sm"}

SKIP_REASONS = ("missing_value", "unknown_op", "unknown_device", "non_positive_latency", "non_positive_dims")
"""Why a row is skipped, checked in this order (a row counts once, under the first that applies):
a required value missing, non-numeric or infinite; an OPName without a kernel family; a Device name the
device library does not know; latency <= 0; a dim that is not a positive integer (padding may be 0) or a
conv whose output would be empty."""

COLUMNS = (
    "family", "op", "device", "device_name", "source",
    "B", "M", "N", "K", "conv_batch", "conv_cin", "conv_hw", "conv_cout", "conv_ksize", "conv_stride", "conv_pad",
    "rows", "cols", "flops", "algo_flops", "bytes", "dtype", "latency_ms",
    "kernel_name", "tile_m", "tile_n", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z",
    "num_blocks", "threads_per_block", "warps_per_sm", "blocks_per_sm", "n_kernels",
)
"""Columns of a loaded frame, in order; the ``dev_*`` device columns follow."""

# Output tile in a kernel name. cuBLAS / cuDNN / CUTLASS: the first AxB after "gemm" or "scudnn"
# (ampere_sgemm_128x64_tn, volta_sgemm_32x32_sliced1x4_tn, sgemm_128x128x8_NT,
# cutlass_80_simt_sgemm_128x256_8x4_tn_align1, cudnn_infer_volta_scudnn_winograd_128x128_...,
# maxwell_gcgemm_64x64_nt); AMD Tensile: the macro tile MT<m>x<n>x<depth_u>.
# NB: the tile is in the library's column-major view (cuBLAS m x n), which for a row-major PyTorch
# product C = A @ B is C^T, i.e. tile_m runs along our K (output columns), tile_n along our M.
# cuDNN's implicit/precomputed/explicit_convolve_sgemm<...> carry template numbers, not a tile: NaN.
_TILE_RE = re.compile(r"_MT(\d+)x(\d+)x\d+|(?:gemm|scudnn)[A-Za-z0-9_]*?_(\d+)x(\d+)", re.IGNORECASE)
_WORK_ITEM_GRID_RE = re.compile(r"Cijk_", re.IGNORECASE)  # AMD Tensile kernels, see _finish

# DeepBench GPU label -> device library key (a label not listed is looked up as it is; unknown -> skipped).
# NB: DeepBench names neither the P100 nor the M40 variant. Its best P100 SGEMM (8.2 TFLOP/s) fits under
# the PCIe card's 9.3 TFLOP/s peak, so we take that one; the M40 is taken as the 12 GB board.
_DEEPBENCH_GPUS = {
    "V100-SXM2-16GB (DGX-1)": "v100-sxm2-16gb",
    "T4-16GB": "t4",
    "P100": "p100-pcie-16gb",
    "TITAN Xp": "titan-xp",
    "TITAN X (Pascal)": "titan-x-pascal",
    "Tesla M40": "m40",
}
_DEEPBENCH_DTYPES = {"fp32": "float32", "fp16": "float16", "fp16_io_fp32_math": "float16", "int8": "int8"}


def parse_tile(kernel_names: pd.Series) -> pd.DataFrame:
    """Output tile (``tile_m``, ``tile_n``) parsed from GEMM / conv kernel names, NaN where none.

    Parameters
    ----------
    kernel_names : pandas.Series of str

    Returns
    -------
    pandas.DataFrame
        Columns ``tile_m``, ``tile_n`` (float), same index as ``kernel_names``.

    Examples
    --------
    >>> parse_tile(pd.Series(["ampere_sgemm_128x64_tn", "Cijk_Ailk_Bljk_SB_MT64x128x16_SE", "relu"]))
       tile_m  tile_n
    0   128.0    64.0
    1    64.0   128.0
    2     NaN     NaN
    """
    codes, uniques = pd.factorize(kernel_names.astype(object), use_na_sentinel=True)
    groups = pd.Series(uniques, dtype=object).astype(str).str.extract(_TILE_RE).astype(float)
    tiles = np.column_stack([groups[0].fillna(groups[2]), groups[1].fillna(groups[3])])
    tiles = np.vstack([tiles, [np.nan, np.nan]])  # row -1: missing names
    return pd.DataFrame(tiles[codes], index=kernel_names.index, columns=["tile_m", "tile_n"])


def load_kernel_traces(paths: str | Path | Sequence[str | Path], *, devices: Iterable[str] | None = None,
                       families: Iterable[Family | str] | None = None) -> pd.DataFrame:
    """Load kernel-trace CSVs (shared NeuSight schema) into one tidy frame, one row per measured kernel.

    Parameters
    ----------
    paths : path or sequence of paths
        CSV files and/or directories (searched recursively for ``*.csv``).
    devices : iterable of str, optional
        Device keys or aliases to keep (resolved by :func:`neusight.devices.load_device`); all if None.
    families : iterable of Family or str, optional
        Kernel families to keep; all if None.

    Returns
    -------
    pandas.DataFrame
        :data:`COLUMNS` then ``dev_*`` columns. Numbers are float64 (NaN where a column does not apply,
        e.g. ``rows`` of a GEMM). ``attrs["skipped"]`` = {reason: rows} over all files, reasons from
        :data:`SKIP_REASONS`; ``attrs["skipped_by_file"]`` = {path: {reason: rows}}.

    Raises
    ------
    DataError
        A path that does not exist, a directory without CSVs, a file missing required columns or
        without one usable row, or filters that leave nothing.

    Examples
    --------
    >>> df = load_kernel_traces("../shared/datasets/neusight-asplos25/kernels/nvidia/bmm")  # doctest: +SKIP
    >>> df.groupby(["family", "device"]).size()  # doctest: +SKIP
    """
    files = _expand_paths(paths)
    devices = [devices] if isinstance(devices, str) else devices
    families = [families] if isinstance(families, str) else families
    keep_devices = None if devices is None else {load_device(d).key for d in devices}
    keep_families = None if families is None else {_family(f) for f in families}
    cache: dict[str, Device | None] = {}
    parts, skipped, by_file = [], Counter(), {}
    for path in files:
        part, counts = _read_trace_file(path, cache)
        skipped.update(counts)
        if counts:
            by_file[str(path)] = dict(counts)
        if keep_devices is not None:
            part = part[part["device"].isin(keep_devices)]
        if keep_families is not None:
            part = part[part["family"].isin({f.value for f in keep_families})]
        parts.append(part)
    frame = pd.concat(parts, ignore_index=True)
    if frame.empty:
        raise DataError(f"no rows of devices={sorted(keep_devices or [])} families="
                        f"{sorted(f.value for f in keep_families or [])} in {len(files)} file(s) under {paths}; "
                        "check the filters against the devices and ops the files hold")
    return _finish(frame, cache, skipped, by_file)


def load_deepbench_gemm(path: str | Path, *, precisions: Iterable[str] = ("fp32",)) -> pd.DataFrame:
    """Load Baidu DeepBench GEMM times into the :func:`load_kernel_traces` schema (family ``linear``).

    DeepBench times ``cublasGemmEx`` column-major C[M x N] = op(A) op(B) with reduction K. Column-major
    C[M x N] is, byte for byte, row-major C^T[N x M] = op(B)^T op(A)^T, so in our row-major
    (M x N) @ (N x K) -> (M x K) convention (N reduces) a row becomes B=1, M=N_db, N=K_db, K=M_db
    (no bias). FLOPs are the same either way; the orientation matches what PyTorch launches.

    Parameters
    ----------
    path : str or Path
        ``deepbench_gemm.csv`` of the shared public-benchmarks data set.
    precisions : iterable of str
        Values of its ``precision`` column to keep (``fp32``, ``fp16``, ``fp16_io_fp32_math``, ``int8``).

    Returns
    -------
    pandas.DataFrame
        Same columns as :func:`load_kernel_traces`; launch and tile columns are NaN (not recorded).
        Rows of GPUs the device library lacks are skipped as ``unknown_device``.
    """
    path = Path(path)
    raw, wanted = _read_deepbench(path, precisions, ("M", "N", "K", "latency_ms"), "GEMM")
    num = raw[["M", "N", "K", "latency_ms"]].apply(pd.to_numeric, errors="coerce").astype(float)
    cache: dict[str, Device | None] = {}
    device = raw["gpu"].map(lambda g: _resolve(_DEEPBENCH_GPUS.get(g, g), cache))
    std = pd.DataFrame({
        "op": "gemm", "family": Family.LINEAR.value, "device_name": raw["gpu"], "source": str(path),
        "latency_ms": num["latency_ms"], "B": 1.0, "M": num["N"], "N": num["K"], "K": num["M"],
        "dtype": raw["precision"].map(_DEEPBENCH_DTYPES),
        "device": device.map(lambda d: None if d is None else d.key),
    })
    reasons = _skip_reasons(std, missing=num.isna().any(axis=1) | ~np.isfinite(num).all(axis=1))
    counts = Counter(reasons.dropna())
    if counts:
        log.warning("%s: skipped %d of %d rows: %s", path, sum(counts.values()), len(std), dict(counts))
    std = std[reasons.isna()]
    if std.empty:
        raise DataError(f"{path}: no usable rows for precisions {sorted(wanted)} (skipped: {dict(counts)}); "
                        "check the precision filter and the device library")
    return _finish(std.reset_index(drop=True), cache, counts, {str(path): dict(counts)} if counts else {})


def _read_deepbench(path: Path, precisions: Iterable[str], columns: tuple[str, ...],
                    kind: str) -> tuple[pd.DataFrame, set[str]]:
    """The rows of a DeepBench table (deepbench_gemm.csv / deepbench_conv.csv) of the wanted precisions."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass the path of deepbench_{kind.lower()}.csv")
    wanted = set(precisions)
    if unknown := wanted - set(_DEEPBENCH_DTYPES):
        raise InputError(f"unknown DeepBench precision(s) {sorted(unknown)}; "
                         f"expected some of {sorted(_DEEPBENCH_DTYPES)}")
    raw = _read_csv(path)
    _require(raw, ("gpu", "precision", *columns), path, schema=f"DeepBench {kind}")
    return raw[raw["precision"].isin(wanted)], wanted


# DeepBench conv columns -> ours (its N and K are batch and filters, not GEMM dims)
_DEEPBENCH_CONV_SHAPE = {"N": "conv_n", "C": "conv_c", "H": "conv_h", "W": "conv_w", "K": "conv_k", "R": "conv_r",
                         "S": "conv_s", "pad_h": "pad_h", "pad_w": "pad_w", "stride_h": "stride_h", "stride_w": "stride_w"}
DEEPBENCH_CONV_PASSES = {"fwd": "fwd_ms", "dgrad": "bwd_data_ms", "wgrad": "bwd_filter_ms"}


def load_deepbench_conv(path: str | Path, *, precisions: Iterable[str] = ("fp32",)) -> pd.DataFrame:
    """Load Baidu DeepBench convolution times: one row per (shape, pass), with the kernel a traced model
    gets for that pass (:func:`neusight.kernels.ops_gemm.conv2d_pass_kernels`).

    DeepBench times cuDNN's forward, backward-data and backward-filter kernels (the fastest algorithm of
    its cuDNN version) of the same shape: input ``N x C x H x W``, ``K`` filters of ``R x S``, padding and
    stride per axis, one group, no bias.

    Returns
    -------
    pandas.DataFrame
        ``device, device_name, source, shape, pass, family, kernel, B, M, N, K, rows, cols, flops,
        algo_flops, bytes, dtype, latency_ms`` plus the shape as ``conv_n, conv_c, conv_h, conv_w, conv_k,
        conv_r, conv_s, pad_h, pad_w, stride_h, stride_w``; ``shape`` numbers the DeepBench row, ``pass`` is
        fwd, dgrad or wgrad. A pass without a time, a GPU the device library lacks, a non-positive time or
        an impossible shape is skipped, counted per :data:`SKIP_REASONS` in the log.
    """
    from neusight.kernels.ops_gemm import conv2d_pass_kernels

    path = Path(path)
    raw, wanted = _read_deepbench(path, precisions, (*_DEEPBENCH_CONV_SHAPE, *DEEPBENCH_CONV_PASSES.values()), "conv")
    raw = raw.reset_index(drop=True)
    shape = raw[list(_DEEPBENCH_CONV_SHAPE)].apply(pd.to_numeric, errors="coerce").astype(float)
    shape.columns = list(_DEEPBENCH_CONV_SHAPE.values())
    cache: dict[str, Device | None] = {}
    device = raw["gpu"].map(lambda g: _resolve(_DEEPBENCH_GPUS.get(g, g), cache))
    kernels: dict[int, dict | None] = {}
    for i, v in shape.iterrows():
        dims = v.to_numpy()
        if not (np.isfinite(dims).all() and (dims == np.round(dims)).all()):
            kernels[i] = None
            continue
        try:
            kernels[i] = conv2d_pass_kernels(*(int(v[c]) for c in ("conv_n", "conv_c", "conv_h", "conv_w", "conv_k",
                                                                   "conv_r", "conv_s")),
                                             stride=(int(v["stride_h"]), int(v["stride_w"])),
                                             padding=(int(v["pad_h"]), int(v["pad_w"])),
                                             dtype=_DEEPBENCH_DTYPES[raw.at[i, "precision"]])
        except ValueError:
            kernels[i] = None
    parts = []
    for name, col in DEEPBENCH_CONV_PASSES.items():
        lat = pd.to_numeric(raw[col], errors="coerce").astype(float)
        ks = [None if kernels[i] is None else kernels[i][name] for i in raw.index]
        part = pd.DataFrame({"device": device.map(lambda d: None if d is None else d.key), "device_name": raw["gpu"],
                             "source": str(path), "shape": raw.index, "pass": name, "family": Family.CONV.value,
                             "kernel": [k.name if k else None for k in ks], "latency_ms": lat,
                             "dtype": raw["precision"].map(_DEEPBENCH_DTYPES)})
        part[["B", "M", "N", "K"]] = np.array([k.dims if k else (np.nan,) * 4 for k in ks], dtype=float)
        part["rows"], part["cols"] = np.nan, np.nan
        part["flops"] = [k.flops if k else np.nan for k in ks]
        part["algo_flops"] = [k.algo_flops if k else np.nan for k in ks]
        part["bytes"] = [k.bytes if k else np.nan for k in ks]
        part["channel_align"] = [float(k.channel_align) if k else np.nan for k in ks]
        reasons = pd.Series(None, index=part.index, dtype=object)
        for mask, reason in ((lat.isna() | ~np.isfinite(lat) | shape.isna().any(axis=1), "missing_value"),
                             (part["device"].isna(), "unknown_device"), (~(lat > 0), "non_positive_latency"),
                             (part["kernel"].isna(), "non_positive_dims")):
            reasons[mask.to_numpy(dtype=bool) & reasons.isna().to_numpy()] = reason
        parts.append(pd.concat([part, shape], axis=1).assign(_skip=reasons))
    out = pd.concat(parts, ignore_index=True)
    counts = Counter(out["_skip"].dropna())
    if counts:
        log.warning("%s: skipped %d of %d (shape, pass) rows: %s", path, sum(counts.values()), len(out), dict(counts))
    out = out[out["_skip"].isna()].drop(columns="_skip").reset_index(drop=True)
    if out.empty:
        raise DataError(f"{path}: no usable rows for precisions {sorted(wanted)} (skipped: {dict(counts)}); "
                        "check the precision filter and the device library")
    return out


# --- reading and validating one file ---------------------------------------------------------------

def _expand_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not items:
        raise DataError("no paths given; pass a CSV file, a directory of CSVs, or a list of them")
    files: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            found = sorted(item.rglob("*.csv"))
            if not found:
                raise DataError(f"{item}: directory holds no *.csv files; point at a kernel-trace directory")
            files += found
        elif item.is_file():
            files.append(item)
        else:
            raise DataError(f"{item}: no such file or directory; check the path "
                            f"(relative paths start at {Path.cwd()})")
    return files


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        raw = pd.read_csv(path, low_memory=False)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as a CSV ({exc}); "
                        "expected a header line and comma-separated rows") from exc
    raw.columns = [str(c).strip() for c in raw.columns]
    return raw


def _require(raw: pd.DataFrame, columns: Iterable[str], path: Path, schema: str = "kernel-trace") -> None:
    if missing := [c for c in columns if c not in raw.columns]:
        raise DataError(f"{path}: missing required column(s) {missing} of the {schema} schema; "
                        f"received columns {list(raw.columns)}; add them (names are case-sensitive) "
                        "or leave the file out")


def _family(value: Family | str) -> Family:
    try:
        return Family(value)
    except ValueError:
        raise InputError(f"unknown kernel family {value!r}; expected one of {[f.value for f in Family]}") from None


def _resolve(name: str, cache: dict[str, Device | None]) -> Device | None:
    """The library Device of a name, None if unknown (cached: one lookup per distinct name)."""
    if name not in cache:
        try:
            cache[name] = load_device(name)
        except DeviceError:
            cache[name] = None
    return cache[name]


def _read_trace_file(path: Path, cache: dict[str, Device | None]) -> tuple[pd.DataFrame, Counter]:
    """One CSV -> the standardised rows that pass every check, and the skip counts."""
    return _standardize(_read_csv(path), path, cache)


def kernel_frame(raw: pd.DataFrame, *, source: str = "<DataFrame>", measured: bool = True) -> pd.DataFrame:
    """A DataFrame in the shared kernel-CSV schema -> the tidy frame of :func:`load_kernel_traces`.

    With ``measured=False`` (rows to predict), ``Latency``, ``Kernel Name`` and the launch columns may be
    absent: they are filled with placeholders (latency 1 ms, no kernel name, a 1x1x1 launch). Rows are
    never dropped silently: a row that is not usable raises (``measured=False``) or is counted.
    """
    raw = raw.copy()
    if not measured:
        for col, fill in {"Latency": 1.0, "Kernel Name": "", **{c: 1 for c in _LAUNCH}}.items():
            if col not in raw.columns:
                raw[col] = fill
        raw["Kernel Name"] = raw["Kernel Name"].fillna("")
    cache: dict[str, Device | None] = {}
    part, counts = _standardize(raw, Path(source), cache)
    if not measured and counts.get("unknown_device"):
        known = {n for n in part["device_name"].unique()}
        bad = sorted({str(n) for n in raw["Device"].dropna().unique()} - {str(n) for n in known})
        raise DataError(f"{source}: Device {', '.join(repr(b) for b in bad)} is not a GPU neusight knows; use a key or "
                        f"torch.cuda.get_device_name() string from neusight.list_devices(), or add a spec YAML")
    if not measured and counts:
        raise DataError(f"{source}: {sum(counts.values())} of {len(raw)} rows cannot be predicted ({dict(counts)}); "
                        f"known OPNames are {sorted(_OPS)}, Device must be a GPU name neusight knows, dims > 0")
    by_file = {source: dict(counts)} if counts else {}
    return _finish(part, cache, counts, by_file)


def _standardize(raw: pd.DataFrame, path: Path, cache: dict[str, Device | None]) -> tuple[pd.DataFrame, Counter]:
    _require(raw, ("OPName", "Latency", "Device"), path)
    op = raw["OPName"].astype(object).where(raw["OPName"].notna()).map(
        lambda s: s.strip() if isinstance(s, str) else s)
    family = op.map({k: v.family.value for k, v in _OPS.items()})
    shape_cols = dict.fromkeys(c for f in family.dropna().unique() for c in _SHAPE_COLUMNS[Family(f)])
    _require(raw, (*_REQUIRED, *shape_cols), path)
    if raw.empty:
        raise DataError(f"{path}: no data rows, only a header; remove the file or record some kernels")

    numeric = ["Latency", *_LAUNCH, *_OPTIONAL, *shape_cols]
    num = raw[[c for c in numeric if c in raw.columns]].apply(pd.to_numeric, errors="coerce").astype(float)
    names = raw["Device"].astype(object)
    devices = {n: _resolve(n, cache) for n in names.dropna().unique()}
    std = pd.DataFrame({
        "op": op, "family": family, "device_name": names, "source": str(path),
        "device": names.map({n: (d.key if d else None) for n, d in devices.items()}),
        "latency_ms": num["Latency"], "kernel_name": raw["Kernel Name"].astype(object),
        "kernels": raw["Kernels"].astype(object) if "Kernels" in raw.columns else None,
        "dtype": "float32",  # the shared sweeps are all FP32 (TF32 off)
    })
    for csv_col, col in {**_LAUNCH, **_OPTIONAL}.items():
        std[col] = num[csv_col] if csv_col in num.columns else np.nan
    for col in _ALL_SHAPE:
        std[col] = num[col] if col in num.columns else np.nan

    common = ["Latency", *_LAUNCH]
    missing = (raw[["OPName", "Device", "Kernel Name"]].isna().any(axis=1)
               | num[common].isna().any(axis=1) | ~np.isfinite(num[common]).all(axis=1))
    for fam, cols in _SHAPE_COLUMNS.items():
        present = [c for c in cols if c in num.columns]
        if len(present) == len(cols):
            missing |= (family == fam.value) & num[present].isna().any(axis=1)
    reasons = _skip_reasons(std, missing)
    counts = Counter(reasons.dropna())
    if reasons.notna().all():
        raise DataError(f"{path}: no usable rows out of {len(raw)} (skipped: {dict(counts)}); "
                        f"known OPNames are {sorted(_OPS)}, devices must be known to neusight.devices")
    if counts:
        log.warning("%s: skipped %d of %d rows: %s", path, sum(counts.values()), len(raw), dict(counts))
    return std[reasons.isna()], counts


def _skip_reasons(std: pd.DataFrame, missing: pd.Series) -> pd.Series:
    """The first :data:`SKIP_REASONS` entry that applies to each row, None for a usable row."""
    reasons = pd.Series(None, index=std.index, dtype=object)

    def mark(mask: pd.Series, reason: str) -> None:
        reasons[mask.to_numpy(dtype=bool) & reasons.isna().to_numpy()] = reason

    mark(missing, "missing_value")
    mark(std["family"].isna(), "unknown_op")
    mark(std["device"].isna(), "unknown_device")
    mark(~(std["latency_ms"] > 0), "non_positive_latency")
    mark(~_dims_ok(std), "non_positive_dims")
    return reasons


def _dims_ok(std: pd.DataFrame) -> pd.Series:
    """Each row's shape columns are positive integers (conv padding >= 0; conv output not empty)."""
    ok = pd.Series(True, index=std.index)
    for fam, cols in _SHAPE_COLUMNS.items():
        rows = (std["family"] == fam.value).to_numpy()
        if not rows.any():
            continue
        vals = std.loc[rows, list(cols)]
        lower = pd.Series(1.0, index=list(cols))
        if fam is Family.CONV:
            lower["Padding"] = 0.0
        good = ((vals >= lower) & (vals % 1 == 0)).all(axis=1)
        if fam is Family.CONV:
            # same emptiness rule as formulas.conv2d_implicit_gemm (dilation 1), checked here so the
            # row is counted instead of raising later
            p = (vals["Input_Size"] + 2 * vals["Padding"] - vals["Kernel_Szie"]) // vals["Stride"] + 1
            good &= p > 0
        ok[rows] = good.to_numpy()
    return ok


# --- derived columns -------------------------------------------------------------------------------

def _per_unique(frame: pd.DataFrame, keys: list[str], fn: Callable[..., tuple[float, ...]]) -> np.ndarray:
    """``fn`` evaluated once per distinct ``keys`` tuple, broadcast back to the rows (n_rows x outputs).

    The formulas are scalar functions; the sweeps repeat each shape on every device, so this calls
    them a few times fewer than there are rows (~80k calls for the 323k shared rows) and keeps the
    rest vectorised."""
    codes = frame.groupby(keys, sort=False, dropna=False).ngroup().to_numpy()
    uniq = frame.drop_duplicates(keys)[keys].itertuples(index=False, name=None)
    return np.array([fn(*row) for row in uniq], dtype=float)[codes]


def _gemm_row(op: str, dtype: str, b: float, m: float, n: float, k: float) -> tuple[float, ...]:
    spec = _OPS[op]
    kern = formulas.gemm(int(b), int(m), int(n), int(k), dtype=dtype, family=spec.family,
                         shared_b=spec.family is Family.LINEAR, bias=spec.bias)
    return (*kern.dims, kern.flops, kern.bytes)


def _conv_row(dtype: str, batch: float, cin: float, cout: float, ks: float, hw: float, stride: float,
              pad: float) -> tuple[float, ...]:
    kern = formulas.conv2d_implicit_gemm(int(batch), int(cin), int(hw), int(hw), int(cout), int(ks), int(ks),
                                         stride=(int(stride),) * 2, padding=(int(pad),) * 2, dtype=dtype)
    return (*kern.dims, kern.flops, kern.bytes, kern.min_flops)


def _rowwise_row(op: str, dtype: str, b: float, h: float) -> tuple[float, ...]:
    spec, rows, cols = _OPS[op], int(b), int(h)
    if spec.family is Family.SOFTMAX:
        kern = formulas.softmax(rows, cols, dtype=dtype)
    elif spec.family is Family.LAYERNORM:
        kern = formulas.layernorm(rows, cols, dtype=dtype)  # nn.LayerNorm(H): affine by default
    else:
        kern = formulas.elementwise(op, rows * cols, n_tensor_inputs=spec.n_inputs,
                                    flops_per_elem=spec.flops_per_elem, cols=cols, dtype=dtype)
    return (*kern.dims, kern.flops, kern.bytes)


def _kernel_columns(std: pd.DataFrame) -> pd.DataFrame:
    """Dims, flops and bytes of every row, from the formulas, by family."""
    out = pd.DataFrame(np.nan, index=std.index, columns=["B", "M", "N", "K", "rows", "cols", "flops", "algo_flops", "bytes",
                                                         "conv_batch", "conv_cin", "conv_hw", "conv_cout",
                                                         "conv_ksize", "conv_stride", "conv_pad"])
    fam = std["family"]
    gemm = (fam == Family.LINEAR.value) | (fam == Family.BMM.value)
    if gemm.any():
        out.loc[gemm, ["B", "M", "N", "K", "flops", "bytes"]] = _per_unique(
            std[gemm], ["op", "dtype", *_GEMM_SHAPE], _gemm_row)
    conv = fam == Family.CONV.value
    if conv.any():
        out.loc[conv, ["B", "M", "N", "K", "flops", "bytes", "algo_flops"]] = _per_unique(
            std[conv], ["dtype", *_CONV_SHAPE], _conv_row)
        out.loc[conv, ["conv_batch", "conv_cin", "conv_cout", "conv_ksize", "conv_hw", "conv_stride", "conv_pad"]] = (
            std.loc[conv, list(_CONV_SHAPE)].to_numpy())
    row = ~(gemm | conv)
    if row.any():
        out.loc[row, ["rows", "cols", "flops", "bytes"]] = _per_unique(
            std[row], ["op", "dtype", *_ROW_SHAPE], _rowwise_row)
    out["algo_flops"] = out["algo_flops"].fillna(out["flops"])
    return out


def _device_columns(devices: Iterable[Device]) -> pd.DataFrame:
    """One row per device: ``device`` (key) + ``dev_<field>`` for every numeric field of Device,
    vendor, architecture and fp32_dual_issue."""
    hints = typing.get_type_hints(Device)
    names = [f.name for f in dataclasses.fields(Device) if f.name != "interconnect_group"   # multi-GPU topology
             and (_is_number(hints.get(f.name)) or f.name in ("vendor", "architecture", "fp32_dual_issue"))]
    rows = [{"device": d.key, **{f"dev_{n}": getattr(d, n) for n in names}} for d in devices]
    frame = pd.DataFrame(rows, columns=["device", *(f"dev_{n}" for n in names)])
    numeric = [f"dev_{n}" for n in names if _is_number(hints.get(n))]
    frame[numeric] = frame[numeric].astype(float)  # None (a peak the vendor does not publish) -> NaN
    return frame


def _is_number(hint: object) -> bool:
    kinds = {a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)}
    return bool(kinds) and kinds <= {int, float}


def _finish(std: pd.DataFrame, cache: dict[str, Device | None], skipped: Counter,
            by_file: dict[str, dict[str, int]]) -> pd.DataFrame:
    """Standardised rows -> the tidy frame of :data:`COLUMNS` + ``dev_*``."""
    std = std.reset_index(drop=True)
    out = _kernel_columns(std)
    for col in ("family", "op", "device", "device_name", "source", "dtype", "latency_ms"):
        out[col] = std[col]
    out["kernel_name"] = std["kernel_name"] if "kernel_name" in std.columns else None
    for col in [*_LAUNCH.values(), *_OPTIONAL.values()]:
        out[col] = std[col].astype(float) if col in std.columns else np.nan
    names = out["kernel_name"].astype(object).where(out["kernel_name"].notna())
    out[["tile_m", "tile_n"]] = parse_tile(names).to_numpy()
    # NB: Tensile GEMMs (Cijk_...) are launched with hipExtModuleLaunchKernel, whose grid is the global
    # work size in work-items; the profiler records that. In blocks (as for every other kernel) grid x is
    # grid x / block x: then workgroups = tiles (x GSU split-K factor), checked on the MI100/MI210 sweeps.
    items = names.fillna("").astype(str).str.match(_WORK_ITEM_GRID_RE).to_numpy(dtype=bool)
    out.loc[items, "grid_x"] = np.ceil(out.loc[items, "grid_x"] / out.loc[items, "block_x"])
    out["num_blocks"] = out["grid_x"] * out["grid_y"] * out["grid_z"]
    out["threads_per_block"] = out["block_x"] * out["block_y"] * out["block_z"]
    # `Kernels` is ";a;b;c" (leading separator): count the non-empty entries
    kernels = std["kernels"] if "kernels" in std.columns else pd.Series(np.nan, index=std.index)
    out["n_kernels"] = kernels.astype(object).where(kernels.notna()).astype("string").str.count(r"[^;]+").astype(float)
    out = out[list(COLUMNS)]
    used = {d.key: d for d in cache.values() if d is not None}
    out = out.merge(_device_columns(used[k] for k in out["device"].unique()), on="device", how="left")
    # The collector's `Blocks per SM` / `Warps per SM` are grid totals over the SMs (not occupancy):
    # blocks / sm_count and blocks x ceil(threads / 32) / sm_count, exact on every NVIDIA row. Where a file
    # lacks them (AMD) they are derived the same way. NB: warps of 32 threads, also on AMD (wavefront 64).
    blocks = out["num_blocks"] / out["dev_sm_count"]
    out["blocks_per_sm"] = out["blocks_per_sm"].fillna(blocks)
    out["warps_per_sm"] = out["warps_per_sm"].fillna(blocks * np.ceil(out["threads_per_block"] / 32))
    out.attrs["skipped"] = {r: int(skipped.get(r, 0)) for r in SKIP_REASONS}
    out.attrs["skipped_by_file"] = by_file
    return out

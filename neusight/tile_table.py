"""The tile table: which tile (GEMM) or launch geometry (row-wise kernels) a kernel gets, learned from
measured traces by nearest neighbour.

- GEMM families (linear, bmm, conv): one index per family and measured GPU; key = log2 (B, M, N, K);
  value = output tile (along M, along K) parsed from the cuBLAS / cuDNN / Tensile kernel name. A kernel
  chooses among the tiles its GPU's library used (``gemm_candidates``; the shape keys record where each
  was used). A GPU not in the table takes the tiles of its nearest known GPU in device space (log2 of
  SMs, per-SM GEMM FLOP/s, per-SM bandwidth, L2 size), since the library's tiles follow architecture and
  SM resources.
- row-wise families (elementwise, softmax, layernorm): key = (log2 rows, log2 cols); value = elements
  per thread block and threads per block, measured from the launch grid. Families without data
  (reductions, copies, norms, pooling, embedding) use the elementwise geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from neusight.devices import Device
from neusight.kernels.base import Family
from neusight.tiles import GEMM_FAMILIES, device_rates

# A tile the library used for fewer than this share of a GPU's measured shapes is not a candidate: rare
# picks (a 32x32 tile for a handful of tiny GEMMs) would otherwise set the bound of every shape, since the
# smallest tile always pads least.
MIN_TILE_SHARE = 0.10

# queries per brute-force block of the nearest-neighbour search (a block's distances: chunk x keys floats)
_QUERY_CHUNK = 1024

ROW_FAMILIES = (Family.ELEMENTWISE.value, Family.SOFTMAX.value, Family.LAYERNORM.value)


def device_key(device: Device) -> np.ndarray:
    """Descriptors of a device for the tile search: log2 of SMs, per-SM GEMM GFLOP/s, per-SM GB/s, L2 MiB."""
    r = device_rates(device)
    return np.log2([r.sm_count, r.gemm_flops / r.sm_count / 1e9, r.bandwidth / r.sm_count / 1e9,
                    device.l2_cache_mib])


@dataclass
class _Index:
    keys: np.ndarray     # (n, d) float32, normalised
    values: np.ndarray   # (n, v) float32
    mean: np.ndarray
    std: np.ndarray

    def query(self, raw: np.ndarray) -> np.ndarray:
        """The values of the nearest key (Euclidean, exact; the first key on a tie) of each row of ``raw``."""
        z = ((raw - self.mean) / self.std).astype(np.float32).astype(float)
        keys = self.keys.astype(float)
        nearest = np.empty(len(z), dtype=np.intp)
        for start in range(0, len(z), _QUERY_CHUNK):     # brute force in chunks: the indexes hold ~2k keys
            part = z[start:start + _QUERY_CHUNK]
            dist = sum((part[:, j, None] - keys[None, :, j]) ** 2 for j in range(keys.shape[1]))
            nearest[start:start + len(part)] = np.argmin(dist, axis=1)
        return self.values[nearest]

    def state(self) -> dict[str, np.ndarray]:
        return {"keys": self.keys, "values": self.values, "mean": self.mean, "std": self.std}


def _index(raw: np.ndarray, values: np.ndarray, weights: np.ndarray | None = None) -> _Index:
    # de-duplicate keys (many sweeps repeat shapes); keep the first value seen for a key
    mean = raw.mean(0)
    std = raw.std(0) + 1e-6
    if weights is not None:
        std = std / weights
    keys = ((raw - mean) / std).astype(np.float32)
    keys, first = np.unique(np.round(keys, 4), axis=0, return_index=True)
    return _Index(keys, values[first].astype(np.float32), mean.astype(np.float32), std.astype(np.float32))


class TileTable:
    """Nearest-neighbour tile and launch-geometry lookup, fitted on a loaded trace frame."""

    def __init__(self, indexes: dict[str, _Index]) -> None:
        self.indexes = indexes

    # -------------------------------------------------------------------------------- fitting
    @classmethod
    def fit(cls, df: pd.DataFrame, devices: dict[str, Device]) -> "TileTable":
        """``df``: a :func:`neusight.dataset.load_kernel_traces` frame; ``devices``: key -> Device."""
        indexes: dict[str, _Index] = {}
        for fam in GEMM_FAMILIES:
            for dev, d in df[(df["family"] == fam) & df["tile_m"].notna()].groupby("device"):
                # NB: kernel names give the tile in cuBLAS's column-major view: tile_m runs along our K.
                values = d[["tile_n", "tile_m"]].to_numpy(float)
                indexes[f"{fam}@{dev}"] = _index(_gemm_shape_key(d), values)
                indexes[f"device@{dev}"] = _index(device_key(devices[dev])[None, :], np.zeros((1, 1)))
        for fam in ROW_FAMILIES:
            d = df[(df["family"] == fam) & (df["num_blocks"] > 0)]
            if d.empty:
                continue
            numel = d["rows"].to_numpy(float) * d["cols"].to_numpy(float)
            values = np.column_stack([numel / d["num_blocks"].to_numpy(float), d["threads_per_block"].to_numpy(float)])
            indexes[fam] = _index(_row_key(d["rows"].to_numpy(float), d["cols"].to_numpy(float)), values)
        return cls(indexes)

    # -------------------------------------------------------------------------------- lookup
    def gemm_candidates(self, family: str, device: Device) -> np.ndarray:
        """The (tile along M, tile along K) pairs the library used for ``family`` on ``device`` (or its nearest
        measured GPU), most used first: the tiles :func:`neusight.tiles.gemm_tiles` chooses among.
        Conv without its own table uses linear's."""
        fam = family if any(k.startswith(family + "@") for k in self.indexes) else Family.LINEAR.value
        known = [k.split("@", 1)[1] for k in self.indexes if k.startswith(fam + "@")]
        if not known:
            raise KeyError("tile table has no GEMM entries; refit it on traces with linear or bmm kernels")
        values = self.indexes[f"{fam}@{self.nearest_device(device, known)}"].values
        tiles, counts = np.unique(values.astype(float), axis=0, return_counts=True)
        keep = counts >= MIN_TILE_SHARE * counts.sum()
        tiles, counts = tiles[keep], counts[keep]
        order = np.lexsort((tiles[:, 1], tiles[:, 0], -counts))     # deterministic: by use, then by size
        return tiles[order]

    def nearest_device(self, device: Device, known: list[str]) -> str:
        """The measured GPU whose descriptors are closest to ``device`` (itself when measured)."""
        if device.key in known:
            return device.key
        keys = np.vstack([self.indexes[f"device@{k}"].mean for k in known])
        return known[int(np.argmin(((keys - device_key(device)) ** 2).sum(1)))]

    def launch_geometry(self, family: str, rows, cols) -> tuple[np.ndarray, np.ndarray]:
        """(elements per block, threads per block) of a row-wise kernel."""
        idx = self.indexes.get(family) or self.indexes[Family.ELEMENTWISE.value]
        v = idx.query(_row_key(np.asarray(rows, float), np.asarray(cols, float)))
        return v[:, 0].astype(float), v[:, 1].astype(float)

    # -------------------------------------------------------------------------------- (de)serialisation
    def state(self) -> dict[str, np.ndarray]:
        """Flat name -> array dict (for a tensors-only checkpoint)."""
        return {f"{fam}.{name}": arr for fam, idx in self.indexes.items() for name, arr in idx.state().items()}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "TileTable":
        fams = sorted({k.rsplit(".", 1)[0] for k in state})  # "linear@t4", "device@t4", "softmax", ...
        return cls({f: _Index(*(np.asarray(state[f"{f}.{n}"]) for n in ("keys", "values", "mean", "std"))) for f in fams})


def _gemm_shape_key(d: pd.DataFrame) -> np.ndarray:
    return np.log2(d[["B", "M", "N", "K"]].to_numpy(float).clip(1))


def _row_key(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    return np.log2(np.column_stack([rows, cols]).clip(1))

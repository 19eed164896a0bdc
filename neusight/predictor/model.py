"""The kernel predictor: tile table + one utilization MLP per family; fit / predict / save / load."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
import torch

from neusight.devices import Device, load_device
from neusight.errors import CheckpointError
from neusight.kernels.base import EXACT_BYTES_GEMMS
from neusight.predictor.features import (BORROW_FRACTION, BORROWS_ELEMENTWISE, CONV_BACKWARD_CLASSES,
                                         DEVICE_DESCRIPTORS, GRADIENT_KERNEL, LAYOUTS, MODEL_FAMILIES,
                                         backward_kernels, conv_backward_class, decompose, feature_names,
                                         n_work_features, without_tensor_cores)
from neusight.predictor.mlp import MLPConfig, MLPEnsemble, UtilizationMLP, build_model
from neusight.predictor.train import FitResult, fit_ensemble_logo, fit_mlp, mape, predict_mlp, size_weights
from neusight.tile_table import TileTable
from neusight.tiles import GEMM_FAMILIES, ROW_REREADS, softmax_overlaps

log = logging.getLogger(__name__)

FORMAT_VERSION = 3   # 2: monotone utilization model (work / device features); 3: envelope over the training GPUs' device vectors
TRAINING_GPUS = ("p4", "p100-pcie-16gb", "t4", "v100-pcie-32gb", "a100-pcie-40gb")
SHIPPED = Path(__file__).resolve().parents[2] / "data" / "predictor"
# for AMD GPUs: the same model trained on the AMD kernel sweeps (MI100, MI210), NeuSight's protocol for AMD
SHIPPED_AMD = SHIPPED.with_name("predictor-amd")
FILES = ("weights.pt", "tile_table.pt", "manifest.json")
CONV_BACKWARD_RANGE = (0.2, 10.0)   # plausible convolution-gradient factors (fitted within it, checked on load)


@dataclass
class PredictorConfig:
    """What a predictor is fitted with (saved in its manifest)."""

    families: dict[str, MLPConfig] = field(default_factory=lambda: {f: MLPConfig() for f in MODEL_FAMILIES})
    # whole GPUs held out for early stopping; ("logo",) = leave-one-GPU-out over the training GPUs
    val_devices: tuple[str, ...] = ("logo",)
    seed: int = 0


class Predictor:
    """Per-family utilization MLPs over the tile decomposition (scikit-learn style fit / predict).

    Examples
    --------
    >>> p = Predictor.load()                       # the shipped checkpoint in data/predictor
    >>> sorted(p.models_)[:2]
    ['bmm', 'conv']
    """

    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        # class (CONV_BACKWARD_CLASSES) -> how much longer cuDNN's convolution-gradient kernels work than the
        # GEMM model predicts for their shape; fitted by neusight.conv_backward, {} = none
        self.conv_backward_: dict[str, float] = {}
        # cuBLAS operand layout (ops_gemm.gemm_layout) -> the GEMM model that predicts 2-D GEMMs of that layout
        # (features.layout_model); {} = every 2-D GEMM by the linear model
        self.layout_models_: dict[str, str] = {}

    # ------------------------------------------------------------------------------------ fit
    def fit(self, df: pd.DataFrame, *, progress: bool = False, resume_dir: str | os.PathLike | None = None) -> "Predictor":
        """Fit the tile table and the family MLPs on a :func:`neusight.dataset.load_kernel_traces` frame.

        With ``resume_dir``, each family's fitted model is kept there as it completes, and a fit that was
        interrupted picks up the finished families instead of training them again (the caller names the
        directory after the data hash, so a changed dataset starts afresh).
        """
        devices = {k: load_device(k) for k in df["device"].unique()}
        self.table_ = TileTable.fit(df, devices)
        design = self._design(df, devices)
        self.models_: dict[str, UtilizationMLP | MLPEnsemble] = {}
        self.fits_: dict[str, FitResult] = {}
        self.metrics_: dict[str, dict] = {}
        for fam, cfg in self.config.families.items():
            d = design[design["model_family"] == fam]
            if fam in BORROWS_ELEMENTWISE and not d.empty:
                ew = design[design["model_family"] == "elementwise"]
                borrowed = ew.sample(frac=BORROW_FRACTION, random_state=self.config.seed).assign(native=0.0)
                d = pd.concat([d, borrowed])
            if d.empty:
                log.warning("no training rows of family %s; it falls back to the elementwise model", fam)
                continue
            feats = list(feature_names(fam))
            val = tuple(v for v in self.config.val_devices if v in set(d["device"]))
            t0 = time.time()
            res, logo = _load_partial(resume_dir, fam, feats, cfg)
            if res is None:
                args = (d[feats].to_numpy(float), d["roofline_ms"].to_numpy(float), d["latency_ms"].to_numpy(float),
                        d["device"].to_numpy(), cfg)
                weights = size_weights(d["log2_waves_ref"].to_numpy(float), cfg.size_weight)
                if self.config.val_devices == ("logo",):
                    res, logo = fit_ensemble_logo(*args, progress=progress, desc=fam, n_mono=n_work_features(fam),
                                                  weights=weights)
                elif cfg.ensemble > 1:
                    raise ValueError(f"family {fam}: ensemble={cfg.ensemble} needs val_devices=[logo] (each member "
                                     f"is fitted as neusight-train fits one)")
                else:
                    res, logo = fit_mlp(*args, val, progress=progress, desc=fam, n_mono=n_work_features(fam),
                                        weights=weights), {}
                _save_partial(resume_dir, fam, feats, cfg, res, logo)
            else:
                log.info("%s: resumed from %s", fam, resume_dir)
            self.models_[fam], self.fits_[fam] = res.model, res
            pred, _ = predict_mlp(res.model, d[feats].to_numpy(float), d["roofline_ms"].to_numpy(float))
            native = (d["native"] != 0).to_numpy() if "native" in d else np.ones(len(d), bool)
            per_dev = {dev: round(mape(pred[(d["device"] == dev).to_numpy() & native],
                                       d["latency_ms"].to_numpy()[(d["device"] == dev).to_numpy() & native]), 2)
                       for dev in sorted(set(d["device"]))}
            self.metrics_[fam] = {"rows": int(native.sum()), "borrowed_rows": int((~native).sum()),
                                  "best_epoch": res.best_epoch, "val_devices": list(res.val_groups),
                                  **({"ensemble_best_epochs": list(res.member_epochs),
                                      "leave_one_gpu_out_of": "the mean of the ensemble's fits"}
                                     if res.member_epochs else {}),
                                  "leave_one_gpu_out_mape": logo,
                                  **({"loss_weight": f"waves^{cfg.size_weight:g} (the leave-one-GPU-out MAPE is "
                                                     f"weighted the same way)"} if cfg.size_weight else {}),
                                  "fit_s": round(time.time() - t0, 1), "train_mape_per_device": per_dev,
                                  "overhead_ms": round(float(res.model.overhead_ms.detach()), 5)}
            log.info("%s: %d rows, best epoch %d, MAPE per GPU %s", fam, len(d), res.best_epoch, per_dev)
        self.train_devices_ = tuple(sorted(devices))
        return self

    def _design(self, df: pd.DataFrame, devices: Mapping[str, Device]) -> pd.DataFrame:
        parts = []
        for dev, d in df.groupby("device", sort=True):
            dec = decompose(d, devices[dev], self.table_)
            parts.append(pd.concat([d, dec.drop(columns=[c for c in dec.columns if c in d.columns])], axis=1))
        return pd.concat(parts).loc[df.index]

    # ------------------------------------------------------------------------------------ predict
    def predict(self, df: pd.DataFrame, device: Device | str, *, conv_backward: bool = True) -> pd.DataFrame:
        """Predict every kernel row of ``df`` (columns ``family, B, M, N, K, rows, cols, flops, bytes, dtype``;
        optional ``channel_align`` of convolutions, :func:`neusight.predictor.features.without_tensor_cores`)
        on one device. Identical shapes are decomposed and predicted once (one MLP call per family).
        ``conv_backward=False`` leaves out the convolution-gradient factors (used when fitting them).

        Returns a frame indexed like ``df``: tile_m, tile_n, elems_per_block, threads_per_block, tiles,
        waves, bound, roofline_ms, utilization, overhead_ms, latency_ms, beyond_training (the features of the
        row outside the range its model was trained on, comma-separated; "" for none: :func:`beyond_training`),
        model_family. A fused attention kernel's roofline and latency add its softmax's time to its GEMMs'
        (:func:`neusight.tiles.softmax_seconds_per_score`), or take the longer of the two where
        :func:`neusight.tiles.softmax_overlaps`.
        """
        self._check_fitted()
        device = load_device(device)
        keys = ["family", "kernel", "B", "M", "N", "K", "rows", "cols", "flops", "algo_flops", "bytes", "dtype"]
        work = df.reindex(columns=keys).copy()
        work["algo_flops"] = work["algo_flops"].fillna(work["flops"])
        # a convolution whose channels keep it off the tensor cores runs as an FP32 CUDA-core kernel (its bytes stay)
        work.loc[without_tensor_cores(df), "dtype"] = "float32"
        # Winograd and FFT convolutions are FP32 kernels on the FP32 lanes (the conv sweeps' kind); on tensor cores
        # (TF32, FP16, BF16) cuDNN runs convolutions as implicit GEMMs, with every FLOP of the direct algorithm
        work.loc[work["dtype"].astype(str) != "float32", "algo_flops"] = work["flops"]
        work["kernel"] = work["kernel"].astype(object).where(work["kernel"].notna(), "conv_fwd")
        # names matter to convolutions (their kind) and, when this predictor routes layouts, to 2-D GEMMs
        named = ["conv", "linear"] if self.layout_models_ else ["conv"]
        # a gradient softmax / layer norm is bounded without the forward's L2 re-reads (tiles.l2_reread_bytes)
        grad = backward_kernels(df) & work["family"].isin(list(ROW_REREADS)).to_numpy()
        narrow = work["kernel"].astype(str).str.startswith(EXACT_BYTES_GEMMS)   # their bytes are their own
        work["kernel"] = work["kernel"].where(work["family"].isin(named) | narrow, "")
        work.loc[grad, "kernel"] = GRADIENT_KERNEL
        for c in ("B", "M", "N", "K", "rows", "cols"):
            work[c] = pd.to_numeric(work[c], errors="coerce").fillna(-1.0)
        uniq = work.drop_duplicates().reset_index(drop=True)
        dec = decompose(uniq.replace({-1.0: np.nan}), device, self.table_, self.layout_models_)
        out = dec[["model_family", "tile_m", "tile_n", "elems_per_block", "threads_per_block", "tiles", "waves",
                   "bound", "roofline_ms"]].copy()
        out["utilization"] = np.nan
        out["overhead_ms"] = np.nan
        out["latency_ms"] = np.nan
        out["beyond_training"] = ""
        for fam, rows in dec.groupby("model_family"):
            model, fam = self._model_for(fam)
            feats = list(feature_names(fam))
            if fam != rows["model_family"].iloc[0]:   # a fallback model: decompose as its family
                rows = decompose(uniq.loc[rows.index].replace({-1.0: np.nan}).assign(family=fam), device, self.table_)
                cols = ["tile_m", "tile_n", "elems_per_block", "threads_per_block", "tiles", "waves", "bound",
                        "roofline_ms"]
                out.loc[rows.index, cols] = rows[cols]
            x = rows[feats].to_numpy(float)
            lat, u = predict_mlp(model, x, rows["roofline_ms"].to_numpy(float))
            out.loc[rows.index, "beyond_training"] = beyond_training(model, x, feats)
            out.loc[rows.index, "latency_ms"] = lat
            out.loc[rows.index, "utilization"] = u
            out.loc[rows.index, "overhead_ms"] = float(model.overhead_ms.detach())
        # fused attention: its softmax's exponentials and FP32 work run after its GEMMs, or beside them where the
        # tensor cores accumulate in tensor memory (neusight.tiles, above softmax_seconds_per_score): in its bound
        # and its time, at their rates (no utilization of their own)
        soft = dec["softmax_ms"].fillna(0.0) if "softmax_ms" in dec else pd.Series(0.0, index=dec.index)
        hit = soft > 0
        if hit.any():
            over = out.loc[hit, "overhead_ms"]
            if softmax_overlaps(device):
                out.loc[hit, "roofline_ms"] = np.maximum(out.loc[hit, "roofline_ms"], soft[hit])
                out.loc[hit, "latency_ms"] = np.maximum(out.loc[hit, "latency_ms"], over + soft[hit])
            else:
                for col in ("roofline_ms", "latency_ms"):
                    out.loc[hit, col] = out.loc[hit, col] + soft[hit]
            out.loc[hit, "utilization"] = out.loc[hit, "roofline_ms"] / (out.loc[hit, "latency_ms"] - over)
        if conv_backward:
            self._apply_conv_backward(uniq, out)
        merged = work.reset_index().merge(pd.concat([uniq, out], axis=1), on=keys, how="left").set_index("index")
        return merged.loc[df.index, out.columns]

    def device_extrapolation(self, device: Device | str) -> list[dict[str, Any]]:
        """The spec-sheet descriptors of ``device`` (:data:`DEVICE_DESCRIPTORS`) outside the range of the GPUs a
        family model was trained on: one dict per descriptor (``feature``, ``label``, ``value``, ``range``,
        ``families``), [] for a GPU inside every range. Those models hold the descriptor at the range's edge."""
        self._check_fitted()
        device = load_device(device)
        found: dict[str, dict[str, Any]] = {}
        for fam, model in sorted(self.models_.items()):
            names = list(feature_names(fam))
            lo, hi = feature_range(model)
            for feat, (label, spec, show) in DEVICE_DESCRIPTORS.items():
                if feat not in names:
                    continue
                i, v = names.index(feat), spec(device)
                if not _outside(np.array([v]), lo[i], hi[i])[0]:
                    continue
                rng = show(lo[i]) if lo[i] == hi[i] else f"{show(lo[i])}-{show(hi[i])}"
                entry = found.setdefault(feat, {"feature": feat, "label": label, "value": show(v), "range": rng,
                                                "families": []})
                entry["families"].append(fam)
        return list(found.values())

    def _apply_conv_backward(self, rows: pd.DataFrame, out: pd.DataFrame) -> None:
        """Convolution gradients work ``factor`` x as long as the GEMM model predicts (launch overhead
        unchanged), never less than their roofline: utilization / factor, capped at 1."""
        if not self.conv_backward_:
            return
        lat, util = apply_conv_backward(conv_backward_class(rows).to_numpy(), out["latency_ms"].to_numpy(float),
                                        out["overhead_ms"].to_numpy(float), out["roofline_ms"].to_numpy(float),
                                        self.conv_backward_)
        hit = lat != out["latency_ms"].to_numpy(float)
        out.loc[hit, "latency_ms"], out.loc[hit, "utilization"] = lat[hit], util[hit]

    def _model_for(self, fam: str) -> tuple[UtilizationMLP, str]:
        """The MLP for a family and the family whose features it takes: its own; a GEMM family without a
        model falls back to linear (then bmm), every other family to elementwise."""
        if fam in self.models_:
            return self.models_[fam], fam
        order = GEMM_FAMILIES if fam in GEMM_FAMILIES else ("elementwise",)
        for alt in order:
            if alt in self.models_:
                return self.models_[alt], alt
        raise CheckpointError(f"this predictor has no model for family {fam!r} nor a fallback "
                              f"({', '.join(order)}); refit it on traces that include one")

    def _check_fitted(self) -> None:
        if not hasattr(self, "models_"):
            raise CheckpointError("this Predictor is not fitted; call fit() or Predictor.load()")

    # ------------------------------------------------------------------------------------ save / load
    def save(self, path: str | os.PathLike, *, manifest_extra: dict | None = None) -> Path:
        """Write the checkpoint directory atomically (a temporary directory renamed into place)."""
        self._check_fitted()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        tmp.chmod(0o755)
        try:
            weights = {f"{fam}.{k}": v.detach().clone() for fam, m in self.models_.items() for k, v in m.state_dict().items()}
            torch.save(weights, tmp / "weights.pt")
            torch.save({k: torch.as_tensor(v) for k, v in self.table_.state().items()}, tmp / "tile_table.pt")
            manifest = {
                "format_version": FORMAT_VERSION,
                "families": {fam: {"features": list(feature_names(fam)), "hidden": list(self.config.families[fam].hidden),
                                   "config": asdict(self.config.families[fam])} for fam in self.models_},
                "train_devices": list(self.train_devices_),
                "val_devices": list(self.config.val_devices),
                "seed": self.config.seed,
                "metrics": self.metrics_,
                "e2e_scale": float(getattr(self, "e2e_scale_", 1.0)),
                "e2e_floor": float(getattr(self, "e2e_floor_", 1.0)),
                "conv_backward_factors": dict(sorted(getattr(self, "conv_backward_", {}).items())),
                "layout_models": dict(sorted(getattr(self, "layout_models_", {}).items())),
                "torch_version": torch.__version__,
                **(manifest_extra or {}),
            }
            manifest["weights_sha256"] = _sha256(tmp / "weights.pt")
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            if path.exists():
                old = path.with_name(f".{path.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Predictor":
        """Load a checkpoint directory (default: the shipped one), checking it against this code."""
        path = Path(path) if path is not None else SHIPPED
        missing = [f for f in FILES if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"predictor checkpoint {str(path)!r} lacks {', '.join(missing)}; regenerate it "
                                  f"with `neusight-train` or point to a directory written by it")
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            weights = torch.load(path / "weights.pt", weights_only=True, map_location="cpu")
            table = torch.load(path / "tile_table.pt", weights_only=True, map_location="cpu")
        except Exception as e:  # corrupt JSON / pickle / zip
            raise CheckpointError(f"predictor checkpoint {str(path)!r} is corrupt ({type(e).__name__}: {e}); "
                                  f"regenerate it with `neusight-train`") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path}/manifest.json: format_version={manifest.get('format_version')!r}, this "
                                  f"code reads {FORMAT_VERSION}; regenerate the checkpoint with `neusight-train`")
        if manifest.get("weights_sha256") not in (None, _sha256(path / "weights.pt")):
            raise CheckpointError(f"{path}/weights.pt does not match the hash in its manifest; the file was changed "
                                  f"or truncated: regenerate it with `neusight-train`")
        pred = cls(_saved_config(manifest, path))
        pred.models_ = {}
        for fam, spec in manifest.get("families", {}).items():
            if fam not in MODEL_FAMILIES:
                raise CheckpointError(f"{path}: family {fam!r} is not one this code predicts ({', '.join(MODEL_FAMILIES)})")
            expected = list(feature_names(fam))
            if spec.get("features") != expected:
                raise CheckpointError(f"{path}: family {fam!r} was trained on features {spec.get('features')} "
                                      f"({len(spec.get('features') or [])}), this code computes {expected} "
                                      f"({len(expected)}); retrain with `neusight-train`")
            model = build_model(len(expected), pred.config.families[fam], n_work_features(fam))
            state = {k.split(".", 1)[1]: v for k, v in weights.items() if k.split(".", 1)[0] == fam}
            try:
                model.load_state_dict(state)
            except RuntimeError as e:
                raise CheckpointError(f"{path}: weights of family {fam!r} do not fit its model ({str(e).splitlines()[0]})") from None
            model.eval()
            pred.models_[fam] = model
        if "elementwise" not in pred.models_:
            raise CheckpointError(f"{path}: no elementwise model, which every other family falls back to")
        pred.table_ = TileTable.from_state({k: v.numpy() for k, v in table.items()})
        pred.manifest_ = manifest
        pred.train_devices_ = tuple(manifest.get("train_devices", ()))
        pred.metrics_ = manifest.get("metrics", {})
        pred.e2e_scale_ = float(manifest.get("e2e_scale", 1.0))
        if not 0.2 < pred.e2e_scale_ < 5:
            raise CheckpointError(f"{path}/manifest.json: e2e_scale={pred.e2e_scale_} is not a plausible factor (0.2-5); "
                                  f"regenerate the checkpoint with `neusight-train`")
        pred.e2e_floor_ = float(manifest.get("e2e_floor", 1.0))
        if not 0.0 <= pred.e2e_floor_ <= 1.0:
            raise CheckpointError(f"{path}/manifest.json: e2e_floor={pred.e2e_floor_} is not a fraction of the launch "
                                  f"overhead (0-1); regenerate the checkpoint with `neusight-train`")
        pred.conv_backward_ = _conv_backward_factors(manifest.get("conv_backward_factors") or {}, path)
        pred.layout_models_ = check_layout_models(manifest.get("layout_models") or {}, f"{path}/manifest.json")
        return pred


def _saved_config(manifest: dict, path: Path) -> PredictorConfig:
    """The PredictorConfig a checkpoint was fitted with, so that saving a loaded predictor writes it again."""
    families = {}
    for fam, spec in (manifest.get("families") or {}).items():
        raw = dict(spec.get("config") or {})
        raw["hidden"] = tuple(spec.get("hidden") or raw.get("hidden") or MLPConfig().hidden)
        try:
            families[fam] = MLPConfig(**raw)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}/manifest.json: family {fam!r} has a config this code cannot read ({e}); "
                                  f"regenerate the checkpoint with `neusight-train`") from None
    return PredictorConfig(families=families, val_devices=tuple(manifest.get("val_devices") or ("logo",)),
                           seed=int(manifest.get("seed", 0)))


def feature_range(model: UtilizationMLP | MLPEnsemble) -> tuple[np.ndarray, np.ndarray]:
    """The (min, max) of every feature over the rows a model was trained on (its clamp range)."""
    m = model.members[0] if isinstance(model, MLPEnsemble) else model
    return m.lo.detach().double().numpy(), m.hi.detach().double().numpy()


def beyond_training(model: UtilizationMLP | MLPEnsemble, x: np.ndarray, names: list[str]) -> list[str]:
    """Per row of features ``x``: the names of the features outside the model's training range, comma-separated
    ("" when every one is inside). The model holds such a feature at the range's edge (and the device features
    inside the envelope of the training GPUs'), so the forecast of that row is an extrapolation."""
    lo, hi = feature_range(model)
    out = _outside(x, lo, hi)
    return [",".join(n for n, o in zip(names, row) if o) for row in out]


def _outside(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """x below lo or above hi by more than the rounding of the float32 range the model keeps."""
    tol = 1e-5 * np.maximum(1.0, np.maximum(np.abs(lo), np.abs(hi)))
    return (x < lo - tol) | (x > hi + tol)


def scale_work(latency_ms: np.ndarray, overhead_ms: np.ndarray, roofline_ms: np.ndarray,
               factor: float) -> tuple[np.ndarray, np.ndarray]:
    """(latency, utilization) of kernels whose work (latency minus launch overhead) takes ``factor`` x as
    long, never less than the roofline. Non-decreasing in the factor and in the latency."""
    work = np.maximum(factor * (latency_ms - overhead_ms), roofline_ms)
    return work + overhead_ms, roofline_ms / work


def apply_conv_backward(classes: np.ndarray, latency_ms: np.ndarray, overhead_ms: np.ndarray, roofline_ms: np.ndarray,
                        factors: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """(latency, utilization) of kernels of CONV_BACKWARD_CLASSES ``classes`` ("" for none) with each class's
    work scaled by its factor (:func:`scale_work`); rows of a class without a factor keep their latency, and
    their utilization is recomputed from it."""
    lat = np.asarray(latency_ms, float).copy()
    for name, factor in factors.items():
        hit = np.asarray(classes) == name
        if hit.any():
            lat[hit] = scale_work(lat[hit], overhead_ms[hit], roofline_ms[hit], factor)[0]
    return lat, roofline_ms / np.maximum(lat - overhead_ms, roofline_ms)


def _conv_backward_factors(raw: Any, path: Path) -> dict[str, float]:
    """The manifest's conv_backward_factors, checked: known classes, plausible factors."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}/manifest.json: conv_backward_factors={raw!r} is not a mapping of class to factor; "
                              f"regenerate the checkpoint with `neusight-train`")
    out = {}
    for name, value in raw.items():
        if name not in CONV_BACKWARD_CLASSES:
            raise CheckpointError(f"{path}/manifest.json: conv_backward_factors has class {name!r}, this code knows "
                                  f"{', '.join(CONV_BACKWARD_CLASSES)}; regenerate the checkpoint with `neusight-train`")
        try:
            f = float(value)
        except (TypeError, ValueError):
            f = float("nan")
        lo, hi = CONV_BACKWARD_RANGE
        if not lo <= f <= hi:
            raise CheckpointError(f"{path}/manifest.json: conv_backward_factors[{name!r}]={value!r} is not a plausible "
                                  f"factor ({lo:g}-{hi:g}); regenerate the checkpoint with `neusight-train`")
        out[name] = f
    return out


def check_layout_models(raw: Any, where: str) -> dict[str, str]:
    """A layout -> GEMM model mapping (Predictor.layout_models_), checked: known layouts and families."""
    fix = "use layouts among " + ", ".join(LAYOUTS) + " and models among " + ", ".join(GEMM_FAMILIES[:2])
    if not isinstance(raw, Mapping):
        raise CheckpointError(f"{where}: layout_models={raw!r} is not a mapping of layout to GEMM model; {fix}")
    for layout, fam in raw.items():
        if layout not in LAYOUTS or fam not in GEMM_FAMILIES[:2]:
            raise CheckpointError(f"{where}: layout_models[{layout!r}]={fam!r} is not a known layout and GEMM "
                                  f"model; {fix}")
    return {str(k): str(v) for k, v in raw.items()}


def _code_fingerprint() -> str:
    """Hash of the modules that turn traces into training rows and fit them: a partial fit made by other
    code is never resumed."""
    here = Path(__file__).resolve().parent
    files = [here / "features.py", here / "mlp.py", here / "train.py", here.parent / "tiles.py",
             here.parent / "tile_table.py", here.parent / "kernels" / "formulas.py", here.parent / "dataset.py"]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def _partial_key(fam: str, feats: list[str], cfg: MLPConfig) -> str:
    blob = json.dumps([fam, feats, asdict(cfg), _code_fingerprint()], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save_partial(resume_dir: str | os.PathLike | None, fam: str, feats: list[str], cfg: MLPConfig, res: FitResult,
                  logo: dict[str, float]) -> None:
    if resume_dir is None:
        return
    d = Path(resume_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{fam}.pt.tmp"
    torch.save({"state": res.model.state_dict(), "best_epoch": torch.tensor(res.best_epoch),
                "member_epochs": torch.tensor(res.member_epochs, dtype=torch.long),
                "logo_devices": sorted(logo), "logo_mape": torch.tensor([logo[k] for k in sorted(logo)])}, tmp)
    os.replace(tmp, d / f"{fam}-{_partial_key(fam, feats, cfg)}.pt")


def _load_partial(resume_dir: str | os.PathLike | None, fam: str, feats: list[str],
                  cfg: MLPConfig) -> tuple[FitResult | None, dict[str, float]]:
    if resume_dir is None:
        return None, {}
    f = Path(resume_dir) / f"{fam}-{_partial_key(fam, feats, cfg)}.pt"
    if not f.is_file():
        return None, {}
    try:
        blob = torch.load(f, weights_only=True)
        model = build_model(len(feats), cfg, n_work_features(fam))
        model.load_state_dict(blob["state"])
        logo = dict(zip(blob["logo_devices"], (float(v) for v in blob["logo_mape"])))
    except Exception:  # a half-written or stale partial: train this family again
        return None, {}
    model.eval()
    epochs = tuple(int(e) for e in blob.get("member_epochs", torch.zeros(0, dtype=torch.long)))
    return FitResult(model, [], int(blob["best_epoch"]), tuple(logo), epochs), logo


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

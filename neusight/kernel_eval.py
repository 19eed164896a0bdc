"""Kernel-level evaluation: a predictor checkpoint against measured kernels, beside two baselines.

Every number in ``docs/kernels.md`` comes out of :func:`evaluate_kernels` (through the
``neusight-evaluate-kernels`` app), so the page is regenerated, never edited. Three predictions per kernel:

1. ``neusight``: the checkpoint's latency (tiles -> waves -> roofline / utilization + overhead).
2. ``roofline``: the same decomposition without the MLP, i.e. ``roofline_ms`` of :meth:`Predictor.predict`
   (waves x per-wave roofline, utilization 1, no launch overhead).
3. ``gbr``: a scikit-learn ``HistGradientBoostingRegressor`` per family on raw features (log2 dims, log2
   FLOPs, log2 bytes, the numeric ``dev_*`` spec columns) predicting log latency, fitted in the same run on
   the same training traces as the checkpoint. It knows the devices only through their spec numbers, as a
   user of a new GPU would.

Errors are absolute percentage errors |pred - measured| / measured x 100; MAPE is their mean.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from neusight.errors import CheckpointError, InputError
from neusight.devices import load_device
from neusight.predictor.mlp import MLPConfig
from neusight.predictor.model import SHIPPED, SHIPPED_AMD, TRAINING_GPUS, Predictor, PredictorConfig
from neusight.util import atomic_write_text

__all__ = ["METHODS", "TARGET_MAPE", "GBRConfig", "KernelEvaluation", "RawFeatureGBR", "error_table",
           "evaluate_kernels", "leave_one_gpu_out", "predict_methods", "predictor_config_from_checkpoint",
           "render_markdown", "scatter_plots", "subsample"]

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO.parent / "shared" / "datasets" / "neusight-asplos25" / "kernels"
EVAL_TRACES = (str(KERNELS / "nvidia-large-shapes"),)
TRAIN_TRACES = (str(KERNELS / "nvidia"),)
# what the shipped AMD predictor (data/predictor-amd) was trained on: the default for AMD-only evaluations
AMD_TRAIN_TRACES = (str(KERNELS / "amd"),)
AMD_TRAINING_GPUS = ("mi100", "mi210")

METHODS = {"neusight": "NeuSight", "roofline": "Roofline", "gbr": "GBR"}
"""Prediction columns ``<method>_ms`` of a results frame -> the name used in tables and plots."""

TARGET_MAPE = {"linear": 10.0, "bmm": 10.0, "elementwise": 15.0, "softmax": 15.0, "layernorm": 15.0}
"""Acceptance targets of issue 3 (MAPE %, per family, on GPUs the predictor was not trained on)."""

_ID_COLUMNS = ("family", "op", "device", "B", "M", "N", "K", "rows", "cols", "flops", "bytes", "source")
_RAW_DIMS = ("B", "M", "N", "K", "rows", "cols", "flops", "bytes")


def subsample(df: pd.DataFrame, max_rows_per_family: int | None, seed: int = 0) -> pd.DataFrame:
    """At most ``max_rows_per_family`` rows of each family, drawn with ``seed`` (same frame -> same rows),
    in the frame's original order; the frame itself when None."""
    if max_rows_per_family is None:
        return df
    if max_rows_per_family < 1:
        raise InputError(f"max_rows_per_family={max_rows_per_family}; expected a positive number of rows or null")
    parts = [d if len(d) <= max_rows_per_family else d.sample(n=max_rows_per_family, random_state=seed)
             for _, d in df.groupby("family", sort=True)]
    return pd.concat(parts).sort_index()


# --- baseline: gradient boosting on raw features ----------------------------------------------------

@dataclass
class GBRConfig:
    """Hyper-parameters of the gradient-boosting baseline (scikit-learn's defaults, more iterations)."""

    max_iter: int = 300
    learning_rate: float = 0.1
    max_leaf_nodes: int = 31
    min_samples_leaf: int = 20
    l2_regularization: float = 0.0
    seed: int = 0


class RawFeatureGBR:
    """Per-family ``HistGradientBoostingRegressor``: raw kernel and device numbers -> log latency.

    Examples
    --------
    >>> from neusight.dataset import load_kernel_traces
    >>> df = load_kernel_traces(TRAIN_TRACES[0] + "/ln")                 # doctest: +SKIP
    >>> RawFeatureGBR(GBRConfig(max_iter=20)).fit(df).predict(df)[:2]    # doctest: +SKIP
    """

    def __init__(self, config: GBRConfig | None = None) -> None:
        self.config = config or GBRConfig()

    def fit(self, df: pd.DataFrame) -> "RawFeatureGBR":
        """Fit one regressor per family of ``df`` (a :func:`neusight.dataset.load_kernel_traces` frame)."""
        from sklearn.ensemble import HistGradientBoostingRegressor

        # every spec column the loader joins that is a number (NaN where a vendor publishes none)
        self.device_columns_ = [c for c in df.columns if c.startswith("dev_")
                                and (pd.api.types.is_numeric_dtype(df[c]) or pd.api.types.is_bool_dtype(df[c]))]
        self.models_, self.columns_ = {}, {}
        c = self.config
        for fam, d in df.groupby("family", sort=True):
            # a column without one value in this family (rows/cols of a GEMM, a spec no training GPU has)
            # carries nothing, and scikit-learn cannot bin it
            x = self._features(d)
            self.columns_[fam] = np.flatnonzero(~np.isnan(x).all(axis=0))
            # NB: early stopping off: its validation split is random and would make the baseline depend
            # on more than the seed and the data
            model = HistGradientBoostingRegressor(max_iter=c.max_iter, learning_rate=c.learning_rate,
                                                  max_leaf_nodes=c.max_leaf_nodes, min_samples_leaf=c.min_samples_leaf,
                                                  l2_regularization=c.l2_regularization, early_stopping=False,
                                                  random_state=c.seed)
            with _one_thread():
                self.models_[fam] = model.fit(x[:, self.columns_[fam]], np.log(d["latency_ms"].to_numpy(float)))
        return self

    def predict(self, df: pd.DataFrame) -> np.ndarray:
        """Predicted latency (ms) per row; a family without a model uses the elementwise one."""
        if not hasattr(self, "models_"):
            raise CheckpointError("this RawFeatureGBR is not fitted; call fit() first")
        out = np.full(len(df), np.nan)
        for fam, idx in df.groupby("family", sort=True).indices.items():
            use = fam if fam in self.models_ else "elementwise"
            if use not in self.models_:
                raise InputError(f"the gradient-boosting baseline has no model for family {fam!r} (fitted on "
                                 f"{sorted(self.models_)}); add its traces to the training data")
            x = self._features(df.iloc[idx])[:, self.columns_[use]]
            with _one_thread():
                out[idx] = np.exp(self.models_[use].predict(x))
        return out

    def _features(self, d: pd.DataFrame) -> np.ndarray:
        dims = np.log2(d[list(_RAW_DIMS)].to_numpy(float))           # NaN where a dim does not apply
        spec = d.reindex(columns=self.device_columns_).to_numpy(float)
        return np.column_stack([dims, spec])


def _one_thread():
    """OpenMP limited to one thread. NB: on a 2-core machine that is busy with other work, scikit-learn's
    OpenMP threads spin-wait on each other: fitting 8,750 softmax rows took 68 s on 2 threads, 1 s on one."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="openmp")


# --- predictions and errors ------------------------------------------------------------------------

def predict_methods(predictor: Predictor | Mapping[str, Predictor], gbr: RawFeatureGBR,
                    df: pd.DataFrame) -> pd.DataFrame:
    """One row per kernel of ``df``: identity columns, ``measured_ms``, ``<method>_ms`` for every method in
    :data:`METHODS`, the decomposition (tiles, waves, bound, utilization) and ``trained_on`` (the
    predictor saw this GPU in training). ``predictor``: one for every GPU, or a predictor per device key."""
    def pick(dev: str) -> Predictor:
        return predictor[dev] if isinstance(predictor, Mapping) else predictor

    parts = [pick(dev).predict(d, dev) for dev, d in df.groupby("device", sort=True)]
    dec = pd.concat(parts).loc[df.index]
    out = df[list(_ID_COLUMNS)].copy()
    out.insert(3, "trained_on", [dev in pick(dev).train_devices_ for dev in df["device"]])
    out["measured_ms"] = df["latency_ms"].to_numpy(float)
    out["neusight_ms"] = dec["latency_ms"].to_numpy(float)
    out["roofline_ms"] = dec["roofline_ms"].to_numpy(float)
    out["gbr_ms"] = gbr.predict(df)
    for col in ("tiles", "waves", "bound", "utilization"):
        out[col] = dec[col].to_numpy()
    return out


def _ape(pred: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(pred - measured) / measured * 100.0


def error_table(results: pd.DataFrame, by: Sequence[str] = ("family", "device"), *, totals: bool = True) -> pd.DataFrame:
    """Per group of ``by``: rows, then MAPE, median and 90th percentile of the absolute % error of every
    method (columns ``<method>_mape``, ``<method>_median``, ``<method>_p90``). With ``totals`` and
    ``by`` = (family, device), each family gets a row ``device="all"`` over its GPUs."""
    def stats(g: pd.DataFrame) -> dict:
        row: dict = {"rows": len(g), "trained_on": bool(g["trained_on"].all()) if "trained_on" in g else None}
        for m in METHODS:
            e = _ape(g[f"{m}_ms"].to_numpy(float), g["measured_ms"].to_numpy(float))
            row |= {f"{m}_mape": e.mean(), f"{m}_median": np.median(e), f"{m}_p90": np.percentile(e, 90)}
        return row

    by = list(by)
    rows = [{**dict(zip(by, key if isinstance(key, tuple) else (key,))), **stats(g)}
            for key, g in results.groupby(by, sort=True)]
    if totals and by == ["family", "device"]:
        rows += [{"family": fam, "device": "all", **stats(g)} for fam, g in results.groupby("family", sort=True)]
    table = pd.DataFrame(rows)
    order = {"all": 1}
    table["_o"] = table["device"].map(lambda d: order.get(d, 0)) if "device" in table else 0
    return table.sort_values([*by[:1], "_o", *by[1:]]).drop(columns="_o").reset_index(drop=True)


# --- leave one GPU out --------------------------------------------------------------------------------

def predictor_config_from_checkpoint(predictor: Predictor) -> PredictorConfig:
    """The hyper-parameters a loaded checkpoint was fitted with (manifest ``families.<fam>.config``);
    families without them take ``conf/predictor/default.yaml``."""
    manifest = getattr(predictor, "manifest_", {}) or {}
    known = {f.name for f in fields(MLPConfig)}
    defaults = _default_family_configs()
    fams = {}
    for fam, spec in manifest.get("families", {}).items():
        cfg = dict(spec.get("config") or defaults.get(fam) or {})
        cfg["hidden"] = tuple(cfg.get("hidden") or spec.get("hidden") or MLPConfig().hidden)
        fams[fam] = MLPConfig(**{k: v for k, v in cfg.items() if k in known})
    if not fams:
        raise CheckpointError("the checkpoint's manifest lists no families; cannot refit it leave-one-GPU-out")
    return PredictorConfig(families=fams, val_devices=tuple(manifest.get("val_devices") or ("logo",)),
                           seed=int(manifest.get("seed", 0)))


def _default_family_configs() -> dict[str, dict]:
    import yaml

    path = REPO / "conf" / "predictor" / "default.yaml"
    if not path.is_file():
        return {}
    return {f: dict(v) for f, v in (yaml.safe_load(path.read_text()) or {}).get("families", {}).items()}


def leave_one_gpu_out(train: pd.DataFrame, large: pd.DataFrame, config: PredictorConfig,
                      gbr_config: GBRConfig | None = None, *, gpus: Iterable[str] | None = None,
                      progress: bool = False) -> pd.DataFrame:
    """Refit the predictor and the GBR baseline once per held-out GPU, on the other GPUs' training rows;
    score the held-out GPU's sweep rows (``split="sweep"``, from ``train``) and its rows of ``large``
    (``split="large"``). Returns one row per (family, held-out GPU, split) with :func:`error_table`'s
    columns and ``fit_s`` (seconds to refit both models for that GPU)."""
    gpus = sorted(train["device"].unique()) if gpus is None else list(gpus)
    fams = {f: c for f, c in config.families.items() if f in set(train["family"])}
    config = PredictorConfig(families=fams, val_devices=config.val_devices, seed=config.seed)
    tables = []
    for gpu in gpus:
        t0 = time.time()
        rest = train[train["device"] != gpu]
        log.info("leave-one-GPU-out: fitting without %s on %d rows", gpu, len(rest))
        pred = Predictor(config).fit(rest, progress=progress)
        gbr = RawFeatureGBR(gbr_config).fit(rest)
        fit_s = time.time() - t0
        for split, frame in (("sweep", train), ("large", large)):
            held = frame[frame["device"] == gpu]
            if held.empty:
                continue
            t = error_table(predict_methods(pred, gbr, held), totals=False)
            t.insert(2, "split", split)
            t["fit_s"] = fit_s
            tables.append(t)
        log.info("leave-one-GPU-out: %s done in %.0f s", gpu, time.time() - t0)
    return pd.concat(tables, ignore_index=True).rename(columns={"device": "held_out"})


# --- the evaluation --------------------------------------------------------------------------------

@dataclass
class KernelEvaluation:
    """What :func:`evaluate_kernels` measured; :meth:`write` puts it into a directory."""

    results: pd.DataFrame                  # one row per kernel, see predict_methods
    summary: pd.DataFrame                  # error_table(results)
    logo: pd.DataFrame | None = None       # leave_one_gpu_out(...) when asked for
    info: dict = field(default_factory=dict)

    def markdown(self) -> str:
        """The summary as a markdown page (what ``docs/kernels.md`` holds)."""
        return render_markdown(self)

    def write(self, out_dir: str | os.PathLike, *, plots: bool = True) -> list[Path]:
        """results.csv, summary.csv, summary.md (+ logo.csv) and ``scatter_<family>.png`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = {"results.csv": self.results.to_csv(index=False), "summary.csv": self.summary.to_csv(index=False),
                 "summary.md": self.markdown()}
        if self.logo is not None:
            files["logo.csv"] = self.logo.to_csv(index=False)
        written = []
        for name, text in files.items():
            atomic_write_text(out / name, text)
            written.append(out / name)
        if plots:
            written += scatter_plots(self.results, out)
        return written


def evaluate_kernels(traces: Sequence[str | os.PathLike] = EVAL_TRACES, *,
                     train_traces: Sequence[str | os.PathLike] = TRAIN_TRACES,
                     train_devices: Sequence[str] = TRAINING_GPUS, checkpoint: str | os.PathLike | None = None,
                     devices: Sequence[str] | None = None, families: Sequence[str] | None = None,
                     max_rows_per_family: int | None = None, gbr: GBRConfig | None = None, logo: bool = False,
                     seed: int = 0, progress: bool = False) -> KernelEvaluation:
    """Evaluate a predictor checkpoint (default: the shipped one) on measured kernel traces.

    Parameters
    ----------
    traces : paths
        Kernel CSVs / directories to evaluate on (default: the large-shape files, incl. NVIDIA L4).
    train_traces, train_devices
        What the GBR baseline (and, with ``logo``, every refit) is trained on: by default the sweeps the
        shipped checkpoint was trained on.
    devices, families : optional
        Keep only these GPUs / kernel families of ``traces`` (families also filter the training rows).
    max_rows_per_family : int, optional
        Deterministic subsample (``seed``) of the evaluated rows AND of the training rows, per family.
    logo : bool
        Also run :func:`leave_one_gpu_out` over the training GPUs (minutes per GPU).

    Returns
    -------
    KernelEvaluation
    """
    from neusight.dataset import load_kernel_traces

    t0 = time.time()
    timings: dict[str, float] = {}
    data = subsample(load_kernel_traces([str(p) for p in traces], devices=devices, families=families),
                     max_rows_per_family, seed)
    per_device: dict[str, Predictor] = {}
    by_path: dict[Path, Predictor] = {}   # the shipped predictors loaded for a mixed-vendor evaluation
    if checkpoint is None and len(data):
        from neusight.api import shipped_predictor_dir

        shipped_of = {d: shipped_predictor_dir(load_device(d)) for d in data["device"].unique()}
        shipped = set(shipped_of.values())
        if shipped == {SHIPPED_AMD}:
            # AMD kernels only: the shipped AMD predictor, and (unless told otherwise) a GBR on the AMD sweeps
            checkpoint = SHIPPED_AMD
            if tuple(map(str, train_traces)) == TRAIN_TRACES and tuple(train_devices) == tuple(TRAINING_GPUS):
                train_traces, train_devices = AMD_TRAIN_TRACES, AMD_TRAINING_GPUS
        elif len(shipped) > 1:
            # NVIDIA and AMD kernels together: each GPU by its vendor's shipped predictor, as neusight.predict
            # does; the GBR baseline and any leave-one-GPU-out stay those of the NVIDIA predictor
            by_path = {path: Predictor.load(path) for path in shipped}
            per_device = {d: by_path[path] for d, path in shipped_of.items()}
            log.info("NVIDIA and AMD kernels: each GPU is scored by its vendor's shipped predictor (%s)",
                     ", ".join(f"{d}: {_short(path)}" for d, path in sorted(shipped_of.items())))
    predictor = by_path[SHIPPED] if SHIPPED in by_path else Predictor.load(checkpoint)
    train_families = list(families) if families else None
    if not logo:  # the baseline only needs the families it is scored on
        train_families = sorted(data["family"].unique())
    train = subsample(load_kernel_traces([str(p) for p in train_traces], devices=list(train_devices),
                                         families=train_families), max_rows_per_family, seed)
    timings["load_s"] = time.time() - t0

    t = time.time()
    baseline = RawFeatureGBR(gbr or GBRConfig(seed=seed)).fit(train)
    timings["gbr_fit_s"] = time.time() - t
    t = time.time()
    results = predict_methods(per_device or predictor, baseline, data)
    timings["predict_s"] = time.time() - t
    summary = error_table(results)

    logo_table = None
    if logo:
        t = time.time()
        logo_table = leave_one_gpu_out(train, data, predictor_config_from_checkpoint(predictor),
                                       gbr or GBRConfig(seed=seed), progress=progress)
        timings["logo_s"] = time.time() - t
    timings["total_s"] = time.time() - t0
    info = {
        "checkpoint": (f"{_short(checkpoint)} (shipped)" if Path(checkpoint).parent == REPO / "data"
                       else str(checkpoint)) if checkpoint else
                      (f"data/predictor (shipped); the AMD GPUs by data/predictor-amd (shipped), trained on "
                       f"{', '.join(by_path[SHIPPED_AMD].train_devices_)}" if per_device else "data/predictor (shipped)"),
        "predictor_train_devices": list(predictor.train_devices_),
        "traces": [str(p) for p in traces], "train_traces": [str(p) for p in train_traces],
        "train_devices": sorted(train["device"].unique()), "train_rows": len(train), "eval_rows": len(data),
        "max_rows_per_family": max_rows_per_family, "seed": seed, "gbr": gbr or GBRConfig(seed=seed),
        "skipped": data.attrs.get("skipped", {}), "timings": timings,
    }
    return KernelEvaluation(results, summary, logo_table, info)


def _short(path: str | os.PathLike) -> str:
    """A path inside the repository relative to it (data/predictor-amd), others as given."""
    p = Path(path)
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


# --- plots --------------------------------------------------------------------------------------------

def scatter_plots(results: pd.DataFrame, out_dir: str | os.PathLike) -> list[Path]:
    """One ``scatter_<family>.png`` per family: predicted vs measured, log-log, one panel per method, the
    y = x line with +-10 % and +-25 % bands, points coloured by GPU (triangles: GPUs not trained on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    out = Path(out_dir)
    written = []
    for fam, d in results.groupby("family", sort=True):
        devices = sorted(d["device"].unique(), key=lambda k: (not d.loc[d["device"] == k, "trained_on"].all(), k))
        colors = {dev: plt.cm.tab10(i % 10) for i, dev in enumerate(devices)}
        values = d[["measured_ms", *(f"{m}_ms" for m in METHODS)]].to_numpy(float)
        lo, hi = np.nanmin(values) / 1.5, np.nanmax(values) * 1.5
        line = np.geomspace(lo, hi, 64)
        fig, axes = plt.subplots(1, len(METHODS), figsize=(5.2 * len(METHODS), 5.6), sharex=True, sharey=True,
                                 constrained_layout=True)
        for ax, (method, label) in zip(axes, METHODS.items()):
            ax.fill_between(line, line * 0.75, line * 1.25, color="0.88", lw=0, zorder=0)
            ax.fill_between(line, line * 0.9, line * 1.1, color="0.74", lw=0, zorder=0)
            ax.plot(line, line, color="black", lw=0.8, zorder=1)
            for dev in devices:
                g = d[d["device"] == dev]
                seen = bool(g["trained_on"].all())
                ax.scatter(g["measured_ms"], g[f"{method}_ms"], s=7 if seen else 10, marker="o" if seen else "^",
                           color=colors[dev], alpha=0.45 if seen else 0.7, lw=0, zorder=2 if seen else 3,
                           rasterized=True)
            mape = _ape(d[f"{method}_ms"].to_numpy(float), d["measured_ms"].to_numpy(float)).mean()
            ax.set_title(f"{label}: MAPE {mape:.1f} % ({len(d)} kernels)", fontsize=11)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            ax.set_xlabel("measured latency (ms)")
            ax.grid(True, which="major", lw=0.3, color="0.7")
        axes[0].set_ylabel("predicted latency (ms)")
        handles = [Line2D([], [], ls="", marker="o" if d.loc[d["device"] == dev, "trained_on"].all() else "^",
                          color=colors[dev], markersize=7,
                          label=dev if d.loc[d["device"] == dev, "trained_on"].all() else f"{dev} (not trained on)")
                   for dev in devices]
        handles += [Patch(color="0.74", label="within 10 %"), Patch(color="0.88", label="within 25 %")]
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), frameon=False)
        fig.suptitle(f"{fam}: predicted vs measured kernel latency", fontsize=13)
        path = out / f"scatter_{fam}.png"
        tmp = out / f".{path.name}.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)
    return written


# --- the markdown page ----------------------------------------------------------------------------

def _rel(path: str) -> str:
    """A path as seen from the repository (``../shared/...``), so the page does not depend on the machine."""
    try:
        return os.path.relpath(Path(path).resolve(), REPO)
    except ValueError:  # another drive (Windows)
        return str(path)


def _fmt(x: float) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:.1f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(header))) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _mape_cells(row: pd.Series, stats: Sequence[str] = ("mape", "median", "p90")) -> list[str]:
    """MAPE (+ median, p90) of every method; the lowest MAPE of the row in bold."""
    best = min(row[f"{m}_mape"] for m in METHODS)
    cells = []
    for m in METHODS:
        for s in stats:
            text = _fmt(row[f"{m}_{s}"])
            cells.append(f"**{text}**" if s == "mape" and row[f"{m}_mape"] == best else text)
    return cells


def _device_label(row: pd.Series) -> str:
    if row["device"] == "all":
        return "all GPUs"
    return row["device"] if row["trained_on"] else f"{row['device']} †"


def render_markdown(ev: KernelEvaluation) -> str:
    """The page ``neusight-evaluate-kernels out_md=...`` writes; every number comes from ``ev``."""
    info, s = ev.info, ev.summary
    tm = info.get("timings", {})
    gbr = info.get("gbr") or GBRConfig()
    lines = ["# Kernel-level accuracy: NeuSight vs roofline vs gradient boosting", "",
             f"Generated by `{info.get('command', 'neusight.kernel_eval.evaluate_kernels(...)')}` "
             "(`neusight/kernel_eval.py`); regenerate it, do not edit it.", "",
             f"- Predictor: `{info.get('checkpoint')}`, trained on {', '.join(info.get('predictor_train_devices', []))}.",
             f"- Evaluated on: {', '.join(f'`{_rel(p)}`' for p in info.get('traces', []))}: {info.get('eval_rows')} "
             f"kernels (rows the loader skipped: {sum(info.get('skipped', {}).values())}).",
             "- Roofline: the predictor's own tile/wave roofline (`roofline_ms`: waves x per-wave max(FLOPs / peak, "
             "bytes / bandwidth), no utilization, no launch overhead).",
             f"- GBR: scikit-learn `HistGradientBoostingRegressor` (max_iter={gbr.max_iter}, "
             f"learning_rate={gbr.learning_rate}, max_leaf_nodes={gbr.max_leaf_nodes}) per family on log2 dims, "
             "log2 FLOPs, log2 bytes and the numeric device-spec columns, predicting log latency; fitted in the "
             f"same run on {', '.join(f'`{_rel(p)}`' for p in info.get('train_traces', []))} "
             f"({', '.join(info.get('train_devices', []))}; {info.get('train_rows')} rows).",
             "- Error: absolute percentage error |predicted - measured| / measured; MAPE is its mean, then the "
             "median and the 90th percentile. Lowest MAPE of a row in bold; † = a GPU the predictor was not "
             "trained on.",
             ("- Subsampling: none, every row." if not info.get("max_rows_per_family") else
              f"- Subsampling: at most {info['max_rows_per_family']} rows per family (seed {info.get('seed')}) of the "
              "evaluated rows and of the training rows (baseline and leave-one-GPU-out refits), to bound the run time."),
             f"- Run time on this machine ({os.cpu_count()} CPUs): " + ", ".join(
                 f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s" for k, v in tm.items()) + ".",
             "- Plots: `scatter_<family>.png` in the run directory (predicted vs measured, one panel per method).", ""]

    cells = s[s["device"] != "all"]
    wins = cells[[all(r["neusight_mape"] <= r[f"{m}_mape"] for m in METHODS) for _, r in cells.iterrows()]]
    losses = cells.drop(wins.index)
    lines += ["## Summary", "",
              f"NeuSight has the lowest MAPE in {len(wins)} of {len(cells)} family x GPU cells."
              + ("" if losses.empty else " Not in: " + ", ".join(
                  f"{r['family']} on {r['device']} ({_fmt(r['neusight_mape'])} % vs roofline "
                  f"{_fmt(r['roofline_mape'])} %, GBR {_fmt(r['gbr_mape'])} %)" for _, r in losses.iterrows()) + "."), ""]
    unseen = cells[~cells["trained_on"].astype(bool)]
    if not unseen.empty:
        lines += ["GPUs not trained on, against the acceptance targets of issue 3:", ""]
        rows = []
        for _, r in unseen.iterrows():
            target = TARGET_MAPE.get(r["family"])
            beats = all(r["neusight_mape"] < r[f"{m}_mape"] for m in METHODS if m != "neusight")
            rows.append([r["family"], r["device"], str(r["rows"]), _fmt(target) if target else "-",
                         *(_fmt(r[f"{m}_mape"]) for m in METHODS),
                         "-" if target is None else ("yes" if r["neusight_mape"] <= target else "no"),
                         "yes" if beats else "no"])
        lines += _table(["family", "GPU", "rows", "target MAPE", *(f"{v} MAPE" for v in METHODS.values()),
                         "target met", "beats both baselines"], rows) + [""]

    lines += ["## Per family and GPU", ""]
    header = ["GPU", "rows", *(f"{v} {s_}" for v in METHODS.values() for s_ in ("MAPE", "median", "p90"))]
    for fam, t in s.groupby("family", sort=True):
        lines += [f"### {fam}", ""]
        lines += _table(header, ([_device_label(r), str(r["rows"]), *_mape_cells(r)] for _, r in t.iterrows())) + [""]

    if ev.logo is not None:
        lo = ev.logo
        lines += ["## Leave one GPU out (training GPUs)", "",
                  "For each training GPU, the predictor (with the checkpoint's hyper-parameters) and the GBR "
                  "baseline are refitted on the other GPUs' sweeps and scored on the held-out GPU: its sweep rows "
                  "(the training distribution) and its large-shape rows (larger shapes as well). The roofline "
                  "column uses the refitted tile table. MAPE in %, lowest in bold.", ""]
        header = ["held-out GPU", "sweep rows", *(f"sweep {v}" for v in METHODS.values()),
                  "large rows", *(f"large {v}" for v in METHODS.values())]
        for fam, t in lo.groupby("family", sort=True):
            rows = []
            for gpu, g in t.groupby("held_out", sort=True):
                row = [gpu]
                for split in ("sweep", "large"):
                    r = g[g["split"] == split]
                    row += ([str(r.iloc[0]["rows"]), *_mape_cells(r.iloc[0], ("mape",))] if len(r)
                            else ["0", *("-" for _ in METHODS)])
                rows.append(row)
            lines += [f"### {fam}", ""] + _table(header, rows) + [""]
        fit = lo.groupby("held_out")["fit_s"].first()
        lines += ["Refit time per held-out GPU (predictor + GBR): "
                  + ", ".join(f"{g} {v:.0f} s" for g, v in fit.items()) + ".", ""]
    return "\n".join(lines)

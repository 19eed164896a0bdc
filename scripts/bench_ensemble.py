"""Benchmark: would averaging a family's MLP over several fit seeds forecast unseen GPUs better? Writes
docs/ensemble.md.

    python scripts/bench_ensemble.py                          # linear, seeds 0-4 (~18 min on 2 cores)
    python scripts/bench_ensemble.py --family bmm --seeds 0 1 2 --out /tmp/e.md

Nested leave-one-GPU-out, trained exactly as `neusight-train` trains a family (neusight.predictor.train.
fit_mlp_logo: the epoch count chosen by leave-one-GPU-out over the remaining GPUs, then a refit on them): for
each training GPU, fit on the other four once per seed, then score the held-out GPU's sweep rows and its rows of
the large-shape files with each single fit and with their ensemble (geometric mean of the fits' latencies).
The held-out GPU is never looked at. Then the same on all five GPUs, scored on L4's large-shape rows (a GPU
no fit sees). The shipped predictor is one fit, seed 0. Last, end to end: the shipped predictor with this
family's model replaced by the five-GPU ensemble (neusight.predictor.mlp.MLPEnsemble, what `neusight-train` fits
with `+predictor.families.<family>.ensemble=<n>`), the end-to-end calibration refitted on the training GPUs'
labels as `neusight-train` does, every plain NVIDIA label forecast, against the shipped predictor.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO.parent / "shared" / "datasets" / "neusight-asplos25" / "kernels"
sys.path.insert(0, str(REPO / "scripts"))

from bench_features import LARGE_FILES  # noqa: E402

UNSEEN = "l4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="linear", choices=sorted(LARGE_FILES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", default=str(REPO / "docs" / "ensemble.md"))
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from neusight.dataset import load_kernel_traces
    from neusight.devices import load_device
    from neusight.predictor.features import BORROW_FRACTION, BORROWS_ELEMENTWISE, feature_names, n_work_features
    from neusight.predictor.mlp import MLPConfig, MLPEnsemble
    from neusight.predictor.model import TRAINING_GPUS, Predictor
    from neusight.predictor.train import fit_mlp_logo, mape, predict_mlp, size_weights
    from neusight.tile_table import TileTable
    from neusight.util import atomic_write_text

    t_start = time.time()
    fam = args.family
    spec = yaml.safe_load((REPO / "conf" / "predictor" / "default.yaml").read_text())["families"][fam]
    cfg = MLPConfig(**{**spec, "hidden": tuple(spec["hidden"])})
    df = load_kernel_traces(str(KERNELS / "nvidia"), devices=list(TRAINING_GPUS))
    large = load_kernel_traces(str(KERNELS / "nvidia-large-shapes" / LARGE_FILES[fam]))
    devices = {k: load_device(k) for k in set(df["device"]) | set(large["device"])}
    pred = Predictor()
    pred.table_ = TileTable.fit(df, {k: devices[k] for k in TRAINING_GPUS})
    d = pred._design(df[df["family"].isin([fam, "elementwise"])], devices)
    if fam in BORROWS_ELEMENTWISE:   # as Predictor.fit: a share of elementwise rows, marked not native
        ew = d[d["model_family"] == "elementwise"].sample(frac=BORROW_FRACTION, random_state=0).assign(native=0.0)
        d = pd.concat([d[d["model_family"] == fam], ew])
    else:
        d = d[d["model_family"] == fam]
    lg = pred._design(large[large["family"] == fam], devices)
    feats, n_mono = list(feature_names(fam)), n_work_features(fam)
    native = (d["native"] != 0) if "native" in d else pd.Series(True, index=d.index)

    rows = []
    for held in [*sorted(TRAINING_GPUS), None]:
        train = d[d["device"] != held] if held else d
        tests = ({"sweep": d[(d["device"] == held) & native], "large shapes": lg[lg["device"] == held]} if held
                 else {"large shapes": lg[lg["device"] == UNSEEN]})
        preds: dict[str, list[np.ndarray]] = {k: [] for k in tests}
        members = []
        for seed in args.seeds:
            run = dataclasses.replace(cfg, seed=seed)
            fit, _ = fit_mlp_logo(train[feats].to_numpy(float), train["roofline_ms"].to_numpy(float),
                                  train["latency_ms"].to_numpy(float), train["device"].to_numpy(), run, n_mono=n_mono,
                                  weights=size_weights(train["log2_waves_ref"].to_numpy(float), run.size_weight))
            members.append(fit.model)
            for name, frame in tests.items():
                preds[name].append(predict_mlp(fit.model, frame[feats].to_numpy(float),
                                               frame["roofline_ms"].to_numpy(float))[0])
        ensemble = MLPEnsemble(members)
        for name, frame in tests.items():
            y = frame["latency_ms"].to_numpy(float)
            single = [mape(p, y) for p in preds[name]]
            rows.append({"held out": held or f"none ({UNSEEN}, never trained on)", "rows": name, "n": len(y),
                         "seed 0 (shipped)": single[0] if args.seeds[0] == 0 else np.nan,
                         "single fits, mean": float(np.mean(single)),
                         "single fits, range": f"{min(single):.1f}-{max(single):.1f}",
                         "ensemble": mape(predict_mlp(ensemble, frame[feats].to_numpy(float),
                                                      frame["roofline_ms"].to_numpy(float))[0], y)})
            r = rows[-1]
            print(f"{fam} held out {r['held out']:28s} {name:12s} single {r['single fits, mean']:5.1f} "
                  f"[{r['single fits, range']}]  ensemble {r['ensemble']:5.1f}  ({time.time() - t_start:.0f} s)",
                  flush=True)
    e2e = end_to_end(fam, ensemble, dataclasses.replace(cfg, ensemble=len(args.seeds)))
    text = f"""# Seed ensembles: averaging a family's MLP over fit seeds

Generated by `python scripts/bench_ensemble.py{'' if fam == 'linear' else ' --family ' + fam}`; regenerate
it, do not edit it. How each cell is made: the script's docstring. Family: {fam}; seeds
{', '.join(map(str, args.seeds))}; each fit as `neusight-train` fits it. Run time: {time.time() - t_start:.0f} s.

MAPE (%) of the held-out GPU's rows for each single fit and for the ensemble of all of them (geometric mean of
their latencies).

{md(pd.DataFrame(rows))}

## End to end

The shipped predictor, and the same with its {fam} model replaced by the ensemble fitted on all five GPUs (the
last row above); for each, the end-to-end calibration refitted on the training GPUs' labels (scale on the excess
over the roofline, launch floor; leave-one-GPU-out: its own check, mean absolute % error of each training GPU
when fitted without it). Then mean (worst) absolute % error over the plain NVIDIA labels.

{md(e2e)}
"""
    atomic_write_text(args.out, text)
    print(text)


def md(table: pd.DataFrame) -> str:
    cols = list(table.columns)
    lines = ["| " + " | ".join(cols) + " |",
             "| " + " | ".join("---" if table[c].dtype == object else "---:" for c in cols) + " |"]
    for _, r in table.iterrows():
        lines.append("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in r) + " |")
    return "\n".join(lines)


def end_to_end(fam: str, ensemble, cfg) -> pd.DataFrame:
    """Rows: the calibration and each (GPU, mode) of the labels; columns: shipped, with the ensemble."""
    from neusight.evaluate import calibrate, evaluate_labels, find_labels
    from neusight.predictor.model import Predictor

    runs = find_labels(REPO.parent / "shared" / "datasets" / "neusight-asplos25")
    cols: dict[str, dict[str, str]] = {}
    for name in ("shipped", f"{fam} ensemble"):
        pred = Predictor.load()                      # a fresh copy, not the cached shipped predictor
        if name != "shipped":
            pred.models_[fam] = ensemble
            pred.config.families[fam] = cfg
        cal = calibrate(pred, runs)
        held = {d: v["mean_abs_err_after"] for d, v in cal["leave_one_gpu_out"].items()}
        col = {"calibration: scale, floor": f"{cal['scale']:.3f}, {cal['floor']:.1f}",
               **{f"calibration leave-one-GPU-out: {d}": f"{v:.1f}" for d, v in sorted(held.items())}}
        res = evaluate_labels(runs, pred)
        err = res["error_pct"].abs()
        for (dev, mode), e in err.groupby([res["device"], res["mode"]]):
            col[f"labels: {dev} {mode} ({len(e)} runs)"] = f"{e.mean():.1f} ({e.max():.1f})"
        cols[name] = col
    return pd.DataFrame(cols).rename_axis("").reset_index()


if __name__ == "__main__":
    main()

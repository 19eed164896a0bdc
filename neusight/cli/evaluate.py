"""``neusight-evaluate``: predict the measured end-to-end runs and report the errors.

Default: every plain (no -fusion/-dp/-tp/-pp) label run of an NVIDIA GPU in ``../shared/datasets/neusight-asplos25``
with the shipped predictor, plus the CNN rows of ``../shared/datasets/public-benchmarks`` in FP32 (issue 4's scope:
V100/T4; other FP32 GPUs apart) and, in sections of their own, their TF32 rows (Ampere and Ada cards' "float"
runs: convolutions on TF32 tensor cores, as PyTorch does by default; ``cnn.tf32=false`` leaves them out), their
AMP rows (forecast under an emulated ``torch.autocast``) and FP16 rows (pure FP16; ``cnn.half=false`` leaves both
out), and their FP32 inference rows at batches below ``cnn.min_batch`` (host-bound; ``cnn.small_batches=false``
leaves them out). Writes into Hydra's run directory: ``results.csv`` (one row per label run), ``per_gpu.csv``,
``cnn_results.csv`` / ``cnn_skipped.csv`` / ``cnn_tf32_results.csv`` / ``cnn_half_results.csv`` /
``cnn_small_batch_results.csv``, ``evaluation.md`` (the tables) and ``predicted_vs_measured.png``.

Examples::

    neusight-evaluate                                    # everything, shipped predictor
    neusight-evaluate out_md=docs/evaluation.md          # and the report into docs/ (relative to the cwd)
    neusight-evaluate labels.gpus=[l4] cnn.enabled=false labels.max_runs=2
    neusight-evaluate --multirun hydra/launcher=joblib checkpoint=data/predictor,/path/to/other
    neusight-evaluate --multirun hydra/launcher=joblib 'labels.gpus=[l4],[t4],[v100-pcie-32gb]'
    neusight-evaluate --multirun hydra/launcher=slurm checkpoint=a,b   # conf/hydra/launcher/slurm.yaml, needs .[slurm]

``checkpoint=<dir>`` may also be written ``predictor=<dir>`` (see :mod:`neusight.cli.predict` for why it is
rewritten). The task function returns the mean absolute % error over the label runs, for sweepers; after a
multirun :class:`SweepSummaryCallback` writes ``sweep_summary.md`` comparing the jobs per GPU.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from neusight.cli.common import (CONF_DIR, catch_user_errors, exit_2_on_config_errors, help_if_asked,
                                 quiet_third_party_logs)
from neusight.cli.predict import _rewrite_predictor_override, job_labels

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
DATASETS = REPO.parent / "shared" / "datasets"


@dataclass
class LabelsConfig:
    dataset: str = str(DATASETS / "neusight-asplos25")   # the folder holding labels/ and models/
    gpus: Optional[list[str]] = None       # device keys or label folder names; null = every GPU of vendors
    vendors: list[str] = field(default_factory=lambda: ["nvidia"])   # add "amd" for the MI100 / MI210 runs
    models: Optional[list[str]] = None     # label model names (gpt2_large, bert_large, ...); null = all
    modes: Optional[list[str]] = None      # inference / training; null = both
    max_runs: Optional[int] = None         # the first n runs after filtering (smoke tests)
    options: list[str] = field(default_factory=list)   # kinds of option runs to add: fusion (torch.compile), parallel (-dp/-tp/-pp)


@dataclass
class CnnConfig:
    enabled: bool = True
    dir: str = str(DATASETS / "public-benchmarks")      # cnn_dle.csv and cnn_lambda.csv
    min_batch: int = 32                    # DLE inference rows below this batch are host-bound: their own section
    tf32: bool = True                      # also the TF32 rows (Ampere+ "float": TF32 convolutions; a section of their own)
    half: bool = True                      # also the AMP (autocast) / FP16 rows (a section of their own)
    small_batches: bool = True             # also the FP32 inference rows below min_batch (host-bound; a section of their own)


@dataclass
class EvaluateConfig:
    labels: LabelsConfig = field(default_factory=LabelsConfig)
    cnn: CnnConfig = field(default_factory=CnnConfig)
    checkpoint: Optional[str] = None       # predictor checkpoint directory; null = the shipped predictor
    out_md: Optional[str] = None           # also write the report here (relative to the working directory)
    accuracy_out: Optional[str] = None     # also write the measured accuracy per kind of forecast here (JSON; the
    #                                        shipped ones: data/accuracy/, shown next to every forecast)
    target_trained_pct: float = 5.0        # acceptance: mean abs % error per GPU on the predictor's training GPUs
    target_unseen_pct: float = 8.0         # ... and on GPUs it never saw (L4; NeuSight reports 12.4 %)
    plot: bool = True


ConfigStore.instance().store(name="evaluate_schema", node=EvaluateConfig)


def _predictor_line(checkpoint: str | None, shipped: list[Path] | None = None) -> str:
    """One sentence per predictor used: where it is, how it was made, what it was trained on."""
    if checkpoint:
        paths, names = [Path(checkpoint)], [checkpoint]
    else:
        paths = shipped or [REPO / "data" / "predictor"]
        names = [f"the shipped predictor ({p.relative_to(REPO) if p.is_relative_to(REPO) else p})" for p in paths]
    lines = []
    for path, where in zip(paths, names):
        manifest = path / "manifest.json"
        extra, trained = "", "(not stated)"
        if manifest.is_file():
            m = json.loads(manifest.read_text())
            sha = str(m.get("weights_sha256") or "")[:12]
            extra = f", weights sha256 {sha}" if sha else ""
            if m.get("command"):
                extra += f", made by `{m['command']}`"
            if m.get("e2e_scale") is not None:
                # NB: fitted on the end-to-end labels of the training GPUs, so their rows below are in-sample for
                # these two numbers; the unseen GPUs' rows are not.
                extra += (f"; plus an end-to-end scale on the excess over the roofline ({float(m['e2e_scale']):.4g}) "
                          f"and a launch floor ({float(m.get('e2e_floor', 1.0)):.2g} x the isolated launch overhead), "
                          "fitted on the training GPUs' labels (their rows below are in-sample for them)")
            cal = m.get("conv_backward_calibration") or {}
            if m.get("conv_backward_factors"):
                extra += ("; convolution gradients slowed by per-kind factors "
                          f"({', '.join(f'{k} {float(v):.3g}' for k, v in sorted(m['conv_backward_factors'].items()))}) "
                          f"fitted on DeepBench's conv kernel times of {', '.join(cal.get('devices') or ['(not stated)'])}")
            trained = ", ".join(m.get("train_devices") or []) or trained
        lines.append(f"Predictor: {where}{extra}; trained on kernel sweeps of {trained}.")
    if len(lines) > 1:
        lines.append("Each GPU is forecast by the shipped predictor of its vendor.")
    return " ".join(lines)


def run_evaluation(cfg: EvaluateConfig, out_dir: str | os.PathLike, command: str = "neusight-evaluate",
                   out_md: str | None = None, accuracy_out: str | None = None) -> dict[str, Any]:
    """Everything the app does, without Hydra: predict, write the files into ``out_dir`` (and the report to
    ``out_md``, the accuracy per kind of forecast to ``accuracy_out``, if given), return a summary."""
    import pandas as pd

    from neusight import e2e_eval as ev
    from neusight.api import load_predictor, shipped_predictor_dir
    from neusight.devices import load_device
    from neusight.evaluate import evaluate_labels, find_labels
    from neusight.util import atomic_write_text

    out = Path(out_dir)
    t0 = time.perf_counter()
    runs = ev.select_labels(find_labels(cfg.labels.dataset, vendors=tuple(cfg.labels.vendors), options=tuple(cfg.labels.options)), gpus=cfg.labels.gpus, models=cfg.labels.models,
                            modes=cfg.labels.modes, max_runs=cfg.labels.max_runs)
    if cfg.checkpoint:
        pred = load_predictor(cfg.checkpoint)
        shipped = None
        trained_on = tuple(pred.train_devices_)
    else:   # each GPU by its vendor's shipped predictor
        pred = None
        shipped = sorted({shipped_predictor_dir(load_device(r.device)) for r in runs}
                         | ({shipped_predictor_dir()} if cfg.cnn.enabled or not runs else set()))
        trained_on = tuple(d for path in shipped for d in load_predictor(path).train_devices_)
    results = evaluate_labels(runs, pred)
    failed = results.attrs.get("failed", [])
    labels = ev.label_frame(results)
    t_labels = time.perf_counter() - t0
    atomic_write_text(out / "results.csv", labels.to_csv(index=False))
    targets = (cfg.target_trained_pct, cfg.target_unseen_pct)
    per_gpu = ev.per_gpu_summary(labels, trained_on, targets)
    atomic_write_text(out / "per_gpu.csv", per_gpu.to_csv(index=False))
    speedups = ev.speedup_frame(labels, ev.LABEL_CONFIG, trained_on)
    atomic_write_text(out / "speedups.csv", speedups.to_csv(index=False))

    cnn = skipped = half = small = tf32 = layouts = None
    if cfg.cnn.enabled:
        sel, skipped = ev.load_cnn_benchmarks(cfg.cnn.dir, min_batch=cfg.cnn.min_batch)
        cnn = ev.predict_cnn(sel, pred)
        atomic_write_text(out / "cnn_results.csv", cnn.to_csv(index=False))
        atomic_write_text(out / "cnn_skipped.csv", skipped.to_csv(index=False))
        atomic_write_text(out / "cnn_speedups.csv", ev.speedup_frame(cnn, ev.CNN_CONFIG, trained_on).to_csv(index=False))
        if cfg.cnn.tf32:
            tf32_sel, _ = ev.load_cnn_benchmarks(cfg.cnn.dir, min_batch=cfg.cnn.min_batch, precisions=ev.TF32_PRECISIONS)
            tf32 = ev.predict_cnn(tf32_sel, pred)
            tf32["fp32_error_pct"] = ev.predict_cnn(tf32_sel, pred, tf32="off")["error_pct"]   # as true FP32
            atomic_write_text(out / "cnn_tf32_results.csv", tf32.to_csv(index=False))
        if cfg.cnn.half:
            half_sel, _ = ev.load_cnn_benchmarks(cfg.cnn.dir, min_batch=cfg.cnn.min_batch, precisions=ev.HALF_PRECISIONS)
            half = ev.predict_cnn(half_sel, pred)
            half["fp16_error_pct"] = ev.predict_cnn(half_sel.assign(dtype="float16", amp=None), pred)["error_pct"]
            half["nhwc_error_pct"] = ev.predict_cnn(half_sel.assign(memory_format="channels_last"), pred)["error_pct"]
            atomic_write_text(out / "cnn_half_results.csv", half.to_csv(index=False))
            both, _ = ev.load_cnn_benchmarks(cfg.cnn.dir, min_batch=cfg.cnn.min_batch, precisions=ev.HALF_PRECISIONS,
                                             by_layout=True)
            both = both[both.groupby(ev.LAYOUT_PAIR_KEY)["memory_format"].transform("nunique") > 1]
            both = both.reset_index(drop=True)
            layouts = ev.layout_pairs(ev.predict_cnn(both, pred))
            atomic_write_text(out / "cnn_layout_pairs.csv", layouts.to_csv(index=False))
        if cfg.cnn.small_batches:
            small_sel, _ = ev.load_cnn_benchmarks(cfg.cnn.dir, min_batch=1)
            small_sel = small_sel[(small_sel["mode"] == "inference") & (small_sel["batch"] < cfg.cnn.min_batch)]
            small = ev.predict_cnn(small_sel, pred)
            atomic_write_text(out / "cnn_small_batch_results.csv", small.to_csv(index=False))
    t_all = time.perf_counter() - t0

    plain = int((~labels["mode"].str.contains("+", regex=False)).sum()) if len(labels) else 0
    n_fused = int(labels["mode"].str.endswith("+fusion").sum()) if len(labels) else 0
    extra = f" and {n_fused} `-fusion` runs (the model under torch.compile)" if n_fused else ""
    fused_note = ("; a -fusion run is forecast with neusight.graph.fusion, mode `inference+fusion` below, next to "
                  "the same run forecast as eager kernels") if n_fused else ""
    header = (f"# End-to-end evaluation\n\nGenerated by `{command}` (neusight/cli/evaluate.py, neusight/e2e_eval.py); "
              "do not edit by hand, rerun it.\n\n"
              f"{_predictor_line(cfg.checkpoint, shipped)} GPUs outside that list are forecast from their spec "
              f"files alone.\n\nLabels: {plain} plain (eager, 1-GPU) runs{extra} of "
              f"`{_short_path(cfg.labels.dataset)}/labels`, predicted with their protocol (neusight/evaluate.py: "
              "inference = eval + no_grad forward; training = forward + backward of a cross-entropy, no loss or "
              f"optimizer time{fused_note}). Wall time: labels {t_labels:.1f} s, everything {t_all:.1f} s on "
              f"{os.cpu_count()} cores.")
    if failed:
        header += (f"\n\n{len(failed)} label run(s) could not be forecast and are left out: "
                   + "; ".join(f"`{_short_path(path)}` ({reason})" for path, reason in failed) + ".")
    footer = ("The predicted-vs-measured log-log plot (NeuSight and roofline side by side) is written to the run "
              "directory as `predicted_vs_measured.png`.")
    md = ev.render_markdown(labels, trained_on, cnn=cnn, cnn_skipped=skipped, header=header, footer=footer,
                            targets=targets, cnn_half=half, cnn_small=small, cnn_tf32=tf32, cnn_layouts=layouts)
    atomic_write_text(out / "evaluation.md", md)
    if out_md:
        atomic_write_text(out_md, md)
    if accuracy_out:
        from neusight.accuracy import accuracy_records, write_accuracy

        used = [load_predictor(p) for p in shipped] if pred is None else [pred]
        gpus = set(labels["gpu"]) | {g for c in (cnn, tf32, half) if c is not None for g in c["gpu"]}
        records = accuracy_records(labels, trained_on, vendors={g: load_device(g).vendor for g in gpus},
                                   cnn=[c for c in (cnn, tf32, half) if c is not None])
        write_accuracy(accuracy_out, records, command=command,
                       predictor_sha256=[p.manifest_.get("weights_sha256") for p in used
                                         if getattr(p, "manifest_", {}).get("weights_sha256")])
    if cfg.plot:
        ev.scatter_plot(labels, out / "predicted_vs_measured.png", cnn=cnn, trained_on=trained_on,
                        title=f"{len(labels)} NeuSight label runs" + (f" + {len(cnn)} ResNet benchmark rows" if cnn is not None else ""))
    summary = {"runs": len(labels), "mean_abs_error_pct": float(labels["error_pct"].abs().mean()),
               "roofline_mean_abs_error_pct": float(labels["roofline_error_pct"].abs().mean()),
               "speedup_pairs": len(speedups),
               "speedup_mean_abs_error_pct": float(speedups["error_pct"].abs().mean()) if len(speedups) else None,
               "labels_wall_s": t_labels, "total_wall_s": t_all,
               "cnn_mean_abs_error_pct": None, "cnn_other_gpus_mean_abs_error_pct": None,
               "cnn_tf32_mean_abs_error_pct": None, "cnn_half_mean_abs_error_pct": None}
    if cnn is not None:   # issue 4's scope (V100, T4) and the other FP32 GPUs apart; NaN when a scope has no row
        acc = cnn["scope"] == ev.SCOPE_ACCEPTANCE
        summary["cnn_mean_abs_error_pct"] = float(cnn.loc[acc, "error_pct"].abs().mean())
        summary["cnn_other_gpus_mean_abs_error_pct"] = float(cnn.loc[~acc, "error_pct"].abs().mean())
    if tf32 is not None:   # TF32 rows (Ampere+ "float" runs): measured, never fitted, outside issue 4
        summary["cnn_tf32_mean_abs_error_pct"] = float(tf32["error_pct"].abs().mean())
    if half is not None:   # AMP / FP16 rows, forecast as pure FP16: measured, never fitted, outside issue 4
        summary["cnn_half_mean_abs_error_pct"] = float(half["error_pct"].abs().mean())
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    with pd.option_context("display.width", 200, "display.float_format", "{:,.1f}".format):
        print(per_gpu.to_string(index=False))
        if cnn is not None:
            print(ev.cnn_summary(cnn).to_string(index=False))
        for other in (tf32, half):
            if other is not None:
                print(ev.precision_summary(other).to_string(index=False))
    print(f"{len(labels)} label runs: mean |error| {summary['mean_abs_error_pct']:.1f} % (roofline "
          f"{summary['roofline_mean_abs_error_pct']:.1f} %)"
          + (f", {len(speedups)} GPU pairs: speed-up mean |error| {summary['speedup_mean_abs_error_pct']:.1f} % "
             f"(roofline {speedups['roofline_error_pct'].abs().mean():.1f} %)" if len(speedups) else "")
          + f"; labels in {t_labels:.1f} s, all in {t_all:.1f} s; "
          f"files in {out}" + (f"; report {out_md}" if out_md else ""))
    return summary


def _short_path(p: str) -> str:
    try:
        return os.path.relpath(p, REPO)
    except ValueError:  # pragma: no cover - other drive on Windows
        return p


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="evaluate")
@catch_user_errors
def _app(cfg: EvaluateConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    quiet_third_party_logs()
    hc = HydraConfig.get()
    out_md = os.path.join(hc.runtime.cwd, cfg.out_md) if cfg.out_md else None   # joins nothing if absolute
    accuracy_out = os.path.join(hc.runtime.cwd, cfg.accuracy_out) if cfg.accuracy_out else None
    command = " ".join(["neusight-evaluate", *hc.overrides.task])
    return run_evaluation(cfg, hc.runtime.output_dir, command, out_md, accuracy_out)["mean_abs_error_pct"]


class SweepSummaryCallback(Callback):
    """After a multirun: one table of every job's per-GPU mean |error| (``sweep_summary.md`` / ``.csv``)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        import pandas as pd
        import yaml

        from neusight.e2e_eval import markdown_table
        from neusight.util import atomic_write_text

        sweep = Path(config.hydra.sweep.dir)
        files = sorted(sweep.glob("*/per_gpu.csv"), key=lambda f: (len(f.parent.name), f.parent.name))
        if len(files) < 2:
            return
        overrides = []
        for f in files:
            ov = f.parent / ".hydra" / "overrides.yaml"
            overrides.append((yaml.safe_load(ov.read_text()) or []) if ov.is_file() else [])
        labels = [lab or f.parent.name for lab, f in zip(job_labels(overrides), files)]
        df = pd.concat([pd.read_csv(f).assign(job=lab) for f, lab in zip(files, labels)], ignore_index=True)
        t = df.pivot_table(index=["gpu", "mode"], columns="job", values="mean_abs_error_pct", aggfunc="first")
        t = t[[lab for lab in dict.fromkeys(labels) if lab in t.columns]]
        atomic_write_text(sweep / "sweep_summary.csv", t.to_csv())
        atomic_write_text(sweep / "sweep_summary.md", "Mean absolute % error per GPU and mode, one column per job.\n\n"
                          + markdown_table(t))
        print(f"\nper-GPU mean |error| % by job ({sweep / 'sweep_summary.md'}):")
        print(t.round(1).to_string())


def main() -> Any:
    if help_if_asked("neusight-evaluate", "evaluate", EvaluateConfig, __doc__):
        return 0
    sys.argv = [sys.argv[0], *_rewrite_predictor_override(sys.argv[1:])]
    return exit_2_on_config_errors(_app)()

"""``neusight-evaluate-kernels``: a predictor checkpoint vs measured kernels, beside a pure roofline and a
gradient-boosting baseline, per family x GPU (logic in :mod:`neusight.kernel_eval`).

    neusight-evaluate-kernels                                   # shipped predictor, large-shape files
    neusight-evaluate-kernels logo=true out_md=docs/kernels.md  # + leave-one-GPU-out, regenerate the doc
    neusight-evaluate-kernels data.traces=[my.csv] checkpoint=path/to/predictor max_rows_per_family=500
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import hydra
from hydra.core.config_store import ConfigStore

from neusight.cli.common import CONF_DIR, catch_user_errors, entry_point, quiet_third_party_logs
from neusight.kernel_eval import EVAL_TRACES, TRAIN_TRACES, GBRConfig
from neusight.predictor.model import TRAINING_GPUS

log = logging.getLogger(__name__)


@dataclass
class EvalDataConfig:
    traces: List[str] = field(default_factory=lambda: list(EVAL_TRACES))        # kernel CSVs / dirs to score
    extra_traces: List[str] = field(default_factory=list)                       # appended to traces
    devices: Optional[List[str]] = None          # keep only these GPUs of traces (keys or names)
    families: Optional[List[str]] = None         # keep only these kernel families (also in training)
    train_traces: List[str] = field(default_factory=lambda: list(TRAIN_TRACES))  # baseline + LOGO refits
    train_devices: List[str] = field(default_factory=lambda: list(TRAINING_GPUS))


@dataclass
class EvaluateKernelsConfig:
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    gbr: GBRConfig = field(default_factory=GBRConfig)   # the gradient-boosting baseline (its seed: from seed)
    checkpoint: Optional[str] = None             # predictor directory; null = the shipped data/predictor
    logo: bool = False                           # also leave-one-GPU-out over the training GPUs (slow)
    max_rows_per_family: Optional[int] = None    # deterministic subsample of eval and training rows
    seed: int = 0
    plots: bool = True                           # scatter_<family>.png
    out_md: Optional[str] = None                 # also write summary.md here (e.g. docs/kernels.md)
    progress: bool = False


ConfigStore.instance().store(name="evaluate_kernels_schema", node=EvaluateKernelsConfig)


def run(cfg: EvaluateKernelsConfig, out_dir: str | Path, command: str | None = None):
    """Evaluate as ``cfg`` says and write the files into ``out_dir`` (Hydra's run directory in the app)."""
    from omegaconf import OmegaConf

    from neusight.kernel_eval import evaluate_kernels
    from neusight.util import atomic_write_text

    ev = evaluate_kernels(
        [*cfg.data.traces, *cfg.data.extra_traces], train_traces=list(cfg.data.train_traces),
        train_devices=list(cfg.data.train_devices), checkpoint=cfg.checkpoint,
        devices=None if cfg.data.devices is None else list(cfg.data.devices),
        families=None if cfg.data.families is None else list(cfg.data.families),
        max_rows_per_family=cfg.max_rows_per_family, logo=cfg.logo, seed=cfg.seed, progress=cfg.progress,
        gbr=GBRConfig(**{**OmegaConf.to_container(cfg.gbr), "seed": cfg.seed}))
    ev.info["command"] = command or "neusight-evaluate-kernels"
    written = ev.write(out_dir, plots=cfg.plots)
    if cfg.out_md:
        atomic_write_text(cfg.out_md, ev.markdown())
        written.append(Path(cfg.out_md))
    return ev, written


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="evaluate_kernels")
@catch_user_errors
def _app(cfg: EvaluateKernelsConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    quiet_third_party_logs()
    hc = HydraConfig.get()
    out_dir = hc.runtime.output_dir
    command = " ".join(["neusight-evaluate-kernels", *hc.overrides.task])   # no hydra.* overrides: same results
    ev, written = run(cfg, out_dir, command)
    overall = ev.summary[ev.summary["device"] == "all"]
    for _, r in overall.iterrows():
        print(f"{r['family']:<12} {r['rows']:>6} kernels  MAPE  NeuSight {r['neusight_mape']:6.1f} %  "
              f"roofline {r['roofline_mape']:6.1f} %  GBR {r['gbr_mape']:6.1f} %")
    print(f"wrote {', '.join(str(p) for p in written[:3])} and {len(written) - 3} more "
          f"in {ev.info['timings']['total_s']:.0f} s")
    return float(overall["neusight_mape"].mean())


main = entry_point(_app, "neusight-evaluate-kernels", "evaluate_kernels", EvaluateKernelsConfig, __doc__)

"""``neusight-train``: fit the per-family utilization MLPs on kernel traces and write a checkpoint.

The defaults regenerate the shipped predictor (``data/predictor``): NVIDIA kernel sweeps of the five
training GPUs only (P4, P100, T4, V100, A100-40GB).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from neusight.cli.common import CONF_DIR, catch_user_errors, entry_point, quiet_third_party_logs

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


@dataclass
class DataConfig:
    traces: list[str] = field(default_factory=lambda: [str(REPO.parent / "shared/datasets/neusight-asplos25/kernels/nvidia")])
    devices: list[str] = field(default_factory=lambda: ["p4", "p100-pcie-16gb", "t4", "v100-pcie-32gb", "a100-pcie-40gb"])


@dataclass
class ConvBackwardConfig:
    # Baidu DeepBench conv times (forward, data and weight gradient of the same shapes); "" = no factors
    csv: str = str(REPO.parent / "shared/datasets/public-benchmarks/deepbench_conv.csv")
    # GPUs the factors are fitted on; null = the predictor's own training GPUs that DeepBench has (shipped: P100,
    # T4), so that a predictor learns from its training GPUs only; DeepBench's other GPUs check the factors
    devices: Optional[list[str]] = None


@dataclass
class CalibrateConfig:
    enabled: bool = True
    # NeuSight dataset folder (labels/, models/): plain end-to-end runs of the training GPUs only
    dataset: str = str(REPO.parent / "shared/datasets/neusight-asplos25")
    # convolution-gradient factors (neusight.conv_backward), NVIDIA predictors only: they describe cuDNN
    conv_backward: ConvBackwardConfig = field(default_factory=ConvBackwardConfig)


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    predictor: Any = MISSING                 # config group predictor/: hyper-parameters per family
    val_devices: list[str] = field(default_factory=lambda: ["logo"])   # or GPU keys held out for early stopping
    seed: int = 0
    out: str = str(REPO / "data" / "predictor")
    progress: bool = True
    resume: bool = True


ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def data_hash(paths: list[str]) -> str:
    """sha256 over the CSV files (relative name + content), so a checkpoint says exactly what it saw."""
    from neusight.dataset import _expand_paths

    h = hashlib.sha256()
    for f in sorted(_expand_paths(paths)):
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _fit_conv_backward(cfg: TrainConfig, pred: Any, df: Any) -> dict | None:
    """Fit the convolution-gradient factors into ``pred`` (after the end-to-end scale: they are fitted on
    in-model forecasts). Skipped when disabled or when the predictor is not for NVIDIA GPUs."""
    from neusight.devices import load_device

    spec = cfg.calibrate.conv_backward
    if not cfg.calibrate.enabled or not spec.csv:
        return None
    vendors = {load_device(d).vendor for d in df["device"].unique()}
    if vendors != {"nvidia"}:
        log.info("no convolution-gradient factors: they are fitted on cuDNN kernels, this predictor is for %s",
                 sorted(vendors))
        return None
    from neusight.conv_backward import fit_conv_backward
    from neusight.dataset import load_deepbench_conv

    rows = load_deepbench_conv(spec.csv)
    devices = list(spec.devices) if spec.devices is not None else sorted(set(rows["device"]) & set(df["device"]))
    if not devices:
        log.info("no convolution-gradient factors: DeepBench has none of the training GPUs %s; name GPUs in "
                 "calibrate.conv_backward.devices to fit them on others", sorted(df["device"].unique()))
        return None
    result = fit_conv_backward(rows, pred, devices, source=spec.csv)
    pred.conv_backward_ = dict(result["factors"])
    log.info("convolution-gradient factors %s from DeepBench rows of %s; summed gradient/forward ratio error %% per "
             "GPU (none, fitted, GPU held out): %s", result["factors"], result["devices"], result["summed_ratio_error_pct"])
    return result


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="train")
@catch_user_errors
def _app(cfg: TrainConfig) -> float:
    from neusight.dataset import load_kernel_traces
    from neusight.errors import InputError
    from neusight.predictor.mlp import MLPConfig
    from neusight.predictor.model import Predictor, PredictorConfig

    quiet_third_party_logs()
    fams = {}
    for name, spec in cfg.predictor.families.items():
        try:
            fams[name] = MLPConfig(**{**OmegaConf.to_container(spec, resolve=True), "seed": cfg.seed,
                                      "hidden": tuple(spec.hidden)})
        except InputError as e:
            raise InputError(f"predictor.families.{name}.{e}. Fix: change it on the command line or in "
                             "conf/predictor/") from None
    t0 = time.time()
    traces = [str(Path(p)) for p in cfg.data.traces]
    df = load_kernel_traces(traces, devices=list(cfg.data.devices))
    log.info("loaded %d kernel rows of %s in %.1f s", len(df), sorted(df["device"].unique()), time.time() - t0)
    pcfg = PredictorConfig(families=fams, val_devices=tuple(cfg.val_devices), seed=cfg.seed)
    digest = data_hash(traces)
    resume_dir = Path(cfg.out).with_name(f".{Path(cfg.out).name}.partial-{digest[:12]}") if cfg.resume else None
    pred = Predictor(pcfg).fit(df, progress=cfg.progress, resume_dir=resume_dir)
    calibration = None
    if cfg.calibrate.enabled:
        from neusight.evaluate import calibrate, find_labels

        calibration = calibrate(pred, find_labels(cfg.calibrate.dataset, vendors=("nvidia", "amd")))
        log.info("end-to-end scale %.4f, launch floor %.2f x overhead, from %d label runs of %s; leave-one-GPU-out: %s",
                 calibration["scale"], calibration["floor"], calibration["runs"], calibration["devices"],
                 calibration["leave_one_gpu_out"])
    conv_backward = _fit_conv_backward(cfg, pred, df)
    command = "neusight-train " + " ".join(sys.argv[1:])
    pred.save(cfg.out, manifest_extra={
        "command": command.strip(), "data": {"traces": traces, "devices": list(cfg.data.devices), "rows": int(len(df)),
                                             "sha256": digest},
        "trained_on": "kernel sweeps of " + ", ".join(sorted(df["device"].unique())),
        "e2e_calibration": calibration, "conv_backward_calibration": conv_backward,
        "created_s": round(time.time() - t0, 1)})
    if resume_dir is not None:
        import shutil

        shutil.rmtree(resume_dir, ignore_errors=True)
    mean = sum(v["train_mape_per_device"][d] for v in pred.metrics_.values() for d in v["train_mape_per_device"])
    n = sum(len(v["train_mape_per_device"]) for v in pred.metrics_.values())
    print(f"wrote {cfg.out} in {time.time() - t0:.0f} s; mean training MAPE {mean / max(n, 1):.1f} %")
    return mean / max(n, 1)


main = entry_point(_app, "neusight-train", "train", TrainConfig, __doc__)

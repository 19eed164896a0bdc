"""``neusight-collect out=my-traces``: time kernels on this machine's GPU into the shared kernel-CSV schema.

    neusight-collect out=traces                               # every op, the default sweep (~300 shapes per op)
    neusight-collect out=traces 'ops=[linear,bmm,softmax]' sweep=quick
    neusight-collect out=traces device=cpu sweep=quick        # no GPU: try the plumbing (rows not trainable)

Check the shipped predictor on them: ``neusight-evaluate-kernels 'data.traces=[traces]'``. Then train with them: ``neusight-train 'data.traces=[../shared/datasets/neusight-asplos25/kernels/nvidia,traces]'
'data.devices=[p4,p100-pcie-16gb,t4,v100-pcie-32gb,a100-pcie-40gb,<your gpu>]' out=my-predictor`` (your GPU
needs a spec file in data/devices/). See :mod:`neusight.collect`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from neusight.cli.common import CONF_DIR, catch_user_errors, entry_point

log = logging.getLogger(__name__)


@dataclass
class CollectConfig:
    out: str = MISSING                   # output folder: <out>/<op>/<Device>.csv (relative to the working directory),
    #                                      e.g. out=traces; required
    ops: list[str] = field(default_factory=lambda: ["linear", "bmm", "conv", "add", "addu", "mul", "mulu", "div",
                                                    "divu", "pow", "powu", "relu", "tanh", "gelu", "softmax", "ln"])
    sweep: str = "default"               # default | quick
    samples: Optional[int] = None        # shapes per op; null = the sweep's
    device: Optional[str] = None         # cuda | cuda:1 | cpu; default: the current GPU, else the CPU
    device_name: Optional[str] = None    # the Device column; null = torch.cuda.get_device_name()
    repeats: int = 25                    # timed calls per shape
    keep: int = 5                        # the mean of this many fastest is the latency
    seed: int = 0
    progress: bool = True


ConfigStore.instance().store(name="collect_schema", node=CollectConfig)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="collect")
@catch_user_errors
def _app(cfg: CollectConfig) -> None:
    import dataclasses
    import os

    from hydra.utils import get_original_cwd

    from neusight.collect import SWEEPS, collect
    from neusight.errors import InputError

    if cfg.sweep not in SWEEPS:
        raise InputError(f"sweep={cfg.sweep!r} is not known. Fix: one of {', '.join(SWEEPS)}")
    sweep = SWEEPS[cfg.sweep]
    if cfg.samples is not None:
        if cfg.samples < 1:
            raise InputError(f"samples={cfg.samples} must be >= 1. Fix: e.g. samples=100")
        sweep = dataclasses.replace(sweep, samples=cfg.samples)
    out = cfg.out if os.path.isabs(cfg.out) else os.path.join(get_original_cwd(), cfg.out)
    progress = None
    if cfg.progress:
        from tqdm import tqdm

        progress = tqdm
    files = collect(out, list(cfg.ops), sweep, device=cfg.device, device_name=cfg.device_name, seed=cfg.seed,
                    repeats=cfg.repeats, keep=cfg.keep, progress=progress)
    for op, path in files.items():
        print(f"{op}: {path}")


main = entry_point(_app, "neusight-collect", "collect", CollectConfig, __doc__)

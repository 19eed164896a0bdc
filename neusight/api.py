"""Public API: trace a model, predict its kernels on a GPU from the spec sheet, aggregate."""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from neusight.accuracy import forecast_kind, measured_accuracy
from neusight.devices import Device, load_device
from neusight.errors import DataError, InputError
from neusight.graph.fusion import REWRITE_NOTE, REWRITTEN_ATTENTION, fused_kernels
from neusight.graph.graph import Graph
from neusight.graph.layout import INDUCTOR_NOTE, LAYOUT_NOTE, TRANSPOSE_KERNELS, charged, with_layout_transposes
from neusight.graph.megatron import megatron_kernels
from neusight.graph.tracer import notes_on, trace
from neusight.kernels.base import ATTENTION_KERNEL
from neusight.kernels.ops_gemm import DEPTHWISE_PREFIX
from neusight.memory import estimate_memory
from neusight.predictor.features import without_tensor_cores
from neusight.predictor.model import SHIPPED, SHIPPED_AMD, Predictor
from neusight.tiles import DEDICATED_LANES_GEMM_FRACTION, GEMM_FAMILIES, sgemm_lane_fraction
from neusight.util import atomic_write_text

log = logging.getLogger(__name__)

PHASES = ("forward", "loss", "backward", "optimizer")


@functools.lru_cache(maxsize=4)
def _predictor(path: str | None) -> Predictor:
    return Predictor.load(path)


def shipped_predictor_dir(device: Device | None = None) -> Path:
    """The shipped checkpoint for ``device``: ``data/predictor-amd`` (trained on AMD kernel sweeps) for an AMD GPU
    when it exists, else ``data/predictor`` (trained on the five NVIDIA training GPUs)."""
    if device is not None and device.vendor == "amd" and SHIPPED_AMD.is_dir():
        return SHIPPED_AMD
    return SHIPPED


def load_predictor(path: str | Path | Predictor | None = None, device: Device | str | None = None) -> Predictor:
    """A checkpoint directory or a Predictor passed through; ``None``: the shipped predictor for ``device``'s
    vendor (:func:`shipped_predictor_dir`; NVIDIA's without a device). Cached."""
    if isinstance(path, Predictor):
        return path
    if path is None:
        path = shipped_predictor_dir(load_device(device) if device is not None else None)
    return _predictor(str(Path(path).resolve()))


def kernel_dims(kernels: pd.DataFrame) -> pd.DataFrame:
    """Split a trace's ``dims`` tuples into B, M, N, K (GEMM families) or rows, cols (the others)."""
    dims = kernels["dims"].tolist()
    gemm = kernels["family"].isin(GEMM_FAMILIES).to_numpy()
    out = pd.DataFrame(np.nan, index=kernels.index, columns=["B", "M", "N", "K", "rows", "cols"])
    if gemm.any():
        out.loc[gemm, ["B", "M", "N", "K"]] = np.array([d for d, g in zip(dims, gemm) if g], dtype=float)
    if (~gemm).any():
        out.loc[~gemm, ["rows", "cols"]] = np.array([d for d, g in zip(dims, gemm) if not g], dtype=float)
    return out


@dataclass
class Prediction:
    """Result of :func:`predict`: total, per phase, per layer and per kernel, plus memory."""

    model: str
    device: Device
    mode: str
    batch_size: int
    seq_len: int | None
    latency_ms: float
    phases: dict[str, float]
    kernels: pd.DataFrame
    graph: Graph = field(repr=False)
    notes: tuple[str, ...] = ()
    memory: Any = None
    predictor_devices: tuple[str, ...] = ()
    accuracy: dict[str, Any] | None = None   # neusight.accuracy.measured_accuracy: how far off this kind of forecast was

    @property
    def layers(self) -> pd.DataFrame:
        """Per module path: latency (ms), share of the total, kernels, and the dominant bound."""
        k = self.kernels
        agg = k.groupby("module", sort=False).agg(latency_ms=("latency_ms", "sum"), kernels=("latency_ms", "size"),
                                                  gflops=("flops", lambda s: s.sum() / 1e9))
        mem = k[k["bound"] == "memory"].groupby("module")["latency_ms"].sum()
        agg["memory_bound_share"] = (mem.reindex(agg.index).fillna(0) / agg["latency_ms"]).round(3)
        agg["share"] = agg["latency_ms"] / max(self.latency_ms, 1e-12)
        return agg.sort_values("latency_ms", ascending=False)

    @property
    def throughput(self) -> tuple[float, str]:
        """What one pass or step processes per second: images/s for vision models (a batch of images),
        tokens/s for sequence models (batch x sequence length), else samples/s."""
        seconds = max(self.latency_ms, 1e-12) / 1e3
        if self.graph is not None and self.graph.image_size is not None:
            return self.batch_size / seconds, "images/s"
        if self.seq_len:
            return self.batch_size * self.seq_len / seconds, "tokens/s"
        return self.batch_size / seconds, "samples/s"

    @property
    def efficiency(self) -> Any:
        """MFU, HFU and MBU of the forecast against the GPU's spec-sheet peaks
        (:class:`neusight.efficiency.Efficiency`)."""
        from neusight.efficiency import efficiency

        return efficiency(self.kernels, self.device, self.latency_ms)

    def by_family(self) -> pd.DataFrame:
        k = self.kernels
        agg = k.groupby("family").agg(kernels=("latency_ms", "size"), latency_ms=("latency_ms", "sum"),
                                      roofline_ms=("roofline_ms", "sum"), gflops=("flops", lambda s: s.sum() / 1e9),
                                      gb=("bytes", lambda s: s.sum() / 1e9))
        agg["share"] = agg["latency_ms"] / max(self.latency_ms, 1e-12)
        return agg.sort_values("latency_ms", ascending=False)

    def to_dict(self) -> dict[str, Any]:
        rate, unit = self.throughput
        d = {"model": self.model, "device": self.device.key, "device_name": self.device.name, "mode": self.mode,
             "batch_size": self.batch_size, "seq_len": self.seq_len, "dtype": getattr(self.graph, "dtype", None),
             "amp": getattr(self.graph, "amp", None), "kv_cache": getattr(self.graph, "kv_cache", None),
             "gradient_checkpointing": getattr(self.graph, "gradient_checkpointing", False),
             "lora_rank": getattr(self.graph, "lora_rank", None),
             "tf32_kernels": int((self.kernels["dtype"] == "tf32").sum()),
             "memory_format": getattr(self.graph, "memory_format", "contiguous"),
             "layout_transposes": int(self.kernels["kernel"].isin(TRANSPOSE_KERNELS).sum()),
             "latency_ms": self.latency_ms,
             "throughput": rate, "throughput_unit": unit, "phases": self.phases,
             "notes": list(self.notes), "predictor_trained_on": list(self.predictor_devices),
             "measured_accuracy": self.accuracy, "efficiency": self.efficiency.to_dict(),
             "families": self.by_family().reset_index().to_dict(orient="records")}
        if self.memory is not None and hasattr(self.memory, "to_dict"):
            d["memory"] = self.memory.to_dict()
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, default=float)
        if path is not None:
            atomic_write_text(path, text)
        return text

    def plot(self, outdir: str | Path, *, formats: tuple[str, ...] = ("png", "svg"), prefix: str = "") -> list[Path]:
        """Render the four pictures into ``outdir``: roofline, time-based roofline, memory timeline (when
        the memory forecast is there) and per-layer breakdown. Returns the files written."""
        from neusight import plots

        outdir = Path(outdir)
        outdir.mkdir(parents=True, exist_ok=True)
        k = self.kernels
        overhead_us = float(k["overhead_ms"].median() * 1e3) if "overhead_ms" in k and len(k) else 5.0
        files = plots.roofline_chart(k, self.device, outdir / f"{prefix}roofline", formats=formats)
        files += plots.time_roofline(k, self.device, outdir / f"{prefix}time_roofline", launch_overhead_us=overhead_us,
                                     formats=formats)
        if self.memory is not None:
            files += plots.memory_timeline(self.memory, outdir / f"{prefix}memory_timeline", formats=formats)
        files += plots.layer_breakdown(k, outdir / f"{prefix}layers", formats=formats)
        return files

    def to_csv(self, path: str | Path) -> None:
        k = self.kernels.copy()
        k["dims"] = k["dims"].map(lambda d: "x".join(str(x) for x in d))
        atomic_write_text(path, k.to_csv(index=False))

    def chrome_trace(self) -> dict[str, Any]:
        """The forecast as a timeline in the Chrome trace-event format (open it in ui.perfetto.dev or
        chrome://tracing): the kernels back to back on one GPU stream in program order, each an event named by
        its kernel with its family, phase, module, dims, bound, utilization and roofline (gaps where the GPU waits for
        a launch when the host is modelled, ``host_us``); the phases as spans on
        a second track. Times in microseconds from the step's start."""
        k = self.kernels
        cost = k["latency_ms"].to_numpy(float) * 1e3                 # with the host modelled: its wait + gpu_ms
        dur = k["gpu_ms"].to_numpy(float) * 1e3 if "gpu_ms" in k else cost
        start = np.concatenate([[0.0], np.cumsum(cost)[:-1]]) + (cost - dur)
        gpu = f"{self.device.name} (forecast)"
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": gpu}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "phases"}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "kernels"}}]
        for phase in dict.fromkeys(k["phase"]):
            mine = (k["phase"] == phase).to_numpy()
            t0, t1 = float(start[mine].min()), float((start + dur)[mine].max())
            events.append({"name": phase, "ph": "X", "pid": 0, "tid": 0, "ts": t0, "dur": t1 - t0, "cat": "phase"})
        for i, row in enumerate(k[["kernel", "family", "phase", "module", "dims", "bound", "utilization",
                                   "roofline_ms"]].itertuples(index=False)):
            events.append({"name": str(row.kernel), "ph": "X", "pid": 0, "tid": 1, "ts": float(start[i]),
                           "dur": float(dur[i]), "cat": str(row.family),
                           "args": {"phase": row.phase, "module": row.module,
                                    "dims": "x".join(str(x) for x in row.dims), "bound": row.bound,
                                    "utilization": round(float(row.utilization), 4),
                                    "roofline_us": round(float(row.roofline_ms) * 1e3, 3)}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"model": self.model, "device": self.device.key, "mode": self.mode,
                              "batch_size": self.batch_size, "seq_len": self.seq_len,
                              "latency_ms": self.latency_ms, "note": "a forecast, not a measurement"}}

    def to_chrome_trace(self, path: str | Path) -> None:
        """Write :meth:`chrome_trace` as JSON (atomically)."""
        atomic_write_text(path, json.dumps(self.chrome_trace(), default=float))


def e2e_kernel_ms(roofline_ms: np.ndarray, isolated_ms: np.ndarray, overhead_ms: np.ndarray, scale: float,
                  floor: float = 1.0) -> np.ndarray:
    """A kernel's cost inside a model: max(roofline + scale x excess, floor x launch overhead), where the
    excess is what its isolated prediction spends beyond roofline and overhead. Non-decreasing in the
    isolated prediction, and never below the roofline."""
    excess = np.maximum(isolated_ms - overhead_ms - roofline_ms, 0.0)
    return np.maximum(roofline_ms + scale * excess, floor * overhead_ms)


def host_waits_ms(gpu_ms: np.ndarray, host_us: float) -> np.ndarray:
    """How long the GPU waits before each kernel for the host to launch it, when the host issues one kernel every
    ``host_us`` microseconds from the run's start and the GPU runs them in order on one stream, each as soon as it
    is launched and the one before has ended: kernel i is launched at (i + 1) x host_us, starts at max(launch, end of
    kernel i - 1) and ends ``gpu_ms[i]`` later. The run ends at sum(gpu_ms) + sum(waits)."""
    d = np.asarray(gpu_ms, dtype=float)
    if not len(d):
        return d.copy()
    done = np.cumsum(d)                                       # the kernels' ends with no host in the way
    launch = np.arange(1, len(d) + 1) * (host_us / 1e3)
    ends = done + np.maximum.accumulate(launch - (done - d))  # end_i = C_i + max_{j<=i}(launch_j - C_{j-1})
    return np.maximum(launch - np.concatenate([[0.0], ends[:-1]]), 0.0)   # launched after the kernel before ended


HOST_MODEL_NOTE = ("host modelled (host_us={h:g}): the host launches a kernel every {h:g} us; the GPU waits "
                   "{wait:,.2f} ms ({share:.0f} % of the forecast) for launches where kernels run shorter than that. "
                   "The host's time per launch depends on the CPU, the PyTorch version and the loop around the model "
                   "and is not in a GPU's spec sheet; docs/host.md")


TF32_NOTE = ("{n} FP32 kernels ({what}) run on TF32 tensor cores (tf32={mode!r}; PyTorch's default puts convolutions "
             "there): bounded by the dense TF32 peak, with a utilization model learned on FP32 kernels; tf32='off' "
             "forecasts true FP32")
FUSED_NOTE = ("torch.compile (TorchInductor default mode): memory-bound ops between GEMMs run as fused kernels; "
              "the memory forecast is the compiled run's (what a fused kernel keeps on chip is not allocated, "
              "pointwise results only pointwise backward kernels read are recomputed there, not saved)")
MEGATRON_NOTE = ("Megatron-LM kernels (neusight.graph.megatron): {fused}, {dropped} Hugging Face kernels dropped (the "
                 "attention scaling folded into the QK^T GEMM, no KV cache); other kernels as Hugging Face runs them")
NO_TENSOR_CORE_NOTE = ("{n} {what} convolution kernels have channels that are not multiples of 8 (FP16 / BF16) or 4 "
                       "(TF32), e.g. a first layer on 3-channel images, which cuDNN's tensor-core kernels want: they are "
                       "forecast as CUDA-core convolutions at the FP32 rates (padding the channels to such a multiple "
                       "lets them use tensor cores)")
DEPTHWISE_NOTE = ("{n} depthwise-convolution kernels are forecast as memory-bound window ops at the memory-bound model's "
                  "speed; no kernel measurement covers them, and PyTorch's FP32 depthwise kernels run well below memory "
                  "bandwidth, so expect this forecast to be too fast (EfficientNet rows of docs/evaluation.md)")
# GPUs whose SM schedulers feed 32 FP32 lanes each: SGEMM cannot fill them all (neusight.tiles.sgemm_lane_fraction),
# and how much it fills was checked against public cuBLAS SGEMMs only (docs/sgemm-public.md), so a forecast resting
# on it says so.
SGEMM_LANES_NOTE = ("{share:.0f} % of this forecast is FP32 GEMMs ({what}), bounded at {fraction:g} of {device}'s "
                    "{peak:.1f} TFLOP/s FP32 peak: its SMs feed 32 FP32 lanes per scheduler, more than SGEMM can keep "
                    "busy. Of such GPUs only L4 has kernel measurements{check}")
SGEMM_LANES_CHECK = {
    "dedicated": "; public cuBLAS SGEMMs on H100 ran at 0.6-1.05x the speed this bound forecasts "
                 "(docs/sgemm-public.md)",
    "shared": " (a 72 W card), and this bound matches them; public cuBLAS SGEMMs of 300-450 W cards (RTX 4090, "
              "RTX A6000) ran about 1.5x faster than forecast, so such a card's FP32 GEMM time may be overestimated "
              "(docs/sgemm-public.md)",
}


def sgemm_lanes_note(device: Device, kernels: pd.DataFrame) -> str | None:
    """SGEMM_LANES_NOTE when FP32 GEMM-like kernels of a run on ``device`` are bounded below its spec-sheet FP32
    peak (neusight.tiles.sgemm_lane_fraction < 1), with their share of the forecast time; else None."""
    fraction = sgemm_lane_fraction(device)
    if fraction >= 1.0 or kernels.empty or "dtype" not in kernels:
        return None
    gemm = kernels["family"].isin(GEMM_FAMILIES) & (kernels["dtype"].astype(str) == "float32")
    if not gemm.any():
        return None
    share = 100.0 * float(kernels.loc[gemm, "latency_ms"].sum()) / max(float(kernels["latency_ms"].sum()), 1e-12)
    kind = "dedicated" if fraction == DEDICATED_LANES_GEMM_FRACTION else "shared"
    return SGEMM_LANES_NOTE.format(share=share, what=", ".join(sorted(kernels.loc[gemm, "family"].unique())),
                                   fraction=fraction, device=device.key, peak=device.fp32_matrix_tflops,
                                   check=SGEMM_LANES_CHECK[kind])


# Eager PyTorch spends host (CPU) time on every kernel it launches: Python, the dispatcher, the launch itself,
# roughly 10-50 us depending on the host and the training loop around the model. Kernels are queued
# asynchronously, so while each takes longer on the GPU than that, the host runs ahead and only GPU time counts,
# which is what is forecast. Below it, the host issuing kernels is the bottleneck and the run takes longer
# than forecast whatever the GPU (docs/evaluation.md, "Small batches": DeepLearningExamples' batch-1 ResNets
# take the same time on a T4 and a V100). The host is not modelled; such a forecast says so.
HOST_BOUND_US = 50.0
# A GPU whose spec-sheet descriptors (compute capability, board power, memory type) lie outside the training GPUs'
# range: the models that take them hold them at the range's edge (and inside the envelope of the training GPUs'
# combinations), so those kernels are forecast as on the nearest training GPU of that kind, scaled by the new
# GPU's own roofline. Stated, with the share of the time that rests on it (kernels' ``beyond_training``).
EXTRAPOLATION_NOTE = ("{device}'s {what} lie{s} outside the range of the GPUs the predictor was trained on ({where}); "
                      "the {fams} models hold {them} at the edge of that range, so {share:.0f} % of the forecast time "
                      "is extrapolated from the nearest training GPUs, scaled by this GPU's own roofline")


def anchored_ms(target: Prediction, reference: Prediction, measured_ms: float) -> float:
    """A forecast anchored to a measurement: ``measured_ms`` (the same run timed on ``reference``'s GPU) times the
    forecast speed-up of ``target``'s GPU over it. Errors the forecast makes alike on both GPUs cancel; how far
    forecast speed-ups are off is measured in docs/evaluation.md ("GPU against GPU")."""
    if isinstance(measured_ms, bool) or not isinstance(measured_ms, (int, float)) or not measured_ms > 0:
        raise InputError(f"anchor_ms={measured_ms!r} is not a positive time in ms. Fix: the step time you measured, "
                         "e.g. anchor_ms=412.5")
    diff = [f for f in ("model", "mode", "batch_size", "seq_len") if getattr(target, f) != getattr(reference, f)]
    diff += [f for f in ("dtype", "amp") if getattr(target.graph, f, None) != getattr(reference.graph, f, None)]
    if diff:
        raise InputError(f"an anchor must be the same run on another GPU; {', '.join(diff)} differ. "
                         "Fix: forecast the measured run itself on its GPU")
    return float(measured_ms) * target.latency_ms / reference.latency_ms


# What a price is quoted per, by throughput unit: the block of work and its size in units.
COST_BLOCKS = {"tokens/s": ("1M tokens", 1e6), "generated tokens/s": ("1M generated tokens", 1e6),
               "images/s": ("1M images", 1e6), "samples/s": ("1M samples", 1e6)}


def check_price(usd_per_gpu_hour: Any, name: str = "gpu_hour_usd") -> float:
    """``usd_per_gpu_hour`` as a float; an InputError naming ``name`` unless it is a positive finite number."""
    v = usd_per_gpu_hour
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
        raise InputError(f"{name}={v!r} is not a positive price. Fix: what one GPU costs for one hour in US dollars, "
                         f"e.g. {name}=2.5 (your cloud's or your own amortized price)")
    return float(v)


def unit_cost(units_per_s: float, unit: str, usd_per_gpu_hour: float, gpus: int = 1) -> tuple[float, str]:
    """What a block of work costs at ``units_per_s`` on ``gpus`` GPUs rented at ``usd_per_gpu_hour`` each: USD
    per 1M tokens for sequence models (``unit`` "tokens/s" or "generated tokens/s"), per 1M images or samples
    otherwise (COST_BLOCKS). Returns (USD, the block's name).

    >>> unit_cost(10_000.0, "tokens/s", 3.6, gpus=1)    # 100 s of one GPU at 0.1 cents a second
    (0.1, '1M tokens')
    """
    price = check_price(usd_per_gpu_hour, "usd_per_gpu_hour")
    if unit not in COST_BLOCKS:
        raise ValueError(f"no cost block for throughput unit {unit!r}; known: {sorted(COST_BLOCKS)}")
    what, size = COST_BLOCKS[unit]
    return gpus * price * size / max(units_per_s, 1e-30) / 3600.0, what


def run_time(step_ms: float, batch_size: int, seq_len: int | None = None, *, gpus: int = 1,
             total_samples: float | None = None, total_tokens: float | None = None,
             usd_per_gpu_hour: float | None = None) -> dict[str, float]:
    """How long a whole run takes at a forecast step time: ``total_samples`` (or, for sequence models,
    ``total_tokens``) processed ``batch_size`` samples (x ``seq_len`` tokens) per step of ``step_ms``.

    Returns ``steps`` (rounded up), ``hours`` of wall time and ``gpu_hours`` (x ``gpus``), and with a price per
    GPU-hour ``usd`` (the GPU-hours at that price). Nothing but the step time is forecast: data loading,
    evaluation, checkpoint saving and restarts are not counted.

    >>> run_time(1000.0, batch_size=8, seq_len=1024, total_tokens=8192 * 3600)["hours"]
    1.0
    """
    if (total_samples is None) == (total_tokens is None):
        raise InputError("a run is total_samples or total_tokens, one of them. Fix: e.g. total_tokens=1e10 for a "
                         "language model, total_samples=1.28e6 for an ImageNet epoch")
    total = total_tokens if total_tokens is not None else total_samples
    if not isinstance(total, (int, float)) or isinstance(total, bool) or not total > 0:
        name = "total_tokens" if total_tokens is not None else "total_samples"
        raise InputError(f"{name}={total!r} is not a positive number. Fix: e.g. {name}=1e9")
    if total_tokens is not None and not seq_len:
        raise InputError(f"total_tokens={total_tokens:g} needs a sequence model (a step processes batch x seq_len "
                         "tokens). Fix: total_samples= for a model without a sequence length")
    per_step = batch_size * (seq_len if total_tokens is not None else 1)
    steps = math.ceil(total / per_step)
    hours = steps * step_ms / 3.6e6
    out = {"steps": float(steps), "hours": hours, "gpu_hours": hours * gpus}
    if usd_per_gpu_hour is not None:
        out["usd"] = out["gpu_hours"] * check_price(usd_per_gpu_hour, "usd_per_gpu_hour")
    return out


def run_line(run: dict[str, float], gpus: int, what: str, usd_per_gpu_hour: float | None = None) -> str:
    """One line for a :func:`run_time` result (its cost too when it has one)."""
    cost = f", ${run['usd']:,.0f} at ${usd_per_gpu_hour:g} per GPU-hour" if "usd" in run else ""
    return (f"run: {what} = {run['steps']:,.0f} steps, {run['hours']:,.1f} h on {gpus} GPU{'s' if gpus > 1 else ''} "
            f"({run['gpu_hours']:,.1f} GPU-hours{cost}; step time only: no data loading, evaluation or checkpointing)")


def cost_line(usd: float, what: str, usd_per_gpu_hour: float, gpus: int = 1, step: str = "forecast") -> str:
    """One line for a :func:`unit_cost` result at the ``step`` ("forecast" or "anchored") step time."""
    where = f" on {gpus} GPUs" if gpus > 1 else ""
    each = " each" if gpus > 1 else ""
    return (f"cost: ${usd:,.4g} per {what}{where} at ${usd_per_gpu_hour:g} per GPU-hour{each} (the {step} step "
            "time only: no data loading, idle or start-up time)")


def extrapolation_note(device: Device, found: list[dict[str, Any]], kernels: pd.DataFrame) -> str | None:
    """EXTRAPOLATION_NOTE for ``Predictor.device_extrapolation(device)``'s findings, None when there are none."""
    if not found:
        return None
    feats = [f["feature"] for f in found]
    flagged = kernels["beyond_training"].astype(str).str.split(",").map(lambda names: bool(set(names) & set(feats)))
    share = 100.0 * float(kernels.loc[flagged, "latency_ms"].sum()) / max(float(kernels["latency_ms"].sum()), 1e-12)
    fams = sorted({fam for f in found for fam in f["families"]})
    return EXTRAPOLATION_NOTE.format(
        device=device.key, what=" and ".join(f"{f['label']} {f['value']}" for f in found), s="" if len(found) > 1 else "s",
        where="; ".join(f"{f['label']} {f['range']}" for f in found), fams=" and ".join(fams),
        them="them" if len(found) > 1 else "it", share=share)


HOST_BOUND_NOTE = ("{n} kernel launches averaging {avg:.0f} us of GPU time each: eager PyTorch spends roughly "
                   "10-50 us of host (CPU) time per launch, so this run may be bound by the host issuing kernels, "
                   "which is not modelled: then it takes longer than forecast, on any GPU")


def check_host_us(host_us: Any) -> None:
    """``host_us``: None or a non-negative number of microseconds (InputError otherwise)."""
    if host_us is None:
        return
    if isinstance(host_us, bool) or not isinstance(host_us, (int, float)) or not 0 <= host_us < 1e6:
        raise InputError(f"host_us={host_us!r} is not a host time per kernel launch in microseconds. Fix: e.g. "
                         "host_us=20 (a modern CPU running eager PyTorch), or leave it out (host not modelled)")


def host_bound_note(latency_ms: float, launches: int) -> str | None:
    """The HOST_BOUND_NOTE for a forecast whose kernels average less GPU time than HOST_BOUND_US, else None."""
    if launches <= 0:
        return None
    avg_us = latency_ms * 1000.0 / launches
    return HOST_BOUND_NOTE.format(n=launches, avg=avg_us) if avg_us < HOST_BOUND_US else None


# PyTorch's TF32 switches for FP32 math, as ``tf32=`` names them: "default" = PyTorch's defaults
# (torch.backends.cudnn.allow_tf32 = True: convolutions on TF32 tensor cores; torch.backends.cuda.matmul.allow_tf32
# = False: matmuls in FP32), "all" = matmuls too (torch.set_float32_matmul_precision("high")), "off" = neither (how
# the NeuSight kernel sweeps and labels were measured). Only GPUs with TF32 tensor cores care (NVIDIA Ampere and later;
# AMD's CDNA3 with "all" only: ROCm does not run FP32 convolutions in TF32 by default).
TF32_MODES = {"default": ("conv",), "all": ("conv", "linear", "bmm"), "off": ()}


def tf32_mode(tf32: Any) -> str:
    """``tf32=`` as one of TF32_MODES: None -> "default", True -> "all", False -> "off"."""
    mode = {None: "default", True: "all", False: "off"}.get(tf32, tf32) if not isinstance(tf32, str) else tf32.lower()
    if mode not in TF32_MODES:
        raise InputError(f"tf32={tf32!r} is not known. Fix: one of {', '.join(map(repr, TF32_MODES))} (or None = "
                         "'default', True = 'all', False = 'off')")
    return mode


def tf32_dtypes(kernels: pd.DataFrame, device: Device, tf32: Any = None) -> pd.Series:
    """The dtype each kernel's math runs in: ``"tf32"`` for the FP32 kernels of the families ``tf32`` lets run on
    TF32 tensor cores, on a GPU that has them; the traced dtype otherwise. (Which of those convolutions have the
    channels for tensor cores is :func:`neusight.predictor.features.without_tensor_cores`'s to say.)"""
    mode = tf32_mode(tf32)
    fams = TF32_MODES[mode]
    dtype = kernels["dtype"].astype(str)
    # the default is cuDNN's (torch.backends.cudnn.allow_tf32); MIOpen on ROCm keeps FP32 convolutions in FP32
    if not fams or not device.tf32_tensor_tflops or (mode == "default" and device.vendor != "nvidia"):
        return dtype
    return dtype.where(~(kernels["family"].isin(fams) & (dtype == "float32")), "tf32")


def predict_graph(g: Graph, device: Device | str, predictor: Predictor | str | Path | None = None, *,
                  calibrated: bool = True, fused: bool = False, megatron: bool = False, tf32: Any = None,
                  host_us: float | None = None, sequence_parallel: int = 1, context_parallel: int = 1,
                  context_comm: str = "p2p") -> Prediction:
    """Predict an already traced graph on ``device``.

    ``calibrated=False`` leaves out the predictor's end-to-end scale (used when fitting that scale);
    ``fused=True`` predicts the kernels ``torch.compile`` runs (:func:`neusight.graph.fusion.fused_kernels`);
    ``megatron=True`` the kernels Megatron-LM runs for the same blocks (:func:`neusight.graph.megatron.megatron_kernels`);
    ``tf32`` which FP32 kernels run on TF32 tensor cores (:data:`TF32_MODES`; None: PyTorch's default, convolutions);
    ``host_us`` the host's time per kernel launch in microseconds (:func:`host_waits_ms`; None: the host is not
    modelled, as the predictor's end-to-end labels were GPU-bound): each kernel's ``latency_ms`` then includes the
    GPU's wait for its launch (``host_wait_ms``; ``gpu_ms`` is its time on the GPU);
    ``sequence_parallel`` the GPUs of a tensor-parallel group that split the blocks' whole-width kernels by tokens
    (:func:`neusight.parallel.split_sequence`; 1: none); ``context_parallel`` the GPUs that split each sequence
    (``g`` being one GPU's part of it), whose attention kernels become what that GPU runs, by ``context_comm``
    (:func:`neusight.parallel.split_context`; 1: none).
    """
    check_host_us(host_us)
    if fused and megatron:
        raise InputError("fused=True and megatron=True exclude each other (torch.compile vs Megatron-LM's own fused "
                         "kernels). Fix: choose one")
    device = load_device(device)
    pred = load_predictor(predictor, device)
    scale = float(getattr(pred, "e2e_scale_", 1.0)) if calibrated else 1.0
    floor = float(getattr(pred, "e2e_floor_", 1.0)) if calibrated else 1.0
    changed: dict[str, int] = {}
    k = (fused_kernels(g, device) if fused else megatron_kernels(g, changed) if megatron else
         g.kernels).reset_index(drop=True)
    if sequence_parallel != 1:
        from neusight.parallel import split_sequence

        k = split_sequence(k, sequence_parallel)
    if context_parallel != 1:
        from neusight.parallel import split_context

        k = split_context(k, context_parallel, context_comm)
    gemm_dtypes = k.loc[k["family"].isin(GEMM_FAMILIES), "dtype"].astype(str)
    if gemm_dtypes.str.startswith("float8").any():
        from neusight.graph.fp8 import check_fp8_device

        check_fp8_device(device)
    if gemm_dtypes.str.startswith("float4").any():
        from neusight.graph.quant import check_fp4_device

        check_fp4_device(device)
    math_dtype = tf32_dtypes(k, device, tf32)
    # convolutions off the tensor cores for their channels (FP16 / BF16, and FP32 ones TF32 would take): the latter
    # stay FP32; Predictor.predict puts the former at the FP32 rates
    no_tc = without_tensor_cores(k.assign(dtype=math_dtype))
    k = k.assign(dtype=math_dtype.where(~(no_tc & (math_dtype == "tf32")), "float32"))
    sel, compiled_cl = charged(g, k, device, ~no_tc, fused)
    k, transposes, n_nchw = with_layout_transposes(k, sel)
    realigned = pd.Series(False, index=k.index)   # the added transposes run on no tensor core to speak of
    realigned[~transposes] = no_tc.to_numpy()
    no_tc = realigned
    n_tf32 = int((k["dtype"] == "tf32").sum())
    cols = [c for c in ("family", "kernel", "flops", "algo_flops", "bytes", "dtype", "channel_align") if c in k]
    frame = pd.concat([k[cols], kernel_dims(k)], axis=1)
    res = pred.predict(frame, device)
    kernels = pd.concat([k, res.drop(columns=["model_family"])], axis=1)
    # NB: kernels were measured one at a time, paying the launch overhead (and the timing events around it)
    # on top of their work. In a model the launches are queued asynchronously and overlap the previous
    # kernel, so a kernel costs its work or a launch floor, whichever is larger: ``e2e_floor`` x the
    # isolated launch overhead. Inside whole models kernels also waste less of their bound than one by one
    # (a steady clock, warm caches, no timing events between them): ``e2e_scale`` scales the excess over the
    # roofline, never the roofline itself. Both are fitted by neusight-train on the training GPUs'
    # end-to-end labels (neusight.evaluate.fit_e2e_scale).
    kernels["isolated_ms"] = kernels["latency_ms"]
    kernels["latency_ms"] = e2e_kernel_ms(kernels["roofline_ms"].to_numpy(float), kernels["isolated_ms"].to_numpy(float),
                                          kernels["overhead_ms"].to_numpy(float), scale, floor)
    if host_us is not None:
        kernels["gpu_ms"] = kernels["latency_ms"]
        kernels["host_wait_ms"] = host_waits_ms(kernels["gpu_ms"].to_numpy(float), host_us)
        kernels["latency_ms"] = kernels["gpu_ms"] + kernels["host_wait_ms"]
    if context_parallel != 1:
        from neusight.parallel import context_steps

        kernels = context_steps(kernels)
    phases = {p: float(kernels.loc[kernels["phase"] == p, "latency_ms"].sum()) for p in PHASES
              if (kernels["phase"] == p).any()}
    notes = notes_on(g.notes, device) + ((FUSED_NOTE,) if fused else ())
    if megatron:
        notes += (MEGATRON_NOTE.format(
            fused=f"{changed['fused']} fused bias-GeLU kernels (one per activation and pass)" if changed["fused"] else
            "no activation that Megatron-LM fuses (its bias-GeLU; this model's run as traced)",
            dropped=changed["dropped"]),)
    rewritten = (k["aten_op"] == REWRITTEN_ATTENTION) & (k["kernel"] == ATTENTION_KERNEL)   # chains: forward kernels
    n_rewritten = int(rewritten.sum()) if fused else 0
    if n_rewritten:
        notes += (REWRITE_NOTE.format(n=n_rewritten),)
    if n_tf32:
        notes += (TF32_NOTE.format(n=n_tf32, what=", ".join(sorted(k.loc[k["dtype"] == "tf32", "family"].unique())),
                                   mode=tf32_mode(tf32)),)
    if no_tc.any():
        names = {"float16": "FP16", "bfloat16": "BF16", "float32": "TF32"}   # float32 here: kept off TF32
        what = sorted({names.get(d, d) for d in k.loc[no_tc, "dtype"]})
        notes += (NO_TENSOR_CORE_NOTE.format(n=int(no_tc.sum()), what=" / ".join(what)),)
    if compiled_cl:
        notes += (INDUCTOR_NOTE.format(n=compiled_cl),)
    if n_nchw:
        notes += (LAYOUT_NOTE.format(n=n_nchw, m=int(transposes.sum()),
                                     ms=float(kernels.loc[transposes.to_numpy(), "latency_ms"].sum())),)
    n_dw = int(kernels["kernel"].astype(str).str.startswith(DEPTHWISE_PREFIX).sum())
    if n_dw:
        notes += (DEPTHWISE_NOTE.format(n=n_dw),)
    total = float(kernels["latency_ms"].sum())
    if lanes := sgemm_lanes_note(device, kernels):
        notes += (lanes,)
    if beyond := extrapolation_note(device, pred.device_extrapolation(device), kernels):
        notes += (beyond,)
    if host_us is not None:
        wait = float(kernels["host_wait_ms"].sum())
        notes += (HOST_MODEL_NOTE.format(h=host_us, wait=wait, share=100.0 * wait / max(total, 1e-12)),)
    elif host := host_bound_note(total, len(kernels)):
        notes += (host,)
    kind, not_covered = forecast_kind(g, kernels, device, pred.train_devices_, fused=fused, megatron=megatron)
    accuracy = measured_accuracy(kind, getattr(pred, "manifest_", {}).get("weights_sha256"), extra=not_covered,
                                 batch_size=g.batch_size, latency_ms=total)
    return Prediction(g.model, device, g.mode, g.batch_size, g.seq_len, total, phases,
                      kernels, g, notes, None, pred.train_devices_, accuracy)


def predict(model: Any, device: Device | str, batch_size: int = 1, seq_len: int | None = None,
            mode: str = "inference", *, head: str | None = None, optimizer: str | None = "adamw",
            predictor: Predictor | str | Path | None = None, memory: bool = True, fused: bool = False,
            tf32: Any = None, host_us: float | None = None, **trace_kwargs: Any) -> Prediction:
    """Forecast one inference pass or one training step of ``model`` on ``device``.

    Parameters
    ----------
    model : str, path or nn.Module
        A preset, a Hugging Face config JSON, or an nn.Module (then pass ``input_shapes``: shapes without the
        batch, or ``(shape, dtype)`` pairs such as ``(("seq",), torch.long)`` for token ids of ``seq_len``).
    device : str, path or Device
        A library key (``"h100-sxm5-80gb"``), a ``torch.cuda.get_device_name()`` string, or a spec YAML.
    mode : {"inference", "training"}
        Training = forward + loss + backward + optimizer step (``optimizer=None`` leaves the step out).
    predictor : optional
        A checkpoint directory; the shipped predictor by default.
    fused : bool
        Forecast the model under ``torch.compile`` (TorchInductor's default mode): the memory-bound ops between
        GEMMs run as fused kernels (see :mod:`neusight.graph.fusion`), and the memory is the compiled run's
        (:func:`neusight.memory.estimate_memory` with ``fused=True``). Default: eager, one kernel per op.
    tf32 : {None, "default", "all", "off"} or bool
        Which FP32 kernels run on TF32 tensor cores on GPUs that have them (Ampere and later): None / "default" as
        PyTorch does by default (convolutions: ``torch.backends.cudnn.allow_tf32``; matmuls stay FP32), "all" /
        True matmuls too (``torch.set_float32_matmul_precision("high")``), "off" / False neither (true FP32, as the
        predictor's training kernels were measured).
    host_us : float, optional
        The host's (CPU's) time per kernel launch, in microseconds: the GPU then waits for launches where kernels
        are shorter than that (small batches, decode steps; :func:`host_waits_ms`). Default: not modelled (the
        GPU time alone, as the NeuSight labels measured GPU-bound runs); docs/host.md.

    Returns
    -------
    Prediction
        ``latency_ms``, ``phases``, ``kernels`` (trace columns + tiles, waves, bound, roofline_ms,
        utilization, latency_ms), ``layers``, ``memory``.

    Examples
    --------
    >>> import neusight
    >>> p = neusight.predict("gpt2", "h100-sxm5-80gb", batch_size=2, seq_len=128)
    >>> p.latency_ms > 0 and set(p.phases) == {"forward"}
    True
    """
    return predict_many(model, [device], batch_size, seq_len, mode, head=head, optimizer=optimizer, predictor=predictor,
                        memory=memory, fused=fused, tf32=tf32, host_us=host_us, **trace_kwargs)[0]


def predict_many(model: Any, devices: Any, batch_size: int = 1, seq_len: int | None = None,
                 mode: str = "inference", *, head: str | None = None, optimizer: str | None = "adamw",
                 predictor: Predictor | str | Path | None = None, memory: bool = True, fused: bool = False,
                 tf32: Any = None, left_out: dict[str, str] | None = None, host_us: float | None = None,
                 progress: Callable[[list], Iterable] | None = None, **trace_kwargs: Any) -> list[Prediction]:
    """:func:`predict` on several GPUs from one trace (one more per software path a GPU takes: its attention
    backend or experts' kernels, when the model's trace depends on them): ``devices`` is a list of keys, aliases,
    spec paths or Devices, or ``"all"`` (every GPU of the library, :func:`neusight.devices.list_devices`).

    ``left_out``: a dict to collect the GPUs the run cannot be forecast on (an InputError, e.g. ``fp8=True`` on a
    GPU without FP8 tensor cores), key -> reason, instead of raising; unless no GPU can, which raises the error that
    names no GPU (the model's own), else the first. Without it, any such error is raised. ``progress``: wraps the
    list of GPUs as they are forecast one by one (e.g. ``tqdm``).

    >>> ps = predict_many("gpt2", ["t4", "l4"], batch_size=1, seq_len=64, memory=False)
    >>> [p.device.key for p in ps], ps[0].latency_ms > ps[1].latency_ms
    (['t4', 'l4'], True)
    """
    from neusight.graph.tracer import trace_key

    devs = load_devices(devices)
    tf32_mode(tf32)   # a bad switch fails before the (slower) trace
    check_host_us(host_us)
    predictors = {d.key: load_predictor(predictor, d) for d in devs}   # per vendor unless given one
    graphs: dict[tuple, Graph] = {}
    preds: list[Prediction] = []
    errors: dict[str, InputError] = {}
    for dev in progress(devs) if progress is not None else devs:
        try:
            path = trace_key(graphs, dev, trace_kwargs)
            if path not in graphs:
                graphs[path] = trace(model, batch_size, seq_len, mode, head=head, optimizer=optimizer, device=dev,
                                     **trace_kwargs)
            g = graphs[path]
            p = predict_graph(g, dev, predictors[dev.key], fused=fused, tf32=tf32, host_us=host_us)
        except InputError as e:
            if left_out is None:
                raise
            errors[dev.key] = e
            left_out[dev.key] = left_out_reason(e)
            continue
        if memory:
            p.memory = estimate_memory(g, dev, fused=fused)
        preds.append(p)
    if not preds:
        raise unrunnable_error(errors)
    return preds


def load_devices(devices: Any) -> list[Device]:
    """``devices`` as a list of Devices: one GPU (a key, alias, spec path or Device), a list of them, or ``"all"``
    (every GPU of the library, :func:`neusight.devices.list_devices`); an empty list is an error."""
    from neusight.devices import list_devices

    if names_all(devices):
        devices = list_devices()
    elif isinstance(devices, (str, Path, Device)):
        devices = [devices]
    devs = [load_device(d) for d in devices]
    if not devs:
        raise InputError("devices=[] names no GPU. Fix: a list of keys such as ['a100-80gb-pcie', 'h100-sxm5-80gb'], "
                         "or 'all'")
    return devs


def left_out_reason(error: InputError) -> str:
    """Why a GPU is left out of a ranking: its error without the fix."""
    return str(error).split(". Fix:")[0]


def unrunnable_error(errors: dict[str, InputError]) -> InputError:
    """The error to raise when no GPU of ``errors`` (device key -> its error) can run a run: the one that names no
    GPU (the model's, which holds on every GPU), else the first."""
    return next((e for key, e in errors.items() if not _names(str(e), key)), next(iter(errors.values())))


ALL_DEVICES = "all"   # devices="all" / device=all: every GPU of the spec library


def names_all(devices: Any) -> bool:
    """Whether ``devices`` is ``"all"`` (any case): every GPU of the spec library."""
    return isinstance(devices, str) and devices.strip().lower() == ALL_DEVICES


def ranked(rows: list[dict[str, Any]], key: str) -> pd.DataFrame:
    """``rows`` (one per GPU, with ``GPU`` and the time column ``key``) as a table ordered by ``key``, fastest
    first (ties by GPU), with ``rank`` first and ``time vs fastest`` after ``key``."""
    table = pd.DataFrame(rows).sort_values([key, "GPU"], kind="stable").reset_index(drop=True)
    table.insert(table.columns.get_loc(key) + 1, "time vs fastest", table[key] / table[key].min())
    table.insert(0, "rank", range(1, len(table) + 1))
    return table


def table_formats(columns: Any) -> dict[str, Any]:
    """Printing formats of a ranked table's numeric columns: times (``ms``, ``... ms``) to 2 decimals, throughputs
    (``.../s``) whole, costs (``USD per ...``) to 4 significant digits, ``time vs ...`` ratios as ``1.23x``,
    percentages (``... %``) to one decimal."""
    fmt: dict[str, Any] = {c: "{:,.2f}".format for c in columns if c == "ms" or c.endswith(" ms")}
    fmt.update({c: "{:,.0f}".format for c in columns if c.endswith("/s")})
    fmt.update({c: "{:,.4g}".format for c in columns if c.startswith("USD per")})
    fmt.update({c: "{:.2f}x".format for c in columns if c.startswith("time vs ")})
    fmt.update({c: "{:.1f}".format for c in columns if c.endswith(" %")})
    return fmt


def _names(text: str, key: str) -> bool:
    """Whether ``text`` names the device ``key`` as a word of its own ("t4" in "... t4 (NVIDIA T4) ...", not in
    "int4")."""
    return re.search(rf"(?<![\w.-]){re.escape(key)}(?![\w-]|\.\w)", text) is not None


def ranking_table(preds: list[Prediction], costs: list[dict[str, Any] | None] | None = None,
                  anchored: dict[str, float] | None = None) -> pd.DataFrame:
    """Forecasts of one run on several GPUs as a table, fastest first (by the ``anchored`` time when given: device
    key -> ms): rank, GPU, ms, time vs fastest, throughput, MFU and MBU (:mod:`neusight.efficiency`; of the
    anchored time when given), the memory peak against the GPU's memory and whether it fits (with a memory
    forecast), the cost (``costs``: per forecast, None or ``{"usd": .., "per": "1M tokens"}``), whether the
    predictor was trained on the GPU and the measured mean error of forecasts of the kind."""
    from neusight.accuracy import short_accuracy

    rows = []
    for p, cost in zip(preds, costs or [None] * len(preds)):
        rate, unit = p.throughput
        row: dict[str, Any] = {"GPU": p.device.key, "ms": p.latency_ms}
        ratio = 1.0      # the forecast's time over the anchored one: rates scale by it
        if anchored is not None:
            row["anchored ms"] = anchored[p.device.key]
            ratio = p.latency_ms / anchored[p.device.key]
        row[unit] = rate * ratio
        eff = p.efficiency
        row["MFU %"], row["MBU %"] = 100 * eff.mfu * ratio, 100 * eff.mbu * ratio
        peak = getattr(p.memory, "peak_bytes", None) if p.memory is not None else None
        if peak is not None:
            row["memory GiB"] = f"{peak / 2**30:,.1f} of {p.device.memory_gib:g}"
            row["fits"] = "yes" if p.memory.fits else "no"
        if cost is not None:
            row[f"USD per {cost['per']}"] = cost["usd"]
        row["predictor trained on it"] = "yes" if p.device.key in tuple(p.predictor_devices) else "no"
        row["measured mean error of the kind"] = short_accuracy(p.accuracy)
        rows.append(row)
    return ranked(rows, "anchored ms" if anchored is not None else "ms")


def rank(model: Any, devices: Any = "all", batch_size: int = 1, seq_len: int | None = None,
         mode: str = "inference", **kwargs: Any) -> pd.DataFrame:
    """The GPUs of ``devices`` (default: every GPU of the library) ranked for one run, fastest first: the
    :func:`ranking_table` of :func:`predict_many`; GPUs the run cannot be forecast on are in
    ``table.attrs["left_out"]`` (key -> reason). ``kwargs`` as :func:`predict`.

    >>> t = rank("gpt2", ["t4", "l4", "h100-sxm5-80gb"], batch_size=1, seq_len=64, memory=False)
    >>> list(t["GPU"]), float(t["time vs fastest"].iloc[0])
    (['h100-sxm5-80gb', 'l4', 't4'], 1.0)
    """
    left_out: dict[str, str] = {}
    table = ranking_table(predict_many(model, devices, batch_size, seq_len, mode, left_out=left_out, **kwargs))
    table.attrs["left_out"] = left_out
    return table


def predict_kernel_table(df: pd.DataFrame, predictor: Predictor | str | Path | None = None) -> pd.Series:
    """Predicted latency (ms) of every row of a DataFrame in the shared kernel-CSV schema.

    Each row is predicted by ``predictor``, else the shipped predictor of its GPU's vendor. Needs ``OPName``,
    ``Device`` and the op's shape columns (``B, M, N, K`` for bmm/linear, conv columns,
    ``B, H`` for the others); ``Latency``, kernel names and launch columns are not used.
    """
    from neusight.dataset import kernel_frame

    if not isinstance(df, pd.DataFrame) or df.empty:
        raise DataError("predict_kernel_table needs a non-empty DataFrame in the shared kernel-CSV schema "
                        "(OPName, Device and shape columns)")
    frame = kernel_frame(df.reset_index(drop=True), measured=False)
    out = pd.Series(np.nan, index=frame.index, name="predicted_ms")
    for dev, rows in frame.groupby("device"):
        out.loc[rows.index] = load_predictor(predictor, dev).predict(rows, dev)["latency_ms"].to_numpy()
    out.index = df.index
    return out

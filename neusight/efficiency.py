"""How much of the GPU a forecast run uses: model FLOPs utilization (MFU) and memory bandwidth utilization (MBU).

- **MFU**: the FLOPs of the run's matrix multiplies (GEMMs, batched GEMMs and fused attention, convolutions; as
  traced, so a causal fused attention counts what its kernel computes) per second of the forecast, over the
  spec-sheet peak of the precision most of those FLOPs run in (FP32, TF32, BF16 / FP16 tensor cores, FP8, FP4).
  Recomputed kernels (gradient checkpointing) are left out, as MFU leaves them out; **HFU** (hardware FLOPs
  utilization) counts them. Elementwise FLOPs are not counted, as MFU does not count them.
- **MBU**: every kernel's minimum DRAM traffic (each input read once, each output written once) per second of the
  forecast, over the spec-sheet DRAM bandwidth. A decode step of a large model is limited by it.

Both divide by the whole forecast (the optimizer step, the loss and any modelled host wait included), so they are
what a profiler's step time would show, not a kernel's own efficiency (that is the kernel table's
``utilization``). The denominators are spec-sheet peaks: an FP32 GEMM on Hopper is bounded by 90 % of its peak
(:func:`neusight.tiles.sgemm_lane_fraction`), so its MFU stays below that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from neusight.devices import Device, dtype_kind
from neusight.errors import DeviceError
from neusight.tiles import GEMM_FAMILIES

# how a precision's peak is named in a summary, by Device.peak_flops' kinds
_PEAK_NAMES = {"float32": "FP32", "tf32": "TF32 tensor", "float16": "FP16 tensor", "bfloat16": "BF16 tensor",
               "float8": "FP8 tensor", "float4": "FP4 tensor"}


@dataclass(frozen=True)
class Efficiency:
    """What a forecast uses of its GPU's spec-sheet peaks (see the module docstring). FLOPs and bytes are per run
    (one pass or step); rates per second of ``seconds``."""

    model_flops: float      # matrix-multiply FLOPs, recomputed kernels left out
    hardware_flops: float   # the same with the recomputed kernels
    peak_dtype: str         # the precision most of them run in: float32, tf32, float16, bfloat16, float8 or float4
    peak_flops: float       # its spec-sheet peak, FLOP/s
    dram_bytes: float       # every kernel's minimum DRAM traffic
    bandwidth: float        # the spec-sheet DRAM bandwidth, bytes/s
    seconds: float          # the forecast
    matrix_fp32: bool = False   # the FP32 peak is a matrix unit's, above the vector lanes' (AMD's CDNA)

    @property
    def achieved_flops(self) -> float:
        """Model FLOPs per second of the forecast."""
        return self.model_flops / self.seconds

    @property
    def mfu(self) -> float:
        return self.achieved_flops / self.peak_flops

    @property
    def hfu(self) -> float:
        return self.hardware_flops / self.seconds / self.peak_flops

    @property
    def achieved_bandwidth(self) -> float:
        """DRAM bytes per second of the forecast."""
        return self.dram_bytes / self.seconds

    @property
    def mbu(self) -> float:
        return self.achieved_bandwidth / self.bandwidth

    @property
    def peak_name(self) -> str:
        """The denominator of MFU in words, e.g. "BF16 tensor peak (989.4 TFLOP/s)"."""
        name = "FP32 matrix" if self.peak_dtype == "float32" and self.matrix_fp32 else _PEAK_NAMES.get(
            self.peak_dtype, self.peak_dtype)
        return f"{name} peak ({self.peak_flops / 1e12:,.1f} TFLOP/s)"

    def to_dict(self) -> dict[str, Any]:
        return {"model_tflop": self.model_flops / 1e12, "hardware_tflop": self.hardware_flops / 1e12,
                "achieved_tflops": self.achieved_flops / 1e12, "peak_dtype": self.peak_dtype,
                "peak_tflops": self.peak_flops / 1e12, "mfu": self.mfu, "hfu": self.hfu,
                "dram_gb": self.dram_bytes / 1e9, "achieved_gbps": self.achieved_bandwidth / 1e9,
                "bandwidth_gbps": self.bandwidth / 1e9, "mbu": self.mbu}

    def line(self) -> str:
        """One summary line: achieved FLOP/s and MFU (HFU when recomputation makes them differ), DRAM traffic and
        MBU."""
        hfu = f", HFU {100 * self.hfu:.1f} % with recomputation" if self.hardware_flops > self.model_flops else ""
        return (f"efficiency: matrix multiplies {_flop(self.model_flops)}, {_flop(self.achieved_flops)}/s = MFU "
                f"{100 * self.mfu:.1f} % of the {self.peak_name}{hfu}; DRAM traffic "
                f"{self.achieved_bandwidth / 1e9:,.0f} GB/s = MBU {100 * self.mbu:.1f} % of "
                f"{self.bandwidth / 1e9:,.0f} GB/s")


def _flop(x: float) -> str:
    """FLOPs to three significant digits in TFLOP, GFLOP or MFLOP."""
    scale, unit = next(((v, u) for v, u in ((1e12, "T"), (1e9, "G")) if x >= v), (1e6, "M"))
    return f"{x / scale:,.3g} {unit}FLOP"


def _kind(dtype: str) -> str:
    return dtype_kind(dtype) or str(dtype)


def efficiency(kernels: pd.DataFrame, device: Device, latency_ms: float) -> Efficiency:
    """The :class:`Efficiency` of a forecast: its kernel table (``family``, ``dtype``, ``flops``, ``bytes`` and
    ``recompute`` when present) on ``device``, over ``latency_ms``.

    >>> import pandas as pd
    >>> from neusight.devices import load_device
    >>> k = pd.DataFrame({"family": ["linear"], "dtype": ["bfloat16"], "flops": [4e12], "bytes": [2e9]})
    >>> e = efficiency(k, load_device("h100-sxm5-80gb"), 10.0)      # 4 TFLOP in 10 ms on a 989 TFLOP/s peak
    >>> e.peak_dtype, round(e.mfu, 3), round(e.mbu, 3)
    ('bfloat16', 0.404, 0.06)
    """
    gemm = kernels[kernels["family"].isin(GEMM_FAMILIES)]
    hardware = float(gemm["flops"].sum())
    model = hardware - float(gemm.loc[gemm["recompute"].astype(bool), "flops"].sum()) if "recompute" in gemm \
        else hardware
    by_kind = gemm.groupby(gemm["dtype"].astype(str).map(_kind))["flops"].sum()   # FP8's e4m3 and e5m2 together
    kind = str(by_kind.idxmax()) if len(by_kind) and by_kind.max() > 0 else "float32"
    try:
        peak = device.peak_flops(kind)
    except DeviceError:     # a precision without a peak of its own in the spec (none traced today): FP32's
        kind, peak = "float32", device.peak_flops("float32")
    return Efficiency(model_flops=model, hardware_flops=hardware, peak_dtype=kind, peak_flops=peak,
                      dram_bytes=float(kernels["bytes"].sum()), bandwidth=device.mem_bandwidth_bytes_per_s,
                      seconds=max(float(latency_ms), 1e-12) / 1e3,
                      matrix_fp32=device.fp32_matrix_tflops > device.fp32_tflops)

"""Large FP32 GEMMs timed in public benchmarks on GPUs whose SMs feed 32 FP32 lanes per scheduler (GA10x, Ada,
Hopper), against the shipped predictor's forecast. Writes docs/sgemm-public.md.

    python scripts/bench_sgemm_public.py                      # a few seconds
    python scripts/bench_sgemm_public.py --out /tmp/sgemm.md

No kernel trace of these GPUs is in the dataset except L4's, so these few public numbers are the only check of
how much of the spec-sheet FP32 peak their SGEMM reaches (neusight.tiles.sgemm_lane_fraction). Each row is a
number copied from its source (a README table or a results CSV), with where it came from; the timings were taken
by others, on machines and library versions we do not control, so read them as a range, not as truth. Two cards
whose SMs feed 16 lanes per scheduler (A100, RTX 2080 Ti) are listed as a control. Each GEMM is forecast as the
kernel sweeps time one (``neusight.predict_kernel_table``, an nn.Linear of B = 1), with the predictor of the
GPU's vendor; the ratio is forecast speed over measured speed (1.0 = right, below 1 = forecast too slow).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from neusight.api import predict_kernel_table
from neusight.devices import load_device
from neusight.e2e_eval import markdown_table
from neusight.tiles import DEDICATED_LANES_GEMM_FRACTION, DUAL_ISSUE_GEMM_FRACTION, sgemm_lane_fraction
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
LARGE_LINEAR = REPO.parent / "shared" / "datasets" / "neusight-asplos25" / "kernels" / "nvidia-large-shapes" / "linear.csv"


@dataclass(frozen=True)
class PublicGemm:
    device: str        # library key
    m: int             # output rows
    k: int             # reduction
    n: int             # output columns
    measured_tflops: float
    timing: str        # what was timed
    source: str        # where the number is published


WAYNE = "github.com/waynehacking8/blackwell-tensorcore-kernels@fd74d2ac68:results/bench_sm90a.csv (kernel 'cublas')"
POINTS = (
    PublicGemm("h100-sxm5-80gb", 2048, 2048, 2048, 21.82, "cublasSgemm, CUDA events", WAYNE),
    PublicGemm("h100-sxm5-80gb", 4096, 4096, 4096, 45.68, "cublasSgemm, CUDA events", WAYNE),
    PublicGemm("h100-sxm5-80gb", 8192, 8192, 8192, 50.49, "cublasSgemm, CUDA events", WAYNE),
    PublicGemm("h100-sxm5-80gb", 4096, 16384, 8192, 35.5, "cuBLAS FP32, 100 iterations",
               "'CUDA Performance Study - NVIDIA H100 SXM5' (a public GitHub write-up, CUDA 12.8), section 5; the "
               "same machine's copy kernel reached 2.0 of 3.35 TB/s"),
    PublicGemm("rtx-4090", 4096, 4096, 4096, 47.61, "cuBLAS SGEMM",
               "github.com/annanyapr/Fast-CUDA-Kernels:README.md"),
    PublicGemm("rtx-a6000", 4096, 4096, 4096, 23.25, "cuBLAS SGEMM",
               "siboehm, 'How to Optimize a CUDA Matmul Kernel for cuBLAS-like Performance' (2022)"),
    PublicGemm("a40", 8000, 8000, 8000, 18.9, "torch.matmul FP32 (busy_pytorch_blas.py 8000)",
               "github.com/bewantbe/busy-gemm-benchmark:README.md"),
    PublicGemm("rtx-2080-ti", 8000, 8000, 8000, 11.4, "torch.matmul FP32 (busy_pytorch_blas.py 8000)",
               "github.com/bewantbe/busy-gemm-benchmark:README.md"),
    PublicGemm("a100-pcie-40gb", 8000, 8000, 8000, 14.1, "torch.matmul FP32 (busy_pytorch_blas.py 8000); "
               "'A100(40G)', PCIe or SXM4 not said", "github.com/bewantbe/busy-gemm-benchmark:README.md"),
)

LANE_CLASS = {1.0: "16 FP32 lanes per scheduler (control)", DEDICATED_LANES_GEMM_FRACTION: "Hopper (32 FP32-only lanes)",
              DUAL_ISSUE_GEMM_FRACTION: "GA10x / Ada (16 of 32 lanes shared with INT32)"}


def table() -> pd.DataFrame:
    devices = [load_device(p.device) for p in POINTS]
    kernels = pd.DataFrame({"OPName": "linear", "B": 1, "M": [p.m for p in POINTS], "N": [p.k for p in POINTS],
                            "K": [p.n for p in POINTS], "Device": [d.name for d in devices]})
    forecast_ms = predict_kernel_table(kernels).to_numpy()
    rows = []
    for p, d, ms in zip(POINTS, devices, forecast_ms):
        flops = 2.0 * p.m * p.k * p.n
        forecast = flops / (ms * 1e-3) / 1e12
        spec = d.fp32_matrix_tflops
        rows.append({"gpu": d.key, "M x K x N": f"{p.m} x {p.k} x {p.n}", "board W": f"{d.tdp_w:.0f}",
                     "spec TFLOP/s": f"{spec:.1f}", "SGEMM share counted": f"{sgemm_lane_fraction(d):.2f}",
                     "measured TFLOP/s": f"{p.measured_tflops:.1f}",
                     "measured / spec": f"{p.measured_tflops / spec:.2f}",
                     "forecast TFLOP/s": f"{forecast:.1f}", "forecast / measured": f"{forecast / p.measured_tflops:.2f}",
                     "class": LANE_CLASS[sgemm_lane_fraction(d)], "ratio": forecast / p.measured_tflops,
                     "timing": p.timing, "source": p.source})
    return pd.DataFrame(rows)


def l4_reference() -> str:
    """The same ratio on the dataset's L4 large-shape linear kernels (the one GA10x / Ada GPU with data), for
    reference next to the public numbers."""
    if not LARGE_LINEAR.is_file():
        return f"- (L4 reference skipped: {LARGE_LINEAR} not found)"
    rows = pd.read_csv(LARGE_LINEAR)
    l4 = load_device("l4")
    rows = rows[rows["Device"].isin([l4.name, *l4.aliases])]   # the dataset records torch.cuda.get_device_name()
    ratio = rows["Latency"].to_numpy() / predict_kernel_table(rows).to_numpy()   # forecast speed / measured speed
    long = rows["Latency"].to_numpy() > 5.0
    return (f"- For reference, the dataset's L4 (72 W, Ada, never trained on): {len(rows)} large-shape linear "
            f"kernels, forecast / measured median {np.median(ratio):.2f} ({np.median(ratio[long]):.2f} over the "
            f"{int(long.sum())} longer than 5 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "sgemm-public.md")
    args = parser.parse_args()
    frame = table()
    summary = [f"- {cls}: {len(g)} GEMMs, forecast / measured {g['ratio'].min():.2f}-{g['ratio'].max():.2f}, "
               f"geometric mean {float(np.exp(np.log(g['ratio']).mean())):.2f}"
               for cls, g in frame.groupby("class", sort=False)]
    text = "\n".join([
        "# Public FP32 GEMM timings against the forecast",
        "",
        "Generated by `python scripts/bench_sgemm_public.py` (see its docstring for what the rows are). "
        "\"SGEMM share counted\": the share of the spec-sheet FP32 peak the tile model bounds SGEMM by "
        "(`neusight.tiles.sgemm_lane_fraction`: 1 where each SM scheduler feeds 16 FP32 lanes, 0.9 on Hopper whose "
        "32 lanes per scheduler are FP32-only, 0.5 on GA10x / Ada whose second 16 are shared with INT32). "
        "\"forecast / measured\" is forecast speed over measured speed.",
        "",
        *summary,
        l4_reference(),
        "",
        markdown_table(frame.drop(columns=["class", "ratio"]), index=False),
        "",
    ])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

"""Tiles, waves and the per-wave roofline (NeuSight's decomposition), as pure vectorised functions.

For a kernel on a device:

1. tile: GEMM-like kernels (linear, bmm, conv as implicit GEMM) compute the (M x K) output in tiles of
   ``tile_m x tile_n`` (one of the device's tiles in the :class:`~neusight.tile_table.TileTable`); row-wise kernels process
   ``elems_per_block`` elements per thread block of ``threads_per_block`` threads (launch geometry).
2. tiles = B x ceil(M / tile_m) x ceil(K / tile_n)     (GEMM)      |  ceil(elements / elems_per_block)
3. concurrent tiles = SMs x resident blocks per SM:  GEMM 1 (one CTA of a large tile fills an SM's
   registers, as NeuSight assumes); row-wise min(max_threads_per_sm / threads_per_block, max_blocks_per_sm)
4. waves = ceil(tiles / concurrent tiles)
5. per-wave roofline = max(wave FLOPs / peak FLOP/s, wave bytes / bandwidth); a tile runs on one SM, so
   the compute leg is tile FLOPs / per-SM peak; roofline = waves x per-wave roofline. The bytes of a forward
   softmax or layer norm include the rows it re-reads from DRAM when its rows in flight spill out of L2
   (``l2_reread_bytes``).

Every bound here is non-decreasing in every kernel dimension (DESIGN.md: adding work never makes a kernel
faster): GEMMs take the best (tile, split-K) pair of the device's library tiles, each pair's bound being
monotone; row-wise kernels are bounded by their roofline (see ``rowwise_tiles``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from neusight.devices import Device
from neusight.kernels.base import Family
from neusight.kernels.formulas import itemsize

GEMM_FAMILIES = (Family.LINEAR.value, Family.BMM.value, Family.CONV.value)

# NB: on GPUs whose SM schedulers each feed 32 FP32 lanes while issuing one warp instruction per clock
# (``Device.fp32_dual_issue``), SGEMM cannot fill every lane the spec sheet counts, and how many it fills depends
# on whose lanes they are (``sgemm_lane_fraction``):
# - GA10x and Ada, where half of those lanes are shared with INT32: we count half the spec-sheet FP32 peak.
#   Held by L4, the one such GPU with data (the predictor's utilization models do not compensate). Measured
#   2026-11-25 (session 16): fraction 0.5 / 0.6 / 0.65 / 0.75 -> L4 large linear MAPE 11.1 / 14.6 / 19.9 / 29.7 %
#   (median signed +3.6 / -12.7 / -19.0 / -29.2), L4 label runs inference 9.2 / 8.8 / 11.0 / 16.5 % (mean signed
#   +1.8 / -7.6 / -11.0 / -16.5), training 2.7 / 12.6 / 16.3 / 22.1 %. L4 is a 72 W card; public cuBLAS SGEMMs
#   of bigger-power GA10x / Ada cards ran faster than this forecasts (session 18, scripts/bench_sgemm_public.py
#   -> docs/sgemm-public.md: RTX 4090 and RTX A6000 at 0.65x of their measured speed), so their FP32 GEMMs may
#   be forecast up to ~1.5x too slow. Not changed: no kernel trace of such a card.
# - Hopper and datacenter Blackwell (compute capability 9.x / 10.x), whose FP32 lanes are their own (INT32 has
#   separate lanes): SGEMM is bound by instruction issue alone. A register-tiled SGEMM inner loop (8 x 8
#   outputs per thread) issues 64 FFMA per k step against 4 vector shared-memory loads, plus per 8-step k tile
#   its global loads, shared stores, barrier and address updates: 512 FFMA in ~555 instructions, 0.92 of the
#   issue slots; we count 0.9 of the spec-sheet peak. Derived, not fitted (no Hopper kernel is in the data).
#   Against public cuBLAS SGEMMs on H100 80GB HBM3 (docs/sgemm-public.md): 4096^3 and 8192^3 on one machine
#   forecast at 0.96x / 0.95x their measured speed (its 2048^3 at 1.68x); 4096 x 16384 x 8192 on another
#   machine, whose own copy kernel reached 2.0 of 3.35 TB/s, at 1.35x. Until session 18 Hopper took the GA10x
#   half (0.55x / 0.54x / 0.77x of those); the median forecast speed-up of the dataset's label runs over the
#   measured A100-PCIE-40GB (docs/unseen.md) went from 1.74x to 2.84x with this.
DUAL_ISSUE_GEMM_FRACTION = 0.5
DEDICATED_LANES_GEMM_FRACTION = 0.9
DEDICATED_FP32_CC_MAJOR = ("9", "10")


def sgemm_lane_fraction(device: Device) -> float:
    """The share of the spec-sheet FP32 peak SGEMM can use on ``device`` (see above): 1 where each scheduler
    feeds 16 FP32 lanes, 0.9 on Hopper / datacenter Blackwell, 0.5 on GA10x / Ada."""
    if not device.fp32_dual_issue:
        return 1.0
    if str(device.compute_capability).split(".")[0] in DEDICATED_FP32_CC_MAJOR:
        return DEDICATED_LANES_GEMM_FRACTION
    return DUAL_ISSUE_GEMM_FRACTION


@dataclass(frozen=True)
class DeviceRates:
    """The device numbers the tile model needs, in base units."""

    sm_count: int
    gemm_flops: float      # FLOP/s for GEMM-like kernels of this dtype
    vector_flops: float    # FLOP/s for everything else
    bandwidth: float       # bytes/s
    max_threads_per_sm: int
    max_blocks_per_sm: int


def device_rates(device: Device, dtype: str = "float32") -> DeviceRates:
    """Peak rates for ``dtype``: FP32 GEMMs on the FP32 (AMD: matrix) units, as in the data (TF32 off);
    ``"tf32"`` (an FP32 GEMM or convolution PyTorch lets run on TF32 tensor cores) at the dense TF32 tensor peak
    where the GPU has one, else as FP32; ``"float8_*"`` at the FP8 tensor peak, ``"float4_*"`` at the FP4 one."""
    if dtype in ("float16", "bfloat16"):
        gemm = device.peak_flops(dtype, tensor_cores=True)
        vector = 2 * device.peak_fp32_flops
    elif dtype.startswith("float8"):   # FP8 GEMMs at the FP8 tensor peak; casts to FP8 are memory-bound
        gemm = (device.fp8_tensor_tflops * 1e12 if device.fp8_tensor_tflops
                else device.peak_flops("float16", tensor_cores=True))   # no GEMM reaches here (api refuses it)
        vector = 2 * device.peak_fp32_flops
    elif dtype.startswith("float4"):   # FP4 GEMMs (NVFP4) at the FP4 tensor peak; quantizing to FP4 is memory-bound
        gemm = (device.fp4_tensor_tflops * 1e12 if device.fp4_tensor_tflops
                else device.peak_flops("float16", tensor_cores=True))   # no GEMM reaches here (api refuses it)
        vector = 2 * device.peak_fp32_flops
    elif dtype == "tf32" and device.tf32_tensor_tflops:
        gemm, vector = device.tf32_tensor_tflops * 1e12, device.peak_fp32_flops
    else:
        gemm = device.fp32_matrix_tflops * 1e12 * sgemm_lane_fraction(device)
        vector = device.peak_fp32_flops
    return DeviceRates(device.sm_count, gemm, vector, device.mem_bandwidth_bytes_per_s,
                       device.max_threads_per_sm, device.max_blocks_per_sm)


# Fused attention (SDPA's flash / cuDNN kernels, flash-attn): besides its GEMMs, every score goes through an online
# softmax the tensor cores cannot do: one exponential on the special-function units (MUFU.EX2) and a few FP32
# instructions (forward: scale and subtract the running max, the running max and sum, the conversion of the
# probability to 16 bits; backward: the recomputed exponential, dP minus the row term, times P, two conversions).
# FlashAttention-2 (Ampere) runs them between its GEMMs in the same warps; FlashAttention-3 and cuDNN's Hopper
# kernels hide part of them behind the other warp group's GEMMs, not all: the accumulators are the warps' own
# registers. The forecast adds them after the GEMMs' time, unhidden: the softmax's own time, exponentials at the
# SFU rate plus the FP32 instructions at the FP32 lanes' rate. Datacenter Blackwell (compute capability 10.x) is
# the exception: its tensor cores accumulate in tensor memory, issued by one thread, so the softmax runs in other
# warps while they work (FlashAttention-4's and cuDNN's Blackwell kernels are built so), and the kernel takes the
# longer of the two (``softmax_overlaps``). That exception was made after seeing FlashAttention-4's B200 speeds.
# Rates are hardware facts, not fitted: 16 exponentials per clock per SM on compute capability 6.0 and 7.0 onwards,
# 32 on 5.x / 6.1 / 6.2 (the CUDA programming guide's arithmetic-instruction throughput table); AMD CDNA runs
# transcendentals at a quarter of a CU's 64 lanes, 16 per clock. The instruction count is from the kernels'
# structure (FlashAttention-2 / -3 papers). Measured against published kernel speeds by
# ``python scripts/bench_attention_public.py`` (docs/attention-public.md).
SOFTMAX_FP32_OPS = 4.0
EXP_PER_SM_CLOCK = 16.0
EXP_PER_SM_CLOCK_WIDE = 32.0
WIDE_SFU_CC = ("5.0", "5.2", "5.3", "6.1", "6.2")


OVERLAPPED_SOFTMAX_CC_MAJOR = ("10",)


def softmax_overlaps(device: Device) -> bool:
    """Whether a fused attention kernel's softmax runs beside its GEMMs on ``device`` (tensor-memory accumulators:
    datacenter Blackwell) rather than after them (see above)."""
    return str(device.compute_capability).split(".")[0] in OVERLAPPED_SOFTMAX_CC_MAJOR


def softmax_seconds_per_score(device: Device) -> float:
    """Seconds the whole ``device`` takes for one attention score's softmax work (its exponential and its
    SOFTMAX_FP32_OPS FP32 instructions, the two run one after the other), see above."""
    per_clock = EXP_PER_SM_CLOCK_WIDE if device.compute_capability in WIDE_SFU_CC else EXP_PER_SM_CLOCK
    exp_rate = per_clock * device.sm_count * device.boost_clock_mhz * 1e6
    fp32_instructions = device.peak_fp32_flops / 2.0          # an FMA counts two FLOPs
    return 1.0 / exp_rate + SOFTMAX_FP32_OPS / fp32_instructions


def gemm_tiles(b: np.ndarray, m: np.ndarray, n: np.ndarray, k: np.ndarray, candidates: np.ndarray,
               size: np.ndarray, rates: DeviceRates, algo_speedup: np.ndarray | float = 1.0) -> pd.DataFrame:
    """Tiles, waves and roofline of GEMM-like kernels: (B x) (M x N) @ (N x K), N the reduction.

    For one tile ``tile_m x tile_n`` and split-K factor ``s``: tiles = B·ceil(M / tile_m)·ceil(K / tile_n)·s;
    waves = ceil(tiles / SMs) (one tile per SM at a time). Compute leg per wave = tile FLOPs (2·tile_m·tile_n·
    ceil(N / s), the padded tile is computed in full) / per-SM peak, since a tile runs on one SM. Memory leg
    per wave = the kernel's minimum bytes (plus the partial sums a split-K GEMM writes and reads back) / waves
    / bandwidth: operand panels are shared by the tiles of a wave through L2 (cuBLAS rasterises for it).
    ``algo_speedup`` = FLOPs / fewest FLOPs of a fast algorithm (Winograd) divides the compute leg.

    The kernel's tile and split are the pair, among the device's library tiles ``candidates`` ((c, 2) array
    from the tile table: the tiles its traces show) and SPLIT_K_FACTORS, with the lowest wave-quantized
    roofline: the library's heuristics pick a good tile for the shape, and the bound is what the best of them
    allows. Each pair's roofline is non-decreasing in every dimension (ceil and products of non-decreasing
    terms), so their minimum is too: adding work never lowers the bound. Ties go to the earlier candidate.
    """
    b, m, n, k = (np.asarray(v, dtype=float) for v in (b, m, n, k))
    size = np.broadcast_to(np.asarray(size, dtype=float), b.shape)
    speed = np.broadcast_to(np.asarray(algo_speedup, dtype=float), b.shape)
    sms = float(rates.sm_count)
    per_sm = rates.gemm_flops / sms
    best = None
    for tm, tn in np.asarray(candidates, dtype=float).reshape(-1, 2):
        out_tiles = b * np.ceil(m / tm) * np.ceil(k / tn)
        for split in SPLIT_K_FACTORS:
            tiles = out_tiles * split
            waves = np.ceil(tiles / sms)
            tile_flops = 2.0 * tm * tn * np.ceil(n / split)
            t_compute = tile_flops / speed / per_sm
            total_bytes = size * b * (m * n + n * k + m * k + (2 * split * m * k if split > 1 else 0.0))
            roof = np.maximum(waves * t_compute, total_bytes / rates.bandwidth)
            cand = {"roof": roof, "tm": np.full_like(b, tm), "tn": np.full_like(b, tn), "split": np.full_like(b, split),
                    "tiles": tiles, "waves": waves, "tile_flops": tile_flops, "t_compute": t_compute,
                    "total_bytes": total_bytes}
            if best is None:
                best = cand
            else:
                take = roof < best["roof"]
                best = {key: np.where(take, cand[key], best[key]) for key in best}
    if best is None:
        raise ValueError("gemm_tiles needs at least one candidate tile")
    waves, tiles = best["waves"], best["tiles"]
    wave_bytes = best["total_bytes"] / waves
    s = np.minimum(sms, tiles)                                 # tiles in a (full) wave
    ridge = rates.gemm_flops * speed / rates.bandwidth
    out = _finish(tiles, sms, waves, best["tile_flops"], wave_bytes / s, best["t_compute"],
                  wave_bytes / rates.bandwidth, (s * best["tile_flops"] / wave_bytes) / ridge)
    out["tile_m"], out["tile_n"], out["split_k"] = best["tm"], best["tn"], best["split"]
    return out


# Split-K: when the output has too few tiles to fill the GPU and the reduction is long, cuBLAS / cuDNN split
# the reduction across CTAs and add the partial sums in a second kernel (the shared linear sweeps show it as
# grid z up to ~50 with a splitKreduce kernel; cuDNN's weight gradients of early conv layers are the extreme
# case: a tiny output, a reduction over batch x pixels). The factors the tile search may use:
SPLIT_K_FACTORS = (1, 2, 4, 8, 16, 32, 64)


def rowwise_tiles(numel: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, elems_per_block: np.ndarray,
                  threads_per_block: np.ndarray, rates: DeviceRates) -> pd.DataFrame:
    """Tiles (thread blocks) and waves of element / row-wise kernels from launch geometry, and their bound.

    The bound is the kernel's roofline, max(FLOPs / vector peak, bytes / bandwidth): a memory-bound kernel
    streams its bytes whatever its block size, and the geometry (taken from the nearest measured launch)
    jumps between shapes, so a per-wave bound built on it could fall when a dimension grows. The waves are
    reported, and the utilization model sees the load through its wave feature.
    """
    blocks = np.maximum(1.0, np.ceil(numel / np.maximum(elems_per_block, 1.0)))
    resident = np.clip(np.floor(rates.max_threads_per_sm / np.maximum(threads_per_block, 32.0)), 1, rates.max_blocks_per_sm)
    concurrent = rates.sm_count * resident
    waves = np.ceil(blocks / concurrent)
    tile_flops = flops / blocks
    tile_bytes = nbytes / blocks
    t_compute = flops / rates.vector_flops / waves               # per wave, so that waves x wave = roofline
    t_memory = nbytes / rates.bandwidth / waves
    ridge = rates.vector_flops / rates.bandwidth
    return _finish(blocks, concurrent, waves, tile_flops, tile_bytes, t_compute, t_memory,
                   (tile_flops / np.maximum(tile_bytes, 1e-30)) / ridge)


# Multi-pass row kernels. PyTorch's softmax over rows longer than SOFTMAX_WARP_MAX_COLS (cunn_SoftMaxForward)
# reads each row three times (max, sum of exponentials, then the output pass); its layer norm
# (vectorized_layer_norm_kernel) twice (the mean and variance, then the normalisation). The re-reads are
# served by L2 while the rows in flight fit there, and come from DRAM when they do not: the shared
# large-shape traces show it as a softmax / layer norm bandwidth that falls with the row length on the 2-6 MB
# L2 GPUs (V100 softmax 743 GB/s at 1,024 columns, 390 at 8-16k) and stays flat on L4's 48 MB. One row per
# block, in blocks as the traces launch them (ROW_LAUNCH), so the rows in flight are SMs x resident blocks.
# Each takes its input row and the output row being written in L2 (twice the input); the share of that
# footprint beyond L2 is re-read from DRAM:
#   extra bytes = re-reads x rows x cols x itemsize x clip(1 - L2 / (2 x in-flight input bytes), 0, 1).
# Forward kernels only: no gradient kernel of either was measured. Non-decreasing in rows and cols (the
# softmax footprint is taken as the larger of its two launch regimes, so the block-size steps cannot lower it).
# Measured 2026-11-25 (session 17; predictors retrained with it, `neusight-evaluate-kernels`): large-shape MAPE
# softmax A100 20.4 -> 15.7, P100 30.2 -> 9.5, P4 18.7 -> 9.0, T4 16.3 -> 10.1, L4 (unseen) 14.0 -> 7.9 %, but
# V100 19.2 -> 25.3 %; layer norm A100 24.2 -> 13.6, P100 31.3 -> 21.6, P4 27.6 -> 17.8, T4 25.9 -> 21.0, V100
# 16.4 -> 7.4, L4 13.8 -> 14.9 %. End to end (59 label runs) 5.7 -> 5.8 %: V100 5.0 -> 5.2 (its GPT-3 runs at
# sequence 2048, whose 2,048-column attention softmax now spills its 6 MB L2), P100 1.3 -> 1.1, L4 9.2 -> 9.1.
# V100 fits worst: its softmax re-reads stay cheaper than a 6 MB L2 implies (an L1 of 128 KB per SM could hold
# them, but T4's data shows DRAM re-reads where the same L1 rule says none; no L1 term).
SOFTMAX_WARP_MAX_COLS = 1024
ROW_REREADS = {Family.SOFTMAX.value: 2.0, Family.LAYERNORM.value: 1.0}


@dataclass(frozen=True)
class RowLaunch:
    """Blocks of the multi-pass row kernels, as a vendor's traces launch them."""

    softmax_elems_per_thread: int   # softmax blocks: cols / this threads (rounded up to a power of two) ...
    softmax_max_threads: int        # ... up to this many
    layernorm_threads: int


# NVIDIA traces: softmax blocks of 256 threads up to 2,048 columns, 512 beyond; layer norm 32 x 4. AMD (ROCm)
# traces: softmax blocks of 1,024 threads at every length past the warp kernel's; layer norm 64 x 4.
ROW_LAUNCH = {"nvidia": RowLaunch(8, 512, 128), "amd": RowLaunch(1, 1024, 256)}


def l2_reread_bytes(family: np.ndarray, rows: np.ndarray, cols: np.ndarray, size: np.ndarray,
                    device: Device) -> np.ndarray:
    """DRAM bytes a forward softmax / layer norm re-reads because its rows in flight spill out of L2 (see
    above); 0 for every other family and for rows that fit."""
    family = np.asarray(family, dtype=object)
    rows, cols, size = (np.asarray(v, dtype=float) for v in (rows, cols, size))
    launch = ROW_LAUNCH[device.vendor]
    sms, threads = float(device.sm_count), float(device.max_threads_per_sm)
    softmax_elems = np.maximum(sms * threads * launch.softmax_elems_per_thread,
                               sms * max(np.floor(threads / launch.softmax_max_threads), 1.0) * cols)
    ln_rows = sms * min(max(np.floor(threads / launch.layernorm_threads), 1.0), float(device.max_blocks_per_sm))
    in_flight = np.where(family == Family.SOFTMAX.value, np.minimum(rows * cols, softmax_elems),
                         np.minimum(rows, ln_rows) * cols) * size
    spill = np.clip(1.0 - device.l2_cache_bytes / np.maximum(2.0 * in_flight, 1.0), 0.0, 1.0)
    rereads = np.select([family == Family.LAYERNORM.value,
                         (family == Family.SOFTMAX.value) & (cols > SOFTMAX_WARP_MAX_COLS)],
                        [ROW_REREADS[Family.LAYERNORM.value], ROW_REREADS[Family.SOFTMAX.value]], 0.0)
    return rereads * spill * rows * cols * size


def _finish(tiles, concurrent, waves, tile_flops, tile_bytes, t_compute, t_memory, intensity_ratio) -> pd.DataFrame:
    """Assemble the tile frame; ``t_compute`` / ``t_memory`` are seconds per wave."""
    wave_s = np.maximum(t_compute, t_memory)
    return pd.DataFrame({
        "tiles": np.asarray(tiles, dtype=float),
        "concurrent": np.broadcast_to(np.asarray(concurrent, dtype=float), np.shape(tiles)).copy(),
        "waves": np.asarray(waves, dtype=float),
        "tile_flops": np.asarray(tile_flops, dtype=float),
        "tile_bytes": np.asarray(tile_bytes, dtype=float),
        "wave_ms": wave_s * 1e3,
        "roofline_ms": waves * wave_s * 1e3,
        "bound": np.where(t_compute >= t_memory, "compute", "memory"),
        "intensity_ratio": np.asarray(intensity_ratio, dtype=float),
    })


def sizes_of(dtypes: pd.Series) -> np.ndarray:
    """Bytes per element of a column of dtype names."""
    return dtypes.map(itemsize).to_numpy(dtype=float)

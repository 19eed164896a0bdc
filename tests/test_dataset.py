"""neusight.dataset: loading the shared kernel traces and DeepBench into the tidy training frame.

The shared data is read in place from ../shared next to the repository; tests that need it skip when it
is absent. Expected FLOPs and bytes are derived by hand in the comments (fp32: 4 bytes per element).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from neusight.dataset import COLUMNS, SKIP_REASONS, load_deepbench_gemm, load_kernel_traces, parse_tile
from neusight.errors import DataError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"
KERNELS = SHARED / "neusight-asplos25" / "kernels"
DEEPBENCH = SHARED / "public-benchmarks" / "deepbench_gemm.csv"
needs_kernels = pytest.mark.skipif(not KERNELS.is_dir(), reason=f"shared kernel traces not found at {KERNELS}")
needs_deepbench = pytest.mark.skipif(not DEEPBENCH.is_file(), reason=f"DeepBench GEMM table not found at {DEEPBENCH}")

TEXT_COLUMNS = {"family", "op", "device", "device_name", "source", "dtype", "kernel_name", "dev_vendor",
                "dev_architecture"}
ELEM_HEADER = ("OPName,Latency,Device,Kernel Name,Warps per SM,Blocks per SM,Grid x,Grid y,Grid z,"
               "Block x,Block y,Block z,B,H\n")


def _check_frame(df: pd.DataFrame, family: str, launch: bool = True) -> None:
    """Columns, dtypes and ranges every loaded frame must satisfy."""
    assert list(df.columns[: len(COLUMNS)]) == list(COLUMNS)
    dev = [c for c in df.columns[len(COLUMNS):]]
    assert dev and all(c.startswith("dev_") for c in dev)
    assert {"dev_vendor", "dev_architecture", "dev_fp32_dual_issue", "dev_sm_count", "dev_fp32_tflops",
            "dev_mem_bandwidth_gbps"} <= set(dev)
    for col in df.columns:
        if col in TEXT_COLUMNS:
            assert not pd.api.types.is_numeric_dtype(df[col]), col
        elif col == "dev_fp32_dual_issue":
            assert pd.api.types.is_bool_dtype(df[col])
        else:
            assert df[col].dtype == np.float64, (col, df[col].dtype)
    assert (df["family"] == family).all()
    assert (df["dtype"] == "float32").all()
    launch_cols = ("num_blocks", "threads_per_block", "blocks_per_sm", "warps_per_sm") if launch else ()
    for col in ("flops", "bytes", "latency_ms", "dev_sm_count", *launch_cols):
        assert (df[col] > 0).all(), col
    gemm = family in ("linear", "bmm", "conv")
    dims, other = (["B", "M", "N", "K"], ["rows", "cols"]) if gemm else (["rows", "cols"], ["B", "M", "N", "K"])
    assert (df[dims] > 0).all().all() and (df[dims] % 1 == 0).all().all()
    assert df[other].isna().all().all()


def _row(df: pd.DataFrame, **dims: float) -> pd.Series:
    mask = np.logical_and.reduce([df[k] == v for k, v in dims.items()])
    assert mask.sum() >= 1, dims
    return df[mask].iloc[0]


@needs_kernels
@pytest.mark.parametrize("op, family, dims, flops, nbytes", [
    # nn.Linear(13, 141) on (1, 58, 13): B=1 M=58 N=13 (reduction) K=141, with bias.
    # flops = 2*58*13*141 + 58*141 (bias add) = 212,628 + 8,178 = 220,806
    # bytes = 4 * (58*13 input + 13*141 weight + 58*141 output + 141 bias) = 4 * 10,906 = 43,624
    ("linear", "linear", dict(B=1, M=58, N=13, K=141), 220_806, 43_624),
    # bmm (13, 27, 15) x (13, 15, 29): flops = 2*13*27*15*29 = 305,370
    # bytes = 4 * (13*27*15 + 13*15*29 + 13*27*29) = 4 * (5,265 + 5,655 + 10,179) = 84,396
    ("bmm", "bmm", dict(B=13, M=27, N=15, K=29), 305_370, 84_396),
    # Conv2d(893, 326, 3, stride 1, padding 1) on (38, 893, 5, 5): P = Q = (5 + 2 - 2 - 1) // 1 + 1 = 5,
    # implicit GEMM M = 38*5*5 = 950, N = 893*3*3 = 8,037, K = 326, B = groups = 1
    # flops = 2*950*8,037*326 = 4,978,117,800
    # bytes = 4 * (38*893*25 input + 326*893*9 weight + 38*326*25 output) = 4 * 3,778,112 = 15,112,448
    ("conv", "conv", dict(conv_batch=38, conv_cin=893, conv_cout=326, conv_hw=5), 4_978_117_800, 15_112_448),
    # add of two (127, 168) tensors: numel 21,336, 1 flop each; reads 2 tensors, writes 1: 4*3*21,336
    ("add", "elementwise", dict(rows=127, cols=168), 21_336, 256_032),
    # x + 1.0 reads ONE tensor: 4*2*21,336
    ("addu", "elementwise", dict(rows=127, cols=168), 21_336, 170_688),
    # gelu (erf form) 5 flops/elem: 5*21,336; one tensor in, one out: 4*2*21,336
    ("gelu", "elementwise", dict(rows=127, cols=168), 106_680, 170_688),
    # softmax over 168: 5 flops/elem = 106,680; read x, write y: 4*2*21,336
    ("softmax", "softmax", dict(rows=127, cols=168), 106_680, 170_688),
    # LayerNorm(272) on (60, 272): numel 16,320, 8 flops/elem = 130,560
    # bytes = 4 * (2*16,320 x and y + 2*60 mean, rstd + 2*272 gamma, beta) = 4 * 33,304 = 133,216
    ("ln", "layernorm", dict(rows=60, cols=272), 130_560, 133_216),
])
def test_one_file_per_family(op: str, family: str, dims: dict, flops: int, nbytes: int) -> None:
    df = load_kernel_traces(KERNELS / "nvidia" / op / "Tesla_T4.csv")
    _check_frame(df, family)
    assert (df["op"] == op).all() and (df["device"] == "t4").all() and (df["device_name"] == "Tesla T4").all()
    assert sum(df.attrs["skipped"].values()) == 0
    row = _row(df, **dims)
    assert row["flops"] == flops
    assert row["bytes"] == nbytes


@needs_kernels
def test_conv_implicit_gemm_dims_and_kernels_count() -> None:
    df = load_kernel_traces(KERNELS / "nvidia" / "conv" / "Tesla_T4.csv")
    row = _row(df, conv_batch=38, conv_cin=893, conv_cout=326, conv_hw=5)
    assert (row["B"], row["M"], row["N"], row["K"]) == (1, 950, 8037, 326)
    assert (row["conv_ksize"], row["conv_stride"], row["conv_pad"]) == (3, 1, 1)
    # winograd_nonfused: data transform, filter transform, volta_sgemm_64x64_nn, output transform
    assert row["n_kernels"] == 4 and (row["tile_m"], row["tile_n"]) == (64, 64)


@needs_kernels
def test_amd_tensile_tiles_and_grid_in_blocks() -> None:
    df = load_kernel_traces(KERNELS / "amd" / "linear" / "AMD_Instinct_MI100.csv")
    _check_frame(df, "linear")
    assert df["tile_m"].notna().all()
    assert df["dev_vendor"].eq("amd").all()
    # MT128x64x32, output 1024 x 2560 of Linear(2560, 2560) on (1, 1024, 2560): the grid is recorded in
    # work-items (hipExtModuleLaunchKernel); in 256-thread blocks: ceil(2560/128) * ceil(1024/64) = 320 tiles
    row = _row(df, M=1024, N=2560, K=2560)
    assert (row["tile_m"], row["tile_n"]) == (128, 64)
    assert row["num_blocks"] == 320
    assert row["blocks_per_sm"] == pytest.approx(320 / row["dev_sm_count"])


@pytest.mark.parametrize("name, tile", [
    ("ampere_sgemm_128x64_tn", (128, 64)),
    ("volta_sgemm_32x32_sliced1x4_tn", (32, 32)),
    ("maxwell_sgemm_64x64_nn", (64, 64)),
    ("sgemm_128x128x8_NT_vec", (128, 128)),
    ("void cutlass::Kernel<cutlass_80_simt_sgemm_256x128_8x4_tn_align1>(cutlass_80_simt_sgemm_256x128_8x4_tn_"
     "align1::Params)", (256, 128)),
    ("cudnn_infer_volta_scudnn_winograd_128x128_ldg1_ldg4_relu_tile148t_nt_v1", (128, 128)),
    ("cudnn_infer_maxwell_scudnn_128x32_relu_small_nn_v1", (128, 32)),
    ("Cijk_Ailk_Bljk_SB_MT64x128x16_MI16x16x4x1_SE_1LDSB0_APM1", (64, 128)),
    ("void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int)", None),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >(int)", None),
])
def test_parse_tile(name: str, tile: tuple[int, int] | None) -> None:
    got = parse_tile(pd.Series([name])).iloc[0]
    if tile is None:
        assert got.isna().all()
    else:
        assert (got["tile_m"], got["tile_n"]) == tile


def _write(tmp_path: Path, body: str, header: str = ELEM_HEADER, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(header + body)
    return path


GOOD = "add,0.02,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,100,50\n"


def test_malformed_rows_are_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path, GOOD * 2
                  + "add,,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,100,50\n"            # NaN latency
                  + "add,abc,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,100,50\n"         # non-numeric latency
                  + "add,-0.5,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,100,50\n"        # negative latency
                  + "add,0.0,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,100,50\n"         # zero latency
                  + "add,0.02,Tesla Z9000,k,1.0,0.5,20,1,1,128,1,1,100,50\n"     # unknown device
                  + "frobnicate,0.02,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,100,50\n"  # unknown OPName
                  + "add,0.02,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,0,50\n"          # B = 0
                  + "add,0.02,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,2.5,50\n")       # fractional dim
    with caplog.at_level(logging.WARNING, logger="neusight.dataset"):
        df = load_kernel_traces(path)
    assert len(df) == 2
    assert df.attrs["skipped"] == {"missing_value": 2, "unknown_op": 1, "unknown_device": 1,
                                   "non_positive_latency": 2, "non_positive_dims": 2}
    assert set(df.attrs["skipped"]) == set(SKIP_REASONS)
    assert df.attrs["skipped_by_file"] == {str(path): {k: v for k, v in df.attrs["skipped"].items() if v}}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage() and "unknown_device" in warnings[0].getMessage()


def test_missing_column_names_it(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD.rsplit(",", 1)[0] + "\n", header=ELEM_HEADER.replace(",H\n", "\n"))
    with pytest.raises(DataError, match=r"missing required column\(s\) \['H'\]") as info:
        load_kernel_traces(path)
    assert str(path) in str(info.value)


def test_missing_core_column(tmp_path: Path) -> None:
    path = _write(tmp_path, "add,Tesla T4\n", header="OPName,Device\n")
    with pytest.raises(DataError, match=r"\['Latency'\]"):
        load_kernel_traces(path)


def test_file_without_usable_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, "add,-1,Tesla T4,k,1.0,0.5,20,1,1,128,1,1,100,50\n")
    with pytest.raises(DataError, match="no usable rows") as info:
        load_kernel_traces(path)
    assert str(path) in str(info.value) and "non_positive_latency" in str(info.value)
    with pytest.raises(DataError, match="no data rows"):
        load_kernel_traces(_write(tmp_path, "", name="header_only.csv"))
    with pytest.raises(DataError, match="cannot be read"):
        load_kernel_traces(_write(tmp_path, "", header="", name="empty.csv"))


def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file or directory"):
        load_kernel_traces(tmp_path / "nope.csv")
    with pytest.raises(DataError, match="holds no"):
        load_kernel_traces(tmp_path)


def test_directory_list_and_filters(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    _write(tmp_path / "a", GOOD, name="t4.csv")
    _write(tmp_path / "a", GOOD.replace("Tesla T4", "Tesla P4").replace("add,", "mulu,"), name="p4.csv")
    ln = _write(tmp_path, GOOD.replace("add,", "ln,"), name="ln.csv")
    df = load_kernel_traces([tmp_path / "a", ln])
    assert sorted(df["op"]) == ["add", "ln", "mulu"] and set(df["family"]) == {"elementwise", "layernorm"}
    assert list(load_kernel_traces(tmp_path / "a", devices=["Tesla P4"])["device"]) == ["p4"]
    assert list(load_kernel_traces(tmp_path / "a", devices="t4")["device"]) == ["t4"]  # one name, not letters
    assert list(load_kernel_traces([tmp_path / "a", ln], families=["layernorm"])["op"]) == ["ln"]
    with pytest.raises(DataError, match="no rows"):
        load_kernel_traces(ln, devices=["p4"])


@needs_deepbench
def test_deepbench_gemm_skips_and_counts_gpus_the_library_lacks(tmp_path: Path) -> None:
    csv = tmp_path / "deepbench_gemm.csv"
    csv.write_text("gpu,precision,M,N,K,latency_ms\nT4-16GB,fp32,64,64,64,0.01\nVoodoo 5,fp32,64,64,64,0.01\n")
    df = load_deepbench_gemm(csv)
    assert list(df["device"]) == ["t4"] and df.attrs["skipped"]["unknown_device"] == 1


def test_deepbench_gemm() -> None:
    df = load_deepbench_gemm(DEEPBENCH)
    _check_frame(df, "linear", launch=False)
    assert sum(df.attrs["skipped"].values()) == 0  # every DeepBench GPU is in the library, Maxwell TITAN X too
    assert {"t4", "v100-sxm2-16gb", "p100-pcie-16gb", "gtx-titan-x"} <= set(df["device"])
    # DeepBench T4 fp32 M=1760 N=16 K=1760 (column-major C[M x N], K reduces) -> row-major C^T:
    # B=1, M=16, N=1760 (reduction), K=1760; flops = 2*16*1760*1760 = 99,123,200
    # bytes = 4 * (16*1760 + 1760*1760 + 16*1760) = 4 * 3,153,920 = 12,615,680 (no bias)
    row = _row(df[df["device"] == "t4"], M=16, N=1760, K=1760)
    assert (row["flops"], row["bytes"], row["latency_ms"]) == (99_123_200, 12_615_680, 0.13)
    assert row[["grid_x", "tile_m", "n_kernels"]].isna().all()


@pytest.mark.slow
@needs_kernels
def test_whole_tree_loads_fast() -> None:
    start = time.perf_counter()
    df = load_kernel_traces(KERNELS)
    elapsed = time.perf_counter() - start
    assert len(df) > 300_000 and elapsed < 30
    assert sum(df.attrs["skipped"].values()) == 0
    gemm = df[df["family"].isin(["linear", "bmm"])]
    assert gemm["tile_m"].notna().mean() > 0.99

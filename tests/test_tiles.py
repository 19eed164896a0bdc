"""The row kernels' L2 re-reads (neusight.tiles.l2_reread_bytes): where they apply, their laws, and that a
traced model's forward softmax and layer norm carry them in their bound while gradient kernels do not. Also the
share of the FP32 peak that bounds SGEMM on each kind of SM (neusight.tiles.sgemm_lane_fraction)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neusight
from neusight.devices import load_device, modify_device
from neusight.tiles import (DEDICATED_LANES_GEMM_FRACTION, DUAL_ISSUE_GEMM_FRACTION, SOFTMAX_WARP_MAX_COLS,
                            device_rates, l2_reread_bytes, sgemm_lane_fraction)

DEVICES = ("p4", "v100-pcie-32gb", "a100-pcie-40gb", "l4", "h100-sxm5-80gb", "mi250")
FAMILIES = ("softmax", "layernorm", "elementwise")


def _extra(family: str, rows: float, cols: float, device, size: float = 4.0) -> float:
    return float(l2_reread_bytes(np.array([family]), np.array([rows]), np.array([cols]), np.array([size]), device)[0])


def test_long_softmax_rows_spill_out_of_a_small_l2_and_not_out_of_a_large_one():
    rows, cols = 32768, 16384
    tensor = rows * cols * 4.0
    v100, l4 = load_device("v100-pcie-32gb"), load_device("l4")
    # V100: 80 SMs x 4 blocks of 512 threads in flight, one 64 KiB row each = 21 MB, twice that against 6 MB
    in_flight = 80 * 4 * cols * 4.0
    spill = 1 - v100.l2_cache_bytes / (2 * in_flight)
    assert _extra("softmax", rows, cols, v100) == pytest.approx(2 * spill * tensor)
    assert _extra("layernorm", rows, cols, v100) == pytest.approx(tensor * (1 - v100.l2_cache_bytes / (2 * 1280 * cols * 4.0)))
    # L4: 58 x 3 rows in flight = 11 MB, twice that fits its 48 MB L2
    assert _extra("softmax", rows, cols, l4) == 0.0
    # rows the warp softmax holds in registers are read once, however large the tensor
    assert _extra("softmax", rows, SOFTMAX_WARP_MAX_COLS, v100) == 0.0
    assert _extra("softmax", rows, SOFTMAX_WARP_MAX_COLS + 1, v100) > 0.0
    # other families never re-read
    assert _extra("elementwise", rows, cols, v100) == 0.0
    # few rows: the whole tensor is in flight and fits
    assert _extra("softmax", 4, cols, v100) == 0.0


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(FAMILIES), st.integers(1, 1 << 17), st.integers(1, 1 << 16), st.sampled_from((2.0, 4.0)),
       st.sampled_from(DEVICES))
def test_rereads_never_drop_when_rows_or_cols_grow_and_stay_within_the_passes(family, rows, cols, size, device):
    dev = load_device(device)
    base = _extra(family, rows, cols, dev, size)
    for r, c in ((rows + 1, cols), (rows * 2, cols), (rows, cols + 1), (rows, cols * 2)):
        assert _extra(family, r, c, dev, size) >= base, (family, rows, cols, size, device, r, c)
    assert 0.0 <= base <= 2.0 * rows * cols * size


@pytest.mark.parametrize("family", ("softmax", "layernorm"))
def test_a_larger_l2_never_adds_rereads(family):
    small = load_device("v100-pcie-32gb")
    larger = modify_device("v100-pcie-32gb", l2_cache_mib=small.l2_cache_mib * 4)
    for rows, cols in ((4096, 2048), (32768, 8192), (65536, 16384)):
        assert _extra(family, rows, cols, larger) <= _extra(family, rows, cols, small)
    assert _extra(family, 65536, 16384, larger) < _extra(family, 65536, 16384, small)


class _RowOps(torch.nn.Module):
    def __init__(self, cols: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(cols)

    def forward(self, x):
        return torch.softmax(self.norm(x), dim=-1)


def test_forward_row_kernels_carry_rereads_in_their_bound_and_gradients_do_not():
    cols, rows = 16384, 8192
    p = neusight.predict(_RowOps(cols), "v100-pcie-32gb", batch_size=rows, mode="training",
                         optimizer=None, input_shapes=[(cols,)])
    k = p.kernels
    dev = load_device("v100-pcie-32gb")
    memory_ms = k["bytes"] / dev.mem_bandwidth_bytes_per_s * 1e3
    row = k["family"].isin(["softmax", "layernorm"])
    fwd = row & ~k["kernel"].str.endswith("_bwd")
    bwd = row & k["kernel"].str.endswith("_bwd")
    assert fwd.sum() == 2 and bwd.sum() == 2
    assert (k.loc[fwd, "roofline_ms"] > memory_ms[fwd] * 1.2).all()
    assert np.allclose(k.loc[bwd, "roofline_ms"], np.maximum(memory_ms[bwd], k.loc[bwd, "flops"]
                                                             / dev.peak_fp32_flops * 1e3))


def test_gradient_kernels_are_told_apart_by_name_and_fused_groups_by_their_members():
    from neusight.predictor.features import backward_kernels

    traced = pd.DataFrame({"kernel": ["softmax", "softmax_bwd", "layernorm_bwd", "fused", "fused"],
                           "aten_op": ["aten._softmax.default", "aten._softmax_backward_data.default",
                                       "aten.native_layer_norm_backward.default", "fused:softmax_bwd+mul",
                                       "fused:div+softmax"]})
    assert backward_kernels(traced).tolist() == [False, True, True, True, False]
    assert backward_kernels(pd.DataFrame({"family": ["softmax", "layernorm"]})).tolist() == [False, False]


@pytest.mark.parametrize("key, share", [
    ("h100-sxm5-80gb", DEDICATED_LANES_GEMM_FRACTION), ("h100-pcie", DEDICATED_LANES_GEMM_FRACTION),
    ("h200", DEDICATED_LANES_GEMM_FRACTION), ("b200", DEDICATED_LANES_GEMM_FRACTION),
    ("l4", DUAL_ISSUE_GEMM_FRACTION), ("rtx-4090", DUAL_ISSUE_GEMM_FRACTION), ("rtx-3090", DUAL_ISSUE_GEMM_FRACTION),
    ("a10", DUAL_ISSUE_GEMM_FRACTION),
    ("a100-pcie-40gb", 1.0), ("v100-pcie-32gb", 1.0), ("t4", 1.0), ("p4", 1.0), ("mi250", 1.0),
])
def test_sgemm_share_of_the_fp32_peak_by_kind_of_sm(key: str, share: float):
    """FP32-only 32-lane schedulers (Hopper, datacenter Blackwell) lose only the issue slots of the loop's other
    instructions; GA10x / Ada, whose second 16 lanes are shared with INT32, half; 16-lane schedulers nothing. Only
    FP32 GEMMs: TF32 / FP16 run on tensor cores and the vector peak stays the spec sheet's."""
    device = load_device(key)
    assert sgemm_lane_fraction(device) == share
    fp32 = device_rates(device, "float32")
    assert fp32.gemm_flops == pytest.approx(device.fp32_matrix_tflops * 1e12 * share)
    assert fp32.vector_flops == device.peak_fp32_flops
    if device.fp16_tensor_tflops:
        assert device_rates(device, "float16").gemm_flops == device.peak_flops("float16", tensor_cores=True)
    assert 0.5 <= DUAL_ISSUE_GEMM_FRACTION < DEDICATED_LANES_GEMM_FRACTION < 1.0

"""Fused graphs (torch.compile): which kernels a group becomes, its bytes, what stays untouched, determinism,
and the fusion labels of the dataset through the evaluation protocol."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from torch import nn

import neusight
from neusight.errors import DataError
from neusight.evaluate import find_labels, predict_label
from neusight.graph.fusion import FUSED_KERNEL, fused_kernels
from tests.conftest import DATASET, need_shared

MEMORY_BOUND = ["elementwise", "softmax", "layernorm", "memory", "embedding", "reduction"]


class _Chain(nn.Module):
    """linear -> (x * 2 + 1).relu() -> linear: three pointwise ops between two GEMMs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * 2 + 1))


def test_a_pointwise_chain_between_gemms_becomes_one_kernel_that_reads_and_writes_once():
    g = neusight.trace(_Chain(), batch_size=8, input_shapes=[(64,)], mode="inference")
    eager, fused = g.kernels, fused_kernels(g)
    assert (eager["family"] == "elementwise").sum() == 3
    (row,) = fused[fused["kernel"] == FUSED_KERNEL].itertuples()
    # reads a's output (8 x 64 fp32 = 2048 B) once and writes what b reads (2048 B); the two intermediates
    # (2 x 2048 B written + read again in eager) never reach DRAM
    assert row.bytes == 2048 + 2048
    assert row.family == "elementwise" and row.flops == eager.loc[eager["family"] == "elementwise", "flops"].sum()
    gemms = lambda k: k[k["family"] == "linear"].drop(columns=["modeled"]).reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(gemms(eager), gemms(fused))


@pytest.fixture(scope="module")
def gpt2():
    return neusight.trace("gpt2", batch_size=2, seq_len=128, mode="inference")


def test_fusion_keeps_every_gemm_and_never_adds_traffic(gpt2):
    eager, fused = gpt2.kernels, fused_kernels(gpt2)
    for fam in ("linear", "bmm"):
        assert sorted(map(tuple, eager.loc[eager["family"] == fam, "dims"])) == \
            sorted(map(tuple, fused.loc[fused["family"] == fam, "dims"]))
    assert len(fused) < len(eager)
    assert fused.loc[fused["family"].isin(MEMORY_BOUND), "bytes"].sum() < \
        eager.loc[eager["family"].isin(MEMORY_BOUND), "bytes"].sum()
    # the GELU of each block (mul, pow, mul, add, mul, tanh, add, mul) is one kernel: reads and writes
    # 2 x 128 x 3072 fp32 once each = 2 x 3,145,728 B
    act = fused[(fused["module"] == "transformer.h.0.mlp.act")]
    assert len(act) == 1 and act["bytes"].iloc[0] == 2 * 2 * 128 * 3072 * 4


def test_fused_table_is_the_same_for_every_trace_of_the_model(gpt2):
    # storages are identified by address while alive; a second trace reuses addresses differently
    again = neusight.trace("gpt2", batch_size=2, seq_len=128, mode="inference")
    pd.testing.assert_frame_equal(fused_kernels(gpt2), fused_kernels(again))


def test_predict_fused_is_faster_and_says_so():
    eager = neusight.predict("gpt2", "l4", batch_size=2, seq_len=128, memory=False)
    fused = neusight.predict("gpt2", "l4", batch_size=2, seq_len=128, memory=False, fused=True)
    assert 0 < fused.latency_ms < eager.latency_ms
    assert any("torch.compile" in n for n in fused.notes) and not any("torch.compile" in n for n in eager.notes)
    assert (fused.kernels["latency_ms"] >= fused.kernels["roofline_ms"]).all()


def test_find_labels_takes_fusion_runs_on_request_and_refuses_other_options():
    need_shared(DATASET)
    plain = find_labels(DATASET)
    both = find_labels(DATASET, options=("fusion",))
    assert all(r.option is None for r in plain)
    fusion = [r for r in both if r.option == "fusion"]
    assert fusion and len(both) == len(plain) + len(fusion)
    with pytest.raises(DataError, match="'dp4'"):
        find_labels(DATASET, options=("dp4",))


def test_a_fusion_label_is_predicted_fused_next_to_its_eager_baseline():
    need_shared(DATASET)
    run = next(r for r in find_labels(DATASET, options=("fusion",)) if r.option == "fusion")
    cache: dict = {}
    fused = predict_label(run, None, cache)
    eager = predict_label(dataclasses.replace(run, option=None), None, cache)
    assert fused["predicted_ms"] < eager["predicted_ms"]
    assert fused["eager_error_pct"] == pytest.approx(eager["error_pct"])

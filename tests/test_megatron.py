"""Megatron-LM's kernels for a traced GPT: what changes against Hugging Face's, and what must not."""

from __future__ import annotations

import pytest

import neusight
from neusight.api import predict_graph
from neusight.errors import InputError
from neusight.graph.megatron import megatron_kernels

GEMMS = ("linear", "bmm")


@pytest.fixture(scope="module")
def graph():
    return neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training", optimizer=None)


def test_bias_gelu_is_one_kernel_per_block_and_phase(graph):
    hf, meg = graph.kernels, megatron_kernels(graph)
    act = meg[meg["module"].str.endswith("mlp.act")]
    assert len(act) == 2 * 12 and (act["kernel"] == "megatron").all()
    # forward reads the input and writes the output, backward also reads the saved input
    elems = 2 * 64 * 3072
    assert sorted(act.groupby("phase")["bytes"].first().to_dict().items()) == [("backward", 12.0 * elems),
                                                                                ("forward", 8.0 * elems)]
    # the chain's FLOPs are kept, its traffic is not
    hf_act = hf[hf["module"].str.endswith("mlp.act")]
    assert act["flops"].sum() == pytest.approx(hf_act["flops"].sum())
    assert act["bytes"].sum() < hf_act["bytes"].sum() / 4


def test_gemms_stay_and_only_the_forward_scale_and_cache_go(graph):
    hf, meg = graph.kernels, megatron_kernels(graph)
    gemm = lambda k: k[k["family"].isin(GEMMS)][["op_index", "flops", "bytes"]].reset_index(drop=True)
    assert gemm(hf).equals(gemm(meg))
    attn = lambda k, phase: k[k["module"].str.endswith(".attn") & (k["phase"] == phase)]["aten_op"].tolist()
    fw_hf, fw_meg = attn(hf, "forward"), attn(meg, "forward")
    assert "aten.mul.Tensor" in fw_hf and "aten.mul.Tensor" not in fw_meg          # folded into the QK^T GEMM
    assert "aten.cat.default" in fw_hf and "aten.cat.default" not in fw_meg        # no KV cache
    assert "aten._softmax.default" in fw_meg and "aten.native_dropout.default" in fw_meg
    assert attn(hf, "backward") == attn(meg, "backward")     # the masked_fill_ backward replaces the scale's
    assert meg["op_index"].is_monotonic_increasing


def test_megatron_forecast_is_faster_and_exclusive_with_fusion(graph):
    eager = predict_graph(graph, "a100-sxm4-40gb")
    meg = predict_graph(graph, "a100-sxm4-40gb", megatron=True)
    assert meg.latency_ms < eager.latency_ms and any("Megatron" in n for n in meg.notes)
    with pytest.raises(InputError, match="exclude each other"):
        predict_graph(graph, "a100-sxm4-40gb", fused=True, megatron=True)

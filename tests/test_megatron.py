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


@pytest.fixture(scope="module")
def selective():
    return neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training", optimizer=None,
                          gradient_checkpointing="selective")


def test_recomputed_kernels_are_marked_in_the_trace(graph, selective):
    """The kernels activation checkpointing runs again in the backward pass carry recompute=True: with the
    selective recompute a second copy of each attention core's forward kernels (its two batched GEMMs, scaling,
    softmax, dropout), in the backward pass and in the attention module."""
    from collections import Counter

    assert not graph.kernels["recompute"].any()
    k = selective.kernels
    again = k[k["recompute"]]
    assert (again["phase"] == "backward").all() and again["module"].str.endswith(".attn").all()
    forward = Counter(k.loc[k["module"].str.endswith(".attn") & (k["phase"] == "forward"), "aten_op"])
    redone = Counter(again["aten_op"])
    assert not redone - forward                                 # nothing the forward pass did not run
    assert redone["aten.bmm.default"] == 2 * 12 and redone["aten._softmax.default"] == 12
    assert set(again["op_index"]) <= selective.recompute_ops     # (views and other ops without a kernel too)


def test_megatron_with_selective_recompute_folds_the_recomputed_scaling_too(graph, selective):
    plain, again = {}, {}
    megatron_kernels(graph, plain)
    k = megatron_kernels(selective, again)
    # each layer's recomputed scaling is folded into the QK^T GEMM as its forward one is: 12 more dropped
    assert again["dropped"] == plain["dropped"] + 12
    assert again["fused"] == plain["fused"] == 24
    assert not k.loc[k["recompute"], "aten_op"].isin(["aten.mul.Tensor", "aten.div.Tensor"]).any()
    assert k["recompute"].sum() == selective.kernels["recompute"].sum() - 12


def test_megatron_with_full_recompute_runs_each_activation_forward_again():
    from collections import Counter

    g = neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training", optimizer=None, gradient_checkpointing=True)
    # the recomputation of a block runs its modules' kernels again, attributed to the same modules as in the forward
    # pass (a forward pass inside the backward one, whose own modules are still entered then), the block's own
    # residual add to the block (transformers checkpoints its forward, whose module hooks do not run again)
    t = g.kernels
    for layer in (0, 11):
        module = t["module"].astype(str)
        inside = (module == f"transformer.h.{layer}") | module.str.startswith(f"transformer.h.{layer}.")
        key = lambda rows: Counter(zip(rows["module"], rows["aten_op"]))     # noqa: E731
        redone, forward = key(t[inside & t["recompute"]]), key(t[inside & (t["phase"] == "forward")])
        assert redone - forward == Counter()
        # all of it but the block's last residual add, which no backward kernel needs (checkpoint's early stop)
        assert forward - redone == Counter({(f"transformer.h.{layer}", "aten.add.Tensor"): 1})
    counts: dict = {}
    k = megatron_kernels(g, counts)
    assert counts["dropped"] == 2 * 12          # each layer's scaling, forward and recomputed
    fused = k[k["aten_op"].str.startswith("megatron:bias_gelu")]
    forward_kind = fused[fused["aten_op"] == "megatron:bias_gelu"]
    assert len(forward_kind) == 24 and int(forward_kind["recompute"].sum()) == 12
    assert (fused["aten_op"] == "megatron:bias_gelu_back").sum() == 12
    again = forward_kind[forward_kind["recompute"]]
    assert (again["phase"] == "backward").all() and (again["bytes"] == 8.0 * 2 * 64 * 3072).all()


def test_a_megatron_step_with_recompute_is_forecast_and_costs_more():
    from neusight.parallel import predict_parallel

    run = dict(batch_size=8, seq_len=128, mode="training", dp=2, tp=2, megatron=True, memory=False)
    plain = predict_parallel("gpt2", "a100-sxm4-40gb", **run)
    times = {ck: predict_parallel("gpt2", "a100-sxm4-40gb", gradient_checkpointing=ck, **run).parts["compute"]
             for ck in ("selective", True)}
    assert plain.parts["compute"] < times["selective"] < times[True]

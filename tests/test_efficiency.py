"""MFU, HFU and MBU of a forecast (neusight.efficiency): their definitions on a hand-counted module, what
recomputation and precision change, and the laws they obey on whole models (a kernel never beats its roofline,
so neither rate exceeds the spec-sheet peak)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import neusight
from neusight.devices import dtype_kind, load_device
from neusight.efficiency import Efficiency, efficiency


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1024, 4096, bias=False)
        self.b = nn.Linear(4096, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Add(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def test_mfu_and_mbu_by_hand_on_two_linears():
    p = neusight.predict(_TwoLinears(), "a100-80gb-pcie", batch_size=512, mode="inference",
                         input_shapes=[(1024,)], memory=False)
    e = p.efficiency
    flops = 2 * 2 * 512 * 1024 * 4096                   # two GEMMs of 512 x 1024 x 4096, a multiply-add = 2
    seconds = p.latency_ms / 1e3
    dev = load_device("a100-80gb-pcie")
    assert e.model_flops == e.hardware_flops == flops
    assert e.peak_dtype == "float32" and e.peak_flops == dev.peak_flops("float32") == 19.5e12
    assert e.mfu == pytest.approx(flops / seconds / 19.5e12, rel=1e-12)
    assert e.hfu == e.mfu
    assert e.dram_bytes == pytest.approx(float(p.kernels["bytes"].sum()))
    assert e.mbu == pytest.approx(e.dram_bytes / seconds / dev.mem_bandwidth_bytes_per_s, rel=1e-12)
    assert 0 < e.mfu < 1 and 0 < e.mbu < 1
    d = e.to_dict()
    assert d["mfu"] == e.mfu and d["peak_tflops"] == 19.5 and d["model_tflop"] == pytest.approx(flops / 1e12)
    assert "MFU" in e.line() and "FP32 peak (19.5 TFLOP/s)" in e.line() and "HFU" not in e.line()


def test_no_matrix_multiply_is_zero_mfu_and_memory_traffic_is_what_mbu_counts():
    n = 1 << 24
    p = neusight.predict(_Add(), "h100-sxm5-80gb", batch_size=1, mode="inference", input_shapes=[(n,), (n,)],
                         memory=False)
    e = p.efficiency
    assert e.model_flops == 0 and e.mfu == 0 and e.peak_dtype == "float32"
    assert e.dram_bytes == 3 * 4 * n                     # two inputs read, one output written
    assert 0.5 < e.mbu <= 1                               # one large streaming kernel: most of the bandwidth


def test_recomputation_counts_in_hfu_not_in_model_flops():
    kw = dict(batch_size=2, seq_len=128, mode="training", memory=False)
    plain = neusight.predict("gpt2", "a100-80gb-pcie", **kw).efficiency
    ckpt = neusight.predict("gpt2", "a100-80gb-pcie", gradient_checkpointing=True, **kw).efficiency
    assert ckpt.model_flops == pytest.approx(plain.model_flops, rel=1e-12)   # the model's math is the same
    assert ckpt.hardware_flops > 1.2 * ckpt.model_flops                     # the forward GEMMs run twice
    assert ckpt.hfu > ckpt.mfu and plain.hfu == plain.mfu
    assert ckpt.mfu < plain.mfu                                              # the same FLOPs in a longer step
    assert "HFU" in ckpt.line()


def test_the_peak_is_that_of_the_precision_most_flops_run_in():
    kw = dict(batch_size=2, seq_len=128, memory=False, attn_implementation="sdpa")
    h100 = load_device("h100-sxm5-80gb")
    bf16 = neusight.predict("llama-3.2-1b", h100, mode="inference", dtype="bfloat16", **kw).efficiency
    assert bf16.peak_dtype == "bfloat16" and bf16.peak_flops == h100.peak_flops("bfloat16")
    # FP8 training: forward GEMMs in e4m3, gradient GEMMs in e5m2 x e4m3; one FP8 peak for all of them
    p = neusight.predict("llama-3.2-1b", h100, mode="training", dtype="bfloat16", fp8=True, **kw)
    fp8 = p.efficiency
    k = p.kernels
    gemm = k[k["family"].isin(["linear", "bmm", "conv"])]
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(gemm["dtype"])
    assert fp8.peak_dtype == "float8" and fp8.peak_flops == h100.peak_flops("float8")
    assert fp8.model_flops == pytest.approx(float(gemm["flops"].sum()))
    assert "FP8 tensor peak" in fp8.line()
    assert dtype_kind("float8_e5m2") == dtype_kind(torch.float8_e4m3fn) == "float8" and dtype_kind("int8") is None


@pytest.mark.parametrize("model, device, kw", [
    ("gpt2", "t4", dict(mode="training", seq_len=256, batch_size=2)),
    ("gpt2", "mi250", dict(mode="inference", seq_len=256, batch_size=4, host_us=20.0)),
    ("llama-3.2-1b", "h100-sxm5-80gb", dict(mode="inference", seq_len=1, kv_cache=512, batch_size=8,
                                            dtype="bfloat16", attn_implementation="sdpa", static_cache=True,
                                            fused=True)),
    ("resnet18", "a100-sxm4-40gb", dict(mode="training", batch_size=32)),
])
def test_neither_rate_exceeds_the_spec_sheet_peak(model, device, kw):
    p = neusight.predict(model, device, memory=False, **kw)
    e = p.efficiency
    assert 0 < e.mfu <= e.hfu <= 1 and 0 < e.mbu <= 1
    # the JSON carries the same numbers
    assert json.loads(p.to_json())["efficiency"]["mbu"] == pytest.approx(e.mbu)


def test_efficiency_of_a_kernel_table_without_recompute_column():
    import pandas as pd

    k = pd.DataFrame({"family": ["linear", "elementwise"], "dtype": ["bfloat16", "bfloat16"],
                      "flops": [2e12, 1e9], "bytes": [1e9, 2e9]})
    e = efficiency(k, load_device("h100-sxm5-80gb"), 10.0)
    assert isinstance(e, Efficiency)
    assert e.model_flops == e.hardware_flops == 2e12 and e.peak_dtype == "bfloat16"
    assert e.achieved_flops == pytest.approx(2e14) and e.achieved_bandwidth == pytest.approx(3e11)
    # AMD's FP32 GEMMs run on matrix cores at twice the vector lanes' peak: the denominator says which
    fp32 = efficiency(k.assign(dtype="float32"), load_device("mi250"), 10.0)
    assert fp32.peak_flops == load_device("mi250").fp32_matrix_tflops * 1e12 and "FP32 matrix peak" in fp32.line()
    assert "FP32 peak" in efficiency(k.assign(dtype="float32"), load_device("a100-80gb-pcie"), 10.0).line()


def test_side_by_side_and_ranking_show_mfu_and_mbu():
    from neusight.api import ranking_table
    from neusight.cli.predict import comparison_table, format_summary, summary_record

    preds = [neusight.predict("gpt2", d, batch_size=1, seq_len=64, mode="inference", memory=False)
             for d in ("t4", "h100-sxm5-80gb")]
    assert preds[0].efficiency.line() in format_summary(preds[0], top=0)
    table = comparison_table([summary_record(p) for p in preds])
    for p in preds:
        assert table.loc["MFU %", p.device.key] == f"{100 * p.efficiency.mfu:.1f}"
        assert table.loc["MBU %", p.device.key] == f"{100 * p.efficiency.mbu:.1f}"
    ranked = ranking_table(preds).set_index("GPU")
    for p in preds:
        assert ranked.loc[p.device.key, "MFU %"] == pytest.approx(100 * p.efficiency.mfu)
    # anchored: the rates of the anchored time (a run twice as long uses half the peak)
    anchored = ranking_table(preds, anchored={p.device.key: 2 * p.latency_ms for p in preds}).set_index("GPU")
    for p in preds:
        assert anchored.loc[p.device.key, "MBU %"] == pytest.approx(50 * p.efficiency.mbu)


@pytest.mark.parametrize("layout", [dict(dp=2, tp=2, pp=2, microbatches=2), dict(dp=2, pp=2, microbatches=4),
                                    dict(dp=4)])
def test_per_gpu_efficiency_of_a_parallel_step_shares_the_models_flops(layout):
    """Each GPU's share of the step's matrix-multiply FLOPs, times the GPUs, is the model's on one GPU (tensor
    parallelism replicates no GEMM but for a rounding of shards: within 0.5 %), and the step's time is the
    denominator."""
    from neusight.parallel import predict_parallel

    run = dict(batch_size=8, seq_len=128, mode="training", memory=False)
    single = neusight.predict("gpt2", "h100-sxm5-80gb", **run).efficiency
    p = predict_parallel("gpt2", "h100-sxm5-80gb", run["batch_size"], run["seq_len"], "training", memory=False,
                         **layout)
    e = p.efficiency
    assert e.model_flops * p.parallelism.gpus == pytest.approx(single.model_flops, rel=5e-3)
    assert e.seconds == pytest.approx(p.latency_ms / 1e3) and e.peak_dtype == single.peak_dtype
    assert 0 < e.mfu <= 1 and 0 < e.mbu <= 1
    assert "efficiency per GPU: matrix multiplies" in p.summary()


def test_generation_prefill_mfu_and_decode_mbu_integrate_the_steps():
    from neusight.generation import predict_generation

    f = predict_generation("gpt2", "l4", batch_size=4, prompt_len=64, new_tokens=33, static_cache=True)
    pre, dec = f.prefill_efficiency, f.decode_efficiency
    assert pre.seconds == pytest.approx(f.prefill_ms / 1e3) and dec.seconds == pytest.approx(f.decode_ms / 1e3)
    # every step's traffic between the shortest and the longest cache's step's (forecast at 3 contexts)
    steps = [neusight.predict("gpt2", "l4", batch_size=4, seq_len=1, kv_cache=c, static_cache=True,
                              memory=False).efficiency for c, _ in f.steps]
    assert len(steps) == 3 and steps[0].dram_bytes < steps[-1].dram_bytes    # the cache grows
    assert 32 * steps[0].dram_bytes < dec.dram_bytes < 32 * steps[-1].dram_bytes
    assert 32 * steps[0].model_flops < dec.model_flops < 32 * steps[-1].model_flops
    assert 0 < dec.mbu <= 1 and 0 < pre.mfu <= 1
    assert f"decode MBU {100 * dec.mbu:.1f} %" in f.summary()
    one = predict_generation("gpt2", "l4", batch_size=4, prompt_len=64, new_tokens=1)
    assert one.decode_efficiency is None and "prefill MFU" in one.summary() and "decode MBU" not in one.summary()
    two = predict_generation("gpt2", "l4", batch_size=4, prompt_len=64, new_tokens=2)   # one decode step
    alone = neusight.predict("gpt2", "l4", batch_size=4, seq_len=1, kv_cache=64, memory=False).efficiency
    assert two.decode_efficiency.dram_bytes == pytest.approx(alone.dram_bytes, rel=1e-12)
    assert two.decode_efficiency.mbu == pytest.approx(alone.mbu, rel=1e-9)


def test_engine_step_efficiency_adds_the_prompt_tokens_to_the_decode_step():
    """A continuously batching engine's mean step: its decode step at the mean context plus what its prompt tokens
    add, in FLOPs and bytes as in time (neusight.engine.AMOUNTS)."""
    from neusight.engine import predict_continuous

    f = predict_continuous("gpt2", "t4", 16, 256, 64)
    e = f.efficiency
    run = dict(seq_len=1, static_cache=True, fused=True, attn_implementation="sdpa", memory=False)
    decode = neusight.predict("gpt2", "t4", batch_size=16, kv_cache=256 + 31, **run).efficiency   # the mean context
    every = neusight.predict("gpt2", "t4", batch_size=16 + f.prefill_tokens, kv_cache=1, **run).efficiency
    assert e.seconds == pytest.approx(f.step_ms / 1e3)
    assert decode.model_flops < e.model_flops < every.model_flops    # prompt tokens' logits: one in 256 computed
    assert e.dram_bytes > decode.dram_bytes
    assert 0 < e.mfu <= 1 and 0 < e.mbu <= 1
    assert f"MBU {100 * e.mbu:.1f} %" in f.summary()


def test_a_parallel_steps_optimizer_traffic_counts_once_not_per_micro_batch():
    """Two micro-batches of the same shape as one: the step's DRAM traffic grows by one micro-batch's forward and
    backward, not by a second optimizer step (which runs once a step)."""
    from neusight.parallel import predict_parallel

    run = dict(mode="training", memory=False, dp=2, optimizer="adamw")
    one = predict_parallel("gpt2", "h100-sxm5-80gb", 4, 128, microbatches=1, **run)
    two = predict_parallel("gpt2", "h100-sxm5-80gb", 8, 128, microbatches=2, **run)
    k = one.per_gpu.kernels
    assert (k["phase"] == "optimizer").any() and k.equals(two.per_gpu.kernels)   # the same micro-batch traced
    step = float(k.loc[k["phase"] != "optimizer", "bytes"].sum())
    assert two.efficiency.dram_bytes - one.efficiency.dram_bytes == pytest.approx(step, rel=1e-9)
    assert two.efficiency.model_flops == pytest.approx(2 * one.efficiency.model_flops, rel=1e-12)

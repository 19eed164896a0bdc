"""FP8 linear layers (fp8=True): which layers become FP8 GEMMs, the kernels of a step, the FP8 peak of the bound,
and the refusals."""

from __future__ import annotations

import re

import pytest

import neusight
from neusight.devices import load_device
from neusight.errors import InputError

# 2 layers of 7 projections each (q 64->64, k / v 64->32, o, gate / up 64->128, down), vocabulary 512
_TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def _gemms(g, prefix=""):
    k = g.kernels
    return k[(k["family"] == "linear") & k["kernel"].astype(str).str.startswith(prefix)]


def test_inference_runs_every_projection_but_the_head_as_an_fp8_gemm_on_fp8_weights():
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16")
    plain = neusight.trace(_TINY_LLAMA, **kw)
    fp8 = neusight.trace(_TINY_LLAMA, fp8=True, **kw)
    scaled = _gemms(fp8, "scaled_mm")
    assert len(scaled) == 14 and set(scaled["dtype"]) == {"float8_e4m3fn"}
    # the same GEMM work; the LM head (64 -> 512) stays a BF16 GEMM
    assert _gemms(fp8)["flops"].sum() == _gemms(plain)["flops"].sum()
    head = _gemms(fp8).query("dtype == 'bfloat16'")
    assert len(head) == 1 and head["dims"].iloc[0] == (1, 64, 64, 512)
    # operands read in one byte each, the BF16 output written in two: q_proj (64 tokens x 64 -> 64)
    q = scaled[scaled["dims"] == (1, 64, 64, 64)].iloc[0]
    assert q["bytes"] == 64 * 64 + 64 * 64 + 2 * 64 * 64
    # FP8 weights: one byte per projection weight, the embeddings and norms as before
    fp8_params = [p for p in fp8.params if p.dtype == "float8_e4m3fn"]
    assert sum(p.numel for p in fp8_params) == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert sum(p.numel * p.itemsize for p in fp8.params) < sum(p.numel * p.itemsize for p in plain.params)
    assert any("FP8 linear layers (FP8 weights" in n and "14 nn.Linear" in n for n in fp8.notes)


def test_training_runs_forward_and_both_gradients_in_fp8_with_weights_kept_in_precision():
    kw = dict(batch_size=2, seq_len=32, mode="training", dtype="bfloat16", optimizer="adamw")
    plain = neusight.trace(_TINY_LLAMA, **kw)
    fp8 = neusight.trace(_TINY_LLAMA, fp8=True, **kw)
    scaled = _gemms(fp8, "scaled_mm")
    # per projection: the forward GEMM (e4m3 x e4m3), the input and the weight gradient (e5m2 gradient first)
    assert (scaled["phase"] == "forward").sum() == 14
    assert (scaled["phase"] == "backward").sum() == 28
    assert set(scaled.loc[scaled["phase"] == "backward", "dtype"]) == {"float8_e5m2"}
    assert _gemms(fp8)["flops"].sum() == pytest.approx(_gemms(plain)["flops"].sum(), rel=1e-12)
    # weights, gradients and optimizer state in the model's precision
    assert {p.dtype for p in fp8.params} == {"bfloat16"} and {g.dtype for g in fp8.grads} == {"bfloat16"}
    assert sum(t.numel * t.itemsize for t in fp8.optimizer_state) == \
        sum(t.numel * t.itemsize for t in plain.optimizer_state)
    assert any("torchao Float8Linear" in n for n in fp8.notes)


def test_fp8_gemms_are_bounded_by_the_fp8_tensor_peak():
    # a compute-bound projection: 2 x 2048 tokens x 4096 -> 4096; on H100 its FP8 roofline is half the BF16 one
    cfg = dict(_TINY_LLAMA, hidden_size=4096, intermediate_size=4096 * 2, num_attention_heads=32,
               num_key_value_heads=32, num_hidden_layers=1)
    kw = dict(batch_size=2, seq_len=2048, mode="inference", dtype="bfloat16", memory=False)
    plain = neusight.predict(cfg, "h100-sxm5-80gb", **kw).kernels
    fp8 = neusight.predict(cfg, "h100-sxm5-80gb", fp8=True, **kw).kernels
    square = (1, 4096, 4096, 4096)
    bf16_roof = plain.loc[(plain["dims"] == square) & (plain["family"] == "linear"), "roofline_ms"].iloc[0]
    fp8_roof = fp8.loc[(fp8["dims"] == square) & (fp8["kernel"].str.startswith("scaled_mm")), "roofline_ms"].iloc[0]
    h100 = load_device("h100-sxm5-80gb")
    assert fp8_roof == pytest.approx(bf16_roof * h100.bf16_tensor_tflops / h100.fp8_tensor_tflops, rel=0.02)
    assert fp8_roof >= 2 * 4096**3 / (h100.fp8_tensor_tflops * 1e12) * 1e3


def test_layers_scaled_mm_cannot_take_stay_in_their_precision():
    odd = dict(_TINY_LLAMA, intermediate_size=120)        # gate / up / down: 120 is not a multiple of 16
    g = neusight.trace(odd, batch_size=1, seq_len=16, mode="inference", dtype="bfloat16", fp8=True)
    assert len(_gemms(g, "scaled_mm")) == 8               # q, k, v, o of both layers
    assert any("6 layers with features not a multiple of 16" in n for n in g.notes)


@pytest.mark.parametrize("model, kw, fragment", [
    (_TINY_LLAMA, dict(device="a100-80gb-pcie"), "a100-80gb-pcie (NVIDIA A100 PCIe 80GB) has none"),
    (_TINY_LLAMA, dict(amp="bfloat16", dtype="float32"), "fp8=True with amp= is not modelled"),
    (_TINY_LLAMA, dict(mode="training", lora_rank=4), "fp8=True with lora_rank=4"),
    ("gpt2", dict(), "GPT2LMHeadModel has none that qualify"),
    (_TINY_LLAMA, dict(fp8="yes"), "fp8='yes' is not true, false, 'dynamic' or 'static'"),
    (_TINY_LLAMA, dict(fp8="static", mode="training"), "fp8='static' casts each input with the fixed scale"),
])
def test_bad_fp8_runs_say_what_to_change(model, kw, fragment):
    kw = {"batch_size": 1, "seq_len": 16, "mode": "inference", "dtype": "bfloat16", "fp8": True, **kw}
    with pytest.raises(InputError, match=re.escape(fragment)):
        neusight.trace(model, **kw)


def test_static_scaling_casts_with_a_fixed_scale_and_no_max_per_call():
    """fp8='static' (a calibrated checkpoint's input scales): the same FP8 GEMMs on the same FP8 weights as dynamic
    scaling, but no max |x| reduction before each cast, so fewer and lighter memory-bound kernels, eager or fused;
    routed experts' casts too. fp8='dynamic' is fp8=True."""
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16")
    dynamic, static = (neusight.trace(_TINY_LLAMA, fp8=mode, **kw) for mode in (True, "static"))
    cols = ["dims", "dtype", "bytes"]
    assert _gemms(static, "scaled_mm")[cols].reset_index(drop=True).equals(
        _gemms(dynamic, "scaled_mm")[cols].reset_index(drop=True))
    assert [p.dtype for p in static.params] == [p.dtype for p in dynamic.params]
    assert (dynamic.kernels["kernel"] == "max").sum() == 14 and not (static.kernels["kernel"] == "max").any()
    memory_bound = lambda g: g.kernels[~g.kernels["family"].isin(["linear", "bmm"])]  # noqa: E731
    assert len(memory_bound(static)) < len(memory_bound(dynamic))
    assert memory_bound(static)["bytes"].sum() < memory_bound(dynamic)["bytes"].sum()
    assert any("static per-tensor scaling" in n for n in static.notes)
    same = neusight.trace(_TINY_LLAMA, fp8="dynamic", **kw)
    assert same.kernels[["kernel", "dims", "bytes"]].reset_index(drop=True).equals(
        dynamic.kernels[["kernel", "dims", "bytes"]].reset_index(drop=True))
    # fused: a dynamic cast's amax over 1,024 tokens x 64 is split over thread blocks (a kernel of its own, as
    # Inductor runs it); a static cast joins the kernel that makes its input
    fused = {m: neusight.predict(_TINY_LLAMA, "h100-sxm5-80gb", fp8=m, fused=True, memory=False,
                                 **dict(kw, seq_len=512)) for m in (True, "static")}
    assert len(fused["static"].kernels) < len(fused[True].kernels)
    assert fused["static"].latency_ms < fused[True].latency_ms
    moe = {m: neusight.trace(_TINY_MIXTRAL, fp8=m, moe_kernels="grouped", **kw) for m in (True, "static")}
    assert (moe[True].kernels["kernel"] == "max").sum() > (moe["static"].kernels["kernel"] == "max").sum() == 0
    assert (moe["static"].kernels["kernel"] == "scaled_grouped_mm").sum() == 4


def test_a_trace_with_fp8_gemms_is_refused_on_a_gpu_without_fp8_tensor_cores():
    g = neusight.trace(_TINY_LLAMA, batch_size=1, seq_len=16, mode="inference", dtype="bfloat16", fp8=True)
    from neusight.api import predict_graph

    assert predict_graph(g, "l4").latency_ms > 0
    with pytest.raises(InputError, match="v100-pcie-32gb"):
        predict_graph(g, "v100-pcie-32gb")


_TINY_MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     vocab_size=512)


@pytest.mark.parametrize("moe_kernels", ["loop", "grouped", "per-expert"])
def test_routed_experts_serve_fp8_weights_as_grouped_gemms_and_train_in_precision(moe_kernels):
    kw = dict(batch_size=2, seq_len=32, dtype="bfloat16", moe_kernels=moe_kernels)
    plain = neusight.trace(_TINY_MIXTRAL, mode="inference", **kw)
    fp8 = neusight.trace(_TINY_MIXTRAL, mode="inference", fp8=True, **kw)
    k = fp8.kernels
    grouped = k[k["kernel"] == "scaled_grouped_mm"]
    # per layer: the gate-up and the down projection over the 4 experts, 2 x 32 tokens x top-2 / 4 = 32 rows each
    assert len(grouped) == 4 and set(grouped["dtype"]) == {"float8_e4m3fn"}
    assert set(grouped["dims"]) == {(4, 32, 64, 2 * 96), (4, 32, 96, 64)}
    gemm = lambda g: g.kernels.loc[g.kernels["family"].isin(["linear", "bmm"]), "flops"].sum()  # noqa: E731
    assert gemm(fp8) == pytest.approx(gemm(plain), rel=1e-12)
    experts = [p for n, p in zip(fp8.param_names, fp8.params) if ".experts." in n]
    assert experts and {p.dtype for p in experts} == {"float8_e4m3fn"}
    assert any("routed experts of 2 layers hold FP8 weights" in n for n in fp8.notes)
    train = neusight.trace(_TINY_MIXTRAL, mode="training", fp8=True, **kw)
    assert not (train.kernels["kernel"] == "scaled_grouped_mm").any()
    assert {p.dtype for n, p in zip(train.param_names, train.params) if ".experts." in n} == {"bfloat16"}
    assert any("kept in the model's precision: the LM head, the routed experts" in n for n in train.notes)


def test_experts_stored_input_major_serve_fp8_weights_too():
    """gpt-oss stores its experts (experts, in, out) (transformers' is_transposed); their FP8 copies are laid out as
    the FP8 grouped GEMM takes them, so FP8 serving runs (it stopped at the GEMM's layout check before)."""
    from neusight.api import predict_graph

    gpt_oss = dict(model_type="gpt_oss", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=2, vocab_size=512, sliding_window=16)
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16", moe_kernels="grouped")
    plain, fp8 = (neusight.trace(gpt_oss, fp8=f, **kw) for f in (False, True))
    grouped = fp8.kernels[fp8.kernels["kernel"] == "scaled_grouped_mm"]
    assert set(grouped["dims"]) == {(4, 32, 64, 2 * 96), (4, 32, 96, 64)} and len(grouped) == 4
    experts = {n: p for n, p in zip(fp8.param_names, fp8.params) if n.endswith(("experts.gate_up_proj",
                                                                                   "experts.down_proj"))}
    assert {p.dtype for p in experts.values()} == {"float8_e4m3fn"}
    assert sum(p.numel for p in experts.values()) == 2 * 4 * (64 * 2 * 96 + 96 * 64)
    assert predict_graph(fp8, "h100-sxm5-80gb").latency_ms > 0
    assert plain.n_params == fp8.n_params

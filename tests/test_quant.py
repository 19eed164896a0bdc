"""Weight-only quantized inference (weight_quant="int8" / "int4" / "mxfp4"): one dequantizing GEMM per projection, its
bytes, the stored weights and their scales, the bound of a decode step, and the refusals."""

from __future__ import annotations

import re

import pytest

import neusight
from neusight.errors import InputError
from neusight.devices import load_device
from neusight.graph.quant import FP4, WEIGHT_ONLY, WEIGHT_QUANT, gemm_name
from neusight.kernels.base import EXACT_BYTES_GEMMS

# 2 layers of 7 projections each (q / o 128 -> 128, k / v 128 -> 64, gate / up 128 -> 256, down 256 -> 128)
_TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
_PROJECTION_WEIGHTS = 2 * (128 * 128 * 2 + 128 * 64 * 2 + 128 * 256 * 3)


def _gemms(g):
    k = g.kernels
    return k[k["family"] == "linear"]


@pytest.mark.parametrize("bits, weight_bytes", [("int8", 1.0), ("int4", 0.5), ("mxfp4", 0.5)])
def test_each_projection_is_one_gemm_reading_its_weight_in_its_stored_bytes(bits, weight_bytes):
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16")
    plain = neusight.trace(_TINY_LLAMA, **kw)
    quant = neusight.trace(_TINY_LLAMA, weight_quant=bits, **kw)
    q = _gemms(quant)
    mine = q[q["kernel"] == f"{bits}_weight_gemm"]
    assert len(mine) == 14 and set(mine["dtype"]) == {"bfloat16"}        # the math in the model's precision
    assert q["flops"].sum() == _gemms(plain)["flops"].sum()               # the same work, the LM head unquantized
    assert len(q) - len(mine) == 1
    # q_proj, 64 tokens: BF16 input and output, the weight in its bytes, its scales (int8: one per output channel;
    # int4: a scale and a zero point per 128 inputs) in BF16; MXFP4: a one-byte power-of-two scale per 32 inputs
    scales = {"int8": 128 * 2, "int4": 2 * 128 * 1 * 2, "mxfp4": 128 * 4}[bits]
    row = mine[mine["dims"] == (1, 64, 128, 128)].iloc[0]
    assert row["bytes"] == 64 * 128 * 2 + 128 * 128 * weight_bytes + scales + 64 * 128 * 2
    stored = [p for p in quant.params if p.dtype in ("int8", "uint8")]
    assert sum(p.numel * p.itemsize for p in stored) == _PROJECTION_WEIGHTS * weight_bytes
    assert any(f"weight-only {bits} quantization: 14 nn.Linear" in n for n in quant.notes)
    assert quant.n_params == plain.n_params                  # two 4-bit weights a byte are still two parameters
    # the scales are resident weight memory too, beside the stored weights
    from neusight.memory import estimate_memory

    delta = {"int8": 1.0, "int4": 0.5, "mxfp4": 0.5}[bits] - 2.0
    added = sum(m.itemsize * m.numel for m in quant.buffers) - sum(m.itemsize * m.numel for m in plain.buffers)
    # int8: 2 layers' 1,024 output channels, a BF16 scale each; int4: 4 bytes per 128 weights; MXFP4: 1 per 32
    assert added == {"int8": 2 * 1024 * 2, "int4": _PROJECTION_WEIGHTS * 4 / 128,
                     "mxfp4": _PROJECTION_WEIGHTS / 32}[bits]
    weights = {n: estimate_memory(g, "h100-sxm5-80gb").breakdown["weights"] for n, g in (("plain", plain),
                                                                                        ("quant", quant))}
    # (each of the 14 scale tensors rounded up to the caching allocator's 512-byte blocks)
    assert 0 <= weights["quant"] - weights["plain"] - (_PROJECTION_WEIGHTS * delta + added) < 14 * 512


def test_a_decode_step_reads_fewer_weight_bytes_and_is_bounded_lower():
    kw = dict(batch_size=1, seq_len=1, mode="inference", dtype="bfloat16", kv_cache=63, memory=False)
    roof = {bits: neusight.predict(_TINY_LLAMA, "h100-sxm5-80gb", weight_quant=bits, **kw).kernels
            for bits in (None, *WEIGHT_ONLY)}
    proj = {b: k.loc[(k["family"] == "linear") & (k["dims"].map(lambda d: d[1]) == 1), "roofline_ms"].sum()
            for b, k in roof.items()}
    assert proj["int4"] < proj["int8"] < proj[None]
    # MXFP4 stores as many bytes as int4 (4 bits a weight; a byte per 32 weights, two BF16 per 128): the same bound
    assert proj["mxfp4"] == pytest.approx(proj["int4"], rel=1e-9)
    # every quantized GEMM is bounded by the bytes it stores, not by its math's precision
    assert all(gemm_name(bits, grouped).startswith(EXACT_BYTES_GEMMS) for bits in WEIGHT_QUANT
               for grouped in (False, True))


def test_layers_whose_inputs_do_not_fill_int4_groups_stay_in_their_precision():
    odd = dict(_TINY_LLAMA, intermediate_size=192)     # down: 192 inputs, not a multiple of 128
    g = neusight.trace(odd, batch_size=1, seq_len=16, mode="inference", dtype="bfloat16", weight_quant="int4")
    assert (_gemms(g)["kernel"] == "int4_weight_gemm").sum() == 12
    assert any("2 layers whose input features are not a multiple of 128" in n for n in g.notes)


@pytest.mark.parametrize("model, kw, fragment", [
    (_TINY_LLAMA, dict(weight_quant="int3"), "weight_quant='int3' is not known"),
    (_TINY_LLAMA, dict(mode="training"), "mode='training'"),
    (_TINY_LLAMA, dict(fp8=True, device="h100-sxm5-80gb"), "with fp8=True is not modelled"),
    (_TINY_LLAMA, dict(weight_quant="nvfp4", device="h100-sxm5-80gb"), "has none (fp4_tensor_tflops is not in its"),
    ("gpt2", dict(), "GPT2LMHeadModel has none that qualify"),
])
def test_bad_weight_quant_runs_say_what_to_change(model, kw, fragment):
    kw = {"batch_size": 1, "seq_len": 16, "mode": "inference", "dtype": "bfloat16", "weight_quant": "int4", **kw}
    with pytest.raises(InputError, match=re.escape(fragment)):
        neusight.trace(model, **kw)


_TINY_MIXTRAL = dict(model_type="mixtral", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     vocab_size=512)


@pytest.mark.parametrize("moe_kernels", ["loop", "grouped"])
def test_routed_experts_are_stored_quantized_and_run_one_dequantizing_grouped_gemm(moe_kernels):
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16", moe_kernels=moe_kernels)
    plain = neusight.trace(_TINY_MIXTRAL, **kw)
    quant = neusight.trace(_TINY_MIXTRAL, weight_quant="int4", **kw)
    k = quant.kernels
    grouped = k[k["kernel"] == "int4_weight_grouped_gemm"]
    # per layer: gate-up (128 -> 2 x 256) and down (256 -> 128) over the 4 experts, 2 x 32 x top-2 / 4 = 32 rows each
    assert len(grouped) == 4 and set(grouped["family"]) == {"bmm"}
    assert set(grouped["dims"]) == {(4, 32, 128, 512), (4, 32, 256, 128)}
    gate_up = grouped[grouped["dims"] == (4, 32, 128, 512)].iloc[0]
    # BF16 rows in, the 4 experts' 4-bit weights with a scale and a zero point per 128 inputs, BF16 rows out
    assert gate_up["bytes"] == 128 * 128 * 2 + 4 * (512 * 128 / 2 + 2 * 512 * 1 * 2) + 128 * 512 * 2
    gemm = lambda g: g.kernels.loc[g.kernels["family"].isin(["linear", "bmm"]), "flops"].sum()  # noqa: E731
    assert gemm(quant) == pytest.approx(gemm(plain), rel=1e-12)
    experts = [p for n, p in zip(quant.param_names, quant.params) if ".experts." in n]
    assert {p.dtype for p in experts} == {"uint8"}
    assert sum(p.numel for p in experts) == 2 * 4 * (128 * 512 + 256 * 128) // 2
    assert any("routed experts of 2 layers are stored in int4" in n for n in quant.notes)


_TINY_GPT_OSS = dict(model_type="gpt_oss", hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                     num_experts_per_tok=2, vocab_size=512, sliding_window=16)


def test_mxfp4_stores_a_mixture_of_experts_routed_experts_alone_as_gpt_oss_ships_them():
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16", moe_kernels="grouped")
    plain = neusight.trace(_TINY_GPT_OSS, **kw)
    quant = neusight.trace(_TINY_GPT_OSS, weight_quant="mxfp4", **kw)
    k = quant.kernels
    grouped = k[k["kernel"] == "mxfp4_weight_grouped_gemm"]
    assert set(grouped["dims"]) == {(4, 32, 128, 256), (4, 32, 128, 128)} and len(grouped) == 4
    gate_up = grouped[grouped["dims"] == (4, 32, 128, 256)].iloc[0]
    # BF16 rows in, 4 experts' 4-bit weights with one scale byte per 32 inputs, BF16 rows out
    assert gate_up["bytes"] == 128 * 128 * 2 + 4 * (256 * 128 / 2 + 256 * 128 / 32) + 128 * 256 * 2
    # attention, router and head untouched: the same kernels as without quantization
    others = lambda g: sorted(g.kernels.loc[g.kernels["family"] == "linear", "dims"])  # noqa: E731
    assert others(quant) == others(plain) and not k["kernel"].str.contains("mxfp4_weight_gemm").any()
    stored = {n: p for n, p in zip(quant.param_names, quant.params) if p.dtype == "uint8"}
    assert stored and all(".experts." in n for n in stored)
    assert quant.n_params == plain.n_params
    # every weight and scale resident (up to the caching allocator's 512-byte blocks)
    from neusight.memory import estimate_memory

    resident = sum(t.numel * t.itemsize for t in [*quant.params, *quant.buffers])
    weights = estimate_memory(quant, "h100-sxm5-80gb").breakdown["weights"]
    assert 0 <= weights - resident < 512 * (len(quant.params) + len(quant.buffers))
    assert sum(t.numel * t.itemsize for t in quant.buffers if t.dtype == "uint8") == 2 * 4 * (256 + 128) * 128 / 32
    note = next(n for n in quant.notes if n.startswith("weight-only mxfp4"))
    assert "routed experts of 2 layers" in note and "attention, the router, the embeddings and the LM head" in note


def test_mxfp4_needs_inputs_in_groups_of_32():
    odd = dict(_TINY_GPT_OSS, hidden_size=120, head_dim=30)                    # experts' inputs: 120 and 120
    with pytest.raises(InputError, match="multiples of 32"):
        neusight.trace(odd, batch_size=1, seq_len=8, mode="inference", dtype="bfloat16", weight_quant="mxfp4")


_TINY_LLAMA4 = dict(model_type="llama4_text", hidden_size=128, intermediate_size=128, intermediate_size_mlp=256,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=1, vocab_size=512)


def test_llama4s_dense_experts_are_not_quantized_and_routed_ones_are():
    """Llama 4's experts as transformers runs them (every expert on every token) have no quantized kernel: int4
    keeps them in the model's precision and says so, MXFP4 (experts only) refuses; routed, they are quantized."""
    kw = dict(batch_size=2, seq_len=16, mode="inference", dtype="bfloat16")
    dense = neusight.trace(_TINY_LLAMA4, weight_quant="int4", **kw)
    assert {p.dtype for n, p in zip(dense.param_names, dense.params) if ".experts." in n} == {"bfloat16"}
    note = next(n for n in dense.notes if n.startswith("weight-only int4"))
    assert "the experts of 2 layers, run as transformers runs them" in note and "moe_kernels='grouped'" in note
    with pytest.raises(InputError, match=re.escape("Fix: moe_kernels='grouped'")):
        neusight.trace(_TINY_LLAMA4, weight_quant="mxfp4", **kw)
    routed = neusight.trace(_TINY_LLAMA4, weight_quant="mxfp4", moe_kernels="grouped", **kw)
    assert {p.dtype for n, p in zip(routed.param_names, routed.params) if ".experts." in n} == {"uint8"}
    assert (routed.kernels["kernel"] == "mxfp4_weight_grouped_gemm").sum() == 4


def test_nvfp4_quantizes_each_projections_input_once_and_runs_an_fp4_gemm():
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16")
    plain = neusight.trace(_TINY_LLAMA, **kw)
    g = neusight.trace(_TINY_LLAMA, weight_quant="nvfp4", device="b200", **kw)
    k = g.kernels
    gemms = k[k["kernel"] == "nvfp4_gemm"]
    assert len(gemms) == 14 and set(gemms["dtype"]) == {FP4}
    assert gemms["flops"].sum() == _gemms(plain)["flops"].sum() - _gemms(plain)["flops"].max()   # all but the head
    # q, k and v share their input's quantization, gate and up theirs: 4 a layer (q/k/v, o, gate/up, down)
    quant = k[k["kernel"] == "nvfp4_quantize"]
    assert len(quant) == 4 * 2 and set(quant["family"]) == {"elementwise"}
    # q_proj at 64 tokens: the input's FP4 values and E4M3 scales (one per 16), the weight's, the BF16 output
    row = gemms[gemms["dims"] == (1, 64, 128, 128)].iloc[0]
    assert row["bytes"] == 64 * 128 * (0.5 + 1 / 16) + 128 * 128 * (0.5 + 1 / 16) + 64 * 128 * 2
    assert quant[quant["dims"] == (64, 128)]["bytes"].iloc[0] == 64 * 128 * (2 + 0.5 + 1 / 16)
    assert any(n.startswith("NVFP4 quantization (W4A4") and "14 nn.Linear" in n for n in g.notes)
    # the graph traced without a GPU is refused where no FP4 tensor core runs it
    bare = neusight.trace(_TINY_LLAMA, weight_quant="nvfp4", **kw)
    from neusight.api import predict_graph

    with pytest.raises(InputError, match="fp4_tensor_tflops"):
        predict_graph(bare, load_device("h100-sxm5-80gb"))
    assert predict_graph(bare, load_device("b200")).latency_ms > 0


def test_nvfp4_gemms_are_bounded_by_the_fp4_tensor_peak_and_their_quantization_fuses_under_compile():
    cfg = dict(_TINY_LLAMA, hidden_size=4096, intermediate_size=4096 * 2, num_attention_heads=32,
               num_key_value_heads=32, num_hidden_layers=1)
    kw = dict(batch_size=2, seq_len=2048, mode="inference", dtype="bfloat16", memory=False)
    plain = neusight.predict(cfg, "b200", **kw).kernels
    fp4 = neusight.predict(cfg, "b200", weight_quant="nvfp4", **kw).kernels
    square = (1, 4096, 4096, 4096)
    bf16_roof = plain.loc[(plain["dims"] == square) & (plain["family"] == "linear"), "roofline_ms"].iloc[0]
    fp4_roof = fp4.loc[(fp4["dims"] == square) & (fp4["kernel"] == "nvfp4_gemm"), "roofline_ms"].iloc[0]
    b200 = load_device("b200")
    assert fp4_roof == pytest.approx(bf16_roof * b200.bf16_tensor_tflops / b200.fp4_tensor_tflops, rel=0.02)
    assert fp4_roof >= 2 * 4096**3 / (b200.fp4_tensor_tflops * 1e12) * 1e3
    # under torch.compile the input norms' kernels quantize their outputs (q/k/v's, gate/up's) in place of their own
    fused = neusight.predict(cfg, "b200", weight_quant="nvfp4", fused=True, **kw).kernels
    alone = lambda t: (t["kernel"] == "nvfp4_quantize").sum()    # noqa: E731
    assert alone(fp4) == 4 and alone(fused) < 4
    assert fused["aten_op"].str.contains("rsqrt").mul(fused["aten_op"].str.contains("nvfp4_quantize")).sum() == 2


def test_nvfp4_routed_experts_run_one_fp4_grouped_gemm_on_their_quantized_tokens():
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16", moe_kernels="grouped")
    g = neusight.trace(_TINY_MIXTRAL, weight_quant="nvfp4", device="b200", **kw)
    k = g.kernels
    grouped = k[k["kernel"] == "nvfp4_grouped_gemm"]
    assert len(grouped) == 4 and set(grouped["dtype"]) == {FP4}
    gate_up = grouped[grouped["dims"] == (4, 32, 128, 512)].iloc[0]
    # the 128 routed rows in FP4 with their scales, the 4 experts' FP4 weights with theirs, BF16 rows out
    assert gate_up["bytes"] == 128 * 128 * (0.5 + 1 / 16) + 4 * 512 * 128 * (0.5 + 1 / 16) + 128 * 512 * 2
    # per layer: q/k/v's input, o's, the experts' gate-up rows and their down rows, each quantized once
    assert (k["kernel"] == "nvfp4_quantize").sum() == 4 * 2
    assert any("routed experts of 2 layers are stored in nvfp4 too, each projection one FP4 grouped GEMM" in n
               for n in g.notes)

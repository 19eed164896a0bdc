"""Generation forecasts (neusight.predict_generation): prefill, then decode steps over a growing KV cache."""

from __future__ import annotations

import re

import numpy as np
import pytest

import neusight
from neusight.errors import InputError


@pytest.fixture(scope="module")
def gen():
    return neusight.predict_generation("gpt2", "a100-80gb-pcie", batch_size=2, prompt_len=100, new_tokens=41)


def test_prefill_is_the_prompt_forward_and_steps_span_the_run(gen):
    """The prefill is the prompt's forward with the head on its last token (generate() asks for those logits
    only), so it is faster than a plain forward that computes every position's."""
    prompt = neusight.predict("gpt2", "a100-80gb-pcie", batch_size=2, seq_len=100, mode="inference", memory=False,
                              logits_to_keep=1)
    assert gen.prefill_ms == prompt.latency_ms
    every = neusight.predict("gpt2", "a100-80gb-pcie", batch_size=2, seq_len=100, mode="inference", memory=False)
    assert gen.prefill_ms < every.latency_ms
    # step i feeds token i with 100 + i - 1 cached tokens, i = 1 .. 40: sampled at the first, middle and last
    assert [c for c, _ in gen.steps] == [100, 120, 139]
    step = neusight.predict("gpt2", "a100-80gb-pcie", batch_size=2, seq_len=1, mode="inference", kv_cache=120,
                            memory=False)
    assert dict(gen.steps)[120] == step.latency_ms


def test_totals_integrate_the_steps(gen):
    xs, ys = zip(*gen.steps)
    assert gen.decode_ms == pytest.approx(np.interp(np.arange(100, 140), xs, ys).sum(), rel=1e-12)
    assert gen.total_ms == gen.prefill_ms + gen.decode_ms
    assert gen.time_per_output_token_ms == pytest.approx(gen.decode_ms / 40)
    assert gen.tokens_per_s == pytest.approx(2 * 41 / (gen.total_ms / 1e3))
    assert gen.steps[0][1] <= gen.steps[-1][1]            # a longer context never costs less
    one = neusight.predict_generation("gpt2", "a100-80gb-pcie", batch_size=2, prompt_len=100, new_tokens=1)
    assert one.decode_ms == 0 and one.steps == [] and one.total_ms == gen.prefill_ms


def test_a_static_cache_changes_the_decode_steps_only(gen):
    static = neusight.predict_generation("gpt2", "a100-80gb-pcie", batch_size=2, prompt_len=100, new_tokens=41,
                                         static_cache=True)
    assert static.prefill_ms == gen.prefill_ms             # the prompt fills an empty cache either way
    step = neusight.predict("gpt2", "a100-80gb-pcie", batch_size=2, seq_len=1, mode="inference", kv_cache=120,
                            memory=False, static_cache=True)
    assert dict(static.steps)[120] == step.latency_ms <= dict(gen.steps)[120]   # small copies: both at the floor


@pytest.mark.parametrize("kw, fragment", [
    (dict(new_tokens=0), "new_tokens=0"),
    (dict(prompt_len=1000, new_tokens=100), "prompt_len=1000 + new_tokens=100"),
    (dict(prompt_len=2000), "prompt_len=2000: seq_len=2000 exceeds"),   # the prompt alone is too long
    (dict(mode="training"), "sets mode, seq_len and kv_cache itself"),
    (dict(tp=0), "tp=0"),
    (dict(tp=5), "tp=5 does not divide the 12 attention heads"),
])
def test_bad_generation_requests_are_refused(kw, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        neusight.predict_generation("gpt2", "t4", **{"prompt_len": 16, "new_tokens": 4, **kw})


def test_tensor_parallel_generation_is_the_parallel_forecast_of_its_steps():
    """tp=2: prefill and every sampled decode step are neusight.parallel's forecasts of the sharded model (each GPU's
    share of the layers and of the cache, plus the all-reduces), and the summary says on how many GPUs."""
    from neusight.parallel import predict_parallel

    f = neusight.predict_generation("gpt2", "h100-sxm5-80gb", batch_size=2, prompt_len=64, new_tokens=9, tp=2)
    prefill = predict_parallel("gpt2", "h100-sxm5-80gb", 2, 64, "inference", tp=2, memory=False, logits_to_keep=1)
    assert f.prefill_ms == prefill.latency_ms
    step = predict_parallel("gpt2", "h100-sxm5-80gb", 2, 1, "inference", tp=2, memory=False, kv_cache=68)
    assert dict(f.steps)[68] == step.latency_ms and step.parts["tp_comm"] > 0
    assert f.tp == 2 and "2 x NVIDIA H100" in f.summary()


def test_generation_says_whether_its_longest_cache_fits(gen):
    """The memory of a generate() call is the higher of its prefill's and its last step's (the longest cache),
    each as forecast for that pass alone."""
    last = neusight.predict("gpt2", "a100-80gb-pcie", batch_size=2, seq_len=1, mode="inference", kv_cache=139)
    prompt = neusight.predict("gpt2", "a100-80gb-pcie", batch_size=2, seq_len=100, mode="inference", logits_to_keep=1)
    assert last.memory.peak_bytes > prompt.memory.peak_bytes       # 40 more tokens cached, no prompt activations
    assert gen.memory_peak_bytes == last.memory.peak_bytes and gen.memory_fits is True
    assert gen.memory_peak_in == "decode"
    assert "memory on the GPU at the longest context (140 tokens)" in gen.summary()
    # GPT-2 Large (3 GB of FP32 weights) with 32 caches of 527 tokens (6 GB) on an 8 GB P4
    big = neusight.predict_generation("gpt2-large", "p4", batch_size=32, prompt_len=512, new_tokens=16)
    assert big.memory_fits is False and "does NOT fit" in big.summary()
    one = neusight.predict_generation("gpt2", "a100-80gb-pcie", batch_size=2, prompt_len=100, new_tokens=1)
    assert one.memory_peak_bytes == prompt.memory.peak_bytes and "no decode step" in one.summary()
    assert "in the prompt's forward (100 tokens)" in one.summary()


def test_a_long_prompt_under_eager_attention_peaks_in_its_prefill():
    """Eager attention holds a batch x heads x prompt^2 score matrix in the prefill, more than a few decode steps
    add to the cache: the run's memory is the prefill's."""
    f = neusight.predict_generation("gpt2", "t4", batch_size=8, prompt_len=1000, new_tokens=4)
    prompt = neusight.predict("gpt2", "t4", batch_size=8, seq_len=1000, mode="inference", logits_to_keep=1)
    last = neusight.predict("gpt2", "t4", batch_size=8, seq_len=1, mode="inference", kv_cache=1002)
    assert prompt.memory.peak_bytes > last.memory.peak_bytes
    assert f.memory_peak_bytes == prompt.memory.peak_bytes and f.memory_peak_in == "prefill"
    assert "in the prompt's forward (1000 tokens)" in f.summary()


def test_a_static_cache_is_held_whole_from_the_prefill_on():
    """generate() sizes a static cache for the whole run before the prefill: the prefill's peak counts the cache's
    growth over the run (the last step's memory minus the first's) on top of its own."""
    kw = dict(batch_size=8, dtype="bfloat16", attn_implementation="sdpa")
    f = neusight.predict_generation("llama-3.2-1b", "l4", prompt_len=2048, new_tokens=2000, static_cache=True, **kw)
    prompt = neusight.predict("llama-3.2-1b", "l4", seq_len=2048, mode="inference", logits_to_keep=1, **kw)
    steps = [neusight.predict("llama-3.2-1b", "l4", seq_len=1, mode="inference", kv_cache=c, static_cache=True, **kw)
             for c in (2048, 4046)]
    growth = steps[1].memory.peak_bytes - steps[0].memory.peak_bytes
    assert growth > 0
    assert f.memory_peak_bytes == max(prompt.memory.peak_bytes + growth, steps[1].memory.peak_bytes)


def test_generation_on_several_gpus_equals_one_gpu_at_a_time():
    from neusight.generation import generation_ranking_table, predict_generation_many

    kw = dict(batch_size=2, prompt_len=48, new_tokens=12, dtype="bfloat16", attn_implementation="sdpa")
    many = predict_generation_many("llama-3.2-1b", ["t4", "h100-sxm5-80gb", "mi210"], **kw)
    for f in many:
        one = neusight.predict_generation("llama-3.2-1b", f.device.key, **kw)
        assert (f.prefill_ms, f.decode_ms, f.steps, f.memory_peak_bytes) == (one.prefill_ms, one.decode_ms, one.steps,
                                                                             one.memory_peak_bytes)
        assert f.notes == one.notes
    t = generation_ranking_table(many)
    assert list(t["GPU"]) == sorted((f.device.key for f in many), key=lambda k: next(
        f.total_ms for f in many if f.device.key == k))
    assert t["time vs fastest"].iloc[0] == 1.0 and list(t["rank"]) == [1, 2, 3]


def test_generation_on_several_gpus_leaves_out_those_that_cannot_run_it():
    from neusight.generation import predict_generation_many

    left: dict[str, str] = {}
    fs = predict_generation_many("llama-3.2-1b", ["t4", "l4"], batch_size=1, prompt_len=32, new_tokens=4,
                                 dtype="bfloat16", fp8=True, left_out=left)
    assert [f.device.key for f in fs] == ["l4"] and list(left) == ["t4"]
    with pytest.raises(InputError, match="prompt_len=5000"):   # beyond the positions on every GPU: the error
        predict_generation_many("gpt2", ["t4", "l4"], prompt_len=5000, new_tokens=4, left_out={})


# ---------------------------------------------------------------------------------------------------------
# an FP8 KV cache (kv_cache_dtype=)

_GQA = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, vocab_size=512)


def test_an_fp8_kv_cache_halves_the_caches_bytes_in_memory_and_in_attention():
    run = dict(batch_size=4, seq_len=1, kv_cache=255, mode="inference", dtype="bfloat16", attn_implementation="sdpa",
               static_cache=True)
    bf16, fp8 = (neusight.predict(_GQA, "h100-sxm5-80gb", kv_cache_dtype=d, **run) for d in (None, "fp8"))
    attention = lambda p: p.kernels[p.kernels["kernel"] == "attention"]  # noqa: E731
    a, b = attention(bf16), attention(fp8)
    cache = 4 * 2 * 256 * 32          # one layer's keys (batch x kv heads x 256 positions x head dim); values alike
    assert len(a) == len(b) == 2 and list(b["flops"]) == list(a["flops"])
    assert list(a["bytes"] - b["bytes"]) == [2 * cache * (2 - 1)] * 2          # keys and values at 1 byte, not 2
    assert (b["latency_ms"] <= a["latency_ms"]).all()
    assert set(fp8.kernels["aten_op"]) - set(bf16.kernels["aten_op"]) == {"neusight.fused.attention_fp8_kv"}
    # the cache buffers (room for the new token: 256 positions) at one byte: 2 layers' keys and values
    act = lambda p: p.memory.breakdown["activations"]  # noqa: E731
    assert act(bf16) - act(fp8) == 2 * 2 * cache * (2 - 1)
    assert any(n.startswith("KV cache in FP8 E4M3: the keys and values of 2 attention layers") for n in fp8.notes)
    gen_run = dict(batch_size=4, prompt_len=64, new_tokens=8, dtype="bfloat16", attn_implementation="sdpa",
                   static_cache=True)
    gen = neusight.predict_generation(_GQA, "h100-sxm5-80gb", kv_cache_dtype="fp8", **gen_run)
    plain = neusight.predict_generation(_GQA, "h100-sxm5-80gb", **gen_run)
    assert gen.prefill_ms == plain.prefill_ms and gen.decode_ms <= plain.decode_ms
    assert gen.memory_peak_bytes <= plain.memory_peak_bytes and any("KV cache in FP8" in n for n in gen.notes)


@pytest.mark.parametrize("kw, fragment", [
    (dict(kv_cache_dtype="fp16"), "kv_cache_dtype='fp16' is not known"),
    (dict(kv_cache_dtype="fp8", static_cache=False), "this run has transformers' dynamic cache"),
    (dict(kv_cache_dtype="fp8", attn_implementation="eager"), "attn_implementation='eager' computes attention"),
    (dict(kv_cache_dtype="fp8", device="v100-sxm2-32gb", dtype="float16"), "PyTorch's math backend"),
])
def test_an_fp8_kv_cache_is_refused_where_it_is_not_modelled(kw, fragment):
    run = dict(batch_size=2, seq_len=1, kv_cache=31, mode="inference", dtype="bfloat16", attn_implementation="sdpa",
               static_cache=True, device="h100-sxm5-80gb")
    with pytest.raises(InputError, match=re.escape(fragment)):
        neusight.trace(_GQA, **{**run, **kw})


def test_an_fp8_kv_cache_is_refused_for_latent_attention():
    """DeepSeek's latent attention projects its cached latent up before attending: not an FP8-cache attention."""
    mla = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=1, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               n_routed_experts=4, num_experts_per_tok=2, vocab_size=512)
    with pytest.raises(InputError, match="does not read its cached keys and values as they are"):
        neusight.trace(mla, batch_size=2, seq_len=1, kv_cache=31, dtype="bfloat16", attn_implementation="sdpa",
                       static_cache=True, kv_cache_dtype="fp8", device="h100-sxm5-80gb")


def test_sliding_window_layers_cache_only_their_window():
    """Gemma 3 attends over a window of 16 tokens in five of six layers (sliding_window=16): transformers keeps the
    last 15 of their keys and values, the sixth (global) layer all of them; eager concatenation and in-place writes
    (static_cache) alike."""
    cfg = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=16)
    for static in (False, True):
        g = neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=63, dtype="bfloat16", attn_implementation="sdpa",
                           static_cache=static)
        k = g.kernels[g.kernels["kernel"] == "attention"]
        keys = {int(re.search(r"layers\.(\d+)\.", m).group(1)): d[-1] for m, d in zip(k["module"], k["dims"])}
        assert keys == {0: 16, 1: 16, 2: 16, 3: 16, 4: 16, 5: 64}, (static, keys)
        cached = sorted({t.shape[2] for t in g.held if len(t.shape) == 4 and t.shape[1] == 2})
        # held after the step: the window's last 15 (a buffer with room for the new token: 16) and all 64
        assert cached == ([15 + 1, 63 + 1] if static else [15, 63 + 1]), (static, cached)

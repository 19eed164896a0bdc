"""Continuous batching (neusight.engine.predict_continuous and serving_capacity(batching="continuous")): a serving
engine's steady state composed from decode-step forecasts."""

from __future__ import annotations

import json
import math
import re

import pytest

import neusight
from neusight.devices import load_device, modify_device
from neusight.engine import attention_core, predict_continuous
from neusight.errors import InputError
from neusight.serving import plan_serving, serving_capacity

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 512}
RUN = dict(prompt_len=64, new_tokens=16)
ENGINE = dict(fused=True, attn_implementation="sdpa", memory=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny-llama.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_the_decode_part_of_a_step_is_the_decode_step_at_the_mean_context(tiny):
    """A step = its decode tokens (one decode step of the running sequences at their mean context, as forecast by
    neusight.predict) + what its prompt tokens add; the throughputs follow from the step."""
    f = predict_continuous(tiny, "a100-80gb-pcie", 8, **RUN)
    mean_ctx = RUN["prompt_len"] + (RUN["new_tokens"] - 2) // 2
    step = neusight.predict(tiny, "a100-80gb-pcie", 8, 1, kv_cache=mean_ctx, static_cache=True, **ENGINE)
    assert f.decode_ms == pytest.approx(step.latency_ms, rel=1e-12)
    assert f.step_ms == pytest.approx(f.decode_ms + f.prompt_ms) and f.prompt_ms > 0
    assert f.prefill_tokens == math.ceil(8 * 64 / 15) and f.step_tokens == 8 + f.prefill_tokens
    assert f.tokens_per_s == pytest.approx(8 * 16 / 15 / (f.step_ms / 1e3))
    assert f.requests_per_s == pytest.approx(f.tokens_per_s / 16)
    assert f.time_per_output_token_ms == f.step_ms and f.time_to_first_token_ms == f.ttft_ms
    assert f.ttft_ms >= f.decode_ms and f.chunks == 1


def test_the_prompt_tokens_add_their_gemms_and_their_attention(tiny):
    """What the prompt tokens add lies between nothing and a whole step of as many more sequences (attention at a
    one-token context) plus their prompts' attention; it is not the decode step's."""
    f = predict_continuous(tiny, "l4", 16, **RUN)
    more = neusight.predict(tiny, "l4", 16 + f.prefill_tokens, 1, kv_cache=1, static_cache=True, **ENGINE)
    prompt = neusight.predict(tiny, "l4", 1, RUN["prompt_len"], **ENGINE)
    k = prompt.kernels
    attn = float(k.loc[attention_core(k), "latency_ms"].sum())
    assert 0 < attn < prompt.latency_ms
    assert 0 < f.prompt_ms <= more.latency_ms + 16 / 15 * attn


@pytest.mark.parametrize("impl, fused", [("sdpa", True), ("eager", False), ("eager", True), ("sdpa", False)])
def test_attention_is_found_on_every_path(tiny, impl, fused):
    """The attention core is told apart whether it runs fused (SDPA's kernels, compiled) or as batched matmuls and
    softmaxes (eager), and it is what grows with the context."""
    short = neusight.predict(tiny, "t4", 64, 1, kv_cache=16, static_cache=True, fused=fused,
                             attn_implementation=impl, memory=False, dtype="float16").kernels
    long = neusight.predict(tiny, "t4", 64, 1, kv_cache=480, static_cache=True, fused=fused,
                            attn_implementation=impl, memory=False, dtype="float16").kernels
    a, b = attention_core(short), attention_core(long)
    assert a.any() and (a.to_numpy() == b.to_numpy()).all()
    assert not (short.loc[a, "family"] == "linear").any()
    assert long.loc[b, "latency_ms"].sum() > short.loc[a, "latency_ms"].sum()


def test_more_sequences_take_longer_steps_and_more_memory(tiny):
    """The laws of DESIGN.md at engine level: more sequences at once -> a step no shorter, more memory, more
    tokens per second overall (each sequence waits longer)."""
    fs = [predict_continuous(tiny, "t4", b, **RUN) for b in (1, 4, 16, 64)]
    for a, b in zip(fs, fs[1:]):
        assert b.step_ms >= a.step_ms and b.ttft_ms >= a.ttft_ms
        assert b.memory_peak_bytes >= a.memory_peak_bytes and b.tokens_per_s > a.tokens_per_s
    assert fs[-1].memory_peak_bytes > fs[0].memory_peak_bytes and fs[-1].step_ms > fs[0].step_ms
    assert all(math.isfinite(f.step_ms) and f.memory_fits for f in fs)


def test_longer_answers_bring_fewer_prompt_tokens_a_step(tiny):
    """With more new tokens per prompt, fewer prompts are admitted a step: fewer prompt tokens, less added."""
    short, long = (predict_continuous(tiny, "t4", 32, prompt_len=256, new_tokens=n) for n in (8, 128))
    assert long.prefill_tokens < short.prefill_tokens and long.prompt_ms < short.prompt_ms


def test_a_small_token_budget_splits_the_prompt_into_chunks(tiny):
    """A prompt longer than the budget's room beside the decode tokens is prefilled in chunks, one step each."""
    whole = predict_continuous(tiny, "t4", 2, **RUN)
    split = predict_continuous(tiny, "t4", 2, **RUN, max_num_batched_tokens=2 + 20)
    assert (whole.chunks, split.chunks, split.chunk_tokens) == (1, 4, 20)
    assert split.ttft_ms > whole.ttft_ms
    assert split.step_ms == pytest.approx(whole.step_ms)     # the mean step is the same work
    assert "max_num_batched_tokens=22" in split.summary()


def test_more_sequences_than_the_token_budget_keeps_running_are_refused_with_the_most_it_does(tiny):
    """With 64 prompt tokens and 15 decode steps a sequence, b sequences need b + 64 b / 15 tokens a step; the
    refusal names the largest b within the budget, which runs; a budget too small for one names the least."""
    with pytest.raises(InputError, match=r"Fix: batch_size <= (\d+)") as e:
        predict_continuous(tiny, "t4", 40, **RUN, max_num_batched_tokens=100)
    most = int(re.search(r"batch_size <= (\d+)", str(e.value)).group(1))
    assert most + math.ceil(most * 64 / 15) <= 100 < most + 1 + math.ceil((most + 1) * 64 / 15)
    assert predict_continuous(tiny, "t4", most, **RUN, max_num_batched_tokens=100).step_tokens <= 100
    with pytest.raises(InputError, match=r"Fix: max_num_batched_tokens >= 6"):
        predict_continuous(tiny, "t4", 1, **RUN, max_num_batched_tokens=5)


def test_the_engine_notes_say_the_steady_state_and_drop_the_launch_warning(tiny):
    f = predict_continuous(tiny, "t4", 8, **RUN)
    assert f.notes[0].startswith("continuous batching, steady state: 8 sequences decoding")
    assert not any("kernel launches averaging" in n or n.startswith("generation with a KV cache") for n in f.notes)
    hosted = predict_continuous(tiny, "t4", 8, **RUN, host_us=20.0)
    assert hosted.step_ms > f.step_ms


def test_tensor_parallel_engines_hold_less_per_gpu(tiny):
    one = predict_continuous(tiny, "h100-sxm5-80gb", 16, **RUN, dtype="bfloat16")
    two = predict_continuous(tiny, "h100-sxm5-80gb", 16, **RUN, dtype="bfloat16", tp=2)
    assert two.tp == 2 and two.memory_peak_bytes < one.memory_peak_bytes
    assert "2 x NVIDIA H100" in two.summary()


def test_an_fp8_cache_holds_less(tiny):
    bf16 = predict_continuous(tiny, "h100-sxm5-80gb", 64, **RUN, dtype="bfloat16")
    fp8 = predict_continuous(tiny, "h100-sxm5-80gb", 64, **RUN, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fp8.memory_peak_bytes < bf16.memory_peak_bytes


@pytest.mark.parametrize("kw, fragment", [
    (dict(new_tokens=1), "new_tokens=1"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(batch_size=64, max_num_batched_tokens=64), "max_num_batched_tokens=64"),
    (dict(max_num_batched_tokens=1), "max_num_batched_tokens=1"),
    (dict(static_cache=True), "static_cache=True"),
    (dict(kv_cache=10), "kv_cache=10"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype='fp4'"),
    (dict(prompt_len=500), "prompt_len=500 + new_tokens=16"),
])
def test_bad_engine_runs_are_refused(tiny, kw, fragment):
    args = {"batch_size": 8, **RUN, **kw}
    with pytest.raises(InputError, match="Fix:") as e:
        predict_continuous(tiny, "t4", **args)
    assert fragment in str(e.value)


def test_a_model_without_attention_is_refused(tmp_path):
    path = tmp_path / "mamba.json"
    path.write_text(json.dumps({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 512}))
    with pytest.raises(InputError, match="no attention kernel"):
        predict_continuous(str(path), "t4", 4, **RUN, attn_implementation="eager")


@pytest.mark.parametrize("target, limit", [(dict(max_tpot_ms=0.5), "time per output token"),
                                           (dict(max_num_batched_tokens=512), "token budget"),
                                           (dict(), "memory")])
def test_the_continuous_capacity_meets_every_target_and_one_more_sequence_misses_one(tiny, target, limit):
    device = modify_device("t4", memory_gib=0.5) if limit == "memory" else load_device("t4")
    cap = serving_capacity(tiny, device, **RUN, batching="continuous", max_batch=1024, **target)
    assert cap.batch_size > 1 and cap.limited_by == limit and cap.batching == "continuous"
    budget = target.get("max_num_batched_tokens", 8192)
    at = predict_continuous(tiny, device, cap.batch_size, **RUN, max_num_batched_tokens=budget)
    assert (cap.forecast.step_ms, cap.forecast.memory_peak_bytes) == (at.step_ms, at.memory_peak_bytes)
    assert at.memory_fits and at.step_tokens <= budget
    more = cap.batch_size + 1
    if limit == "token budget":
        assert more + math.ceil(more * 64 / 15) > budget and cap.over is None
    else:
        over = predict_continuous(tiny, device, more, **RUN)
        assert (over.step_ms > 0.5) if limit == "time per output token" else not over.memory_fits
    assert "continuous batching (steady state" in cap.summary() and "engine forecasts" in cap.summary()
    assert f"limited by {limit}" in cap.summary()


@pytest.mark.parametrize("kw, fragment", [(dict(batching="paged"), "batching='paged'"),
                                          (dict(max_num_batched_tokens=4096), "batching='continuous'")])
def test_bad_batching_is_refused(tiny, kw, fragment):
    with pytest.raises(InputError, match="Fix:") as e:
        serving_capacity(tiny, "t4", **RUN, **kw)
    assert fragment in str(e.value)


def test_a_continuous_serving_plan_searches_each_layouts_engine(tiny):
    plan = plan_serving(tiny, "t4", 2, **RUN, max_tpot_ms=0.5, batching="continuous", max_batch=256)
    assert plan.batching == "continuous" and "batching continuously" in plan.summary()
    cap = serving_capacity(tiny, "t4", **RUN, max_tpot_ms=0.5, batching="continuous", max_batch=256)
    row = plan.table.set_index("layout").loc["dp 2 x tp 1"]
    assert row["sequences per replica"] == cap.batch_size
    assert row["generated tokens/s"] == pytest.approx(2 * cap.tokens_per_s)


def test_the_engine_ranking_puts_the_shortest_step_first(tiny):
    """device=all's table of engine forecasts: the shortest step (at one concurrency, the most tokens/s) first."""
    from neusight.engine import continuous_ranking_table

    fs = [predict_continuous(tiny, d, 32, **RUN, dtype="float16") for d in ("t4", "h100-sxm5-80gb", "l4")]
    t = continuous_ranking_table(fs, [None, {"usd": 1.0, "per": "1M generated tokens"}, None])
    assert list(t["per output token ms"]) == sorted(f.step_ms for f in fs)
    assert list(t["generated tokens/s"]) == sorted((f.tokens_per_s for f in fs), reverse=True)
    assert list(t["rank"]) == [1, 2, 3] and set(t["fits"]) == {"yes"}
    assert "USD per 1M generated tokens" in t.columns


@pytest.mark.parametrize("prompt_len, new_tokens, budget", [(64, 16, 100), (1024, 256, 8192), (7, 2, 2), (1, 1000, 50)])
def test_the_budget_keeps_the_most_sequences_whose_step_fits(prompt_len, new_tokens, budget):
    from neusight.engine import budget_batches

    def tokens(b):
        return b + math.ceil(b * prompt_len / (new_tokens - 1))

    most = budget_batches(prompt_len, new_tokens, budget)
    assert tokens(most + 1) > budget and (most == 0 or tokens(most) <= budget)


def test_the_serving_curve_doubles_the_sequences_up_to_the_budget_and_stops_where_memory_ends(tiny, tmp_path):
    """Default sizes: 1, 2, 4, ... and the most the token budget keeps running; a GPU's curve ends at the first
    size that does not fit (kept, marked). Its rows are predict_continuous's forecasts; the chart is written."""
    from neusight.engine import serving_curve
    from neusight.plots import serving_curve_chart

    t = serving_curve(tiny, ["t4", modify_device("l4", memory_gib=0.45)], **RUN, max_num_batched_tokens=256)
    t4, small = t[t["GPU"] == "t4"], t[t["GPU"] != "t4"]
    assert list(t4["sequences"]) == [1, 2, 4, 8, 16, 32, 48] and set(t4["fits"]) == {"yes"}
    assert list(small["fits"])[-1] == "no" and set(list(small["fits"])[:-1]) == {"yes"} and len(small) < len(t4)
    f = predict_continuous(tiny, "t4", 8, **RUN, max_num_batched_tokens=256)
    row = t4.set_index("sequences").loc[8]
    assert (row["per output token ms"], row["generated tokens/s"]) == (f.step_ms, f.tokens_per_s)
    assert t.attrs["model"] == "tiny-llama"
    chosen = serving_curve(tiny, "t4", **RUN, batch_sizes=[8, 2, 8])
    assert list(chosen["sequences"]) == [2, 8]
    files = serving_curve_chart(t, tmp_path / "curve")
    assert [p.suffix for p in files] == [".png", ".svg"] and all(p.stat().st_size > 0 for p in files)
    with pytest.raises(InputError, match="batch_sizes=0"):
        serving_curve(tiny, "t4", **RUN, batch_sizes=[0, 4])
    with pytest.raises(InputError, match="lacks the columns GPU"):
        serving_curve_chart(t.drop(columns="GPU"), tmp_path / "bad")

"""Serving capacity (neusight.serving_capacity): the largest batch whose generate() fits and meets latency targets."""

from __future__ import annotations

import json
import re

import pytest

import neusight
from neusight.devices import modify_device
from neusight.errors import InputError
from neusight.serving import serving_capacity

RUN = dict(prompt_len=64, new_tokens=8)
TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("serving") / "tiny-llama.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _meets(f, device, tpot=None, ttft=None) -> bool:
    return (f.memory_peak_bytes <= device.memory_bytes and (tpot is None or f.time_per_output_token_ms <= tpot)
            and (ttft is None or f.prefill_ms <= ttft))


@pytest.mark.parametrize("target, limit", [(dict(max_tpot_ms=6.0), "time per output token"),
                                           (dict(max_ttft_ms=20.0), "time to first token"),
                                           (dict(), "memory")])
def test_the_largest_batch_meets_every_target_and_one_more_sequence_misses_one(target, limit):
    """The answer is predict_generation's forecast at that batch, within every target; at one sequence more the
    forecast misses the target named as the limit (on a 1 GiB T4, GPT-2's memory binds first without targets)."""
    device = modify_device("t4", memory_gib=1)
    cap = serving_capacity("gpt2", device, **RUN, **target)
    assert cap.batch_size > 1 and cap.limited_by == limit
    at = neusight.predict_generation("gpt2", device, cap.batch_size, **RUN)
    more = neusight.predict_generation("gpt2", device, cap.batch_size + 1, **RUN)
    assert (cap.forecast.total_ms, cap.forecast.memory_peak_bytes) == (at.total_ms, at.memory_peak_bytes)
    assert (cap.over.total_ms, cap.over.memory_peak_bytes) == (more.total_ms, more.memory_peak_bytes)
    tpot, ttft = target.get("max_tpot_ms"), target.get("max_ttft_ms")
    assert _meets(at, device, tpot, ttft) and not _meets(more, device, tpot, ttft)
    missed = {"memory": more.memory_peak_bytes > device.memory_bytes,
              "time per output token": tpot is not None and more.time_per_output_token_ms > tpot,
              "time to first token": ttft is not None and more.prefill_ms > ttft}
    assert missed[limit]
    assert cap.tokens_per_s == at.tokens_per_s
    assert f"most concurrent sequences: {cap.batch_size} (limited by {limit}" in cap.summary()
    # what one more sequence needs is printed precisely enough to show it beyond the target
    need = float(re.search(r"need ([\d,.]+)", cap.summary()).group(1).replace(",", ""))
    assert need > {"memory": device.memory_gib, "time per output token": tpot, "time to first token": ttft}[limit]


def test_tighter_targets_never_serve_more_sequences(tiny):
    """A lower per-token target can only lower the largest batch (the forecasts grow with the batch)."""
    sizes = [serving_capacity(tiny, "t4", **RUN, max_tpot_ms=t).batch_size for t in (2.0, 1.5, 1.0)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] > 0


def test_the_search_cap_and_an_unmet_target_are_said():
    capped = serving_capacity("gpt2", "t4", **RUN, max_batch=20)
    assert (capped.batch_size, capped.limited_by, capped.over) == (20, "max_batch", None)
    assert "20 or more (the search's max_batch" in capped.summary()
    none = serving_capacity("gpt2", "t4", **RUN, max_tpot_ms=0.5)
    one = neusight.predict_generation("gpt2", "t4", 1, **RUN)
    assert (none.batch_size, none.forecast, none.tokens_per_s) == (0, None, 0.0)
    assert none.limited_by == "time per output token" and none.over.total_ms == one.total_ms
    assert f"no batch meets them: one sequence needs {one.time_per_output_token_ms:,.2f} ms" in none.summary()


GPUS = ("t4", "l4", "a100-80gb-pcie")


@pytest.fixture(scope="module")
def together(tiny):
    """The tiny model's searches on three GPUs sharing one cache, as the CLI runs them."""
    shared: dict = {}
    return [serving_capacity(tiny, d, **RUN, max_tpot_ms=1.0, cache=shared) for d in GPUS]


def test_searches_sharing_a_cache_find_what_each_finds_alone(tiny, together):
    """Several GPUs' searches share the traces of the batches they both probe; the answers are each GPU's own."""
    alone = [serving_capacity(tiny, d, **RUN, max_tpot_ms=1.0) for d in GPUS]
    assert len({c.batch_size for c in alone}) > 1       # different GPUs, different answers
    assert [(c.batch_size, c.limited_by, c.tokens_per_s) for c in together] == \
        [(c.batch_size, c.limited_by, c.tokens_per_s) for c in alone]


def test_tensor_parallel_serving_searches_tp_gpus():
    cap = serving_capacity("gpt2", "h100-sxm5-80gb", **RUN, tp=2, max_tpot_ms=3.0, max_batch=256)
    assert cap.tp == 2 and cap.forecast.tp == 2 and "2 x NVIDIA H100" in cap.summary()
    assert cap.forecast.time_per_output_token_ms <= 3.0 < cap.over.time_per_output_token_ms


@pytest.mark.parametrize("kw, fragment", [
    (dict(max_tpot_ms=0), "max_tpot_ms=0 is not a positive number of milliseconds"),
    (dict(max_tpot_ms=-5), "max_tpot_ms=-5 is not a positive number"),
    (dict(max_ttft_ms="fast"), "max_ttft_ms='fast' is not a positive number"),
    (dict(max_ttft_ms=float("nan")), "max_ttft_ms=nan is not a positive number"),
    (dict(max_tpot_ms=True), "max_tpot_ms=True is not a positive number"),
    (dict(max_tpot_ms=10, new_tokens=1), "new_tokens=1 has none"),
    (dict(batch_size=4), "batch_size=4 is what serving_capacity searches"),
    (dict(max_batch=0), "max_batch=0 is not a positive integer"),
    (dict(prompt_len=2000), "prompt_len=2000"),
    (dict(tp=5), "tp=5 does not divide"),
])
def test_bad_serving_requests_are_refused(kw, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        serving_capacity("gpt2", "t4", **{**RUN, **kw})


def test_the_serving_ranking_puts_the_most_tokens_per_second_first(tiny, together):
    """device=all's table: every GPU's largest batch, the most generated tokens/s first, a GPU that serves none
    (here a P4 asked for 0.5 ms per token) last with dashes, and the lines naming the best and the GPUs left empty."""
    from neusight.cli.predict import serving_ranking_text

    none = serving_capacity(tiny, "p4", **RUN, max_tpot_ms=0.5)
    assert none.batch_size == 0
    text = serving_ranking_text([none, *together], {"t4": 0.5, "l4": 0.8, "a100-80gb-pcie": 2.0, "p4": 0.3})
    rows = [ln.split() for ln in text.splitlines() if re.match(r"\s*\d+\s", ln)]
    best = sorted(together, key=lambda c: -c.tokens_per_s)
    assert [r[1] for r in rows] == [c.device.key for c in best] + ["p4"]
    assert [int(r[2].replace(",", "")) for r in rows] == [c.batch_size for c in best] + [0]
    assert rows[-1][-3:] == ["-", "-", "-"]     # no time, no memory, no cost without a batch
    assert f"most tokens/s: {best[0].device.key} ({best[0].tokens_per_s:,.0f} generated tokens/s" in text
    assert "no batch within the targets on 1 GPU: p4" in text
    assert "per output token <= 0.5 ms" in text          # the targets of the first search


def test_a_serving_plan_ranks_each_layouts_replicas_by_their_tokens_per_second(tiny):
    """plan_serving: every dp x tp layout of the GPUs, each replica at its own largest batch within the targets
    (serving_capacity with tp), dp replicas together; the most generated tokens/s first, a layout that serves
    nothing last, the cost of all the GPUs per 1M generated tokens."""
    from neusight.serving import plan_serving

    plan = plan_serving(tiny, "l4", gpus=2, **RUN, max_tpot_ms=1.0, usd_per_gpu_hour=2.0)
    t = plan.table
    assert sorted(t["layout"]) == ["dp 1 x tp 2", "dp 2 x tp 1"] and plan.skipped == {}
    for _, row in t.iterrows():
        cap = serving_capacity(tiny, "l4", **RUN, max_tpot_ms=1.0, tp=int(row["tp"]))
        assert row["sequences"] == row["dp"] * cap.batch_size == row["dp"] * row["sequences per replica"]
        assert row["generated tokens/s"] == pytest.approx(row["dp"] * cap.tokens_per_s)
        assert plan.capacities[row["layout"]].batch_size == cap.batch_size
    assert list(t["generated tokens/s"]) == sorted(t["generated tokens/s"], reverse=True)
    usd = t["USD per 1M generated tokens"] * t["generated tokens/s"]
    assert usd.iloc[0] == pytest.approx(2 * 2.0 / 3600 * 1e6)      # both GPUs' hours per 1M tokens at that rate
    best = plan.best
    assert best["layout"] == t.iloc[0]["layout"]
    assert f"best: {best['layout']}: {best['sequences']:,} sequences at once" in plan.summary()


@pytest.mark.parametrize("kw, fragment", [
    (dict(gpus=0), "gpus=0 is not a positive number of GPUs"),
    (dict(gpus=2, tp=2), "tp= is what plan_serving searches"),
    (dict(gpus=2, batch_size=8), "batch_size= is what plan_serving searches"),
    (dict(gpus=2, max_tpot_ms=-1), "max_tpot_ms=-1 is not a positive number"),
    (dict(gpus=2, usd_per_gpu_hour=-3), "usd_per_gpu_hour=-3"),
])
def test_bad_serving_plans_are_refused(kw, fragment):
    from neusight.serving import plan_serving

    with pytest.raises(InputError, match=re.escape(fragment)):
        plan_serving("gpt2", "t4", **{**RUN, **kw})

"""neusight.remedies: what makes a step that does not fit fit, each remedy re-forecast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import neusight
from neusight.devices import load_device
from neusight.remedies import ACCUMULATE, Remedy, _generation_rungs, _rungs, fit_remedies, least_peak_bytes

BIN = Path(sys.executable).parent


def _predict(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``neusight-predict args``, its outputs in ``run_dir``; it must succeed."""
    r = subprocess.run([str(BIN / "neusight-predict"), *args, f"hydra.run.dir={run_dir}"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r


def test_the_ladder_skips_what_the_run_already_uses_and_picks_the_gpus_16_bit_type():
    t4, l4 = load_device("t4"), load_device("l4")       # T4 (Turing): no BF16 tensor cores; L4 (Ada): BF16
    # training: sdpa, 16-bit, accumulation, then recompute and accumulation again (cheapest in time first)
    assert _rungs("training", t4, 8, {}) == [("attn_implementation", "sdpa"), ("amp", "float16"), ACCUMULATE,
                                             ("gradient_checkpointing", True), ACCUMULATE]
    assert _rungs("training", l4, 1, {"attn_implementation": "eager"}) == [
        ("attn_implementation", "sdpa"), ("amp", "bfloat16"), ("gradient_checkpointing", True)]   # batch 1: no split
    # inference: no recompute, no accumulation; the model itself in 16 bits (dtype), not autocast; then int4 weights
    assert _rungs("inference", l4, 8, {}) == [("attn_implementation", "sdpa"), ("dtype", "bfloat16"),
                                              ("weight_quant", "int4")]
    assert _rungs("training", l4, 8, {"attn_implementation": "flash_attention_2",
                                      "gradient_checkpointing": "selective", "amp": "bfloat16"}) == [ACCUMULATE]
    assert _rungs("inference", l4, 8, {"dtype": "float16", "weight_quant": "int8"}) == [("attn_implementation", "sdpa")]
    # generate(): an in-place cache, 16 bits, int4 weights, then an FP8 cache with what it needs
    assert _generation_rungs(t4, {}) == [("attn_implementation", "sdpa"), ("static_cache", True),
                                         ("dtype", "float16"), ("weight_quant", "int4"),
                                         ("kv_cache_dtype", "fp8", {"attn_implementation": "sdpa",
                                                                    "static_cache": True})]
    assert _generation_rungs(l4, {"attn_implementation": "flash_attention_2", "static_cache": True,
                                  "dtype": "bfloat16", "fp8": "static"}) == [("kv_cache_dtype", "fp8", {})]


def test_inference_takes_16_bit_then_int4_weights():
    # Llama-3.2-1B inference, batch 1 x 512, FP32, on a T4 cut to 2 GiB: ~5 GiB of FP32 weights; FP16 ~2.8 GiB (no
    # fit); int4 weights (a quarter of FP16's bytes for the linear layers) ~1.4 GiB: fits
    small = neusight.modify_device("t4", memory_gib=2)
    rungs = fit_remedies("llama-3.2-1b", small, 1, 512, "inference")[small.key]
    assert [(r.added, r.fits) for r in rungs] == [("dtype=float16", False), ("weight_quant=int4", True)]
    p = neusight.predict("llama-3.2-1b", small, 1, 512, **rungs[-1].options)
    assert rungs[-1].options == {"dtype": "float16", "weight_quant": "int4"}
    assert (rungs[-1].peak_bytes, rungs[-1].latency_ms) == (p.memory.peak_bytes, p.latency_ms)


@pytest.fixture(scope="module")
def gpt2_on_t4():
    # GPT-2 training, batch 16 x 512, FP32, eager attention, AdamW: ~20 GiB forecast, more than T4's 16 GiB
    run = dict(batch_size=16, seq_len=512, mode="training")
    base = neusight.predict("gpt2", "t4", **run)
    return run, base, fit_remedies("gpt2", "t4", predictions=[base], **run)


def test_remedies_add_up_until_the_step_fits_and_each_is_the_forecast_of_its_run(gpt2_on_t4):
    run, base, remedies = gpt2_on_t4
    assert base.memory.fits is False
    rungs = remedies["t4"]
    # sdpa alone still needs more than 16 GiB (the blocks' other activations); FP16 autocast on top of it fits
    assert [r.added for r in rungs] == ["attn_implementation=sdpa", "amp=float16"]
    assert [r.fits for r in rungs] == [False, True]
    assert rungs[1].options == {"attn_implementation": "sdpa", "amp": "float16"}
    peaks = [base.memory.peak_bytes] + [r.peak_bytes for r in rungs]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 3
    for r in rungs:          # each rung is exactly predict() of the run with its options
        p = neusight.predict("gpt2", "t4", **run, **r.options)
        assert (r.peak_bytes, r.fits, r.latency_ms) == (p.memory.peak_bytes, p.memory.fits, p.latency_ms)
    # 16-bit GEMMs on T4's tensor cores: faster than sdpa in FP32
    assert rungs[1].latency_ms < rungs[0].latency_ms


def test_gradient_accumulation_takes_the_fewest_micro_batches_that_fit():
    # GPT-2 training at batch 64 x 1,024 on T4: ~96 GiB even with sdpa and FP16 autocast; 8 micro-batches of 8 fit
    run = dict(batch_size=64, seq_len=1024, mode="training")
    rungs = fit_remedies("gpt2", "t4", **run)["t4"]
    assert [r.added for r in rungs] == ["attn_implementation=sdpa", "amp=float16", "microbatches=8"]
    last, half = rungs[-1], {"attn_implementation": "sdpa", "amp": "float16"}
    assert last.fits and last.options == {**half, "microbatches": 8}
    # the accumulated step holds one micro-batch's activations: the peak of a plain step at batch 64 / 8, with the
    # run's optimizer (AdamW) stepped once
    assert last.peak_bytes == neusight.predict("gpt2", "t4", 8, 1024, "training", **half).memory.peak_bytes
    four = neusight.predict_parallel("gpt2", "t4", 64, 1024, "training", microbatches=4, optimizer="adamw", **half)
    assert not four.memory_fits                          # 4 micro-batches of 16 do not fit: 8 is the fewest


def test_recompute_comes_after_accumulation_that_does_not_fit_and_starts_without_it():
    # GPT-2, batch 2 x 1,024, on a T4 of 3.2 GiB. With sdpa and FP16 autocast: batch 2 ~4.9 GiB, 2 micro-batches of 1
    # ~3.4 (no fit: not kept), recompute at batch 2 ~3.2 (just over), recompute with 2 micro-batches ~2.7: fits
    small = neusight.modify_device("t4", memory_gib=3.2)
    rungs = fit_remedies("gpt2", small, batch_size=2, seq_len=1024, mode="training")[small.key]
    assert [r.added for r in rungs] == ["attn_implementation=sdpa", "amp=float16", "gradient_checkpointing=true",
                                        "microbatches=2"]
    assert [r.fits for r in rungs] == [False, False, False, True]
    assert rungs[2].options == {"attn_implementation": "sdpa", "amp": "float16", "gradient_checkpointing": True}


def test_no_remedy_goes_below_the_weights_gradients_and_optimizer_state(gpt2_on_t4, monkeypatch):
    run, base, remedies = gpt2_on_t4
    least = least_peak_bytes(base)
    assert least <= min(r.peak_bytes for r in remedies["t4"]) < base.memory.peak_bytes
    # the same bound under recompute and accumulation: GPT-2 at batch 2 x 1,024 goes down to ~2.7 GiB; ~2.2 held
    small = neusight.modify_device("t4", memory_gib=3.2)
    plain = neusight.predict("gpt2", small, 2, 1024, "training")
    rungs = fit_remedies("gpt2", small, 2, 1024, "training", predictions=[plain])[small.key]
    assert rungs[-1].options.get("microbatches") == 2 and rungs[-1].fits
    assert least_peak_bytes(plain) <= min(r.peak_bytes for r in rungs)
    # AdamW holds the FP32 weights, their gradients and two moments (the optimizer's twice the weights' bytes)
    w = plain.memory.breakdown["weights"]
    assert least_peak_bytes(plain) >= 4 * w and plain.memory.breakdown["optimizer"] == 2 * w
    assert least_peak_bytes(neusight.predict("gpt2", "t4", 2, 1024)) is None      # inference: weights can shrink
    # a GPU below the bound: no rung is tried (no forecast made), its list is empty
    tiny = neusight.modify_device("t4", memory_gib=2)
    base_tiny = neusight.predict("gpt2", tiny, 16, 512, "training")
    assert least_peak_bytes(base_tiny) > tiny.memory_bytes

    def no_forecast(*args, **kwargs):
        raise AssertionError("a rung was forecast on a GPU no remedy can fit")
    monkeypatch.setattr(neusight.api, "predict_many", no_forecast)
    assert fit_remedies("gpt2", tiny, 16, 512, "training", predictions=[base_tiny]) == {tiny.key: []}


def test_a_run_that_fits_gets_no_remedies():
    assert fit_remedies("gpt2", "h100-sxm5-80gb", batch_size=1, seq_len=64, mode="training") == {}


def test_remedies_the_run_cannot_take_or_that_do_not_help_are_left_out():
    # ResNet-18 training at batch 1,024 on T4: ~22 GiB. sdpa changes nothing in a CNN (dropped), gradient
    # checkpointing needs a Hugging Face model (refused, skipped); FP16 autocast halves the activations
    base = neusight.predict("resnet18", "t4", 1024, mode="training", optimizer="sgd")
    assert base.memory.fits is False
    rungs = fit_remedies("resnet18", "t4", 1024, mode="training", optimizer="sgd", predictions=[base])["t4"]
    assert [r.added for r in rungs] == ["amp=float16"] and rungs[0].options == {"amp": "float16"}
    assert rungs[0].peak_bytes < base.memory.peak_bytes


def test_remedies_text_says_when_none_fits_or_none_applies():
    from neusight.cli.predict import remedies_text

    preds = [neusight.predict("gpt2", d, 1, 64, memory=False) for d in ("t4", "l4")]
    gib = 2**30
    remedies = {"t4": [Remedy("attn_implementation=sdpa", {"attn_implementation": "sdpa"}, 20 * gib, False, 2.0)],
                "l4": []}
    text = remedies_text([(p.device, p.latency_ms) for p in preds], remedies)
    lines = text.splitlines()
    assert lines[0].startswith("to fit on t4 (16 GiB)")
    # +100 %: 2.0 ms against the forecast's own time
    base = preds[0].latency_ms
    assert lines[1] == f"  attn_implementation=sdpa: peak 20.0 GiB, does NOT fit, 2.00 ms ({100 * (2 / base - 1):+.1f} %)"
    assert lines[2].startswith("  none of these fits: find_max_batch=true")
    assert lines[3].startswith("to fit on l4 (24 GiB): none of the usual remedies (SDPA, 16-bit, int4")
    generation = remedies_text([(p.device, p.latency_ms) for p in preds], remedies, generation=True).splitlines()
    assert generation[2].startswith("  none of these fits: find_max_batch=true finds how many sequences fit")


def test_the_command_line_prints_and_writes_the_remedies_unless_told_not_to(tmp_path):
    args = ["model=gpt2", "device=t4", "batch_size=16", "seq_len=512", "mode=training", "top=0", "json=f.json"]
    r = _predict(tmp_path / "a", *args)
    assert "to fit on t4 (16 GiB)" in r.stdout
    assert "\n  attn_implementation=sdpa: peak " in r.stdout
    assert "\n  + amp=float16: peak " in r.stdout and ", fits, " in r.stdout
    data = json.loads((tmp_path / "a" / "f.json").read_text())
    assert [x["added"] for x in data["fit_remedies"]] == ["attn_implementation=sdpa", "amp=float16"]
    r = _predict(tmp_path / "b", *args, "advise=false")
    assert "does NOT fit" in r.stdout and "to fit on" not in r.stdout
    assert "fit_remedies" not in json.loads((tmp_path / "b" / "f.json").read_text())


def test_generation_remedies_add_a_static_cache_16_bits_then_an_fp8_cache_with_what_it_needs():
    from neusight.generation import predict_generation
    from neusight.remedies import fit_generation_remedies

    # GPT-2 XL generating 512 tokens after 512-token prompts for 64 sequences on T4, FP32, eager, DynamicCache:
    # ~81 GiB. SDPA alone does not lower the decode-step peak (one query: no large score matrix), nor do int4
    # weights (GPT-2's projections are Conv1D modules, not nn.Linear): left out. The FP8 cache needs a fused
    # attention and an in-place cache, so its rung brings SDPA with it
    run = dict(prompt_len=512, new_tokens=512)
    base = predict_generation("gpt2-xl", "t4", 64, **run)
    assert base.memory_fits is False
    rungs = fit_generation_remedies("gpt2-xl", "t4", 64, forecasts=[base], **run)["t4"]
    assert [r.added for r in rungs] == ["static_cache=true", "dtype=float16",
                                        "attn_implementation=sdpa kv_cache_dtype=fp8"]
    assert rungs[-1].options == {"static_cache": True, "dtype": "float16", "attn_implementation": "sdpa",
                                 "kv_cache_dtype": "fp8"}
    assert not rungs[-1].fits                      # ~19 GiB: 64 sequences need more than 16 GiB even so
    for r in rungs:
        f = predict_generation("gpt2-xl", "t4", 64, **run, **r.options)
        assert (r.peak_bytes, r.fits, r.latency_ms) == (int(f.memory_peak_bytes), f.memory_fits, f.total_ms)


def test_generation_remedies_of_several_gpus_are_each_gpus_own_forecast():
    from neusight.generation import predict_generation
    from neusight.remedies import fit_generation_remedies

    # two FP16 GPUs cut to 2 GiB (what-if specs) take the same rungs: forecast together from shared traces
    # (predict_generation_many), each rung must be predict_generation of that GPU with its options
    gpus = [neusight.modify_device(d, memory_gib=2) for d in ("t4", "rtx-2080-ti")]
    run = dict(prompt_len=512, new_tokens=256)
    remedies = fit_generation_remedies("gpt2", gpus, 64, **run)
    assert sorted(remedies) == sorted(d.key for d in gpus)
    for d in gpus:
        rungs = remedies[d.key]
        assert rungs and rungs[0].added == "static_cache=true"
        for r in rungs:
            f = predict_generation("gpt2", d, 64, **run, **r.options)
            assert (r.peak_bytes, r.fits, r.latency_ms) == (int(f.memory_peak_bytes), f.memory_fits, f.total_ms)
    assert remedies[gpus[0].key][-1].latency_ms != remedies[gpus[1].key][-1].latency_ms


def test_generation_on_the_command_line_prints_its_remedies(tmp_path):
    # GPT-2, 64 prompts of 512 + 256 new tokens, on a T4 cut to 2 GiB (what-if spec): does not fit as given
    r = _predict(tmp_path, "model=gpt2", "device=t4", "batch_size=64", "seq_len=512", "new_tokens=256",
                 "+spec.memory_gib=2", "json=g.json")
    assert "to fit on t4+memory_gib=2 (2 GiB), the same run forecast again" in r.stdout
    rows = json.loads((tmp_path / "g.json").read_text())
    assert rows[0]["fit_remedies"][0]["added"] == "static_cache=true"


def test_a_ranking_where_some_gpus_do_not_fit_says_how_to_ask_what_would():
    import pandas as pd

    from neusight.cli.predict import ranking_text

    hint = "on the others, advise=true ranks the GPUs it fits on with the usual memory remedies (slower"
    table = pd.DataFrame({"GPU": ["h100-sxm5-80gb", "t4"], "ms": [1.0, 2.0], "fits": ["no", "yes"]})
    text = ranking_text(table, "ms", "a run", {})
    assert "the run fits in the memory of 1 of 2 GPUs; the fastest of them: t4 (2.00 ms); " + hint in text
    assert hint not in ranking_text(table.assign(fits="yes"), "ms", "a run", {})
    # a ranking of multi-GPU layouts or of a serving engine names its own way to a fit, or none
    assert "on the others, gpus=4 plans" in ranking_text(table, "ms", "a run", {}, "gpus=4 plans ...")
    assert "on the others" not in ranking_text(table, "ms", "a run", {}, None)


def test_a_multi_gpu_step_that_does_not_fit_points_to_the_plan(tmp_path):
    # GPT-2 training as dp=2 on T4s cut to 1 GiB (what-if spec): ~3 GiB per GPU
    r = _predict(tmp_path, "model=gpt2", "device=t4", "batch_size=4", "seq_len=256", "mode=training", "dp=2",
                 "+spec.memory_gib=1")
    assert "does NOT fit" in r.stdout
    assert "to fit: gpus=2 plans every dp x tp x pp layout of these GPUs" in r.stdout


def test_a_ranking_lists_the_gpus_that_fit_with_remedies_fastest_first_and_why_the_others_do_not():
    from neusight.cli.predict import remedies_ranking_text

    preds = [neusight.predict("gpt2", d, 1, 64, memory=False) for d in ("t4", "l4", "p4", "h100-sxm5-80gb")]
    gib = 2**30
    sdpa = {"attn_implementation": "sdpa"}
    remedies = {"t4": [Remedy("attn_implementation=sdpa", sdpa, 20 * gib, False, 5.0),
                       Remedy("amp=float16", {**sdpa, "amp": "float16"}, 10 * gib, True, 3.0)],
                "l4": [Remedy("attn_implementation=sdpa", sdpa, 10 * gib, True, 1.0)],
                "p4": []}          # h100: fits as is, not in the remedies
    runs = [(p.device, p.latency_ms) for p in preds]
    text = remedies_ranking_text(runs, remedies, {"p4": 9 * gib})
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["2"])]
    # ranked by the remedied run's forecast: l4 (1 ms) before t4 (3 ms); the options as the CLI takes them
    assert [r[1] for r in rows] == ["l4", "t4"]
    assert rows[1][-2:] == ["attn_implementation=sdpa", "amp=float16"] and rows[1][2] == "3.00"
    assert rows[1][4] == f"{100 * (3 / preds[0].latency_ms - 1):.1f}"            # against the run's own forecast
    assert "the run fits on 2 more GPUs" in text
    flat = " ".join(text.split())
    assert ("none of the remedies makes it fit on 1 GPU (1 of them hold less than the weights, gradients and "
            "optimizer state alone, 9.0 GiB or more") in flat
    assert "find_max_batch" not in flat            # no batch fits where the state alone does not
    assert "not anchored" not in flat and "not anchored" in remedies_ranking_text(runs, remedies, anchored=True)
    flat = " ".join(remedies_ranking_text(runs, remedies, {"p4": 2 * gib}).split())
    assert "makes it fit on 1 GPU: gpus=N plans" in flat and "find_max_batch=true finds the largest batch" in flat


def test_remedies_are_forecast_for_named_gpus_by_default_and_for_a_ranking_when_asked():
    from types import SimpleNamespace

    from neusight.cli.predict import _advise

    assert _advise(SimpleNamespace(advise=None, device="t4"))
    assert _advise(SimpleNamespace(advise=None, device=["t4", "l4"]))
    assert not _advise(SimpleNamespace(advise=None, device="all"))     # a climb per GPU: about 2-3x the ranking
    assert _advise(SimpleNamespace(advise=True, device="all"))
    assert not _advise(SimpleNamespace(advise=False, device="t4"))


def test_the_ranking_of_every_gpu_forecasts_the_remedies_of_those_the_run_does_not_fit(tmp_path):
    # GPT-2 training at batch 4 x 256 with every GPU cut to 2 GiB (what-if spec): its weights, gradients and AdamW
    # state alone take ~2.2 GiB, so no rung is tried and the ranking says why (advise=true: not by default there)
    r = _predict(tmp_path, "model=gpt2", "device=all", "batch_size=4", "seq_len=256", "mode=training", "top=0",
                 "+spec.memory_gib=2", "advise=true", "json=all.json")
    flat = " ".join(r.stdout.split())
    n = len(json.loads((tmp_path / "all.json").read_text()))
    assert (f"the run fits in the memory of 0 of {n} GPUs; on the others, below, what the usual memory remedies "
            "do") in flat
    assert (f"none of the remedies makes it fit on {n} GPUs ({n} of them hold less than the weights, gradients and "
            "optimizer state alone, 2.2 GiB or more") in flat
    assert all(x["fit_remedies"] == [] for x in json.loads((tmp_path / "all.json").read_text()))

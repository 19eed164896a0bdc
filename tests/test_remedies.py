"""neusight.remedies: what makes a step that does not fit fit, each remedy re-forecast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import neusight
from neusight.devices import load_device
from neusight.remedies import Remedy, _rungs, fit_remedies

BIN = Path(sys.executable).parent


def test_the_ladder_skips_what_the_run_already_uses_and_picks_the_gpus_16_bit_type():
    t4, l4 = load_device("t4"), load_device("l4")       # T4 (Turing): no BF16 tensor cores; L4 (Ada): BF16
    assert _rungs("training", t4, {}) == [("attn_implementation", "sdpa"), ("gradient_checkpointing", True),
                                          ("amp", "float16")]
    assert _rungs("training", l4, {"attn_implementation": "eager"})[-1] == ("amp", "bfloat16")
    # inference: no recompute; the model itself in 16 bits (dtype), not autocast
    assert _rungs("inference", l4, {}) == [("attn_implementation", "sdpa"), ("dtype", "bfloat16")]
    assert _rungs("training", l4, {"attn_implementation": "flash_attention_2", "gradient_checkpointing": "selective",
                                   "amp": "bfloat16"}) == []
    assert _rungs("inference", l4, {"dtype": "float16"}) == [("attn_implementation", "sdpa")]


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
    # sdpa alone still needs more than 16 GiB (the blocks' other activations); recompute on top of it fits
    assert [r.added for r in rungs] == ["attn_implementation=sdpa", "gradient_checkpointing=true"]
    assert [r.fits for r in rungs] == [False, True]
    assert rungs[1].options == {"attn_implementation": "sdpa", "gradient_checkpointing": True}
    peaks = [base.memory.peak_bytes] + [r.peak_bytes for r in rungs]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 3
    for r in rungs:          # each rung is exactly predict() of the run with its options
        p = neusight.predict("gpt2", "t4", **run, **r.options)
        assert (r.peak_bytes, r.fits, r.latency_ms) == (p.memory.peak_bytes, p.memory.fits, p.latency_ms)
    # recompute runs the blocks' forward again: slower than sdpa alone
    assert rungs[1].latency_ms > rungs[0].latency_ms


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
    text = remedies_text(preds, remedies)
    lines = text.splitlines()
    assert lines[0].startswith("to fit on t4 (16 GiB)")
    # +100 %: 2.0 ms against the forecast's own time
    base = preds[0].latency_ms
    assert lines[1] == f"  attn_implementation=sdpa: peak 20.0 GiB, does NOT fit, 2.00 ms ({100 * (2 / base - 1):+.1f} %)"
    assert lines[2].startswith("  none of these fits: find_max_batch=true")
    assert lines[3].startswith("to fit on l4 (24 GiB): none of the usual remedies")


def test_the_command_line_prints_and_writes_the_remedies_unless_told_not_to(tmp_path):
    args = [str(BIN / "neusight-predict"), "model=gpt2", "device=t4", "batch_size=16", "seq_len=512",
            "mode=training", "top=0", "json=f.json"]
    r = subprocess.run([*args, f"hydra.run.dir={tmp_path / 'a'}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "to fit on t4 (16 GiB)" in r.stdout
    assert "\n  attn_implementation=sdpa: peak " in r.stdout
    assert "\n  + gradient_checkpointing=true: peak " in r.stdout and ", fits, " in r.stdout
    data = json.loads((tmp_path / "a" / "f.json").read_text())
    assert [x["added"] for x in data["fit_remedies"]] == ["attn_implementation=sdpa", "gradient_checkpointing=true"]
    r = subprocess.run([*args, "advise=false", f"hydra.run.dir={tmp_path / 'b'}"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "does NOT fit" in r.stdout and "to fit on" not in r.stdout
    assert "fit_remedies" not in json.loads((tmp_path / "b" / "f.json").read_text())

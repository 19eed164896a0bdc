"""Measured accuracy per kind of forecast (neusight.accuracy): records, lookup, files, and the shipped ones."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import neusight
from neusight.accuracy import (ACCURACY_DIR, accuracy_records, forecast_kind, format_accuracy, load_accuracy,
                               measured_accuracy, write_accuracy)
from neusight.api import load_predictor
from neusight.devices import load_device
from neusight.errors import DataError

LABELS = pd.DataFrame({
    "gpu": ["v100-pcie-32gb", "v100-pcie-32gb", "t4", "l4", "l4", "l4"],
    "mode": ["inference", "inference", "inference", "inference", "inference+fusion", "training"],
    "error_pct": [2.0, -4.0, 6.0, -10.0, 5.0, 3.0],
    "batch": [8, 16, 8, 8, 8, 2],
    "measured_ms": [100.0, 200.0, 300.0, 400.0, 350.0, 900.0],
})
TRAINED = ("v100-pcie-32gb", "t4")
VENDORS = {g: "nvidia" for g in LABELS["gpu"]}


def _find(records, **kw):
    return [r for r in records if all(r[k] == v for k, v in kw.items())]


def test_records_group_runs_by_kind_and_by_gpu():
    recs = accuracy_records(LABELS, TRAINED, vendors=VENDORS)
    seen = _find(recs, mode="inference", fused=False, gpu_seen=True, gpu=None)
    assert len(seen) == 1 and seen[0]["runs"] == 3 and seen[0]["gpus"] == ["t4", "v100-pcie-32gb"]
    assert seen[0]["mean_abs_error_pct"] == 4.0 and seen[0]["worst_abs_error_pct"] == 6.0
    assert seen[0]["batch_range"] == [8, 16] and seen[0]["measured_ms_range"] == [100.0, 300.0]
    v100 = _find(recs, mode="inference", gpu="v100-pcie-32gb")
    assert len(v100) == 1 and v100[0]["runs"] == 2 and v100[0]["mean_signed_error_pct"] == -1.0
    fused = _find(recs, mode="inference", fused=True, gpu=None)   # "+fusion" is the torch.compile flag, not a mode
    assert len(fused) == 1 and fused[0]["gpus"] == ["l4"] and not fused[0]["gpu_seen"]
    assert all(r["workload"] == "transformer" and r["precision"] == "fp32" for r in recs)
    multi = pd.concat([LABELS, LABELS.iloc[:1].assign(mode="training+dp4")])   # multi-GPU runs are left out
    assert accuracy_records(multi, TRAINED, vendors=VENDORS) == recs


def test_cnn_precisions_map_to_forecast_precisions():
    cnn = pd.DataFrame({"gpu": ["t4", "t4"], "mode": ["training", "training"], "precision": ["amp", "fp16"],
                        "error_pct": [10.0, -20.0], "source_name": ["Lambda", "Lambda"], "batch": [64, 64],
                        "measured_ms": [250.0, 180.0]})
    recs = accuracy_records(LABELS.iloc[:0], TRAINED, vendors={"t4": "nvidia"}, cnn=[cnn])
    assert {r["precision"] for r in recs} == {"amp-float16", "float16"}
    assert all(r["workload"] == "cnn" and r["sources"] == ["Lambda"] for r in recs)


def test_lookup_prefers_the_gpus_own_runs_and_needs_the_same_weights(tmp_path):
    write_accuracy(tmp_path / "a.json", accuracy_records(LABELS, TRAINED, vendors=VENDORS), command="cmd",
                   predictor_sha256=["abc"])
    kind = {"vendor": "nvidia", "workload": "transformer", "mode": "inference", "precision": "fp32", "fused": False,
            "gpu_seen": True, "gpu": "t4"}
    own = measured_accuracy(kind, "abc", folder=tmp_path)
    assert own["record"]["gpu"] == "t4" and own["record"]["runs"] == 1 and own["command"] == "cmd"
    assert "on t4, a training GPU of the predictor" in format_accuracy(own)
    other = measured_accuracy({**kind, "gpu": "p100-pcie-16gb"}, "abc", folder=tmp_path)   # trained on, no runs
    assert other["record"]["gpu"] is None and other["record"]["runs"] == 3
    assert "over 3 runs on t4, v100-pcie-32gb" in format_accuracy(other)
    half = measured_accuracy({**kind, "precision": "float16"}, "abc", extra=["a KV cache"], folder=tmp_path)
    assert half["record"] is None and format_accuracy(half).startswith("measured accuracy: none")
    big = measured_accuracy(kind, "abc", batch_size=64, folder=tmp_path)   # outside the measured batches: named
    assert big["not_covered"] == ["batch 64 (the runs measured batch 8)"]
    assert measured_accuracy(kind, "abc", batch_size=8, folder=tmp_path)["not_covered"] == []
    short = measured_accuracy(kind, "abc", latency_ms=12.0, folder=tmp_path)   # t4's one run took 300 ms
    assert short["not_covered"] == ["a run of 12 ms (the runs measured took 300 ms)"]
    assert measured_accuracy(kind, "abc", latency_ms=300.0, folder=tmp_path)["not_covered"] == []
    retrained = measured_accuracy(kind, "other-weights", folder=tmp_path)   # never measured: nothing is claimed
    assert not retrained["predictor_measured"] and format_accuracy(retrained) is None


def test_published_runs_make_records_of_their_own_kind_and_say_what_they_covered(tmp_path):
    """run_records takes runs of any precision (bench_training_public's BF16 training runs); a record's "covers"
    drops what its runs had from the forecast's "not in those runs" (the labels time no optimizer step)."""
    from neusight.accuracy import run_records

    runs = pd.DataFrame({"gpu": ["h100-sxm5-80gb", "a100-sxm4-80gb"], "workload": "transformer", "mode": "training",
                         "precision": "bfloat16", "fused": False, "batch": [1, 4], "measured_ms": [500.0, 900.0],
                         "error_pct": [-40.0, -20.0], "source": "published"})
    recs = run_records(runs, TRAINED, vendors={"h100-sxm5-80gb": "nvidia", "a100-sxm4-80gb": "nvidia"})
    assert [(r["gpu"], r["runs"], r["mean_abs_error_pct"], r["gpu_seen"]) for r in recs] == [
        (None, 2, 30.0, False), ("a100-sxm4-80gb", 1, 20.0, False), ("h100-sxm5-80gb", 1, 40.0, False)]
    for r in recs:
        r["covers"] = ["the optimizer step"]
    write_accuracy(tmp_path / "p.json", recs, command="cmd", predictor_sha256=["abc"])
    kind = {"vendor": "nvidia", "workload": "transformer", "mode": "training", "precision": "bfloat16",
            "fused": False, "gpu_seen": False, "gpu": "h100-sxm5-80gb"}
    extra = ["the optimizer step (the transformer labels time forward and backward only)", "a KV cache"]
    acc = measured_accuracy(kind, "abc", extra=extra, folder=tmp_path)
    assert acc["record"]["gpu"] == "h100-sxm5-80gb" and acc["not_covered"] == ["a KV cache"]
    assert measured_accuracy({**kind, "precision": "fp32"}, "abc", extra=extra, folder=tmp_path)["record"] is None


def test_a_bf16_training_forecast_quotes_the_published_runs():
    """data/accuracy/public-training.json (scripts/bench_training_public.py): a BF16 transformer training forecast
    on H100 quotes MosaicML's runs on it, with the optimizer step no longer named as missing."""
    p = neusight.predict("llama-3.2-1b", "h100-sxm5-80gb", batch_size=1, seq_len=512, mode="training",
                         dtype="bfloat16", attn_implementation="sdpa", memory=False)
    r = p.accuracy["record"]
    assert r is not None and r["gpu"] == "h100-sxm5-80gb" and r["precision"] == "bfloat16" and r["runs"] >= 30
    assert any("MPT" in s for s in r["sources"]) and r["mean_signed_error_pct"] < 0     # forecast too short
    assert not any("optimizer" in e for e in p.accuracy["not_covered"])


def test_corrupt_accuracy_file_is_a_clear_error_or_a_warning(tmp_path, caplog):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        load_accuracy(tmp_path, strict=True)
    (tmp_path / "bad.json").write_text(json.dumps({"format_version": 3, "records": [{"gpu": "t4"}]}))
    with pytest.raises(DataError, match="regenerate"):
        load_accuracy(tmp_path, strict=True)
    # looked up for a forecast: left out with a warning, so forecasting (and the evaluation rewriting it) goes on
    write_accuracy(tmp_path / "good.json", accuracy_records(LABELS, TRAINED, vendors=VENDORS), command="cmd",
                   predictor_sha256=["abc"])
    with caplog.at_level("WARNING"):
        assert [f["command"] for f in load_accuracy(tmp_path)] == ["cmd"]
        assert [f["command"] for f in load_accuracy(tmp_path)] == ["cmd"]
    assert "bad.json" in caplog.text and "regenerate" in caplog.text
    assert caplog.text.count("bad.json") == 1          # warned once, not at every forecast
    (tmp_path / "bad.json").unlink()
    good = json.loads((tmp_path / "good.json").read_text())
    del good["records"][0]["measured_ms_range"]        # a record missing a field the line needs
    (tmp_path / "good.json").write_text(json.dumps(good))
    with pytest.raises(DataError, match="good.json"):
        load_accuracy(tmp_path, strict=True)
    assert load_accuracy(tmp_path / "missing") == []


@pytest.mark.parametrize("model,kw,want", [
    ("resnet18", dict(mode="training", amp="float16"), ("cnn", "amp-float16")),
    ("resnet18", dict(mode="inference"), ("cnn", "tf32")),              # convolutions on TF32 on an A100
    ("resnet18", dict(mode="inference", tf32="off"), ("cnn", "fp32")),
    ("vit-base", dict(mode="inference", image_size=64), ("other", "fp32")),   # one patch conv: not a CNN
    ("gpt2", dict(mode="training", seq_len=16), ("transformer", "fp32")),
    ("gpt2", dict(mode="inference", seq_len=16, dtype="bfloat16"), ("transformer", "bfloat16")),
    (torch.nn.Sequential(torch.nn.Linear(8, 8)), dict(mode="inference", input_shapes=[(8,)]), ("other", "fp32")),
])
def test_forecast_kind_of_real_traces(model, kw, want):
    p = neusight.predict(model, "a100-pcie-40gb", batch_size=2, **kw)
    kind, extra = forecast_kind(p.graph, p.kernels, p.device, p.predictor_devices)
    assert (kind["workload"], kind["precision"]) == want
    assert kind["gpu_seen"] and kind["gpu"] == "a100-pcie-40gb"
    assert any("optimizer" in e for e in extra) == (want[0] == "transformer" and kw["mode"] == "training")


def test_shipped_accuracy_files_measure_the_shipped_predictors():
    """Regenerate data/accuracy with the evaluation commands whenever a shipped predictor is retrained."""
    files = load_accuracy(strict=True)
    assert files, f"no accuracy file in {ACCURACY_DIR}"
    shas = {load_predictor(None, load_device(d)).manifest_["weights_sha256"] for d in ("t4", "mi210")}
    measured = {s for f in files for s in f["predictor_weights_sha256"]}
    assert shas <= measured


def test_a_forecast_carries_its_measured_accuracy():
    p = neusight.predict("gpt2-large", "l4", batch_size=4, seq_len=1024)
    r = p.accuracy["record"]
    assert r is not None and r["gpu"] == "l4" and r["workload"] == "transformer" and r["runs"] >= 1
    assert p.to_dict()["measured_accuracy"]["record"] == r
    h100 = neusight.predict("gpt2-large", "h100-sxm5-80gb", batch_size=4, seq_len=1024)
    assert h100.accuracy["record"]["gpu"] is None and not h100.accuracy["record"]["gpu_seen"]


def test_the_side_by_side_cell_names_two_gpus_and_counts_more():
    from neusight.accuracy import short_accuracy

    def acc(gpu, gpus):
        return {"predictor_measured": True, "record": {"gpu": gpu, "gpus": gpus, "runs": 4, "mean_abs_error_pct": 5.25}}

    assert short_accuracy(acc("t4", ["t4"])) == "5.2 % (4 runs on this GPU)"
    assert short_accuracy(acc(None, ["l4", "t4"])) == "5.2 % (4 runs on l4, t4)"
    assert short_accuracy(acc(None, ["a10", "l4", "t4"])) == "5.2 % (4 runs on 3 GPUs)"
    assert short_accuracy({"predictor_measured": True, "record": None}) == "none" and short_accuracy(None) is None


def test_a_forecast_with_quantized_or_narrow_gemms_says_the_measured_runs_had_none():
    # OPT-125m in FP32 on V100: measured runs of its kind exist (FP32 transformer inference on training GPUs)
    kw = dict(batch_size=1, seq_len=1, kv_cache=127, mode="inference")
    plain = neusight.predict("opt-125m", "v100-pcie-32gb", **kw).accuracy
    quant = neusight.predict("opt-125m", "v100-pcie-32gb", weight_quant="int8", **kw).accuracy
    assert plain["record"] is not None and quant["record"] == plain["record"]
    gemms = "quantized weights dequantized in the GEMMs"
    assert gemms not in plain["not_covered"] and gemms in quant["not_covered"]
    fp8 = neusight.predict("opt-125m", "h100-sxm5-80gb", fp8=True, **kw).accuracy
    fp4 = neusight.predict("opt-125m", "b200", weight_quant="nvfp4", **kw).accuracy
    assert "FP8 GEMMs" in fp8["not_covered"] and "FP4 GEMMs (NVFP4)" in fp4["not_covered"]
    # an FP8 KV cache casts to FP8 but multiplies nothing in it
    cache = neusight.predict("opt-125m", "h100-sxm5-80gb", dtype="bfloat16", static_cache=True,
                             attn_implementation="sdpa", kv_cache_dtype="fp8", **kw).accuracy
    assert "a KV cache" in cache["not_covered"] and "FP8 GEMMs" not in cache["not_covered"]

"""End-to-end forecasts: the Hydra configs compose, the evaluation app runs on a subset and writes its files,
the CNN benchmark selection keeps to its scope, and the model-level laws of DESIGN.md hold for the shipped
predictor. Small models and shapes only (GPT-2 small, seq 128)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf
import torch
from torch import nn

import neusight
from neusight.cli.common import CONF_DIR
from neusight.devices import load_device
from neusight.e2e_eval import (CNN_TF32_GPUS, HALF_PRECISIONS, SCOPE_ACCEPTANCE, SCOPE_OTHER, TF32_PRECISIONS,
                               cnn_device_key, cnn_summary, error_table, load_cnn_benchmarks, markdown_table,
                               per_gpu_summary, predict_cnn, write_doc_section)
from neusight.errors import InputError
from tests.conftest import DATASET, SHARED, need_shared

# the schemas register themselves in the ConfigStore on import
import neusight.cli.evaluate  # noqa: F401  isort: skip
import neusight.cli.predict  # noqa: F401  isort: skip

LAUNCHERS = ["basic", "joblib"] + (["slurm"] if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") else [])
EXPERIMENTS = {"predict": ["predict_gpus"], "evaluate": ["evaluate_per_gpu"]}


def _compose(app: str, overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name=app, overrides=overrides, return_hydra_config=True)


# ---------------------------------------------------------------------------------------------------------
# configs


@pytest.mark.parametrize("app", ["predict", "evaluate"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_configs_compose_and_instantiate(app, launcher):
    cfg = _compose(app, [f"hydra/launcher={launcher}"])
    assert cfg.hydra.launcher._target_
    for cb in cfg.hydra.callbacks.values():          # every callback the app registers builds
        assert instantiate(cb) is not None
    if launcher == "joblib":                         # the launcher itself builds from its config
        params = {k: v for k, v in OmegaConf.to_container(cfg.hydra.launcher).items() if k != "_target_"}
        from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher

        assert JoblibLauncher(**params) is not None


@pytest.mark.parametrize("app", ["predict", "evaluate"])
def test_experiment_presets_compose(app):
    for exp in EXPERIMENTS[app]:
        cfg = _compose(app, [f"+experiment={exp}"])
        assert cfg.hydra.sweeper.params, exp


def test_schema_rejects_unknown_keys():
    with pytest.raises(Exception, match="batchsize"):
        _compose("predict", ["batchsize=2"])
    cfg = _compose("evaluate", ["labels.max_runs=2", "checkpoint=/x"])
    assert cfg.labels.max_runs == 2 and cfg.checkpoint == "/x" and cfg.out_md is None


# ---------------------------------------------------------------------------------------------------------
# the evaluation app on 2 runs


def test_evaluate_app_on_two_runs(tmp_path):
    need_shared(DATASET)
    md = tmp_path / "docs" / "evaluation.md"
    r = subprocess.run([str(Path(sys.executable).parent / "neusight-evaluate"), "labels.max_runs=2", "labels.gpus=[l4]",
                        "cnn.enabled=false", f"out_md={md}", f"accuracy_out={tmp_path / 'acc' / 'a.json'}",
                        f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    res = pd.read_csv(run / "results.csv")
    assert len(res) == 2 and set(res["gpu"]) == {"l4"}
    for col in ("gpu", "model", "mode", "seq", "batch", "measured_ms", "predicted_ms", "error_pct",
                "roofline_predicted_ms", "roofline_error_pct"):
        assert col in res.columns, col
    # error % is (predicted - measured) / measured x 100, signed
    np.testing.assert_allclose(res["error_pct"], (res["predicted_ms"] / res["measured_ms"] - 1) * 100)
    assert (run / "predicted_vs_measured.png").stat().st_size > 10_000
    assert md.read_text() == (run / "evaluation.md").read_text()
    assert "| l4 |" in md.read_text() and "Roofline baseline" in md.read_text()
    assert json.loads((run / "summary.json").read_text())["runs"] == 2
    assert list(pd.read_csv(run / "speedups.csv").columns)[:4] == ["model", "mode", "seq", "batch"]
    # the accuracy file: the two runs as one kind (and as l4's own), for the shipped predictor's weights
    from neusight.accuracy import load_accuracy

    (acc,) = load_accuracy(tmp_path / "acc")
    assert "accuracy_out=" in acc["command"] and len(acc["predictor_weights_sha256"]) == 1
    kinds = {(r["mode"], r["gpu"]): r for r in acc["records"]}
    mean = float(np.mean(np.abs(res["error_pct"])))
    for (mode, gpu), r in kinds.items():
        assert gpu in (None, "l4") and not r["gpu_seen"] and r["workload"] == "transformer"
    if len(set(res["mode"])) == 1:
        assert kinds[(res["mode"].iloc[0], None)]["mean_abs_error_pct"] == pytest.approx(mean, abs=0.01)


def test_tables_have_neusight_layout():
    df = pd.DataFrame({"gpu": ["t4", "l4", "t4", "t4"], "model": ["m", "m", "m", "m"], "mode": ["inference"] * 3 + ["training"],
                       "seq": [128] * 4, "batch": [1, 1, 2, 1], "error_pct": [10.0, -5.0, 3.0, 4.0],
                       "roofline_error_pct": [-20.0, -30.0, -25.0, -10.0]})
    t = error_table(df, "inference", gpus=["t4", "l4"])
    assert list(t.columns) == ["t4", "l4"] and t.loc[("m", 128, 1), "l4"] == -5.0
    assert np.isnan(t.loc[("m", 128, 2), "l4"])
    assert "| m | 128 | 1 | +10.0 | -5.0 |" in markdown_table(t, signed=True)
    s = per_gpu_summary(df, trained_on=("t4",)).set_index(["gpu", "mode"])
    # t4 inference: |10| and |3| -> mean 6.5, worst 10; roofline |-20|, |-25| -> mean 22.5
    assert s.loc[("t4", "inference"), "mean_abs_error_pct"] == 6.5
    assert s.loc[("t4", "inference"), "worst_abs_error_pct"] == 10.0
    assert s.loc[("t4", "inference"), "roofline_mean_abs_error_pct"] == 22.5
    assert not s.loc[("l4", "inference"), "in_training_set"]


def _runs(rows):
    """A label frame of (gpu, batch, measured, predicted, roofline) rows of one model."""
    return pd.DataFrame([{"gpu": g, "model": "m", "mode": "inference", "seq": 128, "batch": b, "measured_ms": m,
                          "predicted_ms": p, "roofline_predicted_ms": r} for g, b, m, p, r in rows])


def test_speedups_pair_the_gpus_of_one_configuration():
    from neusight.e2e_eval import speedup_frame, speedup_summary

    df = _runs([("t4", 1, 300.0, 330.0, 100.0), ("v100-pcie-32gb", 1, 100.0, 100.0, 50.0),
                ("l4", 1, 150.0, 120.0, 80.0),
                ("t4", 2, 600.0, 500.0, 200.0)])          # batch 2 ran on one GPU only: no pair
    sp = speedup_frame(df, trained_on=("t4", "v100-pcie-32gb")).set_index(["fast_gpu", "slow_gpu"])
    assert len(sp) == 3                                   # 3 GPUs of batch 1 -> 3 pairs, faster GPU first
    v_t4 = sp.loc[("v100-pcie-32gb", "t4")]
    # measured 3.0x, forecast 3.3x (+10 %), roofline 2.0x (-33.3 %)
    assert v_t4["measured_speedup"] == pytest.approx(3.0) and v_t4["predicted_speedup"] == pytest.approx(3.3)
    assert v_t4["error_pct"] == pytest.approx(10.0) and v_t4["roofline_error_pct"] == pytest.approx(-100 / 3)
    assert not v_t4["unseen_gpu"] and sp.loc[("l4", "t4"), "unseen_gpu"]
    # V100 over L4: measured 150 / 100 = 1.5x, forecast 120 / 100 = 1.2x -> -20 %
    assert sp.loc[("v100-pcie-32gb", "l4"), "error_pct"] == pytest.approx(-20.0)
    s = speedup_summary(speedup_frame(df)).set_index("faster / slower GPU")
    assert s.loc["all pairs", "configs"] == 3 and s.loc["all pairs", "faster GPU named"] == "3 of 3"


def test_speedups_cancel_an_error_shared_by_both_gpus():
    from neusight.e2e_eval import speedup_frame, speedup_summary

    # every forecast 20 % slow: each GPU's error is +20 %, every speed-up exact
    df = _runs([(g, 1, m, 1.2 * m, 0.5 * m) for g, m in (("p4", 400.0), ("t4", 200.0), ("a100-pcie-40gb", 40.0))])
    sp = speedup_frame(df)
    assert len(sp) == 3 and np.allclose(sp["error_pct"], 0.0) and np.allclose(sp["roofline_error_pct"], 0.0)
    # a tie (measured 1.05x apart) is not counted for "which GPU is faster", even when the forecast flips it
    tie = speedup_summary(speedup_frame(_runs([("t4", 1, 105.0, 90.0, 50.0), ("l4", 1, 100.0, 95.0, 50.0)])))
    assert tie.iloc[-1]["faster GPU named"] == "0 of 0"
    flip = speedup_summary(speedup_frame(_runs([("t4", 1, 150.0, 90.0, 50.0), ("l4", 1, 100.0, 95.0, 50.0)])))
    assert flip.iloc[-1]["faster GPU named"] == "0 of 1"


def test_doc_sections_replace_only_their_own(tmp_path):
    doc = tmp_path / "speed.md"
    write_doc_section(doc, "a", "first A", title="# Speed")
    write_doc_section(doc, "b", "only B")
    write_doc_section(doc, "a", "second A")
    text = doc.read_text()
    assert text.startswith("# Speed") and "second A" in text and "only B" in text and "first A" not in text
    assert text.index("second A") < text.index("only B")


# ---------------------------------------------------------------------------------------------------------
# ResNet benchmark rows


@pytest.fixture(scope="module")
def cnn_rows():
    return load_cnn_benchmarks(need_shared(SHARED / "datasets" / "public-benchmarks"))


def test_cnn_selection_keeps_to_scope(cnn_rows):
    sel, skipped = cnn_rows
    assert (sel["precision"] == "fp32").all()
    acceptance = {"t4", "v100-sxm2-16gb", "v100-sxm2-32gb"}
    assert acceptance <= set(sel["gpu"]) <= acceptance | {"titan-rtx", "quadro-rtx-5000", "quadro-rtx-6000",
                                                          "quadro-rtx-8000"}
    assert (sel["scope"] == SCOPE_ACCEPTANCE).tolist() == sel["gpu"].isin(acceptance).tolist()
    # Ampere rows are TF32 whatever the benchmark calls them: never in scope
    assert not sel["gpu_name"].str.contains("A100|A40|A6000|RTX 30", regex=True).any()
    # DLE's ResNet-50, ResNeXt-101 32x4d, SE-ResNeXt-101 32x4d and EfficientNet-B0/B4 have presets; the
    # WideSE EfficientNets (a DLE variant) do not
    assert set(sel["model"]) == {"resnet50", "resnext101-32x4d", "se-resnext101-32x4d", "efficientnet-b0",
                                 "efficientnet-b4"}
    assert set(skipped.loc[skipped["reason"] == "model without a preset", "model"]) == {"efficientnet-widese-b0",
                                                                                        "efficientnet-widese-b4"}
    # each row at its own resolution (EfficientNet-B4: 380)
    assert set(sel.loc[sel["model"] == "efficientnet-b4", "image_size"]) == {380}
    assert set(sel.loc[sel["model"] != "efficientnet-b4", "image_size"]) == {224}
    assert (sel.loc[sel["mode"] == "inference", "batch"] >= 32).all()
    assert {"DeepLearningExamples", "Lambda"} <= set(sel["source_name"])
    assert not sel.duplicated(["source_name", "gpu", "model", "mode", "batch", "version"]).any()   # Lambda: one per era
    assert (sel["measured_ms"] > 0).all()
    reasons = " ".join(skipped["reason"].unique())
    assert "TF32" in reasons and "SUSPECT" in reasons
    laptops = skipped[skipped["gpu_name"].str.contains("laptop") & (skipped["precision"] == "fp32")]
    assert len(laptops) and laptops["reason"].str.contains("laptop").all()
    assert set(skipped.loc[skipped["reason"].str.contains("sections of their own"), "precision"]) >= {"tf32", "amp"}


def test_cnn_summary_keeps_the_acceptance_scope_apart():
    rows = pd.DataFrame({"source_name": ["Lambda"] * 3, "mode": ["training"] * 3,
                         "gpu": ["v100-sxm2-16gb", "titan-rtx", "quadro-rtx-8000"],
                         "scope": [SCOPE_ACCEPTANCE, SCOPE_OTHER, SCOPE_OTHER],
                         "error_pct": [-10.0, 20.0, -40.0], "roofline_error_pct": [-20.0, -30.0, -50.0]})
    s = cnn_summary(rows)
    assert s["scope"].iloc[0] == SCOPE_ACCEPTANCE
    acc = s[(s["scope"] == SCOPE_ACCEPTANCE) & (s["mode"] == "all")].iloc[0]
    other = s[(s["scope"] == SCOPE_OTHER) & (s["mode"] == "all")].iloc[0]
    assert (acc["rows"], acc["mean_abs_error_pct"], acc["gpus"]) == (1, 10.0, "v100-sxm2-16gb")
    assert (other["rows"], other["mean_abs_error_pct"], other["worst_abs_error_pct"]) == (2, 30.0, 40.0)


def test_cnn_prediction_of_one_row(cnn_rows):
    sel, _ = cnn_rows
    row = sel[(sel["gpu"] == "t4") & (sel["mode"] == "inference") & (sel["batch"] == 32)]
    res = predict_cnn(row)
    p = neusight.predict("resnet50", "t4", batch_size=32, image_size=224, mode="inference", memory=False)
    assert res["predicted_ms"].iloc[0] == p.latency_ms
    assert res["roofline_predicted_ms"].iloc[0] <= res["predicted_ms"].iloc[0]


def test_half_precision_rows_are_selected_apart_and_forecast_in_fp16():
    sel, skipped = load_cnn_benchmarks(need_shared(SHARED / "datasets" / "public-benchmarks"),
                                       precisions=HALF_PRECISIONS)
    assert set(sel["precision"]) == {"amp", "fp16"}
    # FP16 rows: a pure half model; AMP rows: the FP32 model under autocast(float16)
    amp = sel["precision"] == "amp"
    assert (sel.loc[~amp, "dtype"] == "float16").all() and sel.loc[~amp, "amp"].isna().all()
    assert (sel.loc[amp, "dtype"] == "float32").all() and (sel.loc[amp, "amp"] == "float16").all()
    # FP16 runs as FP16 on Ampere too (unlike its "float" rows, which are TF32): those cards are in
    assert {"a100-sxm4-40gb", "rtx-3090"} <= set(sel["gpu"])
    assert set(skipped.loc[skipped["reason"].str.contains("not in this selection"), "precision"]) == {"fp32", "tf32"}
    row = sel[(sel["gpu"] == "t4") & (sel["model"] == "resnet50") & (sel["batch"] == 64)]
    assert row["precision"].tolist() == ["amp"]
    # DLE ran it channels-last (its memory_format column says nhwc); Lambda's runs are NCHW (their raw logs say so)
    assert row["memory_format"].tolist() == ["channels_last"]
    assert set(sel.loc[sel["source_name"] == "Lambda", "memory_format"]) == {"contiguous"}
    res = predict_cnn(row)
    p = neusight.predict("resnet50", "t4", batch_size=64, image_size=224, mode="inference", amp="float16",
                         memory=False, memory_format="channels_last")
    assert len(res) == 1 and res["predicted_ms"].iloc[0] == p.latency_ms
    assert set(p.kernels.loc[p.kernels["family"] == "conv", "dtype"]) == {"float16"}
    pure = predict_cnn(row.assign(dtype="float16", amp=None))
    p16 = neusight.predict("resnet50", "t4", batch_size=64, image_size=224, mode="inference", dtype="float16",
                           memory=False, memory_format="channels_last")
    assert pure["predicted_ms"].iloc[0] == p16.latency_ms and (p16.kernels["dtype"] == "float16").all()


def test_tf32_rows_are_the_ampere_cards_float_runs_forecast_with_tf32_convolutions():
    sel, skipped = load_cnn_benchmarks(need_shared(SHARED / "datasets" / "public-benchmarks"),
                                       precisions=TF32_PRECISIONS)
    assert set(sel["precision"]) == {"tf32"} and (sel["dtype"] == "float32").all()
    # the cards of CNN_TF32_GPUS, plus the library's other Ampere cards of Lambda's table (found by alias)
    assert {"a100-pcie-40gb", "a100-sxm4-40gb", "rtx-3090"} <= set(sel["gpu"])
    assert {"rtx-a4000", "rtx-a4500", "rtx-a5000", "rtx-a5500", "rtx-3070"} <= set(sel["gpu"]) - set(CNN_TF32_GPUS.values())
    assert all(load_device(g).tf32_tensor_tflops for g in sel["gpu"])    # every one has TF32 tensor cores
    assert set(skipped.loc[skipped["reason"].str.contains("not in this selection"), "precision"]) == {"fp32", "amp",
                                                                                                      "fp16"}
    row = sel[(sel["gpu"] == "a100-pcie-40gb")].head(1)
    res, as_fp32 = predict_cnn(row), predict_cnn(row, tf32="off")
    b = int(row["batch"].iloc[0])
    p = neusight.predict("resnet50", "a100-pcie-40gb", batch_size=b, image_size=224, mode="training",
                         optimizer="sgd", tf32="default", memory=False)
    assert res["predicted_ms"].iloc[0] == p.latency_ms < as_fp32["predicted_ms"].iloc[0]


def test_cnn_rows_of_gpus_outside_the_tables_are_found_in_the_library(tmp_path):
    """A benchmark table with cards the name tables do not list (a newer table, a held-out card): each is
    looked up in the device library and kept when its precision fits the card; the others are skipped with
    the reason, never dropped silently."""
    bench = need_shared(SHARED / "datasets" / "public-benchmarks")
    lam = pd.read_csv(bench / "cnn_lambda.csv")
    base = lam[(lam["model"] == "resnet50") & (lam["precision"] == "fp32")].iloc[0]
    cards = [("RTX 2080 Ti", "fp32"), ("GTX 1080 Ti", "fp32"), ("A100-SXM4-80GB", "tf32"), ("H100 PCIe 80GB", "tf32"),
             ("TITAN V", "tf32"), ("A10", "fp32"), ("Tesla K80", "fp32")]
    rows = pd.DataFrame([base.to_dict() | {"gpu": g, "precision": p} for g, p in cards])
    rows.to_csv(tmp_path / "cnn_lambda.csv", index=False)
    pd.read_csv(bench / "cnn_dle.csv").head(0).to_csv(tmp_path / "cnn_dle.csv", index=False)
    sel, skipped = load_cnn_benchmarks(tmp_path, precisions=("fp32", "tf32"))
    assert dict(zip(sel["gpu_name"], sel["gpu"])) == {"RTX 2080 Ti": "rtx-2080-ti", "GTX 1080 Ti": "gtx-1080-ti",
                                                      "A100-SXM4-80GB": "a100-sxm4-80gb", "H100 PCIe 80GB": "h100-pcie"}
    why = dict(zip(skipped["gpu_name"], skipped["reason"]))
    assert why["Tesla K80"] == "GPU without a device spec"
    assert why["TITAN V"].startswith("precision the GPU does not run") and why["A10"] == why["TITAN V"]
    assert cnn_device_key("V100-16GB", "fp32") == ("v100-sxm2-16gb", "")   # the table's assumption comes first


def test_unknown_cnn_precision_is_refused():
    with pytest.raises(InputError, match=r"\['int8'\] are not forecast"):
        load_cnn_benchmarks(need_shared(SHARED / "datasets" / "public-benchmarks"), precisions=("int8",))


# ---------------------------------------------------------------------------------------------------------
# model-level laws (DESIGN.md) on the shipped predictor: GPT-2 small, seq 128

DEVICES = ["t4", "v100-pcie-32gb", "a100-80gb-pcie", "h100-sxm5-80gb", "l4"]


@pytest.fixture(scope="module")
def gpt2_latency():
    """(mode, batch) -> {device: ms}; one trace per (mode, batch), predicted on every device."""
    out = {}
    for mode in ("inference", "training"):
        for batch in (1, 2, 4):
            g = neusight.trace("gpt2", batch_size=batch, seq_len=128, mode=mode)
            out[mode, batch] = {d: neusight.predict_graph(g, d).latency_ms for d in DEVICES}
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_training_step_is_slower_than_inference(gpt2_latency, device):
    for batch in (1, 2, 4):
        assert gpt2_latency["training", batch][device] > gpt2_latency["inference", batch][device]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_doubling_the_batch_costs_between_1x_and_2_2x(gpt2_latency, device, mode):
    for batch in (1, 2):
        ratio = gpt2_latency[mode, 2 * batch][device] / gpt2_latency[mode, batch][device]
        assert 1.0 < ratio <= 2.2, (batch, ratio)


_FRESH = """
import json, neusight
p = neusight.predict("gpt2", "l4", batch_size=2, seq_len=128, mode="training", memory=False)
print(json.dumps({"total": p.latency_ms.hex(), "kernels": [float(x).hex() for x in p.kernels["latency_ms"]]}))
"""


def test_deterministic_in_process_and_in_a_fresh_process():
    def once():
        p = neusight.predict("gpt2", "l4", batch_size=2, seq_len=128, mode="training", memory=False)
        return {"total": p.latency_ms.hex(), "kernels": [float(x).hex() for x in p.kernels["latency_ms"]]}

    a, b = once(), once()
    assert a == b
    r = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == a


def test_kernel_cost_in_a_model_keeps_the_roofline_and_the_launch_floor():
    from neusight.api import e2e_kernel_ms

    rng = np.random.default_rng(0)
    roof = rng.uniform(0, 1, 500)
    over = rng.uniform(0.005, 0.03, 500)
    iso = roof + over + rng.uniform(0, 1, 500)              # an isolated prediction: roofline + overhead + excess
    for scale in (0.3, 1.0, 2.0):
        for floor in (0.1, 0.5, 1.0):
            cost = e2e_kernel_ms(roof, iso, over, scale, floor)
            assert (cost >= roof).all() and (cost >= floor * over).all()
            assert (e2e_kernel_ms(roof, iso * 1.5, over, scale, floor) >= cost).all()   # more isolated time, no cheaper
            assert (e2e_kernel_ms(roof, iso, over, scale, min(floor * 2, 1.0)) >= cost).all()  # higher floor, no cheaper
    np.testing.assert_allclose(e2e_kernel_ms(roof, iso, over, 1.0), np.maximum(iso - over, over))
    tiny = e2e_kernel_ms(np.array([1e-6]), np.array([0.02]), np.array([0.02]), 0.6, 0.3)
    np.testing.assert_allclose(tiny, [0.006])          # a launch-bound kernel costs the floor, not its isolated time


def test_find_labels_skips_a_gpu_folder_the_library_lacks(tmp_path, caplog):
    need_shared(DATASET)
    from neusight.evaluate import find_labels

    for gpu in ("Quadro_RTX_9999", "Tesla_T4"):
        (tmp_path / "labels" / gpu).mkdir(parents=True)
        (tmp_path / "labels" / gpu / "bert_large-inf-512-8.json").write_text('{"e2e_latency": 100.0}')
    (tmp_path / "models").symlink_to(DATASET / "models")
    runs = find_labels(tmp_path)
    assert [r.device for r in runs] == ["t4"] and "Quadro_RTX_9999" in caplog.text


def test_label_discovery_survives_odd_folders_and_files(tmp_path, caplog):
    """A GPU name with a slash became nested folders; a label without a model config or with a broken JSON is
    skipped with its reason, not the end of the evaluation; a run the forecaster refuses is reported, not fatal."""
    need_shared(DATASET)
    from neusight.evaluate import evaluate_labels, find_labels

    nested = tmp_path / "labels" / "AMD_Instinct_MI250X_" / "_MI250"   # its first half alone names the MI250X
    mi250x = tmp_path / "labels" / "AMD_Instinct_MI250X"
    h100 = tmp_path / "labels" / "NVIDIA_H100_80GB_HBM3"
    for d in (nested, mi250x, h100):
        d.mkdir(parents=True)
    (nested / "bert_large-inf-512-8.json").write_text('{"e2e_latency": 100.0}')
    (mi250x / "bert_large-inf-512-8.json").write_text('{"e2e_latency": 90.0}')
    (h100 / "bert_large-inf-512-8.json").write_text('{"e2e_latency": 50.0}')
    (h100 / "gpt2_large-inf-2048-2.json").write_text('{"e2e_latency": 50.0}')    # GPT-2 has 1024 positions
    (h100 / "mystery-inf-512-8.json").write_text('{"e2e_latency": 50.0}')       # no models/mystery.json
    (h100 / "bert_large-inf-512-16.json").write_text("not json")
    (h100 / "bert_large-inf-512-32.json").write_text('{"e2e_latency": -1}')
    (tmp_path / "models").symlink_to(DATASET / "models")
    runs = find_labels(tmp_path, vendors=("nvidia", "amd"))
    assert sorted((r.device, r.model, r.batch_size) for r in runs) == [
        ("h100-sxm5-80gb", "bert_large", 8), ("h100-sxm5-80gb", "gpt2_large", 2), ("mi250", "bert_large", 8),
        ("mi250x", "bert_large", 8)]
    assert "mystery.json does not exist" in caplog.text and "JSONDecodeError" in caplog.text
    assert "e2e_latency=-1 is not a positive number" in caplog.text
    res = evaluate_labels([r for r in runs if r.device == "h100-sxm5-80gb"])
    assert list(res["model"]) == ["bert_large"]
    ((path, reason),) = res.attrs["failed"]
    assert path.endswith("gpt2_large-inf-2048-2.json") and "exceeds gpt2_large's maximum of 1024" in reason


def test_option_runs_are_their_own_mode_with_the_eager_baseline_beside_them():
    from neusight.e2e_eval import label_frame, render_markdown

    base = {"device": "l4", "gpu_dir": "NVIDIA_L4", "model": "gpt2_large", "seq_len": 1024, "batch_size": 4,
            "measured_ms": 100.0, "predicted_ms": 110.0, "error_pct": 10.0, "roofline_ms": 70.0,
            "roofline_error_pct": -30.0, "config": "c", "path": "p"}
    rows = pd.DataFrame([{**base, "mode": "inference", "option": None},
                         {**base, "mode": "inference", "option": "fusion", "error_pct": 5.0, "eager_error_pct": 40.0}])
    labels = label_frame(rows)
    assert list(labels["mode"]) == ["inference", "inference+fusion"]
    md = render_markdown(labels, trained_on=())
    assert "### NeuSight (this predictor): inference+fusion, signed % error" in md
    assert "### Without the fusion model (the same runs as eager kernels): inference+fusion" in md
    assert "+40.0" in md and "Without the fusion model (the same runs as eager kernels): inference," not in md


def test_throughput_unit_follows_the_model_kind():
    img = neusight.predict("resnet18", "t4", batch_size=8, memory=False)
    assert img.throughput == (pytest.approx(8 / (img.latency_ms / 1e3)), "images/s")
    lm = neusight.predict("gpt2", "t4", batch_size=2, seq_len=32, memory=False)
    assert lm.throughput == (pytest.approx(64 / (lm.latency_ms / 1e3)), "tokens/s")
    mod = neusight.predict(nn.Linear(16, 4), "t4", batch_size=3, input_shapes=[(16,)], memory=False)
    assert mod.throughput[1] == "samples/s"


def test_host_bound_note_fires_below_the_threshold_only():
    from neusight.api import HOST_BOUND_US, host_bound_note

    assert host_bound_note(100 * HOST_BOUND_US / 1000 * 0.99, 100) is not None
    assert host_bound_note(100 * HOST_BOUND_US / 1000 * 1.01, 100) is None
    assert host_bound_note(1.0, 0) is None
    small = neusight.predict("resnet50", "v100-sxm2-16gb", batch_size=1, memory=False)
    big = neusight.predict("resnet50", "v100-sxm2-16gb", batch_size=64, memory=False)
    assert any("host" in n and "not modelled" in n for n in small.notes)
    assert not any("host (CPU)" in n for n in big.notes)


def test_a_gpu_beyond_the_training_gpus_descriptors_is_said_to_be_extrapolated():
    """H100's compute capability and board power lie outside the training GPUs'; the forecast says so, names
    both with their ranges, and its GEMM kernels carry them in ``beyond_training``. A training GPU gets no
    such note, and a sweep-sized GEMM on it is inside every range while a far larger one is beyond it."""
    from neusight.api import load_predictor
    from neusight.dataset import kernel_frame

    h100 = neusight.predict("gpt2", "h100-sxm5-80gb", batch_size=2, seq_len=256, memory=False)
    note = [n for n in h100.notes if "outside the range of the GPUs" in n]
    assert len(note) == 1 and "compute capability 9.0" in note[0] and "board power 700 W" in note[0]
    gemm = h100.kernels["family"].isin(["linear", "bmm"])
    assert h100.kernels.loc[gemm, "beyond_training"].str.contains("compute_capability").all()
    assert not h100.kernels.loc[~gemm, "beyond_training"].str.contains("compute_capability").any()
    t4 = neusight.predict("gpt2", "t4", batch_size=2, seq_len=256, memory=False)
    assert not any("outside the range of the GPUs" in n for n in t4.notes)
    assert load_predictor(None, "t4").device_extrapolation("t4") == []
    rows = kernel_frame(pd.DataFrame({"OPName": ["linear", "linear"], "Device": ["Tesla T4"] * 2, "B": [1, 1],
                                      "M": [512, 65536], "N": [512, 16384], "K": [512, 16384]}), measured=False)
    beyond = load_predictor(None, "t4").predict(rows, "t4")["beyond_training"].tolist()
    assert beyond[0] == "" and "log2_roofline" in beyond[1].split(",")


def test_fp32_gemms_bounded_below_the_spec_peak_are_said_to_be():
    """A GPU whose SGEMM cannot fill its FP32 lanes (neusight.tiles.sgemm_lane_fraction) gets a note with the share
    of the forecast its FP32 GEMMs take and the fraction counted: 0.9 on Hopper, 0.5 on Ada; none on a 16-lane GPU,
    nor when the GEMMs run on tensor cores (FP16)."""
    from neusight.api import sgemm_lanes_note

    def lanes(p):
        return [n for n in p.notes if "FP32 lanes per scheduler" in n]

    h100 = neusight.predict("gpt2", "h100-sxm5-80gb", batch_size=2, seq_len=256, memory=False)
    (note,) = lanes(h100)
    k = h100.kernels
    gemm = k["family"].isin(["linear", "bmm"])
    share = 100 * k.loc[gemm, "latency_ms"].sum() / k["latency_ms"].sum()
    assert note.startswith(f"{share:.0f} % of this forecast is FP32 GEMMs (bmm, linear), bounded at 0.9 of")
    assert "docs/sgemm-public.md" in note
    assert "bounded at 0.5 of rtx-4090's 82.6" in lanes(neusight.predict("gpt2", "rtx-4090", batch_size=2, seq_len=256,
                                                                          memory=False))[0]
    assert lanes(neusight.predict("gpt2", "a100-pcie-40gb", batch_size=2, seq_len=256, memory=False)) == []
    assert lanes(neusight.predict("gpt2", "h100-sxm5-80gb", batch_size=2, seq_len=256, dtype="float16",
                                  memory=False)) == []
    assert sgemm_lanes_note(load_device("l4"), k.iloc[:0]) is None


# the same laws for the model kinds beyond the presets' transformers and CNNs: a routed mixture of experts, an
# image transformer, a recurrent network (small, so the check takes seconds; a law is "never less than x1",
# which launch-bound kernels meet with equality)
_TINY_MOE = dict(model_type="mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                 vocab_size=256)
_TINY_VIT = dict(model_type="vit", hidden_size=192, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=384, image_size=128, patch_size=8, num_labels=10)


class _TinyLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(256, 256), nn.LSTM(256, 512, batch_first=True)
        self.head = nn.Linear(512, 256)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


@pytest.mark.parametrize("kind", ["moe", "vit", "lstm"])
def test_model_laws_hold_for_moe_vit_and_lstm(tmp_path, kind):
    if kind in ("moe", "vit"):
        cfg = tmp_path / f"{kind}.json"
        cfg.write_text(json.dumps(_TINY_MOE if kind == "moe" else _TINY_VIT))
        model, kw = str(cfg), {"seq_len": 128} if kind == "moe" else {}
    else:
        model, kw = _TinyLSTM(), {"seq_len": 32, "input_shapes": [(("seq",), torch.long)]}
    for device in ("t4", "h100-sxm5-80gb"):
        ms = {(mode, b): neusight.predict(model, device, batch_size=b, mode=mode, memory=False, **kw).latency_ms
              for mode in ("inference", "training") for b in (16, 32)}
        for b in (16, 32):
            assert ms["training", b] > ms["inference", b]
        for mode in ("inference", "training"):
            assert 1.0 <= ms[mode, 32] / ms[mode, 16] <= 2.2, (device, mode, ms)
        assert ms["training", 32] > ms["training", 16]

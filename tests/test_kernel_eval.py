"""neusight-evaluate-kernels and neusight.kernel_eval: error statistics, the baseline, the app end to end on a
few hundred rows, and its one-line errors. The full run (all rows, leave-one-GPU-out) is the app's job:
``neusight-evaluate-kernels logo=true out_md=docs/kernels.md``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from neusight.cli.common import CONF_DIR
from neusight.cli.evaluate_kernels import run
from neusight.dataset import load_kernel_traces
from neusight.errors import InputError
from neusight.kernel_eval import (METHODS, GBRConfig, RawFeatureGBR, error_table, leave_one_gpu_out,
                                  predictor_config_from_checkpoint, subsample)
from neusight.predictor.mlp import MLPConfig
from neusight.predictor.model import Predictor, PredictorConfig

from .conftest import DATASET, need_shared

KERNELS = DATASET / "kernels"
LARGE_LN = KERNELS / "nvidia-large-shapes" / "ln.csv"
TRAIN_LN = KERNELS / "nvidia" / "ln"
APP = Path(sys.executable).with_name("neusight-evaluate-kernels")


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("evaluate_kernels", overrides=list(overrides))


# --- statistics --------------------------------------------------------------------------------------

def test_error_table_by_hand():
    res = pd.DataFrame({"family": "bmm", "device": ["l4", "l4"], "trained_on": False, "measured_ms": [1.0, 2.0],
                        "neusight_ms": [1.1, 1.8],    # |APE| = 10 %, 10 %
                        "roofline_ms": [0.5, 2.0],    # 50 %, 0 %
                        "gbr_ms": [3.0, 2.0]})        # 200 %, 0 %
    t = error_table(res)
    assert list(t["device"]) == ["l4", "all"] and list(t["rows"]) == [2, 2]
    r = t.iloc[0]
    assert r["neusight_mape"] == pytest.approx(10) and r["neusight_p90"] == pytest.approx(10)
    assert r["roofline_mape"] == pytest.approx(25) and r["roofline_median"] == pytest.approx(25)
    assert r["roofline_p90"] == pytest.approx(45)   # linear interpolation: 0 + 0.9 x (50 - 0)
    assert r["gbr_mape"] == pytest.approx(100) and r["gbr_p90"] == pytest.approx(180)
    assert not r["trained_on"]


def test_subsample_is_capped_deterministic_and_ordered():
    df = pd.DataFrame({"family": ["a"] * 50 + ["b"] * 5, "x": range(55)})
    one, two = subsample(df, 10, seed=3), subsample(df, 10, seed=3)
    assert one.equals(two) and list(one.index) == sorted(one.index)
    assert one.groupby("family").size().to_dict() == {"a": 10, "b": 5}
    assert subsample(df, None) is df
    with pytest.raises(InputError):
        subsample(df, 0)


# --- baseline and leave-one-GPU-out -----------------------------------------------------------------

@pytest.fixture(scope="module")
def ln_train() -> pd.DataFrame:
    need_shared(TRAIN_LN)
    return subsample(load_kernel_traces(TRAIN_LN, devices=["t4", "p4"]), 200)


def test_gbr_baseline_fits_and_predicts(ln_train):
    gbr = RawFeatureGBR(GBRConfig(max_iter=30)).fit(ln_train)
    pred = gbr.predict(ln_train)
    assert np.isfinite(pred).all() and (pred > 0).all()
    assert np.array_equal(pred, RawFeatureGBR(GBRConfig(max_iter=30)).fit(ln_train).predict(ln_train))
    # within the training distribution a log-space regressor gets the order of magnitude right
    assert np.median(np.abs(np.log(pred / ln_train["latency_ms"]))) < np.log(2)
    with pytest.raises(InputError, match="no model for family 'bmm'"):
        gbr.predict(ln_train.assign(family="bmm"))


def test_checkpoint_hyper_parameters_are_read_from_its_manifest():
    pred = Predictor.load()
    cfg = predictor_config_from_checkpoint(pred)
    assert set(cfg.families) == set(pred.manifest_["families"])
    for fam, spec in pred.manifest_["families"].items():
        assert cfg.families[fam].hidden == tuple(spec["config"]["hidden"])
        assert cfg.families[fam].epochs == spec["config"]["epochs"]


def test_tiny_leave_one_gpu_out(ln_train):
    large = load_kernel_traces(need_shared(LARGE_LN), devices=["t4", "p4"])
    tiny = MLPConfig(hidden=(8,), epochs=2, patience=1, batch_size=128)
    table = leave_one_gpu_out(ln_train, large, PredictorConfig(families={"layernorm": tiny, "elementwise": tiny}),
                              GBRConfig(max_iter=10))
    assert set(zip(table["held_out"], table["split"])) == {(g, s) for g in ("p4", "t4") for s in ("sweep", "large")}
    assert (table["family"] == "layernorm").all()
    held = table.set_index(["held_out", "split"])["rows"]
    assert held["t4", "sweep"] == (ln_train["device"] == "t4").sum()
    assert held["p4", "large"] == (large["device"] == "p4").sum()
    assert np.isfinite(table[[f"{m}_mape" for m in METHODS]].to_numpy()).all()


# --- the app ---------------------------------------------------------------------------------------

def test_default_config_composes():
    cfg = _compose()
    assert Path(cfg.data.traces[0]).name == "nvidia-large-shapes"
    assert Path(cfg.data.train_traces[0]).name == "nvidia" and len(cfg.data.train_devices) == 5
    assert cfg.checkpoint is None and cfg.logo is False and cfg.max_rows_per_family is None


def test_app_runs_end_to_end_on_a_subset(tmp_path):
    need_shared(LARGE_LN)
    md = tmp_path / "docs" / "kernels.md"
    cfg = _compose(f"data.traces=[{LARGE_LN}]", f"data.train_traces=[{TRAIN_LN}]", "max_rows_per_family=200",
                   "gbr.max_iter=30", f"out_md={md}")
    ev, written = run(cfg, tmp_path / "run", command="neusight-evaluate-kernels (test)")
    out = tmp_path / "run"
    assert {p.name for p in written} >= {"results.csv", "summary.csv", "summary.md", "scatter_layernorm.png",
                                         "kernels.md"}
    res = pd.read_csv(out / "results.csv")
    assert len(res) == 200 and set(res["family"]) == {"layernorm"}
    assert {"measured_ms", "neusight_ms", "roofline_ms", "gbr_ms", "waves", "utilization"} <= set(res.columns)
    assert (res["neusight_ms"] >= res["roofline_ms"]).all()
    assert set(res.loc[~res["trained_on"], "device"]) == {"l4"}          # the one GPU never trained on
    summ = pd.read_csv(out / "summary.csv")
    assert set(summ["device"]) == set(res["device"]) | {"all"}
    assert summ.loc[summ["device"] == "all", "rows"].item() == 200
    text = (out / "summary.md").read_text()
    assert md.read_text() == text
    assert "### layernorm" in text and "neusight-evaluate-kernels (test)" in text and "at most 200 rows" in text
    assert (out / "scatter_layernorm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if not APP.exists():
        pytest.skip(f"console script {APP} not installed (pip install -e .)")
    return subprocess.run([str(APP), f"hydra.run.dir={cwd / 'run'}", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_nonexistent_trace_path_exits_2_with_one_line(tmp_path):
    res = _cli("data.traces=[/nonexistent/kernels.csv]", "plots=false", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/nonexistent/kernels.csv" in lines[0], res.stderr
    assert "Traceback" not in res.stdout + res.stderr


def test_unknown_option_exits_2(tmp_path):
    res = _cli("max_rows=3", cwd=tmp_path)
    assert res.returncode == 2 and "max_rows" in res.stderr



def test_amd_kernels_are_scored_by_the_amd_predictor_by_default():
    need_shared(DATASET)
    from neusight.kernel_eval import evaluate_kernels

    ev = evaluate_kernels([KERNELS / "amd" / "ln"], max_rows_per_family=100, gbr=GBRConfig(max_iter=20))
    assert ev.info["checkpoint"] == "data/predictor-amd (shipped)"
    assert ev.info["predictor_train_devices"] == ["mi100", "mi210"] == ev.info["train_devices"]
    assert ev.results["trained_on"].all()          # its own training GPUs: in-sample, and marked so


def test_nvidia_and_amd_kernels_together_are_each_scored_by_their_vendors_predictor(tmp_path):
    """One folder with both vendors' kernels: every GPU gets the predictor neusight.predict would use for it."""
    need_shared(DATASET)
    import neusight
    from neusight.kernel_eval import evaluate_kernels

    l4 = pd.read_csv(LARGE_LN)
    l4 = l4[l4["Device"] == "NVIDIA L4"].head(20)
    mi210 = pd.read_csv(KERNELS / "amd" / "ln" / "AMD_Instinct_MI210.csv").head(20)
    l4.to_csv(tmp_path / "l4.csv", index=False)
    mi210.to_csv(tmp_path / "mi210.csv", index=False)
    ev = evaluate_kernels([tmp_path], max_rows_per_family=100, gbr=GBRConfig(max_iter=20))
    assert "data/predictor-amd" in ev.info["checkpoint"]
    res = ev.results.set_index("device")
    assert bool(res.loc["mi210", "trained_on"].all()) and not bool(res.loc["l4", "trained_on"].any())
    for dev, raw in (("l4", l4), ("mi210", mi210)):   # the same numbers as the vendor's shipped predictor
        np.testing.assert_allclose(np.sort(res.loc[dev, "neusight_ms"].to_numpy(float)),
                                   np.sort(neusight.predict_kernel_table(raw).to_numpy(float)), rtol=1e-9)

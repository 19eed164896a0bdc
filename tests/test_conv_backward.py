"""Convolution-gradient factors (neusight.conv_backward): the DeepBench conv loader, the kernel classes, the
factors' effect on a prediction (laws), their fit, and their checks in a checkpoint.

No number here is a measured accuracy: those live in docs/deepbench.md (scripts/bench_deepbench.py).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import neusight
from neusight.conv_backward import base_forecast, fit_factors, forecast, ratio_sums
from neusight.dataset import load_deepbench_conv
from neusight.errors import CheckpointError, DataError
from neusight.kernels.ops_gemm import conv2d_pass_kernels
from neusight.predictor.features import CONV_BACKWARD_CLASSES, conv_backward_class
from neusight.predictor.model import SHIPPED, Predictor, scale_work

from .conftest import SHARED, need_shared

DEEPBENCH_CONV = SHARED / "datasets" / "public-benchmarks" / "deepbench_conv.csv"
HEADER = ("gpu,precision,N,C,H,W,K,R,S,pad_h,pad_w,stride_h,stride_w,fwd_ms,bwd_data_ms,bwd_filter_ms\n")


@pytest.fixture(scope="module")
def shipped() -> Predictor:
    return Predictor.load()


@pytest.fixture(scope="module")
def deepbench() -> pd.DataFrame:
    return load_deepbench_conv(need_shared(DEEPBENCH_CONV))


# --------------------------------------------------------------------------------------- kernels, classes

def test_pass_kernels_are_the_traced_ones():
    """conv2d_pass_kernels gives what tracing a training step of the same conv gives, strided or not."""
    for stride in (1, 2):
        conv = torch.nn.Conv2d(64, 128, 3, stride=stride, padding=1, bias=False)
        # a 1x1 conv in front, so that the input of the conv under test needs a gradient
        g = neusight.trace(torch.nn.Sequential(torch.nn.Conv2d(16, 64, 1), conv), batch_size=8, mode="training",
                           input_shapes=[(16, 28, 28)], optimizer=None)
        ours = conv2d_pass_kernels(8, 64, 28, 28, 128, 3, 3, stride=(stride, stride), padding=(1, 1))
        k = g.kernels
        traced = k[(k["family"] == "conv") & (k["flops"] == ours["fwd"].flops)]
        assert sorted(traced["kernel"]) == sorted(k.name for k in ours.values())
        for k in ours.values():
            row = traced[traced["kernel"] == k.name].iloc[0]
            assert tuple(row["dims"]) == k.dims and row["flops"] == k.flops and row["bytes"] == k.bytes


def test_transposed_conv_data_gradient_is_not_a_strided_gradient():
    """A strided transposed conv's data gradient is an ordinary strided forward conv (no strided-gradient
    factor); its weight gradient is a strided conv's."""
    m = torch.nn.Sequential(torch.nn.Conv2d(8, 64, 1), torch.nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1))
    g = neusight.trace(m, batch_size=4, mode="training", input_shapes=[(8, 16, 16)], optimizer=None)
    back = g.kernels[(g.kernels["family"] == "conv") & (g.kernels["phase"] == "backward")]
    big = back[back["flops"] == back["flops"].max()]
    assert sorted(big["kernel"]) == ["conv_dgrad", "conv_wgrad_strided"]


def test_impossible_pass_kernels_are_refused():
    with pytest.raises(ValueError, match="impossible convolution"):
        conv2d_pass_kernels(1, 3, 4, 4, 8, 7, 7)   # a 7x7 filter on a 4x4 input without padding


def test_gradient_classes():
    kinds = {}
    for stride, r in ((1, 3), (2, 3), (1, 1), (2, 1), (1, 5)):
        for part, k in conv2d_pass_kernels(4, 32, 16, 16, 32, r, r, stride=(stride, stride), padding=(r // 2, r // 2)).items():
            frame = pd.DataFrame([{"family": k.family.value, "kernel": k.name, "flops": k.flops, "algo_flops": k.algo_flops}])
            kinds[(part, stride, r)] = conv_backward_class(frame).iloc[0]
    assert {v for (part, _, _), v in kinds.items() if part == "fwd"} == {""}
    for part in ("dgrad", "wgrad"):
        assert kinds[(part, 1, 3)] == f"{part}_winograd"
        assert kinds[(part, 2, 3)] == kinds[(part, 2, 1)] == f"{part}_strided"
        assert kinds[(part, 1, 1)] == kinds[(part, 1, 5)] == part
    assert set(kinds.values()) - {""} == set(CONV_BACKWARD_CLASSES)


# --------------------------------------------------------------------------------------- the loader

def test_deepbench_conv_loads_every_pass(deepbench):
    assert set(deepbench["pass"]) == {"fwd", "dgrad", "wgrad"}
    assert {"v100-sxm2-16gb", "t4", "p100-pcie-16gb", "titan-xp", "gtx-titan-x"} <= set(deepbench["device"])
    assert set(conv_backward_class(deepbench)) == {"", *CONV_BACKWARD_CLASSES}
    assert (deepbench["latency_ms"] > 0).all() and deepbench[["B", "M", "N", "K", "flops", "bytes"]].notna().all().all()
    # passes the table has no time for (some data gradients) are skipped, the rest of their shape kept
    fwd = deepbench[deepbench["pass"] == "fwd"].groupby("device").size()
    dgrad = deepbench[deepbench["pass"] == "dgrad"].groupby("device").size()
    assert (dgrad <= fwd).all() and (dgrad < fwd).any()
    # each row carries its channel alignment (the tensor-core rule of FP16 convolutions; docs/deepbench.md)
    expected = [next(a for a in (8, 4, 2, 1) if c % a == 0 and k % a == 0)
                for c, k in zip(deepbench["conv_c"], deepbench["conv_k"])]
    assert deepbench["channel_align"].tolist() == expected and {1.0, 8.0} <= set(expected)


def test_deepbench_conv_skips_and_counts(tmp_path, caplog):
    csv = tmp_path / "conv.csv"
    csv.write_text(HEADER + "T4-16GB,fp32,8,64,28,28,64,3,3,1,1,1,1,0.5,0.6,\n"      # no weight-gradient time
                            "Voodoo 5,fp32,8,64,28,28,64,3,3,1,1,1,1,0.5,0.6,0.7\n"   # unknown GPU
                            "T4-16GB,fp32,8,64,4,4,64,7,7,0,0,1,1,0.5,0.6,0.7\n"      # empty output
                            "T4-16GB,fp32,8,64,28,28,64,1,1,0,0,1,1,0,0.6,0.7\n")     # zero time
    with caplog.at_level(logging.WARNING, logger="neusight.dataset"):
        df = load_deepbench_conv(csv)
    assert sorted(df["pass"]) == ["dgrad", "dgrad", "fwd", "wgrad"]
    assert "missing_value" in caplog.text and "unknown_device" in caplog.text and "non_positive_dims" in caplog.text
    assert "non_positive_latency" in caplog.text


@pytest.mark.parametrize("text, match", [
    ("gpu,precision,N,C\nT4-16GB,fp32,1,1\n", r"missing required column\(s\) \['H'"),
    (HEADER + "Voodoo 5,fp32,8,64,28,28,64,3,3,1,1,1,1,0.5,0.6,0.7\n", "no usable rows"),
])
def test_deepbench_conv_bad_files(tmp_path, text, match):
    csv = tmp_path / "conv.csv"
    csv.write_text(text)
    with pytest.raises(DataError, match=match):
        load_deepbench_conv(csv)


# --------------------------------------------------------------------------------------- factors in a prediction

def _shipped_with(factors: dict) -> Predictor:
    p = Predictor.load()
    p.conv_backward_ = dict(factors)
    return p


def _resnet_kernels(pred: Predictor) -> pd.DataFrame:
    return neusight.predict("resnet18", "t4", batch_size=8, mode="training", predictor=pred, memory=False).kernels


def test_factors_slow_gradients_only_and_keep_the_laws():
    plain = _resnet_kernels(_shipped_with({}))
    factors = {name: 1.5 for name in CONV_BACKWARD_CLASSES}
    slow = _resnet_kernels(_shipped_with(factors))
    grad = (conv_backward_class(plain) != "").to_numpy()
    assert grad.sum() > 10
    # everything else is untouched, bit for bit
    pd.testing.assert_series_equal(plain.loc[~grad, "latency_ms"], slow.loc[~grad, "latency_ms"])
    iso_p, iso_s = plain.loc[grad, "isolated_ms"].to_numpy(), slow.loc[grad, "isolated_ms"].to_numpy()
    over, roof = plain.loc[grad, "overhead_ms"].to_numpy(), plain.loc[grad, "roofline_ms"].to_numpy()
    np.testing.assert_allclose(iso_s, over + np.maximum(1.5 * (iso_p - over), roof), rtol=1e-12)
    assert (slow["latency_ms"] >= slow["roofline_ms"]).all() and (slow["utilization"] <= 1).all()
    assert (slow["latency_ms"] >= plain["latency_ms"]).all()


def test_factor_below_one_never_goes_below_the_roofline():
    lat, util = scale_work(np.array([1.0, 2.0]), np.array([0.01, 0.01]), np.array([0.9, 0.5]), 0.2)
    assert (lat >= np.array([0.9, 0.5]) + 0.01).all() and (util <= 1).all()
    np.testing.assert_allclose(lat, [0.91, 0.51])


def test_factors_are_monotone():
    rng = np.random.default_rng(0)
    work = rng.uniform(0.1, 2.0, 50)
    roof = work * rng.uniform(0.2, 1.0, 50)
    prev = None
    for f in (0.3, 0.8, 1.0, 1.7, 4.0):
        lat, _ = scale_work(work + 0.01, np.full(50, 0.01), roof, f)
        assert prev is None or (lat >= prev).all()
        prev = lat


# --------------------------------------------------------------------------------------- the fit

def test_fit_recovers_planted_factors(deepbench, shipped):
    """Measured times generated by the forecast with known factors: the fit finds them again."""
    planted = {"dgrad": 1.2, "dgrad_strided": 2.5, "dgrad_winograd": 0.8, "wgrad": 1.6, "wgrad_strided": 1.1,
               "wgrad_winograd": 3.0}
    rows = deepbench[deepbench["device"].isin(["p100-pcie-16gb", "titan-xp"])].reset_index(drop=True)
    base = base_forecast(rows, shipped)
    synthetic = rows.assign(latency_ms=forecast(base, shipped, planted))
    measured, estimated = ratio_sums(synthetic, forecast(base, shipped, planted))
    assert estimated == pytest.approx(measured, rel=1e-9)
    fitted = fit_factors(synthetic, base_forecast(synthetic, shipped), shipped, ["p100-pcie-16gb", "titan-xp"])
    assert fitted.keys() == planted.keys()
    for name, f in planted.items():
        assert fitted[name] == pytest.approx(f, rel=2e-3), name


def test_shipped_factors_and_where_they_come_from(shipped):
    """The shipped NVIDIA predictor carries one factor per class, fitted on DeepBench rows of its own training
    GPUs only (it learns from the five training GPUs and nothing else); the AMD one none (they describe cuDNN)."""
    assert set(shipped.conv_backward_) == set(CONV_BACKWARD_CLASSES)
    cal = shipped.manifest_["conv_backward_calibration"]
    assert cal["devices"] and set(cal["devices"]) <= set(shipped.train_devices_)
    assert cal["factors"] == shipped.conv_backward_
    amd = Predictor.load(SHIPPED.with_name("predictor-amd"))
    assert amd.conv_backward_ == {}


# --------------------------------------------------------------------------------------- checkpoint checks

@pytest.fixture
def ckpt(tmp_path) -> Path:
    return Path(shutil.copytree(SHIPPED, tmp_path / "predictor"))


def _edit(path: Path, factors) -> None:
    m = json.loads((path / "manifest.json").read_text())
    m["conv_backward_factors"] = factors
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("factors, match", [
    ({"dgrad": 50.0}, r"conv_backward_factors\['dgrad'\]=50.0 is not a plausible factor"),
    ({"dgrad": "fast"}, r"conv_backward_factors\['dgrad'\]='fast'"),
    ({"fgrad": 1.2}, "has class 'fgrad'"),
    ([1.2], "is not a mapping"),
])
def test_checkpoint_with_bad_factors_is_refused(ckpt, factors, match):
    _edit(ckpt, factors)
    with pytest.raises(CheckpointError, match=match):
        Predictor.load(ckpt)


def test_checkpoint_factors_round_trip(ckpt):
    _edit(ckpt, {"wgrad": 1.25})
    p = Predictor.load(ckpt)
    assert p.conv_backward_ == {"wgrad": 1.25}
    out = p.save(ckpt.with_name("again"))
    assert Predictor.load(out).conv_backward_ == {"wgrad": 1.25}


def test_training_fits_factors_only_for_nvidia_and_when_asked(shipped):
    """neusight-train's step: an AMD predictor gets no cuDNN factors, and csv='' turns the step off."""
    from omegaconf import OmegaConf

    from neusight.cli.train import TrainConfig, _fit_conv_backward

    cfg = OmegaConf.structured(TrainConfig)
    pred = Predictor.load()
    pred.conv_backward_ = {}
    assert _fit_conv_backward(cfg, pred, pd.DataFrame({"device": ["mi100", "mi210"]})) is None
    cfg.calibrate.conv_backward.csv = ""
    assert _fit_conv_backward(cfg, pred, pd.DataFrame({"device": ["t4"]})) is None
    assert pred.conv_backward_ == {}


def test_shipped_factors_are_what_the_code_fits(deepbench, shipped):
    """The manifest's factors regenerate: fitting again on the same GPUs gives them back."""
    from neusight.conv_backward import fit_conv_backward

    cal = shipped.manifest_["conv_backward_calibration"]
    again = fit_conv_backward(deepbench, shipped, cal["devices"])
    assert again["factors"] == shipped.conv_backward_


def test_training_fits_on_its_own_training_gpus_by_default(deepbench):
    """Default devices: the predictor's training GPUs that DeepBench has; none of them -> no factors."""
    from omegaconf import OmegaConf

    from neusight.cli.train import TrainConfig, _fit_conv_backward

    cfg = OmegaConf.structured(TrainConfig)
    pred = Predictor.load()
    pred.conv_backward_ = {}
    assert _fit_conv_backward(cfg, pred, pd.DataFrame({"device": ["a100-pcie-40gb", "p4"]})) is None
    assert pred.conv_backward_ == {}
    res = _fit_conv_backward(cfg, pred, pd.DataFrame({"device": ["p4", "t4", "p100-pcie-16gb"]}))
    assert res["devices"] == ["p100-pcie-16gb", "t4"] and pred.conv_backward_ == Predictor.load().conv_backward_

"""Charts are written as non-empty PNG and SVG files; the per-layer table adds up."""

from __future__ import annotations

import pandas as pd
import pytest
from torch import nn

import neusight
from neusight import plots
from neusight.devices import load_device
from neusight.errors import InputError
from neusight.memory import estimate_memory

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def kernels() -> pd.DataFrame:
    """A hand-made predicted kernel table: two transformer layers, the head, the loss and the optimizer."""
    # columns: phase, module, aten_op, family, kernel, flops, bytes, latency_ms, roofline_ms, bound, utilization
    rows = []
    for layer in (0, 1):
        p = f"transformer.h.{layer}"
        rows += [
            ("forward", f"{p}.ln_1", "aten.native_layer_norm.default", "layernorm", "layer_norm", 5e6, 8e6,
             0.010, 0.004, "memory", 0.40),
            ("forward", f"{p}.attn.c_attn", "aten.addmm.default", "linear", "gemm", 2e10, 4e7,
             0.500, 0.300, "compute", 0.60),
            ("forward", f"{p}.attn", "aten.bmm.default", "bmm", "gemm", 4e9, 3e7, 0.120, 0.060, "compute", 0.50),
            ("forward", f"{p}.attn", "aten._softmax.default", "softmax", "softmax", 1e7, 6e7,
             0.060, 0.030, "memory", 0.50),
            ("forward", f"{p}.mlp.act", "aten.gelu.default", "elementwise", "gelu", 2e7, 5e7,
             0.040, 0.025, "memory", 0.62),
            ("backward", f"{p}.attn.c_attn", "aten.mm.default", "linear", "gemm", 4e10, 8e7,
             1.000, 0.600, "compute", 0.60),
            ("backward", f"{p}.attn", "aten.clone.default", "memory", "copy", 0.0, 2e7, 0.015, 0.010, "memory", 0.66),
        ]
    rows += [("forward", "lm_head", "aten.mm.default", "linear", "gemm", 8e10, 3e8, 2.000, 1.500, "compute", 0.75),
             ("loss", "", "aten._log_softmax.default", "softmax", "log_softmax", 1e8, 6e8,
              0.300, 0.200, "memory", 0.66),
             ("optimizer", "", "aten._foreach_mul_.Scalar", "elementwise", "foreach", 1e8, 1e9,
              0.600, 0.400, "memory", 0.66)]
    cols = ["phase", "module", "aten_op", "family", "kernel", "flops", "bytes", "latency_ms", "roofline_ms", "bound",
            "utilization"]
    return pd.DataFrame(rows, columns=cols).assign(dtype="float32")


@pytest.fixture(scope="module")
def device():
    return load_device("h100-sxm5-80gb")


def _check_files(paths, stem):
    assert [p.suffix for p in paths] == [".png", ".svg"]
    for p in paths:
        assert p.stem == stem and p.stat().st_size > 1000
    assert paths[0].read_bytes()[:8] == PNG_MAGIC
    assert paths[1].read_text().lstrip().startswith("<?xml")


def test_roofline_chart(kernels, device, tmp_path):
    _check_files(plots.roofline_chart(kernels, device, tmp_path / "roofline.png"), "roofline")


def test_time_roofline(kernels, device, tmp_path):
    _check_files(plots.time_roofline(kernels, device, tmp_path / "time", launch_overhead_us=4.0), "time")
    with pytest.raises(InputError, match="launch_overhead_us"):
        plots.time_roofline(kernels, device, tmp_path / "x", launch_overhead_us=0)


def test_layer_breakdown(kernels, tmp_path):
    _check_files(plots.layer_breakdown(kernels, tmp_path / "sub" / "layers", top=3), "layers")


def test_memory_timeline(tmp_path):
    g = neusight.trace(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), batch_size=4,
                       input_shapes=[(64,)], mode="training")
    report = estimate_memory(g, "l4")
    _check_files(plots.memory_timeline(report, tmp_path / "memory.svg"), "memory")


def test_only_requested_formats(kernels, device, tmp_path):
    assert [p.name for p in plots.roofline_chart(kernels, device, tmp_path / "r", formats=("svg",))] == ["r.svg"]
    with pytest.raises(InputError, match="format"):
        plots.roofline_chart(kernels, device, tmp_path / "r", formats=("jpg",))


def test_missing_columns_are_named(kernels, device, tmp_path):
    with pytest.raises(InputError, match="latency_ms"):
        plots.roofline_chart(kernels.drop(columns="latency_ms"), device, tmp_path / "r")


@pytest.mark.parametrize("module,phase,depth,group", [
    ("transformer.h.12.attn.c_attn", "forward", None, "transformer.h.12"),
    ("layer3.1.conv2", "backward", None, "layer3.1"),
    ("lm_head", "forward", None, "lm_head"),
    ("", "optimizer", None, "(optimizer)"),
    ("", "loss", None, "(loss)"),
    ("", "forward", None, "(root)"),
    ("transformer.h.12.attn.c_attn", "forward", 4, "transformer.h.12.attn"),
])
def test_module_group(module, phase, depth, group):
    assert plots.module_group(module, phase, depth) == group


def test_layer_table(kernels):
    saved = pd.Series({"transformer.h.0.attn": 100, "transformer.h.0.mlp.act": 20})
    t = plots.layer_table(kernels, saved_bytes=saved)
    # program order: two layers, the head, the loss, the optimizer
    assert list(t.index) == ["transformer.h.0", "transformer.h.1", "lm_head", "(loss)", "(optimizer)"]
    # one layer: 0.010 + 0.500 + 0.120 + 0.060 + 0.040 + 1.000 + 0.015 = 1.745 ms, 1.500 of it compute-bound
    assert t.loc["transformer.h.0", "time_ms"] == pytest.approx(1.745)
    assert t.loc["transformer.h.0", "bound"] == "compute"
    assert t.loc["(optimizer)", "bound"] == "memory"
    assert t["share_pct"].sum() == pytest.approx(100.0)
    assert t.loc["transformer.h.0", "kernels"] == 7
    assert t.loc["transformer.h.0", "saved_bytes"] == 120 and t.loc["transformer.h.1", "saved_bytes"] == 0
    # a layer that saves but launches no kernel of its own keeps its bytes, in a row after the layer before it
    saved = pd.Series({"transformer.h.0.attn": 100, "transformer.drop": 7, "transformer.h.1.mlp": 3})
    t = plots.layer_table(kernels, saved_bytes=saved)
    assert list(t.index) == ["transformer.h.0", "transformer.drop", "transformer.h.1", "lm_head", "(loss)",
                             "(optimizer)"]
    assert t["saved_bytes"].sum() == 110 and t["share_pct"].sum() == pytest.approx(100.0)
    assert t.loc["transformer.drop", ["time_ms", "kernels", "bound"]].tolist() == [0.0, 0, "-"]


@pytest.mark.parametrize("key, dtype, dashed", [("h100-sxm5-80gb", "float32", "GEMM"), ("l4", "float32", "GEMM"),
                                                ("a100-pcie-40gb", "float32", None), ("h100-sxm5-80gb", "float16", None),
                                                ("a100-pcie-40gb", "tf32", "TF32"), ("v100-pcie-32gb", "tf32", None)])
def test_roofline_pictures_draw_the_gemm_roof_the_predictor_uses(key, dtype, dashed):
    # the dashed roof is the rate GEMM bounds are computed with, drawn only where it differs from the spec peak
    from neusight.tiles import device_rates

    dev = load_device(key)
    kernels = pd.DataFrame({"family": ["conv", "elementwise"], "dtype": [dtype, "float32"]})
    peak = dev.peak_flops("float32" if dtype == "tf32" else dtype)
    roof = plots._gemm_roof(dev, kernels, peak)
    assert (roof[1].split()[0] if roof else None) == dashed
    if dashed:
        assert roof[0] == device_rates(dev, dtype).gemm_flops != peak


def test_chrome_trace_lays_the_kernels_back_to_back_and_spans_the_phases(tmp_path):
    import json

    p = neusight.predict("gpt2", "t4", batch_size=2, seq_len=64, mode="training", memory=False)
    p.to_chrome_trace(tmp_path / "timeline.json")
    trace = json.loads((tmp_path / "timeline.json").read_text())
    kernels = [e for e in trace["traceEvents"] if e.get("tid") == 1 and e["ph"] == "X"]
    phases = {e["name"]: e for e in trace["traceEvents"] if e.get("tid") == 0 and e["ph"] == "X"}
    assert len(kernels) == len(p.kernels) and set(phases) == set(p.phases)
    assert kernels[0]["ts"] == 0.0
    for a, b in zip(kernels, kernels[1:]):          # back to back, in program order
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"])
    assert kernels[-1]["ts"] + kernels[-1]["dur"] == pytest.approx(p.latency_ms * 1e3)
    for name, ms in p.phases.items():               # each phase span holds its kernels' time
        assert phases[name]["dur"] == pytest.approx(ms * 1e3)
    assert {"dims", "bound", "utilization", "module"} <= set(kernels[0]["args"])

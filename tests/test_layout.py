"""Convolution layouts: which convolutions cuDNN gets in NCHW, and the transposes that costs on tensor cores
(neusight.graph.layout)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import neusight
from neusight.api import predict_graph
from neusight.errors import InputError
from neusight.graph.layout import TO_NHWC, TRANSPOSE_KERNELS
from neusight.graph.records import TensorMeta
from neusight.kernels.ops_gemm import _channels_last, _nchw_operands


@pytest.fixture(scope="module")
def amp_graphs():
    """ResNet-18 mixed-precision training, traced in either layout."""
    return {mf: neusight.trace("resnet18", batch_size=4, mode="training", optimizer="sgd", amp="float16",
                               memory_format=mf) for mf in ("contiguous", "channels_last")}


def _meta(shape, memory_format=torch.contiguous_format) -> TensorMeta:
    return TensorMeta.of(torch.empty(shape, device="meta").to(memory_format=memory_format))


def test_channels_last_is_read_from_strides_as_pytorch_reads_them():
    cl = torch.channels_last
    assert _channels_last(_meta((8, 64, 56, 56), cl)) and not _channels_last(_meta((8, 64, 56, 56)))
    # a 1x1 weight is dense either way; its strides still tell the layouts apart
    assert _channels_last(_meta((256, 64, 1, 1), cl)) and not _channels_last(_meta((256, 64, 1, 1)))
    # strides that fit both layouts (a contiguous N x C x 1 x 1) read as the default NCHW, as in PyTorch; 5-D tensors
    # have their own channels-last
    assert not _channels_last(_meta((8, 2048, 1, 1))) and _channels_last(_meta((8, 2048, 1, 1), cl))
    assert not _channels_last(_meta((8, 1, 32, 32))) and not _channels_last(_meta((8, 64)))
    assert _channels_last(_meta((2, 16, 4, 8, 8), torch.channels_last_3d))
    # PyTorch runs a 2-D convolution channels-last when its input or its weight is; 1-D convolutions never
    x, w, y = _meta((8, 64, 56, 56)), _meta((64, 64, 3, 3)), _meta((8, 64, 56, 56))
    assert _nchw_operands(x, w, y) == (8 * 64 * 56 * 56, 64 * 64 * 9, 8 * 64 * 56 * 56)
    assert _nchw_operands(x, _meta((64, 64, 3, 3), cl), y) is None
    assert _nchw_operands(_meta((8, 64, 56, 56), cl), w, y) is None
    assert _nchw_operands(_meta((8, 64, 100)), _meta((64, 64, 3)), _meta((8, 64, 98))) is not None


def test_the_trace_records_each_convolutions_layout(amp_graphs):
    nchw, nhwc = (g.kernels for g in amp_graphs.values())
    conv = nchw["family"] == "conv"
    assert conv.any() and nchw.loc[conv, "nchw_operands"].map(lambda o: isinstance(o, tuple)).all()
    assert nchw.loc[~conv, "nchw_operands"].isna().all()
    stem = nchw[conv & (nchw["module"] == "conv1") & (nchw["kernel"] == "conv_fwd")].iloc[0]
    assert stem["nchw_operands"] == (4 * 3 * 224 * 224, 64 * 3 * 7 * 7, 4 * 64 * 112 * 112)
    # the operands are the forward convolution's for its gradient kernels too
    ops = nchw[conv & (nchw["module"] == "layer1.0.conv1")]
    assert ops["nchw_operands"].nunique() == 1 and len(ops) == 3
    assert nhwc.loc[nhwc["family"] == "conv", "nchw_operands"].isna().all()
    assert amp_graphs["channels_last"].memory_format == "channels_last"
    # the layout changes no kernel's work: the same kernels, FLOPs and bytes
    pd.testing.assert_frame_equal(nchw.drop(columns="nchw_operands"), nhwc.drop(columns="nchw_operands"))


def test_nchw_tensor_core_convolutions_get_transposes_of_their_operands(amp_graphs):
    p = predict_graph(amp_graphs["contiguous"], "v100-sxm2-16gb")
    k = p.kernels
    t = k["kernel"].isin(TRANSPOSE_KERNELS)
    conv = k["family"] == "conv"
    # every convolution on tensor cores (all but the 3-channel first layer's) gets three: two operands in, one out
    tc = conv & (k["channel_align"] >= 8)
    assert t.sum() == 3 * tc.sum() and (k.loc[t, "kernel"] == TO_NHWC).sum() == 2 * tc.sum()
    assert not (conv & (k["channel_align"] < 8) & k["op_index"].isin(k.loc[t, "op_index"]) &
                (k["module"] == "conv1")).any()
    for i in k.index[tc]:
        rows = k.loc[i + 1:i + 3]   # right after their convolution, in its op, phase and module
        assert list(rows["kernel"].isin(TRANSPOSE_KERNELS)) == [True] * 3
        assert (rows[["op_index", "phase", "module"]] == k.loc[i, ["op_index", "phase", "module"]]).all().all()
        assert rows["bytes"].sum() == 2 * 2 * sum(k.loc[i, "nchw_operands"])   # each read and written, FP16
        assert (rows["family"] == "elementwise").all() and (rows["flops"] == 0).all()
    # they only add time: the channels-last run is the same kernels without them
    q = predict_graph(amp_graphs["channels_last"], "v100-sxm2-16gb")
    assert not q.kernels["kernel"].isin(TRANSPOSE_KERNELS).any()
    assert math.isclose(p.latency_ms, q.latency_ms + k.loc[t, "latency_ms"].sum(), rel_tol=1e-9)
    assert p.latency_ms > q.latency_ms
    assert (k["isolated_ms"] >= k["roofline_ms"]).all()
    assert (p.to_dict()["memory_format"], p.to_dict()["layout_transposes"]) == ("contiguous", int(t.sum()))
    assert (q.to_dict()["memory_format"], q.to_dict()["layout_transposes"]) == ("channels_last", 0)
    note = [n for n in p.notes if "NCHW" in n]
    assert len(note) == 1 and note[0].startswith(f"{tc.sum()} FP16 / BF16 convolution kernels")
    assert not any("NCHW" in n for n in q.notes)


@pytest.mark.parametrize("device, trace_kwargs, why", [
    ("p100-pcie-16gb", {"amp": "float16"}, "no tensor cores"),
    ("mi210", {"amp": "float16"}, "MIOpen: not modelled"),
    ("a100-pcie-40gb", {}, "FP32 / TF32: not modelled"),
    ("v100-sxm2-16gb", {"amp": "bfloat16"}, "no BF16 tensor cores before Ampere"),
    ("a100-pcie-40gb", {"amp": "float16", "memory_format": "channels_last"}, "NHWC already"),
])
def test_no_transposes_where_cudnn_runs_no_nchw_tensor_core_kernel(device, trace_kwargs, why):
    g = neusight.trace("resnet18", batch_size=2, mode="training", optimizer="sgd", **trace_kwargs)
    assert not predict_graph(g, device).kernels["kernel"].isin(TRANSPOSE_KERNELS).any(), why


def test_bf16_convolutions_transpose_on_ampere():
    g = neusight.trace("resnet18", batch_size=2, mode="inference", dtype="bfloat16")
    k = predict_graph(g, "a100-pcie-40gb").kernels
    t = k["kernel"].isin(TRANSPOSE_KERNELS)
    assert t.any() and (k.loc[t, "dtype"] == "bfloat16").all()


def test_torch_compile_runs_resnets_channels_last_and_charges_no_transposes(amp_graphs):
    """Inductor's layout optimization picks channels-last for a ResNet's convolutions (training and inference), so a
    compiled NCHW model pays no transposes, and says why; eager forecasts of the same graph keep them."""
    p = predict_graph(amp_graphs["contiguous"], "a100-pcie-40gb", fused=True)
    assert not p.kernels["kernel"].isin(TRANSPOSE_KERNELS).any()
    assert any(n.startswith("torch.compile runs this graph's convolutions channels-last") for n in p.notes)
    assert predict_graph(amp_graphs["contiguous"], "a100-pcie-40gb").kernels["kernel"].isin(TRANSPOSE_KERNELS).any()
    # FP32 has no transposes to spare: no note
    g32 = neusight.trace("resnet18", batch_size=2, mode="inference")
    assert not any("torch.compile runs" in n for n in predict_graph(g32, "v100-sxm2-16gb", fused=True).notes)


def _conv_net(*convs):
    """An nn.Sequential of 2-D convolutions (c_in, c_out, kernel, groups) on a 16 x 16 image."""
    return torch.nn.Sequential(*(torch.nn.Conv2d(i, o, k, padding=k // 2, groups=grp) for i, o, k, grp in convs))


@pytest.mark.parametrize("convs, mode, expected", [
    ([(64, 128, 3, 1), (128, 128, 3, 1)], "training", True),                   # plain convolutions
    ([(64, 128, 3, 1), (128, 128, 3, 32)], "training", False),                 # grouped, 4 channels per group
    ([(128, 128, 3, 128)], "training", True),                                   # depthwise: 1 channel per group
    ([(256, 64, 3, 1), (64, 256, 1, 1)], "training", False),                    # 3x3 halving the channels
    ([(32, 64, 3, 1), (64, 32, 3, 1)], "training", False),                      # all small
    ([(64, 128, 3, 1), (128, 128, 3, 32)], "inference", True),                  # grouped, but a minority of the FLOPs
    ([(64, 128, 1, 1), (128, 128, 3, 32), (128, 128, 3, 32)], "inference", False),   # grouped FLOPs dominate
])
def test_inductor_layout_heuristic(convs, mode, expected):
    from neusight.graph.layout import inductor_channels_last

    g = neusight.trace(_conv_net(*convs), batch_size=2, mode=mode, input_shapes=[(convs[0][0], 16, 16)],
                       optimizer=None)
    assert inductor_channels_last(g) is expected


def test_an_unknown_memory_format_is_refused_with_the_choices():
    with pytest.raises(InputError, match=r"memory_format='nhwc'.*'contiguous'.*'channels_last'"):
        neusight.trace("resnet18", batch_size=2, memory_format="nhwc")


def test_layout_pairs_compare_measured_and_forecast_slow_downs():
    from neusight.e2e_eval import layout_pairs

    base = {"source_name": "DeepLearningExamples", "gpu": "v100-sxm2-16gb", "model": "resnet50", "mode": "training",
            "precision": "amp", "batch": 256, "image_size": 224}
    res = pd.DataFrame([{**base, "memory_format": "contiguous", "measured_ms": 300.0, "predicted_ms": 290.0,
                         "version": "old"},
                        {**base, "memory_format": "channels_last", "measured_ms": 200.0, "predicted_ms": 220.0,
                         "version": "new"},
                        {**base, "batch": 128, "memory_format": "contiguous", "measured_ms": 1.0, "predicted_ms": 1.0,
                         "version": "old"}])   # no NHWC partner: no pair
    pairs = layout_pairs(res)
    assert len(pairs) == 1
    row = pairs.iloc[0]
    assert row["measured_ratio"] == 1.5 and math.isclose(row["forecast_ratio"], 290 / 220)
    assert math.isclose(row["ratio_error_pct"], (290 / 220 / 1.5 - 1) * 100)
    assert layout_pairs(res.iloc[:0]).empty


def test_the_transposed_copies_are_cudnn_workspace_while_the_convolution_runs():
    """cuDNN allocates nothing itself: the NHWC copies of an NCHW convolution's operands live in the workspace PyTorch
    hands it, for the duration of that convolution. A lone FP16 convolution's peak grows by exactly their bytes."""
    from neusight.memory import estimate_memory

    conv = torch.nn.Conv2d(64, 128, 3, padding=1, bias=False).half()
    x, w, y = 8 * 64 * 32 * 32, 128 * 64 * 9, 8 * 128 * 32 * 32
    peaks = {mf: estimate_memory(neusight.trace(conv, batch_size=8, input_shapes=[(64, 32, 32)], dtype="float16",
                                                memory_format=mf), "v100-sxm2-16gb", allocator="exact")
             for mf in ("contiguous", "channels_last")}
    assert peaks["contiguous"].tensor_peak_bytes - peaks["channels_last"].tensor_peak_bytes == 2 * (x + w + y)
    assert peaks["contiguous"].where["aten_op"].startswith("aten.convolution")
    # no transposes, no copies: a GPU without tensor cores, or no GPU at all
    g = neusight.trace(conv, batch_size=8, input_shapes=[(64, 32, 32)], dtype="float16")
    assert estimate_memory(g, "p100-pcie-16gb", allocator="exact").tensor_peak_bytes == \
        estimate_memory(g, allocator="exact").tensor_peak_bytes == peaks["channels_last"].tensor_peak_bytes

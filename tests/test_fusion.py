"""Fused graphs (torch.compile): which kernels a group becomes, its bytes, what stays untouched, determinism,
and the fusion labels of the dataset through the evaluation protocol."""

from __future__ import annotations

import dataclasses
import shutil

import pandas as pd
import pytest
import torch
from torch import nn

import neusight
from neusight.errors import DataError
from neusight.evaluate import find_labels, predict_label
from neusight.devices import load_device
from neusight.graph.fusion import FUSED_KERNEL, REWRITTEN_ATTENTION, forget_fusion, fused_kernels
from neusight.kernels.base import ATTENTION_KERNEL
from tests.conftest import DATASET, need_shared

MEMORY_BOUND = ["elementwise", "softmax", "layernorm", "memory", "embedding", "reduction"]


class _Chain(nn.Module):
    """linear -> (x * 2 + 1).relu() -> linear: three pointwise ops between two GEMMs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * 2 + 1))


def test_a_pointwise_chain_between_gemms_becomes_one_kernel_that_reads_and_writes_once():
    g = neusight.trace(_Chain(), batch_size=8, input_shapes=[(64,)], mode="inference")
    eager, fused = g.kernels, fused_kernels(g)
    assert (eager["family"] == "elementwise").sum() == 3
    (row,) = fused[fused["kernel"] == FUSED_KERNEL].itertuples()
    # reads a's output (8 x 64 fp32 = 2048 B) once and writes what b reads (2048 B); the two intermediates
    # (2 x 2048 B written + read again in eager) never reach DRAM
    assert row.bytes == 2048 + 2048
    assert row.family == "elementwise" and row.flops == eager.loc[eager["family"] == "elementwise", "flops"].sum()
    gemms = lambda k: k[k["family"] == "linear"].drop(columns=["modeled"]).reset_index(drop=True)  # noqa: E731
    pd.testing.assert_frame_equal(gemms(eager), gemms(fused))


class _SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the silu runs between the gate and up GEMMs, its product after both."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(64, 256), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_a_pointwise_op_fuses_with_its_consumer_across_a_gemm_that_does_not_read_it():
    # Inductor schedules by dataflow, not program order: silu(gate) * up is one kernel, run after the up GEMM
    g = neusight.trace(_SwiGLU(), batch_size=8, input_shapes=[(64,)], mode="inference")
    fused = fused_kernels(g)
    (row,) = fused[fused["kernel"] == FUSED_KERNEL].itertuples()
    assert row.aten_op == "fused:silu+mul"
    assert row.bytes == 3 * 8 * 256 * 4            # reads both GEMMs' outputs, writes the product, once each
    # it runs after both GEMMs that feed it (gate, up) and before the one that reads it (down)
    assert list(fused["kernel"]) == ["addmm_tn", "addmm_tn", FUSED_KERNEL, "addmm_tn"]


class _ReadByGemm(nn.Module):
    """y = relu(a(x)); b(y) + y: the GEMM b reads relu's output, so relu must run before it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        return self.b(y) + y


def test_a_group_a_gemm_reads_never_fuses_with_kernels_after_that_gemm():
    g = neusight.trace(_ReadByGemm(), batch_size=8, input_shapes=[(64,)], mode="inference")
    fused = fused_kernels(g)
    assert not (fused["kernel"] == FUSED_KERNEL).any()
    assert len(fused) == len(g.kernels)


class _SharedInput(nn.Module):
    """A norm whose output three projections read, each through its own pointwise cast (as static FP8 casts or
    dtype conversions are), as Llama's q / k / v read their input norm's."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.q(y * 0.5 + 1) + self.k(y * 0.25 + 1) + self.v(y * 0.125 + 1)


def test_a_pointwise_op_after_a_gemm_joins_the_group_it_reads_when_it_needs_nothing_made_after_it():
    """Inductor schedules by dataflow: the k and v inputs' pointwise ops, traced after the q GEMM, need only the
    norm's output, so they run in the norm's kernel before that GEMM (Inductor's CPU code generation compiles the
    same pattern, with FP8 casts, into one kernel). The projections' own outputs are summed after all three
    GEMMs, which no such hoisting may reorder."""
    g = neusight.trace(_SharedInput(), batch_size=8, input_shapes=[(64,)], mode="inference")
    fused = fused_kernels(g)
    kinds = fused["kernel"].tolist()
    assert kinds.count(FUSED_KERNEL) == 2                  # norm + the three inputs' ops; the final sum
    first = kinds.index(FUSED_KERNEL)
    assert all(k.startswith(("addmm", "mm")) for k in kinds[first + 1:first + 4])
    # one read of x, three 8 x 64 inputs written (FP32): nothing of the norm's output itself reaches DRAM
    assert fused.iloc[first]["bytes"] == 4 * (8 * 64 + 3 * 8 * 64)


def test_a_group_with_a_reduction_stays_after_the_gemm_it_follows():
    """GPT-2's bias gradients (sums over the batch of a gradient that an earlier kernel makes) stay kernels of their
    own after the weight-gradient GEMMs, as Inductor left such a sum of a GELU gradient (not hoisted)."""
    g = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training", optimizer=None)
    fused = fused_kernels(g)
    layer = fused[fused["module"].str.contains(r"\.h\.1\.") & (fused["phase"] == "backward")]
    sums = layer[layer["kernel"].astype(str) == "sum"]
    assert set(sums["module"].str.rsplit(".", n=2).str[-2:].str.join(".")) == {
        "mlp.c_proj", "mlp.c_fc", "attn.c_proj", "attn.c_attn"}


class _RMSNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_norm_over_one_row_is_one_kernel():
    # at batch 1 the row's mean is a one-element tensor; it is data made by the trace and links the ops after it
    g = neusight.trace(_RMSNorm(), batch_size=1, input_shapes=[(4096,)], mode="inference")
    fused = fused_kernels(g)
    assert len(g.kernels) >= 4 and len(fused) == 1
    assert fused["bytes"].iloc[0] == 2 * 4096 * 4


@pytest.fixture(scope="module")
def gpt2():
    return neusight.trace("gpt2", batch_size=2, seq_len=128, mode="inference")


class _Attention(nn.Module):
    """Scores = q k^T scaled (multiplied, or divided with ``divide=True``), softmax, optional dropout, times v.
    ``mask=True`` adds a causal mask after the scale: after a multiplication, as transformers' eager GPT-2 / OPT /
    Llama attention does, no Inductor pattern takes it; after a division one does. ``zero_bias=True`` adds a tensor
    of zeros, as T5's cross-attention does."""

    def __init__(self, mask: bool = False, divide: bool = False, zero_bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv, self.mask, self.divide, self.zero_bias = nn.Linear(64, 192), mask, divide, zero_bias
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 16).transpose(1, 2) for t in self.qkv(x).split(64, dim=-1))
        scores = q @ k.transpose(-1, -2)
        scores = scores / 4.0 if self.divide else scores * 0.25
        if self.mask:
            scores = scores + torch.full((s, s), float("-inf"), device=x.device).triu(1)
        if self.zero_bias:   # T5's cross-attention adds a position bias of zeros, which Inductor folds away
            scores = scores + torch.zeros(b, 4, s, s, device=x.device)
        probs = nn.functional.dropout(scores.softmax(-1), self.dropout, self.training)
        return (probs @ v).transpose(1, 2).reshape(b, s, 64)


def test_an_unmasked_attention_chain_becomes_one_fused_attention_kernel_doing_both_gemms():
    g = neusight.trace(_Attention(), batch_size=2, input_shapes=[(32, 64)], mode="inference")
    eager, fused = g.kernels, fused_kernels(g)
    (att,) = fused[fused["aten_op"] == REWRITTEN_ATTENTION].itertuples()
    bmms = eager[eager["family"] == "bmm"]
    assert len(bmms) == 2 and att.kernel == "attention" and att.flops == bmms["flops"].sum()
    assert not (fused["family"].isin(["bmm", "softmax"]) & (fused["aten_op"] != REWRITTEN_ATTENTION)).any()
    # q, k, v and the output (2 x 4 x 32 x 16 fp32 each) once: the 32 x 32 scores never reach DRAM
    assert att.bytes == 4 * 2 * 4 * 32 * 16 * 4
    p = neusight.predict(_Attention(), "a100-pcie-40gb", batch_size=2, input_shapes=[(32, 64)], fused=True)
    assert any("scaled_dot_product_attention" in n for n in p.notes)


def test_a_causal_mask_added_after_a_multiplication_keeps_the_chain_a_divided_one_does_not():
    kept = fused_kernels(neusight.trace(_Attention(mask=True), batch_size=2, input_shapes=[(32, 64)]))
    assert (kept["family"] == "bmm").sum() == 2 and not (kept["aten_op"] == REWRITTEN_ATTENTION).any()
    divided = fused_kernels(neusight.trace(_Attention(mask=True, divide=True), batch_size=2, input_shapes=[(32, 64)]))
    assert (divided["aten_op"] == REWRITTEN_ATTENTION).sum() == 1
    zero = fused_kernels(neusight.trace(_Attention(zero_bias=True), batch_size=2, input_shapes=[(32, 64)]))
    assert (zero["aten_op"] == REWRITTEN_ATTENTION).sum() == 1 and not zero["aten_op"].str.contains("zeros").any()


@pytest.mark.parametrize(("device", "dtype", "fused"), [
    ("mi250", "float32", True), ("a100-pcie-40gb", "float32", True), ("v100-pcie-32gb", "float16", True),
    ("mi100", "float32", False), ("mi100", "float16", False), ("v100-pcie-32gb", "bfloat16", False)])
def test_a_rewritten_chain_is_one_kernel_only_where_a_fused_attention_kernel_takes_it(device, dtype, fused):
    """Inductor hands the chain to scaled_dot_product_attention, which on MI100 (no fused attention kernel in
    ROCm's PyTorch) and for BF16 before compute capability 8.0 runs its math backend: the same kernels as eager."""
    g = neusight.trace(_Attention(), batch_size=2, input_shapes=[(32, 64)], dtype=dtype)
    assert set(g.kernels.loc[g.kernels["family"] == "bmm", "dtype"]) == {dtype}
    table = fused_kernels(g, load_device(device))
    assert (table["aten_op"] == REWRITTEN_ATTENTION).sum() == int(fused)
    assert (table["family"] == "bmm").sum() == (1 if fused else 2)
    assert (fused_kernels(g)["aten_op"] == REWRITTEN_ATTENTION).sum() == 1      # no device: rewritten, as before


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize(("variant", "mode"), [({}, "inference"), ({"mask": True}, "inference"),
                                             ({"mask": True, "divide": True}, "inference"),
                                             ({"zero_bias": True}, "inference"), ({}, "training"),
                                             ({"dropout": 0.1}, "training")])
def test_the_rewrite_rule_agrees_with_inductor_compiling_the_same_module(variant, mode):
    # ground truth: Inductor itself (its patterns do not depend on the device), counting the chains it rewrites
    import torch._functorch.config
    import torch._inductor.config
    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()
    training = mode == "training"
    module = _Attention(**variant).train(training)
    # a cached graph skips the pattern pass, and its counter with it
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        with torch.set_grad_enabled(training):
            out = torch.compile(module)(torch.randn(2, 32, 64))
            if training:
                out.mean().backward()
    torch._dynamo.reset()
    # a training step's rewrite (forward and backward together) counts twice
    inductor = counters["inductor"].get("fuse_attention", 0) // (2 if training else 1)
    ours = fused_kernels(neusight.trace(_Attention(**variant), batch_size=2, input_shapes=[(32, 64)], mode=mode))
    assert (ours["kernel"] == "attention").sum() == (ours["aten_op"] == REWRITTEN_ATTENTION).sum() // (1 + training)
    assert (ours["kernel"] == "attention").sum() == inductor


def test_a_training_step_rewrites_a_chain_with_dropout_into_a_forward_and_a_backward_attention_kernel():
    # Inductor's training patterns have dropout on the scores: without it the chain stays (as Inductor leaves it)
    plain = fused_kernels(neusight.trace(_Attention(), batch_size=2, input_shapes=[(32, 64)], mode="training"))
    assert not (plain["aten_op"] == REWRITTEN_ATTENTION).any()
    g = neusight.trace(_Attention(dropout=0.1), batch_size=2, input_shapes=[(32, 64)], mode="training")
    eager, fused = g.kernels, fused_kernels(g)
    att = fused[fused["aten_op"] == REWRITTEN_ATTENTION].set_index("kernel")
    assert list(att.index) == ["attention", "attention_bwd"]
    assert list(att["phase"]) == ["forward", "backward"]
    # the forward's two GEMMs; the backward recomputes the scores: 2.5x (five GEMMs, not the eager four)
    fwd_gemms = eager.loc[(eager["family"] == "bmm") & (eager["phase"] == "forward"), "flops"].sum()
    assert att.loc["attention", "flops"] == fwd_gemms and att.loc["attention_bwd", "flops"] == 2.5 * fwd_gemms
    left = fused[fused["aten_op"] != REWRITTEN_ATTENTION]
    assert not left["family"].isin(["bmm"]).any()
    assert not left["aten_op"].str.contains("softmax|dropout").any()
    p = neusight.predict(_Attention(dropout=0.1), "a100-pcie-40gb", batch_size=2, input_shapes=[(32, 64)],
                         mode="training", fused=True)
    assert any("hands 1 attention score chains" in n for n in p.notes)   # one chain, though two kernels


def test_a_fused_attention_kernel_is_bounded_by_all_of_its_flops():
    # the same score-GEMM dims: attention does twice a GEMM's work (its backward five times), so it costs more
    rows = pd.DataFrame({"family": "bmm", "kernel": ["bmm", "attention", "attention_bwd"],
                         "dims": [(64, 512, 64, 512)] * 3, "flops": [2.0, 4.0, 10.0]})
    rows["flops"] *= 64 * 512 * 64 * 512
    rows = rows.assign(algo_flops=rows["flops"], bytes=4.0 * 64 * 3 * 512 * 64, dtype="float32")
    from neusight.api import kernel_dims
    frame = pd.concat([rows.drop(columns="dims"), kernel_dims(rows)], axis=1)
    pred = neusight.predictor.model.Predictor.load().predict(frame, "a100-pcie-40gb")
    roof = pred["roofline_ms"].to_numpy()
    assert roof[1] == pytest.approx(2 * roof[0], rel=0.1) and roof[2] == pytest.approx(5 * roof[0], rel=0.1)
    assert (pred["latency_ms"].diff().dropna() > 0).all()


def _attention_rows(heads: list[int], seq: int, dtype: str, kernel: str = "attention") -> pd.DataFrame:
    from neusight.api import kernel_dims

    gemms = 5.0 if kernel == "attention_bwd" else 2.0
    rows = pd.DataFrame({"family": "bmm", "kernel": kernel, "dims": [(16, seq, d, seq) for d in heads],
                         "flops": [2.0 * gemms * 16 * seq * seq * d for d in heads], "dtype": dtype,
                         "bytes": [4 * 16 * seq * d * 2.0 for d in heads]})
    rows["algo_flops"] = rows["flops"]
    return pd.concat([rows.drop(columns="dims"), kernel_dims(rows)], axis=1)


def test_a_fused_attention_bound_adds_its_softmax_where_tensor_cores_leave_it_behind():
    # every score's exponential (16 per clock per SM) and FP32 work: on an H100's BF16 tensor cores a large share of
    # a head-64 attention's bound, beside FP32 GEMMs on the FP32 lanes a small one
    from neusight.devices import load_device
    from neusight.tiles import softmax_seconds_per_score

    h100 = load_device("h100-sxm5-80gb")
    pred = neusight.predictor.model.Predictor.load()
    softmax_ms = 16 * 4096 * 4096 * softmax_seconds_per_score(h100) * 1e3
    share = {dtype: softmax_ms / pred.predict(_attention_rows([64], 4096, dtype), h100)["roofline_ms"].iloc[0]
             for dtype in ("bfloat16", "float32")}
    assert share["bfloat16"] > 0.4 and share["float32"] < 0.1


def test_on_tensor_memory_gpus_a_fused_attention_softmax_runs_beside_its_gemms():
    # a B200's tensor cores accumulate in tensor memory, so the softmax runs in other warps meanwhile: a head-64 BF16
    # forward is bounded by the longer of the two (its exponentials), not their sum as on an H100
    from neusight.devices import load_device
    from neusight.tiles import softmax_overlaps, softmax_seconds_per_score

    pred = neusight.predictor.model.Predictor.load()
    roof, soft = {}, {}
    for key in ("b200", "h100-sxm5-80gb"):
        device = load_device(key)
        soft[key] = 16 * 8192 * 8192 * softmax_seconds_per_score(device) * 1e3
        roof[key] = pred.predict(_attention_rows([64], 8192, "bfloat16"), device)["roofline_ms"].iloc[0]
    assert softmax_overlaps(load_device("b200")) and not softmax_overlaps(load_device("h100-sxm5-80gb"))
    assert roof["b200"] == pytest.approx(soft["b200"], rel=1e-6)
    assert roof["h100-sxm5-80gb"] > 1.2 * soft["h100-sxm5-80gb"]


def test_a_fused_attention_of_narrow_heads_is_not_bounded_as_padded_tiles():
    # flash kernels' output blocks are head-dim wide: half the head, half the GEMM work in the bound (no tile
    # padded to 128 columns); the softmax's part, the same scores, stays
    from neusight.devices import load_device
    from neusight.tiles import softmax_seconds_per_score

    h100 = load_device("h100-sxm5-80gb")
    softmax_ms = 16 * 8192 * 8192 * softmax_seconds_per_score(h100) * 1e3
    roof = neusight.predictor.model.Predictor.load().predict(_attention_rows([64, 128], 8192, "bfloat16"),
                                                             h100)["roofline_ms"].to_numpy() - softmax_ms
    assert roof[0] == pytest.approx(roof[1] / 2, rel=0.02)


def test_a_fused_attention_backward_is_bounded_by_its_query_gradient_partial_sums():
    # the query gradient is accumulated over blocks of 128 keys in FP32 partial sums (split-K): written and read
    # back, they are most of the backward's traffic, and on an H100 (BF16, head 128) its bound
    from neusight.devices import load_device
    from neusight.tiles import device_rates, softmax_seconds_per_score

    h100 = load_device("h100-sxm5-80gb")
    scores = 16 * 8192 * 8192
    row = _attention_rows([128], 8192, "bfloat16", "attention_bwd")
    pred = neusight.predictor.model.Predictor.load().predict(row, h100)
    partials = 2 * 4.0 * scores * 128 / 128
    memory_ms = (row["bytes"].iloc[0] + partials) / device_rates(h100, "bfloat16").bandwidth * 1e3
    assert pred["bound"].iloc[0] == "memory"
    assert pred["roofline_ms"].iloc[0] == pytest.approx(memory_ms + scores * softmax_seconds_per_score(h100) * 1e3,
                                                        rel=0.01)


@pytest.mark.parametrize("gpu", ["h100-sxm5-80gb", "b200"])   # the softmax after the GEMMs / beside them
@pytest.mark.parametrize("kernel", ["attention", "attention_bwd"])
def test_a_fused_attention_forecast_never_drops_with_more_work(gpu, kernel):
    # DESIGN law (adding work never makes a kernel faster) through flash tiling, narrow heads folded into 128-wide
    # tiles, the backward's partial sums and the softmax: more heads, query rows, head width, keys or the full
    # square instead of the causal half never shorten the bound or the time
    import itertools

    from neusight.api import kernel_dims

    gemms = 5.0 if kernel == "attention_bwd" else 2.0
    grid = list(itertools.product((8, 64), (1, 4, 1000, 4096), (32, 64, 96, 128, 256), (128, 1000, 16384), (0.5, 1.0)))
    rows = pd.DataFrame({"family": "bmm", "kernel": kernel, "dims": [g[:4] for g in grid], "dtype": "bfloat16",
                         "flops": [2 * gemms * bh * lq * d * lk * half for bh, lq, d, lk, half in grid],
                         "bytes": [2.0 * 2 * bh * d * (lq + lk) for bh, lq, d, lk, _ in grid]})
    rows["algo_flops"] = rows["flops"]
    frame = pd.concat([rows.drop(columns="dims"), kernel_dims(rows)], axis=1)
    pred = neusight.predictor.model.Predictor.load().predict(frame, gpu)
    frame = frame.assign(half=[g[4] for g in grid], roof=pred["roofline_ms"].to_numpy(),
                         lat=pred["latency_ms"].to_numpy())
    axes = ["B", "M", "N", "K", "half"]
    for axis in axes:
        for _, line in frame.groupby([a for a in axes if a != axis]):
            line = line.sort_values(axis)
            for col in ("roof", "lat"):      # rounding aside: equal bounds may differ in their last bits
                assert (line[col].diff().iloc[1:] >= -1e-9 * line[col].iloc[1:]).all(), (axis, col)


def test_a_fused_attention_kernel_moves_its_own_bytes_not_a_score_matrix():
    # the scores, the output of the GEMM an attention kernel is modelled as, stay on chip: with small heads over a
    # long sequence they would be 64x the bytes the kernel moves (q, k, v read, the output written)
    from neusight.api import kernel_dims
    from neusight.devices import load_device
    from neusight.tiles import device_rates, softmax_seconds_per_score

    bh, lq, d, lk = 32, 4096, 16, 4096
    own = 4 * bh * lq * d * 2.0
    rows = pd.DataFrame({"family": "bmm", "kernel": ["attention", "attention"],
                         "dims": [(bh, lq, d, lk), (bh, 1, 128, lk)],
                         "flops": [4.0 * bh * lq * lk * d, 4.0 * bh * lk * 128], "dtype": "bfloat16",
                         "bytes": [own, 2 * bh * lk * 128 * 2.0 + 2 * bh * 128 * 2.0]})
    rows["algo_flops"] = rows["flops"]
    frame = pd.concat([rows.drop(columns="dims"), kernel_dims(rows)], axis=1)
    pred = neusight.predictor.model.Predictor.load().predict(frame, "h100-sxm5-80gb")
    rates = device_rates(load_device("h100-sxm5-80gb"), "bfloat16")
    scores_ms = bh * lq * lk * 2.0 / rates.bandwidth * 1e3
    softmax_ms = bh * lq * lk * softmax_seconds_per_score(load_device("h100-sxm5-80gb")) * 1e3   # in its bound too
    assert pred["roofline_ms"].iloc[0] < scores_ms / 4 + softmax_ms
    # a decode step over 4,096 cached tokens: bounded by reading the cached keys and values
    assert pred["roofline_ms"].iloc[1] == pytest.approx(rows["bytes"].iloc[1] / rates.bandwidth * 1e3, rel=0.01)


def test_fusion_keeps_every_gemm_and_never_adds_traffic(gpt2):
    eager, fused = gpt2.kernels, fused_kernels(gpt2)
    for fam in ("linear", "bmm"):
        assert sorted(map(tuple, eager.loc[eager["family"] == fam, "dims"])) == \
            sorted(map(tuple, fused.loc[fused["family"] == fam, "dims"]))
    assert len(fused) < len(eager)
    assert fused.loc[fused["family"].isin(MEMORY_BOUND), "bytes"].sum() < \
        eager.loc[eager["family"].isin(MEMORY_BOUND), "bytes"].sum()
    # the GELU of each block (mul, pow, mul, add, mul, tanh, add, mul) is one kernel: reads and writes
    # 2 x 128 x 3072 fp32 once each = 2 x 3,145,728 B
    act = fused[(fused["module"] == "transformer.h.0.mlp.act")]
    assert len(act) == 1 and act["bytes"].iloc[0] == 2 * 2 * 128 * 3072 * 4


def test_fused_table_is_the_same_for_every_trace_of_the_model(gpt2):
    # storages are identified by address while alive; a second trace reuses addresses differently
    again = neusight.trace("gpt2", batch_size=2, seq_len=128, mode="inference")
    pd.testing.assert_frame_equal(fused_kernels(gpt2), fused_kernels(again))


_FUSED_OF_A_TRACE = """
import neusight
from neusight.graph.fusion import fused_kernels
cfg = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512)
f = fused_kernels(neusight.trace(cfg, 1, 256, "training", dtype="bfloat16", fp8=True, device="h100-sxm5-80gb"))
print(f[["op_index", "aten_op", "dims", "bytes"]].to_csv())
# attention chains rewritten in a training step (found by following the backward's dataflow)
bert = dict(model_type="bert", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=512)
f = fused_kernels(neusight.trace(bert, 2, 64, "training"))
print(f[["op_index", "aten_op", "kernel", "dims", "bytes"]].to_csv())
"""


def test_fused_table_is_the_same_in_every_process():
    """Storages are told apart by address; the tracer holds every recorded output's storage for the trace, so no
    address is reused by a tensor made outside dispatch (the autograd engine's), which linked kernels that share
    no data in a way that varied from process to process (an FP8 training step: 443-446 fused kernels seen)."""
    import os
    import subprocess
    import sys

    runs = []
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", _FUSED_OF_A_TRACE], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": seed})
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout)
    assert runs[0] == runs[1]
    assert runs[0].count("attention_bwd") == 2          # the rewrite is covered: one backward kernel per layer


def test_predict_fused_is_faster_and_says_so():
    eager = neusight.predict("gpt2", "l4", batch_size=2, seq_len=128, memory=False)
    fused = neusight.predict("gpt2", "l4", batch_size=2, seq_len=128, memory=False, fused=True)
    assert 0 < fused.latency_ms < eager.latency_ms
    assert any("torch.compile" in n for n in fused.notes) and not any("torch.compile" in n for n in eager.notes)
    assert (fused.kernels["latency_ms"] >= fused.kernels["roofline_ms"]).all()


def test_find_labels_takes_fusion_runs_on_request_and_refuses_other_options():
    need_shared(DATASET)
    plain = find_labels(DATASET)
    both = find_labels(DATASET, options=("fusion",))
    assert all(r.option is None for r in plain)
    fusion = [r for r in both if r.option == "fusion"]
    assert fusion and len(both) == len(plain) + len(fusion)
    with pytest.raises(DataError, match="'dp4'"):
        find_labels(DATASET, options=("dp4",))


def test_a_fusion_label_is_predicted_fused_next_to_its_eager_baseline():
    need_shared(DATASET)
    run = next(r for r in find_labels(DATASET, options=("fusion",)) if r.option == "fusion")
    cache: dict = {}
    fused = predict_label(run, None, cache)
    eager = predict_label(dataclasses.replace(run, option=None), None, cache)
    assert fused["predicted_ms"] < eager["predicted_ms"]
    assert fused["eager_error_pct"] == pytest.approx(eager["error_pct"])


class _AmaxScale(nn.Module):
    """x / amax(|x|) over a whole activation, as an FP8 cast scales its input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 16384)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y * torch.reciprocal(y.abs().max())


def test_what_uses_a_whole_tensor_reduction_runs_in_a_later_kernel_and_reads_its_input_again():
    g = neusight.trace(_AmaxScale(), batch_size=8, input_shapes=[(64,)], mode="inference")
    fused = fused_kernels(g)
    memory_bound = fused[fused["family"] != "linear"]
    y = 8 * 16384 * 4
    # the amax (with the abs feeding it) is one kernel; the reciprocal and the scaling another, which reads y again
    assert list(memory_bound["aten_op"]) == ["fused:abs+max", "fused:reciprocal+mul"]
    assert memory_bound["bytes"].iloc[1] >= 2 * y
    # a row reduction is not split: a norm over rows of the same tensor stays one kernel with what uses it
    small = neusight.trace(_RMSNorm(), batch_size=8, input_shapes=[(16384,)], mode="inference")
    assert len(fused_kernels(small)) == 1


def test_the_fused_table_is_computed_once_per_graph_and_gpu_and_handed_out_as_a_copy(gpt2):
    first = fused_kernels(gpt2)
    first.loc[:, "flops"] = -1.0                     # a caller's edit does not reach the next caller
    again = fused_kernels(gpt2)
    assert (again["flops"] >= 0).all() and again.equals(fused_kernels(gpt2))
    cache = gpt2.__dict__["_fusion_cache"]
    assert None in cache                             # no device: one entry, whatever ran before
    # GPUs share an entry where every attention chain the rewrite replaces runs the same (fused or not): A100 and
    # H100 run BERT's 12 fused, MI100 none (its math backend); GPT-2's (masked by a select) are not rewritten
    bert = neusight.trace("bert-base", batch_size=2, seq_len=128, mode="inference")
    a100, h100, mi100 = (fused_kernels(bert, load_device(k)) for k in ("a100-80gb-pcie", "h100-sxm5-80gb", "mi100"))
    assert len(bert.__dict__["_fusion_cache"]) == 2 and a100.equals(h100) and not a100.equals(mi100)
    assert (a100["kernel"] == ATTENTION_KERNEL).sum() == 12 and not (mi100["kernel"] == ATTENTION_KERNEL).any()
    fused_kernels(gpt2, load_device("mi100"))
    assert len(cache) == 2                           # None and every GPU (GPT-2 asks nothing of them)
    forget_fusion(bert)                              # the next forecast runs the whole pass again: same table
    assert not {"_fusion_cache", "_fusion_flow", "_fusion_asks"} & bert.__dict__.keys()
    assert fused_kernels(bert, load_device("h100-sxm5-80gb")).equals(h100) and len(bert.__dict__["_fusion_cache"]) == 1

"""Tracer behaviour: phases, modules, dropout, optimizer kernels, label models, registry coverage."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch
from torch import nn

import neusight
from neusight.errors import InputError, ModelError, TraceError
from neusight.memory import estimate_memory
from tests.conftest import DATASET, need_shared

ALL_MODELS = [("gpt2", dict(seq_len=64)), ("bert-base", dict(seq_len=64)), ("opt-1.3b", dict(seq_len=64)),
              ("switch-xl-4", dict(seq_len=64)), ("resnet50", dict()), ("llama-3-8b", dict(seq_len=32)),
              ("mistral-7b", dict(seq_len=32)), ("vit-base", dict())]


@pytest.mark.parametrize("name,kw", ALL_MODELS)
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_every_op_is_registered(name, kw, mode):
    g = neusight.trace(name, batch_size=2, mode=mode, optimizer="adamw", **kw)
    assert g.unmodeled == []
    assert len(g.kernels) > 0
    assert (g.kernels["bytes"] > 0).all()


def test_training_phases_modules_and_dropout():
    g = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training", optimizer="adamw")
    k = g.kernels
    assert set(k["phase"]) == {"forward", "loss", "backward", "optimizer"}
    # forward and backward GEMMs are attributed to the layer that owns them
    attn = k[k["module"] == "transformer.h.3.attn.c_attn"]
    assert set(attn["phase"]) >= {"forward", "backward"}
    # dropout runs as the fused CUDA kernel in training: 12 layers x 3 + embeddings = 37
    assert (k["aten_op"] == "aten.native_dropout.default").sum() == 37
    assert (k["aten_op"] == "aten.native_dropout_backward.default").sum() == 37
    # AdamW with foreach: a handful of multi-tensor kernels, not one per parameter
    opt = k[k["phase"] == "optimizer"]
    assert 0 < len(opt) < 20
    assert opt["aten_op"].str.startswith("aten._foreach_").all()
    # the optimizer reads parameters, grads and two states: >= 4 x parameter bytes
    assert opt["bytes"].sum() >= 4 * 4 * g.n_params
    assert len(g.optimizer_state) == 2 * len(g.params)


def test_inference_has_no_dropout_no_backward():
    g = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="inference")
    assert set(g.kernels["phase"]) == {"forward"}
    assert not g.kernels["aten_op"].str.contains("dropout").any()


def test_sgd_and_no_optimizer():
    sgd = neusight.trace("resnet18", batch_size=2, mode="training", optimizer="sgd")
    none = neusight.trace("resnet18", batch_size=2, mode="training", optimizer=None)
    assert (sgd.kernels["phase"] == "optimizer").any()
    assert not (none.kernels["phase"] == "optimizer").any()
    assert len(sgd.optimizer_state) == len(sgd.params)  # momentum buffers


def test_switch_notes_fixed_capacity():
    g = neusight.trace("switch-xl-4", batch_size=1, seq_len=64, mode="inference")
    assert any("fixed expert capacity" in n for n in g.notes)
    # 12 + 12 sparse layers x 4 experts x 2 GEMMs on batch x capacity = 64 tokens each
    expert = g.kernels[g.kernels["module"].str.contains(r"experts\.expert_\d+\.w[io]$", regex=True)]
    assert len(expert) == 24 * 4 * 2
    assert set(expert["dims"].map(lambda d: d[1])) == {64}


# Top-k routed experts in transformers' standard layout (3-D weights per expert): Mixtral (gated, no bias) and
# gpt-oss (gated with biases and its own gate function), tiny so they trace in a second.
ROUTED_MOE = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    vocab_size=128),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, vocab_size=128),
}


@pytest.mark.parametrize("name", sorted(ROUTED_MOE))
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_routed_experts_trace_under_balanced_routing(tmp_path, name, mode):
    import json

    import transformers

    if not hasattr(transformers.models, name):
        pytest.skip(f"this transformers has no {name}")
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(ROUTED_MOE[name]))
    batch, seq = 2, 24
    g = neusight.trace(str(cfg), batch_size=batch, seq_len=seq, mode=mode, optimizer=None)
    assert g.unmodeled == []
    assert any("balanced routing" in n for n in g.notes)
    fwd = g.kernels[(g.kernels["phase"] == "forward") & (g.kernels["family"] == "linear")]
    expert = fwd[fwd["module"].str.contains("experts")]
    # 2 layers x 4 experts x (up, down); each expert gets ceil(tokens x top-k / experts) = 48 x 2 / 4 = 24 tokens
    assert len(expert) == 2 * 4 * 2
    assert set(expert["dims"].map(lambda d: d[1])) == {batch * seq * 2 // 4}
    h, inter = 64, 96
    assert expert["flops"].sum() == pytest.approx(2 * 4 * 24 * 2 * (h * 2 * inter + inter * h))
    if mode == "training":
        assert (g.kernels["phase"] == "backward").any()
    # one token, 2 choices, 4 experts: only 2 experts run (the eager loop skips experts no token chose)
    one = neusight.trace(str(cfg), batch_size=1, seq_len=1, mode="inference")
    lin = one.kernels[(one.kernels["family"] == "linear") & one.kernels["module"].str.contains("experts")]
    assert len(lin) == 2 * 2 * 2 and set(lin["dims"].map(lambda d: d[1])) == {1}


def test_experts_called_without_routing_keep_their_own_forward(tmp_path):
    """Llama 4's experts take the hidden states alone (every expert on every token's scaled copy, batched): not
    the standard top-k module, so no balanced-routing patch, and its own forward traces on meta."""
    import json
    import transformers

    if not hasattr(transformers.models, "llama4"):
        pytest.skip("this transformers has no llama4")
    cfg = tmp_path / "llama4.json"
    cfg.write_text(json.dumps(dict(model_type="llama4_text", hidden_size=64, intermediate_size=96,
                                   intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                   vocab_size=256)))
    for mode in ("inference", "training"):
        g = neusight.trace(str(cfg), batch_size=2, seq_len=16, mode=mode, optimizer=None)
        assert g.unmodeled == []
        assert not any("balanced routing" in n for n in g.notes)


def _expert_gemms(g, phase="forward"):
    k = g.kernels
    return k[k["module"].str.contains("experts") & (k["phase"] == phase) & k["family"].isin(["bmm", "linear"])]


def test_experts_kernels_follow_the_chosen_implementation(tmp_path):
    """loop / grouped / per-expert: the same GEMM FLOPs, forward and backward; grouped runs one batched GEMM per
    projection, per-expert one mm per expert with no per-expert gather or scatter, loop both per expert."""
    import json

    cfg = tmp_path / "mixtral.json"
    cfg.write_text(json.dumps(ROUTED_MOE["mixtral"]))
    runs = {how: neusight.trace(str(cfg), batch_size=2, seq_len=24, mode="training", optimizer=None, moe_kernels=how)
            for how in ("loop", "grouped", "per-expert")}
    flops = {how: g.kernels.loc[g.kernels["family"].isin(["bmm", "linear"]), "flops"].sum() for how, g in runs.items()}
    assert flops["grouped"] == flops["loop"] == flops["per-expert"]
    for how, g in runs.items():
        assert g.unmodeled == [] and any("balanced routing" in n for n in g.notes), how
    # 2 layers x (up, down), each one batched GEMM over the 4 experts of 24 token copies each
    grouped = _expert_gemms(runs["grouped"])
    assert len(grouped) == 2 * 2 and set(grouped["dims"].map(lambda d: d[:2])) == {(4, 24)}
    assert any("grouped GEMM kernel" in n for n in runs["grouped"].notes)
    # 2 layers x 4 experts x (up, down) mm, and in backward an input- and a weight-gradient mm for each
    per = runs["per-expert"]
    assert len(_expert_gemms(per)) == 2 * 4 * 2 and set(_expert_gemms(per)["aten_op"]) == {"aten.mm.out"}
    assert (_expert_gemms(per, "backward")["aten_op"] == "aten.mm.out").sum() == 2 * 4 * 2 * 2
    # the tokens are gathered once per layer in sorted order, not once per expert as the eager loop does
    gathers = {how: int((g.kernels["module"].str.contains("experts") & (g.kernels["phase"] == "forward")
                         & (g.kernels["aten_op"] == "aten.index_select.default")).sum()) for how, g in runs.items()}
    assert gathers["per-expert"] == gathers["grouped"] < gathers["loop"]
    assert len(per.kernels) < len(runs["loop"].kernels)
    with pytest.raises(InputError, match="moe_kernels='fancy'"):
        neusight.trace("resnet18", batch_size=1, moe_kernels="fancy")


def test_auto_experts_follow_transformers_on_the_gpu(tmp_path):
    """moe_kernels='auto': transformers' grouped_mm experts (its default) as one grouped GEMM for BF16 on NVIDIA
    compute capability 9.x / 10.x, PyTorch's per-expert fallback elsewhere; a config asking for eager experts gets
    the loop."""
    import json

    from neusight.graph.moe import depends_on_gpu, grouped_gemm_runs

    cfg = tmp_path / "mixtral.json"
    cfg.write_text(json.dumps(ROUTED_MOE["mixtral"]))

    def ops(device, dtype, path=cfg):
        g = neusight.trace(str(path), batch_size=2, seq_len=24, mode="inference", dtype=dtype, device=device)
        assert any("moe_kernels='auto'" in n for n in g.notes)
        return set(_expert_gemms(g)["aten_op"])

    assert ops("h100-sxm5-80gb", "bfloat16") == {"aten.bmm.default"}
    assert ops("b200", "bfloat16") == {"aten.bmm.default"}
    for device, dtype in (("h100-sxm5-80gb", "float32"), ("a100-sxm4-40gb", "bfloat16"), ("mi300x", "bfloat16"),
                          (None, "bfloat16")):
        assert ops(device, dtype) == {"aten.mm.out"}, (device, dtype)
    assert not grouped_gemm_runs(None, torch.bfloat16)
    # only experts traced by "auto" make a trace GPU-specific (the CLI traces again per path only then)
    assert depends_on_gpu(neusight.trace(str(cfg), batch_size=2, seq_len=24).notes)
    assert not depends_on_gpu(neusight.trace(str(cfg), batch_size=2, seq_len=24, moe_kernels="loop").notes)
    assert not depends_on_gpu(neusight.trace("gpt2", batch_size=1, seq_len=16).notes)
    eager = tmp_path / "mixtral-eager.json"
    eager.write_text(json.dumps({**ROUTED_MOE["mixtral"], "experts_implementation": "eager"}))
    loop = neusight.trace(str(cfg), batch_size=2, seq_len=24, mode="inference", dtype="bfloat16", moe_kernels="loop")
    assert ops("h100-sxm5-80gb", "bfloat16", eager) == set(_expert_gemms(loop)["aten_op"])
    # predict() and the CLI pass their GPU on: the same model forecast on H100 and A100 runs different kernels
    h100 = neusight.predict(str(cfg), "h100-sxm5-80gb", batch_size=2, seq_len=24, dtype="bfloat16", memory=False)
    a100 = neusight.predict(str(cfg), "a100-sxm4-40gb", batch_size=2, seq_len=24, dtype="bfloat16", memory=False)
    assert set(_expert_gemms(h100)["aten_op"]) == {"aten.bmm.default"}
    assert set(_expert_gemms(a100)["aten_op"]) == {"aten.mm.out"}


def test_per_expert_gemms_keep_the_weights_dtype_and_skip_frozen_weight_gradients(tmp_path):
    """grouped_mm is not autocast: under amp an FP32 model's experts run their GEMMs in FP32 (transformers casts the
    tokens to the weights' dtype); with the experts frozen (LoRA elsewhere) no weight-gradient mm runs."""
    import json

    cfg = tmp_path / "mixtral.json"
    cfg.write_text(json.dumps(ROUTED_MOE["mixtral"]))
    kw = dict(batch_size=2, seq_len=24, mode="training", optimizer=None, moe_kernels="per-expert")
    amp = neusight.trace(str(cfg), amp="bfloat16", **kw).kernels
    mm = amp[amp["aten_op"] == "aten.mm.out"]
    assert len(mm) and set(mm["dtype"]) == {"float32"}
    assert (amp["dtype"] == "bfloat16").any()                     # the attention projections are autocast
    full = neusight.trace(str(cfg), **kw).kernels
    lora = neusight.trace(str(cfg), lora_rank=4, lora_targets=["q_proj", "v_proj"], **kw).kernels
    count = lambda k: int(((k["aten_op"] == "aten.mm.out") & (k["phase"] == "backward")).sum())  # noqa: E731
    assert count(full) == 2 * 4 * 2 * 2 and count(lora) == 2 * 4 * 2      # input gradients only


# Hugging Face image models, tiny: a ViT (patch embeddings + encoder), DeiT (whose auto mapping lists two
# classes) and Swin (shifted windows: in-place strided views, stochastic depth in training).
VISION = {
    "vit": dict(model_type="vit", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                image_size=64, patch_size=16, num_labels=10),
    "deit": dict(model_type="deit", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, image_size=64, patch_size=16),
    "swin": dict(model_type="swin", embed_dim=32, depths=[1, 1], num_heads=[2, 4], image_size=64, patch_size=4,
                 window_size=4, drop_path_rate=0.1),
}


@pytest.mark.parametrize("name", sorted(VISION))
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_hf_image_models_trace_on_pixels(tmp_path, name, mode):
    import json

    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(VISION[name]))
    g = neusight.trace(str(cfg), batch_size=4, mode=mode, optimizer="adamw")
    assert g.unmodeled == []
    assert g.image_size == 64
    assert "64x64 images" in g.notes[0]
    if mode == "training":
        assert {"forward", "loss", "backward", "optimizer"} <= set(g.kernels["phase"])


def test_hf_image_model_is_built_for_the_image_size_asked():
    # ViT-Base/16: 14 x 14 patches + the class token at 224, 24 x 24 + 1 at 384
    for side, tokens in ((224, 197), (384, 577)):
        g = neusight.trace("vit-base", batch_size=2, image_size=side)
        lin = g.kernels[g.kernels["family"] == "linear"]
        square = lin[lin["dims"].map(lambda d: d[2:] == (768, 768))]   # q, k, v, o of 12 layers
        assert len(square) == 12 * 4
        assert set(square["dims"]) == {(1, 2 * tokens, 768, 768)}
    p = neusight.predict("vit-base", "t4", batch_size=8, memory=False)
    assert p.throughput[1] == "images/s"
    with pytest.raises(InputError, match="image_size.*tokens"):
        neusight.trace("gpt2", batch_size=1, seq_len=8, image_size=224)


@pytest.mark.parametrize("model, kw, takes", [
    ("resnet18", {}, "224x224 images (image_size= sets their side)"),
    ("vit-base", dict(image_size=384), "384x384 images"),
    (nn.Linear(16, 4), dict(input_shapes=[(16,)]), "inputs of fixed shapes (input_shapes="),
])
def test_a_sequence_length_for_a_model_without_one_is_an_error(model, kw, takes):
    """seq_len given to a model whose inputs have no sequence dimension names what the model takes, instead of
    forecasting a run the user did not ask for with a "seq" in its summary that changed nothing."""
    with pytest.raises(InputError, match=re.escape("seq_len=128 is for sequence models; ") + ".*" + re.escape(takes)
                       + ".*Fix: leave seq_len out"):
        neusight.trace(model, batch_size=2, seq_len=128, **kw)


class _RNNTagger(nn.Module):
    def __init__(self, cell: type, bidirectional: bool):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.rnn = cell(16, 32, num_layers=2, batch_first=True, bidirectional=bidirectional, dropout=0.1)
        self.head = nn.Linear(32 * (2 if bidirectional else 1), 5)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0])


@pytest.mark.parametrize("cell,fused", [(nn.LSTM, ("_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl")),
                                        (nn.GRU, ("_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward")),
                                        (nn.RNN, ("tanh", "tanh_backward"))])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_and_gru_run_one_recurrent_gemm_and_one_fused_cell_per_step(cell, fused, bidirectional):
    steps, dirs = 12, 2 if bidirectional else 1
    g = neusight.trace(_RNNTagger(cell, bidirectional), batch_size=4, seq_len=steps, mode="training",
                       optimizer=None, input_shapes=[(("seq",), torch.long)])
    assert g.unmodeled == []
    fwd = g.kernels[g.kernels["phase"] == "forward"]
    rnn = fwd[fwd["module"].str.startswith("rnn")]
    gemm = rnn[rnn["family"] == "linear"]
    # per layer and direction: the input projection of all steps, then one recurrent GEMM per step
    assert len(gemm) == 2 * dirs * (1 + steps)
    assert (rnn["aten_op"] == f"aten.{fused[0]}.default").sum() == 2 * dirs * steps
    assert (g.kernels["aten_op"] == f"aten.{fused[1]}.default").sum() == 2 * dirs * steps
    head = fwd[(fwd["module"] == "head") & (fwd["family"] == "linear")]
    assert list(head["dims"]) == [(1, 4 * steps, 32 * dirs, 5)]


class _Resampler(nn.Module):
    """Super-resolution / segmentation style resampling: pixel (un)shuffle, interpolation, unfold, reflect padding."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 32, 3, padding=1)

    def forward(self, x):
        y = nn.functional.pixel_shuffle(self.conv(x), 2)                               # (8, 32, 32)
        y = nn.functional.interpolate(y, scale_factor=0.5, mode="bilinear") + nn.functional.interpolate(
            y, size=(16, 16), mode="nearest")
        return (nn.functional.unfold(y, 3).mean() + nn.functional.pad(y, (1, 1, 1, 1), mode="reflect").mean()
                + nn.functional.pixel_unshuffle(y, 2).mean())


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_resampling_ops_are_memory_bound_copies(mode):
    g = neusight.trace(_Resampler(), batch_size=2, mode=mode, input_shapes=[(8, 16, 16)], optimizer=None)
    assert g.unmodeled == []
    k = g.kernels[g.kernels["aten_op"].str.contains("upsample|pixel_|im2col|reflection_pad")]
    assert {"aten.pixel_shuffle.default", "aten.upsample_bilinear2d.default", "aten.upsample_nearest2d.default",
            "aten.im2col.default", "aten.reflection_pad2d.default"} <= set(k["aten_op"])
    assert (k["family"] == "memory").all()
    # each reads its input and writes its output: the bilinear 2x downsample reads 4x what it writes
    bil = k[k["aten_op"] == "aten.upsample_bilinear2d.default"].iloc[0]
    assert bil["bytes"] == 4 * (2 * 8 * 32 * 32 + 2 * 8 * 16 * 16)


@pytest.mark.parametrize("dim", [-1, 1])
def test_topk_reads_rows_along_its_dim_not_k(dim):
    class TopK(nn.Module):
        def forward(self, x):
            return torch.topk(x, 3, dim=dim).values

    g = neusight.trace(TopK(), batch_size=2, input_shapes=[(5, 40)])
    k = g.kernels[g.kernels["aten_op"].str.startswith("aten.topk")]
    assert len(k) == 1
    rows, cols = (2 * 5, 40) if dim == -1 else (2 * 40, 5)
    assert k["dims"].iloc[0] == (rows, cols)


def test_nn_module_with_token_inputs_and_seq_len():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(100, 32), nn.Linear(32, 100)

        def forward(self, ids, mask):
            return self.head(self.emb(ids)) * mask.unsqueeze(-1)

    g = neusight.trace(LM(), batch_size=3, seq_len=20, mode="training", optimizer=None,
                       input_shapes=[(("seq",), torch.long), (("seq",), "float32")])
    head = g.kernels[(g.kernels["family"] == "linear") & (g.kernels["phase"] == "forward")]
    assert list(head["dims"]) == [(1, 60, 32, 100)]
    assert any("(batch, seq) int64" in n for n in g.notes)
    # without seq_len, the sequence models' default of 512 tokens
    g = neusight.trace(LM(), batch_size=3, input_shapes=[(("seq",), torch.long), (("seq",), "float32")])
    assert list(g.kernels.loc[g.kernels["family"] == "linear", "dims"]) == [(1, 3 * 512, 32, 100)]


@pytest.mark.parametrize("shapes,fragment", [([((4,), "tensor_of_doom")], r"input_shapes\[0\].*not a torch dtype"),
                                             ([(4,), (0, 3)], r"input_shapes\[1\].*positive int"),
                                             ([7], r"input_shapes\[0\].*not a shape")])
def test_bad_nn_module_inputs_name_the_entry(shapes, fragment):
    with pytest.raises(InputError, match=fragment):
        neusight.trace(nn.Linear(4, 4), batch_size=2, input_shapes=shapes)


def test_nn_module_with_input_shapes():
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    g = neusight.trace(net, batch_size=8, mode="training", input_shapes=[(16,)], optimizer="sgd")
    lin = g.kernels[(g.kernels["family"] == "linear") & (g.kernels["phase"] == "forward")]
    assert sorted(lin["dims"]) == [(1, 8, 16, 32), (1, 8, 32, 4)]


def test_an_unknown_option_is_an_input_error_naming_the_closest():
    # before: TypeError "trace() got an unexpected keyword argument", from whichever forecast was called
    with pytest.raises(InputError, match=r"^input_shape=\[\(16,\)\] is not an option.*Fix: input_shapes="):
        neusight.predict(nn.Linear(16, 4), "t4", batch_size=2, input_shape=[(16,)])
    with pytest.raises(InputError, match=r"optimiser='sgd'.*Fix: optimizer="):
        neusight.trace("gpt2", batch_size=1, seq_len=8, mode="training", optimiser="sgd")
    with pytest.raises(InputError, match=r"zzz=1 .*Fix: leave it out"):
        neusight.predict_parallel("gpt2", "t4", batch_size=2, seq_len=8, dp=2, zzz=1)


@pytest.mark.parametrize("optimizer", ["adamw", None])
def test_training_a_module_without_trainable_parameters_is_an_input_error(optimizer):
    # before: a bare ValueError from the optimizer, or a ModelError pointing at the input shapes
    frozen = nn.Linear(16, 4).requires_grad_(False)
    for net in (nn.Sequential(nn.ReLU(), nn.Softmax(dim=-1)), frozen):
        with pytest.raises(InputError, match=r"mode='training'.*has none.*Fix: mode='inference'"):
            neusight.trace(net, batch_size=2, mode="training", input_shapes=[(16,)], optimizer=optimizer)
    assert len(neusight.trace(frozen, batch_size=2, input_shapes=[(16,)]).kernels) > 0   # inference still traces


class _Conv1D(nn.Module):
    """GPT-2's projection: x @ W with W stored (in, out), untransposed."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


def test_gemm_kernels_carry_their_cublas_layout():
    # cuBLAS (column-major) computes x @ b as b^T x^T: the suffix is b's transpose flag, then x's
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _Conv1D(32, 8))
    k = neusight.trace(net, batch_size=4, mode="training", input_shapes=[(16,)], optimizer="sgd").kernels
    gemm = k[k["family"] == "linear"]
    got = sorted(zip(gemm["phase"], gemm["module"], gemm["kernel"], gemm["dims"]))
    # the input needs no gradient, so the first layer has no input-gradient GEMM
    assert got == [("backward", "0", "mm_nt", (1, 32, 4, 16)),     # nn.Linear's weight gradient dy^T @ x
                   ("backward", "2", "mm_nt", (1, 32, 4, 8)),      # Conv1D's weight gradient x^T @ dy
                   ("backward", "2", "mm_tn", (1, 4, 8, 32)),      # Conv1D's input gradient dy @ W^T
                   ("forward", "0", "addmm_tn", (1, 4, 16, 32)),   # nn.Linear: x @ W^T
                   ("forward", "2", "addmm_nn", (1, 4, 32, 8))]    # Conv1D: x @ W
    # nn.Linear's input gradient dy @ W reads W as stored: nn
    k2 = neusight.trace(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)), batch_size=4, mode="training",
                        input_shapes=[(16,)], optimizer="sgd").kernels
    assert set(k2.loc[(k2["phase"] == "backward") & (k2["module"] == "1"), "kernel"]) >= {"mm_nn", "mm_nt"}


def test_an_nn_module_runs_in_the_run_dtype_with_its_weights():
    """An FP32 module (PyTorch's default) traced with dtype=bfloat16 runs in BF16, weights and activations alike (the
    caller's module untouched); a module all in FP16 traced as FP32 is an InputError naming both and the fix, since
    a GPU's GEMMs do not take FP32 inputs with FP16 weights; a module of mixed dtypes is traced as it is."""
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    g = neusight.trace(model, batch_size=4, input_shapes=[(16,)], dtype="bfloat16")
    assert set(g.kernels["dtype"]) == {"bfloat16"}
    assert next(model.parameters()).dtype == torch.float32 and next(model.parameters()).device.type == "cpu"
    with pytest.raises(InputError, match=r"dtype='float32'.*float16.*Fix: dtype='float16'"):
        neusight.trace(model.half(), batch_size=4, input_shapes=[(16,)])
    half = neusight.trace(model, batch_size=4, input_shapes=[(16,)], dtype="float16")     # model.half() cast it
    assert set(half.kernels["dtype"]) == {"float16"}
    mixed = nn.Sequential(nn.Linear(16, 32).half(), nn.LayerNorm(32))
    assert not neusight.trace(mixed, batch_size=4, input_shapes=[(16,)], dtype="float16").unmodeled


def test_sdpa_is_selectable():
    eager = neusight.trace("gpt2", batch_size=1, seq_len=64, attn_implementation="eager")
    sdpa = neusight.trace("gpt2", batch_size=1, seq_len=64, attn_implementation="sdpa")
    assert eager.unmodeled == [] and sdpa.unmodeled == []
    assert (eager.kernels["family"] == "softmax").sum() > (sdpa.kernels["family"] == "softmax").sum()


_GQA_LM = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512}


def _attention_ops(g) -> list[str]:
    k = g.kernels
    return list(k.loc[k["module"].astype(str).str.fullmatch(r"model\.layers\.0\.self_attn"), "aten_op"])


def test_sdpa_takes_the_backend_pytorch_picks_on_the_gpu():
    """Grouped-query attention under sdpa: flash attention (keys and values as they are) in BF16 on compute capability
    8.0+; on an older NVIDIA GPU the math backend (repeated keys and values, materialized scores), since the
    memory-efficient kernel does not take grouped-query attention; without a GPU the memory-efficient kernel."""
    run = dict(batch_size=2, seq_len=1, kv_cache=255, attn_implementation="sdpa", dtype="bfloat16")
    flash = neusight.trace(_GQA_LM, device="a100-sxm4-40gb", **run)
    ops = _attention_ops(flash)
    assert "aten._scaled_dot_product_flash_attention.default" in ops and "aten.clone.default" not in ops
    (att,) = [r for r in flash.ops if r.call.op.startswith("aten._scaled_dot_product_flash")][:1]
    assert att.call.args[1].shape[1] == 2                      # the keys' 2 heads, not 8
    assert any("flash attention" in n and "a100-sxm4-40gb" in n for n in flash.notes)

    math_ops = _attention_ops(neusight.trace(_GQA_LM, device="v100-sxm2-16gb", **{**run, "dtype": "float16"}))
    assert "aten.bmm.default" in math_ops and not any("efficient" in o or "flash" in o for o in math_ops)
    fp32 = _attention_ops(neusight.trace(_GQA_LM, device="h100-sxm5-80gb", **{**run, "dtype": "float32"}))
    assert "aten.bmm.default" in fp32                           # flash takes 16-bit inputs only

    legacy = neusight.trace(_GQA_LM, **run)                    # no GPU: the memory-efficient kernel, as before
    ops = _attention_ops(legacy)
    assert "aten._scaled_dot_product_efficient_attention.default" in ops and "aten.clone.default" in ops
    assert not any("scaled_dot_product_attention on" in n for n in legacy.notes)
    # multi-head attention in FP32 on a flash-capable GPU: the memory-efficient kernel
    mha = neusight.trace({**_GQA_LM, "num_key_value_heads": 8}, device="a100-sxm4-40gb", **{**run, "dtype": "float32"})
    assert "aten._scaled_dot_product_efficient_attention.default" in _attention_ops(mha)


def test_gpus_sharing_a_trace_each_read_their_own_name_in_its_attention_note():
    """H100 and B200 take the same attention backend, so one trace serves both; each forecast's note names its GPU."""
    from neusight.api import predict_many

    run = dict(batch_size=2, seq_len=1, kv_cache=63, attn_implementation="sdpa", dtype="bfloat16")
    h100, b200 = predict_many(_GQA_LM, ["h100-sxm5-80gb", "b200"], mode="inference", **run)
    named = lambda p: [n.split(" as ")[0] for n in p.notes if n.startswith("scaled_dot_product_attention on")]  # noqa
    assert named(h100) == ["scaled_dot_product_attention on h100-sxm5-80gb"]
    assert named(b200) == ["scaled_dot_product_attention on b200"]


def _attention_kernels(model, device, **run) -> set[str]:
    ops = _attention_ops(neusight.trace(model, device=device, **run))
    return {o.removeprefix("aten.").removesuffix(".default") for o in ops
            if "attention" in o or o == "aten.bmm.default"}


def test_sdpa_backends_on_amd_and_older_nvidia_gpus():
    """ROCm: flash attention (AOTriton) for 16-bit inputs on MI200 / MI300, grouped-query keys and values as they
    are; the memory-efficient kernel for FP32 multi-head attention there; the math backend for FP32 grouped-query
    attention there and for everything on MI100, which has no fused attention kernel. NVIDIA before compute
    capability 8.0: BF16 runs the math backend (the memory-efficient kernel takes FP16 / FP32 only there)."""
    run = dict(batch_size=2, seq_len=1, kv_cache=255, attn_implementation="sdpa")
    mha = {**_GQA_LM, "num_key_value_heads": 8}
    flash, eff, math = ({"_scaled_dot_product_flash_attention"}, {"_scaled_dot_product_efficient_attention"},
                        {"bmm"})
    for gpu in ("mi250", "mi300x"):
        assert _attention_kernels(_GQA_LM, gpu, dtype="bfloat16", **run) == flash
        assert _attention_kernels(mha, gpu, dtype="float32", **run) == eff
        assert _attention_kernels(_GQA_LM, gpu, dtype="float32", **run) == math
    for dtype in ("bfloat16", "float16", "float32"):
        assert _attention_kernels(mha, "mi100", dtype=dtype, **run) == math
    assert _attention_kernels(mha, "v100-sxm2-16gb", dtype="bfloat16", **run) == math
    assert _attention_kernels(mha, "v100-sxm2-16gb", dtype="float16", **run) == eff
    g = neusight.trace(mha, device="mi100", dtype="float16", **run)
    assert any("math backend" in n and "mi100" in n for n in g.notes)


class _CausalSdpa(torch.nn.Module):
    """Causal scaled_dot_product_attention of the first ``queries`` positions (all of them by default) against all."""

    def __init__(self, queries: int | None = None) -> None:
        super().__init__()
        self.queries = queries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x if self.queries is None else x[:, :, :self.queries]
        return torch.nn.functional.scaled_dot_product_attention(q, x, x, is_causal=True)


def test_sdpa_flash_declines_causal_attention_of_unequal_lengths():
    """Flash attention does not take is_causal with fewer queries than keys (PyTorch's
    check_flash_causal_non_square_seqlens); the memory-efficient kernel runs it."""
    def kernels(model):
        g = neusight.trace(model, batch_size=2, input_shapes=[(8, 16, 64)], dtype="float16", device="a100-sxm4-40gb")
        return {str(o).removeprefix("aten.").removesuffix(".default") for o in g.kernels["aten_op"]
                if "attention" in str(o)}

    assert kernels(_CausalSdpa()) == {"_scaled_dot_product_flash_attention"}
    assert kernels(_CausalSdpa(queries=4)) == {"_scaled_dot_product_efficient_attention"}


class _MaskedSdpa(torch.nn.Module):
    """scaled_dot_product_attention of 8 query heads over ``kv_heads`` key / value heads, with a
    boolean mask if ``mask``, dropout ``p`` in training."""

    def __init__(self, kv_heads: int = 2, mask: bool = True, p: float = 0.0) -> None:
        super().__init__()
        self.kv_heads, self.mask, self.p = kv_heads, mask, p
        self.gain = torch.nn.Parameter(torch.ones(1))     # something to train

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (batch, 8, seq, head dim)
        x = x * self.gain
        kv = x[:, :self.kv_heads]
        mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool, device=x.device).tril() if self.mask else None
        return torch.nn.functional.scaled_dot_product_attention(x, kv, kv, attn_mask=mask, enable_gqa=True,
                                                                dropout_p=self.p if self.training else 0.0)


def test_sdpa_takes_cudnn_attention_first_on_hopper_and_blackwell():
    """Compute capability 9.0 / 10.x: cuDNN attention first for FP16 / BF16, masked grouped-query attention included
    (the math backend on an A100, where flash attention takes no mask); not for BERT's dropout of 0.1 (cuDNN's
    dropout comes in sixteenths: flash attention), nor for head dims over 128, nor FP32 (the memory-efficient
    kernel). Its forward and backward kernels carry the fused attention's FLOPs (causal only with is_causal)."""
    def run(model, gpu, dims=(8, 64, 64), dtype="bfloat16", mode="inference"):
        g = neusight.trace(model, batch_size=2, input_shapes=[dims], dtype=dtype, device=gpu, mode=mode,
                           optimizer=None)
        names = {str(o).removeprefix("aten.").removesuffix(".default") for o in g.kernels["aten_op"]
                 if "attention" in str(o) or o == "aten.bmm.default"}
        return g, names

    cudnn = "_scaled_dot_product_cudnn_attention"
    for gpu in ("h100-sxm5-80gb", "b200"):
        assert run(_MaskedSdpa(), gpu)[1] == {cudnn}
    assert run(_MaskedSdpa(), "a100-sxm4-40gb")[1] == {"bmm"}
    assert run(_MaskedSdpa(), "h100-sxm5-80gb", dtype="float32")[1] == {"bmm"}
    assert run(_MaskedSdpa(kv_heads=8), "h100-sxm5-80gb", dtype="float32")[1] == {
        "_scaled_dot_product_efficient_attention"}
    assert run(_MaskedSdpa(mask=False), "h100-sxm5-80gb", dims=(8, 64, 256))[1] == {
        "_scaled_dot_product_flash_attention"}
    g, names = run(_MaskedSdpa(mask=False, p=0.1), "h100-sxm5-80gb", mode="training")
    assert names == {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}
    # flash attention's backward has no kernel for head dims in (192, 224] on sm86 / sm89 (L4): not taken to train
    mha = _MaskedSdpa(kv_heads=8, mask=False)
    assert run(mha, "l4", dims=(8, 64, 200))[1] == {"_scaled_dot_product_flash_attention"}
    assert run(mha, "l4", dims=(8, 64, 200), mode="training")[1] == {
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"}
    g, names = run(_MaskedSdpa(), "h100-sxm5-80gb", mode="training")
    assert names == {cudnn, cudnn + "_backward"}
    k = g.kernels.set_index("aten_op")
    fwd, bwd = (float(k.loc[f"aten.{cudnn}{s}.default", "flops"]) for s in ("", "_backward"))
    assert fwd == 4 * 2 * 8 * 64 * 64 * 64 and bwd == 2.5 * fwd      # a mask, not is_causal: every tile computed


def test_flash_attention_2_runs_flash_attns_kernel_where_flash_attn_runs():
    """attn_implementation='flash_attention_2' (transformers' flash-attn integration): flash-attn's kernel on every
    attention call, grouped-query keys and values as they are, also in a training step's backward and in the
    recomputation of checkpointed layers; refused where flash-attn refuses (FP32, a V100, flash-attn 3 off Hopper)
    with the field, the reason and the fix."""
    run = dict(batch_size=2, seq_len=64, attn_implementation="flash_attention_2", dtype="bfloat16")
    flash = "aten._scaled_dot_product_flash_attention.default"
    for gpu in ("a100-sxm4-40gb", "mi250", None):
        g = neusight.trace(_GQA_LM, device=gpu, **run)
        assert {o for o in _attention_ops(g) if "attention" in o} == {flash}
        (att,) = [r for r in g.ops if r.call.op == flash][:1]
        assert att.call.args[1].shape[1] == 2
    g = neusight.trace(_GQA_LM, device="a100-sxm4-40gb", **run)
    assert any("flash-attn 2" in n and "a100-sxm4-40gb" in n for n in g.notes)
    g = neusight.trace(_GQA_LM, device="h100-sxm5-80gb", mode="training", gradient_checkpointing=True,
                       **{**run, "attn_implementation": "flash_attention_3"})
    ops = {str(o) for o in g.kernels["aten_op"] if "attention" in str(o)}
    assert ops == {flash, "aten._scaled_dot_product_flash_attention_backward.default"}
    assert (g.kernels["aten_op"] == flash).sum() == 2 * 2      # 2 layers, each forward once and recomputed once
    for bad, fragment in [(dict(device="v100-sxm2-16gb"), r"compute capability 8\.0\+.*v100-sxm2-16gb is 7\.0"),
                          (dict(device="a100-sxm4-40gb", dtype="float32"), "FP16 / BF16 only.*float32"),
                          (dict(device="a100-sxm4-40gb", attn_implementation="flash_attention_3"), "Hopper")]:
        with pytest.raises(InputError, match=f"attn_implementation='flash_attention_.'.*{fragment}.*Fix: "):
            neusight.trace(_GQA_LM, **{**run, **bad})
    with pytest.raises(ModelError, match="'eager', 'sdpa', 'flash_attention_2', 'flash_attention_3'"):
        neusight.trace(_GQA_LM, **{**run, "attn_implementation": "flex_attention"})




def test_gpus_sharing_a_trace_are_each_refused_where_flash_attn_3_does_not_run():
    """GPUs on one software path share a trace; flash-attn 3 runs on Hopper only, while a B200 takes an H100's SDPA
    backends: after an H100's trace it is still refused with the reason (before: forecast from the H100's trace as
    flash-attn 3's Hopper kernel)."""
    run = dict(batch_size=2, seq_len=64, attn_implementation="flash_attention_3", dtype="bfloat16", memory=False)
    left_out: dict[str, str] = {}
    preds = neusight.predict_many(_GQA_LM, ["h100-sxm5-80gb", "b200", "h200"], left_out=left_out, **run)
    assert [p.device.key for p in preds] == ["h100-sxm5-80gb", "h200"]
    assert list(left_out) == ["b200"] and "flash-attn 3 runs on Hopper GPUs" in left_out["b200"]
    with pytest.raises(InputError, match="flash-attn 3 runs on Hopper GPUs .* b200 is 10.0"):
        neusight.predict_many(_GQA_LM, ["h100-sxm5-80gb", "b200"], **run)


# transformers' classes without an SDPA path: Gemma 2 (logit soft-capping) and gpt-oss (attention sinks) run eager or
# flash-attn; BLOOM (ALiBi) runs eager only
_NO_SDPA = {
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=32),
    "gpt_oss": ROUTED_MOE["gpt_oss"],
    "bloom": dict(model_type="bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=128),
}


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_flash_attn_runs_models_without_an_sdpa_path(name):
    """A model whose transformers class has flash-attn but no SDPA path (Gemma 2, gpt-oss) traces with
    attn_implementation='flash_attention_2' / '_3' as flash-attn's kernel on every attention call, in both passes
    (before, it was built for SDPA, which transformers refused); eager is unchanged; 'sdpa' is refused with the
    implementations the class has."""
    cfg = _NO_SDPA[name]
    run = dict(batch_size=2, seq_len=64, dtype="bfloat16", device="h100-sxm5-80gb", mode="training")
    flash = "aten._scaled_dot_product_flash_attention"
    def forward_ops(g):
        return g.kernels.loc[g.kernels["phase"] == "forward", "aten_op"].astype(str)

    eager = forward_ops(neusight.trace(cfg, attn_implementation="eager", **run))
    assert not eager.str.contains("attention").any()
    for impl in ("flash_attention_2", "flash_attention_3"):
        g = neusight.trace(cfg, attn_implementation=impl, **run)
        ops = g.kernels["aten_op"].astype(str)
        assert (ops == f"{flash}.default").sum() == 2 and (ops == f"{flash}_backward.default").sum() == 2
        ops = forward_ops(g)
        for op, per_layer in (("aten._softmax.default", 1), ("aten.bmm.default", 2)):   # eager's scores and output
            assert (eager == op).sum() - (ops == op).sum() == 2 * per_layer
    with pytest.raises(ModelError, match="attn_implementation='sdpa': transformers has no sdpa path for .*eager | "
                                         "flash_attention_2 | flash_attention_3. Fix: attn_implementation=flash"):
        neusight.trace(cfg, attn_implementation="sdpa", **run)


def test_attention_implementations_a_model_lacks_are_refused_with_the_ones_it_has():
    """BLOOM has neither an SDPA nor a flash-attn path in transformers: both are refused, naming eager as the fix
    (before: a raw transformers ValueError for sdpa, and flash-attn's kernels forecast for a model that never runs
    them)."""
    for impl in ("sdpa", "flash_attention_2"):
        with pytest.raises(ModelError, match=f"attn_implementation='{impl}': transformers has no .* path for "
                                             "BloomForCausalLM .* it runs attn_implementation=eager. Fix: "
                                             "attn_implementation=eager"):
            neusight.trace(_NO_SDPA["bloom"], batch_size=1, seq_len=16, attn_implementation=impl,
                           dtype="bfloat16", device="a100-sxm4-40gb")



@pytest.mark.parametrize("queries,keys,window", [(64, 64, 16), (64, 64, 64), (1, 300, 128), (40, 300, 128),
                                                 (200, 300, 128), (7, 9, 3)])
def test_band_keys_do_the_sliding_windows_work(queries, keys, window):
    """A causal attention of the last ``queries`` of ``keys`` positions within a sliding window (each query sees
    itself and window - 1 keys before it) is forecast as a non-causal one of every query over as many keys as the
    band holds per query: the same number of query-key pairs, to rounding; None where the window holds them all."""
    from neusight.graph.tracer import _band_keys

    pairs = sum(min(p + 1, window) for p in range(keys - queries, keys))
    got = _band_keys(queries, keys, window)
    if keys <= window:
        assert got is None
    else:
        assert abs(got * queries - pairs) <= queries / 2


def test_flash_attn_limits_sliding_window_layers_to_their_band():
    """With flash-attn (transformers passes each layer's sliding window, flash-attn's window_size), a sliding layer's
    attention kernel does the band's work, forward, backward and in recomputations (whole layers and selective);
    full-attention layers stay causal; SDPA computes the masked square as PyTorch does; a note says which."""
    cfg = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=16,
               layer_types=["sliding_attention", "full_attention"])
    run = dict(batch_size=2, seq_len=64, dtype="bfloat16", device="h100-sxm5-80gb", mode="training")
    square = 4 * 2 * 4 * 16 * 64 * 64                        # 4 B H D S^2: both GEMMs of every query-key pair
    band = 4 * 2 * 4 * 16 * (136 + 48 * 16)                  # query p sees min(p + 1, 16) keys
    fwd = "aten._scaled_dot_product_flash_attention.default"
    bwd = "aten._scaled_dot_product_flash_attention_backward.default"
    for gc in (False, True, "selective"):
        g = neusight.trace(cfg, attn_implementation="flash_attention_2", gradient_checkpointing=gc, **run)
        k = g.kernels
        per_layer = k[k["aten_op"].isin([fwd, bwd])].groupby(["aten_op", "module"])["flops"].agg(["sum", "count"])
        layers = sorted(per_layer.loc[fwd].index)
        assert len(layers) == 2
        sliding, full = (per_layer.loc[fwd].loc[x] for x in layers)
        runs = 2 if gc else 1                                   # recomputed in the backward pass
        assert sliding["count"] == full["count"] == runs
        assert abs(sliding["sum"] / runs - band) <= 0.01 * band and full["sum"] / runs == square / 2
        assert per_layer.loc[bwd, "sum"].sort_values().tolist() == pytest.approx(
            [2.5 * sliding["sum"] / runs, 2.5 * square / 2], rel=0.01)
        assert any("sliding-window attention" in n and "16 keys" in n for n in g.notes)
    g = neusight.trace(cfg, attn_implementation="sdpa", **run)
    cudnn = g.kernels[g.kernels["aten_op"] == "aten._scaled_dot_product_cudnn_attention.default"]
    assert sorted(cudnn["flops"]) == [square / 2, square]       # the sliding layer's mask: the whole square
    assert not any("sliding-window attention" in n for n in g.notes)


def test_checkpointed_layers_recompute_attention_with_the_gpus_backend():
    """The recomputation of a checkpointed layer takes the same scaled_dot_product_attention backend as its forward
    on the GPU forecast (it took the GPU-less memory-efficient kernel before)."""
    g = neusight.trace(_GQA_LM, device="a100-sxm4-40gb", batch_size=2, seq_len=64, mode="training",
                       attn_implementation="sdpa", dtype="bfloat16", gradient_checkpointing=True)
    ops = {str(o) for o in g.kernels["aten_op"] if "attention" in str(o)}
    assert ops == {"aten._scaled_dot_product_flash_attention.default",
                   "aten._scaled_dot_product_flash_attention_backward.default"}


@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2"])
def test_selective_recompute_runs_the_fused_attention_again_and_nothing_else(impl):
    """gradient_checkpointing="selective" with a fused attention kernel (SDPA's flash backend, flash-attn 2 as
    transformers calls it): each layer's attention kernel runs a second time in the backward pass, under the same
    backend; every other kernel is the plain step's."""
    run = dict(batch_size=2, seq_len=64, mode="training", attn_implementation=impl, dtype="bfloat16",
               device="a100-sxm4-40gb")
    plain, sel = (neusight.trace(_GQA_LM, gradient_checkpointing=gc, **run) for gc in (False, "selective"))
    flash = "aten._scaled_dot_product_flash_attention.default"
    count = {name: g.kernels.groupby(["phase", "aten_op"]).size() for name, g in (("plain", plain), ("sel", sel))}
    extra = count["sel"].sub(count["plain"], fill_value=0)
    assert extra[extra != 0].to_dict() == {("backward", flash): 2}      # 2 layers, one attention call each


def test_the_cli_traces_again_for_a_gpu_with_other_attention_backends(tmp_path):
    import json

    from neusight.cli.predict import PredictConfig, forecast

    cfg_path = tmp_path / "gqa.json"
    cfg_path.write_text(json.dumps(_GQA_LM))
    cfg = PredictConfig(model=str(cfg_path), device=["v100-sxm2-16gb", "a100-sxm4-40gb", "h100-sxm5-80gb"],
                        batch_size=2, seq_len=1, kv_cache=255, dtype="float16", attn_implementation="sdpa",
                        memory=False)
    preds = forecast(cfg)
    backends = [next(n for n in p.notes if "scaled_dot_product_attention on" in n) for p in preds]
    assert "math backend" in backends[0] and "flash attention" in backends[1] and "cuDNN attention" in backends[2]


@pytest.mark.parametrize("cfg,head,cls", [
    ("gpt2_large.json", None, "GPT2LMHeadModel"),
    ("gpt3_xl.json", None, "GPT2LMHeadModel"),
    ("opt_13.json", None, "OPTForCausalLM"),
    ("bert_large.json", "sequence-classification", "BertForSequenceClassification"),
    ("bert_large.json", "pretraining", "BertForPreTraining"),
    ("switchxl4.json", "seq2seq", "SwitchTransformersForConditionalGeneration"),
])
def test_label_models_trace(cfg, head, cls):
    path = need_shared(DATASET / "models" / cfg)
    g = neusight.trace(str(path), batch_size=1, seq_len=128, mode="inference", head=head)
    assert g.unmodeled == []
    assert g.notes[0].startswith(cls)


def test_gpt3_6_7b_needs_no_weights():
    code = ("import resource, neusight; g = neusight.trace('gpt3-6.7b', batch_size=1, seq_len=128, mode='training');"
            "print(g.n_params, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    n_params, maxrss_kib = int(out[-2]), int(out[-1])
    assert n_params > 6.5e9                 # 6.7 B parameters = 27 GB of FP32 weights (+ grads + AdamW states)
    assert maxrss_kib < 3 * 1024 * 1024     # the whole process stays under 3 GiB


@pytest.mark.parametrize("kw,err", [
    (dict(batch_size=0), InputError),
    (dict(batch_size=2, seq_len=-1), InputError),
    (dict(batch_size=2, seq_len=4096), InputError),   # GPT-2 has 1024 positions
    (dict(batch_size=2, mode="train"), InputError),
    (dict(batch_size=2, optimizer="lion", mode="training"), InputError),
    (dict(batch_size=2, head="vision"), ModelError),
    (dict(batch_size=2, dtype="float8"), InputError),
    (dict(batch_size=2, dtype=torch.float64), InputError),   # no FP64 rates: refused, not forecast at FP32 speed
    (dict(batch_size=2, dtype="int8"), InputError),
])
def test_bad_run_parameters(kw, err):
    with pytest.raises(err):
        neusight.trace("gpt2", **kw)



@pytest.mark.parametrize("model,kw,fragment", [
    ("gpt2", dict(lora_targets=["c_attn"]), r"lora_targets=\['c_attn'\] .* lora_rank is not set.*Fix: lora_rank="),
    ("gpt2", dict(memory_format="channels_last"), "channels_last.*GPT2LMHeadModel.*has none.*Fix: leave memory_format"),
    ("gpt2", dict(moe_kernels="grouped"), "moe_kernels='grouped' .*GPT2LMHeadModel.*has none.*Fix: leave moe_kernels"),
    (dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          vocab_size=128), dict(moe_kernels="loop"), "moe_kernels='loop' .*LlamaForCausalLM.*has none"),
])
def test_options_that_would_change_nothing_are_refused(model, kw, fragment):
    """An option the model gives nothing to act on (LoRA targets without a rank, a channels-last layout without a 4-D
    tensor, experts kernels without routed experts) is refused with the fix, not silently ignored; where it applies
    it still works."""
    with pytest.raises(InputError, match=fragment):
        neusight.trace(model, batch_size=1, seq_len=8, **kw)
    assert neusight.trace("vit-base", batch_size=1, memory_format="channels_last").memory_format == "channels_last"
    g = neusight.trace(ROUTED_MOE["mixtral"], batch_size=1, seq_len=8, moe_kernels="loop")
    assert any("mixture of experts" in n for n in g.notes)


def test_dtype_spellings_name_the_same_precision():
    for name, want in (("bf16", "bfloat16"), ("half", "float16"), ("torch.float16", "float16"), ("fp32", "float32"),
                       (torch.bfloat16, "bfloat16")):
        assert neusight.trace("gpt2", batch_size=1, seq_len=8, dtype=name).dtype == want


def test_a_text_head_on_a_cnn_preset_is_refused():
    with pytest.raises(ModelError, match="head='causal-lm'"):
        neusight.trace("resnet18", batch_size=1, head="causal-lm")
    assert neusight.trace("resnet18", batch_size=1, head="image-classification").kernels.shape[0] > 0


def test_unknown_model_suggests_close_names():
    with pytest.raises(ModelError, match="gpt2-large"):
        neusight.trace("gpt2-lage")


@pytest.mark.parametrize("hub_name, preset", [
    ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"), ("meta-llama/Meta-Llama-3-70B-Instruct", "llama-3-70b"),
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"), ("google/gemma-2-9b-it", "gemma-2-9b"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"), ("openai-community/gpt2-large", "gpt2-large"),
    ("mistralai/Mistral-7B-Instruct-v0.3", None),      # v0.3 is not v0.1's architecture (vocabulary)
    ("EleutherAI/gpt-neo-2.7B", None),
    # retrained releases dated by their month, and reasoning fine-tunes, keep their base's architecture
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"), ("Qwen/Qwen3-235B-A22B-Thinking-2507", "qwen3-235b-a22b"),
    ("deepseek-ai/DeepSeek-V3-0324", "deepseek-v3"), ("deepseek-ai/DeepSeek-R1", "deepseek-v3"),
    ("openai/gpt-oss-120b", "gpt-oss-120b"), ("google/gemma-3-12b-it", "gemma-3-12b"),
    ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.1-70b"), ("acme/model-2507", None),
    ("Qwen/Qwen3-4B-Instruct-2507", "qwen3-4b"), ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama-4-scout"),
    ("meta-llama/Llama-4-Maverick-17B-128E", "llama-4-maverick")])
def test_hub_names_of_fine_tuned_variants_build_their_preset(hub_name, preset):
    from neusight.graph.models import _preset_of_hub_name, build_model

    assert _preset_of_hub_name(hub_name) == preset
    if preset is None:
        with pytest.raises(ModelError, match="looks like a Hugging Face Hub id, but its config.json is not in your"):
            build_model(hub_name)
    elif preset in ("gpt2-large", "llama-2-7b"):
        built = build_model(hub_name)
        assert built.name == preset and built.notes[0].startswith(f"{hub_name!r} built as the preset {preset}")


def test_a_hub_id_in_the_local_cache_is_built_from_its_config(tmp_path):
    """A Hub id whose config.json is in the Hugging Face cache (as huggingface_hub lays it out) is built from that
    config, without a download; run in a fresh interpreter, where HF_HUB_CACHE points at the test's cache."""
    repo = tmp_path / "models--acme--tiny-llama"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_SMALL_LM}))
    code = ("import neusight; g = neusight.trace('acme/tiny-llama', batch_size=1, seq_len=8); "
            "print(g.notes[0]); print(sum(t.numel for t in g.params))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    note, params = r.stdout.strip().splitlines()[-2:]
    assert note == "acme/tiny-llama: its config.json from the local Hugging Face cache"
    built = neusight.trace({"model_type": "llama", **_SMALL_LM}, batch_size=1, seq_len=8)
    assert int(params) == sum(t.numel for t in built.params)


def test_a_hub_id_without_a_readable_cached_config_says_why_and_how_to_fix_it(tmp_path, monkeypatch):
    """A Hub id that is no preset's: not in the cache -> the one-file download that fixes it; in the cache but not
    readable by this transformers -> that file and transformers' reason (was: 'neither a preset nor an existing
    config JSON' and the list of presets, for both)."""
    from huggingface_hub import constants

    from neusight.graph.models import build_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelError, match=r"Hub id, but its config.json is not in your Hugging Face cache \("
                                         + re.escape(str(tmp_path)) + r"\).*hf download acme/not-cached config.json"):
        build_model("acme/not-cached")
    snapshot = tmp_path / "models--acme--odd" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--odd" / "refs").mkdir()
    (tmp_path / "models--acme--odd" / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "no_such_type_xyz"}))
    with pytest.raises(ModelError, match=re.escape(f"its cached config.json ({snapshot / 'config.json'}) cannot be "
                                                   "read by transformers") + ".*no_such_type_xyz"):
        build_model("acme/odd")


def test_data_dependent_module_names_op_and_module():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            y = self.inner(x)
            return y[y > 0]  # boolean indexing: data-dependent shape

    with pytest.raises((TraceError, ModelError), match="meta"):
        neusight.trace(Bad(), batch_size=2, input_shapes=[(4,)])


class _Branchy(nn.Module):
    """Branches on tensor values the way models check their masks and outputs."""

    def __init__(self, read_a_count: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.read_a_count = read_a_count

    def forward(self, x):
        mask = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
        y = self.lin(x) if mask.all() else self.lin(x) * mask[..., None]   # no padding: no masking
        if torch.isnan(y).any().item():
            raise RuntimeError("NaN")
        if self.read_a_count:
            n = int(mask.sum().item())   # a size read from the data
            y = y[:, :n]
        return y


def test_branches_on_tensor_values_take_the_plain_batch_path():
    """all() is true and any() false on meta tensors (no padding, no NaN), as in a plain batch; the kernels of
    both checks are recorded, the masked branch is not taken."""
    g = neusight.trace(_Branchy(), batch_size=2, input_shapes=[(8,)])
    ops = list(g.kernels["aten_op"])
    assert "aten.mul.Tensor" not in ops
    assert {"aten.all.default", "aten.any.default", "aten.isnan.default"} <= set(ops)
    assert (g.kernels["family"] == "linear").sum() == 1


def test_a_value_read_back_from_the_data_is_refused_with_the_module():
    with pytest.raises(TraceError, match=r"read back in module '<root>' .*\(\) int64 tensor"):
        neusight.trace(_Branchy(read_a_count=True), batch_size=2, input_shapes=[(8,)])


_SMALL_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}


@pytest.mark.parametrize("cfg,cls", [
    # transformers asks `pad_token_id in input_ids` when no attention mask is given
    ({"model_type": "deberta-v2", **_SMALL_TEXT, "vocab_size": 512}, "DebertaV2ForMaskedLM"),
    # global-attention tokens: `is_index_global_attn.any().item()`
    ({"model_type": "longformer", **_SMALL_TEXT, "vocab_size": 512, "attention_window": 8}, "LongformerForMaskedLM"),
    # masking_utils skips an all-ones padding mask: `padding_mask.all()`
    ({"model_type": "megatron-bert", **_SMALL_TEXT, "vocab_size": 512}, "MegatronBertForCausalLM"),
    # no causal-LM or pretraining head: the masked-LM one
    ({"model_type": "modernbert", **_SMALL_TEXT}, "ModernBertForMaskedLM"),
])
def test_text_models_that_check_their_inputs_trace(cfg, cls):
    g = neusight.trace(cfg, batch_size=2, seq_len=32, mode="training")
    assert g.notes[0].startswith(f"{cls} from")
    assert set(g.kernels["phase"]) >= {"forward", "loss", "backward"}
    assert (g.kernels["family"] == "linear").sum() > 0


def test_masked_lm_head_and_bare_encoders():
    bert = {"model_type": "bert", **_SMALL_TEXT, "vocab_size": 512}
    g = neusight.trace(bert, batch_size=2, seq_len=16, mode="training", head="masked-lm")
    assert g.notes[0].startswith("BertForMaskedLM from")
    # a model with no task head at all (an embedding encoder) trains on the mean of its output
    from neusight.graph.models import build_model

    built = build_model(bert)
    args, kwargs = built.make_inputs(2, 16)
    out = built.module(*args, **kwargs)
    base = type("Bare", (), {"last_hidden_state": out.logits})()
    assert built.loss(base, args, kwargs).shape == ()


def test_negative_max_positions_mean_no_limit():
    """XLNet's config says max_position_embeddings=-1 (relative positions): any length, not 'at most -1'."""
    from neusight.graph.models import build_model

    built = build_model({"model_type": "xlnet", "d_model": 64, "n_layer": 1, "n_head": 2, "d_inner": 128,
                         "vocab_size": 512})
    assert built.max_seq_len is None


def test_module_without_input_shapes():
    with pytest.raises(InputError, match="input_shapes"):
        neusight.trace(nn.Linear(3, 3), batch_size=2)


def test_broken_config_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        neusight.trace(str(p))
    p.write_text('{"n_layer": 2}')
    with pytest.raises(ModelError, match="model_type"):
        neusight.trace(str(p))


def test_a_config_in_memory_traces_like_its_json(tmp_path):
    import json

    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4)
    p = tmp_path / "config.json"
    p.write_text(cfg.to_json_string())
    want = neusight.trace(str(p), batch_size=2, seq_len=16, mode="training").kernels
    for model in (cfg, json.loads(p.read_text())):     # a PretrainedConfig, a dict
        got = neusight.trace(model, batch_size=2, seq_len=16, mode="training").kernels
        assert got[["family", "flops", "bytes"]].equals(want[["family", "flops", "bytes"]])
    with pytest.raises(ModelError, match="model_type"):
        neusight.trace({"n_layer": 2})


def test_xlnet_whose_attention_weights_are_made_on_the_cpu_traces_in_the_run_dtype():
    # XLNet makes its attention weights with torch.FloatTensor, which ignores torch.device("meta") and is FP32: they
    # are moved to the meta device in the run's dtype, so the projections run as the model's other GEMMs do
    import transformers

    cfg = transformers.XLNetConfig(vocab_size=256, d_model=64, n_layer=2, n_head=4, d_inner=128)
    k = neusight.trace(cfg, batch_size=2, seq_len=16, mode="training", dtype="bfloat16").kernels
    gemms = k[k.family.isin(["linear", "bmm"])]
    assert len(gemms) and set(gemms.dtype) == {"bfloat16"}
    # q, k, v and o of every layer's rel_attn, each 2 x (batch x seq) x d_model x d_model FLOPs in the forward
    proj = gemms[(gemms.phase == "forward") & gemms.module.str.endswith("rel_attn")
                 & (gemms.flops == 2 * 32 * 64 * 64)]
    assert len(proj) == 2 * 4


def test_jetmoe_gates_that_read_token_counts_back_trace_under_balanced_routing():
    # JetMoE's gate hands its experts a .tolist() of token counts, which a trace of shapes cannot read: the balanced
    # split stands in, 2 x 16 tokens x top-2 = 64 pairs over 4 experts, 16 rows for every expert's GEMM
    import transformers

    cfg = transformers.JetMoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_local_experts=4,
                                    num_experts_per_tok=2, kv_channels=16, num_key_value_heads=2, vocab_size=256)
    g = neusight.trace(cfg, batch_size=2, seq_len=16, mode="training")
    assert any("balanced routing" in n and "4 top-k gates (4 experts)" in n for n in g.notes)
    k = g.kernels
    ups = k[(k.phase == "forward") & (k.family == "linear") & k.module.str.endswith("mlp.input_linear")]
    assert len(ups) == 2 * 4 and set(ups.dims) == {(1, 16, 64, 2 * 96)}
    assert (k.phase == "backward").any() and k.module.str.contains("self_attention.experts").any()


def test_longcat_zero_computation_experts_trace_under_balanced_routing():
    # LongCat-Flash's experts find the experts hit with nonzero; balanced over all 12 choices (8 routed, 4 that pass
    # their tokens through), 2 x 16 tokens x top-3 = 96 pairs give 8 rows to each: 8 gate-up and 8 down GEMMs of 8
    # rows, none for the zero-computation experts
    import transformers

    cfg = transformers.LongcatFlashConfig(num_layers=1, hidden_size=256, ffn_hidden_size=512, expert_ffn_hidden_size=64,
                                          num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                          n_routed_experts=8, zero_expert_num=4, moe_topk=3)
    g = neusight.trace(cfg, batch_size=2, seq_len=16, mode="training")
    assert any("1 expert layer (8 routed + 4 zero-computation experts)" in n for n in g.notes)
    k = g.kernels
    gemms = k[(k.phase == "forward") & k.module.str.endswith("mlp.experts") & (k.family == "linear")]
    assert len(gemms) == 16 and set(gemms.dims) == {(1, 8, 256, 2 * 64), (1, 8, 64, 256)}


def test_a_language_model_whose_config_has_an_image_size_is_traced_as_text():
    # Fuyu's config has num_channels and image_size (its image patches) like an image model's, but transformers runs
    # it as a causal LM: it is traced through its language model, with seq_len, not refused as an image model
    import transformers

    cfg = transformers.FuyuConfig(text_config=dict(model_type="persimmon", hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4, vocab_size=512))
    g = neusight.trace(cfg, batch_size=2, seq_len=16, mode="training")
    assert g.notes[0].startswith("the language model of fuyu (its text_config, persimmon)")
    assert (g.kernels.family == "linear").any()
    with pytest.raises(InputError, match="image_size=224 is for image models"):
        neusight.trace(cfg, batch_size=2, seq_len=16, image_size=224)


def test_a_parameter_made_off_the_meta_device_moves_there_and_stays_tied():
    from neusight.graph.models import _strays_to_meta

    shared = torch.nn.Parameter(torch.FloatTensor(3, 4))   # a legacy constructor: CPU, FP32
    a, b = torch.nn.Module(), torch.nn.Module()
    a.w, b.w = shared, shared
    with torch.device("meta"):
        lin = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
    model = torch.nn.ModuleDict({"a": a, "b": b, "lin": lin})
    _strays_to_meta(model, torch.bfloat16)
    assert a.w is b.w and a.w.device.type == "meta" and a.w.dtype == torch.bfloat16 and a.w.shape == (3, 4)
    assert model.lin.weight.device.type == "meta" and len(list(model.parameters())) == 3


@pytest.mark.parametrize("cfg,fragment", [
    ({"model_type": "musicgen"}, "no token vocabulary; .* a multimodal model through the language model of its "
                                 "text_config, which this config lacks"),
    ({"model_type": "wav2vec2", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
      "intermediate_size": 64}, "takes input_values rather than token ids"),
])
def test_configs_without_token_or_pixel_inputs_are_refused_clearly(tmp_path, cfg, fragment):
    import json

    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=fragment):
        neusight.trace(str(p), batch_size=1, seq_len=16)


_SMALL_LM = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512}


def test_a_multimodal_config_is_forecast_through_its_language_model():
    """LLaVA's config (a vision tower + a Llama): the Llama alone, the same kernels as its own config, with a note."""
    text = {"model_type": "llama", **_SMALL_LM}
    alone = neusight.trace(text, batch_size=2, seq_len=16, mode="training")
    g = neusight.trace({"model_type": "llava", "text_config": text}, batch_size=2, seq_len=16, mode="training")
    assert g.kernels[["family", "flops", "bytes"]].equals(alone.kernels[["family", "flops", "bytes"]])
    assert g.notes[0].startswith("the language model of llava (its text_config, llama)")
    assert "the vision encoder is not traced" in g.notes[0]


_TINY_CLIP = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
_TINY_LLAVA = {"model_type": "llava", "image_token_index": 500, "text_config": {"model_type": "llama", **_SMALL_LM},
               "vision_config": _TINY_CLIP}


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_images_run_the_image_encoder_and_projector_before_the_language_model(mode):
    """images=2: LLaVA's image-text class on 2 images per sequence: CLIP's patch convolution on batch x 2 images of
    16 patches, their 16 features each at image tokens of the 48 positions, the language model and head over all
    48. Parameters = the composite model's, its vision tower included; GEMM FLOPs = torch's FlopCounterMode of the
    same forward (and backward)."""
    import transformers

    from neusight.graph.models import build_model, flop_counter_total

    g = neusight.trace(dict(_TINY_LLAVA), batch_size=2, seq_len=48, mode=mode, images=2, optimizer=None)
    assert g.images == 2
    assert ("2 images of 56x56 per sequence through its clip_vision_model encoder and projector, 16 positions"
            in g.notes[0])
    k = g.kernels
    conv = k[(k["family"] == "conv") & (k["phase"] == "forward")]
    assert list(conv["dims"]) == [(1, 2 * 2 * 16, 3 * 14 * 14, 32)]
    head = k[(k["module"] == "lm_head") & (k["phase"] == "forward")]
    assert [tuple(d) for d in head["dims"]] == [(1, 2 * 48, 64, 512)]
    composite = transformers.AutoConfig.for_model("llava", text_config={"model_type": "llama", **_SMALL_LM},
                                                  vision_config=_TINY_CLIP)
    with torch.device("meta"):
        full = transformers.LlavaForConditionalGeneration(composite)
    assert sum(t.numel for t in g.params) == sum(p.numel() for p in full.parameters())
    text_only = neusight.trace(dict(_TINY_LLAVA), batch_size=2, seq_len=48, mode=mode, optimizer=None)
    assert sum(t.numel for t in text_only.params) < sum(t.numel for t in g.params)
    reference = flop_counter_total(build_model(dict(_TINY_LLAVA), images=2), mode, 2, 48)
    assert g.flops(None, ("linear", "bmm", "conv")) == pytest.approx(reference, rel=0.01)
    assert g.unmodeled == []     # the features' scatter into the embeddings and, in training, its gradient


def test_images_take_an_encoders_pooled_token_count():
    """Gemma 3: SigLIP's patches (a padding='valid' convolution) pooled to mm_tokens_per_image tokens per image."""
    vision = {**_TINY_CLIP, "model_type": "siglip_vision_model"}
    cfg = {"model_type": "gemma3", "mm_tokens_per_image": 4, "vision_config": vision,
           "text_config": {"model_type": "gemma3_text", **_SMALL_LM}}
    g = neusight.trace(cfg, batch_size=1, seq_len=20, mode="training", images=3)
    assert ("3 images of 56x56 per sequence through its siglip_vision_model encoder and projector, 4 positions"
            in g.notes[0])
    conv = g.kernels[(g.kernels["family"] == "conv") & (g.kernels["phase"] == "forward")]
    assert list(conv["dims"]) == [(1, 3 * 16, 3 * 14 * 14, 32)]
    with pytest.raises(InputError, match=r"seq_len=11 cannot hold the 12 image tokens of images=3 \(4 per image\)"):
        neusight.trace(cfg, batch_size=1, seq_len=11, images=3)


def test_images_of_a_composite_config_with_its_own_vocabulary():
    """PaliGemma's config carries the vocabulary itself (its text-only trace is the composite class already): images=1
    encodes the image too, with no new parameters."""
    vision = {**_TINY_CLIP, "model_type": "siglip_vision_model"}
    cfg = {"model_type": "paligemma", "vision_config": vision, "text_config": {"model_type": "gemma", **_SMALL_LM},
           "projection_dim": 64}
    g = neusight.trace(copy.deepcopy(cfg), batch_size=2, seq_len=20, images=1)
    assert ("1 image of 56x56 per sequence through its siglip_vision_model encoder and projector, 16 positions"
            in g.notes[0])
    text_only = neusight.trace(copy.deepcopy(cfg), batch_size=2, seq_len=20)
    assert sum(t.numel for t in g.params) == sum(t.numel for t in text_only.params)
    assert g.flops(None, ("conv",)) > 0 == text_only.flops(None, ("conv",))


@pytest.mark.parametrize("name, billions", [("llava-1.5-7b", 7.06), ("llava-1.5-13b", 13.4)])
def test_llava_presets_have_their_published_sizes_and_image_tokens(name, billions):
    """llava-hf's model cards: 7.06B / 13.4B parameters (the vision tower and projector included); 576 tokens per
    336 x 336 image (24 x 24 patches of 14)."""
    g = neusight.trace(name, batch_size=1, seq_len=600, images=1)
    assert sum(t.numel for t in g.params) / 1e9 == pytest.approx(billions, rel=0.005)
    assert ("1 image of 336x336 per sequence through its clip_vision_model encoder and projector, 576 positions"
            in g.notes[0])


@pytest.mark.parametrize("model,kw,error,fragment", [
    (_TINY_LLAVA, dict(seq_len=64, kv_cache=63), InputError, r"images=1 with kv_cache=63: the images are encoded in"),
    (_TINY_LLAVA, dict(seq_len=64, tensor_parallel=2), InputError, r"images=1 with tensor_parallel=2: splitting"),
    (_TINY_LLAVA, dict(seq_len=64, head="masked-lm"), InputError, r"head='masked-lm': images= traces llava's"),
    ("gpt2", dict(seq_len=64), InputError, r"images=1 is for multimodal models with an image encoder .* 'gpt2'"),
    ("resnet18", {}, InputError, r"images=1 is for multimodal models .* resnet18 is a CNN"),
    (torch.nn.Linear(4, 4), dict(input_shapes=[(4,)]), InputError, r"images=1 is for multimodal Hugging Face models; "
     r"Linear is an nn.Module"),
    ("vit-base", {}, InputError, r"images=1 is for multimodal models with an image encoder .* 'vit-base' \(vit\)"),
    ({"model_type": "qwen2_vl"}, dict(seq_len=64), ModelError,
     r"Qwen2VLForConditionalGeneration's image encoder \(qwen2_vl_vision\) cannot be traced on fixed-size pixel"),
])
def test_image_runs_not_modelled_are_refused(model, kw, error, fragment):
    with pytest.raises(error, match=fragment):
        neusight.trace(copy.deepcopy(model), batch_size=1, images=1, **kw)


def test_images_with_pipeline_stages_are_refused_and_data_parallel_replicas_run():
    with pytest.raises(InputError, match=r"pp=2 with images=1: how pipeline stages share an image encoder's layers"):
        neusight.predict_parallel(dict(_TINY_LLAVA), "h100-sxm5-80gb", 4, 64, "training", pp=2, microbatches=2,
                                  images=1)
    replicas = neusight.predict_parallel(dict(_TINY_LLAVA), "h100-sxm5-80gb", 4, 64, "training", dp=2, images=1)
    assert replicas.per_gpu.graph.images == 1


def test_images_in_generation_are_refused():
    with pytest.raises(InputError, match=r"images=1: generation from a prompt with images is not modelled"):
        neusight.predict_generation(dict(_TINY_LLAVA), "l4", 1, 64, 8, images=1)


@pytest.mark.parametrize("images", [0, -1, True, 1.5])
def test_images_must_be_a_positive_count(images):
    with pytest.raises(InputError, match=r"is not a positive integer \(images per sequence\)"):
        neusight.trace(dict(_TINY_LLAVA), batch_size=1, seq_len=64, images=images)


@pytest.mark.parametrize("tied", [False, True])
def test_a_language_model_without_a_causal_lm_class_gets_its_composite_models_head(tied):
    """Qwen2-VL's text model has no causal-LM class of its own in transformers (its head is
    Qwen2VLForConditionalGeneration's): traced with that head, as a text-only prompt runs the composite model, so
    training has its vocabulary GEMMs and cross-entropy and generation its KV cache. Parameters = the composite
    model's, its vision tower left out, tied or not (before: traced bare, the mean of its output as the loss, and
    kv_cache refused)."""
    import transformers

    # heads of 128 (hidden / heads): its default M-RoPE sections need them
    text = {"model_type": "qwen2_vl_text", **_SMALL_LM, "hidden_size": 256, "head_dim": 128}
    cfg = {"model_type": "qwen2_vl", "text_config": text, "tie_word_embeddings": tied}
    g = neusight.trace(cfg, batch_size=2, seq_len=16, mode="training")
    assert any("has no causal-LM class: traced with the LM head qwen2_vl's model puts on it" in n for n in g.notes)
    head = g.kernels[(g.kernels["module"] == "lm_head") & (g.kernels["phase"] == "forward")]
    assert len(head) == 1 and tuple(head["dims"].iloc[0]) == (1, 32, 256, 512)
    composite = transformers.AutoConfig.for_model("qwen2_vl", text_config=text, tie_word_embeddings=tied)
    with torch.device("meta"):
        full = transformers.Qwen2VLForConditionalGeneration(composite)
    expected = sum(p.numel() for n, p in full.named_parameters() if ".visual." not in f".{n}")
    assert sum(t.numel for t in g.params) == expected
    step = neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=15)          # a decode step: one token's logits
    head = step.kernels[step.kernels["module"] == "lm_head"]
    assert tuple(head["dims"].iloc[0]) == (1, 2, 256, 512)
    assert step.flops(families=("bmm",)) > 0


def test_a_models_own_cache_class_is_filled_by_a_prefill_for_a_decode_step():
    """MiniMax takes only its own MiniMaxCache (its lightning-attention layers' states beside the keys and values):
    the decode step gets that cache as a prefill of the context leaves it (before: transformers refused the plain
    DynamicCache). The full-attention layer reads the 63 cached tokens and the new one, the lightning layer its
    (heads, head_dim, head_dim) state, held as the step's input."""
    cfg = {"model_type": "minimax", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": ["linear_attention", "full_attention"],
           "block_size": 16}
    g = neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=63)
    scores = g.kernels[(g.kernels["module"] == "model.layers.1.self_attn") & (g.kernels["family"] == "bmm")]
    assert [d[-1] for d in scores["dims"]][:1] == [64]
    assert {(2, 4, 16, 16), (2, 2, 64, 16)} <= {tuple(t.shape) for t in g.held}


def test_a_sparse_attention_indexer_caches_its_keys_for_a_decode_step():
    """DeepSeek-V3.2's attention (transformers' DynamicIndexedLayer): a decode step's cache holds the indexer's
    keys beside the latent keys and values, and the indexer scores every cached token (before: transformers
    refused a plain DynamicCache). static_cache is refused with the reason."""
    cfg = {"model_type": "deepseek_v32", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4,
           "num_key_value_heads": 4, "n_routed_experts": 4, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
           "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
           "head_dim": 16, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 8}
    g = neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=63)
    k = g.kernels
    scores = k[k["module"].str.endswith("self_attn.indexer") & (k["family"] == "bmm")]
    assert len(scores) and all(d[-1] == 64 for d in scores["dims"])          # every cached token and the new one
    with pytest.raises(InputError, match=r"indexer keys beside them \(DynamicIndexedLayer\)"):
        neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=63, static_cache=True,
                       attn_implementation="sdpa")


def test_a_models_own_cache_layers_hold_a_prefills_state_for_a_decode_step():
    """DeepSeek-V4's compressed attention caches its own layer kind (a sliding window of keys plus compressed
    entries, one per compress_rate tokens, and buffers of the tokens not yet compressed): the decode step's cache is
    what a prefill of the context leaves in it, so the heavily compressed attention reads the window and
    context / 128 entries (before: the window's keys grown from a one-token probe, and the step failed)."""
    cfg = {"model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
           "qk_rope_head_dim": 16, "q_lora_rank": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
           "sliding_window": 16, "layer_types": ["heavily_compressed_attention"] * 2}
    for context in (256, 1024):
        g = neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=context - 1)
        k = g.kernels
        read = 16 + context // 128                          # the window's keys and the compressed entries
        gemms = k[(k["module"] == "model.layers.1.self_attn") & (k["family"] == "bmm")]["dims"].tolist()
        assert gemms == [(2 * 4, 1, 64, read), (2 * 4, 1, read, 64)], (context, gemms)   # scores, then values


def test_a_cache_probe_takes_a_plain_batchs_branch_where_transformers_checks_for_padding():
    """RoFormer's causal LM checks its input ids for padding tokens (a value read back) before the KV cache is
    filled: the unrecorded probe of the cache answers as the trace does, a plain batch without padding (before: torch's
    'Tensor.item() cannot be called on meta tensors')."""
    cfg = {"model_type": "roformer", "is_decoder": True, "hidden_size": 64, "embedding_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 512,
           "pad_token_id": 0}
    g = neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=31)
    gemms = g.kernels[(g.kernels["family"] == "bmm") & g.kernels["module"].str.contains(r"layer\.1\.")]
    # 2 x 4 heads of 16: the new token's scores over the 31 cached and itself, then over their values
    assert gemms["dims"].tolist() == [(8, 1, 16, 32), (8, 1, 32, 16)]


def test_static_cache_refuses_cache_layers_it_cannot_write_in_place():
    """Falcon-H1's layers cache attention keys and values and a state-space layer's states in one layer
    (transformers' LinearAttentionAndFullAttentionLayer): static_cache=true is refused with the reason, where the
    keys and values were concatenated every step under a note saying "written in place"."""
    cfg = {"model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "mamba_d_ssm": 64,
           "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 8}
    assert neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=31, attn_implementation="sdpa").kernels is not None
    with pytest.raises(InputError, match=r"conv and recurrent states beside them "
                                         r"\(LinearAttentionAndFullAttentionLayer\)"):
        neusight.trace(cfg, batch_size=2, seq_len=1, kv_cache=31, static_cache=True, attn_implementation="sdpa")


# Small state-space / linear-attention configs (neusight.graph.ssm): Mamba's selective scan, Mamba-2's chunked scan
# and gated norm, Qwen3-Next's gated delta rule next to a full-attention layer.
SSM = {
    "mamba": {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 512},
    "mamba2": {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 512, "num_heads": 8,
               "head_dim": 16, "state_size": 16, "n_groups": 1, "chunk_size": 8},
    "qwen3_next": {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512,
                   "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "layer_types": ["linear_attention", "full_attention"]},
}


def _needs_hub_fallbacks(model_type: str) -> None:
    import importlib
    from pathlib import Path

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    if "use_kernel_func_from_hub_with_fallback" not in Path(modeling.__file__).read_text():
        pytest.skip("this transformers marks its fused-kernel layers another way")


def _fused_rows(g):
    k = g.kernels
    return k[k["aten_op"].str.startswith("neusight.fused.")]


def test_reference_code_of_fused_kernel_layers_is_named():
    """Mamba's scan and causal conv1d have fused CUDA kernels in optional packages; with ssm_kernels='reference' the
    trace follows transformers' PyTorch code for them and says so; by default it traces those fused kernels and
    says that instead. A plain transformer gets neither note."""
    _needs_hub_fallbacks("mamba")
    notes = neusight.trace(SSM["mamba"], batch_size=1, seq_len=16, ssm_kernels="reference").notes
    note = next(n for n in notes if "PyTorch reference code" in n)
    assert "mamba_ssm" in note and "causal_conv1d" in note and "selective_scan_fn" in note
    notes = neusight.trace(SSM["mamba"], batch_size=1, seq_len=16).notes
    assert not any(n.startswith("transformers' PyTorch reference code") for n in notes)
    note = next(n for n in notes if "traced as the fused kernels" in n)
    assert "causal_conv1d_fn, selective_scan_fn" in note and "mamba_ssm" in note
    plain = neusight.trace("gpt2", batch_size=1, seq_len=16).notes
    assert not any("PyTorch reference code" in n or "fused kernels of" in n for n in plain)
    with pytest.raises(InputError, match="ssm_kernels='fancy'"):
        neusight.trace("gpt2", batch_size=1, seq_len=16, ssm_kernels="fancy")


@pytest.mark.parametrize("name", list(SSM))
def test_fused_ssm_calls_keep_the_forward_work_in_one_kernel_each(name):
    """ssm_kernels='fused': each call of a fused-kernel layer is one kernel with the reference code's FLOPs (the
    forward's total work is unchanged), moving only the call's inputs and outputs; in training one backward kernel
    per call of three times its forward's FLOPs, and every parameter still gets its gradient."""
    _needs_hub_fallbacks(name)
    cfg = SSM[name]
    ref_i = neusight.trace(cfg, batch_size=2, seq_len=32, ssm_kernels="reference")
    fus_i = neusight.trace(cfg, batch_size=2, seq_len=32)
    assert ref_i.flops() == pytest.approx(fus_i.flops(), rel=1e-12)
    assert len(fus_i.kernels) < len(ref_i.kernels)
    fwd = _fused_rows(fus_i)
    assert len(fwd) >= 2 and set(fwd["phase"]) == {"forward"}
    names = set(fwd["kernel"])
    assert "causal_conv1d_fn" in names
    assert names & {"selective_scan_fn", "mamba_chunk_scan_combined", "chunk_gated_delta_rule"}
    for r in fus_i.ops:   # one op, one kernel, bytes of what the call reads and writes
        if r.call.op.startswith("neusight.fused."):
            (kern,) = r.kernels
            assert kern.bytes == sum(t.view_nbytes for t in {(t.storage, t.shape, t.stride): t
                                                             for t in r.call.tensor_args() + list(r.call.outputs)}.values())
    ref_t = neusight.trace(cfg, batch_size=2, seq_len=32, mode="training", optimizer=None, ssm_kernels="reference")
    fus_t = neusight.trace(cfg, batch_size=2, seq_len=32, mode="training", optimizer=None)
    assert ref_t.flops("forward") == pytest.approx(fus_t.flops("forward"), rel=1e-12)
    assert sorted(t.shape for t in ref_t.grads) == sorted(t.shape for t in fus_t.grads)
    rows = _fused_rows(fus_t)
    for kernel in rows.loc[rows["phase"] == "forward", "kernel"]:
        f = rows[(rows["kernel"] == kernel) & (rows["phase"] == "forward")]
        b = rows[(rows["kernel"] == kernel + "_bwd") & (rows["phase"] == "backward")]
        assert len(b) == len(f)
        assert b["flops"].sum() == pytest.approx(3 * f["flops"].sum())


def test_fused_mamba2_training_fuses_the_gated_norm_only_in_training():
    """Mamba-2's training step with mamba_ssm runs its gated RMS norm inside the whole-mixer kernel (one Triton norm
    kernel each way); inference runs transformers' PyTorch norm even with the package."""
    _needs_hub_fallbacks("mamba2")
    train = _fused_rows(neusight.trace(SSM["mamba2"], batch_size=2, seq_len=32, mode="training", optimizer=None))
    norm = train[train["kernel"].str.startswith("rmsnorm_gated")]
    assert list(norm["kernel"]) == ["rmsnorm_gated", "rmsnorm_gated_bwd"] and set(norm["family"]) == {"layernorm"}
    infer = _fused_rows(neusight.trace(SSM["mamba2"], batch_size=2, seq_len=32))
    assert not infer["kernel"].str.startswith("rmsnorm_gated").any()


def test_generation_step_of_hybrid_models():
    """A decode step of a state-space / hybrid model reads the attention layers' cached keys (cache + new tokens
    long) and the fixed-size conv and recurrent states; its fused calls are the one-token update kernels."""
    _needs_hub_fallbacks("qwen3_next")
    g = neusight.trace(SSM["qwen3_next"], batch_size=2, seq_len=1, kv_cache=15)
    k = g.kernels
    scores = k[(k["family"] == "bmm") & k["module"].str.contains("self_attn")]
    assert scores["dims"].iloc[0] == (8, 1, 16, 16)     # 2 x 4 heads, 1 query, head_dim 16, 15 + 1 keys
    assert set(_fused_rows(g)["kernel"]) == {"causal_conv1d_update", "fused_recurrent_gated_delta_rule"}
    for name in ("mamba", "mamba2"):
        assert set(_fused_rows(neusight.trace(SSM[name], batch_size=2, seq_len=1, kv_cache=15))["kernel"]) == {
            "causal_conv1d_update", "selective_state_update"}


def test_deterministic_trace():
    a = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training").kernels
    b = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training").kernels
    assert a.equals(b)
    # with recomputation too: its module attribution counts module entries, which go on rising in the process
    run = dict(batch_size=2, seq_len=32, mode="training", gradient_checkpointing=True)
    c, d = (neusight.trace("gpt2", **run).kernels for _ in range(2))
    assert c["recompute"].any() and c.equals(d)


_M2M = dict(model_type="m2m_100", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512,
            encoder_layerdrop=0.5, decoder_layerdrop=0.5)


def test_layerdrop_is_off_in_a_training_trace():
    """M2M-100 / NLLB skip each layer with probability encoder_layerdrop in training by a random draw: the trace runs
    every layer (the same kernels as with LayerDrop 0), says so, and inference has nothing to say."""
    runs = [neusight.trace(_M2M, batch_size=2, seq_len=16, mode="training") for _ in range(3)]
    plain = neusight.trace({**_M2M, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0}, batch_size=2, seq_len=16,
                           mode="training")
    for g in runs:
        assert g.kernels.equals(plain.kernels)
    [note] = [n for n in runs[0].notes if "LayerDrop" in n]
    assert "decoder_layerdrop=0.5, encoder_layerdrop=0.5" in note and "50%" in note
    assert not [n for n in plain.notes if "LayerDrop" in n]
    assert not [n for n in neusight.trace(_M2M, batch_size=2, seq_len=16).notes if "LayerDrop" in n]


class _RandomDepth(torch.nn.Module):
    """A user module that skips its second layer by Python's random generator, with a LayerDrop attribute."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.layerdrop = 0.3

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if self.training and i == 1 and random.random() < 0.5:
                continue
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return x


def test_random_control_flow_traces_the_same_and_leaves_the_callers_generators_alone():
    model = _RandomDepth()
    random.seed(7)
    torch.manual_seed(7)
    expected = (random.random(), torch.rand(()).item())
    random.seed(7)
    torch.manual_seed(7)
    graphs = [neusight.trace(model, batch_size=2, input_shapes=[(16,)], mode="training") for _ in range(3)]
    assert (random.random(), torch.rand(()).item()) == expected
    assert all(g.kernels.equals(graphs[0].kernels) for g in graphs)
    assert model.layerdrop == 0.3                  # restored after the trace
    assert any("layerdrop=0.3" in n for n in graphs[0].notes)
    linear = graphs[0].kernels.query("phase == 'forward' and family == 'linear'")
    assert len(linear) in (3, 4)                   # LayerDrop off; the module's own coin decides layer 1


def test_tracing_a_module_leaves_it_as_it_was():
    """The tracer works on a meta copy: the caller's weights, gradients and layers are untouched (a training trace
    writes gradients, LoRA adds adapters), tied weights stay tied in the copy, and a second trace is the same."""
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64, bias=False))
    model[2].weight = model[0].weight              # tied input / output embedding
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [n for n, _ in model.named_modules()]
    kw = dict(batch_size=2, seq_len=8, input_shapes=[(("seq",), torch.long)], mode="training")
    first = neusight.trace(model, **kw)
    lora = neusight.trace(model, **kw, lora_rank=4, lora_targets=["1"])
    again = neusight.trace(model, **kw)
    assert first.kernels.equals(again.kernels)
    assert not lora.kernels.equals(first.kernels)
    assert [n for n, _ in model.named_modules()] == modules
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sum(t.numel for t in first.params) == 64 * 16 + 16 * 16 + 16   # the tied weight once


def test_fused_adam_clipping_and_zero_grad_are_one_pass_each():
    """A fused AdamW step moves 28 bytes per FP32 parameter in one kernel; clipping reads the gradients once and
    scales them (12 bytes), zeroing writes them (4 bytes); the foreach AdamW of PyTorch's default moves more."""
    g = neusight.trace("gpt2", batch_size=1, seq_len=32, mode="training", optimizer="adamw-fused",
                       clip_grad_norm=1.0, zero_grad=True)
    n = sum(t.numel for t in g.params)
    opt = g.kernels[g.kernels["phase"] == "optimizer"].set_index("aten_op")["bytes"]
    assert opt["aten._fused_adamw_.default"] == 28 * n
    assert opt["aten._foreach_norm.Scalar"] + opt["aten._foreach_mul_.Tensor"] == pytest.approx(12 * n, rel=1e-3)
    assert opt["aten._foreach_zero_.default"] == 4 * n
    foreach = neusight.trace("gpt2", batch_size=1, seq_len=32, mode="training", optimizer="adamw")
    assert foreach.kernels.query("phase == 'optimizer'")["bytes"].sum() > 28 * n
    with pytest.raises(InputError, match="adamw-fused"):
        neusight.trace("gpt2", batch_size=1, seq_len=32, mode="training", optimizer="lion")


def test_step_options_without_a_step_are_refused():
    with pytest.raises(InputError, match="clip_grad_norm=1.0 / zero_grad=False belong to an optimizer step"):
        neusight.trace("gpt2", batch_size=1, seq_len=32, mode="inference", clip_grad_norm=1.0)
    with pytest.raises(InputError, match="zero_grad=True belong"):
        neusight.trace("gpt2", batch_size=1, seq_len=32, mode="training", optimizer=None, zero_grad=True)
    with pytest.raises(InputError, match="clip_grad_norm=-1 must be a positive number"):
        neusight.trace("gpt2", batch_size=1, seq_len=32, mode="training", clip_grad_norm=-1)


# ---------------------------------------------------------------------------------------------------------
# automatic mixed precision (neusight.graph.amp): torch.autocast's CUDA op lists, emulated on meta

@pytest.fixture(scope="module")
def gpt2_amp():
    return neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training", amp="float16")


def test_amp_runs_gemms_in_half_and_softmax_norms_loss_in_fp32(gpt2_amp):
    k = gpt2_amp.kernels
    assert set(k.loc[k["family"].isin(["linear", "bmm"]), "dtype"]) == {"float16"}
    assert set(k.loc[k["family"].isin(["softmax", "layernorm"]), "dtype"]) == {"float32"}
    # the model keeps FP32 weights, gradients and optimizer state; the step runs in FP32
    assert {p.dtype for p in gpt2_amp.params} == {"float32"} and {g.dtype for g in gpt2_amp.grads} == {"float32"}
    assert set(k.loc[k["phase"] == "optimizer", "dtype"]) <= {"float32"}
    assert gpt2_amp.amp == "float16" and any("autocast(float16)" in n for n in gpt2_amp.notes)


def test_amp_casts_each_weight_once_per_forward(gpt2_amp):
    # every block's c_attn weight (768 x 2304) is cast to float16 once in the forward, however often it is used
    casts = [op for op in gpt2_amp.ops if op.phase == "forward" and "_to_copy" in op.call.op
             and tuple(op.call.args[0].shape) == (768, 2304)]
    assert len(casts) == 12


def test_float16_training_adds_the_grad_scaler_and_bfloat16_does_not(gpt2_amp):
    def scaler_ops(g):
        return [op.call.op for op in g.ops if "_amp_" in op.call.op]

    assert scaler_ops(gpt2_amp) == ["aten._amp_foreach_non_finite_check_and_unscale_.default",
                                    "aten._amp_update_scale_.default"]
    unscale = gpt2_amp.kernels[gpt2_amp.kernels["aten_op"].str.contains("unscale")]
    assert len(unscale) == 1 and unscale["phase"].iloc[0] == "optimizer"
    assert unscale["bytes"].iloc[0] == 2 * sum(g.numel * 4 for g in gpt2_amp.grads)   # every gradient read and written
    bf16 = neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training", amp="bfloat16")
    assert scaler_ops(bf16) == [] and set(bf16.kernels.loc[bf16.kernels["family"] == "linear", "dtype"]) == {"bfloat16"}
    inference = neusight.trace("gpt2", batch_size=2, seq_len=64, mode="inference", amp=True)
    assert scaler_ops(inference) == [] and inference.amp == "float16"


def test_amp_on_a_half_model_or_an_unknown_dtype_is_refused():
    with pytest.raises(InputError, match="amp='float16'.*dtype='float16'"):
        neusight.trace("gpt2", batch_size=1, seq_len=8, dtype="float16", amp="float16")
    with pytest.raises(InputError, match="amp='float8'"):
        neusight.trace("gpt2", batch_size=1, seq_len=8, amp="float8")


# ---------------------------------------------------------------------------------------------------------
# neusight.graph.fastmeta: outputs of frequent ops built by rule instead of by their (Python) meta kernels

@pytest.mark.parametrize("model, kw", [
    ("gpt2", {"seq_len": 64, "mode": "training"}),
    ("gpt2", {"seq_len": 64, "mode": "training", "amp": "float16", "optimizer": "adamw-fused", "clip_grad_norm": 1.0}),
    ("bert-base", {"seq_len": 64, "mode": "training", "amp": "bfloat16", "attn_implementation": "sdpa"}),
    ("resnet18", {"mode": "training", "optimizer": "sgd"}),
    ("efficientnet-b0", {"mode": "training", "optimizer": "adam"}),
    ("llama-3-8b", {"seq_len": 16, "mode": "training", "amp": "bfloat16"}),
])
def test_fast_meta_rules_make_what_the_meta_kernels_make(monkeypatch, model, kw):
    from neusight.graph import fastmeta

    monkeypatch.setattr(fastmeta, "VERIFY", True)
    monkeypatch.setattr(fastmeta, "VERIFIED", 0)
    g = neusight.trace(model, batch_size=2, **kw)          # raises if a rule's output differs in shape, dtype, strides
    assert fastmeta.VERIFIED > 20 and len(g.kernels) > 100


def test_fast_meta_rules_leave_the_trace_unchanged(monkeypatch):
    from neusight.graph import fastmeta

    fast = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training").kernels
    monkeypatch.setattr(fastmeta, "FAST", {})
    slow = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training").kernels
    pd.testing.assert_frame_equal(fast, slow)


@pytest.mark.parametrize("name, billions, layers", [("llama-2-7b", 6.74, 32), ("llama-2-13b", 13.02, 40),
                                                    ("llama-3-8b", 8.03, 32), ("mistral-7b", 7.24, 32)])
def test_llama_family_presets_have_their_published_sizes(name, billions, layers):
    g = neusight.trace(name, batch_size=1, seq_len=16, mode="inference")
    assert sum(t.numel for t in g.params) / 1e9 == pytest.approx(billions, abs=0.01)
    # per layer q, k, v, o, gate, up, down projections, plus the LM head; RMSNorm, SwiGLU, rotary: modelled ops
    assert (g.kernels["family"] == "linear").sum() == 7 * layers + 1
    assert g.unmodeled == []


@pytest.mark.parametrize("name, billions, per_layer", [
    # model cards / the safetensors totals of the released checkpoints; OPT: Zhang et al. 2022, Table 1
    ("llama-2-70b", 68.98, 7), ("llama-3-70b", 70.55, 7), ("llama-3.1-405b", 405.85, 7), ("llama-3.2-1b", 1.24, 7),
    ("llama-3.2-3b", 3.21, 7), ("qwen2.5-7b", 7.62, 7), ("qwen2.5-72b", 72.7, 7), ("qwen3-8b", 8.19, 7),
    ("gemma-2-9b", 9.24, 7), ("phi-3-mini", 3.82, 4), ("phi-4", 14.66, 4),
    # Gemma 3 technical report, Table 1: embedding + other parameters, the vision encoder apart (1B: 302M + 698M,
    # 4B: 675M + 3,209M, 12B: 1,012M + 10,759M, 27B: 1,416M + 25,600M)
    ("gemma-3-1b", 1.000, 7), ("gemma-3-4b", 3.884, 7), ("gemma-3-12b", 11.771, 7), ("gemma-3-27b", 27.016, 7),
    ("opt-125m", 0.125, 6), ("opt-350m", 0.331, 6),
    ("opt-2.7b", 2.65, 6), ("opt-6.7b", 6.66, 6), ("opt-13b", 12.85, 6), ("opt-30b", 29.97, 6), ("opt-66b", 65.7, 6)])
def test_newer_decoder_presets_have_their_published_sizes(name, billions, per_layer):
    g = neusight.trace(name, batch_size=1, seq_len=16, mode="inference")
    assert sum(t.numel for t in g.params) / 1e9 == pytest.approx(billions, rel=0.005)
    layers = len({hit.group(1) for m in g.kernels["module"] if (hit := re.search(r"layers\.(\d+)\.", m))})
    # q, k, v, o and a gated MLP's three (Phi-3: fused qkv and gate_up); OPT: q, k, v, out, fc1, fc2; plus the head
    extra = 2 if name == "opt-350m" else 0        # its 512 -> 1024 projections in and out
    assert (g.kernels["family"] == "linear").sum() == per_layer * layers + 1 + extra
    assert g.unmodeled == []


@pytest.mark.parametrize("name, billions, active, rel", [
    # gpt-oss model card (OpenAI 2025, table 1): totals and active parameters per token, the unembedding counted
    # (a GEMM), the embedding not (a gather); Qwen3 model cards: 30.5B / 3.3B and 235B / 22B activated, the
    # embeddings counted, so their 0.31B / 0.62B (a gather) is taken off; those are rounded, hence the tolerance
    ("gpt-oss-20b", 20.91, 3.61, 0.002), ("gpt-oss-120b", 116.83, 5.13, 0.002),
    ("qwen3-30b-a3b", 30.5, 3.3 - 0.311, 0.02), ("qwen3-235b-a22b", 235.0, 22.0 - 0.622, 0.03)])
def test_2025_mixture_of_experts_presets_have_their_published_sizes(name, billions, active, rel):
    g = neusight.trace(name, batch_size=1, seq_len=64, mode="inference")
    assert sum(t.numel for t in g.params) / 1e9 == pytest.approx(billions, rel=min(rel, 0.005))
    gemm_flops = g.kernels.loc[g.kernels["family"] == "linear", "flops"].sum()
    assert gemm_flops / 64 / 2 / 1e9 == pytest.approx(active, rel=rel)
    assert g.unmodeled == []


@pytest.mark.parametrize("name, billions, non_embedding", [
    # Qwen3 model cards: parameters and non-embedding parameters in billions, as rounded there (the embeddings and
    # an untied LM head counted as embedding)
    ("qwen3-0.6b", 0.6, 0.44), ("qwen3-1.7b", 1.7, 1.4), ("qwen3-4b", 4.0, 3.6), ("qwen3-8b", 8.2, 6.95),
    ("qwen3-14b", 14.8, 13.2), ("qwen3-32b", 32.8, 31.2)])
def test_qwen3_dense_presets_have_their_published_sizes(name, billions, non_embedding):
    g = neusight.trace(name, batch_size=1, seq_len=16, mode="inference")
    sizes = {n: t.numel / 1e9 for n, t in zip(g.param_names, g.params)}
    embedding = sizes["model.embed_tokens.weight"] + sizes.get("lm_head.weight", 0.0)   # tied: one table
    assert sum(sizes.values()) == pytest.approx(billions, abs=0.05)
    assert sum(sizes.values()) - embedding == pytest.approx(non_embedding, abs=0.05 if non_embedding > 1 else 0.005)
    assert ("lm_head.weight" in sizes) == (billions > 5)          # the three smallest tie it to the embeddings
    assert g.unmodeled == []


def test_llama4_presets_have_their_published_sizes_and_run_experts_as_transformers_or_routed():
    """Meta's Llama 4 announcement: Scout 17B active of 109B (with its vision encoder, which the preset leaves out),
    Maverick 17B active of 400B; the active parameters count the 1.03B embedding, a gather here."""
    from neusight.graph.models import build_model

    maverick = build_model("llama-4-maverick").module
    assert sum(p.numel() for p in maverick.parameters()) / 1e9 == pytest.approx(400.0, rel=0.005)
    kw = dict(batch_size=1, seq_len=64, mode="inference", dtype="bfloat16")
    dense, routed = (neusight.trace("llama-4-scout", moe_kernels=k, **kw) for k in ("auto", "loop"))
    total = sum(t.numel for t in dense.params) / 1e9
    assert 107.0 < total < 109.0                       # the language model alone
    flops = lambda g, family: g.kernels.loc[g.kernels["family"] == family, "flops"].sum()  # noqa: E731
    assert flops(routed, "linear") / 64 / 2 / 1e9 == pytest.approx(17.0 - 1.03, rel=0.02)
    # transformers runs every expert on every token: the experts' batched GEMMs do 16 x the routed experts' work
    experts_dense = flops(dense, "bmm") - flops(routed, "bmm")              # the attention's bmm alike in both
    experts_routed = flops(routed, "linear") - flops(dense, "linear")
    assert experts_routed > 0 and experts_dense == pytest.approx(16 * experts_routed, rel=1e-12)
    assert any("all 16 experts run on every token" in n and "moe_kernels='grouped'" in n for n in dense.notes)
    assert any(n.startswith("mixture of experts traced under balanced routing") for n in routed.notes)
    assert dense.unmodeled == routed.unmodeled == []


def test_deepseek_presets_have_their_published_sizes():
    """DeepSeek-V2-Lite: 15.7B parameters, 2.4B active per token; DeepSeek-V3: 671B (without its multi-token-prediction
    module), built only (its trace is a 15 s job)."""
    g = neusight.trace("deepseek-v2-lite", batch_size=1, seq_len=64, mode="inference")
    assert sum(t.numel for t in g.params) / 1e9 == pytest.approx(15.71, rel=0.002)
    gemm_flops = g.kernels.loc[g.kernels["family"] == "linear", "flops"].sum()
    assert gemm_flops / 64 / 2 / 1e9 == pytest.approx(2.4, rel=0.03)
    assert g.unmodeled == []
    from neusight.graph.models import build_model

    v3 = build_model("deepseek-v3").module
    assert sum(p.numel() for p in v3.parameters()) / 1e9 == pytest.approx(671.0, rel=0.001)


def test_mixtral_and_vit_presets_have_their_published_sizes():
    # Mixtral 8x7B: 46.7B parameters, of which ~12.9B act on each token (2 of 8 experts)
    g = neusight.trace("mixtral-8x7b", batch_size=1, seq_len=64, mode="inference")
    assert sum(t.numel for t in g.params) / 1e9 == pytest.approx(46.70, abs=0.01)
    gemm_flops = g.kernels.loc[g.kernels["family"] == "linear", "flops"].sum()
    # 2 FLOPs per active weight and token: 12.9B less the 0.13B embedding table (a gather, not a GEMM)
    assert gemm_flops / 64 / 2 / 1e9 == pytest.approx(12.9 - 0.131, abs=0.03)
    # Mixtral 8x22B (its model card): 141B parameters, 39B active
    g = neusight.trace("mixtral-8x22b", batch_size=1, seq_len=64, mode="inference")
    assert sum(t.numel for t in g.params) / 1e9 == pytest.approx(140.6, rel=0.005)
    gemm_flops = g.kernels.loc[g.kernels["family"] == "linear", "flops"].sum()
    assert gemm_flops / 64 / 2 / 1e9 == pytest.approx(39.0 - 0.2, rel=0.01)
    # ViT-Base/16 and ViT-Large/16 (Dosovitskiy et al. 2021, Table 1): 86M and 304M parameters
    for name, millions in (("vit-base", 86.6), ("vit-large", 304.3)):
        g = neusight.trace(name, batch_size=1)
        assert sum(t.numel for t in g.params) / 1e6 == pytest.approx(millions, abs=0.1)


# ---------------------------------------------------------------------------------------------------------
# generation with a KV cache (kv_cache=): seq_len new tokens after kv_cache cached ones

def test_a_decode_step_attends_over_the_whole_cache_and_grows_it():
    g = neusight.trace("gpt2", batch_size=2, seq_len=1, mode="inference", kv_cache=63)
    assert g.kv_cache == 63 and any("KV cache" in n for n in g.notes)
    k = g.kernels
    qk = k[(k["family"] == "bmm") & (k["module"].str.endswith("h.0.attn"))]
    assert len(qk) == 2 and {d[-1] for d in qk["dims"]} | {d[-2] for d in qk["dims"]} >= {64}   # 1 query x 64 keys
    grow = k[(k["aten_op"].str.startswith("aten.cat")) & k["module"].str.endswith("h.0.attn")]
    assert len(grow) == 2                                      # keys and values, each cache concatenated with the new token
    assert {d for d in grow["dims"]} == {(2 * 12 * 64, 64)}     # (batch x heads x 64 positions, head_dim)


def test_a_static_cache_writes_the_new_tokens_in_place_instead_of_growing_the_cache():
    """static_cache=True: each layer copies its new token's keys and values into a buffer sized for the run (as
    transformers' StaticCache does) and attends over the filled part; nothing concatenates the whole cache."""
    grown, static = (neusight.trace("gpt2", batch_size=2, seq_len=1, kv_cache=63, static_cache=s) for s in (False, True))
    attn = lambda g, op: g.kernels[g.kernels["aten_op"].str.startswith(op)  # noqa: E731
                                   & g.kernels["module"].str.endswith("h.0.attn")]
    assert len(attn(grown, "aten.cat")) == 2 and len(attn(static, "aten.cat")) == 0
    writes = attn(static, "aten.copy_")
    new_token = 2 * 12 * 1 * 64 * 4                              # batch x heads x 1 token x head_dim x FP32
    assert len(writes) == 2 and (writes["bytes"] < 4 * new_token).all()
    assert attn(static, "aten.bmm")["flops"].sum() == attn(grown, "aten.bmm")["flops"].sum()   # 64 positions each
    assert any("written in place" in n for n in static.notes)
    fast, slow = (neusight.predict("llama-3.2-1b", "l4", batch_size=8, seq_len=1, kv_cache=2047, dtype="bfloat16",
                                   static_cache=s) for s in (True, False))
    assert fast.latency_ms < slow.latency_ms and fast.memory.peak_bytes < slow.memory.peak_bytes
    with pytest.raises(InputError, match="static_cache=True"):
        neusight.trace("gpt2", batch_size=2, seq_len=8, static_cache=True)


def test_generation_costs_grow_with_the_context_and_the_cache_is_held_in_memory():
    short, long = (neusight.predict("gpt2", "a100-80gb-pcie", batch_size=4, seq_len=1, kv_cache=n) for n in (64, 960))
    assert long.latency_ms > short.latency_ms
    cache_bytes = 2 * 12 * 4 * 12 * (960 - 64) * 64 * 4       # k and v x layers x batch x heads x extra tokens x dim x FP32
    assert long.memory.peak_bytes - short.memory.peak_bytes >= cache_bytes
    d = long.to_dict()   # the forecast says what it forecast
    assert (d["kv_cache"], d["seq_len"], d["dtype"], d["amp"], d["tf32_kernels"]) == (960, 1, "float32", None, 0)
    assert (d["gradient_checkpointing"], d["lora_rank"]) == (False, None)


def test_a_tensor_parallel_decode_step_holds_its_share_of_the_cache():
    """tp=2: each GPU attends with half the heads over its half of the cache (GPT-2: 12 heads; Llama-style grouped
    query attention: half the key / value heads), and its GEMMs have half the width."""
    for model, kv_heads in (("gpt2", 12), ({"model_type": "llama", **_SMALL_LM, "num_key_value_heads": 2}, 2),
                            ({"model_type": "phi3", **_SMALL_LM, "num_key_value_heads": 2, "pad_token_id": 0}, 2)):
        whole, half = (neusight.trace(model, batch_size=2, seq_len=1, kv_cache=15, tensor_parallel=tp) for tp in (1, 2))
        cache = [{t.shape for t in g.held if len(t.shape) == 4 and t.shape[2] == 16} for g in (whole, half)]
        assert {s[1] for s in cache[0]} == {kv_heads} and {s[1] for s in cache[1]} == {kv_heads // 2}
        k1, k2 = (g.kernels for g in (whole, half))
        assert k2.query("family == 'bmm'")["flops"].sum() * 2 == k1.query("family == 'bmm'")["flops"].sum()


def test_the_cache_has_the_dtype_the_model_stores_under_autocast():
    def cache_dtype(model):   # of the grown cache the output holds: (batch, kv heads, 16 positions, head_dim) per layer
        g = neusight.trace(model, batch_size=1, seq_len=1, mode="inference", kv_cache=15, amp="float16")
        return {t.dtype for t in g.held if len(t.shape) == 4 and t.shape[2] == 16}

    assert cache_dtype("gpt2") == {"float16"}          # its K / V come straight from the FP16 projection
    # the rotary embedding in FP32 promotes its keys; its values come straight from the FP16 projection
    assert cache_dtype("llama-2-7b") == {"float32", "float16"}


@pytest.mark.parametrize("model, kw, fragment", [
    ("gpt2", dict(mode="training", kv_cache=8), "mode='training'"),
    ("bert-base", dict(kv_cache=8), "decoder-only causal language model"),
    ("gpt2", dict(kv_cache=1020, seq_len=8), "exceeds gpt2's maximum of 1024"),
    ("gpt2", dict(kv_cache=0), "kv_cache=0"),
])
def test_bad_generation_runs_are_refused(model, kw, fragment):
    kw = {"seq_len": 1, **kw}
    with pytest.raises(InputError, match=re.escape(fragment)):
        neusight.trace(model, batch_size=1, **kw)


def test_a_downloaded_models_directory_is_read_through_its_config(tmp_path):
    model = tmp_path / "my-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", **_SMALL_LM}))
    g = neusight.trace(str(model), batch_size=1, seq_len=8)
    assert g.model == "my-llama"
    assert g.kernels.equals(neusight.trace({"model_type": "llama", **_SMALL_LM}, batch_size=1, seq_len=8).kernels)


_MODULES_OF_A_TRACE = """
import sys, neusight
from neusight.memory import estimate_memory
cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512)
for ckpt in (False, True):
    g = neusight.trace(cfg, 1, 16, "training", optimizer=None, gradient_checkpointing=ckpt)
    print("|".join(g.kernels["module"].astype(str)))
    print(estimate_memory(g, allocator="exact").peak_bytes)
"""


def test_kernels_go_to_the_same_modules_in_every_process():
    """The module a kernel is attributed to (per-layer tables, pipeline stages) does not depend on the process's
    string hashing: of equally deep modules the tracker is inside (a checkpointed layer's recomputation, a backward
    pass, can leave the previous layer's entry behind) the one entered last is taken. With checkpointing every
    layer of the 12 (one- and two-digit names alike) gets the same backward kernels, its recomputation included."""
    runs = []
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", _MODULES_OF_A_TRACE], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": seed})
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout.splitlines())
    assert runs[0] == runs[1]
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512)
    # the memory forecast too, which follows when the traced run dropped each tensor: the same in this process,
    # whatever it ran before
    for line, ckpt in ((1, False), (3, True)):
        g = neusight.trace(cfg, 1, 16, "training", optimizer=None, gradient_checkpointing=ckpt)
        assert int(runs[0][line]) == estimate_memory(g, allocator="exact").peak_bytes
    k = g.kernels
    layer = k.loc[k["phase"] == "backward", "module"].str.extract(r"layers\.(\d+)\b")[0].dropna().astype(int)
    counts = layer.value_counts()
    # the middle layers alike; the first passes no gradient to a layer before it, the last also gets the norm's
    assert len(counts) == 12 and counts.loc[list(range(1, 11))].nunique() == 1
    assert abs(counts[0] - counts[1]) <= 2 and abs(counts[11] - counts[1]) <= 2


def test_a_head_predicting_its_own_positions_is_trained_on_all_of_them():
    """Perceiver's masked-LM decoder predicts max_position_embeddings positions whatever the input's length: the
    cross-entropy covers every one of them (2 x 256 rows of the 500-word vocabulary here), not the 2 x 64 input ids."""
    cfg = {"model_type": "perceiver", "num_self_attends_per_block": 1, "num_blocks": 1, "d_latents": 64,
           "num_latents": 32, "d_model": 64, "max_position_embeddings": 256, "vocab_size": 500,
           "num_cross_attention_heads": 1, "num_self_attention_heads": 2}
    k = neusight.trace(cfg, batch_size=2, seq_len=64, mode="training").kernels
    ce = k[(k["phase"] == "loss") & (k["aten_op"] == "aten._log_softmax.default")]
    assert ce["dims"].tolist() == [(2 * 256, 500)]


@pytest.mark.parametrize("model, attn", [("gpt2", r"transformer\.h\.(\d+)\.attn$"),
                                         ("opt-125m", r"model\.decoder\.layers\.(\d+)\.self_attn$")])
def test_backward_kernels_belong_to_the_layer_whose_gradients_they_compute(model, attn):
    """An attention module returns its weights too, which the block drops: the backward pass enters it as soon as
    any of its outputs has a gradient, so both gradients of each of its two matmuls (4 batched GEMMs per layer)
    belong to that layer's attention, not to the block around it (GPT-2) or to the next layer's attention (OPT)."""
    g = neusight.trace(model, batch_size=2, seq_len=32, mode="training", optimizer=None)
    k = g.kernels
    bwd = k[(k["phase"] == "backward") & (k["family"] == "bmm")]
    layer = bwd["module"].astype(str).str.extract(attn, expand=False)
    assert layer.notna().all()                                  # every one inside an attention module
    assert layer.astype(int).value_counts().to_dict() == {i: 4 for i in range(12)}


def test_logits_to_keep_runs_the_head_on_the_last_positions_only():
    """logits_to_keep=N (as generate()'s prefill asks for N = 1): the LM head's GEMM has batch x N rows instead of
    batch x seq_len; nothing else of the forward changes."""
    every = neusight.trace("gpt2", batch_size=4, seq_len=128)
    last = neusight.trace("gpt2", batch_size=4, seq_len=128, logits_to_keep=1)
    head = [g.kernels[g.kernels.module == "lm_head"] for g in (every, last)]
    assert [h["dims"].tolist() for h in head] == [[(1, 512, 768, 50257)], [(1, 4, 768, 50257)]]
    rest = [g.kernels[g.kernels.module != "lm_head"][["aten_op", "dims"]] for g in (every, last)]
    assert rest[0].reset_index(drop=True).equals(rest[1].reset_index(drop=True))


@pytest.mark.parametrize("model, kw, fragment", [
    ("gpt2", dict(logits_to_keep=0), "logits_to_keep=0 is not a positive number"),
    ("gpt2", dict(logits_to_keep=True), "logits_to_keep=True is not a positive number"),
    ("gpt2", dict(logits_to_keep=65), "logits_to_keep=65 exceeds seq_len=64"),
    ("gpt2", dict(logits_to_keep=1, mode="training"), "mode='training'"),
    ("bert-base", dict(logits_to_keep=1), "takes no logits_to_keep argument"),
])
def test_bad_logits_to_keep_is_refused(model, kw, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        neusight.trace(model, **{"batch_size": 1, "seq_len": 64, **kw})


@pytest.mark.parametrize("model, kw", [("gpt2", {}), ("deepseek-v2-lite", {"tensor_parallel": 2}),
                                       ("llama-3.2-1b", {"static_cache": True, "attn_implementation": "sdpa"})])
def test_a_kv_cache_shaped_from_a_kept_first_step_traces_as_a_fresh_one(model, kw):
    """The first step that shapes a plain KV cache runs once per model (tracer._plain_cache_layers): a decode step
    traced with the kept shapes has the kernels and the memory of one traced after probing the model afresh (latent
    attention's keys and values differ in width; tensor-parallel shards are another model)."""
    from neusight.graph import tracer
    from neusight.memory import estimate_memory

    run = dict(batch_size=3, seq_len=1, kv_cache=40, dtype="bfloat16", **kw)
    tracer._PLAIN_CACHES.clear()
    fresh = neusight.trace(model, **run)
    assert len(tracer._PLAIN_CACHES) == 1
    kept = neusight.trace(model, **run)
    cols = ["aten_op", "module", "dims", "flops", "bytes"]
    assert fresh.kernels[cols].reset_index(drop=True).equals(kept.kernels[cols].reset_index(drop=True))
    assert estimate_memory(fresh, "l4").peak_bytes == estimate_memory(kept, "l4").peak_bytes

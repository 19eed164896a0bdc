"""Context parallelism (cp=): each sequence split over cp GPUs, attention as a ring of fused kernels; the ring's
steps, its exchanges, the gradients' group, the layout of the GPUs and the bad inputs."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from neusight.api import predict_graph
from neusight.devices import load_device
from neusight.errors import InputError
from neusight.graph.tracer import trace
from neusight.kernels.base import ATTENTION_BWD_KERNEL, ATTENTION_KERNEL, FUSED_ATTENTION
from neusight.parallel import (LinkPath, Links, Parallelism, allgather_ms, allreduce_ms, alltoall_ms,
                               context_exchange_ms, context_steps, p2p_ms, predict_parallel, split_context)

LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
BERT = dict(model_type="bert", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=512, max_position_embeddings=1024)
H100 = "h100-sxm5-80gb"
KW = dict(attn_implementation="sdpa", dtype="bfloat16")


def _attention_flops(k: pd.DataFrame, kernel: str) -> float:
    return float(k.loc[k["kernel"] == kernel, "flops"].sum())


@pytest.mark.parametrize("model, causal", [(LLAMA, True), (BERT, False)])
def test_each_gpu_of_the_ring_does_one_cpth_of_the_sequences_attention(model, causal):
    """Per GPU, the traced kernel of its own chunks plus one kernel per further step (one candidate of the two for
    a causal kernel) do 1 / cp of the whole sequence's attention FLOPs, forward and backward: causal load balance
    (two chunks per GPU) or, without a mask, cp whole blocks."""
    cp, seq = 4, 512
    whole = trace(model, 2, seq, "training", device=H100, **KW).kernels
    part = trace(model, 2, seq // cp, "training", device=H100, context_parallel=cp, **KW).kernels
    ring = split_context(part.reset_index(drop=True), cp)
    steps = ring[(ring["cp_step"] > 0) & ring["kernel"].isin(FUSED_ATTENTION)]
    # causal: two candidates per step (all queries x half the keys, half the queries x all the keys)
    assert len(steps) == (2 if causal else 1) * (cp - 1) * int(part["kernel"].isin(FUSED_ATTENTION).sum())
    one = ring[ring["cp_shape"] == 0]
    for kernel in FUSED_ATTENTION:
        assert _attention_flops(one, kernel) == pytest.approx(_attention_flops(whole, kernel) / cp, rel=1e-12)
    for _, rows in ring[ring["cp_parent"] >= 0].groupby("cp_parent"):
        first = rows[rows["cp_step"] == 0].iloc[0]
        bh, lq, d, lk = first["dims"]
        step = rows[rows["cp_step"] == 1]
        pair = step[step["kernel"] == first["kernel"]]
        if causal:   # both candidates of a step move the traced kernel's bytes in its q and k / v parts
            assert float(pair["bytes"].sum()) == pytest.approx(1.5 * float(first["bytes"]))
            assert sorted(pair["dims"]) == sorted([(bh, lq, d, lk // 2), (bh, lq // 2, d, lk)])
        # each candidate's partial results merged: read the running and the step's, write the running (BF16)
        for shape, attn in pair.groupby("cp_shape"):
            _, q, _, kv = attn["dims"].iloc[0]
            merged = step.loc[(step["cp_shape"] == shape) & (step["family"] == "elementwise"), ["kernel", "bytes"]]
            want = ({"cp_out_correction": 3 * 2 * bh * q * d} if first["kernel"] == ATTENTION_KERNEL else
                    {"cp_dq_accumulate": 3 * 2 * bh * q * d, "cp_dkv_accumulate": 3 * 2 * 2 * bh * kv * d})
            assert dict(zip(merged["kernel"], merged["bytes"])) == want
    # the other kernels are untouched, in their order, each attention step right after its kernel
    ring_columns = ["cp_parent", "cp_step", "cp_shape", "cp_q_bytes", "cp_kv_bytes"]
    assert ring[ring["cp_step"] == 0].drop(columns=ring_columns).reset_index(drop=True).equals(part)
    assert (ring["op_index"].diff().dropna() >= 0).all()


@pytest.mark.parametrize("model, causal", [(LLAMA, True), (BERT, False)])
@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_gathered_or_head_split_attention_does_one_cpth_of_the_work_and_exchanges_as_it_should(model, causal, comm):
    """all_gather: the sequence's keys and values gathered, then (causal) one kernel per chunk of the GPU's queries
    against the keys up to it, or one against all; a2a (Ulysses): 1 / cp of the heads over the whole sequence, the
    whole trace's kernel with the heads divided. Either way 1 / cp of the whole sequence's attention FLOPs per GPU,
    and exchanges that nothing hides."""
    cp, seq = 2, 512
    h100 = load_device(H100)
    whole = trace(model, 2, seq, "training", device=H100, **KW).kernels
    part = trace(model, 2, seq // cp, "training", device=H100, context_parallel=cp, **KW).kernels
    ring = split_context(part.reset_index(drop=True), cp, comm)
    for kernel in FUSED_ATTENTION:
        assert _attention_flops(ring, kernel) == pytest.approx(_attention_flops(whole, kernel) / cp, rel=1e-12)
    attention = ring[ring["kernel"].isin(FUSED_ATTENTION)]
    assert len(attention) == (2 if causal and comm == "all_gather" else 1) * int(
        part["kernel"].isin(FUSED_ATTENTION).sum())
    assert not (ring["family"] == "elementwise").sum() > (part["family"] == "elementwise").sum()   # nothing merged
    if comm == "a2a":
        bh, lq, d, lk = whole.loc[whole["kernel"].isin(FUSED_ATTENTION), "dims"].iloc[0]
        assert attention["dims"].iloc[0] == (bh // cp, lq, d, lk)
    calls = ring[(ring["cp_step"] == 0) & (ring["cp_parent"] >= 0)]
    exposed = context_exchange_ms(ring.assign(latency_ms=1.0), cp, h100, LinkPath(100.0), comm=comm)
    for i, row in calls.iterrows():
        q, kv = row["cp_q_bytes"], row["cp_kv_bytes"]
        assert q > 0 and kv > 0
        want = ((2 if row["kernel"] == ATTENTION_BWD_KERNEL else 1) * allgather_ms(cp * kv, cp, h100, LinkPath(100.0))
                if comm == "all_gather" else
                alltoall_ms(q + kv, cp, h100, LinkPath(100.0)) + alltoall_ms(q, cp, h100, LinkPath(100.0)))
        assert exposed[i] == pytest.approx(want)       # not hidden by the kernels' 1 ms each
    assert exposed.drop(index=calls.index).eq(0).all()


def test_a_step_takes_the_slower_candidate_and_its_exchange_hides_behind_the_step_before():
    """Step 1: candidate 1 (0.03 ms) is slower than candidate 0 (0.01 + 0.005 to merge); step 2: candidate 1's
    attention kernel is the faster, but with its merging kernel (0.04 + 0.02) the slower."""
    h100 = load_device(H100)
    dims = (4, 1024, 64, 1024)
    merge = "cp_out_correction"
    k = pd.DataFrame({"kernel": [ATTENTION_KERNEL, ATTENTION_KERNEL, merge, ATTENTION_KERNEL, ATTENTION_KERNEL,
                                 ATTENTION_KERNEL, merge, ATTENTION_BWD_KERNEL],
                      "dims": [dims] * 8, "dtype": ["bfloat16"] * 8, "cp_parent": [0, 0, 0, 0, 0, 0, 0, -1],
                      "cp_step": [0, 1, 1, 1, 2, 2, 2, 0], "cp_shape": [0, 0, 0, 1, 0, 1, 1, 0],
                      "latency_ms": [0.02, 0.01, 0.005, 0.03, 0.05, 0.04, 0.02, 0.5], "roofline_ms": [0.01] * 8})
    sent = 2 * 4 * 1024 * 64 * 2                 # keys and values of the next chunk, BF16
    k["cp_kv_bytes"] = [sent] + [0.0] * 7
    k["cp_q_bytes"] = [sent / 2] + [0.0] * 7
    kept = context_steps(k)
    assert kept["latency_ms"].tolist() == [0.02, 0.03, 0.04, 0.02, 0.5]
    transfer = p2p_ms(sent, h100, LinkPath(100.0))
    exposed = context_exchange_ms(kept, 3, h100, LinkPath(100.0))
    # two exchanges, beside steps 0 and 1; nothing on other rows
    assert exposed.iloc[0] == pytest.approx(max(0, transfer - 0.02) + max(0, transfer - 0.03))
    assert exposed.iloc[1:].tolist() == [0.0] * 4
    assert context_exchange_ms(kept, 3, h100, LinkPath(1e6)).sum() == 0.0     # a fast link hides them all
    assert context_exchange_ms(kept, 3, h100, LinkPath(100.0), "roofline_ms").iloc[0] == pytest.approx(
        2 * (transfer - 0.01))


def test_context_parallel_step_composes_ring_exchanges_and_reduces_gradients_over_dp_times_cp():
    kw = dict(mode="training", **KW)
    whole = predict_parallel(LLAMA, H100, 4, 1024, dp=2, **kw)
    ring = predict_parallel(LLAMA, H100, 4, 1024, dp=2, cp=2, internode_gbps=1.0, gpus_per_node=2, **kw)
    assert ring.parallelism.gpus == 4 and ring.seq_len == 1024 and whole.parts["cp_comm"] == 0
    g = ring.per_gpu.graph
    assert g.seq_len == 512 and g.batch_size == 2
    # the weights' gradients: one all-reduce over dp x cp = 4 GPUs (dp across the 2 nodes here)
    grads = sum(t.numel * t.itemsize for t in g.grads)
    links = Links.of(ring.parallelism, load_device(H100), 2, 1.0)
    assert ring.parts["dp_allreduce"] == pytest.approx(allreduce_ms(grads, 4, load_device(H100), links.dp))
    # the context-parallel pair sits in one node (ranks: tp innermost, then cp), so its exchanges run over NVLink
    assert links.cp.nodes == 1 and links.dp.nodes == 2
    k = ring.per_gpu.kernels
    exposed = context_exchange_ms(k, 2, load_device(H100), links.cp)
    assert ring.parts["cp_comm"] == pytest.approx(float(exposed.sum()))
    # one kept candidate per ring step: the trace's kernels, and per attention kernel one more with its merging
    # kernels (one forward, two backward)
    attention = g.kernels["kernel"]
    assert len(k) == len(g.kernels) + 2 * int((attention == ATTENTION_KERNEL).sum()) + 3 * int(
        (attention == ATTENTION_BWD_KERNEL).sum())
    # the activations are the part's: less than the whole sequence's on one replica
    assert ring.memory_breakdown["activations"] < whole.memory_breakdown["activations"]
    assert ring.memory_breakdown["weights"] == whole.memory_breakdown["weights"]
    assert any("context parallelism" in n and "dp x cp = 4" in n for n in ring.notes)
    assert "cp 2" in ring.summary()


def test_slow_context_links_expose_the_exchanges():
    """The same layout with the context-parallel pair across nodes (gpus_per_node=1) over a slow network: the
    ring's exchanges outlast their kernels and are charged; within a node over NVLink less is."""
    kw = dict(mode="training", cp=2, **KW)
    near = predict_parallel(LLAMA, H100, 2, 2048, **kw)
    far = predict_parallel(LLAMA, H100, 2, 2048, gpus_per_node=1, internode_gbps=0.5, **kw)
    assert far.parts["cp_comm"] > near.parts["cp_comm"] >= 0
    assert far.parts["compute"] == near.parts["compute"]
    assert far.latency_ms > near.latency_ms


def test_layouts_place_context_parallel_ranks_between_tensor_and_data_parallel_ones():
    par = Parallelism(dp=2, tp=4, cp=2)
    assert par.gpus == 16 and par.replicas == 4
    assert Links.spans(par) == {"tensor-parallel": 4, "context-parallel": 8, "data-parallel": 16,
                                "expert-parallel": 4, "pipeline": 16}
    links = Links.of(par, load_device(H100), 8)
    assert links.tp.nodes == 1 and links.cp.nodes == 1 and links.dp.nodes == 2
    with pytest.raises(InputError, match="cp=0"):
        Parallelism(cp=0)
    with pytest.raises(InputError, match="cp=2 with ep=2"):
        Parallelism(dp=2, ep=2, cp=2)


@pytest.mark.parametrize("model, kw, fragment", [
    (LLAMA, dict(seq_len=1004), "seq_len=1004 is not a multiple of 8"),
    (LLAMA, dict(attn_implementation="eager"), "eager attention"),
    (LLAMA, dict(kv_cache=128, mode="inference"), "kv_cache=128"),
    ("gpt2", dict(seq_len=2048), "seq_len=2048 exceeds"),
    (dict(LLAMA, model_type="mistral", sliding_window=64), dict(), "sliding-window attention layers"),
    (dict(LLAMA, model_type="mistral", sliding_window=64), dict(attn_implementation="flash_attention_2"),
     "sliding-window attention layers"),
    (dict(LLAMA, model_type="mistral", sliding_window=None), dict(), None),
    (dict(LLAMA, model_type="qwen2", sliding_window=64, use_sliding_window=False), dict(), None),
    (LLAMA, dict(megatron=True), "megatron=True"),
    (LLAMA, dict(cp_comm="a2a"), "2 key / value heads on each GPU, which 4 does not divide"),
    (LLAMA, dict(cp_comm="ring"), "cp_comm='ring' is not known"),
    (LLAMA, dict(cp=1, cp_comm="a2a"), "cp=1 has none"),
])
def test_bad_context_parallel_runs_say_what_to_change(model, kw, fragment):
    run = dict(mode="training", cp=4, seq_len=512, **KW)
    run.update(kw)
    if fragment is None:     # windows not in use: runs
        assert predict_parallel(model, H100, 2, **run).parts["compute"] > 0
        return
    with pytest.raises(InputError, match=fragment):
        predict_parallel(model, H100, 2, **run)


def test_predict_graph_without_context_parallelism_is_unchanged():
    g = trace(LLAMA, 2, 256, "training", device=H100, **KW)
    assert split_context(g.kernels, 1) is g.kernels
    one = predict_graph(g, H100)
    assert "cp_step" not in one.kernels


class _MaskedAttention(nn.Module):
    """Attention through an explicit (causal) mask, as a model without is_causal runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_attention_through_an_explicit_mask_is_refused():
    run = dict(mode="inference", input_shapes=[("seq", 64)], dtype="bfloat16")
    assert predict_parallel(_MaskedAttention(), H100, 2, 256, **run).latency_ms > 0     # without cp: runs
    with pytest.raises(InputError, match="explicit mask"):
        predict_parallel(_MaskedAttention(), H100, 2, 256, cp=2, **run)


def test_plans_apply_a_given_cp_to_every_layout_of_the_remaining_gpus():
    from neusight.plan import layouts, plan_parallel

    plan = plan_parallel(LLAMA, H100, 4, 2, 1024, cp=2, **KW)
    t = plan.candidates
    assert (t["cp"] == 2).all() and set(zip(t["dp"], t["tp"], t["pp"])) == set(layouts(2))
    assert all(label.startswith(f"dp {dp} x cp 2 x ") for label, dp in zip(t["layout"], t["dp"]))
    # ZeRO searched where dp x cp > 1 holds the same weights, pipelines excepted: every layout here without stages
    assert set(t.loc[t["pp"] == 1, "zero"]) == {0, 1, 2, 3} and set(t.loc[t["pp"] > 1, "zero"]) == {0}
    assert " cp " in plan.summary().splitlines()[2]        # the column shown
    with pytest.raises(InputError, match="cp=3 is not a positive integer that divides gpus=4"):
        plan_parallel(LLAMA, H100, 4, 2, 1024, cp=3, **KW)


def test_plans_search_the_context_parallel_degrees_asked_for():
    """cp=auto plans every layout of gpus / cp GPUs for every cp dividing gpus, each a forecast with that cp: its
    cp = 1 rows are those of a plan without cp, its cp = 4 row is predict_parallel's cp=4 forecast, and the best is
    the fastest of them all that fits; a list searches those degrees only."""
    from neusight.plan import layout_label, layouts, plan_parallel

    auto = plan_parallel(LLAMA, H100, 4, 2, 1024, mode="inference", cp="auto", **KW)
    t = auto.candidates
    assert sorted(set(t["cp"])) == [1, 2, 4]
    for c in (1, 2, 4):     # every layout of 4 / c GPUs forecast or left out with its reason, none twice
        table = auto.table[auto.table["cp"] == c]
        forecast = [layout_label(dp, tp, pp, c) for dp, tp, pp in zip(table["dp"], table["tp"], table["pp"])]
        every = [layout_label(dp, tp, pp, c) for dp, tp, pp in layouts(4 // c)]
        assert sorted(set(forecast) | {k for k in auto.skipped if k in every}) == sorted(every)
        assert not set(forecast) & set(auto.skipped) and len(set(forecast)) == len(forecast)
    assert auto.skipped["dp 1 x tp 4 x pp 1"].startswith("tp=4 does not divide the 2 num_key_value_heads")
    plain = plan_parallel(LLAMA, H100, 4, 2, 1024, mode="inference", **KW).candidates
    ones = t[t["cp"] == 1].reset_index(drop=True)
    pd.testing.assert_frame_equal(ones.drop(columns="ms"), plain.drop(columns="ms"))
    assert ones["ms"].tolist() == pytest.approx(plain["ms"].tolist())
    four = predict_parallel(LLAMA, H100, 2, 1024, "inference", cp=4, **KW)
    assert t.loc[t["cp"] == 4, "ms"].item() == pytest.approx(four.latency_ms)
    assert auto.best["ms"] == t.loc[t["fits"], "ms"].min()
    assert "context-parallel degrees" in auto.summary().splitlines()[1]
    listed = plan_parallel(LLAMA, H100, 4, 2, 1024, mode="inference", cp=[4, 1], **KW).candidates
    assert sorted(set(listed["cp"])) == [1, 4]


def test_a_plan_drops_the_cp_its_model_or_sequence_cannot_take_with_a_note():
    """A degree that does not split the sequence (1,028 tokens: 4 chunks, not 8) is not tried; a model whose
    attention cannot run as a ring (eager) or a run without a sequence (a CNN) leaves the search with cp = 1 alone,
    exactly the plan without cp; the value itself must be a divisor of gpus, a list of them or 'auto'."""
    from neusight.plan import plan_parallel

    run = dict(mode="inference", **KW)
    odd = plan_parallel(LLAMA, H100, 4, 2, 1028, cp="auto", **run)
    assert sorted(set(odd.candidates["cp"])) == [1, 2]
    assert any(n.startswith("cp=4 not tried: cp=4 splits each sequence into 8 chunks") for n in odd.notes)
    eager = dict(run, attn_implementation="eager")
    dropped = plan_parallel(LLAMA, H100, 4, 2, 1024, cp="auto", **eager)
    assert set(dropped.candidates["cp"]) == {1} and not any(" x cp " in k for k in dropped.skipped)
    assert any(n.startswith("context parallelism not searched: cp=2 runs each attention as a ring")
               for n in dropped.notes)
    plain = plan_parallel(LLAMA, H100, 4, 2, 1024, **eager)
    assert dropped.table["layout"].tolist() == plain.table["layout"].tolist()
    assert dropped.table["ms"].tolist() == pytest.approx(plain.table["ms"].tolist())
    cnn = plan_parallel("resnet18", H100, 2, 2, None, mode="inference", cp="auto")     # no sequence to split
    assert set(cnn.candidates["cp"]) == {1}
    assert "context parallelism not searched: it splits each sequence, and this run has no seq_len" in cnn.notes
    with pytest.raises(InputError, match="cp=2 runs each attention as a ring"):       # given, not searched: refused
        plan_parallel(LLAMA, H100, 4, 2, 1024, cp=2, **eager)
    for bad in ("most", [], [1, 3], [2, True], 0):
        with pytest.raises(InputError, match="a list of them or 'auto'"):
            plan_parallel(LLAMA, H100, 4, 2, 1024, cp=bad, **run)


def test_plans_try_each_exchange_asked_for_on_every_context_parallel_layout():
    """cp_comm=auto: every layout with cp > 1 forecast with each exchange it can run, each candidate the
    forecast of predict_parallel with that exchange; the layout's row its fastest; Ulysses (a2a) left out, with a
    note, where cp does not divide the key / value heads on each GPU (2 heads: cp=4, or cp=2 with tp=2)."""
    from neusight.plan import plan_parallel

    plan = plan_parallel(LLAMA, H100, 4, 2, 1024, mode="inference", cp="auto", cp_comm="auto", **KW)
    c = plan.candidates
    assert set(c.loc[c["cp"] == 1, "cp comm"]) == {"-"}
    heads = 2
    for (label, cp, tp), group in c[c["cp"] > 1].groupby(["layout", "cp", "tp"]):
        runs_a2a = (heads // tp) % cp == 0
        assert sorted(set(group["cp comm"])) == sorted(["p2p", "all_gather"] + (["a2a"] if runs_a2a else []))
        row = plan.table.set_index("layout").loc[label]
        assert row["ms"] == group["ms"].min() and row["cp comm"] == group.loc[group["ms"].idxmin(), "cp comm"]
    dp, cp, tp, pp = 1, 2, 1, 2
    one = c[(c["dp"] == dp) & (c["cp"] == cp) & (c["tp"] == tp) & (c["pp"] == pp) & (c["cp comm"] == "a2a")]
    alone = predict_parallel(LLAMA, H100, 2, 1024, "inference", dp=dp, cp=cp, tp=tp, pp=pp,
                             microbatches=int(one["micro-batches"].item()), cp_comm="a2a", **KW)
    assert one["ms"].item() == pytest.approx(alone.latency_ms)
    assert "context-parallel degrees, their exchanges" in plan.summary().splitlines()[1]
    assert any(n.startswith("cp_comm='a2a' splits the attention heads over the cp=4 GPUs") and
               n.endswith("(left out on dp 1 x cp 4 x tp 1 x pp 1)") for n in plan.notes)
    with pytest.raises(InputError, match="cp=1 has none"):
        plan_parallel(LLAMA, H100, 4, 2, 1024, mode="inference", cp_comm="auto", **KW)
    with pytest.raises(InputError, match="a list of them or 'auto'"):
        plan_parallel(LLAMA, H100, 4, 2, 1024, mode="inference", cp=2, cp_comm=["p2p", "ring"], **KW)
    with pytest.raises(InputError, match="which 4 does not divide"):     # the one exchange asked for cannot run
        plan_parallel(LLAMA, H100, 4, 2, 1024, mode="inference", cp=4, cp_comm="a2a", **KW)


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_the_exchange_buffers_count_while_each_attention_call_runs(comm):
    """Each fused attention call holds its exchange's buffers (multiples of the GPU's queries Q and keys and values
    KV, from the config: batch 2 x 1,024 / cp tokens per GPU, 8 query and 2 key / value heads of 32, BF16; a2a
    over 2 GPUs, which divide the 2 key / value heads, the others over 4) as workspace
    while it runs, nothing else changes: the memory timeline with them is the one without plus those bytes at those
    ops, and the forecast's peak is that timeline's."""
    from neusight.memory import estimate_memory
    from neusight.parallel import context_buffer_bytes

    cp = 2 if comm == "a2a" else 4
    p = predict_parallel(LLAMA, H100, 2, 1024, "training", cp=cp, cp_comm=comm, **KW)
    g = p.per_gpu.graph                                         # one GPU's part of each sequence
    local = 1024 // cp
    q, kv = 2 * local * 8 * 32 * 2, 2 * (2 * local * 2 * 32 * 2)
    need = {"p2p": (2 * kv + q, 5 * kv + q), "all_gather": (cp * kv, 2 * cp * kv),
            "a2a": (2 * q + kv, 3 * q + 2 * kv)}[comm]
    buffers = context_buffer_bytes(g.kernels, cp, comm)
    attention = g.kernels[g.kernels["kernel"].isin(FUSED_ATTENTION)]
    expected = {int(r.op_index): need[r.kernel == ATTENTION_BWD_KERNEL] for r in attention.itertuples()}
    assert buffers == expected and len(expected) == 4          # 2 layers, forward and backward
    plain, held = estimate_memory(g, H100), estimate_memory(g, H100, transient=buffers)
    added = held.timeline["workspace"] - plain.timeline["workspace"]
    assert added.to_dict() == {i: expected.get(i, 0) for i in added.index}
    assert held.tensor_peak_bytes == held.timeline["live_bytes"].max() >= plain.tensor_peak_bytes
    assert p.memory_peak_bytes == pytest.approx(held.peak_bytes)
    assert f"up to {max(need) / 2**20:,.1f} MiB a call" in " ".join(p.notes)


def test_memory_searches_hold_one_gpus_part_of_each_sequence():
    """The longest sequence that fits with cp=4 holds 4x the tokens per GPU that one GPU alone holds (within one
    search step), since each GPU keeps only its part; the largest batch at a sequence split over cp GPUs is that
    of one GPU at the part's length. A model that cannot run the ring is refused."""
    from neusight.devices import modify_device
    from neusight.memory import find_max_batch, find_max_seq_len

    small = modify_device(H100, memory_gib=1.0)
    run = dict(mode="training", **KW)
    model = dict(LLAMA, max_position_embeddings=1 << 20)
    alone = find_max_seq_len(model, small, batch_size=2, step=256, **run)
    split = find_max_seq_len(model, small, batch_size=2, step=256, cp=4, **run)
    assert alone > 0 and split % (4 * 256) == 0 and split // 4 == alone
    assert find_max_batch(model, small, seq_len=4 * 2048, cp=4, **run) == find_max_batch(model, small, seq_len=2048,
                                                                                        **run) > 0
    with pytest.raises(InputError, match="eager attention"):
        find_max_seq_len(model, small, batch_size=2, step=256, cp=4, **{**run, "attn_implementation": "eager"})
    with pytest.raises(InputError, match="not a multiple of 8"):
        find_max_batch(model, small, seq_len=1004, cp=4, **run)

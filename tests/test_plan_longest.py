"""plan_max_seq_len: the longest sequence each layout of N GPUs holds, with what holds the most, and a step's
time at that length; the search's answer against predict_parallel's memory, the ranking, the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest

from neusight.devices import load_device
from neusight.errors import InputError
from neusight.parallel import find_max_parallel, predict_parallel
from neusight.plan import plan_max_seq_len

# a tiny Llama whose logits (32,000 words) make the memory grow with the sequence well before its 8,192 positions
LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192)
KW = dict(attn_implementation="sdpa", dtype="bfloat16")


def _gpu(gib: float):
    return dataclasses.replace(load_device("h100-sxm5-80gb"), memory_gib=gib)


@pytest.fixture(scope="module")
def plan():
    return plan_max_seq_len(LLAMA, _gpu(1.0), 4, 4, "training", cp="auto", **KW)


def _forecast(row, seq: int, gpu):
    return predict_parallel(LLAMA, gpu, 4, seq, "training", dp=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]),
                            cp=int(row["cp"]), cp_comm=row["cp comm"] if row["cp"] > 1 else "p2p",
                            microbatches=int(row["micro-batches"]), zero=int(row["zero"]), optimizer="adamw",
                            gradient_checkpointing=True, **KW)


def test_each_layouts_longest_sequence_fits_and_one_step_longer_does_not(plan):
    """Each layout's answer is the boundary of predict_parallel's memory (the plans' ``fits``): at the longest
    sequence the run fits, one step (64 tokens per GPU) longer it does not, unless the model's positions end it;
    the row's time and memory are that forecast's."""
    gpu = _gpu(1.0)
    t = plan.table
    assert len(t) == 8 and set(t["cp"]) == {1, 2, 4} and (t["zero"][t["pp"] == 1] == 3).all()
    assert set(t["limited by"]) == {"memory"} and t["max seq_len"].nunique() > 3     # the memory binds, unevenly
    for _, row in t.iterrows():
        seq = int(row["max seq_len"])
        assert seq > 0 and seq % (64 * row["cp"]) == 0
        at = _forecast(row, seq, gpu)
        assert at.memory_fits and at.latency_ms == pytest.approx(row["ms"])
        assert at.memory_peak_bytes / 2**30 == pytest.approx(row["memory GiB"])
        assert not _forecast(row, seq + 64 * int(row["cp"]), gpu).memory_fits


def test_the_longest_layout_ranks_first_and_the_summary_names_it(plan):
    t = plan.table
    assert list(t["max seq_len"]) == sorted(t["max seq_len"], reverse=True)
    assert t["rank"].tolist() == list(range(1, len(t) + 1))
    best = plan.best
    assert best is not None and best["layout"] == t.iloc[0]["layout"]
    text = plan.summary()
    assert f"longest: {best['layout']}" in text and f"{int(best['max seq_len']):,} tokens" in text
    assert "full activation recompute" in text and "left out (1): dp 1 x tp 4 x pp 1" in text
    # fewer forecasts than a bisection per layout would take (two shared first probes, then estimates)
    assert plan.forecasts < 8 * math.log2(8192 / 64)


def test_more_memory_holds_longer_sequences_up_to_the_positions():
    small = plan_max_seq_len(LLAMA, _gpu(0.9), 2, 2, "training", **KW).table.set_index("layout")
    large = plan_max_seq_len(LLAMA, _gpu(80), 2, 2, "training", **KW).table.set_index("layout")
    assert (large["max seq_len"] == 8192).all() and set(large["limited by"]) == {"positions"}
    assert (small["max seq_len"] < large.loc[small.index, "max seq_len"]).all()


def test_nothing_fits_and_eager_attention_takes_no_context_parallelism():
    plan = plan_max_seq_len(LLAMA, _gpu(0.3), 2, 2, "training", cp="auto", attn_implementation="eager",
                            dtype="bfloat16")
    assert plan.best is None and (plan.table["max seq_len"] == 0).all() and (plan.table["cp"] == 1).all()
    text = plan.summary()
    assert "no layout holds 64 tokens per GPU" in text
    assert "context parallelism not searched" in text and "eager attention" in text


@pytest.mark.parametrize("call, match", [
    (lambda: plan_max_seq_len("resnet18", "h100-sxm5-80gb", 2, 2), "takes no sequence length"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 2, 2, max_seq_len=16384, **KW),
     r"max_seq_len=16384 is not a positive number of positions within llama's 8192"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 2, 2, step=63, **KW), "step=63 is not an even number"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 2, 2, seq_len=512, **KW), "seq_len= is plan_max_seq_len's"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 0, 2, **KW), "gpus=0 is not a positive number"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 4, 2, cp=3, **KW), "cp=3 is not a positive integer"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 2, 2, overlap_grad_reduce="yes", **KW),
     "overlap_grad_reduce='yes' is not true or false"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 2, 2, ep=0, **KW), "ep=0 is not a positive integer"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 2, 2, vpp=0, **KW), "vpp=0 is not a positive integer"),
    (lambda: plan_max_seq_len(LLAMA, "h100-sxm5-80gb", 2, 2, zero=4, **KW), r"zero=4 is not a ZeRO stage.*\(3 where"),
])
def test_bad_inputs_name_the_field_and_the_fix(call, match):
    with pytest.raises(InputError, match=match) as e:
        call()
    assert "Fix:" in str(e.value)


def test_find_max_parallel_on_sequence_parallel_shards():
    """One layout's search (tp 2 with sequence parallelism, the CLI's find_max_seq_len / find_max_batch there): the
    answer fits and one step more does not; sequence parallelism, which keeps 1 / tp of some activations, holds at
    least as long a sequence as the same shards without it."""
    gpu = _gpu(1.0)
    kw = dict(mode="training", tp=2, optimizer="adamw", gradient_checkpointing=True, **KW)
    with_sp = find_max_parallel(LLAMA, gpu, "seq_len", 2, sp=True, **kw)
    without = find_max_parallel(LLAMA, gpu, "seq_len", 2, **kw)
    assert 0 < without.value <= with_sp.value < 8192 and with_sp.value % 64 == 0
    assert with_sp.prediction.memory_fits and with_sp.prediction.seq_len == with_sp.value
    assert not predict_parallel(LLAMA, gpu, 2, with_sp.value + 64, sp=True, **kw).memory_fits
    batch = find_max_parallel(LLAMA, gpu, "batch_size", None, 1024, sp=True, **kw)
    assert batch.value > 0 and batch.prediction.batch_size == batch.value and batch.prediction.memory_fits
    assert not predict_parallel(LLAMA, gpu, batch.value + 1, 1024, sp=True, **kw).memory_fits


@pytest.mark.parametrize("args, kwargs, match", [
    (("tokens", 2), {}, "search='tokens' is not what find_max_parallel searches"),
    (("seq_len", 2), dict(limit=16384), "limit=16384 exceeds llama's maximum of 8192 positions"),
    (("seq_len", 2), dict(cp=256), "64 tokens on each of cp=256 GPUs exceed the 8,192 positions"),
    (("batch_size", None, 512), dict(dp=4, limit=2), r"one sample per micro-batch \(dp x microbatches = 4\)"),
])
def test_find_max_parallel_refuses_bad_searches(args, kwargs, match):
    with pytest.raises(InputError, match=match) as e:
        find_max_parallel(LLAMA, "h100-sxm5-80gb", *args, **kwargs, **KW)
    assert "Fix:" in str(e.value)


def test_an_exchange_that_cannot_run_a_layout_is_left_out_there_the_others_kept():
    """cp=4 with cp_comm=auto on the tiny Llama's 2 key / value heads: Ulysses' all-to-all cannot split them over 4
    GPUs, so the layout keeps the ring and all_gather rows and a note names a2a; asked for a2a alone, the layout is
    left out with that reason."""
    gpu = _gpu(1.0)
    both = plan_max_seq_len(LLAMA, gpu, 4, 1, "training", cp=[1, 4], cp_comm="auto", **KW)
    ring = both.candidates[both.candidates["cp"] == 4]
    assert sorted(ring["cp comm"]) == ["all_gather", "p2p"] and (ring["max seq_len"] > 0).all()
    assert any("cp_comm='a2a'" in n and "(left out on dp 1 x cp 4 x tp 1 x pp 1)" in n for n in both.notes)
    alone = plan_max_seq_len(LLAMA, gpu, 4, 1, "training", cp=[1, 4], cp_comm=["a2a"], **KW)
    assert "cp_comm='a2a' splits the attention heads" in alone.skipped["dp 1 x cp 4 x tp 1 x pp 1"]
    assert (alone.candidates["cp"] == 1).all()

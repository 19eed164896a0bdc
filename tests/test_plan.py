"""neusight.plan: every layout of N GPUs forecast and ranked, each candidate the forecast predict_parallel makes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from neusight.devices import modify_device
from neusight.errors import InputError, ModelError
from neusight.parallel import predict_parallel
from neusight.generation import predict_generation
from neusight.plan import across, layouts, plan_generation, plan_parallel, scaling_table

BIN = __import__("pathlib").Path(sys.executable).parent
RUN = dict(batch_size=8, seq_len=64, mode="training")
RECOMPUTE = {"no": False, "selective": "selective", "full": True}     # the recompute column's gradient_checkpointing


@pytest.mark.parametrize("gpus", [1, 2, 6, 8, 12])
def test_layouts_are_every_factorisation_once(gpus):
    got = layouts(gpus)
    assert len(set(got)) == len(got)
    assert all(dp * tp * pp == gpus for dp, tp, pp in got)
    expected = {(a, b, gpus // (a * b)) for a in range(1, gpus + 1) for b in range(1, gpus + 1)
                if gpus % (a * b) == 0}
    assert set(got) == expected


@pytest.fixture(scope="module")
def small_gpu():
    """An H100 with 1.5 GiB: GPT-2 training at batch 8 does not fit on one GPU, so layouts differ in fitting."""
    return modify_device("h100-sxm5-80gb", memory_gib=1.5)


@pytest.fixture(scope="module")
def plan(small_gpu):
    return plan_parallel("gpt2", small_gpu, gpus=4, **RUN)


def test_every_layout_is_forecast_or_left_out_with_a_reason(plan):
    assert {(r.dp, r.tp, r.pp) for r in plan.table.itertuples()} | {
        tuple(int(x) for x in label.replace("dp ", "").replace("tp ", "").replace("pp ", "").split(" x "))
        for label in plan.skipped} == set(layouts(4))
    assert plan.skipped == {}        # 12 heads, 12 blocks and batch 8 take every layout of 4 GPUs


def test_ranked_fitting_layouts_first_fastest_first(plan, small_gpu):
    t = plan.table
    fits = (t["fits"] == "yes").tolist()
    assert fits == sorted(fits, reverse=True)          # every "yes" before every "no"
    for group in (t[t["fits"] == "yes"], t[t["fits"] == "no"]):
        assert group["ms"].is_monotonic_increasing
    assert plan.best is not None and plan.best["ms"] == t.loc[t["fits"] == "yes", "ms"].min()
    ok = t[t["fits"] == "yes"]
    assert (ok["memory GiB"] <= small_gpu.memory_gib).all()
    assert (t.loc[t["fits"] == "no", "memory GiB"] > small_gpu.memory_gib).all()
    # a layout's row is its fastest candidate that fits
    c = plan.candidates
    for r in ok.itertuples():
        mine = c[(c["layout"] == r.layout) & c["fits"]]
        assert r.ms == mine["ms"].min()


def test_memory_decides_the_micro_batches_and_zero(plan):
    """On the small GPU plain data parallelism needs gradient accumulation or ZeRO to fit; on the real H100 it fits
    at one micro-batch, so the plan does not pay for more."""
    c = plan.candidates
    dp4 = c[c["layout"] == "dp 4 x tp 1 x pp 1"]
    assert not dp4[(dp4["micro-batches"] == 1) & (dp4["zero"] == 0)]["fits"].any()
    big = plan_parallel("gpt2", "h100-sxm5-80gb", gpus=4, **RUN)
    row = big.table.set_index("layout").loc["dp 4 x tp 1 x pp 1"]
    assert row["micro-batches"] == 1 and row["fits"] == "yes"


def test_candidates_are_predict_parallels_forecasts(plan, small_gpu):
    """The shared traces (predict_parallel's cache) change no number: a candidate equals a fresh forecast."""
    for _, r in plan.candidates.sample(4, random_state=0).iterrows():
        p = predict_parallel("gpt2", small_gpu, dp=int(r["dp"]), tp=int(r["tp"]), pp=int(r["pp"]),
                             microbatches=int(r["micro-batches"]), zero=int(r["zero"]), optimizer="adamw",
                             gradient_checkpointing=RECOMPUTE[r["recompute"]], **RUN)
        assert p.latency_ms == pytest.approx(r["ms"], rel=1e-9)
        assert p.memory_peak_bytes / 2**30 == pytest.approx(r["memory GiB"], rel=1e-9)
        assert r["MFU %"] == pytest.approx(100 * p.efficiency.mfu, rel=1e-9)


def test_layouts_the_model_cannot_take_are_left_out():
    p = plan_parallel("gpt2", "h100-sxm5-80gb", gpus=8, batch_size=4, seq_len=32)
    assert "dp 8 x tp 1 x pp 1" in p.skipped and "does not split" in p.skipped["dp 8 x tp 1 x pp 1"]
    assert "dp 1 x tp 8 x pp 1" in p.skipped       # 8 does not divide GPT-2's 12 heads
    assert set(p.table["layout"]).isdisjoint(p.skipped)
    assert "left out" in p.summary()


def test_fixed_zero_and_micro_batches_are_kept():
    p = plan_parallel("gpt2", "h100-sxm5-80gb", gpus=4, zero=2, microbatches=2, **RUN)
    c = p.candidates
    assert set(c["micro-batches"]) == {2}
    assert set(c.loc[(c["dp"] > 1) & (c["pp"] == 1), "zero"]) == {2}
    assert set(c.loc[(c["dp"] == 1) | (c["pp"] > 1), "zero"]) == {0}


def test_overlapped_collectives_apply_to_the_layouts_with_replicas():
    """overlap_grad_reduce reaches every candidate with dp > 1, overlap_param_gather those with a ZeRO stage (dp > 1,
    no pipeline): each faster, its communication shorter; the others stay as they were (a dp=1 layout has nothing
    to overlap, and predict_parallel refuses the options there)."""
    kw = dict(gpus=4, zero=1, microbatches=1, gradient_checkpointing=False, **RUN)
    key = ["dp", "tp", "pp", "ep"]
    alone = plan_parallel("gpt2", "h100-sxm5-80gb", **kw).candidates.set_index(key).sort_index()
    over = plan_parallel("gpt2", "h100-sxm5-80gb", overlap_grad_reduce=True, overlap_param_gather=True,
                         **kw).candidates.set_index(key).sort_index()
    assert list(over.index) == list(alone.index)
    replicas = over.index.get_level_values("dp") > 1
    assert replicas.any() and (~replicas).any()
    assert (over.loc[replicas, "ms"] < alone.loc[replicas, "ms"]).all()
    assert (over.loc[replicas, "communication ms"] < alone.loc[replicas, "communication ms"]).all()
    assert over.loc[~replicas, "ms"].tolist() == alone.loc[~replicas, "ms"].tolist()
    assert set(over.loc[replicas, "zero"]) == {0, 1}                  # pp > 1: no ZeRO, the reduction overlapped
    with pytest.raises(InputError, match="overlap_grad_reduce='yes'"):
        plan_parallel("gpt2", "h100-sxm5-80gb", overlap_grad_reduce="yes", **kw)


def test_inference_plans_have_no_zero():
    p = plan_parallel("gpt2", "h100-sxm5-80gb", gpus=2, batch_size=4, seq_len=32, mode="inference")
    assert set(p.candidates["zero"]) == {0} and p.best is not None


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(model="gpt9"), "gpt9"),
    (dict(gpus=0), "gpus=0"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(zero=4), "zero=4"),
    (dict(microbatches=0), "microbatches=0"),
    (dict(ep=0), "ep=0"),
    (dict(usd_per_gpu_hour=-1.0), "usd_per_gpu_hour"),
])
def test_bad_input_names_the_field(kwargs, fragment):
    args = dict(model="gpt2", device="h100-sxm5-80gb", gpus=2, batch_size=4, seq_len=32) | kwargs
    with pytest.raises((InputError, ModelError), match=fragment):   # the model's own error when no layout can run
        plan_parallel(**args)


def test_more_pipeline_stages_than_blocks_is_refused():
    with pytest.raises(InputError, match="pp=16 pipeline stages for the 12 transformer blocks"):
        predict_parallel("gpt2", "h100-sxm5-80gb", batch_size=16, seq_len=32, pp=16, microbatches=16)


def test_plan_from_the_command_line(tmp_path):
    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=[a100-80gb-pcie,h100-sxm5-80gb]",
                        "gpus=2", "batch_size=4", "seq_len=32", "mode=training", "gpu_hour_usd=[1.5,3]",
                        "json=plan.json", "csv=plan.csv", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "layouts of 2 GPUs forecast" in r.stdout and "best: dp " in r.stdout
    assert "best layout per GPU type, side by side" in r.stdout and "USD per 1M tokens" in r.stdout
    assert "fastest of the 2 plans: 2 x " in r.stdout and "cheapest: 2 x " in r.stdout
    plans = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [p["device"] for p in plans] == ["a100-80gb-pcie", "h100-sxm5-80gb"]
    assert all(p["best"]["fits"] == "yes" and len(p["layouts"]) == 3 for p in plans)   # dp 2, pp 2, tp 2
    csv = (tmp_path / "run" / "plan.csv").read_text().splitlines()
    assert csv[0].startswith("layout,dp,cp,cp comm,tp,pp,ep,vpp,sp,micro-batches,zero,recompute,ms") and len(csv) > 3



@pytest.fixture(scope="module")
def longer_plan():
    """GPT-2 at sequence 256 on two 3.3 GiB GPUs: tp 2 fits with selective recompute, pp 2 needs full recompute."""
    return plan_parallel("gpt2", modify_device("h100-sxm5-80gb", memory_gib=3.3), gpus=2, batch_size=8, seq_len=256,
                         mode="training")


def test_recompute_is_tried_only_where_nothing_fits_without_it(longer_plan):
    """Selective recompute only where the plain candidate does not fit, full recompute only where the selective
    one does not fit either; each recomputes more: slower, and a peak no higher (lower when the peak is one of
    activations; the optimizer step's can be the peak, which recompute does not change)."""
    c = longer_plan.candidates
    assert set(c["recompute"]) == {"no", "selective", "full"}     # the small GPU needs both somewhere
    assert longer_plan.table.set_index("layout").loc["dp 1 x tp 2 x pp 1", "recompute"] == "selective"
    key = ["layout", "micro-batches", "zero"]
    plain, selective, full = (c[c["recompute"] == r] for r in ("no", "selective", "full"))
    for more, less in ((selective, plain), (full, selective), (full, plain)):
        both = more.merge(less, on=key, suffixes=("", "_less"))
        assert len(both) == len(more)                             # each tried after the lesser one
        assert not both["fits_less"].any()                        # and never where the lesser one fits
        assert (both["ms"] > both["ms_less"]).all()               # more kernels run again
        assert (both["memory GiB"] <= both["memory GiB_less"]).all()
    both = full.merge(plain, on=key, suffixes=("", "_plain"))
    assert (both["memory GiB"] < both["memory GiB_plain"]).any()


def test_selective_recompute_is_skipped_only_where_it_cannot_fit(plan, small_gpu):
    """At sequence 64 the attention cores save too little for selective recompute to bring any candidate under
    1.5 GiB: the plan goes to full recompute without tracing it, and selective would indeed not have fitted."""
    c = plan.candidates
    assert "selective" not in set(c["recompute"]) and "full" in set(c["recompute"])
    for _, r in c[c["recompute"] == "full"].sample(2, random_state=0).iterrows():
        p = predict_parallel("gpt2", small_gpu, dp=int(r["dp"]), tp=int(r["tp"]), pp=int(r["pp"]),
                             microbatches=int(r["micro-batches"]), zero=int(r["zero"]), optimizer="adamw",
                             gradient_checkpointing="selective", **RUN)
        assert not p.memory_fits


def test_fixed_recompute_is_kept(small_gpu):
    for given, label in ((False, "no"), (True, "full"), ("selective", "selective")):
        p = plan_parallel("gpt2", small_gpu, gpus=2, gradient_checkpointing=given, **RUN)
        assert set(p.candidates["recompute"]) == {label}


def test_scaling_table_compares_each_count_with_the_first_that_fits():
    tiny = modify_device("h100-sxm5-80gb", memory_gib=0.1)
    plans = [plan_parallel("gpt2", "h100-sxm5-80gb", gpus=n, **RUN) for n in (1, 2)]
    t = scaling_table([plan_parallel("gpt2", tiny, gpus=1, **RUN), *plans])
    assert list(t["gpus"]) == [1, 1, 2]
    none, first, second = t.to_dict(orient="records")
    assert first["ms"] == plans[0].best["ms"] and second["ms"] == plans[1].best["ms"]
    assert first["speed-up"] == 1 and second["speed-up"] == pytest.approx(first["ms"] / second["ms"])
    assert second["efficiency"] == pytest.approx(second["speed-up"] / 2)
    assert none["layout"] == "none fits" and none["ms"] != none["ms"]     # NaN: nothing to time


def test_scaling_from_the_command_line(tmp_path):
    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=h100-sxm5-80gb", "gpus=[1,2]",
                        "batch_size=4", "seq_len=32", "mode=training", "json=plan.json",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "scaling on h100-sxm5-80gb, global batch 4" in r.stdout and "efficiency" in r.stdout
    plans = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert [p["gpus"] for p in plans] == [1, 2] and plans[0]["scaling"]["speed-up"] == 1


def test_a_plan_where_every_layout_is_left_out_says_so():
    p = plan_parallel("mixtral-8x7b", "h100-sxm5-80gb", gpus=2, batch_size=2, seq_len=16, ep=4, dtype="bfloat16")
    assert p.candidates.empty and p.best is None and len(p.skipped) == 3          # ep=4 divides no dp of 2 GPUs
    assert "no layout could be forecast" in p.summary()


_TINY_MOE = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                 vocab_size=512)
MOE_RUN = dict(batch_size=8, seq_len=32, mode="training", moe_kernels="loop")


def test_expert_parallel_degrees_that_divide_dp_and_the_experts_are_searched():
    p = plan_parallel(_TINY_MOE, "h100-sxm5-80gb", gpus=8, **MOE_RUN)
    c = p.candidates
    assert set(c["dp"]) == {8, 4, 2}            # 2 blocks: at most pp 2; 2 KV heads: at most tp 2
    for dp, eps in c.groupby("dp")["ep"]:       # 4 experts: ep 8 never, though it divides dp 8
        assert set(eps) == {e for e in (1, 2, 4) if dp % e == 0}, dp
    row = c[c["ep"] == 4].iloc[0]
    direct = predict_parallel(_TINY_MOE, "h100-sxm5-80gb", dp=int(row["dp"]), tp=int(row["tp"]), pp=int(row["pp"]),
                              microbatches=int(row["micro-batches"]), zero=int(row["zero"]), ep=4,
                              optimizer="adamw", **MOE_RUN)
    assert row["ms"] == pytest.approx(direct.latency_ms, rel=1e-12)
    assert "expert-parallel degrees" in p.summary() and " ep " in p.summary()
    best = p.best
    assert (f", ep {best['ep']}," in p.summary()) == (best["ep"] > 1)


def test_models_without_experts_and_a_given_ep_search_no_degrees(plan):
    assert set(plan.candidates["ep"]) == {1}
    assert "expert-parallel" not in plan.summary() and " ep " not in plan.summary().splitlines()[2]
    fixed = plan_parallel(_TINY_MOE, "h100-sxm5-80gb", gpus=4, ep=2, **MOE_RUN)
    assert set(fixed.candidates["ep"]) == {2}
    assert {k for k, why in fixed.skipped.items() if "ep=2 does not divide dp" in why} == \
        {"dp 1 x tp 2 x pp 2", "dp 1 x tp 4 x pp 1", "dp 1 x tp 1 x pp 4"}
    lora = plan_parallel(_TINY_MOE, "h100-sxm5-80gb", gpus=2, lora_rank=4, lora_targets=["q_proj", "v_proj"],
                         **MOE_RUN)   # expert parallelism with LoRA: not modelled
    assert set(lora.candidates["ep"]) == {1} and len(lora.candidates)


def test_expert_parallel_plan_from_the_command_line(tmp_path):
    cfg = tmp_path / "moe.json"
    cfg.write_text(json.dumps(_TINY_MOE))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=h100-sxm5-80gb", "gpus=[2,4]",
                        "batch_size=8", "seq_len=32", "mode=training", "csv=plan.csv",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "expert-parallel degrees" in r.stdout
    rows = (tmp_path / "run" / "plan.csv").read_text().splitlines()
    ep = rows[0].split(",").index("ep")
    assert {line.split(",")[ep] for line in rows[1:]} == {"1", "2", "4"}


GEN = dict(prompt_len=32, new_tokens=8)


def test_serving_plan_forecasts_every_dp_x_tp_layout_as_predict_generation_does():
    small = modify_device("l4", memory_gib=0.7)      # GPT-2 in FP32 needs 0.9 GiB on one GPU: fits only when split
    p = plan_generation("gpt2", small, gpus=4, batch_size=4, **GEN)
    c = p.candidates
    assert sorted(zip(c["dp"], c["tp"])) == [(1, 4), (2, 2), (4, 1)]
    for r in c.to_dict(orient="records"):
        f = predict_generation("gpt2", small, 4 // r["dp"], tp=r["tp"], **GEN)
        assert r["sequences per replica"] == 4 // r["dp"]
        assert r["total ms"] == pytest.approx(f.total_ms, rel=1e-12)
        assert r["per output token ms"] == pytest.approx(f.time_per_output_token_ms, rel=1e-12)
        assert r["generated tokens/s"] == pytest.approx(4 * 8 / f.total_ms * 1e3, rel=1e-12)   # all replicas
        assert r["fits"] == f.memory_fits
    t = p.table
    fits = t["fits"] == "yes"
    assert fits.any() and not fits.all()
    assert list(fits) == sorted(fits, reverse=True)                                    # fitting layouts first
    assert list(t.loc[fits, "total ms"]) == sorted(t.loc[fits, "total ms"])
    assert p.best is not None and p.best["layout"] == t.iloc[0]["layout"]
    assert f"best: {p.best['layout']}:" in p.summary()


def test_serving_plan_leaves_out_what_cannot_run():
    p = plan_generation("gpt2", "h100-sxm5-80gb", gpus=8, batch_size=2, **GEN)
    assert p.skipped["dp 8 x tp 1"] == p.skipped["dp 4 x tp 2"] == "the 2 sequences do not split into dp replicas"
    assert "tp=8" in p.skipped["dp 1 x tp 8"]                 # GPT-2's 12 heads
    assert list(p.candidates["layout"]) == ["dp 2 x tp 4"]
    assert "left out (2): dp 8 x tp 1, dp 4 x tp 2" in p.summary()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(gpus=0), "gpus=0"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(tp=2), "tp= is what plan_generation searches"),
    (dict(dp=2), "dp= is what plan_generation searches"),
    (dict(usd_per_gpu_hour=0), "usd_per_gpu_hour"),
])
def test_bad_serving_plan_input_names_the_field(kwargs, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        plan_generation(**(dict(model="gpt2", device="l4", gpus=2, batch_size=2, **GEN) | kwargs))


def test_serving_plan_from_the_command_line(tmp_path):
    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=[l4,h100-sxm5-80gb]", "gpus=2",
                        "batch_size=4", "seq_len=32", "new_tokens=8", "gpu_hour_usd=[0.8,3]", "csv=serve.csv",
                        "json=serve.json", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("layouts of 2 GPUs forecast") == 2 and "USD per 1M generated tokens" in r.stdout
    assert "fastest of the 2 plans: 2 x " in r.stdout and "USD per 1M generated tokens (" in r.stdout
    plans = json.loads((tmp_path / "run" / "serve.json").read_text())
    assert [(p["device"], len(p["layouts"])) for p in plans] == [("l4", 2), ("h100-sxm5-80gb", 2)]
    csv = (tmp_path / "run" / "serve.csv").read_text().splitlines()
    assert csv[0].startswith("layout,dp,tp,sequences per replica,total ms") and len(csv) == 5


def test_across_plans_names_the_fastest_and_the_cheapest_that_fit():
    run = dict(batch_size=4, seq_len=32, mode="training")
    plans = [plan_parallel("gpt2", dev, n, usd_per_gpu_hour=usd, **run)
             for dev, usd in (("t4", 0.35), ("h100-sxm5-80gb", 3.0)) for n in (1, 2)]
    fast = min(plans, key=lambda p: p.best["ms"])
    cheap = min(plans, key=lambda p: p.best["USD per 1M tokens"])
    lines = across(plans)
    assert lines[0].startswith(f"fastest of the 4 plans: {fast.gpus} x {fast.device.key} as {fast.best['layout']}:")
    assert lines[1].startswith(f"cheapest: {cheap.gpus} x {cheap.device.key} as {cheap.best['layout']}:")
    assert across(plans[:1]) == [] and len(across([plan_parallel("gpt2", "t4", 2, **run)] * 2)) == 1   # no price
    none = plan_parallel("gpt2", modify_device("t4", memory_gib=0.1), 1, **run)
    assert across([none, none]) == []                               # nothing fits


def test_a_given_interleaving_applies_to_the_pipeline_layouts():
    p = plan_parallel("gpt2", "h100-sxm5-80gb", gpus=4, vpp=3, **RUN)
    c = p.candidates
    assert set(c.loc[c["pp"] > 1, "vpp"]) == {3} and set(c.loc[c["pp"] == 1, "vpp"]) == {1}
    assert (c.loc[c["pp"] > 1, "micro-batches"] % c.loc[c["pp"] > 1, "pp"] == 0).all()
    plain = plan_parallel("gpt2", "h100-sxm5-80gb", gpus=4, **RUN).candidates
    assert set(plain["vpp"]) == {1}                                # not searched
    assert " vpp " in p.summary() and " vpp " not in plan_parallel("gpt2", "h100-sxm5-80gb", gpus=2,
                                                                    **RUN).summary()


def test_sequence_parallelism_applies_to_the_tensor_parallel_layouts():
    """sp=True is given, not searched: on every layout with tp > 1 (the sp column), none without; there it saves
    memory, and time where the split kernels are above their launch floor, at the same collectives (pipeline
    stages exchange less)."""
    with_sp, without = (plan_parallel("gpt2", "h100-sxm5-80gb", gpus=4, sp=sp, **RUN) for sp in (True, False))
    c = with_sp.candidates
    assert ((c["sp"] == "yes") == (c["tp"] > 1)).all() and (without.candidates["sp"] == "no").all()
    key = ["layout", "micro-batches", "zero", "recompute"]
    both = c.merge(without.candidates, on=key, suffixes=("", "_plain"))
    assert len(both) == len(c)
    tp = both[both["tp"] > 1]
    assert len(tp) and (tp["ms"] <= tp["ms_plain"]).all() and (tp["ms"] < tp["ms_plain"]).any()
    assert (tp["memory GiB"] < tp["memory GiB_plain"]).all()
    one_stage = tp["pp"] == 1               # pipeline stages send 1 / tp of the activation per GPU with sp
    assert (tp.loc[one_stage, "communication ms"] == tp.loc[one_stage, "communication ms_plain"]).all()
    assert (tp.loc[~one_stage, "communication ms"] < tp.loc[~one_stage, "communication ms_plain"]).all()
    rest = both[both["tp"] == 1]
    assert (rest["ms"] == rest["ms_plain"]).all()
    header = [line for line in with_sp.summary().splitlines() if line.lstrip().startswith("rank")]
    assert header and " sp " in header[0] + " "
    assert all(" sp " not in line + " " for line in without.summary().splitlines() if line.lstrip().startswith("rank"))

"""The command lines as a user runs them (subprocesses): bad input -> one ``error:`` line on stderr and exit 2;
good input -> the summary, the side-by-side table and the files asked for."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import neusight
from tests.conftest import REPO

BIN = Path(sys.executable).parent


def _start(tool: str, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / tool), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


BAD = {
    # (tool, arguments) -> a fragment the one-line message must contain
    "predict-unknown-gpu": (("neusight-predict", "model=gpt2", "device=h999"), "unknown device 'h999'"),
    "predict-unknown-model": (("neusight-predict", "model=gpt9", "device=t4"), "gpt9"),
    "predict-uncached-hub-id": (("neusight-predict", "model=acme/not-in-any-cache", "device=t4"),
                                "hf download acme/not-in-any-cache config.json"),
    "predict-batch-0": (("neusight-predict", "model=gpt2", "device=t4", "batch_size=0"), "batch_size=0"),
    "predict-negative-seq": (("neusight-predict", "model=gpt2", "device=t4", "seq_len=-4"), "seq_len=-4"),
    "predict-missing-yaml": (("neusight-predict", "model=gpt2", "device=/nonexistent/gpu.yaml"), "/nonexistent/gpu.yaml"),
    "predict-malformed-yaml": (("neusight-predict", "model=gpt2", "device={bad_yaml}"), "bad_gpu.yaml"),
    "predict-unknown-gpu-in-list": (("neusight-predict", "model=gpt2", "device=[t4,h999]"), "h999"),
    "predict-missing-checkpoint": (("neusight-predict", "model=gpt2", "device=t4", "predictor=/nonexistent/ckpt"),
                                   "/nonexistent/ckpt"),
    "trace-unknown-model": (("neusight-trace", "model=gpt9"), "gpt9"),
    "trace-batch-0": (("neusight-trace", "model=gpt2", "batch_size=0"), "batch_size=0"),
    "trace-negative-seq": (("neusight-trace", "model=gpt2", "seq_len=-4"), "seq_len=-4"),
    "trace-csv-under-a-file": (("neusight-trace", "model=gpt2", "seq_len=8", "csv={bad_yaml}/kernels.csv"),
                               "cannot write"),
    "predict-json-under-a-file": (("neusight-predict", "model=gpt2", "device=t4", "seq_len=8",
                                   "json={bad_yaml}/forecast.json"), "cannot write"),
    "evaluate-unknown-gpu": (("neusight-evaluate", "labels.gpus=[h999]", "cnn.enabled=false"), "h999"),
    "evaluate-unknown-option": (("neusight-evaluate", "labels.options=[dp4]", "cnn.enabled=false"), "'dp4'"),
    "predict-kv-cache-on-an-encoder": (("neusight-predict", "model=bert-base", "device=t4", "seq_len=8", "kv_cache=16"),
                                       "decoder-only causal language model"),
    "predict-static-cache-without-a-cache": (("neusight-predict", "model=gpt2", "device=t4", "static_cache=true"),
                                             "static_cache=True"),
    "predict-generation-training": (("neusight-predict", "model=gpt2", "device=t4", "new_tokens=8", "mode=training"),
                                    "new_tokens=8"),
    "predict-unknown-amp": (("neusight-predict", "model=gpt2", "device=t4", "amp=float8"), "amp='float8'"),
    "predict-fp8-kv-cache-without-static-cache": (("neusight-predict", "model=gpt2", "device=h100-sxm5-80gb",
                                                   "seq_len=32", "new_tokens=4", "attn_implementation=sdpa",
                                                   "kv_cache_dtype=fp8"), "kv_cache_dtype='fp8' stores a KV cache"),
    "predict-unknown-kv-cache-dtype": (("neusight-predict", "model=gpt2", "device=t4", "seq_len=1", "kv_cache=15",
                                        "static_cache=true", "attn_implementation=sdpa", "kv_cache_dtype=int3"),
                                       "kv_cache_dtype='int3' is not known"),
    "predict-serving-target-without-search": (("neusight-predict", "model=gpt2", "device=t4", "new_tokens=8",
                                               "max_tpot_ms=20"), "max_tpot_ms=20.0 is a latency target"),
    "predict-serving-target-zero": (("neusight-predict", "model=gpt2", "device=t4", "new_tokens=8",
                                     "find_max_batch=true", "max_ttft_ms=0"), "max_ttft_ms=0.0 is not a positive"),
    "predict-serving-plan-of-one-layout": (("neusight-predict", "model=gpt2", "device=t4", "gpus=4", "tp=2",
                                            "new_tokens=8", "find_max_batch=true"), "tp=2 fixes one"),
    "predict-unknown-batching": (("neusight-predict", "model=gpt2", "device=t4", "new_tokens=8", "batching=paged"),
                                 "batching='paged' is not known"),
    "predict-token-budget-of-a-static-batch": (("neusight-predict", "model=gpt2", "device=t4", "new_tokens=8",
                                                "max_num_batched_tokens=512"), "add batching=continuous"),
    "predict-continuous-with-static-cache": (("neusight-predict", "model=gpt2", "device=t4", "new_tokens=8",
                                              "batching=continuous", "static_cache=true"), "static_cache=true"),
    "predict-continuous-plan-without-search": (("neusight-predict", "model=gpt2", "device=t4", "gpus=2",
                                                "new_tokens=8", "batching=continuous"), "find_max_batch=true"),
    "predict-continuous-one-new-token": (("neusight-predict", "model=gpt2", "device=t4", "new_tokens=1",
                                          "batching=continuous"), "new_tokens=1"),
    "collect-without-out": (("neusight-collect",), "out= is required"),
    "train-zero-width-layer": (("neusight-train", "predictor.families.linear.hidden=[0]", "out={bad_yaml}.d",
                                "progress=false"), "predictor.families.linear.hidden=(0,)"),
    "predict-dp-0": (("neusight-predict", "model=gpt2", "device=t4", "dp=0"), "dp=0"),
    "predict-negative-top": (("neusight-predict", "model=gpt2", "device=t4", "top=-1"), "top=-1"),
    "predict-negative-run-length": (("neusight-predict", "model=gpt2", "device=t4", "total_tokens=-5"),
                                    "total_tokens=-5"),
    "predict-unknown-dtype": (("neusight-predict", "model=gpt2", "device=t4", "dtype=float8"), "dtype='float8'"),
    "predict-unknown-tf32": (("neusight-predict", "model=gpt2", "device=a100-pcie-40gb", "tf32=fast"), "tf32='fast'"),
    "predict-unknown-memory-format": (("neusight-predict", "model=resnet18", "device=t4", "memory_format=nhwc"),
                                      "memory_format='nhwc'"),
    "predict-tp-not-dividing-heads": (("neusight-predict", "model=gpt2", "device=t4", "tp=5"), "tp=5"),
    "predict-fp8-without-fp8-cores": (("neusight-predict", "model=llama-3-8b", "device=a100-80gb-pcie", "fp8=true",
                                      "dtype=bfloat16"), "fp8=True needs FP8 tensor cores; a100-80gb-pcie"),
    "predict-fp8-unknown-scaling": (("neusight-predict", "model=llama-3-8b", "device=h100-sxm5-80gb", "fp8=maybe",
                                    "dtype=bfloat16"), "fp8='maybe' is not true, false, 'dynamic' or 'static'"),
    "predict-int4-training": (("neusight-predict", "model=llama-3-8b", "device=l4", "mode=training",
                               "weight_quant=int4"), "weight_quant='int4' forecasts serving a quantized checkpoint"),
    "predict-interleaving-without-stages": (("neusight-predict", "model=gpt2", "device=t4", "vpp=2"),
                                            "vpp=2 interleaves model chunks over pipeline stages"),
    "predict-negative-host-time": (("neusight-predict", "model=gpt2", "device=t4", "host_us=-5"), "host_us=-5"),
    "predict-serving-plan-with-tp": (("neusight-predict", "model=gpt2", "device=t4", "gpus=4", "new_tokens=8", "tp=2"),
                                     "gpus=4 searches the dp x tp layouts, and tp=2 fixes one"),
    "predict-ep-not-dividing-dp": (("neusight-predict", "model=mixtral-8x7b", "device=h100-sxm5-80gb", "dp=4", "ep=3"),
                                   "ep=3 does not divide dp=4"),
    "predict-zero-without-replicas": (("neusight-predict", "model=gpt2", "device=t4", "mode=training", "zero=2"),
                                      "dp=1 has none"),
    "predict-longest-over-stages-beyond-positions": (("neusight-predict", "model=gpt2", "device=t4", "pp=2",
                                                      "cp=32", "attn_implementation=sdpa", "seq_len=1024",
                                                      "find_max_seq_len=true"), "cp=32"),
    "predict-checkpointing-inference": (("neusight-predict", "model=gpt2", "device=t4", "gradient_checkpointing=true"),
                                        "mode='inference'"),
    "predict-selective-recompute-of-a-cnn": (("neusight-predict", "model=resnet18", "device=t4", "mode=training",
                                              "gradient_checkpointing=selective"), "no attention function"),
    "predict-unknown-recompute": (("neusight-predict", "model=gpt2", "device=t4", "mode=training",
                                   "gradient_checkpointing=partial"), "'selective'"),
    "predict-sequence-parallel-without-tp": (("neusight-predict", "model=gpt2", "device=t4", "mode=training",
                                              "sp=true"), "tp=1 has none"),
    "predict-overlap-without-replicas": (("neusight-predict", "model=gpt2", "device=t4", "mode=training",
                                          "overlap_grad_reduce=true"), "overlap_grad_reduce=true overlaps"),
    "predict-param-gather-without-zero": (("neusight-predict", "model=gpt2", "device=t4", "mode=training", "dp=2",
                                           "overlap_param_gather=true"), "zero=0 gathers none"),
    "predict-more-ports-than-gpus": (("neusight-predict", "model=gpt2", "device=h100-sxm5-80gb", "mode=training",
                                      "dp=16", "nics_per_node=16"), "nics_per_node=16 is more than gpus_per_node=8"),
    "predict-nvls-off-on-one-gpu": (("neusight-predict", "model=gpt2", "device=h100-sxm5-80gb", "nvls=false"),
                                    "a run with dp=1 and tp=1 has none"),
    "predict-lora-without-targets": (("neusight-predict", "model=resnet18", "device=t4", "mode=training", "lora_rank=4"),
                                     "lora_targets"),
    "predict-sequence-length-of-a-cnn": (("neusight-predict", "model=resnet18", "device=t4", "seq_len=128"),
                                         "seq_len=128 is for sequence models; resnet18 takes 224x224 images"),
    "predict-tokens-of-a-cnn": (("neusight-predict", "model=resnet18", "device=t4", "total_tokens=1e6"),
                                "total_samples="),
    "predict-anchor-without-its-gpu": (("neusight-predict", "model=gpt2", "device=t4", "anchor_ms=12"),
                                       "anchor_device"),
    "predict-unimportable-module": (("neusight-predict", "model=no_such_pkg_xyz:Net", "device=t4",
                                     "input_shapes=[[4]]"), "cannot import 'no_such_pkg_xyz'"),
    "predict-input-shapes-of-a-preset": (("neusight-predict", "model=gpt2", "device=t4", "input_shapes=[[3]]"),
                                         "is for an nn.Module"),
    "predict-negative-price": (("neusight-predict", "model=gpt2", "device=t4", "gpu_hour_usd=-2"),
                               "gpu_hour_usd=-2 is not a positive price"),
    "predict-prices-not-one-per-gpu": (("neusight-predict", "model=gpt2", "device=[t4,l4]", "gpu_hour_usd=[1,2,3]"),
                                       "3 price(s) for 2 device(s)"),
    "predict-rank-all-searches-on-several-gpus": (
        ("neusight-predict", "model=gpt2", "device=all", "tp=2", "find_max_batch=true"),
        "device=all with find_max_batch on several GPUs (dp, tp, pp, cp or zero) is not available"),
    "predict-rank-all-no-gpu-can": (("neusight-predict", "model=gpt2", "device=all", "fp8=true", "dtype=bfloat16",
                                     "seq_len=16"), "GPT2LMHeadModel has none that qualify"),
    "predict-plan-with-a-fixed-layout": (("neusight-predict", "model=gpt2", "device=t4", "gpus=4", "tp=2"),
                                         "gpus=4 searches the dp x tp x pp layouts, and tp=2 fixes one"),
    "predict-plan-of-no-gpus": (("neusight-predict", "model=gpt2", "device=t4", "gpus=[8,0]"),
                                "gpus=[8, 0] is not a positive number of GPUs or a list of them"),
    "predict-longest-plan-with-a-seq-len": (("neusight-predict", "model=gpt2", "device=t4", "gpus=4", "seq_len=128",
                                             "find_max_seq_len=true"),
                                            "seq_len=128 with gpus=4 find_max_seq_len=true: the search finds"),
    "predict-plan-searching-batches": (("neusight-predict", "model=gpt2", "device=t4", "gpus=4", "find_max_batch=true"),
                                       "find_max_seq_len=true searches each layout's longest sequence"),
    "predict-plan-of-every-gpu": (("neusight-predict", "model=gpt2", "device=all", "gpus=4"),
                                  "gpus=4 plans the layouts of one GPU type at a time"),
    "predict-context-parallel-uneven-sequence": (("neusight-predict", "model=gpt2", "device=h100-sxm5-80gb", "cp=3",
                                                  "seq_len=256", "attn_implementation=sdpa"),
                                                 "seq_len=256 is not a multiple of 6"),
    "predict-plan-with-context-parallelism-not-dividing": (("neusight-predict", "model=gpt2", "device=t4", "gpus=4",
                                                            "cp=3"), "cp=3 is not a positive integer that divides"),
    "predict-searched-context-parallelism-without-a-plan": (("neusight-predict", "model=gpt2", "device=t4",
                                                             "cp=auto"), "cp=auto is not a positive integer: one "
                                                                         "forecast takes one context-parallel degree"),
    "predict-searched-context-exchange-without-a-plan": (("neusight-predict", "model=gpt2", "device=t4",
                                                          "cp=2", "cp_comm=auto"), "cp_comm=auto is not one exchange"),
    "predict-plan-with-context-parallel-degrees-misspelled": (("neusight-predict", "model=gpt2", "device=t4",
                                                               "gpus=4", "cp=all"), "a list of them or 'auto'"),
    "predict-misspelled-what-if-field": (("neusight-predict", "model=gpt2", "device=t4", "+spec.mem_bandwith_gbps=600"),
                                         "did you mean 'mem_bandwidth_gbps'"),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The bad-input commands, each in a process of its own forked from one that imported the tools once
    (tests/forked_cli.py: a process per command line paid 2 s of imports each, 80 times)."""
    tmp = tmp_path_factory.mktemp("bad")
    bad_yaml = tmp / "bad_gpu.yaml"
    bad_yaml.write_text("name: Made-up GPU\nvendor: nvidia\nsm_count: -3\n")   # no aliases, negative SMs
    commands = [{"tool": BAD[case][0][0], "cwd": str(tmp),
                 "args": [a.format(bad_yaml=bad_yaml) for a in BAD[case][0][1:]] + [f"hydra.run.dir={tmp / case}"]}
                for case in BAD]
    r = subprocess.run([sys.executable, "-m", "tests.forked_cli", "--jobs", "3", "--timeout", "300"], cwd=REPO,
                       input=json.dumps(commands), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    return {case: subprocess.CompletedProcess(c["args"], out["returncode"], out["stdout"], out["stderr"])
            for case, c, out in zip(BAD, commands, json.loads(r.stdout))}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line(bad_runs, case):
    r = bad_runs[case]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert BAD[case][1] in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=[a100-80gb-pcie,h100-sxm5-80gb]",
                        "batch_size=1", "seq_len=64", "mode=training", "json=forecast.json", f"csv={tmp / 'k.csv'}",
                        f"predictor={REPO / 'data' / 'predictor'}", "top=3", "gpu_hour_usd=[1.5,3.5]",
                        f"hydra.run.dir={tmp / 'run'}"],
                       cwd=tmp, capture_output=True, text=True, timeout=300)
    return r, tmp


def test_predict_prints_summary_and_side_by_side(compare_run):
    r, _ = compare_run
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for fragment in ("total:", "phases: forward", "backward", "optimizer", "bound: compute-bound kernels",
                     "top 3 kernels", "top 3 layers", "transformer.h.*", "side by side", "speed-up vs a100-80gb-pcie",
                     "not in the predictor's training set", "tokens/s",
                     "measured accuracy of this kind (FP32 transformer training on GPUs the predictor was not trained on)",
                     "not in those runs: the optimizer step", "measured mean error of the kind"):
        assert fragment in out, fragment
    assert "memory: peak" in out
    assert "gpt2: training (forward + loss + backward + optimizer), batch 1, seq 64, 124.4 M parameters" in out


def test_predict_writes_json_into_run_dir_and_csv_where_asked(compare_run):
    _, tmp = compare_run
    data = json.loads((tmp / "run" / "forecast.json").read_text())   # relative path: Hydra's run directory
    assert [d["device"] for d in data] == ["a100-80gb-pcie", "h100-sxm5-80gb"]
    assert all(d["latency_ms"] > 0 and set(d["phases"]) >= {"forward", "backward", "optimizer"} for d in data)
    assert all(d["measured_accuracy"]["record"]["gpus"] == ["l4"] for d in data)   # L4: the one unseen GPU measured
    # gpt2, batch 1 x 64 tokens: throughput = tokens per second of the step
    assert all(d["throughput_unit"] == "tokens/s" and d["throughput"] == pytest.approx(64 / (d["latency_ms"] / 1e3))
               for d in data)
    k = pd.read_csv(tmp / "k.csv")                                       # absolute path: as given
    assert set(k["device"]) == {"a100-80gb-pcie", "h100-sxm5-80gb"}
    assert (k["latency_ms"] > 0).all()
    # the per-device kernel rows sum to the totals of the JSON
    for d in data:
        assert k.loc[k["device"] == d["device"], "latency_ms"].sum() == pytest.approx(d["latency_ms"], rel=1e-9)
    # cost: the price per GPU-hour x the hours 1M tokens take at the forecast throughput
    for d, price in zip(data, (1.5, 3.5)):
        assert d["cost"]["usd_per_gpu_hour"] == price and d["cost"]["per"] == "1M tokens"
        assert d["cost"]["usd"] == pytest.approx(price * 1e6 / d["throughput"] / 3600, rel=1e-12)


def test_side_by_side_cost_is_price_ratio_over_speed_up(compare_run):
    r, _ = compare_run
    rows = {ln.split("  ")[0].strip(): ln.split()[-2:] for ln in r.stdout.split("side by side:")[1].splitlines()[1:]
            if ln.strip()}
    a100_ms, h100_ms = (float(v.replace(",", "")) for v in rows["total ms"])
    a100_usd, h100_usd = (float(v) for v in rows["USD per 1M tokens"])
    assert h100_usd / a100_usd == pytest.approx((3.5 / 1.5) * h100_ms / a100_ms, rel=2e-3)   # 4 significant digits
    assert rows["cost vs a100-80gb-pcie"][0] == "1.00x"
    assert "cost: $" in r.stdout and "per 1M tokens at $3.5 per GPU-hour" in r.stdout


def test_predict_multirun_compares_jobs(tmp_path):
    r = subprocess.run([str(BIN / "neusight-predict"), "--multirun", "model=gpt2", "device=t4,l4", "batch_size=1",
                        "seq_len=32", "memory=false", "top=1", f"hydra.sweep.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    table = pd.read_csv(tmp_path / "comparison.csv", index_col=0)
    assert list(table.columns) == ["t4", "l4"]
    assert table.loc["speed-up vs t4", "t4"] == "1.00x"


def _ranked_rows(stdout: str) -> list[list[str]]:
    """The rows of device=all's ranked table: the lines under its header that start with a rank number."""
    lines = stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["rank", "GPU"]) + 1
    rows = []
    for ln in lines[start:]:
        if not (ln.split() and ln.split()[0].isdigit()):
            break
        rows.append(ln.split())
    return rows


def test_device_all_ranks_every_gpu_of_the_library_fastest_first(tmp_path):
    from neusight import list_devices

    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=all", "batch_size=1", "seq_len=32",
                        "gpu_hour_usd=2", "json=all.json", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = {d["device"]: d for d in json.loads((tmp_path / "all.json").read_text())}
    assert sorted(data) == list_devices()
    rows = _ranked_rows(r.stdout)
    assert [int(row[0]) for row in rows] == list(range(1, len(data) + 1))
    order = [row[1] for row in rows]
    assert sorted(order) == list_devices()
    ms = [data[k]["latency_ms"] for k in order]
    assert ms == sorted(ms)                                              # fastest first
    assert f"fastest: {order[0]} ({ms[0]:,.2f} ms)" in r.stdout
    assert f"cheapest per 1M tokens: {order[0]}" in r.stdout            # one price for all: the fastest is cheapest
    for row in rows:                                                      # ... "<peak> of <GiB>" <fits> ...
        i = row.index("of")
        peak = data[row[1]]["memory"]["peak_bytes"] / 2**30
        assert float(row[i - 1]) == pytest.approx(peak, abs=0.05)
        assert row[i + 2] == ("yes" if data[row[1]]["memory"]["fits"] else "no")
    fitting = sum(d["memory"]["fits"] for d in data.values())
    assert f"the run fits in the memory of {fitting} of {len(data)} GPUs" in r.stdout
    # where some do not fit, the ranking says how to ask what would make it fit on them (neusight.remedies)
    assert ("advise=true ranks the GPUs it fits on with the usual memory remedies" in r.stdout) == (fitting < len(data))


def test_device_all_leaves_out_the_gpus_that_cannot_run_it(tmp_path):
    from neusight import list_devices
    from neusight.devices import load_device

    r = subprocess.run([str(BIN / "neusight-predict"), "model=llama-3-8b", "device=all", "batch_size=1", "seq_len=16",
                        "dtype=bfloat16", "fp8=true", "memory=false", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fp8 = sorted(k for k in list_devices() if load_device(k).fp8_tensor_tflops)
    assert fp8 and sorted(row[1] for row in _ranked_rows(r.stdout)) == fp8
    left = r.stdout.split("left out (")[1]
    assert left.startswith(f"{len(list_devices()) - len(fp8)}): fp8=True needs FP8 tensor cores:")
    assert all(k in left for k in list_devices() if k not in fp8)



_TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.mark.parametrize("run", [("mode=training", "batch_size=8", "seq_len=64", "dp=2", "tp=2"),
                                 ("batch_size=2", "seq_len=32", "new_tokens=4", "tp=2", "dtype=bfloat16",
                                  "attn_implementation=flash_attention_2")])
def test_device_all_ranks_multi_gpu_runs_and_leaves_out_gpus_that_cannot(tmp_path, run):
    """device=all with dp / tp (a step, or generate() split over GPUs): every GPU type of the library ranked for the
    same layout, fastest first, with the memory of one GPU and the price of all of them; GPUs that cannot run it
    (flash-attn 2 on older ones) left out with the reason, not stopping the rest (before: refused)."""
    from neusight import list_devices
    from neusight.devices import load_device

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(_TINY_LLAMA))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=all", *run, "gpu_hour_usd=2",
                        "json=all.json", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    generation = "new_tokens=4" in run
    data = {d["device"]: d for d in json.loads((tmp_path / "all.json").read_text())}
    key = "total_ms" if generation else "latency_ms"
    rows = _ranked_rows(r.stdout)
    order = [row[1] for row in rows]
    assert sorted(order) == sorted(data) and [data[k][key] for k in order] == sorted(data[k][key] for k in order)
    assert all(data[k]["gpus"] == (2 if generation else 4) for k in order)
    assert ("tensor parallel over 2 GPUs of each type" if generation else
            "on 4 GPUs of each type (dp 2, tp 2, pp 1") in r.stdout
    assert "memory per GPU GiB" in r.stdout and f"fastest: {order[0]}" in r.stdout
    # flash-attn 2 runs on NVIDIA compute capability 8.0+ and AMD's MI200 / MI300 (not the MI100)
    cannot = sorted(k for k in list_devices() if generation and (k == "mi100" or load_device(k).vendor == "nvidia"
                                                                  and load_device(k).cc < 8.0))
    assert sorted(set(list_devices()) - set(order)) == cannot
    if cannot:
        assert "left out (" in r.stdout and all(k in r.stdout.split("left out (")[1] for k in cannot)



def test_context_parallel_run_from_the_command_line(tmp_path):
    """cp=2: each sequence over two GPUs; the run line names it, the JSON records carry its exposed exchanges, and
    the longest-sequence search counts the whole sequence (a multiple of 2 x 64 tokens)."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(_TINY_LLAMA))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=h100-sxm5-80gb", "mode=training",
                        "batch_size=2", "seq_len=256", "cp=2", "dtype=bfloat16", "attn_implementation=sdpa",
                        "find_max_seq_len=true", "json=cp.json", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "(dp 1, cp 2, tp 1, pp 1" in r.stdout
    assert "note: context parallelism (p2p): each sequence of 256 tokens" in r.stdout
    record = json.loads((tmp_path / "cp.json").read_text())[0]
    assert record["gpus"] == 2 and "cp_comm_ms" in record and record["dp_allreduce_ms"] > 0
    longest = re.search(r"longest sequence that fits on 2 x .* \(dp 1, cp 2, tp 1\) at global batch 2: (\d+)",
                        r.stdout)
    assert longest and int(longest[1]) == 512       # the tiny model's 512 positions: the whole sequence's cap


def test_images_of_a_multimodal_model_from_the_command_line(tmp_path):
    """images=2: the run line says how many images each sequence has, the note what encodes them and how many of
    seq_len's positions they fill."""
    cfg = tmp_path / "tiny_llava.json"
    cfg.write_text(json.dumps({"model_type": "llava", "image_token_index": 500, "text_config": _TINY_LLAMA,
                               "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32,
                                                 "intermediate_size": 64, "num_hidden_layers": 2,
                                                 "num_attention_heads": 2, "image_size": 56, "patch_size": 14}}))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=l4", "batch_size=2", "seq_len=64",
                        "images=2", f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "inference, batch 2, seq 64, 2 images per sequence" in r.stdout
    assert ("2 images of 56x56 per sequence through its clip_vision_model encoder and projector, 16 positions"
            in r.stdout)


def test_plan_searching_context_parallelism_from_the_command_line(tmp_path):
    """gpus=2 cp=[1,2] cp_comm=auto: the plan forecasts the layouts of 2 GPUs and of one cp=2 group with each
    exchange, shows the cp columns and writes them to the plans' CSV."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(_TINY_LLAMA))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=h100-sxm5-80gb", "batch_size=2",
                        "seq_len=256", "gpus=2", "cp=[1,2]", "cp_comm=auto", "dtype=bfloat16",
                        "attn_implementation=sdpa",
                        "csv=plan.csv", f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "context-parallel degrees" in r.stdout and " cp " in r.stdout
    plan = pd.read_csv(tmp_path / "plan.csv")
    assert sorted(zip(plan["dp"], plan["cp"], plan["cp comm"], plan["tp"], plan["pp"])) == [
        (1, 1, "-", 1, 2), (1, 1, "-", 2, 1), (1, 2, "a2a", 1, 1), (1, 2, "all_gather", 1, 1), (1, 2, "p2p", 1, 1),
        (2, 1, "-", 1, 1)]


def test_plan_of_the_longest_sequences_from_the_command_line(tmp_path):
    """gpus=[2,4] find_max_seq_len=true: per count, each layout's longest sequence and a step's time at it, the
    longest of the plans, the layouts as CSV and the plans as JSON, the same numbers in each."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**_TINY_LLAMA, "vocab_size": 32000, "max_position_embeddings": 8192}))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=l4", "batch_size=4", "mode=training",
                        "gpus=[2,4]", "find_max_seq_len=true", "dtype=bfloat16", "attn_implementation=sdpa",
                        "+spec.memory_gib=1", "csv=longest.csv", "json=longest.json", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = pd.read_csv(tmp_path / "longest.csv")
    records = json.loads((tmp_path / "longest.json").read_text())
    assert [rec["gpus"] for rec in records] == [2, 4] and sorted(set(rows["gpus"])) == [2, 4]
    assert (rows["limited by"] == "memory").all() and (rows["max seq_len"] % 64 == 0).all()
    for rec in records:
        best = rec["longest"]
        assert best["max seq_len"] == rows.loc[rows["gpus"] == rec["gpus"], "max seq_len"].max()
        assert f"longest: {best['layout']}" in r.stdout and f"{best['max seq_len']:,} tokens" in r.stdout
    assert "longest of the 2 plans: " in r.stdout


def test_memory_searches_over_pipeline_stages_from_the_command_line(tmp_path):
    """pp=2 microbatches=2 with find_max_batch / find_max_seq_len: the largest global batch and the longest sequence
    whose run's first stage fits, as predict_parallel forecasts that layout: the printed values fit, one sample per
    micro-batch (64 tokens) more does not."""
    from neusight.devices import load_device, modify_device
    from neusight.parallel import predict_parallel

    model = {**_TINY_LLAMA, "vocab_size": 32000, "max_position_embeddings": 8192}
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(model))
    run = ["batch_size=4", "seq_len=512", "mode=training", "pp=2", "microbatches=2", "dtype=bfloat16",
           "attn_implementation=sdpa"]
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=l4", *run, "find_max_batch=true",
                        "find_max_seq_len=true", "+spec.memory_gib=1", f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    batch = int(re.search(r"largest global batch that fits on 2 x .*first stage's GPU\): (\d+) \(", r.stdout)[1])
    seq = int(re.search(r"longest sequence that fits on .* at global batch 4: ([\d,]+)", r.stdout)[1].replace(",", ""))
    gpu = modify_device(load_device("l4"), memory_gib=1)
    kw = dict(mode="training", pp=2, microbatches=2, optimizer="adamw", dtype="bfloat16", attn_implementation="sdpa")
    assert batch % 2 == 0 and seq % 64 == 0 and batch > 4 and 512 < seq < 8192
    assert predict_parallel(model, gpu, batch, 512, **kw).memory_fits
    assert not predict_parallel(model, gpu, batch + 2, 512, **kw).memory_fits
    assert predict_parallel(model, gpu, 4, seq, **kw).memory_fits
    assert not predict_parallel(model, gpu, 4, seq + 64, **kw).memory_fits


def test_multi_gpu_runs_on_named_gpus_end_side_by_side(tmp_path):
    """A dp / tp run on a list of GPU types ends with one table of them side by side: the total and its parts, the
    throughput, the speed-up and cost against the first, one GPU's memory, as the JSON records say."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(_TINY_LLAMA))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=[l4,h100-sxm5-80gb]", "mode=training",
                        "batch_size=4", "seq_len=32", "dp=2", "tp=2", "gpu_hour_usd=[1,3]", "json=two.json",
                        f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    records = json.loads((tmp_path / "two.json").read_text())
    table = r.stdout.split("side by side (parts of the total; memory: one GPU's):\n")[1].splitlines()
    assert table[0].split() == ["l4", "h100-sxm5-80gb"]
    rows = {ln.rsplit(None, 2)[0].strip(): ln.split()[-2:] for ln in table[1:]}
    assert rows["total ms"] == [f"{d['latency_ms']:,.2f}" for d in records]
    assert rows["tp_comm ms"] == [f"{d['tp_comm_ms']:,.2f}" for d in records]
    speed = records[0]["latency_ms"] / records[1]["latency_ms"]
    assert rows["speed-up vs l4"] == ["1.00x", f"{speed:.2f}x"]
    assert rows["memory peak GiB"] == [f"{d['memory_peak_bytes'] / 2**30:.1f}" for d in records]
    assert rows["MFU %"] == [f"{100 * d['efficiency_per_gpu']['mfu']:.1f}" for d in records]


def test_device_all_ranks_generation_by_its_total_time(tmp_path):
    from neusight import list_devices

    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=all", "batch_size=2", "seq_len=32",
                        "new_tokens=8", "gpu_hour_usd=1", "json=gen.json", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = {d["device"]: d for d in json.loads((tmp_path / "gen.json").read_text())}
    assert sorted(data) == list_devices()
    order = [row[1] for row in _ranked_rows(r.stdout)]
    totals = [data[k]["total_ms"] for k in order]
    assert sorted(order) == list_devices() and totals == sorted(totals)
    assert "gpt2: generate(), batch 2, prompt 32, 8 new tokens, dynamic KV cache" in r.stdout
    assert f"cheapest per 1M generated tokens: {order[0]}" in r.stdout
    # one price: the cost per generated token follows the tokens/s
    usd = [data[k]["usd_per_1m_generated_tokens"] * data[k]["generated_tokens_per_s"] for k in order]
    assert max(usd) == pytest.approx(min(usd), rel=1e-9)
    assert all(0 < data[k]["decode_mbu_pct"] <= 100 and 0 < data[k]["prefill_mfu_pct"] <= 100 for k in order)


def test_ranking_searches_are_each_gpus_own_search():
    from omegaconf import OmegaConf

    from neusight.cli.predict import PredictConfig, _ranking_searches
    from neusight.memory import find_max_batch, find_max_seq_len

    cfg = OmegaConf.merge(OmegaConf.structured(PredictConfig),
                          dict(model="gpt2", device="all", batch_size=2, seq_len=256, mode="training",
                               find_max_batch=True, find_max_seq_len=True))
    gpus = ["p4", "t4", "a100-80gb-pcie"]
    cols = _ranking_searches(cfg, neusight.predict_many("gpt2", gpus, 2, 256, "training", memory=False))
    assert set(cols) == {"max batch", "max seq_len"}
    for g in gpus:
        assert cols["max batch"][g] == find_max_batch("gpt2", g, seq_len=256, mode="training")
        assert cols["max seq_len"][g] == find_max_seq_len("gpt2", g, batch_size=2, mode="training")
    assert cols["max batch"]["p4"] < cols["max batch"]["t4"] < cols["max batch"]["a100-80gb-pcie"]   # 8, 16, 80 GB


def test_predict_lists_the_gpus_and_the_model_presets(tmp_path):
    from neusight import list_devices, list_models

    r = subprocess.run([str(BIN / "neusight-predict"), "device=list", "model=list", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    keys = list_devices()
    assert f"GPUs ({len(keys)}," in r.stdout
    assert [ln.split()[0] for ln in lines if ln.split() and ln.split()[0] in keys] == keys   # one row per GPU
    assert all(m in r.stdout for m in list_models())
    assert "forecast" not in r.stdout.lower() and "latency" not in r.stdout.lower()        # no forecast ran
    h100 = next(ln for ln in lines if ln.startswith("h100-sxm5-80gb "))
    assert "67.0" in h100.split() and "3350.0" in h100.split()                           # its spec-file numbers


def test_predict_pictures_layers_and_max_batch(tmp_path):
    """plot=, layers_csv= and find_max_batch=true write the pictures and the per-layer CSV and print the batch."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("neusight-predict")
    r = subprocess.run([str(exe), "model=resnet18", "device=t4", "batch_size=2", "mode=training", "optimizer=sgd",
                        "image_size=64", f"plot={tmp_path / 'pics'}", f"layers_csv={tmp_path / 'layers.csv'}",
                        "find_max_batch=true", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    pngs = sorted(p.name for p in (tmp_path / "pics").glob("*.png"))
    assert pngs == ["t4_layers.png", "t4_memory_timeline.png", "t4_roofline.png", "t4_time_roofline.png"]
    assert (tmp_path / "layers.csv").read_text().startswith("layer,") or "time_ms" in (tmp_path / "layers.csv").read_text()
    assert "largest batch that fits on NVIDIA T4" in r.stdout


def test_predict_on_several_gpus_prints_the_parts_and_writes_json(tmp_path):
    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=h100-sxm5-80gb", "batch_size=4",
                        "seq_len=64", "mode=training", "optimizer=null", "dp=2", "pp=2", "microbatches=2",
                        "json=parallel.json", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "on 4 x NVIDIA H100 SXM5 80GB (dp 2, tp 1, pp 2" in r.stdout and "pp_bubble" in r.stdout
    (rec,) = json.loads((tmp_path / "run" / "parallel.json").read_text())
    assert rec["gpus"] == 4 and rec["latency_ms"] > rec["compute_ms"] > 0 and rec["memory_fits"] is True


def test_largest_batch_on_data_and_tensor_parallel_gpus(tmp_path):
    """find_max_batch=true with dp and tp: the search runs on one GPU's shard, the global batch is dp times its."""
    from neusight.memory import find_max_batch

    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=p4", "batch_size=4", "seq_len=256",
                        "mode=training", "dp=2", "tp=2", "find_max_batch=true", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    per_replica = find_max_batch("gpt2", "p4", seq_len=256, mode="training", tensor_parallel=2)
    whole = find_max_batch("gpt2", "p4", seq_len=256, mode="training")
    assert per_replica > whole >= 1                  # half of every layer's weights, state and activations per GPU
    assert (f"largest global batch that fits on 4 x NVIDIA Tesla P4 (dp 2, tp 2): {2 * per_replica} "
            f"({per_replica} per replica)") in r.stdout


def test_predict_a_megatron_step_from_the_command_line(tmp_path):
    """megatron=true forecasts Megatron-LM's train_step: its AdamW is the fused kernel, its step is timed."""
    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=a100-sxm4-40gb", "batch_size=4",
                        "seq_len=64", "mode=training", "dp=2", "megatron=true", "memory=false", "json=meg.json",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Megatron-LM kernels" in r.stdout
    (rec,) = json.loads((tmp_path / "run" / "meg.json").read_text())
    assert rec["gpus"] == 2 and rec["optimizer_ms"] > 0 and rec["dp_allreduce_ms"] > 0


def test_predict_what_if_spec_changes_the_gpu_it_forecasts(tmp_path):
    """+spec.<field>=<value> forecasts the GPU with that spec number changed, named as such, the same as a spec
    file with the changed number would (here: T4 with twice its memory bandwidth)."""
    import yaml

    from neusight.devices import load_device

    spec = load_device("t4").to_dict()
    spec.update(mem_bandwidth_gbps=640.0, aliases=[])
    spec.pop("key")
    (tmp_path / "t4-fast.yaml").write_text(yaml.safe_dump(spec))
    runs = {}
    for name, dev in (("what-if", ["device=t4", "+spec.mem_bandwidth_gbps=640"]), ("file", ["device=t4-fast.yaml"])):
        r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", *dev, "batch_size=1", "seq_len=32",
                            "memory=false", "json=out.json", f"hydra.run.dir={tmp_path / name}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads((tmp_path / name / "out.json").read_text())
    assert runs["what-if"]["device"] == "t4+mem_bandwidth_gbps=640"
    assert "what-if: mem_bandwidth_gbps 320 -> 640" in runs["what-if"]["device_name"]
    assert runs["what-if"]["latency_ms"] == pytest.approx(runs["file"]["latency_ms"], rel=1e-12)


def test_run_time_counts_steps_hours_and_gpu_hours():
    from neusight.api import run_time
    from neusight.errors import InputError

    run = run_time(1000.0, 8, 1024, gpus=4, total_tokens=8192 * 3600 + 1)    # one token past 3,600 steps
    assert run == {"steps": 3601.0, "hours": pytest.approx(3601 / 3600), "gpu_hours": pytest.approx(4 * 3601 / 3600)}
    assert run_time(50.0, 256, None, total_samples=1.28e6)["steps"] == 5000
    for bad in (dict(), dict(total_tokens=1e6, total_samples=1e3), dict(total_samples=-5), dict(total_tokens=1e6)):
        with pytest.raises(InputError):
            run_time(10.0, 4, None, **bad)
    priced = run_time(1000.0, 8, 1024, gpus=4, total_tokens=8192 * 3600, usd_per_gpu_hour=2.0)
    assert priced["usd"] == pytest.approx(2.0 * 4)                         # 4 GPU-hours at $2
    with pytest.raises(InputError, match="usd_per_gpu_hour=0"):
        run_time(1000.0, 8, 1024, total_tokens=1e6, usd_per_gpu_hour=0)


def test_unit_cost_scales_with_price_and_gpus_and_inversely_with_throughput():
    from neusight.api import unit_cost
    from neusight.errors import InputError

    usd, per = unit_cost(2000.0, "images/s", 1.0)
    assert per == "1M images" and usd == pytest.approx(1e6 / 2000 / 3600)
    assert unit_cost(2000.0, "images/s", 3.0, gpus=8)[0] == pytest.approx(24 * usd)
    assert unit_cost(4000.0, "images/s", 1.0)[0] == pytest.approx(usd / 2)
    assert unit_cost(10.0, "generated tokens/s", 1.0)[1] == "1M generated tokens"
    for bad in (-1.0, 0, float("inf"), "2", True):
        with pytest.raises(InputError, match="usd_per_gpu_hour"):
            unit_cost(10.0, "tokens/s", bad)


def test_anchored_forecast_scales_a_measurement_by_the_forecast_speed_up():
    import neusight
    from neusight.api import anchored_ms, predict_graph
    from neusight.errors import InputError

    g = neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training")
    t4, v100 = predict_graph(g, "t4"), predict_graph(g, "v100-pcie-32gb")
    assert anchored_ms(v100, t4, 100.0) == pytest.approx(100.0 * v100.latency_ms / t4.latency_ms)
    assert anchored_ms(t4, t4, 37.5) == pytest.approx(37.5)
    other = predict_graph(neusight.trace("gpt2", batch_size=4, seq_len=64, mode="training"), "t4")
    with pytest.raises(InputError, match="batch_size"):
        anchored_ms(v100, other, 100.0)
    with pytest.raises(InputError, match="anchor_ms"):
        anchored_ms(v100, t4, 0)


_OWN_MODEL = """
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.gru, self.out = nn.Embedding(500, 32), nn.GRU(32, 64, batch_first=True), nn.Linear(64, 5)

    def forward(self, ids):
        return self.out(self.gru(self.emb(ids))[0])


def wide_mlp():
    return nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 4))
"""


def test_own_module_from_the_command_line(tmp_path):
    """model=<module>:<class or factory> imports the user's own code from the working directory."""
    (tmp_path / "my_models.py").write_text(_OWN_MODEL)
    tagger = _start("neusight-predict", "model=my_models:Tagger", "device=t4", "batch_size=4", "seq_len=16",
                    "mode=training", "input_shapes=[[[seq],long]]", f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path)
    mlp = _start("neusight-trace", "model=my_models:wide_mlp", "batch_size=8", "input_shapes=[[16]]",
                 f"hydra.run.dir={tmp_path / 'b'}", cwd=tmp_path)
    out, err = tagger.communicate(timeout=300)
    assert tagger.returncode == 0, err
    assert "Tagger: training" in out and "Tagger with inputs (batch, seq) int64" in out
    out, err = mlp.communicate(timeout=300)
    assert mlp.returncode == 0, err
    assert "Sequential: inference, batch 8" in out


def test_generation_with_find_max_batch_searches_each_gpus_serving_capacity(tmp_path):
    """new_tokens with find_max_batch=true and max_tpot_ms: after each GPU's forecast, its serving capacity (the
    largest batch whose generate() fits and meets the target), with its cost when priced, and in the JSON."""
    from neusight.serving import serving_capacity

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**_TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512}))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=[t4,l4]", "batch_size=2",
                        "seq_len=64", "new_tokens=8", "find_max_batch=true", "max_tpot_ms=1", "gpu_hour_usd=[0.5,0.8]",
                        "json=serve.json", f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    data = {d["device"]: d for d in json.loads((tmp_path / "serve.json").read_text())}
    for key in ("t4", "l4"):
        cap = serving_capacity(str(cfg), key, 64, 8, max_tpot_ms=1.0)
        assert data[key]["serving"]["max_batch"] == cap.batch_size > 0
        assert data[key]["serving"]["limited_by"] == "time per output token"
        assert data[key]["serving"]["generated_tokens_per_s"] == pytest.approx(cap.tokens_per_s)
        assert f"serving capacity of {cap.model} on {cap.device.name}" in r.stdout
        assert f"most concurrent sequences: {cap.batch_size} (limited by time per output token" in r.stdout
    assert r.stdout.count("per 1M generated tokens at $") == 4     # the forecast's cost and the capacity's, per GPU


def test_continuous_batching_from_the_command_line(tmp_path):
    """new_tokens with batching=continuous: each GPU's engine at batch_size sequences at once
    (neusight.engine.predict_continuous, compiled, SDPA attention), then its capacity within max_tpot_ms, in the
    JSON too."""
    from neusight.engine import predict_continuous
    from neusight.serving import serving_capacity

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**_TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512}))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=[t4,l4]", "batch_size=4",
                        "seq_len=64", "new_tokens=8", "batching=continuous", "max_num_batched_tokens=256",
                        "find_max_batch=true", "max_tpot_ms=0.5", "json=engine.json", "plot=curve",
                        f"hydra.run.dir={tmp_path}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    data = {d["device"]: d for d in json.loads((tmp_path / "engine.json").read_text())}
    for key in ("t4", "l4"):
        f = predict_continuous(str(cfg), key, 4, 64, 8, max_num_batched_tokens=256)
        assert data[key]["time_per_output_token_ms"] == pytest.approx(f.step_ms)
        assert data[key]["generated_tokens_per_s"] == pytest.approx(f.tokens_per_s)
        assert data[key]["step_tokens"] == f.step_tokens == 4 + math.ceil(4 * 64 / 7)
        assert data[key]["step_mbu_pct"] == pytest.approx(100 * f.efficiency.mbu)
        cap = serving_capacity(str(cfg), key, 64, 8, max_tpot_ms=0.5, batching="continuous",
                               max_num_batched_tokens=256)
        assert data[key]["serving"]["max_batch"] == cap.batch_size > 0
        assert data[key]["serving"]["batching"] == "continuous"
        assert data[key]["serving"]["limited_by"] == cap.limited_by
        assert "continuous batching, 4 sequences at once" in r.stdout
    assert r.stdout.count("continuous batching (steady state, max_num_batched_tokens=256)") == 2
    # plot=: the throughput-latency curve, 1, 2, 4, ... sequences up to the 25 the 256-token budget keeps running
    curve = pd.read_csv(tmp_path / "curve" / "serving_curve.csv")
    assert list(curve["sequences"]) == [1, 2, 4, 8, 16, 25] * 2 and list(curve["GPU"][:1]) == ["t4"]
    assert (tmp_path / "curve" / "serving_curve.png").stat().st_size > 0
    assert "throughput against latency" in r.stdout


def test_a_serving_plan_from_the_command_line(tmp_path):
    """gpus=N with new_tokens and find_max_batch=true: every dp x tp layout at its replicas' largest batch within
    the targets, ranked by tokens/s (neusight.serving.plan_serving), as JSON too; the batch_size given is not used."""
    from neusight.serving import plan_serving

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**_TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512}))
    r = subprocess.run([str(BIN / "neusight-predict"), f"model={cfg}", "device=l4", "gpus=2", "batch_size=3",
                        "seq_len=64", "new_tokens=8", "find_max_batch=true", "max_tpot_ms=1", "json=plan.json",
                        f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    plan = plan_serving(str(cfg), "l4", 2, 64, 8, max_tpot_ms=1.0)
    data = json.loads((tmp_path / "plan.json").read_text())
    assert len(data) == 1 and data[0]["best"]["layout"] == plan.best["layout"] and data[0]["batching"] == "static"
    assert [d["sequences"] for d in data[0]["layouts"]] == list(plan.table["sequences"])
    assert "serving capacity of 2 x NVIDIA L4" in r.stdout and f"best: {plan.best['layout']}:" in r.stdout


class _Terminal:
    """A stand-in for a terminal's stderr: what is written, kept."""

    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_searches_over_several_gpus_show_their_progress_on_a_terminal_only(monkeypatch, tty):
    from neusight.cli.common import each_gpu

    gpus = [neusight.load_device(k) for k in ("t4", "l4", "a100-80gb-pcie")]
    err = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", err)
    assert list(each_gpu(gpus, "serving searches")) == gpus          # every GPU, in order
    if tty:   # the bar names the search and the GPUs under way, and is cleared at the end (leave=False)
        assert "serving searches" in err.text and "a100-80gb-pcie" in err.text and "/3 [" in err.text
        assert err.text.rstrip("\r").split("\r")[-1].strip() == ""      # its last line: blanks over the bar
    else:     # piped or captured: nothing
        assert err.text == ""
    err.text = ""
    monkeypatch.setattr(sys, "stderr", _Terminal(True))
    assert list(each_gpu(gpus, "x", enabled=False)) == gpus and sys.stderr.text == ""      # progress=false
    assert list(each_gpu(gpus[:1], "x")) == gpus[:1] and sys.stderr.text == ""              # one GPU: no bar


def test_predict_many_hands_its_gpus_to_a_progress_wrapper():
    from neusight.api import predict_many

    seen = []

    def spy(gpus):
        seen.append([d.key for d in gpus])
        return iter(gpus)

    kw = dict(batch_size=1, seq_len=32, memory=False)
    ps = predict_many("gpt2", ["t4", "l4"], progress=spy, **kw)
    assert seen == [["t4", "l4"]] and [p.device.key for p in ps] == ["t4", "l4"]
    assert [p.latency_ms for p in ps] == [p.latency_ms for p in predict_many("gpt2", ["t4", "l4"], **kw)]


def test_layers_csv_of_a_compiled_step_counts_what_the_compiled_backward_keeps(tmp_path):
    """layers_csv='s saved_bytes under fused=true are the compiled run's (the min-cut's), not eager's."""
    from neusight.memory import saved_activations

    run = dict(batch_size=2, seq_len=64, mode="training")
    r = subprocess.run([str(BIN / "neusight-predict"), "model=gpt2", "device=t4", "batch_size=2", "seq_len=64",
                        "mode=training", "fused=true", f"layers_csv={tmp_path / 'layers.csv'}",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    csv = pd.read_csv(tmp_path / "layers.csv")
    g = neusight.trace("gpt2", **run)
    fused, eager = (int(saved_activations(g, fused=f, device="t4").sum()) for f in (True, False))
    assert int(csv["saved_bytes"].sum()) == fused < eager
    # the embedding dropout's kernels fuse into the first block's: its saved mask and output keep a row of their own
    drop = csv.set_index("layer").loc["transformer.drop"]
    assert drop["kernels"] == 0 and drop["time_ms"] == 0 and drop["saved_bytes"] > 0


def test_help_says_what_every_option_does_and_its_default():
    """`--help` lists every option of the command's config with the comment written beside (or above) it in the
    source and the composed default (conf/*.yaml over the dataclass); Hydra's own help printed the config alone."""
    from neusight.cli.common import options_help
    from neusight.cli.predict import ABOUT, PredictConfig
    from neusight.cli.train import TrainConfig

    text = options_help("neusight-predict", "predict", PredictConfig, ABOUT)
    flat = " ".join(text.split())
    for f in dataclasses.fields(PredictConfig):
        assert re.search(rf"^  {f.name}\b", text, re.M), f.name
    assert "model preset, HF config JSON path, or pkg.module:Class (an nn.Module) (default: gpt2-large)" in flat
    # a comment that runs on over several lines, joined
    assert ("plan: forecast every dp x tp x pp layout of this many GPUs (with the micro-batch counts, ep of MoE "
            "models, ZeRO stages, recompute), ranked;") in flat
    train = " ".join(options_help("neusight-train", "train", TrainConfig, None).split())
    assert "calibrate.dataset NeuSight dataset folder (labels/, models/)" in train      # a comment above its field
    assert re.search(r"predictor\.\* config group predictor/: hyper-parameters per family; \d+ settings", train)
    r = subprocess.run([str(BIN / "neusight-predict"), "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("usage: neusight-predict") and "== Config ==" not in r.stdout

"""Multi-GPU forecasts of one training step, several ways of splitting it. Writes docs/parallel.md.

    python scripts/parallel_examples.py            # ~9 min on 2 cores
    python scripts/parallel_examples.py --out /tmp/parallel.md

GPT-3 2.7B (seq 2048, global batch 16, AdamW, FP32) on 8 GPUs of two kinds, split by data, tensor and pipeline
parallelism (``neusight.predict_parallel``; data parallelism also with ZeRO stages 1-3), next to one GPU running the
same batch (each split with data parallelism also with its collectives overlapped with the compute),
and its tp=8 split with sequence parallelism and selective or full recompute; then Mixtral 8x7B (seq
2048, global batch 8, AdamW, BF16) on 8 80 GB GPUs, with and without expert parallelism, and planned on 8 H100s
(every layout, expert-parallel degree, micro-batch count, ZeRO stage and recompute where needed searched);
Llama-2-70B (seq 4096, global batch 64, BF16, checkpointing) on 64 GPUs in 8 nodes; Llama-3.1-8B at 131,072 tokens
(global batch 2, BF16) on 8 GPUs split by context and tensor parallelism; and a plan
(``neusight.plan_parallel``: every layout searched) of GPT-2 Large (seq 1024, global batch 32) on 1-8 A100 80GB PCIe
boards (NVLink bridges join pairs) and H100 SXMs, as a scaling table; and a serving plan
(``neusight.plan_generation``) of Llama-3-70B generating for 16 concurrent sequences on 8 of either GPU; and ResNet-50
(global batch 256, SGD) on 8 GPUs as PyTorch DDP trains it (its gradient buckets overlapped). These are
forecasts no measurement could check (no multi-GPU labels were available): they show what the composition does, not
how accurate it is.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from neusight.cli.common import quiet_third_party_logs
from neusight.e2e_eval import markdown_table
from neusight.parallel import GPUS_PER_NODE, predict_parallel
from neusight.plan import plan_generation, plan_max_seq_len, plan_parallel, recompute_label, scaling_table
from neusight.util import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
MODEL, SEQ, BATCH = "gpt3-2.7b", 2048, 16
GPUS = ("a100-sxm4-40gb", "h100-sxm5-80gb")
SPLITS = [dict(), dict(dp=8), dict(dp=8, zero=1), dict(dp=8, zero=2), dict(dp=8, zero=3), dict(tp=8),
          dict(pp=8, microbatches=16), dict(dp=2, tp=4), dict(dp=2, tp=2, pp=2, microbatches=4)]
# the tp=8 split again: Megatron-LM's sequence parallelism and selective recompute against none and full recompute
SP_RUNS = [(False, False), (True, False), (False, "selective"), (True, "selective"), (False, True)]
MOE, MOE_SEQ, MOE_BATCH = "mixtral-8x7b", 2048, 8
MOE_GPUS = ("a100-sxm4-80gb", "h100-sxm5-80gb")
MOE_SPLITS = [dict(dp=8), dict(dp=8, ep=2), dict(dp=8, ep=8), dict(tp=8), dict(dp=2, tp=4), dict(dp=4, ep=4, tp=2)]
MOE_PLAN_GPU = "h100-sxm5-80gb"
# several nodes of 8 GPUs (gpus_per_node), 100 GB/s network per GPU (internode_gbps)
BIG, BIG_SEQ, BIG_BATCH = "llama-2-70b", 4096, 64
BIG_GPUS = ("h100-sxm5-80gb",)
BIG_SPLITS = [dict(dp=64, zero=3), dict(dp=8, tp=8, zero=1), dict(dp=2, tp=8, pp=4, microbatches=16),
              dict(dp=4, tp=4, pp=4, microbatches=16)]
# a plan per GPU count: every layout, micro-batch count, ZeRO stage (and recompute where needed) searched
PLAN, PLAN_SEQ, PLAN_BATCH, PLAN_COUNTS = "gpt2-large", 1024, 32, (1, 2, 4, 8)
PLAN_GPUS = ("a100-80gb-pcie", "h100-sxm5-80gb")
# serving: every dp x tp layout of 8 GPUs generating for SERVE_BATCH concurrent sequences
SERVE, SERVE_BATCH, SERVE_PROMPT, SERVE_NEW = "llama-3-70b", 16, 512, 128
SERVE_KW = dict(dtype="bfloat16", attn_implementation="sdpa", static_cache=True)
# long context: each sequence split over cp GPUs (context parallelism) against data and tensor parallelism
LONG, LONG_SEQ, LONG_BATCH = "llama-3.1-8b", 131072, 2
LONG_GPUS = ("a100-sxm4-80gb", "h100-sxm5-80gb")
LONG_SPLITS = [dict(dp=2, cp=4, zero=1), dict(dp=2, cp=4, zero=1, cp_comm="all_gather"),
               dict(dp=2, cp=4, zero=1, cp_comm="a2a"), dict(cp=8, zero=1), dict(cp=8, zero=1, cp_comm="a2a"),
               dict(dp=2, cp=2, tp=2, sp=True, zero=1), dict(dp=2, tp=4, sp=True, zero=1), dict(tp=8, sp=True)]
LONG_KW = dict(dtype="bfloat16", attn_implementation="flash_attention_2", gradient_checkpointing=True)
# a CNN as PyTorch DDP trains it: data parallelism, its gradient buckets' all-reduce beside the backward pass
CNN, CNN_BATCH, CNN_GPUS = "resnet50", 256, ("a100-80gb-pcie", "h100-sxm5-80gb")


def _table(model: str, gpus: tuple[str, ...], splits: list[dict], batch: int, seq: int | None, overlap: bool = False,
           optimizer: str = "adamw", **kw) -> pd.DataFrame:
    """One row per GPU and split; ``overlap``: three more columns, the step with the data-parallel collectives
    overlapped with the compute (``overlap_grad_reduce=true`` on the splits with dp > 1, ``overlap_param_gather=true``
    on those with ZeRO) and what of the gradients' reduction and the parameters' gathers stays exposed."""
    rows = []
    for gpu in gpus:
        cache: dict = {}     # the overlapped forecast reuses the split's trace and single-GPU forecast
        for split in splits:
            p = predict_parallel(model, gpu, batch, seq, "training", optimizer=optimizer, cache=cache, **split, **kw)
            over = (predict_parallel(model, gpu, batch, seq, "training", optimizer=optimizer, cache=cache,
                                     overlap_grad_reduce=True, overlap_param_gather=bool(split.get("zero")),
                                     **split, **kw)
                    if overlap and p.parallelism.dp > 1 else None)
            par = p.parallelism
            rows.append({"gpu": gpu, "dp x tp x pp (micro-batches)": f"{par.dp} x {par.tp} x {par.pp} ({par.microbatches})",
                         "CP": par.cp, "CP comm": par.cp_comm if par.cp > 1 else "-", "SP": "yes" if par.sp else "no",
                         "EP": par.ep,
                         "ZeRO": split.get("zero", 0),
                         "GPUs": par.gpus, "nodes": -(-par.gpus // GPUS_PER_NODE), "step ms": p.latency_ms,
                         **{f"{k} ms": v for k, v in p.parts.items()},
                         "GiB per GPU": p.memory_peak_bytes / 2**30, "fits": "yes" if p.memory_fits else "no",
                         **({"step ms, overlapped": over.latency_ms if over else p.latency_ms,
                             "dp_allreduce ms exposed": over.parts["dp_allreduce"] if over else 0.0,
                             "dp_gather ms exposed": over.parts["dp_gather"] if over else 0.0}
                            if overlap else {})})
    table = pd.DataFrame(rows)
    shown = {"cp_comm ms"} if (table["CP"] > 1).any() else set()     # zero or not, where context parallelism runs
    unused = [c for c in table.columns if c.endswith(" ms") and not c.startswith("step ms") and not table[c].any()
              and c not in shown]
    plain = [c for c, v in (("CP", 1), ("CP comm", "-"), ("SP", "no"), ("EP", 1), ("ZeRO", 0), ("nodes", 1))
             if (table[c] == v).all()]
    return table.drop(columns=unused + plain)


def _memory_savers() -> pd.DataFrame:
    """GPT-3 2.7B as tp=8 on each GPU of GPUS with and without sequence parallelism and activation recompute."""
    rows = []
    for gpu in GPUS:
        for sp, ckpt in SP_RUNS:
            p = predict_parallel(MODEL, gpu, BATCH, SEQ, "training", optimizer="adamw", tp=8, sp=sp,
                                 gradient_checkpointing=ckpt)
            rows.append({"gpu": gpu, "sp": "yes" if sp else "no", "recompute": recompute_label(ckpt),
                         "step ms": p.latency_ms, "compute ms": p.parts["compute"], "tp_comm ms": p.parts["tp_comm"],
                         "activations GiB": p.memory_breakdown["activations"] / 2**30,
                         "GiB per GPU": p.memory_peak_bytes / 2**30, "fits": "yes" if p.memory_fits else "no"})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "parallel.md")
    args = ap.parse_args()
    quiet_third_party_logs()
    t0 = time.time()
    dense = _table(MODEL, GPUS, SPLITS, BATCH, SEQ, overlap=True)
    savers = _memory_savers()
    moe = _table(MOE, MOE_GPUS, MOE_SPLITS, MOE_BATCH, MOE_SEQ, dtype="bfloat16")
    moe_plan = plan_parallel(MOE, MOE_PLAN_GPU, 8, MOE_BATCH, MOE_SEQ, dtype="bfloat16")
    moe_best = moe_plan.table.drop(columns=["layout", "time vs best"])
    unused = (("ep", 1), ("vpp", 1), ("cp", 1), ("cp comm", "-"), ("sp", "no"))
    moe_best = moe_best.drop(columns=[c for c, off in unused if (moe_best[c] == off).all()])   # as the summary
    big = _table(BIG, BIG_GPUS, BIG_SPLITS, BIG_BATCH, BIG_SEQ, overlap=True, dtype="bfloat16",
                 gradient_checkpointing=True)
    cnn = _table(CNN, CNN_GPUS, [dict(), dict(dp=8)], CNN_BATCH, None, overlap=True, optimizer="sgd")
    long = _table(LONG, LONG_GPUS, LONG_SPLITS, LONG_BATCH, LONG_SEQ, **LONG_KW)
    long_plan = plan_parallel(LONG, LONG_GPUS[-1], 8, LONG_BATCH, LONG_SEQ, cp="auto", cp_comm="auto", sp=True,
                              **LONG_KW)
    long_best = long_plan.table.drop(columns=["layout", "time vs best", "ep", "vpp"])
    longest = plan_max_seq_len(LONG, LONG_GPUS[-1], 8, LONG_BATCH, cp="auto", sp=True,
                               **{k: v for k, v in LONG_KW.items() if k != "gradient_checkpointing"})
    longest_table = longest.table.drop(columns=["layout", "ep", "vpp"])
    scaling = pd.concat([scaling_table([plan_parallel(PLAN, gpu, n, PLAN_BATCH, PLAN_SEQ) for n in PLAN_COUNTS])
                         .assign(gpu=gpu) for gpu in PLAN_GPUS])
    scaling = scaling[["gpu", *[c for c in scaling.columns if c != "gpu"]]]
    serving = pd.concat([plan_generation(SERVE, gpu, 8, SERVE_BATCH, SERVE_PROMPT, SERVE_NEW, **SERVE_KW).table
                         .drop(columns=["layout"]).assign(gpu=gpu) for gpu in PLAN_GPUS])
    serving = serving[["gpu", *[c for c in serving.columns if c != "gpu"]]]
    serving["time vs best"] = serving["time vs best"].map("{:.2f}".format)
    scaling[["speed-up", "efficiency"]] = scaling[["speed-up", "efficiency"]].map("{:.2f}".format)
    text = "\n".join([
        "# Multi-GPU forecasts (unvalidated)", "",
        f"Generated by `python scripts/parallel_examples.py` in {time.time() - t0:.0f} s; regenerate it, do not edit it. "
        f"{MODEL}, sequence {SEQ}, global batch {BATCH}, one AdamW training step in FP32 (eager kernels), with the "
        "shipped predictor. How the step is composed: `neusight/parallel.py`. No multi-GPU measurement was available, "
        "so these numbers are forecasts that nothing here has checked; the single-GPU parts are the same forecasts "
        "as everywhere else. The last three columns: the same step with the data-parallel collectives overlapped "
        "with the compute as PyTorch DDP / FSDP and Megatron-LM's `--overlap-grad-reduce` / "
        "`--overlap-param-gather` run them: the gradients' reduction with the backward pass "
        "(`overlap_grad_reduce=true`; plain data parallelism by PyTorch DDP's buckets, the other splits block by "
        "block) and, with ZeRO, the parameters' "
        "gathers with the compute (`overlap_param_gather=true`: FSDP prefetches the next block's, ZeRO 1 / 2 gather "
        "during the next forward pass); and what of each is left exposed (the other columns: nothing overlapped, "
        "Megatron-LM's default).", "",
        markdown_table(dense, index=False), "",
        "## Sequence parallelism and selective recompute", "",
        f"The tp=8 split of {MODEL} again, with Megatron-LM's sequence parallelism (`sp=true`: the blocks' layer "
        "norms, dropouts and residual adds on 1/8 of the tokens per GPU, their saved activations 1/8 as large) and "
        "activation recompute: selective (`gradient_checkpointing=selective`: the attention cores run again in the "
        "backward pass, the s x s scores are not kept) and full (`gradient_checkpointing=true`: every layer's "
        "forward again). Korthikanti et al. (2022) describe both; the forecast charges the recomputed kernels and "
        "no cost for sequence parallelism beyond the split kernels (the collectives keep their volume).", "",
        markdown_table(savers, index=False), "",
        f"## Mixture of experts: {MOE}", "",
        f"{MOE}, sequence {MOE_SEQ}, global batch {MOE_BATCH}, one AdamW training step in BF16 (routed experts as "
        "transformers runs them on the GPU, balanced routing). EP = expert parallelism: groups of EP data-parallel "
        "replicas share the experts, 1/EP each, and exchange token rows by all-to-all (ep_alltoall). Columns that are "
        "zero in every row are left out.", "",
        markdown_table(moe, index=False), "",
        f"Planned (`neusight.plan_parallel`, `neusight-predict model={MOE} device={MOE_PLAN_GPU} gpus=8 "
        f"batch_size={MOE_BATCH} seq_len={MOE_SEQ} mode=training dtype=bfloat16`): every dp x tp x pp layout of 8 "
        f"{MOE_PLAN_GPU} with the expert-parallel degrees that divide its dp and the 8 experts, its micro-batch "
        "counts, ZeRO stages and activation recompute where nothing fits without it; "
        f"{len(moe_plan.candidates)} candidates in {moe_plan.seconds:.0f} s, each layout's fastest that fits in "
        "memory (else its smallest), the layouts that fit first. No fixed split above fits in 80 GB; the plan "
        "finds which do.", "",
        markdown_table(moe_best, index=False), "",
        f"## Several nodes: {BIG} on 64 GPUs", "",
        f"{BIG}, sequence {BIG_SEQ}, global batch {BIG_BATCH}, one AdamW training step in BF16 with gradient "
        "checkpointing, on 8 nodes of 8 GPUs: ranks ordered as Megatron-LM orders them (tensor-parallel innermost, "
        "pipeline stages outermost), groups that span nodes over their GPUs' network links (100 GB/s each, "
        "`internode_gbps`; a ring's or tree's channels spread over the links of the group's GPUs on a node, so "
        "FSDP's group of 8 per node crosses at 800 GB/s, dp=8 x tp=8's data-parallel group of one per node at 100), "
        "the others over NVLink. Last three columns as in the first table: the data-parallel collectives overlapped "
        "with the compute.", "",
        markdown_table(big, index=False), "",
        f"## Long context: {LONG} at {LONG_SEQ:,} tokens on 8 GPUs", "",
        f"{LONG}, sequence {LONG_SEQ:,}, global batch {LONG_BATCH}, one AdamW training step in BF16 with flash-attn 2 "
        "and full activation recompute, on 8 GPUs: the two sequences split by context parallelism (CP: each "
        "sequence over CP GPUs, `cp=`), by tensor parallelism with sequence parallelism (SP), or both; ZeRO 1 over "
        "the GPUs holding the same weights (dp x cp). CP comm (`cp_comm=`): p2p, Transformer Engine's ring as "
        "Megatron-LM runs it by default (causal load balance; each step's keys and values exchanged beside the "
        "step before, and its partial results merged by elementwise kernels); all_gather, the keys and values "
        "gathered first (Llama 3's way, Megatron-LM's `--cp-comm-type all_gather`); a2a, DeepSpeed Ulysses' "
        "all-to-alls, each GPU 1/CP of the heads over the whole sequence. cp_comm: what of the exchanges is "
        "exposed. At this length every ring step's attention kernel outlasts its exchange, so the ring's cp_comm "
        "is zero and its price is its smaller kernels and those merging each step's partial results; tensor "
        "parallelism's is its all-reduces.", "",
        markdown_table(long, index=False), "",
        f"Planned with the context-parallel degree and exchange searched (`neusight-predict model={LONG} "
        f"device={LONG_GPUS[-1]} gpus=8 cp=auto cp_comm=auto sp=true batch_size={LONG_BATCH} seq_len={LONG_SEQ} "
        "mode=training dtype=bfloat16 attn_implementation=flash_attention_2 gradient_checkpointing=true`): every "
        "dp x tp x pp layout of 8 / CP GPUs for CP = 1, 2, 4 and 8, each with CP > 1 by each exchange it can run "
        "(Ulysses' a2a only where CP divides the 8 key / value heads left on each GPU by tp), sequence parallelism "
        f"wherever tp > 1, with their micro-batch counts and ZeRO stages; {len(long_plan.candidates)} candidates in "
        f"{long_plan.seconds:.0f} s, each layout's fastest that fits (else its smallest in memory), the layouts "
        "that fit first.", "",
        markdown_table(long_best, index=False), "",
        f"The longest sequence each layout of the 8 GPUs holds (`neusight.plan_max_seq_len`, `neusight-predict "
        f"model={LONG} device={LONG_GPUS[-1]} gpus=8 cp=auto sp=true batch_size={LONG_BATCH} mode=training "
        "dtype=bfloat16 attn_implementation=flash_attention_2 find_max_seq_len=true`): each layout with what holds "
        "the most (one sequence per micro-batch, full activation recompute, ZeRO 3 where dp x cp > 1 without "
        "pipeline stages; the ring's exchange where CP > 1), searched in multiples of 64 tokens per GPU up to the "
        f"model's {longest.max_positions:,} positions, against the same memory forecast as the plans' fits; ms: a "
        f"step at that length. {longest.forecasts} forecasts in {longest.seconds:.0f} s. Every layout that splits "
        "each sequence (CP or TP) holds the model's whole context; the two that split neither, pipelines without "
        "ZeRO, end sooner.", "",
        markdown_table(longest_table, index=False), "",
        f"## A CNN as PyTorch DDP trains it: {CNN} on 8 GPUs", "",
        f"{CNN}, global batch {CNN_BATCH} (224 x 224 images), one SGD training step (FP32 model, convolutions on "
        "TF32 tensor cores as PyTorch runs them by default on these GPUs), on one GPU and as dp=8. Last three "
        "columns: the gradients' all-reduce beside the backward pass as PyTorch DDP runs it "
        "(`overlap_grad_reduce=true`): buckets of 25 MiB (the first 1 MiB) in the order the gradients are ready. "
        "DDP's two elementwise kernels per parameter (each gradient divided into its bucket, and copied back) are "
        "not charged, as no framework's per-parameter kernels are (the forecast's note gives their time). The A100 "
        "80GB PCIe boards' NVLink bridges join pairs, so the 8-GPU all-reduce runs over PCIe there.", "",
        markdown_table(cnn, index=False), "",
        f"## Planning: {PLAN} on 1-{max(PLAN_COUNTS)} GPUs", "",
        f"{PLAN}, sequence {PLAN_SEQ}, global batch {PLAN_BATCH}, one AdamW training step in FP32, planned with "
        "`neusight.plan_parallel` (`neusight-predict ... gpus=[1,2,4,8]`): for each GPU count every dp x tp x pp "
        "layout with its micro-batch counts and ZeRO stages (and activation recompute where nothing fits without it) "
        "is forecast; the row is the fastest that fits. Speed-up and efficiency against one GPU. The A100 80GB PCIe "
        "boards' NVLink bridges join pairs (`interconnect_group: 2`): a group of more GPUs runs over PCIe, which is "
        "why their best layouts keep tensor parallelism within a pair.", "",
        markdown_table(scaling, index=False), "",
        f"## Serving: {SERVE} on 8 GPUs", "",
        f"{SERVE} generating {SERVE_NEW} tokens after a {SERVE_PROMPT}-token prompt for {SERVE_BATCH} concurrent "
        "sequences in BF16 (PyTorch's SDPA, a static KV cache), planned with `neusight.plan_generation` "
        f"(`neusight-predict model={SERVE} device=[{','.join(PLAN_GPUS)}] gpus=8 batch_size={SERVE_BATCH} "
        f"seq_len={SERVE_PROMPT} new_tokens={SERVE_NEW} dtype=bfloat16 attn_implementation=sdpa "
        "static_cache=true`): dp replicas of the model, each split over tp GPUs and generating its share of the "
        "sequences; those that fit first, fastest first (the fastest generates the most tokens per second).", "",
        markdown_table(serving, index=False)])
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

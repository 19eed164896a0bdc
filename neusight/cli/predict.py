"""``neusight-predict model=gpt3-2.7b device=h100-sxm5-80gb batch_size=2 seq_len=2048 mode=training``: forecast
one inference pass or training step and print where the time goes.

- ``device=[a100-80gb-pcie,h100-sxm5-80gb]`` (a list) traces once, predicts on every GPU and prints them side
  by side (total, phases, speed-up vs the first). ``--multirun device=a100-80gb-pcie,h100-sxm5-80gb`` runs one
  job per GPU (any launcher) and :class:`CompareCallback` prints the same table over the jobs at the end.
- ``json=forecast.json csv=kernels.csv`` write the forecast and the kernel table (relative paths go into
  Hydra's run directory; written atomically).
- ``device=all`` forecasts every GPU of the spec library (shared traces) and prints them ranked, fastest first,
  with their memory fit (:func:`ranking_text`): one pass or step, or ``generate()`` with ``new_tokens=``; GPUs the
  run cannot be forecast on are listed apart with the reason.
- ``gpu_hour_usd=2.5`` (or ``[1.3,2.5]``, one per device) adds what the work costs at that price per GPU-hour:
  per 1M tokens (images or samples), and for a whole run (``total_tokens=`` / ``total_samples=``).
- A forecast (or ``generate()``, ``new_tokens=``) that does not fit in its GPU's memory is forecast again with the
  usual memory remedies until one fits (:mod:`neusight.remedies`; ``advise=false``: not); ``device=all
  advise=true`` ranks the GPUs a step or ``generate()`` fits on only with them below its ranking
  (:func:`remedies_ranking_text`; not by default there: a climb per GPU); a multi-GPU step that does not fit
  points to ``gpus=N`` instead.
- ``device=list`` / ``model=list`` print the GPU spec library / the model presets instead of a forecast.
- ``checkpoint=<dir>`` (or ``predictor=<dir>``) predicts with another predictor checkpoint; null = the
  shipped one. NB: ``conf/predictor/`` is the training hyper-parameter group of ``neusight-train``, so Hydra
  would read ``predictor=<dir>`` as a choice in that group; :func:`main` rewrites it to ``checkpoint=<dir>``
  before Hydra parses the command line.

The task function returns the total latency (ms) for sweepers (of the first GPU when ``device`` is a list).
"""

from __future__ import annotations

import dataclasses
import json as _json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import hydra
from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf

from neusight.cli.common import (CONF_DIR, catch_user_errors, exit_2_on_config_errors, help_if_asked,
                                 quiet_third_party_logs)

if TYPE_CHECKING:
    import pandas as pd

    from neusight.api import Prediction
    from neusight.devices import Device

log = logging.getLogger(__name__)

GIB = 2**30
SUMMARY_FILE = "prediction_summary.json"   # written by every job of a multirun, read by CompareCallback


@dataclass
class PredictConfig:
    model: str = MISSING                 # preset, HF config JSON path, or pkg.module:Class (an nn.Module)
    device: Any = MISSING                # key, alias, spec YAML path, a list of them (side by side), or all (ranked)
    batch_size: int = 1
    seq_len: Optional[int] = None        # sequence models only; default min(512, max positions)
    mode: str = "inference"              # inference | training
    head: Optional[str] = None           # causal-lm | sequence-classification | pretraining | masked-lm | seq2seq
    optimizer: Optional[str] = "adamw"   # adamw | adam | sgd | adamw-fused | adam-fused | null (training; null: no step)
    attn_implementation: str = "eager"   # eager | sdpa | flash_attention_2 | flash_attention_3
    fused: bool = False                  # forecast under torch.compile (fused memory-bound kernels, their memory)
    tf32: Any = None                     # FP32 on TF32 cores (Ampere+): null = convs (PyTorch), all|true, off|false
    host_us: Optional[float] = None      # host (CPU) time per kernel launch, us: the GPU waits for launches of
    #                                      short kernels (small batches, decode steps); null = not modelled
    dp: int = 1                          # data-parallel replicas (batch_size is the global batch)
    tp: int = 1                          # tensor-parallel GPUs per replica (Megatron-style split of each block)
    pp: int = 1                          # pipeline stages
    microbatches: int = 1                # micro-batches per replica (pipeline schedule / gradient accumulation)
    vpp: int = 1                         # interleaved model chunks per pipeline GPU (Megatron-LM's virtual stages)
    sp: bool = False                     # sequence parallelism in each tensor-parallel group (Megatron-LM; tp > 1)
    cp: Any = 1                          # context parallelism: each sequence split over cp GPUs, attention as a ring
    #                                      (Megatron-LM / Transformer Engine; seq_len a multiple of 2 cp; sdpa / flash);
    #                                      a plan (gpus=) searches cp=auto (every divisor) or a list, e.g. [1,2,4]
    cp_comm: Any = "p2p"                 # how: p2p (TE's ring) | all_gather (keys / values gathered) | a2a (Ulysses);
    #                                      a plan (gpus=) tries each with cp_comm=auto or a list
    overlap_grad_reduce: bool = False    # the dp gradients' all-reduce / reduce-scatter beside the backward pass,
    #                                      block by block (PyTorch DDP, FSDP, Megatron-LM --overlap-grad-reduce)
    overlap_param_gather: bool = False   # ZeRO's parameter all-gathers beside the compute (FSDP's prefetch; zero=1|2:
    #                                      during the next forward, Megatron-LM --overlap-param-gather)
    gpus: Any = None                     # plan: forecast every dp x tp x pp layout of this many GPUs (with the
    #                                      micro-batch counts, ep of MoE models, ZeRO stages, recompute), ranked;
    #                                      zero=1-3 / ep= / microbatches= keep one; a list ([8,16,32]): a plan
    #                                      per count and how the best of each scales; with new_tokens: the dp x tp
    #                                      layouts serving batch_size sequences, ranked
    megatron: bool = False               # a Megatron-LM train_step: its kernels, grad clipping, fused AdamW (adamw)
    zero: int = 0                        # ZeRO stage of the dp replicas: 1 optimizer state, 2 + gradients, 3 + weights (FSDP)
    ep: Optional[int] = None             # expert parallelism (MoE): groups of ep dp replicas share the experts, 1/ep
    #                                      each; null = 1 (with gpus=N: the degrees dividing dp and the experts tried)
    gpus_per_node: int = 8               # GPUs per node sharing NVLink; groups spanning nodes use the network
    internode_gbps: float = 100.0        # per-GPU network link between nodes, bidirectional GB/s (400 Gb/s IB = 100)
    nics_per_node: Optional[int] = None  # network ports per node, internode_gbps each, shared by its GPUs; null = one
    #                                      per GPU (DGX / HGX)
    nvls: bool = True                    # all-reduces as NCCL's NVLS / NVLS_TREE where the GPUs' NVSwitches have
    #                                      NVLink SHARP (HGX H100 / H200 / B200); false: as NCCL_NVLS_ENABLE=0
    image_size: Optional[int] = None     # vision models; null = the model's native resolution (224, EfficientNet-B4: 380)
    images: Optional[int] = None         # multimodal models (LLaVA, Gemma 3, PaliGemma, ...): images per sequence,
    #                                      encoded and put at image tokens among seq_len's positions; null = text only
    memory_format: str = "contiguous"    # CNNs' layout: contiguous (NCHW, PyTorch's default) | channels_last (NHWC)
    dtype: str = "float32"
    amp: Any = None                      # mixed precision (torch.autocast): float16 | bfloat16 | true; null = none
    fp8: Any = False                     # nn.Linear GEMMs in FP8 (Ada / Hopper / Blackwell / CDNA3): true = torchao-style
    #                                      dynamic scaling | static: a calibrated checkpoint's fixed input scales (serving)
    weight_quant: Optional[str] = None   # inference with int8 / int4 / mxfp4 weights (weight-only, dequantized in
    #                                      the GEMM; mxfp4 in a mixture of experts: its routed experts, as gpt-oss)
    #                                      | nvfp4 (weights and activations in FP4 on Blackwell's FP4 tensor cores)
    kv_cache: Optional[int] = None       # generation: tokens already in the KV cache (seq_len = new tokens per step)
    static_cache: bool = False           # generation: new tokens written in place (StaticCache, serving engines), not
    #                                      concatenated onto the whole cache every step (eager DynamicCache)
    kv_cache_dtype: Optional[str] = None  # generation with static_cache: the KV cache in fp8 (e4m3) | fp8_e5m2, as
    #                                      serving engines store it; null = the model's dtype
    gradient_checkpointing: Any = None   # training: layers recompute their forward in backward (HF); n: every n-th;
    #                                      selective: the attention cores only (Megatron-LM's selective recompute);
    #                                      null = off (with gpus=N: tried where a candidate does not fit without it)
    lora_rank: Optional[int] = None      # LoRA fine-tuning: adapters of this rank, base weights frozen
    lora_targets: Optional[List[str]] = None  # LoRA's target projections (null: the architecture's defaults)
    moe_kernels: str = "auto"            # routed MoE experts: auto (as transformers runs them on the GPU) | loop |
    #                                      grouped | per-expert (see neusight.trace)
    ssm_kernels: str = "fused"           # state-space / linear-attention layers: fused (mamba_ssm / causal_conv1d /
    #                                      fla kernels) | reference (transformers' PyTorch code; see neusight.trace)
    input_shapes: Optional[List[Any]] = None  # model=pkg.module:Class: its inputs without the batch, e.g. [[3,224,224]]
    #                                      or [[[seq],long]] (token ids of seq_len); see neusight.trace
    new_tokens: Optional[int] = None     # forecast generate(): a seq_len-token prompt, then new_tokens decode steps
    anchor_ms: Optional[float] = None    # a step time you measured on anchor_device: forecasts scaled to it
    anchor_device: Optional[str] = None  # the GPU anchor_ms was measured on
    total_tokens: Optional[float] = None  # a whole run: tokens to process (sequence models) -> steps and hours
    total_samples: Optional[float] = None  # a whole run: samples to process (e.g. 1.28e6, an ImageNet epoch)
    gpu_hour_usd: Any = None             # price of one GPU-hour in USD (one number, or one per device): the cost
    #                                      per 1M tokens (images, samples), and of a run with total_*
    checkpoint: Optional[str] = None     # predictor checkpoint directory; null = the shipped predictor
    memory: bool = True                  # also forecast the memory peak
    advise: Optional[bool] = None        # a run that does not fit: forecast it again with the usual memory remedies
    #                                      (sdpa, 16-bit, accumulation, recompute; generate(): static / FP8 cache);
    #                                      null: for named GPUs, not for device=all (true: ranks those that fit so)
    top: int = 10                        # rows of the kernel and layer tables (0: totals only)
    json: Optional[str] = None           # write the forecast as JSON (relative to Hydra's run directory)
    csv: Optional[str] = None            # write the kernel table as CSV (relative to Hydra's run directory)
    timeline: Optional[str] = None       # write the forecast as a Chrome / Perfetto trace (JSON), one per GPU
    layers_csv: Optional[str] = None     # write the per-layer report (time, share, bound, saved memory) as CSV
    plot: Optional[str] = None           # directory for the pictures (roofline, time roofline, memory, layers)
    find_max_batch: bool = False         # also search the largest batch that fits in each GPU's memory (with
    #                                      new_tokens: whose generate() fits and meets max_tpot_ms / max_ttft_ms)
    max_tpot_ms: Optional[float] = None  # new_tokens + find_max_batch: the most ms per output token (mean step)
    max_ttft_ms: Optional[float] = None  # new_tokens + find_max_batch: the most ms to the first token (prefill)
    batching: str = "static"             # new_tokens: static (one generate() call of batch_size sequences) |
    #                                      continuous (a serving engine's steady state, batch_size sequences
    #                                      decoding at once: vLLM / SGLang; compiled, sdpa unless named, in place)
    max_num_batched_tokens: Optional[int] = None  # continuous: a step's token budget (null = 8192, vLLM's)
    find_max_seq_len: bool = False       # also search the longest sequence (multiple of 64) that fits at batch_size
    #                                      (with gpus=N instead of a plan: each layout's longest, seq_len left out)
    progress: bool = True                # a progress bar on stderr (a terminal's) over the GPUs searched one by one
    spec: Dict[str, Any] = field(default_factory=dict)   # what-if: spec numbers changed on every GPU, e.g.
    #                                      +spec.mem_bandwidth_gbps=4800 (neusight.devices.modify_device)


ConfigStore.instance().store(name="predict_schema", node=PredictConfig)


# ---------------------------------------------------------------------------------------------------------
# grouping and formatting (pure functions of a Prediction)

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def layer_key(module: str, phase: str) -> str:
    """Collapse the index of repeated blocks so the same layer of every block adds up:
    ``transformer.h.12.mlp.c_fc`` -> ``transformer.h.*.mlp.c_fc``; ops outside any module go by phase."""
    if not module:
        return {"loss": "(loss)", "optimizer": "(optimizer step)"}.get(phase, "(model, outside modules)")
    return _INDEX.sub(".*", module)


def top_layers(p: Prediction, top: int = 10) -> pd.DataFrame:
    """Per collapsed module path: total ms over all phases, share, instances, memory-bound share."""
    k = p.kernels
    keys = [layer_key(m, ph) for m, ph in zip(k["module"].astype(str), k["phase"].astype(str))]
    g = k.assign(layer=keys, mem_ms=k["latency_ms"].where(k["bound"] == "memory", 0.0),
                 instances=k["module"].astype(str))
    out = g.groupby("layer").agg(ms=("latency_ms", "sum"), instances=("instances", "nunique"),
                                 kernels=("latency_ms", "size"), mem_ms=("mem_ms", "sum"))
    out["share_pct"] = 100 * out["ms"] / max(p.latency_ms, 1e-12)
    out["memory_bound_pct"] = 100 * out["mem_ms"] / out["ms"].clip(lower=1e-12)
    out = out.drop(columns="mem_ms").sort_values("ms", ascending=False).head(top)
    return out[["ms", "share_pct", "instances", "kernels", "memory_bound_pct"]]


def top_kernels(p: Prediction, top: int = 10) -> pd.DataFrame:
    """Distinct kernels (phase, kernel, dims: B x M x N x K for GEMMs, rows x cols otherwise) by total time: calls, ms per call, total, share, bound, utilization."""
    k = p.kernels.assign(dims=p.kernels["dims"].map(lambda d: "x".join(str(int(x)) for x in d)),
                         kernel=p.kernels["kernel"].astype(str) if "kernel" in p.kernels else
                         p.kernels["aten_op"].astype(str).str.removeprefix("aten.").str.removesuffix(".default"))
    out = k.groupby(["phase", "family", "kernel", "dims"], sort=False).agg(
        calls=("latency_ms", "size"), ms=("latency_ms", "sum"), bound=("bound", "first"),
        utilization=("utilization", "mean"))
    out["ms_per_call"] = out["ms"] / out["calls"]
    out["share_pct"] = 100 * out["ms"] / max(p.latency_ms, 1e-12)
    out = out.sort_values("ms", ascending=False).head(top).reset_index()
    return out[["phase", "family", "kernel", "dims", "calls", "ms_per_call", "ms", "share_pct", "bound", "utilization"]]


def bound_shares(p: Prediction) -> dict[str, float]:
    """Share (%) of the predicted time spent in compute-bound and memory-bound kernels."""
    k = p.kernels
    total = max(float(k["latency_ms"].sum()), 1e-12)
    return {b: 100 * float(k.loc[k["bound"] == b, "latency_ms"].sum()) / total for b in ("compute", "memory")}


def trained_on(p: Prediction) -> str:
    devs = tuple(p.predictor_devices)
    if not devs:
        return "the predictor does not say which GPUs it was trained on"
    if p.device.key in devs:
        return f"in the predictor's training set ({', '.join(devs)})"
    return f"not in the predictor's training set ({', '.join(devs)}): forecast from its spec sheet alone"


def _run_line(p: Prediction) -> str:
    what = p.mode + (f" ({' + '.join(p.phases)})" if p.mode == "training" else "")
    shape = f"batch {p.batch_size}" + (f", seq {p.seq_len}" if p.seq_len else "") + _images_text(p.graph)
    n = p.graph.n_params if p.graph is not None else 0
    size = next((f", {n / scale:.1f} {unit} parameters" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"))
                 if n >= scale), f", {n} parameters" if n else "")
    return f"{p.model}: {what}, {shape}{size}"


def _images_text(g: Any) -> str:
    """``", 2 images per sequence"`` for a trace of a multimodal model fed images, else ""."""
    n = getattr(g, "images", None)
    return f", {n} image{'s' if n > 1 else ''} per sequence" if n else ""


def _memory_line(p: Prediction) -> str | None:
    m = p.memory
    if m is None or getattr(m, "peak_bytes", None) is None:
        return None
    cap = p.device.memory_gib
    fits = getattr(m, "fits", None)
    verdict = "" if fits is None else (": fits" if fits else ": does NOT fit")
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in (getattr(m, "breakdown", None) or {}).items() if v)
    what = "memory under torch.compile" if getattr(m, "fused", False) else "memory"
    return f"{what}: peak {m.peak_bytes / GIB:.1f} GiB of {cap:g} GiB{verdict}" + (f" ({parts} GiB)" if parts else "")


def _generation_efficiency(f: Any) -> dict[str, float]:
    """A generation forecast's prefill MFU and decode MBU (%), for its JSON record and the side-by-side table."""
    out = {"prefill_mfu_pct": 100 * f.prefill_efficiency.mfu}
    if f.decode_efficiency is not None:
        out["decode_mbu_pct"] = 100 * f.decode_efficiency.mbu
    return out


def format_summary(p: Prediction, top: int = 10) -> str:
    """The readable summary the CLI prints for one GPU."""
    import pandas as pd

    from neusight.accuracy import format_accuracy

    lines = [_run_line(p), f"device: {p.device.name} ({p.device.key}), {trained_on(p)}",
             "total: {:,.2f} ms ({:,.0f} {})".format(p.latency_ms, *p.throughput)]
    lines.append("phases: " + " | ".join(f"{ph} {ms:,.2f} ms ({100 * ms / max(p.latency_ms, 1e-12):.1f} %)"
                                         for ph, ms in p.phases.items()))
    b = bound_shares(p)
    lines.append(f"bound: compute-bound kernels {b['compute']:.1f} % of the time, memory-bound {b['memory']:.1f} %")
    lines.append(p.efficiency.line())
    mem = _memory_line(p)
    if mem:
        lines.append(mem)
    if acc := format_accuracy(p.accuracy):
        lines.append(acc)
    for note in p.notes:
        lines.append(f"note: {note}")
    fmt = {"ms": "{:,.3f}".format, "ms_per_call": "{:,.4f}".format, "share_pct": "{:.1f}".format,
           "memory_bound_pct": "{:.0f}".format, "utilization": "{:.2f}".format}
    if top < 1:   # top=0: the totals only
        return "\n".join(lines)
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        lines.append(f"\ntop {top} kernels (calls of the same kernel and dims summed):")
        lines.append(top_kernels(p, top).to_string(index=False, formatters=fmt))
        lines.append(f"\ntop {top} layers (module paths, repeated blocks summed as *; all phases):")
        lines.append(top_layers(p, top).to_string(formatters=fmt))
    return "\n".join(lines)


def comparison_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Side by side: one column per forecast (``label``), rows total / phases / speed-up vs the first / memory.

    ``rows`` are dicts with ``label``, ``latency_ms``, ``phases`` and optionally ``memory_peak_gib``,
    ``fits``, ``trained_on``, ``measured_error`` (the shape of :func:`summary_record`) and ``cost``
    (:func:`_cost`: rows USD per block of work and cost relative to the first).
    """
    import pandas as pd

    phases: list[str] = []
    for r in rows:
        phases += [ph for ph in r["phases"] if ph not in phases]
    base = rows[0]["latency_ms"]
    cols = {}
    for r in rows:
        col = {"total ms": f"{r['latency_ms']:,.2f}"}
        if r.get("throughput") is not None:
            col[r["throughput_unit"]] = f"{r['throughput']:,.0f}"
        for ph in phases:
            col[f"{ph} ms"] = f"{r['phases'][ph]:,.2f}" if ph in r["phases"] else "-"
        col[f"speed-up vs {rows[0]['label']}"] = f"{base / r['latency_ms']:.2f}x"
        if r.get("mfu") is not None:
            col["MFU %"] = f"{100 * r['mfu']:.1f}"
            col["MBU %"] = f"{100 * r['mbu']:.1f}"
        if cost := r.get("cost"):
            col[f"USD per {cost['per']}"] = f"{cost['usd']:,.4g}"
            first = rows[0].get("cost")
            if first and first["per"] == cost["per"]:
                col[f"cost vs {rows[0]['label']}"] = f"{cost['usd'] / first['usd']:.2f}x"
        if r.get("memory_peak_gib") is not None:
            col["memory peak GiB"] = f"{r['memory_peak_gib']:.1f}" + ("" if r.get("fits") in (None, True) else " (no fit)")
        if r.get("trained_on") is not None:
            col["predictor trained on it"] = "yes" if r["trained_on"] else "no"
        if r.get("measured_error") is not None:
            col["measured mean error of the kind"] = r["measured_error"]
        cols[r["label"]] = col
    return pd.DataFrame(cols)


def summary_record(p: Prediction, label: str | None = None) -> dict[str, Any]:
    """What the comparison table needs of one forecast (JSON-safe); the caller adds its ``cost`` (:func:`_cost`)."""
    from neusight.accuracy import short_accuracy

    m = p.memory
    peak = getattr(m, "peak_bytes", None) if m is not None else None
    rate, unit = p.throughput
    eff = p.efficiency
    return {"label": label or p.device.key, "device": p.device.key, "latency_ms": p.latency_ms,
            "throughput": rate, "throughput_unit": unit, "mfu": eff.mfu, "mbu": eff.mbu,
            "phases": dict(p.phases), "memory_peak_gib": None if peak is None else peak / GIB,
            "fits": getattr(m, "fits", None) if m is not None else None,
            "trained_on": p.device.key in tuple(p.predictor_devices),
            "measured_error": short_accuracy(p.accuracy)}


# neusight.remedies: each remedy forecast on each GPU that misses, so not by default in a ranking
FIT_HINT = ("advise=true ranks the GPUs it fits on with the usual memory remedies (slower: a forecast per remedy and "
            "GPU); device=<GPU> lists them")


def ranking_text(table: pd.DataFrame, key: str, run: str, skipped: dict[str, str],
                 fit_hint: str | None = FIT_HINT) -> str:
    """What ``device=all`` prints: the ``run`` line, the ranked ``table`` (:func:`neusight.api.ranking_table` or
    :func:`neusight.generation.generation_ranking_table`, ordered by its ``key`` column, in ms), the fastest GPU
    (and the fastest the run fits on, with ``fit_hint`` where some do not), the cheapest when priced, and the GPUs
    left out with the reason."""
    import textwrap

    from neusight.api import table_formats

    fmt = table_formats(table.columns)
    lines = [run, f"{len(table)} GPUs of the spec library ranked, fastest first (device=list shows their specs; a GPU "
                  "outside the predictor's training set is forecast from its spec sheet alone; its notes: "
                  "neusight-predict device=<GPU>)"]
    with pd_wide():
        lines.append(table.to_string(index=False, formatters=fmt))
    first = table.iloc[0]
    lines.append(f"fastest: {first['GPU']} ({first[key]:,.2f} ms)")
    if "fits" in table:
        fitting = table[table["fits"] == "yes"]
        lines.append(f"the run fits in the memory of {len(fitting)} of {len(table)} GPUs"
                     + (f"; the fastest of them: {fitting.iloc[0]['GPU']} ({fitting.iloc[0][key]:,.2f} ms)"
                        if len(fitting) else "")
                     + (f"; on the others, {fit_hint}" if fit_hint and len(fitting) < len(table) else ""))
    if "max batch" in table:
        most = table.loc[table["max batch"].idxmax()]
        lines.append(f"the largest batch fits on {most['GPU']} ({most['max batch']:,})")
    usd = next((c for c in table.columns if c.startswith("USD per")), None)
    if usd is not None:
        cheap = table.loc[table[usd].idxmin()]
        lines.append(f"cheapest per {usd[len('USD per '):]}: {cheap['GPU']} (${cheap[usd]:,.4g})")
    groups: dict[str, list[str]] = {}
    for k, why in skipped.items():   # one line per reason ("fp8=True needs FP8 tensor cores; t4 (...) has none")
        groups.setdefault(why.split(";")[0], []).append(k)
    lines += [textwrap.fill(f"left out ({len(keys)}): {why}: {', '.join(keys)}", width=116, subsequent_indent="  ",
                            break_on_hyphens=False) for why, keys in groups.items()]
    return "\n".join(lines)


def pd_wide() -> Any:
    """Pandas display options for tables wider than a terminal's default (printed, not wrapped)."""
    import pandas as pd

    return pd.option_context("display.width", 250, "display.max_columns", 50, "display.max_colwidth", 60)


# ---------------------------------------------------------------------------------------------------------
# the app


def _devices(cfg_device: Any) -> list[str]:
    from neusight.api import names_all
    from neusight.devices import list_devices
    from neusight.errors import InputError

    if names_all(cfg_device):   # device=all: every GPU of the library, ranked
        return list_devices()
    devices = list(cfg_device) if OmegaConf.is_list(cfg_device) or isinstance(cfg_device, list) else [cfg_device]
    if not devices or any(d is None or str(d).strip() == "" for d in devices):
        raise InputError(f"device={cfg_device!r} names no GPU; use a key such as device=h100-sxm5-80gb "
                         "(neusight.list_devices() lists them) or a spec YAML path")
    return [str(d) for d in devices]


def _say_what_short_names_leave_out(cfg: Any) -> None:
    """A device given by a short name that one GPU answers to ("A100") could mean other GPUs of the library too:
    say which GPU the forecast takes and what else the name covers."""
    from neusight.api import names_all
    from neusight.devices import also_named, load_device

    if names_all(cfg.device):
        return
    for name in dict.fromkeys(_devices(cfg.device)):
        others = also_named(name)
        if others:
            print(f"note: device={name} is taken as {load_device(name).key}; the name also fits "
                  f"{', '.join(others)} (pass one of those keys to forecast it instead)")


def _step_options(cfg: Any) -> dict[str, Any]:
    """The training-step options of a predict or trace config, as ``neusight.trace`` takes them."""
    targets = list(cfg.lora_targets) if cfg.lora_targets is not None else None
    out = {"gradient_checkpointing": cfg.gradient_checkpointing, "lora_rank": cfg.lora_rank, "lora_targets": targets,
           "moe_kernels": getattr(cfg, "moe_kernels", "auto"), "ssm_kernels": getattr(cfg, "ssm_kernels", "fused"),
           "fp8": getattr(cfg, "fp8", False), "weight_quant": getattr(cfg, "weight_quant", None),
           "static_cache": getattr(cfg, "static_cache", False), "kv_cache_dtype": getattr(cfg, "kv_cache_dtype", None),
           "memory_format": getattr(cfg, "memory_format", "contiguous"), "images": getattr(cfg, "images", None)}
    shapes = getattr(cfg, "input_shapes", None)
    if shapes is not None:
        from omegaconf import OmegaConf

        out["input_shapes"] = OmegaConf.to_container(shapes) if OmegaConf.is_config(shapes) else list(shapes)
    return out


def _wants_run(cfg: PredictConfig) -> bool:
    return cfg.total_tokens is not None or cfg.total_samples is not None


def _run_text(cfg: PredictConfig, step_ms: float, batch_size: int, seq_len: int | None, gpus: int,
              price: float | None = None) -> str:
    """The whole-run line (``total_tokens=`` / ``total_samples=``) for one forecast step, costed at ``price``
    USD per GPU-hour when given."""
    from neusight.api import run_line, run_time

    run = run_time(step_ms, batch_size, seq_len, gpus=gpus, total_samples=cfg.total_samples,
                   total_tokens=cfg.total_tokens, usd_per_gpu_hour=price)
    total = cfg.total_tokens if cfg.total_tokens is not None else cfg.total_samples
    shown = f"{int(total):,}" if float(total).is_integer() else f"{total:,.1f}"
    what = f"{shown} {'tokens' if cfg.total_tokens is not None else 'samples'}"
    return run_line(run, gpus, what, price)


def _prices(cfg: PredictConfig) -> list[float | None]:
    """``gpu_hour_usd`` per GPU of ``cfg.device``: one number for all, a list of one per device, or None each."""
    from neusight.api import check_price
    from neusight.errors import InputError

    n = len(_devices(cfg.device))
    v = cfg.gpu_hour_usd
    if v is None:
        return [None] * n
    if OmegaConf.is_list(v) or isinstance(v, (list, tuple)):
        values = list(v)
        if len(values) != n:
            raise InputError(f"gpu_hour_usd={values} gives {len(values)} price(s) for {n} device(s). Fix: one price "
                             "per device, in the order of device=[...], or a single price for all")
        return [check_price(x) for x in values]
    return [check_price(v)] * n


def _cost(rate: float, unit: str, price: float | None, gpus: int = 1, step: str = "forecast") -> dict[str, Any] | None:
    """The cost record of a throughput (at the ``step`` step time: forecast or anchored) at ``price`` USD per
    GPU-hour; None without a price."""
    if price is None:
        return None
    from neusight.api import unit_cost

    usd, per = unit_cost(rate, unit, price, gpus)
    return {"usd_per_gpu_hour": price, "gpus": gpus, "usd": usd, "per": per, "step": step}


def _cost_text(cost: dict[str, Any]) -> str:
    from neusight.api import cost_line

    return cost_line(cost["usd"], cost["per"], cost["usd_per_gpu_hour"], cost["gpus"], cost["step"])


def _gpus(cfg: PredictConfig) -> list[Device]:
    """The GPUs of ``cfg.device``, each with the what-if changes of ``cfg.spec``."""
    from neusight.devices import modify_device

    changes = OmegaConf.to_container(cfg.spec, resolve=True) if OmegaConf.is_config(cfg.spec) else dict(cfg.spec or {})
    return [modify_device(d, **changes) for d in _devices(cfg.device)]   # loads each GPU; no change: as loaded


def _out_path(path: str) -> str:
    from hydra.core.hydra_config import HydraConfig

    return path if os.path.isabs(path) else os.path.join(HydraConfig.get().runtime.output_dir, path)


def _anchor_device(cfg: PredictConfig) -> Device | None:
    """The GPU of ``anchor_ms`` (None without an anchor); both or neither must be given."""
    from neusight.devices import load_device
    from neusight.errors import InputError

    if (cfg.anchor_ms is None) != (cfg.anchor_device is None):
        raise InputError(f"anchor_ms={cfg.anchor_ms!r} and anchor_device={cfg.anchor_device!r} go together: a step "
                         "time and the GPU it was measured on. Fix: give both, e.g. anchor_ms=412.5 anchor_device=v100")
    if cfg.anchor_device is None:
        return None
    return load_device(cfg.anchor_device)


def forecast(cfg: PredictConfig, extra: Device | None = None,
             skipped: dict[str, str] | None = None) -> list[Prediction]:
    """:func:`neusight.api.predict_many` of ``cfg``: every GPU of ``cfg.device`` (memory too when ``cfg.memory``),
    then ``extra`` (an anchor GPU, last in the list) when given. With a ``skipped`` dict, a GPU of ``cfg.device``
    the run cannot be forecast on (an InputError: no FP8 cores, ...) is left out with its reason there instead of
    failing the command, unless every GPU is; the anchor cannot be left out."""
    from neusight.api import predict_many
    from neusight.cli.common import each_gpu
    from neusight.errors import InputError

    devices = _gpus(cfg) + ([extra] if extra is not None else [])
    preds = predict_many(cfg.model, devices, cfg.batch_size, cfg.seq_len, cfg.mode, memory=cfg.memory,
                         left_out=skipped, progress=lambda gpus: each_gpu(gpus, "forecasts", cfg.progress),
                         **_run_kwargs(cfg))
    if extra is not None and skipped and extra.key in skipped:
        raise InputError(f"anchor_device={extra.key}: {skipped[extra.key]}. Fix: an anchor GPU the run can be "
                         "forecast on")
    if extra is not None and len(preds) == 1:   # the anchor alone: no GPU of cfg.device can run it
        raise InputError(f"device={cfg.device}: no GPU can run this: {'; '.join(sorted(set(skipped.values())))}")
    return preds


def _run_kwargs(cfg: PredictConfig) -> dict[str, Any]:
    """The keywords of ``neusight.predict_many`` that describe ``cfg``'s run (besides model, GPUs and sizes)."""
    return dict(head=cfg.head, optimizer=cfg.optimizer, predictor=cfg.checkpoint, fused=cfg.fused, tf32=cfg.tf32,
                host_us=cfg.host_us, attn_implementation=cfg.attn_implementation, image_size=cfg.image_size,
                dtype=cfg.dtype, amp=cfg.amp, kv_cache=cfg.kv_cache, **_step_options(cfg))


def _advise(cfg: PredictConfig) -> bool:
    """Whether to forecast the memory remedies of a run that does not fit: ``cfg.advise``, else (null) for named
    GPUs but not for ``device=all`` (a climb on each GPU that misses: about 2-3x the ranking's time)."""
    from neusight.api import names_all

    return bool(cfg.advise) if cfg.advise is not None else not names_all(cfg.device)


def _fit_remedies(cfg: PredictConfig, preds: list[Prediction]) -> dict[str, list[Any]]:
    """:func:`neusight.remedies.fit_remedies` of the forecasts in ``preds`` that do not fit (where :func:`_advise`
    says so), with a progress bar over each rung's GPUs."""
    from neusight.cli.common import each_gpu
    from neusight.remedies import fit_remedies

    if not (cfg.memory and _advise(cfg)) or not any(getattr(p.memory, "fits", None) is False for p in preds):
        return {}
    return fit_remedies(cfg.model, [p.device for p in preds], cfg.batch_size, cfg.seq_len, cfg.mode,
                        predictions=preds, progress=lambda gpus: each_gpu(gpus, "memory remedies", cfg.progress),
                        **_run_kwargs(cfg))


def remedies_text(runs: list[tuple[Device, float]], remedies: dict[str, list[Any]], generation: bool = False,
                  least: dict[str, int | None] | None = None) -> str:
    """What the CLI prints of :func:`neusight.remedies.fit_remedies` (``generation``: of
    :func:`neusight.remedies.fit_generation_remedies`): per GPU of ``runs`` ((device, the run's forecast ms)) without
    a fit, each remedy tried and its forecast. ``least``: device key -> the least peak the remedies can reach
    (:func:`neusight.remedies.least_peak_bytes`), to say why none was tried on a GPU smaller than that."""
    from neusight.remedies import out_of_reach

    least = least or {}
    lines = []
    if generation:
        what = "SDPA, a static or FP8 KV cache, 16-bit or int4 weights"
        instead = ("find_max_batch=true finds how many sequences fit (the serving search); tp=N splits the model "
                   "and its cache over N GPUs")
    else:
        what = "SDPA, 16-bit, int4 weights, gradient accumulation or checkpointing"
        instead = ("find_max_batch=true finds the largest batch that fits (gradient accumulation keeps the batch); "
                   "gpus=N plans a multi-GPU layout (ZeRO, tensor or pipeline parallelism)")
    for device, base_ms in runs:
        if device.key not in remedies:
            continue
        rungs = remedies[device.key]
        where = f"{device.key} ({device.memory_gib:g} GiB)"
        if not rungs and out_of_reach(least.get(device.key), device):
            lines.append(f"to fit on {where}: the weights, gradients and optimizer state alone take "
                         f"{least[device.key] / GIB:,.1f} GiB (with the framework's memory), which none of the usual "
                         f"remedies ({what}) lowers; gpus=N plans a multi-GPU layout that shards them (ZeRO, tensor "
                         "or pipeline parallelism)")
            continue
        if not rungs:
            lines.append(f"to fit on {where}: none of the usual remedies ({what}) applies to this run or lowers its "
                         f"peak; {instead}")
            continue
        lines.append(f"to fit on {where}, the same run forecast again with the usual memory remedies, each added "
                     "to the ones before:")
        lines += [f"  {'+ ' if i else ''}{r.line(base_ms)}" for i, r in enumerate(rungs)]
        if not rungs[-1].fits:
            lines.append(f"  none of these fits: {instead}")
    return "\n".join(lines)


def remedies_ranking_text(runs: list[tuple[Device, float]], remedies: dict[str, list[Any]],
                          least: dict[str, int | None] | None = None, generation: bool = False,
                          anchored: bool = False) -> str:
    """What ``device=all`` prints of :func:`neusight.remedies.fit_remedies` (``generation``: of
    :func:`neusight.remedies.fit_generation_remedies`): the GPUs of ``runs`` ((device, the run's forecast ms)) the
    run fits on only with remedies, ranked by the changed run's forecast, then how many none of them makes it fit,
    and why (``least`` as for :func:`remedies_text`; ``anchored``: the ranking's times are anchored to a
    measurement, these are not)."""
    import textwrap

    from neusight.api import ranked, table_formats
    from neusight.remedies import options_text, out_of_reach

    least = least or {}
    rows, short = [], []
    for device, base_ms in runs:
        if device.key not in remedies:
            continue
        rungs = remedies[device.key]
        if not rungs or not rungs[-1].fits:
            short.append(device)
            continue
        r = rungs[-1]
        rows.append({"GPU": device.key, "forecast ms": r.latency_ms, "change %": 100 * (r.latency_ms / base_ms - 1),
                     "memory GiB": f"{r.peak_bytes / GIB:,.1f} of {device.memory_gib:g}",
                     "remedies": options_text(r.options)})

    def fill(text: str) -> str:
        return textwrap.fill(text, width=116, break_on_hyphens=False)

    lines = []
    if rows:
        table = ranked(rows, "forecast ms")
        lines.append(fill(f"with the usual memory remedies (each added to the ones before, cheapest first, until the "
                          f"peak fits; every one forecast again) the run fits on {len(rows)} more GPUs:"))
        with pd_wide():
            lines.append(table.to_string(index=False, formatters=table_formats(table.columns)))
        how = ("a static cache and 16 bits are faster, int4 weights mostly too" if generation
               else "SDPA and 16 bits are faster, accumulation and recompute slower")
        lines.append(fill(f"a remedy changes the run ({how}); the GPUs the run fits on as is were not forecast with "
                          "it: pass the remedies' options with device=all to rank every GPU on the same run"
                          + ("; these times are forecasts, not anchored (the anchor timed the run as given)"
                             if anchored else "")))
    if short:
        beyond = [d for d in short if out_of_reach(least.get(d.key), d)]
        why = ""
        if beyond:
            need = min(least[d.key] for d in beyond)
            why = (f" ({len(beyond)} of them hold less than the weights, gradients and optimizer state alone, "
                   f"{need / GIB:,.1f} GiB or more, which none of the remedies lowers)")
        if generation:
            instead = ("find_max_batch=true finds how many sequences fit (the serving search); tp=N splits the model "
                       "and its cache over N GPUs")
        else:
            instead = "gpus=N plans a multi-GPU layout (ZeRO, tensor or pipeline parallelism)" + (
                "" if len(beyond) == len(short) else "; find_max_batch=true finds the largest batch that fits")
        lines.append(fill(f"none of the remedies makes it fit on {len(short)} GPU{'s' * (len(short) > 1)}{why}: "
                          + instead))
    return "\n".join(lines)


def _write_outputs(cfg: PredictConfig, preds: list[Prediction],
                   costs: list[dict[str, Any] | None] | None = None,
                   remedies: dict[str, list[Any]] | None = None) -> None:
    import pandas as pd

    from neusight.util import atomic_write_text

    if cfg.json:
        path = _out_path(cfg.json)
        records = [p.to_dict() for p in preds]
        for d, c in zip(records, costs or []):
            if c is not None:
                d["cost"] = c
        for d, p in zip(records, preds):
            if remedies and p.device.key in remedies:
                d["fit_remedies"] = [dataclasses.asdict(r) for r in remedies[p.device.key]]
        atomic_write_text(path, _json.dumps(records[0] if len(records) == 1 else records, indent=2, default=float))
        print(f"forecast: {path}")
    if cfg.csv:
        path = _out_path(cfg.csv)
        if len(preds) == 1:
            preds[0].to_csv(path)
        else:
            frames = []
            for p in preds:
                k = p.kernels.copy()
                k["dims"] = k["dims"].map(lambda d: "x".join(str(x) for x in d))
                k.insert(0, "device", p.device.key)
                frames.append(k)
            atomic_write_text(path, pd.concat(frames, ignore_index=True).to_csv(index=False))
        print(f"kernel table: {path}")
    if cfg.timeline:
        for p in preds:
            path = _out_path(cfg.timeline if len(preds) == 1 else _per_device(cfg.timeline, p.device.key))
            p.to_chrome_trace(path)
            print(f"timeline (ui.perfetto.dev or chrome://tracing): {path}")


def _per_device(path: str, key: str) -> str:
    """``timeline.json`` -> ``timeline_<key>.json``: one file per GPU of a side-by-side forecast."""
    root, ext = os.path.splitext(path)
    return f"{root}_{key}{ext or '.json'}"


def _extras(cfg: PredictConfig, preds: list[Prediction], searches: bool = True) -> None:
    """Per-layer CSV, pictures and the max-batch search (unless ``searches`` is false: a ranking has them in its
    table), when asked for."""
    from neusight.util import atomic_write_text

    multi = len(preds) > 1
    for p in preds:
        suffix = f"_{p.device.key}" if multi else ""
        if cfg.layers_csv:
            from neusight.memory import saved_activations
            from neusight.plots import layer_table

            fused = p.memory is not None and p.memory.fused      # under torch.compile: what its backward keeps
            saved = (saved_activations(p.graph, fused=fused, device=p.device) if p.graph.mode == "training"
                     else None)
            path = _out_path(cfg.layers_csv.replace(".csv", f"{suffix}.csv") if multi else cfg.layers_csv)
            atomic_write_text(path, layer_table(p.kernels, saved_bytes=saved).to_csv())
            print(f"per-layer report: {path}")
        if cfg.plot:
            files = p.plot(_out_path(cfg.plot), prefix=f"{p.device.key}_")
            print(f"pictures: {', '.join(str(f) for f in files if str(f).endswith('.png'))}")
        if searches:
            _memory_searches(cfg, p.device)


def _asks_for_list(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "list"


def print_library(models: bool, devices: bool) -> None:
    """``model=list`` / ``device=list``: the model presets and the GPU spec library, instead of a forecast."""
    import pandas as pd

    from neusight.devices import device_dir, device_rows
    from neusight.graph.models import list_models

    if models:
        import textwrap

        names = list_models()
        print(f"model presets ({len(names)}; or pass a Hugging Face config.json path or model directory, a Hub id "
              "such as meta-llama/Llama-2-7b-chat-hf, 'package.module:Class' with input_shapes, or an nn.Module in "
              "Python):")
        print(textwrap.fill(", ".join(names), width=116, initial_indent="  ", subsequent_indent="  ",
                            break_on_hyphens=False))
    if devices:
        table = pd.DataFrame(device_rows()).set_index("key")
        table.columns = ["name", "vendor", "arch", "SMs", "FP32 TFLOP/s", "GB/s", "GiB", "L2 MiB", "W"]
        print(("\n" if models else "") + f"GPUs ({len(table)}, spec files in {device_dir()}; "
              "a GPU is also found by its torch.cuda.get_device_name() string):")
        print(table.to_string(float_format=_spec_number))


def _spec_number(v: float) -> str:
    """A spec-file number as written, to two decimals at most (67.0, 4.83, 3350.0): not padded to the most precise
    value of its column, so one GPU's 4.83 TFLOP/s does not turn everyone else's 67.0 into 67.00."""
    s = f"{v:.2f}".rstrip("0")
    return s + "0" if s.endswith(".") else s


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="predict")
@catch_user_errors
def _app(cfg: PredictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from neusight.util import atomic_write_text

    quiet_third_party_logs()
    if _asks_for_list(cfg.model) or _asks_for_list(cfg.device):
        print_library(models=_asks_for_list(cfg.model), devices=_asks_for_list(cfg.device))
        return 0.0
    _check_counts(cfg)
    _say_what_short_names_leave_out(cfg)
    _check_serving_targets(cfg)
    if cfg.new_tokens is not None:
        return _generation(cfg)
    if cfg.gpus is not None:
        return _plan(cfg)
    if _multi_gpu(cfg):
        return _parallel(cfg)
    from neusight.api import names_all

    reference = _anchor_device(cfg)
    ranking = names_all(cfg.device)
    prices = dict(zip((d.key for d in _gpus(cfg)), _prices(cfg)))
    skipped: dict[str, str] = {}
    preds = forecast(cfg, extra=reference, skipped=skipped if ranking else None)
    anchor, anchored = None, None
    if reference is not None:
        from neusight.api import anchored_ms

        anchor = preds.pop()
        anchored = {p.device.key: anchored_ms(p, anchor, cfg.anchor_ms) for p in preds}
    costs = []
    for i, p in enumerate(preds):
        step = anchored[p.device.key] if anchored is not None else p.latency_ms
        rate, unit = p.throughput
        costs.append(_cost(rate * p.latency_ms / step, unit, prices[p.device.key],
                           step="forecast" if anchor is None else "anchored"))
        if ranking:
            continue
        if i:
            print()
        print(format_summary(p, cfg.top))
        if anchor is not None:
            print(f"anchored: {step:,.2f} ms = the {cfg.anchor_ms:,.2f} ms measured on "
                  f"{anchor.device.key} x the forecast speed-up {anchor.latency_ms / p.latency_ms:.3f}x (forecast "
                  f"there: {anchor.latency_ms:,.2f} ms; forecast speed-ups against measured ones: docs/evaluation.md)")
        if costs[-1] is not None:
            print(_cost_text(costs[-1]))
        if _wants_run(cfg):
            print(_run_text(cfg, step, p.batch_size, p.seq_len, 1, prices[p.device.key]))
    if ranking:
        from neusight.api import ranking_table

        table = ranking_table(preds, costs, anchored)
        for col, values in _ranking_searches(cfg, preds).items():   # find_max_batch / find_max_seq_len per GPU
            table.insert(table.columns.get_loc("predictor trained on it"), col, table["GPU"].map(values))
        remedies = _fit_remedies(cfg, preds)
        print(ranking_text(table, "anchored ms" if anchored is not None else "ms", _run_line(preds[0]), skipped,
                           fit_hint="below, what the usual memory remedies do" if remedies else FIT_HINT))
    elif len(preds) > 1:
        print("\nside by side:")
        table = comparison_table([{**summary_record(p), "cost": c} for p, c in zip(preds, costs)])
        if anchor is not None:
            table.loc[f"anchored ms ({anchor.device.key} = {cfg.anchor_ms:g})"] = [
                f"{anchored[p.device.key]:,.2f}" for p in preds]
        print(table.to_string())
    if not ranking:
        remedies = _fit_remedies(cfg, preds)
    if remedies:
        from neusight.remedies import least_peak_bytes

        least = {p.device.key: least_peak_bytes(p) for p in preds}
        runs = [(p.device, p.latency_ms) for p in preds]
        print("\n" + (remedies_ranking_text(runs, remedies, least, anchored=anchor is not None) if ranking
                      else remedies_text(runs, remedies, least=least)))
    _write_outputs(cfg, preds, costs, remedies)
    _extras(cfg, preds, searches=not ranking)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        records = [{**summary_record(p), "cost": c, "overrides": list(hc.overrides.task), "in_job": len(preds)}
                   for p, c in zip(preds, costs)]
        atomic_write_text(os.path.join(hc.runtime.output_dir, SUMMARY_FILE), _json.dumps(records, default=float))
    return float(preds[0].latency_ms)


def _multi_gpu(cfg: PredictConfig) -> bool:
    """A forecast on several GPUs (neusight.parallel) rather than one."""
    return max(cfg.dp, cfg.tp, cfg.pp, cfg.microbatches, _cp(cfg)) > 1 or bool(cfg.megatron) or bool(cfg.zero)


def _ep(cfg: PredictConfig) -> int:
    """The expert-parallel degree of one layout (``ep=null``: 1; a plan, ``gpus=``, searches it instead)."""
    return 1 if cfg.ep is None else cfg.ep


def _cp(cfg: PredictConfig) -> int:
    """The context-parallel degree of one layout (a plan, ``gpus=``, may search them instead: ``cp=auto`` or a list,
    checked by the plan; 1 here)."""
    from neusight.errors import InputError

    if isinstance(cfg.cp, int) and not isinstance(cfg.cp, bool):
        return cfg.cp
    if cfg.gpus is None:
        raise InputError(f"cp={cfg.cp} is not a positive integer: one forecast takes one context-parallel degree "
                         "(cp=auto or a list of degrees searches them in a plan of gpus=N GPUs). Fix: e.g. cp=2, or "
                         "gpus=8 cp=auto")
    return 1


def _cp_comm(cfg: PredictConfig) -> str:
    """The context-parallel exchange of one layout (a plan, ``gpus=``, checks its own, which may be several:
    ``cp_comm=auto`` or a list; "p2p" here)."""
    from neusight.errors import InputError

    if cfg.gpus is not None:
        return "p2p"
    if not isinstance(cfg.cp_comm, str) or cfg.cp_comm == "auto":
        raise InputError(f"cp_comm={cfg.cp_comm} is not one exchange: one forecast takes one of p2p, all_gather, a2a "
                         "(cp_comm=auto or a list tries each in a plan of gpus=N GPUs). Fix: e.g. cp_comm=a2a, or "
                         "gpus=8 cp=auto cp_comm=auto")
    return cfg.cp_comm


def _check_counts(cfg: PredictConfig) -> None:
    """The run-wide numbers checked before any forecast is made (so a bad one does not cost a forecast first)."""
    from neusight.api import names_all
    from neusight.errors import InputError
    from neusight.parallel import Parallelism

    # its own checks: positive integers, ep | dp, vpp with pp stages
    Parallelism(cfg.dp, cfg.tp, cfg.pp, cfg.microbatches, _ep(cfg), cfg.vpp if cfg.gpus is None else 1,
                cfg.sp if cfg.gpus is None else False, _cp(cfg), _cp_comm(cfg))
    if cfg.top < 0:
        raise InputError(f"top={cfg.top} is negative. Fix: top >= 0 rows of the kernel and layer tables")
    for k, example in (("total_tokens", "1e9"), ("total_samples", "1.28e6"), ("anchor_ms", "850")):
        v = getattr(cfg, k)
        if v is not None and not v > 0:
            raise InputError(f"{k}={v:g} is not a positive number. Fix: e.g. {k}={example}")
    _prices(cfg)   # gpu_hour_usd: positive numbers, one or one per device
    for k in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(cfg, k) and cfg.gpus is None and cfg.dp * _cp(cfg) == 1:
            raise InputError(f"{k}=true overlaps the data-parallel replicas' collectives with the compute; dp=1 has "
                             "none. Fix: dp > 1 (or gpus=N to plan), or leave it out")
    if not cfg.nvls and cfg.gpus is None and max(cfg.dp * _cp(cfg), cfg.tp) == 1:
        raise InputError("nvls=false forecasts NCCL's all-reduces without NVLink SHARP; a run with dp=1 and tp=1 has "
                         "none. Fix: dp > 1 or tp > 1 (or gpus=N to plan), or leave nvls out")
    searches = [k for k in ("find_max_batch", "find_max_seq_len") if getattr(cfg, k)]
    if names_all(cfg.device) and _multi_gpu(cfg) and searches:
        raise InputError(f"device={cfg.device} with {searches[0]} on several GPUs (dp, tp, pp, cp or zero) is "
                         "not available: the ranking of multi-GPU runs has no search column. Fix: name the GPUs to "
                         "search, e.g. device=[a100-80gb-pcie,h100-sxm5-80gb], or leave the search out")


def _generation(cfg: PredictConfig) -> float:
    """``new_tokens=N``: generate() of N tokens after a ``seq_len``-token prompt on every GPU of ``cfg.device``."""
    from neusight.api import names_all
    from neusight.errors import InputError
    from neusight.generation import predict_generation, predict_generation_many

    continuous = _check_batching(cfg)
    other = [k for k in ("layers_csv", "timeline", "kv_cache") if getattr(cfg, k)]
    other += ["plot"] if cfg.plot and not continuous else []   # an engine's plot: its throughput-latency curve
    other += ["csv"] if cfg.csv and cfg.gpus is None else []     # a plan (gpus=) writes its layouts
    other += [k for k in ("find_max_seq_len", "megatron", "gradient_checkpointing", "lora_rank", "total_tokens",
                          "total_samples", "anchor_ms", "zero") if getattr(cfg, k)]
    other += ["fused"] if cfg.fused and not continuous else []  # an engine's forecast is compiled anyway
    other += [f"{k}={getattr(cfg, k)}" for k in ("dp", "pp", "microbatches", "ep", "vpp", "cp")
              if getattr(cfg, k) not in (1, None)]
    other += [f"{k}=true" for k in ("sp", "overlap_grad_reduce", "overlap_param_gather") if getattr(cfg, k)]
    if cfg.mode != "inference" or other:
        raise InputError(f"new_tokens={cfg.new_tokens} forecasts generation (an inference run) and takes no "
                         f"{', '.join(other) or 'mode=' + cfg.mode}. Fix: leave those out (seq_len is the prompt "
                         "length; tp= splits the model over GPUs; data-parallel replicas generate independently, "
                         "gpus=N plans them)")
    devices, ranking = _gpus(cfg), names_all(cfg.device)
    prices = dict(zip((d.key for d in devices), _prices(cfg)))
    kw = dict(prompt_len=cfg.seq_len or 128, new_tokens=cfg.new_tokens, predictor=cfg.checkpoint, dtype=cfg.dtype,
              amp=cfg.amp, head=cfg.head, attn_implementation=cfg.attn_implementation, fp8=cfg.fp8,
              weight_quant=cfg.weight_quant, static_cache=cfg.static_cache, host_us=cfg.host_us,
              **({"kv_cache_dtype": cfg.kv_cache_dtype} if cfg.kv_cache_dtype else {}),
              **({"nvls": cfg.nvls} if cfg.tp > 1 or cfg.gpus is not None else {}))
    if continuous:   # an engine writes its cache in place; its attention is fused (sdpa unless another is named)
        del kw["static_cache"]
        kw.update(batching="continuous", attn_implementation=("sdpa" if cfg.attn_implementation == "eager"
                                                              else cfg.attn_implementation),
                  **({"max_num_batched_tokens": cfg.max_num_batched_tokens}
                     if cfg.max_num_batched_tokens is not None else {}))
    if cfg.gpus is not None:
        plan = _plan_serving if cfg.find_max_batch else _plan_generation
        return plan(cfg, devices, list(prices.values()), kw)
    if continuous:
        return _continuous(cfg, devices, prices, kw)
    skipped: dict[str, str] = {}
    if cfg.tp == 1:   # one GPU each: the traces shared between the GPUs
        forecasts = predict_generation_many(cfg.model, devices, cfg.batch_size, left_out=skipped if ranking else None,
                                            **kw)
    else:
        shared: dict = {}
        forecasts, skipped = _each_gpu(devices, ranking, lambda dev: predict_generation(
            cfg.model, dev, cfg.batch_size, tp=cfg.tp, cache=shared, **kw), cfg.progress)
    rows, costs = [], _summaries(forecasts, ranking, prices)
    for f, cost in zip(forecasts, costs):
        rows.append({"device": f.device.key, "gpus": f.tp, "time_to_first_token_ms": f.prefill_ms,
                     "time_per_output_token_ms": f.time_per_output_token_ms, "total_ms": f.total_ms,
                     "generated_tokens_per_s": f.tokens_per_s, **_generation_efficiency(f),
                     "memory_peak_bytes": f.memory_peak_bytes,
                     "memory_fits": f.memory_fits, "decode_steps": [list(s) for s in f.steps],
                     **({"usd_per_1m_generated_tokens": cost["usd"]} if cost is not None else {})})
    if ranking:
        from neusight.generation import generation_ranking_table

        f = forecasts[0]
        run = (f"{f.model}: generate(), batch {f.batch_size}, prompt {f.prompt_len}, {f.new_tokens} new tokens, "
               f"{'static' if cfg.static_cache else 'dynamic'} KV cache"
               + (f", tensor parallel over {f.tp} GPUs of each type" if f.tp > 1 else ""))
        advise = _advise(cfg) and any(f.memory_fits is False for f in forecasts)
        print(ranking_text(generation_ranking_table(forecasts, costs), "total ms", run, skipped,
                           fit_hint="below, what the usual memory remedies do" if advise else FIT_HINT))
    elif len(rows) > 1:
        import pandas as pd

        table = pd.DataFrame(rows).set_index("device").drop(columns="decode_steps")
        table.insert(list(table.columns).index("memory_peak_bytes"), "memory_peak_gib", table["memory_peak_bytes"] / 2**30)
        table = table.drop(columns="memory_peak_bytes").T
        print("\nside by side:\n"
              + table.to_string(float_format=lambda v: f"{v:,.2f}" if abs(v) >= 10 else f"{v:,.4g}"))
    if _advise(cfg) and any(f.memory_fits is False for f in forecasts):
        from neusight.remedies import fit_generation_remedies

        remedies = fit_generation_remedies(cfg.model, [f.device for f in forecasts], cfg.batch_size,
                                           forecasts=forecasts, **({"tp": cfg.tp} if cfg.tp > 1 else {}), **kw)
        runs = [(f.device, f.total_ms) for f in forecasts]
        print("\n" + (remedies_ranking_text(runs, remedies, generation=True) if ranking
                      else remedies_text(runs, remedies, generation=True)))
        for row in rows:
            if row["device"] in remedies:
                row["fit_remedies"] = [dataclasses.asdict(r) for r in remedies[row["device"]]]
    return _searched_and_written(cfg, forecasts, rows, kw, prices, ranking, "total_ms")


def _check_batching(cfg: PredictConfig) -> bool:
    """``batching`` is static or continuous; continuous serving's own options only with it. True: continuous."""
    from neusight.errors import InputError
    from neusight.serving import BATCHING

    if cfg.batching not in BATCHING:
        raise InputError(f"batching={cfg.batching!r} is not known. Fix: batching=static (one generate() call) or "
                         "batching=continuous (a serving engine's steady state)")
    if cfg.batching == "static":
        if cfg.max_num_batched_tokens is not None:
            raise InputError(f"max_num_batched_tokens={cfg.max_num_batched_tokens} is the token budget of a "
                             "continuously batching engine's step. Fix: add batching=continuous, or leave it out")
        return False
    if cfg.static_cache:
        raise InputError("static_cache=true: a continuously batching engine writes its cache in place already "
                         "(batching=continuous). Fix: leave static_cache out")
    if cfg.gpus is not None and not cfg.find_max_batch:
        raise InputError(f"batching=continuous with gpus={cfg.gpus} plans the layouts serving the most sequences: "
                         "it needs find_max_batch=true. Fix: add find_max_batch=true, or leave gpus out to forecast "
                         "batch_size sequences at once")
    return True


def _continuous(cfg: PredictConfig, devices: list, prices: dict[str, Any], kw: dict[str, Any]) -> float:
    """``new_tokens=N batching=continuous``: each GPU's engine in its steady state with ``batch_size`` sequences
    decoding at once (neusight.engine.predict_continuous), printed, or ranked by generated tokens/s with
    ``device=all``; then the serving searches on request. Returns the first GPU's time per output token."""
    from neusight.api import names_all
    from neusight.engine import continuous_ranking_table, predict_continuous

    ranking = names_all(cfg.device)
    run = {k: v for k, v in kw.items() if k != "batching"}
    shared: dict = {}
    forecasts, skipped = _each_gpu(devices, ranking, lambda dev: predict_continuous(
        cfg.model, dev, cfg.batch_size, tp=cfg.tp, cache=shared, **run), cfg.progress)
    rows, costs = [], _summaries(forecasts, ranking, prices)
    for f, cost in zip(forecasts, costs):
        rows.append({"device": f.device.key, "gpus": f.tp, "batching": "continuous", "sequences": f.batch_size,
                     "time_to_first_token_ms": f.ttft_ms, "time_per_output_token_ms": f.step_ms,
                     "decode_ms": f.decode_ms, "prompt_ms": f.prompt_ms, "step_tokens": f.step_tokens,
                     "generated_tokens_per_s": f.tokens_per_s, "requests_per_s": f.requests_per_s,
                     "step_mfu_pct": 100 * f.efficiency.mfu, "step_mbu_pct": 100 * f.efficiency.mbu,
                     "memory_peak_bytes": f.memory_peak_bytes, "memory_fits": f.memory_fits,
                     **({"usd_per_1m_generated_tokens": cost["usd"]} if cost is not None else {})})
    if ranking:
        f = forecasts[0]
        what = (f"{f.model}: continuous batching, {f.batch_size} sequences at once, prompts of {f.prompt_len}, "
                f"{f.new_tokens} new tokens" + (f", tensor parallel over {f.tp} GPUs of each type" if f.tp > 1 else ""))
        print(ranking_text(continuous_ranking_table(forecasts, costs), "per output token ms", what, skipped,
                           "find_max_batch=true finds how many sequences fit"))
    if cfg.plot:
        _serving_curve(cfg, [f.device for f in forecasts], run, shared)
    return _searched_and_written(cfg, forecasts, rows, kw, prices, ranking, "time_per_output_token_ms")


def _searched_and_written(cfg: PredictConfig, forecasts: list, rows: list[dict], kw: dict[str, Any],
                          prices: dict[str, Any], ranking: bool, answer: str) -> float:
    """The end of a generation or engine forecast: the serving searches on request (each GPU's record added to its
    JSON row), the JSON written on request; returns the first GPU's ``answer`` field."""
    from neusight.util import atomic_write_text

    if cfg.find_max_batch:
        caps = _serving_searches(cfg, forecasts, kw, prices, ranking)
        for row, cap in zip(rows, caps):
            row["serving"] = _serving_record(cap)
    if cfg.json:
        atomic_write_text(_out_path(cfg.json), _json.dumps(rows, indent=2, default=float))
    return float(rows[0][answer])


def _each_gpu(devices: list, ranking: bool, forecast: Any, progress: bool = True) -> tuple[list, dict[str, str]]:
    """``forecast(device)`` on every GPU of ``devices``: with ``ranking`` (device=all) a GPU the run cannot be
    forecast on is left out with the reason (key -> reason, returned) unless none can (then the error); otherwise
    its error is raised."""
    from neusight.api import left_out_reason, unrunnable_error
    from neusight.errors import InputError

    from neusight.cli.common import each_gpu

    forecasts, errors, skipped = [], {}, {}
    for dev in each_gpu(devices, "forecasts", progress):
        try:
            forecasts.append(forecast(dev))
        except InputError as e:
            if not ranking:
                raise
            errors[dev.key], skipped[dev.key] = e, left_out_reason(e)
    if not forecasts:
        raise unrunnable_error(errors)
    return forecasts, skipped


def _summaries(forecasts: list, ranking: bool, prices: dict[str, Any]) -> list:
    """Each generation or engine forecast's cost per 1M generated tokens (None where unpriced); unless
    ``ranking`` (device=all prints a table instead), its summary and cost printed."""
    costs = []
    for i, f in enumerate(forecasts):
        costs.append(_cost(f.tokens_per_s, "generated tokens/s", prices[f.device.key], f.tp))
        if not ranking:
            print(("\n" if i else "") + f.summary())
            if costs[-1] is not None:
                print(_cost_text(costs[-1]))
    return costs


def _serving_curve(cfg: PredictConfig, devices: list, run: dict[str, Any], shared: dict) -> None:
    """``batching=continuous plot=DIR``: each GPU's throughput-latency curve (neusight.engine.serving_curve:
    1, 2, 4, ... sequences at once up to what the token budget keeps running), printed, as a picture and a CSV in
    DIR."""
    from pathlib import Path

    from neusight.api import table_formats
    from neusight.engine import serving_curve
    from neusight.plots import serving_curve_chart
    from neusight.util import atomic_write_text

    prompt_len, new_tokens = run["prompt_len"], run["new_tokens"]
    rest = {k: v for k, v in run.items() if k not in ("prompt_len", "new_tokens")}
    curve = serving_curve(cfg.model, devices, prompt_len, new_tokens, tp=cfg.tp, cache=shared, **rest)
    with pd_wide():
        fmt = {**table_formats(curve.columns), "requests/s": "{:,.2f}".format, "memory GiB": "{:,.1f}".format}
        print(f"\nthroughput against latency, continuous batching (prompts of {prompt_len:,} tokens, {new_tokens:,} "
              "new tokens each):\n" + curve.to_string(index=False, formatters=fmt))
    out = Path(_out_path(cfg.plot))
    files = serving_curve_chart(curve, out / "serving_curve", title=f"{curve.attrs['model']}: continuous batching, "
                                f"prompts of {prompt_len:,}, {new_tokens:,} new tokens (labels: sequences at once)")
    atomic_write_text(out / "serving_curve.csv", curve.to_csv(index=False))
    print(f"pictures: {', '.join(str(f) for f in files if str(f).endswith('.png'))}; table: "
          f"{out / 'serving_curve.csv'}")


def _check_serving_targets(cfg: PredictConfig) -> None:
    """max_tpot_ms / max_ttft_ms are targets of the serving search: generation (new_tokens) with find_max_batch."""
    from neusight.errors import InputError

    given = [f"{k}={getattr(cfg, k)}" for k in ("max_tpot_ms", "max_ttft_ms") if getattr(cfg, k) is not None]
    if given and (cfg.new_tokens is None or not cfg.find_max_batch):
        raise InputError(f"{given[0]} is a latency target of the serving search (the largest batch whose generate() "
                         "meets it). Fix: add new_tokens=<tokens to generate> find_max_batch=true, or leave "
                         f"{given[0].split('=')[0]} out")


def _serving_searches(cfg: PredictConfig, forecasts: list, kw: dict[str, Any], prices: dict[str, Any],
                      ranking: bool) -> list:
    """``new_tokens=`` with ``find_max_batch=true``: each GPU's serving capacity (neusight.serving.serving_capacity:
    the largest batch whose generate() fits and meets max_tpot_ms / max_ttft_ms), printed per GPU, or ranked by
    generated tokens/s at it with ``device=all``; the searches share their traces."""
    from neusight.cli.common import each_gpu
    from neusight.serving import serving_capacity

    run = {k: v for k, v in kw.items() if k not in ("prompt_len", "new_tokens")}
    shared: dict = {}
    caps = [serving_capacity(cfg.model, dev, kw["prompt_len"], kw["new_tokens"], max_tpot_ms=cfg.max_tpot_ms,
                             max_ttft_ms=cfg.max_ttft_ms, tp=cfg.tp, cache=shared, **run)
            for dev in each_gpu([f.device for f in forecasts], "serving searches", cfg.progress)]
    if not ranking:
        for cap, f in zip(caps, forecasts):
            print("\n" + cap.summary(known_notes=f.notes))
            price = prices[cap.device.key]
            if price is not None and cap.forecast is not None:
                print(_cost_text(_cost(cap.tokens_per_s, "generated tokens/s", price, cap.tp)))
        return caps
    print("\n" + serving_ranking_text(caps, prices))
    return caps


def serving_ranking_text(caps: list, prices: dict[str, Any]) -> str:
    """``device=all`` with ``new_tokens=`` and ``find_max_batch=true``: every GPU's serving capacity, the most
    generated tokens/s (at its largest batch within the targets) first; GPUs that serve no batch at the end."""
    import pandas as pd

    from neusight.api import table_formats
    from neusight.serving import targets_text

    rows = []
    for cap in caps:
        f = cap.forecast
        row: dict[str, Any] = {"GPU": cap.device.key, "max batch": cap.batch_size, "limited by": cap.limited_by,
                               "generated tokens/s": cap.tokens_per_s,
                               "time to first token ms": (f.time_to_first_token_ms if f is not None
                                                          else float("nan")),
                               "per output token ms": f.time_per_output_token_ms if f is not None else float("nan"),
                               "memory GiB": (f"{f.memory_peak_bytes / 2**30:,.1f} of {cap.device.memory_gib:g}"
                                              if f is not None else "-")}
        price = prices.get(cap.device.key)
        if price is not None:
            row["USD per 1M generated tokens"] = (_cost(cap.tokens_per_s, "generated tokens/s", price, cap.tp)["usd"]
                                                  if f is not None else float("nan"))
        rows.append(row)
    table = pd.DataFrame(rows).sort_values(["generated tokens/s", "GPU"], ascending=[False, True], kind="stable")
    table.insert(0, "rank", range(1, len(table) + 1))
    first = caps[0]
    targets = "".join(f", {t}" for t in targets_text(first.max_tpot_ms, first.max_ttft_ms))
    gpus = f"each {first.tp} GPUs of a type (tp)" if first.tp > 1 else "each GPU"
    how = ("in one generate() call" if first.batching == "static"
           else "at once, batching continuously (steady state)")
    lines = [f"serving capacity: the largest batch {gpus} serves {how} within its memory{targets}; "
             "most generated tokens/s first"]
    with pd_wide():
        lines.append(table.to_string(index=False, formatters=table_formats(table.columns), na_rep="-"))
    served = table[table["max batch"] > 0]
    if len(served):
        top = served.iloc[0]
        lines.append(f"most tokens/s: {top['GPU']} ({top['generated tokens/s']:,.0f} generated tokens/s at batch "
                     f"{top['max batch']:,})")
    if len(served) < len(table):
        empty = len(table) - len(served)
        lines.append(f"no batch within the targets on {empty} GPU{'s' if empty > 1 else ''}: "
                     + ", ".join(table[table["max batch"] == 0]["GPU"]))
    return "\n".join(lines)


def _serving_record(cap: Any) -> dict[str, Any]:
    """A serving search's result for the JSON output."""
    f = cap.forecast
    return {"max_batch": cap.batch_size, "limited_by": cap.limited_by, "max_tpot_ms": cap.max_tpot_ms,
            "max_ttft_ms": cap.max_ttft_ms, "batching": cap.batching,
            "time_to_first_token_ms": f.time_to_first_token_ms if f is not None else None,
            "time_per_output_token_ms": f.time_per_output_token_ms if f is not None else None,
            "generated_tokens_per_s": cap.tokens_per_s,
            "memory_peak_bytes": f.memory_peak_bytes if f is not None else None}


def _check_serving_layouts(cfg: PredictConfig, instead: str) -> None:
    """A generation plan (gpus=N with new_tokens) searches tp itself, one GPU type at a time; ``instead``: what
    leaving gpus out does (the fix's alternative)."""
    from neusight.api import names_all
    from neusight.errors import InputError

    if cfg.tp != 1:
        raise InputError(f"gpus={cfg.gpus} searches the dp x tp layouts, and tp={cfg.tp} fixes one. Fix: leave tp out "
                         f"to search, or gpus out to {instead}")
    if names_all(cfg.device):
        raise InputError(f"gpus={cfg.gpus} plans the layouts of one GPU type at a time, not of device={cfg.device}. "
                         "Fix: name the GPUs, e.g. device=[a100-80gb-pcie,h100-sxm5-80gb]")


def _plan_generation(cfg: PredictConfig, devices: list, prices: list, kw: dict[str, Any]) -> float:
    """``gpus=N new_tokens=M``: every dp x tp layout of N GPUs serving ``batch_size`` sequences, ranked, per GPU type
    (neusight.plan.plan_generation); the layouts as CSV, the plans as JSON on request."""
    from neusight.plan import plan_generation

    _check_serving_layouts(cfg, "forecast that layout")
    plans = []
    for dev, price in zip(devices, prices):
        for n in _gpu_counts(cfg.gpus):
            plan = plan_generation(cfg.model, dev, n, cfg.batch_size, usd_per_gpu_hour=price, **kw)
            print(("\n" if plans else "") + plan.summary())
            plans.append(plan)
    records = [{"device": p.device.key, "gpus": p.gpus, "batch_size": p.batch_size, "prompt_len": p.prompt_len,
                "new_tokens": p.new_tokens, "best": None if p.best is None else p.best.drop("rank").to_dict(),
                "layouts": p.table.to_dict(orient="records"), "skipped": p.skipped} for p in plans]
    _finish_plans(cfg, plans, records)
    first = plans[0].best
    return float(first["total ms"]) if first is not None else float("nan")


def _plan_serving(cfg: PredictConfig, devices: list, prices: list, kw: dict[str, Any]) -> float:
    """``gpus=N new_tokens=M find_max_batch=true``: every dp x tp layout of N GPUs, each replica serving its largest
    batch within memory and max_tpot_ms / max_ttft_ms, ranked by generated tokens/s, per GPU type
    (neusight.serving.plan_serving); the layouts as CSV, the plans as JSON on request. ``batch_size`` is what the
    search finds, so the one given is not used."""
    from neusight.serving import plan_serving
    from neusight.util import atomic_write_text

    _check_serving_layouts(cfg, "search that layout's capacity")
    run = {k: v for k, v in kw.items() if k not in ("prompt_len", "new_tokens")}
    plans = []
    for dev, price in zip(devices, prices):
        for n in _gpu_counts(cfg.gpus):
            plan = plan_serving(cfg.model, dev, n, kw["prompt_len"], kw["new_tokens"], max_tpot_ms=cfg.max_tpot_ms,
                                max_ttft_ms=cfg.max_ttft_ms, usd_per_gpu_hour=price, **run)
            print(("\n" if plans else "") + plan.summary())
            plans.append(plan)
    best = [p for p in plans if p.best is not None]
    if len(plans) > 1 and best:
        top = max(best, key=lambda p: p.best["generated tokens/s"])
        print(f"\nmost generated tokens/s of the {len(plans)} plans: {top.gpus} x {top.device.key}, "
              f"{top.best['layout']} ({top.best['generated tokens/s']:,.0f} tokens/s, {top.best['sequences']:,} "
              "sequences)")
    if cfg.csv:
        import pandas as pd

        atomic_write_text(_out_path(cfg.csv), pd.concat([p.table.assign(device=p.device.key, gpus=p.gpus)
                                                         for p in plans]).to_csv(index=False))
    if cfg.json:
        records = [{"device": p.device.key, "gpus": p.gpus, "prompt_len": p.prompt_len, "new_tokens": p.new_tokens,
                    "batching": p.batching, "max_tpot_ms": p.max_tpot_ms, "max_ttft_ms": p.max_ttft_ms,
                    "best": None if p.best is None else p.best.drop("rank").to_dict(),
                    "layouts": p.table.to_dict(orient="records"), "skipped": p.skipped} for p in plans]
        atomic_write_text(_out_path(cfg.json), _json.dumps(records, indent=2, default=_json_value))
    first = plans[0].best
    return float(first["generated tokens/s"]) if first is not None else float("nan")


def _finish_plans(cfg: PredictConfig, plans: list, records: list[dict[str, Any]]) -> None:
    """The lines across several plans (neusight.plan.across), then every candidate as CSV and ``records`` as JSON
    on request."""
    import pandas as pd

    from neusight.plan import across
    from neusight.util import atomic_write_text

    if lines := across(plans):
        print("\n" + "\n".join(lines))
    if cfg.csv:
        atomic_write_text(_out_path(cfg.csv), pd.concat([p.candidates.assign(device=p.device.key, gpus=p.gpus)
                                                         for p in plans]).to_csv(index=False))
    if cfg.json:
        atomic_write_text(_out_path(cfg.json), _json.dumps(records, indent=2, default=_json_value))


# a multi-GPU step that does not fit: the plan searches what would (a layout's own remedies are not forecast)
_PLAN_HINT = ("gpus={gpus} plans every dp x tp x pp layout of these GPUs with ZeRO stages, micro-batches and "
              "recompute, those that fit first")


def _parallel(cfg: PredictConfig) -> float:
    """A multi-GPU forecast per GPU type of ``cfg.device`` (neusight.parallel); JSON of the parts on request."""
    from neusight.api import left_out_reason, names_all, unrunnable_error
    from neusight.errors import InputError
    from neusight.parallel import predict_parallel
    from neusight.util import atomic_write_text

    unsupported = [k for k in ("csv", "layers_csv", "plot", "timeline") if getattr(cfg, k)]
    unsupported += ["anchor_ms"] if cfg.anchor_ms is not None else []
    if unsupported:
        raise InputError(f"{unsupported[0]} is not available for multi-GPU forecasts (dp, tp, pp, cp or microbatches > "
                         "1, zero, megatron). Fix: leave it out, or forecast one GPU (dp=tp=pp=cp=microbatches=1)")
    records = []
    # Megatron-LM's AdamW is apex's / Transformer Engine's fused kernel
    optimizer = "adamw-fused" if cfg.megatron and cfg.optimizer == "adamw" else cfg.optimizer
    ranking = names_all(cfg.device)   # every GPU type of the library, ranked: the GPUs that cannot run it left out
    preds, costs, skipped, errors = [], [], {}, {}
    shared: dict = {}   # one trace per software path, the GPUs on it sharing it (predict_parallel's cache)
    run = dict(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, microbatches=cfg.microbatches, head=cfg.head, optimizer=optimizer,
               megatron=cfg.megatron, predictor=cfg.checkpoint, fused=cfg.fused,
               attn_implementation=cfg.attn_implementation, image_size=cfg.image_size, dtype=cfg.dtype, tf32=cfg.tf32,
               host_us=cfg.host_us, amp=cfg.amp, kv_cache=cfg.kv_cache, zero=cfg.zero, ep=_ep(cfg), vpp=cfg.vpp,
               sp=cfg.sp, cp=_cp(cfg), cp_comm=_cp_comm(cfg), overlap_grad_reduce=cfg.overlap_grad_reduce,
               overlap_param_gather=cfg.overlap_param_gather, gpus_per_node=cfg.gpus_per_node,
               internode_gbps=cfg.internode_gbps, nics_per_node=cfg.nics_per_node, nvls=cfg.nvls,
               **_step_options(cfg))
    for dev, price in zip(_gpus(cfg), _prices(cfg)):
        try:
            p = predict_parallel(cfg.model, dev, cfg.batch_size, cfg.seq_len, cfg.mode, memory=cfg.memory,
                                 cache=shared, **run)
        except InputError as e:
            if not ranking:
                raise
            errors[dev.key], skipped[dev.key] = e, left_out_reason(e)
            continue
        gpus = p.parallelism.gpus
        cost = _cost(*p.throughput, price, gpus)
        preds.append(p)
        costs.append(cost)
        records.append({"device": p.device.key, "gpus": gpus, "latency_ms": p.latency_ms,
                        **{f"{k}_ms": v for k, v in p.parts.items()}, "efficiency_per_gpu": p.efficiency.to_dict(),
                        "memory_peak_bytes": p.memory_peak_bytes,
                        "memory_fits": p.memory_fits, **({"cost": cost} if cost is not None else {})})
        if ranking:
            continue
        print(("\n" if len(preds) > 1 else "") + p.summary())
        if p.memory_fits is False:
            print(f"to fit: {_PLAN_HINT.format(gpus=gpus)}")
        if cost is not None:
            print(_cost_text(cost))
        if _wants_run(cfg):
            print(_run_text(cfg, p.latency_ms, p.batch_size, p.seq_len, gpus, price))
        if cfg.pp > 1:
            print(p.stages.round(3).to_string(index=False))
        if cfg.pp > 1 or cfg.microbatches > 1 or cfg.megatron or cfg.sp:
            _layout_searches(cfg, p.device, run)
        else:
            _memory_searches(cfg, p.device)
    if not ranking and len(preds) > 1:
        rows = []
        for p, cost, rec in zip(preds, costs, records):
            rate, unit = p.throughput
            eff = rec["efficiency_per_gpu"]        # computed once, for the JSON record above
            rows.append({"label": p.device.key, "latency_ms": p.latency_ms, "cost": cost,
                         "phases": {k: v for k, v in p.parts.items() if any(q.parts.get(k, 0) > 0 for q in preds)},
                         "throughput": rate, "throughput_unit": unit, "mfu": eff["mfu"], "mbu": eff["mbu"],
                         "memory_peak_gib": None if p.memory_peak_bytes is None else p.memory_peak_bytes / 2**30,
                         "fits": p.memory_fits})
        print("\nside by side (parts of the total; memory: one GPU's):\n" + comparison_table(rows).to_string())
    if ranking:
        from neusight.parallel import parallel_ranking_table

        if not preds:
            raise unrunnable_error(errors)
        run = preds[0].run_line(f"{preds[0].parallelism.gpus} GPUs of each type")
        print(ranking_text(parallel_ranking_table(preds, costs), "ms", run, skipped, _PLAN_HINT.format(
            gpus=preds[0].parallelism.gpus)))
    if cfg.json:
        atomic_write_text(_out_path(cfg.json), _json.dumps(records, indent=2, default=float))
    return float(records[0]["latency_ms"])


def _plan(cfg: PredictConfig) -> float:
    """``gpus=N``: every dp x tp x pp layout of N GPUs ranked, per GPU type of ``cfg.device``
    (neusight.plan.plan_parallel); with a list of counts also how the best layout scales; the candidates as CSV,
    the plans as JSON on request."""
    import pandas as pd

    from neusight.api import names_all
    from neusight.errors import InputError
    from neusight.plan import plan_parallel, scaling_table

    counts = _gpu_counts(cfg.gpus)
    fixed = [f"{k}={getattr(cfg, k)}" for k in ("dp", "tp", "pp") if getattr(cfg, k) != 1]
    if fixed:
        raise InputError(f"gpus={cfg.gpus} searches the dp x tp x pp layouts, and {fixed[0]} fixes one. Fix: leave "
                         f"{fixed[0].split('=')[0]} out to search, or gpus out to forecast that layout")
    if names_all(cfg.device):
        raise InputError(f"gpus={cfg.gpus} plans the layouts of one GPU type at a time, not of device={cfg.device}. "
                         "Fix: name the GPUs, e.g. device=[a100-80gb-pcie,h100-sxm5-80gb]")
    other = [k for k in ("layers_csv", "plot", "timeline", "find_max_batch") if getattr(cfg, k)]
    other += ["anchor_ms"] if cfg.anchor_ms is not None else []
    if other:
        raise InputError(f"{other[0]} is not available with gpus={cfg.gpus} (a search over layouts). Fix: leave it "
                         "out, or forecast one layout with dp= / tp= / pp="
                         + (" (find_max_seq_len=true searches each layout's longest sequence)"
                            if other[0] == "find_max_batch" else ""))
    optimizer = "adamw-fused" if cfg.megatron and cfg.optimizer == "adamw" else cfg.optimizer
    if cfg.find_max_seq_len:
        return _longest_plans(cfg, counts, optimizer)
    plans, records, best_rows = [], [], []
    for dev, price in zip(_gpus(cfg), _prices(cfg)):
        mine = []
        for n in counts:
            plan = plan_parallel(cfg.model, dev, n, cfg.batch_size, cfg.seq_len, cfg.mode,
                                 microbatches=cfg.microbatches if cfg.microbatches != 1 else None,
                                 zero=cfg.zero or None, ep=cfg.ep, vpp=cfg.vpp, sp=cfg.sp, cp=cfg.cp,   # or searched
                                 cp_comm=cfg.cp_comm, optimizer=optimizer,      # or searched
                                 usd_per_gpu_hour=price, head=cfg.head, megatron=cfg.megatron,
                                 predictor=cfg.checkpoint, fused=cfg.fused, attn_implementation=cfg.attn_implementation,
                                 image_size=cfg.image_size, dtype=cfg.dtype, tf32=cfg.tf32, host_us=cfg.host_us,
                                 amp=cfg.amp, kv_cache=cfg.kv_cache, gpus_per_node=cfg.gpus_per_node,
                                 internode_gbps=cfg.internode_gbps, nics_per_node=cfg.nics_per_node, nvls=cfg.nvls,
                                 overlap_grad_reduce=cfg.overlap_grad_reduce,
                                 overlap_param_gather=cfg.overlap_param_gather,
                                 **_step_options(cfg))
            print(("\n" if plans else "") + plan.summary())
            plans.append(plan)
            mine.append(plan)
            best = plan.best
            if best is not None and _wants_run(cfg):
                print(_run_text(cfg, float(best["ms"]), plan.batch_size, plan.seq_len, plan.gpus, price))
            if best is not None:
                label = dev.key if len(counts) == 1 else f"{dev.key} x {n}"
                best_rows.append({"run": label, **best.drop(["rank", "time vs best"]).to_dict()})
            records.append({"device": dev.key, "gpus": plan.gpus, "batch_size": plan.batch_size,
                            "seq_len": plan.seq_len, "mode": plan.mode,
                            "best": None if best is None else best.drop("rank").to_dict(),
                            "layouts": plan.table.to_dict(orient="records"), "skipped": plan.skipped})
        if len(counts) > 1:
            table = scaling_table(mine)
            print(f"\nscaling on {dev.key}, global batch {cfg.batch_size} (each count's best layout; speed-up and "
                  f"efficiency against {table['gpus'].iloc[0]} GPUs):")
            print(table.to_string(index=False, formatters={c: _cell for c in table.columns}))
            for r, rec in zip(table.to_dict(orient="records"), records[-len(counts):]):
                rec["scaling"] = {k: r[k] for k in ("speed-up", "efficiency")}
    if len(best_rows) > 1 and len(counts) == 1:       # several GPU types (with several counts: the scaling tables)
        print("\nbest layout per GPU type, side by side:")
        table = pd.DataFrame(best_rows).set_index("run").drop(columns=["layout"]).T
        print(table.to_string(formatters={c: _cell for c in table.columns}))
    _finish_plans(cfg, plans, records)
    first = plans[0].best
    return float(first["ms"]) if first is not None else float("nan")


def _longest_plans(cfg: PredictConfig, counts: list[int], optimizer: str | None) -> float:
    """``gpus=N find_max_seq_len=true``: the longest sequence each layout of N GPUs holds, per GPU type of
    ``cfg.device`` and count (neusight.plan.plan_max_seq_len); its layouts as CSV, the plans as JSON on request.
    Returns the longest sequence of the first plan."""
    import pandas as pd

    from neusight.errors import InputError
    from neusight.plan import plan_max_seq_len
    from neusight.util import atomic_write_text

    given = [f"{k}={getattr(cfg, k)}" for k in ("seq_len", "total_tokens", "total_samples", "gpu_hour_usd",
                                                "kv_cache") if getattr(cfg, k) is not None]
    if given:
        raise InputError(f"{given[0]} with gpus={cfg.gpus} find_max_seq_len=true: the search finds each layout's "
                         "longest sequence (up to the model's positions) and forecasts a step at it. Fix: leave "
                         f"{given[0].split('=')[0]} out")
    plans, records = [], []
    for dev in _gpus(cfg):
        for n in counts:
            plan = plan_max_seq_len(cfg.model, dev, n, cfg.batch_size, cfg.mode,
                                    microbatches=cfg.microbatches if cfg.microbatches != 1 else None,
                                    zero=cfg.zero or None, ep=cfg.ep, vpp=cfg.vpp, sp=cfg.sp, cp=cfg.cp,
                                    cp_comm=cfg.cp_comm, optimizer=optimizer, head=cfg.head, megatron=cfg.megatron,
                                    predictor=cfg.checkpoint, fused=cfg.fused,
                                    attn_implementation=cfg.attn_implementation, dtype=cfg.dtype, tf32=cfg.tf32,
                                    host_us=cfg.host_us, amp=cfg.amp, gpus_per_node=cfg.gpus_per_node,
                                    internode_gbps=cfg.internode_gbps, nics_per_node=cfg.nics_per_node,
                                    nvls=cfg.nvls, overlap_grad_reduce=cfg.overlap_grad_reduce,
                                    overlap_param_gather=cfg.overlap_param_gather,
                                    **{k: v for k, v in _step_options(cfg).items()
                                       if not (k == "gradient_checkpointing" and v is None)})
            print(("\n" if plans else "") + plan.summary())
            plans.append(plan)
            best = plan.best
            records.append({"device": dev.key, "gpus": plan.gpus, "batch_size": plan.batch_size, "mode": plan.mode,
                            "max_positions": plan.max_positions,
                            "longest": None if best is None else best.drop("rank").to_dict(),
                            "layouts": plan.table.to_dict(orient="records"), "skipped": plan.skipped})
    fitting = [(p, p.best) for p in plans if p.best is not None]
    if len(plans) > 1 and fitting:
        p, row = max(fitting, key=lambda f: (f[1]["max seq_len"], -f[1]["ms"]))
        print(f"\nlongest of the {len(plans)} plans: {p.gpus} x {p.device.key} as {row['layout']}"
              + (f" ({row['cp comm']})" if row["cp comm"] != "-" else "")
              + f": {int(row['max seq_len']):,} tokens, {row['ms']:,.2f} ms a step")
    if cfg.csv:
        atomic_write_text(_out_path(cfg.csv), pd.concat([p.candidates.assign(device=p.device.key, gpus=p.gpus)
                                                         for p in plans]).to_csv(index=False))
    if cfg.json:
        atomic_write_text(_out_path(cfg.json), _json.dumps(records, indent=2, default=_json_value))
    first = plans[0].best
    return float(first["max seq_len"]) if first is not None else 0.0


def _gpu_counts(value: Any) -> list[int]:
    """``gpus=``: one count or a list of them, each a positive integer."""
    from omegaconf import ListConfig

    from neusight.errors import InputError

    counts = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise InputError(f"gpus={value!r} is not a positive number of GPUs or a list of them. Fix: e.g. gpus=8 or "
                         "gpus=[8,16,32]")
    return counts


def _cell(v: Any) -> str:
    """A cell of a mixed column: integers as they are, other numbers to 2 decimals (4 significant digits below 10)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or float(v).is_integer():
        return str(v)
    return f"{v:,.2f}" if abs(v) >= 10 else f"{v:,.4g}"


def _json_value(v: Any) -> Any:
    """numpy scalars in a plan's records as JSON numbers."""
    return v.item() if hasattr(v, "item") else str(v)


def _memory_searches(cfg: PredictConfig, device: Any) -> None:
    """find_max_batch / find_max_seq_len, on one GPU or on dp x cp x tp GPUs (with ZeRO): every GPU holds one
    tensor-parallel shard of one replica, that replica's share of the batch and its 1 / cp of each sequence, so the
    search runs on the shard and a batch it finds is per replica, a sequence length the whole."""
    from neusight.errors import InputError
    from neusight.memory import find_max_batch, find_max_seq_len

    kw = _search_kw(cfg)
    cp = _cp(cfg)
    several = cfg.dp * cp * cfg.tp > 1 or bool(cfg.zero)
    where = (f"{cfg.dp * cp * cfg.tp} x {device.name} (dp {cfg.dp}, " + (f"ep {cfg.ep}, " if _ep(cfg) > 1 else "")
             + (f"cp {cp}, " if cp > 1 else "") + f"tp {cfg.tp}"
             + (f", ZeRO stage {cfg.zero})" if cfg.zero else ")")) if several else device.name
    glob = "global " if several else ""
    if cfg.find_max_batch:
        best = find_max_batch(cfg.model, device, seq_len=cfg.seq_len, image_size=cfg.image_size,
                              kv_cache=cfg.kv_cache, **kw)
        print(f"largest {glob}batch that fits on {where}: {cfg.dp * best}"
              + (f" ({best} per replica)" if cfg.dp > 1 and best else "") + ("" if best else " (batch 1 does not fit)"))
    if cfg.find_max_seq_len:
        if cfg.batch_size % cfg.dp:
            raise InputError(f"batch_size={cfg.batch_size} does not split into dp={cfg.dp} replicas. Fix: a multiple "
                             f"of {cfg.dp}")
        longest = find_max_seq_len(cfg.model, device, batch_size=cfg.batch_size // cfg.dp, **kw)
        print(f"longest sequence that fits on {where} at {glob}batch {cfg.batch_size}: {longest}"
              + ("" if longest else " (64 tokens do not fit)"))


def _layout_searches(cfg: PredictConfig, device: Any, run: dict[str, Any]) -> None:
    """find_max_batch / find_max_seq_len on a layout that pipeline stages, micro-batches, sequence parallelism or
    Megatron-LM's kernels spread over its GPUs unevenly (neusight.parallel.find_max_parallel): the memory
    predict_parallel forecasts for the layout's first stage's GPU, the global batch in multiples of dp x
    microbatches, the sequence in multiples of 64 tokens per GPU of cp; the layout and the run as given."""
    from neusight.parallel import find_max_parallel

    cp = _cp(cfg)
    parts = [f"{k} {getattr(cfg, k)}" for k in ("dp", "tp", "pp") if getattr(cfg, k) > 1]
    parts += [f"cp {cp}"] if cp > 1 else []
    parts += [f"{cfg.microbatches} micro-batches per replica"] if cfg.microbatches > 1 else []
    parts += ["sequence parallelism"] if cfg.sp else []
    parts += ["Megatron-LM"] if cfg.megatron else []
    parts += [f"ZeRO stage {cfg.zero}"] if cfg.zero else []
    where = (f"{cfg.dp * cp * cfg.tp * cfg.pp} x {device.name} ({', '.join(parts)}"
             + ("; the first stage's GPU)" if cfg.pp > 1 else ")"))
    if cfg.find_max_batch:
        found = find_max_parallel(cfg.model, device, "batch_size", None, cfg.seq_len, cfg.mode, **run)
        per = cfg.dp * cfg.microbatches
        print(f"largest global batch that fits on {where}: {found.value}"
              + (f" ({found.value // per} per micro-batch)" if found.value else
                 " (one sample per micro-batch does not fit)"))
    if cfg.find_max_seq_len:
        found = find_max_parallel(cfg.model, device, "seq_len", cfg.batch_size, None, cfg.mode, **run)
        print(f"longest sequence that fits on {where} at global batch {cfg.batch_size}: {found.value:,}"
              + ("" if found.value else f" ({64 * cp} tokens do not fit)"))


def _search_kw(cfg: PredictConfig) -> dict[str, Any]:
    """The keywords of find_max_batch / find_max_seq_len for ``cfg``'s run (besides the searched size)."""
    return dict(mode=cfg.mode, head=cfg.head, optimizer=cfg.optimizer, attn_implementation=cfg.attn_implementation,
                dtype=cfg.dtype, amp=cfg.amp, tensor_parallel=cfg.tp, expert_parallel=_ep(cfg), zero=cfg.zero,
                dp=cfg.dp, fused=cfg.fused, cp=_cp(cfg), cp_comm=_cp_comm(cfg), **_step_options(cfg))


def _ranking_searches(cfg: PredictConfig, preds: list[Prediction]) -> dict[str, dict[str, int]]:
    """``device=all`` with find_max_batch / find_max_seq_len: each GPU's result (column -> device key -> value), for
    the ranking table instead of a line per GPU; the searches' per-probe log is quieted (one search per GPU)."""
    from neusight.cli.common import each_gpu
    from neusight.memory import find_max_batch, find_max_seq_len

    cols: dict[str, dict[str, int]] = {}
    quiet = logging.getLogger("neusight.memory")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        if cfg.find_max_batch:    # each search reuses the probes' traces of the GPUs before it (same path)
            shared: dict = {}
            cols["max batch"] = {p.device.key: find_max_batch(cfg.model, p.device, seq_len=cfg.seq_len,
                                                              image_size=cfg.image_size, kv_cache=cfg.kv_cache,
                                                              traces=shared, **_search_kw(cfg))
                                 for p in each_gpu(preds, "largest batches", cfg.progress)}
        if cfg.find_max_seq_len:
            shared = {}
            cols["max seq_len"] = {p.device.key: find_max_seq_len(cfg.model, p.device, batch_size=cfg.batch_size,
                                                                  traces=shared, **_search_kw(cfg))
                                   for p in each_gpu(preds, "longest sequences", cfg.progress)}
    finally:
        quiet.setLevel(level)
    return cols


class CompareCallback(Callback):
    """After a multirun, print the side-by-side table of every job's forecast (and write comparison.csv)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        files = sorted(sweep.glob(f"*/{SUMMARY_FILE}"), key=lambda f: (len(f.parent.name), f.parent.name))
        rows = _label_jobs([r for f in files for r in _json.loads(f.read_text())])
        if len(rows) < 2:
            return
        from neusight.util import atomic_write_text

        table = comparison_table(rows)
        atomic_write_text(sweep / "comparison.csv", table.to_csv())
        print(f"\nside by side ({len(rows)} jobs; {sweep / 'comparison.csv'}):")
        print(table.to_string())


def job_labels(overrides: list[list[str]]) -> list[str]:
    """One short label per multirun job: the ``key=value`` overrides that differ between the jobs (just the
    value when only ``device`` differs)."""
    parsed = [dict(o.split("=", 1) for o in ov if "=" in o) for ov in overrides]
    keys = sorted({k for d in parsed for k in d})
    varying = [k for k in keys if len({d.get(k) for d in parsed}) > 1]
    return [",".join(d.get(k, "-") if varying == ["device"] else f"{k}={d.get(k, '-')}" for k in varying)
            for d in parsed]


def _label_jobs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r, label in zip(rows, job_labels([r.get("overrides", []) for r in rows])):
        parts = [label] if label else []
        if r.get("in_job", 1) > 1 or not parts:
            parts.append(r["device"])
        r["label"] = ",".join(parts)
    return rows


_GROUP_ALIAS = re.compile(r"^predictor=")


def _rewrite_predictor_override(argv: list[str]) -> list[str]:
    """``predictor=<dir>`` -> ``checkpoint=<dir>`` (see the module docstring for why)."""
    return [_GROUP_ALIAS.sub("checkpoint=", a) for a in argv]


ABOUT = """Forecast how long a model's inference pass, training step or generate() call takes on GPUs you may not
have, from their spec sheets, and the memory it needs: the total, its phases, the top kernels and layers.

examples:
  neusight-predict model=gpt3-2.7b device=h100-sxm5-80gb batch_size=2 seq_len=2048 mode=training
  neusight-predict model=gpt2-large device=[a100-80gb-pcie,h100-sxm5-80gb] batch_size=4 seq_len=1024  # side by side
  neusight-predict model=llama-3-8b device=all batch_size=8 seq_len=512 new_tokens=128 dtype=bfloat16  # all GPUs
  neusight-predict model=gpt3-2.7b device=h100-sxm5-80gb batch_size=64 seq_len=2048 mode=training gpus=8  # plan
  neusight-predict model=list device=list                  # the model presets and the GPU spec library

More in the repository: README.md (the commands), docs/guide.md (what the options do, with measured examples),
docs/limits.md (what the forecasts leave out)."""


def main() -> Any:
    if help_if_asked("neusight-predict", "predict", PredictConfig, ABOUT):
        return 0
    sys.argv = [sys.argv[0], *_rewrite_predictor_override(sys.argv[1:])]
    return exit_2_on_config_errors(_app)()

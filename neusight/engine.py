"""Forecast a serving engine that batches continuously (vLLM, SGLang, TensorRT-LLM) in its steady state.

``predict_continuous("llama-3-8b", "h100-sxm5-80gb", concurrency=64, prompt_len=1024, new_tokens=256,
dtype="bfloat16")`` forecasts an engine that keeps ``concurrency`` sequences decoding at once: each step runs one
forward of every running sequence's next token together with chunks of waiting prompts (chunked prefill), and a
sequence leaves (its cache freed) after its last token while a new one is admitted. In the steady state the
sequences are spread evenly over their lives, so

- a step decodes ``B = concurrency`` tokens whose cached contexts run evenly from ``prompt_len`` to
  ``prompt_len + new_tokens - 2``: their attention is that of one decode step of ``B`` sequences at the mean
  context (attention's cost is linear in the context), the rest of the step (GEMMs, norms, the cache writes) that
  of ``B`` tokens;
- ``B / (new_tokens - 1)`` sequences finish per step (each decodes ``new_tokens - 1`` steps after the prefill made its
  first token), and as many prompts are admitted: a step also prefills ``B * prompt_len / (new_tokens - 1)``
  prompt tokens on average, which join the step's GEMMs (one GEMM of all the step's tokens, as an engine runs
  it) and bring their prompts' attention (one causal prefill's attention per prompt);
- the time per output token is that mean step; the generated tokens per second ``B * new_tokens / (new_tokens - 1)``
  per step; the time to first token of a prompt admitted into this steady state that of the steps its chunks
  (at most ``max_num_batched_tokens - B`` tokens each, the step's token budget less its decode tokens) ride in,
  without queueing (its chunks at the head of the queue);
- the memory that of the decode step (the weights and every running sequence's cache at the mean context, as a
  paged cache holds what the sequences have written) plus the activations of the step's largest prefill.

Every piece comes from the tracer and the kernel predictor; a step is composed from decode-step forecasts
(:func:`neusight.trace`'s ``kv_cache=`` with the cache written in place, ``static_cache``): the attention of the
running sequences from one at ``B`` sequences and the mean context, the other kernels of ``T`` tokens from one of
``T`` one-token sequences less its attention (that of a one-token context), and a prompt's attention from the
fused attention kernels of its prefill. The attention kernels are told apart by being fused attention kernels,
so the engine's attention must be fused (``attn_implementation`` sdpa or flash_attention_2, or ``fused=True``, which
compiles eager attention into one); an engine's language-model head computes logits for the decode tokens and
each finishing prompt's last token only, so the head's kernels of the prefill tokens are left out of the step.

Defaults are an engine's: ``fused=True`` (vLLM compiles the model with ``torch.compile``; SGLang and TensorRT-LLM run
fused kernels of their own), ``attn_implementation="sdpa"`` and no host launch time (CUDA graphs replay the step's
kernels). Not modelled: queueing (requests arriving faster than they finish wait; the time to first token here
has no wait), preemption when the cache runs out, speculative decoding, prefix caching and the cache of prompts
still in prefill (a few partly written prompts beside ``B`` whole sequences).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from neusight.errors import InputError

__all__ = ["ContinuousForecast", "attention_core", "continuous_ranking_table", "predict_continuous", "serving_curve"]

# vLLM's default token budget of a step (max_num_batched_tokens of its OpenAI-compatible server on data-centre GPUs)
MAX_BATCHED_TOKENS = 8192
# the module names whose kernels are the language-model head (HF causal LMs; GPT-NeoX calls it embed_out)
HEAD_MODULES = ("lm_head", "embed_out")
# the decode step's notes an engine forecast leaves out: its own cache note (the step's cache at the mean context is
# in ENGINE_NOTE) and the host-bound warning of eager launches (an engine replays its steps as CUDA graphs; with
# host_us= the host is modelled and its note stays)
DROPPED_NOTES = ("generation with a KV cache:", "kernel launches averaging")
ENGINE_NOTE = ("continuous batching, steady state: {b:,} sequences decoding, {r:.3g} prompts admitted a step "
               "({t:,} prompt tokens a step on average, chunks of at most {c:,}); a step's attention from its "
               "running sequences at the mean context ({ctx:,} tokens), the rest from {n:,} tokens in one forward; "
               "the time to first token has no queueing")


@dataclass
class ContinuousForecast:
    """The steady state of a continuously batching engine with ``batch_size`` sequences decoding at once."""

    model: str
    device: Any
    batch_size: int                      # sequences decoding at once (the engine's concurrency)
    prompt_len: int
    new_tokens: int
    step_ms: float                       # the mean step: the time per output token
    ttft_ms: float                       # a prompt's chunks' steps, without queueing
    decode_ms: float                     # the step's part from its decode tokens (attention at the mean context)
    prompt_ms: float                     # the part its prompt tokens add (GEMMs and others, and their attention)
    prefill_tokens: int                  # prompt tokens a step on average
    chunk_tokens: int                    # the most prompt tokens a step can take beside its decode tokens
    chunks: int                          # steps a prompt's prefill takes
    max_num_batched_tokens: int = MAX_BATCHED_TOKENS
    tp: int = 1
    memory_peak_bytes: float | None = None   # per GPU
    memory_fits: bool | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    efficiency: Any = None               # neusight.efficiency.Efficiency of the mean step (per GPU with tp): its
    #                                      matrix-multiply FLOPs and DRAM bytes composed as its time is

    @property
    def time_per_output_token_ms(self) -> float:
        return self.step_ms

    @property
    def time_to_first_token_ms(self) -> float:
        return self.ttft_ms

    @property
    def step_tokens(self) -> int:
        """Tokens a step forwards on average: the decode tokens and the prompt tokens."""
        return self.batch_size + self.prefill_tokens

    @property
    def requests_per_s(self) -> float:
        """Sequences finished (and admitted) per second."""
        return self.batch_size / (self.new_tokens - 1) / (self.step_ms / 1e3)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second, all sequences (each sequence's first token comes from its prefill)."""
        return self.requests_per_s * self.new_tokens

    def summary(self) -> str:
        gpus = f"{self.tp} x {self.device.name} (tensor parallel)" if self.tp > 1 else self.device.name
        seqs = f"{self.batch_size:,} sequence{'s' if self.batch_size != 1 else ''}"
        lines = [f"{self.model} on {gpus}: continuous batching, {seqs} at once, prompts of "
                 f"{self.prompt_len:,} tokens, {self.new_tokens:,} new tokens each",
                 f"per output token {self.step_ms:,.2f} ms (a mean step: decode {self.decode_ms:,.2f} ms + prompt "
                 f"tokens {self.prompt_ms:,.2f} ms) | time to first token {self.ttft_ms:,.1f} ms ({self.chunks} "
                 f"step{'s' if self.chunks > 1 else ''}, no queueing) | {self.tokens_per_s:,.0f} generated tokens/s | "
                 f"{self.requests_per_s:,.2f} requests/s",
                 f"a step forwards {self.step_tokens:,} tokens on average ({self.batch_size:,} decode + "
                 f"{self.prefill_tokens:,} prompt) of max_num_batched_tokens={self.max_num_batched_tokens:,}"]
        if self.efficiency is not None:
            e = self.efficiency
            lines.append(f"efficiency of the mean step{' per GPU' if self.tp > 1 else ''}: MFU {100 * e.mfu:.1f} % of "
                         f"the {e.peak_name}, MBU {100 * e.mbu:.1f} % of {e.bandwidth / 1e9:,.0f} GB/s "
                         f"({e.achieved_bandwidth / 1e9:,.0f} GB/s)")
        if self.memory_peak_bytes is not None:
            lines.append(f"memory {'per GPU' if self.tp > 1 else 'on the GPU'}: {self.memory_peak_bytes / 2**30:,.1f} "
                         f"GiB of {self.device.memory_gib:g} GiB: {'fits' if self.memory_fits else 'does NOT fit'}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def attention_core(k: Any) -> Any:
    """Which rows of a kernel table are attention's core (what scales with the context, not with the tokens):
    fused attention kernels, and the batched matmuls and softmaxes (alone or fused with the mask and scale) of an
    attention module itself (a module path's last name with "attn" or "attention"; its projections are child
    modules, and GEMMs)."""
    from neusight.kernels.base import ATTENTION_KERNEL

    last = k["module"].str.rsplit(".", n=1).str[-1]
    core = (k["family"].isin(("bmm", "softmax"))
            | ((k["kernel"] == "fused") & k["aten_op"].str.contains("softmax", regex=False)))
    return (k["kernel"] == ATTENTION_KERNEL) | (last.str.contains(r"attn|attention", case=False) & core)


# what a step is composed of: its time, and its DRAM bytes and matrix-multiply FLOPs (for its MBU and MFU)
AMOUNTS = ("latency_ms", "bytes", "gemm_flops")


def _parts(p: Any, amount: str = "latency_ms") -> tuple[float, float, float]:
    """A forecast's (whole, attention core's, language-model head's) ``amount`` (:data:`AMOUNTS`) on one GPU; the
    whole time includes a tensor-parallel forecast's collectives."""
    from neusight.tiles import GEMM_FAMILIES

    k = getattr(p, "per_gpu", p).kernels
    v = (k["flops"].where(k["family"].isin(GEMM_FAMILIES), 0.0) if amount == "gemm_flops" else k[amount]).astype(float)
    attn = float(v[attention_core(k)].sum())
    head = float(v[k["module"].str.rsplit(".", n=1).str[-1].isin(HEAD_MODULES)].sum())
    return float(p.latency_ms) if amount == "latency_ms" else float(v.sum()), attn, head


def _positive(name: str, v: Any, least: int = 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise InputError(f"{name}={v!r} is not an integer >= {least}. Fix: {name} >= {least}")
    return v


def predict_continuous(model: Any, device: Any, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 128,
                       *, max_num_batched_tokens: int = MAX_BATCHED_TOKENS, tp: int = 1, predictor: Any = None,
                       fused: bool = True, attn_implementation: str = "sdpa", host_us: float | None = None,
                       nvls: bool = True, cache: dict | None = None, **trace_kwargs: Any) -> ContinuousForecast:
    """Forecast the steady state of an engine serving ``batch_size`` sequences at once (see the module docstring):
    prompts of ``prompt_len`` tokens, ``new_tokens`` generated each (at least 2: one from the prefill, one decode
    step), at most ``max_num_batched_tokens`` tokens a step (vLLM's name; its default). ``tp``, ``nvls``,
    ``host_us``, ``predictor`` and ``cache`` as in :func:`neusight.predict_generation`; ``trace_kwargs`` go to
    :func:`neusight.trace` (``dtype``, ``kv_cache_dtype``, ``quantization``, ...).

    >>> f = predict_continuous("gpt2", "a100-80gb-pcie", batch_size=8, prompt_len=64, new_tokens=16)
    >>> f.step_ms > f.decode_ms > 0, f.prefill_tokens    # 8 x 64 / 15 prompt tokens a step
    (True, 35)
    """
    from neusight.devices import load_device
    from neusight.parallel import predict_parallel

    batch_size, prompt_len = _positive("batch_size", batch_size), _positive("prompt_len", prompt_len)
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 2:
        raise InputError(f"new_tokens={new_tokens!r}: continuous batching is forecast from its decode steps, and "
                         "each sequence needs at least one (its first token comes from the prefill). Fix: new_tokens "
                         ">= 2, or the prefill alone with neusight.predict(seq_len=prompt_len)")
    budget = _positive("max_num_batched_tokens", max_num_batched_tokens, 2)
    for name in ("mode", "seq_len", "kv_cache", "static_cache", "logits_to_keep"):
        if name in trace_kwargs:
            raise InputError(f"{name}={trace_kwargs[name]!r}: predict_continuous sets {name} itself (an engine "
                             "writes its cache in place, one token a step per sequence). Fix: leave it out")
    _positive("tp", tp)
    steps = new_tokens - 1                      # decode steps of a sequence
    prefill_tokens = step_tokens(batch_size, prompt_len, new_tokens) - batch_size
    if batch_size + prefill_tokens > budget:
        most = budget_batches(prompt_len, new_tokens, budget)
        raise InputError(f"batch_size={batch_size:,} sequences decoding need {batch_size + prefill_tokens:,} tokens a "
                         f"step (their {batch_size:,} and {prefill_tokens:,} prompt tokens of the sequences replacing "
                         f"those that finish), beyond max_num_batched_tokens={budget:,}: the engine cannot keep them "
                         "all running. Fix: " + (f"batch_size <= {most:,}, or a larger max_num_batched_tokens"
                                                 if most else "max_num_batched_tokens >= "
                                                 f"{1 + math.ceil(prompt_len / steps):,}"))
    device = load_device(device)
    cache = {} if cache is None else cache
    kv_dtype = trace_kwargs.pop("kv_cache_dtype", None)   # the running sequences' cache (a prompt's forward reads none)
    from neusight.graph.tracer import check_kv_cache_dtype

    check_kv_cache_dtype(kv_dtype, 1, True, attn_implementation)
    kw = dict(tp=tp, predictor=predictor, fused=fused, attn_implementation=attn_implementation, host_us=host_us,
              nvls=nvls, cache=cache, **trace_kwargs)

    def step(b: int, cached: int, memory: bool) -> Any:
        """One decode step of ``b`` sequences with ``cached`` tokens in their caches."""
        try:
            return predict_parallel(model, device, b, 1, "inference", kv_cache=cached, static_cache=True,
                                    memory=memory, **({"kv_cache_dtype": kv_dtype} if kv_dtype else {}), **kw)
        except InputError as e:
            raise InputError(f"prompt_len={prompt_len} + new_tokens={new_tokens} cannot be served: {e}") from None

    mean_ctx = prompt_len + (steps - 1) // 2    # cached tokens of the mean running sequence
    chunk = budget - batch_size
    n_chunks = math.ceil(prompt_len / chunk)
    last_chunk = prompt_len - (n_chunks - 1) * chunk

    step(1, prompt_len + new_tokens - 2, False)   # the longest sequence's last step: the tracer's checks (positions)
    decode = step(batch_size, mean_ctx, True)
    whole, attn, _ = _parts(decode)
    if attn <= 0.0:
        raise InputError(f"{decode.model} has no attention kernel in its decode step (attention modules' batched "
                         "matmuls, softmaxes or fused attention), which an engine's step is composed from. Fix: a "
                         "model with attention layers (a model of state-space layers alone keeps no KV cache)")
    base = step(batch_size, 1, True)
    based = {a: _parts(base, a) for a in AMOUNTS}

    def extra(tokens: int, logits: float) -> dict[str, float]:
        """What ``tokens`` prompt tokens add to a step's kernels other than attention, their head's share
        ``logits`` (the fraction of them whose logits are computed), in each of :data:`AMOUNTS`."""
        p = step(batch_size + tokens, 1, False)
        out = {}
        for a in AMOUNTS:
            (w, at, h), (b_whole, b_attn, b_head) = _parts(p, a), based[a]
            out[a] = max((w - at - h) - (b_whole - b_attn - b_head) + (h - b_head) * logits, 0.0)
        return out

    prompt = predict_parallel(model, device, 1, prompt_len, "inference", memory=False, logits_to_keep=1, **kw)
    prompt_attn = {a: _parts(prompt, a)[1] for a in AMOUNTS}   # one prompt's causal attention (its chunks' together)
    admitted = batch_size / steps               # prompts admitted (and sequences finished) a step
    added = extra(prefill_tokens, 1.0 / prompt_len)
    prefill = {a: added[a] + admitted * prompt_attn[a] for a in AMOUNTS}
    ttft = (n_chunks * whole + (n_chunks - 1) * extra(chunk, 0.0)["latency_ms"]
            + extra(last_chunk, 1.0 / last_chunk)["latency_ms"] + prompt_attn["latency_ms"])
    step_ms = whole + prefill["latency_ms"]
    per_step = {a: _parts(decode, a)[0] + prefill[a] for a in ("bytes", "gemm_flops")}
    efficiency = replace(decode.efficiency, model_flops=per_step["gemm_flops"], hardware_flops=per_step["gemm_flops"],
                         dram_bytes=per_step["bytes"], seconds=max(step_ms, 1e-12) / 1e3)

    peak = decode.memory_peak_bytes
    if peak is not None:
        biggest = step(batch_size + max(prefill_tokens, min(chunk, prompt_len)), 1, True)
        peak += max((biggest.memory_peak_bytes or 0.0) - (base.memory_peak_bytes or 0.0), 0.0)
    note = ENGINE_NOTE.format(b=batch_size, r=admitted, t=prefill_tokens, c=chunk, ctx=mean_ctx,
                              n=batch_size + prefill_tokens)
    return ContinuousForecast(decode.model, device, batch_size, prompt_len, new_tokens, step_ms, ttft, whole,
                              prefill["latency_ms"], prefill_tokens, chunk, n_chunks, budget, tp, peak,
                              None if peak is None else peak <= device.memory_bytes,
                              (note,) + tuple(n for n in decode.notes if not any(d in n for d in DROPPED_NOTES)),
                              efficiency)


def continuous_ranking_table(forecasts: list[ContinuousForecast],
                             costs: list[dict[str, Any] | None] | None = None) -> Any:
    """Engine forecasts of one run on several GPUs as a table, the shortest step first (at the same concurrency,
    the most generated tokens/s): rank, GPU, time per output token, time vs fastest, time to first token,
    generated tokens/s, requests/s, the mean step's MBU, memory against the GPU's and whether it fits, and the
    cost (``costs`` as in
    :func:`neusight.generation.generation_ranking_table`)."""
    from neusight.api import ranked
    from neusight.generation import with_memory_and_cost

    rows = [with_memory_and_cost({"GPU": f.device.key, "per output token ms": f.step_ms,
                                  "time to first token ms": f.ttft_ms, "generated tokens/s": f.tokens_per_s,
                                  "requests/s": round(f.requests_per_s, 2),
                                  **({"MBU %": 100 * f.efficiency.mbu} if f.efficiency is not None else {})}, f, cost)
            for f, cost in zip(forecasts, costs or [None] * len(forecasts))]
    return ranked(rows, "per output token ms")


def step_tokens(batch: int, prompt_len: int, new_tokens: int) -> int:
    """Tokens an engine's step forwards with ``batch`` sequences decoding: theirs and, on average, the prompt tokens
    of the sequences admitted as they finish (``batch + ceil(batch * prompt_len / (new_tokens - 1))``)."""
    return batch + math.ceil(batch * prompt_len / max(new_tokens - 1, 1))


def budget_batches(prompt_len: int, new_tokens: int, max_num_batched_tokens: int = MAX_BATCHED_TOKENS) -> int:
    """The most sequences an engine keeps decoding within its token budget (:func:`step_tokens` of them in one
    step); 0 when not one fits."""
    lo, hi = 0, max_num_batched_tokens     # step_tokens grows with the sequences: bisect for the largest within
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_tokens(mid, prompt_len, new_tokens) <= max_num_batched_tokens:
            lo = mid
        else:
            hi = mid - 1
    return lo


def serving_curve(model: Any, devices: Any, prompt_len: int = 128, new_tokens: int = 128,
                  batch_sizes: Any = None, *, cache: dict | None = None, **kwargs: Any) -> Any:
    """The throughput-latency curve of a continuously batching engine on each of ``devices`` (a GPU, a list or
    ``"all"``): :func:`predict_continuous` at each of ``batch_sizes`` sequences at once (default: 1, 2, 4, ... up
    to the most the token budget keeps running, and that most), one row each: GPU, sequences, time per output
    token, time to first token, generated tokens/s, requests/s, memory and whether it fits (``attrs["model"]``: the
    model's name). A GPU's curve stops at the first size that does not fit in its memory (that row kept, ``fits``
    "no"). ``kwargs`` go to
    :func:`predict_continuous` (``dtype``, ``max_num_batched_tokens``, ``tp``, ...); the GPUs share ``cache``.

    >>> t = serving_curve("gpt2", ["t4", "l4"], prompt_len=64, new_tokens=16, batch_sizes=[1, 8])
    >>> list(t["sequences"]), bool((t["generated tokens/s"].diff()[1::2] > 0).all())
    ([1, 8, 1, 8], True)
    """
    import pandas as pd

    from neusight.api import load_devices

    most = budget_batches(prompt_len, new_tokens, kwargs.get("max_num_batched_tokens", MAX_BATCHED_TOKENS))
    if batch_sizes is None:
        sizes = [2 ** i for i in range(max(most, 1).bit_length()) if 2 ** i <= most]
        sizes += [most] if most and sizes[-1] != most else []
    else:
        sizes = [batch_sizes] if isinstance(batch_sizes, int) else list(batch_sizes)
        for b in sizes:
            _positive("batch_sizes", b)
        sizes = sorted(set(sizes))
    cache = {} if cache is None else cache
    rows = []
    for device in load_devices(devices):
        for b in sizes:
            f = predict_continuous(model, device, b, prompt_len, new_tokens, cache=cache, **kwargs)
            rows.append({"GPU": f.device.key, "sequences": b, "per output token ms": f.step_ms,
                         "time to first token ms": f.ttft_ms, "generated tokens/s": f.tokens_per_s,
                         "requests/s": f.requests_per_s,
                         "memory GiB": None if f.memory_peak_bytes is None else f.memory_peak_bytes / 2**30,
                         "fits": None if f.memory_fits is None else ("yes" if f.memory_fits else "no")})
            if f.memory_fits is False:
                break
    table = pd.DataFrame(rows)
    table.attrs["model"] = f.model
    return table

"""Forecast text generation end to end: the prompt's prefill, then ``new_tokens`` decode steps.

``predict_generation("llama-2-7b", "l4", batch_size=8, prompt_len=512, new_tokens=128, dtype="float16")``
forecasts what Hugging Face's eager ``generate()`` spends on the GPU: one forward of the whole prompt (which
fills the KV cache; its time is the time to first token) and one step per further token, each attending over
a cache one token longer than the last (:func:`neusight.trace`'s ``kv_cache=``). A step's cost grows with its
context (the attention and the cache copy scale with it; the weights do not), so the decode steps are forecast
at a few context lengths spread over the run and the total is their trapezoidal integral over the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from neusight.errors import InputError

__all__ = ["GenerationForecast", "generation_ranking_table", "predict_generation", "predict_generation_many"]

# decode steps are forecast at this many context lengths, evenly spread (the cost is smooth in the context)
SAMPLES = 3
# the notes of the last decode step a generation forecast repeats (after how its cache takes new tokens): the
# host-bound warning (decode steps are where it matters), collectives, the attention backend and an FP8 cache
GENERATION_NOTES = ("kernel launches", "host modelled", "collectives", "scaled_dot_product_attention on",
                    "KV cache in FP8")
CACHE_NOTES = {False: "each decode step concatenates its keys and values onto the whole KV cache (transformers' "
                      "DynamicCache, as eager generate() runs)",
               True: "each decode step writes its keys and values in place into a KV cache sized for the run "
                     "(static_cache: transformers' StaticCache, as compiled generation and serving engines do)"}


@dataclass
class GenerationForecast:
    """Prefill and decode of one ``generate()`` call of ``batch_size`` sequences."""

    model: str
    device: Any
    batch_size: int
    prompt_len: int
    new_tokens: int
    prefill_ms: float                    # the prompt's forward: time to first token
    decode_ms: float                     # all steps after the first token
    steps: list[tuple[int, float]] = field(default_factory=list)   # (cached tokens, step ms) as forecast
    notes: tuple[str, ...] = ()
    tp: int = 1                          # GPUs the model is split over (Megatron-style tensor parallelism)
    memory_peak_bytes: float | None = None   # per GPU, the higher of the prefill's and the longest cache's step
    memory_fits: bool | None = None
    memory_peak_in: str = "decode"       # where that peak is: "prefill" (the prompt's forward) or "decode"
    prefill_efficiency: Any = None       # neusight.efficiency.Efficiency of the prefill (per GPU with tp)
    decode_efficiency: Any = None        # ... of all decode steps together (their FLOPs and bytes integrated as
    #                                      their times are), None without a decode step

    @property
    def total_ms(self) -> float:
        return self.prefill_ms + self.decode_ms

    @property
    def time_to_first_token_ms(self) -> float:
        """The prompt's prefill, which makes every sequence's first token."""
        return self.prefill_ms

    @property
    def time_per_output_token_ms(self) -> float:
        """Mean decode step (each step emits one token per sequence)."""
        return self.decode_ms / max(self.new_tokens - 1, 1)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole call, all sequences."""
        return self.batch_size * self.new_tokens / (self.total_ms / 1e3)

    def summary(self) -> str:
        gpus = f"{self.tp} x {self.device.name} (tensor parallel)" if self.tp > 1 else self.device.name
        return (f"{self.model} on {gpus}: batch {self.batch_size}, prompt {self.prompt_len}, "
                f"{self.new_tokens} new tokens\n"
                f"time to first token {self.prefill_ms:,.1f} ms | per output token "
                f"{self.time_per_output_token_ms:,.2f} ms"
                f" | total {self.total_ms:,.1f} ms | {self.tokens_per_s:,.0f} generated tokens/s\n"
                + ("decode steps forecast at " + ", ".join(f"context {n + 1}: {ms:.2f} ms" for n, ms in self.steps)
                   if self.steps else "no decode step (one new token: the prefill makes it)")
                + self._efficiency_line() + self._memory_line() + "".join(f"\nnote: {n}" for n in self.notes))

    def _efficiency_line(self) -> str:
        pre, dec = self.prefill_efficiency, self.decode_efficiency
        if pre is None:
            return ""
        line = (f"\nefficiency{' per GPU' if self.tp > 1 else ''}: prefill MFU {100 * pre.mfu:.1f} % of the "
                f"{pre.peak_name}")
        if dec is not None:
            line += (f"; decode MBU {100 * dec.mbu:.1f} % of {dec.bandwidth / 1e9:,.0f} GB/s "
                     f"({dec.achieved_bandwidth / 1e9:,.0f} GB/s), MFU {100 * dec.mfu:.1f} %")
        return line

    def _memory_line(self) -> str:
        if self.memory_peak_bytes is None:
            return ""
        where = "per GPU" if self.tp > 1 else "on the GPU"
        when = (f"in the prompt's forward ({self.prompt_len} tokens)" if self.memory_peak_in == "prefill"
                else f"at the longest context ({self.prompt_len + self.new_tokens - 1} tokens)")
        return (f"\nmemory {where} {when}: "
                f"{self.memory_peak_bytes / 2**30:,.1f} GiB of {self.device.memory_gib:g} GiB: "
                f"{'fits' if self.memory_fits else 'does NOT fit'}")


def _check_run(batch_size: Any, prompt_len: Any, new_tokens: Any, static_cache: Any, trace_kwargs: dict) -> None:
    for name, v in (("batch_size", batch_size), ("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"{name}={v!r} is not a positive integer. Fix: {name} >= 1")
    if {"mode", "seq_len", "kv_cache"} & set(trace_kwargs):
        raise InputError("predict_generation sets mode, seq_len and kv_cache itself. Fix: give prompt_len and "
                         "new_tokens instead")
    if not isinstance(static_cache, bool):
        raise InputError(f"static_cache={static_cache!r} is not true or false. Fix: static_cache=True or leave it out")
    if trace_kwargs.get("images") is not None:
        raise InputError(f"images={trace_kwargs['images']}: generation from a prompt with images is not modelled (its "
                         "decode steps would trace the language model alone, without the image encoder's weights). "
                         "Fix: forecast the prefill with neusight.predict(..., seq_len=<prompt_len>, images=<n>, "
                         "logits_to_keep=1) and the decode steps without images, the image tokens counted in "
                         "prompt_len")
    from neusight.graph.tracer import check_kv_cache_dtype

    check_kv_cache_dtype(trace_kwargs.get("kv_cache_dtype"), 1, static_cache,
                          trace_kwargs.get("attn_implementation", "eager"))


def predict_generation(model: Any, device: Any, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 128,
                       *, predictor: Any = None, tp: int = 1, static_cache: bool = False,
                       host_us: float | None = None, nvls: bool = True, cache: dict | None = None,
                       **trace_kwargs: Any) -> GenerationForecast:
    """Forecast ``generate()`` of ``new_tokens`` tokens after a ``prompt_len``-token prompt (see the module
    docstring). ``trace_kwargs`` go to :func:`neusight.trace` (``dtype=``, ``amp=``, ``attn_implementation=``...).
    ``static_cache`` writes each decode step's keys and values in place (:func:`neusight.trace`), as compiled
    generation and serving engines do, instead of concatenating the whole cache every step.
    ``tp`` > 1 splits the model over that many GPUs (:func:`neusight.parallel.predict_parallel`: each GPU's share of
    every layer, its share of the KV cache's heads, and two all-reduces of the new tokens' activations per layer).
    ``host_us``: the host's time per kernel launch (:func:`neusight.api.host_waits_ms`), which bounds a decode step
    of short kernels; None: not modelled. ``nvls``: with ``tp`` > 1, the all-reduces may run as NCCL's NVLS where
    the GPUs' NVSwitches have NVLink SHARP (:func:`neusight.parallel.predict_parallel`); one GPU has none.
    ``cache``: a dict kept between calls (several GPUs, batch sizes or prompts): calls on the same software path
    share the traces of the same passes, and repeated passes their forecasts (:func:`neusight.parallel.
    predict_parallel`'s ``cache``; one GPU forecast through it equals its forecast without).

    >>> f = predict_generation("gpt2", "a100-80gb-pcie", batch_size=2, prompt_len=32, new_tokens=16)
    >>> f.prefill_ms > 0 and f.decode_ms > 0 and len(f.steps) == 3
    True
    """
    from neusight.devices import load_device

    _check_run(batch_size, prompt_len, new_tokens, static_cache, trace_kwargs)
    kv_dtype = trace_kwargs.pop("kv_cache_dtype", None)   # the decode steps' cache (the prefill reads none)
    device = load_device(device)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise InputError(f"tp={tp!r} is not a positive integer. Fix: tp=1 (one GPU) or the GPUs to split the model over")
    if not isinstance(nvls, bool):
        raise InputError(f"nvls={nvls!r} is not true or false. Fix: nvls=false (NCCL without NVLink SHARP) or leave "
                         "it out")
    if tp == 1 and cache is None:
        return predict_generation_many(model, [device], batch_size, prompt_len, new_tokens, predictor=predictor,
                                       static_cache=static_cache, host_us=host_us, kv_cache_dtype=kv_dtype,
                                       **trace_kwargs)[0]

    def forecast(devices: list, seq: int, memory: bool = False, left_out: Any = None, **kw: Any) -> list:
        from neusight.parallel import predict_parallel

        return [predict_parallel(model, devices[0], batch_size, seq, "inference", tp=tp, predictor=predictor,
                                 memory=memory, host_us=host_us, nvls=nvls, cache=cache, **kw, **trace_kwargs)]

    return _generate([device], batch_size, prompt_len, new_tokens, static_cache, tp, forecast, kv_dtype=kv_dtype)[0]


def predict_generation_many(model: Any, devices: Any, batch_size: int = 1, prompt_len: int = 128,
                            new_tokens: int = 128, *, predictor: Any = None, static_cache: bool = False,
                            left_out: dict[str, str] | None = None, host_us: float | None = None,
                            **trace_kwargs: Any) -> list[GenerationForecast]:
    """:func:`predict_generation` on several GPUs (one each, no tensor parallelism) from shared traces
    (:func:`neusight.api.predict_many`): ``devices`` a list or ``"all"``. ``left_out`` as in ``predict_many``: the
    GPUs the prompt's prefill cannot be forecast on, with the reason, instead of an error.

    >>> fs = predict_generation_many("gpt2", ["t4", "l4"], batch_size=2, prompt_len=32, new_tokens=16)
    >>> [f.device.key for f in fs], fs[0].total_ms > fs[1].total_ms
    (['t4', 'l4'], True)
    """
    from neusight.api import predict_many

    _check_run(batch_size, prompt_len, new_tokens, static_cache, trace_kwargs)
    kv_dtype = trace_kwargs.pop("kv_cache_dtype", None)   # the decode steps' cache (the prefill reads none)

    def forecast(devs: list, seq: int, memory: bool = False, left_out: Any = None, **kw: Any) -> list:
        return predict_many(model, devs, batch_size, seq, "inference", predictor=predictor, memory=memory,
                            left_out=left_out, host_us=host_us, **kw, **trace_kwargs)

    return _generate(devices, batch_size, prompt_len, new_tokens, static_cache, 1, forecast, left_out, kv_dtype)


def _peak(p: Any) -> float | None:
    """A forecast's memory peak: a Prediction's memory report, or a ParallelPrediction's first GPU."""
    report = getattr(p, "memory", None)
    return float(report.peak_bytes) if report is not None else p.memory_peak_bytes


def _generate(devices: Any, batch_size: int, prompt_len: int, new_tokens: int, static_cache: bool, tp: int,
              forecast: Any, left_out: dict[str, str] | None = None,
              kv_dtype: str | None = None) -> list[GenerationForecast]:
    """The prefill on ``devices`` (``forecast(devices, seq_len, memory, left_out, **trace keywords)`` -> one
    forecast per GPU it can run on), then the decode steps at SAMPLES context lengths on those GPUs, their cache in
    ``kv_dtype`` when given (``kv_cache_dtype``); one GenerationForecast each."""
    try:   # the prefill's head computes the last token's logits only, as generate() asks for (logits_to_keep=1)
        first = forecast(devices, prompt_len, memory=True, left_out=left_out, logits_to_keep=1)
    except InputError as e:   # the prefill's seq_len is the caller's prompt_len
        if not str(e).startswith(f"seq_len={prompt_len} "):
            raise
        raise InputError(f"prompt_len={prompt_len}: {e}") from None
    devs = [p.device for p in first]
    steps: list[list[tuple[int, float]]] = [[] for _ in devs]
    effs: list[list[Any]] = [[] for _ in devs]     # the steps' Efficiency, as steps
    notes = [p.notes for p in first]
    decode = [0.0] * len(devs)
    if new_tokens > 1:
        # step i (1 .. new_tokens - 1) feeds token i with prompt_len + i - 1 tokens cached
        cached = sorted({int(round(c)) for c in np.linspace(prompt_len, prompt_len + new_tokens - 2, SAMPLES)})
        growth = [0.0] * len(devs)    # a static cache's bytes beyond the prompt's, held from the prefill on
        for c in cached:
            try:   # the last step holds the longest cache: its memory is the run's
                last = forecast(devs, 1, memory=c == cached[-1] or (static_cache and c == cached[0]), kv_cache=c,
                                static_cache=static_cache, **({"kv_cache_dtype": kv_dtype} if kv_dtype else {}))
            except InputError as e:
                raise InputError(f"prompt_len={prompt_len} + new_tokens={new_tokens} cannot be generated: "
                                 f"{e}") from None
            for i, p in enumerate(last):
                steps[i].append((c, p.latency_ms))
                effs[i].append(p.efficiency)
                notes[i] = p.notes
                if static_cache and len(cached) > 1 and c in (cached[0], cached[-1]) and _peak(p) is not None:
                    growth[i] += _peak(p) * (1.0 if c == cached[-1] else -1.0)
        at = np.arange(prompt_len, prompt_len + new_tokens - 1, dtype=float)   # every step's cached tokens
        for i, run in enumerate(steps):
            xs = np.array([c for c, _ in run], dtype=float)
            ys = np.array([ms for _, ms in run])
            decode[i] = _integral(at, xs, ys)
    else:
        last, growth = first, [0.0] * len(devs)
    out = []
    for i, (p, dev) in enumerate(zip(first, devs)):
        # generate() sizes a static cache for the whole run before the prefill: its growth is held there too
        prefill_peak, decode_peak = _peak(p), _peak(last[i]) if steps[i] else None
        if prefill_peak is not None:
            prefill_peak += max(growth[i], 0.0)
        peak, where = ((prefill_peak, "prefill") if decode_peak is None or (prefill_peak or 0.0) > decode_peak
                       else (decode_peak, "decode"))      # the prompt's forward or the longest cache's step
        dec_eff = None
        if effs[i]:     # the decode steps' FLOPs and bytes summed over every step as their times are
            xs = np.array([c for c, _ in steps[i]], dtype=float)
            e = effs[i][0]
            dec_eff = replace(e, seconds=max(decode[i], 1e-12) / 1e3, **{
                f: _integral(at, xs, np.array([getattr(s, f) for s in effs[i]]))
                for f in ("model_flops", "hardware_flops", "dram_bytes")})
        out.append(GenerationForecast(p.model, dev, batch_size, prompt_len, new_tokens, p.latency_ms, decode[i],
                                      steps[i], ((CACHE_NOTES[static_cache],) if steps[i] else ())
                                      + tuple(n for n in notes[i] if any(w in n for w in GENERATION_NOTES)), tp,
                                      peak, None if peak is None else peak <= dev.memory_bytes, where,
                                      p.efficiency, dec_eff))
    return out


def _integral(at: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> float:
    """The sum over every step's context ``at`` of ``ys`` forecast at the contexts ``xs``, linear between them (one
    forecast: the same for every step)."""
    return float(np.interp(at, xs, ys).sum()) if len(xs) > 1 else float(ys[0]) * len(at)


def generation_ranking_table(forecasts: list[GenerationForecast],
                             costs: list[dict[str, Any] | None] | None = None) -> Any:
    """Generation forecasts of one run on several GPUs as a table, fastest first (by the whole call's time): rank,
    GPU, total ms, time vs fastest, time to first token, time per output token, generated tokens/s, the decode
    steps' MBU (:attr:`GenerationForecast.decode_efficiency`), the memory peak
    at the longest context against the GPU's memory and whether it fits, and the cost (``costs``: per forecast,
    None or ``{"usd": .., "per": "1M generated tokens"}``), as :func:`neusight.api.ranking_table` does for a step."""
    from neusight.api import ranked

    rows = []
    for f, cost in zip(forecasts, costs or [None] * len(forecasts)):
        rows.append(with_memory_and_cost({"GPU": f.device.key, "total ms": f.total_ms,
                                          "time to first token ms": f.prefill_ms,
                                          "per output token ms": f.time_per_output_token_ms,
                                          "generated tokens/s": f.tokens_per_s,
                                          **({"decode MBU %": 100 * f.decode_efficiency.mbu}
                                             if f.decode_efficiency is not None else {})}, f, cost))
    return ranked(rows, "total ms")


def with_memory_and_cost(row: dict[str, Any], f: Any, cost: dict[str, Any] | None) -> dict[str, Any]:
    """A ranking row (:func:`generation_ranking_table`, :func:`neusight.engine.continuous_ranking_table`) with
    forecast ``f``'s memory against its GPU's and whether it fits (where forecast), and its ``cost``."""
    if f.memory_peak_bytes is not None:
        row["memory per GPU GiB" if f.tp > 1 else "memory GiB"] = (f"{f.memory_peak_bytes / 2**30:,.1f} of "
                                                                  f"{f.device.memory_gib:g}")
        row["fits"] = "yes" if f.memory_fits else "no"
    if cost is not None:
        row[f"USD per {cost['per']}"] = cost["usd"]
    return row

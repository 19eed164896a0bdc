"""What would make a step fit: the usual memory remedies, each re-forecast.

A forecast whose memory peak exceeds the GPU answers "no" where the user asked "how fast?". An engineer then
reaches for the same few switches, roughly from the ones that cost no time to the one that costs the most:

1. an attention that keeps no score matrices (``attn_implementation=sdpa``: the fused kernels save a row
   statistic instead of the batch x heads x seq x seq probabilities and dropout mask of the eager attention);
2. 16-bit tensors: in training, mixed precision (``amp``: 16-bit activations, FP32 weights and optimizer); in
   inference, the model in 16 bits (``dtype``: weights and activations). BF16 where the GPU has BF16 tensor
   cores, else FP16;
3. in inference, int4 weights (``weight_quant=int4``: an AWQ / GPTQ-style checkpoint, dequantized in the GEMM);
   in training, gradient accumulation (``microbatches=k``: the batch in k equal micro-batches, forward and
   backward in turn, one optimizer step; the fewest that fit);
4. in training, activation recompute (``gradient_checkpointing=true``: each block's forward runs again in the
   backward pass, only the block inputs are kept), then gradient accumulation again if it still does not fit.

:func:`fit_remedies` forecasts the same run again with each remedy added to the ones before, until the peak fits,
and says what each costs in time. A remedy the run cannot take (a model without gradient checkpointing, a
convolutional net's attention) or that does not lower the peak is left out and not carried on; so is gradient
accumulation that does not fit when recompute comes after it. Nothing here is fitted: the peaks and times are the
forecasts of :func:`neusight.predict_many` (and :func:`neusight.predict_parallel` for micro-batches) for the
changed runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neusight.errors import InputError, ModelError, TraceError

GIB = 2**30
SAME_PEAK = 0.999    # a remedy that leaves the peak above this fraction of it did not help
CANNOT = (InputError, ModelError, TraceError)   # the run cannot take a remedy: that rung is left out


@dataclass(frozen=True)
class Remedy:
    """One rung: the run with ``options`` (every remedy so far, as predict keywords) and what it forecasts."""
    added: str                 # the options this rung adds, "key=value" as the CLI takes them
    options: dict[str, Any]    # all the options changed from the run, this one included
    peak_bytes: int
    fits: bool
    latency_ms: float          # the step's forecast (generate(): the whole call's)

    def line(self, base_ms: float) -> str:
        change = 100 * (self.latency_ms / base_ms - 1) if base_ms > 0 else 0.0
        return (f"{self.added}: peak {self.peak_bytes / GIB:,.1f} GiB, {'fits' if self.fits else 'does NOT fit'}, "
                f"{self.latency_ms:,.2f} ms ({change:+.1f} %)")


ACCUMULATE = ("microbatches", None)     # the gradient-accumulation rung: a search for the fewest micro-batches


def _half(device: Any, run: dict[str, Any]) -> str | None:
    """The 16-bit type a float32 run (no autocast) could take on ``device`` (BF16 where it has BF16 tensor cores,
    else FP16); None if the run has one already."""
    if str(run.get("dtype", "float32")).removeprefix("torch.") != "float32" or run.get("amp"):
        return None
    return "bfloat16" if getattr(device, "bf16_tensor_tflops", 0) else "float16"


def _rungs(mode: str, device: Any, batch_size: int, run: dict[str, Any]) -> list[tuple]:
    """The remedies this run does not already use, in the order tried (see the module docstring): (option, value)
    each, or ACCUMULATE."""
    out: list[tuple] = []
    if run.get("attn_implementation", "eager") == "eager":
        out.append(("attn_implementation", "sdpa"))
    if half := _half(device, run):
        out.append(("amp" if mode == "training" else "dtype", half))
    if mode == "inference" and not (run.get("weight_quant") or run.get("fp8")):
        out.append(("weight_quant", "int4"))
    if mode == "training":
        accumulate = [ACCUMULATE] if batch_size > 1 else []
        out += accumulate
        if not run.get("gradient_checkpointing"):
            out += [("gradient_checkpointing", True)] + accumulate
    return out


def fit_remedies(model: Any, devices: Any, batch_size: int = 1, seq_len: int | None = None,
                 mode: str = "inference", *, predictions: list | None = None, progress: Any = None,
                 **run: Any) -> dict[str, list[Remedy]]:
    """For each GPU of ``devices`` on which the run does not fit, the remedies tried and their forecasts.

    Parameters
    ----------
    model, devices, batch_size, seq_len, mode, **run
        As for :func:`neusight.predict_many` (``run``: its keywords, e.g. ``attn_implementation``, ``dtype``,
        ``amp``, ``gradient_checkpointing``, ``head``, ``optimizer`` (AdamW unless given, as there), ``predictor``,
        ``fused``).
    predictions : list of Prediction, optional
        The run's own forecasts on ``devices`` with their memory, when the caller has them (else forecast here).
    progress : callable, optional
        Wraps the GPUs of each rung's forecast, as :func:`neusight.predict_many`'s ``progress`` (a progress bar).

    Returns
    -------
    dict
        Device key -> the rungs that lowered the peak, in order, ending with the first that fits (every one tried
        if none does; an empty list if no remedy applies or helps, or if the GPU's memory is below
        :func:`least_peak_bytes`, when no rung is tried). GPUs the run fits on are not in it.

    Examples
    --------
    >>> r = fit_remedies("gpt2", "t4", batch_size=16, seq_len=512, mode="training")
    >>> [x.added for x in r["t4"]], [x.fits for x in r["t4"]]
    (['attn_implementation=sdpa', 'amp=float16'], [False, True])
    """
    from neusight.api import load_devices, predict_many

    run = {k: v for k, v in run.items() if k != "memory"}
    devs = load_devices(devices)
    if predictions is None:
        predictions = predict_many(model, devs, batch_size, seq_len, mode, memory=True, **run)
    by_key = {d.key: d for d in devs}
    short = [p for p in predictions if p.memory is not None and p.memory.fits is False and p.device.key in by_key]
    # GPUs smaller than what no remedy here lowers (training: weights, gradients, optimizer state) are not climbed
    beyond = {p.device.key for p in short if out_of_reach(least_peak_bytes(p), p.device)}
    start = {p.device.key: (p.memory.peak_bytes, _rungs(mode, p.device, batch_size, run)) for p in short
             if p.device.key not in beyond}

    def forecast(keys: list[str], options: dict[str, Any]) -> list[tuple]:
        preds = predict_many(model, [by_key[k] for k in keys], batch_size, seq_len, mode, memory=True, left_out={},
                             progress=progress, **{**run, **options})
        return [(p.device.key, p.memory.peak_bytes, p.memory.fits, p.latency_ms) for p in preds]

    cache: dict = {}                 # the micro-batch searches' traces, shared by GPUs on the same software path
    out = _climb(start, forecast, lambda key, options: _fewest_microbatches(
        model, by_key[key], batch_size, seq_len, options, run, cache))
    return {p.device.key: out.get(p.device.key, []) for p in short}


def least_peak_bytes(prediction: Any) -> int | None:
    """The least memory peak :func:`fit_remedies` can reach for a training step: the bytes of the weights, gradients
    and optimizer state at their largest together in the step's memory timeline, plus the framework's own (CUDA
    context, libraries). None of the remedies changes these (mixed precision keeps FP32 weights, gradients and
    optimizer state; accumulation still sums whole gradients); a GPU with less memory is out of their reach.
    None for an inference run or a forecast without memory.

    >>> import neusight
    >>> p = neusight.predict("gpt2", "t4", 8, 512, "training")
    >>> round(least_peak_bytes(p) / 2**30, 2), round(p.memory.peak_bytes / 2**30, 2)
    (2.17, 11.35)
    """
    m = getattr(prediction, "memory", None)
    if m is None or m.mode != "training":
        return None
    held = m.timeline[["weights", "gradients", "optimizer"]].sum(axis=1)
    return int(held.max() if len(held) else 0) + int(m.breakdown.get("framework", 0))


def out_of_reach(least: int | None, device: Any) -> bool:
    """Whether ``device`` holds less than ``least`` (:func:`least_peak_bytes`; None: no such bound)."""
    return (least or 0) > device.memory_bytes


def options_text(options: dict[str, Any]) -> str:
    """Remedy options as the CLI takes them (``attn_implementation=sdpa static_cache=true``)."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())


def _generation_rungs(device: Any, run: dict[str, Any]) -> list[tuple]:
    """The remedies of a ``generate()`` run it does not already use, in the order tried (see
    :func:`fit_generation_remedies`): (option, value) each, the last with the options it needs."""
    out: list[tuple] = []
    if run.get("attn_implementation", "eager") == "eager":
        out.append(("attn_implementation", "sdpa"))
    if not run.get("static_cache"):
        out.append(("static_cache", True))
    if half := _half(device, run):
        out.append(("dtype", half))
    if not (run.get("weight_quant") or run.get("fp8")):
        out.append(("weight_quant", "int4"))
    if not run.get("kv_cache_dtype"):   # an FP8 cache is written in place and read by a fused attention
        needs = {**({"attn_implementation": "sdpa"} if run.get("attn_implementation", "eager") == "eager" else {}),
                 **({} if run.get("static_cache") else {"static_cache": True})}
        out.append(("kv_cache_dtype", "fp8", needs))
    return out


def fit_generation_remedies(model: Any, devices: Any, batch_size: int = 1, *, forecasts: list | None = None,
                            **run: Any) -> dict[str, list[Remedy]]:
    """:func:`fit_remedies` for ``generate()`` (:func:`neusight.predict_generation`, whose keywords ``run`` holds:
    ``prompt_len``, ``new_tokens``, ``tp``, ``dtype``...): the attention in SDPA, the cache written in place
    (``static_cache``: no copy of the whole cache per step), the model in 16 bits, int4 weights, then the cache in
    FP8 (``kv_cache_dtype=fp8``, half its bytes), each added to the ones before until the peak fits. ``forecasts``: the
    run's own, when the caller has them. The batch is not split here: fewer sequences per call is the serving
    search's question (``find_max_batch``).

    >>> r = fit_generation_remedies("gpt2", "t4", 192, prompt_len=512, new_tokens=512)
    >>> [x.added for x in r["t4"]], r["t4"][-1].fits
    (['static_cache=true', 'dtype=float16'], True)
    """
    from neusight.api import load_devices
    from neusight.generation import predict_generation, predict_generation_many

    devs = load_devices(devices)
    cache: dict = {}                 # traces shared by the GPUs and rungs on the same software path
    if forecasts is None:
        forecasts = [predict_generation(model, d, batch_size, cache=cache, **run) for d in devs]
    by_key = {d.key: d for d in devs}
    start = {f.device.key: (f.memory_peak_bytes, _generation_rungs(f.device, run)) for f in forecasts
             if f.memory_fits is False and f.device.key in by_key}

    def forecast(keys: list[str], options: dict[str, Any]) -> list[tuple]:
        if run.get("tp", 1) == 1 and len(keys) > 1:    # one GPU each: the GPUs' forecasts from shared traces
            try:
                fs = predict_generation_many(model, [by_key[k] for k in keys], batch_size, left_out={},
                                             **{k: v for k, v in {**run, **options}.items() if k != "tp"})
                return [(f.device.key, f.memory_peak_bytes, f.memory_fits, f.total_ms) for f in fs]
            except CANNOT:   # some GPU cannot take a decode step so: each on its own, below
                pass
        out, error = [], None
        for key in keys:
            try:
                f = predict_generation(model, by_key[key], batch_size, cache=cache, **{**run, **options})
            except CANNOT as e:     # this GPU cannot take it (FP8 on a GPU without FP8 tensor cores, ...)
                error = e
                continue
            out.append((key, f.memory_peak_bytes, f.memory_fits, f.total_ms))
        if not out and error is not None:
            raise error
        return out

    return _climb(start, forecast)


def _climb(start: dict[str, tuple[float, list]], forecast: Any, search: Any = None) -> dict[str, list[Remedy]]:
    """Each GPU of ``start`` (key -> its peak, its rungs) up its rungs until one fits. ``forecast(keys, options)``
    forecasts GPUs that try the same options together: (key, peak bytes, fits, ms) each, one of CANNOT's errors if
    the run cannot take them; ``search(key, options)`` runs an ACCUMULATE rung (a Remedy or None)."""
    state = {key: {"options": {}, "peak": peak, "rungs": list(rungs), "searched": {}}
             for key, (peak, rungs) in start.items()}
    out: dict[str, list[Remedy]] = {k: [] for k in state}
    while True:
        # the next rung of every GPU still without a fit; GPUs trying the same options are forecast together
        groups: dict[tuple, list[str]] = {}
        searches = []
        for key, s in state.items():
            if not s["rungs"]:
                continue
            rung = s["rungs"].pop(0)
            if rung == ACCUMULATE:
                searches.append(key)
                continue
            options = {**(rung[2] if len(rung) > 2 else {}), **s["options"], rung[0]: rung[1]}   # with its needs
            groups.setdefault(_frozen(options), []).append(key)
        if not groups and not searches:
            return out
        for items, keys in groups.items():
            options = dict(items)
            try:
                results = forecast(keys, options)
            except CANNOT:      # the run cannot take this remedy on any of these GPUs
                continue
            added = options_text({k: v for k, v in options.items() if k not in state[keys[0]]["options"]})
            for key, peak, fits, ms in results:
                _step(state, out, key, Remedy(added, options, int(peak), bool(fits), float(ms)))
        for key in searches:
            s = state[key]
            found = s["searched"].get(_frozen(s["options"]))
            if found is None:
                found = s["searched"][_frozen(s["options"])] = search(key, s["options"])
            # accumulation that does not fit is kept only as the last rung: recompute, tried next, starts without it
            if found is not None and (found.fits or not s["rungs"]):
                _step(state, out, key, found)


def _frozen(options: dict[str, Any]) -> tuple:
    return tuple(sorted(options.items(), key=lambda kv: kv[0]))


def _step(state: dict[str, dict[str, Any]], out: dict[str, list[Remedy]], key: str, r: Remedy) -> None:
    """Record rung ``r`` of GPU ``key`` if it lowered the peak, and carry its options on (done once it fits)."""
    s = state[key]
    if r.peak_bytes >= SAME_PEAK * s["peak"]:
        return               # no help: not carried on to the next rungs
    out[key].append(r)
    s["options"], s["peak"] = r.options, r.peak_bytes
    if r.fits:
        del state[key]


def _fewest_microbatches(model: Any, device: Any, batch_size: int, seq_len: int | None, options: dict[str, Any],
                         run: dict[str, Any], cache: dict) -> Remedy | None:
    """Gradient accumulation: the batch in the fewest equal micro-batches whose step fits
    (:func:`neusight.parallel.predict_parallel` of one replica: each micro-batch's forward and backward in turn,
    one optimizer step), with ``options``; micro-batches of one sample if none fits. None if the run cannot be
    split so."""
    from neusight.parallel import predict_parallel
    from neusight.plan import _divisors

    last = None
    for k in _divisors(batch_size)[1:]:         # 1 micro-batch: the run itself
        try:
            # predict_parallel steps no optimizer unless told; the run's is predict_many's (AdamW unless given)
            p = predict_parallel(model, device, batch_size, seq_len, "training", microbatches=k, cache=cache,
                                 **{"optimizer": "adamw", **run, **options})
        except CANNOT:
            return last
        last = Remedy(f"microbatches={k}", {**options, "microbatches": k}, int(p.memory_peak_bytes),
                      bool(p.memory_fits), float(p.latency_ms))
        if last.fits:
            break
    return last

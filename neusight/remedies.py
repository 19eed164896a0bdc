"""What would make a step fit: the usual memory remedies, each re-forecast.

A forecast whose memory peak exceeds the GPU answers "no" where the user asked "how fast?". An engineer then
reaches for the same few switches, roughly in this order, each cheaper in speed than the next:

1. an attention that keeps no score matrices (``attn_implementation=sdpa``: the fused kernels save a row
   statistic instead of the batch x heads x seq x seq probabilities and dropout mask of the eager attention);
2. in training, activation recompute (``gradient_checkpointing=true``: each block's forward runs again in the
   backward pass, only the block inputs are kept);
3. 16-bit tensors: in training, mixed precision (``amp``: 16-bit activations, FP32 weights and optimizer); in
   inference, the model in 16 bits (``dtype``: weights and activations). BF16 where the GPU has BF16 tensor
   cores, else FP16.

:func:`fit_remedies` forecasts the same run again with each remedy added to the ones before, until the peak fits,
and says what each costs in time. A remedy the run cannot take (a model without gradient checkpointing, a
convolutional net's attention) or that does not lower the peak is left out and not carried on. Nothing here is
fitted: the peaks and times are the forecasts of :func:`neusight.predict_many` for the changed runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neusight.errors import InputError

GIB = 2**30
SAME_PEAK = 0.999    # a remedy that leaves the peak above this fraction of it did not help


@dataclass(frozen=True)
class Remedy:
    """One rung: the run with ``options`` (every remedy so far, as predict keywords) and what it forecasts."""
    added: str                 # the option this rung adds, "key=value" as the CLI takes it
    options: dict[str, Any]    # all the options changed from the run, this one included
    peak_bytes: int
    fits: bool
    latency_ms: float

    def line(self, base_ms: float) -> str:
        change = 100 * (self.latency_ms / base_ms - 1) if base_ms > 0 else 0.0
        return (f"{self.added}: peak {self.peak_bytes / GIB:,.1f} GiB, {'fits' if self.fits else 'does NOT fit'}, "
                f"{self.latency_ms:,.2f} ms ({change:+.1f} %)")


def _rungs(mode: str, device: Any, run: dict[str, Any]) -> list[tuple[str, Any]]:
    """The remedies this run does not already use, in the order tried (see the module docstring)."""
    out: list[tuple[str, Any]] = []
    if run.get("attn_implementation", "eager") == "eager":
        out.append(("attn_implementation", "sdpa"))
    if mode == "training" and not run.get("gradient_checkpointing"):
        out.append(("gradient_checkpointing", True))
    if str(run.get("dtype", "float32")).removeprefix("torch.") == "float32" and not run.get("amp"):
        half = "bfloat16" if getattr(device, "bf16_tensor_tflops", 0) else "float16"
        out.append(("amp" if mode == "training" else "dtype", half))
    return out


def fit_remedies(model: Any, devices: Any, batch_size: int = 1, seq_len: int | None = None,
                 mode: str = "inference", *, predictions: list | None = None, **run: Any) -> dict[str, list[Remedy]]:
    """For each GPU of ``devices`` on which the run does not fit, the remedies tried and their forecasts.

    Parameters
    ----------
    model, devices, batch_size, seq_len, mode, **run
        As for :func:`neusight.predict_many` (``run``: its keywords, e.g. ``attn_implementation``, ``dtype``,
        ``amp``, ``gradient_checkpointing``, ``head``, ``optimizer``, ``predictor``, ``fused``).
    predictions : list of Prediction, optional
        The run's own forecasts on ``devices`` with their memory, when the caller has them (else forecast here).

    Returns
    -------
    dict
        Device key -> the rungs that lowered the peak, in order, ending with the first that fits (every one tried
        if none does; an empty list if no remedy applies or helps). GPUs the run fits on are not in it.

    Examples
    --------
    >>> r = fit_remedies("gpt2", "t4", batch_size=16, seq_len=512, mode="training")
    >>> [x.added for x in r["t4"]], [x.fits for x in r["t4"]]
    (['attn_implementation=sdpa', 'gradient_checkpointing=true'], [False, True])
    """
    from neusight.api import load_devices, predict_many

    run = {k: v for k, v in run.items() if k != "memory"}
    devs = load_devices(devices)
    if predictions is None:
        predictions = predict_many(model, devs, batch_size, seq_len, mode, memory=True, **run)
    by_key = {d.key: d for d in devs}
    state: dict[str, dict[str, Any]] = {}       # device key -> options so far, peak so far, rungs left
    for p in predictions:
        m = p.memory
        if m is None or m.fits is not False or p.device.key not in by_key:
            continue
        state[p.device.key] = {"options": {}, "peak": m.peak_bytes, "rungs": _rungs(mode, p.device, run)}
    out: dict[str, list[Remedy]] = {k: [] for k in state}
    while True:
        # the next rung of every GPU still without a fit, GPUs trying the same options forecast together
        groups: dict[tuple, list[str]] = {}
        for key, s in state.items():
            if s["rungs"]:
                name, value = s["rungs"].pop(0)
                options = {**s["options"], name: value}
                groups.setdefault(tuple(sorted(options.items(), key=lambda kv: kv[0])), []).append(key)
        if not groups:
            return out
        for items, keys in groups.items():
            options = dict(items)
            left_out: dict[str, str] = {}
            try:
                preds = predict_many(model, [by_key[k] for k in keys], batch_size, seq_len, mode, memory=True,
                                     left_out=left_out, **{**run, **options})
            except InputError:      # the run cannot take this remedy on any of these GPUs
                continue
            added = next(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()
                         if k not in state[keys[0]]["options"])
            for p in preds:
                s, m = state[p.device.key], p.memory
                if m is None or m.peak_bytes >= SAME_PEAK * s["peak"]:
                    continue         # no help: not carried on to the next rungs
                out[p.device.key].append(Remedy(added, options, int(m.peak_bytes), bool(m.fits),
                                                float(p.latency_ms)))
                s["options"], s["peak"] = options, m.peak_bytes
                if m.fits:
                    del state[p.device.key]

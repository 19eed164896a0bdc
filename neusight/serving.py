"""How many sequences a GPU can serve at once: the largest batch whose ``generate()`` fits and meets latency targets.

``serving_capacity("llama-3-8b", "h100-sxm5-80gb", prompt_len=1024, new_tokens=256, max_tpot_ms=50,
dtype="bfloat16", attn_implementation="sdpa", static_cache=True)`` searches the most concurrent sequences whose
:func:`neusight.predict_generation` forecast (the whole batch's prefill, then its decode steps) fits in the GPU's
memory, decodes each token within ``max_tpot_ms`` on average and, with ``max_ttft_ms``, delivers the first token
within that; the answer says which of them stops a larger batch, and what the batch generates per second.

A batch's memory, time to first token and time per output token all grow with its size (the laws of
DESIGN.md), so the largest batch within every target is one search (:func:`neusight.memory.largest_within` over the
highest of the three ratios to their targets) instead of three. The batch is static, as ``generate()`` runs it:
every sequence's prompt is prefilled together, and all decode together until the last token. With
``batching="continuous"`` the search is over the concurrency of a serving engine that batches continuously (vLLM,
SGLang, TensorRT-LLM): prefills interleaved with the other sequences' decode steps, a sequence's cache freed when
it ends, in the steady state of :func:`neusight.engine.predict_continuous`; a step's token budget
(``max_num_batched_tokens``) is then a fourth limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from neusight.errors import InputError

__all__ = ["ServingCapacity", "ServingPlan", "plan_serving", "serving_capacity"]

# what stops a larger batch, in the order a tie is named (the token budget: continuous batching's only)
LIMITS = ("memory", "time to first token", "time per output token", "token budget")
# how the sequences are batched: one generate() call, or a continuously batching engine's steady state
BATCHING = ("static", "continuous")
# the search's default upper end (a cap, named as the limit when it is reached)
MAX_BATCH = 4096


@dataclass
class ServingCapacity:
    """The most concurrent sequences one ``generate()`` call can serve on ``tp`` GPUs of ``device``."""

    model: str
    device: Any
    prompt_len: int
    new_tokens: int
    batch_size: int                     # the most sequences within every target; 0: not even one
    limited_by: str                     # one of LIMITS, or "max_batch" (the search's upper end)
    forecast: Any = None                # the GenerationForecast at batch_size (None at 0)
    over: Any = None                    # the forecast at batch_size + 1 (or 1), which misses a target
    max_tpot_ms: float | None = None
    max_ttft_ms: float | None = None
    max_batch: int = MAX_BATCH
    tp: int = 1
    forecasts: int = 0                  # generate() (or engine) forecasts the search made
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    batching: str = "static"            # one of BATCHING
    max_num_batched_tokens: int | None = None   # continuous batching: a step's token budget

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second at the largest batch (0 when none fits)."""
        return self.forecast.tokens_per_s if self.forecast is not None else 0.0

    def summary(self, known_notes: tuple[str, ...] = ()) -> str:
        """What the search found, with the notes of its forecast that are not among ``known_notes`` (those
        printed already with another forecast of the run)."""
        gpus = f"{self.tp} x {self.device.name} (tensor parallel)" if self.tp > 1 else self.device.name
        targets = [f"memory <= {self.device.memory_gib:g} GiB{' per GPU' if self.tp > 1 else ''}",
                   *targets_text(self.max_tpot_ms, self.max_ttft_ms)]
        how = ("one generate() call (static batch)" if self.batching == "static" else
               f"continuous batching (steady state, max_num_batched_tokens={self.max_num_batched_tokens:,})")
        lines = [f"serving capacity of {self.model} on {gpus}: prompts of {self.prompt_len:,} tokens, "
                 f"{self.new_tokens:,} new tokens each, {how}",
                 f"targets: {', '.join(targets)}"]
        if self.batch_size == 0:
            lines.append(f"no batch meets them: one sequence needs {_miss(self.over, self.limited_by, self)}")
        elif self.limited_by == "max_batch":
            lines.append(f"most concurrent sequences: {self.batch_size:,} or more (the search's max_batch; every "
                         "target still met)")
        else:
            lines.append(f"most concurrent sequences: {self.batch_size:,} (limited by {self.limited_by}: "
                         f"{self.batch_size + 1:,} need {_miss(self.over, self.limited_by, self)})")
        if self.forecast is not None:
            f = self.forecast
            lines.append(f"at {self.batch_size:,}: time to first token {f.time_to_first_token_ms:,.1f} ms | "
                         "per output token "
                         f"{f.time_per_output_token_ms:,.2f} ms | {f.tokens_per_s:,.0f} generated tokens/s | memory "
                         f"{f.memory_peak_bytes / 2**30:,.1f} of {self.device.memory_gib:g} GiB")
        kind = "generate()" if self.batching == "static" else "engine"
        lines.append(f"({self.forecasts} {kind} forecasts, {self.seconds:.1f} s)")
        return "\n".join(lines + [f"note: {n}" for n in self.notes if n not in known_notes])


def targets_text(max_tpot_ms: float | None, max_ttft_ms: float | None) -> list[str]:
    """The latency targets given, as the summaries and tables say them."""
    out = [f"per output token <= {max_tpot_ms:,g} ms"] if max_tpot_ms is not None else []
    return out + ([f"time to first token <= {max_ttft_ms:,g} ms"] if max_ttft_ms is not None else [])


def _ratios(f: Any, device: Any, max_tpot_ms: float | None, max_ttft_ms: float | None) -> dict[str, float]:
    """Each target's use by forecast ``f`` (above 1: missed)."""
    out = {"memory": f.memory_peak_bytes / device.memory_bytes}
    if max_ttft_ms is not None:
        out["time to first token"] = f.time_to_first_token_ms / max_ttft_ms
    if max_tpot_ms is not None:
        out["time per output token"] = f.time_per_output_token_ms / max_tpot_ms
    return out


def _beyond(value: float, target: float | None, digits: int) -> str:
    """``value`` to ``digits`` decimals, or up to four more where those would not show it above ``target``."""
    for d in range(digits, digits + 5):
        shown = f"{value:,.{d}f}"
        if target is None or value <= target or float(shown.replace(",", "")) > target:
            break
    return shown


def _miss(f: Any, limit: str, cap: "ServingCapacity") -> str:
    """What forecast ``f`` needs of the target ``limit`` (of the search ``cap``)."""
    if limit == "memory":
        return (f"{_beyond(f.memory_peak_bytes / 2**30, cap.device.memory_gib, 1)} GiB"
                f"{' per GPU' if f.tp > 1 else ''}")
    if limit == "token budget":
        from neusight.engine import step_tokens

        tokens = step_tokens(cap.batch_size + 1, cap.prompt_len, cap.new_tokens)
        return f"{tokens:,} tokens a step (max_num_batched_tokens={cap.max_num_batched_tokens:,})"
    if limit == "time to first token":
        return f"{_beyond(f.time_to_first_token_ms, cap.max_ttft_ms, 1)} ms to the first token"
    return f"{_beyond(f.time_per_output_token_ms, cap.max_tpot_ms, 2)} ms per output token"


def _check_target(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"{name}={value!r} is not a positive number of milliseconds. Fix: e.g. {name}=50, or "
                         "leave it out (no such target)")
    return float(value)


def serving_capacity(model: Any, device: Any, prompt_len: int = 128, new_tokens: int = 128, *,
                     max_tpot_ms: float | None = None, max_ttft_ms: float | None = None,
                     max_batch: int = MAX_BATCH, tp: int = 1, cache: dict | None = None,
                     batching: str = "static", **kwargs: Any) -> ServingCapacity:
    """The largest batch of sequences (``prompt_len`` prompt tokens, ``new_tokens`` new ones each) whose
    ``generate()`` on ``tp`` GPUs of ``device`` fits in memory and, where given, takes at most ``max_tpot_ms`` per
    output token (the mean decode step) and ``max_ttft_ms`` to the first token (the batch's prefill); see the module
    docstring. ``max_batch`` caps the search (the answer is then ``max_batch``, limited by "max_batch").
    ``cache``: a dict kept between searches of the same run on several GPUs (or prompts), which share the traces
    of the batches they both probe (:func:`neusight.predict_generation`'s ``cache``). ``kwargs`` go to
    :func:`neusight.predict_generation` (``dtype``, ``attn_implementation``, ``static_cache``, ``kv_cache_dtype``,
    ``host_us``, ``predictor``, ``nvls``, ...); ``batch_size`` is what is searched.
    ``batching="continuous"``: the most sequences a continuously batching engine keeps decoding at once
    (:func:`neusight.engine.predict_continuous`, which then takes ``kwargs``, e.g. ``max_num_batched_tokens``):
    the time per output token its mean step, the time to first token a prompt's prefill beside them, and a step's
    tokens (decode and prompt) within ``max_num_batched_tokens``.

    >>> cap = serving_capacity("gpt2", "t4", prompt_len=64, new_tokens=8, max_tpot_ms=5, max_batch=64)
    >>> cap.limited_by, cap.forecast.time_per_output_token_ms <= 5 < cap.over.time_per_output_token_ms
    ('time per output token', True)
    """
    from neusight.devices import load_device
    from neusight.engine import MAX_BATCHED_TOKENS, predict_continuous, step_tokens
    from neusight.generation import predict_generation
    from neusight.memory import largest_within

    if batching not in BATCHING:
        raise InputError(f"batching={batching!r} is not known. Fix: one of {', '.join(BATCHING)} (static: one "
                         "generate() call; continuous: a serving engine's steady state)")
    continuous = batching == "continuous"
    budget = kwargs.get("max_num_batched_tokens", MAX_BATCHED_TOKENS) if continuous else None
    if not continuous and "max_num_batched_tokens" in kwargs:
        raise InputError(f"max_num_batched_tokens={kwargs['max_num_batched_tokens']!r} is the token budget of a "
                         "continuously batching engine's step. Fix: add batching='continuous', or leave it out")
    if "batch_size" in kwargs:
        raise InputError(f"batch_size={kwargs['batch_size']!r} is what serving_capacity searches. Fix: leave it out "
                         "(max_batch= caps the search)")
    max_tpot_ms, max_ttft_ms = _check_target("max_tpot_ms", max_tpot_ms), _check_target("max_ttft_ms", max_ttft_ms)
    if max_tpot_ms is not None and isinstance(new_tokens, int) and new_tokens == 1:
        raise InputError("max_tpot_ms= bounds the decode steps, and new_tokens=1 has none (the prefill makes the one "
                         "token). Fix: new_tokens >= 2, or max_ttft_ms= for the prefill")
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise InputError(f"max_batch={max_batch!r} is not a positive integer. Fix: e.g. max_batch=4096")
    device = load_device(device)
    cache = {} if cache is None else cache
    start = time.perf_counter()
    runs: dict[int, Any] = {}

    forecast = predict_continuous if continuous else predict_generation

    def run(b: int) -> Any:
        if b not in runs:
            runs[b] = forecast(model, device, b, prompt_len, new_tokens, tp=tp, cache=cache, **kwargs)
        return runs[b]

    def budget_use(b: int) -> float:
        """A continuous engine's step tokens with ``b`` sequences decoding, against its budget (0: static)."""
        return step_tokens(b, prompt_len, new_tokens) / budget if continuous else 0.0

    def use(b: int) -> float:
        """The highest use of a target by ``b`` sequences (a step beyond the token budget is not forecast)."""
        if budget_use(b) > 1.0:
            return budget_use(b)
        return max(_ratios(run(b), device, max_tpot_ms, max_ttft_ms).values())

    run(1)    # the run's own checks (prompt, positions, options) fail here, as the forecast's
    best = largest_within(use, 1.0, max_batch)
    over = None
    if best == max_batch:
        limited_by = "max_batch"
    elif budget_use(best + 1) > 1.0:
        limited_by = "token budget"
    else:
        over = run(best + 1)
        ratios = _ratios(over, device, max_tpot_ms, max_ttft_ms)
        limited_by = max(LIMITS, key=lambda k: (ratios.get(k, 0.0), -LIMITS.index(k)))
    at = runs[best] if best else None
    return ServingCapacity(runs[1].model, device, prompt_len, new_tokens, best, limited_by, at, over, max_tpot_ms,
                           max_ttft_ms, max_batch, tp, len(runs), time.perf_counter() - start,
                           (at or runs[1]).notes, batching, budget)


@dataclass
class ServingPlan:
    """The ways ``gpus`` GPUs of one type can serve as many sequences as possible within the targets: ``dp``
    replicas of the model, each split over ``tp`` GPUs and serving its own largest batch (:func:`serving_capacity`
    with ``tp``); ``candidates`` has a row per layout."""

    model: str
    device: Any
    gpus: int
    prompt_len: int
    new_tokens: int
    max_tpot_ms: float | None
    max_ttft_ms: float | None
    candidates: pd.DataFrame
    skipped: dict[str, str]              # layout label -> why it was left out
    capacities: dict[str, ServingCapacity] = field(default_factory=dict)   # layout label -> its replica's search
    seconds: float = 0.0
    batching: str = "static"             # one of BATCHING

    @property
    def table(self) -> pd.DataFrame:
        """The layouts, the most generated tokens/s first (ties: fewer GPUs per replica), with ``rank``; a layout
        whose replicas serve no sequence within the targets last."""
        c = self.candidates
        if c.empty:
            return c
        t = c.sort_values(["generated tokens/s", "tp"], ascending=[False, True], kind="stable").reset_index(drop=True)
        t.insert(0, "rank", range(1, len(t) + 1))
        return t

    @property
    def best(self) -> pd.Series | None:
        """The layout that serves the most generated tokens/s, or None when none serves a sequence."""
        t = self.table
        return t.iloc[0] if len(t) and t.iloc[0]["sequences"] > 0 else None

    def summary(self) -> str:
        from neusight.api import table_formats
        from neusight.plan import _left_out_lines

        targets = "".join(f", {t}" for t in targets_text(self.max_tpot_ms, self.max_ttft_ms))
        t = self.table
        lines = [f"{self.model}: serving capacity of {self.gpus} x {self.device.name}: prompts of {self.prompt_len:,} "
                 f"tokens, {self.new_tokens:,} new tokens each, within each GPU's {self.device.memory_gib:g} GiB"
                 f"{targets}",
                 f"{len(t)} layouts (dp replicas x tp GPUs each, every replica its largest batch; "
                 f"{len(self.skipped)} left out) searched in {self.seconds:.1f} s, the most generated tokens/s first"
                 + (":" if self.batching == "static" else ", each replica batching continuously (steady state):")]
        if len(t):
            shown = t.drop(columns=["dp", "tp"])
            fmt = {**table_formats(shown.columns), "memory GiB": "{:,.1f}".format}
            with pd.option_context("display.width", 250, "display.max_columns", 50):
                lines.append(shown.to_string(index=False, formatters=fmt, na_rep="-"))
        else:
            lines.append("no layout could be searched: each is left out below")
        best = self.best
        if best is not None:
            lines.append(f"best: {best['layout']}: {best['sequences']:,} sequences at once, "
                         f"{best['generated tokens/s']:,.0f} generated tokens/s, {best['per output token ms']:,.2f} ms "
                         f"per output token, time to first token {best['time to first token ms']:,.1f} ms")
        elif len(t):
            lines.append("no layout serves a sequence within the targets")
        return "\n".join(lines + _left_out_lines(self.skipped))


def plan_serving(model: Any, device: Any, gpus: int, prompt_len: int = 128, new_tokens: int = 128, *,
                 max_tpot_ms: float | None = None, max_ttft_ms: float | None = None,
                 usd_per_gpu_hour: float | None = None, **kwargs: Any) -> ServingPlan:
    """Every ``dp x tp`` layout of ``gpus`` GPUs of ``device`` (as :func:`neusight.plan_generation` splits them),
    each replica serving its largest batch within memory and the targets (:func:`serving_capacity` with ``tp``),
    ranked by the generated tokens/s of all ``dp`` replicas together. ``usd_per_gpu_hour`` adds the cost per 1M
    generated tokens, all ``gpus`` GPUs counted; ``kwargs`` go to :func:`serving_capacity` (``dtype``,
    ``attn_implementation``, ``static_cache``, ``max_batch``, ...).

    >>> plan = plan_serving("gpt2", "l4", gpus=2, prompt_len=32, new_tokens=8, max_tpot_ms=4, max_batch=64)
    >>> sorted(plan.table["layout"]), plan.best["layout"]      # one L4 takes over 4 ms a token even for one
    (['dp 1 x tp 2', 'dp 2 x tp 1'], 'dp 1 x tp 2')
    """
    from neusight.devices import load_device
    from neusight.errors import ModelError
    from neusight.plan import _divisors, check_replica_plan

    check_replica_plan(gpus, usd_per_gpu_hour, kwargs, ("tp", "dp", "batch_size"), "plan_serving",
                       "search one replica with neusight.serving_capacity(..., tp=)")
    max_tpot_ms, max_ttft_ms = _check_target("max_tpot_ms", max_tpot_ms), _check_target("max_ttft_ms", max_ttft_ms)
    device = load_device(device)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    caps: dict[str, ServingCapacity] = {}
    skipped: dict[str, str] = {}
    errors: list[Exception] = []
    name = model if isinstance(model, str) else type(model).__name__
    for tp in _divisors(gpus):
        dp = gpus // tp
        label = f"dp {dp} x tp {tp}"
        try:
            cap = serving_capacity(model, device, prompt_len, new_tokens, max_tpot_ms=max_tpot_ms,
                                   max_ttft_ms=max_ttft_ms, tp=tp, **kwargs)
        except (InputError, ModelError) as e:
            errors.append(e)
            skipped[label] = str(e).split(". Fix:")[0]
            continue
        name, caps[label], f = cap.model, cap, cap.forecast
        row = {"layout": label, "dp": dp, "tp": tp, "sequences per replica": cap.batch_size,
               "sequences": dp * cap.batch_size, "limited by": cap.limited_by,
               "generated tokens/s": dp * cap.tokens_per_s,
               "time to first token ms": f.time_to_first_token_ms if f is not None else float("nan"),
               "per output token ms": f.time_per_output_token_ms if f is not None else float("nan"),
               "memory GiB": f.memory_peak_bytes / 2**30 if f is not None else float("nan")}
        if usd_per_gpu_hour is not None:
            from neusight.api import unit_cost

            row["USD per 1M generated tokens"] = (unit_cost(row["generated tokens/s"], "generated tokens/s",
                                                             usd_per_gpu_hour, gpus)[0] if f is not None
                                                   else float("nan"))
        rows.append(row)
    if not rows and errors:
        raise errors[0]
    return ServingPlan(name, device, gpus, prompt_len, new_tokens, max_tpot_ms, max_ttft_ms, pd.DataFrame(rows),
                       skipped, caps, time.perf_counter() - start, kwargs.get("batching", "static"))

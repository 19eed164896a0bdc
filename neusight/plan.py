"""Plan a multi-GPU run: every way ``gpus`` GPUs of one type can split a step, forecast and ranked.

A capacity planner's question is rarely "how fast is dp 2 x tp 4?" but "I have 8 H100s: which layout is fastest,
and does it fit?". :func:`plan_parallel` answers it by forecasting every layout of ``gpus`` GPUs with
:func:`neusight.parallel.predict_parallel` (whose model of the collectives, pipeline schedule and ZeRO it
inherits; nothing is fitted here):

- every ``dp x tp x pp`` with ``dp x tp x pp = gpus`` whose data-parallel replicas split the global batch (with
  ``cp`` given, of gpus / cp: each sequence over cp GPUs on every layout; with ``cp="auto"`` or a list of degrees,
  those of gpus / cp for every such cp that splits the sequence: context parallelism searched, dropped with a note
  when the model or run cannot take it, e.g. eager attention; ``cp_comm="auto"`` or a list tries each exchange,
  p2p / all_gather / a2a, on every layout with cp > 1, an exchange that cannot run a layout left out there);
- per layout, the micro-batch counts that split a replica's batch (gradient accumulation when ``pp = 1``, the
  pipeline's schedule otherwise, from ``pp`` micro-batches up: fewer only lengthen the bubble, as the first stage
  holds the activations of the whole replica batch / pp either way). With ``pp = 1`` more micro-batches only save
  memory, so the search stops at the first count that fits; with ``pp > 1`` it stops when one more count that fits
  is slower than the last;
- for a mixture-of-experts model, per layout with ``dp > 1``, every expert-parallel degree ``ep`` that divides both
  ``dp`` and every experts layer's experts (ep = 1 included: expert parallelism trades all-to-alls for memory and
  larger expert GEMMs), unless ``ep`` is given;
- in training, per layout without pipeline stages and with ``dp > 1`` (or ``cp > 1``), ZeRO stages 0-3 (1-3 trade
  collectives for memory);
- in training, activation recompute where a micro-batch count does not fit without it (not where it fits:
  recompute only adds time), unless ``gradient_checkpointing`` is given: first Megatron-LM's selective
  recomputation (only the attention cores run again in the backward pass), then, where that does not fit either,
  full recompute (Hugging Face's gradient checkpointing: every layer's forward again).

A layout is then represented by its fastest candidate that fits in the GPU's memory (else by the one that needs
the least memory). Layouts the model cannot take (attention heads that ``tp`` does not divide, more pipeline
stages than blocks, a batch that ``dp`` does not split) are left out with the reason.

Candidates with the same micro-batch size, ``tp``, ``ep``, ``cp`` and recompute share one trace and (with the
same ``cp_comm``) one single-GPU forecast and memory report (``predict_parallel``'s ``cache``; they differ in
``dp``, ``pp`` or ZeRO), so a search costs one trace per distinct (micro-batch size, tp, ep, cp, recompute). The
``recompute`` column says which: ``no``, ``selective``, ``full`` (every layer) or ``1 in n`` (every n-th layer,
when given).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from neusight.devices import Device, load_device
from neusight.errors import ContextCommError, ContextParallelError, InputError, ModelError
from neusight.graph.graph import SELECTIVE

__all__ = ["GenerationPlan", "LongestPlan", "ParallelPlan", "across", "plan_generation", "plan_max_seq_len",
           "plan_parallel", "layouts", "scaling_table"]

log = logging.getLogger(__name__)

COMM_PARTS = ("tp_comm", "ep_alltoall", "cp_comm", "pp_p2p", "dp_allreduce", "dp_gather", "embedding_allreduce")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(gpus: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, tp, pp)`` with ``dp x tp x pp = gpus``, tensor parallelism outermost in the order.

    >>> layouts(4)
    [(4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)]
    """
    return [(gpus // (tp * pp), tp, pp) for tp in _divisors(gpus) for pp in _divisors(gpus // tp)]


def _context_degrees(cp: Any, gpus: int) -> tuple[list[int], bool]:
    """``plan_parallel``'s ``cp``: the context-parallel degrees to try, and whether they are searched (a list or
    ``"auto"``: every divisor of ``gpus``) rather than given (an integer)."""
    from omegaconf import ListConfig

    fix = "Fix: cp=1, a divisor of gpus, a list of them (e.g. cp=[1,2,4]) or cp=auto (every divisor)"
    if cp == "auto":
        return _divisors(gpus), True
    values = list(cp) if isinstance(cp, (list, tuple, ListConfig)) else [cp]
    if not values or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 or gpus % c for c in values):
        raise InputError(f"cp={cp!r} is not a positive integer that divides gpus={gpus}, a list of them or 'auto' "
                         f"(each sequence over cp of the GPUs). {fix}")
    return sorted(set(values)), isinstance(cp, (list, tuple, ListConfig))


def _context_comms(cp_comm: Any, contexts: list[int]) -> list[str]:
    """``plan_parallel``'s ``cp_comm``: the context-parallel exchanges to try (``"auto"``: all of
    :data:`neusight.parallel.CP_COMMS`; a list: those)."""
    from omegaconf import ListConfig

    from neusight.parallel import CP_COMMS

    values = list(CP_COMMS) if cp_comm == "auto" else (
        list(cp_comm) if isinstance(cp_comm, (list, tuple, ListConfig)) else [cp_comm])
    if not values or any(not isinstance(v, str) or v not in CP_COMMS for v in values):
        raise InputError(f"cp_comm={cp_comm!r} is not one of {', '.join(CP_COMMS)}, a list of them or 'auto'. Fix: "
                         "e.g. cp_comm=a2a, cp_comm=[p2p,a2a] or cp_comm=auto (all three)")
    if values != ["p2p"] and contexts == [1]:
        raise InputError(f"cp_comm={cp_comm!r} chooses how the GPUs of a context-parallel group exchange attention's "
                         "inputs; cp=1 has none. Fix: cp=N, cp=auto or a list of degrees, or leave cp_comm out")
    return [c for c in CP_COMMS if c in values]


def _context_comms_of(contexts: list[int], comms: list[str], seq_len: Any, notes: list[str]) -> dict[int, list[str]]:
    """The exchanges tried with each context-parallel degree of ``contexts``: those of ``comms`` that split
    ``seq_len`` (a2a into cp parts, the others into 2 cp chunks). A pair that does not is noted in ``notes``, a
    degree with none is dropped from ``contexts`` (noted too); an error when nothing would be left."""
    from neusight.parallel import check_context_seq_len

    out: dict[int, list[str]] = {1: ["p2p"]}
    if seq_len is None and 1 in contexts and len(contexts) > 1:
        notes.append("context parallelism not searched: it splits each sequence, and this run has no seq_len")
        contexts[:] = [1]
    for c in [c for c in contexts if c > 1]:
        ok, refused = [], []
        for m in comms:
            try:
                check_context_seq_len(seq_len, c, m)
                ok.append(m)
            except InputError as e:
                refused.append((m, e))
        if ok:
            out[c] = ok
            notes += [f"cp={c} with cp_comm={m} not tried: " + str(e).split(". Fix:")[0] for m, e in refused]
        elif contexts != [c]:
            notes.append(f"cp={c} not tried: " + str(refused[0][1]).split(". Fix:")[0])
            contexts.remove(c)
        else:
            raise refused[0][1]         # nothing left to plan
    return out


def layout_label(dp: int, tp: int, pp: int, cp: int = 1) -> str:
    return f"dp {dp} x " + (f"cp {cp} x " if cp > 1 else "") + f"tp {tp} x pp {pp}"


def _check_plan(gpus: Any, batch_size: Any, microbatches: Any, ep: Any, vpp: Any, sp: Any, zero: Any,
                micro_out: str, ep_out: str, zero_out: str) -> None:
    """A plan's own arguments, each an error naming it and the fix; ``*_out``: what leaving that one out does."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise InputError(f"gpus={gpus!r} is not a positive number of GPUs. Fix: e.g. gpus=8")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size={batch_size!r} is not a positive integer. Fix: the global batch, e.g. 64")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise InputError(f"microbatches={microbatches!r} is not a positive integer. Fix: e.g. microbatches=4, or "
                         f"leave it out {micro_out}")
    if ep is not None and (not isinstance(ep, int) or isinstance(ep, bool) or ep < 1):
        raise InputError(f"ep={ep!r} is not a positive integer. Fix: e.g. ep=2, or leave it out {ep_out}")
    if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1:
        raise InputError(f"vpp={vpp!r} is not a positive integer. Fix: vpp=1 (plain 1F1B) or the interleaved model "
                         "chunks per pipeline GPU, e.g. vpp=2")
    if not isinstance(sp, bool):
        raise InputError(f"sp={sp!r} is not true or false. Fix: sp=true (sequence parallelism where tp > 1) or "
                         "sp=false")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise InputError(f"zero={zero!r} is not a ZeRO stage. Fix: 0, 1, 2 or 3, or leave it out {zero_out}")


def _leave_out(err: Exception, label: str, contexts: list[int], notes: list[str], skipped: dict[str, str],
               errors: list[Exception]) -> bool:
    """A layout a plan could not forecast: when the model or run refuses context parallelism whatever the layout
    (a :class:`ContextParallelError` while cp = 1 is searched too), cp > 1 is dropped from the search with a note
    (``contexts``, and the cp layouts in ``skipped``, edited in place: the layouts' loop reads them) and True is
    returned; otherwise the layout is left out with the reason."""
    if isinstance(err, ContextParallelError) and len(contexts) > 1 and 1 in contexts:
        notes.append("context parallelism not searched: " + str(err).split(". Fix:")[0])
        log.info("%s", notes[-1])
        contexts[:] = [1]
        for k in [k for k in skipped if " x cp " in k]:
            del skipped[k]
        return True
    errors.append(err)
    skipped[label] = str(err).split(". Fix:")[0]
    log.info("%s: left out (%s)", label, skipped[label])
    return False


def _pop_overlaps(kwargs: dict[str, Any]) -> dict[str, bool]:
    """A plan's ``overlap_grad_reduce`` / ``overlap_param_gather``, taken out of ``kwargs`` (applied per layout, where
    they can run) and checked to be true or false."""
    overlap = {k: kwargs.pop(k, False) for k in ("overlap_grad_reduce", "overlap_param_gather")}
    for k, v in overlap.items():
        if not isinstance(v, bool):
            raise InputError(f"{k}={v!r} is not true or false. Fix: {k}=true (on the layouts with dp > 1"
                             + (", with a ZeRO stage" if k == "overlap_param_gather" else "") + ") or leave it out")
    return overlap


def _split_layouts(gpus: int, contexts: list[int], batch_size: int, ep: int | None,
                   skipped: dict[str, str]) -> Any:
    """Every layout (label, dp, cp, tp, pp) of ``gpus`` GPUs for the context-parallel degrees of ``contexts`` (read
    as the caller's loop goes on: a degree it drops is not tried further) whose ``dp`` replicas split the global
    ``batch_size`` and whose dp a given ``ep`` divides; the others noted in ``skipped`` with the reason."""
    for dp, cp, tp, pp in [(dp, c, tp, pp) for c in list(contexts) for dp, tp, pp in layouts(gpus // c)]:
        if cp not in contexts:
            continue            # context parallelism dropped from the search
        label = layout_label(dp, tp, pp, cp)
        if batch_size % dp:
            skipped[label] = f"the global batch {batch_size} does not split into dp replicas"
        elif ep is not None and dp % ep:
            skipped[label] = f"ep={ep} does not divide dp"
        else:
            yield label, dp, cp, tp, pp


@dataclass
class ParallelPlan:
    """The layouts of ``gpus`` GPUs for one run, forecast: ``candidates`` has a row per forecast (layout,
    micro-batches, expert parallelism, interleaving, ZeRO stage, recompute), :attr:`table` one per layout (its best
    candidate),
    fastest that fits first."""

    model: str
    device: Device
    mode: str
    gpus: int
    batch_size: int                      # global batch
    seq_len: int | None
    unit: str                            # tokens/s, images/s or samples/s
    candidates: pd.DataFrame
    skipped: dict[str, str]              # layout label -> why it was left out
    notes: tuple[str, ...] = field(default_factory=tuple)   # the best candidate's forecast notes
    seconds: float = 0.0                 # wall time of the search

    @property
    def table(self) -> pd.DataFrame:
        """One row per layout: its fastest candidate that fits (else its smallest in memory); the layouts that fit
        first, each group fastest first, with ``rank`` and ``time vs best`` (against the fastest that fits)."""
        c = self.candidates
        if c.empty:
            return c
        best = [g[g["fits"]].sort_values("ms", kind="stable").iloc[0] if g["fits"].any()
                else g.sort_values("memory GiB", kind="stable").iloc[0]
                for _, g in c.assign(fits=c["fits"].astype(bool)).groupby("layout", sort=False)]
        return _ranked(pd.DataFrame(best), "ms")

    @property
    def best(self) -> pd.Series | None:
        """The fastest candidate that fits in memory, or None when none does."""
        return _best_row(self.table)

    def summary(self) -> str:
        """The run, the layouts ranked, the best one against plain data parallelism, and what was left out."""
        t = self.table
        per = f", seq {self.seq_len}" if self.seq_len else ""
        c = self.candidates
        degrees = bool(len(t)) and c["cp"].nunique() > 1
        exchanges = bool(len(t)) and c.loc[c["cp"] > 1, "cp comm"].nunique() > 1
        searched = (", expert-parallel degrees" if len(t) and c["ep"].nunique() > 1 else "") + (
            ", context-parallel degrees" + (", their exchanges" if exchanges else "") if degrees else
            ", context-parallel exchanges" if exchanges else "") + (
            ", ZeRO stages, recompute where needed" if self.mode == "training" else "")
        lines = [f"{self.model}: {self.mode}, global batch {self.batch_size}{per} on {self.gpus} x {self.device.name}",
                 f"{len(t)} layouts of {self.gpus} GPUs forecast ({len(self.candidates)} candidates: micro-batch "
                 f"counts{searched}; "
                 f"{len(self.skipped)} layout{'s' if len(self.skipped) != 1 else ''} left out) in "
                 f"{self.seconds:.1f} s; each layout's best candidate, those that fit in {self.device.memory_gib:g} "
                 "GiB first:"]
        lines += _ranking_lines(t, _unused_columns(t), "a smaller global batch, or half precision (dtype= / amp=)")
        best = _best_row(t)
        if best is not None:
            lines.append(f"best: {_describe(best)}: {best['ms']:,.2f} ms a step ({best[self.unit]:,.0f} "
                         f"{self.unit}), {best['memory GiB']:,.1f} GiB per GPU")
            plain = t[(t["tp"] == 1) & (t["pp"] == 1) & (t["cp"] == 1)]
            if len(plain) and plain.iloc[0]["layout"] != best["layout"]:
                p = plain.iloc[0]
                lines.append(f"plain data parallelism ({_describe(p)}): "
                             + (f"{p['ms'] / best['ms']:.2f}x the best's time" if p["fits"] == "yes" else
                                f"does not fit ({p['memory GiB']:,.1f} GiB per GPU)"))
        return "\n".join(lines + _left_out_lines(self.skipped) + [f"note: {n}" for n in self.notes])


def _unused_columns(t: pd.DataFrame) -> list[str]:
    """A plan's table columns its text leaves out: the layout label (dp / cp / tp / pp say it), and expert
    parallelism, interleaving, context parallelism (with its exchange) and sequence parallelism where no layout
    uses them (a model without experts; given, not searched)."""
    hidden = ["layout"] + [k for k in ("ep", "vpp", "cp") if len(t) and (t[k] == 1).all()]
    hidden += ["cp comm"] if "cp" in hidden else []
    return hidden + (["sp"] if len(t) and (t["sp"] == "no").all() else [])


def _ranked(table: pd.DataFrame, key: str) -> pd.DataFrame:
    """``table`` (one row per layout, with ``fits`` and the time column ``key``) ordered as a plan shows it: the
    layouts that fit first, each group fastest first; ``rank`` first, ``time vs best`` (against the fastest that
    fits) after ``key``, ``fits`` as yes / no."""
    t = table.assign(_order=~table["fits"].astype(bool)).sort_values(["_order", key], kind="stable")
    t = t.drop(columns="_order").reset_index(drop=True)
    fitting = t.loc[t["fits"].astype(bool), key]
    ref = float(fitting.min()) if len(fitting) else float(t[key].min())
    t.insert(t.columns.get_loc(key) + 1, "time vs best", t[key] / ref)
    t.insert(0, "rank", range(1, len(t) + 1))
    t["fits"] = t["fits"].map({True: "yes", False: "no"})
    return t


def _ranking_lines(t: pd.DataFrame, hidden: list[str], fix: str) -> list[str]:
    """A plan's ranked :attr:`table` ``t`` as text (without the ``hidden`` columns), or why there is none, and what
    to ``fix`` when no layout fits."""
    from neusight.api import table_formats

    if not len(t):
        return ["no layout could be forecast: each is left out below"]
    shown = t.drop(columns=hidden)
    fmt = {**table_formats(shown.columns), "memory GiB": "{:,.1f}".format}
    with pd.option_context("display.width", 250, "display.max_columns", 50):
        lines = [shown.to_string(index=False, formatters=fmt)]
    if _best_row(t) is None:
        lines.append(f"no layout fits in memory; the smallest need: {t['memory GiB'].min():,.1f} GiB per GPU "
                     f"({t.iloc[t['memory GiB'].argmin()]['layout']}). Try more GPUs (gpus=), {fix}")
    return lines


def _left_out_lines(skipped: dict[str, str]) -> list[str]:
    """The layouts left out, grouped by the reason."""
    import textwrap

    groups: dict[str, list[str]] = {}
    for label, why in skipped.items():
        groups.setdefault(why, []).append(label)
    return [textwrap.fill(f"left out ({len(v)}): {', '.join(v)}: {why}", width=116, subsequent_indent="  ")
            for why, v in groups.items()]


def _best_row(table: pd.DataFrame) -> pd.Series | None:
    """The first row of a plan's :attr:`ParallelPlan.table` when it fits in memory (the table puts those first)."""
    return table.iloc[0] if len(table) and table.iloc[0]["fits"] == "yes" else None


def recompute_label(ckpt: Any) -> str:
    """A trace's ``gradient_checkpointing`` as the plans' ``recompute`` column says it."""
    if not ckpt:
        return "no"
    return ckpt if ckpt == SELECTIVE else "full" if ckpt is True else f"1 in {int(ckpt)}"


def _describe(row: pd.Series) -> str:
    m = int(row["micro-batches"])
    return (row["layout"] + (f", ep {int(row['ep'])}" if row["ep"] > 1 else "")
            + (f", interleaved ({int(row['vpp'])} chunks per GPU)" if row["vpp"] > 1 else "")
            + (", sequence parallelism" if row["sp"] == "yes" else "")
            + (f", cp_comm {row['cp comm']}" if row["cp"] > 1 else "")
            + f", {m} micro-batch{'es' if m > 1 else ''} per replica"
            + (f", ZeRO stage {int(row['zero'])}" if row["zero"] else "")
            + (f", {row['recompute']} activation recompute" if row["recompute"] != "no" else ""))


def plan_parallel(model: Any, device: Device | str, gpus: int, batch_size: int, seq_len: int | None = None,
                  mode: str = "training", *, microbatches: int | None = None, zero: int | None = None,
                  ep: int | None = None, vpp: int = 1, sp: bool = False, cp: int | str | list[int] = 1,
                  optimizer: str | None = "adamw",
                  usd_per_gpu_hour: float | None = None, **kwargs: Any) -> ParallelPlan:
    """Forecast every layout of ``gpus`` GPUs of ``device`` for one step of ``model`` at global ``batch_size``
    and rank them (module docstring: which candidates are tried).

    Parameters
    ----------
    microbatches : int, optional
        Keep this micro-batch count per replica instead of searching them.
    zero : int, optional
        Keep this ZeRO stage (0: none) where it applies (training, ``dp > 1``, ``pp = 1``) instead of searching
        0-3; layouts it cannot apply to run without.
    ep : int, optional
        Keep this expert-parallel degree of a mixture-of-experts model (layouts whose ``dp`` it does not divide are
        left out) instead of searching those that divide ``dp`` and the experts (1 for a model without experts,
        with ``megatron=True`` or ``lora_rank``, which expert parallelism is not modelled with).
    vpp : int
        Interleaved model chunks per GPU on the layouts with pipeline stages (Megatron-LM's interleaved schedule;
        layouts it does not fit are left out; 1: plain 1F1B). Not searched: the forecast shrinks the bubble as 1 /
        vpp and charges only the added point-to-point transfers, so it would always pick the most chunks, while the
        per-chunk overheads of a real run are not modelled.
    sp : bool
        Megatron-LM's sequence parallelism on the layouts with tensor parallelism (``sp`` column). Not searched:
        the forecast has it save memory and time at no cost (the same collective volume), so it is on or off as
        given.
    cp : int, "auto" or list of int
        Context parallelism (:func:`neusight.parallel.predict_parallel`'s ``cp``): each sequence over ``cp`` GPUs,
        the layouts those of gpus / cp sequence groups (``cp`` column; ZeRO over dp x cp). An integer applies to
        every layout; a list searches those degrees (each must divide ``gpus``), ``"auto"`` every divisor of
        ``gpus``. A searched degree that does not split ``seq_len`` is not tried, and context parallelism is
        dropped from the search (both with a note) when the model or run cannot take it at all (eager attention,
        explicit masks, sliding windows, ``megatron=True``, a KV cache).
    cp_comm : str or list of str, optional (in ``kwargs``)
        How the GPUs of a context-parallel group exchange attention's inputs (``predict_parallel``'s ``cp_comm``)
        on every layout with cp > 1, or, as ``"auto"`` or a list, each of those exchanges tried there (``cp comm``
        column); one that does not split ``seq_len`` or cannot run a layout (Ulysses' all-to-all over more GPUs than
        the key / value heads) is left out with a note.
    overlap_grad_reduce, overlap_param_gather : bool, optional (in ``kwargs``)
        The gradients' reduction overlapped with the backward pass on the layouts with data-parallel replicas, ZeRO's
        parameter gathers with the compute on the candidates with a ZeRO stage
        (:func:`neusight.parallel.predict_parallel`); as given, not searched (the forecast has them cost nothing).
    optimizer : str, optional
        The training step's optimizer (its state counts against the memory); None: no step.
    gradient_checkpointing : bool, int or "selective", optional (in ``kwargs``)
        Keep it on (or off, or selective) everywhere instead of trying activation recompute where nothing fits
        without it.
    usd_per_gpu_hour : float, optional
        Adds the cost per 1M tokens (images, samples) of every candidate, all ``gpus`` GPUs counted.
    **kwargs
        As for :func:`neusight.parallel.predict_parallel` (head, predictor, fused, megatron, tf32,
        gpus_per_node, internode_gbps, nics_per_node, attn_implementation, dtype, amp, ...).

    Examples
    --------
    >>> plan = plan_parallel("gpt2", "h100-sxm5-80gb", gpus=4, batch_size=8, seq_len=128)
    >>> sorted({(r.dp, r.tp, r.pp) for r in plan.table.itertuples()}) == sorted(layouts(4))
    True
    """
    from neusight.parallel import predict_parallel

    _check_plan(gpus, batch_size, microbatches, ep, vpp, sp, zero, "to search the counts",
                "to search the expert-parallel degrees", "to search them")
    contexts, _ = _context_degrees(cp, gpus)
    comms = _context_comms(kwargs.pop("cp_comm", "p2p"), contexts)
    if "cache" in kwargs:
        raise InputError("cache= is plan_parallel's own. Fix: leave it out")
    overlap = _pop_overlaps(kwargs)
    if usd_per_gpu_hour is not None:
        from neusight.api import check_price

        check_price(usd_per_gpu_hour, "usd_per_gpu_hour")      # before any forecast, not once per layout
    device = load_device(device)
    training = mode == "training"
    start = time.perf_counter()
    cache: dict = {}
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    errors: list[Exception] = []
    notes_extra: list[str] = []
    searching = training and kwargs.get("gradient_checkpointing") is None   # recompute tried where needed
    recomputes: list[Any] = [SELECTIVE, True]                                 # the kinds tried, in this order
    if searching:
        kwargs.pop("gradient_checkpointing", None)
    state: dict[str, Any] = {"best_ms": math.inf, "notes": (), "unit": "samples/s", "seq": seq_len,
                             "name": model if isinstance(model, str) else type(model).__name__}

    comms_of = _context_comms_of(contexts, comms, seq_len, notes_extra)    # cp -> its exchanges tried
    comm_skips: dict[str, list[str]] = {}      # an exchange's reason -> the layouts it was left out on
    experts = _experts_gcd(model, kwargs) if ep is None else 0
    attention_saved: dict[int, float] = {}     # per trace: bytes its attention modules save for backward
    kept: dict[int, tuple] = {}                # per candidate row: its memory, trace and activations in flight

    def degrees(dp: int, cp: int) -> list[int]:
        """The expert-parallel degrees tried on ``dp`` replicas (none with context parallelism)."""
        if ep is not None:
            return [ep]
        return [e for e in _divisors(dp) if experts % e == 0] if experts and cp == 1 else [1]

    def candidates(label: str, dp: int, cp: int, tp: int, pp: int, m: int, stages: list[int],
                   ckpt: Any) -> list[dict]:
        out: list[dict] = []
        refused = None
        for comm in comms_of[cp]:
            try:
                out += [candidate(label, dp, cp, tp, pp, m, z, ckpt, e, vpp if pp > 1 else 1, comm)
                        for e in degrees(dp, cp) for z in stages]
            except ContextCommError as err:      # this exchange cannot run the layout; the others may
                if len(comms_of[cp]) == 1:
                    raise
                refused = err
                labels = comm_skips.setdefault(str(err).split(". Fix:")[0], [])
                labels += [] if label in labels else [label]
        if refused is not None and not out:
            raise refused
        return out

    def candidate(label: str, dp: int, cp: int, tp: int, pp: int, m: int, z: int, ckpt: Any, e: int,
                  v: int, comm: str) -> dict[str, Any]:
        extra = {"gradient_checkpointing": ckpt} if searching else {}
        p = predict_parallel(model, device, batch_size, seq_len, mode, dp=dp, tp=tp, pp=pp, microbatches=m, zero=z,
                             ep=e, vpp=v, sp=sp and tp > 1, cp=cp, cp_comm=comm,
                             optimizer=optimizer if training else None, cache=cache,
                             overlap_grad_reduce=overlap["overlap_grad_reduce"] and training and dp * cp > 1,
                             overlap_param_gather=overlap["overlap_param_gather"] and z > 0, **extra, **kwargs)
        unit = state["unit"] = p.per_gpu.throughput[1]
        state["name"], state["seq"] = p.model, p.seq_len
        done = batch_size * (p.seq_len if unit == "tokens/s" and p.seq_len else 1)
        parts = p.parts
        row = {"layout": label, "dp": dp, "cp": cp, "cp comm": comm if cp > 1 else "-", "tp": tp, "pp": pp,
               "ep": e, "vpp": v,
               "sp": "yes" if sp and tp > 1 else "no", "micro-batches": m, "zero": z,
               "recompute": recompute_label(p.per_gpu.graph.gradient_checkpointing),
               "ms": p.latency_ms, unit: done / p.latency_ms * 1e3, "MFU %": 100 * p.efficiency.mfu,
               "memory GiB": (p.memory_peak_bytes or 0.0) / 2**30, "fits": bool(p.memory_fits),
               "compute ms": parts["compute"], "communication ms": sum(parts[k] for k in COMM_PARTS),
               "bubble ms": parts["pp_bubble"], "optimizer ms": parts["optimizer"]}
        if usd_per_gpu_hour is not None:
            from neusight.api import unit_cost

            usd, per = unit_cost(done / p.latency_ms * 1e3, unit, usd_per_gpu_hour, gpus)
            row[f"USD per {per}"] = usd
        if row["fits"] and p.latency_ms < state["best_ms"]:
            state["best_ms"], state["notes"] = p.latency_ms, tuple(p.notes)
        # at the most activations in flight (1; interleaved: 1 + (pp - 1) / (pp vpp), as predict_parallel counts)
        kept[id(row)] = (p.memory_peak_bytes or 0.0, p.per_gpu.graph, 1.0 + (pp - 1) / (pp * v) if v > 1 else 1.0)
        return row

    def selective_may_fit(plain: list[dict[str, Any]]) -> bool:
        """Whether selective recompute could bring one of the ``plain`` candidates under the GPU's memory: at most
        every byte the trace's attention modules save for backward goes."""
        for r in plain:
            peak, g, in_flight = kept[id(r)]
            if id(g) not in attention_saved:
                attention_saved[id(g)] = _attention_saved_bytes(g)
            if peak - attention_saved[id(g)] * in_flight <= device.memory_bytes:
                return True
        return False

    for label, dp, cp, tp, pp in _split_layouts(gpus, contexts, batch_size, ep, skipped):
        replica = batch_size // dp
        counts = [microbatches] if microbatches is not None else _divisors(replica)
        if microbatches is None and pp > 1:     # fewer micro-batches than stages: a longer bubble, no less memory
            counts = [m for m in counts if m >= pp] or [replica]
            if vpp > 1:                         # the interleaved schedule wants a multiple of pp
                counts = [m for m in counts if m % pp == 0] or counts
        if replica % counts[0]:
            skipped[label] = f"microbatches={microbatches} does not split a replica's batch"
            continue
        stages = ([zero] if zero is not None else [0, 1, 2, 3]) if training and dp * cp > 1 and pp == 1 else [0]
        last_fit, recompute_fit = math.inf, False
        try:
            for m in counts:
                plain = candidates(label, dp, cp, tp, pp, m, stages, False)
                rows += plain
                tried = plain
                again = []
                if searching and not any(r["fits"] for r in plain) and not (pp == 1 and recompute_fit):
                    for how in list(recomputes):    # selective, then full, where nothing fits without
                        if how == SELECTIVE and not selective_may_fit(plain):
                            continue    # even without the attention cores' activations none would fit
                        try:
                            more = candidates(label, dp, cp, tp, pp, m, stages, how)
                        except InputError as e:
                            if "gradient_checkpointing" not in str(e):
                                raise
                            recomputes.remove(how)
                            notes_extra.append(f"{recompute_label(how)} activation recompute not searched: "
                                               + str(e).split(". Fix:")[0])
                            continue
                        again += more
                        if any(r["fits"] for r in more):
                            break
                    searching = bool(recomputes)
                    rows += again
                    tried = plain + again
                    recompute_fit = recompute_fit or any(r["fits"] for r in again)
                fit_ms = min((r["ms"] for r in tried if r["fits"]), default=math.inf)
                if any(r["fits"] for r in plain) and pp == 1 or fit_ms < math.inf and fit_ms > last_fit:
                    break           # pp = 1: more micro-batches only add time; pp > 1: past the fastest count
                last_fit = min(last_fit, fit_ms)
        except (InputError, ModelError) as e:
            rows = [r for r in rows if r["layout"] != label]
            if _leave_out(e, label, contexts, notes_extra, skipped, errors):
                rows = [r for r in rows if r["cp"] == 1]
            continue
        mine = [r for r in rows if r["layout"] == label]
        fits = [r["ms"] for r in mine if r["fits"]]
        log.info("%s: %d candidates, %s", label, len(mine),
                 f"fastest that fits {min(fits):,.2f} ms" if fits else "none fits")
    if not rows and errors:
        raise errors[0]
    notes_extra += [f"{why} (left out on {', '.join(labels)})" for why, labels in comm_skips.items()
                    if any(r["layout"] in labels for r in rows)]
    return ParallelPlan(state["name"], device, mode, gpus, batch_size, state["seq"], state["unit"], pd.DataFrame(rows),
                        skipped, tuple(state["notes"]) + tuple(notes_extra), time.perf_counter() - start)


@dataclass
class LongestPlan:
    """The longest sequence each layout of ``gpus`` GPUs holds for one run (:func:`plan_max_seq_len`):
    ``candidates`` has a row per layout and context-parallel exchange tried, :attr:`table` one per layout (its
    longest, then fastest), longest first."""

    model: str
    device: Device
    mode: str
    gpus: int
    batch_size: int                      # global batch
    max_positions: int                   # the search's upper end (the model's positions, or max_seq_len)
    step: int                            # tokens per GPU of a sequence: multiples of this are searched
    candidates: pd.DataFrame
    skipped: dict[str, str]              # layout label -> why it was left out
    notes: tuple[str, ...] = field(default_factory=tuple)
    seconds: float = 0.0
    forecasts: int = 0                   # memory probes (forecasts) the search made

    @property
    def table(self) -> pd.DataFrame:
        """One row per layout, its longest sequence (a tie: its fastest exchange); the longest first, ties fastest
        first, with ``rank``."""
        c = self.candidates
        if c.empty:
            return c
        t = c.sort_values(["max seq_len", "ms"], ascending=[False, True], kind="stable", na_position="last")
        t = t.drop_duplicates("layout").reset_index(drop=True)
        t.insert(0, "rank", range(1, len(t) + 1))
        return t

    @property
    def best(self) -> pd.Series | None:
        """The layout that holds the longest sequence (the fastest of those that hold as long), None when no layout
        holds even ``step`` tokens per GPU."""
        t = self.table
        return t.iloc[0] if len(t) and t.iloc[0]["max seq_len"] > 0 else None

    def summary(self) -> str:
        t = self.table
        lines = [f"{self.model}: {self.mode}, global batch {self.batch_size} on {self.gpus} x {self.device.name}: the "
                 f"longest sequence each layout holds in {self.device.memory_gib:g} GiB per GPU (multiples of "
                 f"{self.step} tokens per GPU, up to {self.max_positions:,} positions)",
                 f"{len(t)} layouts searched ({self.forecasts} forecasts; {len(self.skipped)} layout"
                 f"{'s' if len(self.skipped) != 1 else ''} left out) in {self.seconds:.1f} s; each with what holds "
                 "the most: " + ", ".join(_frugal(self.mode, t, self.batch_size)) + "; the time is a step at that "
                 "length:"]
        if not len(t):
            lines.append("no layout could be forecast: each is left out below")
        else:
            from neusight.api import table_formats

            shown = t.drop(columns=_unused_columns(t))
            fmt = {**table_formats(shown.columns), "memory GiB": "{:,.1f}".format, "max seq_len": "{:,}".format}
            with pd.option_context("display.width", 250, "display.max_columns", 50):
                lines.append(shown.to_string(index=False, formatters=fmt))
        best = self.best
        if best is not None:
            lines.append(f"longest: {_describe(best)}: {int(best['max seq_len']):,} tokens, {best['ms']:,.2f} ms a "
                         f"step ({best['tokens/s']:,.0f} tokens/s), {best['memory GiB']:,.1f} GiB per GPU")
        elif len(t):
            lines.append(f"no layout holds {self.step} tokens per GPU; the smallest need: "
                         f"{t['memory GiB'].min():,.1f} GiB per GPU. Try more GPUs (gpus=), a smaller global batch, "
                         "or half precision (dtype= / amp=)")
        return "\n".join(lines + _left_out_lines(self.skipped) + [f"note: {n}" for n in self.notes])


def _frugal(mode: str, t: pd.DataFrame, batch_size: int) -> list[str]:
    """What a :class:`LongestPlan`'s layouts ran with, as the summary says it."""
    out = [] if mode != "training" or not len(t) else (
        ([f"ZeRO stage {int(t['zero'].max())} where dp x cp > 1 and pp = 1"] if t["zero"].max() > 0 else [])
        + [f"{r} activation recompute" for r in t["recompute"].unique() if r != "no"])
    one = len(t) and (t["micro-batches"] * t["dp"] == batch_size).all()
    return out + ["micro-batches of one sequence" if one else "the micro-batches given"]


def plan_max_seq_len(model: Any, device: Device | str, gpus: int, batch_size: int, mode: str = "training", *,
                     step: int = 64, max_seq_len: int | None = None, microbatches: int | None = None,
                     zero: int | None = None, ep: int | None = None, vpp: int = 1, sp: bool = False,
                     cp: int | str | list[int] = 1, optimizer: str | None = "adamw", **kwargs: Any) -> LongestPlan:
    """The longest sequence each layout of ``gpus`` GPUs of ``device`` holds in memory at global ``batch_size``,
    and how long a step at that length takes: a capacity planner's "how long a context can 8 H100s train, and
    how?".

    The layouts are :func:`plan_parallel`'s (``dp x cp x tp x pp``, ``cp`` and ``cp_comm`` given or searched
    the same way), each run with what holds the most, unless given: one sequence per micro-batch (``microbatches``
    = a replica's batch), in training full activation recompute (``gradient_checkpointing``) and ZeRO stage 3
    where it applies (dp x cp > 1, no pipeline), the most expert-parallel GPUs a mixture-of-experts model takes;
    ``sp`` and ``vpp`` as given. Each layout's search (:func:`neusight.memory.largest_within` over multiples of
    ``step`` tokens per GPU, the whole sequence ``cp`` times as long) probes the memory of
    :func:`neusight.parallel.predict_parallel`, the model the plans' ``fits`` column reads; the first probes, at
    1/8 and 1/2 of ``max_seq_len`` (default: the model's positions), are shared by the layouts whose GPUs hold the
    same micro-batch (one trace). Layouts the model cannot take are left out with the reason, as in
    :func:`plan_parallel`; ``**kwargs`` as there.
    """
    from neusight.parallel import find_max_parallel, sequence_model

    _check_plan(gpus, batch_size, microbatches, ep, vpp, sp, zero, "(one sequence per micro-batch)",
                "(the most the model takes)", "(3 where it applies)")
    if "cache" in kwargs or "seq_len" in kwargs:
        raise InputError(f"{'cache' if 'cache' in kwargs else 'seq_len'}= is plan_max_seq_len's own (it searches "
                         "the sequence length). Fix: leave it out; max_seq_len= bounds the search")
    built = sequence_model(model, step, kwargs)
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool)
                                    or not 0 < max_seq_len <= (built.max_seq_len or max_seq_len)):
        raise InputError(f"max_seq_len={max_seq_len!r} is not a positive number of positions within "
                         f"{built.name}'s {built.max_seq_len or 'unbounded'}. Fix: e.g. max_seq_len=32768, or leave "
                         "it out to search up to the model's positions")
    positions = max_seq_len or built.max_seq_len or 1 << 20
    contexts, _ = _context_degrees(cp, gpus)
    comms = _context_comms(kwargs.pop("cp_comm", "p2p"), contexts)
    device = load_device(device)
    training = mode == "training"
    overlap = _pop_overlaps(kwargs)
    ckpt = kwargs.pop("gradient_checkpointing", None)
    chosen = ckpt is None and training        # full recompute unless given (and the model takes it)
    ckpt = True if chosen else ckpt
    start = time.perf_counter()
    notes: list[str] = []
    grain = step * math.lcm(*contexts)      # a multiple of 2 x every cp: each exchange splits it
    comms_of = _context_comms_of(contexts, comms, grain, notes)
    experts = _experts_gcd(model, kwargs) if ep is None else 0
    shared: dict = {}              # the first probes' forecasts, kept for the layouts that share them
    anchors = sorted({max(grain, positions // k // grain * grain) for k in (8, 2)})
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    errors: list[Exception] = []
    comm_skips: dict[str, list[str]] = {}      # an exchange's reason -> the layouts it was left out on
    state: dict[str, Any] = {"forecasts": 0, "name": built.name}

    def search(label: str, dp: int, cp: int, tp: int, pp: int, m: int, z: int, e: int, v: int,
               comm: str) -> dict[str, Any]:
        extra = {"gradient_checkpointing": ckpt} if ckpt is not None else {}
        found = find_max_parallel(model, device, "seq_len", batch_size, None, mode, step=step, limit=positions,
                                  start=anchors, cache=shared, dp=dp, tp=tp, pp=pp, microbatches=m, zero=z, ep=e,
                                  vpp=v, sp=sp and tp > 1, cp=cp, cp_comm=comm,
                                  optimizer=optimizer if training else None,
                                  overlap_grad_reduce=overlap["overlap_grad_reduce"] and training and dp * cp > 1,
                                  overlap_param_gather=overlap["overlap_param_gather"] and z > 0, **extra, **kwargs)
        state["forecasts"] += found.forecasts
        p, seq = found.prediction, found.value
        state["name"] = p.model
        return {"layout": label, "dp": dp, "cp": cp, "cp comm": comm if cp > 1 else "-", "tp": tp, "pp": pp,
                "ep": e, "vpp": v, "sp": "yes" if sp and tp > 1 else "no", "micro-batches": m, "zero": z,
                "recompute": recompute_label(p.per_gpu.graph.gradient_checkpointing), "max seq_len": seq,
                "limited by": "positions" if seq + step * cp > positions else "memory",
                "ms": p.latency_ms if seq else math.nan,
                "tokens/s": batch_size * seq / p.latency_ms * 1e3 if seq else math.nan,
                "memory GiB": (p.memory_peak_bytes or 0.0) / 2**30}

    for label, dp, cp, tp, pp in _split_layouts(gpus, contexts, batch_size, ep, skipped):
        if step * cp > positions:
            skipped[label] = f"{step} tokens on each of cp={cp} GPUs exceed the {positions:,} positions"
            continue
        replica = batch_size // dp
        m = microbatches if microbatches is not None else replica
        if replica % m:
            skipped[label] = f"microbatches={microbatches} does not split a replica's batch"
            continue
        z = (3 if zero is None else zero) if training and dp * cp > 1 and pp == 1 else 0
        e = ep if ep is not None else max([d for d in _divisors(dp) if experts % d == 0] if experts and cp == 1
                                          else [1])
        mine: list[dict[str, Any]] = []
        refused: list[ContextCommError] = []        # exchanges that cannot run the layout; the others may
        try:
            for comm in comms_of[cp]:
                try:
                    mine.append(search(label, dp, cp, tp, pp, m, z, e, vpp if pp > 1 else 1, comm))
                except ContextCommError as err:
                    refused.append(err)
                except InputError as err:
                    if not (chosen and ckpt and "gradient_checkpointing" in str(err)):
                        raise
                    notes.append("activation recompute not used: " + str(err).split(". Fix:")[0])
                    ckpt = None       # the model takes none: every layout runs without
                    mine.append(search(label, dp, cp, tp, pp, m, z, e, vpp if pp > 1 else 1, comm))
            if not mine:
                raise refused[-1]
        except (InputError, ModelError) as err:
            _leave_out(err, label, contexts, notes, skipped, errors)
            continue
        rows += mine
        for err in refused:
            comm_skips.setdefault(str(err).split(". Fix:")[0], []).append(label)
        log.info("%s: %s", label, ", ".join(f"{r['max seq_len']:,} tokens" for r in mine))
    if not rows and errors:
        raise errors[0]
    notes += [f"{why} (left out on {', '.join(labels)})" for why, labels in comm_skips.items()]
    return LongestPlan(state["name"], device, mode, gpus, batch_size, positions, step, pd.DataFrame(rows), skipped,
                       tuple(notes), time.perf_counter() - start, state["forecasts"])


def across(plans: list[ParallelPlan] | list[GenerationPlan]) -> list[str]:
    """Across plans of one run (several GPU types or counts): the fastest best layout that fits and, when the plans
    are priced, the cheapest; no line for fewer than two plans or when nothing fits."""
    fitting = [(p, p.best) for p in plans if p.best is not None]
    if len(plans) < 2 or not fitting:
        return []
    key = "ms" if isinstance(plans[0], ParallelPlan) else "total ms"
    what = "a step" if key == "ms" else "the whole generate() call"

    def named(p: Any, row: pd.Series) -> str:
        return f"{p.gpus} x {p.device.key} as {row['layout']}" + (
            f" ({row['cp comm']})" if row.get("cp comm", "-") != "-" else "")

    p, row = min(fitting, key=lambda f: f[1][key])
    lines = [f"fastest of the {len(plans)} plans: {named(p, row)}: {row[key]:,.2f} ms {what}"]
    price = next((c for c in row.index if c.startswith("USD per ")), None)
    if price is not None:
        p, row = min(fitting, key=lambda f: f[1][price])
        lines.append(f"cheapest: {named(p, row)}: {row[price]:,.4g} USD per {price.removeprefix('USD per ')} "
                     f"({row[key]:,.2f} ms {what})")
    return lines


def _attention_saved_bytes(g: Any) -> float:
    """Bytes a trace's attention modules (a module path's last name with "attn" or "attention") save for the
    backward pass themselves: an upper bound of what selective recompute frees, as the attention core it checkpoints
    runs inside such a module (its projections are child modules: counted or not, the bound holds)."""
    from neusight.memory import saved_activations

    saved = saved_activations(g)
    last = saved.index.to_series().str.rsplit(".", n=1).str[-1]
    return float(saved[last.str.contains(r"attn|attention", case=False).to_numpy()].sum())


def _experts_gcd(model: Any, kwargs: dict[str, Any]) -> int:
    """The greatest common divisor of the experts of ``model``'s experts layers, which every expert-parallel degree
    must divide; 0 for a model without experts and for runs expert parallelism is not modelled with (Megatron-LM's
    kernels, LoRA)."""
    from neusight.graph.models import build_model
    from neusight.parallel import experts_layers

    if kwargs.get("megatron") or kwargs.get("lora_rank") is not None:
        return 0
    built = build_model(model, head=kwargs.get("head"), input_shapes=kwargs.get("input_shapes"),
                        image_size=kwargs.get("image_size"))
    return math.gcd(*(n for _, _, n in experts_layers(built.module)))


def scaling_table(plans: list[ParallelPlan]) -> pd.DataFrame:
    """How a run scales over the GPU counts of ``plans`` (one device, one run, in the order given): each count's
    best layout, its time and throughput, the ``speed-up`` over the first count whose run fits and the
    ``efficiency`` (speed-up / GPU-count ratio; 1 = linear scaling). A count where nothing fits has no time."""
    rows = []
    for plan in plans:
        best = plan.best
        row: dict[str, Any] = {"gpus": plan.gpus}
        if best is None:
            row.update({"layout": "none fits", "ms": math.nan, plan.unit: math.nan})
        else:
            row.update({k: best[k] for k in ("layout", "cp comm", "ep", "vpp", "micro-batches", "zero", "recompute",
                                               "ms", plan.unit, "memory GiB")})
            row.update({k: best[k] for k in best.index if k.startswith("USD per")})
        rows.append(row)
    table = pd.DataFrame(rows)
    for k, off in (("ep", 1), ("vpp", 1), ("cp comm", "-")):   # no experts, interleaving or context parallelism
        if k in table and table[k].fillna(off).eq(off).all():
            table = table.drop(columns=k)
    fitting = table["ms"].notna()
    if fitting.any():
        ref = table[fitting].iloc[0]
        speed = ref["ms"] / table["ms"]
        table["speed-up"] = speed
        table["efficiency"] = speed / (table["gpus"] / ref["gpus"])
    return table


# ---------------------------------------------------------------------------------------------------------
# serving: generate() on N GPUs


@dataclass
class GenerationPlan:
    """The ways ``gpus`` GPUs of one type can serve ``batch_size`` concurrent sequences with ``generate()``:
    ``dp`` replicas of the model, each split over ``tp`` GPUs (tensor parallelism) and generating its
    ``batch_size / dp`` sequences independently; ``candidates`` has a row per layout."""

    model: str
    device: Device
    gpus: int
    batch_size: int                      # concurrent sequences over all replicas
    prompt_len: int
    new_tokens: int
    candidates: pd.DataFrame
    skipped: dict[str, str]              # layout label -> why it was left out
    notes: tuple[str, ...] = field(default_factory=tuple)   # the best layout's forecast notes
    seconds: float = 0.0

    @property
    def table(self) -> pd.DataFrame:
        """The layouts, those that fit first, each group fastest first by the whole call's time (replicas run at the
        same time, so the fastest also generates the most tokens per second), with ``rank`` and ``time vs best``."""
        c = self.candidates
        return c if c.empty else _ranked(c, "total ms")

    @property
    def best(self) -> pd.Series | None:
        """The layout that fits with the most generated tokens per second, or None when none fits."""
        return _best_row(self.table)

    def summary(self) -> str:
        """The run, the layouts ranked, the best one and the one with the shortest time per output token."""
        t = self.table
        lines = [f"{self.model}: generate(), {self.batch_size} concurrent sequences, prompt {self.prompt_len}, "
                 f"{self.new_tokens} new tokens, on {self.gpus} x {self.device.name}",
                 f"{len(t)} layouts of {self.gpus} GPUs forecast (dp replicas x tp GPUs each; "
                 f"{len(self.skipped)} left out) in {self.seconds:.1f} s, those that fit in "
                 f"{self.device.memory_gib:g} GiB first:"]
        lines += _ranking_lines(t, ["layout"], "fewer sequences, or a smaller cache (static_cache=true, a shorter "
                                               "prompt)")
        best = _best_row(t)
        if best is not None:
            lines.append(f"best: {best['layout']}: {best['generated tokens/s']:,.0f} generated tokens/s, "
                         f"{best['per output token ms']:,.2f} ms per output token, time to first token "
                         f"{best['time to first token ms']:,.1f} ms, {best['memory GiB']:,.1f} GiB per GPU")
            fit = t[t["fits"] == "yes"]
            quick = fit.iloc[int(fit["per output token ms"].values.argmin())]
            if quick["layout"] != best["layout"]:
                lines.append(f"shortest time per output token: {quick['layout']}: "
                             f"{quick['per output token ms']:,.2f} ms ({quick['generated tokens/s']:,.0f} generated "
                             "tokens/s)")
        return "\n".join(lines + _left_out_lines(self.skipped) + [f"note: {n}" for n in self.notes])


def check_replica_plan(gpus: Any, usd_per_gpu_hour: Any, kwargs: dict[str, Any], searched: tuple[str, ...],
                       name: str, fix: str) -> None:
    """The arguments of a plan of ``dp`` replicas x ``tp`` GPUs (``name``: plan_generation, plan_serving): a positive
    GPU count, none of the ``searched`` keywords among ``kwargs`` (else ``fix``), a valid price if given."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise InputError(f"gpus={gpus!r} is not a positive number of GPUs. Fix: e.g. gpus=8")
    fixed = [k for k in searched if k in kwargs]
    if fixed:
        raise InputError(f"{fixed[0]}= is what {name} searches. Fix: leave it out, or {fix}")
    if usd_per_gpu_hour is not None:
        from neusight.api import check_price

        check_price(usd_per_gpu_hour, "usd_per_gpu_hour")


def plan_generation(model: Any, device: Device | str, gpus: int, batch_size: int = 1, prompt_len: int = 128,
                    new_tokens: int = 128, *, usd_per_gpu_hour: float | None = None,
                    **kwargs: Any) -> GenerationPlan:
    """Forecast ``generate()`` of ``batch_size`` concurrent sequences (``prompt_len`` prompt tokens, ``new_tokens``
    new ones) on every ``dp x tp`` layout of ``gpus`` GPUs of ``device``: ``dp`` replicas, each split over ``tp``
    GPUs (:func:`neusight.generation.predict_generation` with ``tp``) and generating ``batch_size / dp`` of the
    sequences, and rank them. Pipeline stages are not tried (a decode step would wait on each stage in turn).

    ``usd_per_gpu_hour`` adds the cost per 1M generated tokens, all ``gpus`` GPUs counted; ``kwargs`` go to
    ``predict_generation`` (``dtype``, ``attn_implementation``, ``static_cache``, ``predictor``, ...).

    Examples
    --------
    >>> plan = plan_generation("gpt2", "l4", gpus=2, batch_size=4, prompt_len=32, new_tokens=8)
    >>> sorted(plan.table["layout"])
    ['dp 1 x tp 2', 'dp 2 x tp 1']
    """
    from neusight.generation import predict_generation

    check_replica_plan(gpus, usd_per_gpu_hour, kwargs, ("tp", "dp"), "plan_generation",
                       "forecast one replica with neusight.predict_generation(..., tp=)")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size={batch_size!r} is not a positive integer. Fix: the concurrent sequences, "
                         "e.g. 32")
    device = load_device(device)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    errors: list[Exception] = []
    best_ms, notes, name = math.inf, (), model if isinstance(model, str) else type(model).__name__
    for tp in _divisors(gpus):
        dp = gpus // tp
        label = f"dp {dp} x tp {tp}"
        if batch_size % dp:
            skipped[label] = f"the {batch_size} sequences do not split into dp replicas"
            continue
        try:
            f = predict_generation(model, device, batch_size // dp, prompt_len, new_tokens, tp=tp, **kwargs)
        except (InputError, ModelError) as e:
            errors.append(e)
            skipped[label] = str(e).split(". Fix:")[0]
            log.info("%s: left out (%s)", label, skipped[label])
            continue
        name = f.model
        rate = f.tokens_per_s * dp
        row = {"layout": label, "dp": dp, "tp": tp, "sequences per replica": batch_size // dp,
               "total ms": f.total_ms, "time to first token ms": f.prefill_ms,
               "per output token ms": f.time_per_output_token_ms, "generated tokens/s": rate,
               "memory GiB": (f.memory_peak_bytes or 0.0) / 2**30, "fits": bool(f.memory_fits)}
        if usd_per_gpu_hour is not None:
            from neusight.api import unit_cost

            usd, per = unit_cost(rate, "generated tokens/s", usd_per_gpu_hour, gpus)
            row[f"USD per {per}"] = usd
        if row["fits"] and f.total_ms < best_ms:
            best_ms, notes = f.total_ms, f.notes
        rows.append(row)
        log.info("%s: %.1f ms, %s", label, f.total_ms, "fits" if row["fits"] else "does not fit")
    if not rows and errors:
        raise errors[0]
    return GenerationPlan(name, device, gpus, batch_size, prompt_len, new_tokens, pd.DataFrame(rows), skipped,
                          tuple(notes), time.perf_counter() - start)

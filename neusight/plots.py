"""Pictures performance engineers read, from a predicted kernel table and a memory report; and the per-layer
table behind the layer chart.

Every chart is drawn on a bare :class:`matplotlib.figure.Figure` (no pyplot, no global backend switch) and
saved as PNG (rendered by Agg) and SVG; each function returns the paths it wrote.

The kernel table has one row per GPU kernel with the columns ``phase, module, aten_op, family, kernel, flops,
bytes, latency_ms, roofline_ms, bound, utilization`` (the trace columns plus the predictor's).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd

from neusight.errors import InputError
from neusight.kernels.base import Family

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from neusight.memory import MemoryReport

__all__ = ["layer_breakdown", "layer_table", "memory_timeline", "module_group", "roofline_chart",
           "serving_curve_chart", "time_roofline"]

log = logging.getLogger(__name__)

FORMATS = ("png", "svg")
DPI = 150
# One colour per family, fixed so every chart of a run agrees (matplotlib's tab20, in Family order).
_TAB20 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf", "#aec7e8", "#ffbb78", "#98df8a"]
FAMILY_COLORS = {f.value: _TAB20[i % len(_TAB20)] for i, f in enumerate(Family)}
# Memory categories, bottom to top of the stacked timeline.
_MEMORY_COLORS = {"framework": "#c7c7c7", "weights": "#1f77b4", "optimizer": "#9467bd", "gradients": "#d62728",
                  "activations": "#2ca02c", "workspace": "#ff7f0e"}
_KERNEL_COLUMNS = ("phase", "module", "family", "flops", "bytes", "latency_ms")


# ---------------------------------------------------------------------------------------------------------
# helpers


def _check(kernels: pd.DataFrame, columns: Sequence[str] = _KERNEL_COLUMNS) -> pd.DataFrame:
    if not isinstance(kernels, pd.DataFrame):
        raise InputError(f"expected a kernel table (pandas DataFrame), got {type(kernels).__name__}; pass "
                         f"the .kernels of a prediction")
    missing = [c for c in columns if c not in kernels.columns]
    if missing:
        raise InputError(f"the kernel table lacks column(s) {', '.join(missing)}; expected {', '.join(columns)}. "
                         f"Pass the predicted kernel table (trace columns + latency_ms, roofline_ms, bound), "
                         f"not the bare trace")
    if kernels.empty:
        raise InputError("the kernel table is empty; trace a model that launches at least one kernel")
    return kernels


def _figure(width: float, height: float) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _save(fig: "Figure", path: str | os.PathLike, formats: Sequence[str]) -> list[Path]:
    """Write ``fig`` next to ``path`` once per format (the suffix of ``path`` is replaced)."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise InputError(f"formats={tuple(formats)!r}: use one or more of {', '.join(FORMATS)}")
    base = Path(path)
    base = base.with_suffix("") if base.suffix.lower().lstrip(".") in FORMATS else base
    base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        out = base.parent / f"{base.name}.{fmt}"
        fig.savefig(out, format=fmt, dpi=DPI)
        written.append(out)
    log.info("wrote %s", ", ".join(str(p) for p in written))
    return written


def _eng(unit: str) -> Any:
    from matplotlib.ticker import EngFormatter

    return EngFormatter(unit=unit, places=0, sep=" ")


def _family_order(families: pd.Series) -> list[str]:
    present = set(families)
    return [f.value for f in Family if f.value in present] + sorted(present - set(FAMILY_COLORS))


def _dtype(kernels: pd.DataFrame) -> str:
    return str(kernels["dtype"].mode().iloc[0]) if "dtype" in kernels.columns else "float32"


def _gemm_roof(device: Any, kernels: pd.DataFrame, peak: float) -> tuple[float, str] | None:
    """The GEMM peak the predictor bounds GEMM-like kernels by and its name, where it differs from the
    spec-sheet ``peak`` drawn as the compute roof: the TF32 tensor peak when kernels run in TF32
    (neusight.api.TF32_MODES), else, in FP32 on GPUs whose SGEMM cannot fill every FP32 lane, the share of the FP32
    peak it can (neusight.tiles.sgemm_lane_fraction); None elsewhere."""
    from neusight.devices import Device
    from neusight.tiles import device_rates

    if not isinstance(device, Device):
        return None
    if "dtype" in kernels.columns and (kernels["dtype"].astype(str) == "tf32").any() and device.tf32_tensor_tflops:
        return device_rates(device, "tf32").gemm_flops, "TF32 tensor-core roof"
    gemm = device_rates(device, _dtype(kernels)).gemm_flops
    return (gemm, "GEMM roof (FP32 lanes SGEMM cannot fill)") if gemm < 0.999 * peak else None


def _sizes(latency_ms: pd.Series) -> np.ndarray:
    """Marker areas (pt^2) proportional to kernel time, 4 to 300."""
    lat = latency_ms.to_numpy(dtype=float)
    return 4 + 296 * lat / max(lat.max(), 1e-30)


# ---------------------------------------------------------------------------------------------------------
# roofline


def roofline_chart(kernels: pd.DataFrame, device: Any, path: str | os.PathLike, *,
                   formats: Sequence[str] = FORMATS) -> list[Path]:
    """Classic roofline: arithmetic intensity (FLOP/byte) vs achieved FLOP/s, log-log.

    One point per kernel, area proportional to its time, coloured by family; the device's compute roof
    (peak FLOP/s of the table's dtype), its bandwidth roof (bandwidth x intensity) and the ridge point where
    they meet; dashed, the lower GEMM roof the predictor bounds GEMMs by where SGEMM cannot fill every FP32 lane
    (``Device.fp32_dual_issue``). Kernels without FLOPs (copies) cannot sit on a log axis and are counted in the
    title.

    Returns
    -------
    list of Path
        The files written (``path`` with each suffix of ``formats``).
    """
    k = _check(kernels)
    k = k[(k["latency_ms"] > 0) & (k["bytes"] > 0)]
    drawn = k[k["flops"] > 0]
    peak = device.peak_flops(_dtype(k))
    bw = device.mem_bandwidth_gbps * 1e9
    ridge = peak / bw
    intensity = drawn["flops"] / drawn["bytes"]
    achieved = drawn["flops"] / (drawn["latency_ms"] * 1e-3)
    fig = _figure(8.0, 5.5)
    ax = fig.add_subplot()
    lo = min(float(intensity.min()) if len(drawn) else ridge, ridge) / 4
    hi = max(float(intensity.max()) if len(drawn) else ridge, ridge) * 4
    xs = np.geomspace(lo, hi, 256)
    ax.plot(xs, np.minimum(peak, bw * xs), color="black", lw=1.8, zorder=3)
    gemm_roof = _gemm_roof(device, k, peak)
    gemm = gemm_roof[0] if gemm_roof else None
    if gemm:
        ax.plot(xs, np.minimum(gemm, bw * xs), color="black", ls="--", lw=1, zorder=3)
    ax.axvline(ridge, color="gray", ls=":", lw=1, zorder=1)
    for fam in _family_order(drawn["family"]):
        sel = drawn["family"] == fam
        ax.scatter(intensity[sel], achieved[sel], s=_sizes(drawn["latency_ms"])[sel.to_numpy()], alpha=0.55,
                   color=FAMILY_COLORS.get(fam, "black"), edgecolors="none", label=fam, zorder=2, rasterized=True)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ymin = float(achieved.min()) / 3 if len(drawn) else peak / 1e4
    ax.set_ylim(max(ymin, peak / 1e7), max(peak, gemm or 0.0) * 3)
    ax.yaxis.set_major_formatter(_eng("FLOP/s"))
    ax.set_xlabel("Arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("Achieved performance")
    ax.annotate(f"compute roof {_eng('FLOP/s')(peak)}", (hi, peak), xytext=(-4, 4), textcoords="offset points",
                ha="right", fontsize=8)
    if gemm:
        name = gemm_roof[1].split(" (")[0]
        ax.annotate(f"{name} {_eng('FLOP/s')(gemm)}" + gemm_roof[1][len(name):], (gemm / bw, gemm),
                    xytext=(4, 3), textcoords="offset points", ha="left", va="bottom", fontsize=8)
    ax.annotate(f"ridge point {ridge:.3g} FLOP/B", (ridge, ax.get_ylim()[0]), xytext=(-3, 6),
                textcoords="offset points", rotation=90, ha="right", va="bottom", fontsize=8, color="dimgray")
    fig.draw_without_rendering()   # final layout, so the slope of the memory roof on screen is known
    x0 = lo * 2
    (px0, py0), (px1, py1) = ax.transData.transform([(x0, bw * x0), (x0 * 10, bw * x0 * 10)])
    ax.annotate(f"memory roof {device.mem_bandwidth_gbps:g} GB/s", (x0, bw * x0), xytext=(0, 4),
                textcoords="offset points", rotation=np.degrees(np.arctan2(py1 - py0, px1 - px0)),
                rotation_mode="anchor", ha="left", va="bottom", fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    skipped = len(k) - len(drawn)
    ax.set_title(f"Roofline on {device.name}: {len(drawn)} kernels" + (f" ({skipped} without FLOPs not shown)"
                 if skipped else "") + "\npoint area ~ kernel time", fontsize=10)
    legend = ax.legend(title="family", fontsize=8, title_fontsize=8, loc="lower right", markerscale=0.8)
    for h in legend.legend_handles:
        h.set_sizes([30])
    return _save(fig, path, formats)


def time_roofline(kernels: pd.DataFrame, device: Any, path: str | os.PathLike, *, launch_overhead_us: float = 5.0,
                  formats: Sequence[str] = FORMATS) -> list[Path]:
    """Time-based roofline (Wang et al. 2020, "Time-Based Roofline for Deep Learning Performance Analysis").

    Two panels sharing the time axis: kernel time vs FLOPs with the compute floor t = FLOPs / peak, and kernel
    time vs bytes with the memory floor t = bytes / bandwidth; both floors are raised to the launch overhead.
    Dashed: the GEMM floor where it is higher (``Device.fp32_dual_issue``, FP32).
    A kernel can sit on or above the floors, never below; the distance is the time lost to anything else.

    Parameters
    ----------
    launch_overhead_us : float
        Smallest time of any kernel (launch + scheduling), microseconds.
    """
    from matplotlib.ticker import LogLocator

    if not launch_overhead_us > 0:
        raise InputError(f"launch_overhead_us={launch_overhead_us!r} must be > 0, e.g. 5 (microseconds)")
    k = _check(kernels)
    k = k[k["latency_ms"] > 0]
    t = k["latency_ms"].to_numpy(dtype=float) * 1e-3
    floor = launch_overhead_us * 1e-6
    peak = device.peak_flops(_dtype(k))
    bw = device.mem_bandwidth_gbps * 1e9
    fig = _figure(11.0, 4.8)
    axes = fig.subplots(1, 2, sharey=True)
    gemm_roof = _gemm_roof(device, k, peak)
    gemm = gemm_roof[0] if gemm_roof else None
    panels = ((axes[0], "flops", peak, f"compute floor {_eng('FLOP/s')(peak)}"
               + (f", {'TF32' if 'TF32' in gemm_roof[1] else 'GEMMs'} {_eng('FLOP/s')(gemm)} (dashed)"
                  if gemm_roof else ""), "Work (FLOP)"),
              (axes[1], "bytes", bw, f"memory floor {device.mem_bandwidth_gbps:g} GB/s", "DRAM traffic (bytes)"))
    sizes = _sizes(k["latency_ms"])
    for ax, col, rate, label, xlabel in panels:
        x = k[col].to_numpy(dtype=float)
        ok = x > 0
        lo, hi = (x[ok].min() / 3, x[ok].max() * 3) if ok.any() else (1.0, 1e12)
        xs = np.geomspace(lo, hi, 256)
        ax.plot(xs, np.maximum(xs / rate, floor), color="black", lw=1.8, zorder=2, label=label)
        if col == "flops" and gemm:
            ax.plot(xs, np.maximum(xs / gemm, floor), color="black", ls="--", lw=1, zorder=2,
                    label=f"GEMM floor {_eng('FLOP/s')(gemm)}")
        ax.axhline(floor, color="gray", ls=":", lw=1)
        for fam in _family_order(k["family"]):
            sel = ((k["family"] == fam).to_numpy()) & ok
            ax.scatter(x[sel], t[sel], s=sizes[sel], alpha=0.55, color=FAMILY_COLORS.get(fam, "black"),
                       edgecolors="none", label=fam, zorder=3, rasterized=True)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(LogLocator(base=10, numticks=7))   # at most ~6 labels: no overlap
        ax.xaxis.set_major_formatter(_eng("FLOP" if col == "flops" else "B"))
        ax.set_xlabel(xlabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(label, fontsize=9)
    axes[0].yaxis.set_major_formatter(_eng("s"))
    axes[0].set_ylabel("Kernel time")
    axes[0].annotate(f"launch overhead {launch_overhead_us:.3g} µs", (axes[0].get_xlim()[0], floor), xytext=(4, 4),
                     textcoords="offset points", fontsize=8, color="dimgray")
    ymin = min(float(t.min()), floor) / 2
    axes[0].set_ylim(ymin, float(t.max()) * 3)
    handles, labels = axes[1].get_legend_handles_labels()
    legend = fig.legend(handles[1:], labels[1:], title="family", fontsize=8, title_fontsize=8, loc="outside right")
    for h in legend.legend_handles:
        h.set_sizes([30])
    fig.suptitle(f"Time-based roofline on {device.name}: {len(k)} kernels, {t.sum() * 1e3:.1f} ms "
                 f"(point area ~ kernel time)", fontsize=10)
    return _save(fig, path, formats)


# ---------------------------------------------------------------------------------------------------------
# memory


def memory_timeline(report: "MemoryReport", path: str | os.PathLike, *, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Live memory over the op sequence: stacked by category (framework costs at the bottom), the phase
    boundaries marked, the peak annotated, and the device's memory if the report has one."""
    tl = report.timeline
    if tl.empty:
        raise InputError("the memory report has an empty timeline; estimate a graph with at least one op")
    x = tl["op_index"].to_numpy()
    framework = report.breakdown.get("framework", 0)
    layers = {"framework": np.full(len(tl), framework, dtype=float)} if framework else {}
    layers.update({c: tl[c].to_numpy(dtype=float) for c in _MEMORY_COLORS if c in tl.columns and tl[c].any()})
    total = sum(layers.values(), np.zeros(len(tl)))
    top = max(float(total.max()), report.peak_bytes)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    fig = _figure(10.0, 5.0)
    ax = fig.add_subplot()
    bands = ax.stackplot(x, *[v / scale for v in layers.values()], labels=list(layers),
                         colors=[_MEMORY_COLORS[c] for c in layers], alpha=0.85, lw=0)
    for band in bands:   # thousands of vertices: pixels in the SVG too, axes and text stay vector
        band.set_rasterized(True)
    dev = report.device_memory_bytes
    if dev and dev <= 1.6 * top:   # a device far above the peak would flatten the curve: said in the title
        ax.axhline(dev / scale, color="crimson", ls="--", lw=1.2)
        ax.annotate(f"{report.device or 'device'} memory {dev / scale:.0f} {unit}", (x[0], dev / scale),
                    xytext=(4, 3), textcoords="offset points", ha="left", fontsize=8, color="crimson")
        top = max(top, dev)
    top /= scale
    ax.set_ylim(0, top * 1.18)
    spans = tl.groupby("phase", sort=False)["op_index"].agg(["min", "max"])
    for phase, (first, last) in spans.iterrows():
        if first > 0:
            ax.axvline(first, color="black", ls=":", lw=1)
        if (last - first) > 0.06 * len(tl):   # wide phase: its name centred over its span
            ax.text((first + last) / 2, top * 1.12, phase, ha="center", va="center", fontsize=8, color="dimgray")
        else:                                   # narrow phase: the name just left of its start line
            ax.text(first, top * 1.05, f"{phase} ", ha="right", va="center", fontsize=7, color="dimgray")
    w = report.where
    peak_y = float(total[w["op_index"]]) / scale
    slack = report.peak_bytes - report.tensor_peak_bytes - framework
    note = (f"peak {report.peak_bytes / scale:.2f} {unit} at op {w['op_index']} ({w['phase']})\n"
            f"{_short(w['aten_op'])}, module {w['module'] or '(root)'}")
    if slack > 0:
        note += f"\n+{slack / 2**20:.0f} MiB allocator segment slack"
    right, low = w["op_index"] > 0.6 * len(tl), peak_y < 0.6 * top
    ax.annotate(note, (w["op_index"], peak_y), xytext=(-12 if right else 12, 14 if low else -8),
                textcoords="offset points", ha="right" if right else "left", va="bottom" if low else "top",
                fontsize=8, arrowprops=dict(arrowstyle="->", color="black", lw=0.8),
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="gray", alpha=0.9))
    ax.plot([w["op_index"]], [peak_y], marker="o", color="black", ms=4)
    ax.set_xlim(x[0], max(x[-1], 1))
    ax.set_xlabel("Op index (program order)")
    ax.set_ylabel(f"Live memory ({unit})")
    ax.grid(True, axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], fontsize=8, loc="outside right upper")
    run = f"{report.model} {report.mode}, batch {report.batch_size}" if report.model else "Memory"
    need = f"peak {report.peak_bytes / 2**30:.2f} GiB"
    if dev:
        need += f" of {dev / 2**30:.0f} GiB: {'fits' if report.fits else 'does NOT fit'}"
    ax.set_title(f"{run}{' on ' + report.device if report.device else ''}: {need} "
                 f"({report.allocator} allocator)", fontsize=10)
    return _save(fig, path, formats)


def _short(aten_op: str) -> str:
    """``aten.mm.default`` -> ``aten.mm``."""
    return aten_op.removesuffix(".default")


# ---------------------------------------------------------------------------------------------------------
# per layer

_INDEX = re.compile(r"^\d+$")


def module_group(module: str, phase: str = "forward", depth: int | None = None) -> str:
    """The layer a module path belongs to.

    ``depth=None`` cuts after the first numeric component, i.e. the index of a repeated block
    (``transformer.h.12.attn.c_attn`` -> ``transformer.h.12``, ``layer3.1.conv2`` -> ``layer3.1``) and keeps
    paths without one whole (``lm_head``); an int keeps that many components. Ops outside any module are
    grouped by phase: ``(loss)``, ``(optimizer)``, ``(root)``.
    """
    if not module:
        return {"loss": "(loss)", "optimizer": "(optimizer)"}.get(phase, "(root)")
    parts = module.split(".")
    if depth is not None:
        return ".".join(parts[:max(depth, 1)])
    for i, p in enumerate(parts):
        if _INDEX.match(p):
            return ".".join(parts[:i + 1])
    return module


def _groups(kernels: pd.DataFrame, depth: int | None) -> pd.Series:
    cache: dict[tuple[str, str], str] = {}
    keys = zip(kernels["module"].astype(str), kernels["phase"].astype(str))
    return pd.Series([cache.setdefault(key, module_group(key[0], key[1], depth)) for key in keys],
                     index=kernels.index, name="layer")


def layer_table(kernels: pd.DataFrame, depth: int | None = None, saved_bytes: pd.Series | None = None) -> pd.DataFrame:
    """Per layer (module path grouped by :func:`module_group`), in program order.

    Columns: ``time_ms``, ``share_pct`` of the total time, ``bound`` (``compute`` or ``memory``, whichever
    holds most of the layer's time), ``flops``, ``bytes`` (DRAM traffic), ``kernels`` (count), and
    ``saved_bytes`` (activations saved for backward, from :func:`neusight.memory.saved_activations`) if given; a
    layer that saves some but launches no kernel of its own gets a row of its own with no time (bound ``-``).
    """
    k = _check(kernels, (*_KERNEL_COLUMNS, "bound"))
    g = k.assign(layer=_groups(k, depth))
    out = g.groupby("layer", sort=False).agg(time_ms=("latency_ms", "sum"), flops=("flops", "sum"),
                                             bytes=("bytes", "sum"), kernels=("latency_ms", "size"))
    out.insert(1, "share_pct", 100 * out["time_ms"] / out["time_ms"].sum())
    by_bound = g.groupby(["layer", "bound"], sort=False)["latency_ms"].sum().unstack(fill_value=0.0)
    out.insert(2, "bound", by_bound.idxmax(axis=1).reindex(out.index))
    if saved_bytes is not None:
        groups = [module_group(m, "forward", depth) for m in saved_bytes.index]
        per = saved_bytes.groupby(groups, sort=False).sum()
        order = list(out.index)
        for i, name in enumerate(per.index):   # a layer that saves but launches no kernel of its own (under
            if name not in out.index:          # torch.compile its kernels fused into the next layer's): a row
                prev = next((p for p in reversed(per.index[:i]) if p in order), None)   # after the one before it
                order.insert(order.index(prev) + 1 if prev is not None else 0, name)
        out = out.reindex(order)
        out[["time_ms", "share_pct", "flops", "bytes"]] = out[["time_ms", "share_pct", "flops", "bytes"]].fillna(0.0)
        out["kernels"] = out["kernels"].fillna(0).astype("int64")
        out["bound"] = out["bound"].fillna("-")
        out["saved_bytes"] = per.reindex(order).fillna(0).astype("int64")
    return out


def layer_breakdown(kernels: pd.DataFrame, path: str | os.PathLike, top: int = 20, *, depth: int | None = None,
                    formats: Sequence[str] = FORMATS) -> list[Path]:
    """Horizontal stacked bars: the ``top`` layers by time (all phases), split by kernel family; the
    remaining layers summed in one bar."""
    if not isinstance(top, int) or top < 1:
        raise InputError(f"top={top!r} must be a positive integer, e.g. 20")
    k = _check(kernels)
    g = k.assign(layer=_groups(k, depth))
    by = g.groupby(["layer", "family"], sort=False)["latency_ms"].sum().unstack(fill_value=0.0)
    order = list(dict.fromkeys(g["layer"]))
    by = by.reindex(order)
    total = by.sum(axis=1)
    chosen = total.sort_values(ascending=False, kind="stable").index[:top]
    shown = by.loc[chosen]
    rest = float(total.drop(index=chosen).sum())
    shown = shown[_family_order(pd.Series(shown.columns))]
    grand = float(total.sum())
    fig = _figure(9.0, 1.2 + 0.32 * len(shown))
    ax = fig.add_subplot()
    y = np.arange(len(shown))[::-1]
    left = np.zeros(len(shown))
    for fam in shown.columns:
        v = shown[fam].to_numpy()
        if v.sum() <= 0:
            continue
        ax.barh(y, v, left=left, color=FAMILY_COLORS.get(fam, "black"), label=fam, height=0.7)
        left += v
    for yi, total_ms in zip(y, left):
        ax.text(total_ms, yi, f" {total_ms:.2f} ms ({100 * total_ms / grand:.1f} %)", va="center", fontsize=7)
    ax.set_yticks(y, shown.index, fontsize=8)
    ax.set_xlim(0, left.max() * 1.22)
    ax.set_xlabel("Predicted time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(title="family", fontsize=8, title_fontsize=8, loc="outside right upper")
    title = f"Time per layer (all phases): {grand:.1f} ms in total"
    if len(by) > len(chosen):
        title += (f"\ntop {len(chosen)} of {len(by)} layers shown; the other {len(by) - len(chosen)}: "
                  f"{rest:.1f} ms ({100 * rest / grand:.1f} %)")
    ax.set_title(title, fontsize=10)
    return _save(fig, path, formats)


def serving_curve_chart(curve: pd.DataFrame, path: str | os.PathLike, *, title: str = "",
                        formats: Sequence[str] = FORMATS) -> list[Path]:
    """The throughput-latency curve of a continuously batching engine (:func:`neusight.engine.serving_curve`'s
    table): generated tokens/s against the time per output token, one line per GPU, each point labelled with its
    sequences at once; a point that does not fit in the GPU's memory hollow. Both axes logarithmic."""
    need = ("GPU", "sequences", "per output token ms", "generated tokens/s")
    missing = [c for c in need if c not in curve.columns]
    if missing or curve.empty:
        raise InputError(f"the serving curve {'lacks the columns ' + ', '.join(missing) if missing else 'is empty'}; "
                         "pass the table of neusight.engine.serving_curve")
    fig = _figure(8.0, 5.5)
    ax = fig.add_subplot()
    for i, (gpu, rows) in enumerate(curve.groupby("GPU", sort=False)):
        color = _TAB20[i % len(_TAB20)]
        x, y = rows["per output token ms"].to_numpy(), rows["generated tokens/s"].to_numpy()
        ax.plot(x, y, "-", color=color, lw=1.2, label=gpu)
        fits = (rows["fits"] != "no").to_numpy() if "fits" in rows else np.ones(len(rows), bool)
        ax.scatter(x[fits], y[fits], color=color, s=18, zorder=3)
        ax.scatter(x[~fits], y[~fits], facecolors="none", edgecolors=color, s=30, zorder=3)
        for xi, yi, n in zip(x, y, rows["sequences"]):
            ax.annotate(f"{n:,}", (xi, yi), textcoords="offset points", xytext=(3, -9), fontsize=6, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time per output token (ms, a mean step)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title or "continuous batching: throughput against latency (labels: sequences at once)", fontsize=9)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path, formats)

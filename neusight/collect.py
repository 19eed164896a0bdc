"""Collect kernel traces on your own GPU, in the shared NeuSight kernel-CSV schema.

On a machine with a CUDA (or ROCm) GPU, :func:`collect` times PyTorch ops over a sweep of shapes the way the
NeuSight dataset was measured: each op call timed on its own with CUDA events, ``repeats`` runs after a
warm-up, the mean of the ``keep`` fastest; FP32 with TF32 off. One profiled call per shape records the kernels
the op launches (``torch.profiler``): the longest is the row's ``Kernel Name`` with its grid, block and
occupancy, all of them go to ``Kernels``. Files are written as ``<out>/<op>/<Device name>.csv`` (spaces as
underscores), the layout of ``kernels/nvidia/<op>/<GPU>.csv`` in the dataset, so they load with
:func:`neusight.dataset.load_kernel_traces` and train with
``neusight-train data.traces=[<dataset>/kernels/nvidia,<out>] data.devices=[...,<your gpu>]`` (the GPU needs
a spec file in ``data/devices/``, found by its ``torch.cuda.get_device_name()`` string or an alias).

Without a GPU it runs on the CPU with wall-clock timing and no kernel records (``Kernel Name`` =
``cpu:<op>``, launch geometry 1): that exercises the plumbing only. Such files name the CPU as their device,
which the device library does not know, so training skips their rows.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from neusight.errors import InputError
from neusight.util import atomic_write_text

__all__ = ["OPS", "SWEEPS", "Sweep", "collect", "op_shapes"]

log = logging.getLogger(__name__)

GEMM_OPS = ("linear", "bmm")
ROW_OPS = ("add", "addu", "mul", "mulu", "div", "divu", "pow", "powu", "relu", "tanh", "gelu", "softmax", "ln")
OPS = (*GEMM_OPS, "conv", *ROW_OPS)

# the dataset's column order; the op's shape columns follow
SCHEMA = ("OPName", "Latency", "Device", "Torch Version", "CUDNN Version", "Kernel Name", "Warps per SM",
          "Blocks per SM", "Grid x", "Grid y", "Grid z", "Block x", "Block y", "Block z", "CUDA Version", "Kernels")
SHAPE_COLUMNS = {**{op: ("B", "M", "N", "K") for op in GEMM_OPS},
                 "conv": ("B", "Input_Channel", "Output_Channel", "Kernel_Szie", "Input_Size", "Stride", "Padding"),
                 **{op: ("B", "H") for op in ROW_OPS}}


@dataclass(frozen=True)
class Sweep:
    """The grid each op's shapes are drawn from (``samples`` per op, without replacement, seeded)."""

    gemm_dims: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)   # M, N, K
    bmm_batches: tuple[int, ...] = (1, 2, 8, 32, 128, 512)
    rows: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)          # B of a (B, H) tensor
    cols: tuple[int, ...] = (32, 128, 512, 1024, 2048, 4096, 8192, 16384)          # H
    conv_batches: tuple[int, ...] = (1, 8, 32, 64)
    conv_channels: tuple[int, ...] = (3, 16, 64, 128, 256, 512)
    conv_kernels: tuple[int, ...] = (1, 3, 5, 7)
    conv_sizes: tuple[int, ...] = (7, 14, 28, 56, 112, 224)
    conv_strides: tuple[int, ...] = (1, 2)
    samples: int = 300
    max_bytes: float = 2e9          # skip shapes whose tensors exceed this (inputs, weights and output)


SWEEPS = {
    "default": Sweep(),
    # a few shapes per op: seconds on a CPU, for trying the tool and for tests
    "quick": Sweep(gemm_dims=(16, 64, 128), bmm_batches=(1, 4), rows=(1, 64, 512), cols=(32, 256),
                   conv_batches=(1, 2), conv_channels=(3, 8), conv_kernels=(1, 3), conv_sizes=(8, 16),
                   conv_strides=(1, 2), samples=6, max_bytes=64e6),
}


def op_shapes(op: str, sweep: Sweep, seed: int = 0) -> list[dict[str, int]]:
    """The shapes ``op`` is timed at: up to ``sweep.samples`` grid points, drawn with ``seed``."""
    if op not in OPS:
        raise InputError(f"op={op!r} is not one the collector knows. Fix: one of {', '.join(OPS)}")
    if op in GEMM_OPS:
        d = sweep.gemm_dims
        batches = sweep.bmm_batches if op == "bmm" else (1,)
        grid = [dict(B=b, M=m, N=n, K=k) for b in batches for m in d for n in d for k in d]
    elif op == "conv":
        s = sweep
        grid = [dict(B=b, Input_Channel=ci, Output_Channel=co, Kernel_Szie=k, Input_Size=hw, Stride=st,
                     Padding=k // 2)
                for b in s.conv_batches for ci in s.conv_channels for co in s.conv_channels
                for k in s.conv_kernels for hw in s.conv_sizes for st in s.conv_strides if k <= hw]
    else:
        grid = [dict(B=b, H=h) for b in sweep.rows for h in sweep.cols]
    grid = [g for g in grid if _tensor_bytes(op, g) <= sweep.max_bytes]
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(grid), size=min(sweep.samples, len(grid)), replace=False) if grid else []
    return [grid[i] for i in sorted(pick)]


def _tensor_bytes(op: str, s: dict[str, int]) -> float:
    """FP32 bytes of the op's inputs, weights and output."""
    if op == "linear":
        return 4.0 * (s["M"] * s["N"] + s["N"] * s["K"] + s["M"] * s["K"])
    if op == "bmm":
        return 4.0 * s["B"] * (s["M"] * s["N"] + s["N"] * s["K"] + s["M"] * s["K"])
    if op == "conv":
        out = (s["Input_Size"] + 2 * s["Padding"] - s["Kernel_Szie"]) // s["Stride"] + 1
        return 4.0 * (s["B"] * s["Input_Channel"] * s["Input_Size"] ** 2 + s["B"] * s["Output_Channel"] * out ** 2
                      + s["Output_Channel"] * s["Input_Channel"] * s["Kernel_Szie"] ** 2)
    n = s["B"] * s["H"]
    return 4.0 * n * (3 if op in ("add", "mul", "div", "pow") else 2)


def _make_call(op: str, s: dict[str, int], device: torch.device) -> Callable[[], torch.Tensor]:
    """One call of ``op`` at shape ``s`` on ``device`` (FP32), as the dataset defines it (see its README)."""
    f32 = dict(device=device, dtype=torch.float32)
    if op == "linear":
        layer, x = nn.Linear(s["N"], s["K"], bias=True, **f32), torch.randn(s["B"], s["M"], s["N"], **f32)
        return lambda: layer(x)
    if op == "bmm":
        a, b = torch.randn(s["B"], s["M"], s["N"], **f32), torch.randn(s["B"], s["N"], s["K"], **f32)
        return lambda: torch.bmm(a, b)
    if op == "conv":
        layer = nn.Conv2d(s["Input_Channel"], s["Output_Channel"], s["Kernel_Szie"], stride=s["Stride"],
                          padding=s["Padding"], bias=False, **f32)
        x = torch.randn(s["B"], s["Input_Channel"], s["Input_Size"], s["Input_Size"], **f32)
        return lambda: layer(x)
    x, y = torch.randn(s["B"], s["H"], **f32), torch.rand(s["B"], s["H"], **f32) + 0.5
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "add": lambda: x + y, "addu": lambda: x + 1.0, "mul": lambda: x * y, "mulu": lambda: x * 2.0,
        "div": lambda: x / y, "divu": lambda: x / 3.0, "pow": lambda: y ** x, "powu": lambda: y ** 2.5,
        "relu": lambda: torch.relu(x), "tanh": lambda: torch.tanh(x), "gelu": lambda: nn.functional.gelu(x),
        "softmax": lambda: torch.softmax(x, dim=-1)}
    if op == "ln":
        norm = nn.LayerNorm(s["H"], **f32)
        return lambda: norm(x)
    return calls[op]


def _time_ms(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int, keep: int) -> float:
    """Mean of the ``keep`` fastest of ``repeats`` timed calls (after three warm-up calls), in ms."""
    cuda = device.type == "cuda"
    times = []
    with torch.no_grad():
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            if cuda:
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
    return float(np.mean(sorted(times)[:keep]))


def _kernels(fn: Callable[[], torch.Tensor], device: torch.device, op: str) -> dict[str, object]:
    """The launch record of one call: main kernel (the longest), its geometry and occupancy, all kernels."""
    if device.type != "cuda":
        return {"Kernel Name": f"cpu:{op}", "Kernels": f"cpu:{op}", "Grid x": 1, "Grid y": 1, "Grid z": 1,
                "Block x": 1, "Block y": 1, "Block z": 1, "Warps per SM": np.nan, "Blocks per SM": np.nan}
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    return kernel_record(events)


def kernel_record(events: list[dict]) -> dict[str, object]:
    """The schema's kernel columns from the events of a ``torch.profiler`` chrome trace of one call: the longest
    GPU kernel is the row's kernel (its grid, block, blocks and warps per SM), every kernel is in ``Kernels``.

    Examples
    --------
    >>> ev = [{"cat": "kernel", "name": "ampere_sgemm_128x64_tn", "dur": 9.0,
    ...        "args": {"grid": [8, 4, 1], "block": [256, 1, 1], "blocks per SM": 0.3, "warps per SM": 2.4}}]
    >>> kernel_record(ev)["Kernel Name"], kernel_record(ev)["Grid x"]
    ('ampere_sgemm_128x64_tn', 8)
    """
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {"Kernel Name": "", "Kernels": "", **{c: np.nan for c in SCHEMA[6:14]}}
    main = max(kernels, key=lambda e: float(e.get("dur", 0.0)))
    args = main.get("args", {})
    grid, block = list(args.get("grid", [np.nan] * 3)), list(args.get("block", [np.nan] * 3))
    return {"Kernel Name": main.get("name", ""), "Kernels": ";".join(e.get("name", "") for e in kernels),
            "Grid x": grid[0], "Grid y": grid[1], "Grid z": grid[2],
            "Block x": block[0], "Block y": block[1], "Block z": block[2],
            "Warps per SM": args.get("warps per SM", np.nan), "Blocks per SM": args.get("blocks per SM", np.nan)}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine() or 'unknown'})"


def collect(out: str | os.PathLike, ops: Sequence[str] = OPS, sweep: str | Sweep = "default", *,
            device: str | torch.device | None = None, device_name: str | None = None, seed: int = 0,
            repeats: int = 25, keep: int = 5, progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Path]:
    """Time ``ops`` over ``sweep`` on ``device`` (default: the current CUDA GPU, else the CPU) and write one CSV
    per op; returns {op: file}. ``device_name`` replaces the ``Device`` column (default: the name torch reports).

    Examples
    --------
    >>> files = collect("/tmp/my-traces", ops=["bmm", "softmax"], sweep="quick", device="cpu")  # doctest: +SKIP
    """
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise InputError(f"ops={list(ops)!r}: {unknown[0] if unknown else 'empty'} is not an op the collector "
                         f"knows. Fix: choose from {', '.join(OPS)}")
    if isinstance(sweep, str):
        if sweep not in SWEEPS:
            raise InputError(f"sweep={sweep!r} is not known. Fix: one of {', '.join(SWEEPS)}")
        sweep = SWEEPS[sweep]
    if not 1 <= keep <= repeats:
        raise InputError(f"keep={keep} must be between 1 and repeats={repeats}. Fix: e.g. repeats=25 keep=5")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device='cuda' but torch sees no CUDA / ROCm GPU. Fix: run on a GPU machine, or device=cpu "
                         "to try the tool")
    name = device_name or _device_name(dev)
    versions = {"Torch Version": torch.__version__,
                "CUDNN Version": torch.backends.cudnn.version() if dev.type == "cuda" else "",
                "CUDA Version": (torch.version.cuda or getattr(torch.version, "hip", None) or "") if dev.type == "cuda" else ""}
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False   # FP32, as the dataset
    written: dict[str, Path] = {}
    try:
        for op in ops:
            shapes = op_shapes(op, sweep, seed)
            rows = []
            for s in (progress(shapes) if progress else shapes):
                fn = _make_call(op, s, dev)
                ms = _time_ms(fn, dev, repeats, keep)
                rows.append({"OPName": op, "Latency": ms, "Device": name, **versions, **_kernels(fn, dev, op), **s})
                del fn
            frame = pd.DataFrame(rows, columns=[*SCHEMA, *SHAPE_COLUMNS[op]])
            path = Path(out) / op / f"{name.replace(' ', '_').replace('/', '_')}.csv"
            atomic_write_text(path, frame.to_csv(index=False))
            written[op] = path
            log.info("%s: %d shapes on %s -> %s", op, len(frame), name, path)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return written

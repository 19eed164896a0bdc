"""GPU memory forecast of a traced run: live storage bytes op by op, the peak, what it is made of, whether it
fits on a device, and the largest batch that does.

Method (:func:`estimate_memory`)
--------------------------------
1. Walk the recorded aten ops in program order and cut them into *storages* with lifetimes. An output whose
   storage is one of the op's inputs is a view or an in-place result (same storage, counted once); any other
   output is a fresh allocation. A storage id (the address of the meta StorageImpl) can be reused by a later
   allocation once its storage is freed, so a fresh output always starts a new lifetime.
2. A storage is live from the op that produces it to its last use as an input or output of a later op, or
   later, until the program dropped it as the trace ran (``OpRecord.freed``): a Python variable still holding it
   (Hugging Face's attention returns its probabilities), a tensor autograd saved for a node that has not run yet,
   the temporaries of a backward node's formula, which go when the node returns. The training loop adds its own
   (see ``_lifetimes``): parameters, buffers and optimizer state live throughout; gradients from the backward op
   that produces them to the end of the step; the model inputs and the model outputs the loss reads (logits) are
   held by the caller for the whole step.
3. Live bytes per op = sum of the storages live while it runs (its inputs and outputs both held). The caching
   allocator rounds every block to 512 B; the peak op's blocks are then packed into segments (the reserved
   memory an OOM is decided on), and the framework's fixed costs (CUDA context, cuBLAS/cuDNN workspaces) added.
4. Under torch.compile (``fused=True``) the storages become the compiled run's before step 2's lifetimes (not the
   trace's frees: Inductor's code frees each buffer after its last use, whatever Python held eagerly): what a
   fused kernel keeps on chip is not allocated (:func:`_unmaterialized`), and the forward keeps for the backward
   what Inductor's min-cut partitioner saves, the rest being recomputed there (:func:`_recomputed`,
   :mod:`neusight.remat`). The compiled backward also gets a zero gradient for each output the loss does not read
   (:func:`_tangents`), runs a GEMM whose output is only added to another gradient inside that sum
   (:func:`_addmm_sums`), and writes pointwise kernels' outputs over inputs they read last (:func:`_in_place`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from torch.overrides import TorchFunctionMode

from neusight.errors import InputError
from neusight.graph.graph import Graph
from neusight.kernels.base import Family

__all__ = ["CATEGORIES", "CpuMeasurement", "MemoryReport", "estimate_memory", "find_max_batch", "fixed_costs",
           "measure_cpu", "saved_activations"]

log = logging.getLogger(__name__)

MiB = 2**20

# ---------------------------------------------------------------------------------------------------------
# PyTorch's CUDA caching allocator, c10/cuda/CUDACachingAllocator.cpp (kMinBlockSize, kSmallSize, kSmallBuffer,
# kLargeBuffer, kMinLargeAlloc, kRoundLarge; the same values from PyTorch 1.x to 2.x).
MIN_BLOCK_BYTES = 512              # every block is rounded up to a multiple of 512 B
SMALL_ALLOC_BYTES = 1 * MiB        # blocks up to 1 MiB come from the small pool ...
SMALL_SEGMENT_BYTES = 2 * MiB      # ... which cudaMallocs 2 MiB segments and packs blocks into them
LARGE_SEGMENT_BYTES = 20 * MiB     # 1-10 MiB blocks are carved out of 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * MiB   # from here a block gets its own segment ...
ROUND_LARGE_BYTES = 2 * MiB        # ... rounded up to 2 MiB
# NB: segments are modelled as perfectly packed (no fragmentation): the reserved memory a real run reaches is at
# least this, more when freed blocks of one size cannot serve a later request of another.

# ---------------------------------------------------------------------------------------------------------
# Framework fixed costs on the device, outside the tensors of the model.
# CUDA context (driver state + the kernels loaded into it), by architecture, MiB. With lazy module loading
# (CUDA >= 11.7, PyTorch's default since 1.13) it is ~300-450 MiB:
#   287 MB after the first CUDA tensor with CUDA_MODULE_LOADING=LAZY vs 667 MB eager (pytorch/pytorch#86509);
#   "around 400MB if CUDA >= 11.7 ... lazy module loading" (ptrblck, pytorch/pytorch#109888);
#   426 MiB on an RTX 6000 Ada, PyTorch 2.10 + CUDA 13.0 (unslothai/unsloth-zoo#1053).
# NB: Hopper/Blackwell have no public number at hand; we take the top of the range for them.
CUDA_CONTEXT_MIB = {"maxwell": 300, "pascal": 300, "volta": 300, "turing": 300, "ampere": 400, "ada": 430,
                    "hopper": 500, "blackwell": 500, "cdna1": 400, "cdna2": 400, "cdna3": 500}
CUDA_CONTEXT_DEFAULT_MIB = 450
# cuBLAS workspace per (handle, stream), allocated through the caching allocator and kept for the process:
# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: CUBLAS_WORKSPACE_CONFIG default
# ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB = 8.125 MiB, 32 MiB on sm_90 (Hopper); ROCm (hipBLAS) 32 MiB,
# 128 MiB on gfx94x/95x (CDNA3). parseCUDABlasLtWorkspaceSize: cuBLASLt 1 MiB (hipBLASLt 76 MiB), own pool.
CUBLAS_WORKSPACE_BYTES = {"default": (4096 * 2 + 16 * 8) * 1024, "hopper": 32 * MiB, "cdna1": 32 * MiB,
                          "cdna2": 32 * MiB, "cdna3": 128 * MiB}
CUBLASLT_WORKSPACE_BYTES = {"default": 1 * MiB, "cdna1": 76 * MiB, "cdna2": 76 * MiB, "cdna3": 76 * MiB}
# Training runs backward on autograd's per-device worker thread, which takes its own cuBLAS handle (handles
# are per thread, torch/csrc/autograd/engine.cpp): two workspaces instead of one.
BLAS_HANDLES = {"inference": 1, "training": 2}
# cuDNN convolution workspace: transient, sized by the algorithm cuDNN picks. NB: an allowance (assumption),
# not a measurement: algorithms that need more are skipped by PyTorch when memory is short.
CUDNN_WORKSPACE_BYTES = 64 * MiB

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "workspace")
Allocator = Literal["cuda", "exact"]


@dataclass
class MemoryReport:
    """Forecast memory of one traced run; bytes everywhere.

    Attributes
    ----------
    peak_bytes : int
        What the run needs on the device: ``tensor_peak_bytes`` + allocator segment slack + framework costs.
    tensor_peak_bytes : int
        Allocated tensor bytes at the peak: weights + gradients + optimizer + activations + workspace.
    fits : bool or None
        ``peak_bytes <= device_memory_bytes``; None without a device.
    device_memory_bytes : int or None
    breakdown : dict
        weights, gradients, optimizer, activations (saved for backward, model inputs and outputs), workspace
        (transient), allocator (reserved but unallocated segment tails), framework (CUDA context, cuBLAS/cuDNN).
    where : dict
        ``op_index``, ``aten_op``, ``module``, ``phase`` of the peak.
    allocator, model, mode, batch_size, device : str, int
        How the forecast was made and of what (``device`` is the device's name, None without one).
    fused : bool
        The run under torch.compile (``estimate_memory(..., fused=True)``).
    timeline : DataFrame
        One row per op: op_index, phase, module, aten_op, live_bytes (while the op runs), and the bytes of
        each category in ``CATEGORIES``.
    """

    peak_bytes: int
    tensor_peak_bytes: int
    fits: bool | None
    device_memory_bytes: int | None
    breakdown: dict[str, int]
    where: dict[str, Any]
    timeline: pd.DataFrame = field(repr=False)
    allocator: str = "cuda"
    model: str = ""
    mode: str = ""
    batch_size: int = 0
    device: str | None = None   # the device's name
    fused: bool = False

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (without the timeline)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeline"}
        out["breakdown"] = dict(self.breakdown)
        out["where"] = dict(self.where)
        return out


@dataclass
class _Storage:
    """One allocation: its bytes, category and [start, end] op interval (inclusive)."""

    nbytes: int
    start: int
    end: int
    kind: str              # weights | gradients | optimizer | input | made in <phase>
    module: str = ""       # module path of the op that made it
    backward_use: bool = False
    held: bool = False     # kept alive to the end of the step by the caller
    users: set[int] = field(default_factory=set)   # the ops that read it
    output_grad: int = 0   # a model output that requires grad: the bytes of its gradient (held outputs only)


def _block(nbytes: np.ndarray) -> np.ndarray:
    """Caching-allocator block size: rounded up to a multiple of 512 B (0 stays 0: no block)."""
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def _segment_slack(blocks: np.ndarray) -> int:
    """Reserved-but-unallocated bytes for a set of live blocks, packed into the allocator's segments: blocks of
    10 MiB and more each in their own segment rounded up to 2 MiB; 1-10 MiB blocks together in 20 MiB
    segments; blocks up to 1 MiB together in 2 MiB segments."""
    def ceil(x: np.ndarray | int, m: int) -> np.ndarray | int:
        return -(-x // m) * m

    own = blocks[blocks >= MIN_LARGE_ALLOC_BYTES]
    mid = int(blocks[(blocks > SMALL_ALLOC_BYTES) & (blocks < MIN_LARGE_ALLOC_BYTES)].sum())
    small = int(blocks[blocks <= SMALL_ALLOC_BYTES].sum())
    return (int((ceil(own, ROUND_LARGE_BYTES) - own).sum()) + ceil(mid, LARGE_SEGMENT_BYTES) - mid
            + ceil(small, SMALL_SEGMENT_BYTES) - small)


def _walk(graph: Graph, frees: bool = False) -> list[_Storage]:
    """Cut the op sequence into storages with first and last use (step 1-2 of the module docstring); ``frees``:
    a storage lives at least until the traced program dropped it (``OpRecord.freed``), the eager run's lifetimes."""
    n = len(graph.ops)
    fixed = {t.storage: kind for kind, metas in (("weights", graph.params), ("weights", graph.buffers))
             for t in metas}
    state_ids = {t.storage for t in graph.optimizer_state}
    current: dict[int, _Storage] = {}
    storages: list[_Storage] = []
    in_optimizer = False

    def persistent(sid: int, nbytes: int, kind: str) -> _Storage:
        s = _Storage(nbytes, 0, n - 1, kind, held=True)
        storages.append(s)
        current[sid] = s
        return s

    for rec in graph.ops:
        i, phase = rec.index, rec.phase
        if phase == "optimizer" and not in_optimizer:
            # The state is created by the tracer's un-recorded warm-up step, after backward: an earlier storage
            # at the same address was a different one, freed before.
            in_optimizer = True
            for t in graph.optimizer_state:
                persistent(t.storage, t.nbytes, "optimizer")
        inputs = rec.call.tensor_args()
        in_ids = {t.storage for t in inputs}
        for t in inputs:
            if t.nbytes == 0:   # empty tensors hold no memory (and may share an address with anything)
                continue
            s = current.get(t.storage)
            if s is not None and s.nbytes != t.nbytes and s.kind not in ("weights", "optimizer"):
                # NB: a different size at a known address is a new storage made where the trace does not
                # record (e.g. torch.tensor(...)), at the address of one freed before: not a use of the old one
                s = None
            if s is None:
                kind = fixed.get(t.storage)
                if kind is not None:
                    s = persistent(t.storage, t.nbytes, kind)
                elif t.storage in state_ids:
                    s = persistent(t.storage, t.nbytes, "optimizer")
                else:   # made before the trace (model inputs) or in an un-recorded region
                    s = _Storage(t.nbytes, 0 if phase == "forward" else i, i,
                                 "input" if phase == "forward" else f"made in {phase}", held=phase == "forward")
                    storages.append(s)
                    current[t.storage] = s
            s.end = max(s.end, i)
            s.nbytes = max(s.nbytes, t.nbytes)
            s.users.add(i)
            if phase == "backward" and s.kind in ("input", "made in forward", "made in loss"):
                s.backward_use = True
            if phase == "loss" and s.kind == "made in forward":
                s.held = True   # a model output the loss reads (logits): the caller holds it all step
        fresh: set[int] = set()
        for t in rec.call.outputs:
            if t.nbytes == 0:
                continue
            if t.storage in in_ids or t.storage in fresh:
                s = current[t.storage]
                s.end, s.nbytes = max(s.end, i), max(s.nbytes, t.nbytes)
                continue
            fresh.add(t.storage)
            s = _Storage(t.nbytes, i, i, f"made in {phase}", rec.module)
            storages.append(s)
            current[t.storage] = s
        for sid in rec.freed if frees else ():
            s = current.get(sid)
            if s is not None:
                s.end = max(s.end, i)
    for t in graph.grads:   # the latest storage at a grad's address is the grad (it is alive at the end)
        s = current.get(t.storage)
        if s is not None and s.kind not in ("weights", "optimizer"):
            s.kind = "gradients"
    for t in graph.held:   # what the model output keeps alive (logits, a KV cache: DynamicLayer keys/values)
        s = current.get(t.storage)
        if s is not None:
            s.held = True
            if t.requires_grad:
                s.output_grad += t.numel * t.itemsize
    return storages


def _layout_workspace(graph: Graph, device: Any, fused: bool) -> list[_Storage]:
    """cuDNN's NHWC copies of the operands of each convolution it transposes on ``device``
    (:mod:`neusight.graph.layout`), workspace while the convolution runs: cuDNN allocates no device memory of its
    own, it works in the workspace PyTorch hands it. An op's kernels (a data and a weight gradient) run one after
    the other, so the op needs the largest of theirs."""
    if device is None:
        return []
    from neusight.graph.layout import charged
    from neusight.kernels.formulas import itemsize
    from neusight.predictor.features import without_tensor_cores

    k = graph.kernels
    sel = k[charged(graph, k, device, ~without_tensor_cores(k), fused)[0]]
    need = sel.assign(nbytes=[itemsize(d) * sum(o) for d, o in zip(sel["dtype"], sel["nchw_operands"])])
    modules = {r.index: r.module for r in graph.ops}
    return [_Storage(int(b), int(i), int(i), "cudnn workspace", module=modules[int(i)])
            for i, b in need.groupby("op_index")["nbytes"].max().items()]


def _category(s: _Storage, mode: str) -> str:
    if s.kind in ("weights", "gradients", "optimizer"):
        return s.kind
    if s.kind == "input" or (s.kind in ("made in forward", "made in loss")
                             and (mode == "inference" or s.backward_use or s.held)):
        return "activations"
    return "workspace"


def _compiled(storages: list[_Storage], graph: Graph, device: Any) -> None:
    """Turn the eager run's storages into the compiled run's (step 4 of the module docstring)."""
    from neusight.graph.fusion import _device_key, fused_units

    k = graph.kernels
    launching = set(k.loc[k["family"] != Family.VIEW.value, "op_index"])
    units, views = fused_units(graph, device), {r.index for r in graph.ops} - launching
    storages += _gemm_copies_of_relaid_cats(storages, graph, views)
    storages += _tangents(storages, graph)
    sizes = [s.nbytes for s in storages]
    _unmaterialized(storages, units, views)
    # the min-cut depends on the graph and on what the fusion asks of the device (as the units): solved once each
    cache, key = graph.__dict__.setdefault("_remat_cache", {}), _device_key(graph, device)
    cache[key] = _recomputed(storages, units, sizes, views, graph, cache.get(key))
    _addmm_sums(storages, graph, views)
    _in_place(storages, graph, units, views, launching)


def _by_op(storages: list[_Storage], views: set[int]) -> tuple[dict[int, list[_Storage]], dict[int, list[_Storage]]]:
    """The storages each op makes, and those each op reads (views, which launch nothing, and the maker left out)."""
    made: dict[int, list[_Storage]] = {}
    read: dict[int, list[_Storage]] = {}
    for s in storages:
        made.setdefault(s.start, []).append(s)
        for u in s.users - views - {s.start}:
            read.setdefault(u, []).append(s)
    return made, read


def _elementwise(rec: Any) -> bool:
    """Whether every kernel the op launches is elementwise."""
    return all(k.family is Family.ELEMENTWISE for k in rec.kernels)


def _in_place(storages: list[_Storage], graph: Graph, units: list[set[int]], views: set[int],
              launching: set[int]) -> None:
    """Inductor writes a pointwise kernel's output over an input that the kernel reads for the last time when the two
    are the same size (its scheduler's in-place buffer update: within 5 %, never over), a saved tensor the backward
    is done with included; eager allocates the output anew, so both live while the op runs. Here a kernel is a fused
    unit or a lone launching op of the model's forward or backward whose kernels are all elementwise (reductions,
    softmax and norms read their input more than once, GEMMs are library calls); the input it takes over then dies
    when the output is made."""
    grouped = set().union(*units) if units else set()
    kernels = [*units, *({i} for i in sorted(launching - grouped))]
    made, read = _by_op([s for s in storages if s.nbytes and s.kind.startswith("made in") and not s.held], views)
    for ops in kernels:
        ops = ops - views
        if not ops or any(graph.ops[i].phase not in ("forward", "backward") or not _elementwise(graph.ops[i])
                          for i in ops):
            continue
        lo, hi = min(ops), max(ops)
        free = list({id(s): s for i in sorted(ops) for s in read.get(i, ()) if s.start < lo <= s.end <= hi}.values())
        for out in (s for i in sorted(ops) for s in made.get(i, ())):
            taken = next((s for s in free if 0.95 * s.nbytes <= out.nbytes <= s.nbytes), None)
            if taken is not None:
                free.remove(taken)
                taken.end = min(taken.end, out.start - 1)


def _tangents(storages: list[_Storage], graph: Graph) -> list[_Storage]:
    """The compiled model is one autograd Function to the training loop, whose backward gets a gradient for every
    output that requires one: an output the loss never reads (a KV cache the model returns, its keys and values made
    from the weights) gets a zero tensor of its size (autograd's ``materialize_grads``), allocated when the backward
    reaches the compiled region, after the loss's own backward ops, and freed by Inductor's backward code after its
    last use, in the backward of the module that made the output. Eager's backward has none."""
    phase = [r.phase for r in graph.ops]
    backward = [i for i, p in enumerate(phase) if p == "backward"]
    if not backward:
        return []
    loss_back = [u for s in storages if s.kind == "made in loss" for u in s.users if phase[u] == "backward"]
    start = min(max(loss_back, default=backward[0] - 1) + 1, backward[-1])
    own: dict[str, int] = {}     # module -> its last backward op; inside: the same for its submodules' ops
    inside: dict[str, int] = {}
    for i in (i for i in backward if i >= start):
        module = graph.ops[i].module
        own[module] = i
        while module:
            module = module.rpartition(".")[0]
            inside[module] = i
    return [_Storage(s.output_grad, start, own.get(s.module, inside.get(s.module, backward[-1])), "made in backward",
                     s.module) for s in storages
            if s.output_grad and s.kind == "made in forward" and not any(phase[u] == "loss" for u in s.users)]


def _addmm_sums(storages: list[_Storage], graph: Graph, views: set[int]) -> None:
    """Inductor rewrites ``mm(a, b) + c`` into one ``addmm(c, a, b)`` (a post-grad pattern; on a GPU only where the
    sum feeds something other than pointwise ops): a weight used twice (tied embeddings and output layer) gets the
    gradient of its first use from a GEMM that eager runs at once and adds to the second use's at the end of the
    backward; compiled, that GEMM runs at the end, inside the sum (a gradient, returned), so its output is never held
    on its own and its operands (the logits' gradient, the last hidden states) live until then."""
    ops = graph.ops
    by_start, reads = _by_op(storages, views)
    for r in ops:
        if r.phase != "backward" or r.call.op != "aten.mm.default" or not r.call.outputs:
            continue
        shape = r.call.outputs[0].shape
        for out in (s for s in by_start.get(r.index, ()) if s.kind.startswith("made in") and not s.held):
            later = out.users - views - {r.index}
            if len(later) != 1:
                continue
            a = ops[min(later)]
            args = a.call.tensor_args()
            if (a.phase != "backward" or a.call.op != "aten.add.Tensor" or len(args) != 2
                    or any(t.shape != shape for t in args)):
                continue
            fed = {u for t in by_start.get(a.index, ()) for u in t.users - views - {a.index}
                   if ops[u].phase == "backward"}
            if fed and all(_elementwise(ops[u]) for u in fed):
                continue
            out.nbytes = 0
            for s in reads.get(r.index, ()):
                if s.kind.startswith("made in") and s.end < a.index:
                    s.end = a.index


def _gemm_copies_of_relaid_cats(storages: list[_Storage], graph: Graph, views: set[int]) -> list[_Storage]:
    """A ``cat`` of one non-empty tensor (a KV cache's first update, ``cat([empty, k])``) is a copy to Inductor that
    keeps its input's layout, where eager's cat is contiguous. When that input is a transposed view (heads split from
    a projection: (batch, seq, heads, dim) in memory), the attention GEMMs that read the cache through views can no
    longer flatten batch and heads, and Inductor gives each one a contiguous copy of its operand, which that GEMM's
    backward reads: one more storage the size of the cat per GEMM that reads it in the forward."""
    made = _by_op(storages, views)[0]
    gemm = set(graph.kernels.loc[graph.kernels["family"].isin([Family.BMM.value, Family.LINEAR.value]), "op_index"])
    copies: list[_Storage] = []
    for r in graph.ops:
        if r.phase != "forward" or r.call.op != "aten.cat.default":
            continue
        ins = [t for t in r.call.tensor_args() if t.nbytes > 0]
        outs = [s for s in made.get(r.index, []) if s.kind == "made in forward"]
        if len(ins) != 1 or len(outs) != 1 or _row_major(ins[0]):
            continue
        out = outs[0]
        back = [u for u in out.users - views if u in gemm and graph.ops[u].phase == "backward"]
        fwd = sorted(u for u in out.users - views if u in gemm and graph.ops[u].phase == "forward")
        for u in fwd:
            copies.append(_Storage(out.nbytes, u, max([u, *back]), "made in forward", graph.ops[u].module,
                                   backward_use=bool(back), users={u, *back}))
        if fwd:   # the backward GEMMs read the copies, not the cat
            out.users -= set(back)
            out.backward_use = any(graph.ops[u].phase == "backward" for u in out.users)
            if not out.held:
                out.end = max(out.users | {out.start})
    return copies


def _row_major(t: Any) -> bool:
    """Whether ``t``'s dimensions (those longer than 1) lie in memory in their own order, outermost first."""
    strides = [st for st, n in zip(t.stride, t.shape) if n > 1]
    return all(a > b for a, b in zip(strides, strides[1:]))


def _unmaterialized(storages: list[_Storage], units: list[set[int]], views: set[int]) -> None:
    """Drop what a fused kernel keeps on chip: a storage made by an op of a fused unit
    (:func:`neusight.graph.fusion.fused_units`) that only ops of the same unit read (``views``, ops that launch no
    kernel, do not count), and that nothing holds, is never allocated (torch.compile's kernel computes it in
    registers; a rewritten attention chain's scores, softmax and dropout mask are recomputed by its backward)."""
    unit_of = {i: k for k, unit in enumerate(units) for i in unit}
    for s in storages:
        if s.held or not s.kind.startswith("made in") or s.start not in unit_of:
            continue
        users = s.users - views
        if users and users <= units[unit_of[s.start]]:
            s.nbytes = 0


def _recomputed(storages: list[_Storage], units: list[set[int]], sizes: list[int], views: set[int],
                graph: Graph, saved: set[int] | None = None) -> set[int]:
    """What torch.compile's partitioner saves for the backward and what it recomputes there instead
    (:func:`neusight.remat.saved_set`, its min-cut): a recomputed storage lives to its last forward use (or is
    never written, when a fused kernel kept it on chip), what it is recomputed from lives to the last backward use
    of what it rebuilds; a saved one a fused kernel would have kept on chip is written after all. Storages of a
    rewritten attention chain (a unit with backward ops) are the fused attention kernels' own business. ``saved``:
    the min-cut's answer for these storages when known (it is returned)."""
    from neusight.remat import saved_set

    phase = {r.index: r.phase for r in graph.ops}
    attention = set().union(*(u for u in units if any(phase[i] == "backward" for i in u)))
    candidates = {k for k, s in enumerate(storages) if s.kind == "made in forward" and not s.held
                  and phase[s.start] == "forward" and s.start not in attention}
    if saved is None:
        saved = saved_set(storages, graph, candidates, dict(enumerate(sizes)), views)
    read: dict[int, set[int]] = {}
    for k, s in enumerate(storages):
        for u in s.users - views:
            if s.start != u:
                read.setdefault(u, set()).add(k)
    need: dict[int, int] = {}   # recomputed storage -> the last backward op that reads it or what it rebuilds
    for k in candidates - saved:
        back = [u for u in storages[k].users - views if phase[u] == "backward"]
        if back:
            need[k] = max(back)
    stats: list[_Storage] = []
    for k in sorted(candidates, key=lambda k: storages[k].start, reverse=True):
        s = storages[k]
        if k in saved:
            s.nbytes = max(s.nbytes, sizes[k])
            continue
        if k not in need:
            continue
        s.end = max((u for u in s.users - views if phase[u] != "backward"), default=s.start)
        s.backward_use = False
        rec = graph.ops[s.start]
        if any(kn.family is Family.SOFTMAX for kn in rec.kernels):   # its two row statistics (max, sum) are saved
            out = rec.call.outputs[0]
            stats.append(_Storage(8 * out.numel // max(out.shape[-1], 1), s.start, need[k], s.kind, s.module,
                                  backward_use=True))
        for j in read.get(s.start, ()):
            if j in candidates and j not in saved:
                need[j] = max(need.get(j, -1), need[k])
            elif need[k] > storages[j].end:
                storages[j].end, storages[j].backward_use = need[k], True
    storages += stats
    return saved


def _lifetimes(storages: list[_Storage], n: int, keep_grads: bool = False) -> None:
    """Apply the training-loop lifetimes: what the caller holds and the gradients live to the end of the step.

    Gradients: live from the backward op that produces them to the end of the step, not throughout, because
    ``optimizer.zero_grad()`` sets them to None by default (``set_to_none=True`` since PyTorch 2.0), which frees
    them between steps; so during the forward pass of a steady-state loop no gradient exists. A loop that zeroes
    them instead (``keep_grads``: the trace's ``zero_grad=True``, Megatron-LM's gradient buffer) keeps them for
    the whole step.
    """
    for s in storages:
        if s.held or s.kind == "gradients":
            s.end = n - 1
        if keep_grads and s.kind == "gradients":
            s.start = 0


def estimate_memory(graph: Graph, device: Any = None, *, allocator: Allocator = "cuda",
                    fused: bool = False, transient: dict[int, int] | None = None) -> MemoryReport:
    """Forecast the device memory of a traced run: peak, breakdown, where, timeline.

    Parameters
    ----------
    graph : Graph
        From :func:`neusight.trace`.
    device : str or Device, optional
        Adds ``fits`` and the architecture-dependent fixed costs (else the defaults of the constants above).
    allocator : {"cuda", "exact"}
        ``"cuda"``: blocks rounded as PyTorch's CUDA caching allocator does, segment slack and framework costs
        added. ``"exact"``: requested tensor bytes only, no rounding, no fixed costs (what a CPU run reports).
    fused : bool
        The run under ``torch.compile`` (as ``predict(..., fused=True)`` forecasts its kernels): what a fused
        kernel keeps on chip is not allocated (:func:`_unmaterialized`), what its partitioner recomputes in the
        backward is not saved, what it saves instead is (:func:`_recomputed`); everything else as the eager run
        holds it.
    transient : dict, optional
        Bytes held as workspace while op ``i`` runs, beyond the graph's tensors: communication buffers, e.g. those of
        context parallelism (:func:`neusight.parallel.context_buffer_bytes`), keyed by op index.

    Returns
    -------
    MemoryReport

    Examples
    --------
    >>> import neusight
    >>> from neusight.memory import estimate_memory
    >>> g = neusight.trace("resnet18", batch_size=2, mode="training", optimizer="sgd")
    >>> r = estimate_memory(g, "l4")
    >>> r.fits, r.where["phase"]
    (True, 'backward')
    """
    if allocator not in ("cuda", "exact"):
        raise InputError(f"allocator={allocator!r} is not known; use 'cuda' (GPU caching allocator) or 'exact'")
    if not graph.ops:
        raise InputError(f"the graph of {graph.model} has no ops; trace a model that runs at least one op")
    if device is not None and not hasattr(device, "memory_bytes"):
        from neusight.devices import load_device

        device = load_device(device)
    n = len(graph.ops)
    storages = _walk(graph, frees=not fused)
    if fused:
        _compiled(storages, graph, device)
    _lifetimes(storages, n, keep_grads=graph.keeps_grads)
    storages += _layout_workspace(graph, device, fused)
    modules = {r.index: r.module for r in graph.ops}
    storages += [_Storage(int(b), int(i), int(i), "communication buffers", module=modules[int(i)])
                 for i, b in (transient or {}).items() if b > 0]
    sizes = np.array([s.nbytes for s in storages], dtype=np.int64)
    blocks = _block(sizes) if allocator == "cuda" else sizes
    start = np.array([s.start for s in storages], dtype=np.int64)
    end = np.array([s.end for s in storages], dtype=np.int64)
    cats = np.array([CATEGORIES.index(_category(s, graph.mode)) for s in storages], dtype=np.int64)
    per_cat = np.zeros((len(CATEGORIES), n + 1), dtype=np.int64)   # difference arrays, then running sums
    np.add.at(per_cat, (cats, start), blocks)
    np.add.at(per_cat, (cats, end + 1), -blocks)
    per_cat = per_cat.cumsum(axis=1)[:, :n]
    live = per_cat.sum(axis=0)
    peak_i = int(np.argmax(live))
    rec = graph.ops[peak_i]
    breakdown = {c: int(per_cat[k, peak_i]) for k, c in enumerate(CATEGORIES)}
    tensor_peak = int(live[peak_i])
    if allocator == "cuda":
        at_peak = blocks[(start <= peak_i) & (end >= peak_i)]
        breakdown["allocator"] = _segment_slack(at_peak)
        breakdown["framework"] = sum(fixed_costs(device, graph).values())
    else:
        breakdown["allocator"] = breakdown["framework"] = 0
    peak = tensor_peak + breakdown["allocator"] + breakdown["framework"]
    timeline = pd.DataFrame({"op_index": np.arange(n), "phase": [r.phase for r in graph.ops],
                             "module": [r.module for r in graph.ops], "aten_op": [r.call.op for r in graph.ops],
                             "live_bytes": live, **{c: per_cat[k] for k, c in enumerate(CATEGORIES)}})
    mem = device.memory_bytes if device is not None else None
    report = MemoryReport(peak_bytes=peak, tensor_peak_bytes=tensor_peak, fits=None if mem is None else peak <= mem,
                          device_memory_bytes=mem, breakdown=breakdown,
                          where={"op_index": peak_i, "aten_op": rec.call.op, "module": rec.module, "phase": rec.phase},
                          timeline=timeline, allocator=allocator, model=graph.model, mode=graph.mode,
                          batch_size=graph.batch_size, device=None if device is None else device.name, fused=fused)
    log.debug("memory of %s (%s, batch %d): peak %.2f GiB at op %d %s in %r", graph.model, graph.mode,
              graph.batch_size, report.peak_gib, peak_i, rec.call.op, rec.module)
    return report


def saved_activations(graph: Graph, fused: bool = False, device: Any = None) -> pd.Series:
    """Bytes of the forward-pass storages that backward reads again ("saved for backward"), per module path of
    the op that made them (requested bytes, no allocator rounding), in program order. ``fused=True``: what the
    step under torch.compile saves (``estimate_memory(..., fused=True)``'s storages, on ``device``'s fusion).

    Examples
    --------
    >>> import neusight
    >>> g = neusight.trace("gpt2", batch_size=1, seq_len=64, mode="training", optimizer=None)
    >>> saved = saved_activations(g)
    >>> int(saved.filter(like="transformer.h.3.").sum()) == int(saved.filter(like="transformer.h.4.").sum())
    True
    """
    return _saved_by(graph, lambda s: s.module, fused, device)


def saved_bytes_by_op(graph: Graph, fused: bool = False, device: Any = None) -> pd.Series:
    """Bytes of the storages saved for backward (as :func:`saved_activations`), per index of the op that made
    them."""
    return _saved_by(graph, lambda s: s.start, fused, device)


def _saved_by(graph: Graph, key: Callable[[_Storage], Any], fused: bool, device: Any) -> pd.Series:
    """Bytes of the storages saved for backward, summed per ``key`` of the storage, in program order."""
    totals: dict[Any, int] = {}
    storages = _walk(graph)
    if fused:
        _compiled(storages, graph, device)
    for s in storages:
        if s.backward_use and s.nbytes and s.kind in ("made in forward", "made in loss"):
            totals[key(s)] = totals.get(key(s), 0) + s.nbytes
    return pd.Series(totals, dtype="int64", name="saved_bytes")


def fixed_costs(device: Any, graph: Graph) -> dict[str, int]:
    """Framework bytes on the device that no tensor of the model accounts for (see the constants above).

    ``device`` may be None: then the defaults apply.
    """
    arch = getattr(device, "architecture", None)
    handles = BLAS_HANDLES.get(graph.mode, 1)
    has_conv = any(k.family is Family.CONV for r in graph.ops for k in r.kernels)
    return {"cuda_context": CUDA_CONTEXT_MIB.get(arch, CUDA_CONTEXT_DEFAULT_MIB) * MiB,
            "cublas_workspace": handles * (CUBLAS_WORKSPACE_BYTES.get(arch, CUBLAS_WORKSPACE_BYTES["default"])
                                           + CUBLASLT_WORKSPACE_BYTES.get(arch, CUBLASLT_WORKSPACE_BYTES["default"])),
            "cudnn_workspace": CUDNN_WORKSPACE_BYTES if has_conv else 0}


# the most probe traces a search over several GPUs keeps (find_max_batch's ``traces``), bounding its memory
SHARED_TRACES = 64


def find_max_batch(model: Any, device: Any, *, seq_len: int | None = None, mode: str = "inference",
                   max_batch: int = 1 << 16, zero: int = 0, dp: int = 1, fused: bool = False,
                   traces: dict | None = None, cp: int = 1, cp_comm: str = "p2p", **trace_kwargs: Any) -> int:
    """Largest batch size whose forecast :attr:`MemoryReport.peak_bytes` fits on ``device``.

    Doubles the batch from 1 until a trace does not fit, then bisects between the last fit and the first
    miss (traces are cheap on meta). Assumes memory grows with the batch.

    Parameters
    ----------
    model, seq_len, mode, **trace_kwargs
        As for :func:`neusight.trace`.
    device : str or Device
    max_batch : int
        Upper end of the search; returned if it still fits.
    zero, dp : int
        With ``zero`` = 1-3, the batch of one of ``dp`` data-parallel replicas whose state ZeRO shards
        (:func:`neusight.parallel.predict_parallel`'s memory of one GPU); the global batch is ``dp`` times it.
    fused : bool
        The memory of the run under torch.compile (:func:`estimate_memory` with ``fused=True``).
    traces : dict, optional
        A dict the caller keeps between searches of the same run on several GPUs: each probe's trace is kept in
        it and reused by a GPU on the same software path (as :func:`neusight.predict_many` shares traces).
    cp : int
        Context parallelism (:func:`neusight.parallel.predict_parallel`'s ``cp``): each sequence of ``seq_len``
        split over ``cp`` GPUs, the memory of one of them (its seq_len / cp tokens; ZeRO over dp x cp GPUs, and
        the exchange buffers of ``cp_comm``, :func:`neusight.parallel.context_buffer_bytes`).

    Returns
    -------
    int
        0 if batch 1 does not fit.
    """
    if not isinstance(max_batch, int) or max_batch < 1:
        raise InputError(f"max_batch={max_batch!r} is not a positive integer; use max_batch >= 1")
    from neusight.parallel import Parallelism, check_context_seq_len

    Parallelism(cp=cp, cp_comm=cp_comm)          # its own checks of cp
    if cp > 1:
        check_context_seq_len(seq_len, cp, cp_comm)
    part = seq_len // cp if cp > 1 else seq_len
    return _largest_fit(lambda b: dict(batch_size=b, seq_len=part), "batch_size", max_batch, model, device, mode,
                        {**trace_kwargs, **({"context_parallel": cp} if cp > 1 else {})}, zero, dp * cp, fused,
                        traces, cp_comm)


def find_max_seq_len(model: Any, device: Any, *, batch_size: int = 1, mode: str = "inference",
                     max_seq_len: int | None = None, step: int = 64, zero: int = 0, dp: int = 1,
                     fused: bool = False, traces: dict | None = None, cp: int = 1, cp_comm: str = "p2p",
                     **trace_kwargs: Any) -> int:
    """Longest sequence (a multiple of ``step``) whose forecast memory peak fits on ``device`` at ``batch_size``.

    The same search as :func:`find_max_batch`, over multiples of ``step`` up to ``max_seq_len`` (default: the
    model's maximum positions, else 1 << 20); with ``images`` (a multimodal prompt), its image tokens and a multiple
    of ``step`` of text. Assumes memory grows with the sequence. Returns 0 if ``step``
    tokens do not fit. ``zero`` / ``dp`` / ``fused`` / ``traces`` / ``cp`` / ``cp_comm`` as in :func:`find_max_batch`
    (``batch_size`` is then one replica's; with ``cp`` each GPU holds multiples of ``step`` tokens of a sequence
    ``cp`` times as long, which is what is returned).
    """
    from neusight.graph.models import build_model
    from neusight.parallel import Parallelism

    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise InputError(f"step={step!r} is not a positive integer; use e.g. step=64")
    built = build_model(model, **{k: trace_kwargs[k] for k in ("head", "attn_implementation", "input_shapes", "images")
                                  if trace_kwargs.get(k) is not None})
    if not built.needs_seq_len:
        raise InputError(f"{built.name} takes no sequence length. Fix: find_max_batch for its batch size")
    images = built.image_tokens    # a multimodal prompt's image tokens (images=): the search is over the text beside
    Parallelism(cp=cp, cp_comm=cp_comm)          # its own checks of cp
    if cp > 1 and cp_comm != "a2a" and step % 2:
        raise InputError(f"step={step} with cp={cp}: each GPU's part of a sequence is two chunks, so an even "
                         "number of tokens. Fix: an even step, e.g. step=64")
    if max_seq_len is not None and built.max_seq_len and max_seq_len > built.max_seq_len:
        raise InputError(f"max_seq_len={max_seq_len} exceeds {built.name}'s maximum of {built.max_seq_len} positions. "
                         f"Fix: max_seq_len <= {built.max_seq_len}, or leave it out to search up to it")
    cap = ((max_seq_len or built.max_seq_len or 1 << 20) - images) // cp
    if cap < step:
        return 0
    n = _largest_fit(lambda n: dict(batch_size=batch_size, seq_len=images + n * step), "seq_len", cap // step,
                     model, device, mode, {**trace_kwargs, **({"context_parallel": cp} if cp > 1 else {})}, zero,
                     dp * cp, fused, traces, cp_comm)
    return images + cp * step * n if n else 0



def _largest_fit(shape: Callable[[int], dict], key: str, hi_cap: int, model: Any, device: Any, mode: str,
                 trace_kwargs: dict, zero: int = 0, dp: int = 1, fused: bool = False,
                 traces: dict | None = None, cp_comm: str = "p2p") -> int:
    """Largest n in [1, hi_cap] whose trace ``shape(n)`` (trace keywords; ``key`` the one searched) fits in
    ``device``'s memory, 0 when n = 1 does not (:func:`largest_within`). With ``zero``, the memory of one GPU of
    ``dp`` replicas under that ZeRO stage; ``traces``: probes' traces shared with other GPUs' searches
    (:func:`find_max_batch`); with ``context_parallel`` in the trace keywords, the exchange buffers of ``cp_comm``
    counted."""
    from neusight.devices import load_device
    from neusight.graph.tracer import trace, trace_key
    from neusight.parallel import (Parallelism, _check_zero, check_context_parallel, context_buffer_bytes,
                                   zero_memory_peak)

    device = load_device(device)
    ep = int(trace_kwargs.get("expert_parallel", 1) or 1)
    cp = int(trace_kwargs.get("context_parallel", 1))
    _check_zero(zero, Parallelism(dp=dp, ep=ep), mode == "training")

    def peak(n: int) -> float:
        kw = shape(n)
        graphs = traces.setdefault(tuple(sorted(kw.items())), {}) if traces is not None else {}
        path = trace_key(graphs, device, trace_kwargs)
        g = graphs.get(path)
        if g is None:
            g = trace(model, mode=mode, device=device, **kw, **trace_kwargs)
            check_context_parallel(g, cp, cp_comm)
            if traces is not None and sum(map(len, traces.values())) < SHARED_TRACES:
                graphs[path] = g
        buffers = context_buffer_bytes(g.kernels, cp, cp_comm)
        out = (zero_memory_peak(g, device, zero, dp, ep, fused, buffers) if zero
               else float(estimate_memory(g, device, fused=fused, transient=buffers).peak_bytes))
        log.info("%s=%d: %.2f of %.2f GiB -> %s", key, kw[key], out / 2**30, device.memory_gib,
                 "fits" if out <= device.memory_bytes else "does not fit")
        return out

    return largest_within(peak, device.memory_bytes, hi_cap)


# the most a search multiplies its largest fit by before a first miss, however flat the peaks so far
MAX_GROWTH = 64


def largest_within(peak: Callable[[int], float], limit: float, hi_cap: int, start: Iterable[int] = ()) -> int:
    """Largest n in [1, ``hi_cap``] with ``peak(n) <= limit``, 0 when n = 1 exceeds it, for a ``peak`` that does not
    decrease with n (a run's memory against its batch or sequence length).

    The answer is that of doubling and bisection (the n that fits whose n + 1 does not, or ``hi_cap``), found with
    fewer calls of ``peak`` (each a trace): the search reads the peaks, not only whether they fit. A run's memory
    is close to a quadratic in its batch or sequence (affine, plus attention scores' square without fused
    attention), so each round fits one through the three probes nearest the bracket of the largest fit and the
    smallest miss (a line through two, n = 2 the first probe after n = 1), estimates where it crosses ``limit``
    (before the first miss at most :data:`MAX_GROWTH` times the largest fit, and after an estimate that fell short,
    fitting with a peak less than half the way from the last fit's to the limit, at least twice it) and probes that
    n and, unless its peak lies more than two steps' rise (the rise per n from the largest fit) from the limit, its
    neighbour on the far side (n + 1 after a fit, n - 1 after a miss), which closes the bracket when the estimate is
    right. A round that does not halve the bracket is followed by a bisection step, so a search takes at most about
    twice bisection's probes. ``start``: n to probe first (e.g.
    those several searches share, whose traces are kept); n = 1 is then probed only when none of them fits.
    """
    seen: dict[int, float] = {}

    def probe(n: int) -> bool:
        if n not in seen:
            seen[n] = float(peak(n))
        return seen[n] <= limit

    for n in sorted({min(max(int(n), 1), hi_cap) for n in start}):
        probe(n)
    fitting = [n for n, v in seen.items() if v <= limit]
    if not fitting and not probe(1):
        return 0
    lo = max(fitting, default=1)    # lo fits; hi does not (hi_cap + 1: none seen yet)
    hi = min((n for n, v in seen.items() if v > limit), default=hi_cap + 1)
    bisect = slow = False
    while hi - lo > 1:
        width, missed, estimate = hi - lo, hi <= hi_cap, 0
        if bisect:
            guess = (lo + hi) // 2
        elif len(seen) == 1:        # n = 1 alone
            guess = 2
        else:
            estimate = guess = _crossing(seen, limit, lo, hi if missed else None)
            if not missed:
                guess = max(guess, 2 * lo) if slow else guess      # the last estimate fell short: at least double
                guess = min(guess, MAX_GROWTH * lo)
        guess = min(max(guess, lo + 1), hi - 1)
        # an estimate is checked by its neighbour; a bisection, n = 2 or a bound (the estimate moved) is not one
        check = not bisect and len(seen) > 1 and guess == estimate and lo + 1 < guess < hi - 1
        below = seen[lo]
        fits = probe(guess)
        # the peaks' rise per n from lo to the guess: a neighbour more than two such rises from the limit lies on
        # the guess's side of it, and checking it would not close the bracket
        rise = (seen[guess] - below) / (guess - lo)
        if fits:
            # an estimate that fitted but rose less than half the way to the limit fell short: double next time
            slow = guess == estimate and seen[guess] - below < 0.5 * (limit - below)
            lo = guess
            if check and limit - seen[guess] <= 2 * rise:
                lo, hi = (lo + 1, hi) if probe(lo + 1) else (lo, lo + 1)
        else:
            slow = False
            hi = guess
            if check and seen[guess] - limit <= 2 * rise:
                lo, hi = (hi - 1, hi) if probe(hi - 1) else (lo, hi - 1)
        bisect = missed and 2 * (hi - lo) > width and not bisect
    return lo


def _crossing(seen: dict[int, float], limit: float, lo: int, hi: int | None) -> int:
    """Where the quadratic (a line with two points) through the probes ``seen`` nearest ``lo`` (the largest fit)
    and ``hi`` (the smallest miss; None: none yet) reaches ``limit``: the last n at or under it, past ``lo``."""
    ends = [n for n in (lo, hi) if n is not None]
    # lo and hi, then the probes nearest lo, a neighbour of either (a check, nearly the same peak) last
    near = sorted(seen, key=lambda n: (n not in ends, any(abs(n - e) == 1 for e in ends), abs(n - lo)))[:3]
    root = math.nan
    if len(near) == 3:              # a x^2 + b x + c = limit, x = n - lo; the root on the rising side
        a, b, c = np.polyfit(np.array(near, dtype=float) - lo, [seen[n] for n in near], 2)
        disc = b * b - 4 * a * (c - limit)
        if disc >= 0 and b > 0:
            root = lo + 2 * (limit - c) / (b + math.sqrt(disc))   # stable as a -> 0 (a line)
        elif disc >= 0 and a > 0:
            root = lo + (-b + math.sqrt(disc)) / (2 * a)
    if not math.isfinite(root):     # a line through lo and its nearest probe
        n0, n1 = sorted(near[:2])
        slope = (seen[n1] - seen[n0]) / (n1 - n0)
        root = lo + (limit - seen[lo]) / slope if slope > 0 else math.inf
    if root <= lo:
        return lo + 1
    if hi is not None and root >= hi:
        return hi - 1
    return int(root) if math.isfinite(root) else 1 << 62


# ---------------------------------------------------------------------------------------------------------
# Ground truth on the CPU


@dataclass(frozen=True)
class CpuMeasurement:
    """Peak of allocated tensor bytes of one real run on the CPU, as PyTorch's CPU allocator reports it."""

    peak_bytes: int       # resident_bytes + the highest running total of bytes allocated during the run
    resident_bytes: int   # parameters, buffers, optimizer state and inputs, allocated before the run


class _MetaToCpu(TorchFunctionMode):
    """Turn ``device="meta"`` of factory calls into the CPU, so the model's own input and loss code runs."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device")) == "meta":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def measure_cpu(model: Any, batch_size: int = 1, seq_len: int | None = None, mode: str = "inference", *,
                optimizer: str | None = "adamw", onednn: bool = False, seed: int = 0,
                gradient_checkpointing: bool | int = False, lora_rank: int | None = None,
                lora_targets: Any = None, compiled: bool = False, **build_kwargs: Any) -> CpuMeasurement:
    """Run ``model`` for real on the CPU and measure the peak of allocated tensor bytes.

    The module is the one :func:`neusight.trace` traces (same builder, random weights), run the way the tracer
    runs it: the CUDA code paths of the tracer (fused ``native_dropout``) so both sides execute the same aten
    ops; training does one un-measured warm-up step (creates the optimizer state), ``zero_grad(set_to_none=True)``,
    then the measured step (forward, loss, backward, optimizer step) with the outputs held until it ends.

    Allocations are read from ``torch.profiler.profile(profile_memory=True)``: the CPU allocator reports every
    allocation and free made while profiling (requested bytes, no rounding), so the running sum of those events
    plus the bytes resident before the step is the live tensor memory.

    Parameters
    ----------
    model, batch_size, seq_len, mode, optimizer, gradient_checkpointing, lora_rank, lora_targets, **build_kwargs
        As for :func:`neusight.trace`.
    onednn : bool
        Let convolutions run through oneDNN. Off by default: oneDNN reorders every conv weight into a blocked
        layout through the tensor allocator, a transient copy the CUDA run does not make (on a small ResNet-18
        that copy alone is 9 MiB, 20 % of its peak); the native kernels allocate only small im2col buffers.
    compiled : bool
        Run the module under ``torch.compile`` (Inductor's CPU backend; needs a C++ compiler), compiled in an
        un-measured first run (Dynamo's cache reset first): what its fused kernels keep on chip and what its
        partitioner saves for backward, to check ``estimate_memory(..., fused=True)``. Without the tracer's CUDA
        code paths, which Dynamo does not trace through (Inductor lowers dropout and attention itself).

    Returns
    -------
    CpuMeasurement
    """
    from torch.profiler import ProfilerActivity, profile

    from neusight.graph.models import build_model
    from neusight.graph.tracer import _CudaPaths, _enable_checkpointing, _make_optimizer

    training = mode == "training"
    if "dtype" in build_kwargs:   # as neusight.trace takes it: a name ('bfloat16') or a torch.dtype
        from neusight.graph.amp import model_dtype

        build_kwargs["dtype"] = model_dtype(build_kwargs["dtype"])
    built = build_model(model, **build_kwargs)
    if built.needs_seq_len and not seq_len:
        raise InputError(f"{built.name} needs seq_len (a positive integer) for a real run")
    torch.manual_seed(seed)
    if lora_rank is not None:
        from neusight.graph.lora import apply_lora

        apply_lora(built.module, lora_rank, lora_targets)
    tied = _tied_names(module := built.module)
    module = module.to_empty(device="cpu")
    for first, *others in tied:   # to_empty allocates every name anew: tie shared parameters again
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(first))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
        for b in module.buffers():
            b.fill_(1 if b.is_floating_point() else 0)
    recompute = (_enable_checkpointing(built, mode, gradient_checkpointing) if gradient_checkpointing
                 else contextlib.nullcontext())
    module.train(training)
    with _MetaToCpu():
        args, kwargs = built.make_inputs(batch_size, seq_len)
    opt = _make_optimizer(module, optimizer) if training and optimizer else None

    if compiled:   # a clean Dynamo cache: an earlier compile of the same class (another config, dtype) would guard
        torch._dynamo.reset()   # this one into a recompile, whose graph and memory differ (BERT: 255 -> 301 MiB)
    run = torch.compile(module) if compiled else module
    paths = contextlib.nullcontext if compiled else _CudaPaths

    def step() -> tuple:
        with _MetaToCpu(), paths(), recompute:
            if not training:
                with torch.no_grad():
                    return (run(*args, **kwargs),)
            out = run(*args, **kwargs)
            loss = built.loss(out, args, kwargs)
            loss.backward()
            if opt is not None:
                opt.step()
            return out, loss

    if compiled and not training:   # compile outside the measured run
        step()
    if training:
        with _onednn(onednn):
            held = step()
        del held
        module.zero_grad(set_to_none=True)
    resident = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in
                [*module.parameters(), *module.buffers(), *_tensors((args, kwargs)),
                 *(_tensors(list(opt.state.values())) if opt is not None else [])]}
    with _onednn(onednn), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        held = step()
    del held
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    running = np.cumsum([b for _, b in events]) if events else np.zeros(1, dtype=np.int64)
    base = int(sum(resident.values()))
    return CpuMeasurement(peak_bytes=base + int(max(running.max(), 0)), resident_bytes=base)


@contextlib.contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """Switch oneDNN (mkldnn) kernels on or off for the block (without mkldnn.flags' TF32 warning)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def _tied_names(module: Any) -> list[list[str]]:
    """Groups of parameter names that share one Parameter (tied embeddings), groups of two or more."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _tensors(obj: Any) -> list:
    """Every tensor in nested lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []

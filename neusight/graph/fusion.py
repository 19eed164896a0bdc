"""Fused graphs: the kernels of a traced model as ``torch.compile`` (TorchInductor, default mode) runs them.

Inductor leaves GEMMs and convolutions to the vendor libraries (extern cuBLAS / cuDNN calls, as in eager) and
generates one kernel for each connected group of the memory-bound ops between them: the pointwise chain of a
GELU, the scale + mask + softmax of attention scores, a residual add with the layer norm after it. A fused
kernel reads what its group takes from outside once and writes only what is used outside the group; the
intermediate tensors never reach DRAM. That is the whole model here:

1. Barriers: GEMM-like kernels (linear, bmm, conv) and phase changes split the program into segments.
2. In a segment, memory-bound kernels joined by dataflow (one produces what the other reads) form a group
   (union-find over storages; a storage is re-versioned on every write, so a reused address or an in-place
   update never links unrelated kernels). Inductor schedules by dataflow, not program order, so a group also
   takes a kernel after a GEMM while nothing outside the group has read the group's outputs yet (in the same
   phase): a SwiGLU's silu, run between its gate and up GEMMs in eager, fuses with the product after the up
   GEMM. A group that a GEMM (or any kernel outside it) reads must run before that reader and stays closed, but
   a pointwise group that reads it and nothing made after it closed runs inside it, before that reader: the k
   and v inputs' casts join the norm that makes them, as the q input's does.
3. A group becomes one kernel: FLOPs summed; bytes = inputs read from outside the group (each storage version
   once, at most its size and at most what the reading kernel was traced to move) + outputs read after the
   group, kept alive at the end (the model's outputs) or never read in the trace (gradients).
   It runs at its first member after its last outside input is made. Its family is the strongest reduction in
   it (softmax, then layer norm, then batch norm, reduction, pooling), else elementwise; its dims are those of
   the group's biggest kernel of that family.

One limit of Inductor's is kept: a reduction of a whole tensor into a few values (an FP8 cast's amax) is split
over many thread blocks, so what uses its result runs in a later kernel (``_split_reduction``); such a
reduction shares a kernel only with the pointwise ops that feed it, and a group one other group alone reads is
inlined into that group. NB: Inductor's other limits on what fuses (e.g. row reductions over different axes in
one kernel) are not modelled, so a group can be fused further than Inductor manages: the forecast leans fast.
CUDA graphs are not used by the default mode.

Inductor's attention rewrite is modelled (``_attention_rewrites``): a score GEMM -> scale -> softmax -> GEMM chain
that one of its patterns matches becomes one scaled_dot_product_attention kernel (the fused ``attention`` kernel,
as ``attn_implementation="sdpa"`` traces it); in a training step, where Inductor's patterns have dropout on the
scores and match only then, the chain's backward (four GEMMs, the dropout's and the softmax's gradients, the scale)
becomes one ``attention_bwd`` kernel as well. Which chains match was checked against Inductor itself (``python
scripts/bench_attention_rewrite.py``, docs/attention-rewrite.md; on 28 model types in FP32 and BF16, inference and
training, the rule agrees in every case that compiles on the CPU, 108 of 112): transformers' eager attention is
rewritten where no mask is added (BERT, RoBERTa, MPNet's relative bias after its division, ViT, BART's encoder and
cross-attention, T5's cross-attention with its zero bias) and kept where a causal mask is added after the scale
(GPT-2, GPT-NeoX, OPT, Llama, Falcon's in-place division); in training only where the scores have dropout (BERT and
RoBERTa, not ViT or BART, whose attention dropout is 0 by default). On the ``-fusion`` labels (torch 2.1,
inference) the measured compiled / eager ratio of BERT Large is 0.85 / 0.87 (A100, batch 8 / 16) and 0.84 / 0.85
(L4); forecast 0.97 / 0.97 and 0.92 / 0.91 without the rewrite, 0.90 / 0.90 and 0.77 / 0.77 with it (GPT-2 Large:
0.89 / 0.87 and 0.69 / 0.69 measured, 0.89 / 0.88 and 0.71 / 0.71 forecast either way). No compiled training step
was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd

from neusight.graph.graph import KERNEL_COLUMNS, Graph
from neusight.graph.tracer import fused_sdpa_runs
from neusight.kernels.base import ATTENTION_BWD_KERNEL, ATTENTION_BWD_RATIO, ATTENTION_KERNEL, Family

BARRIERS = frozenset(f.value for f in Family if f.is_gemm)
FREE = frozenset({Family.VIEW.value})
# which family a fused group is predicted as: the first of these it contains, else elementwise
GROUP_FAMILY_ORDER = (Family.SOFTMAX.value, Family.LAYERNORM.value, Family.BATCHNORM.value, Family.REDUCTION.value,
                      Family.POOLING.value)
FUSED_KERNEL = "fused"
REDUCING = frozenset(GROUP_FAMILY_ORDER)


def fused_kernels(g: Graph, device: Any = None) -> pd.DataFrame:
    """The kernel table of ``g`` (same columns as ``g.kernels``) with every fusible group replaced by one row.
    ``device`` (a Device or None) decides whether a rewritten attention chain runs a fused kernel there
    (:func:`_attention_rewrites`).

    Examples
    --------
    >>> import neusight
    >>> g = neusight.trace("gpt2", batch_size=1, seq_len=64, mode="inference")
    >>> len(fused_kernels(g)) < len(g.kernels)
    True
    """
    return _fuse(g, device)[0]


def fused_units(g: Graph, device: Any = None) -> list[set[int]]:
    """The op indices each fused kernel of :func:`fused_kernels` stands for: every group of two or more kernels,
    every rewritten attention chain (its forward and backward ops and the copies of q, k and v it drops). What
    an op of a unit makes and only ops of the same unit read is never written to memory
    (:func:`neusight.memory.estimate_memory` with ``fused=True``)."""
    return _fuse(g, device)[1]


def _fuse(g: Graph, device: Any) -> tuple[pd.DataFrame, list[set[int]]]:
    """:func:`fused_kernels` and :func:`fused_units` in one pass, kept on the graph per outcome of what they ask of
    the device (:func:`_device_key`: GPUs that run the same attention chains fused share it; a forecast under
    torch.compile needs both: the kernels and the memory); the table is handed out as a copy."""
    cache = g.__dict__.setdefault("_fusion_cache", {})
    key = _device_key(g, device)
    if key not in cache:
        cache[key] = _fuse_graph(g, device)
    table, units = cache[key]
    return table.copy(), units


class _ByOp:
    """A kernel table's rows by op: each op's row positions (in table order) and what the fusion asks of them, read
    from the table's columns as arrays (a frame per op, as a groupby makes, costs more than all the rest)."""

    def __init__(self, k: pd.DataFrame):
        self.table = k
        ops = k["op_index"].to_numpy()
        order = np.argsort(ops, kind="stable")
        index, starts = np.unique(ops[order], return_index=True)
        self.rows = dict(zip(index.tolist(), np.split(order, starts[1:])))
        self._columns: dict[str, np.ndarray] = {}
        family = self.column("family")
        self.families = {i: frozenset(family[p]) for i, p in self.rows.items()}

    def __contains__(self, op: int) -> bool:
        return op in self.rows

    def column(self, name: str) -> np.ndarray:
        if name not in self._columns:
            self._columns[name] = self.table[name].to_numpy()
        return self._columns[name]

    def first(self, op: int) -> pd.Series:
        """The first kernel row of ``op``."""
        return self.table.iloc[int(self.rows[op][0])]

    def aten(self) -> dict[int, str]:
        """Each op's aten op (its first kernel row's)."""
        aten = self.column("aten_op")
        return {i: str(aten[p[0]]) for i, p in self.rows.items()}

    def bytes(self, op: int) -> float:
        return float(self.column("bytes")[self.rows[op]].sum())


def forget_fusion(g: Graph) -> None:
    """Drop what the fusion kept on ``g`` (its fused tables, dataflow, questions to GPUs, and the memory's min-cut
    of :mod:`neusight.remat`): the next fused forecast of ``g`` runs the whole pass again, as the first one did (for
    timing it)."""
    for key in ("_fusion_cache", "_fusion_flow", "_fusion_asks", "_remat_cache"):
        g.__dict__.pop(key, None)


def _flow_of(g: Graph) -> tuple[_ByOp, "_Flow"]:
    """``g``'s kernels by op and its dataflow (:func:`_dataflow`), kept on the graph: neither depends on a GPU."""
    got = g.__dict__.get("_fusion_flow")
    if got is None:
        by_op = _ByOp(g.kernels)
        got = g.__dict__["_fusion_flow"] = (by_op, _dataflow(g, by_op))
    return got


def _device_key(g: Graph, device: Any) -> tuple[bool, ...] | None:
    """All the fusion of ``g`` asks of ``device``: for each attention chain the rewrite would replace, whether a
    fused attention kernel takes its inputs there (:func:`neusight.graph.tracer.fused_sdpa_runs`, asked in the
    order :func:`_attention_rewrites` asks); None without a device. The chains asked about do not depend on the
    answers, so they are found once per graph."""
    if device is None:
        return None
    asks = g.__dict__.get("_fusion_asks")
    if asks is None:
        asked: list[tuple] = []
        by_op, flow = _flow_of(g)
        _attention_rewrites(g, by_op, flow, runs=lambda *a: bool(asked.append(a)))
        asks = g.__dict__["_fusion_asks"] = tuple(asked)
    return tuple(bool(fused_sdpa_runs(device, *a)) for a in asks)


def _fuse_graph(g: Graph, device: Any) -> tuple[pd.DataFrame, list[set[int]]]:
    k = g.kernels
    by_op, flow = _flow_of(g)
    reads, writes, produced, readers = flow.reads, flow.writes, flow.produced, flow.readers
    held = flow.held
    attention = _attention_rewrites(g, by_op, flow, runs=lambda *a: fused_sdpa_runs(device, *a))
    rewritten = {i for chain in attention for i in chain.ops}

    # 1-2: groups by union-find inside barrier-free segments
    parent: dict[int, int] = {}
    segment: dict[int, int] = {}
    phase: dict[int, str] = {}
    escaped: set[int] = set()                           # roots of groups something outside them has read
    closed_at: dict[int, int] = {}                      # ... and the op that first read them from outside
    split: set[int] = set()                             # split reductions (_split_reduction)
    reducing: set[int] = set()                          # roots of groups with a reduction (GROUP_FAMILY_ORDER)
    level: dict[int, int] = {}                          # split reductions a kernel depends on, in a chain
    seg, last_phase = 0, None

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
            for flags in (escaped, reducing):
                if ra in flags:
                    flags.add(rb)
            if ra in closed_at:
                closed = closed_at.pop(ra)
                closed_at[rb] = min(closed, closed_at.get(rb, closed))

    def escape(root: int, by: int) -> None:
        escaped.add(root)
        closed_at.setdefault(root, by)

    for r in g.ops:
        if r.index not in reads:
            continue
        fams = by_op.families[r.index] - FREE
        if r.phase != last_phase:
            seg += 1
        last_phase = r.phase
        # an attention chain handed to scaled_dot_product_attention is one kernel that, like a GEMM, fuses with
        # nothing around it
        fusible = not fams & BARRIERS and r.index not in rewritten
        ins = reads[r.index]
        if fusible:
            parent[r.index], segment[r.index], phase[r.index] = r.index, seg, r.phase
            srcs = [src for s, v, _ in ins if (src := produced.get((s, v))) is not None and src in parent]
            # a kernel that needs a split reduction's result runs after all of it: one level further
            level[r.index] = max((level[src] + (src in split) for src in srcs), default=0)
            if fams == {Family.REDUCTION.value} and _split_reduction(r.call):
                split.add(r.index)
            for src in srcs:
                if level[src] == level[r.index] and (
                        segment[src] == seg or (phase[src] == r.phase and find(src) not in escaped)) and not (
                        r.index in split and find(src) in reducing):   # a split reduction takes pointwise only
                    union(r.index, src)
            if fams & REDUCING:
                reducing.add(find(r.index))
            # a group this kernel reads without joining it must run first: it can no longer join later kernels
            for s, v, _ in ins:
                src = produced.get((s, v))
                if src is not None and src in parent and find(src) != find(r.index):
                    escape(find(src), r.index)
        else:
            for s, v, _ in ins:                           # a GEMM reads these groups' outputs: they run before it
                src = produced.get((s, v))
                if src is not None and src in parent:
                    escape(find(src), r.index)
            seg += 1                                      # nothing fuses across a GEMM that reads the group

    groups: dict[int, list[int]] = {}
    for i in parent:
        groups.setdefault(find(i), []).append(i)
    # A group whose outputs one other group of its phase alone reads (nothing kept at the end) is inlined into it,
    # as Inductor inlines a pointwise producer into its only consumer: the upcast before a split amax's scale
    # multiplies it, which the dependency levels above kept apart.
    for root in sorted(groups, key=lambda r: max(groups[r])):
        if root not in groups:
            continue
        members = set(groups[root])
        outs = [(s, v) for i in members for s, v, _ in writes[i]]
        if members & split or not outs or any(o in held or not readers.get(o) for o in outs):
            continue
        outside = {j for o in outs for j in readers[o]} - members
        if not outside or not outside <= parent.keys() or len({find(j) for j in outside}) != 1:
            continue
        consumer = find(next(iter(outside)))
        if set(groups[consumer]) & split and root in reducing:
            continue                                       # a split reduction takes pointwise ops only
        if phase[consumer] == phase[root]:
            union(root, consumer)
            groups[consumer] = groups.pop(consumer) + groups.pop(root)
    # A pointwise group that reads one closed group and nothing made after that group closed runs inside it, before
    # the op that closed it, as Inductor (which schedules by dataflow, not program order) fuses it: the casts of the
    # k and v projections' input join the norm that makes it, before the q projection's GEMM, as the q cast does
    # (checked with Inductor's CPU code generation, one kernel for the norm and the three casts). Groups with a
    # reduction stay where they are: Inductor left a bias gradient's sum of a GELU gradient in a kernel of its own.
    for root in sorted(groups, key=lambda r: min(groups[r])):
        if root not in groups:
            continue
        members = set(groups[root])
        srcs = {src for i in members for s, v, _ in reads[i] if (src := produced.get((s, v))) is not None} - members
        owners = {find(src) for src in srcs if src in parent}
        if root in reducing or members & split or len(owners) != 1:
            continue
        target = owners.pop()
        if target not in escaped or phase[target] != phase[root] or \
                max(level[i] for i in members) != max(level[i] for i in groups[target]):
            continue
        if all((src in parent and find(src) == target) or src < closed_at[target] for src in srcs):
            union(root, target)
            groups[target] = groups.pop(target) + groups.pop(root)

    rows, replaced = [], set()
    units = [set(chain.ops) for chain in attention]
    # 3: one row per group of two or more kernels; everything else is kept as traced
    for members in groups.values():
        if len(members) < 2:
            continue
        ops = set(members)
        replaced |= ops
        units.append(ops)
        read: dict[tuple[int, int], int] = {}
        for i in members:
            for s, v, b in reads[i]:
                if produced.get((s, v)) not in ops:
                    read[(s, v)] = max(read.get((s, v), 0), b)
        # written: what is read after the group, kept at the end, or never read again (a gradient the optimizer
        # or the next step takes; the trace does not see those readers)
        written = sum(b for i in members for s, v, b in writes[i]
                      if (s, v) in held or readers.get((s, v), set()) - ops or not readers.get((s, v)))
        # it runs once its last outside input is made: at the first member after that input's producer
        ready = max((src for key in read if (src := produced.get(key)) is not None), default=-1)
        at = min((i for i in ops if i > ready), default=min(ops))
        rows.append(_group_row(by_op, np.concatenate([by_op.rows[i] for i in sorted(members)]),
                               sum(read.values()) + written, at))
    rows += [row for chain in attention for row in chain.rows]
    kept = k[~k["op_index"].isin(replaced | rewritten)]
    out = pd.concat([kept, pd.DataFrame(rows, columns=KERNEL_COLUMNS)], ignore_index=True)
    out = g.mark_recompute(out.astype({"flops": "float64", "algo_flops": "float64", "bytes": "float64"}))
    return out.sort_values("op_index", kind="stable").reset_index(drop=True), units


Key = tuple[int, int]   # (storage, version)


@dataclass
class _Flow:
    """Which tensor versions each kernel-launching op reads and writes (views read and write nothing)."""
    reads: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)   # op -> [(storage, version, bytes)]
    writes: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    produced: dict[Key, int] = field(default_factory=dict)                       # version -> producing op
    readers: dict[Key, set[int]] = field(default_factory=dict)
    held: set[Key] = field(default_factory=set)                                  # kept alive at the end


def _dataflow(g: Graph, by_op: _ByOp) -> _Flow:
    """Versioned storages of ``g``: a storage is re-versioned on every write, so a reused address or an in-place
    update never links unrelated kernels."""
    flow = _Flow()
    version: dict[int, int] = {}
    storage_bytes: dict[Key, int] = {}                  # (storage, version) -> its size when produced
    for r in g.ops:
        fams = by_op.families[r.index] - FREE if r.index in by_op else set()
        if not fams:
            # no kernel: a view or in-place alias reads and writes nothing; a fresh allocation (a storage none of
            # its inputs has) is a new version, so a reused address never links to its previous tenant
            aliased = {t.storage for t in r.call.tensor_args()}
            for t in r.call.outputs:
                if t.storage not in aliased:
                    version[t.storage] = version.get(t.storage, 0) + 1
            continue
        # NB: a kernel reads at most its own traced bytes of an input (an embedding gathers a few rows of its
        # table). Scalars and empty tensors (wrapped Python numbers, placeholders) are left out: they carry no
        # data, and they are often created outside the trace, at an address a traced tensor used before.
        cap = by_op.bytes(r.index)
        args = r.call.tensor_args()
        for t in args:   # a storage of another size at a known address: a tenant we did not see
            if storage_bytes.get((t.storage, version.get(t.storage, 0)), t.nbytes) != t.nbytes:
                version[t.storage] = version.get(t.storage, 0) + 1
        # A one-element tensor made by a traced op (a row's mean at batch 1) is data, and links like any other.
        ins = [(t.storage, version.get(t.storage, 0), min(t.view_nbytes, t.nbytes, cap)) for t in args
               if t.numel > 1 or (t.numel == 1 and (t.storage, version.get(t.storage, 0)) in flow.produced)]
        flow.reads[r.index] = ins
        for s, v, _ in ins:
            flow.readers.setdefault((s, v), set()).add(r.index)
        outs = []
        for t in r.call.outputs:
            version[t.storage] = version.get(t.storage, 0) + 1
            key = (t.storage, version[t.storage])
            flow.produced[key] = r.index
            storage_bytes[key] = t.nbytes
            outs.append((*key, t.view_nbytes))
        flow.writes[r.index] = outs
    flow.held = {(t.storage, version.get(t.storage, 0)) for t in g.held}
    return flow


# Inductor's attention rewrite (torch/_inductor/fx_passes/fuse_attention.py) hands a chain score GEMM -> scale ->
# softmax -> GEMM to scaled_dot_product_attention, which runs as one fused kernel (flash, cuDNN or memory-efficient
# attention; the scores never reach DRAM). It matches a fixed set of patterns, checked against the installed torch
# and transformers by ``python scripts/bench_attention_rewrite.py`` (docs/attention-rewrite.md), which compiles
# small models on the CPU and counts the rewrites. Kept here: a scale by a constant (multiplied or divided) or none,
# one softmax, casts, copies, dropout after the softmax, an added tensor of zeros (Inductor folds x + 0 away); an
# additive mask or bias only after a division (the masked patterns divide). Not rewritten: a mask or bias added
# after a multiplication or without a scale (transformers' eager attention of GPT-2, OPT, Llama: a causal mask), a
# torch.where / masked_fill mask, and in a training step a chain without dropout.
REWRITE_SCALES = ("aten.mul.Tensor", "aten.div.Tensor")   # out of place: Falcon's in-place /= is not matched
REWRITE_ADDS = ("aten.add.Tensor", "aten.add_.Tensor")
DIVISIONS = ("aten.div.Tensor",)
REWRITE_PASS = ("aten._to_copy.default", "aten.clone.default", "aten.alias.default")
ZERO_FILLS = ("aten.zeros.default", "aten.zeros_like.default", "aten.new_zeros.default")
DROPOUT = "aten.native_dropout.default"
REWRITTEN_ATTENTION = "fused:scaled_dot_product_attention"   # the aten_op of a rewritten chain's kernel
REWRITE_NOTE = ("torch.compile hands {n} attention score chains (score GEMM, scale, softmax, GEMM) to "
                "scaled_dot_product_attention, as Inductor's attention rewrite does: one fused attention kernel "
                "each (in a training step, one more for its backward)")


@dataclass
class _Chain:
    """One rewritten attention chain: the traced ops it replaces and its fused kernel rows (forward, backward)."""
    ops: set[int]
    rows: list[dict]


def _attention_rewrites(g: Graph, by_op: _ByOp, flow: _Flow,
                        runs: Callable[..., bool]) -> list[_Chain]:
    """The attention chains Inductor rewrites into scaled_dot_product_attention (see REWRITE_SCALES), each with the
    ops it replaces (its copies of q, k and v included) and the fused attention kernel(s) replacing them: one in
    inference; in a training step the forward and the backward (:func:`_attention_backward`). Chains whose inputs
    no fused kernel takes on the GPU (``runs(dtype, head_dim, masked)`` false: :func:`neusight.graph.tracer.
    fused_sdpa_runs`: MI100, BF16 before compute capability 8.0) are left out: there scaled_dot_product_attention
    runs its math backend, the same kernels."""
    aten = by_op.aten()
    phase = {r.index: r.phase for r in g.ops}
    training = any(p == "backward" for p in phase.values())

    def only_reader(i: int) -> int | None:
        """The one forward op that reads ``i``'s (first) output; a dropout's mask is left to the backward."""
        outs = flow.writes.get(i, [])
        if not outs or len(outs) > (2 if aten.get(i) == DROPOUT else 1) or outs[0][:2] in flow.held:
            return None
        who = {j for j in flow.readers.get(outs[0][:2], set()) if phase[j] == "forward"}
        return next(iter(who)) if len(who) == 1 else None

    def zeros_operand(i: int) -> int | None:
        """The op that made an all-zero operand of ``i`` that only ``i`` reads, if there is one."""
        for s, v, _ in flow.reads[i]:
            src = flow.produced.get((s, v))
            if src is not None and aten.get(src) in ZERO_FILLS and flow.readers.get((s, v)) == {i}:
                return src
        return None

    chains = []
    for a in sorted(i for i, op in aten.items() if op == "aten.bmm.default" and phase[i] == "forward"):
        chain, scale, masked, softmax, dropout = [], None, False, None, None
        cur = only_reader(a)
        while cur is not None and aten.get(cur) != "aten.bmm.default":
            op, n_in = aten.get(cur), len(flow.reads.get(cur, []))
            if op in REWRITE_SCALES and n_in == 1 and scale is None and not masked and softmax is None:
                scale = op
            elif op in REWRITE_ADDS and n_in == 2 and (zero := zeros_operand(cur)) is not None:
                chain.append(zero)                       # x + 0: Inductor folds it away (T5's cross-attention)
            elif op in REWRITE_ADDS and n_in == 2 and scale in DIVISIONS and not masked and softmax is None:
                masked = True
            elif op == "aten._softmax.default" and softmax is None:
                softmax = cur
            elif op == DROPOUT and softmax is not None and dropout is None:
                dropout = cur
            elif op not in REWRITE_PASS or n_in != 1:
                break
            chain.append(cur)
            cur = only_reader(cur)
        else:
            if cur is None or softmax is None or flow.reads[cur][0][:2] != flow.writes[chain[-1]][0][:2]:
                continue
            # a training step is rewritten only with dropout on the scores (Inductor's patterns there have it)
            if training and dropout is None:
                continue
            ra = by_op.first(a)
            if not runs(ra["dtype"], int(ra["dims"][2]), masked):
                continue
            b = cur
            backward: set[int] = set()
            if training:
                found = _attention_backward(a, b, softmax, dropout, chain, aten, phase, flow)
                if found is None:
                    continue
                backward = found
            replaced = {a, b, *chain, *backward}
            # copies of q, k, v (and of the output gradient) that only the replaced ops read die with them
            copies = {p for x in replaced for s, v, _ in flow.reads[x]
                      if (p := flow.produced.get((s, v))) is not None and aten.get(p) == "aten.clone.default"
                      and flow.readers.get((s, v), set()) <= replaced and len(flow.writes[p]) == 1}
            # q, k, v as the fused kernel reads them: the GEMMs' operands (the copies' inputs are the same bytes)
            q, kt, v = flow.reads[a][0][2], flow.reads[a][1][2], flow.reads[b][1][2]
            nbytes = float(q + kt + v + flow.writes[b][0][2])
            rb = by_op.first(b)
            flops = float(ra["flops"] + rb["flops"])
            row = {"op_index": int(a), "phase": ra["phase"], "module": ra["module"], "aten_op": REWRITTEN_ATTENTION,
                   "family": Family.BMM.value, "kernel": ATTENTION_KERNEL, "dims": tuple(int(x) for x in ra["dims"]),
                   "dtype": ra["dtype"], "flops": flops, "algo_flops": flops, "bytes": nbytes,
                   "modeled": bool(ra["modeled"] and rb["modeled"])}
            rows = [row]
            if backward:
                # as neusight.kernels.ops_gemm._attention: the scores recomputed, five GEMMs (2.5x the forward's
                # FLOPs); q, k, v, the output and its gradient read, the three gradients written
                first = min(backward)
                rows.append({**row, "op_index": first, "phase": phase[first], "kernel": ATTENTION_BWD_KERNEL,
                             "flops": ATTENTION_BWD_RATIO * flops, "algo_flops": ATTENTION_BWD_RATIO * flops,
                             "bytes": 2.0 * nbytes})
            chains.append(_Chain(replaced | copies, rows))
    return chains


def _attention_backward(a: int, b: int, softmax: int, dropout: int | None, chain: list[int], aten: dict[int, str],
                        phase: dict[int, str], flow: _Flow) -> set[int] | None:
    """The backward ops of one attention chain of a training step: the four GEMMs of the two GEMMs' gradients, the
    dropout's and the softmax's gradients and the scale between them. None where they are not all found."""
    forward = {a, b, *chain}
    saved = {(s, v) for x in (a, b) for s, v, _ in flow.reads[x]}
    saved |= {key[:2] for x in forward for key in flow.writes.get(x, [])}
    readers = {j for key in saved for j in flow.readers.get(key, set()) if phase[j] == "backward"}
    gemms = {j for j in readers if aten[j] == "aten.bmm.default"}
    soft = [j for j in readers if aten[j] == "aten._softmax_backward_data.default"]
    drop = [j for j in readers if aten[j] == "aten.native_dropout_backward.default"]
    if len(soft) != 1 or len(drop) != (dropout is not None):
        return None
    found = {*soft, *drop}
    cur = soft[0]
    while True:                      # the softmax gradient's scale, on to the two GEMMs of q's and k's gradients
        outs = flow.writes.get(cur, [])
        who = flow.readers.get(outs[0][:2], set()) if len(outs) == 1 else set()
        if who and who <= gemms:
            break
        if len(who) != 1 or aten[(nxt := next(iter(who)))] not in REWRITE_SCALES + REWRITE_PASS:
            return None
        found.add(nxt)
        cur = nxt
    return found | gemms if len(gemms) == 4 else None


# A reduction of at least this many elements into each of at most SPLIT_OUTPUTS values (a whole tensor's amax or
# sum) is split by Inductor over many thread blocks and finished by another kernel, so nothing that uses its
# result shares a kernel with it or with what it reads. Row reductions (norms, softmax, a loss per token) are not.
SPLIT_REDUCED = 1 << 16
SPLIT_OUTPUTS = 1024


def _split_reduction(call) -> bool:
    """Whether the reduction ``call`` reduces SPLIT_REDUCED or more elements into each of at most SPLIT_OUTPUTS."""
    outs = [t.numel for t in call.outputs if t.numel > 0]
    ins = [t.numel for t in call.tensor_args()]
    if not outs or not ins:
        return False
    produced_values = max(outs)
    return produced_values <= SPLIT_OUTPUTS and max(ins) >= SPLIT_REDUCED * produced_values


def _group_row(by_op: _ByOp, members: np.ndarray, nbytes: float, at: int) -> dict:
    """The fused kernel of one group of member kernel rows (positions in ``by_op``'s table, in op order), run at op
    index ``at``: its lead is the last of the biggest (bytes) rows of its family."""
    column = by_op.column
    families = column("family")[members]
    fams = set(families)
    family = next((f for f in GROUP_FAMILY_ORDER if f in fams), Family.ELEMENTWISE.value)
    of_family = members[families == family]
    candidates = of_family if len(of_family) else members
    lead = int(candidates[np.argsort(column("bytes")[candidates], kind="stable")[-1]])
    dims = column("dims")[lead] if len(of_family) else (1, int(max(np.prod(d) for d in column("dims")[members])))
    flops = float(column("flops")[members].sum())
    return {"op_index": int(at), "phase": column("phase")[lead], "module": column("module")[lead],
            "aten_op": "fused:" + "+".join(dict.fromkeys(column("kernel")[members])), "family": family,
            "kernel": FUSED_KERNEL, "dims": tuple(int(x) for x in dims), "dtype": column("dtype")[lead],
            "flops": flops, "algo_flops": flops, "bytes": float(nbytes),
            "modeled": bool(column("modeled")[members].all())}


"""What torch.compile saves for the backward of a training step, and what it recomputes there instead.

AOTAutograd traces the forward and the backward into one joint graph; its min-cut partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``) then chooses the set of forward tensors
the backward keeps, the one of least bytes from which the backward can rebuild everything it reads with cheap
fusible ops only (pointwise, casts, views, the pointwise part of a softmax or a norm). This module solves the same
min-cut on a traced graph's storages (:func:`saved_set`), with the partitioner's rules as PyTorch 2.x ships them
(``torch._functorch.config``):

- never recomputed ("banned"): compute-heavy ops (GEMMs, convolutions, fused attention, embeddings, pooling),
  random draws (dropout), ops outside the recompute allow-list (``cat``), a reduction's output (4x smaller than
  what it reads: a norm's statistics), a tensor a non-fusible backward op reads (a GEMM's input: the backward
  materializes it anyway), and a fusible op used after an unfusible op further down its input's chain (a
  residual add: "used far apart");
- parameters, model inputs and what the step holds anyway cost nothing to save; any other tensor costs its bytes,
  twice when all its users fuse with its producer (saving it adds a write a fused kernel would not make), times
  1.1 per op between it and the backward (the partitioner's bias towards tensors made late in the forward).

The row statistics a recomputed softmax is rebuilt from (two FP32 values per row) are added by
:func:`neusight.memory._recomputed`, which applies the cut; a norm's are outputs of their own, which the cut saves.
What this does not model: the heuristic that cuts fusible chains longer than 100 nodes (the traced models break
their chains with GEMMs long before), and graph breaks (one joint graph per step is assumed, as Hugging Face models
compile).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from neusight.kernels.base import Family
from neusight.kernels.ops_misc import RANDOM_OPS

if TYPE_CHECKING:
    from neusight.graph.graph import Graph

# Families whose ops Inductor decomposes into pointwise ops and reductions: they fuse, and what they make can be
# recomputed from their inputs (a softmax from its input and its row statistics).
FUSIBLE_FAMILIES = frozenset({Family.ELEMENTWISE.value, Family.VIEW.value, Family.REDUCTION.value,
                              Family.SOFTMAX.value, Family.LAYERNORM.value, Family.BATCHNORM.value})
# Copies and factories of the partitioner's recompute allow-list (``get_default_op_list``).
RECOMPUTABLE_COPIES = frozenset({"clone", "_to_copy", "copy", "contiguous", "zeros", "zeros_like", "ones",
                                 "ones_like", "full", "full_like", "new_zeros", "arange", "scalar_tensor",
                                 "lift_fresh_copy", "index", "_unsafe_index", "gather"})
# Copies Inductor fuses into their consumers' kernels but does not recompute (a cat "cannot be a producer").
FUSIBLE_COPIES = RECOMPUTABLE_COPIES | {"cat", "copy_", "slice_backward", "select_backward"}
FAR_DISCOUNT = 1.1     # the partitioner's weight per op between a tensor and the backward (capped at 100 ops)


def op_name(op: str) -> str:
    """``aten.native_dropout.default`` -> ``native_dropout``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 else op


class OpKinds:
    """What the partitioner calls each traced op: fusible, recomputable (from its kernels' families and name)."""

    def __init__(self, graph: Graph):
        k = graph.kernels
        fams: dict[int, set[str]] = {}
        for i, family in zip(k["op_index"].tolist(), k["family"].tolist()):
            fams.setdefault(i, set()).add(family)
        self.fusible: dict[int, bool] = {}
        self.recomputable: dict[int, bool] = {}
        for r in graph.ops:
            name = op_name(r.call.op)
            families = fams.get(r.index, {Family.VIEW.value})
            copies = families - FUSIBLE_FAMILIES
            fusible = not copies or (copies == {Family.MEMORY.value} and name in FUSIBLE_COPIES)
            self.fusible[r.index] = fusible
            self.recomputable[r.index] = (fusible and name not in RANDOM_OPS
                                          and (not copies or name in RECOMPUTABLE_COPIES))


def saved_set(storages: list, graph: Graph, candidates: set[int], sizes: dict[int, int],
              views: set[int]) -> set[int]:
    """The partitioner's min-cut: which ``candidates`` (indices into ``storages``, storages the forward makes)
    the backward keeps; the others it reads are recomputed there from the kept ones and from everything not a
    candidate (parameters, inputs, what the step holds), which is always at hand.

    ``storages`` are :mod:`neusight.memory`'s (``start`` op, ``users`` ops), ``sizes`` their bytes as allocated
    by the eager run (a fused kernel's intermediate, which the run under torch.compile never writes, still costs
    its bytes to save), ``views`` the ops that launch no kernel (a view is not a use of its own)."""
    import networkx as nx

    phase = {r.index: r.phase for r in graph.ops}
    kinds = OpKinds(graph)
    backward = {i for i, p in phase.items() if p == "backward"}
    made: dict[int, list[int]] = {}
    read: dict[int, list[int]] = {}
    for k, s in enumerate(storages):
        made.setdefault(s.start, []).append(k)
        for u in s.users - views:
            read.setdefault(u, []).append(k)
    users = {k: sorted(s.users - views - {s.start}) for k, s in enumerate(storages)}
    after = {i: sorted({u for k in ks for u in users[k]}) for i, ks in made.items()}   # op -> the ops reading it

    dist: dict[int, int] = {}   # ops between an op and the backward's nearest use of what it makes
    for i in sorted(made, reverse=True):   # (an op that makes nothing, as an in-place one: one op away)
        dist[i] = 0 if i in backward else min((dist.get(u, 0 if u in backward else 1) + 1 for u in after[i]
                                               if u > i), default=10**9)

    banned: set[int] = set()
    for k in candidates:
        i = storages[k].start
        back = [u for u in users[k] if u in backward]
        inputs = sum(sizes[j] for j in set(read.get(i, [])) if storages[j].start != i)
        if (not kinds.recomputable[i] or any(not kinds.fusible[u] for u in back)
                or sizes[k] * 4 < inputs):
            banned.add(k)
    banned |= _used_far_apart(storages, candidates, users, after, backward, kinds)

    g = nx.DiGraph()
    for k in candidates:
        i = storages[k].start
        materialized = not kinds.fusible[i] or any(not kinds.fusible[u] for u in users[k])
        weight = sizes[k] * FAR_DISCOUNT ** min(max(dist.get(i, 1), 1), 100) * (1 if materialized else 2)
        g.add_edge(("in", k), ("out", k), capacity=weight)
        if k in banned:
            g.add_edge("source", ("in", k))
        for u in users[k]:
            if u in backward:
                g.add_edge(("out", k), "sink")
            else:
                for t in made.get(u, []):
                    if t in candidates:
                        g.add_edge(("out", k), ("in", t))
    if "source" not in g or "sink" not in g:
        return set()
    _, (near, _far) = nx.minimum_cut(g, "source", "sink")
    return {k for k in candidates if ("in", k) in near and ("out", k) not in near}


def _used_far_apart(storages: list, candidates: set[int], users: dict[int, list[int]],
                    after: dict[int, list[int]], backward: set[int], kinds: OpKinds) -> set[int]:
    """The partitioner's ``ban_recompute_used_far_apart``: a tensor's fusible forward user that comes after the
    first unfusible op its forward users lead to (a residual add, after the norm and the GEMMs that read the same
    stream) is not recomputed: recomputing it would not fuse with the rest."""
    made_by: dict[int, list[int]] = {}
    for k in candidates:
        made_by.setdefault(storages[k].start, []).append(k)
    out: set[int] = set()
    for k in range(len(storages)):
        fw = [u for u in users[k] if u not in backward]
        if len(fw) < 2:
            continue
        limit = max(fw)
        first = _first_unfusible(fw, limit, after, backward, kinds)
        for u in fw:
            if u > first and kinds.fusible[u]:
                out.update(made_by.get(u, []))
    return out


def _first_unfusible(start: list[int], limit: int, after: dict[int, list[int]], backward: set[int],
                     kinds: OpKinds) -> int:
    """The earliest op, in program order up to ``limit``, reached from ``start`` over forward uses that does not
    fuse with the op before it."""
    heap = [(u, True) for u in start]
    heapq.heapify(heap)
    seen: set[int] = set()
    while heap:
        i, fuses = heapq.heappop(heap)
        if not fuses:
            return i
        if i in seen:
            continue
        seen.add(i)
        for u in after.get(i, []):
            if u not in backward and u <= limit:
                heapq.heappush(heap, (u, kinds.fusible[i] and kinds.fusible[u]))
    return limit

"""Fused graphs: the kernels of a traced model as ``torch.compile`` (TorchInductor, default mode) runs them.

Inductor leaves GEMMs and convolutions to the vendor libraries (extern cuBLAS / cuDNN calls, as in eager) and
generates one kernel for each connected group of the memory-bound ops between them: the pointwise chain of a
GELU, the scale + mask + softmax of attention scores, a residual add with the layer norm after it. A fused
kernel reads what its group takes from outside once and writes only what is used outside the group; the
intermediate tensors never reach DRAM. That is the whole model here:

1. Barriers: GEMM-like kernels (linear, bmm, conv) and phase changes split the program into segments.
2. In a segment, memory-bound kernels joined by dataflow (one produces what the other reads) form a group
   (union-find over storages; a storage is re-versioned on every write, so a reused address or an in-place
   update never links unrelated kernels).
3. A group becomes one kernel: FLOPs summed; bytes = inputs read from outside the group (each storage version
   once, at most its size and at most what the reading kernel was traced to move) + outputs read after the
   group, kept alive at the end (the model's outputs) or never read in the trace (gradients).
   Its family is the strongest reduction in it (softmax, then layer norm, then batch norm, reduction,
   pooling), else elementwise; its dims are those of the group's biggest kernel of that family.

NB: Inductor's own limits on what fuses (e.g. reductions over different axes in one kernel) are not modelled,
so a group can be fused further than Inductor manages: the forecast leans fast. CUDA graphs are not used by the
default mode. Inductor's attention pattern rewrite (matmul -> scale -> [+ mask] -> softmax -> matmul handed to
scaled_dot_product_attention) is not modelled either: tried on the 8 ``-fusion`` labels (A100, L4; BERT Large,
GPT-2 Large), rewriting every such chain of our traces into one memory-efficient attention kernel took the mean
absolute error from 6.5 % to 10.6 % (A100 BERT improved from +8.5 / +9.8 % to -1.7 / -0.3 %, the rest got
worse). The labels' GPT-2 masks its scores with ``torch.where``, which no pattern matches, while the
transformers version traced here adds the mask, so the trace cannot tell which chains Inductor rewrote.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from neusight.graph.graph import KERNEL_COLUMNS, Graph
from neusight.kernels.base import Family

BARRIERS = frozenset(f.value for f in Family if f.is_gemm)
FREE = frozenset({Family.VIEW.value})
# which family a fused group is predicted as: the first of these it contains, else elementwise
GROUP_FAMILY_ORDER = (Family.SOFTMAX.value, Family.LAYERNORM.value, Family.BATCHNORM.value, Family.REDUCTION.value,
                      Family.POOLING.value)
FUSED_KERNEL = "fused"


def fused_kernels(g: Graph) -> pd.DataFrame:
    """The kernel table of ``g`` (same columns as ``g.kernels``) with every fusible group replaced by one row.

    Examples
    --------
    >>> import neusight
    >>> g = neusight.trace("gpt2", batch_size=1, seq_len=64, mode="inference")
    >>> len(fused_kernels(g)) < len(g.kernels)
    True
    """
    k = g.kernels
    by_op = {i: d for i, d in k.groupby("op_index", sort=False)}

    # 1-2: versioned storages -> producer op and readers; groups by union-find inside barrier-free segments
    version: dict[int, int] = {}
    produced: dict[tuple[int, int], int] = {}           # (storage, version) -> producing op index
    storage_bytes: dict[tuple[int, int], int] = {}      # (storage, version) -> its size when produced
    reads: dict[int, list[tuple[int, int, int]]] = {}   # op index -> [(storage, version, bytes read)]
    writes: dict[int, list[tuple[int, int, int]]] = {}
    readers: dict[tuple[int, int], set[int]] = {}
    parent: dict[int, int] = {}
    segment: dict[int, int] = {}
    seg, last_phase = 0, None

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for r in g.ops:
        fams = set(by_op[r.index]["family"]) - FREE if r.index in by_op else set()
        if not fams:
            # no kernel: a view or in-place alias reads and writes nothing; a fresh allocation (a storage none of
            # its inputs has) is a new version, so a reused address never links to its previous tenant
            aliased = {t.storage for t in r.call.tensor_args()}
            for t in r.call.outputs:
                if t.storage not in aliased:
                    version[t.storage] = version.get(t.storage, 0) + 1
            continue
        if r.phase != last_phase:
            seg += 1
        last_phase = r.phase
        fusible = not fams & BARRIERS
        # NB: a kernel reads at most its own traced bytes of an input (an embedding gathers a few rows of its
        # table). Scalars and empty tensors (wrapped Python numbers, placeholders) are left out: they carry no
        # data, and they are often created outside the trace, at an address a traced tensor used before.
        cap = float(by_op[r.index]["bytes"].sum())
        args = r.call.tensor_args()
        for t in args:   # a storage of another size at a known address: a tenant we did not see
            if storage_bytes.get((t.storage, version.get(t.storage, 0)), t.nbytes) != t.nbytes:
                version[t.storage] = version.get(t.storage, 0) + 1
        ins = [(t.storage, version.get(t.storage, 0), min(t.view_nbytes, t.nbytes, cap)) for t in args if t.numel > 1]
        reads[r.index] = ins
        for s, v, _ in ins:
            readers.setdefault((s, v), set()).add(r.index)
        outs = []
        for t in r.call.outputs:
            version[t.storage] = version.get(t.storage, 0) + 1
            key = (t.storage, version[t.storage])
            produced[key] = r.index
            storage_bytes[key] = t.nbytes
            outs.append((*key, t.view_nbytes))
        writes[r.index] = outs
        if fusible:
            parent[r.index], segment[r.index] = r.index, seg
            for s, v, _ in ins:
                src = produced.get((s, v))
                if src is not None and src in parent and segment[src] == seg:
                    parent[find(r.index)] = find(src)
        else:
            seg += 1                                      # nothing fuses across a GEMM
    held = {(t.storage, version.get(t.storage, 0)) for t in g.held}

    groups: dict[int, list[int]] = {}
    for i in parent:
        groups.setdefault(find(i), []).append(i)

    rows, replaced = [], set()
    # 3: one row per group of two or more kernels; everything else is kept as traced
    for members in groups.values():
        if len(members) < 2:
            continue
        ops = set(members)
        replaced |= ops
        read: dict[tuple[int, int], int] = {}
        for i in members:
            for s, v, b in reads[i]:
                if produced.get((s, v)) not in ops:
                    read[(s, v)] = max(read.get((s, v), 0), b)
        # written: what is read after the group, kept at the end, or never read again (a gradient the optimizer
        # or the next step takes; the trace does not see those readers)
        written = sum(b for i in members for s, v, b in writes[i]
                      if (s, v) in held or readers.get((s, v), set()) - ops or not readers.get((s, v)))
        rows.append(_group_row(pd.concat([by_op[i] for i in sorted(members)]), sum(read.values()) + written))
    kept = k[~k["op_index"].isin(replaced)]
    out = pd.concat([kept, pd.DataFrame(rows, columns=KERNEL_COLUMNS)], ignore_index=True)
    out = out.astype({"flops": "float64", "algo_flops": "float64", "bytes": "float64"})
    return out.sort_values("op_index", kind="stable").reset_index(drop=True)


def _group_row(members: pd.DataFrame, nbytes: float) -> dict:
    """The fused kernel of one group of member kernel rows."""
    fams = set(members["family"])
    family = next((f for f in GROUP_FAMILY_ORDER if f in fams), Family.ELEMENTWISE.value)
    of_family = members[members["family"] == family]
    lead = (of_family if len(of_family) else members).sort_values("bytes", kind="stable").iloc[-1]
    dims = lead["dims"] if len(of_family) else (1, int(max(np.prod(d) for d in members["dims"])))
    return {"op_index": int(members["op_index"].min()), "phase": lead["phase"], "module": lead["module"],
            "aten_op": "fused:" + "+".join(dict.fromkeys(members["kernel"])), "family": family, "kernel": FUSED_KERNEL,
            "dims": tuple(int(x) for x in dims), "dtype": lead["dtype"], "flops": float(members["flops"].sum()),
            "algo_flops": float(members["flops"].sum()), "bytes": float(nbytes),
            "modeled": bool(members["modeled"].all())}


"""The kernels one GPU runs in a Megatron-LM step of a GPT model, from the Hugging Face trace of the same model.

Megatron-LM (as of core_r0.5.0: the legacy GPT model, FP32, no flash attention; the version behind the NeuSight
dataset's ``-dp4`` / ``-tp4`` / ``-pp4_<m>`` labels, run through Hugging Face Accelerate) runs the same GEMMs as
Hugging Face's GPT-2 blocks (with :func:`neusight.parallel.shard_tensor_parallel` for tensor parallelism) but
fewer memory-bound kernels around them. What changes here:

1. Bias + GeLU: the MLP's first projection leaves out its bias and one fused kernel (``bias_gelu``, a TorchScript
   fusion) applies bias and tanh-GeLU; its backward is one kernel too (``bias_gelu_back``). Hugging Face's
   tanh-GeLU runs about eight elementwise kernels forward and a dozen backward. Each activation module's
   kernels of one phase become one elementwise kernel: forward reads the input and writes the output, backward
   reads the incoming gradient and the saved input and writes the gradient (FLOPs: the members' sum).
2. The 1 / sqrt(head size) scaling of the attention scores is folded into the QK^T GEMM (``torch.baddbmm`` with
   ``alpha``): the forward scaling kernel goes. (Its backward counterpart stays: Megatron masks the scores in
   place with ``masked_fill_``, whose backward is a pass of the same size over the score gradients.)
3. No KV cache: the forward concatenations that fill Hugging Face's cache (those whose result the model's
   output keeps) go.

With activation recompute (``gradient_checkpointing``: Megatron-LM's ``--recompute-activations`` is ``"selective"``,
its full recompute ``True``) the forward kernels run again in the backward pass (``recompute`` in the kernel
table) get the forward's rules: the recomputed scaling goes, a recomputed activation is one forward bias-GeLU.

Left as traced (small next to the above, or unknown without the run's environment): the separate bias add after
the QKV projection and the fused bias-dropout-add of the residuals (both over tokens x hidden), apex's fused
layer norm (one kernel forward, as traced), Megatron's vocabulary-parallel cross-entropy (a few passes over the
logits instead of log-softmax + NLL) and the ``main_grad`` accumulation of its DDP buffer. That buffer's division
by the data-parallel size before its all-reduce is added by :func:`neusight.parallel.predict_parallel`
(:func:`neusight.parallel.megatron_grad_division_ms`); a NaN check of the buffer's norm, which later versions run
before it, is not.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from neusight.graph.graph import KERNEL_COLUMNS, Graph
from neusight.kernels.base import Family
from neusight.kernels.formulas import itemsize

__all__ = ["megatron_kernels", "ACTIVATION", "ATTENTION"]

# module paths of a block's activation and self-attention (GPT-2 ``mlp.act`` / ``attn``, BERT, OPT)
ACTIVATION = re.compile(r"(?:\.mlp\.act|\.intermediate_act_fn|\.activation_fn)$")
ATTENTION = re.compile(r"(?:\.attn|\.attention\.self|\.self_attn)$")
_SCALE_OPS = ("aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar")
_CACHE_OPS = ("aten.cat.default",)
MEGATRON_KERNEL = "megatron"


def megatron_kernels(g: Graph, counts: dict[str, int] | None = None) -> pd.DataFrame:
    """The kernel table of ``g`` (same columns as ``g.kernels``) as Megatron-LM runs the model's blocks;
    ``counts``, if given, receives how many kernels were dropped (``"dropped"``: scalings, cache writes) and how
    many fused activation kernels replace Hugging Face's chains (``"fused"``).

    Examples
    --------
    >>> import neusight
    >>> g = neusight.trace("gpt2", batch_size=1, seq_len=64, mode="training", optimizer=None)
    >>> k = megatron_kernels(g)
    >>> len(k) < len(g.kernels), int((k["kernel"] == "megatron").sum())     # one forward, one backward per block
    (True, 24)
    """
    k = g.kernels
    module = k["module"].astype(str)
    forward = (k["phase"] == "forward") | k["recompute"]      # a recomputed forward kernel is one too
    attn = module.str.contains(ATTENTION) & forward
    # a scaling multiplies or divides by a number (a rotary embedding's products of two tensors are not one)
    scalings = {r.index for r in g.ops if r.call.op in _SCALE_OPS
                and sum(t.numel > 1 for t in r.call.tensor_args()) == 1}
    drop = attn & (k["family"] == Family.ELEMENTWISE.value) & k["op_index"].isin(scalings)
    # the cache: concatenations whose result the model output keeps (a rotary embedding's cat is not dropped)
    held = {t.storage for t in g.held}
    cache = {r.index for r in g.ops if r.call.op in _CACHE_OPS and any(t.storage in held for t in r.call.outputs)}
    drop |= attn & k["op_index"].isin(cache)
    act = module.str.contains(ACTIVATION) & ~k["family"].isin([f.value for f in Family if f.is_gemm])
    rows = []
    for (_, phase, again), members in k[act].groupby([module[act], k.loc[act, "phase"], k.loc[act, "recompute"]],
                                                     sort=False):
        if len(members) < 2:
            act.loc[members.index] = False        # already one kernel (ReLU): nothing to fuse
            continue
        rows.append(_fused_activation(members, phase, gradient=phase == "backward" and not again))
    if counts is not None:
        counts.update(dropped=int(drop.sum()), fused=len(rows))
    kept = k[~(drop | act)]
    out = pd.concat([kept, pd.DataFrame(rows, columns=KERNEL_COLUMNS)], ignore_index=True)
    out = g.mark_recompute(out.astype({"flops": "float64", "algo_flops": "float64", "bytes": "float64"}))
    return out.sort_values("op_index", kind="stable").reset_index(drop=True)


def _fused_activation(members: pd.DataFrame, phase: str, gradient: bool) -> dict:
    """One bias-GeLU kernel (or its backward, ``gradient``) for the activation's kernels of one phase (a
    recomputed forward in the backward pass: the forward kernel)."""
    lead = members.loc[members["dims"].map(lambda d: int(np.prod(d))).idxmax()]
    elems = int(np.prod(lead["dims"]))
    tensors = 3 if gradient else 2             # backward: gradient in, saved input, gradient out
    return {"op_index": int(members["op_index"].min()), "phase": phase, "module": lead["module"],
            "aten_op": "megatron:bias_gelu" + ("_back" if gradient else ""),
            "family": Family.ELEMENTWISE.value, "kernel": MEGATRON_KERNEL, "dims": tuple(int(x) for x in lead["dims"]),
            "dtype": lead["dtype"], "flops": float(members["flops"].sum()), "algo_flops": float(members["flops"].sum()),
            "bytes": float(tensors * elems * itemsize(lead["dtype"])), "modeled": bool(members["modeled"].all())}

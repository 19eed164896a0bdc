"""The traced graph: ops in program order and the kernel table derived from them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from neusight.graph.records import OpRecord, TensorMeta
from neusight.kernels.base import Family

KERNEL_COLUMNS = ["op_index", "phase", "module", "aten_op", "family", "kernel", "dims", "dtype", "flops", "algo_flops",
                  "bytes", "modeled", "channel_align", "nchw_operands", "recompute"]


# gradient_checkpointing's value for Megatron-LM's selective recomputation (the attention core only)
SELECTIVE = "selective"


@dataclass
class Graph:
    """Result of :func:`neusight.trace`.

    ``ops`` holds every recorded aten op; ``kernels`` one row per GPU kernel (views launch none);
    ``unmodeled`` the names of ops without a registry entry (estimated as memory-bound, never dropped).
    """

    model: str
    mode: str
    batch_size: int
    seq_len: int | None
    optimizer: str | None
    dtype: str
    notes: tuple[str, ...]
    ops: list[OpRecord]
    params: list[TensorMeta] = field(default_factory=list)
    grads: list[TensorMeta] = field(default_factory=list)
    buffers: list[TensorMeta] = field(default_factory=list)
    optimizer_state: list[TensorMeta] = field(default_factory=list)
    image_size: int | None = None
    images: int | None = None   # a multimodal model's images per sequence (their tokens are among seq_len's)
    held: list[TensorMeta] = field(default_factory=list)   # what the model output (and loss) keep alive
    param_names: list[str] = field(default_factory=list)   # ``named_parameters()`` names, in the order of ``params``
    keeps_grads: bool = False   # the step zeroes its gradients instead of freeing them (they live all step)
    amp: str | None = None      # the autocast dtype of a mixed-precision trace ("float16", "bfloat16"), else None
    kv_cache: int | None = None  # tokens already in the KV cache of a generation step, else None
    gradient_checkpointing: bool | int | str = False   # layers recompute their forward in backward (n: every n-th;
    #                                                   "selective": the attention core only)
    lora_rank: int | None = None   # LoRA fine-tuning: the adapters' rank (base weights frozen), else None
    model_kind: str = ""   # how the model was built: "hf" (transformers), "vision" (CNN presets), "module" (nn.Module)
    # every call of a mixture-of-experts layer: (its module path, "forward" or "backward" (a checkpointed layer's
    # recomputation), bytes of the token rows it hands to its experts), what expert parallelism all-to-alls
    expert_dispatch: list[tuple[str, str, float]] = field(default_factory=list)
    memory_format: str = "contiguous"   # the CNN's layout: "contiguous" (NCHW) or "channels_last" (neusight.graph.layout)
    # a tensor-parallel trace's projections split by output features (Megatron-LM's column-parallel linears)
    tp_columns: tuple[str, ...] = ()
    # the model's parameters as numbers where its stored elements differ (weight_quant: two 4-bit weights per byte)
    param_count: int | None = None

    @functools.cached_property
    def kernels(self) -> pd.DataFrame:
        rows: dict[str, list] = {c: [] for c in KERNEL_COLUMNS}
        for r in self.ops:
            for k in r.kernels:
                rows["op_index"].append(r.index)
                rows["phase"].append(r.phase)
                rows["module"].append(r.module)
                rows["aten_op"].append(r.call.op)
                rows["family"].append(k.family.value)
                rows["kernel"].append(k.name)
                rows["dims"].append(k.dims)
                rows["dtype"].append(k.dtype)
                rows["flops"].append(k.flops)
                rows["algo_flops"].append(k.min_flops)
                rows["bytes"].append(k.bytes)
                rows["modeled"].append(r.modeled)
                rows["channel_align"].append(k.channel_align)
                rows["nchw_operands"].append(k.nchw_operands)
                rows["recompute"].append(r.recompute)
        df = pd.DataFrame(rows)
        df["flops"] = df["flops"].astype("float64")
        df["algo_flops"] = df["algo_flops"].astype("float64")
        df["bytes"] = df["bytes"].astype("float64")
        df["channel_align"] = df["channel_align"].astype("float64")   # NaN: not a convolution
        df["recompute"] = df["recompute"].astype(bool)
        return df

    @functools.cached_property
    def recompute_ops(self) -> frozenset[int]:
        """Indices of the ops activation checkpointing ran again in the backward pass (forward ops there)."""
        return frozenset(r.index for r in self.ops if r.recompute)

    def mark_recompute(self, kernels: pd.DataFrame) -> pd.DataFrame:
        """``kernels`` (a rewrite of this trace's kernel table: fused or Megatron-LM rows) with its ``recompute``
        column set from each row's op (a new row takes its op_index's)."""
        return kernels.assign(recompute=kernels["op_index"].isin(self.recompute_ops))

    @property
    def unmodeled(self) -> list[str]:
        return sorted({r.call.op for r in self.ops if not r.modeled})

    @property
    def n_params(self) -> int:
        """The model's parameters (a packed 4-bit weight's byte counted as its two weights)."""
        return self.param_count if self.param_count is not None else sum(p.numel for p in self.params)

    def summary(self) -> pd.DataFrame:
        """Per family: kernel count, GFLOPs, GB of minimum DRAM traffic."""
        k = self.kernels
        out = k.groupby("family").agg(count=("kernel", "size"), gflops=("flops", "sum"), gb=("bytes", "sum"))
        out["gflops"] /= 1e9
        out["gb"] /= 1e9
        order = [f.value for f in Family if f.value in out.index]
        return out.loc[order]

    def flops(self, phase: str | None = None, families: tuple[str, ...] | None = None) -> float:
        k = self.kernels
        if phase is not None:
            k = k[k["phase"] == phase]
        if families is not None:
            k = k[k["family"].isin(families)]
        return float(k["flops"].sum())

    def to_csv(self, path: str | Path) -> None:
        from neusight.util import atomic_write_text

        df = self.kernels.copy()
        df["dims"] = df["dims"].map(lambda d: "x".join(str(x) for x in d))
        atomic_write_text(path, df.to_csv(index=False))

"""What the tracer records per aten op: shapes only, never tensors (the op registry sees these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape-level description of one tensor argument or result of an aten op.

    ``storage`` identifies the underlying storage (views share it) while it is alive; the memory
    planner uses it to count a storage once. ``nbytes`` is the storage size (not the view's).
    """

    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    storage: int
    nbytes: int
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype), device="meta").element_size()

    @property
    def view_nbytes(self) -> int:
        """Bytes the view itself spans if read densely: numel x itemsize."""
        return self.numel * _ITEMSIZE_CACHE.setdefault(self.dtype, self.itemsize)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, t: torch.Tensor, keep: list | None = None) -> "TensorMeta":
        """The metadata of ``t``; ``keep``, if given, gets its storage appended (held alive by the caller)."""
        st = t.untyped_storage()
        if keep is not None:
            keep.append(st)
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), tuple(t.stride()), st._cdata, st.nbytes(),
                   bool(t.requires_grad))


_ITEMSIZE_CACHE: dict[str, int] = {}


@dataclass(frozen=True, slots=True)
class OpCall:
    """One aten op call as the registry sees it.

    ``args`` / ``kwargs`` are the call's arguments with every tensor replaced by a :class:`TensorMeta`
    (lists of tensors become lists of TensorMeta); ``outputs`` is the flat list of tensor results.
    ``op`` is the full overload name, e.g. ``"aten.addmm.default"``; ``packet`` the overload packet
    object (``torch.ops.aten.addmm``) used as registry key.
    """

    op: str
    packet: Any
    args: tuple
    kwargs: dict
    outputs: tuple[TensorMeta, ...]

    def tensor_args(self) -> list[TensorMeta]:
        """All TensorMeta among args and kwargs, flattened, in order."""
        found: list[TensorMeta] = []
        _collect(self.args, found)
        _collect(tuple(self.kwargs.values()), found)
        return found


def _collect(obj: Any, out: list[TensorMeta]) -> None:
    if isinstance(obj, TensorMeta):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _collect(o, out)


@dataclass(slots=True)
class OpRecord:
    """One recorded aten op in program order, with where and when it ran."""

    index: int
    phase: str          # "forward" | "backward" | "optimizer"
    module: str         # owning module path, "" for the model root / outside any module
    call: OpCall
    kernels: list = field(default_factory=list)   # list[Kernel] built by the registry
    modeled: bool = True
    recompute: bool = False   # run again in the backward pass by activation checkpointing (a forward op there)
    # storages whose last recorded tensor (a Python object or a C++ reference: a saved tensor, an engine buffer) was
    # dropped after this op and before the next one, as the traced program ran: its own frees, not last uses
    freed: tuple[int, ...] = ()

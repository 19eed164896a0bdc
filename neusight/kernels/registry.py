"""ONE registry from aten overload packets to kernel builders (in the spirit of
``torch.utils.flop_counter.register_flop_formula``).

A builder takes an :class:`~neusight.graph.records.OpCall` (shapes only) and returns the list of GPU
kernels the op launches on a CUDA device: ``[]`` for a view or metadata op that launches nothing, two
kernels for ``convolution_backward`` (data and weight gradients), etc. Ops without an entry are
reported as unmodeled by the tracer and estimated as memory-bound (read inputs, write outputs).
"""

from __future__ import annotations

from typing import Callable

from neusight.graph.records import OpCall
from neusight.kernels.base import Family, Kernel

Builder = Callable[[OpCall], list[Kernel]]

_REGISTRY: dict[object, Builder] = {}


def register(*packets: object) -> Callable[[Builder], Builder]:
    """Register one builder for several aten overload packets; registering a packet twice is an error."""

    def deco(fn: Builder) -> Builder:
        for p in packets:
            if p in _REGISTRY:
                raise RuntimeError(f"aten op {p} is registered twice ({_REGISTRY[p].__name__} and {fn.__name__})")
            _REGISTRY[p] = fn
        return fn

    return deco


def aten_packets(prefix: str) -> list[object]:
    """Every aten overload packet whose name starts with ``prefix``, from the dispatcher's op list
    (``dir(torch.ops.aten)`` lists only the packets some code has touched so far)."""
    import torch

    names = sorted({n.removeprefix("aten::").split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("aten::" + prefix)})
    return [p for p in (getattr(torch.ops.aten, n, None) for n in names) if isinstance(p, torch._ops.OpOverloadPacket)]


def registered_ops() -> list[str]:
    """Names of every registered overload packet, sorted."""
    _load_builders()
    return sorted(str(p) for p in _REGISTRY)


def is_registered(packet: object) -> bool:
    _load_builders()
    return packet in _REGISTRY


def build_kernels(call: OpCall) -> tuple[list[Kernel], bool]:
    """Kernels of one op call and whether the op is modeled; unmodeled ops get a memory-bound estimate."""
    _load_builders()
    fn = _REGISTRY.get(call.packet)
    if fn is None:
        return fallback_kernels(call), False
    # An op over empty tensors (a zero-size split, a 0-element zeros) launches nothing.
    return [k for k in fn(call) if k.bytes > 0 or k.flops > 0], True


def fallback_kernels(call: OpCall) -> list[Kernel]:
    """NB: an op nobody described is charged as one memory-bound kernel reading its tensor inputs and
    writing its outputs, at zero FLOPs; it is listed in ``Graph.unmodeled`` so the gap is visible."""
    ins = call.tensor_args()
    outs = call.outputs
    nbytes = sum(t.view_nbytes for t in ins) + sum(t.view_nbytes for t in outs)
    numel = max([t.numel for t in outs] + [t.numel for t in ins] + [1])
    dtype = (outs or ins)[0].dtype if (outs or ins) else "float32"
    cols = (outs[0].shape[-1] if outs and outs[0].shape else numel) or 1
    return [Kernel(Family.MEMORY, call.op.split(".")[1] if "." in call.op else call.op,
                   (max(1, numel // cols), cols), 0.0, float(nbytes), dtype)]


_loaded = False


def _load_builders() -> None:
    """Import the builder modules once (they fill the registry with their decorators)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from neusight.kernels import ops_gemm, ops_misc  # noqa: F401


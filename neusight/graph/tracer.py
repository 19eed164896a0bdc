"""Trace a model into the aten ops (and so the GPU kernels) of an inference pass or a training step, on
the meta device: shapes only, no weights, no GPU.

A private ``TorchDispatchMode`` records every aten op below autograd, with the phase (forward, loss,
backward, optimizer), the owning module path (``torch.utils.module_tracker``) and the input / output
shapes. A ``TorchFunctionMode`` makes the CPU/meta code path launch what CUDA would: dropout in training
runs as the fused ``native_dropout`` kernel (meta would otherwise decompose it into bernoulli + mul).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

from neusight.errors import InputError, ModelError, TraceError
from neusight.graph.graph import Graph
from neusight.graph.models import BuiltModel, build_model
from neusight.graph.records import OpCall, OpRecord, TensorMeta
from neusight.kernels.registry import build_kernels

log = logging.getLogger(__name__)

MODES = ("inference", "training")
OPTIMIZERS = ("adamw", "adam", "sgd")

# Metadata / bookkeeping ops that never reach the GPU as a kernel and need no record at all.
_SKIP = frozenset(getattr(torch.ops.aten, n) for n in (
    "size", "stride", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_local_scalar_dense",
    "is_contiguous", "_has_compatible_shallow_copy_type",
) if hasattr(torch.ops.aten, n))


class _Recorder(TorchDispatchMode):
    """Private dispatch mode: appends an OpRecord per aten op that touches a meta tensor."""

    def __init__(self, tracker: ModuleTracker, root_name: str) -> None:
        super().__init__()
        self.tracker = tracker
        self.root = root_name + "."
        self.phase = "forward"
        self.ops: list[OpRecord] = []

    def _module(self) -> str:
        deepest = max(self.tracker.parents, key=lambda p: (p.count("."), len(p)), default="Global")
        if deepest == "Global":
            return ""
        return deepest[len(self.root):] if deepest.startswith(self.root) else ("" if "." not in deepest else deepest)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SKIP:
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            raise TraceError(f"{func} cannot run on the meta device in module {self._module() or '<root>'!r} "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); it is probably data-"
                             f"dependent (nonzero, .item(), boolean indexing). Make the shape static or trace a "
                             f"module without it.") from None
        flat_out: list[torch.Tensor] = []
        _tensors(out, flat_out)
        flat_in: list[torch.Tensor] = []
        _tensors(args, flat_in)
        _tensors(tuple(kwargs.values()), flat_in)
        if not any(t.device.type == "meta" for t in flat_in) and not any(t.device.type == "meta" for t in flat_out):
            return out  # host-side scalar bookkeeping (e.g. optimizer step counters on the CPU)
        outs = tuple(TensorMeta.of(t) for t in flat_out)
        call = OpCall(str(func), packet, _metas(args), {k: _metas(v) for k, v in kwargs.items()}, outs)
        kernels, modeled = build_kernels(call)
        self.ops.append(OpRecord(len(self.ops), self.phase, self._module(), call, kernels, modeled))
        return out


def _tensors(obj: Any, found: list) -> None:
    """Append every tensor in a (nested) tuple / list of op arguments or results; faster than pytree."""
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors(o, found)


def _metas(obj: Any) -> Any:
    """Op arguments with every tensor replaced by its TensorMeta (tuples and lists kept as such)."""
    if isinstance(obj, torch.Tensor):
        return TensorMeta.of(obj)
    if isinstance(obj, tuple):
        return tuple(_metas(o) for o in obj)
    if isinstance(obj, list):
        return [_metas(o) for o in obj]
    return obj


class _CudaPaths(TorchFunctionMode):
    """Route functions whose meta/CPU implementation differs from the CUDA one to the CUDA kernels."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout or func is torch.dropout:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
            if train and 0 < p < 1:
                return torch.native_dropout(x, p, True)[0]
            if train and p >= 1:
                return torch.zeros_like(x)
            return x
        if func is F.scaled_dot_product_attention:
            return _efficient_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention as CUDA runs it in FP32: the memory-efficient fused kernel
    (flash attention needs 16-bit inputs); a boolean mask becomes an additive bias first."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros_like(bias, dtype=q.dtype).masked_fill(bias.logical_not(), float("-inf"))
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, need_lse, dropout_p, is_causal,
                                                                  scale=scale)[0]


def _check_run(built: BuiltModel, batch_size: int, seq_len: int | None, mode: str, optimizer: str | None) -> int | None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size={batch_size!r} is not a positive integer; use batch_size >= 1")
    if mode not in MODES:
        raise InputError(f"mode={mode!r} is not known; use 'inference' or 'training'")
    if optimizer is not None and str(optimizer).lower() not in OPTIMIZERS:
        raise InputError(f"optimizer={optimizer!r} is not known; use 'adamw', 'sgd' or None")
    if built.needs_seq_len:
        if seq_len is None:
            seq_len = min(built.max_seq_len or 512, 512)
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise InputError(f"seq_len={seq_len!r} is not a positive integer; use seq_len >= 1")
        if built.max_seq_len and seq_len > built.max_seq_len:
            raise InputError(f"seq_len={seq_len} exceeds {built.name}'s maximum of {built.max_seq_len} positions; "
                             f"use seq_len <= {built.max_seq_len}")
    elif seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise InputError(f"seq_len={seq_len!r} is not a positive integer; leave it out for {built.name}")
    return seq_len


def trace(model: Any, batch_size: int = 1, seq_len: int | None = None, mode: str = "inference", *,
          head: str | None = None, optimizer: str | None = "adamw", attn_implementation: str = "eager",
          image_size: int = 224, input_shapes: list[tuple[int, ...]] | None = None,
          dtype: str | torch.dtype = torch.float32, include_loss: bool = True, tensor_parallel: int = 1) -> Graph:
    """Trace ``model`` into the aten ops of one inference pass or one training step.

    Parameters
    ----------
    model : str, path or nn.Module
        A preset (``"gpt2-large"``, ``"resnet50"``, ...), a Hugging Face config JSON path, or an nn.Module
        (then ``input_shapes`` gives its inputs' shapes without the batch dimension).
    batch_size, seq_len : int
        Run shape; ``seq_len`` is for sequence models only.
    mode : {"inference", "training"}
        Inference: ``eval()`` and ``no_grad``. Training: ``train()`` (dropout active), forward, loss,
        ``loss.backward()`` and, unless ``optimizer=None``, one optimizer step (foreach kernels, as on CUDA).
    head : str, optional
        HF model class: ``causal-lm``, ``sequence-classification``, ``pretraining``, ``seq2seq``.
    tensor_parallel : int
        Trace one GPU's share of a Megatron-style tensor-parallel model over this many GPUs
        (:func:`neusight.parallel.shard_tensor_parallel`); 1 = the whole model.

    Returns
    -------
    Graph
        ``.ops`` in program order, ``.kernels`` (DataFrame), ``.unmodeled`` op names.

    Examples
    --------
    >>> import neusight
    >>> g = neusight.trace("resnet18", batch_size=2, mode="inference")
    >>> int(g.kernels.query("family == 'conv'").shape[0])
    20
    """
    torch_dtype = getattr(torch, str(dtype).removeprefix("torch.")) if not isinstance(dtype, torch.dtype) else dtype
    built = build_model(model, head=head, attn_implementation=attn_implementation, image_size=image_size,
                        input_shapes=input_shapes, dtype=torch_dtype)
    seq_len = _check_run(built, batch_size, seq_len, mode, optimizer)
    module = built.module
    if tensor_parallel != 1:
        from neusight.parallel import shard_tensor_parallel

        shard_tensor_parallel(module, tensor_parallel)
    training = mode == "training"
    module.train(training)
    args, kwargs = built.make_inputs(batch_size, seq_len)
    tracker = ModuleTracker()
    rec = _Recorder(tracker, type(module).__name__)
    opt = _make_optimizer(module, optimizer) if training and optimizer else None
    grad_ctx = contextlib.nullcontext() if training else torch.no_grad()
    try:
        with grad_ctx, tracker, _CudaPaths(), rec:
            out = module(*args, **kwargs)
            held = _held_tensors(out)
            if training:
                rec.phase = "loss"
                loss = built.loss(out, args, kwargs)
                held.append(TensorMeta.of(loss))
                rec.phase = "backward"
                loss.backward()
    except (TraceError, InputError, ModelError):
        raise
    except Exception as e:
        raise ModelError(f"{built.name} failed on the meta device: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
                         f"Check the input shapes (batch_size={batch_size}, seq_len={seq_len})") from None
    state: list[TensorMeta] = []
    if opt is not None:
        _init_optimizer_state(opt)   # the state a steady-state step finds (the first step creates it lazily)
        with tracker, _CudaPaths(), rec:
            rec.phase = "optimizer"
            opt.step()
        state = [TensorMeta.of(t) for st in opt.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor) and t.device.type == "meta"]
    params = [TensorMeta.of(p) for p in module.parameters()]
    grads = [TensorMeta.of(p.grad) for p in module.parameters() if p.grad is not None]
    buffers = [TensorMeta.of(b) for b in module.buffers()]
    if not include_loss:
        for r in rec.ops:
            if r.phase == "loss":
                r.kernels = []
    return Graph(model=built.name, mode=mode, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer if training else None,
                 dtype=str(torch_dtype).removeprefix("torch."), notes=tuple(built.notes), ops=rec.ops,
                 params=params, grads=grads, buffers=buffers, optimizer_state=state, held=held,
                 image_size=image_size if built.kind == "vision" else None)


def _held_tensors(out: Any, depth: int = 0, seen: set | None = None) -> list[TensorMeta]:
    """Tensors the model output keeps alive until the end of the step (logits, a KV cache...): walks
    containers and plain objects' attributes (a transformers ``DynamicCache`` keeps its keys and values
    in per-layer objects)."""
    seen = set() if seen is None else seen
    if id(out) in seen or depth > 6:
        return []
    seen.add(id(out))
    if isinstance(out, torch.Tensor):
        return [TensorMeta.of(out)] if out.device.type == "meta" else []
    found: list[TensorMeta] = []
    if isinstance(out, dict):
        items = list(out.values())
    elif isinstance(out, (list, tuple)):
        items = list(out)
    elif hasattr(out, "__dict__") and not isinstance(out, torch.nn.Module):
        items = list(vars(out).values())
    else:
        return []
    for item in items:
        found += _held_tensors(item, depth + 1, seen)
    return found


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the per-parameter state the first ``step()`` would create, so the recorded step is a
    steady-state one (AdamW: step count, exp_avg, exp_avg_sq; SGD with momentum: momentum_buffer)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}
                if group.get("amsgrad"):
                    opt.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
            elif isinstance(opt, torch.optim.SGD) and group.get("momentum", 0):
                opt.state[p] = {"momentum_buffer": torch.zeros_like(p)}


def _make_optimizer(module: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    name = name.lower()
    # foreach=True: the multi-tensor kernels PyTorch uses by default on CUDA.
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-4, foreach=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)

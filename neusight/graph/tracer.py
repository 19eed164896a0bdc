"""Trace a model into the aten ops (and so the GPU kernels) of an inference pass or a training step, on
the meta device: shapes only, no weights, no GPU.

A private ``TorchDispatchMode`` records every aten op below autograd, with the phase (forward, loss,
backward, optimizer), the owning module path (``torch.utils.module_tracker``) and the input / output
shapes. A ``TorchFunctionMode`` makes the CPU/meta code path launch what CUDA would: dropout in training
runs as the fused ``native_dropout`` kernel (meta would otherwise decompose it into bernoulli + mul), and
nn.LSTM / nn.GRU / nn.RNN run one recurrent GEMM and one fused cell kernel per time step.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import random
import sys
import weakref
from typing import Any, Iterator

import numpy as np

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker
from torch.utils.weak import WeakTensorKeyDictionary

from neusight.errors import ContextParallelError, InputError, ModelError, TraceError
from neusight.graph import fastmeta
from neusight.graph.amp import Autocast, amp_dtype, model_dtype
from neusight.graph.graph import SELECTIVE, Graph
from neusight.graph.layout import check_memory_format
from neusight.graph.models import BuiltModel, TextModelWithLMHead, build_model, transformers_checks_off
from neusight.graph.records import OpCall, OpRecord, TensorMeta
from neusight.kernels.base import Family
from neusight.kernels.registry import build_kernels

log = logging.getLogger(__name__)

MODES = ("inference", "training")
KV_NOTE = ("generation with a KV cache: {t} new token(s) per sequence after {n} cached ones (transformers' "
           "DynamicCache, read by every layer and grown by concatenation, as eager generate() runs)")
STATIC_KV_NOTE = ("generation with a KV cache: {t} new token(s) per sequence after {n} cached ones, written in place "
                  "into a cache sized for the run (static_cache: transformers' StaticCache, as compiled generation and "
                  "serving engines' paged caches write it) and read by every layer")
# kv_cache_dtype values: the FP8 formats serving engines store a KV cache in (vLLM's kv_cache_dtype names)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_KV_NOTE = ("KV cache in {fmt}: the keys and values of {n} attention layers stored at one byte each, every step's "
               "new ones cast into it, attention reading them as FP8 and computing in {dtype} (the FP8 KV caches of "
               "serving engines: vLLM, SGLang, TensorRT-LLM, with FlashInfer / FlashAttention kernels){other}")
FP8_KV_ATTENTION = "attention_fp8_kv"   # the fused region of an attention over an FP8 cache
AMP_NOTE = ("mixed precision: torch.autocast({dtype}){scaler}, emulated on meta (neusight.graph.amp): GEMMs and "
            "convolutions in {dtype}, softmax, norms and losses in FP32, with the casts between them")
OPTIMIZERS = ("adamw", "adam", "sgd", "adamw-fused", "adam-fused")
SDPA_MARK = "scaled_dot_product_attention on"   # in the note of a trace whose attention backend depends on the GPU
SDPA_NOTE = SDPA_MARK + " {device} as PyTorch dispatches it: {how}"
FLASH_ATTN_NOTE = SDPA_MARK + " {device} as transformers' flash-attn integration runs it: {how}"
WINDOW_NOTE = ("sliding-window attention: flash-attn's kernel computes each query over its window of {windows} keys "
               "only (window_size), as one kernel doing that band's work; scaled_dot_product_attention "
               "(attn_implementation='sdpa') computes the whole masked square")
SDPA_BACKENDS = {
    "flash": "flash attention (FP16 / BF16 on compute capability 8.0+ or ROCm's AOTriton GPUs, no mask; "
             "grouped-query keys and values read as they are)",
    "math": "the math backend, as no fused kernel takes these inputs on this GPU (grouped-query attention outside "
            "flash attention; an AMD GPU without AOTriton kernels, such as MI100; BF16 before compute capability "
            "8.0): scores materialized, softmax, two GEMMs, grouped-query keys and values repeated per query head",
    "efficient": "the memory-efficient fused kernel",
    "cudnn": "cuDNN attention (PyTorch's first choice on compute capability 9.0 / 10.x: FP16 / BF16, masks and "
             "grouped-query keys and values as they are)",
    "flash_attention_2": "flash-attn 2's kernel, as transformers' attn_implementation='flash_attention_2' calls it "
                         "(FP16 / BF16; causal by its flag, a mask as unpadded sequences; grouped-query keys and "
                         "values as they are)",
    "flash_attention_3": "flash-attn 3's Hopper kernel, as transformers' attn_implementation='flash_attention_3' "
                         "calls it (FP16 / BF16; causal by its flag; grouped-query keys and values as they are)",
}
LORA_NOTE = ("LoRA fine-tuning: rank-{r} adapters on {n} projections ({targets}), every base weight frozen (no "
             "weight gradient or optimizer state for it)")
LAYERDROP_NOTE = ("LayerDrop off: every layer is traced, where a training step skips each with probability {p} "
                  "({names}); its layers' share of the forecast is what a step with all layers takes, {keep} of it "
                  "on average")
SELECTIVE_NOTE = ("selective recomputation: the attention core (scores, softmax, dropout, the two batched matmuls or "
                  "the fused attention kernel) runs again in the backward pass instead of keeping its activations, "
                  "as Megatron-LM's --recompute-activations does")
CHECKPOINT_NOTE = ("gradient checkpointing: {which} runs its forward again in the backward pass (Hugging Face's "
                   "activation checkpointing, non-reentrant torch.utils.checkpoint), keeping only its input between "
                   "the passes")

# Metadata / bookkeeping ops that never reach the GPU as a kernel and need no record at all.
_SKIP = frozenset(getattr(torch.ops.aten, n) for n in (
    "size", "stride", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_local_scalar_dense",
    "is_contiguous", "_has_compatible_shallow_copy_type",
) if hasattr(torch.ops.aten, n))
# Meta tensors hold no values, so a Python branch on one (``if mask.all():``, ``x.any().item()``) cannot be taken
# as the data would take it. Models ask these of their masks and ids to find the special cases: padding, packed
# sequences, global-attention tokens, NaNs. The tracer takes the branch of a plain batch, where none occurs: an
# ``all()`` is true, an ``any()`` false. Any other value read back from the GPU (``.item()`` of a sum or a max,
# which may size what follows) stays an error.
_PLAIN_BATCH = {torch.ops.aten.all: True, torch.ops.aten.any: False}
_SCALAR_READ = torch.ops.aten._local_scalar_dense


class _Tracker(ModuleTracker):
    """torch's ModuleTracker, except that the backward pass enters a module as soon as the gradient of any of its
    outputs is ready. torch's waits for all of them, so a module that also returns a tensor its caller drops (an
    attention returning its weights) was entered only once that tensor's gradient had been computed: the kernels
    computing it (the attention's last matmul's gradients) went to the parent module. It leaves a module when the
    gradients of all its inputs are ready, as torch's does, without holding the ones that came first until then
    (the program would not: the trace sees when it drops each tensor, :mod:`neusight.memory`)."""

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        name = self._get_mod_name(mod)
        self._get_append_fn(name, False)()
        tensors = [a for a in tree_flatten(input)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
        if tensors and not _RECOMPUTING:   # see _fw_post_hook
            self._hooks.append(_when_all_grads(tensors, self._get_pop_fn(name, True)))

    def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
        name = self._get_mod_name(mod)
        self._get_pop_fn(name, False)()
        tensors = [a for a in tree_flatten(output)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
        # A checkpoint's recomputation builds a graph the backward never runs (its results stand in for the saved
        # tensors): gradient hooks on it would never fire, and would keep that graph, and what it saves, alive until
        # the trace ends (a hook's closure holds the nodes it is registered on)
        if tensors and not _RECOMPUTING:
            self._hooks.append(register_multi_grad_hook(tensors, self._get_append_fn(name, True), mode="any"))


class _Handles(list):
    """Hook handles removed together."""

    def remove(self) -> None:
        for h in self:
            h.remove()


def _when_all_grads(tensors: list[torch.Tensor], fn: Any) -> _Handles:
    """Call ``fn()`` once the gradients of all ``tensors`` the running backward computes are ready: torch's
    ``register_multi_grad_hook(..., mode="all")``, which also keeps each gradient until the last one comes, to hand
    them to ``fn``; this one keeps none."""
    nodes = [torch.autograd.graph._get_grad_fn_or_grad_acc(t) for t in tensors]
    seen: dict[int, list[int]] = {}   # backward call -> [gradients seen, gradients it computes]

    def hook(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task not in seen:
            seen[task] = [0, sum(map(torch._C._will_engine_execute_node, nodes))]
        seen[task][0] += 1
        if seen[task][0] == seen[task][1]:
            del seen[task]
            fn()

    return _Handles(t.register_hook(hook) for t in tensors)


class _EnteredModules(dict):
    """The set of modules a ModuleTracker is inside, kept in the order they were entered (a dict's key order), each
    with when it was entered (a count over the trace: :data:`_ENTERED`)."""

    def __init__(self, names: Any = ()) -> None:
        super().__init__(dict.fromkeys(names, 0))

    def add(self, name: str) -> None:
        self.pop(name, None)
        _ENTERED[0] += 1
        self[name] = _ENTERED[0]

    def remove(self, name: str) -> None:
        del self[name]


class _PlainBatch(TorchDispatchMode):
    """A run of the model on meta tensors where a branch on an ``all()`` / ``any()`` takes a plain batch's way
    (:data:`_PLAIN_BATCH`) and any other value read back is a TraceError. On its own: the unrecorded runs that fill
    a KV cache (its probe, a prefill; transformers' check of the inputs for padding tokens reads one back); the
    recording mode, :class:`_Recorder`, is one too."""

    def __init__(self) -> None:
        super().__init__()
        self._verdicts = WeakTensorKeyDictionary()   # outputs of all() / any() on meta -> their plain-batch value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func.overloadpacket
        if packet is _SCALAR_READ and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return self._read_scalar(args[0])
        return self._remember(packet, func(*args, **(kwargs or {})))

    def _where(self) -> str:
        return "while the model fills its KV cache"

    def _remember(self, packet: Any, out: Any) -> Any:
        if packet in _PLAIN_BATCH and isinstance(out, torch.Tensor):
            self._verdicts[out] = _PLAIN_BATCH[packet]
        return out

    def _read_scalar(self, t: torch.Tensor) -> Any:
        """``.item()`` / ``bool()`` of a meta tensor: the plain-batch value of an ``all()`` or ``any()``, or an
        error saying where (the host sync itself, a few microseconds, is not a kernel and is not recorded)."""
        verdict = self._verdicts.get(t)
        if verdict is not None and t.numel() == 1:
            return verdict
        raise TraceError(f"a value of a tensor is read back {self._where()} (.item(), "
                         f"bool() or a Python comparison on a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} "
                         "tensor): the trace has shapes, not values, so a branch or a size that depends on the data "
                         "cannot be followed. Make it static or trace a module without it")


class _Recorder(_PlainBatch):
    """Private dispatch mode: appends an OpRecord per aten op that touches a meta tensor."""

    def __init__(self, tracker: ModuleTracker, root_name: str) -> None:
        super().__init__()
        self.tracker = tracker
        self.root = root_name + "."
        self.phase = "forward"
        self.ops: list[OpRecord] = []
        # Every recorded output's storage, held for the trace: a storage's id is the address of its StorageImpl, and
        # a freed one could be reused by a tensor made where the trace does not see it (the autograd engine, Python
        # code outside dispatch), which would then pass for the recorded output. Which addresses get reused varies
        # from process to process; holding them (meta storages have no data) keeps every id unique.
        self._held: list[Any] = []
        # When the program drops each recorded output: a weak reference per tensor object, whose callback notes the
        # op it went after (the ops of a fused region are one op). PyTorch keeps a tensor's Python object as long as
        # C++ holds the tensor (a saved tensor, the engine's gradient buffer), so this is the tensor's own end.
        self._watch: list[weakref.ref] = []
        self._dropped_after: dict[int, int] = {}   # storage -> the op after which its last watched tensor went
        self._region: list[int] | None = None      # storages dropped inside the open fused region (None: none open)

    @contextlib.contextmanager
    def fused_region(self, name: str, inputs: tuple, info: dict) -> Any:
        """Record what runs inside as one fused kernel (:mod:`neusight.graph.ssm`): the ops recorded in the region
        are replaced by one op whose kernel is ``fused_kernel`` of theirs (or ``info["make"]``'s, called alike, which
        may return a list of kernels),
        reading ``inputs`` and writing the tensors the caller appends to the yielded list; the kernel is left in
        ``info["kernel"]``. A region inside another one is part of the outer one."""
        if self._region is not None:
            yield []
            return
        from neusight.graph.ssm import FUSED_OP_PREFIX, fused_kernel

        start, module, phase = len(self.ops), self._module(), self.phase
        outputs: list[torch.Tensor] = []
        self._region = dropped = []
        try:
            yield outputs
        finally:
            self._region = None
        inner = self.ops[start:]
        del self.ops[start:]
        empty = not inner and "make" not in info   # no op: what went inside went after the op before the region
        at = start - 1 if empty else start
        for storage in dropped if at >= 0 else ():
            self._dropped_after[storage] = at
        if empty:
            return
        ins = [TensorMeta.of(t) for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        outs = [TensorMeta.of(t) for t in outputs if t.device.type == "meta"]
        kernel = info.get("make", fused_kernel)(name, [k for r in inner for k in r.kernels], ins, outs)
        kernels = kernel if isinstance(kernel, list) else [kernel]   # a maker may return several
        info["kernel"] = kernel
        call = OpCall(FUSED_OP_PREFIX + name, None, tuple(ins), {}, tuple(outs))
        self.ops.append(OpRecord(start, phase, module, call, kernels, True, bool(_RECOMPUTING)))

    def _module(self) -> str:
        deepest = self.entered_module()
        if deepest == "Global":
            return ""
        return deepest[len(self.root):] if deepest.startswith(self.root) else ("" if "." not in deepest else deepest)

    def entered_module(self) -> str:
        """The tracker's name of the module the next op belongs to: the deepest entered one; of equally deep ones
        (a checkpointed layer's recomputation can leave the previous layer's entry behind) the one entered last,
        never the order of a set of strings, which varies by process. A recomputation is a forward pass inside the
        backward one, whose modules are still entered (deeper ones too): there only the modules entered since the
        recomputation began count, and with none (an op of the recomputed function itself: transformers checkpoints
        a layer's ``forward``, whose module hooks do not run again) the module it was called in."""
        parents = self.tracker.parents
        if not isinstance(parents, _EnteredModules):   # the tracker resets it to a plain set after a backward pass
            parents = self.tracker.parents = _EnteredModules(sorted(parents))
        order = {p: i for i, p in enumerate(parents)}
        if _RECOMPUTING:
            candidates = [p for p, when in parents.items() if when > _RECOMPUTE_START[0]]
            if not candidates and _RECOMPUTING[-1] is not None:
                return _RECOMPUTING[-1]
        else:
            candidates = []
        return max(candidates or parents, key=lambda p: (p.count("."), order[p]), default="Global")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is _SCALAR_READ and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            return self._read_scalar(args[0])
        if packet in _SKIP:
            return func(*args, **kwargs)
        try:
            out = fastmeta.run(func, args, kwargs)
        except AssertionError:
            raise
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
        outs = tuple(TensorMeta.of(t, self._held) for t in flat_out)
        for t, meta in zip(flat_out, outs):
            if t.device.type == "meta":
                self._watch.append(weakref.ref(t, functools.partial(self._drop, meta.storage)))
        call = OpCall(str(func), packet, _metas(args), {k: _metas(v) for k, v in kwargs.items()}, outs)
        kernels, modeled = build_kernels(call)
        self.ops.append(OpRecord(len(self.ops), self.phase, self._module(), call, kernels, modeled,
                                 bool(_RECOMPUTING)))
        return self._remember(packet, out)

    def _drop(self, storage: int, _ref: Any) -> None:
        if self._region is not None:
            self._region.append(storage)
        elif self.ops:
            self._dropped_after[storage] = len(self.ops) - 1

    def close(self) -> None:
        """Write down when the program dropped each storage (``OpRecord.freed``, on the op after which its last
        watched tensor went); what is still held now (the model's output, the loss) is the caller's, not the
        trace's to free."""
        self._watch.clear()   # a dropped weak reference calls back no more
        by_op: dict[int, list[int]] = {}
        for storage, i in self._dropped_after.items():
            by_op.setdefault(i, []).append(storage)
        for i, storages in by_op.items():
            self.ops[i].freed = tuple(storages)

    def _where(self) -> str:
        return f"in module {self._module() or '<root>'!r}"


@contextlib.contextmanager
def _cycles_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (reference counting still frees at once)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


# the sliding window of the attention function call under way (``_CudaPaths._windowed``), None outside them
_WINDOW: list[int | None] = [None]


class _CudaPaths(TorchFunctionMode):
    """Route functions whose meta/CPU implementation differs from the CUDA one to the CUDA kernels (of ``device``
    where PyTorch picks them by the GPU: scaled_dot_product_attention's backend)."""

    def __init__(self, device: Any = None, attn_implementation: str = "eager") -> None:
        super().__init__()
        self.device = device
        # flash_attention_2 / _3: the model was built with sdpa, whose calls become flash-attn's kernel here
        self.flash_attn = attn_implementation if attn_implementation in FLASH_ATTN_IMPLEMENTATIONS else None
        self.sdpa: set[str] = set()    # the backends its scaled_dot_product_attention calls took (SDPA_BACKENDS)
        self.region: Any = None        # the recorder's fused_region, for attention over an FP8 KV cache
        self.windows: set[int] = set()   # the sliding windows flash-attn's kernels were limited to
        self._patches: contextlib.ExitStack | None = None

    def __enter__(self) -> Any:
        # flash-attn runs: transformers hands its attention function the layer's sliding window, which flash-attn's
        # kernel takes (window_size) and scaled_dot_product_attention does not: the model's attention functions are
        # wrapped to pass it on to _flash_attn (through _WINDOW: a recomputation's mode may run a function that an
        # outer mode wrapped)
        if self.flash_attn:
            from unittest import mock

            from neusight.graph.models import FLASH_VIA_SDPA

            try:
                from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
                mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
            except (ImportError, AttributeError):
                mapping = {}
            self._patches = contextlib.ExitStack()
            for name in ("sdpa", FLASH_VIA_SDPA):
                if name in mapping:
                    self._patches.enter_context(mock.patch.dict(mapping, {name: self._windowed(mapping[name])}))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        if self._patches is not None:
            self._patches.close()
            self._patches = None
        return out

    def _windowed(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def attention(*args: Any, **kwargs: Any) -> Any:
            before, window = _WINDOW[0], kwargs.get("sliding_window")
            _WINDOW[0] = int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 0 \
                else None
            try:
                return fn(*args, **kwargs)
            finally:
                _WINDOW[0] = before
        return attention

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
            if self.region is not None and len(args) > 2 and args[1].dtype in FP8_KV_STORAGE:
                return self._fp8_kv_attention(*args, **kwargs)
            if self.flash_attn:
                self.sdpa.add(self.flash_attn)
                return _flash_attn(self.device, self.flash_attn, *args, window=_WINDOW[0], seen=self.windows,
                                   **kwargs)
            backend = _sdpa_backend(self.device, *args, **kwargs)
            self.sdpa.add(backend)
            return _sdpa(backend, *args, **kwargs)
        if func is torch.lstm and _cudnn_rnn_applies(args, kwargs, lstm=True):
            return _cudnn_style_rnn("lstm", *args)
        if func is torch.gru and _cudnn_rnn_applies(args, kwargs, lstm=False):
            return _cudnn_style_rnn("gru", *args)
        if func in (torch.rnn_tanh, torch.rnn_relu) and _cudnn_rnn_applies(args, kwargs, lstm=False):
            return _cudnn_style_rnn("tanh" if func is torch.rnn_tanh else "relu", *args)
        return func(*args, **kwargs)

    def _fp8_kv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        """Attention over an FP8 KV cache (``kv_cache_dtype``): one kernel that reads the cached keys and values at
        one byte each and computes in the queries' dtype, as serving engines' FP8-cache attention does. Traced as the
        attention this GPU runs on the keys and values in the queries' dtype, recorded as one fused region whose
        kernel is that attention's with the FP8 operands' bytes."""
        info: dict[str, Any] = {"make": functools.partial(_fp8_kv_kernel, saved=(k.numel() + v.numel())
                                                          * (q.element_size() - k.element_size()))}
        with self.region(FP8_KV_ATTENTION, (q, k, v), info) as outputs:
            out = self.__torch_function__(F.scaled_dot_product_attention, (), (q, k.to(q.dtype), v.to(q.dtype),
                                                                                *rest), kwargs)
            outputs.append(out)
        return out


# the storage dtypes of an FP8 KV cache
FP8_KV_STORAGE = frozenset(KV_CACHE_DTYPES.values())


def _fp8_kv_kernel(name: str, inner: list, ins: list, outs: list, saved: float) -> list:
    """The kernels of :meth:`_CudaPaths._fp8_kv_attention`'s region: ``inner`` without its first two (the casts of
    the keys and values to the compute dtype, which the FP8-cache kernel does as it loads them), the one fused
    attention kernel among the rest reading ``saved`` bytes fewer. InputError where this GPU runs no fused attention
    kernel on these inputs (the math backend's GEMMs and softmax)."""
    import dataclasses

    rest = list(inner[2:])
    gemms = [i for i, k in enumerate(rest) if k.family == Family.BMM]
    if len(gemms) != 1:
        raise InputError("kv_cache_dtype: an FP8 KV cache is read by a fused attention kernel, and this GPU runs "
                         "scaled_dot_product_attention on these inputs as separate GEMMs and a softmax (PyTorch's math "
                         "backend). Fix: leave kv_cache_dtype out, or a GPU with fused attention for this dtype")
    i = gemms[0]
    rest[i] = dataclasses.replace(rest[i], bytes=rest[i].bytes - saved)
    return rest


# the recomputations running (torch.utils.checkpoint enters a _Recompute per checkpointed call), innermost last:
# each one's function's module (the tracker's name; None when no trace was recording as it was called); and the
# module-entry count when the outermost began. The recorder marks the ops it records meanwhile as recomputed forward
# ops and attributes them among the modules entered since
_RECOMPUTING: list[str | None] = []
_RECOMPUTE_START = [0]
_ENTERED = [0]      # modules entered so far (_EnteredModules.add)


class _Recompute(_CudaPaths):
    """What a checkpointed layer's recomputation in the backward pass runs under: the forward's CUDA code paths
    (:class:`_CudaPaths`) and, under mixed precision, its autocast, as torch.utils.checkpoint restores a real
    autocast state itself (not the emulated one). One mode for both: the recomputation runs inside the outer
    modes' handling of ``backward()``, where a second stacked mode cannot be popped again. While it is entered
    the recorder marks its ops as recomputed (``OpRecord.recompute``)."""

    def __init__(self, amp: torch.dtype | None = None, device: Any = None, attn_implementation: str = "eager") -> None:
        super().__init__(device, attn_implementation)
        self.autocast = Autocast(amp) if amp is not None else None
        # made by torch.utils.checkpoint's context_fn as the checkpointed function first runs: the module it runs in
        recorder = next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, _Recorder)), None)
        self.module = recorder.entered_module() if recorder is not None else None

    def __enter__(self) -> "_Recompute":
        entered = super().__enter__()
        if not _RECOMPUTING:
            _RECOMPUTE_START[0] = _ENTERED[0]
        _RECOMPUTING.append(self.module)
        return entered

    def __exit__(self, *exc: Any) -> Any:
        _RECOMPUTING.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.autocast is not None:
            args, kwargs = self.autocast.cast_args(func, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _cudnn_rnn_applies(args: tuple, kwargs: dict, lstm: bool) -> bool:
    """``torch.lstm(input, (h0, c0), params, has_biases, num_layers, dropout, train, bidirectional, batch_first)``
    (``torch.gru``: ``hx`` one tensor) with biases and no projection: the calls cuDNN runs. Packed sequences,
    bias-free cells and ``proj_size`` keep PyTorch's own decomposition."""
    if kwargs or len(args) != 9 or not isinstance(args[2], (tuple, list)):
        return False
    hx_ok = isinstance(args[1], (tuple, list)) and len(args[1]) == 2 if lstm else isinstance(args[1], torch.Tensor)
    params, has_biases, num_layers, bidirectional = args[2], args[3], args[4], args[7]
    return hx_ok and bool(has_biases) and len(params) == 4 * num_layers * (2 if bidirectional else 1)


def _cudnn_style_rnn(kind: str, x: torch.Tensor, hx: Any, params: list, has_biases: bool, num_layers: int,
                     dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple:
    """nn.LSTM / nn.GRU / nn.RNN with the kernels a GPU runs, not the CPU path's ~4-10 kernels per time step: per
    layer and direction, one GEMM of the input projections of every step, then per step one GEMM of the recurrent
    projection and one fused cell kernel (PyTorch's CUDA LSTM / GRU cells; for nn.RNN the activation; cuDNN's
    standard algorithm has the same shape), the steps' outputs gathered into one sequence. Backward follows by
    autograd: per step the cell's gradient kernel, the recurrent GEMMs' gradients and the gradient sums, a few
    more kernels per step than cuDNN's."""
    lstm = kind == "lstm"
    h0, c0 = hx if lstm else (hx, None)
    seq = x.transpose(0, 1) if batch_first else x            # (T, B, I), time-major as cuDNN
    dirs = 2 if bidirectional else 1
    hn, cn = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            w_ih, w_hh, b_ih, b_hh = params[4 * (layer * dirs + d):4 * (layer * dirs + d) + 4]
            xg = F.linear(seq, w_ih)                           # (T, B, gates x H): every step's input projection
            h = h0[layer * dirs + d]
            c = c0[layer * dirs + d] if lstm else None
            steps = range(seq.shape[0] - 1, -1, -1) if d == 1 else range(seq.shape[0])
            ys = [None] * seq.shape[0]
            if kind in ("tanh", "relu"):                      # both biases once into the input projection
                xg = xg + (b_ih + b_hh)
            for t in steps:
                if lstm:
                    h, c, _ = torch.ops.aten._thnn_fused_lstm_cell(xg[t], F.linear(h, w_hh), c, b_ih, b_hh)
                elif kind == "gru":
                    h, _ = torch.ops.aten._thnn_fused_gru_cell(xg[t], F.linear(h, w_hh), h, b_ih, b_hh)
                else:                                         # one GEMM adding onto the step's input, one activation
                    h = torch.addmm(xg[t], h, w_hh.t())
                    h = torch.tanh(h) if kind == "tanh" else torch.relu(h)
                ys[t] = h
            outs.append(torch.stack(ys))                       # (T, B, H)
            hn.append(h)
            cn.append(c)
        seq = outs[0] if dirs == 1 else torch.cat(outs, dim=-1)
        if train and dropout > 0 and layer < num_layers - 1:
            seq = torch.native_dropout(seq, dropout, True)[0]
    out = seq.transpose(0, 1) if batch_first else seq
    return (out, torch.stack(hn), torch.stack(cn)) if lstm else (out, torch.stack(hn))


# scaled_dot_product_attention's fused backends as PyTorch's dispatcher admits them (sdp_utils.cpp of PyTorch's CUDA
# and ROCm builds; the scaled_dot_product_attention docstring of the installed torch):
# - flash attention: NVIDIA compute capability 8.0 and later (FlashAttention-2), and on ROCm the architectures
#   AOTriton is built for (ROCM_FUSED_ARCHS: MI200 / MI300 / MI350); FP16 / BF16 only, no attention mask, equal head
#   dims of at most 256 in multiples of 8 (512 with ROCm's AOTriton), no is_causal with a query length other than
#   the keys'. It is the first choice where it applies, and the only fused kernel that takes grouped-query attention
#   (enable_gqa) with the keys and values as they are.
# - the memory-efficient kernel: every NVIDIA GPU here (compute capability 5.0+), ROCm's AOTriton architectures; FP16
#   and FP32, plus BF16 on compute capability 8.0+ and on ROCm; head dims in multiples of its GEMM alignment; on ROCm
#   an attention mask must be boolean or of the inputs' dtype. No grouped-query attention.
# - cuDNN attention, first in PyTorch's order on compute capability 9.0 / 10.x (Hopper, datacenter Blackwell) since
#   the cuDNN bundled with PyTorch reached 9.15.1 (check_prefer_cudnn_attention): FP16 / BF16, an attention mask
#   allowed, grouped-query keys and values as they are, head dims of at most CUDNN_MAX_HEAD_DIM in multiples of 8,
#   more than one key, dropout in multiples of 1/16 (so not BERT's 0.1) and none for a single query.
# - the math backend otherwise: MI100 (gfx908) and other AMD GPUs without AOTriton kernels, BF16 before compute
#   capability 8.0, grouped-query attention where neither flash nor cuDNN attention applies.
FLASH_MIN_CC = 8.0
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
ROCM_FLASH_MAX_HEAD_DIM = 512
ROCM_FUSED_ARCHS = ("gfx90a", "gfx942", "gfx950")   # AOTriton's supported (not experimental) targets
CUDNN_MAX_HEAD_DIM = 128        # 256 only with a cuDNN newer than 9.22 and a frontend that has it: not assumed
CUDNN_FIRST_MAJORS = (9, 10)    # compute capabilities on which cuDNN attention comes first
SDPA_PATHS = ("cudnn", "flash", "no-flash", "rocm", "math", "efficient")


def _flash_runs(device: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
                is_causal: bool = False, dropout_p: float = 0.0) -> bool:
    """Whether scaled_dot_product_attention dispatches these inputs to flash attention on ``device``."""
    path = sdpa_path(device)
    d = q.shape[-1]
    max_d = ROCM_FLASH_MAX_HEAD_DIM if path == "rocm" else FLASH_MAX_HEAD_DIM
    if path == "flash" and (8.6 <= device.cc < 9.0 or device.cc >= 12.0) and _needs_grad(q, k, v):
        if 192 < d <= 224 or (d > 224 and dropout_p > 0):   # its backward has no kernel for these there
            return False
    return (path in ("cudnn", "flash", "rocm") and attn_mask is None and q.dtype in FLASH_DTYPES
            and k.dtype == v.dtype == q.dtype and k.shape[-1] == v.shape[-1] == d and d <= max_d
            and d % 8 == 0 and q.dim() == 4 and not (is_causal and q.shape[-2] != k.shape[-2]))


def _cudnn_runs(device: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
                dropout_p: float = 0.0) -> bool:
    """Whether scaled_dot_product_attention dispatches these inputs to cuDNN attention on ``device``."""
    return (sdpa_path(device) == "cudnn" and q.dim() == 4 and q.dtype in FLASH_DTYPES
            and k.dtype == v.dtype == q.dtype and k.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0 and q.shape[-1] == k.shape[-1]
            and max(k.shape[-1], v.shape[-1]) <= CUDNN_MAX_HEAD_DIM and k.shape[-2] != 1
            and dropout_p * 16 == int(dropout_p * 16) and not (dropout_p > 0 and q.shape[-2] == 1)
            and (attn_mask is None or attn_mask.dtype in (torch.bool, q.dtype)))


# transformers' attn_implementation values that call the flash-attn package (not installed here: the model is built
# with "sdpa" and its scaled_dot_product_attention calls run as flash-attn's kernel, :func:`_flash_attn`)
FLASH_ATTN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def _flash_attn(device: Any, implementation: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False, window: int | None = None, seen: set[int] | None = None) -> torch.Tensor:
    """A scaled_dot_product_attention call of a model built for sdpa, run as flash-attn's kernel, as transformers'
    flash_attention_2 / _3 integration runs the same attention: causal by flag (a mask of several queries is the
    causal one; a padding mask would be unpadded into sequences, of which the traced inputs have none). flash-attn 2
    runs FP16 / BF16 on NVIDIA compute capability 8.0+ and on AMD MI200 / MI300 (its ROCm build); flash-attn 3 on
    Hopper (9.0); anything else is an InputError, as flash-attn refuses it. A layer's sliding ``window`` (the
    ``sliding_window`` transformers passes, flash-attn's ``window_size``: each query attends to itself and the
    ``window`` - 1 keys before it) limits the kernel's work to that band where the keys outnumber the window
    (:func:`_band_keys`, :class:`_BandAttention`); the windows so applied are added to ``seen``."""
    name = implementation.replace("flash_attention_", "flash-attn ")
    if q.dtype not in FLASH_DTYPES:
        raise InputError(f"attn_implementation={implementation!r}: {name} runs FP16 / BF16 only, and the attention "
                         f"inputs are {str(q.dtype).removeprefix('torch.')}. Fix: dtype='bfloat16' (or amp="
                         "'bfloat16'), or attn_implementation='sdpa'")
    if q.shape[-1] > FLASH_MAX_HEAD_DIM:
        raise InputError(f"attn_implementation={implementation!r}: {name} takes head dims up to {FLASH_MAX_HEAD_DIM}, "
                         f"this model's are {q.shape[-1]}. Fix: attn_implementation='sdpa'")
    if device is not None:
        if not flash_attn_runs(device, implementation):
            where = ("NVIDIA compute capability 8.0+ and AMD MI200 / MI300" if implementation.endswith("2")
                     else "Hopper GPUs (compute capability 9.0)")
            raise InputError(f"attn_implementation={implementation!r}: {name} runs on {where}; {device.key} is "
                             f"{device.compute_capability}. Fix: attn_implementation='sdpa' (PyTorch's own kernels)")
    causal = bool(is_causal) or (attn_mask is not None and q.shape[-2] > 1)
    keys = _band_keys(q.shape[-2], k.shape[-2], window) if causal and window else None
    if keys is not None:
        if seen is not None:
            seen.add(window)
        return _BandAttention.apply(q, k, v, keys, dropout_p, scale)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, causal, False, scale=scale)[0]


def flash_attn_runs(device: Any, implementation: str) -> bool:
    """Whether flash-attn's ``implementation`` (flash_attention_2 / _3) runs on ``device``: flash-attn 2 on NVIDIA
    compute capability 8.0+ and AMD MI200 / MI300 (its ROCm build), flash-attn 3 on Hopper (9.0)."""
    if implementation.endswith("2"):
        return sdpa_path(device) in ("cudnn", "flash", "rocm")
    return device.vendor == "nvidia" and int(device.cc) == 9


def _band_keys(queries: int, keys: int, window: int) -> int | None:
    """The keys per query of a non-causal attention as large as causal attention of ``queries`` (the last of
    ``keys`` positions) within a sliding ``window`` (query at position p attends keys p - window + 1 .. p); None
    where the window holds every key a query sees."""
    if keys <= window:
        return None
    first = keys - queries + 1            # the first query's keys in full causal attention (positions are 0-based)
    ramp = max(0, min(keys, window) - first + 1)     # queries still filling the window: first .. window keys
    area = ramp * (first + first + ramp - 1) // 2 + (queries - ramp) * window
    return max(1, round(area / queries))


class _BandAttention(torch.autograd.Function):
    """flash-attn's kernel over a sliding window, forward and backward: one non-causal kernel of every query over
    as many keys as the band holds per query (:func:`_band_keys`), which does the band's work; the keys' and
    values' gradients come back whole, as the kernel writes them."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: int, dropout_p: float,
                scale: float | None) -> torch.Tensor:
        kb, vb = k[:, :, :keys], v[:, :, :keys]
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, kb, vb, dropout_p, False, False, scale=scale)
        ctx.save_for_backward(q, kb, vb, out, lse, seed, offset)
        ctx.rest = (cq, ck, mq, mk, dropout_p, scale, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, kb, vb, out, lse, seed, offset = ctx.saved_tensors
        cq, ck, mq, mk, dropout_p, scale, k_shape, v_shape = ctx.rest
        dq, _, _ = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, kb, vb, out, lse, cq, ck, mq, mk, dropout_p, False, seed, offset, scale=scale)
        return dq, kb.new_empty(k_shape), vb.new_empty(v_shape), None, None, None


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _efficient_runs(device: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any) -> bool:
    """Whether the memory-efficient kernel takes these (multi-head) inputs on ``device`` (a GPU)."""
    path = sdpa_path(device)
    half = q.dtype in FLASH_DTYPES
    if path == "math" or q.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        return False
    if q.dtype == torch.bfloat16 and path == "no-flash":
        return False
    if path == "rocm":
        align = 8 if half else 4
        if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
            return False
    else:   # CUDA's GEMM alignment: 16 bytes on tensor cores (16-bit on 7.0+, all on 8.0+), 4 elements on 8.0+
        cc = device.cc
        tensor_cores = cc >= 8.0 or (cc >= 7.0 and half)
        align = max(4 if cc >= 8.0 else 1, (8 if half else 4) if tensor_cores else 1)
    return k.shape[-1] == q.shape[-1] and q.shape[-1] % align == 0 and v.shape[-1] % align == 0


def _sdpa_backend(device: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> str:
    """scaled_dot_product_attention's GPU backend for these inputs, as PyTorch picks it on ``device`` (see the comment
    above FLASH_MIN_CC): cuDNN attention on Hopper and datacenter Blackwell where it applies; else flash attention
    where it applies; else the math backend for grouped-query attention or where the memory-efficient kernel does not
    take the inputs; else the memory-efficient kernel. Without a GPU: the memory-efficient kernel always, with
    repeated keys and values for grouped-query attention."""
    path = sdpa_path(device)
    if path == "efficient":
        return "efficient"
    if _cudnn_runs(device, q, k, v, attn_mask, dropout_p):
        return "cudnn"
    if _flash_runs(device, q, k, v, attn_mask, is_causal, dropout_p):
        return "flash"
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        return "math"
    return "efficient" if _efficient_runs(device, q, k, v, attn_mask) else "math"


def fused_sdpa_runs(device: Any, dtype: Any, head_dim: int, masked: bool = False) -> bool:
    """Whether scaled_dot_product_attention runs a fused kernel (cuDNN, flash or memory-efficient) on ``device`` for
    multi-head inputs of ``dtype`` (a torch dtype or its name) and ``head_dim``, with an additive mask of the inputs'
    dtype if ``masked``. True without a device (the memory-efficient kernel, as :func:`_sdpa_backend` assumes)."""
    if device is None:
        return True
    dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
    if not isinstance(dt, torch.dtype):
        return False
    q = torch.empty((1, 1, 2, int(head_dim)), dtype=dt, device="meta")     # two positions: no single-key case
    mask = torch.empty((1, 1, 2, 2), dtype=dt, device="meta") if masked else None
    return _sdpa_backend(device, q, q, q, mask) != "math"


def _sdpa(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention run as ``backend`` (:func:`_sdpa_backend`) runs it."""
    if backend == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if backend == "cudnn":   # a boolean mask becomes an additive bias, as PyTorch hands it to cuDNN
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, _additive_bias(attn_mask, q),
                                                                  _needs_grad(q, k, v), dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    if backend == "math":
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                 scale=scale, enable_gqa=enable_gqa)[0]
    return _efficient_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def sdpa_path(device: Any) -> str:
    """Which set of scaled_dot_product_attention backends ``device`` (a Device or None) offers (SDPA_PATHS): traces
    of attention for GPUs with the same path are the same. "cudnn": NVIDIA compute capability 9.0 / 10.x (cuDNN
    attention first, then flash); "flash": other NVIDIA GPUs of compute capability 8.0+; "no-flash":
    older NVIDIA GPUs; "rocm": AMD GPUs with AOTriton's kernels (ROCM_FUSED_ARCHS); "math": other AMD GPUs, which
    have no fused attention kernel; "efficient": no GPU given (the memory-efficient kernel, as before GPUs mattered)."""
    if device is None:
        return "efficient"
    if device.vendor != "nvidia":
        return "rocm" if str(device.compute_capability).lower() in ROCM_FUSED_ARCHS else "math"
    if int(device.cc) in CUDNN_FIRST_MAJORS:
        return "cudnn"
    return "flash" if device.cc >= FLASH_MIN_CC else "no-flash"


def software_path(device: Any, dtype: Any, attn_implementation: str = "eager") -> tuple:
    """What the software stack decides by the GPU for a model of ``dtype``: whether routed experts run as one
    grouped GEMM (:func:`neusight.graph.moe.grouped_gemm_runs`) and the attention backends (:func:`sdpa_path`);
    under flash-attn also whether it runs (:func:`flash_attn_runs`: flash-attn 3 on fewer GPUs than share its SDPA
    backends, a B200's trace refused where an H100's is not). Traces for GPUs with the same path are the same."""
    from neusight.graph.moe import grouped_gemm_runs

    path: tuple = (grouped_gemm_runs(device, model_dtype(dtype)), sdpa_path(device))
    if attn_implementation in FLASH_ATTN_IMPLEMENTATIONS:
        path += (device is not None and flash_attn_runs(device, attn_implementation),)
    return path


def trace_key(graphs: dict, device: Any, trace_kwargs: dict) -> tuple:
    """The key in ``graphs`` (traces by :func:`software_path`, first one first) whose trace ``device`` uses: its own
    path (from the ``dtype`` and ``attn_implementation`` of the trace's ``trace_kwargs``), or the first trace's when
    that one took no GPU-specific path (:func:`depends_on_gpu`)."""
    if graphs and not depends_on_gpu(next(iter(graphs.values())).notes):
        return next(iter(graphs))
    return software_path(device, trace_kwargs.get("dtype", "float32"),
                         trace_kwargs.get("attn_implementation", "eager"))


def notes_on(notes: tuple[str, ...], device: Any) -> tuple[str, ...]:
    """A trace's notes as ``device`` reads them: a trace is shared by the GPUs of its software path (:func:`trace_key`)
    and its attention-backend note named the GPU it was traced for; here it names ``device``."""
    lead = SDPA_MARK + " "
    return tuple(lead + device.key + n[n.find(" ", len(lead)):] if n.startswith(lead) else n for n in notes)


def depends_on_gpu(notes: Any) -> bool:
    """Whether a trace with these notes took a GPU-specific path (experts of ``moe_kernels="auto"``, an attention
    backend picked for the GPU), so that a GPU with another :func:`software_path` needs its own trace."""
    from neusight.graph.moe import depends_on_gpu as experts_depend

    return experts_depend(notes) or any(SDPA_MARK in n for n in notes)


def _additive_bias(attn_mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """An attention mask as the additive bias the fused kernels take: a boolean mask becomes 0 / -inf in q's dtype."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        return torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
    return attn_mask


def _efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention as the memory-efficient fused kernel (CUDA's choice for FP32, with a mask, or
    before compute capability 8.0); a boolean mask becomes an additive bias first."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    bias = _additive_bias(attn_mask, q)
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, _needs_grad(q, k, v), dropout_p,
                                                                  is_causal, scale=scale)[0]


@contextlib.contextmanager
def _fixed_rng(seed: int = 0) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's CPU generators for the trace and restore them after: a model whose
    control flow draws a random number (LayerDrop-like skipping, random masking) traces the same kernels every
    time, and the caller's generators are left as they were."""
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


@contextlib.contextmanager
def _layerdrop_off(module: torch.nn.Module, training: bool) -> Iterator[list[tuple[str, float]]]:
    """Zero every LayerDrop probability of ``module`` for a training trace and restore it after.

    Hugging Face models keep it as a float attribute whose name contains ``layerdrop``, on the module
    (``self.layerdrop = config.encoder_layerdrop``: M2M-100 / NLLB, SeamlessM4T, Informer, ...) or read from their
    config in forward (``self.config.layerdrop``: wav2vec2, HuBERT, WavLM, ...). With it on, a training step skips
    each layer with that probability by a random draw, so the traced kernels would be one random sample. Yields the
    ``(name, probability)`` pairs turned off (empty in inference, where no layer is skipped)."""
    changed: list[tuple[Any, str, float]] = []
    found: dict[str, float] = {}
    from_config: dict[str, float] = {}
    if training:
        owners: list[tuple[bool, Any]] = []
        for m in module.modules():
            owners.append((False, m))
            cfg = getattr(m, "config", None)
            if cfg is not None and not isinstance(cfg, torch.nn.Module):
                owners.append((True, cfg))
        seen: set[int] = set()
        for is_config, owner in owners:
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            for attr, value in list(vars(owner).items()):
                if "layerdrop" in attr and isinstance(value, float) and value > 0:
                    changed.append((owner, attr, value))
                    (from_config if is_config else found).setdefault(attr, value)
    try:
        for owner, attr, _ in changed:
            setattr(owner, attr, 0.0)
        # name the config fields a user sets (encoder_layerdrop=0.05), not the module attributes copied from them
        yield sorted((from_config or found).items())
    finally:
        for owner, attr, value in changed:
            setattr(owner, attr, value)


def _windowed_attention(built: BuiltModel) -> str | None:
    """"sliding-window" or "chunked" where some attention layers of ``built`` see only a window or chunk of the
    sequence (transformers' ``layer_types``; configs without them: a ``sliding_window`` in use), else None."""
    config = getattr(built.module, "config", None)
    types = set(getattr(config, "layer_types", None) or ())
    if types:
        return ("sliding-window" if "sliding_attention" in types else
                "chunked" if "chunked_attention" in types else None)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return "sliding-window"
    return None


def _check_run(built: BuiltModel, batch_size: int, seq_len: int | None, mode: str, optimizer: str | None,
               parts: int = 1) -> int | None:
    """The run's checked ``seq_len`` (its default where None); ``parts``: it is one GPU's part of sequences that many
    times as long (context parallelism)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size={batch_size!r} is not a positive integer; use batch_size >= 1")
    if mode not in MODES:
        raise InputError(f"mode={mode!r} is not known; use 'inference' or 'training'")
    if optimizer is not None and str(optimizer).lower() not in OPTIMIZERS:
        raise InputError(f"optimizer={optimizer!r} is not known; use one of {', '.join(OPTIMIZERS)} or None")
    if built.needs_seq_len:
        if seq_len is None:   # 512 positions, or 512 of text after a multimodal prompt's image tokens
            seq_len = min(built.max_seq_len or 512 + built.image_tokens, 512 + built.image_tokens)
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise InputError(f"seq_len={seq_len!r} is not a positive integer; use seq_len >= 1")
        if seq_len < built.image_tokens:
            raise InputError(f"seq_len={seq_len} cannot hold the {built.image_tokens} image tokens of images="
                             f"{built.images} ({built.image_tokens // built.images} per image); seq_len counts every "
                             f"position of the sequence, image tokens and text. Fix: seq_len >= {built.image_tokens}, "
                             "e.g. " + str(built.image_tokens + 512) + " for 512 text tokens, or fewer images")
        if built.max_seq_len and seq_len * parts > built.max_seq_len:
            raise InputError(f"seq_len={seq_len * parts} exceeds {built.name}'s maximum of {built.max_seq_len} "
                             f"positions; use seq_len <= {built.max_seq_len}")
    elif seq_len is not None:
        # the input has no sequence dimension: a CNN's or ViT's images, an nn.Module's fixed input_shapes
        takes = (f"{built.image_size}x{built.image_size} images (image_size= sets their side)" if built.image_size
                 else "inputs of fixed shapes (input_shapes=; a dimension named 'seq' takes seq_len)")
        raise InputError(f"seq_len={seq_len!r} is for sequence models; {built.name} takes {takes}. Fix: leave "
                         "seq_len out")
    return seq_len


def trace(model: Any, batch_size: int = 1, seq_len: int | None = None, mode: str = "inference", *,
          head: str | None = None, optimizer: str | None = "adamw", attn_implementation: str = "eager",
          image_size: int | None = None, input_shapes: list[tuple[int, ...]] | None = None,
          dtype: str | torch.dtype = torch.float32, include_loss: bool = True, tensor_parallel: int = 1,
          expert_parallel: int = 1, fp8: bool | str = False, weight_quant: str | None = None,
          clip_grad_norm: float | None = None, zero_grad: bool = False, amp: Any = None,
          kv_cache: int | None = None, gradient_checkpointing: bool | int | str = False, lora_rank: int | None = None,
          lora_targets: list[str] | tuple[str, ...] | None = None, moe_kernels: str = "auto",
          ssm_kernels: str = "fused", device: Any = None, static_cache: bool = False,
          kv_cache_dtype: str | None = None, memory_format: str = "contiguous", context_parallel: int = 1,
          logits_to_keep: int | None = None, images: int | None = None, **unknown: Any) -> Graph:
    """Trace ``model`` into the aten ops of one inference pass or one training step.

    Parameters
    ----------
    model : str, path, config or nn.Module
        A preset (``"gpt2-large"``, ``"resnet50"``, ...), a Hugging Face config (a config.json path, a
        ``transformers.PretrainedConfig`` or a dict with its ``model_type``), or an nn.Module
        (traced as a meta copy, the module itself is left as it was; an FP32 module runs in ``dtype``, a module
        all of another dtype needs that ``dtype``; ``input_shapes`` gives its inputs' shapes
        without the batch dimension; a ``(shape, dtype)`` pair
        for an input that is not of the run's dtype, e.g. ``(("seq",), torch.long)`` for token ids, where a dim
        "seq" takes ``seq_len``).
    batch_size, seq_len : int
        Run shape; ``seq_len`` is for sequence models only.
    mode : {"inference", "training"}
        Inference: ``eval()`` and ``no_grad``. Training: ``train()`` (dropout active; LayerDrop off, with a note, so
        every layer is traced), forward, loss, ``loss.backward()`` and, unless ``optimizer=None``, one optimizer step
        (foreach kernels, as on CUDA). Random generators are seeded for the trace (and restored after): the same
        arguments trace the same kernels.
    optimizer : {"adamw", "adam", "sgd", "adamw-fused", "adam-fused"} or None
        ``-fused``: the single multi-tensor kernel of ``torch.optim.AdamW(fused=True)`` (and of apex / Megatron-LM
        FusedAdam) instead of PyTorch's default foreach kernels.
    clip_grad_norm : float, optional
        Clip the gradients' global L2 norm to this before the step (``torch.nn.utils.clip_grad_norm_``: one norm
        pass over the gradients, one scaling pass), recorded in the optimizer phase.
    zero_grad : bool
        Record ``optimizer.zero_grad(set_to_none=False)`` after the step (a memset of every gradient), as loops
        that keep their gradient buffers do (Megatron-LM zeroes its contiguous buffer every step).
    head : str, optional
        HF model class: ``causal-lm``, ``sequence-classification``, ``pretraining``, ``masked-lm``, ``seq2seq``.
    tensor_parallel : int
        Trace one GPU's share of a Megatron-style tensor-parallel model over this many GPUs
        (:func:`neusight.parallel.shard_tensor_parallel`); 1 = the whole model.
    expert_parallel : int
        Trace one GPU's share of a mixture-of-experts model whose experts are spread over this many GPUs
        (:func:`neusight.parallel.shard_expert_parallel`): each GPU holds 1 / expert_parallel of every experts layer's
        experts, which receive the token rows of all those GPUs (balanced routing); 1 = every expert.
    context_parallel : int
        ``seq_len`` is one GPU's part of sequences this many times as long (context parallelism,
        :func:`neusight.parallel.predict_parallel`): the whole length is what the model's positions must hold; the
        trace is the part's.
    lora_rank, lora_targets
        LoRA fine-tuning (:mod:`neusight.graph.lora`): every base weight frozen, rank-``lora_rank`` adapters on the
        projections named by ``lora_targets`` (the last part of their module names; default: PEFT's for the
        architecture, e.g. the attention's query and value projections).
    fp8 : bool or {"dynamic", "static"}
        FP8 linear layers (:mod:`neusight.graph.fp8`): every ``nn.Linear`` but the LM head (and those whose features
        are not multiples of 16) as FP8 GEMMs with dynamic per-tensor scaling, as torchao runs them: in training its
        Float8Linear (weights, gradients and optimizer in the model's precision, FP8 casts in every pass), in
        inference FP8 weights (one byte each) with each input cast per call. ``"static"`` (inference): each input
        cast with the fixed scale of a calibrated FP8 checkpoint (TensorRT-LLM, vLLM), no max |x| per call.
        ``True`` = ``"dynamic"``. Needs a GPU with FP8 tensor cores.
    weight_quant : {None, "int8", "int4", "mxfp4", "nvfp4"}
        Weight-only quantized inference (:mod:`neusight.graph.quant`): every ``nn.Linear`` weight but the LM head's
        stored in 8 or 4 bits (int4: groups of 128 inputs; mxfp4: OCP microscaling, groups of 32, and in a mixture
        of experts its routed experts alone, as gpt-oss ships them), each projection one GEMM that dequantizes as it
        loads (Marlin / AWQ / GPTQ-style), computing in the model's dtype. "nvfp4": weights and activations in NVFP4
        (W4A4, groups of 16 with an E4M3 scale), each projection a quantizing kernel and one GEMM on FP4 tensor
        cores (Blackwell; other GPUs are refused).
    moe_kernels : {"auto", "loop", "grouped", "per-expert"}
        Routed mixture-of-experts layers (Mixtral, Qwen-MoE, ...; :mod:`neusight.graph.moe`, balanced routing):
        "loop" runs one GEMM pair per expert on its gathered tokens (transformers' eager experts), "grouped" one
        grouped GEMM per projection over the experts (its ``grouped_mm`` experts, the default from transformers 5
        on, with PyTorch's grouped GEMM kernel), "per-expert" the same experts where PyTorch has no grouped kernel for
        the GPU and dtype (one mm per expert over the sorted tokens). "auto": what transformers runs on ``device``:
        the model's experts implementation, grouped_mm as "grouped" for BF16 weights on NVIDIA compute capability
        9.x / 10.x, else as "per-expert" (also without a device).
    ssm_kernels : {"fused", "reference"}
        State-space and linear-attention layers (Mamba, Mamba-2, Jamba, Qwen3-Next, ...; :mod:`neusight.graph.ssm`):
        "fused" traces each call transformers hands to mamba_ssm / causal_conv1d / fla as one fused kernel forward
        and one backward, as on a GPU with those packages; "reference" traces transformers' PyTorch reference code
        (many small kernels), as without them.
    device : str, Device or None
        The GPU the trace is for; only what the software stack itself decides by the GPU depends on it (the
        experts kernels of ``moe_kernels="auto"``).
    gradient_checkpointing : bool, int or "selective"
        Training with activation (gradient) checkpointing, as ``model.gradient_checkpointing_enable()`` runs it
        in Hugging Face models: each layer keeps only its input and runs its forward again in the backward pass.
        Fewer activations held (the memory forecast), one more forward's work (the latency forecast). An integer n
        checkpoints every n-th layer only (transformers' ``every_n_layers``). "selective" recomputes only each
        attention core (Megatron-LM's selective recomputation): the s x s scores are not kept, at the cost of their
        kernels run again.
    amp : {None, "float16", "bfloat16"} or bool
        Automatic mixed precision: the FP32 model's forward and loss under ``torch.autocast("cuda", amp)``
        (:mod:`neusight.graph.amp`: GEMMs and convolutions in ``amp``, softmax, norms and losses in FP32, the
        casts between them); True = float16. Training in float16 adds ``torch.cuda.amp.GradScaler``'s kernels:
        the loss scaling, the unscale pass over the gradients before the step and the scale update.
    kv_cache : int, optional
        Generation with a KV cache (inference of a decoder-only causal LM): ``seq_len`` new tokens per sequence
        after ``kv_cache`` tokens already in the cache, e.g. ``seq_len=1, kv_cache=2047`` for one decode step at
        context 2048. The cache (transformers' ``DynamicCache``, filled before the trace, so it counts as a model
        input) is read by every layer's attention and grown by ``seq_len``, as Hugging Face's eager generation does;
        sliding-window and chunked-attention layers (Mistral, Gemma 2 / 3, gpt-oss, Llama 4) hold the last window - 1
        tokens, as transformers' cache keeps them for those layers.
    static_cache : bool
        With ``kv_cache``: the cache is a buffer sized for the run, and each step writes its new tokens' keys and
        values in place (one copy of their bytes), as transformers' ``StaticCache`` (compiled generation) and the
        paged caches of serving engines do, instead of concatenating the whole cache again every step.
    kv_cache_dtype : {None, "fp8", "fp8_e4m3", "fp8_e5m2"}
        With ``static_cache`` and a fused attention (``attn_implementation`` sdpa or flash_attention_2 / _3): the
        attention layers' cache stored in FP8 (``fp8`` = e4m3), as serving engines' ``kv_cache_dtype`` does: half
        the bytes of a 16-bit cache in memory and in every attention's reads; each step's new keys and values are
        cast into it (sliding-window layers' buffers too). State-space layers' states keep the model's dtype.
    images : int, optional
        A multimodal model (LLaVA, Gemma 3, PaliGemma, InternVL, ...) as its image-text class runs a prompt with
        this many images per sequence: the image encoder and projector on each image (pixel values of the encoder's
        fixed size), their features at the image tokens' positions, then the language model over all ``seq_len``
        positions (image tokens included). Default: its language model on a text-only prompt.
    logits_to_keep : int, optional
        A causal LM's head on the last ``logits_to_keep`` positions only (transformers' forward argument of that
        name), as ``generate()`` runs a prompt's prefill (it asks for the last token's logits). Default: every
        position's logits, as a plain forward computes them.
    memory_format : {"contiguous", "channels_last"}
        The layout of a CNN's activations and weights: PyTorch's default NCHW, or NHWC as
        ``model.to(memory_format=torch.channels_last)`` and a channels-last input run it (4-D tensors channels-last,
        5-D ones channels-last-3d). It decides which convolutions cuDNN transposes on tensor cores
        (:mod:`neusight.graph.layout`).
    **unknown
        Any other keyword is refused with an InputError naming the closest option (``input_shape`` ->
        ``input_shapes``), here and in every forecast that passes its options on to the trace.

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
    if unknown:
        _refuse_options(unknown)
    torch_dtype = model_dtype(dtype)
    from neusight.graph.moe import check_moe_kernels, clear_dispatch, dispatch_calls, grouped_gemm_runs
    from neusight.graph.ssm import check_ssm_kernels, fused_calls, ssm_note

    check_moe_kernels(moe_kernels)
    check_ssm_kernels(ssm_kernels)
    memory_format = check_memory_format(memory_format)
    if device is not None:
        from neusight.devices import load_device

        device = load_device(device)
    built = build_model(model, head=head, attn_implementation=attn_implementation, image_size=image_size,
                        input_shapes=input_shapes, dtype=torch_dtype, moe_kernels=moe_kernels,
                        grouped_gemm=grouped_gemm_runs(device, torch_dtype), images=images)
    if images is not None:
        _check_image_run(images, kv_cache, tensor_parallel, expert_parallel, context_parallel)
    if not isinstance(context_parallel, int) or isinstance(context_parallel, bool) or context_parallel < 1:
        raise InputError(f"context_parallel={context_parallel!r} is not a positive integer. Fix: e.g. "
                         "context_parallel=1 (the whole sequence)")
    seq_len = _check_run(built, batch_size, seq_len, mode, optimizer, context_parallel)
    if context_parallel > 1 and (windowed := _windowed_attention(built)):
        raise ContextParallelError(f"cp={context_parallel}: {built.name} has {windowed} attention layers, which the "
                                   "ring attention modelled here does not take (causal or no mask over the whole "
                                   "sequence). Fix: cp=1")
    amp_t = amp_dtype(amp)
    _check_kv_cache(built, kv_cache, mode, seq_len)
    if not isinstance(static_cache, bool):
        raise InputError(f"static_cache={static_cache!r} is not true or false. Fix: static_cache=True or leave it out")
    if static_cache and not kv_cache:
        raise InputError("static_cache=True is how a KV cache takes new tokens, and this run has none (kv_cache is not "
                         "set). Fix: kv_cache=<cached tokens> with seq_len=<new tokens>, e.g. kv_cache=2047 seq_len=1, "
                         "or leave static_cache out")
    check_kv_cache_dtype(kv_cache_dtype, kv_cache, static_cache, attn_implementation)
    _check_logits_to_keep(built, logits_to_keep, mode, seq_len)
    if amp_t is not None and torch_dtype != torch.float32:
        dt = str(torch_dtype).removeprefix("torch.")
        raise InputError(f"amp={amp!r} casts an FP32 model's operations, but dtype={dt!r}. Fix: dtype='float32' with "
                         "amp, or a pure half-precision model without amp")
    if (clip_grad_norm is not None or zero_grad) and (mode != "training" or optimizer is None):
        raise InputError(f"clip_grad_norm={clip_grad_norm!r} / zero_grad={zero_grad!r} belong to an optimizer step, "
                         f"which this trace (mode={mode!r}, optimizer={optimizer!r}) has none of. Fix: "
                         "mode='training' with an optimizer, or leave them out")
    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
        raise InputError(f"clip_grad_norm={clip_grad_norm!r} must be a positive number. Fix: e.g. clip_grad_norm=1.0")
    module = built.module
    adapted: list[str] = []
    if lora_targets is not None and lora_rank is None:
        raise InputError(f"lora_targets={list(lora_targets)} names LoRA's target projections, and lora_rank is not "
                         "set: no adapters are added. Fix: lora_rank=<rank> (e.g. 16) as well, or leave lora_targets "
                         "out")
    if lora_rank is not None:
        if tensor_parallel != 1 or expert_parallel != 1:
            what = f"tensor parallelism (tp={tensor_parallel})" if tensor_parallel != 1 else \
                f"expert parallelism (ep={expert_parallel})"
            raise InputError(f"lora_rank={lora_rank} with {what} is not modelled. Fix: tp=1 and ep=1 (data or pipeline "
                             "parallelism work), or leave lora_rank out")
        from neusight.graph.lora import apply_lora

        adapted = apply_lora(module, lora_rank, lora_targets)
    recompute_ctx = (_enable_checkpointing(built, mode, gradient_checkpointing, amp_t, device, attn_implementation)
                     if gradient_checkpointing else contextlib.nullcontext())
    tp_columns: list[str] = []
    if tensor_parallel != 1:
        from neusight.parallel import shard_tensor_parallel

        shard_tensor_parallel(module, tensor_parallel, tp_columns)
    if expert_parallel != 1:
        from neusight.parallel import shard_expert_parallel

        shard_expert_parallel(module, expert_parallel)
    layers_note = _fp8_layers(module, fp8, mode, amp_t, lora_rank, device)
    if weight_quant is not None:
        from neusight.graph.quant import check_fp4_device, check_weight_quant

        check_weight_quant(weight_quant, mode)
        if weight_quant == "nvfp4":
            check_fp4_device(device)
        if layers_note or amp_t is not None or lora_rank is not None:
            other = "fp8=True" if layers_note else f"amp={amp!r}" if amp_t is not None else f"lora_rank={lora_rank}"
            raise InputError(f"weight_quant={weight_quant!r} with {other} is not modelled. Fix: leave one of them out "
                             "(a quantized model computes in its dtype, e.g. dtype='bfloat16')")
    training = mode == "training"
    if training and not any(p.requires_grad for p in module.parameters()):
        raise InputError(f"mode='training' runs a backward pass to the model's trainable parameters, and {built.name} "
                         f"({type(module).__name__}) has none (no nn.Parameter that requires grad). Fix: "
                         "mode='inference', or a model with parameters")
    module.train(training)
    args, kwargs = built.make_inputs(batch_size, seq_len)
    if memory_format == "channels_last":
        tensors = list(module.parameters()) + list(module.buffers()) + list(args) + list(kwargs.values())
        if not any(isinstance(t, torch.Tensor) and t.dim() in (4, 5) for t in tensors):
            raise InputError(f"memory_format='channels_last' lays out 4-D (and 5-D) tensors, convolutions' weights "
                             f"and images, as NHWC; {built.name} ({type(module).__name__}) has none. Fix: leave "
                             "memory_format out (contiguous)")
        args, kwargs = _to_channels_last(module, args, kwargs)
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    if kv_cache:
        kwargs.update(_kv_cache_inputs(module, batch_size, int(kv_cache), amp_t, seq_len if static_cache else 0,
                                       KV_CACHE_DTYPES.get(kv_cache_dtype or "")))
        clear_dispatch(module)    # the cache probe's experts calls are not the trace's
    tracker = _Tracker()
    tracker.parents = _EnteredModules(["Global"])
    _RECOMPUTING.clear()    # no recomputation is running as a trace starts (whatever an interrupted one left)
    rec = _Recorder(tracker, type(module).__name__)
    param_count = None             # the parameters as numbers, where packed storage differs (weight_quant)
    if weight_quant is not None:   # after the cache probe: its layers record into the trace's recorder
        from neusight.graph.quant import apply_weight_quant

        param_count = sum(p.numel() for p in module.parameters())
        layers_note = apply_weight_quant(module, weight_quant, rec.fused_region)
    opt = _make_optimizer(module, optimizer) if training and optimizer else None
    # float16 training runs under torch.cuda.amp.GradScaler (bfloat16 has FP32's range and needs none)
    scaler = ({"scale": torch.full((), 65536.0, device="meta"), "found_inf": torch.zeros((), device="meta"),
               "growth": torch.zeros((), dtype=torch.int32, device="meta")}
              if training and amp_t == torch.float16 else None)
    grad_ctx = contextlib.nullcontext() if training else torch.no_grad()
    ssm_ctx = fused_calls(module, ssm_kernels, rec.fused_region)
    rng_ctx, drop_ctx = _fixed_rng(), _layerdrop_off(module, training)
    paths = _CudaPaths(device, attn_implementation)
    if kv_cache_dtype:
        paths.region = rec.fused_region
    # no cyclic garbage collection while recording: when it would run depends on the process's history, and a tensor
    # it frees would end where it ran (``_Recorder.close``); unreachable cycles wait for the trace's end instead
    with _cycles_paused():
        try:
            with rng_ctx, drop_ctx as dropped, grad_ctx, tracker, paths, rec, recompute_ctx, ssm_ctx as fused_names:
                with Autocast(amp_t) if amp_t is not None else contextlib.nullcontext(), \
                        transformers_checks_off() if built.images else contextlib.nullcontext():
                    out = module(*args, **kwargs)
                    forward_calls = dispatch_calls(module)
                    held = _held_tensors(out)
                    if training:
                        rec.phase = "loss"
                        loss = built.loss(out, args, kwargs)
                if training:
                    if scaler:   # GradScaler.scale(loss): the loss times the scale, then backward
                        loss = loss * scaler["scale"]
                    held.append(TensorMeta.of(loss))
                    rec.phase = "backward"
                    loss.backward()
        except (TraceError, InputError, ModelError):
            raise
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise ModelError(f"{built.name} failed on the meta device: {type(e).__name__}: {first}. "
                             f"Check the input shapes (batch_size={batch_size}, seq_len={seq_len})") from None
        state: list[TensorMeta] = []
        if opt is not None:
            _init_optimizer_state(opt)   # the state a steady-state step finds (the first step creates it lazily)
            with tracker, _CudaPaths(device, attn_implementation), rec:
                rec.phase = "optimizer"
                grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
                if scaler and (clip_grad_norm is not None or not isinstance(opt, _FusedAdam)):
                    # GradScaler.unscale_ (before clipping; a fused step unscales inside its own kernel otherwise)
                    inv = scaler["scale"].reciprocal()
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, scaler["found_inf"], inv)
                if clip_grad_norm is not None:
                    _clip_grad_norm(grads, float(clip_grad_norm))
                opt.step()
                if scaler:                                         # GradScaler.update
                    torch._amp_update_scale_(scaler["scale"], scaler["growth"], scaler["found_inf"], 2.0, 0.5, 2000)
                if zero_grad:   # zero_grad(set_to_none=False) with foreach kernels, as on CUDA: one memset pass
                    torch._foreach_zero_(grads)
            state = [TensorMeta.of(t) for st in opt.state.values() for t in st.values()
                     if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        rec.close()
    dispatch = [(name, "forward" if i < len(forward_calls.get(name, ())) else "backward", b)
                for name, calls in dispatch_calls(module).items() for i, b in enumerate(calls)]
    named = list(module.named_parameters())
    params = [TensorMeta.of(p) for _, p in named]
    grads = [TensorMeta.of(p.grad) for p in module.parameters() if p.grad is not None]
    buffers = [TensorMeta.of(b) for b in module.buffers()]
    if not include_loss:
        for r in rec.ops:
            if r.phase == "loss":
                r.kernels = []
    amp_name = str(amp_t).removeprefix("torch.") if amp_t is not None else None
    notes = tuple(built.notes)
    ssm = ssm_note(ssm_kernels, fused_names, [r.call.op for r in rec.ops])
    notes += (ssm,) if ssm else ()
    notes += (layers_note,) if layers_note else ()
    if kv_cache:
        notes += ((STATIC_KV_NOTE if static_cache else KV_NOTE).format(n=kv_cache, t=seq_len),)
    if kv_cache_dtype:
        notes += (_fp8_kv_note(kwargs["cache"], kv_cache_dtype, rec.ops),)
    if amp_name:
        notes += (AMP_NOTE.format(dtype=amp_name, scaler=" with GradScaler" if scaler else ""),)
    if adapted:
        kinds = sorted({n.rpartition(".")[2] for n in adapted})
        notes += (LORA_NOTE.format(r=lora_rank, n=len(adapted), targets=", ".join(kinds)),)
    # True (every layer), n > 1 (one layer in n) or "selective"; False without (validated by _enable_checkpointing)
    ckpt = (SELECTIVE if gradient_checkpointing == SELECTIVE else int(gradient_checkpointing)
            if gradient_checkpointing else False)
    ckpt = True if ckpt == 1 else ckpt
    if dropped:
        probs = sorted({p for _, p in dropped})
        p_text = " / ".join(f"{p:g}" for p in probs)
        keep = f"{1 - probs[-1]:.0%}" + (f" to {1 - probs[0]:.0%}" if len(probs) > 1 else "")
        notes += (LAYERDROP_NOTE.format(p=p_text, names=", ".join(f"{n}={p:g}" for n, p in dropped), keep=keep),)
    if ckpt == SELECTIVE:
        notes += (SELECTIVE_NOTE,)
    elif ckpt:
        notes += (CHECKPOINT_NOTE.format(which="every layer" if ckpt is True else f"one layer in {ckpt}"),)
    if device is not None and paths.sdpa:
        how = "; ".join(SDPA_BACKENDS[b] for b in sorted(paths.sdpa))
        notes += ((FLASH_ATTN_NOTE if paths.flash_attn else SDPA_NOTE).format(device=device.key, how=how),)
    if paths.windows:
        notes += (WINDOW_NOTE.format(windows=" / ".join(f"{w:,}" for w in sorted(paths.windows))),)
    return Graph(model=built.name, mode=mode, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer if training else None,
                 dtype=str(torch_dtype).removeprefix("torch."), ops=rec.ops, notes=notes,
                 params=params, grads=grads, buffers=buffers, optimizer_state=state, held=held,
                 image_size=built.image_size, images=built.images, param_names=[n for n, _ in named],
                 keeps_grads=bool(zero_grad and opt is not None),
                 amp=amp_name, kv_cache=kv_cache or None, gradient_checkpointing=ckpt,
                 lora_rank=lora_rank if adapted else None, model_kind=built.kind, expert_dispatch=dispatch,
                 memory_format=memory_format, tp_columns=tuple(tp_columns),
                 param_count=param_count)


def _to_channels_last(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``model.to(memory_format=torch.channels_last)`` and a channels-last input: every 4-D parameter, buffer and
    floating-point input channels-last, every 5-D one channels-last-3d (torch's own ``to`` refuses 5-D tensors)."""
    def convert(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5):
            return t
        return t.to(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)

    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            if p.dim() in (4, 5):
                p.data = convert(p.data)
    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


def _fp8_layers(module: torch.nn.Module, fp8: Any, mode: str, amp: torch.dtype | None, lora_rank: int | None,
                device: Any) -> str | None:
    """``fp8=True`` / ``"dynamic"`` / ``"static"``: the model's linear layers as FP8 GEMMs
    (:func:`neusight.graph.fp8.apply_fp8`); its note."""
    if fp8 is False or fp8 is None:
        return None
    if not (fp8 is True or fp8 in ("dynamic", "static")):
        raise InputError(f"fp8={fp8!r} is not true, false, 'dynamic' or 'static'. Fix: fp8=true (FP8 linear layers, "
                         "dynamic scaling as torchao runs them), fp8=static (the fixed input scales of a calibrated "
                         "FP8 checkpoint, inference) or leave it out")
    if fp8 == "static" and mode == "training":
        raise InputError("fp8='static' casts each input with the fixed scale of a calibrated FP8 checkpoint, which "
                         "serving runs; FP8 training scales every pass dynamically. Fix: fp8=true (torchao's "
                         "Float8Linear) for training, or mode='inference'")
    if amp is not None:
        raise InputError("fp8=True with amp= is not modelled (FP8 layers keep their inputs' precision). Fix: a "
                         "bfloat16 model (dtype='bfloat16') with fp8=True, or leave one of them out")
    if lora_rank is not None:
        raise InputError(f"fp8=True with lora_rank={lora_rank} is not modelled. Fix: leave one of them out")
    from neusight.graph.fp8 import apply_fp8, check_fp8_device

    check_fp8_device(device)
    return apply_fp8(module, mode == "training", static=fp8 == "static")


def _enable_checkpointing(built: BuiltModel, mode: str, every: Any = True, amp: torch.dtype | None = None,
                          device: Any = None, attn_implementation: str = "eager") -> contextlib.AbstractContextManager:
    """Turn on a Hugging Face model's activation checkpointing for the trace (``every``: True = every layer, an
    integer n = every n-th layer, "selective" = the attention core only, :class:`_SelectiveRecompute`); returns the
    context the trace runs in. The recomputation in the backward pass runs under :class:`_Recompute` (the forward's
    CUDA code paths on ``device`` and autocast ``amp``; ``context_fn``); transformers' check for packed sequences,
    which reads the position ids' values (a device sync on a GPU, impossible on meta), is skipped: the traced
    inputs are plain sequences."""
    module = built.module
    if every == SELECTIVE:
        if mode != "training":
            raise InputError(f"gradient_checkpointing={SELECTIVE!r} recomputes the attention core in the backward "
                             f"pass; mode={mode!r} has none. Fix: mode='training', or leave gradient_checkpointing out")
        return _SelectiveRecompute(built, amp, device, attn_implementation)
    if every is not True and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise InputError(f"gradient_checkpointing={every!r} is not true, a positive number of layers or "
                         f"{SELECTIVE!r}. Fix: true (every layer), e.g. 2 (every second layer) or {SELECTIVE!r} (the "
                         "attention core only)")
    every_n = 1 if every is True else int(every)
    if mode != "training":
        raise InputError(f"gradient_checkpointing=True recomputes activations in the backward pass; mode={mode!r} "
                         "has none. Fix: mode='training', or leave gradient_checkpointing out")
    enable = getattr(module, "activation_checkpointing_enable", None)
    legacy = getattr(module, "gradient_checkpointing_enable", None)
    if not getattr(module, "supports_gradient_checkpointing", False) or (enable is None and legacy is None):
        raise InputError(f"gradient_checkpointing=True needs a Hugging Face model that supports it; {built.name} "
                         f"({type(module).__name__}) does not. Fix: a transformer preset or config, or leave "
                         "gradient_checkpointing out")
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", None):
        config.use_cache = False        # what transformers switches to itself under checkpointing (with a warning)
    kwargs = {"use_reentrant": False,
              "context_fn": lambda: (contextlib.nullcontext(), _Recompute(amp, device, attn_implementation))}
    if enable is not None and "every_n_layers" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n)
    elif every_n > 1:
        raise InputError(f"gradient_checkpointing={every_n} (one layer in {every_n}) needs a transformers version "
                         "whose activation_checkpointing_enable takes every_n_layers. Fix: gradient_checkpointing=true")
    elif enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        legacy(gradient_checkpointing_kwargs=kwargs)
    try:
        import transformers.masking_utils as masking
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(masking, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    from unittest import mock

    return mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None)


class _SelectiveRecompute:
    """Megatron-LM's selective activation recomputation (``--recompute-activations``; Korthikanti et al. 2022):
    only the attention core, the scores, softmax, dropout and the two batched matmuls (or the fused attention
    kernel), runs again in the backward pass; the projections, MLP and norms keep their activations. Transformers'
    models call their attention core through one function, the modeling module's ``eager_attention_forward`` or
    the ``attn_implementation``'s entry in ``ALL_ATTENTION_FUNCTIONS``; inside this context each becomes a
    non-reentrant ``torch.utils.checkpoint`` of itself, so its saved tensors (the s x s scores and masks among them)
    are dropped after the forward and made again in the backward: the whole core up to its output, as Megatron's
    own checkpoint function reruns it (torch.utils.checkpoint's early stop would skip the last batched matmul, whose
    output no backward needs). A model with no such call is an error when the context ends. Can be entered again
    after it exits (a real run's warm-up step, then its measured one)."""

    def __init__(self, built: BuiltModel, amp: torch.dtype | None, device: Any, attn_implementation: str) -> None:
        self.built, self.calls = built, 0
        self.context = (lambda: (contextlib.nullcontext(), _Recompute(amp, device, attn_implementation)))
        modules = {sys.modules.get(type(m).__module__) for m in built.module.modules()}
        self.targets: list[tuple[Any, str]] = [(mod, "eager_attention_forward") for mod in modules if mod is not None
                                               and callable(getattr(mod, "eager_attention_forward", None))]
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError:
            ALL_ATTENTION_FUNCTIONS = None
        mapping = getattr(ALL_ATTENTION_FUNCTIONS, "_global_mapping", None)
        # the model's own implementation: flash_attention_2 / _3 are built as sdpa (the flash-attn calls are traced)
        built_as = getattr(getattr(built.module, "config", None), "_attn_implementation", None)
        for name in dict.fromkeys((attn_implementation, built_as)):
            if isinstance(mapping, dict) and name in mapping:
                self.targets.append((mapping, name))
        self.stack: contextlib.ExitStack | None = None

    def _wrapped(self, fn: Any) -> Any:
        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        def core(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            # the whole core again, as Megatron's CheckpointFunction, not up to its last saved tensor only
            with set_checkpoint_early_stop(False):
                return checkpoint(fn, *args, use_reentrant=False, context_fn=self.context, **kwargs)
        return core

    def __enter__(self) -> None:
        from unittest import mock

        self.stack = contextlib.ExitStack()
        for owner, name in self.targets:
            if isinstance(owner, dict):
                self.stack.enter_context(mock.patch.dict(owner, {name: self._wrapped(owner[name])}))
            else:
                self.stack.enter_context(mock.patch.object(owner, name, self._wrapped(getattr(owner, name))))

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()
        if exc[0] is None and not self.calls:
            built = self.built
            raise InputError(f"gradient_checkpointing={SELECTIVE!r} recomputes the attention core, and {built.name} "
                             f"({type(built.module).__name__}) calls no attention function the tracer can checkpoint "
                             "(transformers' eager_attention_forward or its attention interface). Fix: "
                             "gradient_checkpointing=true (whole layers)")


def _check_kv_cache(built: BuiltModel, kv_cache: Any, mode: str, seq_len: int | None) -> None:
    """``kv_cache=`` needs an inference pass of a decoder-only causal LM whose positions hold cache + new tokens."""
    if kv_cache is None or kv_cache is False:
        return
    if not isinstance(kv_cache, int) or isinstance(kv_cache, bool) or kv_cache < 1:
        raise InputError(f"kv_cache={kv_cache!r} is not a positive number of cached tokens. Fix: e.g. kv_cache=2047 "
                         "with seq_len=1 for one decode step at context 2048, or leave it out")
    if mode != "inference":
        raise InputError(f"kv_cache={kv_cache} forecasts generation, an inference pass; mode={mode!r}. Fix: "
                         "mode='inference', or leave kv_cache out")
    forward = getattr(built.module, "forward", None)
    params = inspect.signature(forward).parameters if forward is not None else {}
    causal_lm = (type(built.module).__name__.endswith(("ForCausalLM", "LMHeadModel"))
                 or isinstance(built.module, TextModelWithLMHead))
    encoder_decoder = getattr(getattr(built.module, "config", None), "is_encoder_decoder", False)
    if built.kind != "hf" or "cache" not in params or encoder_decoder or not causal_lm:
        raise InputError(f"kv_cache={kv_cache} needs a decoder-only causal language model; {built.name} "
                         f"({type(built.module).__name__}) is not one. Fix: a GPT / OPT / Llama-style model, or "
                         "leave kv_cache out")
    if built.max_seq_len and kv_cache + (seq_len or 0) > built.max_seq_len:
        raise InputError(f"kv_cache={kv_cache} + seq_len={seq_len} exceeds {built.name}'s maximum of "
                         f"{built.max_seq_len} positions. Fix: kv_cache + seq_len <= {built.max_seq_len}")


def _check_logits_to_keep(built: BuiltModel, logits_to_keep: Any, mode: str, seq_len: int | None) -> None:
    """``logits_to_keep=`` needs an inference pass of a model whose forward takes it, and at most seq_len."""
    if logits_to_keep is None:
        return
    if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 1:
        raise InputError(f"logits_to_keep={logits_to_keep!r} is not a positive number of positions. Fix: e.g. "
                         "logits_to_keep=1 (the last token's, as generate()'s prefill), or leave it out (all)")
    if mode != "inference":
        raise InputError(f"logits_to_keep={logits_to_keep} leaves out logits a training step's loss reads "
                         f"(mode={mode!r}). Fix: mode='inference', or leave logits_to_keep out")
    if "logits_to_keep" not in inspect.signature(built.module.forward).parameters:
        raise InputError(f"logits_to_keep={logits_to_keep}: {built.name} ({type(built.module).__name__}) takes no "
                         "logits_to_keep argument (transformers' causal LMs do). Fix: leave it out")
    if seq_len is not None and logits_to_keep > seq_len:
        raise InputError(f"logits_to_keep={logits_to_keep} exceeds seq_len={seq_len}, the positions there are. "
                         f"Fix: logits_to_keep <= {seq_len}")


def check_kv_cache_dtype(kv_cache_dtype: Any, kv_cache: Any, static_cache: bool, attn_implementation: str) -> None:
    """Refuse a ``kv_cache_dtype`` that is not one of :data:`KV_CACHE_DTYPES` or a run it does not fit: one without
    a static KV cache (an FP8 cache is a serving engine's: written in place) or with eager attention (whose GEMMs
    would read the FP8 keys as they are)."""
    if kv_cache_dtype is None:
        return
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InputError(f"kv_cache_dtype={kv_cache_dtype!r} is not known. Fix: one of "
                         f"{', '.join(map(repr, KV_CACHE_DTYPES))} (fp8 = e4m3), or leave it out (the model's dtype)")
    if not kv_cache or not static_cache:
        raise InputError(f"kv_cache_dtype={kv_cache_dtype!r} stores a KV cache in FP8 as serving engines do, written "
                         "in place; this run has " + ("no KV cache" if not kv_cache else "transformers' dynamic cache")
                         + ". Fix: kv_cache=<cached tokens> with static_cache=True (generation: new_tokens= with "
                         "static_cache=true), or leave kv_cache_dtype out")
    if attn_implementation == "eager":
        raise InputError(f"kv_cache_dtype={kv_cache_dtype!r} is read by a fused attention kernel, and "
                         "attn_implementation='eager' computes attention as separate GEMMs. Fix: "
                         "attn_implementation='sdpa' (or flash_attention_2), or leave kv_cache_dtype out")


def _fp8_kv_note(cache: Any, kv_cache_dtype: str, ops: list) -> str:
    """The note of a trace with an FP8 KV cache: its format, the layers that store theirs in it and, when some layers
    cache otherwise (state-space states), those. InputError when its attention does not read it as it is."""
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None
              and isinstance(layer.keys, torch.Tensor) and layer.keys.dtype in FP8_KV_STORAGE]
    stored = {t.untyped_storage()._cdata for layer in layers for t in (layer.keys, layer.values)}
    # every kernel that touches the cache: its attention (the fused region) and the writes of the new tokens
    others = sorted({r.call.op for r in ops if r.kernels and not r.call.op.endswith(FP8_KV_ATTENTION)
                     and not (r.call.packet is torch.ops.aten.copy_ and r.call.args[0].storage in stored)
                     and any(isinstance(a, TensorMeta) and a.storage in stored
                             for a in tree_flatten((r.call.args, r.call.kwargs))[0])})
    if others or not any(r.call.op.endswith(FP8_KV_ATTENTION) for r in ops):
        raise InputError(f"kv_cache_dtype={kv_cache_dtype!r}: this model's attention does not read its cached keys "
                         "and values as they are (" + (f"{', '.join(others)} read them first: DeepSeek's latent "
                         "attention, for one, projects its cached latent up" if others else "no "
                         "scaled_dot_product_attention call reads them") + "), and an FP8 cache is modelled for "
                         "attention kernels that do. Fix: leave kv_cache_dtype out")
    other = len(cache.layers) - len(layers)
    dtype = next(str(k.dtype) for r in ops if r.call.op.endswith(FP8_KV_ATTENTION) for k in r.kernels
                 if k.family == Family.BMM)
    return FP8_KV_NOTE.format(fmt="FP8 " + ("E5M2" if kv_cache_dtype.endswith("e5m2") else "E4M3"),
                              n=len(layers), dtype=dtype,
                              other=f"; {other} layers' caches of other kinds (recurrent states) stay in the "
                              "model's dtype" if other else "")


def _kv_cache_inputs(module: torch.nn.Module, batch: int, length: int, amp: torch.dtype | None,
                     room: int = 0, storage: torch.dtype | None = None) -> dict[str, Any]:
    """A DynamicCache holding ``length`` tokens per layer (meta tensors), as the model's ``cache`` input, shaped and
    typed as the model's own first step stores it (under autocast the dtype depends on the model: GPT-2 caches its
    FP16 projections, Llama the FP32 result of its rotary embedding); a sliding-window layer's the last window - 1
    (:func:`_grown_config_cache`). ``room`` > 0: each attention layer is an in-place layer
    (:func:`_in_place_layer_class`) with room for that many more tokens (``static_cache``; a sliding-window one a
    window's buffer, as StaticSlidingWindowLayer), its buffers in ``storage`` when given (an FP8 cache,
    ``kv_cache_dtype``)."""
    from transformers import DynamicCache

    from_config = _config_cache(module)
    own = _own_cache_class(module)
    if own is not None:   # a cache class of the model's own (MiniMax's): its state after a prefill
        cache = own()
        _prefill(module, cache, batch, length, amp)
    elif from_config is not None:
        probe = from_config()
        _first_step(module, probe, amp)
        if all(_grows_from_probe(layer) for layer in probe.layers):
            cache = _grown_config_cache(probe, batch, length)
        else:   # a model's own layer kind (DeepSeek-V4's compressed attention): its state after a prefill
            cache = from_config()
            _prefill(module, cache, batch, length, amp)
    else:
        cache = DynamicCache()
        for i, (k_heads, k_dim, k_dtype, v_heads, v_dim, v_dtype) in enumerate(_plain_cache_layers(module, amp)):
            cache.update(torch.zeros(batch, k_heads, length, k_dim, dtype=k_dtype, device="meta"),
                         torch.zeros(batch, v_heads, length, v_dim, dtype=v_dtype, device="meta"), i)
    if room:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        for i, layer in enumerate(cache.layers):   # attention layers (not state-space ones)
            if not isinstance(getattr(layer, "keys", None), torch.Tensor):
                continue
            if type(layer) is DynamicLayer:
                cache.layers[i] = _in_place_layer_class()(layer.keys, layer.values, room, storage)
            elif type(layer) is DynamicSlidingWindowLayer:    # a window's buffer (StaticSlidingWindowLayer's)
                cache.layers[i] = _in_place_layer_class()(layer.keys, layer.values, room, storage,
                                                          seen=layer.cumulative_length)
            else:   # keys and values beside other state: left as they were, the note would say "in place"
                beside = ("its sparse attention's indexer keys" if isinstance(layer, _indexed_layer()) else
                          "a state-space layer's conv and recurrent states" if hasattr(layer, "conv_states") else
                          "state of the model's own")
                raise InputError(f"static_cache=True writes each layer's new keys and values in place; "
                                 f"{type(module).__name__} caches {beside} beside them ({type(layer).__name__}), "
                                 "which is not modelled in place. Fix: leave static_cache out (transformers' "
                                 "dynamic cache)")
    return {"cache": cache, "use_cache": True}


def _own_cache_class(module: torch.nn.Module) -> type | None:
    """The cache class a model's forward takes if it is its own (a subclass of DynamicCache that its base model's
    ``cache`` argument names, as MiniMax's, which keeps its lightning-attention layers' states beside the keys and
    values and refuses any other cache), made without arguments; None for transformers' own caches."""
    import types
    import typing

    from transformers import DynamicCache

    for m in (module, getattr(module, "model", None)):
        forward = getattr(m, "forward", None)
        try:
            hint = inspect.signature(forward).parameters["cache"].annotation if forward is not None else None
        except (KeyError, TypeError, ValueError):
            continue
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, DynamicCache) and kind is not DynamicCache and not any(
                    p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    for p in list(inspect.signature(kind.__init__).parameters.values())[1:]):
                return kind
    return None


def _grows_from_probe(layer: Any) -> bool:
    """Whether :func:`_grown_config_cache` knows all of a cache layer's state: transformers' own full-attention,
    sliding-window, indexed and state-space layers; not a model's own subclass (DeepSeek-V4's compressed-attention
    layers keep buffers and compressed entries beside their window)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    return (type(layer) in (DynamicLayer, DynamicSlidingWindowLayer, *_indexed_layer())
            or isinstance(layer, LinearAttentionCacheLayerMixin))


def _prefill(module: torch.nn.Module, cache: Any, batch: int, length: int, amp: torch.dtype | None) -> None:
    """``batch`` prompts of ``length`` tokens through the model into the empty ``cache`` (meta tensors, not
    recorded): whatever state its layers keep after them, as generate()'s prefill leaves it."""
    with torch.no_grad(), _PlainBatch(), Autocast(amp) if amp is not None else contextlib.nullcontext():
        module(input_ids=torch.zeros(batch, length, dtype=torch.long, device="meta"), cache=cache, use_cache=True)


def _first_step(module: torch.nn.Module, cache: Any, amp: torch.dtype | None) -> None:
    """One token of one sequence through the model into the empty ``cache``: each layer's (1, kv heads, 1, head_dim)
    keys and values in their dtypes (values may differ from keys: DeepSeek's latent attention caches its 512-wide
    compressed keys and values as "keys" and the 64-wide rotary key as "values")."""
    with torch.no_grad(), _PlainBatch(), Autocast(amp) if amp is not None else contextlib.nullcontext():
        module(input_ids=torch.zeros(1, 1, dtype=torch.long, device="meta"), cache=cache, use_cache=True)


# plain caches' layers by the model they were probed on (_plain_cache_layers); at most PLAIN_CACHE_MODELS kept
_PLAIN_CACHES: dict[tuple, list[tuple]] = {}
PLAIN_CACHE_MODELS = 32


def _plain_cache_layers(module: torch.nn.Module, amp: torch.dtype | None) -> list[tuple]:
    """Per layer of a plain DynamicCache, (kv heads, head_dim, dtype) of its keys then of its values, as the model's
    first step (:func:`_first_step`) stores them. The step is run once per model: a model of the same class, config,
    parameters (names, shapes and dtypes: tensor-parallel shards, adapters and FP8 layers included) and autocast
    stores the same, so the searches and generation forecasts that trace a model at many batch sizes and contexts
    probe it once."""
    from transformers import DynamicCache

    config = getattr(module, "config", None)
    key = (type(module), config.to_json_string() if hasattr(config, "to_json_string") else repr(config), amp,
           tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))
    layers = _PLAIN_CACHES.get(key)
    if layers is None:
        probe = DynamicCache()
        _first_step(module, probe, amp)
        layers = [(k.shape[1], k.shape[3], k.dtype, v.shape[1], v.shape[3], v.dtype)
                  for k, v in ((layer.keys, layer.values) for layer in probe.layers)]
        if len(_PLAIN_CACHES) >= PLAIN_CACHE_MODELS:
            _PLAIN_CACHES.clear()
        _PLAIN_CACHES[key] = layers
    return layers


@functools.lru_cache(maxsize=None)
def _in_place_layer_class() -> type:
    """The static (in-place) cache layer class (built on first use: transformers is imported only for a KV cache)."""
    from transformers.cache_utils import DynamicLayer

    class InPlaceLayer(DynamicLayer):
        """A cache layer whose keys and values sit in a buffer with room for the run's new tokens: an update copies
        them in place and returns the filled part, as transformers' StaticCache (``index_copy_``) does."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int,
                     storage: torch.dtype | None = None, seen: int | None = None) -> None:
            super().__init__()
            self.filled = keys.shape[-2]
            # a sliding-window or chunked layer's buffer holds the last window - 1 of the ``seen`` tokens so far
            self.seen, self.is_sliding = seen, seen is not None
            self.keys, self.values = (torch.zeros(*t.shape[:-2], self.filled + room, t.shape[-1],
                                                  dtype=storage or t.dtype, device=t.device) for t in (keys, values))
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            n = key_states.shape[-2]
            if self.filled + n > self.keys.shape[-2]:
                raise TraceError(f"the static KV cache has room for {self.keys.shape[-2]} tokens; "
                                 f"{self.filled + n} were written")
            self.keys[..., self.filled:self.filled + n, :].copy_(key_states)
            self.values[..., self.filled:self.filled + n, :].copy_(value_states)
            self.filled += n
            if self.seen is not None:
                self.seen += n
            return self.keys[..., :self.filled, :], self.values[..., :self.filled, :]

        def get_seq_length(self) -> int:
            return self.filled if self.seen is None else self.seen

        def get_mask_sizes(self, query_length: int, *args: Any, **kwargs: Any) -> tuple[int, int]:
            # the keys the next update returns: the buffer's tokens and the new ones, from the window's first token
            return self.filled + query_length, 0 if self.seen is None else self.seen - self.filled

    return InPlaceLayer


def _config_cache(module: torch.nn.Module) -> Any:
    """For a model whose layers do not all cache every token's keys and values: state-space / linear-attention
    layers (Mamba, Qwen3-Next, Jamba, ...: a conv and a recurrent state each) or attention over a sliding window or
    a chunk (Mistral, Gemma 2 / 3, gpt-oss, Llama 4: the last window - 1 tokens each), a maker of the DynamicCache
    its generation uses (built from its config, as transformers' generate() builds it); None for a model whose
    layers all attend over the whole context (a plain DynamicCache)."""
    from transformers import DynamicCache

    try:
        from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin
    except ImportError:
        return None
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        layers = DynamicCache(config=config).layers
    except Exception:   # a config the cache cannot read the layer types of: the plain cache
        return None
    if not any(isinstance(layer, (LinearAttentionCacheLayerMixin, DynamicSlidingWindowLayer, *_indexed_layer()))
               for layer in layers):
        return None
    return lambda: DynamicCache(config=config)


def _indexed_layer() -> tuple:
    """transformers' cache layer of sparse-attention models with an indexer (DeepSeek-V3.2, GLM-MoE-DSA: a key
    cache of the indexer's beside the attention's), as a 1-tuple; empty where this transformers has none."""
    try:
        from transformers.cache_utils import DynamicIndexedLayer
    except ImportError:
        return ()
    return (DynamicIndexedLayer,)


def _grown_config_cache(probe: Any, batch: int, length: int) -> Any:
    """The cache ``probe`` (one token of one sequence through the model) as ``batch`` sequences after ``length``
    tokens: attention layers' keys and values ``length`` long (a sliding-window or chunked layer's the last window -
    1 of them, as its DynamicSlidingWindowLayer keeps, counting all ``length`` as seen), the state-space layers'
    conv and recurrent states (of fixed size whatever the length) for every sequence."""
    from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    def grown(t: torch.Tensor, seq_len: int | None) -> torch.Tensor:
        shape = [batch, *t.shape[1:]]
        if seq_len is not None:
            shape[2] = seq_len
        return torch.zeros(shape, dtype=t.dtype, device="meta")

    for layer in probe.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for states in (layer.conv_states, layer.recurrent_states):
                for i, t in states.items():
                    if isinstance(t, torch.Tensor):
                        states[i] = grown(t, None)
        kept = length
        if isinstance(layer, DynamicSlidingWindowLayer):
            kept = min(length, int(layer.sliding_window) - 1)
            layer.cumulative_length = length
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.ndim == 4:
                setattr(layer, name, grown(t, kept))
        if isinstance(layer, _indexed_layer()):   # indexer keys (batch, tokens, dim), positions (dims, batch, tokens)
            if isinstance(layer.indexer_keys, torch.Tensor):
                t = layer.indexer_keys
                layer.indexer_keys = torch.zeros(batch, length, *t.shape[2:], dtype=t.dtype, device="meta")
            if isinstance(layer.indexer_position_ids, torch.Tensor):
                t = layer.indexer_position_ids
                layer.indexer_position_ids = torch.zeros(t.shape[0], batch, length, *t.shape[3:], dtype=t.dtype,
                                                         device="meta")
    return probe


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
                step = torch.zeros((), device=p.device) if isinstance(opt, _FusedAdam) else torch.tensor(0.0)
                opt.state[p] = {"step": step, "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}
                if group.get("amsgrad"):
                    opt.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
            elif isinstance(opt, torch.optim.SGD) and group.get("momentum", 0):
                opt.state[p] = {"momentum_buffer": torch.zeros_like(p)}


@torch.no_grad()
def _clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_(foreach=True)`` as it runs on CUDA (the function itself refuses the foreach
    path for meta tensors): per-tensor norms in one multi-tensor launch, their norm, one scaling pass."""
    if not grads:
        return
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))


class _FusedAdam(torch.optim.AdamW):
    """Adam(W) as one multi-tensor kernel per step (``torch.optim.AdamW(fused=True)``, apex ``FusedAdam``).

    NB: PyTorch refuses ``fused=True`` for meta tensors, so ``step`` calls the fused aten op itself (its step
    counters live with the parameters, as on CUDA; their increment, a tiny foreach launch, is left out)."""

    def __init__(self, params: list, decoupled: bool) -> None:
        super().__init__(params, lr=1e-4, weight_decay=0.01 if decoupled else 0.0, foreach=False)
        self.decoupled = decoupled

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        op = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            for p in ps:
                if not self.state[p]:
                    self.state[p] = {"step": torch.zeros((), device=p.device), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
            st = [self.state[p] for p in ps]
            beta1, beta2 = group["betas"]
            op(ps, [p.grad for p in ps], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [],
               [s["step"] for s in st], lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
               eps=group["eps"], amsgrad=False, maximize=False)


def _check_image_run(images: int, kv_cache: int | None, tensor_parallel: int, expert_parallel: int,
                     context_parallel: int) -> None:
    """What a trace with ``images`` does not model, refused: the images go through the encoder in a prompt's
    forward pass (a prefill), on one GPU's whole model."""
    if kv_cache:
        raise InputError(f"images={images} with kv_cache={kv_cache}: the images are encoded in the prompt's prefill, "
                         "and a decode step reads them from the cache as any other token. Fix: forecast the prefill "
                         "with images (no kv_cache), the decode steps without images")
    split = {"tensor_parallel": tensor_parallel, "expert_parallel": expert_parallel,
             "context_parallel": context_parallel}
    for name, n in split.items():
        if n != 1:
            raise InputError(f"images={images} with {name}={n}: splitting an image encoder over GPUs is not modelled. "
                             f"Fix: {name}=1 (data or pipeline parallelism), or leave images out")


def _refuse_options(unknown: dict[str, Any]) -> None:
    """An option no trace takes (a misspelt one, most often) as an InputError naming it and the closest option;
    every forecast passes its trace options through :func:`trace`, so they all refuse it here."""
    import difflib

    known = [p for p in inspect.signature(trace).parameters if p not in ("model", "unknown")]
    name, value = next(iter(unknown.items()))
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    fix = f"{close[0]}=... (the closest option)" if close else "leave it out"
    raise InputError(f"{name}={value!r} is not an option of the trace (neusight.trace's options: "
                     f"{', '.join(known)}). Fix: {fix}")


def _make_optimizer(module: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    name = name.lower()
    if name.endswith("-fused"):
        return _FusedAdam(params, decoupled=name == "adamw-fused")
    # foreach=True: the multi-tensor kernels PyTorch uses by default on CUDA.
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-4, foreach=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)

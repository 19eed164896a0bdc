"""Multi-GPU forecasts: Megatron-style data (DP), tensor (TP), pipeline (PP), expert (EP) and context (CP)
parallelism over one GPU type.

A step on ``dp x cp x tp x pp`` GPUs is composed from single-GPU forecasts of what one GPU runs, plus the
communication between GPUs over the device's interconnect:

1. TP: every transformer block is split as Megatron-LM splits it: the QKV and first MLP projections by output
   columns, the attention output and second MLP projections by input rows, the attention heads among the GPUs,
   the vocabulary of the embedding and the LM head too; layer norms, dropout and residual adds stay whole. One
   GPU's share is traced as its own model (:func:`shard_tensor_parallel`), so every kernel of the forward and
   backward pass has its per-GPU shape. Communication: two all-reduces of the block's activations (tokens x
   hidden, FP32) per block in the forward pass, two in the backward pass, one after the embedding; in a
   Megatron-LM step (``megatron``) the backward ones, each column-parallel projection's input gradient, run beside
   the projection's weight-gradient GEMM, which hides up to its own time of them (:func:`async_tp_delta_ms`). With
   Megatron-LM's sequence parallelism (``sp``; Korthikanti et al. 2022, section 4.2.2) the kernels a block runs
   over the whole (tokens, hidden) activation, the layer norms, the dropouts after the attention and MLP outputs
   and the residual adds, run on tokens / tp rows each (:func:`split_sequence`), and what they save for the
   backward pass is 1 / tp as large; each all-reduce becomes a reduce-scatter and an all-gather of the same
   volume, and pipeline stages exchange 1 / tp of the activation per GPU.
2. PP: the blocks are split evenly into ``pp`` stages (embeddings with the first, the head and the loss with
   the last); each micro-batch crosses every stage boundary once forward and once backward (point-to-point,
   tokens x hidden). With ``m`` micro-batches a 1F1B or GPipe schedule takes (m + pp - 1) slots of the slowest
   stage: the pipeline bubble is (pp - 1) slots. Megatron-LM's interleaved schedule (``vpp`` model chunks per GPU,
   its virtual pipeline stages: GPU s holds chunks s, s + pp, ...) cuts the bubble to (pp - 1) / vpp slots, sends
   every micro-batch across vpp times as many chunk boundaries, and holds activations of (1 + (pp - 1) / (pp x
   vpp)) x the layers' worth on the first GPU (Korthikanti et al. 2022, section 4.2.3).
3. DP: every replica runs ``batch_size / dp``; after the backward pass its gradients (FP32, its share of the
   parameters) are all-reduced, not overlapped with the backward pass (Megatron-LM's default of its time).
   ``overlap_grad_reduce`` overlaps them as PyTorch DDP, FSDP and Megatron-LM's ``--overlap-grad-reduce`` do:
   each transformer block's gradients are reduced on a communication stream as soon as the block's backward
   kernels (and its tensor-parallel all-reduces) are done, one collective per block in the order they finish,
   the rest of the model's (embeddings, final norm, head) as one more once its last backward kernel is done;
   only the part of that stream that outlasts the busiest stage's last backward pass is charged
   (:func:`exposed_grad_reduce_ms`). Plain data parallelism (no ZeRO, no tensor, pipeline or expert parallelism, not
   ``megatron``) is reduced as PyTorch DDP reduces it, for any model (a CNN has no blocks): by buckets of
   gradients in the order they are ready (:func:`ddp_buckets`, :func:`exposed_bucket_reduce_ms`); DDP's copies of
   each gradient into its bucket and back (:func:`ddp_bucket_copies_ms`) are told in a note, not charged, since
   the per-parameter kernels of ZeRO, FSDP and Megatron-LM's buffers are not modelled either.
   The slowdown of kernels that share the GPU with the collectives is not modelled.
   ``zero`` = 1 / 2 / 3 shards the replicas' state as ZeRO (DeepSpeed) does, 3 also as PyTorch FSDP's full
   sharding: each GPU keeps 1 / dp of the optimizer state (1), of the gradients too (2), of the weights too (3)
   and steps its 1 / dp of the parameters. The gradients are reduce-scattered and the updated parameters
   all-gathered (1, 2: the all-reduce's volume); with 3 each block's parameters are all-gathered before its
   forward and again before its backward, its gradients reduce-scattered after it, and a GPU holds two gathered
   blocks at a time (the current one and the prefetched next). None of it is overlapped with compute unless
   asked: the gradients' reduction with ``overlap_grad_reduce`` (above), the parameters' gathers with
   ``overlap_param_gather``: ZeRO 1 / 2 gather the updated parameters during the next step's forward pass, each
   block's before the block runs (Megatron-LM's ``--overlap-param-gather``); ZeRO 3 / FSDP prefetches each block's
   gather while the block before it runs, in both passes (:func:`exposed_collectives_ms`: one communication
   stream, collectives in the order they are issued).
4. EP (mixture-of-experts models): groups of ``ep`` data-parallel replicas share each experts layer's experts,
   1 / ep per GPU (:func:`shard_expert_parallel`), as DeepSpeed-MoE and Megatron-LM's expert parallelism do. Every
   call of an experts layer sends its token rows to the GPUs of their experts and gets the results back: two
   all-to-alls, two more in the backward pass. Routing is balanced, so a GPU's experts receive as many rows as its
   own tokens make. The experts' gradients are all-reduced over the dp / ep replicas holding the same experts.
5. CP (context parallelism, as Megatron-LM's ``--context-parallel-size`` runs it with Transformer Engine's ring
   attention, its default point-to-point exchange): each sequence of ``seq_len`` tokens is split over ``cp`` GPUs,
   which trace and run every kernel on their seq_len / cp tokens (:func:`split_context`), except attention: a GPU's
   queries attend to every GPU's keys and values, which travel round the ring, one chunk per step. With causal
   attention each GPU holds two chunks of seq_len / (2 cp) tokens, chunks i and 2 cp - 1 - i (load balancing), so
   every GPU does 1 / cp of the causal work: step 0 its own chunks, causal (the traced kernel); each of the other
   cp - 1 steps a non-causal kernel of half a block: all its queries against the first half of the arriving keys,
   or its second half of the queries against all of them (which one depends on the GPU; every step waits for the
   slower). Without a causal mask (an encoder) every step is the whole block. After each further step elementwise
   kernels fold its partial results into the running ones: the output rescaled and added in the forward pass, the
   gradients of the queries and of the keys and values accumulated in the backward pass. Each step's transfer (the
   keys and values; in the backward pass also their gradients) runs beside the previous step's kernels, and only
   what it outlasts is charged (:func:`context_exchange_ms`). The weights' gradients are reduced over the dp x cp
   GPUs that hold the same weights. Needs a fused attention (SDPA's kernels or flash-attn) without a mask or a
   sliding window. ``cp_comm`` picks the exchange (:data:`CP_COMMS`): the ring above (``"p2p"``, the default),
   the keys and values all-gathered before the attention (``"all_gather"``), or DeepSpeed Ulysses' all-to-alls
   that give each GPU 1 / cp of the heads over the whole sequence (``"a2a"``); those two hide nothing
   (:func:`split_context`, :func:`context_exchange_ms`). The exchanges' buffers count in the memory as workspace
   while each attention call runs (:func:`context_buffer_bytes`).

Collectives are ring algorithms (all-reduces over several nodes may be trees, below): an all-reduce of ``b`` bytes
over ``n`` GPUs moves 2 (n - 1) / n x b per GPU in each direction in 2 (n - 1) steps, an all-gather or
reduce-scatter half of that, an all-to-all (n - 1) / n x b, a point-to-point transfer ``b``; at LINK_EFFICIENCY of
one direction of the device's ``interconnect_gbps`` (NVLink / Infinity Fabric, else PCIe). All-reduces, all-gathers
and reduce-scatters run with the algorithm and protocol NCCL's own cost model picks (:func:`nccl_collective`;
:data:`NCCL_PROTOCOLS`: LL for small messages, whose latency per ring step is a fraction of a microsecond over
NVLink, LL128 or Simple for large ones; all-reduces over several nodes also as a tree, :data:`NCCL_TREE_PROTOCOLS`;
all-reduces over nodes of NVSwitches with NVLink SHARP, ``Device.nvls``, also as NVLS or, across nodes, NVLS_TREE:
:data:`NCCL_NVLS_EFFICIENCY`);
all-to-alls and point-to-point transfers cost HOP_LATENCY_S per exchange. Beyond one node (``gpus_per_node``, 8) a
group whose GPUs sit on several nodes crosses them over its GPUs' network links (``internode_gbps`` each, or a
share of a node's ``nics_per_node`` such ports; a ring's or tree's channels spread over the links of the group's
GPUs on a node, up to the node's own links; one GPU's all-to-all or point-to-point transfers go through its own
link), its ring steps and tree hops between nodes at the network's latency (:class:`Links`, :class:`LinkPath`).
NCCL's NVLS all-gathers and reduce-scatters and CollNet are not modelled.

NB: no multi-GPU step was measured to check these forecasts; the collective model uses public NCCL
characteristics, not numbers fitted to labels, and was held against one published nccl-tests run only
(docs/collectives.md, ``scripts/bench_collectives.py``). Per-GPU kernels are the Hugging Face model's (eager), not
Megatron-LM's own fused kernels. Kernels go to the stage of the block the tracer attributes them to; backward
kernels attributed outside any block (some of an encoder-decoder's) go to the last stage, which leans slow.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from neusight.devices import Device, load_device
from neusight.errors import ContextCommError, ContextParallelError, InputError, ModelError
from neusight.graph.moe import is_routed_experts
from neusight.graph.records import TensorMeta
from neusight.kernels import formulas
from neusight.kernels.base import ATTENTION_BWD_KERNEL, FUSED_ATTENTION

__all__ = ["Parallelism", "Links", "LinkPath", "LargestRun", "ParallelPrediction", "find_max_parallel",
           "predict_parallel", "shard_tensor_parallel",
           "shard_expert_parallel", "split_sequence", "sequence_parallel_mask", "split_context",
           "context_exchange_ms", "allreduce_ms", "allgather_ms", "alltoall_ms", "p2p_ms", "nccl_collective",
           "NCCL_PROTOCOLS", "NCCL_TREE_PROTOCOLS"]

log = logging.getLogger(__name__)

# NCCL reaches about 80 % of a link's one-way bandwidth on large all-reduces (its bus bandwidth); an all-to-all
# exchange or a point-to-point transfer costs a few microseconds of launch and synchronisation. Public
# characteristics, not fitted here.
LINK_EFFICIENCY = 0.8
HOP_LATENCY_S = 5e-6


@dataclass(frozen=True)
class Protocol:
    """One of NCCL's protocols in its cost model of one algorithm (rings: :data:`NCCL_PROTOCOLS`; trees:
    :data:`NCCL_TREE_PROTOCOLS`): a base latency, a latency per ring step or tree hop over each kind of link
    (``nvlink``: NVLink or Infinity Fabric, ``pcie``, ``network``: between nodes), both in microseconds, and the
    share of the link's achieved bandwidth it reaches."""

    name: str
    base_us: float
    step_us: dict[str, float]
    share: float


# NCCL's cost model of its collectives (src/graph/tuning.cc, NCCL 2.18 to 2.28; public constants, not fitted here).
# Rings: LL sends 8-byte words each carrying a flag, so a step is a fraction of a microsecond but a quarter of the
# bandwidth is used in an all-reduce or across nodes (a third in a one-node all-gather or reduce-scatter); LL128
# flags 128-byte lines (0.92 of the bandwidth), and NCCL enables it by default only over NVLink; Simple has the full
# bandwidth and the slowest steps.
NCCL_PROTOCOLS = (
    Protocol("LL", 6.6, {"nvlink": 0.6, "pcie": 1.0, "network": 2.7}, 1 / 4),
    Protocol("LL128", 14.0, {"nvlink": 1.9, "pcie": 2.5, "network": 4.0}, 0.92),
    Protocol("Simple", 8.4, {"nvlink": 3.4, "pcie": 5.7, "network": 14.0}, 1.0),
)
# Trees (all-reduces only): a chain through each node's GPUs and a binary tree between nodes, data going up and
# down it once, so a call costs 2 x (GPUs per node - 1) hops inside a node and 2 x log2(nodes) between nodes
# instead of a ring's 2 (n - 1) steps, at half the bus bandwidth (a ring: n / (2 (n - 1)) of it) times
# NCCL_TREE_BANDWIDTH, LL at 1 / 3.8 of that, LL128 at 120 / 128 (7 / 9 inside one node), each further scaled by
# NCCL's correction for medium sizes (NCCL_TREE_CORRECTION). Few hops between nodes make trees the faster choice
# for small and medium all-reduces over many nodes; NCCL times every call both ways and runs the faster.
NCCL_TREE_PROTOCOLS = (
    Protocol("LL", 6.8, {"nvlink": 0.6, "pcie": 1.0, "network": 5.0}, 1 / 3.8),
    Protocol("LL128", 14.0, {"nvlink": 1.25, "pcie": 1.9, "network": 8.5}, 120 / 128),
    Protocol("Simple", 0.0, {"nvlink": 28.0, "pcie": 28.0, "network": 28.0}, 1.0),
)
NCCL_TREE_BANDWIDTH = 0.92
# per protocol, the factor on a tree's bandwidth for messages of 64 B x 2^i (i = 0 .. 22; larger: 1)
NCCL_TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
# A ring's all-reduce over several nodes under Simple: the latency x 1.4 (x 1.9 before compute capability 8.0),
# NCCL's "plateau effect"; and each ring step inside a node costs at least the network's post overhead (1 us on
# Intel hosts, 3 us under Simple), since every step of such a ring waits on a network transfer somewhere.
NCCL_RING_PLATEAU = (1.9, 1.4)
NCCL_NET_OVERHEAD_US = 1.0
# NVLS (NVLink SHARP; all-reduces inside one node whose NVSwitches reduce and multicast, Device.nvls): each GPU
# reads its 1 / n of the buffer already summed by the switch (sending its whole buffer to the switch, receiving
# 1 / n) and writes the sum once for the switch to copy to every GPU (sending 1 / n, receiving the whole buffer),
# so each link carries (1 + 1 / n) x the bytes each way, against a ring's 2 (n - 1) / n: fewer from 4 GPUs on.
# NCCL's model of it: Simple protocol only, one latency (NCCL_NVLS_LATENCY_US: 23-25 us in NCCL 2.19-2.28), the
# bandwidth times an efficiency per architecture (NCCL_NVLS_EFFICIENCY: Hopper 0.85, Blackwell 0.74) and
# (channels - 1) / channels of its NCCL_NVLS_CHANNELS channels, one of which synchronises.
NCCL_NVLS_LATENCY_US = 25.0
NCCL_NVLS_EFFICIENCY = {9: 0.85, 10: 0.74}
NCCL_NVLS_CHANNELS = 16
# NVLS_TREE (all-reduces over several nodes of such GPUs, k of the group's GPUs on each): NVLS inside each node, and
# each GPU's 1 / k of the node's sum all-reduced across the nodes through its own network port over NCCL's double
# binary tree, which carries that 1 / k once each way with two nodes and twice on more (a node is an inner node of
# one of the two trees); the NVLink and network parts pipelined, so the slower one sets the time. Latency: NVLS's,
# plus each of 2 log2(nodes) tree hops at NCCL_NVLS_TREE_HOP_US (NCCL's network latency of NVLS_TREE).
NCCL_NVLS_TREE_HOP_US = 20.9

_OPTION = re.compile(r"^(?:dp(?P<dp>\d+)|tp(?P<tp>\d+)|pp(?P<pp>\d+)(?:_(?P<mb>\d+))?)$")
# the inside of a split MLP: GPT-2 / BERT / OPT activations, a Llama-style MLP's gate x up product (on its module)
_MLP_INNER = re.compile(r"(?:\.mlp|\.mlp\.act|\.act_fn|\.activation_fn|\.intermediate_act_fn|\.intermediate)$")
# a transformer block's module path: ``transformer.h.3``, ``bert.encoder.layer.3``, ``encoder.block.3``, ...
_BLOCK = re.compile(r"^(.*?\.(?:h|layer|layers|block)\.\d+)(?:\.|$)")


@dataclass(frozen=True)
class Parallelism:
    """How many GPUs split the step, and how: ``dp x tp x pp`` GPUs, ``microbatches`` per replica; ``ep`` of the
    ``dp`` replicas share each mixture-of-experts layer's experts (expert parallelism); ``vpp`` model chunks per
    pipeline GPU (Megatron-LM's interleaved schedule; 1: plain 1F1B); ``sp``: Megatron-LM's sequence parallelism
    within the ``tp`` GPUs of a tensor-parallel group (module docstring, item 1); ``cp``: context parallelism, each
    sequence split over ``cp`` GPUs that run its attention as a ring (module docstring, item 5), so ``dp x cp x tp
    x pp`` GPUs in all, and the weights' gradients are reduced over ``dp x cp`` of them (:attr:`replicas`)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    ep: int = 1
    vpp: int = 1
    sp: bool = False
    cp: int = 1
    cp_comm: str = "p2p"       # how the cp GPUs exchange attention's inputs: CP_COMMS

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "ep", "vpp", "cp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"{name}={v!r} must be a positive integer. Fix: e.g. {name}=1")
        if self.dp % self.ep:
            raise InputError(f"ep={self.ep} does not divide dp={self.dp}: the experts are spread over groups of ep "
                             f"data-parallel replicas. Fix: an ep that divides {self.dp} (ep={self.dp}: every replica "
                             "holds its own share of the experts)")
        if not isinstance(self.sp, bool):
            raise InputError(f"sp={self.sp!r} is not true or false. Fix: sp=true (sequence parallelism) or sp=false")
        if self.sp and self.tp == 1:
            raise InputError("sp=True splits the tokens of the layer norms, dropouts and residual adds over the GPUs "
                             "of a tensor-parallel group; tp=1 has none. Fix: tp >= 2, or sp=false")
        if self.vpp > 1 and (self.pp == 1 or self.microbatches % self.pp):
            raise InputError(f"vpp={self.vpp} interleaves model chunks over pipeline stages, and needs pp > 1 and a "
                             f"number of micro-batches that pp divides (pp={self.pp}, microbatches="
                             f"{self.microbatches}), as Megatron-LM's interleaved schedule does. Fix: vpp=1, or "
                             "pp >= 2 with microbatches a multiple of pp")

        if self.cp_comm not in CP_COMMS:
            raise InputError(f"cp_comm={self.cp_comm!r} is not known. Fix: one of {', '.join(CP_COMMS)} (p2p: "
                             "Transformer Engine's ring, the default)")
        if self.cp_comm != "p2p" and self.cp == 1:
            raise InputError(f"cp_comm={self.cp_comm!r} chooses how the GPUs of a context-parallel group exchange "
                             "attention's inputs; cp=1 has none. Fix: cp >= 2, or leave cp_comm out")
        if self.cp > 1 and self.ep > 1:
            raise InputError(f"cp={self.cp} with ep={self.ep} is not modelled (context-parallel GPUs would share the "
                             "expert-parallel groups). Fix: leave one of them out")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        """The GPUs of a group that holds the same weights and reduces their gradients: ``dp x cp`` (a sequence's
        context-parallel GPUs hold the same weights and compute gradients from their parts of it)."""
        return self.dp * self.cp

    @classmethod
    def from_option(cls, option: str) -> "Parallelism":
        """A label option of the NeuSight dataset: ``dp4``, ``tp4``, ``pp4_8`` (4 stages, 8 micro-batches)."""
        m = _OPTION.match(option or "")
        if m is None:
            raise InputError(f"parallelism option {option!r} is not dpN, tpN or ppN_M. Fix: e.g. dp4, tp4, pp4_8")
        if m["pp"]:
            return cls(pp=int(m["pp"]), microbatches=int(m["mb"] or 1))
        return cls(dp=int(m["dp"] or 1), tp=int(m["tp"] or 1))


@dataclass(frozen=True)
class LinkPath:
    """The links one group's collectives cross: ``gbps`` (bidirectional GB/s per GPU) of the slowest, the kind of
    link between its GPUs inside a node (``"nvlink"``: NVLink or Infinity Fabric; ``"pcie"``) and how many nodes
    its GPUs sit on (a ring step from one node to the next crosses the network); ``nvls``: its GPUs on a node are
    joined by NVSwitches that reduce and multicast (NVLink SHARP). Across nodes, ``rails`` of the
    group's GPUs sit on each node, each with a network link of its own (``gbps``), and ``inside_gbps`` joins them
    inside a node: NCCL spreads a ring's or a tree's channels over those network links, one per channel, so such a
    collective crosses nodes at ``rails`` x ``gbps`` together, up to ``inside_gbps`` (:attr:`ring_gbps`), while
    one GPU's transfers (all-to-all, point to point) go through its own link at ``gbps``."""

    gbps: float
    kind: str = "nvlink"
    nodes: int = 1
    rails: int = 1
    inside_gbps: float = 0.0     # 0: as gbps
    nvls: bool = False           # each node's GPUs joined by NVSwitches with NVLink SHARP (NCCL's NVLS, NVLS_TREE)

    @property
    def ring_gbps(self) -> float:
        """Bidirectional GB/s per GPU that a ring's or a tree's channels reach over this path."""
        if self.nodes <= 1 or self.rails <= 1:
            return self.gbps
        return min(self.inside_gbps or self.gbps, self.rails * self.gbps)

    @classmethod
    def of(cls, device: Device, gbps: "float | LinkPath | None" = None) -> "LinkPath":
        """``gbps`` as a path: a LinkPath as it is; a number (None: the device's ``interconnect_gbps``) as links of
        that speed inside one node, NVLink-class when the device has such links (faster than its PCIe), through
        NVLink SHARP switches where the device has them (``Device.nvls``)."""
        if isinstance(gbps, LinkPath):
            return gbps
        kind = _link_kind(device)
        return cls(float(device.interconnect_gbps if gbps is None else gbps), kind, 1, nvls=_sharp(device, kind))


def _sharp(device: Device, kind: str) -> bool:
    """Whether a group's NVLink-class links on ``device`` go through NVSwitches with NVLink SHARP (``Device.nvls``)."""
    return device.nvls and kind == "nvlink"


def _link_kind(device: Device) -> str:
    """``"nvlink"`` when ``device`` has NVLink-class links (NVLink, Infinity Fabric: faster than its PCIe), else
    ``"pcie"``."""
    return "nvlink" if device.interconnect_gbps > device.pcie_gbps else "pcie"


def nccl_collective(nbytes: float, n: int, device: Device, gbps: "float | LinkPath | None" = None,
                    passes: int = 2) -> tuple[float, str]:
    """(ms, "algorithm protocol") of a collective over ``n`` GPUs as NCCL's cost model times it: ``passes`` = 2 an
    all-reduce of ``nbytes`` (a ring's 2 (n - 1) steps, each moving 1 / n of them each way, or a tree:
    :data:`NCCL_TREE_PROTOCOLS`), 1 an all-gather or reduce-scatter of ``nbytes`` in all (rings only, n - 1 steps);
    over ``gbps`` (a :class:`LinkPath`, or bidirectional GB/s per GPU inside one node; None: the device's
    ``interconnect_gbps``). Per algorithm and protocol: its base latency, each step's or hop's over its link (those
    between nodes over the network) and the bytes at its share of the achieved bandwidth; the fastest is taken, as
    NCCL takes it.

    >>> h100 = load_device("h100-sxm5-80gb")
    >>> [(round(ms * 1e3, 1), p) for ms, p in (nccl_collective(b, 8, h100) for b in (2**17, 2**22, 2**30))]
    [(17.5, 'ring LL'), (41.4, 'NVLS Simple'), (4235.8, 'NVLS Simple')]
    >>> ring_only = LinkPath(900, "nvlink", 1)              # 8 H100s without NVLink SHARP (NCCL_NVLS_ENABLE=0)
    >>> [(round(ms * 1e3, 1), p) for ms, p in (nccl_collective(b, 8, h100, ring_only) for b in (2**22, 2**30))]
    [(62.8, 'ring LL128'), (5275.6, 'ring Simple')]
    >>> over_8_nodes = LinkPath(100, "nvlink", 8, rails=8, inside_gbps=900)   # 64 GPUs, 400 Gb/s InfiniBand each
    >>> [(round(ms * 1e3, 1), p) for ms, p in (nccl_collective(b, 64, h100, over_8_nodes) for b in (2**17, 2**30))]
    [(52.0, 'tree LL'), (7455.0, 'ring Simple')]
    """
    if n <= 1 or nbytes <= 0:
        return 0.0, "none"
    path = LinkPath.of(device, gbps)
    nodes = max(1, min(path.nodes, n))
    full = _link_bytes_per_s(device, path, ring=True)
    best = (math.inf, "none")
    # rings
    steps = passes * (n - 1)
    # steps between nodes, as NCCL counts them (no more than all of them: one GPU per node)
    crossing = min(steps, 2 * nodes if passes == 2 else nodes - 1) if nodes > 1 else 0
    moved = passes * (n - 1) / n * nbytes
    for p in _enabled(NCCL_PROTOCOLS, path):
        share = 1 / 3 if p.name == "LL" and passes == 1 and nodes == 1 else p.share
        intra = p.step_us[path.kind]
        if nodes > 1:
            intra = max(intra, NCCL_NET_OVERHEAD_US * (3 if p.name == "Simple" else 1))
        latency_us = p.base_us + (steps - crossing) * intra + crossing * p.step_us["network"]
        if nodes > 1 and passes == 2 and p.name == "Simple":
            latency_us *= NCCL_RING_PLATEAU[0] if 0 < device.cc < 8.0 else NCCL_RING_PLATEAU[1]
        best = min(best, (latency_us * 1e-3 + moved / (full * share) * 1e3, f"ring {p.name}"))
    if passes != 2:
        return best
    share = _nvls_efficiency(device) * (NCCL_NVLS_CHANNELS - 1) / NCCL_NVLS_CHANNELS if path.nvls else 0.0
    if share > 0 and (nodes == 1 or path.rails > 1):    # NVLS in one node; NVLS_TREE with k GPUs on each of several
        k = n if nodes == 1 else path.rails
        switch = (1 + 1 / k) * nbytes / (_link_bytes_per_s(device, path.inside_gbps or path.gbps) * share)
        network = 0.0 if nodes == 1 else (1 if nodes <= 2 else 2) * nbytes / k / _link_bytes_per_s(device, path)
        latency_us = NCCL_NVLS_LATENCY_US + 2 * int(math.log2(nodes)) * NCCL_NVLS_TREE_HOP_US
        best = min(best, (latency_us * 1e-3 + max(switch, network) * 1e3,
                          "NVLS Simple" if nodes == 1 else "NVLS_TREE Simple"))
    # trees (all-reduce)
    per_node = max(1, n // nodes)
    size = math.log2(max(nbytes, 64) / 64)
    for p in _enabled(NCCL_TREE_PROTOCOLS, path):
        share = 7 / 9 if p.name == "LL128" and nodes == 1 else p.share
        share *= NCCL_TREE_BANDWIDTH * _tree_correction(p.name, size)
        hops_up = (per_node - 1) * p.step_us[path.kind] + int(math.log2(nodes)) * p.step_us["network"]
        latency_us = p.base_us + 2 * hops_up
        best = min(best, (latency_us * 1e-3 + 2 * nbytes / (full * share) * 1e3, f"tree {p.name}"))
    return best


def collective_call(nbytes: float, n: int, device: Device, gbps: "float | LinkPath | None" = None,
                    passes: int = 2) -> str:
    """One collective as a forecast's notes describe it: its size, GPUs, time and NCCL's algorithm and protocol
    (:func:`nccl_collective`; ``passes`` 2 an all-reduce, 1 an all-gather or reduce-scatter of ``nbytes`` in all).

    >>> collective_call(2**30, 8, load_device("h100-sxm5-80gb"))
    "1,024.0 MiB over 8 GPUs, 4.24 ms as NCCL's NVLS Simple"
    """
    ms, how = nccl_collective(nbytes, n, device, gbps, passes)
    return f"{nbytes / 2**20:,.1f} MiB over {n} GPUs, {_duration(ms)} as NCCL's {how}"


def _duration(ms: float) -> str:
    """A collective's time for a note: ms from 1 ms on, else us."""
    return f"{ms:,.2f} ms" if ms >= 1 else f"{ms * 1e3:,.1f} us"


def _median(values: list[float]) -> float:
    """The middle value (the upper one of an even count); 0 for none."""
    return sorted(values)[len(values) // 2] if values else 0.0


def network_share_gbps(internode_gbps: float, nics_per_node: int | None, gpus_per_node: int) -> float:
    """Each GPU's share of its node's network: ``internode_gbps`` per port, ``nics_per_node`` ports (None: one per
    GPU) shared by the node's ``gpus_per_node`` GPUs, all of which cross at once in the collectives modelled."""
    return internode_gbps if nics_per_node is None else internode_gbps * nics_per_node / gpus_per_node


def _enabled(protocols: tuple[Protocol, ...], path: LinkPath) -> list[Protocol]:
    """The ``protocols`` NCCL enables by default over ``path``: LL128 only over NVLink-class links."""
    return [p for p in protocols if p.name != "LL128" or path.kind == "nvlink"]


def _nvls_efficiency(device: Device) -> float:
    """NCCL's NVLS efficiency for ``device``'s architecture (:data:`NCCL_NVLS_EFFICIENCY`; later ones as the
    latest, 0 before Hopper)."""
    major = int(device.cc)
    if major < min(NCCL_NVLS_EFFICIENCY):
        return 0.0
    return NCCL_NVLS_EFFICIENCY.get(major, NCCL_NVLS_EFFICIENCY[max(NCCL_NVLS_EFFICIENCY)])


def _tree_correction(protocol: str, size: float) -> float:
    """NCCL's tree correction for a message of 64 B x 2^``size``, interpolated between its powers of two (NCCL
    steps it at each), so that a tree's time grows with the bytes (a step up in the factor would make a larger
    message faster); 1 beyond the table."""
    fix = (*NCCL_TREE_CORRECTION[protocol], 1.0)
    i = min(int(size), len(fix) - 1)
    return fix[i] if i == len(fix) - 1 else fix[i] + (fix[i + 1] - fix[i]) * (size - i)


def allreduce_ms(nbytes: float, n: int, device: Device, gbps: "float | LinkPath | None" = None) -> float:
    """All-reduce of ``nbytes`` over ``n`` GPUs with the algorithm and protocol NCCL would pick
    (:func:`nccl_collective`: a ring's 2 (n - 1) / n x bytes each way in 2 (n - 1) steps, or over several nodes
    perhaps a tree); over ``gbps`` (a :class:`LinkPath`, or bidirectional GB/s per GPU inside one node; None: the
    device's ``interconnect_gbps``)."""
    return nccl_collective(nbytes, n, device, gbps, 2)[0]


def allgather_ms(nbytes: float, n: int, device: Device, gbps: "float | LinkPath | None" = None) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in all over ``n`` GPUs: (n - 1) / n x bytes, n - 1 steps
    (an all-reduce is a reduce-scatter followed by an all-gather), with the protocol NCCL would pick."""
    return nccl_collective(nbytes, n, device, gbps, 1)[0]


def alltoall_ms(nbytes: float, n: int, device: Device, gbps: "float | LinkPath | None" = None) -> float:
    """All-to-all over ``n`` GPUs, each sending ``nbytes`` in all: (n - 1) / n of them leave the GPU (to the n - 1
    others, at once), n - 1 exchanges' latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return ((n - 1) / n * nbytes / _link_bytes_per_s(device, gbps) + (n - 1) * HOP_LATENCY_S) * 1e3


def p2p_ms(nbytes: float, device: Device, gbps: "float | LinkPath | None" = None) -> float:
    """One point-to-point transfer of ``nbytes`` to a neighbour GPU."""
    return (nbytes / _link_bytes_per_s(device, gbps) + HOP_LATENCY_S) * 1e3 if nbytes > 0 else 0.0


def _link_bytes_per_s(device: Device, gbps: "float | LinkPath | None" = None, ring: bool = False) -> float:
    """Achieved one-way bytes per second over ``gbps`` (a path, or bidirectional GB/s): a GPU's own link, or with
    ``ring`` what NCCL's ring and tree channels reach together (:attr:`LinkPath.ring_gbps`)."""
    path = LinkPath.of(device, gbps)
    return (path.ring_gbps if ring else path.gbps) / 2 * 1e9 * LINK_EFFICIENCY


# Several nodes: GPUs_PER_NODE GPUs share a node's NVLink / Infinity Fabric; between nodes each GPU has its own
# network link (DGX / HGX H100: one 400 Gb/s InfiniBand NDR port per GPU = 100 GB/s bidirectional; A100 systems:
# 200 Gb/s HDR = 50). NCCL's rings and trees cross nodes through those ports, one channel per port, so a group
# with g GPUs on each node crosses at g ports together, up to its links inside the node (LinkPath.ring_gbps); a
# GPU's own transfers (all-to-all, point to point) use its port alone.
GPUS_PER_NODE = 8
INTERNODE_GBPS = 100.0


@dataclass(frozen=True)
class Links:
    """The :class:`LinkPath` (bidirectional GB/s per GPU, kind of link inside a node, nodes spanned) that each kind of
    group's collectives run over, from where its GPUs sit: ranks ordered as Megatron-LM orders them
    (tensor-parallel innermost, then context-parallel, then data-parallel, pipeline stages outermost;
    expert-parallel groups are runs of ``ep`` data-parallel ranks), ``gpus_per_node`` consecutive ranks per node.
    ``dp`` is the path of the group that reduces the gradients: the ``dp x cp`` replicas of the weights."""

    tp: LinkPath
    dp: LinkPath
    ep: LinkPath
    pp: LinkPath
    nodes: int
    cp: LinkPath = LinkPath(0.0)

    @classmethod
    def of(cls, par: "Parallelism", device: Device, gpus_per_node: int = GPUS_PER_NODE,
           internode_gbps: float = INTERNODE_GBPS, nics_per_node: int | None = None, nvls: bool = True) -> "Links":
        """``internode_gbps``: each network port's bidirectional GB/s; ``nics_per_node``: a node's ports (None: one
        per GPU, as DGX / HGX have). With fewer ports than GPUs, a node's GPUs share them: each GPU's share is
        ``internode_gbps`` x ports / GPUs (every GPU of a node crosses at once in the collectives modelled).
        ``nvls``: a group may all-reduce through NVLink SHARP where the device's switches have it (``Device.nvls``:
        NVLS inside one node, NVLS_TREE across nodes; False: as NCCL runs with ``NCCL_NVLS_ENABLE=0``)."""
        for name, v in (("gpus_per_node", gpus_per_node), ("internode_gbps", internode_gbps)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or \
                    (name == "gpus_per_node" and not isinstance(v, int)):
                raise InputError(f"{name}={v!r} must be a positive {'integer' if name == 'gpus_per_node' else 'number'}"
                                 f". Fix: e.g. {name}={GPUS_PER_NODE if name == 'gpus_per_node' else INTERNODE_GBPS:g}")
        if nics_per_node is not None:
            if isinstance(nics_per_node, bool) or not isinstance(nics_per_node, int) or nics_per_node < 1:
                raise InputError(f"nics_per_node={nics_per_node!r} must be a positive integer (a node's network "
                                 "ports). Fix: e.g. nics_per_node=4, or leave it out (one per GPU)")
            if nics_per_node > gpus_per_node:
                raise InputError(f"nics_per_node={nics_per_node} is more than gpus_per_node={gpus_per_node}; the "
                                 "model gives a GPU one port at most. Fix: nics_per_node <= gpus_per_node, with "
                                 "internode_gbps = each GPU's ports together")
        internode_gbps = network_share_gbps(internode_gbps, nics_per_node, gpus_per_node)
        intra = device.interconnect_gbps
        group = device.interconnect_group or gpus_per_node

        def over(span: int, members: int) -> LinkPath:
            # inside each node: beyond the GPUs the links join (a bridged pair) the host's PCIe
            inside = min(span, gpus_per_node) <= group
            link = intra if inside else min(intra, device.pcie_gbps)
            kind = _link_kind(device) if inside else "pcie"
            nodes = min(members, math.ceil(span / gpus_per_node))      # the nodes its GPUs sit on
            sharp = nvls and _sharp(device, kind)
            if span <= gpus_per_node:
                return LinkPath(link, kind, nodes, nvls=sharp)
            # beyond a node the network, each of the group's GPUs on a node with a link of its own (DGX / HGX: one
            # NIC per GPU)
            return LinkPath(min(link, float(internode_gbps)), kind, nodes, max(1, members // nodes), link, nvls=sharp)

        spans = cls.spans(par)
        return cls(tp=over(spans["tensor-parallel"], par.tp), dp=over(spans["data-parallel"], par.replicas),
                   ep=over(spans["expert-parallel"], par.ep), pp=over(spans["pipeline"], par.pp),
                   nodes=math.ceil(par.gpus / gpus_per_node), cp=over(spans["context-parallel"], par.cp))

    @staticmethod
    def spans(par: "Parallelism") -> dict[str, int]:
        """How many consecutive ranks each kind of group's GPUs span (ranks ordered as in the class docstring)."""
        return {"tensor-parallel": par.tp, "context-parallel": par.tp * par.cp,
                "data-parallel": par.tp * par.cp * par.dp, "expert-parallel": par.tp * par.ep, "pipeline": par.gpus}


# ---------------------------------------------------------------------------------------------------------
# tensor parallelism: one GPU's share of each block, as a model of its own

# Llama-style blocks: q / k / v / o projections in "<name>Attention", gate / up / down in "<name>MLP", attention
# reshaped by head_dim. Each was checked to halve every layer GEMM and attention product at tp=2
# (tests/test_parallel.py); blocks that normalize the whole query width (OLMo 2 / 3) or fuse projections (GLM)
# are not Llama-style in this sense and are refused; Phi-3's fused projections have entries of their own below.
_LLAMA_STYLE = ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe", "Gemma", "Gemma2", "Gemma3",
                "Ministral", "Granite", "Cohere", "Olmo", "Helium", "Ernie4_5", "Arcee", "Exaone4", "SeedOss",
                "HunYuanDenseV1", "Apertus", "SmolLM3", "Starcoder2", "Llama4Text", "GptOss",
                # the language models of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (multimodal rotary positions, same split)
                "Qwen2VL", "Qwen2_5_VL", "Qwen3VLText")
# multi-head latent attention blocks (DeepSeek-V2 / V3)
_MLA = ("DeepseekV2", "DeepseekV3")
# (class name, attribute) -> how Megatron splits that projection: "col" = output features, "row" = input features
_SPLITS = {
    ("GPT2Attention", "c_attn"): "col", ("GPT2Attention", "c_proj"): "row",
    ("GPT2MLP", "c_fc"): "col", ("GPT2MLP", "c_proj"): "row",
    ("BertSelfAttention", "query"): "col", ("BertSelfAttention", "key"): "col", ("BertSelfAttention", "value"): "col",
    ("BertSelfOutput", "dense"): "row", ("BertIntermediate", "dense"): "col", ("BertOutput", "dense"): "row",
    ("OPTAttention", "q_proj"): "col", ("OPTAttention", "k_proj"): "col", ("OPTAttention", "v_proj"): "col",
    ("OPTAttention", "out_proj"): "row", ("OPTDecoderLayer", "fc1"): "col", ("OPTDecoderLayer", "fc2"): "row",
    # Llama-style attention reshapes by head_dim (-1 heads), so splitting the projections is enough; Mixtral's
    # experts split their intermediate width instead (_split_experts), its router stays whole on every GPU
    **{(f"{m}Attention", p): "col" for m in _LLAMA_STYLE for p in ("q_proj", "k_proj", "v_proj")},
    **{(f"{m}Attention", "o_proj"): "row" for m in _LLAMA_STYLE},
    **{(f"{m}MLP", p): "col" for m in _LLAMA_STYLE for p in ("gate_proj", "up_proj")},
    **{(f"{m}MLP", "down_proj"): "row" for m in _LLAMA_STYLE},
    ("Starcoder2MLP", "c_fc"): "col", ("Starcoder2MLP", "c_proj"): "row",
    # GPT-J reshapes its q / k / v by head_dim (-1 heads) as the Llama-style blocks do; its MLP is fc_in / fc_out
    **{("GPTJAttention", p): "col" for p in ("q_proj", "k_proj", "v_proj")}, ("GPTJAttention", "out_proj"): "row",
    ("GPTJMLP", "fc_in"): "col", ("GPTJMLP", "fc_out"): "row",
    # Phi-3 fuses q, k and v into one projection and gate and up into another: a column split keeps every part's
    # share (each GPU: heads / tp queries, kv heads / tp keys and values; gate and up halves that chunk(2) finds),
    # with the attention's own head counts divided (_OWN_HEADS)
    ("Phi3Attention", "qkv_proj"): "col", ("Phi3Attention", "o_proj"): "row",
    ("Phi3MLP", "gate_up_proj"): "col", ("Phi3MLP", "down_proj"): "row",
    # DeepSeek's multi-head latent attention: the shared low-rank down projections (q_a, kv_a with the rotary key)
    # stay whole on every GPU, the per-head up projections split by heads (column), the output by rows; its
    # attention reshapes by head dims (-1 heads). Dense MLPs and shared experts split like Llama's
    **{(f"{m}Attention", p): "col" for m in _MLA for p in ("q_proj", "q_b_proj", "kv_b_proj")},
    **{(f"{m}Attention", "o_proj"): "row" for m in _MLA},
    **{(f"{m}MLP", p): "col" for m in _MLA for p in ("gate_proj", "up_proj")},
    **{(f"{m}MLP", "down_proj"): "row" for m in _MLA},
}
# attention blocks that slice a fused projection by head counts read from their config: each gets a copy of the
# config with the counts divided by tp (and the module attribute of the same name divided)
_OWN_HEADS = {"Phi3Attention": ("num_attention_heads", "num_key_value_heads")}
# blocks whose head counts live in their config: (query heads, key/value heads) must divide by tp
_CONFIG_HEADS = {**{f"{m}Attention": ("num_attention_heads", "num_key_value_heads")
                    for m in (*_LLAMA_STYLE, *_MLA, "Phi3")}, "GPTJAttention": ("num_attention_heads",)}
# attributes that hold a width a split divides: GPT-2 splits the fused QKV output by ``split_size``
_WIDTHS = {"GPT2Attention": ("split_size", "embed_dim"), "BertSelfAttention": ("all_head_size",),
           "OPTAttention": ("embed_dim",)}
_HEADS = {"GPT2Attention": "num_heads", "BertSelfAttention": "num_attention_heads", "OPTAttention": "num_heads"}
# per-head parameters of an attention block, split by heads with its projections: gpt-oss's attention sinks
_PER_HEAD = {"GptOssAttention": ("sinks",)}


def shard_tensor_parallel(module: nn.Module, tp: int, columns: list[str] | None = None) -> nn.Module:
    """Turn ``module`` (on the meta device) into one GPU's share of a ``tp``-way tensor-parallel model, in place;
    ``columns``, if given, receives the module paths of the projections split by output features (Megatron-LM's
    column-parallel linears, whose backward pass all-reduces their input's gradient).

    Known blocks: GPT-2 (also GPT-3-style configs built as GPT-2), GPT-J, BERT, OPT and the Llama-style blocks of
    ``_LLAMA_STYLE`` (Llama, Mistral, Qwen, Gemma, ...; routed experts of Mixtral / Qwen-MoE too), Phi-3's fused
    projections and DeepSeek-V2 / V3's multi-head latent attention (``_MLA``: the per-head up projections split,
    the shared low-rank down projections whole). Raises
    ModelError for a model without any of them or with attention / MLP blocks of another kind beside them (split
    only in part, :func:`_unsplit_blocks`), InputError when heads or widths do not divide by ``tp``.
    """
    if tp == 1:
        return module
    found = 0
    for path, parent in list(module.named_modules()):
        cls = type(parent).__name__
        if cls in _HEADS:
            heads = getattr(parent, _HEADS[cls], None)
            if heads is not None:
                if heads % tp:
                    raise InputError(f"tp={tp} does not divide the {heads} attention heads of {cls}. Fix: choose a "
                                     f"tp that divides {heads}")
                setattr(parent, _HEADS[cls], heads // tp)
            for attr in _WIDTHS.get(cls, ()):
                if isinstance(getattr(parent, attr, None), int):
                    setattr(parent, attr, getattr(parent, attr) // tp)
        for attr in _CONFIG_HEADS.get(cls, ()):
            heads = getattr(getattr(parent, "config", None), attr, None)
            if isinstance(heads, int) and heads % tp:
                raise InputError(f"tp={tp} does not divide the {heads} {attr} of {cls}. Fix: choose a tp that "
                                 f"divides {heads}")
        if cls in _OWN_HEADS and getattr(parent, "config", None) is not None:
            own = copy.copy(parent.config)
            for attr in _OWN_HEADS[cls]:
                setattr(own, attr, getattr(own, attr) // tp)
                if isinstance(getattr(parent, attr, None), int):
                    setattr(parent, attr, getattr(parent, attr) // tp)
            parent.config = own
        for (owner, attr), how in _SPLITS.items():
            if cls == owner and isinstance(getattr(parent, attr, None), nn.Module):
                setattr(parent, attr, _split(getattr(parent, attr), how, tp, f"{cls}.{attr}"))
                found += 1
                if how == "col" and columns is not None:
                    columns.append(f"{path}.{attr}" if path else attr)
        for attr in _PER_HEAD.get(cls, ()):
            w = getattr(parent, attr)      # (heads,): _CONFIG_HEADS checked that tp divides them
            setattr(parent, attr, nn.Parameter(torch.empty(w.shape[0] // tp, dtype=w.dtype, device="meta"),
                                               requires_grad=w.requires_grad))
        if is_routed_experts(parent) or getattr(parent, "neusight_dense", False):   # Llama 4's run densely too
            _split_experts(parent, tp, cls)
            found += 1
    if not found:
        raise ModelError(f"tensor parallelism is modelled for GPT-2 (and GPT-3 configs built as GPT-2), GPT-J, BERT, "
                         f"OPT, Llama-style blocks ({', '.join(_LLAMA_STYLE)}, Phi3) and DeepSeek's latent attention "
                         f"({', '.join(_MLA)}); {type(module).__name__} has "
                         "none. Fix: use tp=1 (dp and pp work for any model)")
    whole = _unsplit_blocks(module)
    if whole:
        raise ModelError(f"tensor parallelism would split only part of {type(module).__name__}: its "
                         f"{', '.join(whole)} block{'s' if len(whole) > 1 else ''} with linear layers "
                         f"{'are' if len(whole) > 1 else 'is'} not among the modelled ones (GPT-2, GPT-J, BERT, OPT, "
                         f"Llama-style blocks: {', '.join(_LLAMA_STYLE)}, Phi3, {', '.join(_MLA)}), and a forecast "
                         f"with {'them' if len(whole) > 1 else 'it'} whole on every GPU would be wrong. Fix: use tp=1 "
                         "(dp and pp work for any model)")
    _split_vocab(module, tp)
    return module


def _unsplit_blocks(module: nn.Module) -> list[str]:
    """Class names of the attention and MLP blocks of ``module`` (by name: ``...Attention``, ``...MLP``) that hold
    linear layers of their own but that no tensor-parallel split knows: a model tensor parallelism would only
    partly shard."""
    known = {owner for owner, _ in _SPLITS}
    return sorted({type(m).__name__ for m in module.modules()
                   if type(m).__name__.endswith(("Attention", "MLP")) and type(m).__name__ not in known
                   and any(isinstance(c, nn.Linear) for c in m.children())})


def _split(layer: nn.Module, how: str, tp: int, where: str) -> nn.Module:
    """A Linear or Conv1D with its output (``col``) or input (``row``) features divided by ``tp``."""
    w = layer.weight
    conv1d = type(layer).__name__ == "Conv1D"          # transformers' Conv1D: weight (in, out)
    n_in, n_out = (w.shape[0], w.shape[1]) if conv1d else (w.shape[1], w.shape[0])
    n = n_out if how == "col" else n_in
    if n % tp:
        raise InputError(f"tp={tp} does not divide the {n} {'output' if how == 'col' else 'input'} features of "
                         f"{where}. Fix: choose a tp that divides {n}")
    n_in, n_out = (n_in, n_out // tp) if how == "col" else (n_in // tp, n_out)
    with torch.device("meta"):
        new = type(layer)(n_out, n_in) if conv1d else nn.Linear(n_in, n_out, bias=layer.bias is not None)
    return new.to(w.dtype)


def _split_experts(mod: nn.Module, tp: int, where: str) -> None:
    """Routed experts, each split as a Megatron MLP: its gate / up projections by output features (column), its
    down projection by input features (row), so every GPU holds 1/tp of every expert's intermediate width."""
    transposed = bool(getattr(mod, "is_transposed", False))
    up_name = "gate_up_proj" if getattr(mod, "has_gate", True) else "up_proj"
    # the intermediate axis: (experts, out, in) weights, or (experts, in, out) when transposed
    for name, axis in ((up_name, 2 if transposed else 1), ("down_proj", 1 if transposed else 2),
                       (f"{up_name}_bias", 1)):
        w = getattr(mod, name, None)
        if not isinstance(w, torch.Tensor) or (name.endswith("_bias") and not getattr(mod, "has_bias", False)):
            continue
        if w.shape[axis] % tp:
            raise InputError(f"tp={tp} does not divide the {w.shape[axis]} intermediate features of {where}.{name}. "
                             f"Fix: choose a tp that divides {w.shape[axis]}")
        shape = list(w.shape)
        shape[axis] //= tp
        setattr(mod, name, nn.Parameter(torch.empty(shape, dtype=w.dtype, device="meta"), requires_grad=w.requires_grad))


def shard_expert_parallel(module: nn.Module, ep: int) -> nn.Module:
    """Turn ``module`` (on the meta device) into one GPU's share of an ``ep``-way expert-parallel mixture of experts,
    in place: every experts layer keeps 1 / ep of its experts, which take the token rows of all ``ep`` GPUs.

    Routed top-k experts (Mixtral, Qwen-MoE, DeepSeek, ...; :func:`neusight.graph.moe.is_routed_experts`) keep the
    first experts / ep of their stacked weights; under balanced routing a GPU's experts receive as many token-expert
    pairs as its own tokens make, so the per-expert share grows ep-fold. Switch Transformers' fixed-capacity layers
    keep experts / ep experts, each with an ep-fold buffer. Routers, shared experts, attention and everything else
    stay whole. Raises ModelError for a model without experts layers, InputError when ``ep`` does not divide a
    layer's experts.
    """
    if ep == 1:
        return module
    found = 0
    for name, mod, n_exp in experts_layers(module):
        _check_experts(n_exp, ep, name or type(mod).__name__)
        if is_routed_experts(mod):
            for attr, w in list(mod.named_parameters(recurse=False)):
                if w.dim() >= 1 and w.shape[0] == n_exp:
                    shape = (n_exp // ep, *w.shape[1:])
                    setattr(mod, attr, nn.Parameter(torch.empty(shape, dtype=w.dtype, device="meta"),
                                                    requires_grad=w.requires_grad))
            mod.num_experts = n_exp // ep
        else:
            keys = list(mod.experts.keys())
            mod.experts = nn.ModuleDict({k: mod.experts[k] for k in keys[:len(keys) // ep]})
            mod.neusight_capacity *= ep
        found += 1
    if not found and any(getattr(m, "neusight_dense", False) for m in module.modules()):
        raise ModelError(f"expert parallelism (ep={ep}) hands each token to the GPUs of its chosen experts, but "
                         f"{type(module).__name__}'s experts run as transformers runs them, every expert on every "
                         "token (moe_kernels='auto'). Fix: moe_kernels='grouped' (or 'loop' / 'per-expert') to "
                         "forecast them routed, as serving engines run them")
    if not found:
        raise ModelError(f"expert parallelism (ep={ep}) spreads a mixture of experts' experts over GPUs; "
                         f"{type(module).__name__} has no experts layers (routed top-k experts or Switch Transformers' "
                         "sparse MLPs). Fix: ep=1")
    return module


def experts_layers(module: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(path, module, number of experts) of every experts layer of ``module`` that expert parallelism spreads:
    routed top-k experts (:func:`neusight.graph.moe.is_routed_experts`) and Switch Transformers' sparse MLPs (as
    traced with a fixed capacity); empty for a model without experts."""
    found = []
    for name, mod in module.named_modules():
        if is_routed_experts(mod):
            found.append((name, mod, int(mod.num_experts)))
        elif hasattr(mod, "neusight_capacity") and isinstance(getattr(mod, "experts", None), nn.ModuleDict):
            found.append((name, mod, len(mod.experts)))
    return found


def _check_experts(n_exp: int, ep: int, where: str) -> None:
    if n_exp % ep:
        raise InputError(f"ep={ep} does not divide the {n_exp} experts of {where}. Fix: an ep that divides {n_exp}")


# Megatron-LM pads the vocabulary to a multiple of 128 x tp (its make-vocab-size-divisible-by default), so each
# GPU holds the same number of rows.
VOCAB_MULTIPLE = 128


def _split_vocab(module: nn.Module, tp: int) -> None:
    """Vocabulary-parallel embedding and LM head: each GPU holds ceil(V / (128 tp)) x 128 rows of the vocabulary."""
    get_in, get_out = getattr(module, "get_input_embeddings", None), getattr(module, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    tied = isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear) and head.weight is emb.weight
    if isinstance(emb, nn.Embedding):
        with torch.device("meta"):
            emb = nn.Embedding(_vocab_share(emb.num_embeddings, tp), emb.embedding_dim).to(emb.weight.dtype)
        module.set_input_embeddings(emb)
    if isinstance(head, nn.Linear):
        with torch.device("meta"):
            new = nn.Linear(head.in_features, _vocab_share(head.out_features, tp), bias=head.bias is not None)
        new = new.to(head.weight.dtype)
        if tied:   # the LM head shares the embedding's weight, as before the split
            new.weight = emb.weight
        module.set_output_embeddings(new)


def _vocab_share(vocab: int, tp: int) -> int:
    return math.ceil(vocab / (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE


# ---------------------------------------------------------------------------------------------------------
# composition


@dataclass
class ParallelPrediction:
    """A step on ``parallelism.gpus`` GPUs: total, its parts, per-stage times, and one GPU's forecast."""

    model: str
    device: Device
    mode: str
    batch_size: int                      # global batch
    seq_len: int | None
    parallelism: Parallelism
    latency_ms: float
    parts: dict[str, float]              # compute, tp_comm, ep_alltoall, cp_comm (the context-parallel
                                         # exchanges left exposed), pp_p2p, pp_bubble,
                                         # dp_allreduce (the gradients' all-reduce, or reduce-scatter with
                                         # ZeRO), dp_gather (ZeRO's parameter all-gathers), embedding_allreduce,
                                         # optimizer (ms)
    stages: pd.DataFrame                 # per stage and micro-batch: forward_ms, backward_ms, tp_comm_ms, ep_comm_ms,
    #                                      cp_comm_ms, p2p_ms,
    #                                      tp_overlap_ms (what Megatron-LM's overlap changed in tp_comm_ms)
    per_gpu: Any                         # the api.Prediction of one micro-batch on one GPU (all stages)
    roofline_ms: float = float("nan")    # the same composition with every kernel at its roofline
    notes: tuple[str, ...] = field(default_factory=tuple)
    memory_breakdown: dict[str, float] | None = None   # bytes on the busiest GPU (the first stage), approximate

    @property
    def memory_peak_bytes(self) -> float | None:
        return None if self.memory_breakdown is None else float(sum(self.memory_breakdown.values()))

    @property
    def memory_fits(self) -> bool | None:
        peak = self.memory_peak_bytes
        return None if peak is None else peak <= self.device.memory_bytes

    @property
    def throughput(self) -> tuple[float, str]:
        """The whole run's (rate, unit): the global batch's tokens (sequence models) or samples per second."""
        unit = self.per_gpu.throughput[1]     # tokens, images or samples
        per_step = self.batch_size * (self.seq_len if unit == "tokens/s" and self.seq_len else 1)
        return per_step / max(self.latency_ms, 1e-12) * 1e3, unit

    @property
    def efficiency(self) -> Any:
        """MFU, HFU and MBU per GPU (:class:`neusight.efficiency.Efficiency`): one GPU's share of the step's
        matrix-multiply FLOPs and DRAM traffic (the forecast micro-batch on its shard of every stage, times the
        micro-batches, over the pipeline stages; the optimizer's traffic once, in the share of its time the step
        spends on it) over the step's time, communication and bubbles included."""
        from dataclasses import replace

        per = self.per_gpu
        e = per.efficiency
        share = self.parallelism.microbatches / self.parallelism.pp
        k = per.kernels
        opt_bytes = float(k.loc[k["phase"] == "optimizer", "bytes"].sum())
        opt_ms = per.phases.get("optimizer", 0.0)
        opt_share = self.parts.get("optimizer", 0.0) / opt_ms if opt_ms > 0 else 0.0
        return replace(e, model_flops=e.model_flops * share, hardware_flops=e.hardware_flops * share,
                       dram_bytes=(e.dram_bytes - opt_bytes) * share + opt_bytes * opt_share,
                       seconds=max(self.latency_ms, 1e-12) / 1e3)

    def run_line(self, on: str) -> str:
        """What ran ``on`` which GPUs ("8 x NVIDIA H100 ..."): the model, mode, batch, sequence and layout."""
        par = self.parallelism
        return (f"{self.model}: {self.mode}, global batch {self.batch_size}"
                + (f", seq {self.seq_len}" if self.seq_len else "")
                + f" on {on} (dp {par.dp}, "
                + (f"cp {par.cp}{'' if par.cp_comm == 'p2p' else f' ({par.cp_comm})'}, " if par.cp > 1 else "")
                + (f"ep {par.ep}, " if par.ep > 1 else "") + f"tp {par.tp}{' with sp' if par.sp else ''}, "
                + f"pp {par.pp}, "
                + (f"interleaved: {par.vpp} chunks per GPU, " if par.vpp > 1 else "")
                + f"{par.microbatches} micro-batch{'es' if par.microbatches > 1 else ''} per replica)")

    def summary(self) -> str:
        lines = [self.run_line(f"{self.parallelism.gpus} x {self.device.name}"), f"total: {self.latency_ms:,.2f} ms"]
        lines.append("parts: " + " | ".join(f"{k} {v:,.2f} ms" for k, v in self.parts.items() if v > 0))
        lines.append(self.efficiency.line().replace("efficiency:", "efficiency per GPU:", 1))
        if self.memory_breakdown is not None:
            lines.append(f"memory per GPU (first stage, approximate): {self.memory_peak_bytes / 2**30:,.1f} GiB of "
                         f"{self.device.memory_gib:g} GiB: {'fits' if self.memory_fits else 'does NOT fit'}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)



def parallel_ranking_table(preds: list[ParallelPrediction],
                           costs: list[dict[str, Any] | None] | None = None) -> pd.DataFrame:
    """Forecasts of one multi-GPU run on several GPU types as a table, fastest first: rank, GPU, ms, time vs
    fastest, the whole run's throughput, MFU and MBU per GPU, the memory peak of its busiest GPU against the GPU's
    memory and whether it fits (with a memory forecast), the cost (``costs``: per forecast, None or
    ``{"usd": .., "per": "1M tokens"}``, all the run's GPUs paid) and whether the predictor was trained on the GPU."""
    from neusight.api import ranked

    rows = []
    for p, cost in zip(preds, costs or [None] * len(preds)):
        rate, unit = p.throughput
        eff = p.efficiency
        row: dict[str, Any] = {"GPU": p.device.key, "ms": p.latency_ms, unit: rate, "MFU %": 100 * eff.mfu,
                               "MBU %": 100 * eff.mbu}
        if p.memory_peak_bytes is not None:
            row["memory per GPU GiB"] = f"{p.memory_peak_bytes / 2**30:,.1f} of {p.device.memory_gib:g}"
            row["fits"] = "yes" if p.memory_fits else "no"
        if cost is not None:
            row[f"USD per {cost['per']}"] = cost["usd"]
        row["predictor trained on it"] = "yes" if p.device.key in tuple(p.per_gpu.predictor_devices) else "no"
        rows.append(row)
    return ranked(rows, "ms")


def predict_parallel(model: Any, device: Device | str, batch_size: int, seq_len: int | None = None,
                     mode: str = "training", *, dp: int = 1, tp: int = 1, pp: int = 1, microbatches: int = 1,
                     head: str | None = None, optimizer: str | None = None, predictor: Any = None,
                     fused: bool = False, megatron: bool = False, memory: bool = True, tf32: Any = None,
                     zero: int = 0, ep: int = 1, gpus_per_node: int = GPUS_PER_NODE,
                     internode_gbps: float = INTERNODE_GBPS, nics_per_node: int | None = None,
                     cache: dict | None = None, host_us: float | None = None, vpp: int = 1, sp: bool = False,
                     overlap_grad_reduce: bool = False, overlap_param_gather: bool = False, nvls: bool = True,
                     cp: int = 1, cp_comm: str = "p2p", **trace_kwargs: Any) -> ParallelPrediction:
    """Forecast one step of ``model`` with global batch ``batch_size`` on ``dp x cp x tp x pp`` GPUs of ``device``.

    ``batch_size`` is split among the ``dp`` replicas, each replica's share into ``microbatches``. Training
    = forward + backward (+ the gradient all-reduce when dp > 1, + ``optimizer`` if given); inference = forward.
    With ``memory``, the first stage's GPU's memory: the single-GPU forecast of one micro-batch on the
    tensor-parallel shard, with that stage's share of the weights, gradients and optimizer state and the activations of
    min(microbatches, pp) micro-batches in flight on the first stage (1F1B), each holding 1 / pp of the layers.

    ``zero`` (0-3): the ZeRO stage of the data-parallel replicas (module docstring, item 3); 3 is also FSDP's
    full sharding. ``ep``: expert parallelism of a mixture-of-experts model over groups of ``ep`` of the ``dp``
    replicas (item 4). ``tf32`` as in :func:`neusight.predict`. ``megatron=True`` forecasts a Megatron-LM training
    step as its ``train_step`` runs it: Megatron's kernels (:mod:`neusight.graph.megatron`), zeroing of the
    gradient buffer, the loss, gradient clipping to norm 1.0 (``clip_grad_norm=`` to change it) and a fused AdamW step (``optimizer="adamw-fused"`` unless given), each
    stage stepping its own parameters (with pipeline stages and tied embeddings the last stage holds a copy of
    the word embeddings, whose gradients the first and the last stage all-reduce), the gradient buffer divided by
    dp before its all-reduce (:func:`megatron_grad_division_ms`, in ``parts["optimizer"]``) and, with tp > 1, the
    backward all-reduces overlapped with the weight-gradient GEMMs (:func:`async_tp_delta_ms`).

    ``cache``: a dict the caller keeps between calls (:func:`neusight.plan.plan_parallel` does): the trace of one
    GPU's micro-batch, its forecast and its memory report are kept in it under everything they depend on, so
    layouts with the same micro-batch size and ``tp`` (differing in ``dp``, ``pp``, ``zero`` or the links) reuse them,
    and other GPUs on the same software path (their attention backends and experts' kernels,
    :func:`neusight.graph.tracer.trace_key`) reuse the trace, as :func:`neusight.api.predict_many` does.
    ``host_us``: the host's time per kernel launch on each GPU (:func:`neusight.api.host_waits_ms`; None: not
    modelled).
    ``gpus_per_node``, ``internode_gbps``, ``nics_per_node``: the nodes the GPUs sit on, each network port's
    bidirectional GB/s and a node's ports (None: one per GPU), from which each group's links follow (:class:`Links`).
    ``nvls``: all-reduces may run as NCCL's NVLS (inside a node) or NVLS_TREE (across nodes) where the GPUs'
    NVSwitches have NVLink SHARP (``Device.nvls``: HGX H100, H200, B200; :data:`NCCL_NVLS_EFFICIENCY`); False
    forecasts NCCL with ``NCCL_NVLS_ENABLE=0`` (rings and trees only).
    ``vpp``: model chunks per pipeline GPU under Megatron-LM's interleaved schedule (module docstring, item 2; 1:
    plain 1F1B); pp must divide ``microbatches`` and pp x vpp the transformer blocks.
    ``sp``: Megatron-LM's sequence parallelism over the ``tp`` GPUs (module docstring, item 1); needs tp > 1.
    ``cp``: context parallelism (module docstring, item 5): each sequence split over ``cp`` GPUs (``seq_len`` a
    multiple of 2 x cp; of cp with ``cp_comm="a2a"``), its attention a ring of fused kernels
    (``attn_implementation`` sdpa or flash-attn), the gradients reduced over ``dp x cp`` GPUs (and ZeRO sharding
    over as many); not with ``ep``, ``kv_cache`` or ``megatron``. ``cp_comm``: how the ``cp`` GPUs exchange
    attention's inputs (:data:`CP_COMMS`): ``"p2p"`` Transformer Engine's ring (its default), ``"all_gather"`` the
    keys and values gathered first, ``"a2a"`` DeepSpeed Ulysses' all-to-alls, heads split over the GPUs
    (:func:`split_context`).
    ``overlap_grad_reduce``: the gradients' all-reduce (reduce-scatter with ZeRO) runs beside the last micro-batch's
    backward pass, block by block as their gradients are done (module docstring, item 3); plain data parallelism
    (no ZeRO, tp, pp, ep, not ``megatron``) by PyTorch DDP's buckets; only what outlasts the backward pass counts.
    Needs dp > 1 and training.
    ``overlap_param_gather`` (ZeRO stages 1-3): the parameters' all-gathers overlap the compute (module docstring,
    item 3): with ZeRO 1 / 2 the updated parameters are gathered during the next step's forward pass, each block's
    before it runs (Megatron-LM's ``--overlap-param-gather``); with ZeRO 3 (FSDP) each block's gather is prefetched
    while the block before it runs, in the forward and in the backward pass.

    Examples
    --------
    >>> p = predict_parallel("gpt2", "h100-sxm5-80gb", batch_size=8, seq_len=128, dp=2, tp=2)
    >>> p.parallelism.gpus, p.parts["tp_comm"] > 0, p.parts["dp_allreduce"] > 0
    (4, True, True)
    """
    from neusight.api import check_host_us, predict_graph
    from neusight.graph.tracer import trace, trace_key

    check_host_us(host_us)
    par = Parallelism(dp, tp, pp, microbatches, ep, vpp, sp, cp, cp_comm)
    if not isinstance(overlap_grad_reduce, bool):
        raise InputError(f"overlap_grad_reduce={overlap_grad_reduce!r} is not true or false. Fix: "
                         "overlap_grad_reduce=true (the gradients' reduction beside the backward pass) or leave it out")
    if overlap_grad_reduce and (par.replicas == 1 or mode != "training"):
        raise InputError("overlap_grad_reduce=true overlaps the data-parallel replicas' gradient reduction with the "
                         f"backward pass; {'dp=1 has none' if par.replicas == 1 else 'this run is inference'}. Fix: "
                         f"{'dp > 1' if par.replicas == 1 else 'mode=training'}, or leave overlap_grad_reduce out")
    if not isinstance(overlap_param_gather, bool):
        raise InputError(f"overlap_param_gather={overlap_param_gather!r} is not true or false. Fix: "
                         "overlap_param_gather=true (ZeRO's parameter gathers beside the compute) or leave it out")
    if overlap_param_gather and not zero:
        raise InputError("overlap_param_gather=true overlaps ZeRO's parameter all-gathers with the compute; zero=0 "
                         "gathers none. Fix: zero=1, 2 or 3 (with dp > 1), or leave overlap_param_gather out")
    if not isinstance(nvls, bool):
        raise InputError(f"nvls={nvls!r} is not true or false. Fix: nvls=false (NCCL without NVLink SHARP, as "
                         "NCCL_NVLS_ENABLE=0 runs it) or leave it out")
    device = load_device(device)
    links = Links.of(par, device, gpus_per_node, internode_gbps, nics_per_node, nvls)
    if batch_size % (dp * microbatches):
        raise InputError(f"batch_size={batch_size} does not split into dp={dp} replicas x {microbatches} "
                         f"micro-batches. Fix: a batch_size that is a multiple of {dp * microbatches}")
    micro = batch_size // (dp * microbatches)
    training = mode == "training"
    _check_zero(zero, par, training)
    if ep > 1 and megatron:
        raise InputError(f"ep={ep} with megatron=True is not modelled (the Megatron-LM kernels are GPT-2's, without "
                         "experts). Fix: leave one of them out")
    if megatron and trace_kwargs.get("lora_rank") is not None:
        raise InputError(f"lora_rank={trace_kwargs['lora_rank']} with megatron=True is not modelled (Megatron-LM's "
                         "kernels are those of full training). Fix: leave one of them out")
    if megatron and training:
        optimizer = optimizer or "adamw-fused"
        trace_kwargs = {"clip_grad_norm": 1.0, "zero_grad": True, **trace_kwargs}
    if pp > 1 and trace_kwargs.get("images") is not None:
        raise InputError(f"pp={pp} with images={trace_kwargs['images']}: how pipeline stages share an image encoder's "
                         "layers and the language model's is not modelled (its blocks would be split evenly, as if "
                         "of equal cost). Fix: pp=1 (data parallelism), or leave images out")
    if cp > 1:
        if megatron:
            raise ContextParallelError(f"cp={cp} with megatron=True is not modelled (Megatron-LM's kernels here are "
                                       "GPT-2's eager attention; its context parallelism runs Transformer Engine's). "
                                       "Fix: leave one of them out (cp with attn_implementation='sdpa' or "
                                       "'flash_attention_2')")
        if trace_kwargs.get("kv_cache") is not None:
            raise ContextParallelError(f"cp={cp} with kv_cache={trace_kwargs['kv_cache']} (a generation step) is not "
                                       "modelled: context parallelism here splits a whole sequence's prompt or "
                                       "training step. Fix: cp=1")
        check_context_seq_len(seq_len, cp, cp_comm)
    local_seq = seq_len // cp if cp > 1 else seq_len
    traced = (model if isinstance(model, str) else id(model), micro, local_seq, mode, head, optimizer, tp, ep, cp,
              repr(sorted(trace_kwargs.items())))
    key = (*traced, device, id(predictor) if predictor is not None and not isinstance(predictor, str) else predictor,
           fused, megatron, repr(tf32), host_us, sp, cp_comm)
    kept = cache.get(key) if cache is not None else None
    if kept is None:
        # one trace per software path (as predict_many shares them): GPUs whose attention backends and experts'
        # kernels are the same run the same kernels; the forecast, its checks and the memory are per GPU
        graphs = cache.setdefault(("traces", *traced), {}) if cache is not None else {}
        path = trace_key(graphs, device, trace_kwargs)
        if path not in graphs:
            graphs[path] = trace(model, micro, local_seq, mode, head=head,
                                 optimizer=optimizer if training else None, tensor_parallel=tp, expert_parallel=ep,
                                 device=device, context_parallel=cp, **trace_kwargs)
        g = graphs[path]
        check_context_parallel(g, cp, cp_comm)
        kept = {"graph": g, "one": predict_graph(g, device, predictor, fused=fused, megatron=megatron, tf32=tf32,
                                                 host_us=host_us, sequence_parallel=tp if sp else 1,
                                                 context_parallel=cp, context_comm=cp_comm)}
        if cache is not None:
            cache[key] = kept
    g, one = kept["graph"], kept["one"]
    k = one.kernels
    index = _block_index(k)
    block = _block_numbers(k, index)
    stage = _stages(k, block, pp)
    tokens, hidden = _activation_shape(k, block) if tp > 1 or pp > 1 else (0.0, 0.0)
    act_bytes = tokens * hidden * (2.0 if g.amp or g.dtype in ("float16", "bfloat16") else 4.0)   # one micro-batch
    n = int(block.max()) + 1 if block.notna().any() else 0       # blocks are numbered 0 .. n - 1
    if pp > max(n, 1):
        raise InputError(f"pp={pp} pipeline stages for the {n} transformer blocks of {g.model}: a stage would hold "
                         f"none. Fix: pp <= {max(n, 1)}")
    if vpp > 1 and n % (pp * vpp):
        raise InputError(f"vpp={vpp} chunks on each of pp={pp} stages need a number of transformer blocks that "
                         f"{pp * vpp} divides; {g.model} has {n}. Fix: a vpp with {n} % (pp x vpp) == 0, or vpp=1")
    blocks_per_stage = [sum(1 for b in range(n) if b * pp // n == s) for s in range(pp)]

    ep_ms = _expert_alltoall_ms(g, index, n, par, training, device, links.ep)
    columns = g.tp_columns if megatron else ()    # Megatron-LM overlaps their backward collectives with GEMMs

    def cp_ms(column: str) -> list[float]:         # each stage's exposed ring exchanges of one micro-batch
        exposed = context_exchange_ms(k, cp, device, links.cp, column, cp_comm)
        return [float(exposed[stage == s].sum()) for s in range(pp)]

    parts, stages = _compose(k, stage, blocks_per_stage, "latency_ms", par, training, act_bytes, device, links, ep_ms,
                             columns, tokens, cp_ms("latency_ms"))
    roofline, roof_stages = _compose(k, stage, blocks_per_stage, "roofline_ms", par, training, act_bytes, device,
                                     links, ep_ms, columns, tokens, cp_ms("roofline_ms"))
    held, tied_bytes = _stage_parameters(g, index, n, pp)
    share = max(held)                                   # the busiest stage's parameters steps and all-reduces
    grad_bytes = sum(t.numel * t.itemsize for t in g.grads) * share
    param_bytes = sum(t.numel * t.itemsize for t in g.params) * share
    expert_share = _expert_parameter_share(g) if ep > 1 else 0.0
    units = _unit_parameter_bytes(g, index) if zero == 3 else []

    rep = par.replicas      # the GPUs holding the same weights: dp x cp

    def sharded_ms(nbytes: float) -> float:   # ZeRO's reduce-scatter or all-gather: experts over dp / ep replicas
        return (allgather_ms(nbytes * (1 - expert_share), rep, device, links.dp)
                + allgather_ms(nbytes * expert_share, rep // ep, device, links.dp))

    def reduce_ms(nbytes: float) -> float:    # the gradients': ZeRO's reduce-scatter, else an all-reduce (the
        if zero:                               # experts' over the dp / ep replicas that hold the same experts)
            return sharded_ms(nbytes)
        return (allreduce_ms(nbytes * (1 - expert_share), rep, device, links.dp)
                + allreduce_ms(nbytes * expert_share, rep // ep, device, links.dp))

    if zero == 3:   # per block (and the rest): gather before forward and backward, reduce-scatter the gradients
        grad_share = grad_bytes / max(sum(units), 1.0)
        parts["dp_allreduce"] = sum(reduce_ms(u * grad_share) for u in units)
        parts["dp_gather"] = sum(2 * sharded_ms(u) for u in units)
    elif zero:      # reduce-scatter the gradients, all-gather the updated parameters
        parts["dp_allreduce"] = reduce_ms(grad_bytes)
        parts["dp_gather"] = sharded_ms(param_bytes)
    else:
        parts["dp_allreduce"] = reduce_ms(grad_bytes) if training else 0.0
        parts["dp_gather"] = 0.0
    tp_ms = 2 * allreduce_ms(act_bytes, tp, device, links.tp) if tp > 1 else 0.0   # per block and pass

    def tp_bwd_ms(s: int, column: str) -> float:   # per block of stage s in the backward pass, net of Megatron-LM's
        frame = stages if column == "latency_ms" else roof_stages      # overlap with the weight-gradient GEMMs
        return tp_ms + float(frame.loc[s, "tp_overlap_ms"]) / max(blocks_per_stage[s], 1)

    # plain data parallelism (no ZeRO, tp, pp, ep, not Megatron-LM) overlaps as PyTorch DDP does: by its buckets
    ddp = (overlap_grad_reduce and not zero and not megatron and tp == 1 and pp == 1 and ep == 1
           and bool(g.param_names))
    if ddp:
        trainable = [(name, t) for name, t in zip(g.param_names, g.params) if t.requires_grad]
        names = [name for name, _ in trainable]
        nbytes = [t.numel * t.itemsize for _, t in trainable]
        ratio = grad_bytes / max(sum(nbytes), 1.0)      # gradient bytes per parameter byte
        sizes = [b * ratio for b in nbytes]
        backward = k["phase"] == "backward"

        def ddp_exposed(column: str) -> tuple[float, list[float]]:
            buckets = ddp_buckets(k, backward, names, sizes, column)
            return (exposed_bucket_reduce_ms(buckets, float(k.loc[backward, column].sum()), reduce_ms),
                    [b for _, b in buckets])

        alone = parts["dp_allreduce"]
        parts["dp_allreduce"], bucket_bytes = ddp_exposed("latency_ms")
        n_buckets = len(bucket_bytes)
        dp_roofline = ddp_exposed("roofline_ms")[0]
        # DDP's own kernels on each gradient (into its bucket, and back): told, not charged, since ZeRO's, FSDP's and
        # Megatron-LM's per-parameter kernels are not modelled either and layouts are to compare on the same footing
        copies_ms = ddp_bucket_copies_ms([t.numel for _, t in trainable], g.grads[0].dtype if g.grads else "float32",
                                         device, predictor)[0]
    elif overlap_grad_reduce:   # the busiest stage's units, each reduced as soon as its backward pass is done
        busiest = max(range(pp), key=lambda i: held[i])
        units_s = _stage_units(g, index, n, pp)[busiest]
        ratio = grad_bytes / max(sum(units_s.values()), 1.0)      # gradient bytes per parameter byte
        grads = {u: b * ratio for u, b in units_s.items()}
        alone = parts["dp_allreduce"]
        parts["dp_allreduce"] = exposed_grad_reduce_ms(k, stage == busiest, grads, "latency_ms", reduce_ms,
                                                       tp_bwd_ms(busiest, "latency_ms"))
        dp_roofline = exposed_grad_reduce_ms(k, stage == busiest, grads, "roofline_ms", reduce_ms,
                                             tp_bwd_ms(busiest, "roofline_ms"))
    else:
        dp_roofline = parts["dp_allreduce"]
    gather_roofline, gather_alone = parts["dp_gather"], parts["dp_gather"]
    if overlap_param_gather:   # ZeRO: pp == 1, one stage; every unit's parameters gathered before it runs
        units_0 = _stage_units(g, index, n, 1)[0]
        gathers = {u: sharded_ms(b) for u, b in units_0.items()}
        scatters = {u: reduce_ms(b * grad_bytes / max(sum(units_0.values()), 1.0)) for u, b in units_0.items()}
        whole = pd.Series(True, index=k.index)

        def exposed(column: str) -> tuple[float, float | None]:
            """(exposed gathers, exposed reduce-scatters if they overlap too) under ``column``'s kernel times."""
            kw = dict(gathers=gathers, prefetch=1 if zero == 3 else None)
            fwd = exposed_collectives_ms(k, whole, ("forward", "loss"), column, tp_block_ms=tp_ms, **kw)
            if zero < 3:     # gathered once, after the step: during the next forward pass
                return fwd, None
            kw["tp_block_ms"] = tp_bwd_ms(0, column)
            bwd = exposed_collectives_ms(k, whole, ("backward",), column, **kw)
            if not overlap_grad_reduce:
                return fwd + bwd, None
            both = exposed_collectives_ms(k, whole, ("backward",), column, reduces=scatters, **kw)
            return fwd + bwd, both - bwd     # the reduce-scatters: what they add to the gathers' backward

        parts["dp_gather"], scattered = exposed("latency_ms")
        parts["dp_allreduce"] = parts["dp_allreduce"] if scattered is None else scattered
        gather_roofline, scattered = exposed("roofline_ms")
        dp_roofline = dp_roofline if scattered is None else scattered
    parts["embedding_allreduce"] = allreduce_ms(tied_bytes, 2, device, links.pp) if training and pp > 1 else 0.0
    opt = k["phase"] == "optimizer"
    shards = _zero_shards(rep, ep, expert_share)
    stepped = share / shards if zero else share           # with ZeRO each GPU steps its 1 / dp of the parameters
    parts["optimizer"] = float(k.loc[opt, "latency_ms"].sum()) * stepped
    opt_roofline = float(k.loc[opt, "roofline_ms"].sum()) * stepped
    if megatron and training:    # the DDP buffer divided by dp before its all-reduce: the busiest stage's gradients
        div_ms, div_roofline = megatron_grad_division_ms(sum(t.numel for t in g.grads) * share, device, predictor)
        parts["optimizer"] += div_ms
        opt_roofline += div_roofline
    roofline_ms = (sum(roofline.values()) + dp_roofline + gather_roofline + parts["embedding_allreduce"]
                   + opt_roofline)
    breakdown = None
    buffers = context_buffer_bytes(g.kernels, cp, cp_comm)     # cp's exchange buffers per attention op ({}: none)
    if memory:
        from neusight.memory import estimate_memory

        if "memory" not in kept:
            kept["memory"] = estimate_memory(g, device, fused=fused, transient=buffers)
        report = kept["memory"]
        b = _zero_breakdown(report, zero, shards, units) if zero else dict(report.breakdown)
        if sp:      # what the sequence-parallel kernels save for the backward pass: 1 / tp of it per GPU
            if "sp_saved" not in kept:
                from neusight.memory import saved_bytes_by_op

                made = g.kernels.loc[sequence_parallel_mask(g.kernels) & (g.kernels["phase"] == "forward"),
                                     "op_index"]
                saved = saved_bytes_by_op(g, fused=fused, device=device)
                kept["sp_saved"] = float(saved[saved.index.isin(made)].sum())
            b["activations"] = b["activations"] - kept["sp_saved"] * (1.0 - 1.0 / tp)
        in_flight = min(microbatches, pp) / pp if pp > 1 else 1.0
        in_flight *= 1.0 + (pp - 1) / (pp * vpp) if vpp > 1 else 1.0     # interleaved: more chunks in flight
        breakdown = {key: v * held[0] if key in ("weights", "gradients", "optimizer") else
                     v * in_flight if key == "activations" else float(v) for key, v in b.items()}
    notes = tuple(one.notes) + ((f"{par.gpus} GPUs over {device.interconnect_gbps:g} GB/s links "
                                 "(interconnect_gbps); collectives modelled, not measured",) if par.gpus > 1 else ())
    # each group's link against the same group inside one node, and against the GPUs' own links
    field_of = {name: f for name, f, n in (("tensor-parallel", "tp", tp), ("data-parallel", "dp", rep),
                                           ("context-parallel", "cp", cp), ("expert-parallel", "ep", ep),
                                           ("pipeline", "pp", pp)) if n > 1}
    one_node = Links.of(par, device, par.gpus, internode_gbps)
    beyond = [name for name, f in field_of.items() if getattr(one_node, f).gbps < device.interconnect_gbps]
    if beyond:
        notes += (f"{device.key}'s {device.interconnect_gbps:g} GB/s links join groups of {device.interconnect_group} "
                  f"GPUs (interconnect_group: {'NVLink bridges' if device.vendor == 'nvidia' else 'a hive'}); the "
                  f"{_joined(beyond)} collectives span more and run over PCIe at {device.pcie_gbps:g} GB/s "
                  "(pcie_gbps)",)
    if links.nodes > 1:
        crossing = [name for name, f in field_of.items() if getattr(links, f).gbps < getattr(one_node, f).gbps]
        shared = nics_per_node is not None and nics_per_node < gpus_per_node
        ports = (f"{nics_per_node} network ports of {internode_gbps:g} GB/s per node (nics_per_node, internode_gbps, "
                 f"bidirectional), {network_share_gbps(internode_gbps, nics_per_node, gpus_per_node):g} GB/s per GPU "
                 "as all its GPUs share them" if shared else
                 f"{internode_gbps:g} GB/s per GPU (internode_gbps, bidirectional)")
        notes += (f"{links.nodes} nodes of {gpus_per_node} GPUs (gpus_per_node): "
                  + (f"the {_joined(crossing)} collectives cross nodes over {ports}, a ring's or tree's channels "
                     "spread over the ports of the group's GPUs on each node ("
                     + ", ".join(f"{name}: {getattr(links, field_of[name]).ring_gbps:g} GB/s" for name in crossing)
                     + ")" if crossing else "no collective group runs slower for it (each "
                     "stays within a node, or the network is as fast as the GPUs' own links)")
                  + "; ranks ordered tensor-parallel innermost, pipeline stages outermost",)
    reducing = [name for name, f in field_of.items() if (f == "tp" or f == "dp" and training)
                and (path := getattr(links, f)).kind == "nvlink" and (path.nodes == 1 or path.rails > 1)]
    if device.nvls and reducing:
        notes += (f"the {_joined(reducing)} all-reduces run over nodes whose NVSwitches sum and multicast "
                  + ("(NVLink SHARP): NCCL's NVLS algorithm (NVLS_TREE across nodes) where its cost model finds it "
                     "faster than a ring or tree (nvls=false: without it, as NCCL_NVLS_ENABLE=0)" if nvls else
                     "(NVLink SHARP), not used here (nvls=false: rings and trees only, as NCCL_NVLS_ENABLE=0)"),)
    if tp > 1 and act_bytes > 0:
        notes += (f"each tensor-parallel all-reduce (two per block in the forward pass"
                  f"{', two in the backward' if training else ''}"
                  f"{'; with sp a reduce-scatter + all-gather, charged as the all-reduce' if sp else ''}"
                  f"): {collective_call(act_bytes, tp, device, links.tp)} "
                  f"(its cost model's fastest algorithm and protocol for that size)",)
    if rep > 1 and training and not zero and ep == 1 and not overlap_grad_reduce:
        notes += (f"the gradients' all-reduce: {collective_call(grad_bytes, rep, device, links.dp)}",)
    if rep > 1 and training and zero and ep == 1:
        if zero == 3:
            unit = _median(units)
            what = f"{len(index)} transformer blocks and the rest" if index else "the whole model, one unit"
            notes += (f"ZeRO stage 3's collectives, per unit of parameters ({what}): the median unit's parameters "
                      "all-gathered twice a step, before its forward and "
                      f"its backward pass, {collective_call(unit, rep, device, links.dp, 1)}; its gradients "
                      "reduce-scattered once, "
                      f"{collective_call(unit * grad_bytes / max(sum(units), 1.0), rep, device, links.dp, 1)}",)
        else:
            notes += (f"ZeRO stage {zero}'s collectives, one call each: the gradients' reduce-scatter, "
                      f"{collective_call(grad_bytes, rep, device, links.dp, 1)}; the updated parameters' all-gather, "
                      f"{collective_call(param_bytes, rep, device, links.dp, 1)}",)
    if columns and training and tp > 1:
        change = par.microbatches * float(stages["tp_overlap_ms"].sum())
        notes += (f"Megatron-LM overlaps each column-parallel projection's backward "
                  f"{'reduce-scatter' if sp else 'all-reduce'} of its input gradient with its weight-gradient GEMM "
                  + ("and all-gathers its saved input again beside its input-gradient GEMM " if sp else "")
                  + f"(asynchronous, its default): tensor-parallel communication {change:+.1f} ms in all (summed over "
                  "the stages' GPUs), the collectives' share of the SMs not modelled",)
    if ep > 1:
        n_layers = len({path for path, _, _ in g.expert_dispatch})
        per_call = _median([b for _, phase, b in g.expert_dispatch if phase == "forward"])
        notes += (f"expert parallelism: each of {ep} GPUs holds 1/{ep} of the experts of the {n_layers} experts "
                  f"layer{'s' if n_layers != 1 else ''} and runs them on the token rows of all {ep}, sent and returned "
                  f"by an all-to-all each ({per_call / 2**20:,.1f} MiB from each GPU a call, "
                  f"{_duration(alltoall_ms(per_call, ep, device, links.ep))}; two more per layer in the backward "
                  "pass); routing balanced, all-to-alls not overlapped with compute",)
    if sp:
        n_sp = int(sequence_parallel_mask(g.kernels).sum())
        notes += (f"sequence parallelism: {n_sp} kernels of the blocks (layer norms, dropouts, residual adds) run on "
                  f"1/{tp} of the tokens per GPU and save 1/{tp} of their activations; all-reduces as reduce-scatter "
                  "+ all-gather of the same volume",)
    if cp > 1:
        calls = k[(k["cp_step"] == 0) & (k["cp_parent"] >= 0)]
        fwd = calls[calls["kernel"] != ATTENTION_BWD_KERNEL]
        chunk = float(fwd["cp_kv_bytes"].iloc[0])             # one GPU's keys and values of one call
        alone = float(context_exchange_ms(k.assign(latency_ms=0.0), cp, device, links.cp, "latency_ms",
                                          cp_comm).sum())
        split = (f"each sequence of {seq_len:,} tokens split over {cp} GPUs, {local_seq:,} tokens each"
                 + ("" if cp_comm == "a2a" else f" (two chunks of {local_seq // 2:,}, for causal load balance)"))
        how = {"p2p": f"each of its {len(calls)} attention calls a ring of {cp} steps, the GPU's own chunks first, "
                      f"then {cp - 1} of the other GPUs' keys and values ({chunk / 2**20:,.1f} MiB a step, "
                      f"{_duration(p2p_ms(chunk, device, links.cp))}; twice as much with their gradients in the "
                      "backward pass), each received beside the previous step's kernels; each step's partial results "
                      "folded in by elementwise kernels (the output rescaled and added; the gradients accumulated)",
               "all_gather": f"each of its {len(calls)} attention calls first all-gathers the sequence's keys and "
                             f"values ({cp} x {chunk / 2**20:,.1f} MiB, "
                             f"{_duration(allgather_ms(cp * chunk, cp, device, links.cp))}; in the backward pass "
                             "again, then their gradients reduce-scattered), then runs a kernel per chunk of the "
                             "GPU's queries against the keys up to it (cp_comm_type all_gather)",
               "a2a": f"each of its {len(calls)} attention calls exchanges queries, keys and values all-to-all so "
                      f"that each GPU runs 1/{cp} of the heads over the whole sequence, and the output back (in the "
                      "backward pass their gradients; DeepSpeed Ulysses, cp_comm_type a2a)"}[cp_comm]
        notes += (f"context parallelism ({cp_comm}): {split}; {how}: {alone:,.1f} ms of exchanges per micro-batch, "
                  f"{stages['cp_comm_ms'].sum():,.1f} ms of them exposed (cp_comm); the gradients reduced over dp x "
                  f"cp = {rep} GPUs. The exchanges' buffers count in the memory while each attention call runs "
                  f"(up to {max(buffers.values()) / 2**20:,.1f} MiB a call)",)
    if ((overlap_grad_reduce and not ddp) or overlap_param_gather) and not index:
        notes += (f"{g.model} has no transformer blocks (the units the overlap is modelled in), so its parameters "
                  "are gathered and its gradients reduced as one unit, before and after the pass: the overlap "
                  "options hide nothing here" + (" (without ZeRO its gradients' all-reduce overlaps the backward "
                                                 "pass by buckets, as PyTorch DDP runs it)" if zero else ""),)
    if (training and rep > 1 and not zero and not megatron and not overlap_grad_reduce and tp == 1 and pp == 1
            and ep == 1):
        notes += ("the gradients' all-reduce runs after the backward pass here (Megatron-LM's default); PyTorch DDP "
                  "runs it beside the backward pass by buckets: overlap_grad_reduce=true forecasts that",)
    if ddp:
        notes += (f"the gradients' all-reduce overlaps the backward pass as PyTorch DDP runs it (overlap_grad_reduce): "
                  f"{n_buckets} bucket{'s' if n_buckets != 1 else ''} (the first of 1 MiB, then 25 MiB each) in "
                  f"the order their gradients are ready, one collective at a time (the median bucket: "
                  f"{collective_call(_median(bucket_bytes), rep, device, links.dp)}): "
                  f"{alone:,.1f} ms of it alone, "
                  f"{parts['dp_allreduce']:,.1f} ms left exposed after the last backward kernel (kernels sharing the "
                  "GPU with it are not slowed in the forecast). Not included: DDP's two elementwise kernels per "
                  f"parameter (each gradient divided into its bucket and copied back), {copies_ms:,.2f} ms by this "
                  "forecast's kernel model (ZeRO's, FSDP's and Megatron-LM's per-parameter kernels are not modelled "
                  "either, so layouts compare alike; with gradient_as_bucket_view=True one division per parameter "
                  "remains)",)
    elif overlap_grad_reduce:
        what = "reduce-scatter" if zero else "all-reduce"
        notes += (f"the gradients' {what} overlaps the backward pass (overlap_grad_reduce), one collective per "
                  f"transformer block as its gradients are done: {alone:,.1f} ms of it alone, "
                  f"{parts['dp_allreduce']:,.1f} ms left exposed after the busiest stage's last backward pass "
                  "(kernels sharing the GPU with it are not slowed in the forecast)",)
    if zero:
        what = ("optimizer state", "optimizer state and gradients", "optimizer state, gradients and weights")[zero - 1]
        notes += (f"ZeRO stage {zero}{' (FSDP full sharding)' if zero == 3 else ''}: {what} sharded over the {rep} "
                  + (f"data-parallel replicas (the experts' over the {rep // ep} holding the same experts)"
                     if ep > 1 else "data-parallel replicas" + (" (dp x cp)" if cp > 1 else ""))
                  + ("" if overlap_grad_reduce and overlap_param_gather else
                     "; its parameter all-gathers are not overlapped with compute (an upper bound on their time)"
                     if overlap_grad_reduce else
                     "; its gradients' reduce-scatter is not overlapped with compute (an upper bound on its time)"
                     if overlap_param_gather else
                     "; its collectives are not overlapped with compute (an upper bound on their time)"),)
    if overlap_param_gather:
        notes += ("the parameters' all-gathers overlap the compute (overlap_param_gather): "
                  + ("each block's prefetched while the block before it runs, in the forward and the backward pass"
                     if zero == 3 else "each block's during the next step's forward pass, before the block runs")
                  + f": {gather_alone:,.1f} ms of them alone, {parts['dp_gather']:,.1f} ms left exposed",)
    return ParallelPrediction(g.model, device, mode, batch_size, seq_len if cp > 1 else g.seq_len, par,
                              sum(parts.values()), parts, stages, one, roofline_ms, notes, breakdown)


def sequence_model(model: Any, step: Any, kwargs: dict[str, Any]) -> Any:
    """``model`` built (on meta) as a search of its sequence length takes it, with the run's ``kwargs`` that shape
    it; an error unless ``step`` (tokens per GPU) is even and the model takes a sequence length."""
    from neusight.graph.models import build_model

    if not isinstance(step, int) or isinstance(step, bool) or step < 2 or step % 2:
        raise InputError(f"step={step!r} is not an even number of tokens (each GPU's part of a sequence). Fix: e.g. "
                         "step=64")
    built = build_model(model, **{k: kwargs[k] for k in ("head", "attn_implementation", "input_shapes", "image_size")
                                  if kwargs.get(k) is not None})
    if not built.needs_seq_len:
        raise InputError(f"{built.name} takes no sequence length. Fix: search or plan its batch size instead "
                         "(find_max_batch, or gpus=N at a batch_size)")
    return built


@dataclass(frozen=True)
class LargestRun:
    """What :func:`find_max_parallel` found: the largest ``value`` (global batch or sequence length) whose run fits,
    the forecast at it (when nothing fits, at the smallest probe) and how many forecasts the search made."""

    value: int
    prediction: ParallelPrediction
    forecasts: int


def find_max_parallel(model: Any, device: Device | str, search: str, batch_size: int | None = None,
                      seq_len: int | None = None, mode: str = "training", *, step: int = 64,
                      limit: int | None = None, start: tuple[int, ...] | list[int] = (), cache: dict | None = None,
                      **kwargs: Any) -> LargestRun:
    """The largest global batch (``search="batch_size"``, at ``seq_len``) or sequence (``search="seq_len"``, at
    global ``batch_size``) whose run on a layout of GPUs fits in their memory as :func:`predict_parallel` forecasts
    it (its ``memory_fits``, the first stage's GPU; ``**kwargs``: the layout and run, dp / tp / pp / microbatches /
    cp / zero / sp / ...): the global batch in multiples of dp x microbatches (one sample more per micro-batch),
    the sequence in multiples of ``step`` tokens per GPU of its ``cp``, up to ``limit`` (default: 65,536 for the
    batch, the model's positions for the sequence). The search is :func:`neusight.memory.largest_within`; ``start``
    (values of the searched quantity) are probed first, with ``cache`` (:func:`predict_parallel`'s) for those only,
    so that searches of several layouts share their traces without keeping every probe's.
    """
    from neusight.memory import largest_within

    if search not in ("batch_size", "seq_len"):
        raise InputError(f"search={search!r} is not what find_max_parallel searches. Fix: 'batch_size' or 'seq_len'")
    if "cache" in kwargs:
        raise InputError("cache= is find_max_parallel's own. Fix: leave it out")
    device = load_device(device)
    cp = int(kwargs.get("cp", 1))
    if search == "seq_len":
        built = sequence_model(model, step, kwargs)
        if limit is not None and built.max_seq_len and limit > built.max_seq_len:
            raise InputError(f"limit={limit} exceeds {built.name}'s maximum of {built.max_seq_len} positions. Fix: "
                             f"at most {built.max_seq_len}, or leave it out to search up to it")
        unit, cap = step * cp, limit or built.max_seq_len or 1 << 20
    else:
        unit, cap = int(kwargs.get("dp", 1)) * int(kwargs.get("microbatches", 1)), limit or 1 << 16
    kept: dict[str, Any] = {"forecasts": 0}

    def peak(n: int) -> float:
        size = {"batch_size": batch_size, "seq_len": seq_len, search: n * unit}
        p = predict_parallel(model, device, size["batch_size"], size["seq_len"], mode,
                             cache=cache if n * unit in start else None, **kwargs)
        kept["forecasts"] += 1
        if "smallest" not in kept or n < kept["smallest"][0]:
            kept["smallest"] = (n, p)
        if p.memory_fits and n > kept.get("largest", (0, None))[0]:
            kept["largest"] = (n, p)
        log.debug("%s %d: %.2f GiB per GPU", search, n * unit, (p.memory_peak_bytes or 0.0) / 2**30)
        return float(p.memory_peak_bytes or 0.0)

    if cap < unit:
        what = (f"{step} tokens on each of cp={cp} GPUs exceed the {cap:,} positions" if search == "seq_len"
                else f"one sample per micro-batch (dp x microbatches = {unit}) exceeds limit={cap}")
        raise InputError(f"{what}. Fix: " + ("a smaller cp" if search == "seq_len" else "a larger limit"))
    n = largest_within(peak, device.memory_bytes, cap // unit, [v // unit for v in start])
    return LargestRun(n * unit, (kept["largest"] if n else kept["smallest"])[1], kept["forecasts"])


def _joined(names: list[str]) -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _check_zero(zero: Any, par: Parallelism, training: bool) -> None:
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool):
        raise InputError(f"zero={zero!r} is not a ZeRO stage. Fix: 0 (plain data parallelism), 1 (optimizer state "
                         "sharded), 2 (and gradients) or 3 (and weights: FSDP's full sharding)")
    if not zero:
        return
    if par.replicas == 1:
        raise InputError(f"zero={zero} shards over data-parallel replicas; dp=1 has none. Fix: dp > 1, or zero=0")
    if not training:
        raise InputError(f"zero={zero} shards a training step's state; this run is inference. Fix: mode='training', "
                         "or zero=0")
    if par.pp > 1:
        raise InputError(f"zero={zero} with pipeline stages (pp={par.pp}) is not modelled. Fix: pp=1, or zero=0")


def zero_memory_peak(g: Any, device: Device, zero: int, dp: int, ep: int = 1, fused: bool = False,
                     transient: dict[int, int] | None = None) -> float:
    """Peak bytes on one GPU of trace ``g`` run by ``dp`` data-parallel replicas under ZeRO stage ``zero``
    (:func:`_zero_breakdown`; ``ep``: the experts' expert-parallel degree; ``fused``: under torch.compile;
    ``transient``: communication buffers per op, :func:`neusight.memory.estimate_memory`), as
    :func:`predict_parallel` forecasts it with ``pp=1``."""
    from neusight.memory import estimate_memory

    units = _unit_parameter_bytes(g, _block_index(g.kernels)) if zero == 3 else []
    shards = _zero_shards(dp, ep, _expert_parameter_share(g) if ep > 1 else 0.0)
    report = estimate_memory(g, device, fused=fused, transient=transient)
    return float(sum(_zero_breakdown(report, zero, shards, units).values()))


def _zero_shards(dp: int, ep: int, expert_share: float) -> float:
    """How many ways ZeRO splits a GPU's state on average: the experts' share (``expert_share`` of the bytes) over
    the dp / ep replicas that hold the same experts, the rest over all dp."""
    return 1.0 / ((1 - expert_share) / dp + expert_share * ep / dp)


def _zero_breakdown(report: Any, zero: int, dp: float, units: list[float]) -> dict[str, float]:
    """The memory breakdown of one GPU under ZeRO stage ``zero`` over ``dp`` replicas (with expert parallelism the
    average of the experts' and the other state's shard counts, :func:`_zero_shards`), from the unsharded run's
    timeline: at every op the sharded categories count 1 / dp (optimizer state from stage 1, gradients from 2,
    weights at 3), so do the optimizer step's temporaries (it steps 1 / dp of the parameters); the peak is taken
    again over the ops. Stage 3 adds two gathered blocks (the running one and the prefetched next, less the shard
    already counted). The allocator slack and the framework's fixed costs are the unsharded run's."""
    from neusight.memory import CATEGORIES

    t = report.timeline
    sharded = {"weights": zero >= 3, "gradients": zero >= 2, "optimizer": zero >= 1}
    cols = {c: t[c].astype(float) / (dp if sharded.get(c) else 1) for c in CATEGORIES}
    cols["workspace"] = cols["workspace"].where(t["phase"] != "optimizer", cols["workspace"] / dp)
    i = sum(cols.values()).idxmax()
    out = {c: float(cols[c][i]) for c in CATEGORIES}
    if zero == 3 and units:
        out["weights"] += sum(sorted(units)[-2:]) * (dp - 1) / dp
    out.update({k: float(v) for k, v in report.breakdown.items() if k not in CATEGORIES})
    return out


def _unit_parameter_bytes(g: Any, index: dict[str, float]) -> list[float]:
    """Parameter bytes of each unit FSDP wraps (every transformer block) and of the rest of the model (embeddings,
    final norm, head) as one more unit; the whole model as one unit without parameter names."""
    return [u for u in _stage_units(g, index, len(index), 1)[0].values() if u > 0]


def _compose(k: pd.DataFrame, stage: pd.Series, blocks_per_stage: list[int], column: str, par: Parallelism,
             training: bool, act_bytes: float, device: Device, links: Links | None = None,
             ep_ms: list[float] | None = None, async_columns: tuple[str, ...] = (),
             tokens: float = 0.0, cp_ms: list[float] | None = None) -> tuple[dict[str, float], pd.DataFrame]:
    """Per-stage times of one micro-batch (kernel ``column`` summed) and the step's parts under the schedule;
    ``ep_ms``: each stage's expert-parallel all-to-alls of one micro-batch; ``cp_ms``: each stage's exposed
    context-parallel exchanges of one micro-batch (:func:`context_exchange_ms`); ``async_columns``: the
    column-parallel projections whose backward collectives overlap their GEMMs as Megatron-LM runs them
    (:func:`async_tp_delta_ms`), ``tokens`` the rows of a block's activation."""
    rows = []
    ar_ms = allreduce_ms(act_bytes, par.tp, device, links and links.tp)
    delta = (async_tp_delta_ms(k, async_columns, stage, par.pp, column, ar_ms / 2, tokens, par.sp)
             if training and async_columns and par.tp > 1 else [0.0] * par.pp)
    for s, n_blocks in enumerate(blocks_per_stage):
        mine = k[stage == s]
        per_block = 4 if training else 2                 # all-reduces per block: 2 forward (+ 2 backward)
        tp_calls = n_blocks * per_block + (1 if s == 0 else 0)   # + the vocabulary-parallel embedding's
        rows.append({"stage": s, "blocks": n_blocks,
                     "forward_ms": float(mine.loc[mine["phase"].isin(("forward", "loss")), column].sum()),
                     "backward_ms": float(mine.loc[mine["phase"] == "backward", column].sum()),
                     "tp_comm_ms": max(0.0, tp_calls * ar_ms + delta[s]),
                     "ep_comm_ms": ep_ms[s] if ep_ms else 0.0,
                     "cp_comm_ms": cp_ms[s] if cp_ms else 0.0,
                     # chunk boundaries a micro-batch crosses leaving this GPU: vpp (the last GPU: vpp - 1)
                     "p2p_ms": (2 if training else 1) * p2p_ms(act_bytes / (par.tp if par.sp else 1), device,
                                                                links and links.pp)
                     * (par.vpp - (s == par.pp - 1)),
                     "tp_overlap_ms": delta[s]})     # what the overlap changed in tp_comm_ms (negative: hidden)
    stages = pd.DataFrame(rows)
    slot = stages[["forward_ms", "backward_ms", "tp_comm_ms", "ep_comm_ms", "cp_comm_ms", "p2p_ms"]].sum(axis=1)
    slowest = stages.loc[int(slot.idxmax())]
    m = par.microbatches
    # 1F1B (and GPipe): the first micro-batch crosses every stage forward and back, the other m - 1 follow at
    # the pace of the slowest stage: sum of the stages' slots + (m - 1) x the slowest. Parts: the slowest stage's
    # m micro-batches (compute, tensor-parallel all-reduces), every hand-off between stages, and the bubble: the
    # other stages' work while the first micro-batch fills and drains the pipeline ((pp - 1) slots when the
    # stages are balanced; with vpp chunks per GPU the pipeline fills chunk by chunk, (pp - 1) / vpp slots).
    work = stages[["forward_ms", "backward_ms", "tp_comm_ms", "ep_comm_ms", "cp_comm_ms"]].sum(axis=1)
    parts = {"compute": m * float(slowest["forward_ms"] + slowest["backward_ms"]),
             "tp_comm": m * float(slowest["tp_comm_ms"]),
             "ep_alltoall": m * float(slowest["ep_comm_ms"]),
             "cp_comm": m * float(slowest["cp_comm_ms"]),
             "pp_p2p": float(stages["p2p_ms"].sum() + (m - 1) * slowest["p2p_ms"]),
             "pp_bubble": float(work.sum() - work.loc[slowest.name]) / par.vpp}   # interleaved: 1 / vpp of it
    return parts, stages


def async_tp_delta_ms(k: pd.DataFrame, columns: tuple[str, ...], stage: pd.Series, pp: int, column: str,
                      half_ms: float, tokens: float, sp: bool = False) -> list[float]:
    """Per pipeline stage, what Megatron-LM's overlap of its column-parallel projections' backward collectives
    with their GEMMs changes in one micro-batch's tensor-parallel communication (ms; negative: time hidden).

    ``columns``: the module paths of the column-parallel projections (:attr:`neusight.graph.Graph.tp_columns`);
    those with one parent (a block's query / key / value, or gate / up) are one Megatron-LM linear, one collective
    per call. In Megatron-LM's backward pass of such a linear (``LinearWithGradAccumulationAndAsyncCommunication``,
    with CUDA_DEVICE_MAX_CONNECTIONS=1 as it requires) the input-gradient GEMM runs first, then the input
    gradient's collective is issued asynchronously and the weight-gradient GEMM (the one of the projection's
    backward GEMMs that reduces over the ``tokens`` rows) and the bias's reduction (its other backward kernels)
    run beside it, ``column`` times. Without sequence parallelism that collective is the all-reduce (2 x
    ``half_ms``, ``half_ms`` being a reduce-scatter or all-gather of the activation): what the weight gradient's
    kernels cover of it is hidden. With ``sp`` it is a reduce-scatter, hidden the same way, and the projection first
    all-gathers its saved input again (it kept 1 / tp of it), asynchronously beside the input-gradient GEMM: what
    that GEMM does not cover is added. Neither shares the GPU without cost in reality (the collectives' kernels
    take SMs from the GEMMs), which is not modelled."""
    out = [0.0] * pp
    bwd = k.loc[k["phase"] == "backward", ["module", "family", "dims", column]]
    module = bwd["module"].astype(str)
    groups: dict[str, list[str]] = {}
    for path in columns:
        groups.setdefault(path.rpartition(".")[0], []).append(path)
    collective = half_ms if sp else 2 * half_ms
    for paths in groups.values():
        rows = bwd[module.isin(paths)]
        gemm = rows["family"] == "linear"
        if not gemm.any():
            continue
        # dims (1, M, N, K), N reduced: the input gradient is (tokens, out) x (out, in), the weight gradient
        # reduces over the tokens (when out == tokens the two have the same dims: either is the input gradient)
        over_tokens = rows["dims"].map(lambda d: len(d) == 4 and d[2] == tokens).astype(bool)
        dgrad = gemm & ~over_tokens
        if int(dgrad.sum()) * 2 < int(gemm.sum()):
            dgrad = gemm & (gemm.astype(int).cumsum() % 2 == 1)
        calls = max(1, int(gemm.sum()) // (2 * len(paths)))
        wgrad_ms = float(rows.loc[~dgrad, column].sum()) / calls
        dgrad_ms = float(rows.loc[dgrad, column].sum()) / calls
        change = -min(collective, wgrad_ms) + (max(0.0, half_ms - dgrad_ms) if sp else 0.0)
        out[int(stage[rows.index[0]])] += calls * change
    return out


MEGATRON_BUCKET = 40_000_000   # parameters per gradient bucket of Megatron-LM's DDP (its bucket_size default)


def megatron_grad_division_ms(numel: float, device: Device, predictor: Any = None) -> tuple[float, float]:
    """(forecast ms, roofline ms) of Megatron-LM's DDP dividing its gradient buffer of ``numel`` FP32 elements by the
    data-parallel size before the all-reduce (``Bucket.start_grad_sync``; it runs with dp = 1 too): one elementwise
    kernel per bucket of :data:`MEGATRON_BUCKET` parameters, reading and writing it, forecast by the predictor's
    elementwise model with the end-to-end calibration, as every kernel of a step."""
    if numel <= 0:
        return 0.0, 0.0
    full, rest = divmod(float(numel), MEGATRON_BUCKET)
    return elementwise_passes_ms([(size, n) for size, n in ((float(MEGATRON_BUCKET), full), (rest, 1.0)) if size and n],
                                 "div", "float32", device, predictor)


def ddp_bucket_copies_ms(numels: list[float], dtype: str, device: Device,
                         predictor: Any = None) -> tuple[float, float]:
    """(forecast ms, roofline ms) of what PyTorch DDP (``gradient_as_bucket_view=False``, its default) runs on each
    parameter's gradient of ``numels`` elements besides the collectives: a kernel multiplying it by 1 / world size
    into its bucket (``Reducer::copy_grad_to_bucket``, as the gradient is ready) and, once its bucket is reduced, a
    copy back into the gradient (``copy_bucket_to_grad``): two elementwise passes per parameter."""
    counts: dict[float, float] = {}
    for n in numels:
        if n > 0:
            counts[float(n)] = counts.get(float(n), 0.0) + 2.0
    return elementwise_passes_ms(sorted(counts.items()), "copy_", dtype, device, predictor)


def elementwise_passes_ms(passes: list[tuple[float, float]], kernel: str, dtype: str, device: Device,
                          predictor: Any = None) -> tuple[float, float]:
    """(forecast ms, roofline ms) of ``count`` elementwise kernels of ``numel`` elements each, for every
    ``(numel, count)`` of ``passes``, each reading and writing its elements of ``dtype``: synthetic kernels
    (no trace has them) forecast by the predictor's elementwise model with the end-to-end calibration, as every
    kernel of a step."""
    from neusight.api import e2e_kernel_ms, load_predictor
    from neusight.kernels.formulas import itemsize

    if not passes:
        return 0.0, 0.0
    sizes, counts = zip(*passes)
    cols = 1024.0
    frame = pd.DataFrame({"family": "elementwise", "kernel": kernel, "flops": sizes, "algo_flops": sizes,
                          "bytes": [2 * itemsize(dtype) * n for n in sizes], "dtype": dtype,
                          "B": float("nan"), "M": float("nan"), "N": float("nan"), "K": float("nan"),
                          "rows": [math.ceil(n / cols) for n in sizes], "cols": cols})
    pred = load_predictor(predictor, device)
    res = pred.predict(frame, device)
    ms = e2e_kernel_ms(res["roofline_ms"].to_numpy(float), res["latency_ms"].to_numpy(float),
                       res["overhead_ms"].to_numpy(float), float(getattr(pred, "e2e_scale_", 1.0)),
                       float(getattr(pred, "e2e_floor_", 1.0)))
    return (float(sum(c * m for c, m in zip(counts, ms))),
            float(sum(c * r for c, r in zip(counts, res["roofline_ms"].to_numpy(float)))))


def _expert_alltoall_ms(g: Any, index: dict[str, float], n: int, par: Parallelism, training: bool,
                        device: Device, gbps: float | None = None) -> list[float]:
    """Each pipeline stage's expert-parallel all-to-alls of one micro-batch (ms): per call of an experts layer one
    to send its token rows to the experts' GPUs and one to bring the results back; in training two more for the
    gradients of every forward call (a checkpointed layer's recomputation dispatches again)."""
    out = [0.0] * par.pp
    if par.ep == 1:
        return out
    for path, phase, nbytes in g.expert_dispatch:
        m = _BLOCK.match(path)
        b = index.get(m.group(1)) if m else None
        s = int(b) * par.pp // n if b is not None and n else par.pp - 1
        calls = 4 if training and phase == "forward" else 2
        out[s] += calls * alltoall_ms(nbytes, par.ep, device, gbps)
    return out


def _expert_parameter_share(g: Any) -> float:
    """Share of the traced parameter bytes that belong to experts layers (what expert parallelism spreads)."""
    layers = {path for path, _, _ in g.expert_dispatch}
    if not layers or not g.param_names:
        return 0.0
    sizes = [t.numel * t.itemsize for t in g.params]
    total = float(sum(sizes)) or 1.0
    # a routed experts module's own parameters, or a Switch sparse MLP's experts (not its router)
    mine = sum(size for name, size in zip(g.param_names, sizes)
               if any(name.startswith(f"{p}.experts.") or name.rpartition(".")[0] == p for p in layers))
    return mine / total


def _block_index(k: pd.DataFrame) -> dict[str, float]:
    """Transformer block module path -> its number, in the order the forward pass first enters the blocks (an
    encoder's blocks, then a decoder's)."""
    path = k["module"].astype(str).str.extract(_BLOCK, expand=False)
    first = k.loc[path.notna() & (k["phase"] == "forward")].groupby(path)["op_index"].min().sort_values()
    return {p: float(i) for i, p in enumerate(first.index)}


def _block_numbers(k: pd.DataFrame, index: dict[str, float]) -> pd.Series:
    """Each kernel's transformer block number (:func:`_block_index`); NaN outside any block."""
    return k["module"].astype(str).str.extract(_BLOCK, expand=False).map(index)


_WORD_EMBEDDING = re.compile(r"(?:^|\.)(?:wte|embed_tokens|word_embeddings|shared)\.weight$")
_OUTPUT_WEIGHT = re.compile(r"(?:^|\.)(?:lm_head|decoder)\.weight$")
_EMBEDDINGS = re.compile(r"embed|(?:^|\.)(?:wte|wpe|shared)\.")      # word, position, token-type embeddings


def _stage_units(g: Any, index: dict[str, float], n: int, pp: int) -> list[dict[str, float]]:
    """Per pipeline stage, the parameter bytes it holds by unit: a transformer block's module path, or ``""`` for
    the rest of the model. Blocks' parameters go with their block's stage, embeddings with the first stage, the
    rest (final norm, an untied head) with the last; with pp > 1 a tied word embedding is also held by the last
    stage, which needs it for the output layer (Megatron-LM keeps such a copy and all-reduces its gradient with
    the first stage's; key ``"tied"`` there). Without parameter names: 1 / pp of everything each, as ``""``."""
    sizes = [t.numel * t.itemsize for t in g.params]
    total = float(sum(sizes))
    if pp == 1 and g.param_names and index:
        out: list[dict[str, float]] = [{}]
    elif pp == 1 or not g.param_names or total == 0:
        return [{"": total / pp} for _ in range(pp)]
    else:
        out = [{} for _ in range(pp)]
    tied = pp > 1 and not any(_OUTPUT_WEIGHT.search(name) for name in g.param_names)
    for name, size in zip(g.param_names, sizes):
        m = _BLOCK.match(name)
        if m and m.group(1) in index and n:
            s, unit = int(index[m.group(1)]) * pp // n, m.group(1)
        else:
            s, unit = (0 if _EMBEDDINGS.search(name) else pp - 1), ""
            if tied and s == 0 and _WORD_EMBEDDING.search(name):
                out[-1]["tied"] = float(size)
        out[s][unit] = out[s].get(unit, 0.0) + size
    return out


def _stage_parameters(g: Any, index: dict[str, float], n: int, pp: int) -> tuple[list[float], float]:
    """(share of the traced parameters each pipeline stage holds, bytes of the tied word embedding the first and
    the last stage all-reduce), from :func:`_stage_units`."""
    units = _stage_units(g, index, n, pp)
    total = float(sum(t.numel * t.itemsize for t in g.params))
    if total == 0:
        return [1.0 / pp] * pp, 0.0
    return [sum(u.values()) / total for u in units], units[-1].get("tied", 0.0)


DDP_BUCKET_BYTES = 25 * 2**20     # PyTorch DDP's gradient bucket (bucket_cap_mb's default, 25 MiB)
DDP_FIRST_BUCKET_BYTES = 2**20    # and its first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB)


def ddp_buckets(k: pd.DataFrame, mine: pd.Series, names: list[str], sizes: list[float],
                column: str) -> list[tuple[float, float]]:
    """PyTorch DDP's gradient buckets in one backward pass: (when the bucket's last gradient is ready, ms from the
    pass's start; its gradient bytes), in the order DDP reduces them.

    ``k`` / ``mine``: the kernels and those of the GPU in question, with ``column`` times; ``names`` / ``sizes``:
    the trainable parameters (``module.path.weight``) and their gradient bytes, in registration order. The pass
    runs its kernels in order, and a parameter's gradient is ready when the last backward kernel of its module ends
    (one whose module runs none: at the pass's end). After its first iteration DDP rebuilds its buckets in the order
    the gradients became ready (``Reducer::rebuild_buckets``): a first bucket of :data:`DDP_FIRST_BUCKET_BYTES`, then
    :data:`DDP_BUCKET_BYTES` each, a bucket closing once it holds at least its cap.

    >>> k = pd.DataFrame({"op_index": [0, 1, 2], "phase": "backward", "module": ["fc", "conv2", "conv1"],
    ...                   "latency_ms": [1.0, 2.0, 3.0]})
    >>> mib = 2.0**20
    >>> ddp_buckets(k, k["phase"] == "backward", ["conv1.weight", "conv2.weight", "fc.weight", "fc.bias"],
    ...             [30 * mib, 20 * mib, 0.5 * mib, 0.5 * mib], "latency_ms")
    [(1.0, 1048576.0), (6.0, 52428800.0)]
    """
    sel = k.loc[mine & (k["phase"] == "backward"), ["op_index", "module", column]].sort_values("op_index",
                                                                                              kind="stable")
    end = sel[column].astype(float).cumsum()
    done = float(end.iloc[-1]) if len(end) else 0.0
    last = end.groupby(sel["module"].astype(str)).max().to_dict()      # module -> end of its last backward kernel
    ready = [float(last.get(name.rpartition(".")[0], done)) for name in names]
    order = sorted(range(len(names)), key=lambda i: (ready[i], -i))   # ties: DDP's initial, reversed order
    buckets: list[tuple[float, float]] = []
    cap, held, at = float(DDP_FIRST_BUCKET_BYTES), 0.0, 0.0
    for i in order:
        held, at = held + sizes[i], max(at, ready[i])
        if held >= cap:
            buckets.append((at, held))
            cap, held, at = float(DDP_BUCKET_BYTES), 0.0, 0.0
    if held:
        buckets.append((at, held))
    return buckets


def exposed_bucket_reduce_ms(buckets: list[tuple[float, float]], pass_ms: float, reduce_ms: Any) -> float:
    """What reducing ``buckets`` (:func:`ddp_buckets`) beside a backward pass of ``pass_ms`` adds to it (ms): each
    bucket's collective, ``reduce_ms(bytes)``, starts once the bucket is ready and the one before it is done (one
    communication stream); only what outlasts the pass counts.

    >>> exposed_bucket_reduce_ms([(1.0, 10.0), (6.0, 40.0)], 6.0, lambda b: b / 10)   # 1-2, then 6-10
    4.0
    """
    free = 0.0
    for at, nbytes in buckets:
        free = max(free, at) + reduce_ms(nbytes)
    return max(0.0, free - pass_ms)


def exposed_grad_reduce_ms(k: pd.DataFrame, mine: pd.Series, grads: dict[str, float], column: str,
                           reduce_ms: Any, tp_block_ms: float = 0.0) -> float:
    """What a gradient reduction overlapped with the backward pass adds to a step (ms): ``grads`` (gradient bytes
    by unit: a transformer block's module path, anything else the rest of the model), each reduced by one
    collective of ``reduce_ms(bytes)`` once the unit's backward kernels are done (:func:`exposed_collectives_ms`)."""
    return exposed_collectives_ms(k, mine, ("backward",), column, reduces={u: reduce_ms(b) for u, b in grads.items()},
                                  tp_block_ms=tp_block_ms)


def exposed_collectives_ms(k: pd.DataFrame, mine: pd.Series, phases: tuple[str, ...], column: str, *,
                           gathers: dict[str, float] | None = None, reduces: dict[str, float] | None = None,
                           prefetch: int | None = None, tp_block_ms: float = 0.0) -> float:
    """How much longer than its kernels one pass takes when collectives overlap it (ms).

    ``k``: one micro-batch's kernels with ``column`` times, ``mine``: those of the stage in question, ``phases``:
    the pass. The pass runs its kernels in order; a transformer block's kernels end with its ``tp_block_ms`` of
    tensor-parallel all-reduces. ``gathers`` (ms by unit: a block's module path, ``""`` the rest of the model)
    must end before the unit's first kernel starts; ``reduces`` start once the unit's last kernel has ended (a unit
    without kernels in the pass: at its end). Collectives run one at a time on one stream, in the order they are
    issued: the rest's gather at the start, a block's gather when the pass reaches the block ``prefetch`` blocks
    before it (FSDP's prefetch: 1, the next block's gather beside the running block; None: all at the start; a
    block's kernels may come in several runs, as when its recomputed forward precedes the end of the next block's
    backward). Returns the pass's end (its last kernel or collective) less its kernels' time.
    """
    gathers, reduces = gathers or {}, reduces or {}
    sel = k.loc[mine & k["phase"].isin(phases), ["op_index", "module", column]].sort_values("op_index")
    unit = sel["module"].astype(str).str.extract(_BLOCK, expand=False).fillna("")
    run = (unit != unit.shift()).cumsum()                                   # consecutive kernels of one unit
    segs = pd.DataFrame({"unit": unit.groupby(run).first(), "ms": sel[column].astype(float).groupby(run).sum()})
    last_seg = {u: i for i, u in segs["unit"].items()}                      # each unit's last run
    blocks = [u for u in dict.fromkeys(segs["unit"]) if u]                  # in the order the pass reaches them
    free = clock = 0.0
    pending: list[tuple[float, float]] = []          # reduces issued, not yet run: (issue time, ms)
    started: dict[str, float] = {}
    ready: dict[str, float] = {}

    def run_until(t: float) -> None:
        nonlocal free
        while pending and pending[0][0] <= t:
            issue, ms = pending.pop(0)
            free = max(free, issue) + ms

    if gathers.get(""):
        free = ready[""] = gathers[""]
    for i, (unit_, ms) in segs.iterrows():
        if unit_ not in ready:
            j = blocks.index(unit_) if unit_ else -1
            issue = 0.0 if prefetch is None or j < prefetch else started[blocks[j - prefetch]]
            run_until(issue)
            if gathers.get(unit_):
                free = max(free, issue) + gathers[unit_]
                ready[unit_] = free
            else:
                ready[unit_] = 0.0
        clock = max(clock, ready[unit_])
        started.setdefault(unit_, clock)
        clock += ms + (tp_block_ms if unit_ and last_seg[unit_] == i else 0.0)
        if last_seg[unit_] == i and reduces.get(unit_):
            pending.append((clock, reduces[unit_]))
    pending += [(clock, ms) for u, ms in reduces.items() if ms and u not in last_seg]
    run_until(math.inf)
    kernels = float(segs["ms"].sum()) + tp_block_ms * len(blocks)
    return max(0.0, max(clock, free) - kernels)


def _stages(k: pd.DataFrame, block: pd.Series, pp: int) -> pd.Series:
    """Pipeline stage of every kernel: its block's (blocks split evenly), else the first stage for what runs
    before the first block in the forward pass (embeddings) and after the last one in the backward pass (their
    gradients), the last stage for the rest (final norm, head, loss) and the optimizer spread evenly."""
    n = int(block.max()) + 1 if block.notna().any() else 1
    stage = (block * pp // n).where(block.notna())
    in_block = block.notna()
    fwd, bwd = k["phase"] == "forward", k["phase"] == "backward"
    first_fwd = k.loc[fwd & in_block, "op_index"].min() if (fwd & in_block).any() else math.inf
    last_bwd = k.loc[bwd & in_block, "op_index"].max() if (bwd & in_block).any() else -math.inf
    early = (fwd & (k["op_index"] < first_fwd)) | (bwd & (k["op_index"] > last_bwd))
    stage = stage.where(in_block, (~early) * (pp - 1))
    return stage.fillna(pp - 1).astype(int)


def sequence_parallel_mask(k: pd.DataFrame) -> pd.Series:
    """The kernels of ``k`` (a trace's kernel table) that Megatron-LM's sequence parallelism splits by tokens:
    inside a transformer block, the elementwise and layer-norm kernels over the whole (tokens, hidden) activation
    (the layer norms, the dropouts after the attention and MLP outputs, the residual adds), which tensor
    parallelism alone runs whole on every GPU. Kernels inside the split attention and MLP (narrower than hidden on
    a tensor-parallel shard), GEMMs and reductions are not among them; nor is the MLP's activation (by module path,
    :data:`_MLP_INNER`), as a 4 x hidden MLP split over tp=4 GPUs is as wide as the block."""
    block = _block_numbers(k, _block_index(k))
    tokens, hidden = _activation_shape(k, block)
    full = k["dims"].map(lambda d: len(d) == 2 and d[0] == tokens and d[1] == hidden).astype(bool)
    inner = k["module"].astype(str).str.contains(_MLP_INNER)
    return block.notna() & k["family"].isin(("elementwise", "layernorm")) & full & ~inner


def split_sequence(k: pd.DataFrame, tp: int) -> pd.DataFrame:
    """``k`` with the kernels of :func:`sequence_parallel_mask` on tokens / ``tp`` rows each (their dims, FLOPs
    and bytes divided by ``tp``), as one GPU of a sequence-parallel group runs them."""
    if tp == 1:
        return k
    mask = sequence_parallel_mask(k)
    tokens, _ = _activation_shape(k, _block_numbers(k, _block_index(k)))
    if tokens % tp:
        raise InputError(f"sp=True splits the {int(tokens)} tokens of a micro-batch over tp={tp} GPUs, which do not "
                         f"divide them. Fix: a batch x sequence length that {tp} divides, or sp=false")
    out = k.copy()
    out["dims"] = [(d[0] // tp, *d[1:]) if m else d for d, m in zip(out["dims"], mask)]
    for column in ("flops", "algo_flops", "bytes"):
        if column in out:
            out[column] = out[column].where(~mask, out[column] / tp)
    return out


def _activation_shape(k: pd.DataFrame, block: pd.Series) -> tuple[float, float]:
    """(tokens, hidden) of one micro-batch: the rows and the reduction width of the first projection of the first
    block (its input is the activation the GPUs exchange)."""
    gemm = k[(k["family"] == "linear") & (k["phase"] == "forward") & block.notna()]
    if gemm.empty:
        raise ModelError("tensor / pipeline parallelism needs a transformer (blocks of projections whose input is "
                         "the activation the GPUs exchange); this model has none. Fix: use dp only")
    _, tokens, hidden, _ = gemm.sort_values("op_index")["dims"].iloc[0]
    return float(tokens), float(hidden)


# ---------------------------------------------------------------------------------------------------------
# context parallelism (module docstring, item 5)

# how the GPUs of a context-parallel group exchange each attention call's inputs (split_context)
CP_COMMS = ("p2p", "all_gather", "a2a")


def _attention_share(row: Any) -> float:
    """The share of its whole (queries x keys) block a fused attention kernel row computes: 0.5 causal, 1 without a
    mask (:func:`neusight.kernels.ops_gemm._attention`'s FLOPs), less over a sliding window's band."""
    bh, lq, d, lk = row.dims
    whole = 4.0 * bh * lq * lk * d * (2.5 if row.kernel == ATTENTION_BWD_KERNEL else 1.0)
    return float(row.flops) / whole if whole > 0 else 0.0


def check_context_seq_len(seq_len: Any, cp: int, comm: str = "p2p") -> None:
    """Refuse a ``seq_len`` that context parallelism over ``cp`` GPUs cannot split: into cp parts with
    ``comm="a2a"``, else into 2 cp chunks (two per GPU, for causal load balance)."""
    need = cp if comm == "a2a" else 2 * cp
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len % need:
        raise InputError(f"cp={cp} splits each sequence into {need} chunks"
                         + ("" if comm == "a2a" else " (two per GPU, for causal load balance)")
                         + f"; seq_len={seq_len!r} is not a multiple of {need}. Fix: a seq_len that {need} divides")


def check_context_parallel(g: Any, cp: int, comm: str = "p2p") -> None:
    """Refuse context parallelism over ``cp`` GPUs for a trace ``g`` whose attention is not what ring attention
    runs: fused kernels (SDPA's or flash-attn's) without an explicit mask, causal or over the whole block; with
    ``comm="a2a"`` (heads split over the GPUs) also key / value heads that ``cp`` does not divide."""
    if cp == 1:
        return
    k = g.kernels
    attention = k["kernel"].isin(FUSED_ATTENTION)
    if not attention.any():
        raise ContextParallelError(f"cp={cp} runs each attention as a ring of fused attention kernels (Transformer "
                                   f"Engine's context parallelism); {g.model}'s trace has none (eager attention: a "
                                   "softmax between two GEMMs, or no attention at all). Fix: "
                                   "attn_implementation='sdpa' or 'flash_attention_2' (a transformer), or cp=1")
    forward = ("aten._scaled_dot_product_efficient_attention.", "aten._scaled_dot_product_cudnn_attention.")
    masked = sorted({r.module for r in g.ops if r.call.op.startswith(forward) and len(r.call.args) > 3
                     and isinstance(r.call.args[3], TensorMeta)})
    if masked:
        raise ContextParallelError(f"cp={cp}: the attention of {masked[0]}"
                                   f"{' and others' if len(masked) > 1 else ''} reads an explicit mask (a sliding "
                                   "window or chunked attention under SDPA), which the ring attention modelled here "
                                   "does not take (causal or no mask only). Fix: cp=1")
    for row in k[attention].itertuples():
        share = _attention_share(row)
        if abs(share - 0.5) > 0.02 and abs(share - 1.0) > 0.02:
            raise ContextParallelError(f"cp={cp}: the attention of {row.module} computes {share:.0%} of its block "
                                       "(a sliding window's band under flash-attn), which the ring attention "
                                       "modelled here does not take (causal or no mask only). Fix: cp=1")
        heads = row.dims[0] // max(int(g.batch_size), 1)     # key / value heads (query heads packed with them)
        if comm == "a2a" and (row.dims[0] % max(int(g.batch_size), 1) or heads % cp):
            raise ContextCommError(f"cp_comm='a2a' splits the attention heads over the cp={cp} GPUs (DeepSpeed "
                                   f"Ulysses); the attention of {row.module} has {heads} key / value heads on each "
                                   f"GPU, which {cp} does not divide. Fix: cp_comm='p2p' (a ring) or 'all_gather', "
                                   "or a cp that divides them")


def _merge_kernels(row: pd.Series, dims: tuple) -> list[dict[str, Any]]:
    """The kernels that fold one ring step's partial results (attention ``row`` of that step's ``dims``) into the
    GPU's running ones, as Transformer Engine's ring attention runs them: in the forward pass the output rescaled
    by the log-sum-exps and added (``cp_out_correction``), in the backward pass the gradients of the queries and
    of the keys and values added to their accumulators (``cp_dq_accumulate``, ``cp_dkv_accumulate``); elementwise,
    in the attention's dtype."""
    bh, lq, d, lk = (int(x) for x in dims)
    dtype = str(row["dtype"])
    made = ([formulas.elementwise("cp_dq_accumulate", bh * lq * d, n_tensor_inputs=2, dtype=dtype),
             formulas.elementwise("cp_dkv_accumulate", 2 * bh * lk * d, n_tensor_inputs=2, dtype=dtype)]
            if row["kernel"] == ATTENTION_BWD_KERNEL else
            [formulas.elementwise("cp_out_correction", bh * lq * d, n_tensor_inputs=2, flops_per_elem=4.0,
                                  dtype=dtype)])
    return [{**row.to_dict(), "family": t.family.value, "kernel": t.name, "dims": t.dims, "dtype": t.dtype,
             "flops": t.flops, "algo_flops": t.flops, "bytes": t.bytes, "channel_align": float("nan"),
             "nchw_operands": None} for t in made]


def _query_key_bytes(dims: tuple, dtype: Any) -> tuple[int, int]:
    """The bytes of a fused attention kernel's (``dims``: bh, lq, d, lk) queries (as its output and their
    gradients) and of its keys and values together, in ``dtype``."""
    bh, lq, d, lk = (int(x) for x in dims)
    itemsize = formulas.itemsize(str(dtype))
    return bh * lq * d * itemsize, 2 * bh * lk * d * itemsize


def context_buffer_bytes(k: pd.DataFrame, cp: int, comm: str = "p2p") -> dict[int, int]:
    """The communication buffers of context parallelism over ``cp`` GPUs, per op of the traced kernels ``k`` (one
    GPU's part of each sequence): bytes held while each fused attention call runs, beyond the tensors of the trace.
    With Q the GPU's queries (the output, their gradients: the same size) and KV its keys and values:

    - ``"p2p"`` (the ring): forward, the keys and values received for the next step beside those of this one
      (2 KV, double-buffered) and the step's partial output beside the running one (Q); backward, the keys and values
      (2 KV) and their accumulating gradients (2 KV) double-buffered round the ring, and the step's partial gradients
      (Q + KV) before they are added;
    - ``"all_gather"``: forward, the whole sequence's keys and values (cp KV); backward, those gathered again and
      their gradients before the reduce-scatter (2 cp KV);
    - ``"a2a"``: forward, the queries, keys and values after the all-to-all (Q + KV) and the output before its way
      back (Q); backward, the output's gradient (Q), the queries, keys and values (Q + KV) and their gradients before
      the all-to-all back (Q + KV).

    An approximation of Transformer Engine's and DeepSpeed's buffers (their allocator reuse and FP32 accumulators
    are not followed); the key / value bytes are those each GPU holds (grouped-query heads as they are)."""
    out: dict[int, int] = {}
    if cp == 1:
        return out
    for row in k[k["kernel"].isin(FUSED_ATTENTION)].itertuples():
        q, kv = _query_key_bytes(row.dims, row.dtype)
        backward = row.kernel == ATTENTION_BWD_KERNEL
        need = {"p2p": (5 * kv + q) if backward else (2 * kv + q),
                "all_gather": (2 if backward else 1) * cp * kv,
                "a2a": (3 * q + 2 * kv) if backward else (2 * q + kv)}[comm]
        out[int(row.op_index)] = max(out.get(int(row.op_index), 0), int(need))
    return out


def split_context(k: pd.DataFrame, cp: int, comm: str = "p2p") -> pd.DataFrame:
    """``k`` (the kernel table of one GPU's seq_len / ``cp`` tokens) with each fused attention kernel as context
    parallelism over ``cp`` GPUs runs it (module docstring, item 5), by ``comm`` (:data:`CP_COMMS`):

    - ``"p2p"`` (Transformer Engine's ring, its default): the traced kernel is step 0 (the GPU's own chunks); steps
      1 .. cp - 1 are added after it, for a causal kernel two candidate half blocks each (``cp_shape`` 0 and 1),
      all the queries against half the keys and half the queries against all the keys (the step takes the slower,
      :func:`context_steps`), without a mask the whole block again; each with the kernels merging its partial
      results (:func:`_merge_kernels`);
    - ``"all_gather"`` (Megatron-LM's ``--cp-comm-type all_gather``, Llama 3's context parallelism): the keys and
      values of the whole sequence gathered first, then one kernel per chunk of the GPU's queries against the keys
      up to that chunk (causal at its end; the two chunks of the GPU in the middle of the ring, each against about
      half the sequence), or, without a mask, one kernel against all the keys;
    - ``"a2a"`` (DeepSpeed Ulysses, ``--cp-comm-type a2a``): queries, keys and values exchanged all-to-all so that
      each GPU holds 1 / cp of the heads over the whole sequence, one kernel over it.

    Every row gets ``cp_parent`` (the position of its attention kernel in ``k``, -1 for other kernels),
    ``cp_step``, ``cp_shape`` and, on the attention kernels of ``k``, ``cp_q_bytes`` and ``cp_kv_bytes``: one of
    the GPU's query-side tensors (q, the output, their gradients) and its keys and values, the units of the
    exchanges (:func:`context_exchange_ms`). An attention kernel's bytes are split between the query side and the
    key side by their lengths."""
    if cp == 1:
        return k
    if comm not in CP_COMMS:
        raise InputError(f"cp_comm={comm!r} is not known. Fix: one of {', '.join(CP_COMMS)}")
    k = k.reset_index(drop=True)
    attention = k["kernel"].isin(FUSED_ATTENTION).to_numpy()
    out = k.assign(cp_parent=[i if a else -1 for i, a in enumerate(attention)], cp_step=0, cp_shape=0,
                   cp_q_bytes=0.0, cp_kv_bytes=0.0, cp_order=k.index * 1.0)
    added = []
    for i in k.index[attention]:
        row = k.loc[i]
        bh, lq, d, lk = row["dims"]
        backward = 2.5 if row["kernel"] == ATTENTION_BWD_KERNEL else 1.0
        out.loc[i, ["cp_q_bytes", "cp_kv_bytes"]] = [float(b) for b in _query_key_bytes(row["dims"], row["dtype"])]
        q_bytes = float(row["bytes"]) * lq / (lq + lk)
        kv_bytes = float(row["bytes"]) - q_bytes
        causal = abs(_attention_share(row) - 0.5) <= 0.02
        kernels: list[tuple[tuple, float, float]] = []       # (dims, FLOPs, bytes) replacing the traced kernel
        if comm == "a2a":                                     # heads / cp over the whole sequence
            kernels = [((bh // cp, lq * cp, d, lk * cp), float(row["flops"]) * cp, float(row["bytes"]))]
        elif comm == "all_gather" and causal:                 # a chunk of lk / 2 queries against K keys each
            half = lk / 2
            kernels = [((bh, lq // 2, d, int(keys)), 4.0 * bh * (lq // 2) * (keys - half / 2) * d * backward,
                        q_bytes / 2 + kv_bytes * keys / lk) for keys in (cp * half, (cp + 1) * half)]
        elif comm == "all_gather":
            kernels = [((bh, lq, d, lk * cp), float(row["flops"]) * cp, q_bytes + kv_bytes * cp)]
        if kernels:
            for step, (dims, flops, nbytes) in enumerate(kernels):
                if step == 0:
                    out.at[i, "dims"] = dims
                    out.loc[i, ["flops", "algo_flops", "bytes"]] = [flops, flops, nbytes]
                else:
                    added.append({**row.to_dict(), "dims": dims, "flops": flops, "algo_flops": flops, "bytes": nbytes,
                                  "cp_parent": i, "cp_step": step, "cp_shape": 0, "cp_q_bytes": 0.0,
                                  "cp_kv_bytes": 0.0, "cp_order": i + step / cp})
            continue
        shapes = ([((bh, lq, d, max(1, lk // 2)), q_bytes + kv_bytes / 2), ((bh, max(1, lq // 2), d, lk),
                                                                           q_bytes / 2 + kv_bytes)]
                  if causal else [((bh, lq, d, lk), float(row["bytes"]))])
        for step in range(1, cp):
            for shape, (dims, nbytes) in enumerate(shapes):
                ring = {"cp_parent": i, "cp_step": step, "cp_shape": shape, "cp_q_bytes": 0.0, "cp_kv_bytes": 0.0,
                        "cp_order": i + step / cp}
                added.append({**row.to_dict(), "dims": dims, "bytes": nbytes, **ring})
                added += [{**m, **ring} for m in _merge_kernels(row, dims)]
    out = pd.concat([out, pd.DataFrame(added, columns=out.columns)], ignore_index=True)
    return out.sort_values("cp_order", kind="stable").drop(columns="cp_order").reset_index(drop=True)


def context_steps(kernels: pd.DataFrame) -> pd.DataFrame:
    """A forecast kernel table of :func:`split_context` with each causal ring step's slower candidate kept (its
    attention and merging kernels together): in every step some GPUs of the ring run one half block and the
    others the other, and the step waits for all of them."""
    if "cp_step" not in kernels or not (kernels["cp_step"] > 0).any():
        return kernels
    steps = kernels[kernels["cp_step"] > 0]
    took = steps.groupby(["cp_parent", "cp_step", "cp_shape"])["latency_ms"].sum()
    slower = took.groupby(level=["cp_parent", "cp_step"]).idxmax()
    keep = pd.MultiIndex.from_tuples(slower.to_list(), names=["cp_parent", "cp_step", "cp_shape"])
    chosen = pd.MultiIndex.from_frame(steps[["cp_parent", "cp_step", "cp_shape"]]).isin(keep)
    return kernels.drop(index=steps.index[~chosen]).reset_index(drop=True)


def context_exchange_ms(kernels: pd.DataFrame, cp: int, device: Device, path: "LinkPath | None",
                        column: str = "latency_ms", comm: str = "p2p") -> pd.Series:
    """Per kernel of a forecast table (:func:`split_context`, :func:`context_steps`), the exposed time of the
    exchanges of its attention call between the ``cp`` GPUs (on the call's first row, 0 elsewhere), over the
    context-parallel group's links (``path``), by ``comm``:

    - ``"p2p"``: each of the cp - 1 steps after the first first receives the next chunk of keys and values (in the
      backward pass also the gradients of the keys and values, twice the bytes) from a neighbour, point to point,
      while the step before runs (its kernels, ``column`` times): what the transfer outlasts of that step counts;
    - ``"all_gather"``: the keys and values all-gathered before the call's kernels (and in the backward pass again,
      then their gradients reduce-scattered), none of it hidden;
    - ``"a2a"``: queries, keys and values sent all-to-all before the kernel and the output after it (in the
      backward pass the output's gradient before, the gradients of the queries, keys and values after), none of it
      hidden."""
    out = pd.Series(0.0, index=kernels.index)
    if cp == 1 or "cp_step" not in kernels:
        return out
    first = kernels.index[(kernels["cp_step"] == 0) & (kernels["cp_parent"] >= 0)]
    later = kernels[kernels["cp_step"] > 0].groupby(["cp_parent", "cp_step"])[column].sum()
    for i in first:
        row = kernels.loc[i]
        q, kv = float(row["cp_q_bytes"]), float(row["cp_kv_bytes"])
        backward = row["kernel"] == ATTENTION_BWD_KERNEL
        if comm == "all_gather":
            out[i] = (2 if backward else 1) * allgather_ms(cp * kv, cp, device, path)
            continue
        if comm == "a2a":
            out[i] = alltoall_ms(q + kv, cp, device, path) + alltoall_ms(q, cp, device, path)
            continue
        transfer = p2p_ms((2 if backward else 1) * kv, device, path)
        steps = later.loc[row["cp_parent"]].sort_index().to_list() if row["cp_parent"] in later.index else []
        beside = [float(row[column]), *steps][:cp - 1]
        out[i] = sum(max(0.0, transfer - t) for t in beside)
    return out

"""Multi-GPU forecasts: the Megatron-style split of a block, the collective formulas, how the parts compose,
the bad inputs, and multi-GPU label runs through the evaluation protocol."""

from __future__ import annotations

import json
import re

import pytest
from torch import nn

import neusight
from neusight.devices import load_device
from neusight.errors import InputError, ModelError
from neusight.evaluate import find_labels, predict_label
from neusight.parallel import (NCCL_PROTOCOLS, LinkPath, Parallelism, allgather_ms, allreduce_ms, alltoall_ms,
                               collective_call, nccl_collective, p2p_ms, predict_parallel, shard_tensor_parallel)
from tests.conftest import DATASET, need_shared


def _gemm_flops(g) -> float:
    k = g.kernels
    return float(k.loc[k["family"].isin(["linear", "bmm"]), "flops"].sum())


def test_option_names_parse_and_bad_ones_are_refused():
    assert Parallelism.from_option("dp4") == Parallelism(dp=4)
    assert Parallelism.from_option("tp2") == Parallelism(tp=2)
    assert Parallelism.from_option("pp4_8") == Parallelism(pp=4, microbatches=8)
    assert Parallelism(dp=2, tp=2, pp=2).gpus == 8
    with pytest.raises(InputError, match="'fusion'"):
        Parallelism.from_option("fusion")
    with pytest.raises(InputError, match="tp=0"):
        Parallelism(tp=0)


def test_collectives_follow_the_ring_formulas():
    h100 = load_device("h100-sxm5-80gb")          # 900 GB/s bidirectional NVLink -> 450 GB/s one way
    # all-reduce of 1 GB over 4 GPUs: 2 x 3/4 x 1e9 B / (450e9 x 0.8 B/s) = 4.1667 ms, + NCCL's Simple protocol's
    # latency: 8.4 us + 2 x 3 steps x 3.4 us over NVLink
    assert allreduce_ms(1e9, 4, h100) == pytest.approx(4.16667 + 0.0288, rel=1e-4)
    assert allreduce_ms(1e9, 1, h100) == 0.0
    # 64 KiB: NCCL's LL protocol, 6.6 us + 6 steps x 0.6 us, at a quarter of the bandwidth
    assert allreduce_ms(2**16, 4, h100) == pytest.approx((6.6 + 6 * 0.6) * 1e-3 + 1.5 * 2**16 / 90e9 * 1e3)
    # an all-gather: half the steps and half the bytes of an all-reduce; LL at a third of the bandwidth in one node
    assert allgather_ms(2**16, 4, h100) == pytest.approx((6.6 + 3 * 0.6) * 1e-3 + 0.75 * 2**16 / 120e9 * 1e3)
    assert allgather_ms(1e9, 4, h100) == pytest.approx(4.16667 / 2 + (8.4 + 3 * 3.4) * 1e-3, rel=1e-4)
    # point to point: 1e9 / 360e9 s = 2.7778 ms + 5 us
    assert p2p_ms(1e9, h100) == pytest.approx(2.7778 + 0.005, rel=1e-4)
    # all-to-all of 1 GB per GPU over 4 GPUs: 3/4 of it leaves, 2.0833 ms, + 3 exchanges x 5 us
    assert alltoall_ms(1e9, 4, h100) == pytest.approx(2.08333 + 0.015, rel=1e-4)
    assert alltoall_ms(1e9, 1, h100) == 0.0


def test_collectives_take_the_protocol_nccls_cost_model_finds_fastest():
    """NCCL's LL protocol for small messages (a decode step's all-reduce: tens of microseconds, where a ring of
    Simple steps would take 70 us on 8 GPUs), LL128 in between over NVLink, Simple for large ones; never LL128 over
    PCIe; the time grows with the bytes and with the GPUs, and is the least of the protocols' times. Rings only:
    the H100s' links here without NVLink SHARP (NVLS: the next test)."""
    h100, l4 = load_device("h100-sxm5-80gb"), load_device("l4")
    sizes = [2.0**e for e in range(3, 33)]
    rings = {h100: LinkPath(900.0), l4: None}
    for dev in (h100, l4):
        for n in (2, 4, 8):
            for passes in (1, 2):
                times = [nccl_collective(b, n, dev, rings[dev], passes=passes) for b in sizes]
                assert all(a[0] < b[0] for a, b in zip(times, times[1:]))              # monotone in bytes
                assert times[0][1] == "ring LL" and times[-1][1] == "ring Simple"
                assert dev is h100 or all("LL128" not in p for _, p in times)          # PCIe: no LL128
        assert all(nccl_collective(b, 4, dev, rings[dev])[0] < nccl_collective(b, 8, dev, rings[dev])[0]
                   for b in sizes)
    assert {p for _, p in (nccl_collective(b, 8, h100, rings[h100]) for b in sizes)} == {"ring LL", "ring LL128",
                                                                                         "ring Simple"}
    decode = allreduce_ms(8 * 8192 * 2, 8, h100)     # Llama-3-70B's hidden state, batch 8, BF16: 128 KiB
    assert 0.010 < decode < 0.020
    simple = next(p for p in NCCL_PROTOCOLS if p.name == "Simple")
    for b in sizes:
        as_simple = (simple.base_us + 14 * simple.step_us["nvlink"]) * 1e-3 + 1.75 * b / 360e9 * 1e3
        assert allreduce_ms(b, 8, h100) <= as_simple + 1e-12
    assert LinkPath.of(h100) == LinkPath(900.0, "nvlink", 1, nvls=True)
    assert LinkPath.of(l4, 32) == LinkPath(32.0, "pcie", 1)


def test_all_reduces_inside_an_nvlink_sharp_node_take_nvls_where_it_is_faster():
    """On GPUs whose NVSwitches reduce and multicast (HGX H100, B200: ``nvls`` in their specs), an all-reduce inside
    a node may run as NCCL's NVLS: each link carries (1 + 1/n) x the bytes each way instead of a ring's
    2 (n - 1) / n, at NCCL's efficiency for the architecture (Hopper 0.85, Blackwell 0.74) x 15/16 of its 16
    channels, after one 25 us latency. So it wins large and medium all-reduces over 8 GPUs, never small ones (the
    ring's LL steps are faster) nor any over 2 GPUs (it moves more bytes than the ring there); it is never slower
    than the rings, since NCCL takes the faster; all-gathers, reduce-scatters, other GPUs and groups across nodes
    have none."""
    from neusight.parallel import Links

    h100, b200, a100 = load_device("h100-sxm5-80gb"), load_device("b200"), load_device("a100-sxm4-80gb")
    sizes = [2.0**e for e in range(3, 34)]
    # 1 GiB over 8 H100s: 25 us + 9/8 of it at 0.85 x 15/16 of the ring's 360 GB/s (0.8 x 450 GB/s one way):
    # a bus bandwidth of 444 GB/s (2 x 7/8 x bytes / time) where the ring reaches 358
    for dev, eff, gbps in ((h100, 0.85, 360e9), (b200, 0.74, 720e9)):
        ms, how = nccl_collective(2**30, 8, dev)
        assert how == "NVLS Simple"
        assert ms == pytest.approx(0.025 + 9 / 8 * 2**30 / (gbps * eff * 15 / 16) * 1e3)
    assert 2 * 7 / 8 * 2**30 / nccl_collective(2**30, 8, h100)[0] / 1e6 == pytest.approx(444, abs=1)
    ring_only = LinkPath(900.0)
    for n in (2, 4, 8):
        runs = [nccl_collective(b, n, h100) for b in sizes]
        assert all(a[0] < b[0] for a, b in zip(runs, runs[1:]))                        # monotone in bytes
        for b, (ms, how) in zip(sizes, runs):
            ring_ms, ring_how = nccl_collective(b, n, h100, ring_only)
            assert ms <= ring_ms and (how == ring_how or how == "NVLS Simple" and ms < ring_ms)
        assert runs[0][1] == "ring LL" and ("NVLS Simple" in {h for _, h in runs}) == (n > 2)
        assert all(nccl_collective(b, n, h100, passes=1)[1].startswith("ring") for b in sizes)
    assert nccl_collective(2**17, 8, h100)[1] == "ring LL"      # a decode step's all-reduce
    assert nccl_collective(2**22, 8, h100)[1] == "NVLS Simple"   # 4 MiB: 41 us, the ring's LL128 63 us
    assert all(not nccl_collective(b, 8, a100)[1].startswith("NVLS") for b in sizes)
    # which groups: on nodes of NVLink-SHARP GPUs unless switched off; not over PCIe nor on other GPUs
    assert Links.of(Parallelism(dp=8), h100).dp.nvls and Links.of(Parallelism(tp=4, dp=2), h100).tp.nvls
    assert not Links.of(Parallelism(dp=8), h100, nvls=False).dp.nvls
    assert Links.of(Parallelism(dp=16), h100).dp.nvls and Links.of(Parallelism(tp=8, dp=2), h100).tp.nvls
    assert not any(Links.of(Parallelism(dp=8), load_device(k)).dp.nvls for k in ("a100-sxm4-80gb", "h100-pcie"))


def test_all_reduces_across_nvlink_sharp_nodes_take_nvls_tree_where_it_is_faster():
    """Over several nodes of H100s, NCCL's NVLS_TREE: NVLS inside each node, and each GPU's 1 / k of the node's sum
    (k of the group's GPUs per node) over its own network port in a tree between the nodes: once each way over
    two nodes, twice over more; the NVLink and network parts pipelined (the slower sets the time), after NVLS's
    25 us and 2 log2(nodes) tree hops of 20.9 us. It wins large all-reduces over 2 nodes of 8; a group with one GPU
    per node has no NVLS; it never makes an all-reduce slower; all-gathers have none."""
    from neusight.parallel import Links

    h100 = load_device("h100-sxm5-80gb")
    sizes = [2.0**e for e in range(3, 34)]
    two = Links.of(Parallelism(dp=16), h100).dp                  # 2 nodes, 8 GPUs each, 100 GB/s ports
    # 1 GiB: NVLink carries 9/8 of it at 0.85 x 15/16 x 360 GB/s (4.21 ms), each port 1/8 of it at 40 GB/s (3.36
    # ms): NVLink sets the time; a bus bandwidth of 2 x 15/16 x 2^30 B / 4.28 ms = 471 GB/s (rings: 309)
    ms, how = nccl_collective(2**30, 16, h100, two)
    switch = 9 / 8 * 2**30 / (360e9 * 0.85 * 15 / 16) * 1e3
    assert how == "NVLS_TREE Simple" and ms == pytest.approx((25 + 2 * 20.9) * 1e-3 + switch)
    assert 2**30 / 8 / 40e9 * 1e3 < switch
    assert 2 * 15 / 16 * 2**30 / ms / 1e6 == pytest.approx(471, abs=1)
    off = nccl_collective(2**30, 16, h100, Links.of(Parallelism(dp=16), h100, nvls=False).dp)
    assert off[1] == "ring Simple" and 2 * 15 / 16 * 2**30 / off[0] / 1e6 == pytest.approx(309, abs=1)
    for nodes in (2, 4, 8):
        path = Links.of(Parallelism(dp=8 * nodes), h100).dp
        off = Links.of(Parallelism(dp=8 * nodes), h100, nvls=False).dp
        runs = [nccl_collective(b, 8 * nodes, h100, path) for b in sizes]
        assert all(a[0] < b[0] for a, b in zip(runs, runs[1:]))                        # monotone in bytes
        for b, (ms, how) in zip(sizes, runs):
            ring_ms, ring_how = nccl_collective(b, 8 * nodes, h100, off)
            assert ms <= ring_ms and (how == ring_how or how == "NVLS_TREE Simple" and ms < ring_ms)
        assert "NVLS_TREE Simple" in {h for _, h in runs}
        assert all(nccl_collective(b, 8 * nodes, h100, path, passes=1)[1].startswith("ring") for b in sizes)
    # over 8 nodes each port carries its share twice: the 8 GiB all-reduce goes back to the ring
    assert nccl_collective(2**33, 64, h100, Links.of(Parallelism(dp=64), h100).dp)[1] == "ring Simple"
    one_per_node = Links.of(Parallelism(dp=8, tp=8), h100).dp
    assert one_per_node.rails == 1 and all(not nccl_collective(b, 8, h100, one_per_node)[1].startswith("NVLS")
                                           for b in sizes)


def test_nvls_shortens_a_tensor_parallel_step_on_h100_and_can_be_switched_off():
    """GPT-2 split over 4 H100s: its 6 MiB tensor-parallel all-reduces run as NVLS (43 us) rather than as rings;
    nvls=False forecasts the rings, every kernel the same; a note says which; a bad value is refused."""
    h100, cache = load_device("h100-sxm5-80gb"), {}
    on, off = (predict_parallel("gpt2", h100, batch_size=8, seq_len=256, tp=4, memory=False, cache=cache, nvls=v)
               for v in (True, False))
    assert on.parts["tp_comm"] < off.parts["tp_comm"]
    assert on.latency_ms - off.latency_ms == pytest.approx(on.parts["tp_comm"] - off.parts["tp_comm"])
    assert {k: v for k, v in on.parts.items() if k != "tp_comm"} == {k: v for k, v in off.parts.items()
                                                                     if k != "tp_comm"}
    note = lambda p: next(n for n in p.notes if n.startswith("each tensor-parallel all-reduce"))  # noqa: E731
    assert "as NCCL's NVLS Simple" in note(on) and "as NCCL's ring" in note(off)
    assert any("NCCL's NVLS algorithm (NVLS_TREE across nodes) where its cost model" in n for n in on.notes)
    assert any("not used here (nvls=false" in n for n in off.notes)
    a100 = predict_parallel("gpt2", "a100-sxm4-80gb", batch_size=8, seq_len=256, tp=4, memory=False, cache=cache)
    assert not any("NVLink SHARP" in n for n in a100.notes)
    with pytest.raises(InputError, match="nvls='yes' is not true or false"):
        predict_parallel("gpt2", h100, batch_size=8, seq_len=256, tp=2, nvls="yes")


def test_all_reduces_over_many_nodes_take_nccls_tree_where_it_is_faster():
    """A tree's all-reduce crosses log2(nodes) network hops each way where a ring crosses 2 x nodes steps, so over
    8 nodes NCCL's model runs small and medium all-reduces as a tree and the largest as a ring (half a tree's bus
    bandwidth against n / (2 (n - 1)) of the ring's); inside one node the ring's LL and LL128 steps stay the
    faster. All-gathers and reduce-scatters have no tree. Time grows with the bytes and with the nodes."""
    from neusight.parallel import NCCL_TREE_PROTOCOLS

    h100 = load_device("h100-sxm5-80gb")
    sizes = [2.0**e for e in range(3, 34)]
    def path(nodes: int) -> LinkPath:       # 8 GPUs per node, each with a 100 GB/s network link
        return LinkPath(100.0, "nvlink", nodes, 8, 900.0) if nodes > 1 else LinkPath(900.0)

    for nodes in (1, 2, 4, 8):
        runs = [nccl_collective(b, 8 * nodes, h100, path(nodes)) for b in sizes]
        assert all(a[0] < b[0] for a, b in zip(runs, runs[1:]))                     # monotone in bytes
        assert runs[-1][1] == "ring Simple"
        assert all(p.startswith("ring") for _, p in runs) == (nodes == 1)
        assert all(nccl_collective(b, 8 * nodes, h100, path(nodes), passes=1)[1].startswith("ring") for b in sizes)
    on = lambda b, nodes: nccl_collective(b, 8 * nodes, h100, path(nodes))[0]  # noqa: E731
    assert all(on(b, 2) < on(b, 4) < on(b, 8) for b in sizes)                           # and in the nodes
    # a 128 KiB all-reduce over 8 nodes: the tree's LL (6.8 us + 2 x (7 x 0.6 + 3 x 5.0) us, the bytes twice at
    # 1 / 3.8 x 0.92 of the 8 network links together x NCCL's medium-size correction, 0.5 at 2^11 x 64 B) beats
    # every ring
    ll = next(p for p in NCCL_TREE_PROTOCOLS if p.name == "LL")
    want = (ll.base_us + 2 * (7 * 0.6 + 3 * 5.0)) * 1e-3 + 2 * 2**17 / (400e9 * 0.8 / 3.8 * 0.92 * 0.5) * 1e3
    assert nccl_collective(2**17, 64, h100, path(8)) == (pytest.approx(want), "tree LL")
    # the least latency of a ring there (LL: 6.6 us, 110 steps inside nodes at the network's 1 us post overhead,
    # 16 between nodes at 2.7 us) is already above the tree's whole time
    assert want < (6.6 + 110 * 1.0 + 16 * 2.7) * 1e-3


def test_gpus_on_one_software_path_share_a_multi_gpu_trace():
    """With a cache kept across GPUs (as a multi-GPU ranking keeps one), GPUs whose software takes the same path
    share one trace of a GPU's micro-batch, as predict_many shares them: eager FP32 attention is the same kernels on
    every GPU (one trace); SDPA in FP16 picks its backend by the GPU (a T4 has no flash attention): one trace per
    path. Each
    forecast is the one the GPU gets alone, notes included, and a GPU that cannot run the trace is refused as
    alone (FP8 on an A100 after an H100)."""
    from neusight.graph.tracer import software_path

    kw = dict(batch_size=8, seq_len=128, tp=2, memory=False)
    gpus = ("a100-80gb-pcie", "t4", "h100-sxm5-80gb", "a100-sxm4-80gb")
    sdpa = dict(dtype="float16", attn_implementation="sdpa")
    paths = {software_path(load_device(k), "float16", "sdpa") for k in gpus}
    assert 2 <= len(paths) < len(gpus)
    for extra, n_traces in ((dict(), 1), (sdpa, len(paths))):
        cache: dict = {}
        shared = [predict_parallel("gpt2", k, cache=cache, **kw, **extra) for k in gpus]
        traces = [v for key, v in cache.items() if key[0] == "traces"]
        assert len(traces) == 1 and len(traces[0]) == n_traces
        alone = [predict_parallel("gpt2", k, **kw, **extra) for k in gpus]
        assert [(p.latency_ms, p.parts, p.notes) for p in shared] == [(p.latency_ms, p.parts, p.notes) for p in alone]
    cache = {}
    llama = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    fp8 = dict(kw, dtype="bfloat16", fp8=True, cache=cache)
    assert predict_parallel(llama, "h100-sxm5-80gb", **fp8).latency_ms > 0
    with pytest.raises(InputError, match="fp8=True needs FP8 tensor cores; a100-80gb-pcie"):
        predict_parallel(llama, "a100-80gb-pcie", **fp8)
    assert [len(v) for key, v in cache.items() if key[0] == "traces"] == [1]   # refused on the H100's trace


def test_a_forecast_names_the_algorithm_and_protocol_of_its_collectives():
    h100 = load_device("h100-sxm5-80gb")
    p = predict_parallel("gpt2", h100, batch_size=8, seq_len=256, mode="training", dp=2, tp=2, memory=False)
    tp_note = next(n for n in p.notes if n.startswith("each tensor-parallel all-reduce"))
    act = 4 * 256 * 768 * 4                     # a micro-batch's (tokens, hidden) activation in FP32, per replica
    ms, how = nccl_collective(act, 2, h100)
    assert f"{act / 2**20:,.1f} MiB over 2 GPUs, {ms * 1e3:,.1f} us as NCCL's {how}" in tp_note
    assert how.startswith("ring ") and "two in the backward" in tp_note
    dp_note = next(n for n in p.notes if n.startswith("the gradients' all-reduce:"))
    assert p.parts["dp_allreduce"] < 1 and f"{p.parts['dp_allreduce'] * 1e3:,.1f} us as NCCL's ring" in dp_note
    inference = predict_parallel("gpt2", h100, batch_size=8, seq_len=256, mode="inference", tp=2, memory=False)
    assert not any("two in the backward" in n or "gradients' all-reduce:" in n for n in inference.notes)


def test_zero_and_ddp_notes_give_their_collectives_per_call():
    h100 = load_device("h100-sxm5-80gb")
    kw = dict(batch_size=8, seq_len=128, mode="training", dp=4, memory=False)
    z2 = predict_parallel("gpt2", h100, zero=2, **kw)
    note = next(n for n in z2.notes if n.startswith("ZeRO stage 2's collectives"))
    grads = params = 124_439_808 * 4                       # GPT-2's parameters (its head tied), FP32
    # not overlapped: the note's calls are what the forecast charges
    assert collective_call(grads, 4, h100, passes=1) in note
    assert f"{z2.parts['dp_allreduce']:,.2f} ms as NCCL's" in note.split("; ")[0]
    assert f"{z2.parts['dp_gather']:,.2f} ms as NCCL's" in note.split("; ")[1]
    assert f"{params / 2**20:,.1f} MiB over 4 GPUs" in note.split("; ")[1]
    z3 = predict_parallel("gpt2", h100, zero=3, **kw)
    note = next(n for n in z3.notes if n.startswith("ZeRO stage 3's collectives"))
    block = 7_087_872 * 4                                   # one GPT-2 block's parameters: the median of 13 units
    assert "12 transformer blocks and the rest" in note
    assert f"before its forward and its backward pass, {collective_call(block, 4, h100, passes=1)};" in note
    assert note.endswith(collective_call(block, 4, h100, passes=1))      # its gradients: as large, FP32 too
    ddp = predict_parallel("gpt2", h100, overlap_grad_reduce=True, **kw)
    note = next(n for n in ddp.notes if "as PyTorch DDP runs it" in n)
    median = re.search(r"the median bucket: ([\d.,]+) MiB over 4 GPUs, [\d.,]+ (us|ms) as NCCL's ring", note)
    assert median and 25 <= float(median.group(1).replace(",", "")) < 200
    assert not any("collectives, " in n for n in ddp.notes)


def test_tensor_parallel_shard_halves_the_gemm_work():
    whole = neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training", optimizer=None)
    half = neusight.trace("gpt2", batch_size=2, seq_len=64, mode="training", optimizer=None, tensor_parallel=2)
    # every block GEMM and attention head splits in two; the LM head keeps ceil(50257 / 256) x 128 = 25,216
    # vocabulary rows instead of 25,128.5 (Megatron's padding), so the ratio sits a little above 1/2
    ratio = _gemm_flops(half) / _gemm_flops(whole)
    assert 0.5 < ratio < 0.505
    # layer norms stay whole on every GPU
    ln = lambda g: g.kernels.loc[g.kernels["family"] == "layernorm", "flops"].sum()  # noqa: E731
    assert ln(half) == ln(whole)


def test_llama_blocks_split_like_megatron_with_grouped_query_heads():
    whole = neusight.trace("llama-3-8b", batch_size=1, seq_len=32, mode="training", optimizer=None)
    half = neusight.trace("llama-3-8b", batch_size=1, seq_len=32, mode="training", optimizer=None, tensor_parallel=2)
    # q, k, v, gate, up split by output, o and down by input; the LM head by vocabulary (128256 = 501 x 256: no
    # padding), so the GEMM work halves exactly
    assert _gemm_flops(half) / _gemm_flops(whole) == pytest.approx(0.5, abs=1e-9)
    k = {p.shape for p in half.params}
    assert (2048, 4096) in k and (512, 4096) in k and (7168, 4096) in k and (4096, 7168) in k   # q, k/v, up, down
    with pytest.raises(InputError, match="does not divide the 8 num_key_value_heads of LlamaAttention"):
        neusight.trace("llama-3-8b", batch_size=1, seq_len=16, mode="inference", tensor_parallel=16)


_TINY_MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     vocab_size=512)


def test_mixtral_splits_attention_and_every_expert_like_a_megatron_mlp(tmp_path):
    cfg = tmp_path / "mixtral.json"
    cfg.write_text(json.dumps(_TINY_MIXTRAL))
    whole = neusight.trace(str(cfg), batch_size=2, seq_len=32, mode="training", optimizer=None)
    half = neusight.trace(str(cfg), batch_size=2, seq_len=32, mode="training", optimizer=None, tensor_parallel=2)
    # attention and every expert's intermediate width halve; the vocabulary (512 = 2 x 256) splits without padding;
    # the router (64 -> 4 experts) and its gradients are the GEMMs that stay whole on every GPU
    def router(g):
        k = g.kernels[g.kernels["family"] == "linear"]
        return k.loc[k["dims"].map(lambda d: 4 in d[1:]), "flops"].sum()
    assert router(half) == router(whole) > 0
    assert (_gemm_flops(half) - router(half)) / (_gemm_flops(whole) - router(whole)) == pytest.approx(0.5, abs=1e-9)
    shapes = {tuple(p.shape) for p in half.params}
    assert (4, 2 * 48, 64) in shapes and (4, 64, 48) in shapes      # gate_up and down of the 4 experts
    odd = tmp_path / "odd.json"     # heads divide by 4, an expert's 98 intermediate features do not
    odd.write_text(json.dumps(dict(_TINY_MIXTRAL, num_key_value_heads=4, intermediate_size=98)))
    with pytest.raises(InputError, match="does not divide the 98 intermediate features"):
        neusight.trace(str(odd), batch_size=1, seq_len=8, mode="inference", tensor_parallel=4)
    p = predict_parallel(str(cfg), "h100-sxm5-80gb", batch_size=2, seq_len=32, mode="training", tp=2)
    assert p.parts["tp_comm"] > 0 and p.latency_ms > 0


_TINY_DEEPSEEK = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                      q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                      n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=512)


def test_latent_attention_splits_its_heads_and_keeps_its_shared_down_projections():
    """DeepSeek's multi-head latent attention at tp=2: the per-head up projections (q_b, kv_b) and the output
    projection halve, the shared low-rank down projections (q_a, kv_a) stay whole on every GPU, so does the
    attention's compressed KV cache, whose keys (the 16-wide latent) and values (the 8-wide rotary key) differ in
    width; the dense MLP, shared and routed experts halve too."""
    def gemm(g, pattern):
        k = g.kernels
        k = k[(k["phase"] == "forward") & k["family"].isin(["linear", "bmm"])]
        return float(k.loc[k["module"].str.contains(pattern), "flops"].sum())

    for kv_cache, seq in ((None, 32), (15, 1)):
        whole, half = (neusight.trace(_TINY_DEEPSEEK, batch_size=2, seq_len=seq, mode="inference",
                                      kv_cache=kv_cache, tensor_parallel=tp) for tp in (1, 2))
        for part in (r"q_b_proj$", r"kv_b_proj$", r"o_proj$", r"self_attn$", r"mlp\.(?:gate|up|down)_proj$",
                     r"shared_experts", r"experts$"):
            assert gemm(whole, part) > 0, part
            assert gemm(half, part) == pytest.approx(gemm(whole, part) / 2, rel=1e-12), part
        for part in (r"q_a_proj$", r"kv_a_proj_with_mqa$"):
            assert gemm(half, part) == gemm(whole, part) > 0, part
    with pytest.raises(InputError, match="does not divide the 4 num_attention_heads of DeepseekV3Attention"):
        neusight.trace(_TINY_DEEPSEEK, batch_size=1, seq_len=8, mode="inference", tensor_parallel=8)


def _expert_gemms(g):
    k = g.kernels
    return k[k["module"].str.contains(r"\.experts\b") & k["family"].isin(["linear", "bmm"])]


def test_expert_parallel_spreads_the_experts_and_keeps_their_work(tmp_path):
    """ep=2 of dp=2: each GPU holds 2 of the 4 experts, which run on the token rows of both GPUs (balanced routing),
    so the experts' GEMM work per GPU is unchanged in half as many GEMMs; the router stays whole. Per experts layer
    call two all-to-alls of its token rows, two more in the backward pass; the experts' gradients are not all-reduced
    (no other replica holds the same experts), the rest over both replicas."""
    cfg = tmp_path / "mixtral.json"
    cfg.write_text(json.dumps(_TINY_MIXTRAL))
    kw = dict(batch_size=4, seq_len=32, mode="training", dp=2, optimizer="adamw", moe_kernels="loop")
    whole = predict_parallel(str(cfg), "h100-sxm5-80gb", **kw)
    spread = predict_parallel(str(cfg), "h100-sxm5-80gb", ep=2, **kw)
    gw, gs = whole.per_gpu.graph, spread.per_gpu.graph
    assert _expert_gemms(gw)["flops"].sum() > 0
    assert _expert_gemms(gs)["flops"].sum() == pytest.approx(_expert_gemms(gw)["flops"].sum(), rel=1e-12)
    forward = lambda g: int((_expert_gemms(g)["phase"] == "forward").sum())  # noqa: E731
    assert forward(gw) == 2 * forward(gs) == 2 * 2 * 4                      # 2 layers, 2 projections per expert
    shapes = {tuple(p.shape) for p in gs.params}
    assert (2, 2 * 96, 64) in shapes and (2, 64, 96) in shapes and (4, 64) in shapes   # gate_up, down, router
    assert _gemm_flops(gs) == pytest.approx(_gemm_flops(gw), rel=1e-12)
    # each of 2 layers: one call in the forward pass; 2 x 32 tokens x top-2 rows of 64 FP32 values
    assert gs.expert_dispatch == [(f"model.layers.{i}.mlp.experts", "forward", 2 * 32 * 2 * 64 * 4.0) for i in (0, 1)]
    h100 = load_device("h100-sxm5-80gb")
    assert spread.parts["ep_alltoall"] == pytest.approx(2 * 4 * alltoall_ms(2 * 32 * 2 * 64 * 4.0, 2, h100))
    assert whole.parts["ep_alltoall"] == 0
    experts = sum(t.numel * t.itemsize for n, t in zip(gs.param_names, gs.params) if ".experts." in n)
    total = sum(t.numel * t.itemsize for t in gs.params)
    assert spread.parts["dp_allreduce"] == pytest.approx(allreduce_ms(total - experts, 2, h100))
    assert whole.memory_breakdown["weights"] - spread.memory_breakdown["weights"] == pytest.approx(experts)
    assert spread.memory_peak_bytes < whole.memory_peak_bytes
    assert "ep 2" in spread.summary() and any("expert parallelism" in n for n in spread.notes)
    one = alltoall_ms(2 * 32 * 2 * 64 * 4.0, 2, h100)              # each call's, as charged above
    assert any(f"(0.0 MiB from each GPU a call, {one * 1e3:,.1f} us;" in n for n in spread.notes)


def test_expert_parallel_dispatches_again_for_a_recomputed_layer_and_splits_switch_experts():
    # a checkpointed layer runs its forward again in the backward pass: two more all-to-alls per layer (6 vs 4)
    kw = dict(batch_size=4, seq_len=32, mode="training", dp=2, ep=2, optimizer=None, memory=False)
    plain = predict_parallel(_TINY_MIXTRAL, "a100-sxm4-40gb", **kw)
    ckpt = predict_parallel(_TINY_MIXTRAL, "a100-sxm4-40gb", gradient_checkpointing=True, **kw)
    assert [ph for _, ph, _ in ckpt.per_gpu.graph.expert_dispatch] == ["forward", "backward"] * 2   # per layer
    assert ckpt.parts["ep_alltoall"] == pytest.approx(1.5 * plain.parts["ep_alltoall"])
    # a decode step: one call per layer (the KV-cache probe's forward is not counted), one token x top-2 rows each
    decode = neusight.trace(_TINY_MIXTRAL, batch_size=2, seq_len=1, mode="inference", kv_cache=7, expert_parallel=2)
    assert decode.expert_dispatch == [(f"model.layers.{i}.mlp.experts", "forward", 2 * 2 * 64 * 4.0) for i in (0, 1)]
    # Switch Transformers: 2 of 4 experts per GPU, each with twice the fixed capacity
    one = neusight.trace("switch-base-4", batch_size=2, seq_len=64, mode="inference")
    two = neusight.trace("switch-base-4", batch_size=2, seq_len=64, mode="inference", expert_parallel=2)
    assert _expert_gemms(one)["flops"].sum() > 0
    assert _expert_gemms(two)["flops"].sum() == pytest.approx(_expert_gemms(one)["flops"].sum(), rel=1e-12)
    assert len(_expert_gemms(two)) == len(_expert_gemms(one)) // 2
    assert [b for _, _, b in two.expert_dispatch] == [b for _, _, b in one.expert_dispatch]


def test_zero_with_expert_parallelism_shards_the_experts_over_the_replicas_that_hold_them():
    """dp=4, ep=2: each expert lives on 2 of the 4 replicas, so ZeRO splits the experts' optimizer state two ways
    and the rest four ways; the optimizer steps that average share of the parameters."""
    kw = dict(batch_size=8, seq_len=32, mode="training", dp=4, ep=2, optimizer="adamw")
    plain = predict_parallel(_TINY_MIXTRAL, "h100-sxm5-80gb", **kw)
    z1 = predict_parallel(_TINY_MIXTRAL, "h100-sxm5-80gb", zero=1, **kw)
    g = plain.per_gpu.graph
    sizes = {n: t.numel * t.itemsize for n, t in zip(g.param_names, g.params)}
    f = sum(v for n, v in sizes.items() if ".experts." in n) / sum(sizes.values())
    share = (1 - f) / 4 + f / 2
    assert z1.memory_breakdown["optimizer"] == pytest.approx(plain.memory_breakdown["optimizer"] * share)
    assert z1.parts["optimizer"] == pytest.approx(plain.parts["optimizer"] * share)
    z3 = predict_parallel(_TINY_MIXTRAL, "h100-sxm5-80gb", zero=3, **kw)
    assert z3.memory_peak_bytes < z1.memory_peak_bytes < plain.memory_peak_bytes
    assert z3.parts["dp_gather"] > 0 and z3.parts["ep_alltoall"] == plain.parts["ep_alltoall"] > 0


@pytest.mark.parametrize("kw, error, fragment", [
    (dict(dp=4, ep=3), InputError, "ep=3 does not divide dp=4"),
    (dict(dp=8, ep=8), InputError, "ep=8 does not divide the 4 experts of model.layers.0.mlp.experts"),
    (dict(dp=2, ep=2, megatron=True), InputError, "ep=2 with megatron=True"),
    (dict(dp=2, ep=2, lora_rank=4), InputError, "expert parallelism (ep=2) is not modelled"),
    (dict(dp=2, ep=2, model="gpt2"), ModelError, "GPT2LMHeadModel has no experts layers"),
])
def test_bad_expert_parallel_runs_say_what_to_change(kw, error, fragment):
    model = kw.pop("model", _TINY_MIXTRAL)
    with pytest.raises(error, match=re.escape(fragment)):
        predict_parallel(model, "a100-sxm4-40gb", batch_size=8, seq_len=16, mode="training", **kw)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_blocks_split_like_llama(tmp_path, model_type):
    import transformers

    if not hasattr(transformers.models, model_type):
        pytest.skip(f"this transformers has no {model_type}")
    cfg = tmp_path / "qwen.json"    # Qwen2: biased q / k / v; Qwen3: RMS norms of q and k per head
    cfg.write_text(json.dumps(dict(model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)))
    whole = neusight.trace(str(cfg), batch_size=2, seq_len=32, mode="training", optimizer=None)
    half = neusight.trace(str(cfg), batch_size=2, seq_len=32, mode="training", optimizer=None, tensor_parallel=2)
    assert _gemm_flops(half) / _gemm_flops(whole) == pytest.approx(0.5, abs=1e-9)
    assert half.unmodeled == []


_TINY_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "qwen3_moe", "granite", "cohere", "starcoder2",
                                        "ministral", "phi3", "llama4_text", "gpt_oss"])
def test_other_llama_style_blocks_halve_every_layer_product(model_type):
    """Each block's projections, MLP (or experts) and attention products halve at tp=2; only routers stay whole."""
    import transformers

    if not hasattr(transformers.models, model_type.removesuffix("_text")):
        pytest.skip(f"this transformers has no {model_type}")
    cfg = {"model_type": model_type, **_TINY_DECODER}
    whole, half = (neusight.trace(cfg, batch_size=2, seq_len=32, mode="training", optimizer=None, tensor_parallel=tp)
                   for tp in (1, 2))

    def layer_products(g):
        k = g.kernels
        k = k[k["family"].isin(["linear", "bmm"]) & k["module"].str.contains(r"layers\.\d+\.")]
        return float(k.loc[~k["module"].str.contains(r"\.gate$|router"), "flops"].sum())

    assert layer_products(half) / layer_products(whole) == pytest.approx(0.5, abs=0.003)   # bias gradients aside
    assert half.unmodeled == []


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_language_models_language_models_split_like_llama(model_type):
    """The language model of Qwen2-VL / Qwen2.5-VL / Qwen3-VL (multimodal rotary positions; traced with its
    composite model's LM head): every layer product and the vocabulary-parallel LM head halve at tp=2."""
    import transformers

    if not hasattr(transformers.models, model_type):
        pytest.skip(f"this transformers has no {model_type}")
    text = {"model_type": f"{model_type}_text", **_TINY_DECODER, "hidden_size": 512, "head_dim": 128}  # M-RoPE: 128
    whole, half = (neusight.trace({"model_type": model_type, "text_config": text}, batch_size=2, seq_len=32,
                                  mode="training", optimizer=None, tensor_parallel=tp) for tp in (1, 2))

    def products(g, modules):
        k = g.kernels
        return float(k.loc[k["family"].isin(["linear", "bmm"]) & k["module"].str.contains(modules), "flops"].sum())

    for modules in (r"layers\.\d+\.", r"^lm_head$"):
        assert products(half, modules) / products(whole, modules) == pytest.approx(0.5, abs=1e-9), modules
    assert half.unmodeled == []


def test_gpt_j_splits_like_llama_and_refuses_heads_tp_does_not_divide():
    """GPT-J's q / k / v / out projections and fc_in / fc_out halve at tp=2, so do its attention products and each
    GPU's KV cache (half the heads); 4 heads do not split 8 ways."""
    cfg = dict(model_type="gptj", n_embd=64, n_head=4, n_layer=2, rotary_dim=8, vocab_size=512, n_positions=256)

    def layer_products(g):
        k = g.kernels
        return float(k.loc[k["family"].isin(["linear", "bmm"]) & k["module"].str.contains(r"\.h\.\d+\."),
                           "flops"].sum())

    whole, half = (neusight.trace(cfg, batch_size=2, seq_len=32, mode="training", optimizer=None, tensor_parallel=tp)
                   for tp in (1, 2))
    assert layer_products(whole) > 0
    assert layer_products(half) / layer_products(whole) == pytest.approx(0.5, abs=0.003)   # bias gradients aside
    assert half.unmodeled == []
    step = [neusight.trace(cfg, batch_size=2, seq_len=1, mode="inference", kv_cache=15, static_cache=True,
                           tensor_parallel=tp) for tp in (1, 2)]
    assert layer_products(step[1]) / layer_products(step[0]) == pytest.approx(0.5, abs=0.003)
    with pytest.raises(InputError, match="does not divide the 4 num_attention_heads of GPTJAttention"):
        neusight.trace(cfg, batch_size=1, seq_len=8, mode="inference", tensor_parallel=8)


@pytest.mark.parametrize("model_type", ["olmo2", "glm"])
def test_blocks_that_are_not_llama_style_are_refused(model_type):
    """OLMo 2 normalizes the whole query width, GLM fuses gate and up in a block otherwise its own: neither is split."""
    with pytest.raises(ModelError, match="Llama-style blocks"):
        neusight.trace({"model_type": model_type, **_TINY_DECODER}, batch_size=2, seq_len=8, tensor_parallel=2)


def test_a_model_split_only_in_part_is_refused():
    """OLMoE's routed experts split like Mixtral's, but its attention (which normalizes the whole query width, as
    OLMo 2's) does not: a forecast with the attention whole on every GPU is refused, not returned."""
    with pytest.raises(ModelError, match=r"split only part of OlmoeForCausalLM: its OlmoeAttention block"):
        neusight.trace({"model_type": "olmoe", **_TINY_DECODER, "num_experts": 4}, batch_size=2, seq_len=8,
                       tensor_parallel=2)

    class LlamaMLP(nn.Module):          # a block tensor parallelism knows, by its class name
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    class MyAttention(nn.Module):       # and one it does not
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

    model = nn.Sequential(LlamaMLP(), MyAttention()).to("meta")
    with pytest.raises(ModelError, match="its MyAttention block with linear layers is not among the modelled ones"):
        shard_tensor_parallel(model, 2)
    assert shard_tensor_parallel(nn.Sequential(LlamaMLP()).to("meta"), 2)[0].up_proj.out_features == 8


_TINY_LLAMA4 = dict(model_type="llama4_text", hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, vocab_size=512,
                    attention_chunk_size=16)


def test_llama4s_experts_split_as_transformers_runs_them_and_need_routing_for_expert_parallelism():
    kw = dict(batch_size=2, seq_len=32, mode="inference", dtype="bfloat16")
    whole, half = (neusight.trace(_TINY_LLAMA4, tensor_parallel=tp, **kw) for tp in (1, 2))
    experts = lambda g: g.kernels[g.kernels["module"].str.endswith("feed_forward.experts")  # noqa: E731
                                  & (g.kernels["family"] == "bmm")]
    # every expert on every token (2 x 32 rows each), its intermediate width halved: gate-up 128 -> 64, down 64 -> 32
    assert set(experts(whole)["dims"]) == {(4, 64, 64, 128), (4, 64, 64, 64)}
    assert set(experts(half)["dims"]) == {(4, 64, 64, 64), (4, 64, 32, 64)}
    with pytest.raises(ModelError, match=re.escape("Fix: moe_kernels='grouped'")):
        predict_parallel(_TINY_LLAMA4, "h100-sxm5-80gb", dp=2, ep=2, **kw)
    routed = predict_parallel(_TINY_LLAMA4, "h100-sxm5-80gb", dp=2, ep=2, moe_kernels="grouped", **kw)
    assert routed.parts["ep_alltoall"] > 0


def test_zero_stages_shard_the_state_and_trade_collectives():
    """ZeRO over 4 replicas: stage 1 holds 1/4 of the optimizer state and steps 1/4 of the parameters, 2 also 1/4 of
    the gradients, 3 also 1/4 of the weights (plus two gathered blocks); the reduce-scatter and all-gather of stages
    1-2 move what the all-reduce moves (two calls, so one more of NCCL's base latencies), stage 3 gathers the
    parameters twice more (1.5x in all); compute is the same. Memory per GPU falls with every stage."""
    kw = dict(batch_size=8, seq_len=128, mode="training", dp=4, optimizer="adamw")
    runs = {z: predict_parallel("gpt2", "a100-sxm4-40gb", zero=z, **kw) for z in (0, 1, 2, 3)}
    base = runs[0]
    g = base.per_gpu.graph
    state = sum(t.numel * t.itemsize for t in g.optimizer_state)
    peaks = [runs[z].memory_peak_bytes for z in (0, 1, 2, 3)]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]
    for z in (1, 2, 3):
        p = runs[z]
        assert p.parts["compute"] == base.parts["compute"]
        assert p.parts["optimizer"] == pytest.approx(base.parts["optimizer"] / 4)
        assert p.memory_breakdown["optimizer"] == pytest.approx(state / 4)
        assert any(f"ZeRO stage {z}" in n for n in p.notes)
    simple = next(p for p in NCCL_PROTOCOLS if p.name == "Simple")
    for z in (1, 2):
        assert runs[z].parts["dp_allreduce"] + runs[z].parts["dp_gather"] == pytest.approx(
            base.parts["dp_allreduce"] + simple.base_us * 1e-3)
    assert runs[3].parts["dp_allreduce"] + runs[3].parts["dp_gather"] > 1.5 * base.parts["dp_allreduce"]
    assert runs[3].parts["dp_gather"] == pytest.approx(2 * runs[3].parts["dp_allreduce"], rel=1e-9)
    weights = sum(t.numel * t.itemsize for t in g.params)
    # a shard, and the two largest units gathered less their shards: GPT-2's embeddings and final norm (wte 50257 x
    # 768, wpe 1024 x 768, 2 x 768) and one block (7,087,872 parameters), FP32
    gathered = (50257 * 768 + 1024 * 768 + 2 * 768 + 7_087_872) * 4 * 3 / 4
    assert runs[3].memory_breakdown["weights"] == pytest.approx(weights / 4 + gathered)
    assert runs[2].memory_breakdown["weights"] == pytest.approx(weights)


@pytest.mark.parametrize("kw, fragment", [
    (dict(zero=4, dp=2), "zero=4 is not a ZeRO stage"),
    (dict(zero=1, dp=1), "dp=1 has none"),
    (dict(zero=2, dp=2, mode="inference"), "this run is inference"),
    (dict(zero=1, dp=2, pp=2), "with pipeline stages (pp=2)"),
])
def test_bad_zero_runs_say_what_to_change(kw, fragment):
    kw = {"mode": "training", **kw}
    with pytest.raises(InputError, match=re.escape(fragment)):
        predict_parallel("gpt2", "a100-sxm4-40gb", batch_size=4, seq_len=32, **kw)


def test_groups_that_span_nodes_run_at_the_network_links():
    """Ranks as Megatron-LM orders them (tensor-parallel innermost, pipeline outermost), 8 per node: with dp=4 x
    tp=4 the tensor-parallel groups stay in a node, the data-parallel ones span two with two GPUs on each; NCCL
    spreads their ring's channels over those two GPUs' network links (100 GB/s each), so the all-reduce crosses
    nodes at 200 GB/s instead of NVLink's 900. A group with one GPU per node has that GPU's link alone; one with
    8 per node reaches 800. Rings and trees only here (nvls=False: H100 SXM's NVLink SHARP has tests of its own)."""
    from neusight.parallel import Links

    h100 = load_device("h100-sxm5-80gb")
    links = Links.of(Parallelism(dp=4, tp=4), h100, nvls=False)
    across = LinkPath(100, "nvlink", 2, rails=2, inside_gbps=900)
    assert (links.tp, links.dp, links.nodes) == (LinkPath(900), across, 2) and across.ring_gbps == 200
    assert Links.of(Parallelism(dp=4, tp=4), h100).dp == LinkPath(100, "nvlink", 2, 2, 900, nvls=True)
    nvlink = LinkPath(900, "nvlink", 1, nvls=True)
    assert Links.of(Parallelism(dp=2, tp=4), h100) == Links(nvlink, nvlink, nvlink, nvlink, 1, nvlink)
    assert Links.of(Parallelism(dp=2, tp=4), h100, gpus_per_node=4).dp == LinkPath(100, "nvlink", 2, 1, 900,
                                                                                    nvls=True)
    assert Links.of(Parallelism(dp=16), h100).dp.ring_gbps == 800                       # 8 NICs per node
    assert Links.of(Parallelism(dp=8, tp=8), h100).dp.ring_gbps == 100                  # one GPU per node
    l4 = load_device("l4")
    pcie = Links.of(Parallelism(dp=4, tp=4), l4).dp                                     # PCIe inside a node
    assert pcie == LinkPath(l4.interconnect_gbps, "pcie", 2, 2, l4.interconnect_gbps)
    assert pcie.ring_gbps == l4.interconnect_gbps
    # one GPU's own transfers (all-to-all, point to point) keep its link; rings and trees use the rails
    assert alltoall_ms(1e9, 4, h100, across) == alltoall_ms(1e9, 4, h100, LinkPath(100, "nvlink", 2))
    assert allreduce_ms(1e9, 4, h100, across) < allreduce_ms(1e9, 4, h100, LinkPath(100, "nvlink", 2))
    kw = dict(batch_size=16, seq_len=128, mode="training", dp=4, tp=4, memory=False, nvls=False)
    two = predict_parallel("gpt2", "h100-sxm5-80gb", **kw)
    one = predict_parallel("gpt2", "h100-sxm5-80gb", gpus_per_node=16, **kw)
    assert two.parts["tp_comm"] == one.parts["tp_comm"] and two.parts["compute"] == one.parts["compute"]
    grads = sum(t.numel * t.itemsize for t in two.per_gpu.graph.grads)
    assert two.parts["dp_allreduce"] == pytest.approx(allreduce_ms(grads, 4, h100, across))
    assert one.parts["dp_allreduce"] == pytest.approx(allreduce_ms(grads, 4, h100, LinkPath(900)))
    # at 200 GB/s (100 one way, 80 % of it); NCCL counts 2 x nodes = 4 of the ring's 6 steps between nodes (the
    # network's latency per step) and 2 on NVLink inside a node, and its "plateau effect" takes 1.4 x that latency
    simple = next(p for p in NCCL_PROTOCOLS if p.name == "Simple")
    assert two.parts["dp_allreduce"] - grads * 1.5 / (100e9 * 0.8) * 1e3 == pytest.approx(
        1.4 * (simple.base_us + 2 * simple.step_us["nvlink"] + 4 * simple.step_us["network"]) * 1e-3)
    assert any("2 nodes of 8 GPUs" in n and "(data-parallel: 200 GB/s)" in n for n in two.notes)
    with pytest.raises(InputError, match="gpus_per_node=0"):
        predict_parallel("gpt2", "h100-sxm5-80gb", gpus_per_node=0, **kw)
    with pytest.raises(InputError, match="internode_gbps=-1"):
        predict_parallel("gpt2", "h100-sxm5-80gb", internode_gbps=-1, **kw)


def test_fewer_network_ports_than_gpus_are_shared_by_the_nodes_gpus():
    """nics_per_node=4 on nodes of 8 GPUs: each port (internode_gbps) serves two GPUs, so every group crossing nodes
    gets half the network it gets with one port per GPU; groups inside a node are untouched."""
    from neusight.parallel import Links

    h100 = load_device("h100-sxm5-80gb")
    for par, default, shared in ((Parallelism(dp=16), 800, 400), (Parallelism(dp=8, tp=8), 100, 50),
                                 (Parallelism(dp=4, tp=4), 200, 100)):
        assert Links.of(par, h100).dp.ring_gbps == default
        assert Links.of(par, h100, nics_per_node=4).dp.ring_gbps == shared
        assert Links.of(par, h100, nics_per_node=8) == Links.of(par, h100)          # one port per GPU: the default
        assert Links.of(par, h100, nics_per_node=4).tp == Links.of(par, h100).tp
    assert Links.of(Parallelism(dp=8, tp=8), h100, nics_per_node=2).dp.gbps == 25
    kw = dict(batch_size=32, seq_len=128, mode="training", dp=16, memory=False)
    full = predict_parallel("gpt2", h100, **kw)
    half = predict_parallel("gpt2", h100, nics_per_node=4, **kw)
    assert half.parts["compute"] == full.parts["compute"] and half.parts["dp_allreduce"] > full.parts["dp_allreduce"]
    assert any("4 network ports of 100 GB/s per node" in n and "50 GB/s per GPU" in n
               and "(data-parallel: 400 GB/s)" in n for n in half.notes)
    for bad, match in ((0, "nics_per_node=0 must be a positive integer"), (True, "nics_per_node=True"),
                       (2.5, "nics_per_node=2.5"), (16, "nics_per_node=16 is more than gpus_per_node=8")):
        with pytest.raises(InputError, match=match):
            predict_parallel("gpt2", h100, nics_per_node=bad, **kw)


def test_groups_beyond_a_bridged_pair_run_over_pcie():
    """PCIe boards with NVLink bridges (interconnect_group: 2) join pairs: with tensor parallelism innermost a
    tp=2 group is a bridged pair, while the data-parallel group of dp=2 x tp=2 spans 4 GPUs and runs over PCIe."""
    from neusight.devices import modify_device
    from neusight.parallel import Links

    a100 = load_device("a100-80gb-pcie")
    assert a100.interconnect_group == 2 and a100.pcie_gbps < a100.interconnect_gbps
    links = Links.of(Parallelism(dp=2, tp=2), a100)
    assert (links.tp, links.dp) == (LinkPath(a100.interconnect_gbps, "nvlink"), LinkPath(a100.pcie_gbps, "pcie"))
    assert Links.of(Parallelism(dp=2), a100).dp == LinkPath(a100.interconnect_gbps, "nvlink")
    assert Links.of(Parallelism(tp=4), a100).tp == LinkPath(a100.pcie_gbps, "pcie")
    mi210 = load_device("mi210")
    assert Links.of(Parallelism(dp=4), mi210).dp == LinkPath(mi210.interconnect_gbps, "nvlink")   # a hive
    kw = dict(batch_size=16, seq_len=128, mode="training", dp=2, tp=2, memory=False)
    pairs = predict_parallel("gpt2", a100, **kw)
    switched = predict_parallel("gpt2", modify_device(a100, interconnect_group=8), **kw)   # as if all 4 were linked
    assert pairs.parts["tp_comm"] == switched.parts["tp_comm"]
    assert pairs.parts["dp_allreduce"] > 5 * switched.parts["dp_allreduce"]
    assert any("join groups of 2 GPUs" in n and "data-parallel collectives" in n for n in pairs.notes)
    assert not any("join groups of" in n for n in switched.notes)
    for d in map(load_device, neusight.list_devices()):
        if d.interconnect_group is not None:     # a group size only means something where PCIe is slower
            assert d.pcie_gbps < d.interconnect_gbps, d.key


def test_one_gpu_is_the_single_gpu_forecast():
    one = predict_parallel("gpt2", "a100-pcie-40gb", batch_size=4, seq_len=128)
    single = neusight.predict("gpt2", "a100-pcie-40gb", batch_size=4, seq_len=128, mode="training", optimizer=None,
                              memory=False)
    assert one.latency_ms == pytest.approx(single.latency_ms, rel=1e-9)
    assert one.parts["tp_comm"] == one.parts["pp_bubble"] == one.parts["dp_allreduce"] == 0


def test_parts_compose_as_the_schedule_says():
    kw = dict(batch_size=8, seq_len=128, device="h100-sxm5-80gb")
    dp = predict_parallel("gpt2", dp=2, **kw)
    half = predict_parallel("gpt2", **{**kw, "batch_size": 4})
    # each replica runs half the batch, then all-reduces its FP32 gradients
    assert dp.parts["compute"] == pytest.approx(half.parts["compute"])
    n_params = sum(t.numel for t in dp.per_gpu.graph.grads)
    assert dp.parts["dp_allreduce"] == pytest.approx(allreduce_ms(4.0 * n_params, 2, load_device("h100-sxm5-80gb")))
    # a pipeline of 4 stages: the first micro-batch crosses every stage, the others follow at the slowest stage's
    # pace; the bubble's share falls with more micro-batches
    one, few, many = (predict_parallel("gpt2", pp=4, microbatches=m, **kw) for m in (1, 2, 8))
    slots = few.stages[["forward_ms", "backward_ms", "tp_comm_ms", "p2p_ms"]].sum(axis=1)
    work = few.stages[["forward_ms", "backward_ms", "tp_comm_ms"]].sum(axis=1)
    assert few.parts["pp_bubble"] == pytest.approx(work.sum() - work[slots.idxmax()])
    assert few.parts["pp_p2p"] == pytest.approx(few.stages["p2p_ms"].sum() + few.stages["p2p_ms"][slots.idxmax()])
    assert few.parts["embedding_allreduce"] > 0            # GPT-2 ties its word embedding to the head
    assert few.latency_ms == pytest.approx(slots.sum() + slots.max() + few.parts["embedding_allreduce"])
    assert many.parts["pp_bubble"] / many.latency_ms < few.parts["pp_bubble"] / few.latency_ms
    # one micro-batch: the stages run one after the other, the whole model once plus the hand-offs (unbalanced
    # stages, e.g. the last with the LM head, do not stretch every slot to the slowest)
    whole = predict_parallel("gpt2", **kw)
    assert one.latency_ms == pytest.approx(whole.parts["compute"] + one.stages["p2p_ms"].sum()
                                           + one.parts["embedding_allreduce"], rel=1e-9)
    assert list(few.stages["blocks"]) == [3, 3, 3, 3]      # GPT-2's 12 blocks over 4 stages
    tp = predict_parallel("gpt2", tp=2, **kw)
    assert tp.parts["tp_comm"] > 0 and tp.parts["compute"] < predict_parallel("gpt2", **kw).parts["compute"]


def test_bad_parallel_runs_say_what_to_change():
    with pytest.raises(InputError, match="does not divide the 12 attention heads"):
        predict_parallel("gpt2", "t4", batch_size=2, seq_len=64, tp=5)
    with pytest.raises(ModelError, match="tensor parallelism is modelled for"):
        predict_parallel("resnet18", "t4", batch_size=2, tp=2)
    with pytest.raises(InputError, match="batch_size=6 does not split"):
        predict_parallel("gpt2", "t4", batch_size=6, seq_len=64, dp=4)


def test_multi_gpu_label_runs_are_found_on_request_and_forecast(tmp_path):
    need_shared(DATASET)
    gpu = tmp_path / "labels" / "NVIDIA_H100_80GB_HBM3"
    gpu.mkdir(parents=True)
    (tmp_path / "models").symlink_to(DATASET / "models")
    (gpu / "bert_large-train-512-8-dp4.json").write_text(json.dumps({"e2e_latency": 100.0}))
    assert find_labels(tmp_path) == []
    (run,) = find_labels(tmp_path, options=("parallel",))
    res = predict_label(run)
    assert run.option == "dp4" and res["predicted_ms"] > 0 and res["roofline_ms"] < res["predicted_ms"]


def test_memory_per_gpu_divides_the_state_among_stages_and_shards():
    kw = dict(batch_size=4, seq_len=64, optimizer="adamw", device="a100-80gb-pcie")
    one = predict_parallel("gpt2", **kw)
    single = neusight.predict("gpt2", "a100-80gb-pcie", batch_size=4, seq_len=64, mode="training")
    assert one.memory_peak_bytes == pytest.approx(single.memory.peak_bytes)
    two = predict_parallel("gpt2", pp=2, microbatches=2, **kw)
    # weights, gradients and Adam state split over 2 stages: the first holds the embeddings and blocks 0-5
    g = one.per_gpu.graph
    first = sum(t.numel for name, t in zip(g.param_names, g.params)
                if name.startswith(("transformer.wte.", "transformer.wpe."))
                or any(name.startswith(f"transformer.h.{i}.") for i in range(6)))
    share = first / sum(t.numel for t in g.params)
    assert 0.6 < share < 0.7
    for part in ("weights", "gradients", "optimizer"):
        assert two.memory_breakdown[part] == pytest.approx(one.memory_breakdown[part] * share)
    tp = predict_parallel("gpt2", tp=2, **kw)
    assert tp.memory_breakdown["weights"] < 0.6 * one.memory_breakdown["weights"]
    assert one.memory_fits and predict_parallel("gpt2", memory=False, **kw).memory_peak_bytes is None


def test_encoder_decoder_blocks_are_numbered_in_order_and_split_evenly():
    # Switch-Base: 12 encoder blocks then 12 decoder blocks, both named block.0 ... block.11; the activation the
    # stages exchange is read off the first projection (its RMS norm is no layer-norm kernel)
    p = predict_parallel("switch-base-4", "h100-sxm5-80gb", batch_size=4, seq_len=64, pp=2, microbatches=2)
    assert list(p.stages["blocks"]) == [12, 12]
    assert p.parts["pp_bubble"] > 0


def test_the_same_parallel_run_gives_the_same_forecast_bit_for_bit():
    kw = dict(batch_size=8, seq_len=64, dp=2, tp=2, pp=2, microbatches=2, memory=False)
    a, b = (predict_parallel("gpt2", "a100-sxm4-40gb", **kw) for _ in range(2))
    assert a.latency_ms == b.latency_ms and a.parts == b.parts


def test_megatron_step_has_its_kernels_clipping_fused_adam_and_per_stage_parameters():
    kw = dict(batch_size=4, seq_len=128, device="a100-sxm4-40gb", memory=False)
    meg = predict_parallel("gpt2", megatron=True, **kw)
    k = meg.per_gpu.kernels
    # fused bias-GeLU: one kernel per block and phase, where Hugging Face runs a chain of elementwise kernels
    fused = k[k["kernel"] == "megatron"]
    assert sorted(fused["phase"].value_counts().to_dict().items()) == [("backward", 12), ("forward", 12)]
    assert not (k["module"].str.endswith("mlp.act") & (k["kernel"] != "megatron")).any()
    # the step: clip (norm + scale), one fused AdamW kernel, the buffer's memset
    opt = k[k["phase"] == "optimizer"]["aten_op"].tolist()
    assert {"aten._foreach_norm.Scalar", "aten._foreach_mul_.Tensor", "aten._fused_adamw_.default",
            "aten._foreach_zero_.default"} <= set(opt)
    assert meg.parts["optimizer"] > 0 and 0 < meg.roofline_ms <= meg.latency_ms     # the law, for the whole step
    plain = predict_parallel("gpt2", **kw)
    assert plain.parts["optimizer"] == 0 and meg.parts["compute"] < plain.parts["compute"]
    # two stages: the busiest holds more than half the parameters (embeddings, and the last stage's copy of the
    # tied word embedding), whose gradients the first and last stage all-reduce
    two = predict_parallel("gpt2", pp=2, megatron=True, **kw)
    assert two.parts["optimizer"] > meg.parts["optimizer"] / 2
    wte = 50257 * 768 * 4
    assert two.parts["embedding_allreduce"] == pytest.approx(allreduce_ms(wte, 2, load_device("a100-sxm4-40gb")))
    assert meg.parts["embedding_allreduce"] == 0           # one stage holds the only copy


def test_largest_batch_under_zero_is_where_the_parallel_forecast_stops_fitting():
    """find_max_batch(zero=3, dp=4): one replica's batch B such that predict_parallel fits at the global batch 4 B
    and not at 4 (B + 1); sharding the state lets a replica hold more than without ZeRO (GPT-2 on an 8 GB P4)."""
    from neusight.memory import find_max_batch

    kw = dict(seq_len=256, mode="training", optimizer="adamw")
    plain = find_max_batch("gpt2", "p4", **kw)
    sharded = find_max_batch("gpt2", "p4", zero=3, dp=4, **kw)
    assert sharded > plain >= 1
    fit, miss = (predict_parallel("gpt2", "p4", 4 * b, dp=4, zero=3, **kw) for b in (sharded, sharded + 1))
    assert fit.memory_fits and not miss.memory_fits
    with pytest.raises(InputError, match="dp=1 has none"):
        find_max_batch("gpt2", "p4", zero=1, **kw)


def test_interleaved_schedule_divides_the_bubble_and_adds_chunk_boundaries():
    """vpp chunks per GPU (Megatron-LM's interleaved 1F1B): the same stages' work, the bubble / vpp, every GPU
    sending a micro-batch across vpp chunk boundaries (the last one vpp - 1), and activations of (1 + (pp - 1) /
    (pp x vpp)) x the layers' worth in flight on the first GPU."""
    kw = dict(batch_size=8, seq_len=64, mode="training", pp=4, microbatches=8, optimizer="adamw")
    plain = predict_parallel("gpt2", "h100-sxm5-80gb", **kw)
    three = predict_parallel("gpt2", "h100-sxm5-80gb", vpp=3, **kw)
    assert three.parts["compute"] == plain.parts["compute"] and three.parts["optimizer"] == plain.parts["optimizer"]
    assert three.parts["pp_bubble"] == pytest.approx(plain.parts["pp_bubble"] / 3, rel=1e-12)
    hop = plain.stages["p2p_ms"].iloc[0]
    assert hop > 0 and list(plain.stages["p2p_ms"]) == pytest.approx([hop, hop, hop, 0.0])
    assert list(three.stages["p2p_ms"]) == pytest.approx([3 * hop, 3 * hop, 3 * hop, 2 * hop])
    assert three.memory_breakdown["activations"] == pytest.approx(plain.memory_breakdown["activations"]
                                                                  * (1 + 3 / 12), rel=1e-12)
    assert three.latency_ms < plain.latency_ms
    assert "interleaved: 3 chunks per GPU" in three.summary()


@pytest.mark.parametrize("kw, fragment", [
    (dict(pp=1, vpp=2), "vpp=2 interleaves model chunks over pipeline stages, and needs pp > 1"),
    (dict(pp=4, microbatches=6, vpp=3), "microbatches=6"),
    (dict(pp=4, microbatches=8, vpp=2), "vpp=2 chunks on each of pp=4 stages need a number of transformer blocks"),
    (dict(pp=2, microbatches=2, vpp=0), "vpp=0 must be a positive integer"),
])
def test_bad_interleaving_says_what_to_change(kw, fragment):
    with pytest.raises(InputError, match=re.escape(fragment)):
        predict_parallel("gpt2", "h100-sxm5-80gb", batch_size=24, seq_len=16, mode="training", **kw)


def test_sequence_parallelism_splits_the_whole_width_kernels_and_their_activations_by_tokens():
    """sp=True (Megatron-LM's sequence parallelism) on tp=4 GPT-2 blocks: per block the layer norms, the two
    dropouts after the row-parallel projections and the residual adds (forward and backward: 12 kernels) run on
    tokens / 4 rows; the MLP's activation, as wide as the block on a 4-way shard of a 4 x hidden MLP, is not among
    them; what they save for backward (per block in FP32: two layer-norm inputs and two outputs, 4 bytes each, and
    two 1-byte dropout masks: 18 bytes per token and hidden unit, Korthikanti et al.'s 10 sbh in 16 bits) is 1 / 4
    as large; the collectives do not change."""
    from neusight.parallel import sequence_parallel_mask, split_sequence

    b, s, tp, h, blocks = 4, 128, 4, 768, 12
    kw = dict(batch_size=b, seq_len=s, mode="training", tp=tp, optimizer="adamw")
    plain = predict_parallel("gpt2", "h100-sxm5-80gb", **kw)
    sp = predict_parallel("gpt2", "h100-sxm5-80gb", sp=True, **kw)
    k = plain.per_gpu.graph.kernels
    mask = sequence_parallel_mask(k)
    assert mask.sum() == 12 * blocks
    picked = k.loc[mask, "module"].str.replace(r"\.h\.\d+", ".h.N", regex=True)
    assert set(picked) == {"transformer.h.N", "transformer.h.N.ln_1", "transformer.h.N.ln_2",
                           "transformer.h.N.attn.resid_dropout", "transformer.h.N.mlp.dropout"}
    act = k["module"].str.endswith(".mlp.act")
    assert k.loc[act, "dims"].map(lambda d: tuple(d) == (b * s, h)).any()   # as wide as the block, not picked
    split = split_sequence(k, tp)
    assert (split.loc[mask, "dims"] == k.loc[mask, "dims"].map(lambda d: (d[0] // tp, d[1]))).all()
    assert (split.loc[~mask, "dims"] == k.loc[~mask, "dims"]).all()
    assert split.loc[mask, "bytes"].sum() == pytest.approx(k.loc[mask, "bytes"].sum() / tp)
    assert sp.parts["tp_comm"] == plain.parts["tp_comm"] and sp.parts["compute"] < plain.parts["compute"]
    tokens = b * s
    saved = plain.memory_breakdown["activations"] - sp.memory_breakdown["activations"]
    # + each layer norm's mean and reciprocal deviation per token (2 x 2 x 4 bytes); the first block's input is
    # the embedding's (not split) while the last block's output is saved by the final layer norm: they cancel
    assert saved == pytest.approx((1 - 1 / tp) * blocks * (18 * h + 16) * tokens, rel=1e-6)
    assert "tp 4 with sp" in sp.summary() and any("sequence parallelism" in n for n in sp.notes)


@pytest.mark.parametrize("kw, fragment", [
    (dict(tp=1, sp=True), "tp=1 has none"),
    (dict(tp=4, sp="yes"), "sp='yes' is not true or false"),
    (dict(tp=4, sp=True, seq_len=30), "do not divide them"),
])
def test_bad_sequence_parallelism_says_what_to_change(kw, fragment):
    run = {**dict(batch_size=1, seq_len=32, mode="training"), **kw}
    with pytest.raises(InputError, match=re.escape(fragment)):
        predict_parallel("gpt2", "h100-sxm5-80gb", **run)


def test_an_overlapped_gradient_reduction_leaves_what_outlasts_the_backward_pass():
    """Two blocks and the rest of the model, each gradient collective taking its bytes in ms: block 1's backward
    ends at 5 (its collective runs 5-9), block 0's at 9 (9-13), the backward pass at 10, the rest's collective
    waits for block 0's (13-15): 5 ms past the backward pass. Forward kernels and another stage's are not in it;
    a block's tensor-parallel all-reduces (1 ms each block) delay its gradients and the backward's end alike."""
    import pandas as pd

    from neusight.parallel import exposed_grad_reduce_ms

    k = pd.DataFrame({"op_index": range(7), "phase": ["forward", "backward", "backward", "backward", "backward",
                                                      "backward", "backward"],
                      "module": ["transformer.h.0.mlp", "lm_head", "transformer.h.1.mlp.c_proj", "transformer.h.1.attn",
                                 "transformer.h.0.attn", "transformer.h.2.mlp", "transformer.wte"],
                      "ms": [50.0, 1.0, 1.0, 3.0, 4.0, 70.0, 1.0]})
    mine = k["module"] != "transformer.h.2.mlp"
    grads = {"transformer.h.1": 4.0, "transformer.h.0": 4.0, "": 2.0}
    assert exposed_grad_reduce_ms(k, mine, grads, "ms", lambda b: b) == pytest.approx(5.0)
    assert exposed_grad_reduce_ms(k, mine, grads, "ms", lambda b: b, tp_block_ms=1.0) == pytest.approx(5.0)
    assert exposed_grad_reduce_ms(k, mine, grads, "ms", lambda b: b / 4) == pytest.approx(0.5)   # only the rest's
    assert exposed_grad_reduce_ms(k, mine, {"": 2.0}, "ms", lambda b: b) == pytest.approx(2.0)   # no blocks: all


@pytest.mark.parametrize("kw", [dict(dp=4), dict(dp=4, zero=2), dict(dp=2, tp=2), dict(dp=2, pp=2, microbatches=2)])
def test_overlapping_the_gradient_reduction_hides_at_most_the_backward_pass(kw):
    """The law: overlapped, the exposed reduction is no more than the reduction alone and no less than what the
    busiest stage's backward pass cannot cover; nothing else changes. Plain data parallelism runs as PyTorch DDP
    (by its buckets; its copy kernels told in a note, not charged), the other layouts block by block."""
    run = dict(batch_size=8, seq_len=128, mode="training", optimizer="adamw", **kw)
    alone = predict_parallel("gpt2", "a100-sxm4-40gb", **run)
    over = predict_parallel("gpt2", "a100-sxm4-40gb", overlap_grad_reduce=True, **run)
    ddp = kw == dict(dp=4)
    assert any("as PyTorch DDP runs it" in n and "Not included" in n for n in over.notes) == ddp
    assert any("one collective per transformer block" in n for n in over.notes) == (not ddp)
    a, o = alone.parts["dp_allreduce"], over.parts["dp_allreduce"]
    backward = float(alone.stages["backward_ms"].max() + alone.stages["tp_comm_ms"].max() / 2)
    assert max(0.0, a - backward) <= o < a
    assert over.latency_ms == pytest.approx(alone.latency_ms - (a - o))
    assert {k: v for k, v in over.parts.items() if k != "dp_allreduce"} == \
        {k: v for k, v in alone.parts.items() if k != "dp_allreduce"}
    assert over.roofline_ms <= alone.roofline_ms
    assert over.memory_peak_bytes == alone.memory_peak_bytes
    assert any("overlap_grad_reduce" in n and f"{a:,.1f} ms of it alone" in n for n in over.notes)


@pytest.mark.parametrize("kw, fragment", [
    (dict(dp=1), "dp=1 has none"),
    (dict(dp=2, mode="inference"), "this run is inference"),
    (dict(dp=2, overlap_grad_reduce="yes"), "overlap_grad_reduce='yes' is not true or false"),
])
def test_bad_overlap_of_the_gradient_reduction_says_what_to_change(kw, fragment):
    run = {"batch_size": 4, "seq_len": 32, "mode": "training", "overlap_grad_reduce": True, **kw}
    with pytest.raises(InputError, match=re.escape(fragment)):
        predict_parallel("gpt2", "a100-sxm4-40gb", **run)


def test_gathers_before_each_block_and_prefetched_one_ahead():
    """Blocks of 10 ms whose gathers take 5 (then 15) ms each: with the next block's gather issued when the pass
    reaches the running block (prefetch 1), only the first gather shows (5 ms); at 15 ms a gather the pass waits
    for every gather (3 x 15 - 2 x 10 = 25 ms), as it does with every gather issued at the start. A block whose
    kernels come in two runs (its recomputed forward before the end of the block after it, in the backward pass)
    is prefetched from its first run."""
    import pandas as pd

    from neusight.parallel import exposed_collectives_ms

    k = pd.DataFrame({"op_index": range(3), "phase": "forward", "ms": 10.0,
                      "module": ["m.layers.0.mlp", "m.layers.1.mlp", "m.layers.2.attn"]})
    every = pd.Series(True, index=k.index)
    five = {f"m.layers.{i}": 5.0 for i in range(3)}
    assert exposed_collectives_ms(k, every, ("forward",), "ms", gathers=five, prefetch=1) == pytest.approx(5.0)
    slow = {u: 15.0 for u in five}
    for prefetch in (1, None):
        assert exposed_collectives_ms(k, every, ("forward",), "ms", gathers=slow, prefetch=prefetch) == \
            pytest.approx(25.0)
    assert exposed_collectives_ms(k, every, ("backward",), "ms", gathers=slow, prefetch=1) == 0.0   # no such pass
    bwd = pd.DataFrame({"op_index": range(4), "phase": "backward", "ms": [10.0, 8.0, 2.0, 4.0],
                        "module": ["m.layers.1.mlp", "m.layers.0.mlp", "m.layers.1.mlp", "m.layers.0.attn"]})
    # block 1 runs 5-15 after its gather (0-5); block 0's gather (5-10) is issued as block 1 starts: 5 ms exposed
    got = exposed_collectives_ms(bwd, pd.Series(True, index=bwd.index), ("backward",), "ms", gathers=five, prefetch=1)
    assert got == pytest.approx(5.0)


@pytest.mark.parametrize("zero", [1, 3])
def test_overlapping_the_parameter_gathers_hides_at_most_the_compute(zero):
    run = dict(batch_size=8, seq_len=128, mode="training", optimizer="adamw", dp=4, zero=zero)
    alone = predict_parallel("gpt2", "a100-sxm4-40gb", **run)
    over = predict_parallel("gpt2", "a100-sxm4-40gb", overlap_param_gather=True, **run)
    both = predict_parallel("gpt2", "a100-sxm4-40gb", overlap_param_gather=True, overlap_grad_reduce=True, **run)
    a, o = alone.parts["dp_gather"], over.parts["dp_gather"]
    assert max(0.0, a - alone.parts["compute"]) <= o < a
    assert over.parts["dp_allreduce"] == alone.parts["dp_allreduce"]           # not overlapped unless asked
    assert both.parts["dp_allreduce"] < alone.parts["dp_allreduce"]
    assert both.latency_ms < over.latency_ms < alone.latency_ms
    assert both.roofline_ms <= both.latency_ms and over.roofline_ms <= alone.roofline_ms
    assert any("overlap_param_gather" in n and f"{a:,.1f} ms of them alone" in n for n in over.notes)


@pytest.mark.parametrize("kw, fragment", [
    (dict(dp=2), "zero=0 gathers none"),
    (dict(dp=2, zero=1, overlap_param_gather=1), "overlap_param_gather=1 is not true or false"),
])
def test_bad_overlap_of_the_parameter_gathers_says_what_to_change(kw, fragment):
    run = {"batch_size": 4, "seq_len": 32, "mode": "training", "overlap_param_gather": True, **kw}
    with pytest.raises(InputError, match=re.escape(fragment)):
        predict_parallel("gpt2", "a100-sxm4-40gb", **run)


def test_a_model_without_transformer_blocks_overlaps_its_gradients_by_ddp_buckets():
    """A CNN's gradients are reduced as PyTorch DDP reduces them: by buckets in the order they are ready, beside the
    backward pass. The laws of the overlap hold, nothing else changes, and the notes say which."""
    from neusight.parallel import ddp_bucket_copies_ms

    run = dict(batch_size=64, mode="training", optimizer="sgd", dp=4, image_size=64)
    alone = predict_parallel("resnet18", "a100-sxm4-40gb", **run)
    over = predict_parallel("resnet18", "a100-sxm4-40gb", overlap_grad_reduce=True, **run)
    g = over.per_gpu.graph
    copies = ddp_bucket_copies_ms([t.numel for t in g.params], "float32", load_device("a100-sxm4-40gb"))
    assert copies[0] >= copies[1] > 0
    a, o = alone.parts["dp_allreduce"], over.parts["dp_allreduce"]
    backward = float(alone.stages["backward_ms"].max())
    assert max(0.0, a - backward) <= o < a
    assert {k: v for k, v in over.parts.items() if k != "dp_allreduce"} == \
        {k: v for k, v in alone.parts.items() if k != "dp_allreduce"}
    assert over.roofline_ms <= alone.roofline_ms
    assert any("overlap_grad_reduce=true forecasts that" in n for n in alone.notes)
    # DDP's copy kernels: told with their forecast time, not charged
    assert any(f"copied back), {copies[0]:,.2f} ms" in n for n in over.notes)
    assert any("as PyTorch DDP runs it" in n and f"{a:,.1f} ms of it alone" in n for n in over.notes)
    assert not any("hide nothing" in n for n in over.notes)
    # with ZeRO there are no DDP buckets: a block-less model's reduction stays after the pass, and says so
    zero = dict(run, zero=1)
    plain = predict_parallel("resnet18", "a100-sxm4-40gb", **zero)
    sharded = predict_parallel("resnet18", "a100-sxm4-40gb", overlap_grad_reduce=True, **zero)
    assert sharded.parts["dp_allreduce"] == pytest.approx(plain.parts["dp_allreduce"])
    assert any("no transformer blocks" in n and "hide nothing" in n for n in sharded.notes)


def test_ddp_buckets_follow_the_ready_order_and_the_caps():
    import pandas as pd

    from neusight.parallel import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_buckets, exposed_bucket_reduce_ms

    mib = 2.0**20
    # backward order: head, then blocks 3 .. 0; each module's kernels end at 1, 2, ... ms
    mods = ["head", "b3", "b2", "b1", "b0"]
    k = pd.DataFrame({"op_index": range(5), "phase": "backward", "module": mods, "ms": 1.0})
    names = [f"{m}.weight" for m in reversed(mods)] + ["unused.weight"]    # registration order: b0 first
    sizes = [10 * mib, 10 * mib, 10 * mib, 30 * mib, 0.25 * mib, 5 * mib]
    buckets = ddp_buckets(k, k["phase"] == "backward", names, sizes, "ms")
    # head (0.25 MiB, ready at 1) + b3 (30 MiB, at 2) close the 1 MiB first bucket; b2 + b1 (20 MiB) wait for more;
    # the unused parameter (no backward kernel) is ready at the pass's end, like b0, and comes first of the two
    # (DDP's initial order is the registration order reversed): 25 MiB close the second bucket, b0 is the third
    assert buckets == [(2.0, 30.25 * mib), (5.0, 25 * mib), (5.0, 10 * mib)]
    assert sum(b for _, b in buckets) == pytest.approx(sum(sizes))
    # the caps are PyTorch's own defaults
    from torch.distributed import _DEFAULT_FIRST_BUCKET_BYTES
    from torch.nn.parallel.distributed import _DEFAULT_BUCKET_CAP_MB

    assert (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES) == (_DEFAULT_FIRST_BUCKET_BYTES, _DEFAULT_BUCKET_CAP_MB * 2**20)
    # the stream: bucket 1 runs 2 -> 2 + 30.25, buckets 2 and 3 after it; a pass of 5 ms leaves the rest exposed
    assert exposed_bucket_reduce_ms(buckets, 5.0, lambda b: b / mib) == pytest.approx(2 + 30.25 + 35 - 5)
    # collectives that take no time expose nothing; a pass longer than the stream hides everything
    assert exposed_bucket_reduce_ms(buckets, 5.0, lambda b: 0.0) == 0.0
    assert exposed_bucket_reduce_ms(buckets, 100.0, lambda b: b / mib) == 0.0


def test_ddp_bucket_copies_are_two_elementwise_passes_per_parameter():
    from neusight.parallel import ddp_bucket_copies_ms, elementwise_passes_ms

    a100 = load_device("a100-sxm4-40gb")
    numels = [64, 1024, 1024, 2_359_296]
    got = ddp_bucket_copies_ms(numels, "float32", a100)
    assert got == pytest.approx(elementwise_passes_ms([(64, 2), (1024, 4), (2_359_296, 2)], "copy_", "float32", a100))
    # each pass reads and writes the gradient: the roofline is 4 x its bytes over the DRAM bandwidth
    assert got[1] == pytest.approx(4 * 4 * sum(numels) / a100.mem_bandwidth_bytes_per_s * 1e3, rel=1e-6)
    assert got[0] >= got[1]
    assert ddp_bucket_copies_ms(numels + [4096], "float32", a100)[0] > got[0]       # more parameters, more time
    assert ddp_bucket_copies_ms(numels, "bfloat16", a100)[1] == pytest.approx(got[1] / 2)
    assert ddp_bucket_copies_ms([], "float32", a100) == (0.0, 0.0)


def _column_backward(order: str):
    """One block's backward kernels of a column-parallel QKV projection (Conv1D order: input gradient, weight
    gradient, bias sum; Linear without bias, as Llama's: weight gradient first), 64 tokens, 96 -> 32 features."""
    import pandas as pd

    dgrad = ("linear", (1, 64, 96, 32), 2.0)           # (tokens, out) x (out, in): reduces over the 96 outputs
    wgrad = ("linear", (1, 32, 64, 96), 3.0)           # reduces over the 64 tokens
    rows = [dgrad, wgrad, ("reduction", (96, 64), 0.5)] if order == "conv1d" else [wgrad, dgrad]
    rows.append(("layernorm", (64, 32), 1.0))           # not the projection's: never counted
    return pd.DataFrame({"op_index": range(len(rows)), "phase": "backward", "family": [r[0] for r in rows],
                         "dims": [r[1] for r in rows], "ms": [r[2] for r in rows],
                         "module": ["h.0.attn.c_attn"] * (len(rows) - 1) + ["h.0.ln_1"]})


@pytest.mark.parametrize("order, wgrad_ms", [("conv1d", 3.5), ("linear", 3.0)])
def test_megatron_hides_the_input_gradient_collective_behind_the_weight_gradient(order, wgrad_ms):
    """Megatron-LM's asynchronous tensor-parallel all-reduce: issued after the input-gradient GEMM, it runs beside
    the weight-gradient GEMM (and the bias's sum), which hide up to their own time of it. With sequence
    parallelism the collective is a reduce-scatter (half an all-reduce), and the saved input is all-gathered again
    beside the input-gradient GEMM (2 ms here): what outlasts that GEMM is added."""
    import pandas as pd

    from neusight.parallel import async_tp_delta_ms

    k = _column_backward(order)
    stage = pd.Series(0, index=k.index)
    cols = ("h.0.attn.c_attn",)
    assert async_tp_delta_ms(k, cols, stage, 1, "ms", 1.0, 64) == [pytest.approx(-2.0)]          # all hidden
    assert async_tp_delta_ms(k, cols, stage, 1, "ms", 5.0, 64) == [pytest.approx(-wgrad_ms)]     # 10 ms: partly
    assert async_tp_delta_ms(k, cols, stage, 1, "ms", 1.0, 64, sp=True) == [pytest.approx(-1.0)]
    # reduce-scatter of 5 ms: the weight gradient hides wgrad_ms of it; the 5 ms re-gather outlasts the 2 ms GEMM
    assert async_tp_delta_ms(k, cols, stage, 1, "ms", 5.0, 64, sp=True) == [pytest.approx(-wgrad_ms + 3.0)]
    assert async_tp_delta_ms(k, (), stage, 1, "ms", 5.0, 64) == [0.0]
    two = pd.Series(1, index=k.index)                   # the block on the second of two stages
    assert async_tp_delta_ms(k, cols, two, 2, "ms", 1.0, 64) == [0.0, pytest.approx(-2.0)]


def test_tensor_parallel_trace_names_its_column_parallel_projections():
    g = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training", optimizer=None, tensor_parallel=2)
    assert len(g.tp_columns) == 24 and set(c.rsplit(".", 1)[1] for c in g.tp_columns) == {"c_attn", "c_fc"}
    opt = neusight.trace("opt-125m", batch_size=2, seq_len=32, mode="inference", tensor_parallel=2)
    assert {c.rsplit(".", 1)[1] for c in opt.tp_columns} == {"q_proj", "k_proj", "v_proj", "fc1"}
    assert neusight.trace("gpt2", batch_size=2, seq_len=32, mode="inference").tp_columns == ()


def test_megatron_tensor_parallel_step_overlaps_only_backward_collectives():
    """Laws of the overlap in a Megatron-LM step: it only removes time (forward all-reduces stay whole), never more
    than the backward all-reduces it overlaps, the roofline stays below the forecast, and it is Megatron-LM's:
    the Hugging Face kernels' forecast and inference are untouched."""
    kw = dict(batch_size=4, seq_len=128, device="a100-sxm4-40gb", memory=False, tp=2)
    meg = predict_parallel("gpt2", megatron=True, **kw)
    a100 = load_device("a100-sxm4-40gb")
    ar = allreduce_ms(4 * 128 * 768 * 4, 2, a100)
    forward_only = (12 * 2 + 1) * ar
    assert forward_only * (1 - 1e-9) <= meg.parts["tp_comm"] < (12 * 4 + 1) * ar   # here: every backward one hidden
    assert meg.stages["tp_overlap_ms"].iloc[0] == pytest.approx(meg.parts["tp_comm"] - (12 * 4 + 1) * ar)
    assert any("asynchronous" in n for n in meg.notes) and 0 < meg.roofline_ms <= meg.latency_ms
    hf = predict_parallel("gpt2", **kw)
    assert (hf.stages["tp_overlap_ms"] == 0).all() and hf.parts["tp_comm"] == pytest.approx((12 * 4 + 1) * ar)
    inf = predict_parallel("gpt2", megatron=True, mode="inference", **kw)
    assert (inf.stages["tp_overlap_ms"] == 0).all() and not any("asynchronous" in n for n in inf.notes)


def test_overlapped_gradient_reduction_beside_megatrons_tensor_parallel_overlap():
    """Laws of the data-parallel overlap beside Megatron-LM's tensor-parallel one: the overlapped gradient
    reduction is never more exposed than the un-overlapped one and stays positive (the rest of the model's
    gradients are reduced once the pass has ended), the tensor-parallel communication is the same with or without
    it, and every stage hides some of its backward all-reduces."""
    run = dict(batch_size=8, seq_len=256, mode="training", memory=False, dp=2, tp=2, overlap_grad_reduce=True)
    meg = predict_parallel("gpt2", "a100-sxm4-40gb", megatron=True, **run)
    alone = predict_parallel("gpt2", "a100-sxm4-40gb", megatron=True, **{**run, "overlap_grad_reduce": False})
    assert 0 < meg.parts["dp_allreduce"] <= alone.parts["dp_allreduce"]
    assert meg.parts["tp_comm"] == pytest.approx(alone.parts["tp_comm"])
    assert (meg.stages["tp_overlap_ms"] < 0).all() and 0 < meg.roofline_ms <= meg.latency_ms


def test_megatron_folds_only_the_attention_scaling_and_says_what_it_changed():
    """Megatron-LM folds the 1 / sqrt(head size) scaling of the scores into its QK^T GEMM: one multiplication by a
    number per layer goes. A rotary embedding's products of two tensors (Llama) are not scalings and stay; a
    model without GPT-2's activation gets no fused bias-GeLU kernel, and the note says so."""
    from neusight.api import predict_graph
    from neusight.graph.megatron import megatron_kernels

    g = neusight.trace("llama-3.2-1b", batch_size=2, seq_len=32, mode="inference")
    counts: dict = {}
    k = megatron_kernels(g, counts)
    attn = lambda t: t[t["module"].str.endswith("self_attn") & (t["family"] == "elementwise")]  # noqa: E731
    assert len(attn(g.kernels)) - len(attn(k)) == 16            # 16 layers, one scaling each
    assert counts["fused"] == 0 and counts["dropped"] >= 16
    note = [n for n in predict_graph(g, "a100-sxm4-40gb", megatron=True).notes if n.startswith("Megatron-LM kernels")]
    assert len(note) == 1 and "no activation that Megatron-LM fuses" in note[0]
    gpt2 = neusight.trace("gpt2", batch_size=2, seq_len=32, mode="training", optimizer=None)
    assert "24 fused bias-GeLU kernels" in " ".join(predict_graph(gpt2, "a100-sxm4-40gb", megatron=True).notes)


def test_megatron_step_divides_its_gradient_buffer_once_per_step():
    """Megatron-LM's DDP divides its FP32 gradient buffer by dp before the all-reduce, bucket by bucket: one more
    read and write of every gradient per step (not per micro-batch), at no less than the DRAM bound; only in a
    Megatron-LM step."""
    from neusight.parallel import MEGATRON_BUCKET, megatron_grad_division_ms

    a100 = load_device("a100-sxm4-40gb")
    ms, roof = megatron_grad_division_ms(2.5 * MEGATRON_BUCKET, a100)
    assert roof == pytest.approx(2 * 4 * 2.5 * MEGATRON_BUCKET / (a100.mem_bandwidth_gbps * 1e9) * 1e3, rel=0.02)
    assert ms >= roof > 0 and megatron_grad_division_ms(0, a100) == (0.0, 0.0)
    kw = dict(batch_size=8, seq_len=64, device="a100-sxm4-40gb", memory=False, dp=2)
    for m in (1, 2):
        meg = predict_parallel("gpt2", megatron=True, microbatches=m, **kw)
        k = meg.per_gpu.kernels
        steps = float(k.loc[k["phase"] == "optimizer", "latency_ms"].sum())
        numel = sum(t.numel for t in meg.per_gpu.graph.grads)
        assert meg.parts["optimizer"] == pytest.approx(steps + megatron_grad_division_ms(numel, a100)[0])
    plain = predict_parallel("gpt2", optimizer="adamw", **kw)
    k = plain.per_gpu.kernels
    assert plain.parts["optimizer"] == pytest.approx(float(k.loc[k["phase"] == "optimizer", "latency_ms"].sum()))

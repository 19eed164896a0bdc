"""host_us: a host launching one kernel every host_us microseconds, the GPU waiting for launches of short kernels."""

from __future__ import annotations

import numpy as np
import pytest

import neusight
from neusight.api import host_waits_ms
from neusight.errors import InputError


def _simulate(gpu_ms, host_us):
    """The same queue, kernel by kernel."""
    end, waits = 0.0, []
    for i, d in enumerate(gpu_ms):
        start = max(end, (i + 1) * host_us / 1e3)
        waits.append(start - end)
        end = start + d
    return np.array(waits)


@pytest.mark.parametrize("seed", range(20))
def test_waits_are_the_queue_of_launches_and_kernels(seed):
    rng = np.random.default_rng(seed)
    d = rng.exponential(rng.uniform(0.001, 0.2), size=int(rng.integers(1, 300)))
    h = float(rng.uniform(0, 120))
    w = host_waits_ms(d, h)
    assert np.allclose(w, _simulate(d, h), rtol=0, atol=1e-12)
    total = d.sum() + w.sum()
    assert (w >= -1e-12).all()
    assert total >= d.sum() - 1e-12                              # never faster than the GPU alone
    assert total >= len(d) * h / 1e3 + d[-1] - 1e-12            # never before the last launch + its kernel


def test_long_kernels_wait_only_for_the_first_launch_and_no_host_waits_nothing():
    d = np.full(50, 0.2)                                         # 200 us each
    assert np.allclose(host_waits_ms(d, 50.0), [0.05] + [0.0] * 49)
    assert not host_waits_ms(d, 0.0).any()
    short = np.full(50, 0.001)                                   # 1 us each: the host sets the pace
    assert short.sum() + host_waits_ms(short, 50.0).sum() == pytest.approx(50 * 0.05 + 0.001)


def test_predict_with_the_host_keeps_gpu_time_and_adds_the_waits():
    plain = neusight.predict("resnet18", "v100-sxm2-16gb", batch_size=1, memory=False)
    slow = neusight.predict("resnet18", "v100-sxm2-16gb", batch_size=1, memory=False, host_us=60)
    faster = neusight.predict("resnet18", "v100-sxm2-16gb", batch_size=1, memory=False, host_us=20)
    k = slow.kernels
    assert np.allclose(k["gpu_ms"], plain.kernels["latency_ms"], rtol=1e-12)
    assert np.allclose(k["host_wait_ms"], host_waits_ms(k["gpu_ms"].to_numpy(), 60))
    assert np.allclose(k["latency_ms"], k["gpu_ms"] + k["host_wait_ms"])
    assert slow.latency_ms == pytest.approx(sum(slow.phases.values()))
    assert plain.latency_ms < faster.latency_ms < slow.latency_ms
    assert slow.latency_ms >= len(k) * 0.06                      # a batch-1 CNN: host-bound
    assert any(n.startswith("host modelled (host_us=60)") for n in slow.notes)
    assert not any("kernel launches averaging" in n for n in slow.notes)   # the warning gives way to the model
    assert any("kernel launches averaging" in n for n in plain.notes)


def test_timeline_shows_the_gpu_waiting_for_launches():
    p = neusight.predict("resnet18", "t4", batch_size=1, memory=False, host_us=40)
    events = [e for e in p.chrome_trace()["traceEvents"] if e.get("tid") == 1 and e["ph"] == "X"]
    k = p.kernels
    assert [e["dur"] for e in events] == pytest.approx(list(k["gpu_ms"] * 1e3))
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(events, events[1:])]
    assert gaps == pytest.approx(list(k["host_wait_ms"][1:] * 1e3), abs=1e-6)
    assert events[0]["ts"] == pytest.approx(k["host_wait_ms"].iloc[0] * 1e3)
    assert events[-1]["ts"] + events[-1]["dur"] == pytest.approx(p.latency_ms * 1e3)


def test_a_decode_step_launches_no_faster_than_the_host():
    f = neusight.predict_generation("gpt2", "h100-sxm5-80gb", batch_size=1, prompt_len=16, new_tokens=4, host_us=30)
    step = neusight.predict("gpt2", "h100-sxm5-80gb", batch_size=1, seq_len=1, kv_cache=16, memory=False)
    assert f.time_per_output_token_ms >= len(step.kernels) * 0.03
    assert any(n.startswith("host modelled") for n in f.notes)
    two = neusight.predict_parallel("gpt2", "h100-sxm5-80gb", batch_size=2, seq_len=16, mode="inference", tp=2,
                                    host_us=30, memory=False)
    assert "host_wait_ms" in two.per_gpu.kernels and two.per_gpu.kernels["host_wait_ms"].sum() > 0


@pytest.mark.parametrize("bad", [-1, "fast", True, 1e7])
def test_bad_host_time_names_the_field(bad):
    with pytest.raises(InputError, match="host_us="):
        neusight.predict("gpt2", "t4", batch_size=1, seq_len=8, host_us=bad)

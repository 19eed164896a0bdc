"""The collector writes the shared kernel-CSV schema: what it writes, the loader and the trainer read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from neusight.collect import OPS, SWEEPS, collect, kernel_record, op_shapes
from neusight.dataset import load_kernel_traces
from neusight.errors import InputError

BIN = Path(sys.executable).parent


def test_a_cpu_collection_loads_as_training_data_with_no_row_skipped(tmp_path):
    # device_name files the rows under a GPU the library knows, so the loader keeps them (on a real GPU the
    # name torch reports does that)
    files = collect(tmp_path, sweep="quick", device="cpu", device_name="Tesla T4", repeats=3, keep=2)
    assert sorted(files) == sorted(OPS)
    assert files["bmm"] == tmp_path / "bmm" / "Tesla_T4.csv"
    df = load_kernel_traces(tmp_path)
    assert sum(df.attrs["skipped"].values()) == 0
    assert len(df) == sum(len(op_shapes(op, SWEEPS["quick"])) for op in OPS)
    assert set(df["family"]) == {"linear", "bmm", "conv", "elementwise", "softmax", "layernorm"}
    assert (df["device"] == "t4").all() and (df["latency_ms"] > 0).all() and (df["flops"] > 0).all()
    # shapes as the dataset defines them: bmm (B, M, N) x (B, N, K), N the reduction
    bmm = pd.read_csv(files["bmm"])
    assert list(bmm.columns[-4:]) == ["B", "M", "N", "K"] and (bmm["OPName"] == "bmm").all()


def test_shapes_are_seeded_and_bounded():
    sweep = SWEEPS["default"]
    a, b = op_shapes("linear", sweep, seed=1), op_shapes("linear", sweep, seed=1)
    assert a == b and len(a) == sweep.samples and a != op_shapes("linear", sweep, seed=2)
    assert all(s["B"] == 1 for s in a)
    convs = op_shapes("conv", sweep)
    assert all(s["Padding"] == s["Kernel_Szie"] // 2 and s["Kernel_Szie"] <= s["Input_Size"] for s in convs)


def test_the_longest_kernel_is_the_rows_kernel():
    events = [{"cat": "cpu_op", "name": "aten::bmm", "dur": 50.0},
              {"cat": "kernel", "name": "void splitKreduce_kernel", "dur": 2.0, "args": {"grid": [1, 1, 1]}},
              {"cat": "kernel", "name": "ampere_sgemm_128x64_nn", "dur": 30.0,
               "args": {"grid": [16, 8, 4], "block": [128, 1, 1], "blocks per SM": 4.7, "warps per SM": 18.9}}]
    r = kernel_record(events)
    assert r["Kernel Name"] == "ampere_sgemm_128x64_nn" and r["Kernels"].count(";") == 1
    assert (r["Grid x"], r["Grid y"], r["Grid z"], r["Block x"]) == (16, 8, 4, 128) and r["Warps per SM"] == 18.9
    assert kernel_record([])["Kernel Name"] == ""


def test_bad_collection_requests_say_what_to_change(tmp_path):
    with pytest.raises(InputError, match="lstm is not an op"):
        collect(tmp_path, ops=["bmm", "lstm"], sweep="quick", device="cpu")
    with pytest.raises(InputError, match="sweep='huge'"):
        collect(tmp_path, ops=["bmm"], sweep="huge", device="cpu")
    with pytest.raises(InputError, match="keep=9"):
        collect(tmp_path, ops=["bmm"], sweep="quick", device="cpu", repeats=5, keep=9)
    assert not any(tmp_path.iterdir())        # nothing written
    r = subprocess.run([str(BIN / "neusight-collect"), f"out={tmp_path / 'o'}", "ops=[lstm]",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "lstm is not an op" in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_a_gpu_without_one_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="torch sees no CUDA"):
        collect(tmp_path, ops=["bmm"], sweep="quick", device="cuda")

"""The predictor: the laws of DESIGN.md on the SHIPPED checkpoint, bad inputs, and fit / save / load.

Laws ("Laws the code keeps"), as hypothesis property tests over GEMM shapes (linear, bmm) and row-wise
shapes (elementwise, softmax, layer norm) on GPUs inside and outside the training set:

- a prediction is finite, positive and never below the roofline bound of its kernel;
- adding work (doubling a dim: more FLOPs, bytes and, from some size on, waves) never lowers latency;
- the same input gives the same output bit for bit, in any row order and in any process.

No number here is a measured accuracy: those live in docs/kernels.md, produced by neusight-evaluate-kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import neusight
from neusight.api import predict_kernel_table
from neusight.dataset import kernel_frame, load_kernel_traces
from neusight.errors import CheckpointError, DataError, DeviceError, InputError, NeuSightError
from neusight.devices import load_device
from neusight.predictor.features import feature_names
from neusight.predictor.mlp import MLPConfig, UtilizationMLP, log_excess_rowwise
from neusight.predictor.model import SHIPPED, Predictor, PredictorConfig
from neusight.predictor.train import predict_mlp
from neusight.tiles import device_rates, gemm_tiles

from .conftest import DATASET, need_shared

# two training GPUs, two NVIDIA GPUs never trained on (Ada, Hopper) and one AMD (CDNA2)
DEVICES = ("t4", "a100-pcie-40gb", "h100-sxm5-80gb", "l4", "mi250")
ROW_OPS = ("add", "addu", "mul", "div", "pow", "relu", "tanh", "gelu", "softmax", "ln")
OUT_COLUMNS = ["tiles", "waves", "roofline_ms", "utilization", "overhead_ms", "latency_ms"]

# Each example predicts a list of shapes on all five GPUs (one predict call per GPU), so few examples
# cover many kernels. derandomize: the same examples on every run (a strict xfail must fail every time);
# no shrinking: a shrunk counterexample is not worth tens of seconds of predict calls.
LAWS = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])

dim = st.integers(1, 8192)
gemm_shape = st.tuples(st.integers(1, 64), dim, dim, dim)                   # B, M, N (reduction), K
row_shape = st.tuples(st.integers(1, 16384), st.integers(1, 16384))        # B (rows), H (cols)
gemm_case = st.tuples(st.sampled_from(("linear", "bmm")), st.lists(gemm_shape, min_size=1, max_size=8))
row_case = st.tuples(st.sampled_from(ROW_OPS), st.lists(row_shape, min_size=1, max_size=8))


@pytest.fixture(scope="module")
def shipped() -> Predictor:
    return Predictor.load()


def _raw(op: str, shapes: list[tuple[int, ...]]) -> pd.DataFrame:
    """Shapes of one op in the shared kernel-CSV schema, repeated on every GPU of DEVICES."""
    cols = ("B", "M", "N", "K") if op in ("linear", "bmm") else ("B", "H")
    one = pd.DataFrame(shapes, columns=list(cols)).assign(OPName=op)
    return pd.concat([one.assign(Device=d) for d in DEVICES], ignore_index=True)


def _predict(pred: Predictor, raw: pd.DataFrame) -> pd.DataFrame:
    """kernel_frame -> Predictor.predict per GPU; the tidy frame's columns + the prediction columns."""
    frame = kernel_frame(raw, measured=False)
    parts = [pred.predict(d, dev) for dev, d in frame.groupby("device", sort=True)]
    ids = frame[["family", "device", "B", "M", "N", "K", "rows", "cols"]]
    return pd.concat([ids, pd.concat(parts).loc[frame.index]], axis=1)


def _check_bounds(out: pd.DataFrame) -> None:
    lat, roof = out["latency_ms"].to_numpy(float), out["roofline_ms"].to_numpy(float)
    bad = ~(np.isfinite(lat) & (lat > 0) & np.isfinite(roof) & (roof > 0) & (lat >= roof))
    assert not bad.any(), out.loc[bad, ["family", "device", "B", "M", "N", "K", "rows", "cols", "roofline_ms",
                                        "latency_ms"]].to_string()
    u = out["utilization"].to_numpy(float)
    assert ((u > 0) & (u <= 1)).all()


# --- laws: bound -------------------------------------------------------------------------------------

@LAWS
@given(gemm_case)
def test_gemm_prediction_is_finite_positive_and_above_roofline(shipped, case):
    op, shapes = case
    _check_bounds(_predict(shipped, _raw(op, shapes)))


@LAWS
@given(row_case)
def test_rowwise_prediction_is_finite_positive_and_above_roofline(shipped, case):
    op, shapes = case
    _check_bounds(_predict(shipped, _raw(op, shapes)))


def test_extreme_shapes_stay_finite(shipped):
    # far outside the sweeps (dims up to ~3,000 there): features are clamped to the training range,
    # so the utilization stays at its boundary value instead of extrapolating
    out = _predict(shipped, _raw("bmm", [(1, 1, 1, 1), (512, 8192, 8192, 8192), (1, 65536, 65536, 1)]))
    _check_bounds(out)
    _check_bounds(_predict(shipped, _raw("softmax", [(1, 1), (1 << 20, 8192), (1, 1 << 24)])))


# --- laws: adding work never makes a kernel faster ---------------------------------------------------------

def _monotone_violations(pred: Predictor, op: str, shapes: list[tuple[int, ...]]) -> pd.DataFrame:
    """Every (shape, GPU, doubled dim) whose doubled kernel is predicted faster than the original.
    NB: a relative 1e-6 absorbs float32 rounding where the model is flat; it hides no real speed-up."""
    dims = ("B", "M", "N", "K") if op in ("linear", "bmm") else ("B", "H")
    base = _raw(op, shapes)
    variants = [base.assign(variant="base")]
    for d in dims:
        v = base.copy()
        v[d] = v[d] * 2
        variants.append(v.assign(variant=d))
    raw = pd.concat(variants, ignore_index=True)
    out = _predict(pred, raw.drop(columns="variant"))
    out["variant"], out["shape"] = raw["variant"].to_numpy(), np.tile(np.arange(len(base)), len(variants))
    ref = out[out["variant"] == "base"].set_index("shape")["latency_ms"]
    doubled = out[out["variant"] != "base"].copy()
    doubled["base_ms"] = ref.loc[doubled["shape"]].to_numpy()
    doubled["base_shape"] = base[list(dims)].astype(int).apply(tuple, axis=1).iloc[doubled["shape"]].to_numpy()
    return doubled[doubled["latency_ms"] < doubled["base_ms"] * (1 - 1e-6)]


def _describe(bad: pd.DataFrame, op: str) -> str:
    worst = bad.assign(r=bad["latency_ms"] / bad["base_ms"]).sort_values("r").iloc[0]
    dims = "B, M, N, K" if op in ("linear", "bmm") else "B, H"
    return (f"{len(bad)} violation(s); worst: {op} ({dims}) = {worst['base_shape']} on {worst['device']}: "
            f"doubling {worst['variant']} "
            f"goes from {worst['base_ms']:.4f} ms to {worst['latency_ms']:.4f} ms")


# Found by this search on an earlier (unconstrained) checkpoint, kept as explicit examples: bmm (1, 1848, 5, 31)
# on l4 got 2.6x faster when B doubled; linear (1, 23, 498, 17) on a100-pcie-40gb when N doubled.
@LAWS
@given(gemm_case)
@example(("bmm", [(1, 1848, 5, 31)]))
@example(("linear", [(1, 23, 498, 17)]))
def test_gemm_latency_never_drops_when_a_dim_doubles(shipped, case):
    op, shapes = case
    bad = _monotone_violations(shipped, op, shapes)
    assert bad.empty, _describe(bad, op)


# Earlier counterexamples: add (2, 157) on l4 doubling B; gelu (31, 8) on a100-pcie-40gb doubling H.
@LAWS
@given(row_case)
@example(("add", [(2, 157)]))
@example(("gelu", [(31, 8)]))
def test_rowwise_latency_never_drops_when_a_dim_doubles(shipped, case):
    op, shapes = case
    bad = _monotone_violations(shipped, op, shapes)
    assert bad.empty, _describe(bad, op)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(0, 3))
def test_utilization_model_is_monotone_in_work_features_for_any_weights(seed, n_mono, n_free):
    """The law holds by construction: whatever the weights (random here, large ones included), raising any
    work feature with the device features fixed never lowers the excess over the roofline."""
    gen = torch.Generator().manual_seed(seed)
    model = UtilizationMLP(n_mono + n_free, (16, 8), n_mono=n_mono)
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * 3)
        model.mean.copy_(torch.randn(n_mono + n_free, generator=gen))
        model.lo.copy_(torch.full((n_mono + n_free,), -2.0))
        model.hi.copy_(torch.full((n_mono + n_free,), 2.0))
    x = torch.randn(400, n_mono + n_free, generator=gen, dtype=torch.float64) * 3
    up = x.clone()
    up[:, :n_mono] += torch.rand(400, n_mono, generator=gen, dtype=torch.float64) * 2   # more work, same GPU
    params = model.numpy_params()
    lo, hi = log_excess_rowwise(params, x.numpy()), log_excess_rowwise(params, up.numpy())
    assert (hi >= lo - 1e-9 * np.abs(lo)).all(), float((lo - hi).max())
    with torch.no_grad():   # the torch forward used in training is the same function
        np.testing.assert_allclose(model.double().log_excess(x).numpy(), lo, rtol=1e-9, atol=1e-9)


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 2**31 - 1))
def test_unseen_device_feature_combinations_stay_bounded(seed):
    """Device features enter through bounded gains, so no combination of them (each clamped to the training
    range, but jointly never seen, like a held-out GPU) can blow the excess up: |log excess| is bounded by
    the weights, whatever the device features are."""
    gen = torch.Generator().manual_seed(seed)
    model = UtilizationMLP(6, (16, 8), n_mono=4)
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * 5)
        model.lo.copy_(torch.full((6,), -1.0))
        model.hi.copy_(torch.full((6,), 1.0))
    p = model.numpy_params()
    x = np.zeros((200, 6))
    x[:, 4:] = torch.randn(200, 2, generator=gen, dtype=torch.float64).numpy() * 1e6   # wild device features
    q = log_excess_rowwise(p, x)
    bound = 4 * p["out"][0].sum() + abs(p["out"][1][0]) + p["skip"].sum() * 1.0
    assert np.isfinite(q).all() and (np.abs(q) <= bound + 1e-9).all()


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 2**31 - 1))
def test_unseen_device_combination_stays_within_the_training_gpus_envelope(seed):
    """Two training GPUs at device features (-1, -1) and (1, 1); a GPU at (-1, 1) has each feature inside the
    training range but a combination never seen. Its log excess lies between the lowest and highest the model
    gives the same kernels with the training GPUs' device features; the training GPUs' own predictions are
    untouched by the envelope; the float64 row-wise forward agrees with the torch one."""
    gen = torch.Generator().manual_seed(seed)
    model = UtilizationMLP(6, (16, 8), n_mono=4)
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * 3)
    work = torch.randn(50, 4, generator=gen, dtype=torch.float64)
    gpus = [torch.tensor([-1.0, -1.0], dtype=torch.float64), torch.tensor([1.0, 1.0], dtype=torch.float64)]
    model = model.double().eval()
    with_dev = lambda g: torch.cat([work, g.expand(50, 2)], 1)   # noqa: E731
    train = torch.cat([with_dev(g) for g in gpus])
    before = model.log_excess(train).detach()
    model.fit_device_range(train)
    assert int(model.n_device_rows) == 2
    torch.testing.assert_close(model.log_excess(train).detach(), before)
    members = torch.stack([model.log_excess(with_dev(g)).detach() for g in gpus])
    q = model.log_excess(with_dev(torch.tensor([-1.0, 1.0], dtype=torch.float64))).detach()
    assert (q >= members.min(0).values - 1e-12).all() and (q <= members.max(0).values + 1e-12).all()
    rowwise = log_excess_rowwise(model.numpy_params(), with_dev(torch.tensor([-1.0, 1.0], dtype=torch.float64)).numpy())
    np.testing.assert_allclose(rowwise, q.numpy(), rtol=1e-9, atol=1e-9)


def test_a_model_without_device_features_has_no_envelope():
    model = UtilizationMLP(4, (8,), n_mono=4).double()
    x = torch.randn(20, 4, dtype=torch.float64)
    before = model.log_excess(x).detach()
    model.fit_device_range(x)
    assert int(model.n_device_rows) == 0
    torch.testing.assert_close(model.log_excess(x).detach(), before)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(st.tuples(st.integers(1, 64), dim, dim, dim), st.sampled_from(("B", "M", "N", "K")),
       st.sampled_from(("t4", "a100-pcie-40gb", "l4", "mi250")))
def test_gemm_bound_never_drops_when_a_dim_doubles(shipped, shape, which, device):
    """The roofline bound itself (best of the device's tiles and split-K factors) is monotone."""
    dev = load_device(device)
    rates = device_rates(dev)
    cand = shipped.table_.gemm_candidates("linear", dev)
    b, m, n, k = (np.array([float(v)]) for v in shape)
    base = gemm_tiles(b, m, n, k, cand, np.array([4.0]), rates)["roofline_ms"].iloc[0]
    dims = dict(zip("BMNK", (b, m, n, k)))
    dims[which] = dims[which] * 2
    up = gemm_tiles(dims["B"], dims["M"], dims["N"], dims["K"], cand, np.array([4.0]), rates)["roofline_ms"].iloc[0]
    assert up >= base, (shape, which, device, base, up)


# --- laws: determinism -------------------------------------------------------------------------------------

@settings(LAWS, max_examples=4)
@given(gemm_case, row_case)
def test_same_input_twice_gives_identical_output(shipped, gemm, rows):
    raw = pd.concat([_raw(*gemm), _raw(*rows)], ignore_index=True)
    raw = pd.concat([raw, raw.iloc[: len(raw) // 2]], ignore_index=True)  # duplicates are predicted once
    frame = kernel_frame(raw, measured=False)
    for dev, d in frame.groupby("device", sort=True):
        pd.testing.assert_frame_equal(shipped.predict(d, dev), shipped.predict(d, dev), check_exact=True)


# Counterexample (shipped checkpoint, t4): these six bmm shapes predicted in reverse order give other bits for
# the first and the last (it once differed by 3.1e-05 and 2.4e-04 ms, when the float32 MLP ran on the batch of
# unique shapes: matmul results depended on a row's position; the float64 row-wise forward fixed it).
ORDER_CASE = ("bmm", [(61, 724, 1930, 5750), (4, 1466, 253, 805), (26, 1063, 136, 4783), (36, 1024, 3027, 496),
                      (45, 761, 662, 5712), (35, 4488, 6347, 5965)])


@LAWS
@given(gemm_case, row_case, st.randoms(use_true_random=False))
@example(ORDER_CASE, ("add", [(1, 1)]), random.Random(0))
def test_row_order_does_not_change_predictions(shipped, gemm, rows, rnd):
    raw = pd.concat([_raw(*gemm), _raw(*rows)], ignore_index=True)
    frame = kernel_frame(raw, measured=False)
    for dev, d in frame.groupby("device", sort=True):
        order = list(d.index)
        rnd.shuffle(order)
        if order == list(d.index):
            order = order[::-1]
        pd.testing.assert_frame_equal(shipped.predict(d, dev), shipped.predict(d.loc[order], dev).loc[d.index],
                                      check_exact=True)


@LAWS
@given(gemm_case, row_case)
@example(ORDER_CASE, ("add", [(1, 1)]))
def test_other_rows_do_not_change_a_prediction(shipped, gemm, rows):
    raw = pd.concat([_raw(*gemm), _raw(*rows)], ignore_index=True)
    frame = kernel_frame(raw, measured=False)
    for dev, d in frame.groupby("device", sort=True):
        together = shipped.predict(d, dev)
        alone = pd.concat([shipped.predict(d.loc[[i]], dev) for i in d.index])
        pd.testing.assert_frame_equal(together, alone, check_exact=True)


def _digest(out: pd.DataFrame) -> str:
    return hashlib.sha256(np.ascontiguousarray(out[OUT_COLUMNS].to_numpy(np.float64)).tobytes()).hexdigest()


_DIGEST_SCRIPT = """
import hashlib, sys, numpy as np, pandas as pd
from neusight.dataset import kernel_frame
from neusight.predictor.model import Predictor
import io
raw = pd.read_json(io.StringIO(sys.stdin.read()), orient="split")
frame = kernel_frame(raw, measured=False)
p = Predictor.load()
out = pd.concat([p.predict(d, dev) for dev, d in frame.groupby("device", sort=True)]).loc[frame.index]
cols = {cols!r}
print(hashlib.sha256(np.ascontiguousarray(out[cols].to_numpy(np.float64)).tobytes()).hexdigest())
"""


def test_same_prediction_in_another_process(shipped):
    raw = pd.concat([_raw("bmm", [(8, 512, 64, 512), (1, 3000, 3000, 3000)]),
                     _raw("ln", [(4096, 1024), (3, 7)])], ignore_index=True)
    frame = kernel_frame(raw, measured=False)
    here = pd.concat([shipped.predict(d, dev) for dev, d in frame.groupby("device", sort=True)]).loc[frame.index]
    script = _DIGEST_SCRIPT.replace("{cols!r}", repr(OUT_COLUMNS))
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    res = subprocess.run([sys.executable, "-c", script], input=raw.to_json(orient="split"), capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == _digest(here)


# --- bad inputs ---------------------------------------------------------------------------------------

def test_kernel_table_missing_column_is_named():
    df = pd.DataFrame({"OPName": ["bmm"], "Device": ["t4"], "B": [1], "M": [64], "N": [64]})  # no K
    with pytest.raises(DataError, match=r"missing required column\(s\) \['K'\]"):
        predict_kernel_table(df)
    with pytest.raises(DataError, match="Device"):
        predict_kernel_table(pd.DataFrame({"OPName": ["softmax"], "B": [4], "H": [1024]}))


def test_kernel_table_unknown_device_is_named():
    df = pd.DataFrame({"OPName": ["bmm", "bmm"], "Device": ["t4", "NVIDIA Z9000"], "B": 1, "M": 64, "N": 64, "K": 64})
    with pytest.raises((DataError, DeviceError), match="NVIDIA Z9000"):
        predict_kernel_table(df)


def test_kernel_table_predicts_known_rows():
    df = pd.DataFrame({"OPName": ["bmm", "softmax"], "Device": ["Tesla T4", "NVIDIA L4"], "B": [8, 4],
                       "M": [512, None], "N": [64, None], "K": [512, None], "H": [None, 1024]}, index=[10, 20])
    out = predict_kernel_table(df)
    assert list(out.index) == [10, 20] and np.isfinite(out).all() and (out > 0).all()


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A copy of the shipped checkpoint, to damage."""
    return Path(shutil.copytree(SHIPPED, tmp_path / "predictor"))


def _edit_manifest(path: Path, edit) -> None:
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_undamaged_copy_loads(ckpt):
    assert set(Predictor.load(ckpt).models_) == set(Predictor.load().models_)


def test_checkpoint_directory_missing(tmp_path):
    with pytest.raises(CheckpointError, match="lacks"):
        Predictor.load(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["weights.pt", "tile_table.pt", "manifest.json"])
def test_checkpoint_file_missing(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=name):
        Predictor.load(ckpt)


@pytest.mark.parametrize("name", ["weights.pt", "tile_table.pt", "manifest.json"])
def test_checkpoint_file_corrupt(ckpt, name):
    (ckpt / name).write_bytes(b"\x00garbage\xff" * 100)
    with pytest.raises(CheckpointError, match="corrupt"):
        Predictor.load(ckpt)


def test_checkpoint_weights_changed_after_saving(ckpt):
    w = torch.load(ckpt / "weights.pt", weights_only=True)
    torch.save({k: v + 1 for k, v in w.items()}, ckpt / "weights.pt")
    with pytest.raises(CheckpointError, match="does not match the hash"):
        Predictor.load(ckpt)


def test_checkpoint_wrong_feature_count(ckpt):
    _edit_manifest(ckpt, lambda m: m["families"]["linear"].update(features=m["families"]["linear"]["features"][:-1]))
    with pytest.raises(CheckpointError, match=r"family 'linear' was trained on features .*\(\d+\)"):
        Predictor.load(ckpt)


@pytest.mark.parametrize("field, value", [("e2e_scale", 0.0), ("e2e_scale", 40.0), ("e2e_floor", -0.1), ("e2e_floor", 3.0)])
def test_checkpoint_implausible_calibration(ckpt, field, value):
    _edit_manifest(ckpt, lambda m: m.update({field: value}))
    with pytest.raises(CheckpointError, match=f"{field}={value}"):
        Predictor.load(ckpt)


def test_checkpoint_unknown_family(ckpt):
    _edit_manifest(ckpt, lambda m: m["families"].update(matmul=m["families"].pop("bmm")))
    with pytest.raises(CheckpointError, match="'matmul'"):
        Predictor.load(ckpt)


def test_checkpoint_weights_of_wrong_shape(ckpt):
    w = torch.load(ckpt / "weights.pt", weights_only=True)
    key = "softmax.w_mono"
    w[key] = torch.zeros(w[key].shape[0] + 3, w[key].shape[1])
    torch.save(w, ckpt / "weights.pt")
    digest = hashlib.sha256((ckpt / "weights.pt").read_bytes()).hexdigest()
    _edit_manifest(ckpt, lambda m: m.update(weights_sha256=digest))   # past the hash check, to the shape check
    with pytest.raises(CheckpointError, match="weights of family 'softmax' do not fit"):
        Predictor.load(ckpt)


@pytest.mark.parametrize("value", [{"xy": "bmm"}, {"nn": "softmax"}, ["nn"]])
def test_checkpoint_unknown_layout_routing(ckpt, value):
    _edit_manifest(ckpt, lambda m: m.update(layout_models=value))
    with pytest.raises(CheckpointError, match="layout_models"):
        Predictor.load(ckpt)


def _gemm_rows(kernels: list[str]) -> pd.DataFrame:
    from neusight.kernels import formulas

    k = formulas.gemm(1, 4096, 1280, 5120)
    return pd.DataFrame({"family": "linear", "kernel": kernels, "B": 1, "M": 4096, "N": 1280, "K": 5120,
                         "flops": k.flops, "bytes": k.bytes, "dtype": "float32"})


def test_layout_routing_sends_only_its_layout_to_the_bmm_model(tmp_path):
    names = ["addmm_nn", "mm_nt", "addmm_tn", "gemm"]
    plain = Predictor.load()
    pred = Predictor.load()
    pred.layout_models_ = {"nn": "bmm"}
    got = pred.predict(_gemm_rows(names), "t4")
    base = plain.predict(_gemm_rows(names), "t4")
    as_bmm = plain.predict(_gemm_rows(["gemm"]).assign(family="bmm"), "t4")
    assert list(got["model_family"]) == ["bmm", "linear", "linear", "linear"]
    assert set(base["model_family"]) == {"linear"} and base["latency_ms"].nunique() == 1
    assert got["latency_ms"].iloc[0] == pytest.approx(as_bmm["latency_ms"].iloc[0])
    assert got["latency_ms"].iloc[0] != pytest.approx(base["latency_ms"].iloc[0])
    assert (got["latency_ms"].iloc[1:].to_numpy() == base["latency_ms"].iloc[1:].to_numpy()).all()
    assert (got["latency_ms"] >= got["roofline_ms"]).all() and np.isfinite(got["latency_ms"]).all()
    # the routing is part of the checkpoint
    pred.save(tmp_path / "routed")
    again = Predictor.load(tmp_path / "routed")
    assert again.layout_models_ == {"nn": "bmm"}
    assert (again.predict(_gemm_rows(names), "t4")["latency_ms"] == got["latency_ms"]).all()


# --- fit, save, load ----------------------------------------------------------------------------------

TINY = MLPConfig(hidden=(8,), epochs=3, patience=2, batch_size=128)


@pytest.fixture(scope="module")
def small_df() -> pd.DataFrame:
    """A few hundred rows of linear and add on two training GPUs (deterministic sample)."""
    kernels = need_shared(DATASET / "kernels" / "nvidia")
    files = [kernels / op / f"{gpu}.csv" for op in ("linear", "add") for gpu in ("Tesla_T4", "Tesla_P4")]
    df = load_kernel_traces(files)
    return df.groupby(["family", "device"]).sample(n=100, random_state=0).reset_index(drop=True)


@pytest.fixture(scope="module")
def small_fit(small_df) -> Predictor:
    cfg = PredictorConfig(families={"linear": TINY, "elementwise": TINY}, val_devices=("logo",))
    return Predictor(cfg).fit(small_df)


def test_small_fit_predicts_within_the_laws(small_fit, small_df):
    assert set(small_fit.models_) == {"linear", "elementwise"}
    assert small_fit.train_devices_ == ("p4", "t4")
    assert set(small_fit.metrics_["linear"]["leave_one_gpu_out_mape"]) == {"p4", "t4"}
    for dev, d in small_df.groupby("device"):
        out = small_fit.predict(d, dev)
        assert (np.isfinite(out["latency_ms"]) & (out["latency_ms"] >= out["roofline_ms"])).all()


def test_ensemble_fit_averages_its_members_and_round_trips(small_df, tmp_path):
    from neusight.predictor.mlp import MLPEnsemble

    cfg = PredictorConfig(families={"linear": replace(TINY, ensemble=3), "elementwise": TINY}, val_devices=("logo",))
    pred = Predictor(cfg).fit(small_df)
    ens = pred.models_["linear"]
    assert isinstance(ens, MLPEnsemble) and len(ens.members) == 3
    assert len(pred.metrics_["linear"]["ensemble_best_epochs"]) == 3
    d = small_df[(small_df["family"] == "linear") & (small_df["device"] == "t4")]
    design = pred._design(d, {"t4": load_device("t4")})
    x = design[list(feature_names("linear"))].to_numpy(float)
    roof = design["roofline_ms"].to_numpy(float)
    members = np.array([predict_mlp(m, x, roof)[0] for m in ens.members])
    assert len({tuple(np.round(m, 9)) for m in members}) == 3            # the seeds differ
    got, util = predict_mlp(ens, x, roof)
    np.testing.assert_allclose(got, np.exp(np.log(members).mean(0)), rtol=1e-12)
    assert (got >= roof).all() and ((util > 0) & (util <= 1)).all()
    assert (members.min(0) <= got + 1e-12).all() and (got <= members.max(0) + 1e-12).all()
    out = pred.predict(d, "t4")
    np.testing.assert_allclose(out["latency_ms"].to_numpy(float), got, rtol=1e-9)
    pred.save(tmp_path / "ens")
    again = Predictor.load(tmp_path / "ens")
    assert again.config.families["linear"].ensemble == 3
    np.testing.assert_array_equal(again.predict(d, "t4")["latency_ms"].to_numpy(), out["latency_ms"].to_numpy())
    # a manifest that claims another ensemble size than its weights hold is refused
    _edit_manifest(tmp_path / "ens", lambda m: m["families"]["linear"]["config"].update(ensemble=2))
    with pytest.raises(CheckpointError, match="weights of family 'linear' do not fit"):
        Predictor.load(tmp_path / "ens")
    _edit_manifest(tmp_path / "ens", lambda m: m["families"]["linear"]["config"].update(ensemble=0))
    with pytest.raises(CheckpointError, match="ensemble=0"):
        Predictor.load(tmp_path / "ens")


def test_ensemble_needs_leave_one_gpu_out(small_df):
    cfg = PredictorConfig(families={"linear": replace(TINY, ensemble=2), "elementwise": TINY}, val_devices=("t4",))
    with pytest.raises(ValueError, match="ensemble=2 needs val_devices"):
        Predictor(cfg).fit(small_df)
    with pytest.raises(ValueError, match="ensemble=0"):
        replace(TINY, ensemble=0)
    for field_, bad in (("hidden", ()), ("hidden", (64, 0)), ("epochs", 0), ("batch_size", -1), ("lr", 0.0),
                        ("patience", -1), ("weight_decay", -1e-4), ("size_weight", -0.5)):
        with pytest.raises(InputError, match=f"{field_}="):
            replace(TINY, **{field_: bad})


def test_fit_is_deterministic(small_fit, small_df):
    again = Predictor(small_fit.config).fit(small_df)
    d = small_df[small_df["device"] == "t4"]
    pd.testing.assert_frame_equal(small_fit.predict(d, "t4"), again.predict(d, "t4"), check_exact=True)


def test_save_load_round_trip_is_exact(small_fit, small_df, tmp_path):
    path = small_fit.save(tmp_path / "ckpt", manifest_extra={"command": "pytest"})
    loaded = Predictor.load(path)
    assert loaded.train_devices_ == small_fit.train_devices_
    assert json.loads((path / "manifest.json").read_text())["command"] == "pytest"
    frame = kernel_frame(_raw("linear", [(1, 256, 128, 512)]), measured=False)  # l4: an unseen GPU
    for dev in ("t4", "p4", "l4"):
        d = pd.concat([small_df[small_df["device"] == "t4"], frame[frame["device"] == dev]], ignore_index=True)
        pd.testing.assert_frame_equal(small_fit.predict(d, dev), loaded.predict(d, dev), check_exact=True)


def test_family_without_a_model_is_predicted_or_refused_clearly(small_fit):
    frame = kernel_frame(_raw("bmm", [(4, 256, 128, 512)]), measured=False)
    try:
        out = small_fit.predict(frame[frame["device"] == "t4"], "t4")
    except NeuSightError as e:
        assert "bmm" in str(e)
    else:
        assert (np.isfinite(out["latency_ms"]) & (out["latency_ms"] >= out["roofline_ms"])).all()


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("fail_at", [1, 2])  # weights.pt / tile_table.pt
def test_failed_save_leaves_nothing_behind(small_fit, tmp_path, monkeypatch, fail_at):
    target = tmp_path / "ckpt"
    small_fit.save(target, manifest_extra={"run": "first"})
    before = _snapshot(target)
    real_save, calls = torch.save, []

    def failing_save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == fail_at:
            real_save(obj, f, *args, **kwargs)   # a file half in place, then the failure
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="simulated"):
        small_fit.save(target, manifest_extra={"run": "second"})
    calls.clear()
    with pytest.raises(OSError, match="simulated"):
        small_fit.save(tmp_path / "fresh")
    monkeypatch.undo()
    assert _snapshot(target) == before                         # the old checkpoint, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or partial directory
    assert Predictor.load(target).manifest_["run"] == "first"


# ------------------------------------------------------------------------------------ size-weighted loss
def test_size_weights_grow_with_waves_and_are_clipped():
    from neusight.predictor.train import SIZE_WEIGHT_MAX_WAVES, size_weights

    assert size_weights(np.array([0.0, 5.0]), 0.0) is None          # power 0: unweighted
    w = size_weights(np.log2([0.25, 1.0, 4.0, 64.0, SIZE_WEIGHT_MAX_WAVES, 16 * SIZE_WEIGHT_MAX_WAVES]), 1.0)
    np.testing.assert_allclose(w, [1.0, 1.0, 4.0, 64.0, SIZE_WEIGHT_MAX_WAVES, SIZE_WEIGHT_MAX_WAVES])
    np.testing.assert_allclose(size_weights(np.log2([16.0]), 0.5), [4.0])
    with pytest.raises(ValueError, match="size_weight=-1"):
        size_weights(np.zeros(3), -1.0)


def test_fit_rejects_weights_that_do_not_fit_the_rows():
    from neusight.predictor.train import fit_mlp

    rng = np.random.default_rng(0)
    x, roof = rng.normal(size=(40, 3)), np.full(40, 0.1)
    y, groups = roof * 2, np.array(["a", "b"] * 20)
    for bad in (np.ones(39), np.r_[np.ones(39), 0.0], np.r_[np.ones(39), np.nan]):
        with pytest.raises(ValueError, match="weights: expected 40 finite positive values"):
            fit_mlp(x, roof, y, groups, TINY, n_mono=1, weights=bad)


def test_weighted_loss_fits_the_heavy_rows_better():
    """Two kinds of rows the model cannot both fit (same features, latencies 2x apart): the fit lands
    nearer the kind the weights favour, whichever that is."""
    from neusight.predictor.train import fit_mlp, predict_mlp

    rng = np.random.default_rng(0)
    roof = np.repeat(rng.uniform(0.05, 0.2, 100), 2)
    x = np.c_[np.log2(roof), rng.normal(size=(len(roof), 2))]
    y = roof * np.where(np.arange(len(x)) % 2 == 0, 2.0, 4.0)          # even rows 2x roofline, odd rows 4x
    cfg = MLPConfig(hidden=(8,), lr=0.03, epochs=150, patience=150, batch_size=64)
    groups = np.array(["a"] * len(x))
    means = {}
    for heavy in (0, 1):
        w = np.where(np.arange(len(x)) % 2 == heavy, 50.0, 1.0)
        fit = fit_mlp(x, roof, y, groups, cfg, n_mono=1, weights=w)
        means[heavy] = float(np.mean(predict_mlp(fit.model, x, roof)[0] / roof))
    assert means[0] < 2.8 < 3.2 < means[1], means


def test_size_weight_reaches_the_fit_and_the_manifest(small_df, small_fit):
    cfg = PredictorConfig(families={"linear": replace(TINY, size_weight=1.0), "elementwise": TINY}, val_devices=("logo",))
    weighted = Predictor(cfg).fit(small_df)
    assert "waves^1" in weighted.metrics_["linear"]["loss_weight"]
    assert "loss_weight" not in weighted.metrics_["elementwise"] and "loss_weight" not in small_fit.metrics_["linear"]
    d = small_df[(small_df["device"] == "t4") & (small_df["family"] == "linear")]
    assert not np.array_equal(weighted.predict(d, "t4")["latency_ms"], small_fit.predict(d, "t4")["latency_ms"])
    pd.testing.assert_frame_equal(weighted.predict(d, "t4"), Predictor(cfg).fit(small_df).predict(d, "t4"),
                                  check_exact=True)


# ------------------------------------------------------------------------------------ without early stopping
def _three_gpus(seed: int = 0):
    rng = np.random.default_rng(seed)
    roof = rng.uniform(0.05, 0.5, 90)
    x = np.c_[np.log2(roof), rng.normal(size=(90, 2))]
    groups = np.repeat(np.array(["a", "b", "c"]), 30)
    y = roof * (1.5 + (groups == "c") * 0.5 + rng.uniform(0, 0.2, 90))
    return x, roof, y, groups


def test_full_schedule_folds_never_see_their_held_out_gpu():
    """early_stopping=False: the final model is the plain full-schedule fit on every GPU, and each GPU's score
    is that of a model fitted without its rows (its labels cannot change its own fold's predictions)."""
    from neusight.predictor.train import fit_mlp, fit_mlp_logo, mape, predict_mlp

    x, roof, y, groups = _three_gpus()
    cfg = replace(TINY, epochs=5, early_stopping=False)
    final, scores = fit_mlp_logo(x, roof, y, groups, cfg, n_mono=1)
    assert set(scores) == {"a", "b", "c"} and final.val_groups == ("a", "b", "c")
    plain = fit_mlp(x, roof, y, groups, replace(cfg, patience=cfg.epochs + 1), (), n_mono=1)
    np.testing.assert_array_equal(predict_mlp(final.model, x, roof)[0], predict_mlp(plain.model, x, roof)[0])
    held = groups == "c"
    alone = fit_mlp(x[~held], roof[~held], y[~held], groups[~held], replace(cfg, patience=cfg.epochs + 1), (), n_mono=1)
    pred = predict_mlp(alone.model, x[held], roof[held])[0]
    assert scores["c"] == round(mape(pred, y[held]), 2)
    y2 = np.where(held, y * 3, y)                      # GPU c's labels change: its fold model does not
    _, scores2 = fit_mlp_logo(x, roof, y2, groups, cfg, n_mono=1)
    assert scores2["c"] == round(mape(pred, y2[held]), 2)
    assert scores2["c"] != scores["c"]


def test_early_stopping_flag_reaches_the_fit_and_is_deterministic(small_df, small_fit):
    cfg = PredictorConfig(families={"linear": replace(TINY, early_stopping=False), "elementwise": TINY},
                          val_devices=("logo",))
    full = Predictor(cfg).fit(small_df)
    assert set(full.metrics_["linear"]["leave_one_gpu_out_mape"]) == {"p4", "t4"}
    assert full.config.families["linear"].early_stopping is False
    d = small_df[(small_df["device"] == "t4") & (small_df["family"] == "linear")]
    # the flag changes the linear fit (three epochs whatever the folds say), not the elementwise one
    assert not np.array_equal(full.predict(d, "t4")["latency_ms"], small_fit.predict(d, "t4")["latency_ms"])
    e = small_df[(small_df["device"] == "t4") & (small_df["family"] == "elementwise")]
    pd.testing.assert_frame_equal(full.predict(e, "t4"), small_fit.predict(e, "t4"), check_exact=True)
    pd.testing.assert_frame_equal(full.predict(d, "t4"), Predictor(cfg).fit(small_df).predict(d, "t4"),
                                  check_exact=True)


# ---------------------------------------------------------------------------------------------------------
# TF32: which FP32 kernels run on TF32 tensor cores (neusight.api.TF32_MODES)

@pytest.fixture(scope="module")
def resnet_graph():
    return neusight.trace("resnet18", batch_size=8, mode="training", optimizer="sgd")


def test_tf32_default_runs_convolutions_on_tensor_cores_of_gpus_that_have_them(resnet_graph):
    from neusight.api import predict_graph

    a100 = {m: predict_graph(resnet_graph, "a100-pcie-40gb", tf32=m) for m in (None, "default", "all", "off", True,
                                                                               False)}
    k = a100[None].kernels
    aligned = k["channel_align"] >= 4   # every conv but the 3-channel first layer's (next test)
    assert set(k.loc[(k["family"] == "conv") & aligned, "dtype"]) == {"tf32"}   # PyTorch's default: convolutions
    assert set(k.loc[k["family"] == "linear", "dtype"]) == {"float32"}          # ... but not matmuls
    assert set(a100["all"].kernels.loc[k["family"] == "linear", "dtype"]) == {"tf32"}
    assert (a100["off"].kernels["dtype"] != "tf32").all()
    assert a100[None].latency_ms == a100["default"].latency_ms < a100["off"].latency_ms
    assert a100[True].latency_ms == a100["all"].latency_ms and a100[False].latency_ms == a100["off"].latency_ms
    assert any("TF32" in n for n in a100[None].notes) and not any("TF32" in n for n in a100["off"].notes)
    for p in a100.values():   # the laws hold with the TF32 bound too
        assert (p.kernels["isolated_ms"] >= p.kernels["roofline_ms"]).all() and np.isfinite(p.latency_ms)
    conv = k["family"] == "conv"   # a TF32 convolution is bounded by the TF32 peak, not the FP32 one
    assert (k.loc[conv, "roofline_ms"] <= a100["off"].kernels.loc[conv, "roofline_ms"]).all()
    assert (k.loc[conv & aligned, "roofline_ms"] < a100["off"].kernels.loc[conv & aligned, "roofline_ms"]).all()
    # a GPU without TF32 tensor cores runs true FP32 whatever the switch says
    v100 = {m: predict_graph(resnet_graph, "v100-sxm2-16gb", tf32=m).latency_ms for m in ("default", "all", "off")}
    assert len(set(v100.values())) == 1
    # PyTorch's default TF32 convolutions are cuDNN's: on ROCm (MI300X has TF32 units) only tf32="all" uses them
    mi300 = {m: predict_graph(resnet_graph, "mi300x", tf32=m).kernels for m in ("default", "all")}
    assert (mi300["default"]["dtype"] != "tf32").all() and (mi300["all"]["dtype"] == "tf32").any()


def test_convolutions_with_unaligned_channels_stay_off_the_tensor_cores(resnet_graph):
    """A convolution is forecast on tensor cores only when its input and output channels are multiples of 8
    (FP16 / BF16) or 4 (TF32), as NVIDIA's convolution guide asks: ResNet's first layer (3 input channels) is a
    CUDA-core convolution at the FP32 rates, in TF32 and in mixed precision alike, and the forecast says so; its other
    convolutions are unaffected."""
    from neusight.api import predict_graph

    k = resnet_graph.kernels
    conv = k["family"] == "conv"
    stem = conv & (k["module"] == "conv1")
    assert set(k.loc[stem, "kernel"]) == {"conv_fwd", "conv_wgrad_strided"}   # no data gradient of the input
    assert (k.loc[stem, "channel_align"] == 1).all() and (k.loc[conv & ~stem, "channel_align"] == 8).all()
    assert k.loc[~conv, "channel_align"].isna().all()
    tf32, off = (predict_graph(resnet_graph, "a100-pcie-40gb", tf32=m).kernels for m in ("default", "off"))
    assert (tf32.loc[stem, "dtype"] == "float32").all() and (tf32.loc[conv & ~stem, "dtype"] == "tf32").all()
    pd.testing.assert_series_equal(tf32.loc[stem, "latency_ms"], off.loc[stem, "latency_ms"])
    note = [n for n in predict_graph(resnet_graph, "a100-pcie-40gb").notes if "multiples of 8" in n]
    assert len(note) == 1 and note[0].startswith("2 TF32 convolution kernels")
    assert not any("multiples of 8" in n for n in predict_graph(resnet_graph, "a100-pcie-40gb", tf32="off").notes)
    # mixed precision: the FP16 first layer is bounded by the FP32 peak, its bytes stay half precision
    amp = neusight.trace("resnet18", batch_size=8, mode="training", optimizer="sgd", amp="float16")
    ka = predict_graph(amp, "a100-pcie-40gb").kernels
    stem_a = (ka["family"] == "conv") & (ka["module"] == "conv1")
    assert (ka.loc[stem_a, "dtype"] == "float16").all()
    dev = load_device("a100-pcie-40gb")
    fwd = ka[stem_a & (ka["kernel"] == "conv_fwd")].iloc[0]
    assert fwd["roofline_ms"] >= fwd["flops"] / dev.peak_fp32_flops * 1e3 * (1 - 1e-9)
    assert fwd["bytes"] == k.loc[stem & (k["kernel"] == "conv_fwd"), "bytes"].iloc[0] / 2
    assert any(n.startswith("2 FP16 convolution kernels") for n in predict_graph(amp, "a100-pcie-40gb").notes)


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(st.tuples(dim, dim, dim), st.sampled_from(("M", "N", "K")), st.sampled_from((1.0, 8.0)),
       st.sampled_from(("float16", "bfloat16")), st.sampled_from(("v100-sxm2-16gb", "a100-pcie-40gb", "h100-sxm5-80gb")))
def test_half_precision_convolutions_keep_the_work_law_on_either_side_of_the_channel_rule(shipped, shape, which, align,
                                                                                         dtype, device):
    """Within one side of the channel rule (tensor cores, or the CUDA cores for unaligned channels) more work never
    forecasts a convolution faster. Across it the law does not hold and is not meant to: padding a first layer's 3
    channels to 8 adds work and lets it use tensor cores, which NVIDIA's guide recommends for speed."""
    def conv(m, n, k):
        return {"family": "conv", "kernel": "conv_fwd", "B": 1.0, "M": m, "N": n, "K": k, "rows": np.nan,
                "cols": np.nan, "flops": 2.0 * m * n * k, "algo_flops": 2.0 * m * n * k,
                "bytes": 2.0 * (m * n + n * k + m * k), "dtype": dtype, "channel_align": align}
    dims = dict(zip("MNK", (float(v) for v in shape)))
    bigger = {**dims, which: dims[which] * 2}
    lat = shipped.predict(pd.DataFrame([conv(*dims.values()), conv(*bigger.values())]), device)["latency_ms"]
    assert lat.iloc[1] >= lat.iloc[0], (shape, which, align, dtype, device, lat.tolist())


def test_grouped_convolutions_are_aligned_by_their_channel_counts():
    """The channel rule counts a convolution's channels, not its channels per group: a ResNeXt 32x4d block's
    grouped convolution (128 channels in 32 groups of 4) is aligned. Counted per group, ResNeXt-101's AMP rows went
    from +1.5 to +9.8 % on T4 (inference) and to +22.8 % on V100 (training) when the rule was written."""
    from neusight.kernels.base import channel_alignment

    assert [channel_alignment(c, k) for c, k in ((3, 64), (4, 64), (64, 6), (128, 128), (16, 24))] == [1, 4, 2, 8, 8]
    g = neusight.trace(torch.nn.Conv2d(128, 128, 3, padding=1, groups=32), batch_size=2, mode="training",
                       input_shapes=[(128, 8, 8)], optimizer=None)
    conv = g.kernels[g.kernels["family"] == "conv"]
    assert set(conv["kernel"]) == {"conv_fwd", "conv_wgrad"} and (conv["channel_align"] == 8).all()


def test_unknown_tf32_mode_is_refused_with_the_choices(resnet_graph):
    from neusight.api import predict_graph

    with pytest.raises(InputError, match=r"tf32='fast'.*'default', 'all', 'off'"):
        predict_graph(resnet_graph, "a100-pcie-40gb", tf32="fast")


def test_mixed_precision_training_is_forecast_faster_than_fp32_on_tensor_cores():
    # GEMMs at the FP16 / BF16 tensor peak, the rest as traced (FP32 softmax, norms, loss, casts, FP32 AdamW)
    runs = {amp: neusight.predict("gpt2", "a100-pcie-40gb", batch_size=4, seq_len=128, mode="training", amp=amp,
                                  memory=False) for amp in (None, "float16", "bfloat16")}
    assert runs["float16"].latency_ms < runs[None].latency_ms and runs["bfloat16"].latency_ms < runs[None].latency_ms
    k = runs["float16"].kernels
    assert (k["isolated_ms"] >= k["roofline_ms"]).all()
    assert set(k.loc[k["family"] == "linear", "dtype"]) == {"float16"}


def test_predict_many_equals_predict_on_each_gpu_from_one_trace():
    gpus = ["t4", "l4", "mi210"]   # an AMD GPU: its vendor's predictor, as predict() picks it
    many = neusight.predict_many("gpt2", gpus, batch_size=2, seq_len=64, mode="training")
    for p, key in zip(many, gpus):
        one = neusight.predict("gpt2", key, batch_size=2, seq_len=64, mode="training")
        assert p.device.key == key and p.latency_ms == one.latency_ms and p.phases == one.phases
        assert p.memory.peak_bytes == one.memory.peak_bytes


def test_predict_many_leaves_out_gpus_that_cannot_run_it_or_raises():
    left: dict[str, str] = {}
    ps = neusight.predict_many("llama-3-8b", ["t4", "l4", "h100-sxm5-80gb"], seq_len=16, dtype="bfloat16", fp8=True,
                               memory=False, left_out=left)
    assert [p.device.key for p in ps] == ["l4", "h100-sxm5-80gb"]
    assert list(left) == ["t4"] and left["t4"].startswith("fp8=True needs FP8 tensor cores")
    with pytest.raises(InputError, match="fp8=True needs FP8 tensor cores"):   # without left_out: raised
        neusight.predict_many("llama-3-8b", ["t4", "l4"], seq_len=16, dtype="bfloat16", fp8=True, memory=False)
    with pytest.raises(InputError, match="GPT2LMHeadModel has none that qualify"):   # no GPU can: the model's error
        neusight.predict_many("gpt2", ["t4", "l4"], seq_len=16, dtype="bfloat16", fp8=True, left_out={})
    with pytest.raises(InputError, match="devices"):
        neusight.predict_many("gpt2", [], seq_len=16)


def test_an_error_names_a_gpu_only_by_its_whole_key():
    """predict_many raises the error that names no GPU when none can run the model: "int4" does not name t4."""
    from neusight.api import _names

    assert _names("fp8=True needs FP8 tensor cores; t4 (NVIDIA T4) has none", "t4")
    assert _names("it does not fit on l4.", "l4") and _names("a100-80gb-pcie: no", "a100-80gb-pcie")
    assert not _names("weight_quant='int4' quantizes nn.Linear weights", "t4")
    assert not _names("a100-80gb-pcie-x", "a100-80gb-pcie") and not _names("see l4.yaml", "l4")


def test_rank_orders_gpus_fastest_first_with_their_memory_fit():
    t = neusight.rank("gpt2-large", ["t4", "a100-80gb-pcie", "h100-sxm5-80gb", "rtx-3090"], batch_size=4,
                      seq_len=1024, mode="training")
    assert list(t["rank"]) == [1, 2, 3, 4]
    assert t["ms"].is_monotonic_increasing and t["time vs fastest"].iloc[0] == 1.0
    assert (t["time vs fastest"] == t["ms"] / t["ms"].min()).all()
    fits = dict(zip(t["GPU"], t["fits"]))
    assert fits["h100-sxm5-80gb"] == "yes" and fits["t4"] == "no"    # about 58 GiB: 80 GB yes, 16 GB no
    assert dict(zip(t["GPU"], t["predictor trained on it"]))["t4"] == "yes" and t.attrs["left_out"] == {}

"""The tile table's nearest-neighbour lookup (neusight.tile_table): exact nearest key, the first key on a tie,
the same answer however many queries come at once, and launch geometries of the shipped table that a kernel can
run with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import neusight.tile_table as tt
from neusight.predictor.model import Predictor

DATA = Path(__file__).resolve().parents[1] / "data"


def _index(keys: list[list[float]], values: list[list[float]]) -> tt._Index:
    k = np.asarray(keys, np.float32)
    return tt._Index(k, np.asarray(values, np.float32), np.zeros(k.shape[1], np.float32),
                     np.ones(k.shape[1], np.float32))


def _nearest_one_by_one(idx: tt._Index, raw: np.ndarray) -> np.ndarray:
    """Reference: a Python loop over the keys, strict '<' so the first of equally near keys wins."""
    out = []
    for q in ((raw - idx.mean) / idx.std).astype(np.float32).astype(float):
        best, best_d = 0, np.inf
        for i, key in enumerate(idx.keys.astype(float)):
            d = float(((q - key) ** 2).sum())
            if d < best_d:
                best, best_d = i, d
        out.append(idx.values[best])
    return np.asarray(out)


def test_the_nearest_key_gives_the_value_and_the_first_key_wins_a_tie():
    idx = _index([[0, 0], [2, 0], [0, 3]], [[10, 1], [20, 2], [30, 3]])
    got = idx.query(np.array([[0.1, 0.2], [1.9, -1.0], [0.0, 2.0], [1.0, 0.0], [0.0, 1.5]]))
    # (1, 0) is as near to key 0 as to key 1, (0, 1.5) as near to key 0 as to key 2: key 0 wins both
    assert got.tolist() == [[10, 1], [20, 2], [30, 3], [10, 1], [10, 1]]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 60))
def test_lookup_matches_a_one_by_one_search(seed: int, n_keys: int, n_queries: int):
    rng = np.random.default_rng(seed)
    # keys and queries on a coarse grid, so ties are common
    idx = _index(rng.integers(0, 6, (n_keys, 2)).tolist(), rng.integers(0, 100, (n_keys, 2)).tolist())
    raw = rng.integers(-1, 7, (n_queries, 2)) / 2.0
    np.testing.assert_array_equal(idx.query(raw), _nearest_one_by_one(idx, raw))


def test_queries_in_several_blocks_answer_as_one_at_a_time(monkeypatch: pytest.MonkeyPatch):
    rng = np.random.default_rng(3)
    idx = _index(rng.normal(size=(50, 2)).tolist(), rng.integers(0, 9, (50, 2)).tolist())
    raw = rng.normal(size=(23, 2))
    whole = idx.query(raw)
    monkeypatch.setattr(tt, "_QUERY_CHUNK", 4)      # 6 blocks, the last one short
    np.testing.assert_array_equal(idx.query(raw), whole)
    np.testing.assert_array_equal(np.vstack([idx.query(r[None]) for r in raw]), whole)
    assert idx.query(np.empty((0, 2))).shape == (0, 2)


@pytest.mark.parametrize("checkpoint", ["predictor", "predictor-amd"])
def test_shipped_launch_geometries_are_measured_ones(checkpoint: str):
    """Every answer is a (elements per block, threads per block) pair some measured launch had."""
    table = Predictor.load(DATA / checkpoint).table_
    rows = 2.0 ** np.arange(0, 25, 1.5)
    cols = 2.0 ** np.arange(0, 17, 1.0)
    r, c = (a.ravel() for a in np.meshgrid(rows, cols))
    for fam in tt.ROW_FAMILIES:
        epb, tpb = table.launch_geometry(fam, r, c)
        seen = {tuple(v) for v in table.indexes[fam].values.astype(float).tolist()}
        assert {(e, t) for e, t in zip(epb.tolist(), tpb.tolist())} <= seen
        assert np.all(epb > 0) and np.all(tpb >= 32) and np.all(tpb <= 1024)

"""Wiring masks: constructors, validation, explicit storage."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dense_bridge as db


@given(i=st.integers(1, 40), u=st.integers(1, 40), density=st.floats(0.01, 1.0), seed=st.integers(0, 10**6))
@settings(max_examples=60, deadline=None)
def test_random_wiring_exact_count_per_output(i, u, density, seed):
    w = db.wiring.random(i, u, density, seed)
    k = max(1, round(density * i))
    assert w.shape == (i, u) and (w.adjacency.sum(axis=0) == k).all()
    assert w == db.wiring.random(i, u, density, seed)
    assert db.wiring.Wiring.from_config(w.to_config()) == w


def test_banded_square_is_band():
    w = db.wiring.banded(6, 6, 1).adjacency
    i, j = np.indices((6, 6))
    assert np.array_equal(w, np.abs(i - j) <= 1)


@pytest.mark.parametrize("i,u", [(3, 10), (10, 3), (7, 7)])
def test_banded_every_output_connected(i, u):
    assert db.wiring.banded(i, u, 0).adjacency.any(axis=0).all()


def test_block_diagonal_blocks():
    w = db.wiring.block_diagonal(4, 6, 2).adjacency
    expected = np.zeros((4, 6), bool)
    expected[:2, :3] = expected[2:, 3:] = True
    assert np.array_equal(w, expected)


def test_dense_and_from_adjacency():
    assert db.wiring.dense(3, 2).adjacency.all()
    a = np.array([[1, 0], [0, 1], [1, 1]])
    assert np.array_equal(db.wiring.from_adjacency(a).adjacency, a.astype(bool))


def test_empty_output_rejected_unless_asked():
    a = np.array([[1, 0], [1, 0]])
    with pytest.raises(db.SpecError, match="no input"):
        db.wiring.from_adjacency(a)
    assert db.wiring.from_adjacency(a, allow_empty_outputs=True).num_connections == 2


def test_adjacency_is_read_only():
    w = db.wiring.dense(2, 2)
    with pytest.raises(ValueError):
        w.adjacency[0, 0] = False

"""The Dask top-k's ranking product: bits that do not depend on where a key sits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attnnb._dask.products import elementwise_products, ordered_products


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), d=st.integers(1, 70), width=st.integers(1, 300),
       column=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_a_key_gets_the_same_bits_at_every_column(seed, d, width, column, dtype):
    """One key placed at any column of a block of any width gets bit-equal products
    (a BLAS product does not promise this: see the module docstring)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 9, d)).astype(dtype)
    key = rng.standard_normal(d).astype(dtype)
    alone = ordered_products(np, q, key[None, :, None])[0, :, 0]
    kt = rng.standard_normal((1, d, width)).astype(dtype)
    j = column.draw(st.integers(0, width - 1))
    kt[0, :, j] = key
    np.testing.assert_array_equal(ordered_products(np, q, kt)[0, :, j], alone)


def test_compiled_loop_and_array_operations_give_the_same_bits():
    """The NumPy path (a compiled loop) and the other namespaces' path (array operations)
    round every step alike, and both are the product to float32 rounding."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 17, 45)).astype(np.float32)
    kt = rng.standard_normal((2, 3, 45, 131)).astype(np.float32)
    compiled = ordered_products(np, q, kt)
    np.testing.assert_array_equal(compiled, elementwise_products(np, q, kt))
    exact = q.astype(np.float64) @ kt.astype(np.float64)
    scale = np.abs(q).astype(np.float64) @ np.abs(kt).astype(np.float64)
    assert np.all(np.abs(compiled - exact) <= 45 * 2.0**-24 * scale)
    assert compiled.dtype == np.float32 and compiled.shape == (2, 3, 17, 131)


def test_empty_and_depth_zero():
    """No rows, no keys or no depth: the right shape, zeros for depth 0."""
    assert ordered_products(np, np.ones((1, 0, 4)), np.ones((1, 4, 5))).shape == (1, 0, 5)
    assert ordered_products(np, np.ones((1, 3, 4)), np.ones((1, 4, 0))).shape == (1, 3, 0)
    np.testing.assert_array_equal(ordered_products(np, np.ones((1, 3, 0)), np.ones((1, 0, 5))),
                                  np.zeros((1, 3, 5)))

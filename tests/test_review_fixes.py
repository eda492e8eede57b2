"""Argument handling found wanting in review (2026-12-03), each case as it should be.

Masks and biases with two batch axes stay small; patterns never freeze or wrap the
caller's arrays; builders and helpers check their arguments and name them; ToMe's
weighted merge takes integer counts; masked arrays and Dask arrays of unknown chunk
sizes are refused with a clear message.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnnb
from attnnb import diff, patterns, tome
from attnnb._validate import attention_problem


def test_bias_and_mask_of_two_batch_axes_copy_the_batch_axes_only():
    rng = np.random.default_rng(0)
    B1, B2, H, L, D = 2, 8, 4, 32, 8
    q = rng.standard_normal((B1, B2, H, L, D))
    bias = rng.standard_normal((B1, 1, 1, L, L))
    mask = rng.random((1, B2, 1, L, L)) > 0.3
    problem = attention_problem(q, q, q, bias=bias, mask=mask)
    for canonical, user in ((problem.bias, bias), (problem.mask, mask)):
        held = canonical.base if canonical.base is not None else canonical
        while getattr(held, "base", None) is not None:
            held = held.base
        assert held.nbytes <= B1 * B2 * L * L * user.itemsize  # never the heads
        np.testing.assert_array_equal(
            canonical, np.broadcast_to(user, (B1, B2, H, L, L)).reshape(B1 * B2, H, L, L))
    got = attnnb.attention(q, q, q, bias=bias, mask=mask, backend="reference")
    want = attnnb.attention(q, q, q, bias=np.broadcast_to(bias, (B1, B2, H, L, L)).copy(),
                            mask=np.broadcast_to(mask, (B1, B2, H, L, L)).copy(),
                            backend="reference")
    np.testing.assert_array_equal(got, want)


def test_pattern_leaves_the_callers_arrays_writeable():
    indptr = np.array([0, 1, 3], np.int64)
    indices = np.array([0, 0, 1], np.int32)
    pattern = patterns.Pattern(indptr, indices, (2, 2))
    assert indptr.flags.writeable and indices.flags.writeable
    indptr[0] = 0  # still the caller's to write
    assert not pattern.indptr.flags.writeable and not pattern.indices.flags.writeable


def test_pattern_refuses_keys_that_int32_would_wrap():
    with pytest.raises(ValueError, match=r"indices must lie in \[0, Lk\)"):
        patterns.Pattern(np.array([0, 1]), np.array([2**32 + 1], np.int64), (1, 4))


@pytest.mark.parametrize("tokens", [np.array([False, False, False, False, True]), [1.7], ["a"]])
def test_longformer_global_tokens_must_be_integer_positions(tokens):
    with pytest.raises(TypeError, match="global_tokens"):
        patterns.longformer(5, 1, tokens)


@pytest.mark.parametrize("builder", [lambda c: patterns.local(5, 1, causal=c),
                                     lambda c: patterns.strided(5, 2, causal=c),
                                     lambda c: patterns.fixed(6, 3, 1, causal=c),
                                     lambda c: patterns.dilated(6, 2, 2, causal=c)])
@pytest.mark.parametrize("value", [None, 1, "yes"])
def test_builders_take_a_real_bool_for_causal(builder, value):
    with pytest.raises(TypeError, match="causal must be True or False"):
        builder(value)


@pytest.mark.parametrize("name", ["mask", "bias", "key_size"])
def test_ragged_lists_name_the_argument(name):
    q = np.zeros((2, 3, 4))
    value = [[True, False], [True]] if name == "mask" else [[1.0, 2.0], [1.0]]
    with pytest.raises(TypeError, match=f"^{name} could not be read"):
        attnnb.attention(q, q, q, backend="reference", **{name: value})


def test_lam_lambda_init_and_seed_errors_name_the_argument():
    q = np.zeros((1, 2, 3, 4))
    with pytest.raises(TypeError, match="^lam could not be read"):
        attnnb.diff_attention(q, q, q[:, :1], [[0.1, 0.2], [0.1]], backend="reference")
    with pytest.raises(TypeError, match="lambda_init must be a number"):
        diff.subln(q, lambda_init=[0.1, 0.2])
    with pytest.raises(TypeError, match="seed must be"):
        patterns.bigbird(8, 2, 0, 1, 1, seed="x")


def test_subln_weight_never_grows_the_result():
    x = np.ones(8)
    with pytest.raises(ValueError, match="weight of shape"):
        diff.subln(x, np.ones((5, 8)), lambda_init=0.2)
    assert diff.subln(np.ones((3, 8)), np.ones(8), lambda_init=0.2).shape == (3, 8)


def test_merge_wavg_takes_integer_counts():
    rng = np.random.default_rng(1)
    matching = tome.bipartite_soft_matching(rng.standard_normal((1, 6, 3)), 2)
    x = rng.standard_normal((1, 6, 4))
    counts = rng.integers(1, 4, (1, 6, 1))
    got = tome.merge_wavg(matching, x, counts)
    want = tome.merge_wavg(matching, x, counts.astype(np.float64))
    for g, w in zip(got, want):
        assert g.dtype == np.float64
        np.testing.assert_array_equal(g, w)
    with pytest.raises(TypeError):
        tome.merge_wavg(matching, x, np.ones((1, 6, 1), bool))


def test_masked_arrays_with_masked_entries_are_refused():
    v = np.ma.masked_array(np.ones((5, 3)), mask=np.zeros((5, 3), bool))
    q = np.zeros((2, 3))
    assert attnnb.attention(q, np.ones((5, 3)), v, backend="reference").shape == (2, 3)
    v[2] = np.ma.masked
    with pytest.raises(TypeError, match="^v is a masked array"):
        attnnb.attention(q, np.ones((5, 3)), v, backend="reference")


def test_dask_arrays_of_unknown_chunk_sizes_are_refused():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(2)
    q = da.from_array(rng.standard_normal((6, 4)), chunks=(3, 4))
    unknown = q[q[:, 0] > -100]  # chunks ((nan, nan), (4,))
    k, v = rng.standard_normal((7, 4)), rng.standard_normal((7, 3))
    with pytest.raises(ValueError, match=r"q has chunks of unknown size.*compute_chunk_sizes"):
        attnnb.attention(unknown, k, v, causal=True, backend="reference")
    known = unknown.compute_chunk_sizes()
    np.testing.assert_allclose(attnnb.attention(known, k, v, backend="reference").compute(),
                               attnnb.attention(q.compute(), k, v, backend="reference"))

"""topk_attention against a sort-based reference written with plain loops."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnnb

from .helpers import HOST_BACKENDS, assert_close


def sorted_topk(q, k, v, top_k, mask=None, causal=False, key_size=None, scale=1.0):
    """Loop reference: sort each row's allowed keys by (-weight, index), keep top_k."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    H, Lq, _ = q.shape
    Lk = k.shape[1]
    group = H // k.shape[0]
    out = np.zeros((H, Lq, v.shape[-1]))
    lse = np.full((H, Lq), -np.inf)
    for h in range(H):
        for i in range(Lq):
            cand = []
            for j in range(Lk):
                if mask is not None and not mask[h, i, j]:
                    continue
                if causal and j > i + Lk - Lq:
                    continue
                t = scale * q[h, i] @ k[h // group, j]
                if key_size is not None:
                    t += np.log(key_size[j])
                cand.append((-t, j))
            cand.sort()
            kept = cand[:top_k]
            if not kept:
                continue
            t = np.array([-c for c, _ in kept])
            js = [j for _, j in kept]
            mx = t.max()
            e = np.exp(t - mx)
            out[h, i] = (e / e.sum()) @ v[h // group, js]
            lse[h, i] = mx + np.log(e.sum())
    return out, lse


def integer_qkv(rng, hq, hk, lq, lk, d, dtype):
    """Small integers: every logit is exact in float32 and float64, with many ties."""
    q = rng.integers(-2, 3, (hq, lq, d)).astype(dtype)
    k = rng.integers(-2, 3, (hk, lk, d)).astype(dtype)
    v = rng.standard_normal((hk, lk, 5)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("top_k", [1, 3, 17, 70, 200])
def test_against_sorted_reference_with_ties(rng, backend, dtype, top_k):
    q, k, v = integer_qkv(rng, 4, 2, 67, 130, 3, dtype)
    out, lse = attnnb.topk_attention(q, k, v, top_k, scale=1.0, return_lse=True,
                                     backend=backend)
    ref, ref_lse = sorted_topk(q, k, v, top_k)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_causal_key_size(rng, backend, dtype):
    q, k, v = integer_qkv(rng, 2, 1, 70, 90, 4, dtype)
    mask = rng.random((2, 70, 90)) < 0.6
    mask[:, 3] = False  # empty rows
    key_size = rng.choice([1.0, 2.0, 4.0], size=90)
    for top_k in (0, 1, 5, 40):
        out, lse = attnnb.topk_attention(q, k, v, top_k, mask=mask, causal=True,
                                         key_size=key_size, scale=0.5, return_lse=True,
                                         backend=backend)
        ref, ref_lse = sorted_topk(q, k, v, top_k, mask, True, key_size, 0.5)
        assert_close(out, ref, dtype)
        assert_close(lse, ref_lse, dtype, what="lse")
        np.testing.assert_array_equal(out[:, 3], 0.0)
        assert np.all(lse[:, 3] == -np.inf)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_top_k_at_least_allowed_is_masked_attention(rng, backend):
    q = rng.standard_normal((3, 75, 8))
    k = rng.standard_normal((3, 80, 8))
    v = rng.standard_normal((3, 80, 6))
    mask = rng.random((75, 80)) < 0.3
    dense = attnnb.attention(q, k, v, mask=mask, causal=True, backend="reference")
    for top_k in (80, 1000):
        out = attnnb.topk_attention(q, k, v, top_k, mask=mask, causal=True, backend=backend)
        assert_close(out, dense, np.float64)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("top_k", [3, 6, 7, 60])  # 6 = 100 // 16: as many chunks as top_k
def test_exactly_top_k_kept_among_equal_keys(backend, top_k):
    # all keys identical: every weight ties, so the lowest top_k indices are kept
    q = np.ones((1, 4, 2))
    k = np.ones((1, 100, 2))
    v = np.arange(100, dtype=np.float64).reshape(1, 100, 1)
    out, lse = attnnb.topk_attention(q, k, v, top_k, return_lse=True, backend=backend)
    np.testing.assert_allclose(out[0, :, 0], np.mean(np.arange(top_k)), rtol=1e-12)
    np.testing.assert_allclose(lse[0], 2 / np.sqrt(2) + np.log(top_k), rtol=1e-12)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_nan_outside_allowed_set_and_huge_logits(rng, backend):
    q = rng.standard_normal((1, 66, 4)).astype(np.float32) * 100
    k = rng.standard_normal((1, 66, 4)).astype(np.float32) * 100
    v = rng.standard_normal((1, 66, 3)).astype(np.float32)
    k[0, 65] = np.nan  # only the last query may see it (causal)
    out = attnnb.topk_attention(q, k, v, 4, causal=True, scale=1.0, backend=backend)
    assert np.isfinite(out[0, :65]).all()
    assert np.isnan(out[0, 65]).all()
    ref, _ = sorted_topk(q[:, :65], k[:, :65], v[:, :65], 4, causal=True)
    assert_close(out[:, :65], ref, np.float32)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(1, 70), lk=st.integers(1, 70),
       top_k=st.integers(0, 80))
def test_property_matches_reference_backend(seed, lq, lk, top_k):
    rng = np.random.default_rng(seed)
    q, k, v = integer_qkv(rng, 2, 1, lq, lk, 3, np.float64)
    mask = rng.random((lq, lk)) < 0.7
    # scale 1: integer logits are exact, so both backends see the same ties
    kw = dict(mask=mask, causal=True, scale=1.0)
    a = attnnb.topk_attention(q, k, v, top_k, backend="cpu", **kw)
    b = attnnb.topk_attention(q, k, v, top_k, backend="reference", **kw)
    assert_close(a, b, np.float64)


def test_validation():
    q = k = v = np.zeros((2, 5, 4))
    with pytest.raises(TypeError, match="top_k"):
        attnnb.topk_attention(q, k, v, 2.5)
    with pytest.raises(TypeError, match="top_k"):
        attnnb.topk_attention(q, k, v, True)
    with pytest.raises(ValueError, match="top_k"):
        attnnb.topk_attention(q, k, v, -1)
    with pytest.raises(TypeError, match="mask"):
        attnnb.topk_attention(q, k, v, 2, mask=np.ones((5, 5)))
    with pytest.raises(ValueError, match="key_size"):
        attnnb.topk_attention(q, k, v, 2, key_size=np.zeros(5))
    assert attnnb.topk_attention(q, k, v, np.int64(2)).shape == (2, 5, 4)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300), top_k=st.integers(0, 40),
       levels=st.integers(1, 50), masked=st.floats(0.0, 1.0), nan=st.booleans())
def test_row_threshold_selects_like_a_sort(seed, n, top_k, levels, masked, nan):
    # the CPU selection on its own: few distinct values (ties), -inf keys, NaN; both the
    # chunk-bound path (n // 16 >= top_k) and the unbounded one
    from attnnb.cpu._sparse_tiles import row_threshold

    rng = np.random.default_rng(seed)
    row = rng.integers(0, levels, n).astype(np.float32)
    row[rng.random(n) < masked] = -np.inf
    if nan and n:
        row[rng.integers(n)] = np.nan
    thr, cut = row_threshold(row, n, top_k, np.empty(max(n, 1), np.float32))
    j = np.arange(n)
    chosen = (row > thr) | np.isnan(row) | ((row == thr) & (j <= cut))
    allowed = row > -np.inf
    if np.isnan(row).any():
        expected = allowed | np.isnan(row)
    else:
        order = sorted(np.flatnonzero(allowed), key=lambda i: (-row[i], i))
        expected = np.zeros(n, bool)
        expected[order[:top_k]] = True
    np.testing.assert_array_equal(chosen & (allowed | np.isnan(row)), expected)


def test_row_threshold_when_the_chunk_maxima_are_exactly_the_top_k():
    # the bound's candidates are then exactly top_k keys: the threshold is their minimum
    from attnnb.cpu._sparse_tiles import row_threshold

    row = np.zeros(32, np.float32)
    row[3], row[20] = 10.0, 9.0
    thr, cut = row_threshold(row, 32, 2, np.empty(32, np.float32))
    chosen = (row > thr) | ((row == thr) & (np.arange(32) <= cut))
    np.testing.assert_array_equal(np.flatnonzero(chosen), [3, 20])

"""topk_attention against a sort-based reference written with plain loops."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnnb

from .helpers import HOST_BACKENDS, assert_close, from_jit

GRAD_RTOL = {np.float64: 1e-12, np.float32: 1e-4}  # as tests/grad/test_cpu.py


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


def expected_selection(row, top_k):
    """The keys a row keeps, by a sort on (-logit, index); everything when it holds NaN."""
    n = len(row)
    allowed = row > -np.inf
    if np.isnan(row).any():
        return allowed | np.isnan(row)
    order = sorted(np.flatnonzero(allowed), key=lambda i: (-row[i], i))
    keep = np.zeros(n, bool)
    keep[order[:top_k]] = True
    return keep


def run_select_row(row, top_k):
    """``select_row`` on its own: ``(thr, cut, list of kept indices or None)``."""
    from attnnb.cpu._topk_rows import BUCKETS, scratch_size, select_row

    n = len(row)
    w = from_jit(scratch_size)(n)
    gmax, cval, ftmp = (np.empty(w, row.dtype) for _ in range(3))
    cidx, itmp = np.empty(w, np.int64), np.empty(w, np.int64)
    thr, cut, cnt = from_jit(select_row)(row, n, top_k, gmax, cval, cidx, ftmp, itmp,
                                         np.empty(BUCKETS, np.int64))
    if cnt < 0:
        return thr, cut, None
    kept = cidx[:cnt].copy()
    np.testing.assert_array_equal(cval[:cnt], row[kept])  # the list carries the logits
    return thr, cut, kept


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 1500), top_k=st.integers(0, 90),
       levels=st.sampled_from([1, 2, 5, 50, 10**6]), masked=st.floats(0.0, 1.0),
       nan=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]),
       layout=st.sampled_from(["random", "ascending", "descending", "spread"]))
def test_select_row_selects_like_a_sort(seed, n, top_k, levels, masked, nan, dtype, layout):
    # the CPU selection on its own: few distinct values (ties), -inf keys, NaN, sorted rows,
    # values over the whole float range; rows short enough to take every allowed key and
    # long enough for the group bound (n >= 4 top_k)
    rng = np.random.default_rng(seed)
    row = rng.integers(0, levels, n).astype(dtype)
    if layout == "ascending":
        row.sort()
    elif layout == "descending":
        row[::-1].sort()
    elif layout == "spread":  # (hi - lo) overflows or is subnormal; +-inf; -0.0 / +0.0 ties
        big, sub = np.finfo(dtype).max, np.finfo(dtype).tiny / 4
        values = [-big, -1.0, -0.0, 0.0, sub, 3 * sub, 1e-30, 1.0, big, np.inf]
        some = rng.random(len(values)) < 0.6
        some[rng.integers(len(values))] = True
        row = rng.choice(np.array(values, dtype)[some], n)
    row[rng.random(n) < masked] = -np.inf
    if nan and n:
        row[rng.integers(n)] = np.nan
    thr, cut, kept = run_select_row(row, top_k)
    j = np.arange(n)
    chosen = (row > thr) | np.isnan(row) | ((row == thr) & (j <= cut))
    allowed = row > -np.inf
    expected = expected_selection(row, top_k)
    np.testing.assert_array_equal(chosen & (allowed | np.isnan(row)), expected)
    if kept is None:
        assert np.isnan(row).any() and cut == n
    else:
        np.testing.assert_array_equal(np.sort(kept), np.flatnonzero(expected))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, top_k", [(32, 2), (512, 64), (4096, 64), (1000, 1), (3000, 250)])
def test_select_row_edge_rows(dtype, n, top_k):
    # the bound's group maxima exactly the top_k; all equal; the maximum in the keys no
    # group holds (n % group); one allowed key; exactly top_k allowed
    rows = []
    r = np.zeros(n, dtype)
    r[3], r[n - 12] = 10.0, 9.0
    rows.append(r)
    rows.append(np.full(n, 7.0, dtype))
    r = np.zeros(n, dtype)
    r[-1] = 5.0  # the last key: outside every group when n is not a multiple of it
    rows.append(r)
    r = np.full(n, -np.inf, dtype)
    r[n // 2] = 1.0
    rows.append(r)
    r = np.full(n, -np.inf, dtype)
    r[:: n // top_k][:top_k] = 2.0
    rows.append(r)
    rows.append(np.arange(n, dtype=dtype)[::-1].copy())
    for row in rows:
        thr, cut, kept = run_select_row(row, top_k)
        np.testing.assert_array_equal(np.sort(kept), np.flatnonzero(expected_selection(row,
                                                                                        top_k)))


def test_kth_largest_buckets():
    # clustered values, ties across the bucket boundaries, a span that overflows
    from attnnb.cpu._topk_rows import BUCKETS, kth_largest

    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        big = np.finfo(dtype).max
        for a in (rng.standard_normal(300), np.r_[np.zeros(200), 1e-7 * rng.random(50)],
                  np.r_[-big, rng.integers(0, 3, 100), big], np.r_[np.full(64, 2.0), 1.0],
                  np.finfo(dtype).tiny * rng.integers(0, 4, 90) / 8,  # a subnormal span
                  rng.integers(0, 4, 257)):
            a = a.astype(dtype)
            for k in (1, 2, len(a) // 3, len(a) - 1, len(a)):
                got = from_jit(kth_largest)(a.copy(), len(a), k, a.min(), a.max(),
                                            np.empty(len(a), dtype), np.empty(len(a), np.int64),
                                            np.empty(BUCKETS, np.int64))
                assert got == np.sort(a)[::-1][k - 1], (k, dtype)


def integer_problem(rng, hq, hk, lq, lk, d, dtype, levels=2):
    q = rng.integers(-levels, levels + 1, (hq, lq, d)).astype(dtype)
    k = rng.integers(-levels, levels + 1, (hk, lk, d)).astype(dtype)
    v = rng.standard_normal((hk, lk, 6)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lq, lk, causal", [(130, 1100, False), (200, 700, True),
                                            (700, 200, True), (64, 4100, True)])
@pytest.mark.parametrize("top_k", [1, 7, 64, 150])
def test_long_rows_against_the_references(rng, dtype, lq, lk, causal, top_k):
    # rows long enough for the group bound and the gathered second pass; integer data, so
    # every logit is exact in both dtypes and ties are many; GQA, a mask with empty rows,
    # key sizes; compared with the loop reference and the reference backend
    q, k, v = integer_problem(rng, 4, 2, lq, lk, 3, dtype)
    mask = rng.random((4, lq, lk)) < 0.8
    mask[:, 5] = False
    key_size = rng.choice([1.0, 2.0, 4.0], size=lk)
    kw = dict(mask=mask, causal=causal, key_size=key_size, scale=1.0)
    out, lse = attnnb.topk_attention(q, k, v, top_k, return_lse=True, backend="cpu", **kw)
    ref, ref_lse = sorted_topk(q, k, v, top_k, mask, causal, key_size, 1.0)
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")
    out_r = attnnb.topk_attention(q, k, v, top_k, backend="reference", **kw)
    assert_close(out, out_r, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_rows_nan_inf_and_random_logits(rng, dtype):
    # random logits (no ties), -inf keys, a NaN key seen by some rows, huge logits
    lq, lk = 150, 1500
    q = rng.standard_normal((2, lq, 16)).astype(dtype) * 3
    k = rng.standard_normal((2, lk, 16)).astype(dtype) * 3
    v = rng.standard_normal((2, lk, 70)).astype(dtype)  # Dv not a multiple of 64
    k[1, 1400] = np.nan
    out = attnnb.topk_attention(q, k, v, 40, causal=True, backend="cpu")
    seen = np.arange(lq) + lk - lq >= 1400
    assert np.isnan(out[1, seen]).all()
    assert np.isfinite(out[1, ~seen]).all() and np.isfinite(out[0]).all()
    ref = attnnb.topk_attention(q, k, v, 40, causal=True, backend="reference")
    assert_close(out[:, ~seen], ref[:, ~seen], dtype)
    big = attnnb.topk_attention(q * 300, k[:1] * 300, v[:1], 40, backend="cpu")
    assert np.isfinite(big).all()
    if dtype == np.float64:  # float32 logits of 1e4-1e5 carry errors that reorder ranks
        assert_close(big, attnnb.topk_attention(q * 300, k[:1] * 300, v[:1], 40,
                                                backend="reference"), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("top_k", [1, 64])
def test_long_rows_gradients(rng, dtype, top_k):
    # the backward recomputes the forward's selection: gradients match the reference's
    q, k, v = integer_problem(rng, 4, 2, 100, 900, 3, dtype)
    key_size = rng.choice([1.0, 3.0], size=900).astype(dtype)
    kw = dict(causal=True, key_size=key_size, scale=1.0, return_lse=True)
    (out, lse), pull_c = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k, backend="cpu", **kw)
    _, pull_r = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k, backend="reference", **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(dtype)
    got, want = pull_c(dout, dlse), pull_r(dout, dlse)
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], dtype, rtol=GRAD_RTOL[dtype], what=name)


# ---------------------------------------------------------------------------
# the other normalizers over the kept keys


NORMALIZERS = ("softmax1", "relu_expm1", "sigmoid", "softpick")


def softmax_ranking(q, k, top_k, key_size=None, causal=False):
    """bool ``(B, Hq, Lq, Lk)``: the keys each row keeps, ranked by ``s + log key_size``
    decreasing, equal values by index (a lexicographic sort, row by row)."""
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    group = Hq // k.shape[1]
    s = np.einsum("bhid,bhjd->bhij", q, np.repeat(k, group, axis=1)) / np.sqrt(D)
    if key_size is not None:
        s = s + np.log(key_size)[:, None, None, :]
    keep = np.zeros(s.shape, bool)
    for b, h, i in np.ndindex(B, Hq, Lq):
        allowed = np.arange(Lk) <= i + Lk - Lq if causal else np.ones(Lk, bool)
        js = np.flatnonzero(allowed)
        order = np.lexsort((js, -s[b, h, i, js]))
        keep[b, h, i, js[order[:top_k]]] = True
    return keep


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("top_k", [3, 40])
def test_normalizers_weigh_the_keys_softmax_ranks(rng, backend, normalizer, top_k):
    """Every normalizer over the kept keys: attention with the softmax ranking's keys as
    its mask (sigmoid's default bias counts every key, kept or not)."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 33, 8), (2, 2, 70, 8), (2, 2, 70, 5)))
    key_size = rng.uniform(0.5, 2.0, (2, 70))
    kw = dict(normalizer=normalizer, key_size=key_size, return_lse=True)
    out, lse = attnnb.topk_attention(q, k, v, top_k, causal=True, backend=backend, **kw)
    keep = softmax_ranking(q, k, top_k, key_size, causal=True)
    want, want_lse = attnnb.attention(q, k, v, mask=keep, backend="reference", **kw)
    assert_close(out, want)
    assert_close(lse, want_lse, what="lse")


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalizers_cpu_equals_the_reference_with_gradients(rng, normalizer, dtype):
    q, k, v = (rng.standard_normal(s).astype(dtype)
               for s in ((1, 4, 70, 16), (1, 2, 131, 16), (1, 2, 131, 12)))
    kw = dict(normalizer=normalizer, causal=True, return_lse=True)
    (out, lse), pb = attnnb.vjp(attnnb.topk_attention, q, k, v, 9, backend="cpu", **kw)
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.topk_attention, q, k, v, 9,
                                        backend="reference", **kw)
    assert_close(out, ref, dtype)
    dout = rng.standard_normal(out.shape)
    dlse = np.where(np.isfinite(ref_lse), rng.standard_normal(ref_lse.shape), 0.0)
    got, want = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    for name in want:
        assert_close(got[name], want[name], rtol=GRAD_RTOL[dtype], what=name)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_normalizers_gradients_against_finite_differences(rng, backend, normalizer):
    from .helpers import assert_gradients_near_fd

    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 5, 3), (1, 1, 9, 3), (1, 1, 9, 2)))
    inputs = dict(q=2 * q, k=k, v=v, key_size=rng.uniform(0.5, 2.0, 9))
    assert_gradients_near_fd(attnnb.topk_attention, inputs, rng, lse=True, points=4,
                             top_k=4, normalizer=normalizer, causal=True, backend=backend)


def test_normalizers_refusals(rng):
    q = np.zeros((2, 5, 4))
    with pytest.raises(ValueError, match="normalizer"):
        attnnb.topk_attention(q, q, q, 2, normalizer="softermax")
    with pytest.raises(NotImplementedError, match="learned sigmoid_bias"):
        attnnb.vjp(attnnb.topk_attention, q, q, q, 2, normalizer="sigmoid",
                   sigmoid_bias=np.zeros(2))
    da = pytest.importorskip("dask.array")
    lazy = da.from_array(q)
    with pytest.raises(TypeError, match="sigmoid_bias must be a real number here"):
        attnnb.topk_attention(lazy, lazy, lazy, 2, normalizer="sigmoid",
                              sigmoid_bias=np.zeros(2))

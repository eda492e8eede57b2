"""sparse_attention: equal to attention(mask=pattern.to_mask()) on every host backend."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnnb
from attnnb import patterns as P

from .helpers import HOST_BACKENDS, assert_close, from_jit, qkv


def dense_with_mask(q, k, v, pattern, **kw):
    mask = pattern.to_mask()  # per head: (H, Lq, Lk) broadcasts against (*batch, H, Lq, Lk)
    return attnnb.attention(np.asarray(q, np.float64), k, v, mask=mask, backend="reference",
                            **kw)


def patterns_for(lq, lk, hq, rng):
    return {
        "local": P.local((lq, lk), 9),
        "local-causal-wide": P.local((lq, lk), 70, causal=True),
        "strided": P.strided((lq, lk), 5),
        "fixed": P.fixed((lq, lk), 16, 3, causal=False),
        "dilated": P.dilated((lq, lk), 6, 3),
        "longformer": P.longformer((lq, lk), 11, [0, lk // 2]),
        "random-per-head": P.from_mask(rng.random((hq, lq, lk)) < 0.2),
        "block-per-head": P.block_sparse(rng.random((hq, -(-lq // 64), -(-lk // 64))) < 0.6,
                                         64, shape=(lq, lk)),
        "empty": P.from_mask(np.zeros((lq, lk), bool)),
    }


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["local", "local-causal-wide", "strided", "fixed", "dilated",
                                  "longformer", "random-per-head", "block-per-head", "empty"])
def test_matches_masked_attention(rng, backend, dtype, name):
    # lengths not multiples of the 64-tiles, Lq != Lk, GQA, a batch axis
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=130, lk=150, d=16, dv=12, dtype=dtype)
    p = patterns_for(130, 150, 4, rng)[name]
    out, lse = attnnb.sparse_attention(q, k, v, p, return_lse=True, backend=backend)
    ref, ref_lse = dense_with_mask(q, k, v, p, return_lse=True)
    assert out.dtype == dtype and out.shape == (2, 4, 130, 12)
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("normalizer", ["softmax", "softmax1", "relu_expm1", "sigmoid", "softpick"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalizers_key_size_scale(rng, backend, normalizer, dtype):
    q, k, v = qkv(rng, hq=3, lq=77, lk=100, d=8, dtype=dtype, scale=2.0)
    key_size = rng.integers(1, 5, size=100).astype(np.float64)
    p = P.bigbird(100, 8, 1, 3, 2, seed=3) & P.local((100, 100), 30)
    p = P.from_mask(p.to_mask()[-77:])
    kw = dict(key_size=key_size, scale=0.3, normalizer=normalizer, return_lse=True)
    out, lse = attnnb.sparse_attention(q, k, v, p, backend=backend, **kw)
    ref, ref_lse = dense_with_mask(q, k, v, p, **kw)
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_two_dimensional_inputs_and_huge_logits(rng, backend):
    q, k, v = qkv(rng, hq=1, lq=90, lk=90, d=4, dtype=np.float32)
    q, k, v = q[0] * 100, k[0] * 100, v[0]  # logits ~1e4
    p = P.local(90, 4, causal=True)
    out = attnnb.sparse_attention(q, k, v, p, scale=1.0, backend=backend)
    ref = dense_with_mask(q, k, v, p, scale=1.0)
    assert out.shape == (90, 4) and np.isfinite(out).all()
    assert_close(out, ref, np.float32)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_renormalisation_example(backend):
    # weights 0.1, 0.5, 0.3, 0.1 over four tokens; keeping tokens 2 and 3 gives 0.625, 0.375
    w = np.array([0.1, 0.5, 0.3, 0.1])
    q = np.ones((1, 1))
    k = np.log(w)[:, None]
    v = np.eye(4)
    dense = attnnb.attention(q, k, v, scale=1.0, backend=backend)
    np.testing.assert_allclose(dense[0], w, rtol=1e-12)
    keep = P.from_mask(np.array([[False, True, True, False]]))
    out = attnnb.sparse_attention(q, k, v, keep, scale=1.0, backend=backend)
    np.testing.assert_allclose(out[0], [0.0, 0.625, 0.375, 0.0], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_sparse_weights_are_dense_weights_renormalised(rng, backend):
    lq, lk = 70, 80
    q, k, _ = qkv(rng, hq=1, lq=lq, lk=lk, d=8)
    v = np.eye(lk)[None]  # output rows are the weights
    p = P.dilated((lq, lk), 5, 2) | P.longformer((lq, lk), 0, [3])
    dense = attnnb.attention(q, k, v, backend="reference")[0]
    m = p.to_mask()
    expected = np.where(m, dense, 0.0)
    expected /= expected.sum(axis=1, keepdims=True)
    out = attnnb.sparse_attention(q, k, v, p, backend=backend)[0]
    assert_close(out, expected, np.float64)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_empty_rows_and_nan_outside_pattern(rng, backend):
    q, k, v = qkv(rng, hq=2, lq=70, lk=70, d=8, dtype=np.float32)
    m = P.local(70, 2).to_mask()
    m[5] = False  # empty row
    m[:, 40] = False
    k[:, 40] = np.nan  # a key no row may attend
    v[:, 40] = np.inf
    p = P.from_mask(m)
    out, lse = attnnb.sparse_attention(q, k, v, p, return_lse=True, backend=backend)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[:, 5], 0.0)
    assert np.all(lse[:, 5] == -np.inf)
    ref, ref_lse = dense_with_mask(q, k, v, p, return_lse=True)
    assert_close(out, ref, np.float32)
    assert_close(lse, ref_lse, np.float32, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_lse_combines_disjoint_patterns(rng, backend):
    q, k, v = qkv(rng, hq=2, lq=66, lk=97, d=8)
    a = P.local((66, 97), 10, causal=True)
    b = P.from_mask(~a.to_mask())
    oa, la = attnnb.sparse_attention(q, k, v, a, return_lse=True, backend=backend)
    ob, lb = attnnb.sparse_attention(q, k, v, b, return_lse=True, backend=backend)
    full, lf = attnnb.attention(q, k, v, return_lse=True, backend="reference")
    lse = np.logaddexp(la, lb)
    combined = (np.exp(la - lse)[..., None] * oa + np.exp(lb - lse)[..., None] * ob)
    assert_close(combined, full, np.float64, rtol=1e-11)
    assert_close(lse, lf, np.float64, rtol=1e-11)


def test_cpu_visits_only_pattern_tiles():
    # a window of 256 over 4096 keys: each query tile touches at most 10 of 64 key tiles
    p = P.local(4096, 256)
    lay = p.blocks(64, 64)
    per_tile = np.diff(lay.tile_ptr)
    assert per_tile.max() <= 10 and lay.n_kt == 64
    assert lay.tile_full.sum() >= 6 * lay.n_qt  # interior tiles need no element mask


def test_inputs_not_written(rng):
    q, k, v = qkv(rng, hq=2, lq=70, lk=70, d=8, dtype=np.float32)
    copies = [x.copy() for x in (q, k, v)]
    for x in (q, k, v):
        x.flags.writeable = False
    attnnb.sparse_attention(q, k[:, ::-1], v, P.local(70, 3), backend="cpu")
    for x, c in zip((q, k, v), copies, strict=True):
        np.testing.assert_array_equal(x, c)


def test_validation():
    q = np.zeros((2, 10, 4), np.float32)
    k = v = np.zeros((2, 12, 4), np.float32)
    with pytest.raises(TypeError, match="pattern must be"):
        attnnb.sparse_attention(q, k, v, np.ones((10, 12), bool))
    with pytest.raises(ValueError, match=r"\(Lq, Lk\) = \(10, 12\)"):
        attnnb.sparse_attention(q, k, v, P.local(10, 2))
    with pytest.raises(ValueError, match="heads"):
        attnnb.sparse_attention(q, k, v, P.from_mask(np.ones((3, 10, 12), bool)))
    with pytest.raises(ValueError, match="normalizer"):
        attnnb.sparse_attention(q, k, v, P.local((10, 12), 2), normalizer="sparsemax")
    with pytest.raises(TypeError, match="q"):
        attnnb.sparse_attention(q.astype(int), k, v, P.local((10, 12), 2))
    with pytest.raises(TypeError, match="return_lse"):
        attnnb.sparse_attention(q, k, v, P.local((10, 12), 2), return_lse=1)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(1, 140), lk=st.integers(1, 140),
       per_head=st.booleans(), density=st.floats(0.0, 1.0),
       normalizer=st.sampled_from(["softmax", "softmax1", "relu_expm1", "sigmoid",
                                          "softpick"]))
def test_property_cpu_equals_masked_reference(seed, lq, lk, per_head, density, normalizer):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, hq=2, hk=1, lq=lq, lk=lk, d=4, dtype=np.float32)
    # blocks of allowed pairs plus scattered ones: full, partial and absent tiles
    m = rng.random((2, lq, lk)) < density
    m |= P.block_sparse(rng.random((2, -(-lq // 64), -(-lk // 64))) < density, 64,
                        shape=(lq, lk)).to_mask()
    p = P.from_mask(m if per_head else m[0])
    out, lse = attnnb.sparse_attention(q, k, v, p, normalizer=normalizer, return_lse=True,
                                       backend="cpu")
    ref, ref_lse = dense_with_mask(q, k, v, p, normalizer=normalizer, return_lse=True)
    assert_close(out, ref, np.float32)
    assert_close(lse, ref_lse, np.float32, what="lse")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nq=st.integers(1, 9), nk=st.integers(1, 64),
       j0=st.integers(0, 40), density=st.floats(0.0, 1.0), band=st.booleans())
def test_csr_tile_mask_keeps_exactly_the_rows_keys(seed, nq, nk, j0, density, band):
    # every branch of the partial-tile mask: empty row, full row, one run, scattered keys
    from attnnb.cpu._sparse_tiles import csr_tile_mask

    rng = np.random.default_rng(seed)
    lk = j0 + nk + 20
    allowed = rng.random((nq, lk)) < density
    if band:  # one run per row, as a sliding window gives
        lo = rng.integers(0, lk, nq)
        hi = lo + rng.integers(0, lk, nq)
        allowed = (np.arange(lk) >= lo[:, None]) & (np.arange(lk) <= hi[:, None])
    p = P.from_mask(allowed)
    S = rng.standard_normal((nq, nk))
    before = S.copy()
    cursor = p.indptr[:-1].copy()  # each row's first stored key: no later than its first >= j0
    from_jit(csr_tile_mask)(S, p.indptr, p.indices, 0, j0, cursor)
    keep = allowed[:, j0 : j0 + nk]
    np.testing.assert_array_equal(S, np.where(keep, before, -np.inf))
    # the cursor now points past the row's keys below j0 + nk
    np.testing.assert_array_equal(cursor - p.indptr[:-1], allowed[:, : j0 + nk].sum(axis=1))

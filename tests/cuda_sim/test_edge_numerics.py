"""Edge numerics on the cuda backend against the float64 reference.

The rules (:mod:`attnnb.reference._common`): a NaN or ``+inf`` logit makes its
row NaN, a ``-inf`` one is a zero weight; tiny normalisers (``relu_expm1``
with tiny positive logits, ``softmax1`` with very negative ones) still give
the weighted mean; a value enters a row only through a nonzero weight.
"""

import numpy as np
import pytest

import attnnb
from attnnb import patterns as P

from ..helpers import assert_close, qkv
from .common import n

DTYPES = [np.float32, np.float64]
NORMALIZERS = ["softmax", "softmax1", "relu_expm1"]


def both(fn, *args, **kw):
    """``fn`` on cuda and on the reference, each with ``return_lse=True``."""
    return (fn(*args, return_lse=True, backend="cuda", **kw),
            fn(*args, return_lse=True, backend="reference", **kw))


def compare(got, want, dtype):
    (out, lse), (ref, ref_lse) = got, want
    assert isinstance(out, np.ndarray) and out.dtype == ref.dtype
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_inf_bias_makes_its_row_nan(rng, dtype, normalizer):
    lq, lk = n(5), n(10)
    q, k, v = qkv(rng, hq=2, hk=1, lq=lq, lk=lk, d=3, dtype=dtype)
    bias = rng.standard_normal((lq, lk))
    mask = np.ones((lq, lk), bool)
    bias[2, lk - 1] = np.inf  # allowed: row 2 is NaN
    bias[3, 1] = np.inf  # masked: row 3 never sees it
    mask[3, 1] = False
    got, want = both(attnnb.attention, q, k, v, bias=bias, mask=mask, normalizer=normalizer)
    compare(got, want, dtype)
    out, lse = got
    assert np.isnan(out[:, 2]).all() and np.isnan(lse[:, 2]).all()
    assert np.isfinite(np.delete(out, 2, axis=1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_key_reaches_rows_through_their_logits(rng, dtype):
    lq, lk = n(6), n(10)
    q, k, v = qkv(rng, hq=2, hk=1, lq=lq, lk=lk, d=3, dtype=dtype)
    q[..., 1] = np.where(np.abs(q[..., 1]) < 0.1, 0.5, q[..., 1])
    k[0, 4] = 0.0
    k[0, 4, 1] = np.inf  # logit +inf where q[i, 1] > 0, -inf where below
    plus = q[..., 1] > 0
    for normalizer in NORMALIZERS:
        got, want = both(attnnb.attention, q, k, v, normalizer=normalizer)
        compare(got, want, dtype)
        np.testing.assert_array_equal(np.isnan(got[1]), plus)
    pattern = P.local((lq, lk), 3)
    got, want = both(attnnb.sparse_attention, q, k, v, pattern, normalizer="relu_expm1")
    compare(got, want, dtype)
    np.testing.assert_array_equal(np.isnan(got[1]), plus & pattern.to_mask()[:, 4])
    got, want = both(attnnb.topk_attention, q, k, v, 2)
    compare(got, want, dtype)
    np.testing.assert_array_equal(np.isnan(got[1]), plus)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_expm1_tiny_logits(rng, dtype):
    """Every positive logit tiny (subnormal): the sum is below ``1 / finfo.max``."""
    lq, lk = n(5), n(10)
    if dtype == np.float32:  # exact logits: small integers times 2**-141
        q = rng.integers(0, 4, (2, lq, 4)).astype("f4") * np.float32(2.0**-70)
        k = rng.integers(0, 4, (1, lk, 4)).astype("f4") * np.float32(2.0**-70)
        scale = None
    else:  # exact logits: small integers times a subnormal scale
        q = rng.integers(0, 4, (2, lq, 4)).astype("f8")
        k = rng.integers(0, 4, (1, lk, 4)).astype("f8")
        scale = 2.2e-313
    q[1, 2] = 0.0  # an empty row
    v = rng.standard_normal((1, lk, 2)).astype(dtype)
    got, want = both(attnnb.attention, q, k, v, scale=scale, normalizer="relu_expm1")
    compare(got, want, dtype)
    assert np.isfinite(got[0]).all() and (want[1][np.isfinite(want[1])] < -85).all()
    got, want = both(attnnb.sparse_attention, q, k, v, P.local((lq, lk), 2), scale=scale,
                     normalizer="relu_expm1")
    compare(got, want, dtype)
    assert np.isfinite(got[0]).all()
    # the brief's reproduction: random tiny float32 inputs (their logits round as subnormals)
    r = np.random.default_rng(23)
    q = (abs(r.standard_normal((2, 3, 4))) * 1e-20).astype("f4")
    k = (abs(r.standard_normal((2, 5, 4))) * 1e-20).astype("f4")
    v = r.standard_normal((2, 5, 2)).astype("f4")
    got, want = both(attnnb.attention, q[:, None], k[:, None], v[:, None],
                     normalizer="relu_expm1")
    compare(got, want, np.float32)


def test_softmax1_tiny_normaliser(rng):
    """``1 + sum e^s`` is ``e^-m`` to rounding and ``e^m`` subnormal: the output is still
    a normal number with all its digits."""
    lk = n(300)
    q, k, v = qkv(rng, hq=1, lq=2, lk=lk, d=3, dtype=np.float32, scale=0.1)
    v = np.abs(v) * 1e3
    got, want = both(attnnb.attention, q, k, v, bias=np.full((2, lk), -95.0),
                     normalizer="softmax1")
    assert np.abs(want[0]).min() > 10 * np.finfo(np.float32).tiny
    compare(got, want, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["bias -1e4", "bias -inf", "relu_expm1 logit <= 0",
                                  "left padding", "masked"])
def test_zero_weight_values_never_reach_the_row(rng, dtype, case):
    lq, lk = n(5), n(11)
    q, k, v = qkv(rng, hq=2, hk=1, lq=lq, lk=lk, d=3, dtype=dtype)
    keys = np.zeros(lk, bool)
    keys[[1, 5, lk - 1]] = True
    kw = {}
    if case == "masked":
        kw["mask"] = ~keys
    elif case == "left padding":  # the first key tiles: the running max jumps past them
        keys[: lk // 2] = True
        kw["bias"] = np.where(keys, -1e4, 0.0)
    elif case == "relu_expm1 logit <= 0":
        kw["bias"] = np.where(keys, -50.0, 0.0)
        kw["normalizer"] = "relu_expm1"
    else:
        kw["bias"] = np.where(keys, -1e4 if case == "bias -1e4" else -np.inf, 0.0)
    clean = v.copy()
    clean[0, keys] = 0.0
    v[0, keys, 0] = np.inf
    v[0, keys, 1] = np.nan
    got = attnnb.attention(q, k, v, return_lse=True, backend="cuda", **kw)
    want = attnnb.attention(q, k, clean, return_lse=True, backend="reference", **kw)
    compare(got, want, dtype)
    compare(got, attnnb.attention(q, k, v, return_lse=True, backend="reference", **kw), dtype)


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
def test_zero_weight_and_bad_values_diff(rng, mode):
    lq, lk = n(5), n(11)
    q = rng.standard_normal((2, lq, 3)).astype(np.float32)
    k = rng.standard_normal((2, lk, 3)).astype(np.float32)
    v = rng.standard_normal((1, lk, 3)).astype(np.float32)
    keys = np.zeros(lk, bool)
    keys[: lk // 2] = True
    bias = np.where(keys, -1e4, 0.0)
    v[0, keys, 1] = np.nan  # behind underflowed weights
    v[0, lk - 1, 2] = np.inf  # attended: NaN (difference: inf - lam * inf) or +inf / clipped
    got = attnnb.diff_attention(q, k, v, 0.4, bias=bias, mode=mode, backend="cuda")
    want = attnnb.diff_attention(q, k, v, 0.4, bias=bias, mode=mode, backend="reference")
    assert_close(got, want, np.float32)
    assert np.isfinite(got[..., :2]).all()


def test_a_nan_row_has_a_nan_query_gradient(rng):
    """docs/contract.md §5.3 on cuda: a NaN row's own query gets a NaN gradient, for
    every normalizer, top-k and each differential mode; the other rows' stay finite."""
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=n(5), lk=n(9), d=4, dv=3,
                  dtype=np.float64)
    q[0, 0, 2, 1] = np.nan
    calls = [(attnnb.attention, (q, k, v), dict(normalizer=name)) for name in
             ("softmax", "softmax1", "relu_expm1", "sigmoid", "softpick")]
    calls.append((attnnb.topk_attention, (q, k, v, 3), {}))
    calls += [(attnnb.diff_attention, (q, np.concatenate([k, k], axis=1), v, 0.5),
               dict(mode=m)) for m in ("difference", "rectified", "heaviside")]
    for fn, args, kw in calls:
        out, pull = attnnb.vjp(fn, *args, backend="cuda", **kw)
        dq = pull(np.ones_like(out))["q"]
        assert np.isnan(dq[0, 0, 2]).all(), (fn.__name__, kw)
        rows = np.ones(dq.shape[:3], bool)
        rows[0, :, 2] = False
        assert np.isfinite(dq[rows]).all(), (fn.__name__, kw)

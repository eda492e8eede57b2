"""Edge numerics on the host backends: infinite logits, tiny normalisers, zero weights.

The rules are written down in :mod:`attnnb.reference._common`:

* a NaN or ``+inf`` logit on an allowed key makes its row NaN (output and LSE),
  as PyTorch's softmax does; a ``-inf`` logit is a weight of exactly zero;
* a row's normaliser may be tiny (``relu_expm1`` with tiny positive logits,
  ``softmax1`` with very negative ones) and the output is still the weighted
  mean of §1, the LSE the log of the (tiny) sum;
* a value enters a row only through a nonzero weight: keys outside the
  allowed set, with a ``-inf`` logit, ``relu_expm1``'s logits ``<= 0`` and
  weights that underflow never affect the row, even when their value is NaN
  or Inf; a nonzero weight carries a non-finite value into its columns.
"""

import numpy as np
import pytest

import attnnb
from attnnb import patterns as P

from .helpers import HOST_BACKENDS, assert_close, qkv

DTYPES = [np.float32, np.float64]
NORMALIZERS = ["softmax", "softmax1", "relu_expm1"]


def packed(rng, lq=70, lk=130, d=4, dv=3, dtype=np.float32):
    """``diff_attention`` inputs for one head pair: q ``(2, lq, d)``, k ``(2, lk, d)``,
    v ``(1, lk, dv)``."""
    return (rng.standard_normal((2, lq, d)).astype(dtype),
            rng.standard_normal((2, lk, d)).astype(dtype),
            rng.standard_normal((1, lk, dv)).astype(dtype))


# ---------------------------------------------------------------- +inf logits


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_inf_bias_makes_its_row_nan(rng, backend, dtype, normalizer):
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=70, lk=130, d=4, dtype=dtype)
    bias = rng.standard_normal((70, 130)).astype(dtype)
    mask = np.ones((70, 130), bool)
    bias[5, 129] = np.inf  # allowed: row 5 is NaN
    bias[9, 3] = np.inf  # masked: row 9 never sees it
    mask[9, 3] = False
    out, lse = attnnb.attention(q, k, v, bias=bias, mask=mask, normalizer=normalizer,
                                return_lse=True, backend=backend)
    assert np.isnan(out[..., 5, :]).all() and np.isnan(lse[..., 5]).all()
    clean = bias.copy()
    clean[5, 129] = clean[9, 3] = 0.0
    want, want_lse = attnnb.attention(q, k, v, bias=clean, mask=mask, normalizer=normalizer,
                                      return_lse=True, backend="reference")
    rows = np.arange(70) != 5
    assert_close(out[..., rows, :], want[..., rows, :], dtype)
    assert_close(lse[..., rows], want_lse[..., rows], dtype, what="lse")


def inf_key(rng, dtype):
    """Inputs whose key 20 holds ``+inf`` in one component (the others 0): the logit of
    query ``i`` for it is ``+inf`` where ``q[i, 1] > 0`` and ``-inf`` where it is below."""
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=70, lk=130, d=4, dtype=dtype)
    q[..., 1] = np.where(np.abs(q[..., 1]) < 0.1, 0.5, q[..., 1])  # no zero: 0 * inf
    k[0, 0, 20] = 0.0
    k[0, 0, 20, 1] = np.inf
    return q, k, v, q[0, :, :, 1] > 0  # the rows (per query head) whose logit is +inf


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_inf_key_reaches_rows_through_their_logits(rng, backend, dtype, normalizer):
    q, k, v, plus = inf_key(rng, dtype)
    out, lse = attnnb.attention(q, k, v, normalizer=normalizer, return_lse=True,
                                backend=backend)
    np.testing.assert_array_equal(np.isnan(out[0]).all(-1), plus)
    np.testing.assert_array_equal(np.isnan(lse[0]), plus)
    # a -inf logit is a zero weight: as if key 20 were masked out
    mask = np.ones((70, 130), bool)
    mask[:, 20] = False
    want, want_lse = attnnb.attention(q, k, v, mask=mask, normalizer=normalizer,
                                      return_lse=True, backend="reference")
    assert_close(out[0][~plus], want[0][~plus], dtype)
    assert_close(lse[0][~plus], want_lse[0][~plus], dtype, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_key_sparse_and_topk(rng, backend, dtype):
    q, k, v, plus = inf_key(rng, dtype)
    pattern = P.local((70, 130), 40)
    sees = pattern.to_mask()[:, 20]
    for normalizer in ("softmax", "relu_expm1"):
        out, lse = attnnb.sparse_attention(q, k, v, pattern, normalizer=normalizer,
                                           return_lse=True, backend=backend)
        np.testing.assert_array_equal(np.isnan(out[0]).all(-1), plus & sees)
        np.testing.assert_array_equal(np.isnan(lse[0]), plus & sees)
        want, want_lse = attnnb.attention(q, k, v, mask=pattern.to_mask() & (
            np.arange(130) != 20), normalizer=normalizer, return_lse=True, backend="reference")
        ok = ~(plus & sees)
        assert_close(out[0][ok], want[0][ok], dtype)
        assert_close(lse[0][ok], want_lse[0][ok], dtype, what="lse")
    for top_k in (3, 100):  # the gathering and the sweeping second pass on the cpu
        out, lse = attnnb.topk_attention(q, k, v, top_k, return_lse=True, backend=backend)
        np.testing.assert_array_equal(np.isnan(out[0]).all(-1), plus)
        np.testing.assert_array_equal(np.isnan(lse[0]), plus)
        want, want_lse = attnnb.topk_attention(q, k, v, top_k, mask=np.arange(130) != 20,
                                               return_lse=True, backend="reference")
        assert_close(out[0][~plus], want[0][~plus], dtype)
        assert_close(lse[0][~plus], want_lse[0][~plus], dtype, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", ["difference", "rectified"])
def test_inf_bias_diff(rng, backend, mode):
    q, k, v = packed(rng)
    bias = rng.standard_normal((70, 130)).astype(np.float32)
    bias[7, 100] = np.inf
    out = attnnb.diff_attention(q, k, v, 0.4, bias=bias, mode=mode, backend=backend)
    bad = np.zeros(out.shape[:-1], bool)
    bad[0, 7] = True
    np.testing.assert_array_equal(np.isnan(out).all(-1), bad)
    clean = bias.copy()
    clean[7, 100] = 0.0
    want = attnnb.diff_attention(q, k, v, 0.4, bias=clean, mode=mode, backend="reference")
    assert_close(out[~bad], want[~bad], np.float32)


# ---------------------------------------------------------------- tiny normalisers


def relu_expm1_formula(q, k, v, scale, mask=None):
    """``max(0, e^s - 1)``-weighted mean of ``v`` and its log normaliser, in float64,
    written out directly; ``q, k, v`` are ``(H, L, D)`` (``k, v`` one head each)."""
    s = scale * np.einsum("hid,jd->hij", q.astype(np.float64), k.astype(np.float64)[0])
    phi = np.maximum(0.0, np.expm1(s))
    if mask is not None:
        phi = np.where(mask, phi, 0.0)
    z = phi.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(z > 0, phi / np.where(z > 0, z, 1.0), 0.0) @ v.astype(np.float64)[0]
        return out, np.log(z[..., 0])


def tiny_relu_problems(dtype):
    """``(q, k, v, scale)`` whose positive logits are all tiny: their normaliser is below
    ``1 / finfo(dtype).max``, which takes subnormal logits.  Besides the random float32
    case (whose logits carry the rounding of subnormals, ~1e-5), small integers scaled
    so that every logit is exact."""
    r = np.random.default_rng(23)
    if dtype == np.float32:
        q = (abs(r.standard_normal((2, 3, 4))) * 1e-20).astype("f4")
        k = (abs(r.standard_normal((2, 5, 4))) * 1e-20).astype("f4")
        v = r.standard_normal((2, 5, 2)).astype("f4")
        yield q[:, None], k[:, None], v[:, None], None
        # several tiles, GQA, a zero row (every logit 0: an empty row); small integers
        # times 2**-70, so that the subnormal logits (multiples of 2**-141) are exact
        q = r.integers(0, 4, (1, 2, 70, 4)).astype("f4") * np.float32(2.0**-70)
        q[0, 1, 3] = 0.0
        yield (q, r.integers(0, 4, (1, 1, 130, 4)).astype("f4") * np.float32(2.0**-70),
               r.standard_normal((1, 1, 130, 3)).astype("f4"), None)
    else:
        yield (r.integers(0, 4, (1, 3, 4)).astype("f8")[None],
               r.integers(0, 4, (1, 5, 4)).astype("f8")[None],
               r.standard_normal((1, 1, 5, 2)), 2.2e-313)
        yield (r.integers(0, 4, (1, 2, 70, 4)).astype("f8"),
               r.integers(0, 4, (1, 1, 130, 4)).astype("f8"),
               r.standard_normal((1, 1, 130, 3)), 2.2e-313)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_expm1_tiny_logits(backend, dtype):
    for q, k, v, scale in tiny_relu_problems(dtype):
        sc = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        pattern = P.local((q.shape[-2], k.shape[-2]), 2)
        for mask in (None, pattern.to_mask()):
            if mask is None:
                out, lse = attnnb.attention(q, k, v, scale=scale, normalizer="relu_expm1",
                                            return_lse=True, backend=backend)
            else:
                out, lse = attnnb.sparse_attention(q, k, v, pattern, scale=scale,
                                                   normalizer="relu_expm1", return_lse=True,
                                                   backend=backend)
            for b in range(q.shape[0]):
                want, want_lse = relu_expm1_formula(q[b], k[b], v[b], sc, mask)
                assert np.isfinite(out[b]).all()
                assert_close(out[b], want, dtype)
                assert_close(lse[b], want_lse, dtype, what="lse")
                assert (want_lse[np.isfinite(want_lse)] < -85).all()  # the sums are tiny


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["flat", "lazy"])
def test_softmax1_tiny_normaliser(rng, backend, dtype, layout):
    """Every logit so negative that ``1 + sum e^s`` is ``e^-m`` to rounding (``e^-m``
    overflows, ``e^m`` is subnormal), with values large enough that the output is a
    normal number: it must neither flush to zero nor lose its digits.  "lazy": the
    second key tile is within the cpu's lazy-rescaling margin of the first, so the
    running sum is large (~1e5) against a shift below the largest logit."""
    q, k, v = qkv(rng, batch=(1,), hq=1, lq=5, lk=128, d=4, dtype=dtype, scale=0.1)
    v = np.abs(v) * 1e4
    low = -95.0 if dtype == np.float32 else -712.0
    bias = np.full((5, 128), low)
    if layout == "lazy":
        bias[:, 64:] = low + 7
    out, lse = attnnb.attention(q, k, v, bias=bias, normalizer="softmax1", return_lse=True,
                                backend=backend)
    s = np.einsum("hid,hjd->hij", q[0].astype(np.float64), k[0].astype(np.float64)) / 2
    e = np.exp(s + bias)
    want = (e / (1 + e.sum(-1, keepdims=True))) @ v[0].astype(np.float64)
    assert np.abs(want).min() > 10 * np.finfo(dtype).tiny  # a normal number
    assert_close(out[0], want, dtype)
    assert_close(lse[0], np.log(e.sum(-1)), dtype, what="lse")


# ---------------------------------------------------------------- zero weights, bad values

ZERO_WEIGHT_CASES = ["masked", "bias -1e4", "bias -inf", "relu_expm1 logit <= 0",
                     "left padding"]


def zero_weight_problem(rng, dtype, case, bad):
    """``(q, k, v, kwargs, keys)``: ``keys`` have weight exactly 0 in every row (or are
    masked) and hold ``bad`` values."""
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=70, lk=130, d=4, dtype=dtype)
    keys = np.zeros(130, bool)
    keys[[3, 64, 100, 129]] = True
    kw = {}
    if case == "masked":
        kw["mask"] = np.broadcast_to(~keys, (70, 130))
    elif case.startswith("bias"):
        kw["bias"] = np.where(keys, -1e4 if case == "bias -1e4" else -np.inf, 0.0)
    elif case == "left padding":  # a whole first key tile: the running max jumps past it
        keys[:64] = True
        kw["bias"] = np.where(keys, -1e4, 0.0)
    else:
        kw["normalizer"] = "relu_expm1"
        kw["bias"] = np.where(keys, -50.0, 0.0)  # logits <= 0: phi = 0
    v[0, 0, keys, 1] = bad
    v[0, 0, keys & (np.arange(130) % 2 == 0), 0] = -bad  # a few more
    return q, k, v, kw, keys


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ZERO_WEIGHT_CASES)
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_zero_weight_values_never_reach_the_row(rng, backend, dtype, case, bad):
    q, k, v, kw, keys = zero_weight_problem(rng, dtype, case, bad)
    out, lse = attnnb.attention(q, k, v, return_lse=True, backend=backend, **kw)
    clean = v.copy()
    clean[0, 0, keys] = 0.0
    want, want_lse = attnnb.attention(q, k, clean, return_lse=True, backend="reference", **kw)
    assert np.isfinite(want).all()
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_weight_values_sparse_and_topk(rng, backend, dtype):
    q, k, v, _, keys = zero_weight_problem(rng, dtype, "relu_expm1 logit <= 0", np.nan)
    # sparse, relu_expm1: keys inside the pattern whose logits are all <= 0, and key 10,
    # outside every row's pattern
    q = np.abs(q)
    k[0, 0, keys] = -np.abs(k[0, 0, keys])
    v[0, 0, 10] = np.inf
    clean = v.copy()
    clean[0, 0, keys] = clean[0, 0, 10] = 0.0
    pattern = P.local((70, 130), 30) | P.from_mask(np.broadcast_to(keys, (70, 130)))
    assert not pattern.to_mask()[:, 10].any()
    out, lse = attnnb.sparse_attention(q, k, v, pattern, normalizer="relu_expm1",
                                       return_lse=True, backend=backend)
    want, want_lse = attnnb.attention(q, k, clean, mask=pattern.to_mask(),
                                      normalizer="relu_expm1", return_lse=True,
                                      backend="reference")
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, dtype, what="lse")
    # top-k: kept keys whose weight underflows (logits below -5e3), and keys that lost the
    # selection; 16 of 130 keys gathers the kept values on the cpu, 130 sweeps the tiles
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=70, lk=130, d=4, dtype=dtype)
    sign = np.sign(q[0, 0, 0, 0])
    q[..., 0] = (np.abs(q[..., 0]) + 1) * sign
    k[0, 0, keys] = 0.0
    k[0, 0, keys, 0] = -1e4 * sign
    clean = v.copy()
    clean[0, 0, keys] = 0.0
    v[0, 0, keys] = np.nan
    mask = keys | ((np.arange(130) >= 5) & (np.arange(130) < 10))
    for top_k, kw in ((3, {}), (16, {"mask": mask}), (130, {})):
        out, lse = attnnb.topk_attention(q, k, v, top_k, return_lse=True, backend=backend,
                                         **kw)
        want, want_lse = attnnb.topk_attention(q, k, clean, top_k, return_lse=True,
                                               backend="reference", **kw)
        assert np.isfinite(want).all()
        assert_close(out, want, dtype)
        assert_close(lse, want_lse, dtype, what="lse")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("mode", ["difference", "rectified"])
@pytest.mark.parametrize("case", ["bias -1e4", "left padding"])
def test_zero_weight_values_diff(rng, backend, mode, case):
    q, k, v = packed(rng)
    keys = np.zeros(130, bool)
    keys[[3, 64, 100, 129]] = True
    if case == "left padding":
        keys[:64] = True
    bias = np.where(keys, -1e4, 0.0)
    clean = v.copy()
    clean[0, keys] = 0.0
    v[0, keys, 1] = np.nan
    v[0, keys, 2] = np.inf
    out = attnnb.diff_attention(q, k, v, 0.4, bias=bias, mode=mode, backend=backend)
    want = attnnb.diff_attention(q, k, clean, 0.4, bias=bias, mode=mode, backend="reference")
    assert np.isfinite(want).all()
    assert_close(out, want, np.float32)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonzero_weight_carries_a_bad_value(rng, backend, dtype):
    """The other side of the rule: a small but nonzero weight is not dropped."""
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=70, lk=130, d=4, dtype=dtype)
    bias = np.zeros((70, 130))
    bias[:, 10] = -20.0  # weight ~1e-9: small, far from underflow
    v[0, 0, 10, 1] = np.inf
    v[0, 0, 10, 2] = np.nan
    out = attnnb.attention(q, k, v, bias=bias, backend=backend)
    assert np.isposinf(out[..., 1]).all() and np.isnan(out[..., 2]).all()
    assert np.isfinite(out[..., [0, 3]]).all()
    # the differential map: o1 - lam * o2 with both maps attending key 10
    q2, k2, v2 = packed(rng, dtype=dtype)
    v2[0, 10, 1] = np.inf
    out = attnnb.diff_attention(q2, k2, v2, 0.4, backend=backend)
    assert np.isnan(out[..., 1]).all() and np.isfinite(out[..., [0, 2]]).all()
    # rectified: +inf where the clipped weight of key 10 is positive, untouched where it is 0
    out = attnnb.diff_attention(q2, k2, v2, 0.4, mode="rectified", backend=backend)
    clean = v2.copy()
    clean[0, 10, 1] = 0.0
    want = attnnb.diff_attention(q2, k2, clean, 0.4, mode="rectified", backend="reference")
    clipped = np.isfinite(out[..., 1])
    assert np.isposinf(out[..., 1][~clipped]).all() and clipped.any() and not clipped.all()
    assert_close(out[clipped], want[clipped], dtype)
    assert_close(out[..., [0, 2]], want[..., [0, 2]], dtype)


# ------------------------------------------- non-finite values at a tile's edges


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq", [1, 20])  # tiles transposed per task (decoding), or filled first
@pytest.mark.parametrize("key, column", [(0, 0), (63, 8), (64, 0), (127, 8), (149, 8)])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_a_value_at_a_tile_edge_behind_a_zero_weight(rng, dtype, lq, key, column, value):
    """The finiteness check of a value tile covers every element of it: the first and
    last of a full 64-key tile, and the last of the partial last one (150 keys).  A
    value there behind a zero weight (a masked key) leaves no trace; allowed, it fills
    its column with NaN or Inf as the reference does."""
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=lq, lk=150, d=8, dv=9, dtype=dtype)
    v[0, 0, key, column] = value
    mask = np.ones((lq, 150), bool)
    mask[:, key] = False
    out = attnnb.attention(q, k, v, mask=mask, backend="cpu")
    want = attnnb.attention(q, k, v, mask=mask, backend="reference")
    assert np.isfinite(out).all()
    assert_close(out, want, dtype)
    seen = attnnb.attention(q, k, v, backend="cpu")
    assert not np.isfinite(seen[..., column]).any()
    assert np.isfinite(np.delete(seen, column, axis=-1)).all()
    assert_close(seen, attnnb.attention(q, k, v, backend="reference"), dtype)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_row_has_a_nan_query_gradient(rng, backend, dtype):
    """docs/contract.md §5.3: a NaN row's own query gets a NaN gradient, for every
    normalizer, top-k and each differential mode; the other rows' stay finite."""
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=5, lk=70, d=4, dv=3, dtype=dtype)
    q[0, 0, 2, 1] = np.nan
    calls = [(attnnb.attention, (), dict(normalizer=n)) for n in
             ("softmax", "softmax1", "relu_expm1", "sigmoid", "softpick")]
    calls.append((attnnb.topk_attention, (3,), {}))
    calls += [(attnnb.diff_attention, (0.5,), dict(mode=m))
              for m in ("difference", "rectified", "heaviside")]
    for fn, extra, kw in calls:
        args = (q, k, v) + extra
        if fn is attnnb.diff_attention:  # one pair: the NaN is in its first map
            args = (q, np.concatenate([k, k], axis=1), v) + extra
        out, pull = attnnb.vjp(fn, *args, backend=backend, **kw)
        dq = pull(np.ones_like(out))["q"]
        what = f"{fn.__name__} {kw}"
        assert np.isnan(dq[0, 0, 2]).all(), what
        rows = np.ones(dq.shape[:3], bool)
        rows[0, :, 2] = False  # (the pair's second map shares the NaN row's output)
        assert np.isfinite(dq[rows]).all(), what

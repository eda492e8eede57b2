"""Property tests (hypothesis) for the invariants of docs/contract.md §1 on every host backend."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import attnnb
from attnnb._front.validate import attention_problem
from attnnb.reference.attention import attention_weights

from .helpers import HOST_BACKENDS, RTOL, assert_close

PROPERTY = settings(max_examples=20, deadline=None, derandomize=True)
dtypes = st.sampled_from([np.float32, np.float64])
backends = st.sampled_from(HOST_BACKENDS)
normalizers = st.sampled_from(["softmax", "softmax1", "relu_expm1"])


def random_qkv(seed, hq, hk, lq, lk, d, dtype):
    rng = np.random.default_rng(seed)
    return rng, tuple(rng.standard_normal(s).astype(dtype)
                      for s in ((hq, lq, d), (hk, lk, d), (hk, lk, d + 1)))


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(1, 70), lk=st.integers(1, 40),
       dup=st.integers(2, 5), causal=st.booleans(), normalizer=normalizers, dtype=dtypes,
       backend=backends)
def test_duplicate_keys_equal_key_size(seed, lq, lk, dup, causal, normalizer, dtype, backend):
    """``n`` copies of a key == that key once with ``key_size = n``."""
    rng, (q, k, v) = random_qkv(seed, 2, 1, lq, lk, 4, dtype)
    j = int(rng.integers(lk))
    # the copies sit right after key j, so causal visibility is unchanged for j's copies
    # when the key set is read back with sizes: drop them and give j size dup + 1
    k_dup = np.insert(k, [j] * dup, k[:, j:j + 1], axis=1)
    v_dup = np.insert(v, [j] * dup, v[:, j:j + 1], axis=1)
    size = np.ones(lk)
    size[j] = dup + 1
    bias_cols = rng.standard_normal(lk)  # a per-key bias, copied with the key
    bias = np.broadcast_to(bias_cols, (lq, lk))
    bias_dup = np.broadcast_to(np.insert(bias_cols, [j] * dup, bias_cols[j]), (lq, lk + dup))
    if causal:
        # causal on the long key axis must not split the copies: mask by key position
        pos = np.insert(np.arange(lk), [j] * dup, j)
        allowed = pos[None, :] <= np.arange(lq)[:, None] + lk - lq
        mask_dup, mask = allowed, allowed[:, np.r_[:j + 1, j + 1 + dup:lk + dup]]
    else:
        mask_dup = mask = None
    want = attnnb.attention(q, k_dup, v_dup, bias=bias_dup, mask=mask_dup,
                            normalizer=normalizer, backend=backend, return_lse=True)
    got = attnnb.attention(q, k, v, bias=bias, mask=mask, key_size=size,
                           normalizer=normalizer, backend=backend, return_lse=True)
    rtol = 4 * RTOL[np.dtype(dtype)]
    assert_close(got[0], want[0], rtol=rtol)
    assert_close(got[1], want[1], rtol=rtol, what="lse")


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(1, 40), lk=st.integers(1, 70),
       density=st.floats(0.05, 1.0), causal=st.booleans(),
       normalizer=st.sampled_from(["softmax", "relu_expm1"]), dtype=dtypes, backend=backends)
def test_masked_weights_are_renormalised_dense_weights(seed, lq, lk, density, causal,
                                                       normalizer, dtype, backend):
    """Weights over an allowed set == dense weights restricted to it and renormalised."""
    rng, (q, k, v) = random_qkv(seed, 2, 2, lq, lk, 4, dtype)
    mask = rng.random((lq, lk)) < density
    key_size = rng.random(lk) + 0.5
    dense, _, _ = attention_weights(attention_problem(q, k, v, key_size=key_size,
                                                      normalizer=normalizer))
    masked, _, allowed = attention_weights(attention_problem(
        q, k, v, mask=mask, causal=causal, key_size=key_size, normalizer=normalizer))
    kept = dense * allowed
    mass = kept.sum(-1, keepdims=True)
    renorm = np.where(mass > 0, kept / np.where(mass > 0, mass, 1), 0.0)
    np.testing.assert_allclose(masked, renorm, rtol=1e-10, atol=1e-12)
    # and the backend's output is those weights applied to v
    out = attnnb.attention(q, k, v, mask=mask, causal=causal, key_size=key_size,
                           normalizer=normalizer, backend=backend)
    assert_close(out, (renorm @ v.astype(np.float64))[0], dtype)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(1, 40), lk=st.integers(1, 90),
       parts=st.integers(2, 4), causal=st.booleans(), dtype=dtypes, backend=backends)
def test_lse_merges_disjoint_key_splits(seed, lq, lk, parts, causal, dtype, backend):
    """softmax results over a partition of the keys combine exactly through their LSEs."""
    rng, (q, k, v) = random_qkv(seed, 3, 1, lq, lk, 8, dtype)
    mask = rng.random((lq, lk)) < 0.8
    want, want_lse = attnnb.attention(q, k, v, mask=mask, causal=causal, return_lse=True,
                                      backend=backend)
    label = rng.integers(parts, size=lk)  # key j goes to part label[j]
    outs, lses = [], []
    for p in range(parts):
        o, s = attnnb.attention(q, k, v, mask=mask & (label == p), causal=causal,
                                return_lse=True, backend=backend)
        outs.append(o.astype(np.float64))
        lses.append(s.astype(np.float64))
    lse = np.logaddexp.reduce(np.stack(lses), axis=0)
    with np.errstate(invalid="ignore"):  # -inf - -inf on rows empty everywhere
        weights = [np.where(np.isneginf(s), 0.0, np.exp(s - lse)) for s in lses]
    out = sum(w[..., None] * o for w, o in zip(weights, outs, strict=True))
    rtol = 8 * RTOL[np.dtype(dtype)]
    assert_close(out, want, rtol=rtol)
    assert_close(lse, want_lse, rtol=rtol, what="lse")


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(1, 40), lk=st.integers(1, 70),
       normalizer=normalizers, causal=st.booleans(), dtype=dtypes, backend=backends)
def test_output_in_convex_hull_of_values(seed, lq, lk, normalizer, causal, dtype, backend):
    """softmax/relu_expm1 rows are convex combinations of the allowed values
    (softmax1's of the values and 0)."""
    rng, (q, k, v) = random_qkv(seed, 2, 2, lq, lk, 4, dtype)
    q *= 3
    out = attnnb.attention(q, k, v, causal=causal, normalizer=normalizer, backend=backend)
    allowed = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq if causal else lk)
    eps = 4 * np.finfo(dtype).eps * np.abs(v).max()
    for h in range(2):
        for i in range(lq):
            vals = v[h, allowed[i]]
            if normalizer == "softmax1" or not len(vals):
                vals = np.vstack([vals, np.zeros((1, v.shape[-1]), dtype)])
            if normalizer == "relu_expm1" and not out[h, i].any():
                continue  # every logit <= 0: an empty row
            assert (out[h, i] >= vals.min(0) - eps).all()
            assert (out[h, i] <= vals.max(0) + eps).all()


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), lq=st.integers(1, 40), lk=st.integers(1, 70),
       density=st.floats(0.0, 1.0), dtype=dtypes, backend=backends)
def test_softmax1_is_softmax_times_sigmoid_of_lse(seed, lq, lk, density, dtype, backend):
    """softmax1 = softmax * e^lse / (1 + e^lse) with the same lse: never larger."""
    rng, (q, k, v) = random_qkv(seed, 2, 1, lq, lk, 4, dtype)
    mask = rng.random((lq, lk)) < density
    o0, l0 = attnnb.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
    o1, l1 = attnnb.attention(q, k, v, mask=mask, normalizer="softmax1", return_lse=True,
                              backend=backend)
    rtol = 4 * RTOL[np.dtype(dtype)]
    assert_close(l1, l0, rtol=rtol, what="lse")
    gate = np.exp(-np.logaddexp(0.0, -l0.astype(np.float64)))  # e^l / (1 + e^l), stable
    assert_close(o1, o0 * gate[..., None], rtol=rtol)
    assert (np.abs(o1) <= np.abs(o0) * (1 + rtol) + rtol).all()


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), lk=st.integers(1, 70), d=st.integers(2, 8),
       dtype=dtypes, backend=backends)
def test_relu_expm1_ignores_keys_with_nonpositive_logits(seed, lk, d, dtype, backend):
    """Keys whose logit is <= 0 (here: exactly 0 or negative) get exactly zero weight."""
    rng = np.random.default_rng(seed)
    q = np.zeros((1, 1, d), dtype)
    q[..., 0] = 2.0
    k = rng.standard_normal((1, lk, d)).astype(dtype)
    sign = rng.integers(-1, 2, lk)  # -1: negative logit, 0: exactly zero, 1: positive
    sign[0] = 1
    k[0, :, 0] = sign * (np.abs(k[0, :, 0]) + 0.1)
    v = rng.standard_normal((1, lk, 3)).astype(dtype)
    w, _, _ = attention_weights(attention_problem(q, k, v, normalizer="relu_expm1"))
    assert (w[0, 0, 0, sign <= 0] == 0).all() and (w[0, 0, 0, sign > 0] > 0).all()
    out = attnnb.attention(q, k, v, normalizer="relu_expm1", backend=backend)
    keep = sign > 0
    want = attnnb.attention(q, k[:, keep], v[:, keep], normalizer="relu_expm1",
                            backend="reference")
    assert_close(out, want, dtype)
    v2 = v.copy()
    v2[:, ~keep] = 1e3  # changing ignored values changes nothing
    assert_close(attnnb.attention(q, k, v2, normalizer="relu_expm1", backend=backend), want,
                 dtype)

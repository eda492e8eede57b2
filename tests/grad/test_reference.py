"""The float64 reference gradients (docs/contract.md §5) against finite differences.

Every gradient that ``attnnb.vjp`` gives on the ``reference`` backend is
compared with central differences of the reference forward, for every
option of §1-§2; then hypothesis checks invariants that tie the gradients of
different problems together (lam = 0, merged duplicate keys, key-disjoint
parts combined through their LSEs).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnnb
from attnnb import patterns

REF = "reference"
STEP = 1e-6
TOL = 1e-7  # relative to the largest entry of the finite-difference gradient


# ---------------------------------------------------------------------------
# finite differences


def _loss(result, dout, dlse):
    """``sum(out * dout) + sum(lse * dlse)``; empty rows' ``-inf`` LSEs count as 0."""
    if dlse is None:
        return float(np.sum(result * dout))
    out, lse = result
    return float(np.sum(out * dout) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * dlse))


def numeric_gradient(f, x, step=STEP):
    """Fourth-order central differences of the scalar ``f`` at the float64 array ``x``.

    The five-point stencil's truncation error (``step**4``) stays far below
    the tolerance even where the second-order one's (``step**2`` times the
    third derivative) does not: ``relu_expm1`` rows whose ``S`` is tiny have
    gradients of ~1e3 and third derivatives far larger.
    """
    x = np.array(x, dtype=np.float64)
    g = np.zeros_like(x)

    def at(index, delta):
        y = x.copy()
        y[index] += delta
        return f(y)

    for index in np.ndindex(x.shape):
        g[index] = (8 * (at(index, step) - at(index, -step))
                    - (at(index, 2 * step) - at(index, -2 * step))) / (12 * step)
    return g


def check_gradients(fn, args, kwargs, wrt, rng, lse=True, tol=TOL):
    """Compare ``vjp(fn, *args, **kwargs)``'s gradients with finite differences.

    ``args`` is a list of ``(name, value)`` for the positional arguments,
    ``kwargs`` the keyword ones; ``wrt`` the names whose gradients are
    checked (every other key of the gradient dict must be absent from
    ``wrt`` only because it is not differentiable here).  Returns the dict.
    """
    names = [n for n, _ in args]
    values = dict(args) | dict(kwargs)
    fixed = {"backend": REF, "return_lse": True} if lse else {"backend": REF}

    def call(**over):
        vals = values | over
        return fn(*[vals[n] for n in names], **{n: vals[n] for n in kwargs}, **fixed)

    result, pullback = attnnb.vjp(fn, *[v for _, v in args], **kwargs, **fixed)
    out = result[0] if lse else result
    dout = rng.standard_normal(out.shape)
    dlse = rng.standard_normal(result[1].shape) if lse else None
    grads = pullback(dout, dlse) if lse else pullback(dout)
    for name in wrt:
        num = numeric_gradient(lambda x, name=name: _loss(call(**{name: x}), dout, dlse),
                               values[name])
        got = grads[name]
        assert got.shape == np.shape(values[name]), name
        assert np.all(np.isfinite(got)), name
        scale = max(np.abs(num).max(), 1e-3)
        err = np.abs(got - num).max() / scale
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    return grads


def qkv(rng, batch=(1,), hq=2, hk=None, lq=4, lk=5, d=3, dv=2):
    hk = hq if hk is None else hk
    return (rng.standard_normal(batch + (hq, lq, d)),
            rng.standard_normal(batch + (hk, lk, d)),
            rng.standard_normal(batch + (hk, lk, dv)))


NORMALIZERS = ("softmax", "softmax1", "relu_expm1", "sigmoid", "softpick")


# ---------------------------------------------------------------------------
# dense attention


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("lse", [False, True])
def test_plain(rng, normalizer, lse):
    q, k, v = qkv(rng, batch=(2,))
    check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                    {"normalizer": normalizer}, ("q", "k", "v"), rng, lse=lse)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("bias_shape", [(), (5,), (4, 5), (2, 1, 1, 5), (1, 2, 4, 1),
                                        (2, 2, 4, 5)])
def test_bias_broadcast(rng, normalizer, bias_shape):
    q, k, v = qkv(rng, batch=(2,))
    bias = rng.standard_normal(bias_shape)
    grads = check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                            {"bias": bias, "normalizer": normalizer},
                            ("q", "k", "v", "bias"), rng)
    assert grads["bias"].shape == bias_shape


@pytest.mark.parametrize("mask_shape", [(5,), (4, 5), (2, 1, 4, 5), (2, 4, 5)])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_mask_broadcast(rng, mask_shape, normalizer):
    q, k, v = qkv(rng, batch=(2,))
    mask = rng.random(mask_shape) < 0.7
    mask[..., 0] = True  # no empty row here (they have tests of their own below)
    check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                    {"mask": mask, "bias": rng.standard_normal((4, 5)),
                     "normalizer": normalizer}, ("q", "k", "v", "bias"), rng)


@pytest.mark.parametrize("lq, lk", [(3, 6), (6, 3), (5, 5)])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_causal_rectangular(rng, lq, lk, normalizer):
    # Lq > Lk leaves the first Lq - Lk rows with no key: they must contribute nothing
    q, k, v = qkv(rng, lq=lq, lk=lk)
    check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                    {"causal": True, "normalizer": normalizer,
                     "bias": rng.standard_normal((lq, lk))}, ("q", "k", "v", "bias"), rng)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_grouped_query(rng, normalizer):
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=3, lk=4, d=2)
    check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                    {"normalizer": normalizer, "bias": rng.standard_normal((4, 3, 4)),
                     "causal": True}, ("q", "k", "v", "bias"), rng)


@pytest.mark.parametrize("size_shape", [(), (5,), (2, 5), (2, 5, 1)])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_key_sizes(rng, size_shape, normalizer):
    q, k, v = qkv(rng, batch=(2,))
    size = rng.uniform(0.5, 3.0, size_shape)
    grads = check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                            {"key_size": size, "normalizer": normalizer},
                            ("q", "k", "v", "key_size"), rng)
    assert grads["key_size"].shape == size_shape


def test_multi_axis_batch_and_two_dimensional(rng):
    q, k, v = qkv(rng, batch=(2, 3), hq=1, lq=3, lk=4, d=2, dv=2)
    check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                    {"bias": rng.standard_normal((3, 1, 3, 4)),
                     "key_size": rng.uniform(0.5, 2, (2, 3, 4, 1))},
                    ("q", "k", "v", "bias", "key_size"), rng)
    q2, k2, v2 = q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]
    check_gradients(attnnb.attention, [("q", q2), ("k", k2), ("v", v2)],
                    {"bias": rng.standard_normal((4,)), "key_size": rng.uniform(0.5, 2, 4),
                     "causal": True}, ("q", "k", "v", "bias", "key_size"), rng)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_everything_at_once(rng, normalizer):
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=4, lk=6, d=2, dv=3)
    mask = rng.random((2, 1, 4, 6)) < 0.8
    check_gradients(attnnb.attention, [("q", q), ("k", k), ("v", v)],
                    {"mask": mask, "bias": rng.standard_normal((1, 4, 1, 6)),
                     "key_size": rng.uniform(0.5, 3, (2, 6, 1)), "causal": True,
                     "scale": 0.7, "normalizer": normalizer},
                    ("q", "k", "v", "bias", "key_size"), rng)


# ---------------------------------------------------------------------------
# sparse and top-k


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_pattern(rng, normalizer, per_head):
    q, k, v = qkv(rng, batch=(2,), hq=2, hk=1, lq=6, lk=6)
    if per_head:
        pattern = patterns.from_mask(rng.random((2, 6, 6)) < 0.5)
    else:
        pattern = patterns.local(6, 1, causal=True) | patterns.longformer(6, 0, [0])
    check_gradients(attnnb.sparse_attention, [("q", q), ("k", k), ("v", v),
                                              ("pattern", pattern)],
                    {"normalizer": normalizer, "key_size": rng.uniform(0.5, 2, (2, 6))},
                    ("q", "k", "v", "key_size"), rng)


def test_sparse_equals_masked_attention(rng):
    q, k, v = qkv(rng, lq=6, lk=6)
    pattern = patterns.from_mask(rng.random((2, 6, 6)) < 0.5)
    _, pb = attnnb.vjp(attnnb.sparse_attention, q, k, v, pattern, backend=REF)
    out, pb_dense = attnnb.vjp(attnnb.attention, q, k, v, mask=pattern.to_mask(), backend=REF)
    dout = rng.standard_normal(out.shape)
    for name, g in pb(dout).items():
        np.testing.assert_allclose(g, pb_dense(dout)[name], rtol=0, atol=1e-14)


def _untied_keys(rng, lq, lk, d, batch=(1,), hq=2, log_size=0.0):
    """q, k whose ranked logits (``+ log_size``) are >= 1e-2 apart in every row.

    A finite-difference step then never changes which keys top-k keeps.
    """
    while True:
        q, k, v = qkv(rng, batch=batch, hq=hq, lq=lq, lk=lk, d=d)
        s = np.sort(q @ np.swapaxes(k, -1, -2) / np.sqrt(d) + log_size, axis=-1)
        if np.diff(s, axis=-1).min() > 1e-2:
            return q, k, v


@pytest.mark.parametrize("top_k", [1, 2, 4, 9])
def test_topk(rng, top_k):
    q, k, v = _untied_keys(rng, 4, 6, 3)
    check_gradients(attnnb.topk_attention, [("q", q), ("k", k), ("v", v), ("top_k", top_k)],
                    {}, ("q", "k", "v"), rng)


def test_topk_with_mask_causal_and_sizes(rng):
    size = rng.uniform(0.5, 3.0, 6)
    q, k, v = _untied_keys(rng, 4, 6, 3, batch=(2,), log_size=np.log(size))
    mask = rng.random((4, 6)) < 0.8
    check_gradients(attnnb.topk_attention, [("q", q), ("k", k), ("v", v), ("top_k", 2)],
                    {"mask": mask, "causal": True, "key_size": size},
                    ("q", "k", "v", "key_size"), rng)


def test_topk_selection_is_constant(rng):
    """Top-k's gradient is masked attention's over the keys the forward kept."""
    q, k, v = _untied_keys(rng, 4, 6, 3)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(3)
    kept = s >= np.sort(s, axis=-1)[..., -2:-1]  # the 2 largest of every row
    out, pb = attnnb.vjp(attnnb.topk_attention, q, k, v, 2, backend=REF)
    _, pb_dense = attnnb.vjp(attnnb.attention, q, k, v, mask=kept, backend=REF)
    dout = rng.standard_normal(out.shape)
    for name, g in pb(dout).items():
        np.testing.assert_allclose(g, pb_dense(dout)[name], rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------
# differential attention


def diff_qkv(rng, batch=(2,), h=2, hk=1, lq=4, lk=5, d=2, dv=3):
    return (rng.standard_normal(batch + (2 * h, lq, d)),
            rng.standard_normal(batch + (2 * hk, lk, d)),
            rng.standard_normal(batch + (hk, lk, dv)))


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
@pytest.mark.parametrize("lam_shape", [None, (2, 1), (2, 2, 4)])
def test_diff(rng, mode, lam_shape):
    q, k, v = diff_qkv(rng)
    lam = 0.6 if lam_shape is None else rng.uniform(0.2, 0.9, lam_shape)
    grads = check_gradients(attnnb.diff_attention, [("q", q), ("k", k), ("v", v),
                                                    ("lam", lam)],
                            {"bias": rng.standard_normal((4, 5)),
                             "key_size": rng.uniform(0.5, 2, (2, 5, 1)), "causal": True,
                             "mask": rng.random((2, 1, 4, 5)) < 0.8, "mode": mode},
                            ("q", "k", "v", "lam", "bias", "key_size"), rng, lse=False)
    assert grads["lam"].shape == np.shape(lam)
    assert isinstance(grads["lam"], np.ndarray)


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
def test_diff_grouped_query_no_options(rng, mode):
    q, k, v = diff_qkv(rng, batch=(1,), h=4, hk=2, lq=3, lk=4)
    check_gradients(attnnb.diff_attention, [("q", q), ("k", k), ("v", v), ("lam", 0.4)],
                    {"mode": mode}, ("q", "k", "v", "lam"), rng, lse=False)


# ---------------------------------------------------------------------------
# empty rows, extreme logits, non-finite inputs


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_empty_rows_give_zeros(rng, normalizer):
    q, k, v = qkv(rng)
    mask = np.ones((4, 5), bool)
    mask[1] = False  # row 1 has no key
    bias = rng.standard_normal((4, 5))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, mask=mask, bias=bias,
                                key_size=rng.uniform(0.5, 2, 5), normalizer=normalizer,
                                return_lse=True, backend=REF)
    grads = pb(rng.standard_normal(out.shape), rng.standard_normal(lse.shape))
    for name, g in grads.items():
        assert np.all(np.isfinite(g)), name
    assert np.all(grads["q"][:, :, 1] == 0)
    assert np.all(grads["bias"][1] == 0)
    # everything empty: all gradients are zero
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, mask=np.zeros(5, bool),
                                bias=bias, key_size=np.ones(5), normalizer=normalizer,
                                return_lse=True, backend=REF)
    for name, g in pb(np.ones(out.shape), np.ones(lse.shape)).items():
        assert np.all(g == 0), name


def test_relu_row_with_no_positive_logit_is_empty(rng):
    q, k, v = qkv(rng)
    bias = np.zeros((4, 5))
    bias[2] = -50.0  # Z == 0 for row 2: every logit <= 0
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, normalizer="relu_expm1",
                         backend=REF)
    grads = pb(rng.standard_normal(out.shape))
    assert np.all(grads["q"][:, :, 2] == 0) and np.all(grads["bias"][2] == 0)
    assert all(np.all(np.isfinite(g)) for g in grads.values())


def test_empty_rows_in_topk_and_diff(rng):
    q, k, v = qkv(rng)
    out, pb = attnnb.vjp(attnnb.topk_attention, q, k, v, 0, backend=REF)
    for g in pb(np.ones(out.shape)).values():
        assert np.all(g == 0)
    q, k, v = diff_qkv(rng)
    mask = np.ones((4, 5), bool)
    mask[0] = False
    for mode in ("difference", "rectified"):
        out, pb = attnnb.vjp(attnnb.diff_attention, q, k, v, np.full((2, 2, 4), 0.5),
                             mask=mask, mode=mode, bias=np.zeros((4, 5)), backend=REF)
        grads = pb(np.ones(out.shape))
        assert all(np.all(np.isfinite(g)) for g in grads.values())
        assert np.all(grads["q"][:, :, 0] == 0) and np.all(grads["lam"][:, :, 0] == 0)
        assert np.all(grads["bias"][0] == 0)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_huge_logits_stay_finite(rng, normalizer, offset):
    q, k, v = qkv(rng)
    bias = rng.standard_normal((4, 5))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, bias=bias + offset,
                                normalizer=normalizer, return_lse=True, backend=REF)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    grads = pb(dout, dlse)
    for name, g in grads.items():
        assert np.all(np.isfinite(g)), name
    if normalizer == "softmax" or (offset > 0 and normalizer != "sigmoid"):
        # a constant shift leaves softmax's weights unchanged (and its LSE shifted); far
        # above 0 the others are softmax to rounding (e^s - 1 = e^s, 1 + S = S), except
        # sigmoid, whose weights saturate at 1 each
        _, pb0 = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, return_lse=True,
                            backend=REF)
        for name, g in pb0(dout, dlse).items():
            np.testing.assert_allclose(grads[name], g, rtol=0, atol=1e-8, err_msg=name)
    # large positive logits through topk and diff too
    out, pb = attnnb.vjp(attnnb.topk_attention, q, k, v, 2, key_size=np.full(5, 2.0),
                         backend=REF)
    assert all(np.all(np.isfinite(g)) for g in pb(np.ones(out.shape)).values())
    dq, dk, dv = diff_qkv(rng)
    out, pb = attnnb.vjp(attnnb.diff_attention, dq, dk, dv, 0.5,
                         bias=np.full((4, 5), offset), mode="rectified", backend=REF)
    assert all(np.all(np.isfinite(g)) for g in pb(np.ones(out.shape)).values())


def test_nan_key_outside_every_allowed_set_is_harmless(rng):
    q, k, v = qkv(rng)
    mask = np.ones(5, bool)
    mask[3] = False
    clean = [x.copy() for x in (k, v)]
    k[..., 3, :] = np.nan
    v[..., 3, :] = np.nan
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, mask=mask, bias=np.zeros(5), backend=REF)
    _, pb_clean = attnnb.vjp(attnnb.attention, q, *clean, mask=mask, bias=np.zeros(5),
                             backend=REF)
    dout = rng.standard_normal(out.shape)
    for name, g in pb(dout).items():
        np.testing.assert_allclose(g, pb_clean(dout)[name], rtol=0, atol=1e-14, err_msg=name)


def test_nan_query_reaches_only_what_its_row_read(rng):
    q, k, v = qkv(rng, hq=2, lq=4, lk=5)
    q[0, 1, 2, 0] = np.nan  # head 1, row 2; with causal it sees keys 0..3
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, causal=True, bias=np.zeros((2, 4, 5)),
                         backend=REF)
    grads = pb(np.ones(out.shape))
    nan_q = np.isnan(grads["q"])
    assert nan_q[0, 1, 2].all() and nan_q.sum() == q.shape[-1]
    assert np.isnan(grads["k"][0, 1, :4]).all() and np.isfinite(grads["k"][0, 1, 4]).all()
    assert np.isfinite(grads["k"][0, 0]).all() and np.isfinite(grads["v"][0, 0]).all()
    assert np.isnan(grads["bias"][1, 2, :4]).all()
    assert np.isfinite(np.delete(grads["bias"][1], 2, axis=0)).all()


# ---------------------------------------------------------------------------
# properties


SETTINGS = settings(max_examples=20, deadline=None)


def _draw_arrays(data, shape):
    seed = data.draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).standard_normal(shape)


@SETTINGS
@given(data=st.data(), h=st.integers(1, 2), g=st.sampled_from([1, 2]),
       lq=st.integers(1, 5), lk=st.integers(1, 5), causal=st.booleans())
def test_lam_zero_is_attention_on_the_first_map(data, h, g, lq, lk, causal):
    hk = h if g == 1 else 1
    if h % hk:
        return
    q = _draw_arrays(data, (2 * h, lq, 3))
    k = _draw_arrays(data, (2 * hk, lk, 3))
    v = _draw_arrays(data, (hk, lk, 2))
    out, pb = attnnb.vjp(attnnb.diff_attention, q, k, v, 0.0, causal=causal, backend=REF)
    dout = _draw_arrays(data, out.shape)
    grads = pb(dout)
    att, pb_att = attnnb.vjp(attnnb.attention, q[0::2], k[0::2], v, causal=causal,
                             backend=REF)
    expect = pb_att(dout)
    np.testing.assert_allclose(grads["q"][0::2], expect["q"], atol=1e-12)
    np.testing.assert_allclose(grads["k"][0::2], expect["k"], atol=1e-12)
    np.testing.assert_allclose(grads["v"], expect["v"], atol=1e-12)
    assert np.all(grads["q"][1::2] == 0) and np.all(grads["k"][1::2] == 0)
    # dlam = -dout . o2, with o2 the second map's attention
    o2 = attnnb.attention(q[1::2], k[1::2], v, causal=causal, backend=REF)
    np.testing.assert_allclose(grads["lam"], -np.sum(dout * o2), atol=1e-12)


@SETTINGS
@given(data=st.data(), counts=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       normalizer=st.sampled_from(NORMALIZERS), lq=st.integers(1, 4))
def test_merged_duplicates_give_summed_gradients(data, counts, normalizer, lq):
    """Merging n duplicates into a key of size n: its gradient is their gradients' sum."""
    q = _draw_arrays(data, (2, lq, 3))
    k = _draw_arrays(data, (2, len(counts), 3))
    v = _draw_arrays(data, (2, len(counts), 2))
    owner = np.repeat(np.arange(len(counts)), counts)
    kw = dict(normalizer=normalizer, return_lse=True, backend=REF)
    if normalizer == "sigmoid":  # one bias for both (the default follows the key count)
        kw["sigmoid_bias"] = -1.0
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k[:, owner], v[:, owner], **kw)
    (out_m, lse_m), pb_m = attnnb.vjp(attnnb.attention, q, k, v,
                                      key_size=np.array(counts, float), **kw)
    np.testing.assert_allclose(out_m, out, atol=1e-12)
    dout, dlse = _draw_arrays(data, out.shape), _draw_arrays(data, lse.shape)
    full, merged = pb(dout, dlse), pb_m(dout, dlse)
    np.testing.assert_allclose(merged["q"], full["q"], atol=1e-11)
    for name in ("k", "v"):
        summed = np.zeros_like(merged[name])
        np.add.at(summed, (slice(None), owner), full[name])
        np.testing.assert_allclose(merged[name], summed, atol=1e-11)


@SETTINGS
@given(data=st.data(), lk=st.integers(2, 6), lq=st.integers(1, 4),
       normalizer=st.sampled_from(["softmax", "relu_expm1"]), causal=st.booleans())
def test_key_disjoint_parts_combined_through_lse(data, lk, lq, normalizer, causal):
    """The gradient of a combination of key-disjoint parts is the whole problem's.

    ``out = sum_p a_p out_p`` and ``lse = logsumexp_p lse_p`` with ``a_p =
    exp(lse_p - lse)``; by the chain rule part ``p`` receives ``a_p dout``
    and ``a_p (dlse + dout . (out_p - out))``.
    """
    split = data.draw(st.integers(1, lk - 1))
    q = _draw_arrays(data, (1, lq, 2))
    k = _draw_arrays(data, (1, lk, 2))
    v = _draw_arrays(data, (1, lk, 3))
    bias = _draw_arrays(data, (lq, lk))
    mask = np.tril(np.ones((lq, lk), bool), lk - lq) if causal else np.ones((lq, lk), bool)
    kw = dict(normalizer=normalizer, return_lse=True, backend=REF)
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, mask=mask, **kw)
    dout, dlse = _draw_arrays(data, out.shape), _draw_arrays(data, lse.shape)
    whole = pb(dout, dlse)
    parts = [slice(0, split), slice(split, lk)]
    results = [attnnb.vjp(attnnb.attention, q, k[:, p], v[:, p], bias=bias[:, p],
                          mask=mask[:, p], **kw) for p in parts]
    with np.errstate(invalid="ignore"):
        weights = [np.where(np.isfinite(lse), np.exp(r[0][1] - lse), 0.0) for r in results]
    dq = np.zeros_like(q)
    dk, dv, dbias = np.zeros_like(k), np.zeros_like(v), np.zeros_like(bias)
    for p, ((out_p, _), pb_p), a in zip(parts, results, weights):
        g = pb_p(a[..., None] * dout, a * (dlse + np.sum(dout * (out_p - out), axis=-1)))
        dq += g["q"]
        dk[:, p], dv[:, p], dbias[:, p] = g["k"], g["v"], g["bias"]
    for name, got in (("q", dq), ("k", dk), ("v", dv), ("bias", dbias)):
        np.testing.assert_allclose(got, whole[name], atol=1e-10, err_msg=name)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_heaviside_second_map_gets_no_gradient(rng, backend):
    """The gate is held fixed: the second components' queries and keys get zeros, and
    d lam is minus the gated keys' share of dP (docs/contract.md §2.4)."""
    q, k, v = diff_qkv(rng, batch=(1,), h=2, hk=1, lq=6, lk=7)
    out, pullback = attnnb.vjp(attnnb.diff_attention, q, k, v, 0.3, mode="heaviside",
                               causal=True, backend=backend)
    grads = pullback(rng.standard_normal(out.shape))
    assert not grads["q"][:, 1::2].any() and not grads["k"][:, 1::2].any()
    assert grads["q"][:, 0::2].any() and grads["k"][:, 0::2].any()

"""The normalizers without softmax's row sum over exponentials (docs/contract.md §1.5).

* ``sigmoid``: ``w = key_size * sigmoid(s + b)``, no normalisation (Ramapuram et al.);
* ``softpick``: ``w = c relu(e^s - 1) / (sum_k c |e^s_k - 1| + eps)`` (Zuhri et al.).

Against materialised formulas, cpu against the reference (forward, LSE, every
gradient), gradients against finite differences, parts over disjoint keys (they add
for sigmoid, merge through their LSEs for softpick), and each one's edges.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnnb
from attnnb._core.codes import SOFTPICK_EPS

from .helpers import assert_gradients_near_fd

BACKENDS = ("reference", "cpu")
NORMALIZERS = ("sigmoid", "softpick")


def _qkv(rng, B=2, Hq=4, Hk=2, Lq=70, Lk=75, D=8, Dv=5, dtype=np.float64, scale=1.0):
    return (scale * rng.standard_normal((B, Hq, Lq, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, Dv)).astype(dtype))


def _formula(normalizer, q, k, v, *, mask=None, bias=None, key_size=None, causal=False,
             sigmoid_bias=None):
    """The definition written out in float64 (moderate logits: no shift needed);
    returns ``(out, lse)``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    Lq, Lk = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    c = 1.0 if key_size is None else np.asarray(key_size, np.float64)[:, None, None, :]
    allowed = np.ones(s.shape, bool)
    if mask is not None:
        allowed &= mask
    if causal:
        allowed &= np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + Lk - Lq
    if normalizer == "sigmoid":
        b = -math.log(Lk) if sigmoid_bias is None else sigmoid_bias
        w = np.where(allowed, c / (1.0 + np.exp(-(s + b))), 0.0)
        total = w.sum(-1)
    else:
        num = np.where(allowed, c * np.maximum(np.expm1(s), 0.0), 0.0)
        total = np.where(allowed, c * np.abs(np.expm1(s)), 0.0).sum(-1)
        w = num / (total[..., None] + SOFTPICK_EPS)
    with np.errstate(divide="ignore"):
        return w @ v, np.log(total)


CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "mask, bias, key sizes": dict(mask="mask", bias="bias", key_size="sizes"),
}


def _arguments(rng, spec, Lq=70, Lk=75):
    made = {"mask": rng.random((2, 1, Lq, Lk)) < 0.6, "bias": rng.standard_normal((Lq, Lk)),
            "sizes": rng.uniform(0.5, 3.0, (2, Lk))}
    return {n: made.get(x, x) if isinstance(x, str) else x for n, x in spec.items()}


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_against_the_formula(normalizer, backend, case):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    kw = _arguments(rng, CASES[case])
    if normalizer == "sigmoid" and case == "causal":
        kw["sigmoid_bias"] = 0.7
    out, lse = attnnb.attention(q, k, v, normalizer=normalizer, return_lse=True,
                                backend=backend, **kw)
    ref, ref_lse = _formula(normalizer, q, k, v, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-13)  # lse may be near 0


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("shape", ["several tiles, GQA", "decoding rows", "one sweep",
                                   "one head, Lq > Lk"])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_cpu_equals_the_reference(normalizer, shape, dtype, rtol):
    """Forward, LSE and every gradient (the LSE's cotangent and key sizes included),
    with dropout and a mask."""
    rng = np.random.default_rng(2)
    dims = {"several tiles, GQA": dict(B=2, Hq=4, Hk=2, Lq=150, Lk=140),
            "decoding rows": dict(B=1, Hq=8, Hk=2, Lq=3, Lk=700),
            "one sweep": dict(B=4, Hq=4, Hk=2, Lq=70, Lk=66),
            "one head, Lq > Lk": dict(B=1, Hq=1, Hk=1, Lq=90, Lk=30)}[shape]
    q, k, v = _qkv(rng, dtype=dtype, scale=2.0, **dims)
    Lq, Lk = dims["Lq"], dims["Lk"]
    kw = dict(normalizer=normalizer, causal=True, return_lse=True, dropout_p=0.2, seed=4,
              mask=rng.random((Lq, Lk)) < 0.8,
              bias=rng.standard_normal((Lq, Lk)).astype(dtype),
              key_size=rng.uniform(0.5, 2.0, Lk).astype(dtype))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
    as64 = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype != bool else x)
            for n, x in kw.items()}
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.attention, *(x.astype(np.float64)
                                                          for x in (q, k, v)),
                                        backend="reference", **as64)
    np.testing.assert_allclose(out, ref, rtol=0, atol=rtol * np.abs(ref).max())
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=rtol, atol=rtol)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    dlse = np.where(np.isfinite(ref_lse), dlse, 0.0)
    g, r = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=0,
                                   atol=rtol * np.abs(r[name]).max(), err_msg=name)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_against_finite_differences(normalizer, backend):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=1, Lq=5, Lk=7, D=3, Dv=2, scale=2.0)
    inputs = dict(q=q, k=k, v=v, bias=rng.standard_normal((5, 7)),
                  key_size=rng.uniform(0.5, 2.0, 7))
    assert_gradients_near_fd(attnnb.attention, inputs, rng, lse=True, points=5,
                             normalizer=normalizer, causal=True, backend=backend)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_edges(normalizer, backend):
    """Empty rows and rows of zero logits (zeros, -inf), +-1e4 logits (finite: sigmoid's
    weights saturate at the key sizes), a NaN logit (its row NaN, the others not)."""
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=2, Lq=6, Lk=9)
    mask = np.ones((6, 9), bool)
    mask[2] = False
    bias = np.zeros((6, 9))
    bias[3, :4], bias[3, 4:] = 1e4, -1e4
    q[0, 1, 4, 0] = np.nan
    kw = dict(mask=mask, bias=bias, normalizer=normalizer, return_lse=True)
    out, lse = attnnb.attention(q, k, v, backend=backend, **kw)
    ref, ref_lse = attnnb.attention(q, k, v, backend="reference", **kw)
    assert not out[:, :, 2].any() and np.isneginf(lse[:, :, 2]).all()
    np.testing.assert_allclose(out[0, :, 3], ref[0, :, 3], rtol=1e-12)
    np.testing.assert_allclose(lse[0, :, 3], ref_lse[0, :, 3], rtol=1e-12)
    assert np.isfinite(out[0, :, 3]).all() and np.isfinite(lse[0, :, 3]).all()
    if normalizer == "sigmoid":
        np.testing.assert_allclose(out[0, :, 3], v[0, :, :4].sum(1), rtol=1e-12)
    assert np.isnan(out[0, 1, 4]).all() and np.isnan(lse[0, 1, 4])
    assert np.isfinite(np.delete(out[0, 1], [2, 4], 0)).all()
    if normalizer == "softpick":  # every logit 0: no weight at all
        zero = attnnb.attention(np.zeros_like(q), k, v, normalizer="softpick",
                                return_lse=True, backend=backend)
        assert not zero[0].any() and np.isneginf(zero[1]).all()


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_merged_key_weighs_what_its_copies_weigh(normalizer, backend):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=2, Lq=6, Lk=9)
    sizes = np.ones(9)
    sizes[0] = 2
    merged = attnnb.attention(q, k, v, key_size=sizes, normalizer=normalizer,
                              backend=backend)
    twice = attnnb.attention(q, np.concatenate([k[:, :, :1], k], 2),
                             np.concatenate([v[:, :, :1], v], 2), normalizer=normalizer,
                             sigmoid_bias=-math.log(9) if normalizer == "sigmoid" else None,
                             backend=backend)
    np.testing.assert_allclose(merged, twice, rtol=1e-12)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_parts_over_disjoint_keys_merge(normalizer):
    """combine(normalizer=...) and Dask's key blocks: sigmoid's parts add (the outputs,
    and the weights by logaddexp; every part with the whole call's default bias),
    softpick's merge as softmax1's (its eps a sink of logit log eps)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, Lq=40, Lk=48)
    whole, whole_lse = attnnb.attention(q, k, v, normalizer=normalizer, return_lse=True)
    b = {"sigmoid_bias": -math.log(48)} if normalizer == "sigmoid" else {}
    parts = [attnnb.attention(q, k[:, :, a:z], v[:, :, a:z], normalizer=normalizer,
                              return_lse=True, **b) for a, z in ((0, 20), (20, 48))]
    out, lse = attnnb.combine([p[0] for p in parts], [p[1] for p in parts],
                              normalizer=normalizer)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12)
    lazy = [da.from_array(x, chunks=(1, 2, 16, x.shape[-1])) for x in (q, k, v)]
    out, lse = attnnb.attention(*lazy, normalizer=normalizer, causal=True, return_lse=True)
    ref, ref_lse = attnnb.attention(q, k, v, normalizer=normalizer, causal=True,
                                    return_lse=True, backend="reference")
    np.testing.assert_allclose(out.compute(), ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse.compute(), ref_lse, rtol=1e-12)


# ---------------------------------------------------------------------------
# sigmoid


def test_sigmoid_bias_refusals_name_the_argument():
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="sigmoid_bias belongs to normalizer='sigmoid'"):
        attnnb.attention(q, q, q, sigmoid_bias=0.5)
    with pytest.raises(ValueError, match=r"sigmoid_bias of shape \(3,\) cannot be broadcast"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sigmoid_bias=np.zeros(3))
    with pytest.raises(TypeError, match="sigmoid_bias must be a real number or a real array"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sigmoid_bias=np.zeros(2, complex))
    with pytest.raises(ValueError, match="sigmoid_bias must be finite"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sigmoid_bias=np.array([0, np.nan]))
    with pytest.raises(ValueError, match="sigmoid_bias must be finite"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sigmoid_bias=np.inf)
    with pytest.raises(ValueError, match="normalizer='softmax'"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sinks=np.zeros(2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2,), (3, 1), (3, 2)])
def test_a_learned_sigmoid_bias_is_each_heads_own(backend, shape):
    """An array ``sigmoid_bias`` (broadcastable to ``(*batch, Hq)``) is one ``b`` per
    query head: the same as each head computed alone with its number."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, B=3, Hq=2, Hk=1, Lq=6, Lk=9)
    sb = rng.standard_normal(shape)
    bias = rng.standard_normal((6, 9))
    out, lse = attnnb.attention(q, k, v, bias=bias, normalizer="sigmoid", sigmoid_bias=sb,
                                return_lse=True, backend=backend)
    per_head = np.broadcast_to(sb, (3, 2))
    for b in range(3):
        for h in range(2):
            o, lo = attnnb.attention(q[b, h], k[b, 0], v[b, 0], bias=bias, normalizer="sigmoid",
                                     sigmoid_bias=per_head[b, h], return_lse=True,
                                     backend=backend)
            np.testing.assert_allclose(out[b, h], o, rtol=1e-12)
            np.testing.assert_allclose(lse[b, h], lo, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2,), (1, 2), (1, 1)])
def test_a_learned_sigmoid_bias_gradient(backend, shape):
    """``attnnb.vjp`` gives an array ``sigmoid_bias`` a gradient (the bias gradient summed
    over each head's logits), with and without a bias of its own and key sizes."""
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=1, Lq=5, Lk=7, D=3, Dv=2, scale=2.0)
    inputs = dict(q=q, k=k, v=v, sigmoid_bias=rng.standard_normal(shape))
    assert_gradients_near_fd(attnnb.attention, inputs, rng, lse=True, points=3,
                             normalizer="sigmoid", causal=True, backend=backend)
    inputs.update(bias=rng.standard_normal((5, 7)), key_size=rng.uniform(0.5, 2.0, 7))
    assert_gradients_near_fd(attnnb.attention, inputs, rng, lse=True, points=3,
                             normalizer="sigmoid", backend=backend)


def test_a_learned_sigmoid_bias_on_sparse_attention():
    """The forward takes it; the gradient is refused by name (sparse kernels return no
    bias gradient), never left out."""
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=2, Lq=6, Lk=6)
    pattern = attnnb.patterns.local(6, window=2)
    sb = np.array([0.5, -1.0])
    out = attnnb.sparse_attention(q, k, v, pattern, normalizer="sigmoid", sigmoid_bias=sb)
    ref = attnnb.attention(q, k, v, mask=pattern.to_mask(), normalizer="sigmoid",
                           sigmoid_bias=sb, backend="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-12)
    with pytest.raises(NotImplementedError, match="learned sigmoid_bias"):
        attnnb.vjp(attnnb.sparse_attention, q, k, v, pattern, normalizer="sigmoid",
                   sigmoid_bias=sb)


# ---------------------------------------------------------------------------
# softpick


@pytest.mark.parametrize("backend", BACKENDS)
def test_softpick_negative_logits_keep_a_gradient(backend):
    """The seed's question: a logit below 0 gets weight 0 in both softpick and
    relu_expm1, but softpick's denominator still passes it a gradient (through the row's
    positive weights), where relu_expm1's passes none.  A row whose logits are all below
    0 outputs 0 in both; softpick's LSE stays finite and carries a gradient to them."""
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, B=1, Hq=1, Hk=1, Lq=2, Lk=6)
    q[:] = 0.0  # the logits are the bias
    bias = np.array([[-3.0, -2.0, -0.5, 0.7, 1.5, 2.0], [-3.0, -2.0, -0.5, -0.7, -1.5, -2.0]])
    negative = bias < 0
    for normalizer in ("softpick", "relu_expm1"):
        (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, normalizer=normalizer,
                                    return_lse=True, backend=backend)
        assert not out[..., 1, :].any()  # the all-negative row
        g = pb(rng.standard_normal(out.shape), None)["bias"]
        if normalizer == "softpick":
            assert (g[0][negative[0]] != 0).all()
            assert np.isfinite(lse[..., 1]).all()
            g_lse = pb(np.zeros_like(out), np.ones_like(lse))["bias"]
            assert (g_lse[1] != 0).all()
        else:
            assert not g[0][negative[0]].any() and not g[1].any()
            assert np.isneginf(lse[..., 1]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_softpick_counts_a_key_whose_bias_is_minus_inf(backend):
    """A ``-inf`` bias leaves its key in the allowed set: softpick's denominator counts
    it (``|e^-inf - 1| = 1``), where a masked key is not counted."""
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=2, Lq=5, Lk=6)
    bias = np.zeros((5, 6))
    bias[:, 2] = -np.inf
    kw = dict(normalizer="softpick", return_lse=True)
    out, lse = attnnb.attention(q, k, v, bias=bias, backend=backend, **kw)
    ref, ref_lse = attnnb.attention(q, k, v, bias=bias, backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    masked = attnnb.attention(q, k, v, mask=np.arange(6) != 2, backend=backend, **kw)[1]
    np.testing.assert_allclose(np.exp(lse) - np.exp(masked), 1.0, rtol=1e-12)


def test_cpu_float32_sigmoid_rows_whose_weights_underflow():
    """float32 sigmoid weights below float32's ``exp`` range are 0, not ``key_size /
    e^88`` (the vectorised ``exp`` clamps its argument): a row whose every logit is
    below about -88 is an underflowed row, zeros and ``lse = -inf`` with no gradient,
    as float64 rows below about -745 are; rows in range agree with the reference."""
    rng = np.random.default_rng(13)
    q, k, v = _qkv(rng, B=1, Hq=4, Hk=1, Lq=3, Lk=70, dtype=np.float32)
    bias = np.array([-20.0, -80.0, -95.0, -800.0]).reshape(4, 1, 1) + np.linspace(0, -3, 70)
    kw = dict(bias=bias.astype(np.float32), normalizer="sigmoid", sigmoid_bias=0.0,
              return_lse=True, scale=0.0)
    (out, lse), pull = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
    ref, ref_lse = attnnb.attention(q, k, v, backend="reference", **kw)
    np.testing.assert_allclose(lse[0, :2], ref_lse[0, :2], rtol=2e-6)
    np.testing.assert_allclose(out[0, :2], ref[0, :2], rtol=2e-5, atol=1e-6 * np.abs(
        ref[0, :2]).max())
    assert np.isneginf(lse[0, 2:]).all() and not out[0, 2:].any()
    grads = pull(np.ones_like(out), np.ones_like(lse))
    assert all(np.isfinite(g).all() for g in grads.values())
    assert grads["bias"].shape == (4, 1, 70) and not grads["bias"][2:].any()

"""Sigmoid attention (docs/contract.md §1.5): ``w = key_size * sigmoid(s + b)`` with no
normalisation, against a materialised formula, across backends, parts that add up, and
gradients against finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnnb

BACKENDS = ("reference", "cpu")


def _qkv(rng, B=2, Hq=4, Hk=2, Lq=70, Lk=75, D=8, Dv=5, dtype=np.float64):
    return (rng.standard_normal((B, Hq, Lq, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, Dv)).astype(dtype))


def _formula(q, k, v, *, b=None, mask=None, bias=None, key_size=None, causal=False):
    """The definition written out in float64: ``sum_j c_j sigmoid(s_ij + b) v_j``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    Lq, Lk = q.shape[-2], k.shape[-2]
    b = -math.log(Lk) if b is None else b
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]) + b
    if bias is not None:
        s = s + bias
    w = 1.0 / (1.0 + np.exp(-s))
    if key_size is not None:
        w = w * np.asarray(key_size, np.float64)[:, None, None, :]
    allowed = np.ones(s.shape, bool)
    if mask is not None:
        allowed &= mask
    if causal:
        allowed &= np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + Lk - Lq
    w = np.where(allowed, w, 0.0)
    with np.errstate(divide="ignore"):
        return w @ v, np.log(w.sum(-1))


CASES = {
    "plain, default b = -log(Lk)": {},
    "causal, b given": dict(causal=True, sigmoid_bias=0.7),
    "mask, bias, key sizes": dict(mask="mask", bias="bias", key_size="sizes"),
}


def _arguments(rng, spec, Lq=70, Lk=75):
    made = {"mask": rng.random((2, 1, Lq, Lk)) < 0.6, "bias": rng.standard_normal((Lq, Lk)),
            "sizes": rng.uniform(0.5, 3.0, (2, Lk))}
    return {n: made.get(x, x) if isinstance(x, str) else x for n, x in spec.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_against_the_formula(backend, case):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    kw = _arguments(rng, CASES[case])
    out, lse = attnnb.attention(q, k, v, normalizer="sigmoid", return_lse=True,
                                backend=backend, **kw)
    b = kw.pop("sigmoid_bias", None)
    ref, ref_lse = _formula(q, k, v, b=b, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


@pytest.mark.parametrize("shape", ["several tiles, GQA", "decoding rows", "one head, Lq > Lk"])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_cpu_equals_the_reference(shape, dtype, rtol):
    """Forward, LSE and every gradient (the LSE's cotangent included), with dropout."""
    rng = np.random.default_rng(2)
    dims = {"several tiles, GQA": dict(B=2, Hq=4, Hk=2, Lq=150, Lk=140),
            "decoding rows": dict(B=1, Hq=8, Hk=2, Lq=3, Lk=700),
            "one head, Lq > Lk": dict(B=1, Hq=1, Hk=1, Lq=90, Lk=30)}[shape]
    q, k, v = _qkv(rng, dtype=dtype, **dims)
    kw = dict(normalizer="sigmoid", causal=True, return_lse=True, dropout_p=0.2, seed=4,
              bias=rng.standard_normal((dims["Lq"], dims["Lk"])).astype(dtype),
              key_size=rng.uniform(0.5, 2.0, dims["Lk"]).astype(dtype))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
    as64 = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.attention, *(x.astype(np.float64)
                                                          for x in (q, k, v)),
                                        backend="reference", **as64)
    np.testing.assert_allclose(out, ref, rtol=0, atol=rtol * np.abs(ref).max())
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=rtol, atol=rtol)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()  # the causal rows with no key
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    g, r = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=0,
                                   atol=rtol * np.abs(r[name]).max(), err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_against_finite_differences(backend):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=1, Lq=5, Lk=7, D=3, Dv=2)
    inputs = dict(q=q, k=k, v=v, bias=rng.standard_normal((5, 7)),
                  key_size=rng.uniform(0.5, 2.0, 7))
    kw = dict(normalizer="sigmoid", causal=True, return_lse=True, backend=backend)
    (out, lse), pb = attnnb.vjp(attnnb.attention, **inputs, **kw)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    grads = pb(dout, dlse)
    eps = 1e-6
    for name, x in inputs.items():
        for _ in range(5):
            idx = tuple(rng.integers(0, n) for n in x.shape)
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps

            def f(arr, name=name):
                o, s = attnnb.attention(**{**inputs, name: arr}, **kw)
                return np.sum(dout * o) + np.sum(dlse * s)

            fd = (f(plus) - f(minus)) / (2 * eps)
            assert abs(fd - grads[name][idx]) <= 1e-6 * (1 + abs(fd)), (name, idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edges(backend):
    """Empty rows (zeros, -inf), +-1e4 logits (the weights saturate at 0 and the key
    size), a NaN logit (its row NaN), a merged key of size 2 as the key twice."""
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=2, Lq=6, Lk=9)
    mask = np.ones((6, 9), bool)
    mask[2] = False
    bias = np.zeros((6, 9))
    bias[3, :4], bias[3, 4:] = 1e4, -1e4
    qn = q.copy()
    qn[0, 1, 4, 0] = np.nan
    out, lse = attnnb.attention(qn, k, v, mask=mask, bias=bias, normalizer="sigmoid",
                                return_lse=True, backend=backend)
    assert not out[:, :, 2].any() and np.isneginf(lse[:, :, 2]).all()
    np.testing.assert_allclose(out[0, :, 3], v[0, :, :4].sum(1), rtol=1e-12)
    np.testing.assert_allclose(lse[0, :, 3], math.log(4), rtol=1e-12)
    assert np.isnan(out[0, 1, 4]).all() and np.isfinite(np.delete(out[0, 1], 4, 0)).all()
    sizes = np.ones(9)
    sizes[0] = 2
    merged = attnnb.attention(q, k, v, key_size=sizes, normalizer="sigmoid", sigmoid_bias=-1.0,
                              backend=backend)
    twice = attnnb.attention(q, np.concatenate([k[:, :, :1], k], 2),
                             np.concatenate([v[:, :, :1], v], 2), normalizer="sigmoid",
                             sigmoid_bias=-1.0, backend=backend)
    np.testing.assert_allclose(merged, twice, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_equals_masked_dense(backend):
    from attnnb import patterns

    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, Lq=140, Lk=140)
    pattern = patterns.local(140, 20)
    (out, lse), pb = attnnb.vjp(attnnb.sparse_attention, q, k, v, pattern,
                                normalizer="sigmoid", return_lse=True, backend=backend)
    (ref, ref_lse), pr = attnnb.vjp(attnnb.attention, q, k, v, mask=pattern.to_mask(),
                                    normalizer="sigmoid", return_lse=True, backend=backend)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout, None), pr(dout, None)
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(g[name], r[name], rtol=1e-11, atol=1e-13, err_msg=name)


def test_parts_over_disjoint_keys_add_up():
    """combine(normalizer="sigmoid") adds the outputs and the weights (logaddexp); Dask's
    key blocks do the same, with the whole call's default bias."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, Lq=40, Lk=48)
    whole, whole_lse = attnnb.attention(q, k, v, normalizer="sigmoid", return_lse=True)
    b = -math.log(48)
    parts = [attnnb.attention(q, k[:, :, a:z], v[:, :, a:z], normalizer="sigmoid",
                              sigmoid_bias=b, return_lse=True) for a, z in ((0, 20), (20, 48))]
    out, lse = attnnb.combine([p[0] for p in parts], [p[1] for p in parts],
                              normalizer="sigmoid")
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12)
    lazy = [da.from_array(x, chunks=(1, 2, 16, x.shape[-1])) for x in (q, k, v)]
    out, lse = attnnb.attention(*lazy, normalizer="sigmoid", causal=True, return_lse=True)
    ref, ref_lse = attnnb.attention(q, k, v, normalizer="sigmoid", causal=True,
                                    return_lse=True, backend="reference")
    np.testing.assert_allclose(out.compute(), ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse.compute(), ref_lse, rtol=1e-12)


def test_weights_are_the_sigmoids():
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, Lq=20, Lk=25)
    w = attnnb.weights(attnnb.attention, q, k, v, normalizer="sigmoid", causal=True)
    out = attnnb.attention(q, k, v, normalizer="sigmoid", causal=True)
    np.testing.assert_allclose(w @ np.repeat(v, 2, axis=1), out, rtol=1e-12, atol=1e-13)
    s = attnnb.attention_stats(attnnb.attention, q, k, v, normalizer="sigmoid", causal=True,
                               stats=("max", "received"))
    np.testing.assert_allclose(s["max"], w.max(-1), rtol=1e-13)


def test_refusals_name_the_argument():
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="sigmoid_bias belongs to normalizer='sigmoid'"):
        attnnb.attention(q, q, q, sigmoid_bias=0.5)
    with pytest.raises(TypeError, match="sigmoid_bias must be a real number"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sigmoid_bias=np.zeros(2))
    with pytest.raises(ValueError, match="sigmoid_bias must be finite"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sigmoid_bias=np.inf)
    with pytest.raises(ValueError, match="normalizer='softmax'"):
        attnnb.attention(q, q, q, normalizer="sigmoid", sinks=np.zeros(2))


def test_torch_gradcheck():
    torch = pytest.importorskip("torch")
    import attnnb.torch as at

    rng = np.random.default_rng(8)
    q, k, v = (torch.tensor(x, requires_grad=True)
               for x in _qkv(rng, B=1, Hq=2, Hk=1, Lq=4, Lk=5, D=3, Dv=2))
    bias = torch.tensor(rng.standard_normal((4, 5)), requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, bias: at.attention(q, k, v, bias=bias, normalizer="sigmoid",
                                           sigmoid_bias=torch.tensor(-0.5), causal=True),
        (q, k, v, bias))

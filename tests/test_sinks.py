"""Learned attention sinks (docs/contract.md §1.15): a logit per query head in the
softmax's denominator only, against a materialised formula, across backends, and their
gradient against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import attnnb

BACKENDS = ("reference", "cpu")


def _qkv(rng, B=2, Hq=4, Hk=2, Lq=7, Lk=9, D=8, dtype=np.float64):
    return (rng.standard_normal((B, Hq, Lq, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, D)).astype(dtype))


def _with_sink_column(q, k, v, sinks, causal=False):
    """The gpt-oss way: the sink as one more logit column, softmax, the column dropped."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(q.shape[-1])
    if causal:
        Lq, Lk = s.shape[-2:]
        s = np.where(np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + Lk - Lq, s, -np.inf)
    col = np.broadcast_to(np.asarray(sinks, float).reshape(-1, 1, 1)
                          if np.ndim(sinks) == 1 else np.asarray(sinks)[..., None, None],
                          s.shape[:-1] + (1,))
    ext = np.concatenate([s, col], axis=-1)
    w = np.exp(ext - ext.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", w[..., :-1], v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq, Lk", [(7, 9), (130, 70), (3, 300)])  # tiles, decoding splits
def test_sinks_against_the_sink_column(backend, causal, Lq, Lk):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, Lq=Lq, Lk=Lk)
    sinks = 3 * rng.standard_normal(4)
    out = attnnb.attention(q, k, v, sinks=sinks, causal=causal, backend=backend)
    np.testing.assert_allclose(out, _with_sink_column(q, k, v, sinks, causal), rtol=1e-11,
                               atol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_sinks_are_softmax1_and_lse_excludes_the_sink(backend):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, Lq=70, Lk=80)
    out, lse = attnnb.attention(q, k, v, sinks=np.zeros(4), return_lse=True, backend=backend)
    ref, ref_lse = attnnb.attention(q, k, v, normalizer="softmax1", return_lse=True,
                                    backend=backend)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lse, ref_lse)
    plain_lse = attnnb.attention(q, k, v, return_lse=True, backend=backend)[1]
    _, lse_s = attnnb.attention(q, k, v, sinks=np.full(4, 2.0), return_lse=True,
                                backend=backend)
    np.testing.assert_array_equal(lse_s, plain_lse)


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_cpu_forward_and_gradients_equal_the_reference(dtype, rtol):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, B=2, Hq=4, Hk=2, Lq=130, Lk=70, dtype=dtype)
    sinks = rng.standard_normal((2, 4)).astype(dtype)  # per batch element and head
    kw = dict(sinks=sinks, causal=True, return_lse=True,
              bias=rng.standard_normal((130, 70)).astype(dtype))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
    f64 = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.attention, q.astype(np.float64),
                                        k.astype(np.float64), v.astype(np.float64),
                                        backend="reference", **f64)
    np.testing.assert_allclose(out, ref, rtol=0, atol=rtol * np.abs(ref).max())
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    g, r = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    assert g["sinks"].shape == (2, 4) and g["sinks"].dtype == dtype
    for n in r:
        np.testing.assert_allclose(g[n], r[n], rtol=0, atol=10 * rtol * np.abs(r[n]).max(),
                                   err_msg=n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_gradient_against_finite_differences(backend):
    """Every input's gradient, the sinks' (one per head, broadcast over the batch) too,
    with an LSE cotangent (which does not reach the sinks) and an empty row."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, B=2, Hq=2, Hk=1, Lq=6, Lk=7)
    sinks = rng.standard_normal(2)
    mask = np.ones((6, 7), bool)
    mask[2] = False
    kw = dict(mask=mask, return_lse=True)
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, sinks=sinks, backend=backend, **kw)
    dout = rng.standard_normal(out.shape)
    dlse = np.where(np.isfinite(lse), rng.standard_normal(lse.shape), 0.0)
    grads = pb(dout, dlse)

    def loss(**change):
        args = {"q": q, "k": k, "v": v, "sinks": sinks, **change}
        o, s = attnnb.attention(backend=backend, **args, **kw)
        return np.sum(dout * o) + np.sum(dlse * np.where(np.isfinite(s), s, 0.0))

    eps = 1e-6
    for name, x in (("sinks", sinks), ("q", q), ("k", k)):
        for idx in list(np.ndindex(x.shape))[:6]:
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)
            assert abs(fd - grads[name][idx]) <= 1e-6 * (1 + abs(fd)), (name, idx)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", ["batch", "heads"])
def test_sinks_with_a_bias_gradient_in_chunks(backend, chunk, monkeypatch):
    """A broadcast bias's gradient formed chunk by chunk (docs/contract.md §5.4): each
    chunk reads its own batch elements' and heads' sinks."""
    from attnnb._core import bias_chunks as _bias_chunks

    rng = np.random.default_rng(13)
    q, k, v = _qkv(rng, B=3 if chunk == "batch" else 1, Hq=4, Hk=2, Lq=9, Lk=9)
    kw = dict(bias=rng.standard_normal((9, 9)), sinks=rng.standard_normal(q.shape[:2]),
              backend=backend)
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, **kw)
    dout = rng.standard_normal(out.shape)
    whole = pb(dout)
    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 1)
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, **kw)
    for name, g in pb(dout).items():
        np.testing.assert_allclose(g, whole[name], rtol=1e-12, atol=1e-14, err_msg=name)


def test_sinks_refusals():
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="normalizer='softmax'"):
        attnnb.attention(q, q, q, sinks=np.zeros(2), normalizer="softmax1")
    with pytest.raises(ValueError, match="cannot be broadcast"):
        attnnb.attention(q, q, q, sinks=np.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        attnnb.attention(q, q, q, sinks=np.array([0.0, np.inf]))
    with pytest.raises(TypeError, match="sinks must be a real"):
        attnnb.attention(q, q, q, sinks=np.array([True, False]))


def test_torch_sinks_gradcheck_and_drop_in():
    torch = pytest.importorskip("torch")
    import attnnb.torch as at

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: at.attention(q, k, v, causal=True, sinks=s), (q, k, v, sinks),
        eps=1e-6, atol=1e-8, rtol=1e-6)
    out = at.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
    expected = _with_sink_column(*(x.detach().numpy() for x in (q, k, v)),
                                 sinks.detach().numpy(), causal=True)
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_sinks_equal_masked_dense_sinks(backend):
    from attnnb import patterns

    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, Lq=150, Lk=150)
    sinks = rng.standard_normal(4)
    pattern = patterns.local(150, 40, causal=True)
    (out, lse), pb = attnnb.vjp(attnnb.sparse_attention, q, k, v, pattern, sinks=sinks,
                                return_lse=True, backend=backend)
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.attention, q, k, v, mask=pattern.to_mask(),
                                        sinks=sinks, return_lse=True, backend=backend)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for n in ("q", "k", "v", "sinks"):
        np.testing.assert_allclose(g[n], r[n], rtol=1e-11, atol=1e-13, err_msg=n)


@pytest.mark.parametrize("top_k", [3, 100])  # the gathered rows and the masked sweep
def test_topk_sinks_cpu_equal_the_reference(top_k):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, Lq=70, Lk=130)
    sinks = rng.standard_normal(4)
    kw = dict(sinks=sinks, causal=True, return_lse=True)
    (out, lse), pb = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k, backend="cpu", **kw)
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k,
                                        backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    plain = attnnb.topk_attention(q, k, v, top_k, causal=True, backend="cpu")
    assert not np.allclose(out, plain)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for n in ("q", "k", "v", "sinks"):
        np.testing.assert_allclose(g[n], r[n], rtol=1e-11, atol=1e-13, err_msg=n)


# ---------------------------------------------------------------------------
# parts over disjoint keys: combine and Dask


def test_combine_merges_parts_computed_with_sinks():
    """Parts computed with the sinks merge into the whole call's result (each part's
    own sink factor undone, the merged one applied); the LSE excludes the sink."""
    rng = np.random.default_rng(20)
    q, k, v = _qkv(rng, B=2, Hq=3, Hk=3, Lq=6, Lk=11)
    sinks = rng.standard_normal((2, 3)) * 2
    whole, whole_lse = attnnb.attention(q, k, v, sinks=sinks, return_lse=True)
    parts = [attnnb.attention(q, k[:, :, a:b], v[:, :, a:b], sinks=sinks, return_lse=True)
             for a, b in ((0, 4), (4, 5), (5, 11))]
    out, lse = attnnb.combine([p[0] for p in parts], [p[1] for p in parts], sinks=sinks)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-12)
    plain = attnnb.combine([p[0] for p in parts], [p[1] for p in parts])[0]
    assert not np.allclose(plain, whole)  # parts with sinks are not softmax parts
    with pytest.raises(ValueError, match="normalizer='softmax'"):
        attnnb.combine([out], [lse], sinks=sinks, normalizer="softmax1")
    with pytest.raises(ValueError, match="cannot be broadcast"):
        attnnb.combine([out], [lse], sinks=np.zeros(5))


@pytest.mark.parametrize("fn", ["attention", "sparse_attention", "topk_attention"])
def test_dask_arrays_with_sinks_equal_one_call(fn):
    """Key blocks computed as softmax, merged by their LSEs, finished with each query
    block's sinks."""
    da = pytest.importorskip("dask.array")
    from attnnb import patterns

    rng = np.random.default_rng(21)
    q, k, v = _qkv(rng, B=2, Hq=4, Hk=2, Lq=40, Lk=40)
    sinks = rng.standard_normal((2, 4))
    call = {"attention": lambda *a, **kw: attnnb.attention(*a, causal=True, **kw),
            "sparse_attention": lambda *a, **kw: attnnb.sparse_attention(
                *a, patterns.local(40, 6), **kw),
            "topk_attention": lambda *a, **kw: attnnb.topk_attention(*a, 5, **kw)}[fn]
    ref, ref_lse = call(q, k, v, sinks=sinks, return_lse=True, backend="reference")
    lazy = [da.from_array(x, chunks=(1, 2, 16, 8)) for x in (q, k, v)]
    out, lse = call(*lazy, sinks=sinks, return_lse=True, backend="cpu")
    np.testing.assert_allclose(out.compute(), ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse.compute(), ref_lse, rtol=1e-12)
    with pytest.raises(TypeError, match="sinks must be a NumPy array"):
        call(*lazy, sinks=da.from_array(sinks))

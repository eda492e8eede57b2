"""Attention dropout on the cuda backend (docs/contract.md §1.14): the reference's keep
decisions bit for bit, and its gradients.  Small sizes: the simulator runs a thread per
GPU thread."""

import numpy as np
import pytest

import attnnb

from ..helpers import assert_drops_the_reference_keys
from .common import n


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_drops_the_reference_keys(rng, causal):
    """One-hot values: the output is each row's dropped weights, so the zeros are the
    reference's exactly (GQA, Lq != Lk)."""
    lq, lk = n(9), n(13)
    q = rng.standard_normal((1, 2, lq, 4))
    k = rng.standard_normal((1, 1, lk, 4))
    v = np.broadcast_to(np.eye(lk), (1, 1, lk, lk)).copy()
    assert_drops_the_reference_keys(q, k, v, "cuda", causal)


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-4)])
def test_cuda_dropout_gradients_equal_the_reference(rng, dtype, rtol):
    """Every gradient (q, k, v, bias, key_size) under dropout, causal, GQA."""
    lq, lk = n(7), n(10)
    q = rng.standard_normal((2, 2, lq, 4)).astype(dtype)
    k = rng.standard_normal((2, 1, lk, 4)).astype(dtype)
    v = rng.standard_normal((2, 1, lk, 3)).astype(dtype)
    kw = dict(dropout_p=0.3, seed=77, causal=True, return_lse=True,
              bias=rng.standard_normal((lq, lk)).astype(dtype),
              key_size=rng.uniform(0.5, 2.0, (2, lk)).astype(dtype))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cuda", **kw)
    f64 = {name: (x.astype(np.float64) if isinstance(x, np.ndarray) else x)
           for name, x in kw.items()}
    (ref, _), pb_ref = attnnb.vjp(attnnb.attention, q.astype(np.float64), k.astype(np.float64),
                                  v.astype(np.float64), backend="reference", **f64)
    np.testing.assert_allclose(out, ref, rtol=0, atol=rtol * np.abs(ref).max())
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    g, r = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=0,
                                   atol=rtol * np.abs(r[name]).max(), err_msg=name)


@pytest.mark.parametrize("function", ["attention", "sparse", "topk"])
def test_cuda_sinks_equal_the_reference(rng, function):
    """Learned sinks (a logit per head in the denominator): the reference's output, LSE
    and every gradient, the sinks' too; device inputs take host sinks."""
    from attnnb import patterns

    lq, lk = n(7), n(9)
    q = rng.standard_normal((2, 2, lq, 4))
    k = rng.standard_normal((2, 1, lk, 4))
    v = rng.standard_normal((2, 1, lk, 3))
    sinks = rng.standard_normal(2) * 2
    if function == "sparse":
        fn, args = attnnb.sparse_attention, (q, k, v, patterns.local((lq, lk), 3))
    elif function == "topk":
        fn, args = attnnb.topk_attention, (q, k, v, 3)
    else:
        fn, args = attnnb.attention, (q, k, v)
    kw = dict(sinks=sinks, return_lse=True) | ({} if function == "sparse" else
                                               dict(causal=True, dropout_p=0.25, seed=4))
    if function == "topk":
        del kw["dropout_p"], kw["seed"]
    (out, lse), pb = attnnb.vjp(fn, *args, backend="cuda", **kw)
    (ref, ref_lse), pb_ref = attnnb.vjp(fn, *args, backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    g, r = pb(dout, dlse), pb_ref(dout, dlse)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=0,
                                   atol=1e-11 * np.abs(r[name]).max(), err_msg=name)
    if function == "attention":
        from .common import host, to_device

        on_device = attnnb.attention(*to_device(q, k, v), sinks=sinks, causal=True)
        np.testing.assert_allclose(host(on_device), attnnb.attention(
            q, k, v, sinks=sinks, causal=True, backend="reference"), rtol=0, atol=1e-12)



def test_cuda_sparse_and_topk_dropout_equal_the_reference(rng):
    """A pattern, and a top-k selection (made before dropout), with dropout: outputs and
    gradients against the reference's, the same keep decisions."""
    from attnnb import patterns

    lq = lk = n(10)
    q = rng.standard_normal((1, 2, lq, 4))
    k = rng.standard_normal((1, 2, lk, 4))
    v = rng.standard_normal((1, 2, lk, 3))
    kw = dict(dropout_p=0.4, seed=5, return_lse=True)
    for fn, extra in ((attnnb.sparse_attention, (patterns.local(lq, 3, causal=True),)),
                      (attnnb.topk_attention, (4,))):
        (out, lse), pb = attnnb.vjp(fn, q, k, v, *extra, backend="cuda", **kw)
        (ref, ref_lse), pb_ref = attnnb.vjp(fn, q, k, v, *extra, backend="reference", **kw)
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
        dout = rng.standard_normal(out.shape)
        g, r = pb(dout), pb_ref(dout)
        for name in r:
            np.testing.assert_allclose(g[name], r[name], rtol=1e-11, atol=1e-13,
                                       err_msg=f"{fn.__name__} {name}")


def test_cuda_chunked_backward_keys_the_whole_problems_indices(rng, monkeypatch):
    """A broadcast bias's gradient formed chunk by chunk (one key head of one batch
    element each): every chunk keys its decisions by the call's batch and head indices,
    so the gradients are the reference's."""
    from attnnb._core import bias_chunks as _bias_chunks

    lq, lk = n(5), n(6)
    q = rng.standard_normal((2, 2, lq, 4))
    k = rng.standard_normal((2, 2, lk, 4))
    v = rng.standard_normal((2, 2, lk, 3))
    kw = dict(dropout_p=0.4, seed=9, bias=rng.standard_normal((lq, lk)))
    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", lq * lk * 8)
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cuda", **kw)
    _, pb_ref = attnnb.vjp(attnnb.attention, q, k, v, backend="reference", **kw)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=1e-11, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
def test_cuda_diff_dropout_equals_the_reference(rng, mode):
    """Differential attention's dropout (one decision per combined weight of a head pair,
    after the clip): the reference's output and every gradient (lam's too), GQA, causal,
    a bias; a value tile holding an Inf takes the two maps apart, under the same
    decisions."""
    lq, lk = n(7), n(10)
    q = rng.standard_normal((1, 4, lq, 4))
    k = rng.standard_normal((1, 2, lk, 4))
    v = rng.standard_normal((1, 1, lk, 3))
    lam = rng.uniform(0.1, 0.7, (1, 2, lq))
    kw = dict(dropout_p=0.35, seed=5, causal=True, mode=mode,
              bias=rng.standard_normal((lq, lk)))
    out, pb = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, backend="cuda", **kw)
    ref, pb_ref = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for name in r:
        if r[name] is not None:
            np.testing.assert_allclose(g[name], r[name], rtol=0,
                                       atol=1e-11 * np.abs(r[name]).max(), err_msg=name)
    if mode == "difference":
        v[0, 0, 2, 1] = np.inf
        out = attnnb.diff_attention(q, k, v, lam, backend="cuda", **kw)
        ref = attnnb.diff_attention(q, k, v, lam, backend="reference", **kw)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        finite = np.isfinite(ref)
        np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-12, atol=1e-12)

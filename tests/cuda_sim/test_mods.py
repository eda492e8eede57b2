"""Mask and score functions on the cuda backend (docs/contract.md §2.10): the reference's
outputs and gradients, the mods compiled into the register-tiled kernels as device
functions.  Small sizes: the simulator runs a thread per GPU thread."""

import numpy as np
import pytest

import attnnb
from attnnb import mods

from .common import host, n, to_device

TOL = {np.float64: 1e-12, np.float32: 2e-5}


def _scaled_square(s, b, h, i, j, weights):
    """A user's function of s (complex step for its slope) and of b, h through an array."""
    return s * weights[b, h] + 0.05 * s * s


TILT = np.array([0.25, -0.5])


def _tilted(s, b, h, i, j):
    """Reads a global float array by name (contract §2.10: read at every call)."""
    return s + TILT[h] * (j - i)


def _same_group(ids, offset):
    """A factory: a closure over an array, a constant and a helper of its own."""
    def group(x):
        return ids[x]

    def mask(b, h, i, j):
        return group(i + offset) == group(j)
    return mask


def _problem(rng, dtype, B=2, Hq=2, Hk=1, Lq=7, Lk=10, D=4, Dv=3):
    q = rng.standard_normal((B, Hq, n(Lq), D)).astype(dtype)
    k = rng.standard_normal((B, Hk, n(Lk), D)).astype(dtype)
    v = rng.standard_normal((B, Hk, n(Lk), Dv)).astype(dtype)
    return q, k, v


def _cases(rng, lq, lk):
    ids = np.repeat(np.arange(3), -(-lk // 3))[:lk]
    return {
        "alibi": dict(score_mod=mods.constant(mods.alibi(np.array([0.5, -0.25])))),
        "document & causal": dict(mask_mod=mods.document(ids[lk - lq:], ids) & mods.causal),
        "user score, softcap, window, bias": dict(
            score_mod=mods.score_mod(_scaled_square, rng.uniform(0.5, 1.5, (2, 2)),
                                     constant=True) + mods.softcap(3.0),
            mask_mod=mods.sliding_window(4), bias=rng.standard_normal((lq, lk))),
        "read by name": dict(mask_mod=_same_group(ids, lk - lq), score_mod=_tilted),
    }


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", ["alibi", "document & causal",
                                  "user score, softcap, window, bias", "read by name"])
def test_cuda_mods_equal_the_reference(rng, dtype, case):
    """Outputs, LSEs and every gradient (q, k, v, bias) against the float64 reference:
    GQA, Lq != Lk, sizes crossing the tiles' borders."""
    q, k, v = _problem(rng, dtype)
    lq, lk = q.shape[2], k.shape[2]
    kw = _cases(rng, lq, lk)[case]
    kw = {name: (x.astype(dtype) if isinstance(x, np.ndarray) else x) for name, x in kw.items()}
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, return_lse=True, backend="cuda",
                                **kw)
    f64 = {name: (x.astype(np.float64) if isinstance(x, np.ndarray) else x)
           for name, x in kw.items()}
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.attention, *(x.astype(np.float64)
                                                            for x in (q, k, v)),
                                        return_lse=True, backend="reference", **f64)
    tol = TOL[dtype]
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * np.abs(ref).max())
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=tol)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    g, r = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    for name in r:
        if name == "score_mod":  # constant mods: no gradient
            assert g[name] == r[name] == (None,) * len(r[name])
            continue
        if r[name] is None:
            continue
        np.testing.assert_allclose(g[name], r[name], rtol=0,
                                   atol=5 * tol * np.abs(r[name]).max(), err_msg=name)


def test_cuda_mods_take_device_arrays(rng):
    """Device inputs give device outputs, the same as host inputs (bit for bit)."""
    q, k, v = _problem(rng, np.float32, B=1)
    kw = dict(score_mod=mods.constant(mods.alibi(np.array([0.5, 0.25]))), causal=True)
    on_host = attnnb.attention(q, k, v, backend="cuda", **kw)
    on_device = attnnb.attention(*to_device(q, k, v), backend="cuda", **kw)
    np.testing.assert_array_equal(host(on_device), on_host)


def test_cuda_mods_see_the_calls_batch_indices(rng, monkeypatch):
    """A chunked backward (a broadcast bias past the chunk size) hands its parts' functions
    the whole call's batch indices: a per-batch mask still matches the reference."""
    import attnnb._core.bias_chunks as chunks

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 64)
    q, k, v = _problem(rng, np.float64, B=3, Hq=1, Hk=1, Lq=5, Lk=6)

    def every_other(b, h, i, j):
        return (i + j + b) % 2 == 0 or i == j

    kw = dict(mask_mod=every_other, bias=rng.standard_normal((1, 1, 5, 6)))
    (out, pb) = attnnb.vjp(attnnb.attention, q, k, v, backend="cuda", **kw)
    (ref, pb_ref) = attnnb.vjp(attnnb.attention, q, k, v, backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for name in ("q", "k", "v", "bias"):
        np.testing.assert_allclose(g[name], r[name], rtol=1e-11, atol=1e-12, err_msg=name)


def _key_shift(s, b, h, i, j, shift):
    return s + shift[h, j]


def _key_shift_da(g, s, b, h, i, j, grads, shift):
    grads[0][h, j] += g


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cuda_score_array_gradients_equal_the_reference(rng, dtype):
    """Gradients into learnable arrays (ALiBi's slopes, T5's table, a user's per-head
    key shift with its grad_arrays, the forgetting gates) against the float64 reference,
    the same bits on a second run; GQA, Lq != Lk, a bias among them."""
    q, k, v = _problem(rng, dtype)
    lq, lk = q.shape[2], k.shape[2]
    score = (mods.alibi(rng.standard_normal(2)) + mods.relative_bias(
        rng.standard_normal((6, 2)), 6, 8, True)
        + mods.score_mod(_key_shift, rng.standard_normal((2, lk)),
                         grad_arrays=_key_shift_da)
        + mods.forgetting(-np.abs(rng.standard_normal((2, lk)))))
    mods.check(score, shape=(2, 2, lq, lk))  # the user's grad_arrays: central differences
    kw = dict(score_mod=score, mask_mod=mods.causal, bias=rng.standard_normal((lq, lk)))
    dout = rng.standard_normal((2, 2, lq, 3))
    runs = []
    for _ in range(2):
        out, pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cuda", **kw)
        runs.append(pb(dout.astype(dtype)))
    _, pb_ref = attnnb.vjp(attnnb.attention, *(x.astype(np.float64) for x in (q, k, v)),
                           backend="reference", **kw)
    ref = pb_ref(dout)
    tol = 20 * TOL[dtype]
    for name in ("q", "k", "v", "bias"):
        np.testing.assert_allclose(runs[0][name], ref[name], rtol=0,
                                   atol=tol * np.abs(ref[name]).max(), err_msg=name)
    assert len(runs[0]["score_mod"]) == len(ref["score_mod"]) == len(mods.parameters(score))
    for p, (got, want, again) in enumerate(zip(runs[0]["score_mod"], ref["score_mod"],
                                               runs[1]["score_mod"])):
        if want is None:  # (a parameter of no gradient: an integer setting)
            assert got is None and again is None
            continue
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max(),
                                   err_msg=f"parameter {p}")
        np.testing.assert_array_equal(got, again)


@pytest.mark.parametrize("function", ["sparse", "topk", "difference", "rectified",
                                      "heaviside"])
def test_cuda_mods_in_every_function_equal_the_reference(rng, function):
    """Sparse (the mask function intersected with the pattern), top-k (rows rank the
    modified logits) and differential attention (both maps, h the pair's index, every
    mode): outputs and every gradient, the slopes' too, against the reference."""
    from attnnb import patterns

    Hk = 2 if function in ("difference", "rectified", "heaviside") else 1
    q, k, v = _problem(rng, np.float64, B=1, Hq=4, Hk=Hk)
    lq, lk = q.shape[2], k.shape[2]
    alibi = mods.alibi(rng.standard_normal(2 if Hk == 2 else 4))
    kw = dict(mask_mod=mods.sliding_window(6), score_mod=alibi + mods.softcap(3.0))
    if function == "sparse":
        args, fn = (q, k, v, patterns.local((lq, lk), 4)), attnnb.sparse_attention
    elif function == "topk":
        args, fn = (q, k, v, 3), attnnb.topk_attention
    else:
        lam = rng.uniform(0.1, 0.6, (1, 2, lq))
        args, fn = (q, k, v[:, :1], lam), attnnb.diff_attention
        kw["mode"] = function
    out, pb = attnnb.vjp(fn, *args, backend="cuda", **kw)
    ref, pb_ref = attnnb.vjp(fn, *args, backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for name in r:
        if name == "score_mod":
            for got, want in zip(g[name], r[name]):
                if want is not None:
                    np.testing.assert_allclose(got, want, rtol=0,
                                               atol=1e-11 * np.abs(want).max())
        elif r[name] is not None:
            np.testing.assert_allclose(g[name], r[name], rtol=0,
                                       atol=1e-11 * np.abs(r[name]).max(), err_msg=name)

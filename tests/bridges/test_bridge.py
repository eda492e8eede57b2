"""attnnb._bridges.common: a call split into forward, residuals and backward, for the
framework bridges.

The backward from the residuals must give exactly ``attnnb.vjp``'s gradients without
running the forward again, and :func:`~attnnb._bridges.common.signature` must say what the call
returns, and refuse what the function refuses, from shapes and dtypes alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnnb
from attnnb import patterns
from attnnb._bridges import common as _bridge
from attnnb._front import dispatch as _dispatch

REF = "reference"


def _calls(rng):
    q, k, v = (rng.standard_normal((2, 2, n, 4)) for n in (5, 6, 6))
    mask = rng.random((5, 6)) > 0.3
    yield "attention", dict(q=q, k=k, v=v, mask=mask, bias=rng.standard_normal((5, 6))), dict(
        causal=True, return_lse=True, backend=REF)
    yield "sparse_attention", dict(q=q, k=k, v=v), dict(pattern=patterns.local((5, 6), 1),
                                                          backend=REF)
    yield "topk_attention", dict(q=q, k=k, v=v, key_size=rng.uniform(0.5, 2, 6)), dict(
        top_k=2, return_lse=True, backend=REF)
    yield "diff_attention", dict(q=q, k=k, v=v[:, :1], lam=np.float32(0.5), mask=mask), dict(
        mode="rectified", backend=REF)


@pytest.mark.parametrize("index", range(4))
def test_forward_backward_is_vjp(rng, index, monkeypatch):
    name, arrays, static = list(_calls(rng))[index]
    fn = _bridge.FUNCTIONS[name]
    result, (out, lse) = _bridge.forward(name, arrays, static)
    want_result, pullback = attnnb.vjp(fn, **arrays, **static)
    pieces = result if isinstance(result, tuple) else (result,)
    cotangents = [rng.standard_normal(p.shape) for p in pieces]
    want = pullback(*cotangents)
    sig = _bridge.signature(name, {a: (np.shape(x), np.asarray(x).dtype)
                                   for a, x in arrays.items()}, static)
    assert (sig.out_shape, sig.out_dtype) == (pieces[0].shape, pieces[0].dtype)
    assert out.dtype == sig.residual_dtype and (lse is None) == (sig.lse_shape is None)
    # the backward never calls the forward: take it away
    def no_forward(*args):
        raise AssertionError("the backward ran the forward")

    monkeypatch.setitem(_dispatch._LOADED, (name, REF), no_forward)
    grads = _bridge.backward(name, arrays, static, (out.ravel(), lse), *cotangents)
    assert grads.keys() == want.keys()
    for a, g in grads.items():
        np.testing.assert_array_equal(g, want[a], err_msg=a)


def test_signature_refuses_what_the_function_refuses():
    with pytest.raises(ValueError, match="k's last axis"):
        _bridge.signature("attention", {"q": ((5, 4), np.float32), "k": ((6, 3), np.float32),
                                        "v": ((6, 3), np.float32)}, {})
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        _bridge.signature("attention", {a: ((5, 4), np.float32) for a in ("q", "k", "v", "mask")},
                          {})
    with pytest.raises(TypeError, match="sparse_attention takes no array argument"):
        _bridge.signature("sparse_attention", {a: ((5, 4), np.float32) for a in "qkv"} | {
            "bias": ((5, 5), np.float32)}, {"pattern": patterns.local(5, 1)})


def test_signature_of_the_lse_and_the_backend(monkeypatch):
    monkeypatch.delenv("ATTNNB_BACKEND", raising=False)
    specs = {a: ((3, 2, 5, 4), np.float16) for a in "qkv"}
    sig = _bridge.signature("attention", specs, {"return_lse": False})
    assert (sig.out_shape, sig.out_dtype) == ((3, 2, 5, 4), np.float16)
    assert (sig.lse_shape, sig.lse_dtype, sig.residual_dtype) == ((3, 2, 5), np.float32,
                                                                  np.float32)
    assert sig.backend == "cpu"
    with attnnb.use_backend(REF):
        assert _bridge.signature("attention", specs, {}).backend == REF

"""The public gradient API, ``attnnb.vjp`` (docs/contract.md §5.1, §5.2, §5.4).

Shapes, dtypes, broadcast summing, 2-D inputs, errors, repeated and threaded
pullbacks, and the LSE cotangent.  The values themselves are checked against
finite differences in test_reference.py.  Every call uses the
``reference`` backend: it is the one with a backward pass so far.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest

import attnnb
from attnnb import patterns
from attnnb._front import dispatch as _dispatch

REF = "reference"
README = Path(__file__).resolve().parents[2] / "README.md"


def qkv(rng, batch=(2,), hq=2, hk=None, lq=4, lk=5, d=3, dv=2, dtype=np.float64):
    hk = hq if hk is None else hk
    return tuple(rng.standard_normal(s).astype(dtype) for s in
                 (batch + (hq, lq, d), batch + (hk, lk, d), batch + (hk, lk, dv)))


def diff_qkv(rng, batch=(2,), h=2, hk=1, lq=4, lk=5, d=2, dv=3, dtype=np.float64):
    return tuple(rng.standard_normal(s).astype(dtype) for s in
                 (batch + (2 * h, lq, d), batch + (2 * hk, lk, d), batch + (hk, lk, dv)))


def _calls(rng, dtype=np.float64):
    """One call of each differentiable function: ``(fn, args, kwargs)``."""
    q, k, v = qkv(rng, dtype=dtype)
    dq, dk, dv = diff_qkv(rng, dtype=dtype)
    size = rng.uniform(0.5, 2.0, (2, 5, 1))
    return [
        (attnnb.attention, (q, k, v), dict(bias=rng.standard_normal((4, 5)), key_size=size,
                                           causal=True, return_lse=True)),
        (attnnb.attention, (q, k, v), dict(normalizer="softmax1")),
        (attnnb.sparse_attention, (q, k, v, patterns.local((4, 5), 1)),
         dict(key_size=size, return_lse=True)),
        (attnnb.topk_attention, (q, k, v, 2), dict(key_size=size, causal=True)),
        (attnnb.diff_attention, (dq, dk, dv, 0.5),
         dict(bias=rng.standard_normal((2, 4, 5)), key_size=size, mode="rectified")),
    ]


def _pull(pullback, result, rng, dlse=True):
    """Call ``pullback`` with random cotangents of ``result``'s shapes."""
    if isinstance(result, tuple):
        out, lse = result
        return pullback(rng.standard_normal(out.shape),
                        rng.standard_normal(lse.shape) if dlse else None)
    return pullback(rng.standard_normal(result.shape))


# ---------------------------------------------------------------------------
# result and keys


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_result_is_exactly_the_functions(rng, dtype):
    for fn, args, kwargs in _calls(rng, dtype):
        result, _ = attnnb.vjp(fn, *args, **kwargs, backend=REF)
        expect = fn(*args, **kwargs, backend=REF)
        assert type(result) is type(expect)
        for got, want in zip(*(r if isinstance(r, tuple) else (r,) for r in (result, expect))):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_gradient_keys(rng):
    expected = [{"q", "k", "v", "bias", "key_size"}, {"q", "k", "v"}, {"q", "k", "v", "key_size"},
                {"q", "k", "v", "key_size"}, {"q", "k", "v", "bias", "key_size", "lam"}]
    for (fn, args, kwargs), keys in zip(_calls(rng), expected):
        result, pullback = attnnb.vjp(fn, *args, **kwargs, backend=REF)
        grads = _pull(pullback, result, rng)
        assert set(grads) == keys, fn.__name__
        assert list(grads)[:3] == ["q", "k", "v"]
    # a mask has no gradient; neither has a pattern, top_k or scale
    q, k, v = qkv(rng)
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, mask=np.ones(5, bool), scale=0.3,
                               backend=REF)
    assert set(pullback(np.ones(out.shape))) == {"q", "k", "v"}


# ---------------------------------------------------------------------------
# shapes


@pytest.mark.parametrize("bias_shape", [(), (5,), (4, 5), (1, 5), (2, 1, 1, 1), (1, 2, 4, 1),
                                        (2, 2, 4, 5), (3, 1, 4, 5)])
def test_bias_gradient_has_the_bias_shape(rng, bias_shape):
    batch = (2, 3) if bias_shape == (3, 1, 4, 5) else (2,)
    q, k, v = qkv(rng, batch=batch, hq=2, hk=1)
    bias = rng.standard_normal(bias_shape)
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, backend=REF)
    dout = rng.standard_normal(out.shape)
    grads = pullback(dout)
    assert grads["bias"].shape == bias_shape
    # the sum over the broadcast axes of the full bias's gradient
    full = np.broadcast_to(bias, batch + (2, 4, 5)).copy()
    out_full, pb_full = attnnb.vjp(attnnb.attention, q, k, v, bias=full, backend=REF)
    g_full = pb_full(dout)["bias"]
    assert g_full.shape == full.shape
    lead = len(full.shape) - len(bias_shape)
    summed = g_full.sum(axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(bias_shape) if n == 1 and summed.shape[a] != 1)
    summed = summed.sum(axis=axes, keepdims=True)
    np.testing.assert_allclose(grads["bias"], summed, rtol=0, atol=1e-12)
    for name in ("q", "k", "v"):
        np.testing.assert_allclose(grads[name], pb_full(dout)[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("size_shape", [(), (1,), (5,), (2, 5), (2, 5, 1), (1, 5)])
def test_key_size_gradient_has_the_key_size_shape(rng, size_shape):
    q, k, v = qkv(rng)
    size = rng.uniform(0.5, 2.0, size_shape)
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, key_size=size, backend=REF)
    dout = rng.standard_normal(out.shape)
    g = pullback(dout)["key_size"]
    assert g.shape == size_shape and g.dtype == np.float64
    full = np.broadcast_to(size[..., 0] if size_shape == (2, 5, 1) else size, (2, 5)).copy()
    _, pb_full = attnnb.vjp(attnnb.attention, q, k, v, key_size=full, backend=REF)
    g_full = pb_full(dout)["key_size"]
    expect = g_full.reshape(size_shape) if size_shape == (2, 5, 1) else g_full
    while expect.ndim > len(size_shape):
        expect = expect.sum(axis=0)
    axes = tuple(a for a, n in enumerate(size_shape) if n == 1 and expect.shape[a] != 1)
    expect = expect.sum(axis=axes, keepdims=True) if axes else expect
    np.testing.assert_allclose(g, expect.reshape(size_shape), rtol=0, atol=1e-12)


@pytest.mark.parametrize("lam", [0.5, np.float64(0.5), np.array(0.5), np.full((2, 1), 0.5),
                                 np.full((2, 4), 0.5), np.full((2, 2, 4), 0.5), [[0.5], [0.3]]])
def test_lam_gradient_has_the_lam_shape(rng, lam):
    q, k, v = diff_qkv(rng)
    out, pullback = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, backend=REF)
    dout = rng.standard_normal(out.shape)
    g = pullback(dout)["lam"]
    assert isinstance(g, np.ndarray) and g.shape == np.shape(lam)
    full = np.broadcast_to(np.asarray(lam, float), (2, 2, 4)).copy()
    _, pb_full = attnnb.vjp(attnnb.diff_attention, q, k, v, full, backend=REF)
    g_full = pb_full(dout)["lam"]
    np.testing.assert_allclose(g.sum(), g_full.sum(), rtol=1e-12)
    if np.shape(lam) == (2, 1):
        np.testing.assert_allclose(g[:, 0], g_full.sum(axis=(0, 2)), rtol=1e-12)


def test_qkv_gradients_have_their_shapes(rng):
    for fn, args, kwargs in _calls(rng):
        result, pullback = attnnb.vjp(fn, *args, **kwargs, backend=REF)
        grads = _pull(pullback, result, rng)
        for name, x in zip("qkv", args[:3]):
            assert grads[name].shape == x.shape, (fn.__name__, name)
    # several batch axes and no batch axis
    for batch in ((2, 3), ()):
        q, k, v = qkv(rng, batch=batch, hq=4, hk=2)
        out, pullback = attnnb.vjp(attnnb.attention, q, k, v, backend=REF)
        grads = pullback(np.ones(out.shape))
        assert [grads[n].shape for n in "qkv"] == [q.shape, k.shape, v.shape]


def test_two_dimensional_inputs_get_two_dimensional_gradients(rng):
    q, k, v = (rng.standard_normal(s) for s in ((4, 3), (5, 3), (5, 2)))
    bias, size = rng.standard_normal((4, 5)), rng.uniform(0.5, 2, 5)
    for fn, extra, kwargs in ((attnnb.attention, (), dict(bias=bias, key_size=size)),
                              (attnnb.sparse_attention, (patterns.local((4, 5), 1),),
                               dict(key_size=size)),
                              (attnnb.topk_attention, (3,), dict(key_size=size))):
        (out, lse), pullback = attnnb.vjp(fn, q, k, v, *extra, **kwargs, return_lse=True,
                                          backend=REF)
        assert out.shape == (4, 2) and lse.shape == (4,)
        grads = pullback(np.ones((4, 2)), np.ones(4))
        assert grads["q"].shape == (4, 3) and grads["k"].shape == (5, 3)
        assert grads["v"].shape == (5, 2) and grads["key_size"].shape == (5,)
        if "bias" in grads:
            assert grads["bias"].shape == (4, 5)
        # the same as the one-head 4-D problem
        _, pb4 = attnnb.vjp(fn, q[None, None], k[None, None], v[None, None], *extra,
                            **kwargs, return_lse=True, backend=REF)
        g4 = pb4(np.ones((1, 1, 4, 2)), np.ones((1, 1, 4)))
        for name in "qkv":
            np.testing.assert_array_equal(grads[name], g4[name][0, 0])


# ---------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_gradient_dtypes_follow_the_inputs(rng, dtype):
    for fn, args, kwargs in _calls(rng, dtype):
        kwargs = dict(kwargs)
        if "bias" in kwargs:
            kwargs["bias"] = kwargs["bias"].astype(dtype)
        if "key_size" in kwargs:
            kwargs["key_size"] = kwargs["key_size"].astype(dtype)
        if fn is attnnb.diff_attention:
            args = args[:3] + (np.full((2, 1), 0.5, dtype),)
        result, pullback = attnnb.vjp(fn, *args, **kwargs, backend=REF)
        for name, g in _pull(pullback, result, rng).items():
            assert g.dtype == dtype, (fn.__name__, name)


def test_mixed_and_non_float_argument_dtypes(rng):
    q, k, v = qkv(rng)
    q = q.astype(np.float32)
    bias = rng.integers(-2, 3, (4, 5))  # an integer bias: the output's dtype
    size = rng.uniform(0.5, 2, 5).astype(np.float16)
    out, pullback = attnnb.vjp(attnnb.attention, q, k.astype(np.float16), v, bias=bias,
                               key_size=size, backend=REF)
    assert out.dtype == np.float64
    grads = pullback(np.ones(out.shape))
    assert grads["q"].dtype == np.float32 and grads["k"].dtype == np.float16
    assert grads["v"].dtype == np.float64 and grads["bias"].dtype == np.float64
    assert grads["key_size"].dtype == np.float16
    # a Python float lam follows the output; lists of floats are float64, as NumPy reads them
    dq, dk, dv = diff_qkv(rng, dtype=np.float32)
    out, pullback = attnnb.vjp(attnnb.diff_attention, dq, dk, dv, 0.5, backend=REF)
    g = pullback(np.ones(out.shape))["lam"]
    assert g.dtype == np.float32 and g.shape == ()
    out, pullback = attnnb.vjp(attnnb.diff_attention, dq, dk, dv, [[0.5], [0.4]], backend=REF)
    assert pullback(np.ones(out.shape))["lam"].dtype == np.float64


def test_float16_gradients_are_float32_computations(rng):
    q, k, v = qkv(rng, dtype=np.float16)
    bias = rng.standard_normal((4, 5)).astype(np.float16)
    (out, lse), pullback = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, causal=True,
                                      return_lse=True, backend=REF)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    dout = rng.standard_normal(out.shape).astype(np.float16)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    grads = pullback(dout, dlse)
    _, pb64 = attnnb.vjp(attnnb.attention, *(x.astype(np.float64) for x in (q, k, v)),
                         bias=bias.astype(np.float64), causal=True, return_lse=True,
                         backend=REF)
    expect = pb64(dout.astype(np.float64), dlse.astype(np.float64))
    for name, g in grads.items():
        assert g.dtype == np.float16
        err = np.abs(g.astype(np.float64) - expect[name]).max() / np.abs(expect[name]).max()
        assert err < 2e-3, (name, err)


# ---------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("fn", [np.sum, lambda q, k, v: q, attnnb.tome.merge_wavg, "attention",
                                None, attnnb.diff.subln])
def test_unknown_function_is_type_error(rng, fn):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match="vjp supports attnnb.attention"):
        attnnb.vjp(fn, q, k, v, backend=REF)


def test_bad_arguments_are_the_functions_errors(rng):
    q, k, v = qkv(rng)
    for fn, args, kwargs in (
            (attnnb.attention, (q, k, v), dict(normalizer="softmax2")),
            (attnnb.attention, (q, k[..., :2], v), {}),
            (attnnb.attention, (q, k, v), dict(bias=np.ones((3, 5)))),
            (attnnb.attention, (q, k, v), dict(return_lse=1)),
            (attnnb.topk_attention, (q, k, v, -1), {}),
            (attnnb.sparse_attention, (q, k, v, patterns.local(4, 1)), {}),
            (attnnb.diff_attention, (q[0, 0], k[0, 0], v[0, 0], 0.5), {}),
            (attnnb.diff_attention, (*diff_qkv(rng), np.nan), {}),
            (attnnb.diff_attention, (*diff_qkv(rng), 0.5), dict(mode="sum"))):
        with pytest.raises((TypeError, ValueError)) as expect:
            fn(*args, **kwargs, backend=REF)
        with pytest.raises(type(expect.value)) as got:
            attnnb.vjp(fn, *args, **kwargs, backend=REF)
        assert str(got.value) == str(expect.value)
    # arguments that do not fit the signature
    with pytest.raises(TypeError):
        attnnb.vjp(attnnb.attention, q, k)
    with pytest.raises(TypeError):
        attnnb.vjp(attnnb.attention, q, k, v, no_such_option=1)


def test_cotangent_shape_and_dtype_errors(rng):
    q, k, v = qkv(rng)
    (out, lse), pullback = attnnb.vjp(attnnb.attention, q, k, v, return_lse=True, backend=REF)
    with pytest.raises(ValueError, match=r"^dout must have the shape of out, \(2, 2, 4, 2\); "
                                         r"got shape \(2, 2, 4, 3\)"):
        pullback(np.ones((2, 2, 4, 3)))
    with pytest.raises(ValueError, match=r"^dout .*got shape \(2, 2, 4\)"):
        pullback(np.ones(lse.shape))
    with pytest.raises(ValueError, match=r"^dlse must have the shape of lse, \(2, 2, 4\)"):
        pullback(np.ones(out.shape), np.ones((2, 2, 1)))
    with pytest.raises(TypeError, match="^dout must have a floating dtype"):
        pullback(np.ones(out.shape, int))
    with pytest.raises(TypeError, match="^dout must be an array, got None"):
        pullback(None)
    with pytest.raises(TypeError, match="^dlse must have a floating dtype"):
        pullback(np.ones(out.shape), np.ones(lse.shape, bool))
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, backend=REF)
    with pytest.raises(TypeError):  # no lse was returned, so there is no dlse to give
        pullback(np.ones(out.shape), np.ones(lse.shape))
    dq, dk, dv = diff_qkv(rng)
    out, pullback = attnnb.vjp(attnnb.diff_attention, dq, dk, dv, 0.5, backend=REF)
    with pytest.raises(ValueError, match=r"^dout must have the shape of out, \(2, 2, 4, 3\)"):
        pullback(np.ones((2, 4, 4, 3)))


@pytest.mark.parametrize("backend", ["cpu", None])
def test_backend_without_gradients_says_so_before_any_work(rng, monkeypatch, backend):
    """A backend lacking a backward pass: NotImplementedError, before the forward runs.

    The cpu backend stands in for one: its gradient operations are taken out
    of the registry for this test, whether or not they exist.
    """
    monkeypatch.delenv("ATTNNB_BACKEND", raising=False)
    for op in _dispatch.GRADIENT_OPERATIONS:
        monkeypatch.delitem(_dispatch._REGISTRY, (op, "cpu"), raising=False)
        monkeypatch.delitem(_dispatch._LOADED, (op, "cpu"), raising=False)
    ran = []
    monkeypatch.setitem(_dispatch._LOADED, ("attention", "cpu"), lambda *a: ran.append(a))
    q, k, v = qkv(rng)
    with pytest.raises(NotImplementedError,
                       match="^attention gradients are not implemented on the cpu backend yet"):
        attnnb.vjp(attnnb.attention, q, k, v, backend=backend)
    assert not ran  # the forward never ran
    for fn, extra in ((attnnb.sparse_attention, (patterns.local((4, 5), 1),)),
                      (attnnb.topk_attention, (2,))):
        with pytest.raises(NotImplementedError, match=f"^{fn.__name__} gradients are not "
                                                      "implemented on the cpu backend yet"):
            attnnb.vjp(fn, q, k, v, *extra, backend="cpu")
    with pytest.raises(RuntimeError, match="^diff_attention gradients .* cpu backend yet"):
        attnnb.vjp(attnnb.diff_attention, *diff_qkv(rng), 0.5, backend="cpu")


def test_missing_gradient_message_and_cuda_gradients_registered():
    err = _dispatch._not_implemented("attention_vjp", "cuda")
    assert isinstance(err, NotImplementedError) and isinstance(err, RuntimeError)
    assert str(err) == "attention gradients are not implemented on the cuda backend yet"
    for op in _dispatch.GRADIENT_OPERATIONS:  # tested under the simulator: tests/cuda_sim
        assert _dispatch._REGISTRY[(op, "cuda")] == f"attnnb.cuda.backward:{op}"


# ---------------------------------------------------------------------------
# the cotangent of the LSE


def test_dlse_none_is_zero_and_given_dlse_counts(rng):
    for normalizer in ("softmax", "softmax1", "relu_expm1"):
        q, k, v = qkv(rng)
        (out, lse), pullback = attnnb.vjp(attnnb.attention, q, k, v, normalizer=normalizer,
                                          bias=np.zeros(5), return_lse=True, backend=REF)
        dout = rng.standard_normal(out.shape)
        none, zeros = pullback(dout), pullback(dout, np.zeros(lse.shape))
        assert none.keys() == zeros.keys()
        for name in none:
            np.testing.assert_array_equal(none[name], zeros[name])
        only_lse = pullback(np.zeros(out.shape), np.ones(lse.shape))
        assert np.abs(only_lse["q"]).max() > 0
        # the gradient is linear in the cotangents
        both = pullback(dout, np.ones(lse.shape))
        for name in both:
            np.testing.assert_allclose(both[name], none[name] + only_lse[name], atol=1e-12)
        # d lse / d bias[j] is the weight of key j over S: each row's sum is 1 (softmax)
        if normalizer != "relu_expm1":
            np.testing.assert_allclose(only_lse["bias"].sum(), np.prod(lse.shape), rtol=1e-12)


def test_the_lse_cotangent_without_the_output_one(rng):
    q, k, v = qkv(rng)
    (out, lse), pullback = attnnb.vjp(attnnb.topk_attention, q, k, v, 3, return_lse=True,
                                      backend=REF)
    grads = pullback(np.zeros(out.shape), rng.standard_normal(lse.shape))
    assert np.all(grads["v"] == 0)  # the LSE does not read v
    assert np.abs(grads["k"]).max() > 0


# ---------------------------------------------------------------------------
# reuse


def test_repeated_pullbacks_agree_and_are_independent(rng):
    for fn, args, kwargs in _calls(rng):
        result, pullback = attnnb.vjp(fn, *args, **kwargs, backend=REF)
        out = result[0] if isinstance(result, tuple) else result
        dout = rng.standard_normal(out.shape)
        lse_args = (np.ones(result[1].shape),) if isinstance(result, tuple) else ()
        first = pullback(dout, *lse_args)
        first_copy = {n: g.copy() for n, g in first.items()}
        second = pullback(dout, *lse_args)
        for g in first.values():
            g[...] = 0  # the caller owns the arrays it gets
        third = pullback(dout, *lse_args)
        for name in first_copy:
            np.testing.assert_array_equal(second[name], first_copy[name])
            np.testing.assert_array_equal(third[name], first_copy[name])
        scaled = pullback(2 * dout, *(2 * a for a in lse_args))
        for name in first_copy:
            np.testing.assert_allclose(scaled[name], 2 * first_copy[name], atol=1e-12)


def test_threaded_pullbacks_match_serial_ones(rng):
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=6, lk=7)
    (out, lse), pullback = attnnb.vjp(attnnb.attention, q, k, v, bias=rng.standard_normal(7),
                                      key_size=rng.uniform(0.5, 2, 7), causal=True,
                                      return_lse=True, backend=REF)
    douts = [rng.standard_normal(out.shape) for _ in range(8)]
    serial = [pullback(d, d[..., 0]) for d in douts]
    results = [None] * len(douts)
    barrier = threading.Barrier(len(douts))

    def work(i):
        barrier.wait()
        for _ in range(3):
            results[i] = pullback(douts[i], douts[i][..., 0])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(douts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, serial):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_pullback_keeps_the_forwards_backend(rng, monkeypatch):
    monkeypatch.delenv("ATTNNB_BACKEND", raising=False)
    q, k, v = qkv(rng)
    with attnnb.use_backend("reference"):
        out, pullback = attnnb.vjp(attnnb.attention, q, k, v)
    grads = pullback(np.ones(out.shape))  # outside the context: still the reference
    _, pb = attnnb.vjp(attnnb.attention, q, k, v, backend=REF)
    for name, g in pb(np.ones(out.shape)).items():
        np.testing.assert_array_equal(grads[name], g)


def test_inputs_are_never_written_and_read_only_inputs_work(rng):
    q, k, v = qkv(rng)
    bias, size = rng.standard_normal((4, 5)), rng.uniform(0.5, 2, 5)
    arrays = (q, k, v, bias, size)
    before = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False
    (out, lse), pullback = attnnb.vjp(attnnb.attention, q, np.asfortranarray(k), v[..., ::1],
                                      bias=bias, key_size=size, return_lse=True, backend=REF)
    dout = np.ones(out.shape)
    dout.flags.writeable = False
    pullback(dout, None)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b)


def test_readme_gradients_block_runs():
    text = README.read_text()
    match = re.search(r"<!-- usage:gradients -->\n```python\n(.*?)```\n.*?"
                      r"<!-- /usage:gradients -->", text, re.S)
    assert match, "README has no usage:gradients block"
    namespace = {}
    exec(compile(match.group(1), "README.md:usage:gradients", "exec"), namespace)
    grads = namespace["grads"]
    assert grads["q"].shape == (2, 4, 16, 8) and grads["bias"].shape == (16, 16)

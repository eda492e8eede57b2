"""Helpers shared by the test modules: random data, tolerances, comparisons.

The tolerances and the comparison are those of ``python -m attnnb check``
(:mod:`attnnb.check`), so the tests and the command agree on what "close" means.
"""

from __future__ import annotations

import numpy as np

from attnnb.check import TOLERANCE, relative_error

HOST_BACKENDS = ("reference", "cpu")

# relative tolerances against the float64 reference, by dtype (one definition: attnnb.check)
RTOL = TOLERANCE


def randn(rng, shape, dtype=np.float64, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def qkv(rng, batch=(), hq=2, hk=None, lq=7, lk=9, d=8, dv=None, dtype=np.float64, scale=1.0):
    """Random ``q, k, v`` of the SDPA layout ``(*batch, H, L, D)``."""
    hk = hq if hk is None else hk
    dv = d if dv is None else dv
    return (randn(rng, batch + (hq, lq, d), dtype, scale),
            randn(rng, batch + (hk, lk, d), dtype, scale),
            randn(rng, batch + (hk, lk, dv), dtype, scale))


def assert_close(actual, expected, dtype=None, rtol=None, what="output"):
    """Relative comparison scaled by the largest finite magnitude of ``expected``.

    NaN and infinities must sit in the same places (infinities with the same
    signs); see :func:`attnnb.check.relative_error`.  ``rtol`` defaults to the
    tolerance of ``dtype`` (default: ``actual``'s dtype).
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if rtol is None:
        rtol = RTOL[np.dtype(dtype if dtype is not None else actual.dtype)]
    err, problem = relative_error(actual, expected)
    assert not problem, f"{what}: {problem}"
    assert err <= rtol, f"{what}: max relative error {err:.3g} > {rtol:.3g}"


_JIT_CALLERS: dict = {}


def from_jit(fn):
    """``fn`` (a shared loop of the cpu backend) called through a ``numba.njit`` function.

    Shared loops are compiled only to be inlined into kernels and have no entry point
    from Python (:mod:`attnnb.cpu._numba_patches.linking`); the caller is compiled from their IR, as
    a kernel is.  One caller per function, compiled for each new argument types.
    """
    caller = _JIT_CALLERS.get(fn)
    if caller is None:
        import numba

        def call(*args):
            return fn(*args)

        caller = _JIT_CALLERS[fn] = numba.njit(call)
    return caller


def assert_gradients_near_fd(fn, inputs, rng, *, lse=False, points=6, eps=1e-6, **fixed):
    """:func:`attnnb.vjp`'s gradients of ``fn(**inputs, **fixed)`` in every entry of
    ``inputs`` against central differences at ``points`` random indices each (random
    cotangents of the output, and of the LSE with ``lse``; the dropout seed, if any, in
    ``fixed``)."""
    import attnnb

    if lse:
        fixed = dict(fixed, return_lse=True)
    result, pullback = attnnb.vjp(fn, **inputs, **fixed)
    outs = result if lse else (result,)
    cotangents = [rng.standard_normal(np.shape(o)) for o in outs]
    grads = pullback(*cotangents)

    def loss(**over):
        res = fn(**{**inputs, **over}, **fixed)
        return sum(np.sum(c * r) for c, r in zip(cotangents, res if lse else (res,)))

    for name, x in inputs.items():
        for _ in range(points):
            idx = tuple(rng.integers(0, n) for n in np.shape(x))
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)
            assert abs(fd - grads[name][idx]) <= 1e-6 * (1 + abs(fd)), (name, idx)


def assert_drops_the_reference_keys(q, k, v, backend, causal):
    """Dropout 0.4 with one-hot values ``v``: the output is each row's dropped weights, so
    ``backend`` must zero exactly the reference's entries and agree on the rest (and on
    the LSE, that of the weights before dropout) to rounding.  Returns the reference's
    output."""
    import attnnb

    kw = dict(dropout_p=0.4, seed=2024, causal=causal, return_lse=True)
    ref, ref_lse = attnnb.attention(q, k, v, backend="reference", **kw)
    out, lse = attnnb.attention(q, k, v, backend=backend, **kw)
    np.testing.assert_array_equal(out == 0, ref == 0)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    return ref


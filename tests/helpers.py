"""Helpers shared by the test modules: random data, tolerances, comparisons."""

from __future__ import annotations

import numpy as np

HOST_BACKENDS = ("reference", "cpu")

# relative tolerances against the float64 reference, by compute dtype
RTOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12, np.dtype(np.float16): 2e-3}


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

    NaN and infinities must sit in the same places.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if rtol is None:
        rtol = RTOL[np.dtype(dtype if dtype is not None else actual.dtype)]
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isinf(a), np.isinf(e), err_msg=f"{what}: Inf positions")
    fin = np.isfinite(e)
    if not fin.any():
        return
    np.testing.assert_array_equal(a[np.isinf(e)], e[np.isinf(e)], err_msg=f"{what}: Inf signs")
    scale = max(np.abs(e[fin]).max(), 1e-300)
    err = np.abs(a[fin] - e[fin]).max() / scale
    assert err <= rtol, f"{what}: max relative error {err:.3g} > {rtol:.3g}"

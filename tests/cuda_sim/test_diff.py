"""diff_attention() on the cuda backend against the float64 reference."""

import numpy as np
import pytest

from ..helpers import assert_close, randn
from .common import assert_several_tiles, host, n, to_device

diff = pytest.importorskip("attnnb.diff", reason="diff_attention is not in this tree yet")
MODES = ("difference", "rectified")


def packed(rng, batch=(), h=2, hk=1, lq=5, lk=7, d=3, dv=4, dtype=np.float64):
    """q ``(*batch, 2h, lq, d)``, k ``(*batch, 2hk, lk, d)``, v ``(*batch, hk, lk, dv)``."""
    return (randn(rng, batch + (2 * h, lq, d), dtype), randn(rng, batch + (2 * hk, lk, d), dtype),
            randn(rng, batch + (hk, lk, dv), dtype))


def compare(q, k, v, lam, dtype=None, **kw):
    out = diff.diff_attention(q, k, v, lam, backend="cuda", **kw)
    ref = diff.diff_attention(q, k, v, lam, backend="reference", **kw)
    assert isinstance(out, np.ndarray) and out.dtype == ref.dtype
    assert_close(out, ref, dtype or out.dtype)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_every_option(rng, dtype, mode, causal):
    """GQA pairs, per-token lam, mask + bias + key_size, Lq != Lk."""
    lq, lk = n(6), n(10)
    q, k, v = packed(rng, batch=(2,), h=4, hk=2, lq=lq, lk=lk, dtype=dtype)
    lam = rng.uniform(0.2, 0.9, (2, 4, lq))
    mask = rng.random((lq, lk)) > 0.25
    bias = rng.standard_normal((4, 1, lk))
    key_size = rng.integers(1, 4, (2, lk))
    compare(q, k, v, lam, mask=mask, bias=bias, key_size=key_size, causal=causal, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lam", [0.0, 0.8, "per_head"])
def test_lam_shapes(rng, mode, lam):
    q, k, v = packed(rng, h=2, hk=2, lq=n(5), lk=n(8))
    lam = np.array([[0.3], [1.2]]) if lam == "per_head" else lam
    compare(q, k, v, lam, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_empty_rows_no_keys_and_nan(rng, mode):
    q, k, v = packed(rng, h=2, hk=2, lq=5, lk=6)
    mask = np.ones((2, 5, 6), bool)
    mask[1, 2] = False
    q[3, 4, 0] = np.nan  # pair 1, second component, query 4
    v[0, 5] = np.inf  # key 5 of pair 0, masked below for every query
    mask[0, :, 5] = False
    out = compare(q, k, v, 0.6, mask=mask, mode=mode)
    assert np.all(out[1, 2] == 0)
    assert np.isnan(out[1, 4]).all() and np.isfinite(out[0]).all()
    out0 = diff.diff_attention(q, k[:, :0], v[:, :0], 0.6, mode=mode, backend="cuda")
    assert out0.shape == (2, 5, 4) and np.all(out0 == 0)
    v[0, 5] = 1.0  # unmasked below
    compare(q[:, :4], k, v, 0.6, causal=True, mode=mode)  # Lq < Lk
    compare(np.concatenate([q, q], axis=1), k, v, 0.6, causal=True, mode=mode)  # Lq > Lk


@pytest.mark.parametrize("mode", MODES)
def test_device_arrays_in_and_out(rng, mode):
    q, k, v = packed(rng, batch=(2,), h=2, hk=1, lq=n(5), lk=n(6), dtype=np.float32)
    lam = np.full((2, 1), 0.7, np.float32)
    mask = rng.random((q.shape[-2], k.shape[-2])) > 0.2
    ref = diff.diff_attention(q, k, v, lam, mask=mask, mode=mode, backend="reference")
    out = diff.diff_attention(*to_device(q, k, v), lam, mask=to_device(mask)[0], mode=mode)
    assert hasattr(out, "copy_to_host") and out.shape == ref.shape
    assert_close(host(out), ref, np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_several_tiles_per_axis(rng, mode):
    """Three query and three key tiles, value columns over the threads of a row (one
    padded), head size padded, a signed per-token lam (0 for one row) and an Inf value
    in a middle key tile that both maps weight (difference: NaN or Inf, as two calls)."""
    lq, lk, d, dv = n(11), n(16), 5, 7
    assert_several_tiles(lq, lk, d, dv, streams=2)
    q, k, v = packed(rng, batch=(1,), h=2, hk=1, lq=lq, lk=lk, d=d, dv=dv, dtype=np.float32)
    lam = rng.uniform(-0.3, 0.9, (1, 2, lq))
    lam[0, 1, 3] = 0.0
    compare(q, k, v, lam, mode=mode)
    v[0, 0, lk // 2, 3] = np.inf
    for causal in (False, True):
        out = compare(q, k, v, lam, causal=causal, mode=mode)
        assert np.isfinite(np.delete(out, 3, axis=-1)).all()


def test_heaviside_mode_is_refused_on_cuda(rng):
    q = rng.standard_normal((1, 2, 4, 4))
    with pytest.raises(NotImplementedError, match="heaviside"):
        diff.diff_attention(q, q, q[:, :1], 0.5, mode="heaviside", backend="cuda")

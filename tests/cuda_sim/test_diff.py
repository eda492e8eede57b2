"""diff_attention() on the cuda backend against the float64 reference: the output of
every mode and the Heaviside mode's gradients (the other modes' are in test_backward)."""

import numpy as np
import pytest

import attnnb

from ..helpers import assert_close, randn
from .common import assert_several_tiles, host, n, to_device
from .test_backward import gradients

diff = pytest.importorskip("attnnb.diff", reason="diff_attention is not in this tree yet")
MODES = ("difference", "rectified", "heaviside")


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


def maps_and_gates(q, k, v, lam, **kw):
    """``(A1, A2, H)``: the exact maps of a call and its Heaviside gates ``H(A1 - lam A2)``
    (which keys of which rows lam is subtracted from)."""
    _, a1, a2 = attnnb.weights(diff.diff_attention, q, k, v, lam, maps=True, **kw)
    return a1, a2, a1 - np.broadcast_to(lam, a1.shape[:-1])[..., None] * a2 > 0


def test_heaviside_gate_flips_on_many_keys(rng):
    """lam near the ratio of the two maps: the gate is set on some keys of a row and
    clear on others (and a whole row each way: lam very negative, lam very large)."""
    lq, lk = n(9), n(14)
    q, k, v = packed(rng, h=2, hk=1, lq=lq, lk=lk, d=4, dv=5)
    lam = rng.uniform(0.6, 1.6, (2, lq))
    lam[0, 2], lam[1, 5] = -3.0, 40.0
    a1, _, h = maps_and_gates(q, k, v, lam, causal=True)
    assert h[0, 2, :3].all() and not h[1, 5].any()
    allowed = a1 > 0
    assert 0.25 < h.sum() / allowed.sum() < 0.75
    assert (h.any(-1) & (allowed & ~h).any(-1)).sum() >= lq  # rows with keys either way
    compare(q, k, v, lam, causal=True, mode="heaviside")


def heaviside_gradients(args, dtype, rtol=None, two_streams=None, **kw):
    """Every gradient of ``diff_attention(*args, mode="heaviside", **kw)`` on cuda (the
    pair streams, or ``two_streams``) against the reference's; returns cuda's."""
    kw = dict(kw, mode="heaviside")
    got = gradients(diff.diff_attention, args, kw, "cuda", two_streams=two_streams)
    want = gradients(diff.diff_attention, args, kw, "reference")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape
        assert got[name].dtype == want[name].dtype == np.dtype(dtype), name
        assert_close(got[name], want[name], dtype, rtol=rtol, what=f"d{name}")
    return got


@pytest.mark.parametrize("two_streams", [None, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_heaviside_gradients_every_option(rng, dtype, two_streams):
    """GQA (two pairs over one key pair), Lq != Lk across several tiles, causal, a mask
    with an empty row, bias, key sizes, signed per-token lam: the second map's queries
    and keys get zeros; through the pair streams and the two-stream kernels."""
    lq, lk = n(11), n(14)
    q, k, v = packed(rng, h=2, hk=1, lq=lq, lk=lk, d=5, dv=7, dtype=dtype)
    lam = rng.uniform(-0.4, 1.4, (2, lq)).astype(dtype)
    mask = rng.random((lq, lk)) > 0.25
    mask[3] = False
    kw = dict(mask=mask, bias=randn(rng, (lq, lk), dtype), causal=True,
              key_size=rng.integers(1, 4, (lk,)).astype(dtype))
    got = heaviside_gradients((q, k, v, lam), dtype, 1e-4 if dtype == np.float32 else None,
                              two_streams, **kw)
    assert not got["q"][1::2].any() and not got["k"][1::2].any()
    assert got["q"][0::2].any() and got["lam"].any()


@pytest.mark.parametrize("lam", [0.7, "per_head"])
def test_heaviside_gradients_one_pair_and_lam_shapes(rng, lam):
    """One pair, a scalar lam or one per head (their gradients summed over the rows),
    causal with Lq > Lk (the first rows see no key)."""
    q, k, v = packed(rng, batch=(2,), h=1 if lam == 0.7 else 2, hk=1, lq=n(10), lk=n(7))
    lam = np.array([[0.5], [-0.6]]) if lam == "per_head" else lam
    heaviside_gradients((q, k, v, lam), np.float64, causal=True)


def test_heaviside_first_map_zero_where_the_gate_is_set(rng):
    """lam < 0 sets the gate wherever the second map weighs a key, also where the first
    map underflows to 0 (its queries scaled up): those keys weigh ``-lam``, their values
    get ``-lam dout`` and lam the rows' ``dP``, while ``ds1`` is 0 there."""
    q, k, v = packed(rng, h=2, hk=2, lq=n(6), lk=n(9))
    q[0::2] *= 300.0
    lam = np.array([[-0.5], [-0.9]])
    a1, _, h = maps_and_gates(q, k, v, lam)
    assert h.all() and (a1 == 0).sum() >= 10
    out = compare(q, k, v, lam, mode="heaviside")
    assert np.isfinite(out).all()
    heaviside_gradients((q, k, v, lam), np.float64)


def sinks_gradients(args, dtype, two_streams=None, **kw):
    """The output and every gradient (the sinks' included) of ``diff_attention(*args,
    **kw)`` on cuda against the reference's (``two_streams``: the backward's route)."""
    compare(*args, **kw)
    got = gradients(diff.diff_attention, args, kw, "cuda", two_streams=two_streams)
    want = gradients(diff.diff_attention, args, kw, "reference")
    assert got.keys() == want.keys() and "sinks" in want
    for name in want:
        assert isinstance(got[name], np.ndarray) and got[name].shape == want[name].shape
        assert got[name].dtype == want[name].dtype == np.dtype(dtype), name
        assert_close(got[name], want[name], dtype, 1e-4 if dtype == np.float32 else None,
                     what=f"d{name}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("mode", MODES)
def test_sinks_every_option(rng, dtype, mode):
    """A learned sink per component map: GQA (two pairs over one key pair), causal with
    Lq < Lk, a mask with an empty row (its maps weigh nothing), bias, key sizes, signed
    per-token lam; the forward and every gradient."""
    lq, lk = n(5), n(7)
    q, k, v = packed(rng, h=2, hk=1, lq=lq, lk=lk, dtype=dtype)
    lam = rng.uniform(-0.4, 1.2, (2, lq)).astype(dtype)
    mask = rng.random((lq, lk)) > 0.25
    mask[2] = False
    sinks = rng.uniform(-1.0, 1.5, 4).astype(dtype)
    sinks_gradients((q, k, v, lam), dtype, mask=mask, bias=randn(rng, (lq, lk), dtype),
                    causal=True, key_size=rng.integers(1, 4, (lk,)).astype(dtype),
                    sinks=sinks, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_sinks_two_stream_backward(rng, mode):
    """The two-stream kernels read the maps' normalisers, sinks in, as the pair streams."""
    q, k, v = packed(rng, batch=(2,), h=1, hk=1, lq=n(4), lk=n(6))
    sinks_gradients((q, k, v, 0.6), np.float64, two_streams=True, causal=True,
                    sinks=rng.uniform(-1.0, 1.0, (2, 2)), mode=mode)


def test_sinks_device_arrays(rng):
    """Device q, k, v with host sinks: the forward, and vjp's maps' LSEs for the sinks'
    gradient (the streams gathered from device arrays)."""
    q, k, v = packed(rng, batch=(1,), h=2, hk=1, lq=n(4), lk=n(5), dtype=np.float32)
    sinks = rng.uniform(-1.0, 1.0, (1, 4)).astype(np.float32)
    out, pullback = attnnb.vjp(diff.diff_attention, *to_device(q, k, v), 0.7, sinks=sinks,
                               backend="cuda")
    ref, ref_pullback = attnnb.vjp(diff.diff_attention, q, k, v, 0.7, sinks=sinks,
                                   backend="reference")
    assert hasattr(out, "copy_to_host")
    assert_close(host(out), ref, np.float32)
    dout = rng.standard_normal(ref.shape).astype(np.float32)
    got, want = pullback(to_device(dout)[0]), ref_pullback(dout)
    for name in ("q", "k", "v", "sinks"):
        assert_close(host(got[name]), want[name], np.float32, 1e-4, what=f"d{name}")

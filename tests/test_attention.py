"""attention(): every host backend against the float64 reference, and the reference
against a literal transcription of the contract (docs/contract.md §1), on awkward shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnnb

from .helpers import HOST_BACKENDS, RTOL, assert_close, qkv

OTHERS = [b for b in HOST_BACKENDS if b != "reference"]


def compare_backends(q, k, v, *, backends=OTHERS, **options):
    """Every backend's ``(out, lse)`` against the reference's; returns the reference's."""
    ref, ref_lse = attnnb.attention(q, k, v, return_lse=True, backend="reference", **options)
    comp = np.dtype(np.float64) if ref.dtype == np.float64 else np.dtype(np.float32)
    for backend in backends:
        out, lse = attnnb.attention(q, k, v, return_lse=True, backend=backend, **options)
        assert out.dtype == ref.dtype and lse.dtype == ref_lse.dtype, backend
        rtol = RTOL[np.dtype(ref.dtype)] if ref.dtype == np.float16 else RTOL[comp]
        assert_close(out, ref, rtol=rtol, what=f"{backend} out")
        assert_close(lse, ref_lse, rtol=rtol, what=f"{backend} lse")
    return ref, ref_lse


def naive_attention(q, k, v, *, mask=None, bias=None, key_size=None, causal=False, scale=None,
                    normalizer="softmax"):
    """The contract read literally, one query row at a time, in float64.

    q ``(H, Lq, D)``, k ``(Hk, Lk, D)``, v ``(Hk, Lk, Dv)``; mask/bias ``(H, Lq, Lk)``,
    key_size ``(Lk,)``.  Returns ``out (H, Lq, Dv)`` and ``lse (H, Lq)``.
    """
    H, Lq, D = q.shape
    Hk, Lk, Dv = v.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    sizes = np.ones(Lk) if key_size is None else key_size
    out = np.zeros((H, Lq, Dv))
    lse = np.full((H, Lq), -np.inf)
    for h in range(H):
        g = h // (H // Hk)
        for i in range(Lq):
            num = np.zeros(Dv)
            z = 0.0
            for j in range(Lk):
                if mask is not None and not mask[h, i, j]:
                    continue
                if causal and j > i + Lk - Lq:
                    continue
                s = scale * float(q[h, i] @ k[g, j]) + (0.0 if bias is None else bias[h, i, j])
                phi = max(0.0, math.expm1(s)) if normalizer == "relu_expm1" else math.exp(s)
                num += sizes[j] * phi * v[g, j]
                z += sizes[j] * phi
            if z > 0:
                out[h, i] = num / (z + 1 if normalizer == "softmax1" else z)
                lse[h, i] = math.log(z)
    return out, lse


@pytest.mark.parametrize("normalizer", ["softmax", "softmax1", "relu_expm1"])
def test_reference_is_the_contract(rng, normalizer):
    H, Hk, Lq, Lk, D, Dv = 4, 2, 5, 7, 3, 2
    q, k, v = qkv(rng, hq=H, hk=Hk, lq=Lq, lk=Lk, d=D, dv=Dv)
    mask = rng.random((H, Lq, Lk)) < 0.7
    mask[1, 2] = False  # an empty row
    bias = rng.standard_normal((H, Lq, Lk))
    key_size = rng.integers(1, 4, Lk).astype(float)
    want, want_lse = naive_attention(q, k, v, mask=mask, bias=bias, key_size=key_size,
                                     causal=True, scale=0.8, normalizer=normalizer)
    out, lse = attnnb.attention(q, k, v, mask=mask, bias=bias, key_size=key_size, causal=True,
                                scale=0.8, normalizer=normalizer, return_lse=True,
                                backend="reference")
    assert_close(out, want, rtol=1e-12)
    assert_close(lse, want_lse, rtol=1e-12, what="lse")
    assert np.isneginf(lse[1, 2]) and not out[1, 2].any()


SHAPES = {
    # name: (batch, hq, hk, lq, lk, d, dv)
    "awkward": ((), 3, 3, 70, 131, 16, 12),
    "lq>lk": ((2,), 2, 2, 77, 45, 8, 8),
    "one head": ((), 1, 1, 65, 64, 5, 7),
    "gqa batch (2,3)": ((2, 3), 6, 2, 9, 130, 4, 3),
    "mqa": ((1,), 4, 1, 64, 63, 8, 8),
    "one query": ((2,), 2, 1, 1, 129, 8, 4),
    "one key": ((), 2, 2, 66, 1, 8, 4),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_shapes(rng, shape, dtype, causal):
    batch, hq, hk, lq, lk, d, dv = SHAPES[shape]
    q, k, v = qkv(rng, batch=batch, hq=hq, hk=hk, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype)
    ref, lse = compare_backends(q, k, v, causal=causal)
    assert ref.shape == batch + (hq, lq, dv) and lse.shape == batch + (hq, lq)
    assert ref.dtype == dtype
    if causal and lq > lk:  # queries before the first key see nothing
        assert not ref[..., : lq - lk, :].any()
        assert np.isneginf(lse[..., : lq - lk]).all()
        assert np.isfinite(lse[..., lq - lk:]).all()


# (d, dv, lq, lk) reaching every path of the register-blocked products: value widths of
# 16, 64 + 16, 32 + a 16-wide block reaching back over 8 columns (40), 160 = 64 + 64 + 32,
# and below 16 (row by row); query tiles whose last 4-row block reaches back (69, 66, 131);
# partial last key tiles of 5, 20, 40 and 2 keys (padded to 16, 32, 64 and 16 columns);
# fewer than 4 query rows (decoding), where the products go row by row.
HEAD_SIZES = [(16, 16, 69, 197), (40, 40, 66, 84), (80, 20, 131, 104), (24, 160, 5, 130),
              (160, 12, 2, 197), (96, 96, 3, 69)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, dv, lq, lk", HEAD_SIZES)
def test_head_sizes(rng, d, dv, lq, lk, dtype, causal):
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype)
    compare_backends(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_2d_inputs(rng, causal):
    q, k, v = (rng.standard_normal(s) for s in ((70, 8), (67, 8), (67, 5)))
    ref, lse = compare_backends(q, k, v, causal=causal)
    assert ref.shape == (70, 5) and lse.shape == (70,)
    full = attnnb.attention(q[None], k[None], v[None], causal=causal, backend="reference")
    np.testing.assert_array_equal(ref, full[0])


@pytest.mark.parametrize("lq, lk, dv", [(0, 5, 4), (5, 0, 4), (0, 0, 4), (5, 6, 0)])
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_zero_lengths(rng, backend, lq, lk, dv):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=lq, lk=lk, d=4, dv=dv, dtype=np.float32)
    out, lse = attnnb.attention(q, k, v, return_lse=True, backend=backend)
    assert out.shape == (2, 2, lq, dv) and out.dtype == np.float32
    assert lse.shape == (2, 2, lq) and lse.dtype == np.float32
    assert not out.any()
    if lk == 0:  # no key at all: every row is empty
        assert np.isneginf(lse).all()
    else:
        assert np.isfinite(lse).all()


@pytest.mark.parametrize("backend", OTHERS)
def test_float16(rng, backend):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=70, lk=67, d=8, dtype=np.float16)
    ref, lse = compare_backends(q, k, v, backends=[backend], causal=True)
    assert ref.dtype == np.float16 and lse.dtype == np.float32


@pytest.mark.parametrize("dtypes, want", [
    ((np.float16, np.float32, np.float16), np.float32),
    ((np.float32, np.float64, np.float32), np.float64),
    ((np.float16, np.float16, np.float64), np.float64),
    ((np.float32, np.float32, np.float32), np.float32),
])
def test_mixed_dtypes(rng, dtypes, want):
    q, k, v = qkv(rng, hq=2, lq=9, lk=11, d=4)
    q, k, v = (x.astype(t) for x, t in zip((q, k, v), dtypes, strict=True))
    assert np.result_type(*dtypes) == want
    out, lse = compare_backends(q, k, v)
    assert out.dtype == want and lse.dtype == want


def _options(rng, batch, hq, lq, lk, dtype):
    """Named option sets covering every argument of attention()."""
    r = rng.random
    return {
        "mask key padding (Lk,)": dict(mask=r(lk) < 0.7),
        "mask (Lq,Lk)": dict(mask=r((lq, lk)) < 0.6),
        "mask (Hq,1,Lk)": dict(mask=r((hq, 1, lk)) < 0.6),
        "mask (*batch,1,1,Lk)": dict(mask=r(batch + (1, 1, lk)) < 0.6),
        "mask full": dict(mask=r(batch + (hq, lq, lk)) < 0.6),
        "bias (Lq,Lk)": dict(bias=rng.standard_normal((lq, lk)).astype(dtype)),
        "bias (Hq,Lq,Lk) float64": dict(bias=rng.standard_normal((hq, lq, lk))),
        "bias int": dict(bias=rng.integers(-2, 3, (lq, lk))),
        "key_size (Lk,)": dict(key_size=rng.integers(1, 5, lk).astype(dtype)),
        "key_size (*batch,Lk)": dict(key_size=r(batch + (lk,)) * 3 + 0.1),
        "key_size ToMe (B,N,1)": dict(key_size=rng.integers(1, 5, batch + (lk, 1))),
        "causal": dict(causal=True),
        "scale": dict(scale=0.37),
        "softmax1": dict(normalizer="softmax1"),
        "relu_expm1": dict(normalizer="relu_expm1"),
        "relu_expm1 causal key_size": dict(normalizer="relu_expm1", causal=True,
                                           key_size=rng.integers(1, 5, lk)),
        "everything softmax1": dict(mask=r((lq, lk)) < 0.8, bias=rng.standard_normal((lq, lk)),
                                    key_size=r(lk) + 0.5, causal=True, scale=0.5,
                                    normalizer="softmax1"),
    }


OPTION_NAMES = list(_options(np.random.default_rng(0), (2,), 3, 5, 6, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", OPTION_NAMES)
def test_options(rng, name, dtype):
    batch, hq, hk, lq, lk = (2,), 3, 1, 70, 131
    q, k, v = qkv(rng, batch=batch, hq=hq, hk=hk, lq=lq, lk=lk, d=8, dv=6, dtype=dtype, scale=2)
    options = _options(rng, batch, hq, lq, lk, dtype)[name]
    compare_backends(q, k, v, **options)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_empty_rows(rng, backend):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=70, lk=67, d=8, dtype=np.float32)
    mask = rng.random((70, 67)) < 0.5
    mask[[0, 5, 69]] = False
    for normalizer in ("softmax", "softmax1", "relu_expm1"):
        out, lse = attnnb.attention(q, k, v, mask=mask, normalizer=normalizer,
                                    return_lse=True, backend=backend)
        assert not out[..., [0, 5, 69], :].any()
        assert np.isneginf(lse[..., [0, 5, 69]]).all()
        assert np.isfinite(out).all()


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_relu_expm1_all_logits_nonpositive_is_empty(backend):
    # q . k < 0 everywhere: every weight is max(0, e^s - 1) = 0, so Z = 0: an empty row
    q = np.ones((1, 3, 4))
    k = -np.abs(np.random.default_rng(1).standard_normal((1, 5, 4))) - 0.1
    v = np.ones((1, 5, 2))
    out, lse = attnnb.attention(q, k, v, normalizer="relu_expm1", return_lse=True,
                                backend=backend)
    assert not out.any() and np.isneginf(lse).all()

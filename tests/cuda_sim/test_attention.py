"""attention() on the cuda backend against the float64 reference, every option."""

import numpy as np
import pytest

import attnnb

from ..helpers import assert_close, qkv
from .common import check_against_reference, host, n, to_device

DTYPES = [np.float32, np.float64]
NORMALIZERS = ["softmax", "softmax1", "relu_expm1"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_every_option(rng, dtype, causal, normalizer):
    """GQA, Lq != Lk, Dv != D, mask + bias + key_size + causal at once."""
    lq, lk = n(6), n(11)
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=lq, lk=lk, d=5, dv=3, dtype=dtype)
    mask = rng.random((lq, lk)) > 0.3
    bias = rng.standard_normal((4, 1, lk))
    key_size = rng.integers(1, 4, (2, lk))
    check_against_reference(q, k, v, mask=mask, bias=bias, key_size=key_size, causal=causal,
                            normalizer=normalizer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 4), (4, 9), (5, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_shapes(rng, dtype, lq, lk, causal):
    """Single rows, Lq > Lk (causal leaves the first rows empty), one head, scale given."""
    q, k, v = qkv(rng, hq=1, lq=n(lq), lk=n(lk), d=4, dtype=dtype)
    check_against_reference(q, k, v, causal=causal, scale=0.7)


def test_two_dimensional_and_nested_batch(rng):
    q, k, v = qkv(rng, lq=5, lk=7, d=3, hq=1)
    out = check_against_reference(q[0], k[0], v[0])[0]
    assert out.shape == (5, 3)
    q, k, v = qkv(rng, batch=(2, 1), hq=2, lq=3, lk=4, d=2)
    assert check_against_reference(q, k, v)[0].shape == (2, 1, 2, 3, 2)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_empty_rows(rng, normalizer):
    """Fully masked rows, and relu_expm1 rows whose logits are all <= 0: zeros, -inf."""
    q, k, v = qkv(rng, hq=2, lq=5, lk=6, d=3)
    mask = np.ones((2, 5, 6), bool)
    mask[0, 1] = False
    mask[1, 4] = False
    q[1, 2] = 0.0  # zero logits: relu_expm1 gives the whole row zero weight
    out, lse = check_against_reference(q, k, v, mask=mask, normalizer=normalizer)
    assert np.all(out[0, 1] == 0) and lse[0, 1] == -np.inf
    if normalizer == "relu_expm1":
        assert np.all(out[1, 2] == 0) and lse[1, 2] == -np.inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_values(rng, dtype):
    """NaN in q spoils its row only; NaN / Inf at keys outside a row's set never reach it."""
    q, k, v = qkv(rng, hq=1, lq=6, lk=7, d=3, dtype=dtype)
    q[0, 1, 0] = np.nan
    k[0, 5, :] = np.nan
    v[0, 6, :] = np.inf
    mask = np.ones((6, 7), bool)
    mask[:, 5] = False
    mask[2:, 6] = False
    out, lse = check_against_reference(q, k, v, mask=mask)
    assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, 1])
    assert np.isfinite(out[0, 2:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits(rng, dtype):
    """Logits of +-1e4 neither overflow nor underflow to NaN."""
    q, k, v = qkv(rng, hq=1, lq=4, lk=9, d=2, dtype=dtype)
    bias = np.zeros((4, 9))
    bias[:, ::2] = 1e4
    bias[1] = -1e4
    # a float32 logit near 1e4 is only known to ~1e-3 (its spacing), and so is its weight
    rtol = 2e-3 if dtype == np.float32 else None
    for normalizer in NORMALIZERS:
        out, _ = check_against_reference(q, k, v, bias=bias, normalizer=normalizer, rtol=rtol)
        assert np.isfinite(out).all()


def test_float16_and_mixed(rng):
    q, k, v = qkv(rng, hq=2, lq=5, lk=6, d=3, dtype=np.float16)
    out, lse = attnnb.attention(q, k, v, return_lse=True, backend="cuda")
    ref, ref_lse = attnnb.attention(q, k, v, return_lse=True, backend="reference")
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert_close(out, ref, np.float16)
    assert_close(lse, ref_lse, np.float32, rtol=1e-5, what="lse")
    out = attnnb.attention(q.astype(np.float32), k, v.astype(np.float64), backend="cuda")
    assert out.dtype == np.float64


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_device_arrays_in_and_out(rng, normalizer):
    """Device q, k, v (mask / bias / key_size on either side): a device result, auto picks cuda."""
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=n(5), lk=n(7), d=3, dv=2, dtype=np.float32)
    lq, lk = q.shape[-2], k.shape[-2]
    mask = rng.random((2, 1, lq, lk)) > 0.2
    bias = rng.standard_normal((lk,)).astype(np.float32)
    key_size = rng.random((2, lk, 1)) + 0.5  # ToMe's (B, N, 1) layout
    kw = dict(causal=True, normalizer=normalizer)
    ref, ref_lse = attnnb.attention(q, k, v, mask=mask, bias=bias, key_size=key_size,
                                    return_lse=True, backend="reference", **kw)
    dq, dk, dv = to_device(q, k, v)
    dmask, dbias, dks = to_device(mask, bias, key_size)
    for extras in ((mask, bias, key_size), (dmask, dbias, dks), (mask, dbias, key_size)):
        out, lse = attnnb.attention(dq, dk, dv, mask=extras[0], bias=extras[1],
                                    key_size=extras[2], return_lse=True, **kw)
        is_device_array = attnnb._front.validate.is_device_array
        assert is_device_array(out) and is_device_array(lse)
        assert out.shape == ref.shape and lse.shape == ref_lse.shape
        assert_close(host(out), ref, np.float32)
        assert_close(host(lse), ref_lse, np.float32, what="lse")
    assert host(dq).tobytes() == q.tobytes()  # inputs untouched


def test_device_float16_result_stays_float16(rng):
    q, k, v = qkv(rng, hq=1, lq=3, lk=5, d=2, dtype=np.float16)
    out, lse = attnnb.attention(*to_device(q, k, v), return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert_close(host(out), attnnb.attention(q, k, v, backend="reference"), np.float16)


def test_device_bias_in_another_dtype_and_broadcast_batch(rng):
    """A float64 device bias with float32 q is converted as read; partly broadcast batches."""
    q, k, v = qkv(rng, batch=(2, 3), hq=1, lq=3, lk=4, d=2, dtype=np.float32)
    bias = rng.standard_normal((2, 1, 1, 3, 4))  # batch axes partly broadcast
    ref = attnnb.attention(q, k, v, bias=bias, backend="reference")
    out = attnnb.attention(*to_device(q, k, v), bias=to_device(bias)[0])
    assert_close(host(out), ref, np.float32)


def test_mixing_host_and_device_is_a_type_error(rng):
    q, k, v = qkv(rng, hq=1, lq=3, lk=4, d=2, dtype=np.float32)
    dq, dk, dv = to_device(q, k, v)
    with pytest.raises(TypeError, match="k is on the host"):
        attnnb.attention(dq, k, dv)
    with pytest.raises(TypeError, match="mask is a CUDA device array"):
        attnnb.attention(q, k, v, mask=to_device(np.ones((3, 4), bool))[0])
    with pytest.raises(TypeError, match="backend 'cpu' runs on the host"):
        attnnb.attention(dq, dk, dv, backend="cpu")
    with pytest.raises(TypeError, match="mask must be a boolean"):
        attnnb.attention(dq, dk, dv, mask=to_device(np.ones((3, 4)))[0])
    with pytest.raises(ValueError, match="bias of shape"):
        attnnb.attention(dq, dk, dv, bias=to_device(np.ones((2, 4)))[0])
    with pytest.raises(ValueError, match="key_size must be positive"):
        attnnb.attention(dq, dk, dv, key_size=to_device(-np.ones(4))[0])


def test_backends_reports_cuda():
    ok, why = attnnb.backends()["cuda"]
    assert ok, why


def _gpu_library(name):
    """torch (with CUDA) or cupy on a real GPU, else skip: the simulator's arrays are not
    real device memory, so the wrappers cannot take them."""
    from .common import SIMULATOR

    if SIMULATOR:
        pytest.skip("wrapping device results needs a real GPU")
    lib = pytest.importorskip(name)
    if name == "torch" and not lib.cuda.is_available():
        pytest.skip("torch without CUDA")
    return lib


def test_torch_tensors_in_and_wrapped_out(rng):
    torch = _gpu_library("torch")
    q, k, v = qkv(rng, hq=2, lq=n(5), lk=n(7), d=4, dtype=np.float32)
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    out = attnnb.attention(tq, tk, tv, causal=True)
    wrapped = torch.as_tensor(out, device="cuda")
    assert wrapped.data_ptr() == out.__cuda_array_interface__["data"][0]  # no copy
    assert_close(wrapped.cpu().numpy(), attnnb.attention(q, k, v, causal=True,
                                                         backend="reference"), np.float32)


def test_cupy_arrays_in_and_wrapped_out(rng):
    cupy = _gpu_library("cupy")
    q, k, v = qkv(rng, hq=2, lq=n(5), lk=n(7), d=4, dtype=np.float32)
    out = cupy.asarray(attnnb.attention(*(cupy.asarray(x) for x in (q, k, v))))
    assert_close(cupy.asnumpy(out), attnnb.attention(q, k, v, backend="reference"),
                 np.float32)


def test_strided_device_views(rng):
    """4-D device views of any strides are read in place; other ranks need contiguity."""
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=10, lk=12, d=3, dtype=np.float32)
    dq, dk, dv = to_device(q, k, v)
    ref = attnnb.attention(q[..., ::2, :], k[..., ::3, :], v[..., ::3, :], backend="reference")
    out = attnnb.attention(dq[..., ::2, :], dk[..., ::3, :], dv[..., ::3, :])
    assert_close(host(out), ref, np.float32)
    with pytest.raises(ValueError, match="^q is a non-contiguous CUDA device array"):
        attnnb.attention(dq[0, :, ::2], dk[0], dv[0])
    with pytest.raises(ValueError, match="^v is a non-contiguous CUDA device array"):
        attnnb.attention(dq[0], dk[0], dv[0, :, ::3])


def test_strided_device_mask_and_bias(rng):
    q, k, v = qkv(rng, hq=2, lq=4, lk=5, d=3, dtype=np.float32)
    mask = rng.random((4, 10)) > 0.3
    bias = rng.standard_normal((2, 4, 10)).astype(np.float32)
    ref = attnnb.attention(q, k, v, mask=mask[:, ::2], bias=bias[..., 1::2],
                           backend="reference")
    dmask, dbias = to_device(mask, bias)
    out = attnnb.attention(*to_device(q, k, v), mask=dmask[:, ::2], bias=dbias[..., 1::2])
    assert_close(host(out), ref, np.float32)

"""attnnb.vjp on the cuda backend against the float64 reference's gradients.

Sizes cross three or more query and key tiles of the backward kernels (the
simulator's 4 x 6 tiles, 2 x 2 threads), with Lq != Lk, GQA, D != Dv.
"""

from dataclasses import replace
from functools import partial

import numpy as np
import pytest

import attnnb
from attnnb import patterns
from attnnb.vjp import run as vjp_run

from ..helpers import assert_close, qkv, randn
from .common import SIMULATOR, assert_several_tiles, host, n, to_device

NORMALIZERS = ["softmax", "softmax1", "relu_expm1"]
LQ, LK, D, DV = n(13), n(14), 5, 7


def gradients(fn, args, kw, backend, rng_seed=7, dlse=True, two_streams=None):
    """``vjp`` of ``fn`` on ``backend`` with seeded cotangents; returns the gradients.

    ``two_streams``: given to the cuda backward of :func:`attnnb.diff_attention` (True:
    the two-stream kernels instead of the pair streams)."""
    if two_streams is None:
        result, pullback = attnnb.vjp(fn, *args, backend=backend, **kw)
    else:  # vjp's pullback, its backward given two_streams
        result, saved, _ = vjp_run(fn, args, dict(kw, backend=backend))
        saved = replace(saved, backward=partial(saved.backward, two_streams=two_streams))

        def pullback(dout, dlse=None):
            return saved.gradients(dout, dlse)
    rng = np.random.default_rng(rng_seed)
    if isinstance(result, tuple):
        out, lse = (host(x) for x in result)
        return pullback(rng.standard_normal(out.shape),
                        rng.standard_normal(lse.shape) if dlse else None)
    return pullback(rng.standard_normal(host(result).shape))


def compare(fn, args, dtype, two_streams=None, **kw):
    """Every gradient of ``fn(*args, **kw)`` on cuda against the reference's
    (``two_streams``: :func:`gradients`')."""
    got = gradients(fn, args, kw, "cuda", two_streams=two_streams)
    want = gradients(fn, args, kw, "reference")
    assert got.keys() == want.keys()
    for name in want:
        assert isinstance(got[name], np.ndarray) and got[name].shape == want[name].shape
        assert got[name].dtype == want[name].dtype == np.dtype(dtype), name
        assert_close(got[name], want[name], dtype, what=f"d{name}")
    return got


def test_sizes_cross_several_tiles():
    from attnnb.cuda._backward_tiling import backward_tiling

    assert_several_tiles(LQ, LK, D, DV)
    if SIMULATOR:
        for kernel in ("dq", "dkdv"):
            t = backward_tiling(np.float64, D, DV, 1, kernel)
            assert LQ > 2 * t.bq and LK > 2 * t.bk


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_row_and_two_keys_a_thread(rng, dtype):
    """The key-tile kernel's production micro-tiles at 64 < D <= 128 (one query row and
    two keys a thread; here with the simulator's small tiles, 4 x 6 of 1 x 2): GQA,
    causal, a mask with an empty row, the LSE's cotangent."""
    from attnnb.cuda import _micro

    old = _micro.set_micro_tiles((4, 6, 1, 2))
    try:
        q, k, v = qkv(rng, hq=2, hk=1, lq=LQ, lk=LK, d=D, dv=DV, dtype=dtype)
        mask = rng.random((LQ, LK)) > 0.3
        mask[3] = False
        compare(attnnb.attention, (q, k, v), dtype, mask=mask, causal=True, return_lse=True)
    finally:
        _micro.set_micro_tiles(old)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_attention_every_option(rng, normalizer, causal):
    """GQA, Lq != Lk, mask + broadcast bias + key sizes, dlse: float64 gradients."""
    q, k, v = qkv(rng, hq=2, hk=1, lq=LQ, lk=LK, d=D, dv=DV)
    mask = rng.random((LQ, LK)) > 0.3
    mask[4] = False  # an empty row
    bias = rng.standard_normal((2, 1, LK))
    key_size = rng.integers(1, 4, (LK,)).astype(np.float64)
    compare(attnnb.attention, (q, k, v), np.float64, mask=mask, bias=bias, key_size=key_size,
            causal=causal, normalizer=normalizer, return_lse=True)


def test_attention_float32_full_bias_and_batch(rng):
    """No LSE returned (no dlse); a bias of the full problem's shape."""
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=LQ, lk=LK, d=D, dv=DV, dtype=np.float32)
    bias = randn(rng, (2, 2, LQ, LK), np.float32)
    compare(attnnb.attention, (q, k, v), np.float32, bias=bias, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sparse_shared_and_per_head(rng, dtype):
    q, k, v = qkv(rng, hq=2, hk=1, lq=LQ, lk=LK, d=D, dv=DV, dtype=dtype)
    key_size = rng.integers(1, 4, (LK,)).astype(dtype)
    shared = patterns.local((LQ, LK), 2) | patterns.strided((LQ, LK), 5)
    compare(attnnb.sparse_attention, (q, k, v, shared), dtype, key_size=key_size,
            normalizer="softmax1", return_lse=True)
    per_head = rng.random((2, LQ, LK)) > 0.6
    per_head[0, :, :6] = True  # full tiles next to partial ones
    per_head[1, 5] = False  # an empty row
    compare(attnnb.sparse_attention, (q, k, v, patterns.from_mask(per_head)), dtype,
            return_lse=True)


def test_topk_with_ties_and_key_sizes(rng):
    q, k, v = qkv(rng, hq=2, hk=1, lq=LQ, lk=LK, d=D, dv=DV)
    k[0, 9] = k[0, 3]  # equal logits: the forward's tie rule decides
    key_size = rng.integers(1, 4, (LK,)).astype(np.float64)
    compare(attnnb.topk_attention, (q, k, v, 5), np.float64, key_size=key_size, causal=True,
            return_lse=True)


def diff_inputs(rng, dtype):
    q = randn(rng, (4, LQ, D), dtype)  # two pairs over one key pair (GQA)
    k = randn(rng, (2, LK, D), dtype)
    v = randn(rng, (1, LK, DV), dtype)
    return q, k, v


@pytest.mark.parametrize("mode", ["difference", "rectified", "difference-two-streams",
                                  "rectified-two-streams"])
def test_diff_both_modes(rng, mode):
    """Both modes; each also through the two-stream kernels (the design the pair streams
    replaced, kept for timing them against each other on a GPU)."""
    two_streams = True if mode.endswith("-two-streams") else None
    mode = mode.split("-")[0]
    q, k, v = diff_inputs(rng, np.float64)
    lam = rng.uniform(0.2, 0.9, (2, LQ))
    bias = rng.standard_normal((LQ, LK))
    key_size = rng.integers(1, 4, (LK,)).astype(np.float64)
    compare(attnnb.diff_attention, (q, k, v, lam), np.float64, two_streams=two_streams,
            bias=bias, key_size=key_size, causal=True, mode=mode)


def test_diff_lam_zero_and_negative(rng):
    """The difference mode runs each stream alone, the second weighted by ``-lam``; a row
    with ``lam = 0`` still has ``dlam = -dout . o2`` (its stream's sum is formed unweighted)."""
    q, k, v = diff_inputs(rng, np.float64)
    lam = rng.uniform(-0.9, 0.9, (2, LQ))
    lam[:, ::3] = 0.0
    got = compare(attnnb.diff_attention, (q, k, v, lam), np.float64, causal=True)
    assert np.all(got["lam"][:, ::3] != 0)


@pytest.mark.parametrize("mode", ["difference", "rectified"])
@pytest.mark.parametrize("d, dv", [(D, DV), (DV, DV), (DV, D)])
def test_diff_mask_and_more_queries_than_keys(rng, d, dv, mode):
    """Both modes' pair streams with a mask holding an empty row, causal with Lq > Lk
    (the first rows see no key), at d <, = and > Dv (the key-tile kernel padded to Dv,
    or not)."""
    lq, lk = n(14), n(13)
    q = randn(rng, (4, lq, d), np.float64)
    k = randn(rng, (2, lk, d), np.float64)
    v = randn(rng, (1, lk, dv), np.float64)
    mask = rng.random((lq, lk)) > 0.3
    mask[lq - 2] = False
    lam = rng.uniform(0.2, 0.9, (2, 1))
    compare(attnnb.diff_attention, (q, k, v, lam), np.float64, mask=mask, causal=True,
            mode=mode)


@pytest.mark.parametrize("mode", ["rectified", "heaviside"])
@pytest.mark.parametrize("tiles", [(4, 8, 2, 2), (4, 16, 2, 4)])
def test_clip_words(rng, tiles, mode):
    """The rectified pair streams (and the Heaviside mode's gated one) read the forward's
    clip bits a word a row and key tile when the key tile divides 32 (the production
    tiles' case; the simulator's default 4 x 6 tiles take the bit-by-bit path): rows of
    three words, lam of both signs, some rows where the clip removes every weight (lam
    large) and the bias gradient."""
    from attnnb.cuda import _micro

    old = _micro.set_micro_tiles(tiles)
    try:
        lq, lk = n(9), 70
        q = randn(rng, (4, lq, D), np.float64)
        k = randn(rng, (2, lk, D), np.float64)
        v = randn(rng, (1, lk, DV), np.float64)
        lam = rng.uniform(-0.5, 0.9, (2, lq))
        lam[:, 1] = 50.0
        bias = rng.standard_normal((lq, lk))
        compare(attnnb.diff_attention, (q, k, v, lam), np.float64, bias=bias, causal=True,
                mode=mode)
    finally:
        _micro.set_micro_tiles(old)


def test_diff_float32_scalar_lam_and_mask(rng):
    q, k, v = diff_inputs(rng, np.float32)
    mask = rng.random((LQ, LK)) > 0.2
    compare(attnnb.diff_attention, (q, k, v, 0.6), np.float32, mask=mask, mode="rectified")


def test_non_finite_keys_outside_the_set(rng):
    """NaN / Inf keys and values that no row may attend never reach a gradient."""
    q, k, v = qkv(rng, hq=1, lq=LQ, lk=LK, d=D, dv=DV)
    k[0, 8] = np.nan
    v[0, 8] = np.inf
    mask = np.ones((LQ, LK), bool)
    mask[:, 8] = False
    got = compare(attnnb.attention, (q, k, v), np.float64, mask=mask, return_lse=True)
    assert np.isfinite(got["q"]).all() and np.isfinite(got["v"][:, :8]).all()


def test_device_inputs_give_device_gradients_bit_for_bit(rng):
    """Device q, k, v, bias and cotangents: device gradients equal to the host run's, and
    the same bits on a second pullback."""
    from attnnb._front.validate import is_device_array

    q, k, v = qkv(rng, hq=2, hk=1, lq=LQ, lk=LK, d=D, dv=DV, dtype=np.float32)
    bias = randn(rng, (LQ, LK), np.float32)
    kw = dict(bias=bias, causal=True, return_lse=True)
    (out, lse), pullback = attnnb.vjp(attnnb.attention, *to_device(q, k, v),
                                      bias=to_device(bias)[0], causal=True, return_lse=True)
    assert is_device_array(out)
    dout = randn(rng, out.shape, np.float32)
    dlse = randn(rng, lse.shape, np.float32)
    first = pullback(*to_device(dout, dlse))
    again = pullback(*to_device(dout, dlse))
    _, host_pullback = attnnb.vjp(attnnb.attention, q, k, v, backend="cuda", **kw)
    on_host = host_pullback(dout, dlse)
    for name, g in first.items():
        assert is_device_array(g), name
        np.testing.assert_array_equal(host(g), host(again[name]), err_msg=name)
        np.testing.assert_array_equal(host(g), on_host[name], err_msg=name)


def test_device_diff_gradients(rng):
    from attnnb._front.validate import is_device_array

    q, k, v = diff_inputs(rng, np.float32)
    lam = rng.uniform(0.2, 0.9, (2, 1)).astype(np.float32)
    out, pullback = attnnb.vjp(attnnb.diff_attention, *to_device(q, k, v), lam)
    dout = randn(rng, out.shape, np.float32)
    got = pullback(to_device(dout)[0])
    _, ref_pullback = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, backend="reference")
    want = ref_pullback(dout)
    for name, g in got.items():
        assert is_device_array(g), name
        assert_close(host(g), want[name], np.float32, what=f"d{name}")


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("bias_shape", [(LQ, LK), (2, 1, 1, LK), (4, 1, LK)])
def test_broadcast_bias_gradient_in_chunks(monkeypatch, rng, on_device, bias_shape):
    """A broadcast bias whose full-size gradient buffer would pass ``CHUNK_BYTES``: one
    key head of one batch element a chunk (here 4), host or device inputs, a mask and
    key sizes; every gradient as the reference's, device gradients for device inputs."""
    from attnnb._core import bias_chunks as _bias_chunks
    from attnnb._front.validate import is_device_array

    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 1)
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=LQ, lk=LK, d=D, dv=DV)
    kw = dict(bias=randn(rng, bias_shape, np.float64), mask=rng.random((LQ, LK)) > 0.3,
              key_size=rng.integers(1, 4, (2, LK)).astype(np.float64), causal=True,
              return_lse=True)
    assert len(_bias_chunks.bias_chunks((2, 4, 2, LQ, LK), 8, (1, 1, LQ, LK))) == 4
    want = gradients(attnnb.attention, (q, k, v), kw, "reference")
    if on_device:
        kw["bias"], kw["key_size"] = to_device(kw["bias"], kw["key_size"])
        got = gradients(attnnb.attention, to_device(q, k, v), kw, "cuda")
        assert all(is_device_array(g) for g in got.values())
    else:
        got = gradients(attnnb.attention, (q, k, v), kw, "cuda")
    for name in want:
        assert_close(host(got[name]), want[name], np.float64, what=f"d{name}")


@pytest.mark.parametrize("mode", ["difference", "rectified"])
def test_diff_broadcast_bias_gradient_in_chunks(monkeypatch, rng, mode):
    """The same for differential attention (both streams of each head in its chunk),
    ``lam`` per head and row: its gradient too."""
    from attnnb._core import bias_chunks as _bias_chunks

    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 1)
    q = randn(rng, (2, 4, LQ, D), np.float64)
    k = randn(rng, (2, 2, LK, D), np.float64)
    v = randn(rng, (2, 1, LK, DV), np.float64)
    lam = rng.uniform(0.2, 0.9, (2, 2, LQ))
    kw = dict(bias=randn(rng, (LQ, LK), np.float64), causal=True, mode=mode)
    compare(attnnb.diff_attention, (q, k, v, lam), np.float64, **kw)


def test_device_float16_gradients_and_empty_axes(rng):
    """float16 device inputs: float16 device gradients (computed in float32); an empty key
    or query axis: zero gradients of the right shapes."""
    from attnnb._front.validate import is_device_array

    q, k, v = qkv(rng, hq=2, hk=1, lq=LQ, lk=LK, d=D, dv=DV, dtype=np.float16)
    key_size = rng.integers(1, 3, (LK,)).astype(np.float16)
    out, pullback = attnnb.vjp(attnnb.attention, *to_device(q, k, v), key_size=key_size)
    dout = randn(rng, out.shape, np.float16)
    got = pullback(to_device(dout)[0])
    _, ref_pullback = attnnb.vjp(attnnb.attention, q, k, v, key_size=key_size,
                                 backend="reference")
    want = ref_pullback(dout)
    for name, g in got.items():
        assert is_device_array(g) and g.dtype == np.float16, name
        assert_close(host(g), want[name], np.float16, what=f"d{name}")
    for lq, lk in ((0, 5), (4, 0)):
        q, k, v = qkv(rng, hq=1, lq=lq, lk=lk, d=3, dv=2)
        out, pullback = attnnb.vjp(attnnb.attention, q, k, v, backend="cuda")
        grads = pullback(np.ones(out.shape))
        for name, x in (("q", q), ("k", k), ("v", v)):
            assert grads[name].shape == x.shape and not grads[name].any()


def test_torch_cuda_autograd_against_cpu(rng):
    """On a GPU: attnnb.torch's autograd with CUDA tensors (cotangents and residuals read in
    place) against the same call on CPU tensors."""
    from .test_attention import _gpu_library

    torch = _gpu_library("torch")
    import attnnb.torch as at

    q, k, v = (torch.tensor(x) for x in qkv(rng, hq=2, hk=1, lq=LQ, lk=LK, d=D, dv=DV,
                                               dtype=np.float32))
    bias = torch.tensor(randn(rng, (LQ, LK), np.float32))
    dout = torch.tensor(randn(rng, (2, LQ, DV), np.float32))
    grads = {}
    for device in ("cpu", "cuda"):
        leaves = [x.to(device).requires_grad_(True) for x in (q, k, v, bias)]
        at.attention(*leaves[:3], bias=leaves[3], causal=True).backward(dout.to(device))
        grads[device] = [x.grad.cpu() for x in leaves]
    for name, a, b in zip("qkvb", grads["cuda"], grads["cpu"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"d{name}")

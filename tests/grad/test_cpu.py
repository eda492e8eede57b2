"""The cpu backward kernels against the float64 reference gradients (docs/contract.md §5).

Awkward sizes (not multiples of the 64-row / 64-key tiles, ``Lq != Lk``),
GQA, every normalizer, masks and biases of several broadcast shapes, key
sizes, ``dlse``, sparse patterns (shared and per head), top-k and
differential attention.  Tolerances relative to the largest entry: 1e-12
in float64, 1e-4 in float32.
"""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

import attnnb
from attnnb import patterns

RTOL = {np.float64: 1e-12, np.float32: 1e-4}
DTYPES = [np.float64, np.float32]


def arr(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def both(fn, args, kwargs, dtype, seed=0):
    """Gradients of ``fn`` on cpu and reference for one random cotangent."""
    rng = np.random.default_rng(seed)
    got, pull_c = attnnb.vjp(fn, *args, backend="cpu", **kwargs)
    want, pull_r = attnnb.vjp(fn, *args, backend="reference", **kwargs)
    if kwargs.get("return_lse"):
        dout, dlse = arr(rng, *want[0].shape, dtype=dtype), arr(rng, *want[1].shape, dtype=dtype)
        return pull_c(dout, dlse), pull_r(dout, dlse)
    dout = arr(rng, *want.shape, dtype=dtype)
    return pull_c(dout), pull_r(dout)


def assert_close(got, want, dtype):
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert np.isfinite(g).all(), name
        scale = max(np.abs(w).max(), np.finfo(dtype).tiny)
        err = np.abs(g.astype(np.float64) - w).max() / scale
        assert err <= RTOL[dtype], (name, err)


def traced_peak(pull, dout):
    """``(gradients, peak bytes allocated)`` of one pullback call, after a first call
    that compiles (or loads) its kernels."""
    import tracemalloc

    pull(dout)
    tracemalloc.start()
    try:
        grads = pull(dout)
        return grads, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def qkv():
    def make(dtype, B=2, Hq=4, Hk=2, Lq=70, Lk=131, D=24, Dv=40, seed=1):
        rng = np.random.default_rng(seed)
        return (arr(rng, B, Hq, Lq, D, dtype=dtype), arr(rng, B, Hk, Lk, D, dtype=dtype),
                arr(rng, B, Hk, Lk, Dv, dtype=dtype))
    return make


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalizer", ["softmax", "softmax1", "relu_expm1", "sigmoid",
                                        "softpick"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_every_option(qkv, dtype, normalizer, causal):
    q, k, v = qkv(dtype)
    rng = np.random.default_rng(2)
    kwargs = dict(mask=rng.random((70, 131)) > 0.2, bias=arr(rng, 4, 1, 131, dtype=dtype),
                  key_size=rng.integers(1, 4, (2, 131)).astype(dtype), causal=causal,
                  normalizer=normalizer, return_lse=True)
    assert_close(*both(attnnb.attention, (q, k, v), kwargs, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(70, 131), (2, 4, 70, 131), (2, 1, 1, 131)])
def test_bias_shapes(qkv, dtype, bias_shape):
    q, k, v = qkv(dtype)
    bias = arr(np.random.default_rng(3), *bias_shape, dtype=dtype)
    assert_close(*both(attnnb.attention, (q, k, v), dict(bias=bias), dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(70, 131), (2, 1, 70, 131), (4, 1, 131),
                                        (2, 1, 1, 131)])
@pytest.mark.parametrize("chunk", ["batch", "heads"])
def test_broadcast_bias_gradient_in_chunks(monkeypatch, qkv, dtype, bias_shape, chunk):
    """A broadcast bias whose full-size gradient buffer would be too large: the backward
    runs in chunks (whole batch elements, or key heads of one batch element) and sums
    them to the bias's shape; the same gradients, every one, with a mask, key sizes,
    GQA and an LSE cotangent."""
    import attnnb.cpu.backward as backward
    from attnnb._core import bias_chunks as _bias_chunks

    q, k, v = qkv(dtype)
    one_batch = 4 * 70 * 131 * np.dtype(dtype).itemsize  # Hq query heads' rows
    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", one_batch if chunk == "batch" else 1)
    monkeypatch.setattr(backward, "ONE_SWEEP_TASKS", 1)  # chunks of one key head allowed
    rng = np.random.default_rng(6)
    kwargs = dict(bias=arr(rng, *bias_shape, dtype=dtype), mask=rng.random((70, 131)) > 0.2,
                  key_size=rng.integers(1, 4, (2, 131)).astype(dtype), causal=True,
                  return_lse=True)
    shape = (2, 4, 2, 70, 131, 24, 40)
    pieces = _bias_chunks.bias_chunks(shape, np.dtype(dtype).itemsize, (1, 1, 70, 131))
    assert len(pieces) == (2 if chunk == "batch" else 4)
    assert_close(*both(attnnb.attention, (q, k, v), kwargs, dtype), dtype)


def test_broadcast_bias_gradient_in_chunks_matches_finite_differences(monkeypatch, qkv):
    """The chunked bias gradient (one key head a chunk) against central differences of
    the float64 reference forward, at entries the batch and heads all contribute to."""
    import attnnb.cpu.backward as backward
    from attnnb._core import bias_chunks as _bias_chunks

    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 1)
    monkeypatch.setattr(backward, "ONE_SWEEP_TASKS", 1)
    q, k, v = qkv(np.float64)
    rng = np.random.default_rng(8)
    bias = arr(rng, 70, 131)
    w = arr(rng, 2, 4, 70, 40)
    grads = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, causal=True, backend="cpu")[1](w)
    eps = 1e-6
    for idx in [(0, 0), (69, 130), (35, 17), (69, 0)]:
        sums = []
        for step in (eps, -eps):
            moved = bias.copy()
            moved[idx] += step
            out = attnnb.attention(q, k, v, bias=moved, causal=True, backend="reference")
            sums.append(np.sum(out * w))
        fd = (sums[0] - sums[1]) / (2 * eps)
        assert abs(grads["bias"][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (idx, fd)


def test_broadcast_bias_gradient_memory(monkeypatch):
    """The pullback's peak allocation stays below the full (B, H, Lq, Lk) buffer that a
    shared (Lq, Lk) bias would otherwise need (16 MiB here, the bias 0.25 MiB)."""
    import attnnb.cpu.backward as backward
    from attnnb._core import bias_chunks as _bias_chunks

    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 2**20)
    monkeypatch.setattr(backward, "ONE_SWEEP_TASKS", 1)  # chunks of 1 MiB, whatever form
    rng = np.random.default_rng(7)
    B, H, L, D = 4, 16, 256, 16
    q, k, v = (arr(rng, B, H, L, D, dtype=np.float32) for _ in range(3))
    bias = arr(rng, L, L, dtype=np.float32)
    out, pull = attnnb.vjp(attnnb.attention, q, k, v, bias=bias, backend="cpu")
    dout = arr(rng, *out.shape, dtype=np.float32)
    grads, peak = traced_peak(pull, dout)
    full = B * H * L * L * 4
    assert peak < full / 2, (peak, full)
    want = attnnb.vjp(attnnb.attention, *(x.astype(np.float64) for x in (q, k, v)),
                      bias=bias.astype(np.float64), backend="reference")[1](
        dout.astype(np.float64))
    err = np.abs(grads["bias"] - want["bias"]).max() / np.abs(want["bias"]).max()
    assert err <= RTOL[np.float32], err


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_dimensional_one_head_and_empty_rows(dtype):
    rng = np.random.default_rng(4)
    q, k, v = arr(rng, 5, 8, dtype=dtype), arr(rng, 67, 8, dtype=dtype), arr(rng, 67, 3,
                                                                             dtype=dtype)
    mask = rng.random((5, 67)) > 0.5
    mask[2] = False  # an empty row: zero gradients, never NaN
    got, want = both(attnnb.attention, (q, k, v), dict(mask=mask), dtype)
    assert_close(got, want, dtype)
    assert not got["q"][2].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_stay_finite(qkv, dtype):
    """Logits of order 1e4: finite gradients.  Compared in float64 only: in float32 the
    logits themselves carry errors of ~1e-3 there, which the weights amplify."""
    q, k, v = qkv(dtype)
    got, want = both(attnnb.attention, (q * 300, k * 300, v), dict(causal=True), dtype)
    for g in got.values():
        assert np.isfinite(g).all()
    if dtype == np.float64:
        for name in want:
            scale = np.abs(want[name]).max()
            assert np.abs(got[name] - want[name]).max() <= 1e-9 * scale, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_patterns(qkv, dtype, per_head):
    q, k, v = qkv(dtype)
    rng = np.random.default_rng(5)
    if per_head:
        pattern = patterns.from_mask(rng.random((4, 70, 131)) > 0.8)
    else:
        pattern = patterns.local((70, 131), 17) | patterns.longformer((70, 131), 0, [0, 99])
    kwargs = dict(key_size=rng.integers(1, 3, (2, 131)).astype(dtype), return_lse=True)
    assert_close(*both(attnnb.sparse_attention, (q, k, v, pattern), kwargs, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq", [70, 1, 3])
def test_topk_selection_held_fixed(qkv, dtype, causal, lq):
    """Also with fewer query rows than a register block (decoding), where the dense
    backward forms its logits differently: the selection's threshold key must stay in."""
    q, k, v = qkv(dtype, Lq=lq)
    kwargs = dict(causal=causal, return_lse=True)
    assert_close(*both(attnnb.topk_attention, (q, k, v, 9), kwargs, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq", [1, 3])
def test_sparse_with_few_query_rows(qkv, dtype, lq):
    q, k, v = qkv(dtype, Lq=lq)
    pattern = patterns.local((lq, 131), 40) | patterns.longformer((lq, 131), 0, [0, 99])
    kwargs = dict(return_lse=True)
    assert_close(*both(attnnb.sparse_attention, (q, k, v, pattern), kwargs, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
@pytest.mark.parametrize("lam_shape", [(), (2, 1), (1, 2, 70)])
def test_differential(dtype, mode, lam_shape):
    rng = np.random.default_rng(6)
    q, k, v = (arr(rng, 1, 4, 70, 16, dtype=dtype), arr(rng, 1, 2, 131, 16, dtype=dtype),
               arr(rng, 1, 1, 131, 32, dtype=dtype))
    lam = 0.2 + 0.1 * rng.random(lam_shape)
    kwargs = dict(bias=arr(rng, 70, 131, dtype=dtype), causal=True, mode=mode,
                  key_size=rng.integers(1, 3, (1, 131)).astype(dtype))
    assert_close(*both(attnnb.diff_attention, (q, k, v, lam), kwargs, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rectified_gqa_and_mask(dtype):
    rng = np.random.default_rng(7)
    q, k, v = (arr(rng, 2, 8, 70, 16, dtype=dtype), arr(rng, 2, 4, 67, 16, dtype=dtype),
               arr(rng, 2, 2, 67, 24, dtype=dtype))
    kwargs = dict(mask=rng.random((70, 67)) > 0.3, mode="rectified")
    assert_close(*both(attnnb.diff_attention, (q, k, v, 0.6), kwargs, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(70, 67), (2, 1, 70, 67), (4, 1, 67)])
@pytest.mark.parametrize("chunk", ["batch", "heads"])
def test_rectified_broadcast_bias_gradient_in_chunks(monkeypatch, dtype, bias_shape, chunk):
    """The rectified backward of a broadcast bias whose full-size buffer would be too
    large: in chunks of batch elements, or of value heads (each with its GQA group of
    heads and both streams), every gradient as in one piece, ``lam`` per row included."""
    from attnnb._core import bias_chunks as _bias_chunks

    rng = np.random.default_rng(9)
    q, k, v = (arr(rng, 2, 8, 70, 16, dtype=dtype), arr(rng, 2, 4, 67, 16, dtype=dtype),
               arr(rng, 2, 2, 67, 24, dtype=dtype))
    one_batch = 4 * 70 * 67 * np.dtype(dtype).itemsize  # the H = 4 heads' rows
    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", one_batch if chunk == "batch" else 1)
    pieces = _bias_chunks.bias_chunks((2, 4, 2, 70, 67), np.dtype(dtype).itemsize,
                                      (1, 1, 70, 67))
    assert len(pieces) == (2 if chunk == "batch" else 4)
    lam = 0.3 + 0.2 * rng.random((2, 4, 70))
    kwargs = dict(bias=arr(rng, *bias_shape, dtype=dtype), mask=rng.random((70, 67)) > 0.3,
                  key_size=rng.integers(1, 4, (2, 67)).astype(dtype), causal=True,
                  mode="rectified")
    assert_close(*both(attnnb.diff_attention, (q, k, v, lam), kwargs, dtype), dtype)


def test_rectified_broadcast_bias_gradient_memory(monkeypatch):
    """The rectified pullback's peak allocation stays below the full (B, H, Lq, Lk)
    buffer of a shared (Lq, Lk) bias (16 MiB here, chunks of 1 MiB)."""
    from attnnb._core import bias_chunks as _bias_chunks

    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 2**20)
    rng = np.random.default_rng(10)
    B, H, L, D = 2, 8, 512, 16
    q, k = arr(rng, B, 2 * H, L, D, dtype=np.float32), arr(rng, B, 2 * H, L, D, dtype=np.float32)
    v = arr(rng, B, H, L, D, dtype=np.float32)
    bias = arr(rng, L, L, dtype=np.float32)
    out, pull = attnnb.vjp(attnnb.diff_attention, q, k, v, 0.4, bias=bias, mode="rectified",
                           backend="cpu")
    dout = arr(rng, *out.shape, dtype=np.float32)
    grads, peak = traced_peak(pull, dout)
    full = B * H * L * L * 4
    assert peak < full / 2, (peak, full)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    want = attnnb.vjp(attnnb.diff_attention, *wide, 0.4, bias=bias.astype(np.float64),
                      mode="rectified", backend="reference")[1](dout.astype(np.float64))
    for name in ("q", "k", "v", "bias", "lam"):
        err = np.abs(grads[name] - want[name]).max() / np.abs(want[name]).max()
        assert err <= RTOL[np.float32], (name, err)


@pytest.mark.parametrize("lq, lk", [(70, 131), (1, 3000)])
def test_rectified_stream_lses_are_the_forwards_bits(lq, lk):
    """The rectified backward takes each stream's LSE from the dense forward run on
    values of width zero: the full forward's LSE bit for bit (decoding's split keys
    included), with a mask, a bias and key sizes."""
    import dataclasses

    from attnnb._front.validate import attention_problem
    from attnnb.cpu.attention import attention as forward
    from attnnb.cpu.rectified_backward import stream_lses

    rng = np.random.default_rng(11)
    q, k = arr(rng, 2, 4, lq, 16, dtype=np.float32), arr(rng, 2, 4, lk, 16, dtype=np.float32)
    v = arr(rng, 2, 2, lk, 32, dtype=np.float32)
    problem = attention_problem(q, k, v, mask=rng.random((lq, lk)) > 0.2,
                                bias=arr(rng, lq, lk, dtype=np.float32),
                                key_size=rng.integers(1, 4, (2, lk)).astype(np.float32),
                                causal=lq > 1, head_pairs=True)
    for c, lse in enumerate(stream_lses(problem)):
        stream = dataclasses.replace(problem, q=np.ascontiguousarray(problem.q[:, c::2]),
                                     k=np.ascontiguousarray(problem.k[:, c::2]))
        np.testing.assert_array_equal(lse, forward(stream)[1])


@pytest.mark.parametrize("causal", [False, True])
def test_rectified_writes_every_gradient_element(monkeypatch, causal):
    """The rectified backward's ``dq``, ``dk``, ``dv``, ``d1`` and ``e`` start unset
    (``written_whole``): started as NaN, every gradient comes out as before."""
    import attnnb.cpu.rectified_backward as rectified

    rng = np.random.default_rng(8)
    q, k, v = (arr(rng, 2, 4, 70, 16, dtype=np.float32), arr(rng, 2, 4, 67, 16,
               dtype=np.float32), arr(rng, 2, 2, 67, 24, dtype=np.float32))
    dout = arr(rng, 2, 2, 70, 24, dtype=np.float32)
    kwargs = dict(mask=rng.random((70, 67)) > 0.3, mode="rectified", causal=causal,
                  backend="cpu")

    def grads():
        return attnnb.vjp(attnnb.diff_attention, q, k, v, 0.6, **kwargs)[1](dout)

    plain = grads()
    monkeypatch.setattr(rectified, "written_whole", lambda shape, dt: np.full(shape, np.nan, dt))
    poisoned = grads()
    for key in ("q", "k", "v", "lam"):
        assert np.isfinite(poisoned[key]).all(), key
        np.testing.assert_array_equal(poisoned[key], plain[key], err_msg=key)


def test_concurrent_pullbacks_agree(qkv):
    q, k, v = qkv(np.float32)
    _, pullback = attnnb.vjp(attnnb.attention, q, k, v, causal=True, backend="cpu")
    dout = np.ones((2, 4, 70, 40), np.float32)
    want = pullback(dout)
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: pullback(dout), range(8)))
    for got in results:
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's inf @ 0
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_masked_inf_key_reaches_no_gradient(qkv, dtype):
    """docs/contract.md §1.9 for gradients: a key outside every row's allowed set holds
    Inf in k and v; every other gradient stays finite and equals the reference's."""
    q, k, v = qkv(dtype)
    k, v = k.copy(), v.copy()
    k[:, :, 77], v[:, :, 77] = np.inf, -np.inf
    mask = np.ones((70, 131), bool)
    mask[:, 77] = False
    got, want = both(attnnb.attention, (q, k, v), dict(mask=mask, causal=True), dtype)
    for name in ("q", "k", "v"):
        g, w = got[name], want[name]
        if name != "q":
            g, w = np.delete(g, 77, axis=2), np.delete(w, 77, axis=2)
        assert np.isfinite(g).all(), name
        assert np.abs(g - w).max() <= RTOL[dtype] * np.abs(w).max(), name


def test_dense_and_sparse_gradients_share_one_compiled_kernel_each(qkv):
    """The dense path's tile lists and placeholders are typed as a pattern's, so a
    sparse gradient after a dense one compiles no second dq or dk/dv kernel."""
    from attnnb.cpu.backward import dkdv_kernel, dq_kernel

    q, k, v = qkv(np.float32)
    dout = np.ones(q.shape[:-1] + v.shape[-1:], np.float32)
    attnnb.vjp(attnnb.attention, q, k, v, causal=True, backend="cpu")[1](dout)
    before = {kernel: list(kernel.signatures) for kernel in (dkdv_kernel, dq_kernel)}
    pattern = patterns.local((q.shape[2], k.shape[2]), 13)
    attnnb.vjp(attnnb.sparse_attention, q, k, v, pattern, backend="cpu")[1](dout)
    for kernel, signatures in before.items():
        assert kernel.signatures == signatures, kernel.py_func.__name__


@pytest.mark.parametrize("dtype, dv", [(np.float32, 256), (np.float64, 128), (np.float32, 512)])
def test_value_rows_a_multiple_of_1kib_apart(rng, dtype, dv):
    """Value widths whose rows are 1 or 2 KiB apart take the value products' keys in
    runs (:func:`attnnb.cpu._tiles.key_run`): forward and gradients as the reference's,
    with a last key tile of 36 keys and causal rows that end inside a run."""
    q, k = arr(rng, 1, 2, 70, 16, dtype=dtype), arr(rng, 1, 2, 100, 16, dtype=dtype)
    v = arr(rng, 1, 2, 100, dv, dtype=dtype)
    for causal in (False, True):
        want = attnnb.attention(q, k, v, causal=causal, backend="reference")
        got = attnnb.attention(q, k, v, causal=causal, backend="cpu")
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err <= (2e-5 if dtype == np.float32 else 1e-12), err
        g, w = both(attnnb.attention, (q, k, v), {"causal": causal}, dtype)
        assert_close(g, w, dtype)

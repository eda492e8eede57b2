"""Attention dropout (docs/contract.md §1.14): the generator, the forward, the gradients.

The keep decisions are a pure function of the seed and ``(b, h, i, j)``
(:mod:`attnnb._core.dropout`); the reference backend applies them to materialised
weights, the cpu kernels tile by tile.  Checked here: the generator's keep
rate against binomial bounds, the decisions of the cpu kernels against the
reference's element by element, the mean over seeds against the undropped
output, gradients against finite differences and across backends, and
reproducibility.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnnb
from attnnb._core import dropout as _dropout

from .helpers import assert_drops_the_reference_keys, assert_gradients_near_fd

BACKENDS = ("reference", "cpu")


def _qkv(rng, B=2, Hq=3, Hk=3, Lq=7, Lk=9, D=4, Dv=4, dtype=np.float64):
    return (rng.standard_normal((B, Hq, Lq, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, D)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, Dv)).astype(dtype))


# ---------------------------------------------------------------------------
# the generator


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bounds(p):
    """Over a (2, 4, 256, 300) block, overall and per row and per key: the kept share
    stays within 5 (overall) or 6 (per row / key, ~2000 of them) standard deviations."""
    shape = (2, 4, 256, 300)
    keep = _dropout.keep_mask(12345, p, shape)
    n = keep.size
    sd = np.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p)) < 5 * sd
    rows = keep.mean(axis=-1)
    assert np.abs(rows - (1 - p)).max() < 6 * np.sqrt(p * (1 - p) / shape[-1])
    cols = keep.mean(axis=(0, 1, 2))
    assert np.abs(cols - (1 - p)).max() < 6 * np.sqrt(p * (1 - p) / (n / shape[-1]))


def test_keep_decisions_independent_across_seeds_and_neighbours():
    """Neighbouring seeds, rows, heads and keys are uncorrelated (|r| < 5 sd)."""
    a = _dropout.keep_mask(7, 0.5, (2, 2, 128, 128)).astype(float)
    b = _dropout.keep_mask(8, 0.5, (2, 2, 128, 128)).astype(float)
    bound = 5 / np.sqrt(a.size)
    for x, y in ((a, b), (a[..., 1:, :], a[..., :-1, :]), (a[..., 1:], a[..., :-1]),
                 (a[:, 1:], a[:, :-1]), (a[1:], a[:-1])):
        r = np.corrcoef(x.ravel(), y.ravel())[0, 1]
        assert abs(r) < bound * np.sqrt(a.size / x.size)


def test_keep_decisions_are_a_function_of_the_absolute_indices():
    """A block given its absolute indices equals the same slice of the whole."""
    whole = _dropout.keep_mask(99, 0.3, (3, 4, 50, 70))
    part = _dropout.keep_mask(99, 0.3, (1, 2, 20, 30), b=[2], h=[1, 3],
                              i=np.arange(10, 30), j=np.arange(40, 70))
    np.testing.assert_array_equal(part, whole[2:3, 1::2, 10:30, 40:70])


def test_python_integers_give_the_arrays_bits():
    """The scalar functions the kernels compile give the NumPy version's decisions."""
    seed = 2**64 - 12345
    lo, hi = _dropout.seed_words(seed)
    thr = _dropout.threshold(0.4)
    expected = _dropout.keep_mask(seed, 0.4, (2, 2, 3, 5))
    for b, h, i, j in np.ndindex(expected.shape):
        key = _dropout.row_key(lo, hi, b, h, i)
        assert _dropout.kept(key, _dropout.column_word(j), thr) == expected[b, h, i, j]


# ---------------------------------------------------------------------------
# the forward


SHAPES = {
    "small": dict(B=2, Hq=3, Hk=3, Lq=7, Lk=9),
    "tiles, gqa": dict(B=1, Hq=4, Hk=2, Lq=130, Lk=70, D=16, Dv=8),
    "decoding": dict(B=1, Hq=2, Hk=1, Lq=3, Lk=200, D=8),
    "one head, 2 key tiles": dict(B=1, Hq=1, Hk=1, Lq=65, Lk=129, D=8),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_drops_the_reference_keys(shape, causal):
    """With one-hot values the output is each row's dropped weights: the cpu kernels
    zero exactly the reference's entries, and agree on the rest to rounding."""
    rng = np.random.default_rng(1)
    o = SHAPES[shape]
    Lk = o["Lk"]
    q, k, _ = _qkv(rng, **{**o, "Dv": 1})
    v = np.broadcast_to(np.eye(Lk), (o["B"], o["Hk"], Lk, Lk)).copy()
    ref = assert_drops_the_reference_keys(q, k, v, "cpu", causal)
    factor = 1 / (1 - 0.4)
    w = attnnb.attention(q, k, v, backend="reference", causal=causal)
    kept = (ref != 0)
    np.testing.assert_allclose(ref[kept], factor * w[kept], rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalizer", ["softmax", "softmax1", "relu_expm1"])
def test_lse_is_that_of_the_weights_before_dropout(backend, normalizer):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, Lq=70, Lk=80)
    _, lse = attnnb.attention(q, k, v, normalizer=normalizer, return_lse=True,
                              backend=backend)
    _, lse_d = attnnb.attention(q, k, v, normalizer=normalizer, return_lse=True,
                                dropout_p=0.5, seed=3, backend=backend)
    np.testing.assert_array_equal(lse_d, lse)


def test_mean_over_seeds_tends_to_the_undropped_output():
    """Inverted dropout is unbiased: over 3000 seeds the mean output is within 5
    standard errors of the undropped one, element by element."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=2, Lq=5, Lk=6)
    exact = attnnb.attention(q, k, v, backend="cpu")
    runs = np.stack([attnnb.attention(q, k, v, dropout_p=0.3, seed=s, backend="cpu")
                     for s in range(3000)])
    stderr = runs.std(axis=0) / np.sqrt(len(runs))
    assert np.all(np.abs(runs.mean(axis=0) - exact) < 5 * stderr + 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_seed_same_bits_other_seed_other_output(backend):
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, Lq=70, Lk=70, dtype=np.float32)
    a = attnnb.attention(q, k, v, dropout_p=0.2, seed=11, backend=backend)
    b = attnnb.attention(q, k, v, dropout_p=0.2, seed=11, backend=backend)
    c = attnnb.attention(q, k, v, dropout_p=0.2, seed=12, backend=backend)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_one_gives_zeros_and_zero_is_no_dropout(backend):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng)
    np.testing.assert_array_equal(
        attnnb.attention(q, k, v, dropout_p=1.0, seed=1, backend=backend), 0.0)
    np.testing.assert_array_equal(attnnb.attention(q, k, v, dropout_p=0.0, backend=backend),
                                  attnnb.attention(q, k, v, backend=backend))


def test_refusals_name_the_argument():
    q = np.zeros((2, 3, 4))
    with pytest.raises(TypeError, match="seed="):
        attnnb.attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        attnnb.attention(q, q, q, dropout_p=1.5, seed=0)
    with pytest.raises(TypeError, match="dropout_p must be a real number"):
        attnnb.attention(q, q, q, dropout_p="0.1", seed=0)
    with pytest.raises(ValueError, match="seed must be in"):
        attnnb.attention(q, q, q, dropout_p=0.1, seed=-1)
    with pytest.raises(TypeError, match="seed must be an integer"):
        attnnb.attention(q, q, q, dropout_p=0.1, seed=1.5)


def test_dask_arrays_with_dropout_are_refused():
    da = pytest.importorskip("dask.array")
    q = da.zeros((2, 3, 4), chunks=1)
    with pytest.raises(NotImplementedError, match="Dask"):
        attnnb.attention(q, q, q, dropout_p=0.1, seed=0)


# ---------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalizer", ["softmax", "softmax1", "relu_expm1", "sigmoid",
                                        "softpick"])
def test_gradients_against_finite_differences(backend, normalizer):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=1, Lq=6, Lk=7)
    inputs = dict(q=q, k=k, v=v, bias=rng.standard_normal((6, 7)),
                  key_size=rng.uniform(0.5, 2.0, 7))
    assert_gradients_near_fd(attnnb.attention, inputs, rng, dropout_p=0.35, seed=77,
                             normalizer=normalizer, causal=True, backend=backend)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-4)])
def test_cpu_gradients_equal_the_reference(shape, dtype, rtol):
    """Every gradient (q, k, v, bias, key_size; GQA, decoding rows, a partial key tile,
    the one-sweep backward) of the cpu kernels against the float64 reference."""
    rng = np.random.default_rng(7)
    o = SHAPES[shape]
    q, k, v = _qkv(rng, **o, dtype=dtype)
    kw = dict(dropout_p=0.25, seed=5, causal=True, return_lse=True,
              bias=rng.standard_normal((o["Lq"], o["Lk"])).astype(dtype),
              key_size=rng.uniform(0.5, 3.0, (o["B"], o["Lk"])).astype(dtype))
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
    _, pb_ref = attnnb.vjp(attnnb.attention, q.astype(np.float64), k.astype(np.float64),
                           v.astype(np.float64), backend="reference",
                           **{n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x)
                              for n, x in kw.items()})
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    grads, ref = pb(dout.astype(dtype), dlse.astype(dtype)), pb_ref(dout, dlse)
    for name in ref:
        scale = np.abs(ref[name]).max()
        np.testing.assert_allclose(grads[name], ref[name], rtol=0, atol=rtol * scale,
                                   err_msg=name)


def test_one_sweep_backward_with_dropout_equals_the_reference():
    """Eight key heads or more: dkdv_kernel owns dq too (attnnb.cpu.backward)."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, B=2, Hq=8, Hk=4, Lq=70, Lk=66, D=8, Dv=8)
    kw = dict(dropout_p=0.5, seed=2**63 + 5)
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
    _, pb_ref = attnnb.vjp(attnnb.attention, q, k, v, backend="reference", **kw)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=1e-11, atol=1e-13)


# ---------------------------------------------------------------------------
# sparse and top-k attention


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_dropout_equals_masked_dense_dropout(backend):
    """The decisions depend on (b, h, i, j) only: a pattern with dropout is dense
    attention with the pattern as a mask, with the same seed."""
    from attnnb import patterns

    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, B=2, Hq=2, Hk=1, Lq=150, Lk=150, D=8, Dv=8)
    pattern = patterns.local(150, 40, causal=True)
    kw = dict(dropout_p=0.3, seed=31, return_lse=True, backend=backend)
    out, lse = attnnb.sparse_attention(q, k, v, pattern, **kw)
    ref, ref_lse = attnnb.attention(q, k, v, mask=pattern.to_mask(), **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


@pytest.mark.parametrize("top_k", [3, 100])  # a gathered row list, and the masked sweep
def test_topk_dropout_cpu_equals_reference(top_k):
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=2, Lq=70, Lk=130, D=8, Dv=8)
    kw = dict(dropout_p=0.4, seed=8, causal=True, return_lse=True)
    (out, lse), pb = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k, backend="cpu", **kw)
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.topk_attention, q, k, v, top_k,
                                        backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    plain = attnnb.topk_attention(q, k, v, top_k, causal=True, return_lse=True,
                                  backend="cpu")[1]
    np.testing.assert_array_equal(lse, plain)  # the LSE before dropout
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=1e-11, atol=1e-13, err_msg=name)


def test_sparse_gradients_with_dropout_against_reference_and_fd():
    from attnnb import patterns

    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, B=1, Hq=2, Hk=1, Lq=9, Lk=9)
    pattern = patterns.local(9, 3)
    kw = dict(dropout_p=0.3, seed=3)
    out, pb = attnnb.vjp(attnnb.sparse_attention, q, k, v, pattern, backend="cpu", **kw)
    _, pb_ref = attnnb.vjp(attnnb.sparse_attention, q, k, v, pattern, backend="reference",
                           **kw)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout), pb_ref(dout)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=1e-11, atol=1e-13, err_msg=name)
    eps = 1e-6
    for _ in range(5):
        idx = tuple(rng.integers(0, n) for n in q.shape)
        plus, minus = q.copy(), q.copy()
        plus[idx] += eps
        minus[idx] -= eps
        fd = np.sum(dout * (attnnb.sparse_attention(plus, k, v, pattern, **kw)
                            - attnnb.sparse_attention(minus, k, v, pattern, **kw))) / (2 * eps)
        assert abs(fd - g["q"][idx]) <= 1e-6 * (1 + abs(fd))


# ---------------------------------------------------------------------------
# differential attention: one decision per combined weight of a head pair


def _pairs(rng, B=1, H=2, Hk=1, Lq=70, Lk=75, d=4, Dv=8, dtype=np.float64):
    return (rng.standard_normal((B, 2 * H, Lq, d)).astype(dtype),
            rng.standard_normal((B, 2 * Hk, Lk, d)).astype(dtype),
            rng.standard_normal((B, Hk, Lk, Dv)).astype(dtype))


@pytest.mark.parametrize("mode", ["difference", "rectified"])
def test_diff_dropout_drops_the_combined_weights(mode):
    """The reference's output is the dropped combined weights times the values, and
    the decisions are attention's for head pair h (docs/contract.md §1.14)."""
    from attnnb._front.validate import attention_problem
    from attnnb.reference.diff import diff_weights

    rng = np.random.default_rng(12)
    q, k, v = _pairs(rng, Lq=9, Lk=11)
    lam = 0.6
    kw = dict(dropout_p=0.4, seed=99, causal=True, mode=mode)
    out = attnnb.diff_attention(q, k, v, lam, backend="reference", **kw)
    problem = attention_problem(q, k, v, causal=True, head_pairs=True)
    w, _ = diff_weights(problem, np.full((1, 2, 9), lam), mode)
    keep = _dropout.keep_mask(99, 0.4, w.shape)
    expected = (w * keep / 0.6) @ np.repeat(v, 2, axis=1)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-4)])
def test_diff_dropout_cpu_equals_the_reference(mode, dtype, rtol):
    """Forward and every gradient (q, k, v, lam, bias, key_size; GQA, partial tiles,
    a causal limit) of the cpu kernels against the float64 reference."""
    rng = np.random.default_rng(13)
    q, k, v = _pairs(rng, B=2, H=2, Hk=1, Lq=70, Lk=75, dtype=dtype)
    lam = rng.uniform(0.2, 0.9, (2, 1)).astype(dtype)
    kw = dict(dropout_p=0.3, seed=2**40 + 3, causal=True, mode=mode,
              bias=rng.standard_normal((70, 75)).astype(dtype),
              key_size=rng.uniform(0.5, 2.0, 75).astype(dtype))
    out, pb = attnnb.vjp(attnnb.diff_attention, q, k, v, lam, backend="cpu", **kw)
    as64 = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x)
            for n, x in kw.items()}
    ref, pb_ref = attnnb.vjp(attnnb.diff_attention, *(x.astype(np.float64)
                                                      for x in (q, k, v, lam)),
                             backend="reference", **as64)
    np.testing.assert_allclose(out, ref, rtol=0, atol=rtol * np.abs(ref).max())
    undropped = attnnb.diff_attention(q, k, v, lam, backend="cpu",
                                      **dict(kw, dropout_p=0.0))
    assert not np.allclose(out, undropped)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout.astype(dtype)), pb_ref(dout)
    for name in r:
        np.testing.assert_allclose(g[name], r[name], rtol=0,
                                   atol=rtol * np.abs(r[name]).max(), err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["difference", "rectified", "heaviside"])
def test_diff_dropout_gradients_against_finite_differences(mode, backend):
    rng = np.random.default_rng(14)
    q, k, v = _pairs(rng, B=1, H=2, Hk=2, Lq=6, Lk=7, d=3, Dv=4)
    arguments = dict(q=q, k=k, v=v, lam=rng.uniform(0.3, 0.8, (2, 1)),
                     bias=rng.standard_normal((6, 7)))
    assert_gradients_near_fd(attnnb.diff_attention, arguments, rng, points=5,
                             dropout_p=0.35, seed=5, mode=mode, backend=backend)


def test_diff_dropout_refusals():
    rng = np.random.default_rng(15)
    q, k, v = _pairs(rng, Lq=4, Lk=4)
    with pytest.raises(TypeError, match="seed"):
        attnnb.diff_attention(q, k, v, 0.5, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        attnnb.diff_attention(q, k, v, 0.5, dropout_p=1.5, seed=1)


# ---------------------------------------------------------------------------
# a problem run in parts (a broadcast bias's gradient in chunks) drops as the whole


@pytest.mark.parametrize("B, Hq, Hk", [(3, 8, 4), (1, 10, 10)])  # batch / head chunks
def test_chunked_backward_keys_the_whole_problems_indices(B, Hq, Hk, monkeypatch):
    """With the bias gradient formed chunk by chunk (attnnb._core.bias_chunks: 8 key heads
    a chunk here), each chunk keys its decisions by the call's batch and head indices:
    the gradients equal the one-piece backward's."""
    from attnnb._core import bias_chunks as _bias_chunks

    rng = np.random.default_rng(16)
    q, k, v = _qkv(rng, B=B, Hq=Hq, Hk=Hk, Lq=20, Lk=21, D=4, Dv=4)
    bias = rng.standard_normal((20, 21))
    kw = dict(dropout_p=0.4, seed=17, bias=bias, backend="cpu")
    out, pb = attnnb.vjp(attnnb.attention, q, k, v, **kw)
    dout = rng.standard_normal(out.shape)
    whole = pb(dout)
    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 20 * 21 * 8)  # one key head a chunk
    out_c, pb_c = attnnb.vjp(attnnb.attention, q, k, v, **kw)
    parts = pb_c(dout)
    np.testing.assert_array_equal(out_c, out)
    for name in whole:
        np.testing.assert_allclose(parts[name], whole[name], rtol=1e-12, atol=1e-14,
                                   err_msg=name)


@pytest.mark.parametrize("mode", ["difference", "rectified"])
def test_chunked_diff_backward_keys_the_whole_problems_indices(mode, monkeypatch):
    from attnnb._core import bias_chunks as _bias_chunks

    rng = np.random.default_rng(17)
    q, k, v = _pairs(rng, B=2, H=4, Hk=2, Lq=20, Lk=21)
    bias = rng.standard_normal((20, 21))
    kw = dict(dropout_p=0.4, seed=18, bias=bias, mode=mode, backend="cpu")
    out, pb = attnnb.vjp(attnnb.diff_attention, q, k, v, 0.5, **kw)
    dout = rng.standard_normal(out.shape)
    whole = pb(dout)
    monkeypatch.setattr(_bias_chunks, "CHUNK_BYTES", 20 * 21 * 8)
    parts = attnnb.vjp(attnnb.diff_attention, q, k, v, 0.5, **kw)[1](dout)
    for name in whole:
        np.testing.assert_allclose(parts[name], whole[name], rtol=1e-12, atol=1e-14,
                                   err_msg=name)

"""Decoding: few queries against many keys (attnnb/cpu/_decoding.py).

With at most 16 queries the cpu kernel transposes its key tiles itself (or,
below 4 rows, takes dot products with the keys as stored; from 4 rows, on AVX2
hosts, forms a full tile's logits from the keys as stored), and it splits
each row's keys into ranges that are merged through their log-sum-exps.
Each case here is shaped so that the keys are split (checked), and compared
with the float64 reference: every normalizer, causal with ``Lq != Lk``, GQA,
masks, biases, key sizes, empty rows and non-finite inputs in a later split.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import attnnb
from attnnb.cpu._blocks import ROWS
from attnnb.cpu._decoding import LOCAL_TILE_ROWS, key_splits

from ..helpers import qkv
from ..test_attention import compare_backends

LK = 600  # ten key tiles: two or more splits for the shapes below


def split_count(q, k):
    B, H, Lq = q.shape[0], q.shape[1], q.shape[2]
    return key_splits(B, H, Lq, k.shape[2])


@pytest.mark.parametrize("normalizer", ["softmax", "softmax1", "relu_expm1"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lq", [1, 3, 5, LOCAL_TILE_ROWS])
def test_split_keys_match_the_reference(rng, lq, dtype, causal, normalizer):
    q, k, v = qkv(rng, batch=(1,), hq=4, hk=2, lq=lq, lk=LK, d=24, dv=20, dtype=dtype)
    assert split_count(q, k) > 1
    compare_backends(q, k, v, causal=causal, normalizer=normalizer)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_masks_bias_and_key_sizes(rng, dtype):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=4, lk=LK + 37, d=16, dv=8, dtype=dtype)
    assert split_count(q, k) > 1
    mask = rng.random((2, 1, 4, LK + 37)) > 0.3
    mask[0, 0, 1] = False  # an empty row: zeros and lse = -inf
    bias = rng.standard_normal((4, LK + 37)).astype(dtype)
    key_size = rng.integers(1, 5, (2, LK + 37)).astype(dtype)
    out, lse = compare_backends(q, k, v, mask=mask, bias=bias, key_size=key_size)
    assert not out[0, :, 1].any() and np.isneginf(lse[0, :, 1]).all()


def test_row_lengths_of_one_split_only(rng):
    """Causal with ``Lq > Lk``-like offsets: the first rows see keys of the first split only."""
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=9, lk=LK, d=8, dtype=np.float32)
    mask = np.ones((9, LK), bool)
    mask[:4, 300:] = False  # these rows' later splits see nothing
    compare_backends(q, k, v, mask=mask, causal=True)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_inputs_in_a_later_split(rng, where, value):
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=2, lk=LK, d=8, dtype=np.float32)
    arrays = {"q": q, "k": k, "v": v}
    idx = (0, 1, 1, 3) if where == "q" else (0, 1, LK - 5, 3)
    arrays[where][idx] = value
    compare_backends(q, k, v)


def test_inf_value_behind_a_zero_weight(rng):
    """A key whose weight is exactly 0 (a -1e4 bias) in a later split leaves no trace."""
    q, k, v = qkv(rng, batch=(1,), hq=1, lq=1, lk=LK, d=8, dtype=np.float32)
    v[0, 0, LK - 3] = np.inf
    bias = np.zeros((1, LK), np.float32)
    bias[0, LK - 3] = -1e4
    out, _ = compare_backends(q, k, v, bias=bias)
    assert np.isfinite(out).all()


def test_large_logits_stay_finite(rng):
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=3, lk=LK, d=8, dtype=np.float32)
    bias = np.zeros((3, LK), np.float32)
    bias[:, 10] = 1e4
    bias[:, 500] = -1e4
    out, lse = compare_backends(q, k, v, bias=bias)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_same_bits_with_any_thread_count(rng):
    q, k, v = qkv(rng, batch=(1,), hq=3, lq=2, lk=4 * LK, d=32, dtype=np.float32)
    before = numba.get_num_threads()
    try:
        results = []
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            results.append(attnnb.attention(q, k, v, return_lse=True))
    finally:
        numba.set_num_threads(before)
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


@pytest.mark.parametrize("normalizer", ["softmax", "relu_expm1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lq", [ROWS, 7, LOCAL_TILE_ROWS])
def test_decoding_rows_have_the_bits_of_the_general_path(rng, lq, dtype, normalizer):
    """A decoding call's logits come from the keys as stored (full tiles, where
    ``LOGITS_FROM_KEYS``) or from key tiles its tasks transpose (the last, partial
    tile), a longer call's from the prologue's transposed tiles; each logit is the
    same chain of FMAs either way.  So the rows of a decoding call have the bits of
    the same rows inside a call of ``LOCAL_TILE_ROWS + 1`` queries (enough heads that
    neither call splits its keys)."""
    q, k, v = qkv(rng, batch=(4,), hq=8, hk=4, lq=LOCAL_TILE_ROWS + 1, lk=LK, d=24, dv=20,
                  dtype=dtype)
    few = np.ascontiguousarray(q[:, :, :lq])
    assert split_count(few, k) == 1 and split_count(q, k) == 1
    out, lse = attnnb.attention(few, k, v, normalizer=normalizer, return_lse=True,
                                backend="cpu")
    all_out, all_lse = attnnb.attention(q, k, v, normalizer=normalizer, return_lse=True,
                                        backend="cpu")
    np.testing.assert_array_equal(out, all_out[:, :, :lq])
    np.testing.assert_array_equal(lse, all_lse[:, :, :lq])


def test_split_rule_depends_on_the_shape_only():
    assert key_splits(1, 8, 1, 4096) == 4
    assert key_splits(1, 8, LOCAL_TILE_ROWS + 1, 4096) == 1  # not decoding
    assert key_splits(64, 8, 1, 4096) == 1  # enough tasks already
    assert key_splits(1, 1, 1, 100) == 1  # too few key tiles to split
    assert key_splits(1, 1, 1, 64 * 1000) == 32


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gradients_through_split_keys_match_the_reference(rng, dtype):
    """The backward reads the forward's ``out`` and ``lse``: from the merged splits here."""
    q, k, v = qkv(rng, batch=(1,), hq=4, hk=2, lq=3, lk=LK, d=16, dv=12, dtype=dtype)
    assert split_count(q, k) > 1
    dout = rng.standard_normal((1, 4, 3, 12)).astype(dtype)
    dlse = rng.standard_normal((1, 4, 3)).astype(dtype)
    got = attnnb.vjp(attnnb.attention, q, k, v, causal=True, normalizer="softmax1",
                     return_lse=True, backend="cpu")[1](dout, dlse)
    want = attnnb.vjp(attnnb.attention, q, k, v, causal=True, normalizer="softmax1",
                      return_lse=True, backend="reference")[1](dout, dlse)
    rtol = 1e-12 if dtype == np.float64 else 1e-4
    for name in want:
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err <= rtol, (name, err)


def test_gradient_through_split_keys_matches_finite_differences(rng):
    """d sum(out * w) / dq by central differences of the cpu forward itself (float64)."""
    q, k, v = qkv(rng, batch=(1,), hq=2, lq=1, lk=LK, d=8, dtype=np.float64)
    assert split_count(q, k) > 1
    w = rng.standard_normal((1, 2, 1, 8))
    grads = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu")[1](w)
    eps = 1e-6
    arrays = {"q": q, "k": k}
    for name, idx in [("q", (0, 0, 0, 0)), ("q", (0, 1, 0, 5)), ("k", (0, 0, 10, 3)),
                      ("k", (0, 1, LK - 7, 2))]:
        sums = []
        for step in (eps, -eps):
            moved = dict(arrays)
            moved[name] = arrays[name].copy()
            moved[name][idx] += step
            sums.append(np.sum(attnnb.attention(moved["q"], moved["k"], v, backend="cpu") * w))
        fd = (sums[0] - sums[1]) / (2 * eps)
        assert abs(grads[name][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (name, idx, fd)


def _few_rows_problem(rng, lq, dtype):
    """A decoding-shaped backward with everything that can go wrong: a mask, a bias, key
    sizes, a non-finite key in a masked-out column, GQA, ``Lk`` not a whole tile."""
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=lq, lk=LK - 7, d=24, dv=20, dtype=dtype)
    k[1, 0, 77, 3] = np.inf
    mask = rng.random((lq, LK - 7)) > 0.2
    mask[:, 77] = False
    kwargs = dict(mask=mask, bias=rng.standard_normal((4, 1, LK - 7)).astype(dtype),
                  key_size=rng.integers(1, 4, (2, LK - 7)).astype(dtype), causal=True,
                  return_lse=True)
    dout = rng.standard_normal((2, 4, lq, 20)).astype(dtype)
    dlse = rng.standard_normal((2, 4, lq)).astype(dtype)
    return (q, k, v), kwargs, (dout, dlse)


@pytest.mark.parametrize("one_sweep", [True, False])
@pytest.mark.parametrize("lq", [ROWS, 5, LOCAL_TILE_ROWS])
def test_backward_transposes_its_own_tiles_with_the_filled_tiles_bits(monkeypatch, rng, lq,
                                                                      one_sweep):
    """With few query rows the backward's tasks transpose each key and value tile
    themselves (or, where ``LOGITS_FROM_KEYS``, read full tiles as stored against the
    rows transposed) instead of a prologue over all of ``k`` and ``v``: the same
    products, so the same gradients bit for bit (the one-sweep and two-sweep kernels)."""
    import attnnb.cpu.backward as backward

    (q, k, v), kwargs, (dout, dlse) = _few_rows_problem(rng, lq, np.float32)
    monkeypatch.setattr(backward, "ONE_SWEEP_TASKS", 1 if one_sweep else 10**9)

    def grads():
        return attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kwargs)[1](dout, dlse)

    local = grads()
    monkeypatch.setattr(backward, "LOCAL_TILE_ROWS", 0)  # the filled tiles instead
    filled = grads()
    for name in ("q", "k", "v", "bias", "key_size"):
        assert np.isfinite(local[name]).all(), name
        np.testing.assert_array_equal(local[name], filled[name], err_msg=name)


@pytest.mark.parametrize("one_sweep", [True, False])
@pytest.mark.parametrize("lq", [1, ROWS - 1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_backward_of_fewer_rows_than_a_block_reads_keys_as_stored(monkeypatch, rng, lq, dtype,
                                                                 one_sweep):
    """Below ``ROWS`` query rows the backward forms ``q k^T`` and ``dout v^T`` by dot
    products on the keys and values as stored (no transposed tiles), as the forward
    does: the float64 reference's gradients, and float32 within its precision."""
    import attnnb.cpu.backward as backward

    (q, k, v), kwargs, (dout, dlse) = _few_rows_problem(rng, lq, dtype)
    monkeypatch.setattr(backward, "ONE_SWEEP_TASKS", 1 if one_sweep else 10**9)
    got = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kwargs)[1](dout, dlse)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    want = attnnb.vjp(attnnb.attention, *wide, backend="reference",
                      **{**kwargs, "bias": kwargs["bias"].astype(np.float64),
                         "key_size": kwargs["key_size"].astype(np.float64)})[1](
        dout.astype(np.float64), dlse.astype(np.float64))
    rtol = 1e-12 if dtype == np.float64 else 2e-5
    for name in ("q", "k", "v", "bias", "key_size"):
        assert np.isfinite(got[name]).all(), name
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err <= rtol, (name, err)

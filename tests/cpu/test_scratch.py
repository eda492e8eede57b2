"""The reused key-tile buffer of the CPU kernels (attnnb/cpu/_scratch.py)."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

import attnnb
from attnnb.cpu import _scratch


def qkv(rng, lk, d=16, dtype=np.float32):
    q = rng.standard_normal((1, 2, 33, d)).astype(dtype)
    k = rng.standard_normal((1, 2, lk, d)).astype(dtype)
    v = rng.standard_normal((1, 2, lk, 8)).astype(dtype)
    return q, k, v


def test_buffer_is_reused_kept_at_the_largest_and_released():
    k = np.zeros((1, 2, 100, 16), np.float32)
    v = np.zeros((1, 2, 100, 8), np.float32)
    _scratch.release()
    assert _scratch.held_bytes() == 0
    with _scratch.key_tile_buffers(k, v) as (kt, v_ok):
        assert kt.shape == (1, 2, 2, 16, 64) and v_ok.shape == (1, 2, 2)
        assert kt.flags.c_contiguous and kt.ctypes.data % _scratch.ALIGN == 0
        first = kt.ctypes.data
    held = _scratch.held_bytes()
    assert held >= kt.nbytes
    with _scratch.key_tile_buffers(k[:, :, :10], v[:, :, :10]) as (kt, _):  # fits: reused
        assert kt.ctypes.data == first
    assert _scratch.held_bytes() == held
    big = np.zeros((1, 2, 1000, 16), np.float32)
    with _scratch.key_tile_buffers(big, v[:, :, :1]) as (kt, _):  # too small: a new one
        assert kt.nbytes > held
    assert _scratch.held_bytes() > held  # the larger one is kept
    _scratch.release()
    assert _scratch.held_bytes() == 0


def test_calls_at_the_same_time_get_their_own_buffers():
    k = np.zeros((1, 1, 64, 4), np.float32)
    _scratch.release()
    with _scratch.key_tile_buffers(k, k) as (a, _):
        with _scratch.key_tile_buffers(k, k) as (b, _):
            assert not np.shares_memory(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_do_not_depend_on_the_buffer_history(dtype):
    # a small call after a large one runs in the large buffer; stale data must not leak in
    rng = np.random.default_rng(0)
    small = qkv(rng, 70, dtype=dtype)
    alone = attnnb.attention(*small, backend="cpu")
    _scratch.release()
    attnnb.attention(*qkv(rng, 300, dtype=dtype), backend="cpu")
    attnnb.sparse_attention(*small, attnnb.patterns.local((33, 70), 5), backend="cpu")
    np.testing.assert_array_equal(attnnb.attention(*small, backend="cpu"), alone)


def test_threads_share_the_pool_safely():
    rng = np.random.default_rng(1)
    problems = [qkv(rng, lk) for lk in (50, 130, 257, 64) * 3]
    expected = [attnnb.attention(*p, backend="cpu") for p in problems]
    with cf.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: attnnb.attention(*p, backend="cpu"), problems))
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)

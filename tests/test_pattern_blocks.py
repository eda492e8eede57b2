"""``Pattern.blocks()``: the block layout against straightforward versions, and its memory.

``_block_layout`` reads the CSR in passes of ``chunk`` entries to keep its
temporaries small; small ``chunk`` values make the tests cross many pass
boundaries (tile rows split between passes, passes inside one CSR row).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from attnnb import patterns as P
from attnnb.patterns import _block_layout

CHUNKS = (1, 3, 64, 1000, P._BLOCK_CHUNK)


def dense_layout(p, tq, tk):
    """``(tile_ptr, tile_idx, tile_full)`` from the dense mask, block by block."""
    Lq, Lk = p.shape
    mask = p.to_mask().reshape(p.n_heads, Lq, Lk)
    n_qt, n_kt = -(-Lq // tq), -(-Lk // tk)
    ptr, idx, full = [0], [], []
    for h in range(p.n_heads):
        for t in range(n_qt):
            for kt in range(n_kt):
                blk = mask[h, t * tq:(t + 1) * tq, kt * tk:(kt + 1) * tk]
                if blk.any():
                    idx.append(kt)
                    full.append(bool(blk.all()))
            ptr.append(len(idx))
    return np.array(ptr, np.int64), np.array(idx, np.int32), np.array(full, bool)


def counting_layout(p, tq, tk):
    """``(tile_ptr, tile_idx, tile_full)`` counting the pairs of every block in one go
    (``O(nnz)`` memory): usable at sizes where the dense mask is too large."""
    Lq, Lk = p.shape
    n_qt, n_kt = -(-Lq // tq), -(-Lk // tk)
    rows = np.repeat(np.arange(p.n_heads * Lq, dtype=np.int64), np.diff(p.indptr))
    code = (rows // Lq * n_qt + rows % Lq // tq) * n_kt + p.indices // tk
    present, counts = np.unique(code, return_counts=True)
    qt, kt = present // n_kt, present % n_kt
    rows_in = np.minimum(tq, Lq - qt % n_qt * tq)
    cols_in = np.minimum(tk, Lk - kt * tk)
    ptr = np.zeros(p.n_heads * n_qt + 1, np.int64)
    np.cumsum(np.bincount(qt, minlength=p.n_heads * n_qt), out=ptr[1:])
    return ptr, kt.astype(np.int32), counts == rows_in * cols_in


def assert_layout(lay, want, p, tq, tk):
    ptr, idx, full = want
    assert (lay.tile_q, lay.tile_k) == (tq, tk)
    assert (lay.n_qt, lay.n_kt) == (-(-p.shape[0] // tq), -(-p.shape[1] // tk))
    for name, got, exp in (("tile_ptr", lay.tile_ptr, ptr), ("tile_idx", lay.tile_idx, idx),
                           ("tile_full", lay.tile_full, full)):
        assert got.dtype == exp.dtype, name
        assert not got.flags.writeable, name
        np.testing.assert_array_equal(got, exp, err_msg=name)


def _random_per_head(rng):
    m = rng.random((3, 37, 29)) < 0.15
    m[0, 5:9] = False          # empty rows inside a tile row
    m[1, :16] = False          # an empty tile row
    m[2, :8, :8] = True        # a full block at (8, 8) tiles
    m[:, -1] = True            # a full last row (partial last tile row)
    return P.from_mask(m)


def _cases():
    rng = np.random.default_rng(7)
    layout = rng.random((2, 5, 4)) < 0.4
    layout[0, 1] = False
    yield "local", P.local(50, 3)
    yield "local causal rect wide", P.local((13, 40), 5, causal=True)
    yield "local causal rect tall", P.local((40, 13), 2, causal=True)  # early rows empty
    yield "strided", P.strided(45, 4)
    yield "fixed", P.fixed((30, 47), 6, 2, causal=False)
    yield "dilated", P.dilated(41, 3, 3, causal=True)
    yield "longformer", P.longformer(44, 2, [0, 17, 43])
    yield "bigbird", P.bigbird(53, 6, 1, 3, 2, seed=3)
    yield "block_sparse per head", P.block_sparse(layout, 7, shape=(33, 26))
    yield "from_mask per head", _random_per_head(rng)
    yield "local per head", P.local(30, 2) | P.from_mask(rng.random((2, 30, 30)) < 0.05)
    yield "dense", P.from_mask(np.ones((19, 23), bool))
    yield "one row", P.from_mask(rng.random((1, 70)) < 0.5)
    yield "empty", P.from_mask(np.zeros((2, 12, 9), bool))
    yield "no queries", P.local((0, 5), 1)
    yield "no keys", P.local((6, 0), 1)


CASES = list(_cases())
TILES = [(1, 1), (3, 5), (8, 8), (16, 7), (64, 64)]


@pytest.mark.parametrize("name,p", CASES, ids=[c[0] for c in CASES])
def test_blocks_equal_the_dense_layout(name, p):
    for tq, tk in TILES:
        want = dense_layout(p, tq, tk)
        assert_layout(p.blocks(tq, tk), want, p, tq, tk)
        for chunk in CHUNKS:
            assert_layout(_block_layout(p, tq, tk, chunk), want, p, tq, tk)


@pytest.mark.parametrize("seed", range(6))
def test_random_patterns_every_chunk(seed):
    rng = np.random.default_rng(seed)
    H = int(rng.integers(1, 4))
    Lq, Lk = (int(x) for x in rng.integers(1, 60, size=2))
    m = rng.random((H, Lq, Lk)) < rng.choice([0.02, 0.2, 0.9])
    m[:, rng.random(Lq) < 0.3] = False  # empty rows
    p = P.from_mask(m if H > 1 else m[0])
    tq, tk = (int(x) for x in rng.integers(1, 20, size=2))
    want = dense_layout(p, tq, tk)
    for chunk in CHUNKS + (int(rng.integers(2, 50)),):
        assert_layout(_block_layout(p, tq, tk, chunk), want, p, tq, tk)


def test_large_patterns_across_many_passes():
    """Many default-size passes, a tile row wider than a pass, and a sparse grid."""
    for p, tiles in ((P.local(8192, 300, causal=True), (64, 64)),
                     (P.from_mask(np.ones((70, 5000), bool)), (64, 64)),
                     (P.strided((3000, 9000), 97, causal=False), (16, 32)),
                     (P.local(4096, 40) | P.from_mask(np.eye(4096, dtype=bool)[None]
                                                       .repeat(3, 0)), (32, 128))):
        tq, tk = tiles
        assert p.nnz > 2 * P._BLOCK_CHUNK or p.n_heads > 1
        assert_layout(p.blocks(tq, tk), counting_layout(p, tq, tk), p, tq, tk)


def test_blocks_cached_and_kernel_tiles():
    p = P.local(300, 20, causal=True)
    lay = p.blocks()
    assert p.blocks() is lay and p.blocks(64, 64) is lay
    assert p.blocks(32, 64) is not lay
    assert lay.n_tiles == int(lay.tile_ptr[-1])


def test_blocks_temporary_memory_is_not_proportional_to_nnz():
    """The first ``blocks()`` of a 4.2 M-pair window allocates a few passes' worth of
    memory: counting every pair at once took 175 MiB here (42 bytes a pair)."""
    p = P.local(16384, 256, causal=True)
    assert p.nnz > 4_000_000
    tracing = tracemalloc.is_tracing()  # leave a tracer started by someone else running
    if not tracing:
        tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        lay = p.blocks()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if not tracing:
            tracemalloc.stop()
    assert lay.n_tiles == 256 * 5 - (4 + 3 + 2 + 1)  # a band of 5 key tiles per tile row
    assert peak - before < p.nnz  # under one byte a pair (int32 indices are 4)
    assert peak - before < 8 * 2**20

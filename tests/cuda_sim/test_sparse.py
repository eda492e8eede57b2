"""sparse_attention() and topk_attention() on the cuda backend against the float64 reference."""

import numpy as np
import pytest

from ..helpers import assert_close, qkv
from .common import SIMULATOR, assert_several_tiles, host, n, to_device

patterns = pytest.importorskip("attnnb.patterns", reason="sparse attention is not in this tree yet")
sparse = pytest.importorskip("attnnb.sparse")
NORMALIZERS = ["softmax", "softmax1", "relu_expm1"]


def compare(fn, q, k, v, arg, dtype=None, **kw):
    out, lse = fn(q, k, v, arg, return_lse=True, backend="cuda", **kw)
    ref, ref_lse = fn(q, k, v, arg, return_lse=True, backend="reference", **kw)
    assert isinstance(out, np.ndarray) and out.dtype == ref.dtype
    assert_close(out, ref, dtype or out.dtype)
    assert_close(lse, ref_lse, dtype or out.dtype, what="lse")
    return out, lse


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_sparse_patterns(rng, dtype, normalizer):
    """Shared and per-head patterns, rectangles, GQA, key sizes; empty rows included."""
    lq, lk = n(7), n(10)
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=lq, lk=lk, d=3, dv=2, dtype=dtype)
    key_size = rng.integers(1, 4, (2, lk))
    shared = patterns.local((lq, lk), 2) | patterns.strided((lq, lk), 3)
    compare(sparse.sparse_attention, q, k, v, shared, key_size=key_size, normalizer=normalizer)
    per_head = rng.random((4, lq, lk)) > 0.6
    per_head[1, 3] = False  # an empty row
    per_head[2, :, :4] = True  # full tiles next to partial ones
    compare(sparse.sparse_attention, q, k, v, patterns.from_mask(per_head),
            normalizer=normalizer)


def test_sparse_device_arrays(rng):
    q, k, v = qkv(rng, hq=2, lq=n(6), lk=n(9), d=3, dtype=np.float32)
    pat = patterns.local((q.shape[-2], k.shape[-2]), 1, causal=True)
    ref = sparse.sparse_attention(q, k, v, pat, backend="reference")
    out = sparse.sparse_attention(*to_device(q, k, v), pat)
    assert hasattr(out, "copy_to_host")
    assert_close(host(out), ref, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("top_k", [0, 1, 3, 50])
@pytest.mark.parametrize("causal", [False, True])
def test_topk(rng, dtype, top_k, causal):
    """Mask, causal, key sizes, GQA, Lq != Lk; ties go to the lower key index."""
    lq, lk = n(6), n(10)
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=lq, lk=lk, d=3, dv=2, dtype=dtype)
    k[..., 7, :] = k[..., 2, :]  # exact ties between keys 2 and 7
    mask = rng.random((lq, lk)) > 0.2
    key_size = rng.integers(1, 3, (2, lk))
    compare(sparse.topk_attention, q, k, v, top_k, mask=mask, causal=causal, key_size=key_size)


def test_topk_nan_rows_and_chunked_launches(rng, monkeypatch):
    """A NaN logit spoils its row only; a tiny scratch budget forces one launch per tile."""
    from attnnb.cuda import topk

    monkeypatch.setattr(topk, "SCRATCH_ELEMENTS", 1)
    q, k, v = qkv(rng, hq=2, lq=n(9), lk=n(8), d=3)
    q[1, 4, 0] = np.nan
    out, _ = compare(sparse.topk_attention, q, k, v, 3)
    assert np.isnan(out[1, 4]).all() and np.isfinite(np.delete(out[1], 4, axis=0)).all()
    d_out = sparse.topk_attention(*to_device(q, k, v), 3)
    assert_close(host(d_out), out, np.float64)


@pytest.mark.parametrize("normalizer", ["softmax", "relu_expm1"])
def test_sparse_several_tiles_per_axis(rng, normalizer):
    """Three query and three key tiles: full, partial and skipped tiles in one sweep,
    value columns over the threads of a row (one padded), per-head patterns, GQA."""
    lq, lk, d, dv = n(11), n(16), 5, 7
    assert_several_tiles(lq, lk, d, dv)
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=lq, lk=lk, d=d, dv=dv, dtype=np.float32)
    allowed = rng.random((2, lq, lk)) > 0.5
    allowed[:, :4, :6] = True  # a full tile
    allowed[:, 4:8, 6:12] = False  # a skipped tile
    allowed[1, 9] = False  # an empty row
    pattern = patterns.from_mask(allowed)
    if SIMULATOR:
        from attnnb.cuda._micro import tiling_for

        tiling = tiling_for(np.float32, d, dv)
        layout = pattern.blocks(tiling.bq, tiling.bk)
        n_grid = pattern.n_heads * -(-lq // tiling.bq) * -(-lk // tiling.bk)
        assert layout.tile_full.any() and not layout.tile_full.all()
        assert layout.n_tiles < n_grid
    key_size = rng.integers(1, 4, (1, lk))
    compare(sparse.sparse_attention, q, k, v, pattern, key_size=key_size, normalizer=normalizer)


@pytest.mark.parametrize("causal", [False, True])
def test_topk_several_tiles_per_axis(rng, monkeypatch, causal):
    """Three query and three key tiles, ties across key tiles, a mask, key sizes, one
    launch per query tile; value columns over the threads of a row."""
    from attnnb.cuda import topk

    lq, lk, d, dv = n(11), n(16), 5, 7
    assert_several_tiles(lq, lk, d, dv)
    q, k, v = qkv(rng, batch=(1,), hq=2, hk=1, lq=lq, lk=lk, d=d, dv=dv, dtype=np.float32)
    k[..., 13, :] = k[..., 1, :]  # exact ties in the first and the last key tile
    k[..., 8, :] = k[..., 1, :]
    mask = rng.random((lq, lk)) > 0.15
    key_size = rng.integers(1, 3, (1, lk))
    for top_k in (2, 5):
        compare(sparse.topk_attention, q, k, v, top_k, mask=mask, key_size=key_size,
                causal=causal)
    monkeypatch.setattr(topk, "SCRATCH_ELEMENTS", 1)
    compare(sparse.topk_attention, q, k, v, 5, mask=mask, causal=causal)

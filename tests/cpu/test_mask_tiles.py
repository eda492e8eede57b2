"""A boolean mask's tile map (attnnb/cpu/_mask_tiles.py): the classes, and the kernels
that skip empty tiles and the per-element test of full ones, against the reference."""

from __future__ import annotations

import numpy as np
import pytest

import attnnb
from attnnb.cpu._mask_tiles import EMPTY, FULL, PARTIAL, mask_tile_classes


def _classes_by_numpy(mask):
    B, H, Lq, Lk = mask.shape
    nq, nk = -(-Lq // 64), -(-Lk // 64)
    out = np.empty((B, H, nq, nk), np.int8)
    for b, h, i, j in np.ndindex(out.shape):
        block = mask[b, h, 64 * i:64 * i + 64, 64 * j:64 * j + 64]
        out[b, h, i, j] = PARTIAL if block.any() and not block.all() else (
            FULL if block.all() else EMPTY)
    return out


def _window(L, w):
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    return (j <= i) & (j > i - w)


def _documents(L, n):
    doc = np.arange(L) * n // L
    return doc[:, None] == doc[None, :]


def test_classes_of_full_and_broadcast_masks():
    rng = np.random.default_rng(0)
    full = rng.random((2, 3, 150, 200)) < 0.5
    full[:, :, :64, :64] = True
    full[:, :, 64:128, 128:] = False
    np.testing.assert_array_equal(mask_tile_classes(full), _classes_by_numpy(full))
    pad = np.ones((2, 1, 1, 200), bool)
    pad[1, ..., 120:] = False  # batch 1: the last 80 keys are padding
    classes = mask_tile_classes(np.broadcast_to(pad, (2, 4, 150, 200)))
    assert classes.shape == (2, 1, 1, 4)  # broadcast axes classified once
    np.testing.assert_array_equal(classes[0, 0, 0], [FULL] * 4)
    np.testing.assert_array_equal(classes[1, 0, 0], [FULL, PARTIAL, EMPTY, EMPTY])


MASKS = {
    "sliding window 70": lambda L: _window(L, 70),
    "4 documents": lambda L: _documents(L, 4),
    "padding": lambda L: np.broadcast_to(np.arange(L) < L - 90, (L, L)),
    "empty rows": lambda L: np.where(np.arange(L)[:, None] < 70, False, _window(L, 100)),
}


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_block_masks_against_the_reference(name, causal, dtype, rtol):
    """Masks that leave whole tiles empty or full: outputs, LSEs and every gradient
    against the float64 reference (GQA, Lq != Lk tiles, 2 batch elements)."""
    rng = np.random.default_rng(1)
    L = 300
    mask = MASKS[name](L)
    q = rng.standard_normal((2, 4, L, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, L, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, L, 8)).astype(dtype)
    kw = dict(mask=mask, causal=causal, return_lse=True)
    (out, lse), pb = attnnb.vjp(attnnb.attention, q, k, v, backend="cpu", **kw)
    (ref, ref_lse), pb_ref = attnnb.vjp(attnnb.attention, q.astype(np.float64),
                                        k.astype(np.float64), v.astype(np.float64),
                                        backend="reference", **kw)
    np.testing.assert_allclose(out, ref, rtol=0, atol=rtol * np.abs(ref).max())
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=rtol)
    dout = rng.standard_normal(out.shape)
    g, r = pb(dout.astype(dtype)), pb_ref(dout)
    for n in r:
        np.testing.assert_allclose(g[n], r[n], rtol=0, atol=10 * rtol * np.abs(r[n]).max(),
                                   err_msg=n)


def test_padding_mask_per_batch_element():
    """A (B, 1, 1, Lk) padding mask differing per batch element, decoding rows too."""
    rng = np.random.default_rng(2)
    pad = np.ones((2, 1, 1, 260), bool)
    pad[1, ..., 70:] = False
    for Lq in (3, 130):
        q = rng.standard_normal((2, 2, Lq, 8))
        k, v = rng.standard_normal((2, 2, 260, 8)), rng.standard_normal((2, 2, 260, 8))
        out = attnnb.attention(q, k, v, mask=pad, backend="cpu")
        ref = attnnb.attention(q, k, v, mask=pad, backend="reference")
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)

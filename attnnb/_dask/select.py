"""Exact top-k selection across key blocks.

A row keeps its ``top_k`` largest ranking logits ``x = s + log key_size``
(``-inf`` outside its allowed set), equal ones going to the lower key
index (docs/contract.md §2.3).  The ``top_k`` best of a union of key blocks
are among the ``top_k`` best of each block, so:

1. each key block lists its candidates: its ``min(top_k, nk)`` best keys per
   row, as values and global key indices in increasing index order
   (:func:`candidates`);
2. candidate lists are merged in key-block order, keeping the ``top_k`` best
   again (:func:`merge_candidates`): the order of the indices survives, so
   "lower index first" is a matter of position;
3. the final list gives each row its threshold ``thr`` (the ``top_k``-th
   best value) and cut (the last index kept at ``thr``) (:func:`selection`):
   key ``j`` is kept when ``x > thr``, or ``x == thr`` and ``j <= cut``,
   the rule of :mod:`attnnb._core.selection`;
4. each key block then runs :func:`attnnb.attention` masked to its kept
   keys (:func:`topk_part`), with the call's normalizer, and the parts merge
   as that normalizer's parts do (:func:`attnnb._dask.ops.part_rules`).

The ranking logits are computed on the host in the compute dtype
(``(q * scale) @ k^T + log key_size``, :func:`attnnb._dask.logits.block_logits`),
block by block (an ``(nq, nk)`` array per head of the block); the weights are
the backend's.  The product is :func:`attnnb._dask.products.ordered_products`,
whose entries do not depend on where a key sits: a BLAS product's rounding depends on the
matrix shape and even on the column (OpenBLAS's AVX2 kernel), so it could
give two equal keys in different blocks logits one unit in the last place
apart, and the lower index would then not win their tie.  A row with
a NaN among its allowed logits keeps its whole allowed set, so that the
NaN reaches it, as in one call.
"""

from __future__ import annotations

import numpy as np

from .._front.eager import attention
from .blocks import key_heads, namespace, native
from .logits import block_logits


def _best(values, index, top_k):
    """The ``min(top_k, n)`` best of each row (largest values, ties to earlier positions),
    in their order of position: ``(values, index)``."""
    xp = namespace(values)
    n = values.shape[-1]
    kk = min(top_k, n)
    if kk == n:
        return values, index
    kth = -xp.partition(-values, kk - 1, axis=-1)[..., kk - 1:kk]
    above = values > kth
    tied = values == kth
    need = kk - above.sum(axis=-1, keepdims=True)
    keep = above | (tied & (xp.cumsum(tied, axis=-1) <= need))
    shape = values.shape[:-1] + (kk,)
    # exactly kk per row, found in row-major order: positions increase along each row
    return values[keep].reshape(shape), index[keep].reshape(shape)


def candidates(q, k, mask, key_size, *, start, top_k, limit, heads, scale, mask_mod=None,
               score_mod=None):
    """Phase 1 on one key block: ``(values, key indices, nan rows)`` of its best keys."""
    k, _ = key_heads(k, None, heads)
    x, _ = block_logits(q, k, mask, key_size, limit, scale, mask_mod, score_mod)
    xp = namespace(x)
    nan = xp.isnan(x).any(axis=-1)
    x = xp.where(xp.isnan(x), -np.inf, x)
    index = xp.broadcast_to(xp.arange(start, start + x.shape[-1]), x.shape)
    values, index = _best(x, index, top_k)
    return values, index, nan


def merge_candidates(parts, *, top_k):
    """Phase 1's lists of consecutive key blocks merged (in key-block order)."""
    xp = namespace(parts[0][0])
    values = xp.concatenate([p[0] for p in parts], axis=-1)
    index = xp.concatenate([p[1] for p in parts], axis=-1)
    nan = parts[0][2]
    for p in parts[1:]:
        nan = nan | p[2]
    values, index = _best(values, index, top_k)
    return values, index, nan


def selection(merged, *, top_k):
    """``(thr, cut, nan)`` per row from the final candidate list (see the module docstring)."""
    values, index, nan = merged
    xp = namespace(values)
    kk = min(top_k, values.shape[-1])
    kth = -xp.partition(-values, kk - 1, axis=-1)[..., kk - 1]
    at = values == kth[..., None]  # the list holds exactly the kept keys
    cut = xp.where(at, index, -1).max(axis=-1)
    cut = xp.where(kth == -np.inf, -1, cut)  # fewer than top_k allowed keys: keep them all
    return kth, cut, nan


def topk_part(q, k, v, mask, key_size, chosen, *, start, limit, heads, scale, normalizer,
              backend, sigmoid_bias=None, mask_mod=None, score_mod=None):
    """Phase 2 on one key block: ``(out, lse)`` of attention over the keys it keeps (the
    score function weighs them as it ranked them; ``normalizer`` and the whole call's
    ``sigmoid_bias`` weigh the kept keys)."""
    k, v = key_heads(k, v, heads)
    x, allowed = block_logits(q, k, mask, key_size, limit, scale, mask_mod, score_mod)
    xp = namespace(x)
    thr, cut, nan = chosen
    index = xp.arange(start, start + x.shape[-1])
    thr, cut = thr[..., None], cut[..., None]
    keep = (x > thr) | ((x == thr) & (index <= cut))
    keep = xp.where(nan[..., None], allowed, keep)
    out, lse = attention(q, k, v, mask=keep, key_size=key_size, scale=scale,
                         normalizer=normalizer, return_lse=True, sigmoid_bias=sigmoid_bias,
                         backend=backend, score_mod=score_mod)
    return native(out, q), native(lse, q)

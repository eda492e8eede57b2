"""The Heaviside mode of differential attention across key blocks.

The weights ``A1 - lam H(A1 - lam A2)`` (docs/contract.md §2.4) of one key
block are those of the maps over every key block, ``A_c = e^(x_c - T_c)``
with ``T_c`` the map's LSE over all of them (learned sinks included).  Unlike
the rectified clip, the gate does not scale with the maps (a gated key loses
``lam``, not a share of its weight), so no call of the backend on the block
gives the block's share: the weights are formed here, key by key, from the
block's logits (:func:`attnnb._dask.logits.block_logits`) in float64, as the
reference forms them, and weigh the values with IEEE sums (a zero weight
carries no value).  For float32 inputs a map below float32's smallest normal
number counts as 0, as in the kernels: the literal gate opens wherever ``A1 >
lam A2``, however small both are, so a float64 gate would subtract ``lam`` at
keys that a float32 call, or a query block that sees one key block, leaves at 0.
"""

from __future__ import annotations

import numpy as np

from .blocks import key_heads, lam_rows, namespace
from .logits import block_logits


def heaviside_part(q, k, v, mask, bias, key_size, lam, total, *, limit, heads, scale, backend,
                   mask_mod=None, score_mod=None):
    """One key block's share of Heaviside-gated differential attention, in ``q``'s dtype.

    ``total`` are the maps' LSEs over every key block ``(T1, T2)``; the other
    arguments as in :mod:`attnnb._dask.blocks` (``backend`` is not used: the
    block's work is on the host).  Keys neither map weighs (both ``A_c`` zero: in
    float64, or below float32's smallest normal number for float32 inputs) stay
    closed, as in one call; a row whose LSE is NaN gets NaN.
    """
    k, v = key_heads(k, v, heads, pairs=True)
    xp = namespace(q)
    lam = xp.asarray(lam_rows(lam, tuple(total[0].shape), np.float64))[..., None]
    maps = []
    for c, lse in enumerate(total):
        x, _ = block_logits(q[..., c::2, :, :], k[..., c::2, :, :], mask, key_size, limit,
                            scale, mask_mod, score_mod, bias=bias, ordered=False)
        lse = lse.astype(np.float64)
        lse = xp.where(lse == -np.inf, 0, lse)[..., None]  # an empty row: x is -inf too
        with np.errstate(invalid="ignore", over="ignore"):
            a = xp.exp(x.astype(np.float64) - lse)
        # a float32 map below float32's smallest normal number is 0, as the kernels'
        # float32 exponential gives it: the gate of a key neither map weighs stays closed
        # (in float64 it would open wherever A1 > lam A2, and subtract lam there)
        maps.append(xp.where(a < np.finfo(q.dtype).tiny, 0, a) if q.dtype == np.float32
                    else a)
    with np.errstate(invalid="ignore"):
        gap = maps[0] - lam * maps[1]
        gate = xp.where(xp.isnan(gap), np.nan, (gap > 0).astype(np.float64))
        weights = maps[0] - lam * gate
    return weighted_sums(weights, v).astype(q.dtype)


def weighted_sums(weights, v):
    """float64 ``weights @ v`` per query head, ``S + (H, nq, Dv)`` (query head ``h`` reads
    value head ``h // (H // Hv)``), with the IEEE sums of one weighted sum per key where
    values are not finite: a zero weight carries no value (§1.1)."""
    xp = namespace(v)
    *batch, h, nq, nk = weights.shape
    hv, dv = v.shape[-3], v.shape[-1]
    w = weights.reshape(*batch, hv, (h // hv) * nq, nk)
    values = v.astype(np.float64)
    finite = xp.isfinite(values)
    with np.errstate(invalid="ignore"):
        sums = w @ xp.where(finite, values, 0)
        if not bool(finite.all()):  # count the infinities and NaNs that nonzero weights carry
            up, down = (w > 0).astype(np.float64), (w < 0).astype(np.float64)
            pos, neg = ((values == x).astype(np.float64) for x in (np.inf, -np.inf))
            rising = up @ pos + down @ neg
            falling = up @ neg + down @ pos
            nans = (up + down) @ xp.isnan(values).astype(np.float64)
            sums = xp.where(rising > 0, np.inf, sums)
            sums = xp.where(falling > 0, -np.inf, sums)
            sums = xp.where((nans > 0) | ((rising > 0) & (falling > 0)), np.nan, sums)
    return sums.reshape(*batch, h, nq, dv)

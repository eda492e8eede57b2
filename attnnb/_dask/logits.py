"""A block's logits on the host, for the decisions a Dask graph makes per key.

Top-k's selection (:mod:`attnnb._dask.select`) ranks keys and the Heaviside
gate (:mod:`attnnb._dask.gates`) compares two maps key by key across key
blocks; both need the logits of a (query block, key block) pair as one call
forms them: ``scale q k^T``, then the score function, then the bias, then
``log key_size``, with ``-inf`` outside the allowed set (docs/contract.md
§1.1).
"""

from __future__ import annotations

import numpy as np

from .blocks import namespace
from .products import ordered_products


def block_logits(q, k, mask, key_size, limit, scale, mask_mod=None, score_mod=None, bias=None,
                 ordered=True):
    """``x = f((q * scale) @ k^T) + bias + log key_size``, ``-inf`` where not allowed; and
    the allowed set.

    Parameters
    ----------
    q : array ``S + (Hq, nq, D)``
    k : array ``S + (Hk, nk, D)``
        Query head ``h`` reads key head ``h // (Hq // Hk)``.
    mask : bool array broadcastable to ``S + (Hq, nq, nk)``, or None
    key_size : array broadcastable to ``S + (nk,)``, or None
    limit : :class:`~attnnb._dask.visible.Diagonal` or None
        The causal limit where it crosses the block.
    scale : float
    mask_mod, score_mod : the call's functions placed at the block, or None
        ``f`` is the score function (none: the identity); the mask function's
        pairs leave the allowed set.
    bias : array broadcastable to ``S + (Hq, nq, nk)``, or None
    ordered : bool
        The products of :func:`~attnnb._dask.products.ordered_products`, whose
        rounding does not depend on where a key sits (top-k's ties need it);
        False: the array library's matrix product.

    Returns
    -------
    x : array ``S + (Hq, nq, nk)`` in ``q``'s dtype
    allowed : bool array broadcastable to ``x``
    """
    xp = namespace(q)
    *batch, hq, nq, d = q.shape
    hk, nk = k.shape[-3], k.shape[-2]
    qs = (q * q.dtype.type(scale)).reshape(*batch, hk, (hq // hk) * nq, d)
    kt = xp.broadcast_to(xp.swapaxes(k, -1, -2), (*batch, hk, d, nk))
    x = (ordered_products(xp, qs, kt) if ordered else qs @ kt).reshape(*batch, hq, nq, nk)
    if score_mod is not None or mask_mod is not None:
        x, mask = _with_mods(xp, x, mask, mask_mod, score_mod)
    if bias is not None:
        x = x + xp.asarray(bias).astype(x.dtype)
    if key_size is not None:
        logs = xp.log(xp.asarray(key_size).astype(np.float64)).astype(q.dtype)
        x = x + xp.broadcast_to(logs, (*batch, nk))[..., None, None, :]
    if limit is not None:
        diagonal = xp.asarray(limit.mask(nq, nk))
        mask = diagonal if mask is None else xp.logical_and(mask, diagonal)
    allowed = xp.ones((nq, nk), bool) if mask is None else xp.asarray(mask)
    return xp.where(allowed, x, -np.inf), allowed


def _with_mods(xp, x, mask, mask_mod, score_mod):
    """The block's logits through the score function and its mask through the mask
    function (host float64 loops of :mod:`attnnb._mods.compile`, as the reference's)."""
    from .._mods.compile import mask_values, score_values

    shape = x.shape
    flat = (int(np.prod(shape[:-3], dtype=np.int64)), *shape[-3:])
    if score_mod is not None:
        s, _ = score_values(score_mod, np.asarray(x, np.float64).reshape(flat), shape[-2])
        x = xp.asarray(s.reshape(shape).astype(x.dtype))
    if mask_mod is not None:
        allowed = xp.asarray(mask_values(mask_mod, flat).reshape(shape))
        mask = allowed if mask is None else xp.logical_and(mask, allowed)
    return x, mask

"""Sparse attention: :func:`sparse_attention` over a pattern, and :func:`topk_attention`."""

from __future__ import annotations

from ._core.dropout import refuse_lazy_dropout
from ._dask import any_dask
from ._front import eager as _eager


def sparse_attention(q, k, v, pattern, *, key_size=None, scale=None, normalizer="softmax",
                     return_lse=False, dropout_p=0.0, seed=None, sinks=None, sigmoid_bias=None,
                     mask_mod=None, score_mod=None, backend=None):
    """Attention over a sparse pattern, at a cost proportional to its allowed pairs.

    Equal to ``attention(q, k, v, mask=pattern.to_mask(), ...)``: each query's
    weights are renormalised over the keys the pattern allows it.

    Parameters
    ----------
    q : array ``(*batch, Hq, Lq, D)`` or ``(Lq, D)``
    k : array ``(*batch, Hk, Lk, D)`` or ``(Lk, D)``
    v : array ``(*batch, Hk, Lk, Dv)`` or ``(Lk, Dv)``
        Grouped-query attention as :func:`attnnb.attention`.
    pattern : :class:`attnnb.patterns.Pattern`
        Of shape ``(Lq, Lk)``, shared by every head (``n_heads == 1``) or one
        per query head (``n_heads == Hq``); shared by the batch.
    key_size : positive array broadcastable to ``(*batch, Lk)``, optional
        Proportional attention, as in :func:`attnnb.attention`.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    normalizer : {"softmax", "softmax1", "relu_expm1", "sigmoid", "softpick"}
    return_lse : bool
    dropout_p, seed
        Attention dropout, as in :func:`attnnb.attention`: the same decisions
        as dense attention with the pattern as a mask and the same seed.
    sinks : real array broadcastable to ``(*batch, Hq)``, optional
        Learned attention sinks, as in :func:`attnnb.attention`.
    sigmoid_bias : float or real array broadcastable to ``(*batch, Hq)``, optional
        As in :func:`attnnb.attention` (default ``-log(Lk)``); :func:`attnnb.vjp`
        refuses an array here (no gradient for it yet).
    mask_mod, score_mod : optional
        As in :func:`attnnb.attention` (:mod:`attnnb.mods`): the mask function
        is intersected with the pattern.
    backend : {None, "auto", "reference", "cpu", "cuda"}

    Returns
    -------
    out : array ``(*batch, Hq, Lq, Dv)``
        Queries the pattern gives no key get zeros.
    lse : array ``(*batch, Hq, Lq)``, with ``return_lse=True``; ``-inf`` on empty rows.

    Notes
    -----
    The kernels visit, per tile of 64 queries, only the 64-key tiles the
    pattern touches (``pattern.blocks()``), masking element by element only
    inside partially allowed tiles.  Block-aligned patterns (windows,
    Longformer, BigBird, block-sparse) thus cost close to their allowed
    pairs; a pattern leaving a few keys in every tile (e.g. ``strided`` with a
    stride up to 64) costs as much as the tiles it touches.

    Examples
    --------
    >>> import numpy as np, attnnb
    >>> from attnnb import patterns
    >>> q = k = v = np.random.default_rng(0).standard_normal((2, 512, 32), dtype=np.float32)
    >>> out = attnnb.sparse_attention(q, k, v, patterns.local(512, 64, causal=True))
    >>> out.shape
    (2, 512, 32)
    """
    if any_dask(q, k, v):
        from ._dask.ops import sparse_attention as lazy

        refuse_lazy_dropout(dropout_p)
        return lazy(q, k, v, pattern, key_size=key_size, scale=scale, normalizer=normalizer,
                    return_lse=return_lse, sinks=sinks, sigmoid_bias=sigmoid_bias,
                    mask_mod=mask_mod, score_mod=score_mod, backend=backend)
    return _eager.sparse_attention(q, k, v, pattern, key_size=key_size, scale=scale,
                                   normalizer=normalizer, return_lse=return_lse,
                                   dropout_p=dropout_p, seed=seed, sinks=sinks,
                                   sigmoid_bias=sigmoid_bias, mask_mod=mask_mod,
                                   score_mod=score_mod, backend=backend)


def topk_attention(q, k, v, top_k, *, mask=None, causal=False, key_size=None, scale=None,
                   normalizer="softmax", return_lse=False, dropout_p=0.0, seed=None,
                   sinks=None, sigmoid_bias=None, mask_mod=None, score_mod=None, backend=None):
    """Attention over each query's ``top_k`` largest allowed softmax weights.

    Query ``i`` ranks its allowed keys (``mask``, ``causal``) by
    ``key_size[j] * exp(s[i, j])``, keeps the ``top_k`` largest -- equal
    weights go to the lower key index, so exactly ``min(top_k, allowed)``
    keys are kept -- and the normalizer weighs the kept ones (softmax: it is
    renormalised over them).

    Parameters
    ----------
    q, k, v : arrays as in :func:`attnnb.attention`
    top_k : int >= 0
        Keys kept per query; ``top_k >= Lk`` is plain masked attention and
        ``top_k = 0`` gives empty rows (zeros, ``lse = -inf``).
    mask : bool array broadcastable to ``(*batch, Hq, Lq, Lk)``, optional
    causal : bool
        Bottom-right aligned, as :func:`attnnb.attention`.
    key_size : positive array broadcastable to ``(*batch, Lk)``, optional
    scale : float, optional
    normalizer : {"softmax", "softmax1", "relu_expm1", "sigmoid", "softpick"}
        As in :func:`attnnb.attention`, over the kept keys; the ranking is
        softmax's for every normalizer (``sigmoid``'s bias takes no part in it).
    return_lse : bool
        LSE over the kept keys.
    dropout_p, seed
        Attention dropout over the kept keys' weights, as in
        :func:`attnnb.attention` (the selection is made before dropout).
    sinks : real array broadcastable to ``(*batch, Hq)``, optional
        Learned attention sinks over the kept keys, as in :func:`attnnb.attention`
        (they take no part in the selection).
    sigmoid_bias : float or real array broadcastable to ``(*batch, Hq)``, optional
        As in :func:`attnnb.attention` (default ``-log(Lk)``, the keys' count
        before the selection); :func:`attnnb.vjp` refuses an array here.
    mask_mod, score_mod : optional
        As in :func:`attnnb.attention` (:mod:`attnnb.mods`): keys are ranked by
        their modified logits, among those the mask function allows.
    backend : {None, "auto", "reference", "cpu", "cuda"}

    Returns
    -------
    out : array ``(*batch, Hq, Lq, Dv)``
    lse : array ``(*batch, Hq, Lq)``, with ``return_lse=True``

    Notes
    -----
    Keys whose weight is exactly zero (logit ``-inf``) are never kept. A
    query with a NaN among its allowed logits gets a NaN row (the NaN is
    not ranked). The ranking is by the softmax weights for every normalizer:
    for ``relu_expm1``, ``softpick`` and ``sigmoid`` without key sizes it is
    their own order too (each weight grows with its logit).
    """
    if any_dask(q, k, v):
        from ._dask.ops import topk_attention as lazy

        refuse_lazy_dropout(dropout_p)
        return lazy(q, k, v, top_k, mask=mask, causal=causal, key_size=key_size, scale=scale,
                    normalizer=normalizer, return_lse=return_lse, sinks=sinks,
                    sigmoid_bias=sigmoid_bias, mask_mod=mask_mod, score_mod=score_mod,
                    backend=backend)
    return _eager.topk_attention(q, k, v, top_k, mask=mask, causal=causal, key_size=key_size,
                                 scale=scale, normalizer=normalizer, return_lse=return_lse,
                                 dropout_p=dropout_p, seed=seed, sinks=sinks,
                                 sigmoid_bias=sigmoid_bias, mask_mod=mask_mod,
                                 score_mod=score_mod, backend=backend)

"""Dense attention: :func:`attention`."""

from __future__ import annotations

from ._core.dropout import refuse_lazy_dropout
from ._dask import any_dask
from ._front import eager as _eager


def attention(q, k, v, *, mask=None, bias=None, key_size=None, causal=False, scale=None,
              normalizer="softmax", return_lse=False, dropout_p=0.0, seed=None, sinks=None,
              sigmoid_bias=None, mask_mod=None, score_mod=None, backend=None):
    """Scaled dot-product attention with masks, bias, key sizes and other normalizers.

    Parameters
    ----------
    q : array ``(*batch, Hq, Lq, D)`` or ``(Lq, D)``
    k : array ``(*batch, Hk, Lk, D)`` or ``(Lk, D)``
        ``Hq`` must be a multiple of ``Hk`` (grouped-query attention: query
        head ``h`` uses key head ``h // (Hq // Hk)``).
    v : array ``(*batch, Hk, Lk, Dv)`` or ``(Lk, Dv)``
    mask : bool array broadcastable to ``(*batch, Hq, Lq, Lk)``, optional
        True where query ``i`` may attend key ``j``.
    bias : array broadcastable to ``(*batch, Hq, Lq, Lk)``, optional
        Added to the scaled logits.
    key_size : positive array broadcastable to ``(*batch, Lk)``, optional
        Proportional attention (Token Merging): key ``j`` counts as
        ``key_size[j]`` identical keys.  ToMe's ``(B, N, 1)`` size arrays are
        accepted as they are.
    causal : bool
        Key ``j`` is allowed for query ``i`` only when ``j <= i + Lk - Lq``
        (bottom-right aligned, as FlashAttention).
    scale : float, optional
        Logit scale, default ``1 / sqrt(D)``.
    normalizer : {"softmax", "softmax1", "relu_expm1", "sigmoid", "softpick"}
        ``softmax1`` adds 1 to the denominator (a head may attend to
        nothing); ``relu_expm1`` uses ``max(0, exp(s) - 1)`` as the kernel;
        ``softpick`` the same numerator over ``eps + sum_j |exp(s) - 1|``
        (Zuhri et al. 2025; ``lse`` is the log of that sum without ``eps``);
        ``sigmoid`` weighs each key on its own, ``w = key_size[j] *
        sigmoid(s + sigmoid_bias)``, with no normalisation (Ramapuram et al.
        2024).
    return_lse : bool
        Also return ``lse = log sum_j key_size[j] * phi(s[i, j])`` over the
        allowed set (without softmax1's ``+1``), the weights' before dropout
        (for ``sigmoid``: the log of the row's total weight).
    dropout_p : float
        Attention dropout, as FlashAttention's: each weight ``(b, h, i, j)`` is
        dropped with probability ``dropout_p`` and the kept ones scaled by
        ``1 / (1 - dropout_p)``.  The decisions are a pure function of ``seed``
        and the four indices (:mod:`attnnb._core.dropout`), the same on every
        backend, and :func:`attnnb.vjp` regenerates them: nothing
        ``(Lq, Lk)`` is stored.
    seed : int in ``[0, 2**64)``, optional
        Required when ``dropout_p > 0``.
    sinks : real array broadcastable to ``(*batch, Hq)``, optional
        Learned attention sinks (gpt-oss, StreamingLLM): a logit per query
        head in the denominator only, ``w_j = e^{s_j} / (e^{sink} + sum_k
        e^{s_k})``, with ``normalizer="softmax"`` (``softmax1`` is the sink 0).
        ``lse`` excludes the sink; :func:`attnnb.vjp` gives its gradient.
    sigmoid_bias : float or real array broadcastable to ``(*batch, Hq)``, optional
        ``normalizer="sigmoid"``'s ``b``; default ``-log(Lk)`` (the keys' count,
        masked or not: FlashSigmoid's ``-log(n)``).  A number is one constant
        ``b`` for every head; an array (one or more axes) is a learned bias per
        query head, to which :func:`attnnb.vjp` gives a gradient.
    mask_mod : :class:`attnnb.mods.MaskMod` or function ``(b, h, i, j) -> bool``, optional
        Key ``j`` is allowed for query ``i`` only where it returns True (and
        ``mask`` and ``causal`` allow it); compiled into the kernels, never
        materialised on the cpu backend (:mod:`attnnb.mods`).
    score_mod : :class:`attnnb.mods.ScoreMod` or function ``(s, b, h, i, j) -> float``
        Rewrites each scaled logit ``s`` before ``bias``, key sizes and the
        normalizer (:mod:`attnnb.mods`); ``b`` is the flattened batch index and
        ``h`` the query head.
    backend : {None, "auto", "reference", "cpu", "cuda"}
        None reads :func:`attnnb.use_backend`, then ``ATTNNB_BACKEND``,
        then "auto" (cuda for device arrays, else cpu).

    Returns
    -------
    out : array ``(*batch, Hq, Lq, Dv)`` (``(Lq, Dv)`` for 2-D input)
        In the result dtype of q, k, v (float16 is computed in float32).
        Rows with no allowed key, or whose weights sum to zero, are zero.
    lse : array ``(*batch, Hq, Lq)``, only with ``return_lse=True``
        Float32 for float16 inputs; ``-inf`` on empty rows.

    Notes
    -----
    Choices where the contract is silent: a zero head dimension ``D`` is a
    ``ValueError``; a longdouble input is computed and returned as float64.
    """
    if any_dask(q, k, v):
        from ._dask.ops import attention as lazy

        refuse_lazy_dropout(dropout_p)
        return lazy(q, k, v, mask=mask, bias=bias, key_size=key_size, causal=causal,
                    scale=scale, normalizer=normalizer, return_lse=return_lse, sinks=sinks,
                    sigmoid_bias=sigmoid_bias, mask_mod=mask_mod, score_mod=score_mod,
                    backend=backend)
    return _eager.attention(q, k, v, mask=mask, bias=bias, key_size=key_size, causal=causal,
                            scale=scale, normalizer=normalizer, return_lse=return_lse,
                            dropout_p=dropout_p, seed=seed, sinks=sinks,
                            sigmoid_bias=sigmoid_bias, mask_mod=mask_mod,
                            score_mod=score_mod, backend=backend)

"""Reference gradients: float64 NumPy from the materialised weights, written for clarity.

The oracle for every backend's backward pass (docs/contract.md §5).  Each
function here implements one ``"<function>_vjp"`` operation with the
interface of :mod:`attnnb.vjp`: it takes the canonical problem, the
forward's canonical ``out`` and ``lse`` and the canonical cotangents, and
returns canonical float64 gradients.  This backend recomputes the weights
(and ``out`` and ``lse``) in float64 from the problem instead of trusting
the saved ones, so that it stays an independent oracle whatever forward
produced them; the saved arrays are accepted for the interface's sake.

The math, for one row ``i`` (query ``i`` of one head), over its allowed set
``A(i)``, with ``c_j`` the key sizes and ``phi`` the kernel::

    S_i = sum_j c_j phi(s_ij)             lse_i = log S_i
    Z_i = S_i (+ 1 for "softmax1")        w_ij = c_j phi(s_ij) / Z_i
    out_i = sum_j w_ij v_j

    dv_j        = sum_i w_ij dout_i
    dw_ij       = dout_i . v_j
    D_i         = sum_j w_ij dw_ij  (= dout_i . out_i)
    ds_ij       = c_j phi'(s_ij) [(dw_ij - D_i) / Z_i + dlse_i / S_i]
    d log c_j  += w_ij (dw_ij - D_i) + dlse_i c_j phi(s_ij) / S_i
    dq_i        = scale sum_j ds_ij k_j
    dk_j        = scale sum_i ds_ij q_i   (summed over the query heads of a GQA group)
    dbias_ij    = ds_ij

with ``phi = exp`` (``phi' = phi``) for the softmax normalizers and
``phi(x) = max(0, e^x - 1)``, ``phi'(x) = e^x`` for ``x > 0`` and ``0``
otherwise (the kink at 0 has derivative 0), for ``"relu_expm1"``.  Factors
like ``c_j e^{s_ij} / Z_i`` are formed as ``exp(s_ij + log c_j - log Z_i)``,
so logits of +-1e4 stay finite.  Discrete parts (mask, causal limit,
pattern, top-k selection) are constants: a key outside ``A(i)`` gets
nothing from row ``i``, and an empty row (``S_i = 0``) contributes nothing.

Non-finite inputs follow the forward's dependencies: a NaN or Inf reaches
the gradients only through the allowed set.  A row whose output is NaN
gives NaN to the gradients of what it read (its query, its bias entries,
the keys, values and key sizes of its allowed set) and nothing else; a key
outside every allowed set never turns a gradient NaN, even holding NaN
itself.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._common import (
    allowed_set,
    apply_weights,
    expand_kv_heads,
    logistic,
    logits,
    normalize,
    problem_allowed,
    problem_logits,
    softpick_terms,
)
from .attention import dropout_factors, sink_of
from .diff import heaviside_gate, map_normalizer, pair_dropout, pair_key_heads, stream_logits
from .sparse import pattern_mask
from .topk import topk_selection


def _t(x: np.ndarray) -> np.ndarray:
    """Swap the last two axes: ``(..., Lq, Lk)`` to ``(..., Lk, Lq)``."""
    return np.swapaxes(x, -1, -2)


def _group_sum(x: np.ndarray, hk: int) -> np.ndarray:
    """Sum ``(B, Hq, ...)`` over the query heads of each GQA group: ``(B, Hk, ...)``.

    Query head ``h`` reads key head ``h // (Hq // Hk)``, so the group of key
    head ``g`` is the run of query heads ``g * G, ..., g * G + G - 1``.
    """
    B, Hq = x.shape[:2]
    return x.reshape((B, hk, Hq // hk) + x.shape[2:]).sum(axis=2)


def _sum_to(x: np.ndarray, shape) -> np.ndarray:
    """Sum ``x`` (4-D) over the axes where ``shape`` is 1, keeping them."""
    if shape is None:
        return x
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _softmax_backward(s, allowed, log_key_size, normalizer, dw, dlse, sink=0.0):
    """Backward through the normalizer of one stream of weights.

    Parameters
    ----------
    s : float64 ``(B, H, Lq, Lk)``
        Logits, scale and bias applied (key sizes not).
    allowed : bool ``(B, H, Lq, Lk)``
        The allowed set, a constant.
    log_key_size : ``(B, Lk)`` or None
    normalizer : {"softmax", "softmax1", "relu_expm1"}
    dw : float64 ``(B, H, Lq, Lk)``
        The cotangent of the weights ``w``; only its allowed entries are read.
    dlse : float64 ``(B, H, Lq)`` or None
        The cotangent of the LSE; None means zero.
    sink : float or float64 ``(B, H, 1, 1)``
        ``softmax1``'s sink logit (its denominator is ``e^sink + S``).

    Returns
    -------
    w : float64 ``(B, H, Lq, Lk)``
        The forward weights, zero outside the allowed set.
    ds : float64 ``(B, H, Lq, Lk)``
        The cotangent of the logits, zero outside the allowed set.
    dlog_size : float64 ``(B, H, Lq, Lk)``
        Each pair's contribution to ``d log key_size[j]`` (sum over heads and
        queries for the gradient); zeros when there are no key sizes.
    """
    lks = None if log_key_size is None else log_key_size.astype(np.float64)
    if normalizer == "sigmoid":
        return _sigmoid_backward(s, allowed, lks, dw, dlse)
    if normalizer == "softpick":
        return _softpick_backward(s, allowed, lks, dw, dlse)
    w, lse = normalize(s, allowed, lks, normalizer, sink)
    w = np.where(allowed, w, 0.0)  # a NaN row's weights are NaN only where it reads
    t = s if lks is None else s + lks[:, None, None, :]
    if normalizer == "relu_expm1":
        counted = allowed & ~(s <= 0)  # as the forward: a NaN logit stays counted
    else:
        counted = allowed
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        log_z = np.logaddexp(lse, np.reshape(sink, np.shape(sink)[:-1])) \
            if normalizer == "softmax1" else lse  # (a NaN row's lse: NaN, quietly)
        # a row is live when it has weight; NaN rows stay live so that NaN propagates
        live = counted & ~np.isneginf(lse)[..., None]
        # c_j phi'(s_ij) / Z_i and / S_i (phi' = e^s for both kernels where counted)
        g_z = np.where(live, np.exp(t - log_z[..., None]), 0.0)
        g_s = np.where(live, np.exp(t - lse[..., None]), 0.0)
        dw = np.where(allowed, dw, 0.0)  # NaN values outside the allowed set stay out
        d_row = np.sum(np.where(allowed, w * dw, 0.0), axis=-1, keepdims=True)
        ds = g_z * (dw - d_row)
        dlog_size = np.where(allowed, w * (dw - d_row), 0.0)
        if dlse is not None:
            dl = np.asarray(dlse, np.float64)[..., None]
            # c_j phi(s_ij) / S_i: the weights over S, without softmax1's +1
            w_s = g_s * -np.expm1(-s) if normalizer == "relu_expm1" else g_s
            ds = ds + np.where(live, g_s * dl, 0.0)
            dlog_size = dlog_size + np.where(live, w_s * dl, 0.0)
    ds = np.where(allowed, ds, 0.0)
    return w, ds, dlog_size


def _sigmoid_backward(s, allowed, lks, dw, dlse):
    """:func:`_softmax_backward` for ``w = c sigmoid(s)``, ``lse = log sum_j w``: each
    weight depends on its own logit, ``ds = w (1 - sigmoid(s)) (dw + dlse / e^lse)``."""
    w, lse = normalize(s, allowed, lks, "sigmoid")
    w = np.where(allowed, w, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = np.where(allowed, dw, 0.0)
        if dlse is not None:
            live = ~np.isneginf(lse)
            g = g + np.where(live, np.asarray(dlse, np.float64) * np.exp(-lse), 0.0)[..., None]
        g = np.where(allowed, g, 0.0)
        ds = np.where(allowed, w * (1.0 - logistic(s)) * g, 0.0)
        dlog_size = np.where(allowed, w * g, 0.0)
    return w, ds, dlog_size


def _softpick_backward(s, allowed, lks, dw, dlse):
    """:func:`_softmax_backward` for softpick (:func:`~attnnb.reference._common.softpick_terms`):
    with ``g = dw``, ``delta = sum_j w g - dlse / r``, ``ds = a ([s > 0] g - sign(s) delta)``
    and ``d log c = w g - u delta``."""
    w, lse, a, u, r = softpick_terms(s, allowed, lks)
    w, a, u = (np.where(allowed, x, 0.0) for x in (w, a, u))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = np.where(allowed, dw, 0.0)
        delta = np.sum(np.where(allowed, w * g, 0.0), axis=-1)
        if dlse is not None:
            live = ~np.isneginf(lse)
            delta = delta - np.where(live, np.asarray(dlse, np.float64) / r, 0.0)
        delta = delta[..., None]
        ds = np.where(allowed, a * (np.where(s > 0, g, 0.0) - np.sign(s) * delta), 0.0)
        dlog_size = np.where(allowed, w * g - u * delta, 0.0)
    return w, ds, dlog_size


def _weights_backward(problem_q, k_exp, v_exp, scale, s, allowed, log_key_size,
                      normalizer, dout, dlse, dropout=None, sink=0.0, slope=None):
    """Gradients of one dense stream ``out = w(s) @ v`` with query-head-expanded k, v.

    With ``dropout`` (the factors ``z`` of :func:`~attnnb.reference.attention.dropout_factors`)
    the stream is ``out = (w z) @ v``: the weights' cotangent is ``z (dout @ v^T)`` and
    ``dv`` reads ``w z``; the normalizer's backward is unchanged.

    Returns ``dq (B, H, Lq, D)``, ``dk (B, H, Lk, D)``, ``dv (B, H, Lk, Dv)``
    (per query head, before GQA summing), ``ds`` and the ``d log key_size``
    contributions ``(B, H, Lq, Lk)``.  ``slope``: a score mod's ``d s / d raw``, which
    the logits' gradient passes through on its way to ``q`` and ``k`` (``ds`` stays the
    gradient of the modified logits ``s``).
    """
    dout = np.asarray(dout, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dw = np.matmul(dout, _t(v_exp.astype(np.float64)))
        if dropout is not None:
            dw = dw * dropout
    w, ds, dlog_size = _softmax_backward(s, allowed, log_key_size, normalizer, dw, dlse,
                                         sink)
    if dropout is not None:
        w = w * dropout
    q = problem_q.astype(np.float64)
    ds_raw = ds if slope is None else np.where(ds == 0.0, 0.0, ds * slope)
    # apply_weights keeps a non-finite k, q or dout out of the rows that never read it
    dq = scale * apply_weights(ds_raw, k_exp, allowed)
    dk = scale * apply_weights(_t(ds_raw), q, _t(allowed))
    dv = apply_weights(_t(w), dout, _t(allowed))
    return dq, dk, dv, ds, dlog_size


def _finish(problem, dq, dk, dv, ds, dlog_size, dbias_shape):
    """GQA-sum ``dk``, ``dv``; reduce ``dbias`` and ``d log key_size``."""
    hk = problem.k.shape[1]
    dbias = None
    if problem.bias is not None:
        dbias = _sum_to(ds, dbias_shape)
    dlks = None
    if problem.log_key_size is not None:
        dlks = dlog_size.sum(axis=(1, 2))
    return dq, _group_sum(dk, hk), _group_sum(dv, hk), dbias, dlks


def _masked_vjp(problem, allowed, bias, dout, dlse, dbias_shape, normalizer):
    B, Hq = problem.q.shape[:2]
    k = expand_kv_heads(problem.k, Hq)
    v = expand_kv_heads(problem.v, Hq)
    s = logits(problem.q, k, problem.scale, bias)
    grads = _weights_backward(problem.q, k, v, problem.scale, s, allowed,
                              problem.log_key_size, normalizer, dout, dlse,
                              dropout_factors(problem), sink_of(problem))
    return _finish(problem, *grads, dbias_shape)


def attention_vjp(problem, out, lse, dout, dlse=None, dbias_shape=None):
    """Gradients of dense attention (the ``"attention_vjp"`` operation).

    Parameters
    ----------
    problem : :class:`~attnnb._front.validate.Problem`
    out : ``(B, Hq, Lq, Dv)``
        The forward's output (unused here: recomputed in float64).
    lse : ``(B, Hq, Lq)``
        The forward's LSE (unused here: recomputed in float64).
    dout : ``(B, Hq, Lq, Dv)``
    dlse : ``(B, Hq, Lq)`` or None
        None means no gradient flows into the LSE.
    dbias_shape : 4-tuple or None
        ``(B or 1, Hq or 1, Lq or 1, Lk or 1)``: ``dbias`` is summed over the
        axes given as 1.  None: the full ``(B, Hq, Lq, Lk)``.

    Returns
    -------
    dq : float64 ``(B, Hq, Lq, D)``
    dk : float64 ``(B, Hk, Lk, D)``
    dv : float64 ``(B, Hk, Lk, Dv)``
    dbias : float64 of shape ``dbias_shape``, or None without bias
    dlog_key_size : float64 ``(B, Lk)``, or None without key sizes
    """
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    if problem.mask_mod is None and problem.score_mod is None:
        allowed = allowed_set((B, Hq, Lq, Lk), problem.mask, problem.causal)
        return _masked_vjp(problem, allowed, problem.bias, dout, dlse, dbias_shape,
                           problem.normalizer)
    return _modded_vjp(problem, dout, dlse, dbias_shape)


def _modded_vjp(problem, dout, dlse, dbias_shape):
    """:func:`attention_vjp` with a mask or score mod: the score mod's slope on the way to
    ``q`` and ``k``, and its arrays' gradients (a sixth result, flat in leaf order)."""
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    k = expand_kv_heads(problem.k, Hq)
    v = expand_kv_heads(problem.v, Hq)
    mod = problem.score_mod
    s, raw, slope = problem_logits(problem, k, with_slope=mod is not None)
    allowed = problem_allowed(problem, (B, Hq, Lq, Lk))
    grads = _weights_backward(problem.q, k, v, problem.scale, s, allowed,
                              problem.log_key_size, problem.normalizer, dout, dlse,
                              dropout_factors(problem), sink_of(problem), slope)
    finished = _finish(problem, *grads, dbias_shape)
    if mod is None:
        return finished
    return finished + (_mod_array_gradients(mod, grads[3], raw, problem.dropout_origin),)


def _mod_array_gradients(mod, ds, raw, origin):
    """A score mod's parameter gradients from ``ds`` (of its values) and its logits ``raw``
    (``(B, H, Lq, Lk)``); None when it has none to give (vjp refused that before)."""
    from .._mods.compile import missing_array_gradients
    from ._mods import array_gradients

    return None if missing_array_gradients(mod) else array_gradients(mod, ds, raw, origin)


def sparse_attention_vjp(problem, pattern, out, lse, dout, dlse=None):
    """Gradients of sparse attention: dense attention with the pattern as a fixed mask.

    Arguments and returns as :func:`attention_vjp` (``dbias`` is None: the
    function takes no bias); ``pattern`` is the forward's
    :class:`~attnnb.patterns.Pattern`, shared or one per query head.
    """
    B, Hq = problem.shape[:2]
    masked = dataclasses.replace(problem, mask=pattern_mask(pattern, B, Hq))
    return attention_vjp(masked, out, lse, dout, dlse)


def topk_attention_vjp(problem, top_k, out, lse, dout, dlse=None):
    """Gradients of top-k attention with the forward's selection held fixed.

    The selection is recomputed exactly as the reference forward makes it
    (:func:`~attnnb.reference.topk.topk_selection`: ranked by
    ``s + log key_size``, ties to the lower key index) and is then a
    constant mask; gradients flow through the kept keys' softmax only.
    Arguments and returns as :func:`attention_vjp`, with ``top_k`` the
    forward's ``int`` (``dbias`` is None).
    """
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    k = expand_kv_heads(problem.k, Hq)
    s = problem_logits(dataclasses.replace(problem, bias=None), k)[0]  # ranked without bias
    allowed = problem_allowed(problem, (B, Hq, Lq, Lk))
    lks = None if problem.log_key_size is None else problem.log_key_size.astype(np.float64)
    keep = topk_selection(s, allowed, lks, top_k)
    if problem.score_mod is None:  # (the bias: sigmoid's, weighing the kept keys)
        return _masked_vjp(problem, keep, problem.bias, dout, dlse, None, problem.normalizer)
    kept = dataclasses.replace(problem, mask=keep, causal=False, mask_mod=None)
    return _modded_vjp(kept, dout, dlse, None)


def diff_attention_vjp(problem, lam, mode, out, dout, dbias_shape=None):
    """Gradients of differential attention (the ``"diff_attention_vjp"`` operation).

    Difference mode: ``out = o1 - lam o2`` with ``o_c = A_c v``, so stream 1
    gets ``dout``, stream 2 gets ``-lam dout`` and ``dlam_i = -dout_i . o2_i``.
    Rectified mode: ``P = max(0, A1 - lam A2)``, ``out = P v``; ``dP =
    dout v^T`` where ``P > 0`` (the clip's kink has derivative 0), ``dA1 =
    dP``, ``dA2 = -lam dP``, ``dlam_i = -sum_j dP_ij A2_ij``.  Heaviside mode:
    ``P = A1 - lam g``, ``g = H(A1 - lam A2)`` held fixed: ``dA1 = dP``, ``dA2 =
    0``, ``dlam_i = -sum_j dP_ij g_ij``.  Each map then
    goes through its softmax backward; bias and key sizes get the sum of
    both streams.  Dropout (factors ``z``, one per head pair) makes ``out = (z
    w) v``: ``dw`` and the weights that reach ``dv`` are multiplied by ``z``.

    Parameters
    ----------
    problem : :class:`~attnnb._front.validate.Problem` built with ``head_pairs=True``
        ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``, ``v (B, Hk, Lk, Dv)``;
        mask and bias broadcast to ``(B, H, Lq, Lk)``.
    lam : ``(B, H, Lq)``
    mode : {"difference", "rectified", "heaviside"}
    out : ``(B, H, Lq, Dv)``
        The forward's output (unused here: recomputed in float64).
    dout : ``(B, H, Lq, Dv)``
    dbias_shape : 4-tuple or None
        As :func:`attention_vjp`, against ``(B, H, Lq, Lk)``.

    Returns
    -------
    dq : float64 ``(B, 2H, Lq, d)``
    dk : float64 ``(B, 2Hk, Lk, d)``
    dv : float64 ``(B, Hk, Lk, Dv)``
    dbias : float64 of shape ``dbias_shape``, or None without bias
    dlog_key_size : float64 ``(B, Lk)``, or None without key sizes
    dlam : float64 ``(B, H, Lq)``
    """
    B, H2, Hk2, Lq, Lk, _, _ = problem.shape
    H, Hk = H2 // 2, Hk2 // 2
    heads = pair_key_heads(H, Hk)
    allowed = problem_allowed(problem, (B, H, Lq, Lk))
    lam = np.asarray(lam, np.float64)
    dout = np.asarray(dout, np.float64)
    v = expand_kv_heads(problem.v, H).astype(np.float64)  # pair h reads value head g
    lks = problem.log_key_size
    mod = problem.score_mod
    s, raw, slope = zip(*(stream_logits(problem, heads, c, mod is not None) for c in range(2)))
    # a NaN row's maps are NaN only on its allowed set, so its NaN reaches only what it read
    maps = [np.where(allowed, normalize(s[c], allowed, lks, *map_normalizer(problem, c))[0],
                     0.0) for c in range(2)]
    with np.errstate(invalid="ignore", over="ignore"):
        dw = np.where(allowed, np.matmul(dout, _t(v)), 0.0)
    factors = pair_dropout(problem)
    if factors is not None:
        dw = dw * factors
    w = maps[0] - lam[..., None] * maps[1]
    # what lam multiplies, and the cotangent of the second map
    second, dw2 = maps[1], -lam[..., None] * dw
    if mode == "rectified":
        # clipped entries pass nothing back; NaN (not <= 0) keeps propagating
        dw = np.where(w <= 0, 0.0, dw)
        dw2 = -lam[..., None] * dw
        w = np.maximum(w, 0.0)
    elif mode == "heaviside":  # the gate held fixed: A2 gets no gradient
        second = heaviside_gate(maps[0], maps[1], lam[..., None])
        w = maps[0] - lam[..., None] * second
        dw2 = np.zeros_like(dw)
    if factors is not None:
        w = w * factors
    dlam = -np.sum(np.where(allowed, dw * second, 0.0), axis=-1)
    dq = np.zeros(problem.q.shape)
    dk = np.zeros(problem.k.shape)
    dv = np.zeros(problem.v.shape)
    ds_sum = np.zeros((B, H, Lq, Lk))
    dlog_sum = np.zeros((B, H, Lq, Lk))
    q = problem.q.astype(np.float64)
    k = problem.k.astype(np.float64)
    mod_grads = []
    for c, stream_dw in enumerate((dw, dw2)):
        normalizer, sink = map_normalizer(problem, c)
        _, ds, dlog_size = _softmax_backward(s[c], allowed, lks, normalizer, stream_dw, None,
                                             sink)
        ds_sum += ds
        dlog_sum += dlog_size
        if mod is not None:
            mod_grads.append(_mod_array_gradients(mod, ds, raw[c], problem.dropout_origin))
            ds = np.where(ds == 0.0, 0.0, ds * slope[c])  # on to q and k: through the slope
        kc = k[:, heads[:, c]]
        dq[:, c::2] = problem.scale * apply_weights(ds, kc, allowed)
        dk_pairs = problem.scale * apply_weights(_t(ds), q[:, c::2], _t(allowed))
        for h in range(H):  # pair h's key head; several pairs share one under GQA
            dk[:, heads[h, c]] += dk_pairs[:, h]
    dv_pairs = apply_weights(_t(w), dout, _t(allowed))
    for h in range(H):
        dv[:, heads[h, 0] // 2] += dv_pairs[:, h]
    dbias = _sum_to(ds_sum, dbias_shape) if problem.bias is not None else None
    dlks = dlog_sum.sum(axis=(1, 2)) if lks is not None else None
    if mod is None:
        return dq, dk, dv, dbias, dlks, dlam
    from .._mods.compile import sum_param_grads

    return dq, dk, dv, dbias, dlks, dlam, sum_param_grads(mod_grads)

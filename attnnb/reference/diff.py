"""Reference differential attention: the two softmax maps, subtracted, times ``v``."""

from __future__ import annotations

import dataclasses

import numpy as np

from ._common import apply_weights, expand_kv_heads, normalize, problem_allowed, problem_logits
from .attention import dropout_factors


def pair_key_heads(h_pairs: int, hk_pairs: int) -> np.ndarray:
    """``(H, 2)`` key-head index of each query pair's two components.

    Pair ``h`` uses key pair ``g = h // (H // Hk)``: component ``c`` meets key
    head ``2g + c`` (component with component, as ``multihead_flashdiff_1``).
    """
    g = np.arange(h_pairs) // (h_pairs // hk_pairs)
    return 2 * g[:, None] + np.arange(2)[None, :]


def diff_maps(problem):
    """The two softmax maps of a canonical problem, in float64.

    Returns ``(A1, A2, allowed)``: float64 ``(B, H, Lq, Lk)`` each (zero outside
    the allowed set and on empty rows, NaN on NaN rows) and the boolean allowed
    set.  ``problem`` is as for :func:`diff_weights`.
    """
    B, H2, Hk2, Lq, Lk, _, _ = problem.shape
    H = H2 // 2
    heads = pair_key_heads(H, Hk2 // 2)
    allowed = problem_allowed(problem, (B, H, Lq, Lk))
    maps = []
    for c in range(2):
        s = stream_logits(problem, heads, c)[0]
        a, _ = normalize(s, allowed, problem.log_key_size, *map_normalizer(problem, c))
        maps.append(a)
    return maps[0], maps[1], allowed


def map_normalizer(problem, c):
    """``(normalizer, sink)`` of map ``c`` of every pair: softmax, or with learned sinks
    softmax1 with query head ``2h + c``'s sink (float64 ``(B, H, 1, 1)``)."""
    if problem.sinks is None:
        return "softmax", 0.0
    return "softmax1", np.asarray(problem.sinks, np.float64)[:, c::2, None, None]


def stream_logits(problem, heads, c, with_slope=False):
    """``(s, raw, slope)`` of component ``c`` of every pair (:func:`problem_logits`: the
    mods see the pair's index as the head)."""
    stream = dataclasses.replace(problem, q=problem.q[:, c::2])
    return problem_logits(stream, problem.k[:, heads[:, c]], with_slope)


def pair_dropout(problem):
    """float64 ``(B, H, Lq, Lk)`` dropout factors of the combined weights, one per head
    pair (docs/contract.md §1.14), or None without dropout."""
    return dropout_factors(problem, heads=problem.shape[1] // 2)


def diff_weights(problem, lam, mode="difference"):
    """The differential weights of a canonical problem, in float64.

    Parameters
    ----------
    problem : :class:`~attnnb._front.validate.Problem` built with ``head_pairs=True``
        ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``, mask and bias ``(B, H, Lq, Lk)``.
    lam : ``(B, H, Lq)``
    mode : ``"difference"``, ``"rectified"`` or ``"heaviside"``

    Returns
    -------
    w : float64 ``(B, H, Lq, Lk)``: ``A1 - lam A2``, ``max(0, A1 - lam A2)`` or
        ``A1 - lam H(A1 - lam A2)`` (:func:`heaviside_gate`), zero on keys outside
        the allowed set and on empty rows; before dropout.
    allowed : bool ``(B, H, Lq, Lk)``
    """
    a1, a2, allowed = diff_maps(problem)
    lam = np.asarray(lam, np.float64)[..., None]
    if mode == "heaviside":
        return a1 - lam * heaviside_gate(a1, a2, lam), allowed
    w = a1 - lam * a2
    if mode == "rectified":
        w = np.maximum(w, 0.0)  # NaN rows stay NaN
    return w, allowed


def heaviside_gate(a1, a2, lam):
    """``H(A1 - lam A2)``: 1.0 where ``A1 - lam A2 > 0``, else 0.0 (also at 0, so that
    keys neither map weighs, masked ones included, stay at weight 0; NaN where the
    difference is NaN, so that NaN rows stay NaN)."""
    x = a1 - lam * a2
    return np.where(np.isnan(x), np.nan, (x > 0).astype(np.float64))


def diff_attention(problem, lam, mode="difference"):
    """Differential attention of a canonical problem; float64 ``(B, H, Lq, Dv)``.

    ``"difference"`` is ``A1 @ v - lam * (A2 @ v)``: equal to ``(A1 - lam A2) @ v``
    for finite values, and for non-finite ones each map's output follows the
    rules of :mod:`attnnb.reference._common` before the two are combined (so
    an Inf value that both maps weight gives NaN, as two attention calls
    subtracted do).  ``"rectified"`` weights the values by ``max(0, A1 - lam A2)``:
    a clipped (zero) weight never carries a value; ``"heaviside"`` by ``A1 - lam
    H(A1 - lam A2)``.  Dropout multiplies each
    combined weight (both maps' entries, in the difference mode) by its factor.
    """
    dtype = problem.compute_dtype
    factors = pair_dropout(problem)
    if mode != "difference":
        w, allowed = diff_weights(problem, lam, mode)
        if factors is not None:
            w = w * factors
        v = expand_kv_heads(problem.v, w.shape[1])
        return apply_weights(w, v, allowed, dtype)
    a1, a2, allowed = diff_maps(problem)
    if factors is not None:
        a1, a2 = a1 * factors, a2 * factors
    v = expand_kv_heads(problem.v, a1.shape[1])
    o1 = apply_weights(a1, v, allowed, dtype)
    o2 = apply_weights(a2, v, allowed, dtype)
    with np.errstate(invalid="ignore"):  # inf - inf = NaN is the propagation we want
        return o1 - np.asarray(lam, np.float64)[..., None] * o2

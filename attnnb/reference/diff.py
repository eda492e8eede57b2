"""Reference differential attention: the two softmax maps, subtracted, times ``v``."""

from __future__ import annotations

import numpy as np

from ._common import allowed_set, apply_weights, expand_kv_heads, logits, normalize


def pair_key_heads(h_pairs: int, hk_pairs: int) -> np.ndarray:
    """``(H, 2)`` key-head index of each query pair's two components.

    Pair ``h`` uses key pair ``g = h // (H // Hk)``: component ``c`` meets key
    head ``2g + c`` (component with component, as ``multihead_flashdiff_1``).
    """
    g = np.arange(h_pairs) // (h_pairs // hk_pairs)
    return 2 * g[:, None] + np.arange(2)[None, :]


def diff_weights(problem, lam, mode="difference"):
    """The differential weights of a canonical problem, in float64.

    Parameters
    ----------
    problem : :class:`~attnnb._validate.Problem` built with ``head_pairs=True``
        ``q (B, 2H, Lq, d)``, ``k (B, 2Hk, Lk, d)``, mask and bias ``(B, H, Lq, Lk)``.
    lam : ``(B, H, Lq)``
    mode : ``"difference"`` or ``"rectified"``

    Returns
    -------
    w : float64 ``(B, H, Lq, Lk)``: ``A1 - lam A2`` (or ``max(0, .)``), zero on
        keys outside the allowed set and on empty rows.
    allowed : bool ``(B, H, Lq, Lk)``
    """
    B, H2, Hk2, Lq, Lk, _, _ = problem.shape
    H = H2 // 2
    heads = pair_key_heads(H, Hk2 // 2)
    allowed = allowed_set((B, H, Lq, Lk), problem.mask, problem.causal)
    maps = []
    for c in range(2):
        s = logits(problem.q[:, c::2], problem.k[:, heads[:, c]], problem.scale, problem.bias)
        a, _ = normalize(s, allowed, problem.log_key_size, "softmax")
        maps.append(a)
    w = maps[0] - np.asarray(lam, np.float64)[..., None] * maps[1]
    if mode == "rectified":
        w = np.where(w < 0, 0.0, w)  # not np.maximum's NaN rules: NaN rows stay NaN anyway
    return w, allowed


def diff_attention(problem, lam, mode="difference"):
    """Differential attention of a canonical problem; float64 ``(B, H, Lq, Dv)``."""
    w, allowed = diff_weights(problem, lam, mode)
    v = expand_kv_heads(problem.v, w.shape[1])
    return apply_weights(w, v, allowed)

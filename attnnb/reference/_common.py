"""Shared pieces of the float64 reference: scores, allowed sets, normalizers."""

from __future__ import annotations

import numpy as np


def expand_kv_heads(x: np.ndarray, hq: int) -> np.ndarray:
    """Repeat key/value heads for grouped-query attention.

    ``x`` is ``(B, Hk, L, D)``; query head ``h`` uses key head ``h // (hq // Hk)``,
    as ``torch.repeat_interleave`` along the head axis.
    """
    return np.repeat(x, hq // x.shape[1], axis=1)


def logits(q, k, scale, bias=None):
    """``scale * q @ k^T (+ bias)`` in float64; q ``(B, H, Lq, D)``, k ``(B, H, Lk, D)``."""
    s = scale * np.matmul(q.astype(np.float64), np.swapaxes(k.astype(np.float64), -1, -2))
    if bias is not None:
        s = s + bias.astype(np.float64)
    return s


def allowed_set(shape, mask=None, causal=False):
    """Boolean ``(B, H, Lq, Lk)``: True where query i may attend key j."""
    B, H, Lq, Lk = shape
    allowed = np.ones(shape, dtype=bool)
    if mask is not None:
        allowed &= mask
    if causal:
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        allowed &= j <= i + (Lk - Lq)
    return allowed


def normalize(s, allowed, log_key_size=None, normalizer="softmax"):
    """Attention weights and LSE from logits over the allowed set.

    Parameters
    ----------
    s : float64 ``(B, H, Lq, Lk)`` logits (scale and bias applied).
    allowed : bool ``(B, H, Lq, Lk)``.
    log_key_size : ``(B, Lk)`` or None, added to the logits (proportional attention).
    normalizer : ``"softmax"``, ``"softmax1"`` or ``"relu_expm1"``.

    Returns
    -------
    w : float64 ``(B, H, Lq, Lk)``, zero outside the allowed set and on empty rows.
    lse : float64 ``(B, H, Lq)``, ``log sum_j key_size[j] * phi(s[i, j])``; ``-inf`` on
        empty rows.
    """
    t = s if log_key_size is None else s + log_key_size.astype(np.float64)[:, None, None, :]
    if normalizer == "relu_expm1":
        # key_size * max(0, e^s - 1) = e^(s + log size) * (1 - e^-s) for s > 0: no overflow
        counted = allowed & ~(s <= 0)  # NaN logits stay counted so that they propagate
    else:
        counted = allowed
    t = np.where(counted, t, -np.inf)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.max(t, axis=-1, keepdims=True) if t.shape[-1] else np.full(
            t.shape[:-1] + (1,), -np.inf)
        m_safe = np.where(np.isneginf(m), 0.0, m)
        e = np.where(counted, np.exp(t - m_safe), 0.0)
        if normalizer == "relu_expm1":
            e = e * np.where(counted, -np.expm1(-s), 0.0)
        z = e.sum(axis=-1, keepdims=True)
        lse = (m_safe + np.log(z))[..., 0]
        denom = z + np.exp(-m_safe) if normalizer == "softmax1" else z
        w = np.where(z > 0, e / np.where(z > 0, denom, 1.0), 0.0)
    lse = np.where(z[..., 0] > 0, lse, -np.inf)
    # NaN anywhere in a row's counted logits propagates to that row only
    w = np.where(np.isnan(m), np.nan, w)
    lse = np.where(np.isnan(m[..., 0]), np.nan, lse)
    return w, lse


def apply_weights(w, v, allowed):
    """``w @ v`` where keys outside a row's allowed set never contribute.

    With finite values this is a plain matmul; when ``v`` holds NaN or Inf,
    each row only sums its allowed keys, so a non-finite value reaches only
    the rows that may attend it.
    """
    v = v.astype(np.float64)
    if np.isfinite(v).all():
        return np.matmul(w, v)
    B, H, Lq, _ = w.shape
    out = np.zeros((B, H, Lq, v.shape[-1]))
    with np.errstate(invalid="ignore"):  # 0 * inf = NaN is the propagation we want
        for b in range(B):
            for h in range(H):
                for i in range(Lq):
                    sel = allowed[b, h, i]
                    out[b, h, i] = w[b, h, i, sel] @ v[b, h, sel]
    return out

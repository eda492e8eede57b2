"""Reference dense attention."""

from __future__ import annotations

import numpy as np

from .._core.dropout import keep_mask, keep_scale
from ._common import apply_weights, expand_kv_heads, normalize, problem_allowed, problem_logits


def sink_of(problem):
    """float64 ``(B, Hq, 1, 1)`` sink logits of a problem with sinks, else 0."""
    if problem.sinks is None:
        return 0.0
    return np.asarray(problem.sinks, np.float64)[:, :, None, None]


def dropout_factors(problem, heads=None):
    """float64 ``(B, heads, Lq, Lk)`` factors of the weights under the problem's dropout:
    ``1 / (1 - p)`` where kept, 0 where dropped; None without dropout.  ``heads``: the
    query heads by default (the head pairs for differential attention)."""
    if not problem.dropout_p:
        return None
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    H = Hq if heads is None else heads
    b0, h0 = problem.dropout_origin
    keep = keep_mask(problem.seed, problem.dropout_p, (B, H, Lq, Lk), b=b0 + np.arange(B),
                     h=h0 + np.arange(H))
    return np.where(keep, keep_scale(problem.dropout_p), 0.0)


def attention_weights(problem):
    """Weights, LSE and allowed set of a :class:`~attnnb._front.validate.Problem`.

    Returns float64 ``w`` ``(B, Hq, Lq, Lk)``, ``lse`` ``(B, Hq, Lq)`` and the
    boolean allowed set.  Also used by tests and by the sparse and top-k
    references.
    """
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    k = expand_kv_heads(problem.k, Hq)
    s = problem_logits(problem, k)[0]
    allowed = problem_allowed(problem, (B, Hq, Lq, Lk))
    w, lse = normalize(s, allowed, problem.log_key_size, problem.normalizer, sink_of(problem))
    return w, lse, allowed


def attention(problem):
    """Dense attention of a canonical problem, computed in float64.

    Returns ``(out, lse)``: float64 ``(B, Hq, Lq, Dv)`` and ``(B, Hq, Lq)``.
    """
    w, lse, allowed = attention_weights(problem)
    v = expand_kv_heads(problem.v, problem.q.shape[1])
    factors = dropout_factors(problem)
    if factors is not None:  # the LSE stays that of the weights before dropout
        w = w * factors
    out = apply_weights(w, v, allowed, problem.compute_dtype)
    return out, np.asarray(lse)

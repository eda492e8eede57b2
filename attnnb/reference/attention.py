"""Reference dense attention."""

from __future__ import annotations

import numpy as np

from ._common import allowed_set, apply_weights, expand_kv_heads, logits, normalize


def attention_weights(problem):
    """Weights, LSE and allowed set of a :class:`~attnnb._validate.Problem`.

    Returns float64 ``w`` ``(B, Hq, Lq, Lk)``, ``lse`` ``(B, Hq, Lq)`` and the
    boolean allowed set.  Also used by tests and by the sparse and top-k
    references.
    """
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    k = expand_kv_heads(problem.k, Hq)
    s = logits(problem.q, k, problem.scale, problem.bias)
    allowed = allowed_set((B, Hq, Lq, Lk), problem.mask, problem.causal)
    w, lse = normalize(s, allowed, problem.log_key_size, problem.normalizer)
    return w, lse, allowed


def attention(problem):
    """Dense attention of a canonical problem, computed in float64.

    Returns ``(out, lse)``: float64 ``(B, Hq, Lq, Dv)`` and ``(B, Hq, Lq)``.
    """
    w, lse, allowed = attention_weights(problem)
    v = expand_kv_heads(problem.v, problem.q.shape[1])
    out = apply_weights(w, v, allowed, problem.compute_dtype)
    return out, np.asarray(lse)

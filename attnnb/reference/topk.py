"""Reference top-k attention: rank every allowed key, keep the ``top_k`` best."""

from __future__ import annotations

import dataclasses

import numpy as np

from ._common import apply_weights, expand_kv_heads, normalize, problem_allowed, problem_logits
from .attention import dropout_factors, sink_of


def topk_selection(s, allowed, log_key_size, top_k):
    """Boolean ``(B, H, Lq, Lk)``: the keys each query keeps.

    A key's rank is its position when the allowed keys are sorted by
    ``s + log key_size`` (equivalently by ``key_size * exp(s)``) decreasing,
    equal values by increasing key index; the ``top_k`` best are kept.
    Keys of zero weight (``-inf``) are never kept; a row whose allowed
    logits hold a NaN keeps its whole allowed set, so the NaN propagates.
    """
    t = s if log_key_size is None else s + log_key_size[:, None, None, :]
    t = np.where(allowed, t, -np.inf)
    order = np.argsort(-t, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(t.shape[-1])[None, None, None, :], axis=-1)
    keep = allowed & (rank < top_k) & (t > -np.inf)
    nan_row = np.isnan(t).any(axis=-1, keepdims=True)
    return np.where(nan_row, allowed, keep)


def topk_attention(problem, top_k):
    """Top-k attention of a canonical problem in float64; returns ``(out, lse)``.

    The keys are ranked as softmax weighs them, whatever the normalizer; the
    normalizer then weighs the kept keys (``sigmoid``'s bias, the problem's only
    bias, is added after the ranking).
    """
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    k = expand_kv_heads(problem.k, Hq)
    v = expand_kv_heads(problem.v, Hq)
    s = problem_logits(dataclasses.replace(problem, bias=None), k)[0]  # a score function's
    allowed = problem_allowed(problem, (B, Hq, Lq, Lk))
    lks = None if problem.log_key_size is None else problem.log_key_size.astype(np.float64)
    keep = topk_selection(s, allowed, lks, top_k)
    if problem.bias is not None:
        s = s + problem.bias.astype(np.float64)
    w, lse = normalize(s, keep, problem.log_key_size, problem.normalizer, sink_of(problem))
    factors = dropout_factors(problem)
    if factors is not None:  # the selection and the LSE are those before dropout
        w = w * factors
    return apply_weights(w, v, keep, problem.compute_dtype), np.asarray(lse)

"""Reference sparse-pattern attention: dense attention with the pattern as mask."""

from __future__ import annotations

import dataclasses

import numpy as np

from .attention import attention


def pattern_mask(pattern, B, Hq):
    """The pattern as a boolean ``(B, Hq, Lq, Lk)`` view (per head or shared)."""
    mask = pattern.to_mask()
    if pattern.n_heads == 1:
        mask = mask[None]
    return np.broadcast_to(mask[None], (B, Hq) + pattern.shape)


def sparse_attention(problem, pattern):
    """``attention(problem with mask=pattern.to_mask())`` in float64; returns ``(out, lse)``."""
    B, Hq = problem.shape[:2]
    return attention(dataclasses.replace(problem, mask=pattern_mask(pattern, B, Hq)))

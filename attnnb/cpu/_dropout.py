"""Dropout in the CPU kernels: :mod:`attnnb._core.dropout`'s generator, compiled and tiled.

A kernel that drops weights takes ``dropout = [seed_lo, seed_hi, threshold, b0, h0]``
(an int64 array: a parallel loop cannot take a tuple from a named tuple;
:func:`kernel_dropout` builds it on the host, ``threshold = 0`` when nothing
is dropped; ``b0, h0`` the problem's ``dropout_origin``, added to the batch
and head indices), forms its rows' keys once per task
(:func:`row_keys`) and applies the decisions to each weight tile
(:func:`drop_tile`, forward; :func:`keep_factors`, backward).  The decisions
are the reference backend's bit for bit: the same integer functions.
"""

from __future__ import annotations

import numpy as np

from .._core import dropout as _dropout
from ._jit import inner

_row_key = _dropout.rebound(_dropout.row_key, inner)
_column_word = _dropout.rebound(_dropout.column_word, inner)
_kept = _dropout.rebound(_dropout.kept, inner)


def kernel_dropout(problem) -> np.ndarray:
    """``[seed_lo, seed_hi, threshold, b0, h0]`` (int64) of a problem for the kernels."""
    if not problem.dropout_p:
        return np.zeros(5, np.int64)
    lo, hi = _dropout.seed_words(problem.seed)
    return np.array([lo, hi, _dropout.threshold(problem.dropout_p), *problem.dropout_origin],
                    np.int64)


@inner
def row_keys(dropout, b, h, i0, nq, keys):
    """``keys[r]`` = the key of row ``(b, h, i0 + r)`` for ``r < nq`` (no-op without
    dropout)."""
    if dropout[2] == 0:
        return
    for r in range(nq):
        keys[r] = row_key(dropout, b, h, i0 + r)


@inner
def row_key(dropout, b, h, i):
    """The key of row ``(b, h, i)`` of the problem, ``(b0 + b, h0 + h, i)`` of the call
    (:func:`attnnb._core.dropout.row_key`)."""
    return _row_key(dropout[0], dropout[1], dropout[3] + b, dropout[4] + h, i)


@inner
def column_words(dropout, j0, nk, words):
    """``words[c]`` = the word of key ``j0 + c`` for ``c < nk``."""
    for c in range(nk):
        words[c] = _column_word(j0 + c)


@inner
def drop_tile(P, dropout, keys, j0, words):
    """Zero the dropped weights of the ``(nq, nk)`` tile ``P`` of keys ``j0 ..`` (rows
    keyed by :func:`row_keys`); the kept ones stay unscaled (the host scales the output
    by ``1 / (1 - p)``).  ``words`` is scratch of ``TILE_K`` int64."""
    if dropout[2] == 0:
        return
    nq, nk = P.shape
    column_words(dropout, j0, nk, words)
    threshold = dropout[2]
    for r in range(nq):
        key = keys[r]
        for c in range(nk):
            if not _kept(key, words[c], threshold):
                P[r, c] = 0.0


@inner
def drop_listed(weights, key_index, n, dropout, key):
    """Zero ``weights[x]`` where key ``key_index[x]`` of the row keyed ``key`` is dropped
    (``x < n``); returns whether any was (False without dropout)."""
    if dropout[2] == 0:
        return False
    dropped = False
    for x in range(n):
        word = _column_word(key_index[x])
        if not _kept(key, word, dropout[2]):
            weights[x] = 0.0
            dropped = True
    return dropped


@inner
def keep_factors(Z, dropout, b, h, i0, j0, words, scale):
    """``Z[r, c]`` = ``scale`` (``1 / (1 - p)``) where element ``(b, h, i0 + r, j0 + c)``
    is kept, else 0, for the ``(nq, nk)`` tile ``Z``; ``words`` is scratch of ``TILE_K``
    int64."""
    nq, nk = Z.shape
    column_words(dropout, j0, nk, words)
    for r in range(nq):
        key = row_key(dropout, b, h, i0 + r)
        for c in range(nk):
            Z[r, c] = scale if _kept(key, words[c], dropout[2]) else 0.0 * scale


@inner
def scale_by_kept(X, Y, dropout, b, h, i0, j0, words, scale):
    """``X[r, c]`` and ``Y[r, c]`` times ``scale`` (``1 / (1 - p)``) where element ``(b,
    h, i0 + r, j0 + c)`` is kept, zeroed where it is dropped, for ``(nq, nk)`` tiles ``X``
    and ``Y`` (no-op without dropout); ``words`` is scratch of ``TILE_K`` int64."""
    if dropout[2] == 0:
        return
    nq, nk = X.shape
    column_words(dropout, j0, nk, words)
    for r in range(nq):
        key = row_key(dropout, b, h, i0 + r)
        for c in range(nk):
            if _kept(key, words[c], dropout[2]):
                X[r, c] *= scale
                Y[r, c] *= scale
            else:
                X[r, c] = 0.0
                Y[r, c] = 0.0


def scale_kept(out, problem):
    """``out *= 1 / (1 - p)`` in place, the kept weights' factor (nothing without dropout)."""
    if problem.dropout_p:
        out *= out.dtype.type(_dropout.keep_scale(problem.dropout_p))
    return out


"""Shared inner loops for kernels that weight values by already-normalised maps.

The online softmax of :mod:`attnnb.cpu._tiles` folds ``exp(s - m)`` into a
running accumulator.  A kernel that knows each row's normaliser in advance
(the rectified differential kernel, which needs both maps' LSEs before it
can clip their difference) instead builds final weights tile by tile and
adds ``P @ v_tile`` to the output directly:

* :func:`rectified_weights` -- ``P = max(0, A1 - lam * A2)`` or ``A1 - lam H(A1 - lam
  A2)``, ``A_c = exp(S_c - lse_c)``
* :func:`add_sink` -- ``lse = log(e^lse + e^sink)``: the normaliser of a map whose
  denominator holds a learned sink
* :func:`~attnnb.cpu._tiles.add_weighted_values` -- ``acc += P @ v_tile``, skipping
  zero weights when the value tile holds NaN or Inf (shared with the online update)
* :func:`finish_weighted_rows` -- copy the accumulator out, NaN rows stay NaN
"""

from __future__ import annotations

import numpy as np

from .._core import scalars as _scalars
from ._exp import exp_shifted
from ._jit import inner
from ._tiles import view2d


@inner
def _map_row(srow, prow, lse, nk):
    """``prow = exp(srow - lse)``; an empty row (``lse = -inf``) has weights 0."""
    if lse == -np.inf:
        prow[:nk] = 0.0
    else:
        exp_shifted(srow, prow, lse, nk)


_log_add_exp = inner(_scalars.log_add_exp)  # shared with the cuda backend


@inner
def add_sink(lse_rows, sink):
    """``lse_rows = log(e^lse + e^sink)`` in place: ``exp(s - lse)`` then weighs as
    ``e^s / (e^sink + sum e^s)``.  An empty row's normaliser becomes the sink (its
    logits stay ``-inf``, its weights 0); NaN rows stay NaN."""
    for r in range(lse_rows.shape[0]):
        lse_rows[r] = _log_add_exp(lse_rows[r], sink)


@inner
def rectified_weights(S1, S2, lse1, lse2, lam, gated, P_flat, P2_flat):
    """``P = max(0, A1 - lam * A2)`` for one tile, ``A_c = exp(S_c - lse_c)``; with
    ``gated``, ``P = A1 - lam H(A1 - lam * A2)`` (``H(x) = 1`` for ``x > 0``, else 0)
    instead.

    Parameters
    ----------
    S1, S2 : ``(nq, nk)`` modified logits of the two maps (masked keys ``-inf``).
    lse1, lse2 : ``(nq,)`` the maps' log normalisers over all allowed keys
        (``-inf`` on an empty row; rows with a NaN LSE are skipped here and
        set to NaN by :func:`finish_weighted_rows`).
    lam : ``(nq,)``
    P_flat, P2_flat : scratch of at least ``nq * nk`` elements; the weights are
        returned as an ``(nq, nk)`` view of ``P_flat``.
    """
    nq, nk = S1.shape
    P = view2d(P_flat, nq, nk)
    P2 = view2d(P2_flat, nq, nk)
    for r in range(nq):
        prow = P[r]
        if lse1[r] != lse1[r] or lse2[r] != lse2[r]:
            prow[:] = 0.0
            continue
        _map_row(S1[r], prow, lse1[r], nk)
        p2row = P2[r]
        _map_row(S2[r], p2row, lse2[r], nk)
        lr = lam[r]
        if gated:
            for c in range(nk):
                a1 = prow[c]
                prow[c] = a1 - lr if a1 - lr * p2row[c] > 0.0 else a1
        else:
            for c in range(nk):
                w = prow[c] - lr * p2row[c]
                prow[c] = w if w > 0.0 else 0.0
    return P


@inner
def finish_weighted_rows(acc, lse1, lse2, out_rows):
    """``out = acc``; rows where either map met a NaN logit are NaN."""
    nq, dv = acc.shape
    for r in range(nq):
        if lse1[r] != lse1[r] or lse2[r] != lse2[r]:
            out_rows[r, :] = np.nan
        else:
            for c in range(dv):
                out_rows[r, c] = acc[r, c]

"""Token Merging on the ``reference`` backend: float64 NumPy, written for clarity.

Three operations (see :mod:`attnnb.tome` for the algorithm they serve):

* :func:`match` -- cosine similarity of every token of set A with every token
  of set B (materialised: this is the oracle), the best B partner of each A
  token, and the A tokens ordered by that best similarity.
* :func:`merge` -- reduce tokens into output slots (``mean``/``sum``/``amax``).
* :func:`unmerge` -- copy each output slot back to every token it holds.
"""

from __future__ import annotations

import numpy as np


def cosine_rows(x):
    """Rows of ``x`` (float64) divided by their Euclidean norm, as the reference does.

    Parameters
    ----------
    x : array ``(..., C)``

    Returns
    -------
    float64 ``(..., C)``: ``x / sqrt(x[..., 0]**2 + x[..., 1]**2 + ...)``.

    Notes
    -----
    The squares are summed channel by channel, left to right, and every entry
    is divided by the norm, as the ``cpu`` kernel does, so that both give the
    same float64 unit rows.  (``np.linalg.norm`` sums pairwise, and
    ``x * (1 / norm)`` rounds a one-channel ``x / |x|`` to one ulp below 1 for
    some ``x``; either would make the backends break differently ties that
    are exact only in exact arithmetic.)  A zero row gives NaN (``0 / 0``), as
    ``metric / metric.norm()`` does.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        squares = np.zeros(x.shape[:-1] + (1,))
        for c in range(x.shape[-1]):
            squares += x[..., c:c + 1] * x[..., c:c + 1]
        return x / np.sqrt(squares)


def descending_order(values):
    """Indices sorting each row of ``values`` from largest to smallest, stably.

    Ties keep the lower index first; NaN ranks above everything (as
    ``torch.sort(descending=True)``) and ``-inf`` below everything.
    """
    key = -values
    key[np.isnan(values)] = -np.inf
    return np.argsort(key, axis=-1, kind="stable")


def match(metric, a_idx, b_idx, class_token, distill_token):
    """Best partner in set B for every token of set A, and the edges ordered by similarity.

    Parameters
    ----------
    metric : array ``(B, N, C)``
        Not normalised.
    a_idx : int64 ``(B or 1, Ta)``
        Token positions of set A.
    b_idx : int64 ``(B or 1, Tb)``, ``Tb >= 1``
        Token positions of set B.
    class_token : bool
        A token 0 may not be merged: its similarities are ``-inf``.
    distill_token : bool
        B token 0 may not receive a merge: its similarities are ``-inf``.

    Returns
    -------
    node_max : float64 ``(B, Ta)``
        ``max_j cos(a_i, b_j)`` (NaN when any similarity of the row is NaN).
    node_idx : int64 ``(B, Ta)``
        The first ``j`` attaining it (the first NaN when there is one).
    order : int64 ``(B, Ta)``
        ``descending_order(node_max)``: the candidate edges, best first.
    """
    unit = cosine_rows(metric)
    a = np.take_along_axis(unit, np.asarray(a_idx)[..., None], axis=1)
    b = np.take_along_axis(unit, np.asarray(b_idx)[..., None], axis=1)
    scores = a @ np.swapaxes(b, -1, -2)
    if class_token:
        scores[:, 0, :] = -np.inf
    if distill_token:
        scores[:, :, 0] = -np.inf
    nan = np.isnan(scores)
    # A NaN wins the row (torch.max propagates it); otherwise the first maximum.
    node_idx = np.where(nan.any(axis=-1), np.argmax(nan, axis=-1),
                        np.argmax(np.where(nan, -np.inf, scores), axis=-1))
    node_max = np.take_along_axis(scores, node_idx[..., None], axis=-1)[..., 0]
    return node_max, node_idx.astype(np.int64), descending_order(node_max)


def merge(x, slot, n_out, mode):
    """Reduce the tokens of ``x`` into ``n_out`` output slots per batch.

    Parameters
    ----------
    x : array ``(B, N, C)``
    slot : int64 ``(B or 1, N)``
        Output slot of every token; ``-1`` drops the token.  Every slot in
        ``range(n_out)`` receives at least one token.
    n_out : int
    mode : {"mean", "sum", "amax"}

    Returns
    -------
    float64 ``(B, n_out, C)``: the mean, sum or maximum over each slot's tokens.
    """
    x = np.asarray(x, dtype=np.float64)
    B, N, C = x.shape
    slot = np.broadcast_to(slot, (B, N))
    batch = np.broadcast_to(np.arange(B)[:, None], (B, N))
    keep = slot >= 0
    where = (batch[keep], slot[keep])
    if mode == "amax":
        out = np.full((B, n_out, C), -np.inf)
        np.maximum.at(out, where, x[keep])
        return out
    out = np.zeros((B, n_out, C))
    np.add.at(out, where, x[keep])
    if mode == "mean":
        count = np.zeros((B, n_out))
        np.add.at(count, where, 1.0)
        out /= count[..., None]
    return out


def unmerge(x, slot):
    """``out[b, p] = x[b, slot[b, p]]``: every token takes its slot's value.

    ``x`` is ``(B, n_out, C)``, ``slot`` int64 ``(B or 1, N)`` with no ``-1``;
    returns float64 ``(B, N, C)``.
    """
    x = np.asarray(x, dtype=np.float64)
    slot = np.broadcast_to(slot, (x.shape[0], slot.shape[1]))
    return np.take_along_axis(x, slot[..., None], axis=1)

"""Statistics of dense attention's weights on the CPU: one pass over the tiles after the LSE.

The weights of row ``i`` are ``w = r_i exp(s' - lse_i) F z`` (``s'`` the
modified logit, ``r_i`` softmax1's or the sinks' ratio, ``F``
``relu_expm1``'s factor, ``z`` the dropout factor): the forward's LSE,
formed first on values of width zero (the same logits, so the same LSE bit
for bit, without the value product), fixes them, and the pass reduces each
tile of them at once.  One task per (batch, head, run of query tiles):

* per row, written by the row's task: entropy ``-sum w log w`` (``log w`` from
  the logit, not a logarithm per weight, except ``relu_expm1``'s factor), the
  largest weight and its key (the lowest on ties: keys come in increasing
  order), the mass on the chosen keys, the exact zeros among the allowed keys;
* per key, the weight received: each task adds into its own row of
  ``received (tasks, Lk)``, summed on the host in task order (no races, the
  same bits on every run).

Rows whose LSE is NaN get NaN statistics (and NaN received by every key),
empty rows zeros and ``argmax = -1``, as :mod:`attnnb._front.row_weights` gives.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numba import prange

from .._core.codes import NORMALIZER_CODES, RELU_EXPM1
from .._core.dropout import keep_scale
from ._decoding import SPLIT_TASKS
from ._dropout import keep_factors, kernel_dropout
from ._exp import exp_shifted
from ._host import kernel_sinks, run_sweep
from ._jit import kernel, wide_vectors
from ._task import sweep_geometry
from ._tiles import (
    TILE_K,
    TILE_Q,
    key_tiles_seen,
    modify_logits,
    scaled_rows,
    task_scratch,
    tile_logits_t,
    view2d,
)
from .attention import attention as attention_forward

# per_row's columns: the statistics a row gets
ENTROPY, MAX, ARGMAX, MASS, ZEROS = range(5)


@kernel
def stats_kernel(q, k, v, kt, v_ok, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                 causal, normalizer, row_lse, ratio, dropout, kept_scale, key_mask, n_split,
                 per_row, received, out, lse):
    """One task per (batch, query head, split of the query tiles); see the module docstring.

    Leading arguments as every tiled kernel's (:mod:`attnnb.cpu._host`; ``v``
    of width zero).  ``row_lse``, ``ratio``: ``(B, Hq, Lq)``; ``dropout``
    :func:`~attnnb.cpu._dropout.kernel_dropout`'s, ``kept_scale`` its ``1 / (1 -
    p)``; ``key_mask (Lk,)`` the keys of the mass; writes ``per_row (B, Hq, Lq,
    5)`` (float64; the argmax and zeros as floats) and ``received (B * Hq *
    n_split, Lk)`` (float64, zeros on entry).
    """
    B, Hq, Lq, Lk, _, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, TILE_Q, causal)
    per_split = (n_qt + n_split - 1) // n_split
    dropping = dropout[2] != 0
    log_keep = math.log(kept_scale) if dropping else 0.0
    for task in prange(B * Hq * n_split):
        wide_vectors()
        b, h, split = task // (Hq * n_split), (task // n_split) % Hq, task % n_split
        g = h // group
        q_flat, S_flat, P_flat, F_flat, _ = task_scratch(q, TILE_Q, 0)
        Z_flat = np.empty(TILE_Q * TILE_K if dropping else 0, q.dtype)
        words = np.empty(TILE_K, np.int64)
        recv = received[task]
        mask_bh, bias_bh, logks_b = mask[b, h], bias[b, h], logks[b]
        for qt in range(split * per_split, min(n_qt, (split + 1) * per_split)):
            i0 = qt * TILE_Q
            nq = min(TILE_Q, Lq - i0)
            qs = scaled_rows(q[b, h], i0, nq, scale, q_flat)
            acc = np.zeros((nq, 5))
            for r in range(nq):
                acc[r, ARGMAX] = -1.0
            for t in range(key_tiles_seen(i0, nq, diag, n_kt)):
                j0 = t * TILE_K
                nk = min(TILE_K, Lk - j0)
                S = tile_logits_t(qs, kt[b, g], j0, nk, S_flat)
                F = view2d(F_flat, nq, nk)
                modify_logits(S, F, i0, j0, diag, bias_bh, has_bias, mask_bh, has_mask, logks_b,
                              has_ks, normalizer)
                P = view2d(P_flat, nq, nk)
                Z = view2d(Z_flat, nq if dropping else 0, nk)
                if dropping:
                    keep_factors(Z, dropout, b, h, i0, j0, words, kept_scale)
                # keys the tile hides from some row: counted out of the zeros below
                cut = j0 + nk - 1 > i0 + diag
                for r in range(nq):
                    i = i0 + r
                    shift = row_lse[b, h, i]
                    if shift != shift or shift == -np.inf:  # NaN and empty rows: below
                        continue
                    w_row = P[r]
                    exp_shifted(S[r], w_row, shift, nk)
                    row_ratio = ratio[b, h, i]
                    log_scale = math.log(row_ratio) - shift + (log_keep if dropping else 0.0)
                    for c in range(nk):
                        w_row[c] *= row_ratio
                    if normalizer == RELU_EXPM1:  # log F where the weight is not 0
                        for c in range(nk):
                            f = F[r, c]
                            w_row[c] *= f
                            S[r, c] += math.log(f) if f > 0.0 else 0.0
                    if dropping:
                        for c in range(nk):
                            w_row[c] *= Z[r, c]
                    # vectorisable reductions: no branch but selects
                    entropy = 0.0
                    mass = 0.0
                    zeros = 0
                    top = 0.0
                    for c in range(nk):
                        w = w_row[c]
                        entropy -= w * (S[r, c] + log_scale) if w > 0.0 else 0.0
                        mass += w if key_mask[j0 + c] else 0.0
                        zeros += 1 if w == 0.0 else 0
                        recv[j0 + c] += w
                        top = max(top, w)
                    if has_mask or cut:
                        for c in range(nk):
                            hidden = (has_mask and not mask_bh[i, j0 + c]) or j0 + c > i + diag
                            zeros -= 1 if hidden else 0
                    acc[r, ENTROPY] += entropy
                    acc[r, MASS] += mass
                    acc[r, ZEROS] += zeros
                    if top > acc[r, MAX]:  # the first key holding it: the lowest
                        acc[r, MAX] = top
                        for c in range(nk):
                            if w_row[c] == top:
                                acc[r, ARGMAX] = j0 + c
                                break
            for r in range(nq):
                shift = row_lse[b, h, i0 + r]
                if shift != shift:  # a NaN row: NaN weights everywhere
                    acc[r, ENTROPY] = np.nan
                    acc[r, MAX] = np.nan
                    acc[r, MASS] = np.nan
                    for j in range(Lk):
                        recv[j] = np.nan
                for x in range(5):
                    per_row[b, h, i0 + r, x] = acc[r, x]


def splits(B: int, Hq: int, Lq: int) -> int:
    """Runs of query tiles per (batch, head): enough tasks for the threads
    (:data:`~attnnb.cpu._decoding.SPLIT_TASKS`), each a run of at least one tile."""
    n_qt = -(-Lq // TILE_Q)
    if B * Hq == 0 or n_qt == 0:
        return 1
    return max(1, min(n_qt, -(-SPLIT_TASKS // (B * Hq))))


def attention_stats(problem, key_mask):
    """Statistics of dense attention's weights for a canonical problem (no top-k, no pattern).

    Returns ``(per_row, received)``: float64 ``(B, Hq, Lq, 5)`` (entropy, max,
    argmax, mass on ``key_mask``, zeros) and ``(B, Hq, Lk)``.
    """
    B, Hq, _, Lq, Lk = problem.shape[:5]
    dt = problem.q.dtype
    no_values = np.ascontiguousarray(problem.v[..., :0])
    # the LSE of the weights before dropout, from the same logits: the forward's bit for bit
    _, row_lse = attention_forward(dataclasses.replace(problem, v=no_values, dropout_p=0.0))
    with np.errstate(over="ignore"):
        if problem.normalizer == "softmax1":  # sigmoid(lse - sink)
            sink = kernel_sinks(problem)[:, :, None].astype(np.float64)
            ratio = 1.0 / (1.0 + np.exp(sink - row_lse.astype(np.float64)))
        else:
            ratio = np.ones(row_lse.shape)
    ratio = np.ascontiguousarray(ratio, dt)
    n_split = splits(B, Hq, Lq)
    per_row = np.zeros((B, Hq, Lq, 5))
    received = np.zeros((B * Hq * n_split, Lk))
    run_sweep(stats_kernel, dataclasses.replace(problem, v=no_values),
              NORMALIZER_CODES[problem.normalizer], row_lse, ratio, kernel_dropout(problem),
              dt.type(keep_scale(problem.dropout_p)), key_mask, n_split, per_row, received)
    return per_row, received.reshape(B, Hq, n_split, Lk).sum(axis=2)

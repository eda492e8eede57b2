"""The set-up every tiled CPU kernel does before its key sweep, in one place.

A tiled kernel (dense, sparse, top-k, differential, and the backward
kernels to come) runs one task per (batch, query head, query tile).  Each
needs the same geometry of the problem (:func:`sweep_geometry`) and, per
task, the same rows, key/value head, scratch, online state and scaled
queries (:func:`query_task`).  Kernels call these instead of repeating the
lines; being :func:`~attnnb.cpu._jit.inner` functions they are inlined, so
they cost nothing.
"""

from __future__ import annotations

from ._jit import inner
from ._tiles import TILE_K, online_state, scaled_rows, task_rows, task_scratch


@inner
def sweep_geometry(q, k, v, tile_q, causal):
    """``(B, Hq, Lq, Lk, Dv, group, n_qt, n_kt, diag)`` of a kernel's problem.

    ``group`` query heads share a key head (GQA); ``n_qt`` query tiles of
    ``tile_q`` rows and ``n_kt`` key tiles of ``TILE_K`` keys cover the
    problem; key ``j`` is masked for query ``i`` when ``j > i + diag``
    (``diag = Lk`` when not ``causal``: nothing is masked).
    """
    B, Hq, Lq = q.shape[0], q.shape[1], q.shape[2]
    Hk, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    n_qt = (Lq + tile_q - 1) // tile_q
    n_kt = (Lk + TILE_K - 1) // TILE_K
    diag = Lk - Lq if causal else Lk
    return B, Hq, Lq, Lk, Dv, Hq // Hk, n_qt, n_kt, diag


@inner
def query_task(task, q, kt, v, scale, tile_q, group, n_qt):
    """Everything task ``task`` of ``B * Hq * n_qt`` needs before its key sweep.

    Returns ``(b, h, g, qt, i0, nq, kth, vh, qs, m, l, acc, S_flat, P_flat,
    F_flat, T_flat)``: batch, query head, its key head (GQA), query tile and
    its rows ``i0 : i0 + nq``; the key head's transposed key tiles ``kth``
    and values ``vh``; the scaled queries ``qs (nq, D)``; the online state
    (running shift ``m``, sum ``l``, accumulator ``acc (nq, Dv)``); and the
    flat scratch of :func:`~attnnb.cpu._tiles.task_scratch`.
    """
    Hq, Lq, Dv = q.shape[1], q.shape[2], v.shape[3]
    b, h, qt, i0, nq = task_rows(task, Hq, n_qt, tile_q, Lq)
    g = h // group
    q_flat, S_flat, P_flat, F_flat, T_flat = task_scratch(q, tile_q, Dv)
    m, l, acc = online_state(q, nq, Dv)
    qs = scaled_rows(q[b, h], i0, nq, scale, q_flat)
    return (b, h, g, qt, i0, nq, kt[b, g], v[b, g], qs, m, l, acc, S_flat, P_flat, F_flat,
            T_flat)

"""Dense attention on the CPU: the tiled core swept over every key tile."""

from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import kernel, launch, wide_vectors
from ._scratch import key_tile_buffers
from ._tiles import (
    NORMALIZER_CODES,
    SWEEP_TILE_Q,
    TILE_K,
    finish_rows,
    key_tiles_seen,
    modify_logits,
    online_state,
    online_update,
    prepare_key_tile,
    scaled_rows,
    task_rows,
    task_scratch,
    tile_logits_t,
)


@kernel
def attention_kernel(q, k, v, scale, bias, has_bias, mask, has_mask, logks, has_ks, causal,
                     normalizer, kt, v_ok, out, lse):
    """One task per (batch, query head, query tile); see :mod:`attnnb.cpu._tiles`.

    With ``causal`` the sweep stops at the last key tile the tile's last
    query may see, and only tiles that cross the diagonal are masked
    element by element.
    """
    B, Hq, Lq, D = q.shape
    Hk, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hk
    n_qt = (Lq + SWEEP_TILE_Q - 1) // SWEEP_TILE_Q
    n_kt = (Lk + TILE_K - 1) // TILE_K
    diag = Lk - Lq if causal else Lk  # j > i + diag is masked; Lk disables it
    for task in prange(kt.shape[0] * kt.shape[1] * kt.shape[2]):
        prepare_key_tile(k, v, kt, v_ok, task)
    for task in prange(B * Hq * n_qt):
        wide_vectors()
        b, h, _, i0, nq = task_rows(task, Hq, n_qt, SWEEP_TILE_Q, Lq)
        g = h // group
        kth, vh = kt[b, g], v[b, g]
        q_flat, S_flat, P_flat, F_flat, T_flat = task_scratch(q, SWEEP_TILE_Q, Dv)
        m, l, acc = online_state(q, nq, Dv)
        qs = scaled_rows(q[b, h], i0, nq, scale, q_flat)
        last = key_tiles_seen(i0, nq, diag, n_kt)
        for t in range(last):
            j0 = t * TILE_K
            nk = min(TILE_K, Lk - j0)
            S = tile_logits_t(qs, kth, j0, nk, S_flat)
            F = S_flat[: nq * nk].reshape((nq, nk)) if normalizer != 2 else \
                F_flat[: nq * nk].reshape((nq, nk))
            modify_logits(S, F, i0, j0, diag, bias[b, h], has_bias, mask[b, h], has_mask,
                          logks[b], has_ks, normalizer)
            online_update(S, F, m, l, acc, P_flat, T_flat, vh, j0, v_ok[b, g, t], normalizer)
        finish_rows(acc, m, l, normalizer, out[b, h, i0 : i0 + nq], lse[b, h, i0 : i0 + nq])


def _dummy_pairwise(dtype):
    # Shaped so that Numba types it like a real broadcast mask or bias (readonly, layout
    # 'A'): calls with and without a mask then share one compiled kernel.
    return np.broadcast_to(np.zeros((), dtype), (1, 1, 2, 2))


def kernel_arguments(problem):
    """Host-side arrays for the kernel: always-present placeholders keep one signature."""
    dt = problem.q.dtype
    B, Hq, _, Lq, Lk, _, _ = problem.shape
    bias = problem.bias if problem.bias is not None else _dummy_pairwise(dt)
    mask = problem.mask if problem.mask is not None else _dummy_pairwise(np.bool_)
    if problem.log_key_size is not None:
        logks = problem.log_key_size
    else:
        logks = np.zeros((1, 1), dt)
    return bias, mask, logks


def empty_outputs(problem):
    """``out (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)`` to fill, in the compute dtype."""
    B, Hq, _, Lq, _, _, Dv = problem.shape
    dt = problem.q.dtype
    return np.empty((B, Hq, Lq, Dv), dt), np.empty((B, Hq, Lq), dt)


def attention(problem):
    """Run dense attention of a canonical problem; returns ``(out, lse)``."""
    q, k, v = problem.q, problem.k, problem.v
    out, lse = empty_outputs(problem)
    if out.size == 0 and lse.size == 0:
        return out, lse
    bias, mask, logks = kernel_arguments(problem)
    with key_tile_buffers(k, v) as (kt, v_ok):
        launch(attention_kernel, q, k, v, q.dtype.type(problem.scale), bias,
               problem.bias is not None, mask, problem.mask is not None, logks,
               problem.log_key_size is not None, problem.causal,
               NORMALIZER_CODES[problem.normalizer], kt, v_ok, out, lse)
    return out, lse

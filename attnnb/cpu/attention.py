"""Dense attention on the CPU: the tiled core swept over every key tile."""

from __future__ import annotations

from numba import prange

from .._codes import NORMALIZER_CODES, RELU_EXPM1
from ._host import run_sweep
from ._jit import kernel, wide_vectors
from ._task import query_task, sweep_geometry
from ._tiles import (
    SWEEP_TILE_Q,
    TILE_K,
    finish_rows,
    key_tiles_seen,
    modify_logits,
    online_update,
    prepare_key_tile,
    tile_logits_t,
    view2d,
)


@kernel
def attention_kernel(q, k, v, kt, v_ok, scale, bias, has_bias, mask, has_mask, logks, has_ks,
                     causal, normalizer, out, lse):
    """One task per (batch, query head, query tile); see :mod:`attnnb.cpu._tiles`.

    Leading arguments as every tiled kernel's (:mod:`attnnb.cpu._host`).  With
    ``causal`` the sweep stops at the last key tile the tile's last query may
    see, and only tiles that cross the diagonal are masked element by element.
    """
    B, Hq, Lq, Lk, Dv, group, n_qt, n_kt, diag = sweep_geometry(q, k, v, SWEEP_TILE_Q, causal)
    for task in prange(kt.shape[0] * kt.shape[1] * kt.shape[2]):
        prepare_key_tile(k, v, kt, v_ok, task)
    for task in prange(B * Hq * n_qt):
        wide_vectors()
        (b, h, _, i0, nq, kth, vh, qs, m, l, acc, S_flat, P_flat, F_flat,
         T_flat) = query_task(task, q, kt, v, scale, SWEEP_TILE_Q, group, n_qt)
        g = h // group
        last = key_tiles_seen(i0, nq, diag, n_kt)
        for t in range(last):
            j0 = t * TILE_K
            nk = min(TILE_K, Lk - j0)
            S = tile_logits_t(qs, kth, j0, nk, S_flat)
            # relu_expm1 keeps the logits and the kernel values apart (see modify_logits)
            F = view2d(F_flat, nq, nk) if normalizer == RELU_EXPM1 else S
            modify_logits(S, F, i0, j0, diag, bias[b, h], has_bias, mask[b, h], has_mask,
                          logks[b], has_ks, normalizer)
            online_update(S, F, m, l, acc, P_flat, T_flat, vh, j0, v_ok[b, g, t], normalizer)
        finish_rows(acc, m, l, normalizer, out[b, h, i0 : i0 + nq], lse[b, h, i0 : i0 + nq])


def attention(problem):
    """Run dense attention of a canonical problem; returns ``(out, lse)``."""
    return run_sweep(attention_kernel, problem, NORMALIZER_CODES[problem.normalizer])

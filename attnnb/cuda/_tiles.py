"""The shared per-row device functions of the CUDA tiled core, and tile sizes.

Every CUDA attention kernel is one thread block per (batch x query head,
query tile) and one thread per query row: the block stages key and value
tiles in shared memory (:func:`load_rows`), and each thread sweeps them with
an online (running-maximum) normaliser kept in registers, as in
FlashAttention.  The kernels differ only in which key tiles they visit and
how they combine results; the code that touches every score lives here:

* ``load_rows``   -- cooperative copy of a key / value tile into shared memory
* ``row_logits``  -- ``s[c] = q_row . k_tile[c]`` (q pre-scaled)
* ``modify_row``  -- bias, mask, causal limit, ``relu_expm1``'s factor,
  ``log(key_size)``
* ``online_row``  -- running max / sum, ``acc = acc * alpha + p @ v_tile``
* ``finish_row``  -- normaliser-specific division, LSE, empty and NaN rows

The functions are built per compute dtype by :func:`device_functions` so
that every literal is a constant of that dtype: a float32 kernel then does
float32 arithmetic only (``gpu/ptx_check.py`` checks the PTX for this).
Inputs of any floating dtype (float16, mixed) are converted on load.

Tile sizes: ``TILE_Q`` query rows (= threads) per block and at most
``TILE_K`` keys per shared tile, from ``ATTNNB_CUDA_TILE_Q`` /
``ATTNNB_CUDA_TILE_K`` at import or :func:`set_tiles`; the key tile shrinks
so that one key and one value tile fit in 48 KiB of static shared memory.
"""

from __future__ import annotations

import math
import os
import threading
from functools import cache
from types import SimpleNamespace

import numpy as np
from numba import cuda

from .._codes import RELU_EXPM1, SOFTMAX1

SHARED_BYTES = 48 * 1024  # static shared memory per block on every CUDA GPU


def _env_tile(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer; got {raw!r}") from None
    if not 1 <= value <= 1024:
        raise ValueError(f"{name} must be between 1 and 1024; got {value}")
    return value


TILE_Q = _env_tile("ATTNNB_CUDA_TILE_Q", 64)
TILE_K = _env_tile("ATTNNB_CUDA_TILE_K", 64)
_LOCK = threading.Lock()


def set_tiles(tile_q: int | None = None, tile_k: int | None = None) -> tuple[int, int]:
    """Set the query tile (threads per block) and the largest key tile.

    Returns the previous ``(TILE_Q, TILE_K)``.  Kernels are compiled per tile
    size, so changing them costs one compile per kernel on a real GPU (the
    simulator's tests use tiny tiles).
    """
    global TILE_Q, TILE_K
    old = (TILE_Q, TILE_K)
    for name, value in (("tile_q", tile_q), ("tile_k", tile_k)):
        if value is not None and not (isinstance(value, int) and 1 <= value <= 1024):
            raise ValueError(f"{name} must be an integer between 1 and 1024; got {value!r}")
    if tile_q is not None:
        TILE_Q = tile_q
    if tile_k is not None:
        TILE_K = tile_k
    return old


def tiles_for(dtype: np.dtype, *widths: int) -> tuple[int, int]:
    """``(tile_q, tile_k)`` for a compute dtype and the widths of the staged rows.

    ``widths`` are the row lengths of the tiles a kernel keeps in shared
    memory (``D, Dv`` for dense attention); the key tile is cut so that they fit.
    """
    row_bytes = sum(widths) * np.dtype(dtype).itemsize
    tk = min(TILE_K, SHARED_BYTES // row_bytes)
    if tk < 1:
        raise ValueError(
            f"head sizes {widths} are too large for the cuda backend: one row of each staged "
            f"tile ({row_bytes} bytes) must fit in {SHARED_BYTES} bytes of shared memory"
        )
    return TILE_Q, tk


def key_tiles_seen(i0, tq, Lq, Lk, tk, causal):
    """``(diag, last)``: the causal offset and how many key tiles a query block visits.

    ``j > i + diag`` is outside the allowed set (``diag = Lk`` disables it);
    with ``causal`` the sweep stops at the last key tile the block's last
    query may see (causal tile skipping).
    """
    diag = Lk - Lq if causal else Lk
    last = (Lk + tk - 1) // tk
    if causal:
        last = min(last, max(0, (min(i0 + tq, Lq) - 1 + diag) // tk + 1))
    return diag, last


def block_rows(Hq, Hk, Lq, tq, qt0):
    """Where the calling thread works: ``(b, h, g, i0, i, valid, ii)``.

    Block ``(b * Hq + h, query tile - qt0)`` of query head ``h`` and its
    key/value head ``g = h // (Hq // Hk)`` (grouped-query attention); the
    thread's query row ``i`` (``valid`` when ``i < Lq``; ``ii`` is ``i``
    clipped for reads).  ``qt0`` is the first query tile of a launch that
    covers only some of them (0 otherwise).
    """
    bh = cuda.blockIdx.x
    b = bh // Hq
    h = bh - b * Hq
    i0 = (qt0 + cuda.blockIdx.y) * tq
    i = i0 + cuda.threadIdx.x
    return b, h, h // (Hq // Hk), i0, i, i < Lq, min(i, Lq - 1)


def row_views(bias, mask, logks, b, h, i):
    """The ``(bias, mask, log key size)`` rows of query ``i`` of ``(b, h)``.

    Each input axis is full or 1 (broadcast); the rows have length ``Lk`` or 1.
    """
    return (bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0,
                 i if bias.shape[2] > 1 else 0],
            mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0,
                 i if mask.shape[2] > 1 else 0],
            logks[b if logks.shape[0] > 1 else 0])


def index_or_zero(idx, extent):
    """``idx`` on an axis of length ``extent``, or 0 on a broadcast (length-1) axis."""
    return idx if extent > 1 else 0


@cache
def device_functions(dtype: np.dtype) -> SimpleNamespace:
    """The shared device functions for one compute dtype (float32 or float64)."""
    dtype = np.dtype(dtype)
    CAST = dtype.type
    ZERO = dtype.type(0)
    ONE = dtype.type(1)
    NINF = dtype.type(-np.inf)
    NAN = dtype.type(np.nan)
    F_FOLD = dtype.type(2.0**-40)  # relu_expm1 factors below this go into the logit
    L_MIN = dtype.type(4 / np.finfo(dtype).max)  # below this, 1 / l would overflow
    index = cuda.jit(device=True)(index_or_zero)
    tiles_seen = cuda.jit(device=True)(key_tiles_seen)
    views = cuda.jit(device=True)(row_views)
    rows = cuda.jit(device=True)(block_rows)

    @cuda.jit(device=True)
    def load_rows(src, j0, nk, dst):
        """Block-cooperative ``dst[:nk] = src[j0:j0+nk]``, converted to the compute dtype.

        Every thread of the block must call it (follow with ``syncthreads``).
        """
        width = dst.shape[1]
        for e in range(cuda.threadIdx.x, nk * width, cuda.blockDim.x):
            r = e // width
            c = e - r * width
            dst[r, c] = CAST(src[j0 + r, c])

    @cuda.jit(device=True)
    def load_query(src, i, scale, qr):
        """``qr = scale * src[i]`` in the compute dtype (the thread's query row)."""
        for e in range(qr.shape[0]):
            qr[e] = CAST(src[i, e]) * scale

    @cuda.jit(device=True)
    def start_row(src, i, scale, qr, acc):
        """Load the thread's scaled query row, zero its accumulator; return ``(m, l)``."""
        load_query(src, i, scale, qr)
        for e in range(acc.shape[0]):
            acc[e] = ZERO
        return NINF, ZERO

    @cuda.jit(device=True)
    def row_logits(qr, Ks, nk, S):
        """``S[c] = qr . Ks[c]`` for the ``nk`` keys of the shared tile."""
        d = qr.shape[0]
        for c in range(nk):
            t = ZERO
            for e in range(d):
                t += qr[e] * Ks[c, e]
            S[c] = t

    @cuda.jit(device=True)
    def modify_row(S, F, nk, i, j0, diag, bias_row, has_bias, mask_row, has_mask, logks_row,
                   has_ks, normalizer):
        """Turn raw logits into the values the online softmax sweeps over.

        In order: add ``bias``; set keys outside the allowed set (``mask``
        false, or beyond the causal limit ``j > i + diag``) to ``-inf``; for
        ``relu_expm1`` store the factor ``1 - exp(-s)`` in ``F`` and drop
        ``s <= 0`` (a NaN logit stays, to propagate); add ``log(key_size)``.
        ``bias_row`` / ``mask_row`` / ``logks_row`` are the row's views, of
        length ``Lk`` or 1 (broadcast).
        """
        nb = bias_row.shape[0]
        nm = mask_row.shape[0]
        nl = logks_row.shape[0]
        for c in range(nk):
            j = j0 + c
            s = S[c]
            if has_bias:
                s += CAST(bias_row[index(j, nb)])
            if has_mask and not mask_row[index(j, nm)]:
                s = NINF
            if j > i + diag:
                s = NINF
            if normalizer == RELU_EXPM1:
                if s > ZERO:
                    F[c] = -math.expm1(-s)
                else:
                    F[c] = ZERO
                    if s == s:
                        s = NINF
            if has_ks:
                s += CAST(logks_row[index(j, nl)])
            S[c] = s

    @cuda.jit(device=True)
    def add_weighted_row(P, nk, Vs, acc):
        """``acc += P @ Vs`` over the tile's ``nk`` keys, skipping zero weights."""
        for e in range(acc.shape[0]):
            t = ZERO
            for c in range(nk):
                p = P[c]
                if p != ZERO:
                    t += p * Vs[c, e]
            acc[e] += t

    @cuda.jit(device=True)
    def online_row(S, F, nk, Vs, m, l, acc, normalizer):
        """Fold one tile of modified logits into ``(m, l, acc)``; return the new ``(m, l)``.

        ``m`` is the running max (``-inf`` before any allowed key, NaN once a
        NaN logit was seen), ``l`` the running ``sum exp(s - m)``, ``acc``
        the running ``sum exp(s - m) v``.  The tile's ``p @ v`` is summed on
        its own before it is added (``acc = acc * alpha + t``): one long
        chain over all keys loses accuracy.  Zero weights are skipped, so a
        key outside the allowed set never reaches the row, even as NaN; and
        when ``alpha`` underflows to 0 the accumulator is cleared rather than
        multiplied, so a value behind a weight that underflowed leaves no
        trace (the rule in :mod:`attnnb.reference._common`).
        ``S`` is overwritten with the weights ``p``.

        For ``relu_expm1`` a factor ``F = 1 - exp(-s)`` below ``2**-40`` (a
        tiny logit, ``F ~ s``) is folded into the logit (``S += log F``,
        ``F = 1``), so that the running max follows the largest weight even
        when all of a row's positive logits are tiny: otherwise the weights,
        their sum and products are subnormal and lose their digits.
        """
        if m != m:
            return m, l
        if normalizer == RELU_EXPM1:
            for c in range(nk):
                f = F[c]
                if f < F_FOLD and f > ZERO:  # F = 0: a key that does not count
                    S[c] += math.log(f)
                    F[c] = ONE
        mx = m
        seen_nan = False
        for c in range(nk):
            x = S[c]
            if x != x:
                seen_nan = True
            elif x > mx:
                mx = x
        if seen_nan:
            return NAN, l
        if mx == NINF:
            return m, l
        alpha = math.exp(m - mx)
        total = ZERO
        for c in range(nk):
            p = math.exp(S[c] - mx)
            if normalizer == RELU_EXPM1:
                p *= F[c]
            S[c] = p
            total += p
        for e in range(acc.shape[0]):
            # alpha = 0: the earlier weights underflowed; 0 * inf would be NaN
            acc[e] = ZERO if alpha == ZERO else acc[e] * alpha
        add_weighted_row(S, nk, Vs, acc)
        return mx, l * alpha + total

    @cuda.jit(device=True)
    def map_lse(m, l):
        """The LSE of a finished sweep: NaN rows NaN, empty rows ``-inf``."""
        if m != m:
            return NAN
        if l == ZERO or m == NINF:
            return NINF
        return m + math.log(l)

    @cuda.jit(device=True)
    def rectified_row(S1, S2, nk, lse1, lse2, lam):
        """``S1 = max(0, exp(S1 - lse1) - lam * exp(S2 - lse2))`` (weights of two maps
        whose LSEs are known; an empty map, ``lse = -inf``, has weights 0)."""
        for c in range(nk):
            a1 = ZERO if lse1 == NINF else math.exp(S1[c] - lse1)
            a2 = ZERO if lse2 == NINF else math.exp(S2[c] - lse2)
            w = a1 - lam * a2
            S1[c] = w if w > ZERO else ZERO

    @cuda.jit(device=True)
    def finish_value(x, m, l, lse, normalizer):
        """One output value ``x / Z`` of a finished row (``lse = map_lse(m, l)``).

        Empty rows (no allowed key, or weights summing to zero) get zeros;
        rows that met a NaN logit get NaN.  For ``softmax1``
        ``Z = l + exp(-m)`` (the ``+1`` in units of ``exp(m)``); the LSE
        excludes it.  ``x / Z`` is taken as ``(x / l) * sigmoid(lse)``,
        which neither overflows ``exp(-m)`` nor goes through a subnormal
        ``exp(m)`` for very negative logits.  A sum ``l`` below
        ``4 / finfo.max`` (where ``1 / l`` would overflow; :func:`online_row`
        keeps ``relu_expm1``'s sums away from it) is divided by directly.
        """
        if m != m:
            return NAN
        if l == ZERO or m == NINF:
            return ZERO
        if normalizer == SOFTMAX1:  # 1 / (l + e^-m) = sigmoid(lse) / l, stably
            a = math.exp(-abs(lse))
            sig = ONE / (ONE + a) if lse >= ZERO else a / (ONE + a)
            return (x * (ONE / l)) * sig  # x / l first: sigmoid(lse) / l can be subnormal
        if l < L_MIN:
            return x / l
        return x * (ONE / l)

    @cuda.jit(device=True)
    def finish_row(acc, m, l, normalizer, out_row):
        """Write ``out_row = acc / Z`` (:func:`finish_value`); return ``lse = m + log(l)``
        (NaN rows NaN, empty rows ``-inf``)."""
        lse = map_lse(m, l)
        for e in range(out_row.shape[0]):
            out_row[e] = finish_value(acc[e], m, l, lse, normalizer)
        return lse

    return SimpleNamespace(
        CAST=CAST, ZERO=ZERO, NINF=NINF, NAN=NAN, index=index, tiles_seen=tiles_seen,
        views=views, rows=rows, load_rows=load_rows, load_query=load_query, start_row=start_row,
        row_logits=row_logits,
        modify_row=modify_row, online_row=online_row, map_lse=map_lse,
        rectified_row=rectified_row, add_weighted_row=add_weighted_row, finish_row=finish_row,
        finish_value=finish_value,
    )


_KERNELS: dict = {}


def cached_kernel(key, build):
    """Build a kernel once per ``key`` (thread-safe): ``build()`` returns the dispatcher."""
    fn = _KERNELS.get(key)
    if fn is None:
        with _LOCK:
            fn = _KERNELS.get(key)
            if fn is None:
                fn = _KERNELS[key] = build()
    return fn

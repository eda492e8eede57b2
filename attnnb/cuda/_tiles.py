"""Dtype-specific device functions shared by the CUDA kernels, tile sizes, the kernel cache.

The attention kernels run on the register-tiled core of
:mod:`attnnb.cuda._micro`; what they share with it and with the Token
Merging kernels (:mod:`attnnb.cuda.tome`, one thread per row) lives here:

* ``load_rows``    -- cooperative copy of a tile of rows into shared memory
* ``row_logits``   -- ``s[c] = q_row . k_tile[c]`` (one thread's row)
* ``map_lse``      -- the LSE of a finished online sweep (NaN and empty rows)
* ``finish_value`` -- one output value of a finished row (normaliser division,
  empty and NaN rows; softmax1's and softpick's ``1 / (l + e^(sink - m))``
  without overflow; sigmoid's ``e^m``, unnormalised)
* ``tiles_seen``   -- the key tiles a query tile visits (causal tile skipping)

The functions are built per compute dtype by :func:`device_functions` so
that every literal is a constant of that dtype: a float32 kernel then does
float32 arithmetic only (``gpu/ptx_check.py`` checks the PTX for this).
Inputs of any floating dtype (float16, mixed) are converted on load.

Tile sizes of the one-thread-per-row kernels (Token Merging): ``TILE_Q``
rows (= threads) per block and at most ``TILE_K`` rows per shared tile,
from ``ATTNNB_CUDA_TILE_Q`` / ``ATTNNB_CUDA_TILE_K`` at import or
:func:`set_tiles`; the tile shrinks so that it fits in 48 KiB of static
shared memory.
"""

from __future__ import annotations

import math
import os
import threading
from functools import cache
from types import SimpleNamespace

import numpy as np
from numba import cuda

from .._core import scalars as _scalars
from .._core.codes import SIGMOID, SOFTMAX1, SOFTPICK
from .._core.specialise import specialise, template

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


def index_or_zero(idx, extent):
    """``idx`` on an axis of length ``extent``, or 0 on a broadcast (length-1) axis."""
    return idx if extent > 1 else 0


class _Unbound:
    """What a template's constant holds until a build binds it: a copy that misses one
    fails to compile, naming it."""

    def __repr__(self) -> str:
        return "<a template's constant, bound per build>"


def unbound(count: int) -> tuple:
    """``count`` placeholders for the globals a module's templates read (bound per build
    by :func:`attnnb._core.specialise.specialise`)."""
    return (_Unbound(),) * count


def device(fn=None, **options):
    """``cuda.jit(device=True, **options)`` for a template: compiled in the copies a
    build makes of it (:func:`attnnb._core.specialise.specialise`), its constants bound."""

    def make(fn):
        return template(cuda.jit(device=True, **options)(fn), make, py=fn)

    return make(fn) if fn is not None else make


def kernel(fn):
    """A kernel's Python function as a template: its copies are Python functions, which
    ``cuda.jit`` compiles where they are launched (and the PTX check where it checks
    them)."""
    return template(fn, _python, py=fn)


def _python(fn):
    return fn


# the dtype's constants the templates below read, bound per dtype (dtype_constants)
CAST, ZERO, ONE, NINF, NAN, L_MIN, LOG_TINY, HALF = unbound(8)

index = cuda.jit(device=True)(index_or_zero)
tiles_seen = cuda.jit(device=True)(key_tiles_seen)
sigmoid = cuda.jit(device=True)(_scalars.sigmoid)  # shared with the cpu backend


def dtype_constants(dtype) -> dict:
    """The constants of one compute dtype (float32 or float64), by name."""
    dtype = np.dtype(dtype)
    t = dtype.type
    return dict(CAST=t, ZERO=t(0), ONE=t(1), NINF=t(-np.inf), NAN=t(np.nan),
                L_MIN=t(4 / np.finfo(dtype).max),  # below this, 1 / l would overflow
                LOG_TINY=t(np.log(np.finfo(dtype).tiny)),  # below this, e^m is subnormal
                HALF=t(0.5), _tag=dtype.name)


@cache
def device_functions(dtype: np.dtype) -> SimpleNamespace:
    """The shared device functions for one compute dtype (float32 or float64), its
    constants, and ``bindings`` (both by name, for the kernels built on them)."""
    constants = dtype_constants(dtype)
    built = {fn_name: specialise(fn, constants, constants["_tag"]) for fn_name, fn in (
        ("load_rows", load_rows), ("row_logits", row_logits), ("map_lse", map_lse),
        ("finish_value", finish_value))}
    shared = dict(index=index, tiles_seen=tiles_seen, sigmoid=sigmoid)
    return SimpleNamespace(**constants, **built, **shared,
                           bindings={**constants, **built, **shared})


def dtype_kernel(fn, dtype, name: str, **constants):
    """The Python function of the kernel template ``fn`` (:func:`kernel`) for one compute
    dtype, with its own ``constants`` (numbers, in its tag with ``name``)."""
    suffix = "_".join([name] + [f"{k}{int(v) if isinstance(v, bool) else v}"
                                for k, v in sorted(constants.items())
                                if isinstance(v, (bool, int))])
    bindings = device_functions(np.dtype(dtype)).bindings
    return specialise(fn, {**bindings, **constants}, f"{bindings['_tag']}_{suffix}")


@device
def load_rows(src, j0, nk, dst):
    """Block-cooperative ``dst[:nk] = src[j0:j0+nk]``, converted to the compute dtype.

    Every thread of the block must call it (follow with ``syncthreads``).
    """
    width = dst.shape[1]
    for e in range(cuda.threadIdx.x, nk * width, cuda.blockDim.x):
        r = e // width
        c = e - r * width
        dst[r, c] = CAST(src[j0 + r, c])


@device
def row_logits(qr, Ks, nk, S):
    """``S[c] = qr . Ks[c]`` for the ``nk`` keys of the shared tile."""
    d = qr.shape[0]
    for c in range(nk):
        t = ZERO
        for e in range(d):
            t += qr[e] * Ks[c, e]
        S[c] = t


@device
def map_lse(m, l):
    """The LSE of a finished sweep: NaN rows NaN, empty rows ``-inf``."""
    if m != m:
        return NAN
    if l == ZERO or m == NINF:
        return NINF
    return m + math.log(l)


@device
def unshift(x, m):
    """``x e^m`` with one rounding into the subnormals at most: where ``e^m`` itself
    would be subnormal (``m`` below ``log(finfo.tiny)``) it is taken in two halves,
    each a normal number while the result can be one."""
    if m < LOG_TINY:
        h = m * HALF
        return (x * math.exp(h)) * math.exp(m - h)
    return x * math.exp(m)


@device
def finish_value(x, m, l, lse, normalizer, sink):
    """One output value ``x / Z`` of a finished row (``lse = map_lse(m, l)``).

    Empty rows (no allowed key, or weights summing to zero) get zeros;
    rows that met a NaN logit get NaN.  For ``softmax1``
    ``Z = l + exp(sink - m)`` (the row's sink logit, 0 or learned, in units of
    ``exp(m)``); the LSE excludes it.  ``softpick``'s ``Z = l + eps e^-m`` is the
    same with the sink ``log eps``.  ``x / Z`` is taken as ``(x / l) *
    sigmoid(lse - sink)``,
    which neither overflows ``exp(-m)`` nor goes through a subnormal
    ``exp(m)`` for very negative logits.  A sum ``l`` below
    ``4 / finfo.max`` (where ``1 / l`` would overflow; the core's ``modify_value``
    folds tiny ``relu_expm1`` factors into the logit, keeping sums away from it;
    softpick's terms of tiny logits are tiny) is divided by directly.
    ``sigmoid`` is not normalised: ``x e^m`` (:func:`unshift`).
    """
    if m != m:
        return NAN
    if l == ZERO or m == NINF:
        return ZERO
    if normalizer == SIGMOID:
        return unshift(x, m)
    y = x / l if l < L_MIN else x * (ONE / l)
    if normalizer == SOFTMAX1 or normalizer == SOFTPICK:
        # 1 / (l + e^(sink - m)) = sigmoid(lse - sink) / l, stably; x / l first:
        # sigmoid(lse - sink) / l can be subnormal
        y *= sigmoid(lse - sink, ONE)
    return y


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

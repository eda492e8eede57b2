"""The host buffer for the CPU kernels' transposed key tiles, reused across calls.

Every CPU kernel first copies the keys into tiles transposed for the
register-blocked ``Q K^T`` (:func:`attnnb.cpu._tiles.prepare_key_tile`): a
buffer as large as ``k`` itself.  Fresh memory of that size costs a page fault
per 4 KiB page on first touch, and two threads faulting at once contend in
the kernel, a large share of a short call (docs/notes/performance.md, "What each
step gave").  So the buffer is kept after a call and reused by the next one
that fits in it.

Memory held: at most one idle buffer, the largest one used so far (the size
of the largest ``k`` seen, in the compute dtype, rounded up to a whole
64-key tile).  :func:`release` frees it.  Calls running at the same time
(Python threads) never share a buffer: a call takes the idle buffer out of
the pool, or allocates its own when the pool is empty or too small.
"""

from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager

import numpy as np

from ._tiles import TILE_K

ALIGN = 64  # bytes: one cache line, one 512-bit vector

_lock = threading.Lock()
_idle: np.ndarray | None = None  # flat uint8, not in use by any call


def _after_fork_in_child() -> None:
    # a lock held by another thread at fork time would stay held in the child forever
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _take(nbytes: int) -> np.ndarray:
    global _idle
    with _lock:
        if _idle is not None and _idle.nbytes >= nbytes + ALIGN:
            buf, _idle = _idle, None
            return buf
    return np.empty(nbytes + ALIGN, np.uint8)


def _give(buf: np.ndarray) -> None:
    global _idle
    with _lock:
        if _idle is None or _idle.nbytes < buf.nbytes:
            _idle = buf


def release() -> None:
    """Free the idle key-tile buffer (the next CPU call allocates a new one)."""
    global _idle
    with _lock:
        _idle = None


def held_bytes() -> int:
    """Bytes held by the idle buffer (0 when none)."""
    with _lock:
        return 0 if _idle is None else int(_idle.nbytes)


@contextmanager
def key_tile_buffers(k: np.ndarray, v: np.ndarray, tiles: bool = True):
    """``(kt, v_ok)`` for one kernel call, filled by :mod:`attnnb.cpu._prologue`.

    ``kt``: ``(B, Hk, n_tiles, D, TILE_K)`` in ``k``'s dtype, C-contiguous and
    64-byte aligned, from the pool; ``v_ok``: ``(B, Hv, n_tiles)`` bool, new.
    ``k (B, Hk, Lk, D)``, ``v (B, Hv, Lk, Dv)``, ``n_tiles = ceil(Lk / TILE_K)``,
    or 0 when not ``tiles`` (a kernel that transposes its tiles itself).
    """
    B, Hk, Lk, D = k.shape
    if not tiles:  # nothing to hold: no pool, no alignment (a tenth of the cost)
        yield (np.empty((B, Hk, 0, D, TILE_K), k.dtype),
               np.empty((B, v.shape[1], 0), np.bool_))
        return
    n_kt = -(-Lk // TILE_K)
    shape = (B, Hk, n_kt, D, TILE_K)
    nbytes = math.prod(shape) * k.dtype.itemsize
    buf = _take(nbytes)
    start = -buf.ctypes.data % ALIGN
    kt = buf[start : start + nbytes].view(k.dtype).reshape(shape)
    try:
        yield kt, np.empty((B, v.shape[1], n_kt), np.bool_)
    finally:
        del kt
        _give(buf)

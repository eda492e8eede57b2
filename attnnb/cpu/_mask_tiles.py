"""A boolean mask's tile map: which 64 x 64 tiles it leaves empty, partial or full.

A mask given as an array (a padding mask, transformers' sliding-window and
document masks) usually masks whole tiles or allows whole tiles.  Its map,
``classes (MB, MH, NQ, NK)`` int8 of :data:`EMPTY`, :data:`PARTIAL` or
:data:`FULL` per (query tile of ``TILE_Q`` rows, key tile of ``TILE_K``
keys), lets the kernels skip the empty tiles (the dense forward and both
backward sweeps) and the per-element test in full ones (the dense forward).
Axes along which the mask is broadcast (stride 0) are classified once: a
``(B, 1, 1, Lk)`` padding mask has ``MH = NQ = 1``.  Built per call by a
parallel kernel that stops reading a tile once it has seen both values.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import inner, kernel, launch
from ._mod_hooks import MASK_FN, mod_allowed, no_mods
from ._tiles import TILE_K, TILE_Q

EMPTY, PARTIAL, FULL = 0, 1, 2


@inner
def task_tile(task, classes):
    """``(b, h, qt, kt, i0, j0)``: the tile that task ``task`` of a classifier classifies."""
    MB, MH, NQ, NK = classes.shape
    qt, kt = (task // NK) % NQ, task % NK
    return task // (MH * NQ * NK), (task // (NQ * NK)) % MH, qt, kt, qt * TILE_Q, kt * TILE_K


@inner
def allowed_at(mask, b, h, i, j, mods):
    """Whether ``(i, j)`` is allowed: by the mask function in its copies (``MASK_FN``),
    else by ``mask``."""
    if MASK_FN:
        origin = mods[0]
        return mod_allowed(b + origin[0], h + origin[1], i, j, mods)
    return mask[b, h, i, j]


@kernel
def classify_kernel(mask, Lq, Lk, mods, classes):
    """``classes[b, h, qt, kt]`` of the tiles of ``mask (MB, MH, Lq, Lk)``, or of the mask
    function (its copies: :mod:`attnnb.cpu._mods`, whose ``mask`` is a placeholder), one
    task per tile; a ``classes`` axis of length 1 (batch or head) stands for all,
    evaluated at index 0.  A row's allowed keys are counted, not branched on, so that
    the loop vectorises; the task stops at the first row that shows both values."""
    for task in prange(classes.size):
        b, h, qt, kt, i0, j0 = task_tile(task, classes)
        j1 = min(j0 + TILE_K, Lk)
        allowed = masked = False
        for i in range(i0, min(i0 + TILE_Q, Lq)):
            count = 0
            for j in range(j0, j1):
                count += allowed_at(mask, b, h, i, j, mods)
            allowed = allowed or count > 0
            masked = masked or count < j1 - j0
            if allowed and masked:
                break
        classes[b, h, qt, kt] = PARTIAL if allowed and masked else FULL if allowed else EMPTY


def combined_classes(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The tile map of two masks together: empty where either is, full where both are."""
    a, b = np.broadcast_arrays(first, second)
    return np.where((a == EMPTY) | (b == EMPTY), EMPTY,
                    np.where((a == FULL) & (b == FULL), FULL, PARTIAL)).astype(np.int8)


def unbroadcast(mask: np.ndarray) -> np.ndarray:
    """``mask (B, H, Lq, Lk)`` with each broadcast axis (stride 0) cut to length 1."""
    index = tuple(slice(0, 1) if n > 1 and s == 0 else slice(None)
                  for n, s in zip(mask.shape, mask.strides))
    return mask[index]


def mask_tile_classes(mask: np.ndarray) -> np.ndarray:
    """The tile map of a canonical ``(B, H, Lq, Lk)`` boolean mask view (module docstring)."""
    reduced = unbroadcast(mask)
    MB, MH, Lq, Lk = reduced.shape
    classes = np.empty((MB, MH, -(-Lq // TILE_Q), -(-Lk // TILE_K)), np.int8)
    if classes.size:
        launch(classify_kernel, reduced, Lq, Lk, no_mods(), classes)
    return classes


def no_tile_map() -> np.ndarray:
    """A placeholder map for kernels called without a mask (never read)."""
    return np.full((1, 1, 1, 1), PARTIAL, np.int8)


@inner
def tile_class(classes, b, h, qt_first, qt_last, kt):
    """The class of key tile ``kt`` for query tiles ``qt_first ..= qt_last`` of batch ``b``,
    head ``h``: EMPTY or FULL when all of them are, else PARTIAL (broadcast axes of the
    map read index 0)."""
    MB, MH, NQ, NK = classes.shape
    bb = b if MB > 1 else 0
    hh = h if MH > 1 else 0
    kk = kt if NK > 1 else 0
    if NQ == 1:
        return classes[bb, hh, 0, kk]
    first = classes[bb, hh, qt_first, kk]
    for qt in range(qt_first + 1, qt_last + 1):
        if classes[bb, hh, qt, kk] != first:
            return PARTIAL
    return first


def visible_tiles(classes: np.ndarray, n_qt: int, n_kt: int) -> np.ndarray:
    """Bool ``(n_qt, n_kt)``: the tiles that some batch element and head may attend."""
    return np.broadcast_to((classes != EMPTY).any(axis=(0, 1)), (n_qt, n_kt))

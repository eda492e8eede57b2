"""A block layout: which key tiles each query tile touches (the storage that
:mod:`attnnb.patterns` describes), read by the sparse kernels of every backend.

Here, and not in the public module, so that a backend needs no public module;
:mod:`attnnb.patterns` exports it as :class:`attnnb.patterns.BlockLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockLayout:
    """Which key tiles each query tile touches; see the module docstring."""

    tile_q: int
    tile_k: int
    n_qt: int
    n_kt: int
    tile_ptr: np.ndarray
    tile_idx: np.ndarray
    tile_full: np.ndarray

    @property
    def n_tiles(self) -> int:
        """Number of (query tile, key tile) blocks visited, over all heads."""
        return int(self.tile_idx.size)

    def by_key_tile(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The layout read by key tile: ``(col_ptr, col_qt, col_full)``.

        Key tile ``t`` of head ``h`` is seen by the query tiles
        ``col_qt[col_ptr[h * n_kt + t] : col_ptr[h * n_kt + t + 1]]``, in
        increasing order (``col_full`` as ``tile_full``): what a backward pass
        that owns a key tile's gradients sweeps.  O(tiles).
        """
        heads = (self.tile_ptr.size - 1) // max(self.n_qt, 1)
        tile_row = np.repeat(np.arange(self.tile_ptr.size - 1), np.diff(self.tile_ptr))
        column = tile_row // max(self.n_qt, 1) * self.n_kt + self.tile_idx
        order = np.lexsort((tile_row, column))
        col_ptr = np.zeros(heads * self.n_kt + 1, np.int64)
        np.cumsum(np.bincount(column, minlength=heads * self.n_kt), out=col_ptr[1:])
        return (col_ptr, (tile_row % max(self.n_qt, 1))[order].astype(np.int32),
                np.ascontiguousarray(self.tile_full[order]))

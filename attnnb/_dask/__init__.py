"""Dask arrays through the attention functions (docs/contract.md §7.2).

When ``q``, ``k`` or ``v`` is a ``dask.array.Array``, the public functions
hand their arguments to :mod:`attnnb._dask.ops`, which builds a lazy task
graph: one task per (query block, key block) that the allowed set touches,
each running the public function on NumPy (or CuPy) chunks, and a tree of
LSE merges over the key blocks.

This package's ``__init__`` never imports Dask: :func:`any_dask` only looks
for ``dask.array`` among the modules already imported (a Dask array cannot
exist without it), so ``import attnnb`` stays free of the optional extra.
"""

from __future__ import annotations

import sys


def any_dask(*arrays) -> bool:
    """True when one of ``arrays`` is a ``dask.array.Array``; never imports Dask."""
    dask_array = sys.modules.get("dask.array")
    if dask_array is None:
        return False
    return any(isinstance(x, dask_array.Array) for x in arrays)

"""The one place where the CPU backend's Numba compilation options live.

``FASTMATH`` deliberately leaves out ``nnan`` and ``ninf``: masked logits are
``-inf`` and NaN inputs must propagate, so the compiler may not assume either
away.  ``reassoc`` lets LLVM vectorise the row reductions (max, sum);
``contract`` allows FMAs.
"""

from __future__ import annotations

import numba

FASTMATH = {"contract", "reassoc", "nsz", "arcp"}


def kernel(fn=None, *, parallel=True):
    """``numba.njit`` for a top-level kernel: cached, parallel, project fastmath."""
    deco = numba.njit(parallel=parallel, cache=True, fastmath=FASTMATH, nogil=True)
    return deco(fn) if fn is not None else deco


def inner(fn):
    """``numba.njit`` for a shared inner loop called from kernels (inlined by LLVM)."""
    return numba.njit(cache=True, fastmath=FASTMATH, nogil=True)(fn)


_SERIAL_TWINS: dict = {}


def launch(kernel_fn, *args):
    """Run a parallel kernel, or its serial twin in a forked child (see _threading)."""
    from ._cache import track_sources
    from ._threading import in_forked_child, launch_lock

    track_sources()  # before anything compiles: see _cache
    if in_forked_child():
        twin = _SERIAL_TWINS.get(kernel_fn)
        if twin is None:
            twin = numba.njit(parallel=False, cache=False, fastmath=FASTMATH)(kernel_fn.py_func)
            _SERIAL_TWINS[kernel_fn] = twin
        return twin(*args)
    with launch_lock():
        return kernel_fn(*args)

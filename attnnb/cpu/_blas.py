"""Keep the BLAS that Numba's ``np.dot`` calls single-threaded while a parallel kernel runs.

Numba's ``np.dot`` calls SciPy's BLAS (``scipy.linalg.cython_blas``, an
OpenBLAS in the wheels).  OpenBLAS starts its own threads for products
larger than about ``m * n * k = 2**18``; called from every thread of a
``prange`` loop, those threads compete with Numba's for the same cores and
a tiled product ran 3-10x slower than with one BLAS thread per caller.
:func:`single_threaded_blas` sets that BLAS to one thread for the duration
of a call and restores the previous setting when the last concurrent caller
leaves.  Meanwhile other users of SciPy's BLAS in the process run
single-threaded too: slower, never wrong.  Where the library or its
``*_set_num_threads`` symbol is not found it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

_PREFIXES = ("scipy_openblas", "openblas")
_SUFFIXES = ("", "64_")
_lock = threading.Lock()
_state = {"active": 0, "saved": None}
_funcs: list | None = None


def _loaded_openblas_paths() -> list[str]:
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower()}
    except OSError:
        return []
    # SciPy's own copy first (NumPy's wheels ship another, 64-bit-integer one)
    scipy_first = sorted(paths, key=lambda p: "/scipy" not in p)
    return [p for p in scipy_first if p.startswith("/")]


def _find():
    """``(get, set)`` of SciPy's OpenBLAS, or None."""
    try:
        import scipy.linalg.cython_blas  # noqa: F401  (loads the library Numba uses)
    except Exception:  # pragma: no cover - scipy is a dependency
        return None
    libs = []
    for path in _loaded_openblas_paths():
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    # cython_blas uses 32-bit integers: an unsuffixed symbol is the right library
    for suffix in _SUFFIXES:
        for lib in libs:
            for prefix in _PREFIXES:
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype = ctypes.c_int
                    put.argtypes = [ctypes.c_int]
                    return get, put
    return None


@contextlib.contextmanager
def single_threaded_blas():
    """Context manager: SciPy's BLAS uses one thread inside, as before outside."""
    global _funcs
    with _lock:
        if _funcs is None:
            found = _find()
            _funcs = [found] if found else []
        if _funcs:
            get, put = _funcs[0]
            if _state["active"] == 0:
                _state["saved"] = get()
                put(1)
            _state["active"] += 1
    try:
        yield
    finally:
        if _funcs:
            with _lock:
                _state["active"] -= 1
                if _state["active"] == 0:
                    _funcs[0][1](_state["saved"])

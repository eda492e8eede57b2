"""Choose a Numba threading layer that survives both threads and ``fork``.

Numba's default here is GNU OpenMP, which kills a process forked after a
parallel call when the child runs a parallel region; ``workqueue`` aborts
on concurrent calls from Python threads.  Intel TBB handles both, so when
the ``tbb`` wheel is installed we load its shared library before Numba's
first parallel call (``pip install tbb`` puts ``libtbb.so.12`` in the
environment's ``lib/``, where Numba does not look), and Numba's default
priority (tbb, omp, workqueue) then picks it.

If TBB cannot be loaded, kernels called in a process forked after a
parallel call run their serial twins instead (:func:`in_forked_child`).
Where Numba ends up with ``workqueue`` (no TBB, no OpenMP), parallel calls
are serialised with a lock (:func:`launch_lock`), since that layer aborts
the process on concurrent launches.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from contextlib import nullcontext

_forked = False


def _load_tbb() -> bool:
    names = ["libtbb.so.12", "libtbb.so", "libtbb.12.dylib", "tbb12.dll"]
    dirs = [os.path.join(sys.prefix, "lib"), os.path.join(sys.prefix, "Library", "bin")]
    for d in dirs:
        for name in names:
            for path in glob.glob(os.path.join(d, name)):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    return True
                except OSError:
                    continue
    return False


TBB_PRELOADED = _load_tbb()


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def in_forked_child() -> bool:
    """True in a forked child whose threading layer may not survive the fork."""
    if not _forked:
        return False
    import numba

    layer = getattr(numba, "threading_layer", None)
    try:
        return layer() != "tbb" if layer else True
    except ValueError:  # no parallel region has run in this process yet
        return False


_LAUNCH_LOCK = threading.Lock()
_NO_LOCK = nullcontext()
_layer = None  # Numba's threading layer, once it has chosen one


def launch_lock():
    """A context manager serialising parallel launches where the layer needs it.

    Until the first parallel region has run, Numba has not chosen its layer,
    so launches are serialised; afterwards only under ``workqueue``.
    """
    global _layer
    if _layer is None:
        import numba

        try:
            _layer = numba.threading_layer()  # fixed once chosen: asked once
        except ValueError:  # no parallel region has run in this process yet
            return _LAUNCH_LOCK
    return _LAUNCH_LOCK if _layer == "workqueue" else _NO_LOCK

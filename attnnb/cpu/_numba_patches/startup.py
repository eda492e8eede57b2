"""Numba's first-use set-up without importing SciPy's linear algebra.

The first compile or cache load of any function makes Numba's CPU target
import its lowering modules (``CPUContext.load_additional_registries``).
One of them, ``numba.np.arraymath``, runs ``_check_blas()`` when imported:
``import scipy.linalg.cython_blas``, only to learn whether a BLAS is there,
and that imports all of ``scipy.linalg`` (a fifth of a first call's time:
docs/notes/performance.md, "Numba's internals behind one gate").  No kernel of this
package calls a BLAS function.

:func:`import_arraymath` imports that module first, with Numba's
``ensure_blas`` replaced for the duration of the import by a check that
SciPy can be found; SciPy is a dependency of attnnb, so Numba's
``_HAVE_BLAS`` comes out as it would.  ``ensure_blas`` is restored at once:
a function that does use BLAS still imports SciPy's when it is compiled,
and Numba's C helpers import ``scipy.linalg.cython_blas`` themselves when
such a function first runs.  Where the gate (:mod:`attnnb.cpu._numba_patches`)
is closed, the module was imported already, or Numba has moved these names,
nothing changes.
"""

from __future__ import annotations

import importlib.util
import sys

from . import ACTIVE


def _scipy_found() -> None:
    if importlib.util.find_spec("scipy") is None:
        raise ImportError("scipy is required for linear algebra")


def import_arraymath() -> bool:
    """Import ``numba.np.arraymath`` without ``scipy.linalg``; False when not done here."""
    if "numba.np.arraymath" in sys.modules:
        return False
    try:
        from numba.np import linalg

        ensure_blas = linalg.ensure_blas
    except (ImportError, AttributeError):  # pragma: no cover - another Numba layout
        return False
    linalg.ensure_blas = _scipy_found
    try:
        from numba.np import arraymath
    finally:
        linalg.ensure_blas = ensure_blas
    if getattr(arraymath, "ensure_blas", None) is _scipy_found:
        arraymath.ensure_blas = ensure_blas  # the name it imported, for any later use
    return True


if ACTIVE:
    import_arraymath()

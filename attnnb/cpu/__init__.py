"""The ``cpu`` backend: Numba ``njit(parallel=True, cache=True)`` kernels.

Importing this package loads Numba and selects the threading layer (see
:mod:`attnnb.cpu._threading`); nothing compiles until a kernel is called.
"""

from . import _threading  # noqa: F401  (must run before the first parallel call)

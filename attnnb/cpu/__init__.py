"""The ``cpu`` backend: Numba ``njit(parallel=True, cache=True)`` kernels.

Importing this package loads Numba, imports Numba's array lowering without
SciPy's linear algebra (see :mod:`attnnb.cpu._startup`) and selects the
threading layer (see :mod:`attnnb.cpu._threading`, before the first parallel
call); nothing compiles until a kernel is called.
"""

from . import _startup, _threading  # noqa: F401

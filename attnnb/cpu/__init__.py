"""The ``cpu`` backend: Numba ``njit(parallel=True, cache=True)`` kernels.

Importing this package loads Numba, imports Numba's array lowering without
SciPy's linear algebra (see :mod:`attnnb.cpu._numba_patches.startup`) and selects the
threading layer (see :mod:`attnnb.cpu._threading`, before the first parallel
call); nothing compiles until a kernel is called.  Every change to Numba's
internals is in :mod:`attnnb.cpu._numba_patches`, behind one version gate.
"""

from . import _threading  # noqa: F401
from ._numba_patches import startup  # noqa: F401

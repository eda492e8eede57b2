"""Self-check cases run by ``python -m attnnb check``.

Convention: every module ``attnnb/checks/<feature>.py`` defines::

    def cases() -> list[tuple[str, Callable[[str], object]]]:
        ...

a list of ``(name, run)`` pairs.  ``run(backend)`` computes on fixed,
seeded random data (small, awkward sizes; float32 and float64 inputs) with
the given backend name and returns a host NumPy array or a tuple of them.
The command discovers every module of this package with :mod:`pkgutil`,
runs each case on ``"reference"`` and on every other available backend,
and compares the results elementwise: NaN and infinities must sit in the
same places, and the largest absolute difference of the finite entries,
relative to the largest finite magnitude of the reference result, must
stay within a tolerance set by the result's dtype (:data:`TOLERANCE`).

A case whose function raises :class:`NotImplementedError` on a backend is
reported as skipped there; any other exception is a failure.  Modules are
imported only by the command, never by ``import attnnb``.
"""

from __future__ import annotations

import numpy as np

# Relative tolerance of a backend's result against the reference's, by dtype.
TOLERANCE = {
    np.dtype(np.float16): 5e-3,
    np.dtype(np.float32): 2e-5,
    np.dtype(np.float64): 1e-12,
}


def data(seed: int, *shapes, dtype=np.float64):
    """Standard-normal arrays of the given shapes from one seeded generator."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)

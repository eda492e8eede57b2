"""Self-check cases run by ``python -m attnnb check`` (engine: :mod:`attnnb.check`).

Convention: every module ``attnnb/checks/<feature>.py`` defines::

    def cases() -> list[tuple[str, Callable[[str], object]]]:
        ...

a list of ``(name, run)`` pairs.  ``run(backend)`` computes on fixed,
seeded random data (small, awkward sizes; float32 and float64 inputs) with
the given backend name and returns a host NumPy array or a tuple of them.
The engine discovers every module of this package with :mod:`pkgutil`
(modules whose name starts with ``_`` excepted), runs each case on
``"reference"`` and on every other available backend, and compares the
results elementwise: NaN and infinities must sit in the same places, and
the largest absolute difference of the finite entries, relative to the
largest finite magnitude of the reference result, must stay within the
tolerance of the result's dtype (:data:`attnnb.check.TOLERANCE`, the same
as the test suite's).

A case whose function raises :class:`NotImplementedError` on a backend is
reported as skipped there; any other exception is a failure.  Modules are
imported only by the command, never by ``import attnnb``.
"""

from __future__ import annotations

import numpy as np


def data(seed: int, *shapes, dtype=np.float64):
    """Standard-normal arrays of the given shapes from one seeded generator."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)

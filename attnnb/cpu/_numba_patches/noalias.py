"""A decorator option for Numba's internal ``noalias`` flag.

The register-blocked tile products (:mod:`attnnb.cpu._blocks`) keep a block
of accumulators in registers only when LLVM knows that the scratch they
accumulate into does not overlap the tiles they read; otherwise every step
stores and reloads them (docs/notes/performance.md, "Numba's internals behind one
gate").  Numba has an internal flag for it (``Flags.noalias``: every array
argument gets LLVM's ``noalias`` attribute) but no public option, so this
module registers a private decorator option, :data:`OPTION`, that maps to it.
Only functions compiled with that option get the flag, and it is valid only
because their callers never pass overlapping arrays.  Where the gate
(:mod:`attnnb.cpu._numba_patches`) is closed or the registration fails,
:data:`NOALIAS` is False and the products compile without it (correct,
slower).
"""

from __future__ import annotations

from . import ACTIVE

OPTION = "_attnnb_noalias"


def _enable_option() -> bool:
    try:
        from numba.core import cpu, options
        from numba.core.compiler import Flags

        if not hasattr(Flags, "noalias"):
            return False
        target = cpu.CPUTargetOptions
        if not isinstance(getattr(target, OPTION, None), options.TargetOptions.Mapping):
            setattr(target, OPTION, options.TargetOptions.Mapping("noalias"))
        return True
    except Exception:  # pragma: no cover - depends on Numba's internals
        return False


NOALIAS = ACTIVE and _enable_option()

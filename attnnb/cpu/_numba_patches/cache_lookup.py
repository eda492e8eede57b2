"""A kernel's cache lookup without the full refresh of Numba's CPU target.

Numba refreshes its CPU target before every cache lookup: it imports and
installs every lowering and typing registry and starts the runtime (NRT).
Machine code loaded from the cache needs only the runtime: the registries
serve compilation, and every compile refreshes the contexts itself
(``numba.core.compiler.CompilerBase``), so a process that loads all its
kernels never needs them.  The parallel runtime is started by the loaded
function's own ``reload_init``.  :func:`fast_lookup` gives a kernel's cache a
lookup that only starts the runtime (docs/notes/performance.md, "Numba's internals
behind one gate").

A specialisation not in the cache compiles in the calling process, as Numba
does.  Its loop bodies' stand-alone libraries are linked, never compiled
(:mod:`.linking`), so the compiling process runs the same machine code as a
process that loads the kernel (``tests/test_determinism.py``).
"""

from __future__ import annotations

from . import ACTIVE


def fast_lookup(dispatcher):
    """Give ``dispatcher``'s on-disk cache the lookup described above; returns it."""
    cache = getattr(dispatcher, "_cache", None)
    if not ACTIVE or cache is None or not hasattr(cache, "load_overload"):
        return dispatcher

    def load_overload(sig, target_context):
        return load_cached(cache, sig, target_context)

    cache.load_overload = load_overload
    return dispatcher


def load_cached(cache, sig, target_context):
    """Numba's ``cache.load_overload(sig, target_context)`` without the full refresh of
    the target context: ``None`` when the specialisation is not in the cache."""
    try:
        from numba.core.runtime import rtsys

        guard = cache._guard_against_spurious_io_errors
        load = cache._load_overload
    except (ImportError, AttributeError):  # pragma: no cover - another Numba layout
        return type(cache).load_overload(cache, sig, target_context)
    rtsys.initialize(target_context)
    with guard():
        return load(sig, target_context)
    return None  # the guard swallowed an I/O error: not cached, as in Numba's own

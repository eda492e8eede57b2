"""Hooks on every Numba compile and cache save, for ``warmup`` while it runs.

``python -m attnnb warmup`` times each kernel it compiles and has its worker
processes claim a kernel before compiling it, so that two workers never
compile one kernel (:mod:`attnnb.warmup`).  Numba has no public hook for
either, so :func:`wrap` routes ``Dispatcher.compile`` and
``Cache.save_overload`` through the caller's functions until the function it
returns restores them.  Where the gate (:mod:`attnnb.cpu._numba_patches`) is
closed, :func:`wrap` returns None and ``warmup`` runs its cases in one
process without timing the kernels.
"""

from __future__ import annotations

from . import ACTIVE


def wrap(on_compile, on_save):
    """Route Numba's compiles and cache saves through ``on_compile(compile, dispatcher,
    sig)`` and ``on_save(save, cache, sig, data)`` (each given Numba's own function to
    call); returns a function that restores Numba's, or None where the gate is closed."""
    if not ACTIVE:
        return None
    from numba.core.caching import Cache
    from numba.core.dispatcher import Dispatcher

    compile_, save = Dispatcher.compile, Cache.save_overload

    def compile(self, sig):
        return on_compile(compile_, self, sig)

    def save_overload(self, sig, data):
        return on_save(save, self, sig, data)

    Dispatcher.compile, Cache.save_overload = compile, save_overload

    def restore():
        Dispatcher.compile, Cache.save_overload = compile_, save

    return restore


def argument_types(sig) -> tuple:
    """The argument types of a signature as ``Dispatcher.compile`` receives it."""
    from numba.core import sigutils

    return tuple(sigutils.normalize_signature(sig)[0])


def cache_hits(dispatcher) -> int:
    """How many times ``dispatcher`` loaded a specialisation from the on-disk cache."""
    return sum(dispatcher._cache_hits.values())


def index_path(cache) -> str | None:
    """The index file of a dispatcher's on-disk cache, or None."""
    return getattr(getattr(cache, "_cache_file", None), "_index_path", None)

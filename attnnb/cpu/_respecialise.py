"""Copies of the kernels with a mask or score function compiled in.

A kernel reaches the hooks of :mod:`attnnb.cpu._mod_hooks` through the
global names of the shared loops it calls.  :func:`respecialise` copies a
kernel, and every shared loop on the way from it to a hook, as new Python
functions over the same code with those names bound to the mod's compiled
functions, and decorates each copy as its original was decorated
(:func:`attnnb.cpu._jit.kernel`, :func:`~attnnb.cpu._jit.inner`).  Functions
that reach no hook are shared, not copied.

Each copy's qualified name ends in the mod's fingerprint
(:func:`attnnb._mod_compile.fingerprint`: its functions' code, the constants
and helpers they read, and the composition), so Numba's on-disk cache keeps
it in files of its own, and a later process finds it there without
compiling: Numba's index key
holds the code and the signature, not the globals, so copies of one kernel
must differ by name.  Each copy gets the package-wide source stamp
(:mod:`attnnb.cpu._numba_patches.source_stamp`), so that an edit to the backend
recompiles them as it recompiles the originals.
"""

from __future__ import annotations

import dis
import threading
import types

from ._jit import REMAKE
from ._numba_patches.source_stamp import restamp

_copies: dict = {}
_lock = threading.Lock()


def global_names(code: types.CodeType) -> set:
    """The global names ``code`` and the code nested in it read."""
    names = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def respecialise(dispatcher, bindings: dict, tag: str):
    """``dispatcher`` with the global names in ``bindings`` bound to their values, in it
    and in the shared loops it calls; ``dispatcher`` itself when it reaches none.

    ``tag`` names the bindings (it must differ whenever they do): it ends the
    copies' qualified names and keys this process's memo.
    """
    with _lock:
        return _copy(dispatcher, bindings, tag)


def _copy(dispatcher, bindings: dict, tag: str):
    key = (dispatcher, tag)
    found = _copies.get(key)
    if found is not None:
        return found
    fn = dispatcher.py_func
    scope = fn.__globals__
    rebound = {}
    for name in global_names(fn.__code__):
        if name in bindings:
            rebound[name] = bindings[name]
            continue
        value = scope.get(name)
        if getattr(value, REMAKE, None) is not None:
            copied = _copy(value, bindings, tag)
            if copied is not value:
                rebound[name] = copied
    if not rebound:
        _copies[key] = dispatcher
        return dispatcher
    new_scope = dict(scope)
    new_scope.update(rebound)
    clone = types.FunctionType(fn.__code__, new_scope, fn.__name__, fn.__defaults__,
                               fn.__closure__)
    clone.__qualname__ = f"{fn.__qualname__}__{tag}"
    clone.__module__ = fn.__module__
    clone.__doc__ = fn.__doc__
    copied = getattr(dispatcher, REMAKE)(clone)
    restamp(copied)
    _copies[key] = copied
    return copied

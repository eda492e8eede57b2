"""Make Numba's on-disk cache notice an edit to any module of :mod:`attnnb.cpu`.

Numba stamps each cached function with the modification time and size of
*its own* source file only.  A kernel defined in ``attention.py`` compiles in
the shared loops of ``_tiles.py`` and ``_exp.py``, so after an edit to one of
those the next process would load the old kernel from disk (seen here: a
changed ``finish_rows`` ignored until ``attention.py`` was touched).  A fresh
install rewrites every file and is safe; a source checkout being worked on
is not.

:func:`track_sources` gives every cached dispatcher of this package one
stamp covering all of the package's modules, so any edit makes every entry
stale and it is recompiled (and saved again) on its next first call.  It
runs before each kernel launch and costs a length comparison when no module
was imported since.  It relies on Numba's cache internals
(``dispatcher._cache._cache_file._source_stamp``); where those are missing
it does nothing, and the cache behaves as Numba's own.
"""

from __future__ import annotations

import os
import sys

_PACKAGE = __name__.rpartition(".")[0]
_DIR = os.path.dirname(os.path.abspath(__file__))
_scanned: set[str] = set()
_modules_seen = -1
_stamp: tuple | None = None


# Backend-neutral modules whose code or constants the kernels compile in.
_NEUTRAL = ("_codes.py", "_selection.py")


def package_stamp() -> tuple:
    """``(name, mtime, size)`` of every module of this package and of the neutral
    modules the kernels compile in (:data:`_NEUTRAL`), sorted by name."""
    paths = [os.path.join(_DIR, name) for name in os.listdir(_DIR) if name.endswith(".py")]
    paths += [os.path.join(os.path.dirname(_DIR), name) for name in _NEUTRAL]
    stamp = []
    for path in sorted(paths, key=os.path.basename):
        st = os.stat(path)
        stamp.append((os.path.basename(path), st.st_mtime, st.st_size))
    return tuple(stamp)


def restamp(dispatcher) -> bool:
    """Give ``dispatcher``'s cache the package-wide stamp; False if it has no disk cache."""
    global _stamp
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if cache_file is None or not hasattr(cache_file, "_source_stamp"):
        return False
    if _stamp is None:
        _stamp = package_stamp()
    cache_file._source_stamp = _stamp
    return True


def track_sources() -> None:
    """Restamp the cached dispatchers of every module of this package imported so far."""
    global _modules_seen
    if len(sys.modules) == _modules_seen:
        return
    _modules_seen = len(sys.modules)
    for name, module in list(sys.modules.items()):
        if name in _scanned or module is None or not name.startswith(_PACKAGE + "."):
            continue
        _scanned.add(name)
        for obj in list(vars(module).values()):
            if hasattr(obj, "py_func") and hasattr(obj, "_cache"):
                restamp(obj)

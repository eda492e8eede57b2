"""Make Numba's on-disk cache notice an edit to any module of :mod:`attnnb.cpu`.

Numba stamps each cached function with *its own* source file only (its
modification time and size before Numba 0.68, a hash of its contents
since).  A kernel defined in ``attention.py`` compiles in the shared loops
of ``_tiles.py`` and ``_exp.py``, so after an edit to one of those the next
process would load the old kernel from disk (seen here: a changed
``finish_rows`` ignored until ``attention.py`` was touched).

:func:`track_sources` gives every cached dispatcher of this package one
stamp covering all of the package's modules: a SHA-256 of their names and
contents (:func:`package_stamp`).  Any edit makes every entry stale, and it
is recompiled (and saved again) on its next first call; a reinstall of the
same files, which gives them new modification times, keeps the cache.  The
stamp is computed once per process (about 20 small files).  It runs before
each kernel launch and costs a length comparison when no module was
imported since.  It relies on Numba's cache internals
(``dispatcher._cache._cache_file._source_stamp``); where the gate
(:mod:`attnnb.cpu._numba_patches`) is closed or those are missing it does
nothing, and the cache behaves as Numba's own.  The stamp is never one Numba
writes, so a cache written with the patches off is stale to a process with
them on, and the other way round.

Where the cache goes is Numba's choice, unchanged here: ``NUMBA_CACHE_DIR``
when set, else ``__pycache__`` next to the sources when that is writable,
else the user's cache directory (``$XDG_CACHE_HOME/numba``, by default
``~/.cache/numba`` on Linux), so a read-only installation still caches.
"""

from __future__ import annotations

import hashlib
import os
import sys

from . import ACTIVE

_PACKAGE = __name__.rpartition(".")[0].rpartition(".")[0]  # attnnb.cpu
_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FENCE_DIR = os.path.dirname(os.path.abspath(__file__))
_scanned: set[str] = set()
_modules_seen = -1
_stamp: tuple | None = None


# Backend-neutral code the kernels compile in: the shared numerics and the mods compiler
# (folders of the package), and the public module of the built-in mods.
_NEUTRAL_FOLDERS = ("_core", "_mods")
_NEUTRAL_FILES = ("mods.py",)


def package_sources() -> list[str]:
    """Paths of the modules the stamp covers: every module of :mod:`attnnb.cpu` and of
    this package, and the neutral code the kernels compile in (:data:`_NEUTRAL_FOLDERS`,
    :data:`_NEUTRAL_FILES`), sorted by path relative to ``attnnb``."""
    root = os.path.dirname(_DIR)
    folders = (_DIR, _FENCE_DIR) + tuple(os.path.join(root, f) for f in _NEUTRAL_FOLDERS)
    paths = [os.path.join(folder, name) for folder in folders
             for name in os.listdir(folder) if name.endswith(".py")]
    paths += [os.path.join(root, name) for name in _NEUTRAL_FILES]
    return sorted(paths, key=_relative)


def _relative(path: str) -> str:
    return os.path.relpath(path, os.path.dirname(_DIR))


def package_stamp() -> tuple:
    """``("sha256", hex digest)`` of the names and contents of :func:`package_sources`.

    Modification times play no part, so identical files (a reinstall, a
    copy) give the same stamp.
    """
    digest = hashlib.sha256()
    for path in package_sources():
        with open(path, "rb") as f:
            data = f.read()
        # name and length first, so that no two file sets hash the same bytes
        digest.update(f"{_relative(path)}\0{len(data)}\0".encode())
        digest.update(data)
    return ("sha256", digest.hexdigest())


def restamp(dispatcher) -> bool:
    """Give ``dispatcher``'s cache the package-wide stamp; False if it has no disk cache."""
    global _stamp
    if not ACTIVE:
        return False
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
    if not ACTIVE or len(sys.modules) == _modules_seen:
        return
    _modules_seen = len(sys.modules)
    for name, module in list(sys.modules.items()):
        if name in _scanned or module is None or not name.startswith(_PACKAGE + "."):
            continue
        _scanned.add(name)
        for obj in list(vars(module).values()):
            if hasattr(obj, "py_func") and hasattr(obj, "_cache"):
                restamp(obj)

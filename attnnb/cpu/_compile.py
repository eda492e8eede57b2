"""Compile a kernel's new specialisation in a fresh process, then load it from the cache.

Why no process runs a parallel kernel it compiled itself
    Numba compiles the body of each ``prange`` loop as a function of its own
    (a *gufunc*), optimises it, and links a copy of it into the kernel's
    module, where it is optimised a second time together with the kernel.
    Both copies carry one symbol name, and the JIT binds the kernel's call to
    the first definition it holds: the stand-alone gufunc in the process
    that compiled it, the kernel's own copy in a process that loaded the
    kernel from the on-disk cache (the same mechanism :func:`._jit.inner`
    removes for the shared loops by inlining them).  LLVM's optimisation is
    not idempotent, so the two are different machine code: measured on the
    AMD EPYC Zen 5 machines, float64 dense attention differed by 1-2 ulp in
    most causal and grouped-query shapes (float32 happened to agree).  The
    gufunc is called through the parallel runtime's function pointer, so it
    cannot be inlined.  Instead, the first call of a specialisation that is
    not in the cache compiles it in a child process (this interpreter, this
    environment, the same ``attnnb``), which saves it to the cache, and this
    process then loads it like every later process does.  Every process
    therefore runs the cached machine code, whoever compiled it.

Since :mod:`._linking`
    The loop body's stand-alone libraries are now linked as IR and never
    compiled, so a compiling process holds no copy of the body but the
    kernel's own, and runs what a loader runs (a float64 test of a kernel
    compiled in the calling process, ``tests/test_determinism.py``, passes on
    the Xeon type).  The child compile stays as a safeguard until that test
    has passed on the Zen 5 type, where the difference was seen.

Cost
    The child's start-up and imports, about 0.6 s (measured: ToMe's unmerge
    kernel, 1.24-1.34 s through a child against 0.65-0.73 s compiled here),
    on top of a compile of 1-20 s, once per specialisation and cache.  A specialisation already in
    the cache is loaded as before, without a child.

When the kernel compiles here after all
    Where the child cannot save to the cache (Numba has no writable cache
    directory, the dispatcher is not a module attribute the child can
    import) or fails, Numba compiles the specialisation in this process as
    usual; its float64 results may then differ by an ulp from a loaded copy
    (docs/contract.md §1.13).  Processes that compile and never keep the
    result, the ``warmup`` workers and tests that read a kernel's LLVM IR,
    set :data:`COMPILE_HERE` to ``"1"``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import warnings

COMPILE_HERE = "ATTNNB_COMPILE_HERE"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_failed: set = set()  # (kernel name, signature) a child could not compile
_compiled: set = set()  # (kernel name, signature) a child compiled

_CHILD = """\
import importlib, os, pickle, sys
sys.path.insert(0, sys.argv[1])
os.environ[{env!r}] = "1"
module = importlib.import_module(sys.argv[2])
from {cache_module} import track_sources
track_sources()
getattr(module, sys.argv[3]).compile(pickle.loads(bytes.fromhex(sys.argv[4])))
"""


def compile_in_child_first(dispatcher):
    """Give ``dispatcher`` (a top-level cached kernel) the compile path described above.

    Numba's ``Dispatcher.compile`` first asks the dispatcher's cache for the
    specialisation and compiles it only when the cache has none.  The cache
    lookup set here (an attribute of this dispatcher's cache object alone)
    has a child process compile it on such a miss and looks again, so that
    ``Dispatcher.compile`` and any wrapper of it (``warmup``'s) run as usual
    and find the child's work.  Returns ``dispatcher``.
    """
    cache = getattr(dispatcher, "_cache", None)
    if cache is None or not hasattr(cache, "load_overload"):  # pragma: no cover - Numba's internals
        return dispatcher

    def load_overload(sig, target_context):
        cres = load_cached(cache, sig, target_context)
        if cres is None and os.environ.get(COMPILE_HERE) != "1" and _compile_in_child(
                dispatcher, sig):
            cres = load_cached(cache, sig, target_context)
        return cres

    cache.load_overload = load_overload
    return dispatcher


def load_cached(cache, sig, target_context):
    """Numba's ``cache.load_overload(sig, target_context)`` without the full refresh of
    the target context: ``None`` when the specialisation is not in the cache.

    Numba refreshes its CPU target before every cache lookup: it imports and
    installs every lowering and typing registry (about 0.1 s, and 32,000 of
    the 105,000 objects that the interpreter's collector then walks again
    at exit, measured on the 2-core AMD type) and starts the runtime
    (NRT).  Machine code loaded from the cache needs only the runtime: the
    registries serve compilation, and every compile refreshes the contexts
    itself (``numba.core.compiler.CompilerBase``), so a process that loads
    all its kernels never pays for them.  The parallel runtime is started
    by the loaded function's own ``reload_init``.  Where Numba's internals
    differ, the full ``load_overload`` runs.
    """
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


def compiled_in_child(dispatcher, sig) -> bool:
    """Whether a child process of this one compiled ``sig`` of ``dispatcher``."""
    return (_name(dispatcher), str(sig)) in _compiled


def _name(dispatcher) -> str:
    return f"{dispatcher.py_func.__module__}.{dispatcher.py_func.__name__}"


def _compile_in_child(dispatcher, sig) -> bool:
    """Have a child process compile ``sig`` of ``dispatcher`` into the cache; True if it did."""
    module, name = dispatcher.py_func.__module__, dispatcher.py_func.__name__
    key = (_name(dispatcher), str(sig))
    if key in _failed:
        return False
    try:
        reachable = getattr(importlib.import_module(module), name, None) is dispatcher
    except ImportError:  # pragma: no cover - a kernel defined outside any module
        reachable = False
    if not reachable:
        return False
    # Numba's compile lock is held here, as for a compile in this process: threads
    # that reach the same specialisation wait for this child and then find it cached.
    script = _CHILD.format(env=COMPILE_HERE, cache_module=f"{__package__}._cache")
    done = subprocess.run(
        [sys.executable, "-c", script, _PACKAGE_ROOT, module, name, pickle.dumps(sig).hex()],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=dict(os.environ, **{COMPILE_HERE: "1"}), check=False)
    if done.returncode != 0:
        _failed.add(key)
        report = done.stderr.decode(errors="replace")
        if len(report) > 3000:  # Numba's innermost error comes first, the call chain last
            report = report[:1500] + "\n...\n" + report[-1500:]
        warnings.warn(f"attnnb: compiling {key[0]}{key[1]} in a child process failed, so it "
                      "compiles in this one (its float64 results may differ by an ulp from a "
                      f"cached copy): {report}", RuntimeWarning, stacklevel=2)
        return False
    _compiled.add(key)
    return True

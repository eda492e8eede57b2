"""Optimise and compile a parallel kernel's loop body once, inside the kernel's own library.

Where a kernel's compile time went
    Numba compiles the body of each ``prange`` loop as a function of its own
    (the *gufunc*), in a code library of its own, then builds two more
    libraries around it (the gufunc's array wrapper and the parallel
    launcher), each linking in the ones before it, and finally links all of
    them into the kernel's library.  Every library is optimised by LLVM's
    full module pipeline and compiled to machine code when it is finalised,
    so the loop body, which holds every inlined tile loop, was optimised four
    times and turned into machine code four times.  Only the copy inside the
    kernel's library ever runs from the on-disk cache.  Measured on the
    2-core Xeon (model 167): the first compile of the float32 dense kernel
    spent 4.3 s of its 15.2 s in those four libraries, and ``python -m attnnb
    warmup`` on an empty cache took 109 s.

What this module changes
    While an attnnb kernel compiles (:func:`link_parfors_once` marks its
    dispatcher), the libraries Numba creates for its parallel loops are
    *link-only*: their functions get the function-level passes that every
    module gets when it is added, and they are linked into the next library
    as IR, but they are not optimised as a whole and never reach the JIT
    engine.  The kernel's library links them all and is optimised and
    compiled once, as before.  Measured: the dense float32 kernel's first
    compile 15.2 -> 11.3 s, ``warmup`` 109 -> 59 s; its outputs are
    bit-identical to before at D = 16, 40, 64 and 160 and its speed the same
    (the machine code has the same FMAs, and a few instructions fewer).
    Libraries created outside an attnnb kernel's compile (a user's own
    ``guvectorize``, whose wrapper is cached and must be compiled) are not
    touched.

Environments
    After compiling a function Numba points its environment global (the
    ``Env`` object that error paths use) at the function's ``Env``.  For a
    link-only library that global is defined only once the kernel's library
    is in the engine, so the assignment waits until then (Numba itself
    would write through a null address).

These are Numba internals (``CPUCodeLibrary`` and the CPU codegen of Numba
0.68); where they are missing, nothing is patched and kernels compile as
Numba does by default, more slowly but with the same results.
"""

from __future__ import annotations

import threading

_PARFOR_LIBRARIES = (
    "__numba_parfor_gufunc_",  # the loop body (its function's qualname)
    "<numba.np.ufunc.wrappers._GufuncWrapper",  # the array wrapper (its str())
    "parallelgufuncwrapper",  # the launcher
)
_MARK = "_attnnb_link_parfors"  # attribute set on a kernel's dispatcher
_LINK_ONLY = "_attnnb_link_only"  # attribute set on a link-only library

_state = threading.local()  # depth: attnnb kernel compiles running on this thread
_pending_envs: dict = {}  # environment global name -> Env, set once a library defines it


def _in_kernel_compile() -> bool:
    return getattr(_state, "depth", 0) > 0


def _install() -> bool:
    try:
        from numba.core import codegen, event
    except ImportError:  # pragma: no cover - depends on Numba's internals
        return False
    library_class = getattr(codegen, "JITCodeLibrary", None)
    codegen_class = getattr(codegen, "JITCPUCodegen", None)
    needed = ("_optimize_final_module", "_finalize_final_module", "_finalize_dynamic_globals")
    if (library_class is None or codegen_class is None
            or not all(hasattr(library_class, name) for name in needed)
            or not hasattr(codegen_class, "create_library")
            or not hasattr(codegen_class, "set_env")):  # pragma: no cover
        return False
    if getattr(library_class, "_attnnb_patched", False):
        return True

    create_library = codegen_class.create_library
    optimize_final_module = library_class._optimize_final_module
    finalize_final_module = library_class._finalize_final_module
    set_env = codegen_class.set_env

    def create(self, name, **kwargs):
        library = create_library(self, name, **kwargs)
        if _in_kernel_compile() and str(name).startswith(_PARFOR_LIBRARIES):
            setattr(library, _LINK_ONLY, True)
        return library

    def optimize(self):
        if not getattr(self, _LINK_ONLY, False):
            optimize_final_module(self)

    def finalize(self):
        if getattr(self, _LINK_ONLY, False):
            self._finalize_dynamic_globals()
            self._finalized = True
            return
        finalize_final_module(self)
        if _pending_envs:
            engine = self._codegen._engine
            for name in [n for n in _pending_envs if engine.get_global_value_address(n)]:
                set_env(self._codegen, name, _pending_envs.pop(name))

    def set_environment(self, env_name, env):
        if self._engine.get_global_value_address(env_name) == 0:
            _pending_envs[env_name] = env  # kept alive here until it is set
            return
        set_env(self, env_name, env)

    codegen_class.create_library = create
    codegen_class.set_env = set_environment
    library_class._optimize_final_module = optimize
    library_class._finalize_final_module = finalize
    library_class._attnnb_patched = True

    class _KernelCompiles(event.Listener):
        """Counts the attnnb kernel compiles running on this thread."""

        def on_start(self, ev):
            if getattr(ev.data.get("dispatcher"), _MARK, False):
                _state.depth = getattr(_state, "depth", 0) + 1

        def on_end(self, ev):
            if getattr(ev.data.get("dispatcher"), _MARK, False):
                _state.depth -= 1

    event.register("numba:compile", _KernelCompiles())
    return True


ENABLED = _install()


def link_parfors_once(dispatcher):
    """Have ``dispatcher`` (a parallel kernel) compile its loop bodies as described above.

    Returns ``dispatcher``.
    """
    if ENABLED:
        setattr(dispatcher, _MARK, True)
    return dispatcher

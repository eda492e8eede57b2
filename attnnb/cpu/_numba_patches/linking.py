"""Machine code only where it runs: a kernel's loop bodies and shared loops are linked as IR.

Where a kernel's compile time went
    Numba compiles the body of each ``prange`` loop as a function of its own
    (the *gufunc*), in a code library of its own, then builds two more
    libraries around it (the gufunc's array wrapper and the parallel
    launcher), each linking in the ones before it, and finally links all of
    them into the kernel's library.  Every library is optimised by LLVM's
    full module pipeline and compiled to machine code when it is finalised,
    so the loop body, which holds every inlined tile loop, was optimised four
    times and turned into machine code four times.  The shared loops
    (:func:`.._jit.inner`, :func:`.._jit.blocks`) are compiled stand-alone too,
    each a library of its own, and their machine code never runs: kernels
    inline them.  Only the kernel's own library runs from the on-disk cache.
    (Figures: docs/notes/performance.md, "Compile time: each loop body optimised once".)

What this module changes
    * While an attnnb kernel compiles (:func:`link_parfors_once` marks its
      dispatcher), the libraries Numba creates for its parallel loops are
      linked as IR only: their functions get the function-level passes that
      every module gets when it is added, but they are not optimised as a
      whole and never reach the JIT engine.  The kernel's library links them
      all and is optimised and compiled once, as before.
    * A shared loop's library (:func:`link_only` marks its dispatcher) is
      link-only as well: it is never compiled to machine code, and it is
      cached as IR (a cache entry of kind ``"attnnb-ir"``) instead of as
      machine code plus IR.  Its functions get the function-level passes;
      the library is optimised as a whole on its own only for the
      register-blocked products (:func:`.._jit.blocks`), whose speed depends on
      it.  Kernels inline every shared loop, and the kernel's module pipeline
      optimises the inlined body with the kernel's constants, so for the other
      loops a separate optimisation would be work done twice.  Such a function
      cannot be called from Python: its entry point raises
      ``TypeError`` (tests call shared loops through a small ``numba.njit``
      caller).
    Kernels link the same IR as without this module, so their outputs are the
    same bits (``tests/test_determinism.py``) and their speed the same
    (docs/notes/performance.md, "Shared loops optimised once").  Libraries created
    outside these (a user's own ``guvectorize``, whose wrapper is cached and
    must be compiled; any other Numba function) are not touched.

A kernel's cache entry
    Numba caches a library as its machine code plus the bitcode of its
    whole linked module (for libraries that others link in), and a load
    parses that bitcode only to learn which symbols the module defines.  No
    library links a kernel's own, so a kernel's library
    (marked while :func:`link_parfors_once`'s dispatcher compiles) is cached
    as its machine code and the names of the symbols it defines (a cache
    entry of kind ``"attnnb-object"``), loaded as Numba loads machine code,
    the engine told the names: half the size, and a faster first call
    (docs/notes/performance.md, "First calls without parsing the kernels' IR").

Environments
    After compiling a function Numba points its environment global (the
    ``Env`` object that error paths use) at the function's ``Env``.  For a
    library that never reaches the engine that global is defined only once
    a kernel's library that links it is there, so the assignment waits until
    then (Numba itself would write through a null address).

These are Numba internals (``CPUCodeLibrary`` and the CPU codegen of Numba
0.68).  Where the gate (:mod:`attnnb.cpu._numba_patches`) is closed or they are
missing, nothing is patched and kernels compile as Numba does by default, more
slowly but with the same results.
"""

from __future__ import annotations

import threading

from . import ACTIVE

_PARFOR_LIBRARIES = (
    "__numba_parfor_gufunc_",  # the loop body (its function's qualname)
    "<numba.np.ufunc.wrappers._GufuncWrapper",  # the array wrapper (its str())
    "parallelgufuncwrapper",  # the launcher
)
_KERNEL_MARK = "_attnnb_link_parfors"  # on a kernel's dispatcher
_SHARED_MARK = "_attnnb_shared_loop"  # on a shared loop's dispatcher
_OPTIMISE_ALONE = "_attnnb_optimise_alone"  # on one whose library is also optimised alone
_LINK_ONLY = "_attnnb_link_only"  # on a library: never compiled to machine code
_UNOPTIMISED = "_attnnb_unoptimised"  # on a library: not optimised as a whole
_IR_KIND = "attnnb-ir"  # the cache format of a link-only library: its IR
_KERNEL_LIBRARY = "_attnnb_kernel_library"  # on a library: a kernel's own, never linked
_OBJECT_KIND = "attnnb-object"  # its cache format: machine code and defined symbol names

_state = threading.local()  # .stack: the dispatchers compiling on this thread, innermost last
_pending_envs: dict = {}  # environment global name -> Env, set once a library defines it
_not_callable: list = []  # [library, address] of the entry point of link-only functions

NOT_CALLABLE_MESSAGE = (
    "this attnnb cpu function is compiled only to be inlined into kernels and has no "
    "machine code of its own; call it from a numba.njit function")


def _compiling() -> list:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def _mark_new_library(library, name: str) -> None:
    stack = _compiling()
    if not stack:
        return
    if name.startswith(_PARFOR_LIBRARIES) and any(getattr(d, _KERNEL_MARK, False)
                                                  for d in stack):
        setattr(library, _LINK_ONLY, True)
        setattr(library, _UNOPTIMISED, True)
        return
    innermost = stack[-1]
    own = name == getattr(getattr(innermost, "py_func", None), "__qualname__", None)
    if getattr(innermost, _KERNEL_MARK, False) and own:
        setattr(library, _KERNEL_LIBRARY, True)
        return
    if getattr(innermost, _SHARED_MARK, False) and own:
        setattr(library, _LINK_ONLY, True)
        if not getattr(innermost, _OPTIMISE_ALONE, False):
            # only kernels run this IR, and each kernel's module is optimised as a whole
            setattr(library, _UNOPTIMISED, True)


def _not_callable_address(codegen) -> int:
    """The address of a CPython entry point that raises ``TypeError``, compiled once."""
    if not _not_callable:
        from numba.core.compiler_lock import global_compiler_lock

        with global_compiler_lock:
            _not_callable[:] = _build_not_callable(codegen)
    return _not_callable[1]


def _build_not_callable(codegen) -> list:
    """``[library, address]`` of a function ``PyObject *f(self, args, kws)`` that sets
    ``TypeError(NOT_CALLABLE_MESSAGE)`` and returns NULL, as a CPython wrapper does."""
    from llvmlite import ir

    library = codegen.create_library("attnnb_not_callable")
    module = library.create_ir_module("attnnb_not_callable")
    ptr = ir.IntType(8).as_pointer()
    fn = ir.Function(module, ir.FunctionType(ptr, [ptr, ptr, ptr]), "attnnb_not_callable")
    set_string = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, ptr]),
                             "PyErr_SetString")
    # Numba maps the symbol PyExc_TypeError to the exception object itself
    # (numba.core.base), so the symbol's address is the PyObject *
    type_error = ir.GlobalVariable(module, ir.IntType(8), "PyExc_TypeError")
    text = bytearray(NOT_CALLABLE_MESSAGE.encode() + b"\0")
    message = ir.GlobalVariable(module, ir.ArrayType(ir.IntType(8), len(text)),
                                "attnnb_not_callable_message")
    message.initializer = ir.Constant(message.type.pointee, text)
    message.global_constant = True
    builder = ir.IRBuilder(fn.append_basic_block())
    builder.call(set_string, [type_error, builder.bitcast(message, ptr)])
    builder.ret(ir.Constant(ptr, None))
    library.add_ir_module(module)
    library.finalize()
    return [library, library.get_pointer_to_function(fn.name)]


def _install() -> bool:
    try:
        from llvmlite import binding as ll
        from numba.core import codegen, event
    except ImportError:  # pragma: no cover - depends on Numba's internals
        return False
    library_class = getattr(codegen, "JITCodeLibrary", None)
    codegen_class = getattr(codegen, "JITCPUCodegen", None)
    needed = ("_optimize_final_module", "_finalize_final_module", "_finalize_dynamic_globals",
              "_get_module_for_linking", "get_pointer_to_function",
              "serialize_using_object_code", "_unserialize", "enable_object_caching",
              "_set_compiled_object", "_get_compiled_object")
    engine_class = getattr(codegen, "JitEngine", None)  # its _defined_symbols: set per load
    if (library_class is None or codegen_class is None
            or not all(hasattr(library_class, name) for name in needed)
            or not hasattr(engine_class, "is_symbol_defined")
            or not hasattr(codegen_class, "create_library")
            or not hasattr(codegen_class, "set_env")):  # pragma: no cover
        return False
    if getattr(library_class, "_attnnb_patched", False):
        return True

    create_library = codegen_class.create_library
    set_env = codegen_class.set_env
    optimize_final_module = library_class._optimize_final_module
    finalize_final_module = library_class._finalize_final_module
    get_pointer = library_class.get_pointer_to_function
    serialize = library_class.serialize_using_object_code
    unserialize = library_class._unserialize.__func__

    def create(self, name, **kwargs):
        library = create_library(self, name, **kwargs)
        _mark_new_library(library, str(name))
        return library

    def optimize(self):
        if not getattr(self, _UNOPTIMISED, False):
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

    def pointer(self, name):
        if getattr(self, _LINK_ONLY, False):
            self._ensure_finalized()
            return _not_callable_address(self._codegen)
        return get_pointer(self, name)

    def serialize_ir(self):
        if getattr(self, _LINK_ONLY, False):
            return (self.name, _IR_KIND, self._get_module_for_linking().as_bitcode())
        if getattr(self, _KERNEL_LIBRARY, False):
            shared = self._get_module_for_linking()
            names = sorted({gv.name for values in (shared.functions, shared.global_variables)
                            for gv in values if not gv.is_declaration})
            return (self.name, _OBJECT_KIND, (self._get_compiled_object(), names))
        return serialize(self)

    def unserialize_ir(cls, codegen_, state):
        name, kind, data = state
        if kind == _OBJECT_KIND:
            object_code, names = data
            library = codegen_.create_library(name)
            library.enable_object_caching()
            library._set_compiled_object(object_code)
            library._finalize_final_module()  # the engine takes the machine code
            codegen_._engine._defined_symbols |= set(names)
            return library
        if kind != _IR_KIND:
            return unserialize(cls, codegen_, state)
        library = codegen_.create_library(name)
        setattr(library, _LINK_ONLY, True)
        library._final_module = library._shared_module = ll.parse_bitcode(data)
        library._finalize_dynamic_globals()
        library._finalized = True
        return library

    def set_environment(self, env_name, env):
        if self._engine.get_global_value_address(env_name) == 0:
            _pending_envs[env_name] = env  # kept alive here until it is set
            return
        set_env(self, env_name, env)

    codegen_class.create_library = create
    codegen_class.set_env = set_environment
    library_class._optimize_final_module = optimize
    library_class._finalize_final_module = finalize
    library_class.get_pointer_to_function = pointer
    library_class.serialize_using_object_code = serialize_ir
    library_class._unserialize = classmethod(unserialize_ir)
    library_class._attnnb_patched = True

    class _Compiles(event.Listener):
        """The dispatchers compiling on this thread."""

        def on_start(self, ev):
            _compiling().append(ev.data.get("dispatcher"))

        def on_end(self, ev):
            _compiling().pop()

    event.register("numba:compile", _Compiles())
    return True


ENABLED = ACTIVE and _install()


def link_parfors_once(dispatcher):
    """Have ``dispatcher`` (a parallel kernel) compile its loop bodies as described above.

    Returns ``dispatcher``.
    """
    if ENABLED:
        setattr(dispatcher, _KERNEL_MARK, True)
    return dispatcher


def link_only(dispatcher, *, optimise_alone: bool = False):
    """Make ``dispatcher`` (a shared loop, always inlined) link-only, as described above.

    ``optimise_alone``: its library is also optimised as a whole on its own
    before kernels link it (the register-blocked products: see the module
    notes).  Returns ``dispatcher``.
    """
    if ENABLED:
        setattr(dispatcher, _SHARED_MARK, True)
        setattr(dispatcher, _OPTIMISE_ALONE, optimise_alone)
    return dispatcher

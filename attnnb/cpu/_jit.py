"""The one place where the CPU backend's Numba compilation options live.

``FASTMATH`` deliberately leaves out ``nnan`` and ``ninf``: masked logits are
``-inf`` and NaN inputs must propagate, so the compiler may not assume either
away.  ``reassoc`` lets LLVM vectorise the row reductions (max, sum);
``contract`` allows FMAs.

``NOALIAS``: the register-blocked tile products (:mod:`attnnb.cpu._blocks`)
keep a 4 x 64 block of accumulators in registers only when LLVM knows that
the scratch they accumulate into does not overlap the tiles they read;
otherwise every step stores and reloads them (measured: 0.42x the speed).
Numba has an internal ``noalias`` compiler flag (``Flags.noalias``: every
array argument gets LLVM's ``noalias`` attribute) but no public option for
it, so :func:`_enable_noalias_option` registers a private decorator option
``_attnnb_noalias`` that maps to it.  This touches no other function: only
functions compiled with that option get the flag.  Where the registration
fails (a Numba that renamed its internals), :data:`NOALIAS` is False and
:func:`blocks` compiles the same, still correct, functions without it.
The flag is only valid because the callers never pass overlapping arrays.
"""

from __future__ import annotations

import numba
from numba import types
from numba.extending import intrinsic

from ._cache import track_sources
from ._compile import compile_in_child_first
from ._linking import link_only, link_parfors_once
from ._threading import in_forked_child, launch_lock

FASTMATH = {"contract", "reassoc", "nsz", "arcp"}

# the attribute that keeps the decorator a kernel or shared loop was made with, so
# that attnnb.cpu._respecialise can make a copy of it the same way
REMAKE = "_attnnb_remake"


def _remade_by(dispatcher, remake):
    setattr(dispatcher, REMAKE, remake)
    return dispatcher


def _targets_avx512() -> bool:
    """Whether kernels compile for AVX-512 (the CPU Numba targets, or this host's)."""
    import llvmlite.binding as llvm

    features = numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return "+avx512f" in features


# 32 vector registers of 512 bits (AVX-512) rather than AVX2's 16 of 256 bits:
# how wide a register block may be (attnnb.cpu._blocks.PASS_COLS)
WIDE_REGISTERS = _targets_avx512()

_NOALIAS_OPTION = "_attnnb_noalias"


def _enable_noalias_option() -> bool:
    try:
        from numba.core import cpu, options
        from numba.core.compiler import Flags

        if not hasattr(Flags, "noalias"):
            return False
        target = cpu.CPUTargetOptions
        if not isinstance(getattr(target, _NOALIAS_OPTION, None), options.TargetOptions.Mapping):
            setattr(target, _NOALIAS_OPTION, options.TargetOptions.Mapping("noalias"))
        return True
    except Exception:  # pragma: no cover - depends on Numba's internals
        return False


NOALIAS = _enable_noalias_option()


def kernel(fn=None, *, parallel=True):
    """``numba.njit`` for a top-level kernel: cached, parallel, project fastmath.

    A parallel kernel's new specialisations compile in a child process and
    load from the cache (:mod:`._compile` says why), and its loop bodies are
    optimised and compiled once, inside its own library (:mod:`._linking`).
    """
    deco = numba.njit(parallel=parallel, cache=True, fastmath=FASTMATH, nogil=True)

    def make(fn):
        dispatcher = deco(fn)
        if parallel:
            dispatcher = compile_in_child_first(link_parfors_once(dispatcher))
        return _remade_by(dispatcher, make)

    return make(fn) if fn is not None else make


def inner(fn):
    """``numba.njit`` for a shared inner loop called from kernels, always inlined.

    ``forceinline`` (LLVM's ``alwaysinline``; its callees inherit it) is what
    makes results reproducible across processes.  A call that is not inlined
    goes through the callee's symbol, and Numba links a copy of the callee
    into every kernel under that same name.  The JIT binds the call to the
    first definition it holds: the callee's stand-alone code in a process
    that compiled the callee first, the kernel's own copy in a process that
    loaded the kernel from the cache.  The two are different machine code
    (optimised in different modules), and results differed by an ulp in
    ~30 % of the elements.  Inlined, a kernel's code depends on its IR alone.
    Measured cost: no change in speed; cold compiles ~10 % longer (dense,
    sparse), more where a loop is called from several places (the
    differential kernel, which is why it calls each shared loop once).

    Being only inlined, a shared loop is linked into kernels as IR and never
    compiled to machine code of its own (:func:`._linking.link_only`: 5 % of
    a cold ``warmup``), so it cannot be called from Python (``TypeError``);
    tests call it through a ``numba.njit`` caller.
    """
    deco = numba.njit(cache=True, fastmath=FASTMATH, nogil=True, forceinline=True)
    return _remade_by(link_only(deco(fn)), inner)


def blocks(fn=None, *, noalias=None):
    """``numba.njit`` for a register-blocked tile product: like :func:`inner` (always
    inlined), plus the ``noalias`` flag when available (``noalias=False`` forces it
    off, which tests use to check that the flag takes effect and the result is the same).
    Not callable from Python either.  Unlike the other shared loops, its library is also
    optimised on its own before kernels inline it (:mod:`._linking`: measured faster).
    """
    use = NOALIAS if noalias is None else (noalias and NOALIAS)
    opts = dict(cache=True, fastmath=FASTMATH, nogil=True, forceinline=True)
    if use:
        opts[_NOALIAS_OPTION] = True
    deco = numba.njit(**opts)

    def make(fn):
        return _remade_by(link_only(deco(fn), optimise_alone=True), make)

    return make(fn) if fn is not None else make


_WIDE_ATTRIBUTES = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM use 512-bit vectors in the function that calls this (a no-op).

    LLVM's tuning for many AVX-512 Intel cores prefers 256-bit vectors, which
    halves the width of the register-blocked loops and leaves a 4 x 64 float32
    block too large for the register file.  The two string attributes set here
    apply to the calling function only (and, through LLVM's inliner, to
    functions it is inlined into); on CPUs without AVX-512 they change nothing.
    """

    def codegen(context, builder, signature, args):
        attrs = builder.function.attributes
        for attr in _WIDE_ATTRIBUTES:
            if attr not in attrs:
                set.add(attrs, attr)  # llvmlite's add() accepts only keyword attributes
        return context.get_dummy_value()

    return types.none(), codegen


_SERIAL_TWINS: dict = {}


def launch(kernel_fn, *args):
    """Run a parallel kernel, or its serial twin in a forked child (see _threading)."""
    track_sources()  # before anything compiles: see _cache
    if in_forked_child():
        twin = _SERIAL_TWINS.get(kernel_fn)
        if twin is None:
            twin = numba.njit(parallel=False, cache=False, fastmath=FASTMATH)(kernel_fn.py_func)
            _SERIAL_TWINS[kernel_fn] = twin
        return twin(*args)
    with launch_lock():
        return kernel_fn(*args)

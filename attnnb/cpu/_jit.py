"""The one place where the CPU backend's Numba compilation options live.

``FASTMATH`` deliberately leaves out ``nnan`` and ``ninf``: masked logits are
``-inf`` and NaN inputs must propagate, so the compiler may not assume either
away.  ``reassoc`` lets LLVM vectorise the row reductions (max, sum);
``contract`` allows FMAs.

``NOALIAS``: the register-blocked tile products get Numba's internal
``noalias`` flag where the Numba patches allow it
(:mod:`attnnb.cpu._numba_patches.noalias`); their callers never pass
overlapping arrays.
"""

from __future__ import annotations

import sys
import threading

import numba

from .._core.specialise import template
from ._numba_patches.cache_lookup import fast_lookup
from ._numba_patches.linking import link_only, link_parfors_once
from ._numba_patches.noalias import NOALIAS, OPTION
from ._numba_patches.source_stamp import restamp, track_sources
from ._numba_patches.vector_width import wide_vectors  # noqa: F401 - the kernels' import
from ._threading import in_forked_child, launch_lock

FASTMATH = {"contract", "reassoc", "nsz", "arcp"}


def _remade_by(dispatcher, make):
    """``dispatcher`` as a template of :func:`attnnb._core.specialise.specialise`: its copies
    are made by ``make``, the decorator that made it, and get the package's source stamp
    (so that an edit to the backend recompiles them as it recompiles the originals)."""

    def remake(fn):
        copied = make(fn)
        restamp(copied)
        return copied

    return template(dispatcher, remake)


def _targets_avx512() -> bool:
    """Whether kernels compile for AVX-512 (the CPU Numba targets, or this host's)."""
    import llvmlite.binding as llvm

    features = numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return "+avx512f" in features


# 32 vector registers of 512 bits (AVX-512) rather than AVX2's 16 of 256 bits:
# how wide a register block may be (attnnb.cpu._blocks.PASS_COLS)
WIDE_REGISTERS = _targets_avx512()


def kernel(fn=None, *, parallel=True):
    """``numba.njit`` for a top-level kernel: cached, parallel, project fastmath.

    Its loop bodies are optimised and compiled once, inside its own library,
    and it is looked up in the on-disk cache without Numba's full refresh
    (:mod:`._numba_patches.linking`, :mod:`._numba_patches.cache_lookup`).
    """
    deco = numba.njit(parallel=parallel, cache=True, fastmath=FASTMATH, nogil=True)

    def make(fn):
        dispatcher = deco(fn)
        if parallel:
            dispatcher = fast_lookup(link_parfors_once(dispatcher))
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
    (optimised in different modules), and results differed by an ulp.
    Inlined, a kernel's code depends on its IR alone, at no cost in speed
    and some in compile time, which is why the differential kernel calls each
    shared loop once (docs/notes/performance.md, "Compile time and the first call").

    Being only inlined, a shared loop is linked into kernels as IR and never
    compiled to machine code of its own (:func:`._numba_patches.linking.link_only`),
    so with the Numba patches on it cannot be called from Python
    (``TypeError``); tests call it through a ``numba.njit`` caller.
    """
    deco = numba.njit(cache=True, fastmath=FASTMATH, nogil=True, forceinline=True)
    return _remade_by(link_only(deco(fn)), inner)


def blocks(fn=None, *, noalias=None):
    """``numba.njit`` for a register-blocked tile product: like :func:`inner` (always
    inlined), plus the ``noalias`` flag when available (``noalias=False`` forces it
    off, which tests use to check that the flag takes effect and the result is the same).
    Not callable from Python either.  Unlike the other shared loops, its library is also
    optimised on its own before kernels inline it (:mod:`._numba_patches.linking`).
    """
    use = NOALIAS if noalias is None else (noalias and NOALIAS)
    opts = dict(cache=True, fastmath=FASTMATH, nogil=True, forceinline=True)
    if use:
        opts[OPTION] = True
    deco = numba.njit(**opts)

    def make(fn):
        return _remade_by(link_only(deco(fn), optimise_alone=True), make)

    return make(fn) if fn is not None else make


_SERIAL_TWINS: dict = {}


def launch(kernel_fn, *args):
    """Run a parallel kernel, or its serial twin in a forked child (see _threading)."""
    track_sources()  # before anything compiles: see _numba_patches.source_stamp
    if in_forked_child():
        twin = _SERIAL_TWINS.get(kernel_fn)
        if twin is None:
            twin = numba.njit(parallel=False, cache=False, fastmath=FASTMATH)(kernel_fn.py_func)
            _SERIAL_TWINS[kernel_fn] = twin
        return twin(*args)
    with launch_lock(), _compile_notice(kernel_fn):
        return kernel_fn(*args)


# A first call that waits this long on compiling a mask or score function's kernels says
# so on stderr, once per function, as `warmup` shows its progress.
NOTICE_AFTER_S = 2.0
_noticed: set = set()


class _compile_notice:
    """Around a launch of a kernel copy with mods (:func:`attnnb._core.specialise.specialise`)
    that has no compiled code in this process yet: a line on stderr if it is still running after
    :data:`NOTICE_AFTER_S` (compiling, or loading from the disk cache)."""

    def __init__(self, kernel_fn):
        name = getattr(getattr(kernel_fn, "py_func", None), "__qualname__", "")
        tag = name.partition("__mod_")[2]
        self.timer = None
        if tag and tag not in _noticed and not kernel_fn.overloads:
            self.timer = threading.Timer(NOTICE_AFTER_S, self._say, (tag,))
            self.timer.daemon = True

    @staticmethod
    def _say(tag):
        if tag in _noticed:
            return
        _noticed.add(tag)
        sys.stderr.write("attnnb: compiling the cpu kernels of a new mask or score function "
                         "(its first use; then cached on disk) ...\n")
        sys.stderr.flush()

    def __enter__(self):
        if self.timer is not None:
            self.timer.start()

    def __exit__(self, *exc):
        if self.timer is not None:
            self.timer.cancel()

"""Every change this backend makes to Numba's internals, behind one gate.

The cpu backend is plain ``numba.njit`` code.  Where Numba's public API has no
way to say what the kernels need, a module of this package reaches into Numba
(or llvmlite) and changes one thing; each module here has a fallback that is
plain Numba.  Nothing outside this package changes Numba's behaviour (a test
checks that no other module imports the internals these reach); the
intrinsics elsewhere (``_exp``, ``_vector_ir``) use Numba's extension API.

=============  =======================  =====================  ===================  ==============
module         internal it touches      what it gains          pinned by (tests/)   when off
=============  =======================  =====================  ===================  ==============
linking        codegen.create_library,  loop bodies and the    cpu/test_linking.py  Numba's own
               codegen.set_env; the     shared loops they                           compile (about
               library's _optimize_,    inline optimised and                        twice as long)
               _finalize_final_module,  compiled once (cold
               get_pointer_to_          warmup: about half);
               function, serialize,     kernels cached as
               _unserialize; the        machine code and
               numba:compile event      symbol names
source_stamp   Cache._cache_file.       an edit to any module  cpu/test_kernel_     Numba's stamp:
               _source_stamp            the kernels compile    cache.py, cpu/       the kernel's
                                        in makes them stale    test_concurrency.py  own file only
cache_lookup   Cache._load_overload,    a cached kernel loads  cpu/test_kernel_     Numba's
               _guard_against_          without the lowering   cache.py             load_overload
               spurious_io_errors       registries (~0.1 s)
startup        numba.np.linalg.         no scipy.linalg        cpu/test_startup.py  Numba imports
               ensure_blas while        import on the first                         scipy.linalg
               arraymath is imported    call (0.12-0.15 s)
noalias        CPUTargetOptions: an     tile products keep     cpu/test_blocks.py   products
               option for               their accumulators                          without it
               Flags.noalias            in registers                                (slower)
vector_width   llvmlite's function      512-bit vectors on     cpu/test_numba_      LLVM's own
               attribute set (a raw     AVX-512 CPUs           patches.py           width
               set.add)
views          numba.np.arrayobj.       views with no          cpu/test_views.py    NumPy reshapes
               populate_array; the      reference counts and                        and slices
               array struct's fields    no reshape helper in
                                        the inner loops
compile_hooks  Dispatcher.compile,      warmup's kernel        test_warmup.py       one process,
               Cache.save_overload      table; claims keep                          no kernel
               (while warmup runs)      two workers from                            table
                                        compiling one kernel
=============  =======================  =====================  ===================  ==============

Each module's docstring says how, and why the public API could not.

The gate
    :data:`ACTIVE` is True only on the Numba releases in :data:`TESTED_NUMBA`
    (the ones CI runs with the patches on) and when :data:`SWITCH` is not set to
    ``0``.  Otherwise every module above takes its fallback, together: the
    kernels are the same code, compiled by plain Numba, about twice as slow to
    compile and to run (docs/notes/performance.md, "Numba's internals behind one
    gate"), and give the same results within the contract's tolerances (float64
    results of the process that compiled a kernel may then differ by an ulp from
    those of a process that loaded it, docs/contract.md §1.13).  Outside the
    tested releases a one-line warning says so; set ``ATTNNB_NUMBA_PATCHES=0`` to
    bisect a wrong answer to the patches, or ``=1`` to silence the warning (they
    stay off there).

A cache written with the patches on holds entries that plain Numba cannot
read.  The two never meet: with the patches on, every cached kernel carries the
package's stamp (:mod:`.source_stamp`), which differs from any stamp Numba
writes, so each side finds the other's index stale and compiles its own.
"""

from __future__ import annotations

import os
import warnings

import numba

# Numba releases (major, minor) that CI runs with the patches on.
TESTED_NUMBA = ((0, 68),)
# ATTNNB_NUMBA_PATCHES: "0" turns the patches off; "1" (or unset) leaves the gate to decide.
SWITCH = "ATTNNB_NUMBA_PATCHES"


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _decide() -> tuple[bool, str]:
    """``(active, why)`` from the switch and Numba's release."""
    switch = os.environ.get(SWITCH, "").strip()
    if switch not in ("", "0", "1"):
        raise ValueError(f"{SWITCH} must be 0 (patches off) or 1 (patches on where tested); "
                         f"got {switch!r}")
    if switch == "0":
        return False, f"off: {SWITCH}=0"
    if _release(numba.__version__) not in TESTED_NUMBA:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_NUMBA)
        if switch != "1":
            warnings.warn(f"attnnb: Numba {numba.__version__} is not a release its compile "
                          f"patches were tested with ({tested}); they are off, so cpu kernels "
                          "compile and run about 2x slower (same results within tolerance)",
                          RuntimeWarning, stacklevel=2)
        return False, f"off: Numba {numba.__version__} is not a tested release ({tested})"
    return True, f"on: Numba {numba.__version__}"


ACTIVE, STATE = _decide()

"""The first calls of a new mask function: its mask as an array, its kernels not yet built.

A mask function compiles its own copy of a kernel (seconds: the whole tiled
kernel with the function inlined).  For the first :data:`STAND_INS` calls
that would compile such a copy, :func:`stand_in` gives the problem with the
function evaluated into a boolean mask instead (a small serial loop compiled
for the function, a fraction of a second), which the kernels already built
without mods run; the next call compiles the copy (a line on stderr after two
seconds) and every later one runs it.  A copy already compiled in this
process or saved in the disk cache is used from the first call.  The two
give the same bits: the same allowed set, the same tiles, the same
arithmetic (tests/cpu/test_first_tier.py), so that trying a function (a call
or two) never waits on a compile, and a loop of steps reaches the kernels
made for it.

Score functions have no stand-in (an array cannot stand for a function of
the logit); masks past :data:`MAX_MASK_BYTES` neither (the array would cost
more than the compile saves).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading

import numpy as np

#: The largest mask a stand-in materialises, in bytes (one per batch element or head
#: only where the function reads ``b`` or ``h``).
MAX_MASK_BYTES = 1 << 26
#: How many calls a stand-in serves before the kernel's copy compiles.
STAND_INS = 2
#: The environment variable that turns stand-ins off when ``0`` (every call compiles what
#: it needs: the test suite, and benchmarks of the steady state).
SWITCH = "ATTNNB_FIRST_TIER"

_served: collections.Counter = collections.Counter()
_lock = threading.Lock()


def stand_in(problem, kernel):
    """``problem`` with its mask function as a mask array, for one of the first
    :data:`STAND_INS` calls that would compile ``kernel``'s copy for it; None when the
    copy is compiled or on disk, or where a stand-in does not apply (a score function, a
    forked child, a mask past :data:`MAX_MASK_BYTES`)."""
    from ._mods import mod_kernel
    from ._threading import in_forked_child

    if os.environ.get(SWITCH) == "0" or problem.mask_mod is None or problem.score_mod is not None:
        return None
    if in_forked_child():
        return None
    copy = mod_kernel(kernel, problem)
    if copy.overloads or _cached_on_disk(copy):
        return None
    with _lock:
        if _served[copy] >= STAND_INS:
            return None
        _served[copy] += 1
    mask = _mask_array(problem)
    if mask is None:
        return None
    return dataclasses.replace(problem, mask=mask, mask_mod=None)


def _mask_array(problem):
    from .._mods.compile import mask_values, reads_argument

    B, Hq, _, Lq, Lk, _, _ = problem.shape
    mod = problem.mask_mod
    Bm = B if reads_argument(mod, 0) else 1
    Hm = Hq if reads_argument(mod, 1) else 1
    own = problem.mask
    size = Bm * Hm * Lq * Lk if own is None else B * Hq * Lq * Lk
    if size > MAX_MASK_BYTES:
        return None
    values = mask_values(mod, (Bm, Hm, Lq, Lk), problem.dropout_origin)
    if own is not None:
        values = np.logical_and(own, values)
    return np.broadcast_to(values, (B, Hq, Lq, Lk))


def _cached_on_disk(dispatcher) -> bool:
    """Whether Numba's disk cache holds an index for ``dispatcher`` (some signature of it
    saved by an earlier process: loading it is quicker than a stand-in's loop)."""
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    return bool(index) and os.path.exists(index)

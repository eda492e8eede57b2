"""A parallel kernel's loop bodies are optimised and compiled once, in its own library
(:mod:`attnnb.cpu._numba_patches.linking`); other Numba functions compile as Numba does."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from attnnb.cpu._numba_patches import linking as _linking

pytestmark = pytest.mark.skipif(not _linking.ENABLED, reason="the Numba patches are off")


def _row_sums(x, out):
    for i in numba.prange(x.shape[0]):
        total = 0.0
        for j in range(x.shape[1]):
            total += x[i, j]
        out[i] = total


def _linked_libraries(library, seen=None):
    """Every library that ``library`` links in, recursively."""
    seen = [] if seen is None else seen
    for linked in library._linking_libraries:
        if linked not in seen:
            seen.append(linked)
            _linked_libraries(linked, seen)
    return seen


def _link_only(dispatcher):
    (cres,) = dispatcher.overloads.values()
    return [lib.name for lib in _linked_libraries(cres.library)
            if getattr(lib, _linking._LINK_ONLY, False)]


def test_a_marked_kernel_links_its_loop_bodies_without_compiling_them():
    kernel = _linking.link_parfors_once(numba.njit(parallel=True)(_row_sums))
    x = np.arange(35.0).reshape(7, 5)
    out = np.zeros(7)
    kernel(x, out)
    np.testing.assert_array_equal(out, x.sum(axis=1))
    names = _link_only(kernel)
    # the loop body, its array wrapper and the launcher
    assert len(names) == 3, names
    assert any(name.startswith("__numba_parfor_gufunc_") for name in names)


def test_a_kernel_is_cached_as_machine_code_and_its_symbol_names():
    """A kernel's own library is never linked into another, so its cache entry keeps
    no IR (Numba's keeps the whole linked module's, parsed again at every load)."""
    from numba.core.caching import NullCache

    kernel = _linking.link_parfors_once(numba.njit(parallel=True, cache=True)(_row_sums))
    kernel._cache = NullCache()  # compiled here, not loaded from an earlier run's cache
    x = np.arange(35.0).reshape(7, 5)
    out = np.zeros(7)
    kernel(x, out)
    (cres,) = kernel.overloads.values()
    name, kind, (object_code, names) = cres.library.serialize_using_object_code()
    assert kind == _linking._OBJECT_KIND
    assert isinstance(object_code, bytes) and len(object_code) > 100
    assert cres.fndesc.mangled_name in names, names[:5]


def test_an_unmarked_parallel_function_compiles_as_numba_does():
    plain = numba.njit(parallel=True)(_row_sums)
    x = np.arange(12.0).reshape(3, 4)
    out = np.zeros(3)
    plain(x, out)
    np.testing.assert_array_equal(out, x.sum(axis=1))
    assert _link_only(plain) == []


class _Recording(dict):
    """A dict that remembers every key ever set."""

    def __init__(self):
        super().__init__()
        self.keys_set = []

    def __setitem__(self, key, value):
        self.keys_set.append(key)
        super().__setitem__(key, value)


def test_the_loop_body_environment_is_set_once_the_kernel_defines_it(monkeypatch):
    """Numba points a compiled function's environment global at its ``Env``; for the
    link-only loop body that global exists only in the kernel's library, so the
    assignment waits for it (Numba would write through a null address)."""
    import ctypes

    recording = _Recording()
    monkeypatch.setattr(_linking, "_pending_envs", recording)
    kernel = _linking.link_parfors_once(numba.njit(parallel=True)(_row_sums))
    x = np.ones((4, 3))
    out = np.zeros(4)
    kernel(x, out)
    np.testing.assert_array_equal(out, np.full(4, 3.0))
    assert recording.keys_set, "no environment was deferred"
    assert dict(recording) == {}, "deferred environments left unset"
    (cres,) = kernel.overloads.values()
    engine = cres.library.codegen._engine
    for name in recording.keys_set:
        address = engine.get_global_value_address(name)
        assert address != 0
        assert ctypes.c_void_p.from_address(address).value, name


def test_a_shared_loop_has_no_entry_point_from_python_and_runs_inside_jitted_code():
    from attnnb.cpu._tiles import transposed_copy

    from ..helpers import from_jit

    src = np.arange(30, dtype=np.float32).reshape(5, 6)
    dst = np.zeros((6, 5), np.float32)
    with pytest.raises(TypeError, match="only to be inlined into kernels"):
        transposed_copy(src, 0, 5, 0, 6, dst)
    np.testing.assert_array_equal(dst, 0.0)
    from_jit(transposed_copy)(src, 0, 5, 0, 6, dst)
    np.testing.assert_array_equal(dst, src.T)


def _scaled_sum(x, factor):
    total = 0.0
    for value in x:
        total += value * factor
    return total


@pytest.mark.parametrize("decorator", ["inner", "blocks"])
def test_only_the_products_are_optimised_alone_before_kernels_inline_them(decorator):
    """A shared loop's library is link-only and not optimised as a whole (the caller's
    module is); a register-blocked product's library is optimised alone too."""
    from numba.core.caching import NullCache

    from attnnb.cpu import _jit

    from ..helpers import from_jit

    shared = getattr(_jit, decorator)(_scaled_sum)
    shared._cache = NullCache()  # compiled here, not loaded from an earlier run's cache
    x = np.arange(9.0)
    assert from_jit(shared)(x, 0.5) == 18.0
    (cres,) = shared.overloads.values()
    assert getattr(cres.library, _linking._LINK_ONLY, False)
    assert getattr(cres.library, _linking._UNOPTIMISED, False) == (decorator == "inner")


_CACHED_SHARED_LOOP = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from attnnb.cpu._tiles import transposed_copy
from attnnb.cpu._numba_patches.linking import _LINK_ONLY
from tests.helpers import from_jit
src = np.arange(12, dtype=np.float64).reshape(3, 4)
dst = np.zeros((4, 3))
from_jit(transposed_copy)(src, 0, 3, 0, 4, dst)
(cres,) = transposed_copy.overloads.values()
print(json.dumps([bool(np.array_equal(dst, src.T)), sum(transposed_copy.stats.cache_hits.values()),
                  bool(getattr(cres.library, _LINK_ONLY, False))]))
"""


def test_a_shared_loop_is_cached_as_ir_and_loads_from_the_cache(tmp_path):
    """The first process compiles the loop and caches its IR; the second loads it and a
    jitted caller compiled from it computes the same."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CACHED_SHARED_LOOP, root],
                                      cwd=root, env=env, capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1])
            for _ in range(2)]
    assert runs == [[True, 0, True], [True, 1, True]]

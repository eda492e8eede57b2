"""The fence around Numba's internals (attnnb/cpu/_numba_patches): its gate, its
switch, and that nothing outside it patches Numba."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings

import numba
import numpy as np
import pytest

import attnnb
from attnnb.cpu import _numba_patches as fence

ROOT = pathlib.Path(attnnb.__file__).parent
TESTED = "{}.{}.1".format(*fence.TESTED_NUMBA[-1])


@pytest.mark.parametrize("switch, version, active, warns", [
    ("", TESTED, True, False),
    ("1", TESTED, True, False),
    ("0", TESTED, False, False),
    ("", "0.59.1", False, True),
    ("1", "0.59.1", False, False),
    ("0", "0.59.1", False, False),
])
def test_the_gate_opens_only_on_a_tested_numba_and_without_the_switch(
        monkeypatch, switch, version, active, warns):
    monkeypatch.setenv(fence.SWITCH, switch)
    monkeypatch.setattr(numba, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, why = fence._decide()
    assert got is active
    assert ("Numba 0.59.1" in why) == (version == "0.59.1" and switch != "0")
    assert [str(w.message).startswith("attnnb: Numba 0.59.1") for w in caught] == (
        [True] if warns else [])


def test_a_switch_value_it_does_not_know_is_refused(monkeypatch):
    monkeypatch.setenv(fence.SWITCH, "off")
    with pytest.raises(ValueError, match="ATTNNB_NUMBA_PATCHES must be 0"):
        fence._decide()


_OFF = """
import json
import numpy as np
from numba.core import codegen, cpu
import attnnb
from attnnb.cpu import _jit
from attnnb.cpu._numba_patches import ACTIVE, linking, vector_width, views
from attnnb.cpu.tome import unmerge
out = unmerge(np.arange(24, dtype=np.float32).reshape(2, 4, 3),
              np.array([[0, 1, 1, 3, 2], [3, 2, 1, 0, 0]]))
print(json.dumps({
    "active": ACTIVE, "linking": linking.ENABLED, "noalias": _jit.NOALIAS,
    "library_patched": hasattr(codegen.JITCodeLibrary, "_attnnb_patched"),
    "option": hasattr(cpu.CPUTargetOptions, "_attnnb_noalias"),
    "plain": [vector_width.wide_vectors is vector_width._nothing,
              views.flat is views._reshaped_flat],
    "out": out.tolist()}))
"""


def test_with_the_switch_off_numba_is_untouched_and_kernels_still_run(tmp_path):
    env = dict(os.environ, ATTNNB_NUMBA_PATCHES="0", NUMBA_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _OFF], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    x = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    index = np.array([[0, 1, 1, 3, 2], [3, 2, 1, 0, 0]])
    assert report.pop("out") == [x[b][index[b]].tolist() for b in range(2)]
    assert report == {"active": False, "linking": False, "noalias": False,
                      "library_patched": False, "option": False, "plain": [True, True]}


@pytest.mark.skipif(not fence.ACTIVE, reason="the Numba patches are off")
def test_wide_vectors_sets_the_callers_vector_width():
    from attnnb.cpu._numba_patches.vector_width import wide_vectors

    @numba.njit(cache=False)
    def caller(x):
        wide_vectors()
        return x + 1.0

    caller(1.0)
    (ir,) = caller.inspect_llvm().values()
    assert '"prefer-vector-width"="512"' in ir and '"min-legal-vector-width"="512"' in ir


# The internals the patches reach; a module outside the fence that imports one is a
# patch outside the fence.
_INTERNALS = ("numba.core.caching", "numba.core.dispatcher", "numba.core.codegen",
              "numba.core.cpu", "numba.core.options", "numba.core.compiler",
              "numba.core.runtime", "numba.core.sigutils", "numba.np.linalg",
              "numba.np.arraymath", "numba.np.arrayobj", "from numba.core import codegen",
              "from numba.core import cpu", "from numba.core import sigutils",
              "from numba.np import linalg", "from numba.np import arraymath")


def test_nothing_outside_the_fence_reaches_the_internals_it_patches():
    fence_dir = ROOT / "cpu" / "_numba_patches"
    found = [(str(path.relative_to(ROOT)), name) for path in ROOT.rglob("*.py")
             if fence_dir not in path.parents
             for name in _INTERNALS if name in path.read_text()]
    assert found == []

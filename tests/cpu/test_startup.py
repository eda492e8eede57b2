"""The first cpu call's set-up (attnnb/cpu/_numba_patches/startup.py): no SciPy linear algebra.

Numba imports ``scipy.linalg`` on its first compile or cache load only to
learn that a BLAS exists; the cpu backend imports that part of Numba without
it, and Numba's linear algebra still works afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnnb.cpu._numba_patches import ACTIVE

CODE = """
import json, sys
import numpy as np
import attnnb
q = np.random.default_rng(0).standard_normal((1, 2, 70, 16)).astype(np.float32)
out = attnnb.attention(q, q, q, backend="cpu")
from numba.np import arraymath, linalg
report = {"scipy_linalg": "scipy.linalg" in sys.modules, "have_blas": arraymath._HAVE_BLAS,
          "restored": arraymath.ensure_blas is linalg.ensure_blas}
import numba
a = np.arange(4.0).reshape(2, 2)
report["dot"] = numba.njit(lambda x: np.dot(x, x))(a).tolist() == (a @ a).tolist()
print(json.dumps(report))
"""


@pytest.mark.skipif(not ACTIVE, reason="the Numba patches are off")
def test_first_cpu_call_imports_no_scipy_linalg_and_blas_still_works():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report == {"scipy_linalg": False, "have_blas": True, "restored": True, "dot": True}

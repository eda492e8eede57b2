"""attnnb.release_buffers(): frees the key-tile buffer the cpu kernels keep between calls."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import attnnb


def test_release_buffers_frees_the_kept_buffer():
    from attnnb.cpu import _scratch

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 70, 16)).astype(np.float32) for _ in range(3))
    first = attnnb.attention(q, k, v, backend="cpu")
    assert _scratch.held_bytes() >= k.nbytes  # kept for the next call
    assert attnnb.release_buffers() is None
    assert _scratch.held_bytes() == 0
    attnnb.release_buffers()  # nothing held: a no-op
    assert _scratch.held_bytes() == 0
    # the next call allocates a new buffer and gives the same result
    np.testing.assert_array_equal(attnnb.attention(q, k, v, backend="cpu"), first)
    assert _scratch.held_bytes() > 0
    attnnb.release_buffers()
    assert _scratch.held_bytes() == 0


def test_release_buffers_before_any_cpu_call_imports_nothing():
    code = ("import sys, attnnb; attnnb.release_buffers(); "
            "print(any(m == 'numba' or m.startswith(('numba.', 'attnnb.cpu')) "
            "for m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_release_buffers_is_public():
    assert "release_buffers" in attnnb.__all__
    assert attnnb.release_buffers.__doc__

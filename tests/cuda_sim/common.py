"""Shared helpers of the cuda tests: sizes, device copies, comparison with the reference."""

from __future__ import annotations

import os

import numpy as np

import attnnb

from ..helpers import assert_close

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
SCALE = 1 if SIMULATOR else int(os.environ.get("ATTNNB_CUDA_TEST_SCALE", "1"))


def n(size: int) -> int:
    """A sequence length, scaled up on a real GPU (kept awkward: never a power of two)."""
    return size if SCALE == 1 else size * SCALE + 3


def to_device(*arrays):
    from numba import cuda

    return tuple(None if a is None else cuda.to_device(np.ascontiguousarray(a)) for a in arrays)


def host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def check_against_reference(q, k, v, dtype=None, rtol=None, **kw):
    """Run cuda (host in, host out) and reference; compare output and LSE."""
    out, lse = attnnb.attention(q, k, v, return_lse=True, backend="cuda", **kw)
    ref, ref_lse = attnnb.attention(q, k, v, return_lse=True, backend="reference", **kw)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == ref.dtype and lse.dtype == ref_lse.dtype
    assert_close(out, ref, dtype or out.dtype, rtol=rtol)
    assert_close(lse, ref_lse, dtype or out.dtype, rtol=rtol, what="lse")
    return out, lse


def assert_several_tiles(lq, lk, d, dv, streams=1):
    """Under the simulator: ``lq`` and ``lk`` span three or more query / key tiles of the
    register-tiled kernels, and a row's value columns are split over its threads."""
    if not SIMULATOR:  # a device runs the production tiles
        return
    from attnnb.cuda._micro import tiling_for

    tiling = tiling_for(np.float32, d, dv, streams)
    assert lq > 2 * tiling.bq and lk > 2 * tiling.bk, (lq, lk, tiling)
    assert tiling.nx > 1 and dv > tiling.to, tiling

"""A first comparison of the cpu backend with the reference (full suite: test_attention.py)."""

import numpy as np
import pytest

import attnnb

from .helpers import assert_close, qkv


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_matches_reference(rng, dtype, causal):
    q, k, v = qkv(rng, batch=(2,), hq=4, hk=2, lq=70, lk=131, d=16, dv=12, dtype=dtype)
    out, lse = attnnb.attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
    ref, ref_lse = attnnb.attention(q.astype(np.float64), k, v, causal=causal,
                                    return_lse=True, backend="reference")
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    assert_close(lse, ref_lse, dtype, what="lse")

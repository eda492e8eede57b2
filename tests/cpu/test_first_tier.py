"""A mask function's first calls: its mask as an array (attnnb/cpu/_first_tier.py).

The stand-in must give the same bits as the kernels compiled for the
function, forward and backward, and must not compile those kernels; after
its calls, the kernels compile and run.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import attnnb
from attnnb import mods
from attnnb._front.validate import attention_problem
from attnnb.cpu import _first_tier
from attnnb.cpu._mods import mod_kernel
from attnnb.cpu.attention import attention_kernel
from attnnb.cpu.backward import dkdv_kernel


def striped_by_head(period):
    """A mask function reading ``b`` and ``h`` (a map per batch element and head); each
    period its own kernels (a constant of the function)."""
    def mask(b, h, i, j):
        return ((i + j + h) % period != b) & (j <= i + 40)
    return mask


PERIODS = {np.float32: 5, np.float64: 6}


def _call(dtype, backend="cpu", period=None):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 37, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 101, 16)).astype(dtype) for _ in range(2))
    mask = rng.random((37, 101)) < 0.9
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, pullback = attnnb.vjp(attnnb.attention, q, k, v, mask=mask, causal=True,
                               mask_mod=striped_by_head(period or PERIODS[dtype]),
                               dropout_p=0.1, seed=4,
                               backend=backend)
    grads = pullback(dout)
    return (out,) + tuple(grads[n] for n in "qkv")


def _copies(dtype):
    rng = np.random.default_rng(0)
    problem = attention_problem(
        rng.standard_normal((2, 4, 37, 16)).astype(dtype),
        rng.standard_normal((2, 2, 101, 16)).astype(dtype),
        rng.standard_normal((2, 2, 101, 16)).astype(dtype),
        mask_mod=mods.resolved(mods.mask_mod(striped_by_head(PERIODS[dtype]))))
    return mod_kernel(attention_kernel, problem), mod_kernel(dkdv_kernel, problem)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_stand_in_gives_the_compiled_kernels_bits(dtype, monkeypatch):
    monkeypatch.setenv(_first_tier.SWITCH, "1")
    monkeypatch.setattr(_first_tier, "_cached_on_disk", lambda dispatcher: False)
    monkeypatch.setattr(_first_tier, "_served", collections.Counter())
    forward, backward = _copies(dtype)
    if forward.overloads or backward.overloads:
        pytest.skip("this process compiled the function's kernels already")
    first = _call(dtype)
    assert not forward.overloads and not backward.overloads  # nothing compiled
    monkeypatch.setenv(_first_tier.SWITCH, "0")
    compiled = _call(dtype)
    assert forward.overloads and backward.overloads
    for a, b in zip(first, compiled):
        np.testing.assert_array_equal(a, b)
    reference = _call(np.float64, backend="reference", period=PERIODS[dtype])
    for a, b in zip(first, reference):
        np.testing.assert_allclose(a, b, rtol=1e-4 if dtype == np.float32 else 1e-11,
                                   atol=1e-5 if dtype == np.float32 else 1e-12)


def test_stand_ins_end_after_their_count_and_past_their_size(monkeypatch):
    monkeypatch.setenv(_first_tier.SWITCH, "1")
    monkeypatch.setattr(_first_tier, "_cached_on_disk", lambda dispatcher: False)
    monkeypatch.setattr(_first_tier, "_served", collections.Counter())
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 8, 4))
    problem = attention_problem(
        q, q, q, mask_mod=mods.resolved(mods.mask_mod(striped_by_head(7))))
    served = [_first_tier.stand_in(problem, dkdv_kernel) is not None for _ in range(4)]
    if mod_kernel(dkdv_kernel, problem).overloads:
        assert served == [False] * 4
    else:
        assert served == [True] * _first_tier.STAND_INS + [False] * (
            4 - _first_tier.STAND_INS)
    monkeypatch.setattr(_first_tier, "_served", collections.Counter())
    monkeypatch.setattr(_first_tier, "MAX_MASK_BYTES", 63)  # 8 x 8 entries: one too many
    assert _first_tier.stand_in(problem, dkdv_kernel) is None

"""attnnb.combine: partial results over disjoint key sets merge into the whole (contract §7.1)."""

from __future__ import annotations

import numpy as np
import pytest

import attnnb
from tests.helpers import assert_close, qkv

BACKEND = "reference"  # exact in float64 and compiles nothing; one case runs the cpu kernels


@pytest.mark.parametrize("normalizer", ["softmax", "relu_expm1", "softmax1"])
@pytest.mark.parametrize("splits", [[4], [2, 5, 6], [0, 9]])
def test_parts_merge_into_the_whole(rng, normalizer, splits):
    q, k, v = qkv(rng, batch=(2,), hq=2, lq=5, lk=9)
    bias = rng.standard_normal((5, 9))
    whole = attnnb.attention(q, k, v, bias=bias, normalizer=normalizer, return_lse=True,
                             backend=BACKEND)
    edges = [0, *splits, 9]
    outs, lses = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        o, s = attnnb.attention(q, k[..., a:b, :], v[..., a:b, :], bias=bias[:, a:b],
                                normalizer=normalizer, return_lse=True, backend=BACKEND)
        outs.append(o)
        lses.append(s)
    out, lse = attnnb.combine(outs, lses, normalizer=normalizer)
    assert_close(out, whole[0])
    assert_close(lse, whole[1], what="lse")


def test_cpu_parts_and_merging_in_any_order(rng):
    q, k, v = qkv(rng, batch=(1,), hq=4, hk=2, lq=33, lk=70, dtype=np.float32)
    whole = attnnb.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    # the causal limit of the whole problem, as a mask of each key range
    mask = np.tri(33, 70, 70 - 33, dtype=bool)
    outs, lses = [], []
    for a, b in ((0, 20), (20, 64), (64, 70)):
        o, s = attnnb.attention(q, k[..., a:b, :], v[..., a:b, :], mask=mask[:, a:b],
                                return_lse=True, backend="cpu")
        outs.append(o)
        lses.append(s)
    out, lse = attnnb.combine(outs, lses)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert_close(out, whole[0], rtol=4e-6)
    assert_close(lse, whole[1], rtol=4e-6, what="lse")
    ab = attnnb.combine(outs[:2], lses[:2])
    tree = attnnb.combine([ab[0], outs[2]], [ab[1], lses[2]])
    reversed_ = attnnb.combine(outs[::-1], lses[::-1])
    for o, s in (tree, reversed_):
        assert_close(o, out, rtol=4e-6)
        assert_close(s, lse, rtol=4e-6, what="lse")


def test_empty_parts_contribute_nothing_and_empty_rows_stay_zero(rng):
    q, k, v = qkv(rng, hq=1, lq=4, lk=6)
    mask = np.ones((4, 6), bool)
    mask[1] = False  # row 1 is empty everywhere
    mask[2, :3] = False  # row 2 is empty in the first part
    whole = attnnb.attention(q, k, v, mask=mask, return_lse=True, backend=BACKEND)
    a = attnnb.attention(q, k[:, :3], v[:, :3], mask=mask[:, :3], return_lse=True,
                         backend=BACKEND)
    b = attnnb.attention(q, k[:, 3:], v[:, 3:], mask=mask[:, 3:], return_lse=True,
                         backend=BACKEND)
    with np.errstate(all="raise"):
        out, lse = attnnb.combine([a[0], b[0]], [a[1], b[1]])
    assert np.all(out[0, 1] == 0) and lse[0, 1] == -np.inf
    assert_close(out, whole[0])
    assert_close(lse, whole[1], what="lse")
    # a part that is empty in every row changes nothing
    nothing = (np.zeros_like(out), np.full_like(lse, -np.inf))
    again = attnnb.combine([out, nothing[0]], [lse, nothing[1]])
    np.testing.assert_array_equal(again[0], out)
    np.testing.assert_array_equal(again[1], lse)


def test_non_finite_parts():
    out = np.ones((3, 2))
    lse = np.zeros(3)
    spoilt = np.full((3, 2), np.nan)
    # row 0: the NaN part weighs e^-2000 (nothing): it does not reach the row
    # row 1: its LSE is NaN: the row is NaN; row 2: a NaN in one value column only
    spoilt_lse = np.array([-2000.0, np.nan, 0.0])
    spoilt[2, 0] = np.nan
    spoilt[2, 1] = 3.0
    res, res_lse = attnnb.combine([out, spoilt], [lse, spoilt_lse])
    np.testing.assert_array_equal(res[0], [1.0, 1.0])
    assert res_lse[0] == 0.0
    assert np.isnan(res[1]).all() and np.isnan(res_lse[1])
    assert np.isnan(res[2, 0]) and res[2, 1] == 2.0 and res_lse[2] == np.log(2)


def test_dtypes_and_inputs_untouched(rng):
    o = [rng.standard_normal((2, 3)).astype(np.float16) for _ in range(2)]
    s = [rng.standard_normal(2).astype(np.float32) for _ in range(2)]
    for a in o + s:
        a.flags.writeable = False
    out, lse = attnnb.combine(o, s)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    w = np.exp(np.stack(s).astype(np.float64))
    expected = (w[..., None] * np.stack(o)).sum(0) / w.sum(0)[:, None]
    assert_close(out, expected)
    assert_close(lse, np.log(w.sum(0)), rtol=1e-6, what="lse")
    single = attnnb.combine([o[0]], [s[0]])
    np.testing.assert_array_equal(single[0], o[0])


def test_softmax1_tiny_and_huge_lse():
    # softmax1 parts whose factor e^lse / (1 + e^lse) is near 0 and near 1
    soft = np.array([[1.0, 2.0], [3.0, 4.0]])
    for lse in ([-30.0, 30.0], [-700.0, -1.0]):
        lse = np.array(lse)
        factor = np.exp(lse) / (1 + np.exp(lse))
        out, res = attnnb.combine([soft * factor[:, None]], [lse], normalizer="softmax1")
        assert_close(out, soft * factor[:, None])
        np.testing.assert_array_equal(res, lse)


@pytest.mark.parametrize("outs, lses, error, match", [
    ([np.zeros((2, 3))], [], ValueError, "one entry per part"),
    ([], [], ValueError, "at least one part"),
    ([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2)] * 2, ValueError, r"outs\[1\] has"),
    ([np.zeros((2, 3))], [np.zeros(3)], ValueError, r"lses\[0\] must have shape \(2,\)"),
    ([np.zeros((2, 3), int)], [np.zeros(2)], TypeError, "floating dtype"),
    ([np.zeros(())], [np.zeros(())], ValueError, "value axis"),
    (np.zeros((2, 2, 3)), np.zeros((2, 2)), TypeError, "sequences of arrays"),
])
def test_bad_parts(outs, lses, error, match):
    with pytest.raises(error, match=match):
        attnnb.combine(outs, lses)


def test_unknown_normalizer():
    with pytest.raises(ValueError, match="normalizer must be one of"):
        attnnb.combine([np.zeros((1, 1))], [np.zeros(1)], normalizer="sparsemax")

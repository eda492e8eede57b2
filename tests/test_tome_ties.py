"""Token Merging ties that are exact only in exact arithmetic, and the shared edge order.

With one channel every unit row is ``+-1`` in exact arithmetic, so every
similarity ties.  The backends break such ties the same way only when they
round the row normalisation the same way: the cpu kernel once multiplied by
``1 / norm``, which gives ``1 - 1 ulp`` for some magnitudes where the
reference's ``x / |x|`` is exactly 1.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from attnnb import tome
from attnnb._core import tome_order as _tome_order
from attnnb.reference import tome as ref_tome

ROOT = pathlib.Path(__file__).resolve().parents[1] / "attnnb"


def _same_sign_magnitudes(rng, shape):
    """Positive entries spread over several orders of magnitude, float64."""
    return np.exp(rng.uniform(-5.0, 5.0, size=shape))


def _assert_same_matching(a, b):
    for name in ("unm_idx", "src_idx", "dst_idx", "slot"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_channel_ties_reference_equals_cpu(rng, sign):
    metric = sign * _same_sign_magnitudes(rng, (3, 64, 1))
    for kw in ({}, {"class_token": True}, {"class_token": True, "distill_token": True}):
        ref = tome.bipartite_soft_matching(metric, 20, backend="reference", **kw)
        cpu = tome.bipartite_soft_matching(metric, 20, backend="cpu", **kw)
        _assert_same_matching(cpu, ref)
    # every similarity is exactly 1: edges in A order, all into the first allowed B token
    ref = tome.bipartite_soft_matching(metric, 20, backend="reference")
    np.testing.assert_array_equal(ref.src_idx, np.broadcast_to(np.arange(20), (3, 20)))
    np.testing.assert_array_equal(ref.dst_idx, 0)


def test_one_channel_ties_mixed_signs_and_other_matchings(rng):
    """Similarities exactly +-1: the first B token of the A token's own sign wins."""
    metric = _same_sign_magnitudes(rng, (2, 50, 1)) * rng.choice([-1.0, 1.0], (2, 50, 1))
    for build in (lambda m, be: tome.bipartite_soft_matching(m, 17, backend=be),
                  lambda m, be: tome.kth_bipartite_soft_matching(m, 5, backend=be),
                  lambda m, be: tome.random_bipartite_soft_matching(m, 9, seed=3, backend=be),
                  lambda m, be: tome.bipartite_soft_matching_random2d(m, 10, 5, 2, 2, 8,
                                                                      seed=1, backend=be)):
        _assert_same_matching(build(metric, "cpu"), build(metric, "reference"))


def test_unit_rows_are_bit_identical_in_float64(rng):
    """The cpu kernel's row normalisation rounds exactly as the reference's, any width."""
    from attnnb.cpu import tome as cpu_tome

    for C in (1, 2, 7, 8, 9, 33, 300):
        rows = _same_sign_magnitudes(rng, (20, C)) * rng.choice([-1.0, 1.0], (20, C))
        want = ref_tome.cosine_rows(rows)
        for src, exp in zip(rows, want, strict=True):
            dst = np.empty(C)
            assert not cpu_tome._unit_row(src, dst)
            np.testing.assert_array_equal(dst, exp, err_msg=f"C = {C}")
    np.testing.assert_array_equal(ref_tome.cosine_rows(_same_sign_magnitudes(rng, (9, 1))), 1.0)


def test_one_channel_match_is_identical(rng):
    """One product per similarity: the same similarities, partners and order."""
    from attnnb.cpu import tome as cpu_tome

    metric = _same_sign_magnitudes(rng, (2, 40, 1)) * rng.choice([-1.0, 1.0], (2, 40, 1))
    a_idx, b_idx = np.arange(0, 40, 2)[None], np.arange(1, 40, 2)[None]
    got = cpu_tome.match(metric, a_idx, b_idx, False, False)
    want = ref_tome.match(metric, a_idx, b_idx, False, False)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _order_by_definition(values):
    """Row by row: NaNs (in index order), then the numbers largest first (ties by index)."""
    out = []
    for row in np.asarray(values, np.float64):
        idx = list(range(row.size))
        nan = [i for i in idx if np.isnan(row[i])]
        num = sorted((i for i in idx if not np.isnan(row[i])), key=lambda i: (-row[i], i))
        out.append(nan + num)
    return np.array(out, np.int64).reshape(np.shape(values))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_descending_order(rng, dtype):
    values = rng.choice([-np.inf, -1.0, -0.5, 0.0, -0.0, 0.25, 1.0, np.nan], size=(4, 40))
    values = values.astype(dtype)
    before = values.copy()
    got = _tome_order.descending_order(values)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, _order_by_definition(values))
    np.testing.assert_array_equal(got, ref_tome.descending_order(values.copy()))
    np.testing.assert_array_equal(values, before)  # not modified
    assert _tome_order.descending_order(np.zeros((2, 0))).shape == (2, 0)


def _imports(path):
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = "attnnb." + ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            names += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("backend,other", [("cpu", "cuda"), ("cuda", "cpu")])
def test_tome_backends_do_not_import_the_oracle_or_each_other(backend, other):
    names = _imports(ROOT / backend / "tome.py")
    assert "attnnb._core.tome_order" in names or backend == "cpu"
    for name in names:
        assert not name.startswith(("attnnb.reference", f"attnnb.{other}")), name

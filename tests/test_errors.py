"""Bad input: every error names the argument, what it received and what was expected.

Each test also checks that the rejected call left its inputs untouched.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnnb
from attnnb import diff, patterns, tome

from .helpers import qkv, randn

PACKAGE = Path(attnnb.__file__).parent


def _copies(*arrays):
    return [np.array(a, copy=True) for a in arrays]


def _assert_unchanged(arrays, copies):
    for a, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(a, c)


def test_topk_one_element_array_names_top_k(rng):
    q, k, v = qkv(rng)
    top_k = np.array([3])
    before = _copies(q, k, v, top_k)
    with pytest.raises(TypeError, match=r"top_k must be an integer.*shape \(1,\)"):
        attnnb.topk_attention(q, k, v, top_k=top_k, backend="reference")
    _assert_unchanged((q, k, v, top_k), before)
    # a 0-d integer array is an integer, and stays accepted
    assert attnnb.topk_attention(q, k, v, np.array(3), backend="reference").shape == q.shape


@pytest.mark.parametrize("seed, error", [("x", TypeError), (-1, ValueError), (1.5, TypeError)])
def test_random_matchings_bad_seed_names_seed(rng, seed, error):
    metric = randn(rng, (2, 16, 4))
    before = _copies(metric)
    with pytest.raises(error, match=r"seed must be .*; got "):
        tome.random_bipartite_soft_matching(metric, 3, seed=seed, backend="reference")
    with pytest.raises(error, match=r"seed must be .*; got "):
        tome.bipartite_soft_matching_random2d(metric, 4, 4, 2, 2, 3, seed=seed,
                                              backend="reference")
    _assert_unchanged((metric,), before)


def test_merge_source_wrong_source_shape_names_source(rng):
    metric = randn(rng, (1, 6, 4))
    matching = tome.bipartite_soft_matching(metric, 2, backend="reference")
    source = np.ones((1, 5, 6))
    before = _copies(metric, source)
    with pytest.raises(ValueError, match=r"^source must have shape \(1, 6, N0\).*got \(1, 5, 6\)"):
        tome.merge_source(matching, metric, source=source)
    _assert_unchanged((metric, source), before)


def test_key_size_nan_says_nan(rng):
    q, k, v = qkv(rng, lk=4)
    key_size = np.array([1.0, np.nan, 2.0, 3.0])
    before = _copies(q, k, v, key_size)
    with pytest.raises(ValueError, match=r"key_size .* holds NaN at index \(1,\)"):
        attnnb.attention(q, k, v, key_size=key_size, backend="reference")
    _assert_unchanged((q, k, v, key_size), before)


def test_diff_attention_odd_key_heads_blames_k(rng):
    q = randn(rng, (1, 6, 4, 8))
    k = randn(rng, (1, 3, 4, 8))
    before = _copies(q, k)
    for hv in (1, 2):  # whatever v holds, k cannot hold key pairs
        v = randn(rng, (1, hv, 4, 16))
        with pytest.raises(ValueError, match=r"^k must have an even number of heads .*got 3"):
            attnnb.diff_attention(q, k, v, 0.5, backend="reference")
    _assert_unchanged((q, k), before)


def test_unmerge_wrong_token_count_names_x(rng):
    metric = randn(rng, (1, 6, 4))
    matching = tome.bipartite_soft_matching(metric, 2, backend="reference")
    for n in (5, 6):  # neither an arbitrary size nor the metric's own token count
        x = np.ones((1, n, 4))
        before = _copies(x)
        with pytest.raises(ValueError,
                           match=rf"^x must have shape \(1, 4, C\).*unmerge.*got \(1, {n}, 4\)"):
            matching.unmerge(x)
        _assert_unchanged((x,), before)


def test_diff_attention_nonfinite_lam_says_where(rng):
    q, k, _ = qkv(rng, hq=4, hk=4, lq=3, lk=5)
    v = randn(rng, (2, 5, 16))  # one value head per key pair
    lam = np.array([[0.5], [np.nan]])
    before = _copies(q, k, v, lam)
    with pytest.raises(ValueError, match=r"lam must be finite.*nan at index \(1, 0\)"):
        attnnb.diff_attention(q, k, v, lam, backend="reference")
    with pytest.raises(ValueError, match=r"lam must be finite.*inf .*scalar"):
        attnnb.diff_attention(q, k, v, np.inf, backend="reference")
    _assert_unchanged((q, k, v, lam), before)


def test_lam_lambda_init_and_seed_errors_name_the_argument():
    q = np.zeros((1, 2, 3, 4))
    with pytest.raises(TypeError, match="^lam could not be read"):
        attnnb.diff_attention(q, q, q[:, :1], [[0.1, 0.2], [0.1]], backend="reference")
    with pytest.raises(TypeError, match="lambda_init must be a number"):
        diff.subln(q, lambda_init=[0.1, 0.2])
    with pytest.raises(TypeError, match="seed must be"):
        patterns.bigbird(8, 2, 0, 1, 1, seed="x")


@pytest.mark.parametrize("fn", ["attention", "topk_attention", "diff_attention"])
def test_key_size_must_be_finite_and_positive(rng, fn):
    q, k, v = qkv(rng, hq=2, hk=2, lq=3, lk=4)
    if fn == "diff_attention":
        v = randn(rng, (1, 4, 8))  # one value head per key pair
    extra = {"attention": (), "topk_attention": (2,), "diff_attention": (0.5,)}[fn]
    for bad, what in ((np.inf, r"finite and positive.*holds inf"),
                      (-np.inf, "positive"), (0.0, "positive"), (-2.0, "positive")):
        key_size = np.array([1.0, 2.0, bad, 1.0])
        before = _copies(q, k, v, key_size)
        with pytest.raises(ValueError, match=rf"^key_size must be .*{what}.*index \(2,\)"):
            getattr(attnnb, fn)(q, k, v, *extra, key_size=key_size, backend="reference")
        _assert_unchanged((q, k, v, key_size), before)


def _imported_modules(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports anywhere (deferred imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ("attnnb." if node.level else "") + (node.module or "")
            found.add(base.rstrip("."))
            found.update(f"{base}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_device_and_checks_modules_form_no_cycle():
    device = _imported_modules(PACKAGE / "_front" / "device.py")
    assert not any(m.endswith("_validate") for m in device), sorted(device)
    checks = _imported_modules(PACKAGE / "_front" / "checks.py")
    assert not any(m.startswith("attnnb") for m in checks), sorted(checks)
    # each module imports on its own, in a fresh interpreter, in either order
    for first in ("attnnb._front.checks", "attnnb._front.device", "attnnb._front.validate",
                  "attnnb"):
        code = f"import {first}; import attnnb; attnnb.attention"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
